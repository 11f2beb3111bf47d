"""The native core of the simulator's ASAP mode (``asap_comm/sim/core/native.py``, ``kernels/sim_async.cpp``):
the same answers as the Python engine, bit for bit, wherever it runs, and the Python engine wherever it does not.

Every regression-fixture case the native core covers runs through it (and must: ``core == "native"``) and gives
every request's start, completion and error, every rank's busy time and jobs, the event count and the lane's
counts of the Python engine exactly; so do ToyCost runs over the knobs the fixture leaves at one value."""
import dataclasses
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from asap_comm.serving.protocol import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core import native
from asap_comm.sim.core.async_mode import _AsyncSim
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.shapes import ModelShapes
from sim_fakes import ToyCost

FIXTURE = Path(__file__).parent / "fixtures" / "sim_regression.json"
DATA = json.loads(FIXTURE.read_text())
needs_native = pytest.mark.skipif(not native.available(), reason="asap_comm._C built without the native sim core")

DEEP = SimpleNamespace(num_experts=8, top_k=2, hidden=8, heads=4, moe_layers=(False,) + (True,) * 7)


@functools.lru_cache(maxsize=None)
def _cost(profile: str, model: str) -> CostModel:
    return CostModel(Profile(DATA["profiles"][profile], profile),
                     ModelShapes.from_hf_config(DATA["models"][model], name=model))


def _both(monkeypatch, *args, **kw):
    """(the Python engine's run, the default run) of ``simulate(*args, **kw)``."""
    monkeypatch.setenv("ASAP_SIM_NATIVE", "0")
    py = simulate(*args, **kw)
    monkeypatch.delenv("ASAP_SIM_NATIVE")
    return py, simulate(*args, **kw)


def _same(py, nat) -> None:
    assert py.core == "python"
    rows = [(r.request_id, r.start_s, r.done_s, r.error) for r in py.records]
    got = [(r.request_id, r.start_s, r.done_s, r.error) for r in nat.records]
    bad = [(a, b) for a, b in zip(rows, got) if a != b]
    assert not bad, f"{len(bad)} of {len(rows)} records differ; first (python, native): {bad[:3]}"
    assert nat.ranks == py.ranks
    assert (nat.events, nat.makespan_s, nat.lane) == (py.events, py.makespan_s, py.lane)
    assert nat.spans == py.spans


def _covered(case) -> bool:
    """Whether the native core should run this fixture case: dedicated devices, no lock-step ablation."""
    cores = DATA["profiles"][case["profile"]].get("cores")
    return cores is None and (case["cfg"]["barrier_free"] or case["cfg"]["num_attention_ranks"] == 1)


ASYNC_CASES = [c for c in DATA["cases"] if c["mode"] == "async"]


def test_the_fixture_has_cases_both_ways():
    assert sum(map(_covered, ASYNC_CASES)) >= 20 and not all(map(_covered, ASYNC_CASES))


@needs_native
@pytest.mark.parametrize("case", ASYNC_CASES, ids=[f"{i}-{c['name']}" for i, c in enumerate(ASYNC_CASES)])
def test_fixture_case_native_matches_python_exactly(monkeypatch, case):
    cost = _cost(case["profile"], case["model"])
    trace = [Request(rid, arrival, n) for rid, arrival, n in case["requests"]]
    py, nat = _both(monkeypatch, "async", trace, cost, cost.shapes, RuntimeConfig(**case["cfg"]),
                    sync_ranks=case["sync_ranks"], par=Parallelism(**case["par"]), routing=case["routing"],
                    slo_s=case["slo_s"])
    assert nat.core == ("native" if _covered(case) else "python")
    _same(py, nat)
    # and the fixture's TTFTs (what test_sim_regression checks of the default run)
    tol = DATA["tolerance_rel"]
    for rec, want in zip(nat.records, case["ttft_s"]):
        assert (want is None) == (rec.ttft_s is None)
        assert want is None or abs(rec.ttft_s - want) <= tol * abs(want) + 1e-12


def _trace(n: int, seed: int, max_len: int = 2000, gap: float = 2e-4) -> list:
    import random
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1.0 / gap)
        out.append(Request(i, t, rng.choice([rng.randint(1, 300), rng.randint(200, max_len)])))
    return out


TOY = RuntimeConfig(num_attention_ranks=4, num_expert_ranks=2, token_budget=512, chunk_len=256, max_prompt_len=2048,
                    expert_token_budget=1024, expert_deadline_s=2e-4)
VARIANTS = {
    "default": {},
    "no-lane": dict(long_prompt_lane=False),
    "no-balance-no-pingpong": dict(token_balanced=False, ping_pong=False),
    "no-expert-batching": dict(expert_batching=False, token_balanced=False),
    "round-robin": dict(load_aware=False),  # no chunking either (effective_chunk_len is None)
    "lane-threshold-groups": dict(lane_threshold=600, lane_groups=2),
    "lane-small-pool-gives-up": dict(lane_tokens=2048, lane_wait_s=0.002),
    "one-group": dict(num_attention_ranks=1),
    "short-deadline": dict(expert_deadline_s=0.0, expert_token_budget=64),
    # lane chunks of equal attention cost (policies.split_equal_cost), alone, on two groups, and given up
    "lane-chunks-cost": dict(lane_chunks="cost"),
    "lane-chunks-cost-threshold-groups": dict(lane_chunks="cost", lane_threshold=600, lane_groups=2),
    "lane-chunks-cost-gives-up": dict(lane_chunks="cost", lane_tokens=2048, lane_wait_s=0.002),
}


