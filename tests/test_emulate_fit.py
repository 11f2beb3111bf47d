"""The emulation's host overhead and served routing (asap_comm.sim.emulate.fit, simulate_emulated(host_overhead=,
expert_skew=)): the least-squares fit, the measurements from a probe's timeline and counters, how the simulator
charges them in both modes, and their input checks."""
import math

import pytest
import torch

from asap_comm.serving.runtime import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.common import batch_skew
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.emulate.emulator import EmulatedFactory, EmulatedModel, simulate_emulated
from asap_comm.sim.emulate.fit import busy_outside_holds, fit_one, routing_skew
from asap_comm.sim.emulate.stats import read_stats
from asap_comm.sim.emulate.stats import _Stats

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
    for bad in (0.9, -1.0, True, "1.5", 100.0, float("nan")):
        with pytest.raises(ValueError, match="expert_skew"):
            simulate_emulated(_factory("async"), "async", solo, CFG, expert_skew=bad)


@pytest.mark.parametrize("key", ["expert_job_s", "async_layer_s"])
def test_the_expert_batch_busy_time_and_the_round_trip_latency_lengthen_asap_only(key):
    solo = [Request(0, 0.0, 100)]
    base = simulate_emulated(_factory("async"), "async", solo, CFG).records[0].ttft_s
    more = simulate_emulated(_factory("async"), "async", solo, CFG, host_overhead={key: 0.02}).records[0].ttft_s
    assert more - base >= 2 * 0.02 * 0.999  # at least once per MoE layer (2) of the one micro-batch
    sync = simulate_emulated(_factory("sync"), "sync", solo, SYNC).records[0].ttft_s
    assert simulate_emulated(_factory("sync"), "sync", solo, SYNC, host_overhead={key: 0.05}).records[0].ttft_s \
        == pytest.approx(sync)
    # the expert batch's busy time queues the next batch, the latency does not: a burst drains slower with it
    burst = [Request(i, 0.0, 100) for i in range(8)]
    ends = {h: max(r.done_s for r in simulate_emulated(_factory("async"), "async", burst, CFG,
                                                       host_overhead={key: h}).records) for h in (0.0, 0.02)}
    assert ends[0.02] > ends[0.0]


def test_batch_skew_shrinks_with_the_spread_over_prompts():
    assert batch_skew(1.5, {7: 100}) == 1.5  # one prompt: its own skew
    assert batch_skew(1.5, {1: 50, 2: 50, 3: 50, 4: 50}) == pytest.approx(1.0 + 0.5 / 2)  # 4 equal: / sqrt(4)
    assert batch_skew(1.5, {1: 1000, 2: 1}) == pytest.approx(1.5, abs=1e-3)  # one prompt dominates
    assert batch_skew(1.0, {1: 5, 2: 5}) == 1.0 and batch_skew(2.0, {}) == 2.0
    many = batch_skew(3.0, {i: 10 for i in range(100)})
    assert many == pytest.approx(1.0 + 2.0 / math.sqrt(100))


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_served_routers_skew_slows_the_expert_side_less_for_a_batch_of_prompts(mode):
    """The skew multiplies the expert work of one prompt fully; a step (or expert batch) of several prompts pays
    it averaged over them (batch_skew), so a burst of 4 pays less than 4 solo prompts would."""
    cfg = CFG if mode == "async" else SYNC
    solo = [Request(0, 0.0, 100)]
    t = [simulate_emulated(_factory(mode), mode, solo, cfg, expert_skew=s).records[0].ttft_s for s in (1.0, 1.5, 2.0)]
    assert t[0] < t[1] < t[2]
    extra_solo = t[2] - t[0]
    burst = [Request(i, 0.0, 100) for i in range(4)]
    ends = [max(r.done_s for r in simulate_emulated(_factory(mode), mode, burst, cfg, expert_skew=s).records)
            for s in (1.0, 2.0)]
    assert 0 < ends[1] - ends[0] < 3.0 * extra_solo  # the full skew on 4 prompts' tokens would add about 4x


def test_busy_outside_holds_and_routing_skew_from_a_timeline_and_counters():
    spans = [(0, 0, "attn L1", 0.0, 0.010), (0, 0, "attn tail", 0.02, 0.004), (0, 1, "lane kv L1 req 3 -> 1", 0, 1.0),
             (1, 0, "attn L1", 0.0, 0.006), (2, 0, "experts L1 (34 rows)", 0.01, 0.008)]
    stats = [{"role": "attention", "held_s": 0.014, "route_rows_max": 30.0, "route_rows_mean": 20.0},
             {"role": "expert", "held_s": 0.005, "route_rows_max": 0.0, "route_rows_mean": 0.0}]
    busy, n = busy_outside_holds(spans, stats, "attention", "attn")
    assert n == 3 and busy == pytest.approx((0.020 - 0.014) / 3)  # track 1 (the lane's puts) is not a job
    assert busy_outside_holds(spans, stats, "expert", "experts") == (pytest.approx(0.003), 1)
    assert busy_outside_holds(spans, [{"role": "expert", "held_s": 9.0}], "expert", "experts")[0] == 0.0
    assert busy_outside_holds([], stats, "attention", "attn") == (0.0, 0)
    assert routing_skew(stats) == pytest.approx(1.5) and routing_skew([{"role": "attention"}]) == 1.0


class _Routed:
    def __init__(self, ids):
        self.topk_ids = ids


class _Router:
    """route() returns fixed top-k ids; nothing else is called."""

    def __init__(self, ids):
        self.ids = ids

    def route(self, layer, x):
        return _Routed(self.ids)


def test_an_emulated_router_call_counts_the_rows_of_its_hottest_expert_rank(tmp_path):
    from asap_comm.sim.costmodel.costs import CostModel

    cost, tiny = CostModel.load(PROFILE, EMU), ModelShapes.load("tiny")  # 8 experts, top 2
    # 4 ranks of 2 experts (0-1, 2-3, 4-5, 6-7); 4 tokens: every one reaches rank 0 (4 rows), one rank 1, two rank 2
    # (tokens 2 and 3), none rank 3; a token with both experts on one rank is one row (token 0)
    ids = torch.tensor([[0, 1], [0, 2], [1, 4], [5, 0]])
    m = EmulatedModel(_Router(ids), cost, tiny, "attention", 0, 1e-3, 16, 4, _Stats(tmp_path / "attention-1-1.stat"))
    m.route(1, torch.zeros(4, tiny.hidden_size))
    m.route(2, torch.zeros(4, tiny.hidden_size))
    (s,) = read_stats(tmp_path)
    assert (s["route_rows_max"], s["route_rows_mean"]) == (8.0, 3.5)  # per call: max 4, mean (4+1+2+0)/4
    assert routing_skew([s]) == pytest.approx(8.0 / 3.5)
