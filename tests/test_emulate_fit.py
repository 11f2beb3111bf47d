"""The emulation's host overhead (asap_comm.sim.emulate_fit, simulate_emulated(host_overhead=)): the least-squares
fit, how the simulator charges it in both modes, and its input checks."""
import pytest

from asap_comm.serving.runtime import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.emulate import EmulatedFactory, simulate_emulated
from asap_comm.sim.emulate_fit import fit_one
from asap_comm.sim.shapes import ModelShapes

PROFILE, EMU = "ascend-910c-cm384", "deepseek-v3"


def _factory(mode):
    def inner(role, experts):  # never called: the simulator only reads the shapes
        raise AssertionError("not run")

    tiny = ModelShapes.load("tiny")
    if mode == "async":
        return EmulatedFactory(inner, PROFILE, EMU, time_scale=0.35, token_scale=128, num_expert_ranks=4,
                               attention_tp=8, expert_devices=4, real_shapes=tiny)
    return EmulatedFactory(inner, PROFILE, EMU, time_scale=0.35, token_scale=128, num_expert_ranks=4,
                           attention_tp=8, expert_devices=8, real_shapes=tiny)


CFG = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=4, token_budget=128, chunk_len=128, max_prompt_len=512)
SYNC = RuntimeConfig(num_attention_ranks=3, num_expert_ranks=1, token_budget=128, chunk_len=128, max_prompt_len=512)


def test_fit_one_recovers_a_known_overhead():
    base, per = [0.2, 0.5, 0.9, 1.4], [3, 6, 9, 12]  # TTFT without it, jobs of each request

    def predict(h):
        return [b + n * h for b, n in zip(base, per)]

    real = predict(0.0123)
    h, rms = fit_one(predict, real)
    assert h == pytest.approx(0.0123, abs=1e-5) and rms < 1e-4
    h0, _ = fit_one(predict, base)  # nothing to add: zero, not a negative overhead
    assert h0 == pytest.approx(0.0, abs=1e-5)
    noisy = [r + e for r, e in zip(real, (0.004, -0.003, 0.002, -0.001))]
    hn, rms_n = fit_one(predict, noisy)
    assert abs(hn - 0.0123) < 0.001 and rms_n > 0
    top, _ = fit_one(predict, predict(0.5))  # beyond the searched range: its edge
    assert top == pytest.approx(0.1)


@pytest.mark.parametrize("mode,key", [("async", "async_job_s"), ("sync", "sync_layer_s")])
def test_the_overhead_lengthens_ttft_and_lowers_capacity(mode, key):
    cfg = CFG if mode == "async" else SYNC
    solo = [Request(0, 0.0, 100)]
    ttft = [simulate_emulated(_factory(mode), mode, solo, cfg, host_overhead={key: h}).records[0].ttft_s
            for h in (0.0, 0.01, 0.02)]
    assert ttft[0] < ttft[1] < ttft[2]
    # one 100-token chunk: 2 MoE layers (+ the tail job on ASAP's attention rank): the added wall time is at least
    # the overhead times the layers it is charged on
    assert ttft[2] - ttft[0] >= 2 * 0.02 * 0.999
    # other mode's key: this mode's TTFT unchanged
    other = "sync_layer_s" if key == "async_job_s" else "async_job_s"
    assert simulate_emulated(_factory(mode), mode, solo, cfg, host_overhead={other: 0.05}).records[0].ttft_s \
        == pytest.approx(ttft[0])
    # busy time, not only latency: a burst of 12 takes longer to drain by several requests' overheads
    burst = [Request(i, 0.0, 100) for i in range(12)]
    ends = [max(r.done_s for r in simulate_emulated(_factory(mode), mode, burst, cfg,
                                                    host_overhead={key: h}).records) for h in (0.0, 0.02)]
    assert ends[1] - ends[0] > 2.5 * (ttft[2] - ttft[0])  # 3 steps (or jobs) per worker, one after another


def test_host_overhead_input_is_checked():
    solo = [Request(0, 0.0, 50)]
    for bad in ({"async_job_s": -0.01}, {"layer_s": 0.01}, {"sync_layer_s": "1"}, {"async_job_s": True}):
        with pytest.raises(ValueError, match="host_overhead"):
            simulate_emulated(_factory("async"), "async", solo, CFG, host_overhead=bad)
    assert simulate_emulated(_factory("async"), "async", solo, CFG, host_overhead={}).records[0].ttft_s > 0