@needs_native
@pytest.mark.parametrize("name", list(VARIANTS))
def test_toy_runs_native_match_python_exactly(monkeypatch, name):
    cfg = dataclasses.replace(TOY, **VARIANTS[name])
    trace = _trace(160, seed=len(name))
    trace += [Request(1000, 0.001, 0), Request(1001, 0.002, 5000)]  # rejected: empty, longer than max_prompt_len
    py, nat = _both(monkeypatch, "async", trace, ToyCost(), DEEP, cfg)
    assert nat.core == "native"
    _same(py, nat)
    assert sum(r.ok for r in nat.records) == 160
    assert {r.request_id for r in nat.records if r.error} == {1000, 1001}


@needs_native
@pytest.mark.parametrize("kw", [dict(par=Parallelism(attention_tp=4)),
                                dict(par=Parallelism(serial_expert_transfers=True)),
                                dict(routing="zipf:1.1", slo_s=0.01),
                                dict(layers=[(False, 2.0), (True, 3.0), (False, 1.0), (True, 1.5)])],
                         ids=["tp4", "serial-transfers", "skew-slo", "weighted-layers"])
def test_toy_runs_with_parallelism_routing_and_layers_match_exactly(monkeypatch, kw):
    trace = _trace(120, seed=7)
    cost = ToyCost()
    if "routing" in kw:  # a skewed routing needs a cost model that knows its experts' placement: the real one
        cost = _cost("ascend-910c-cm384", next(iter(DATA["models"])))
        trace = [Request(r.request_id, r.arrival_s * 50, r.prompt_len) for r in trace]
    shapes = getattr(cost, "shapes", DEEP)
    py, nat = _both(monkeypatch, "async", trace, cost, shapes, TOY, **kw)
    assert nat.core == "native"
    _same(py, nat)


def test_what_the_native_core_does_not_cover_runs_in_python(monkeypatch):
    trace = _trace(40, seed=3)
    if native.available():
        assert simulate("async", trace, ToyCost(), DEEP, TOY).core == "native"
    # the lock-step ablation, a shared CPU host, failures, the environment switch: the Python engine
    assert simulate("async", trace, ToyCost(), DEEP, dataclasses.replace(TOY, barrier_free=False)).core == "python"
    cpu = ToyCost()
    cpu.cores = 2
    assert simulate("async", trace, cpu, DEEP, TOY).core == "python"
    assert simulate("async", trace, ToyCost(), DEEP, dataclasses.replace(TOY, spare_expert_ranks=1),
                    failures=[(0.001, 0)], spare_load_s=0.0).core == "python"
    monkeypatch.setenv("ASAP_SIM_NATIVE", "0")
    assert simulate("async", trace, ToyCost(), DEEP, TOY).core == "python"
    assert simulate("sync", trace, ToyCost(), DEEP, TOY).core == "python"


def test_a_replaced_method_runs_the_python_engine(monkeypatch):
    seen = []
    orig = _AsyncSim._start_batch

    def spy(self, rank, batch):
        seen.append(len(batch))
        return orig(self, rank, batch)

    monkeypatch.setattr(_AsyncSim, "_start_batch", spy)
    res = simulate("async", _trace(20, seed=1), ToyCost(), DEEP, TOY)
    assert res.core == "python" and seen
    sim = _AsyncSim(ToyCost(), DEEP, TOY, _trace(5, seed=1), False)
    assert native.unsupported(sim) == "_AsyncSim._start_batch is replaced"


@needs_native
def test_spans_native_match_python_exactly(monkeypatch):
    """Every attention and expert job's span (rank, label, start, duration), in the order the Python engine
    records them, the lane's layers included."""
    py, nat = _both(monkeypatch, "async", _trace(60, seed=5), ToyCost(), DEEP, TOY, spans=True)
    assert nat.core == "native" and len(nat.spans) > 1000
    labels = {label.split(" ")[0] for _rank, label, _s, _d in nat.spans}
    assert labels == {"attn", "shared", "experts", "lane"}
    _same(py, nat)


@needs_native
def test_native_run_refuses_what_it_does_not_cover():
    cpu = ToyCost()
    cpu.cores = 2
    sim = _AsyncSim(cpu, DEEP, TOY, _trace(5, seed=1), False)
    with pytest.raises(ValueError, match="native.run: .*share CPU cores"):
        native.run(sim)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_prompts_arriving_together_reach_their_rank_in_arrival_order(monkeypatch, mode):
    """The front end is one sender (``FrontEnd._flush``): a one-chunk prompt admitted at the same instant as a
    two-chunk one, after it, reaches the rank after it and runs after it. (The simulator used to deliver each
    request after its own message time alone, so the shorter message overtook the longer one: a short prompt
    ran first whenever prompts arrived together, as in a bursty trace, which the runtime never does.)"""
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=256, chunk_len=256,
                        max_prompt_len=2048, ping_pong=False, long_prompt_lane=False, token_balanced=False)
    trace = [Request(0, 0.0, 512), Request(1, 0.0, 200)]  # two chunks, then one; one chunk per micro-batch / step
    kw = dict(sync_ranks=1) if mode == "sync" else {}
    runs = _both(monkeypatch, mode, trace, ToyCost(), DEEP, cfg, **kw) if mode == "async" else (
        simulate(mode, trace, ToyCost(), DEEP, cfg, **kw),)
    for res in runs:
        done = {r.request_id: r.done_s for r in res.records}
        # FIFO: request 0's first chunk, then its second (eligible once the first is done, and ahead in the
        # queue), then request 1's only chunk
        assert done[0] < done[1], (res.core, done)
    if mode == "async" and native.available():
        _same(*runs)
