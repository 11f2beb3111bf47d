"""Routing skew (asap_comm.sim.costmodel.routing): the distributions, their per-rank shares, the simulator and the emulator
charging them, the command line and the histogram files."""
import json
import random

import pytest

from asap_comm.serving.protocol import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.common import rows_per_rank_fraction
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.routing import (BALANCED, HISTOGRAM_FORMAT, Routing, block_placement, emulated_scales,
                                             known_histograms, parse_routing, rank_of_experts, routed_cost)
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.emulate.emulator import EmulatedFactory, EmulatedModel
from asap_comm.sim.emulate.stats import _Stats

PROFILE, EMU = "ascend-910c-cm384", "deepseek-v3"


@pytest.fixture(scope="module")
def cost():
    return CostModel.load(PROFILE, EMU)


def _trace(n=40, seed=1):
    rng = random.Random(seed)
    return [Request(i, i * 0.05, rng.randint(500, 8000)) for i in range(n)]


CFG = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=16, token_budget=16384, chunk_len=8192,
                    max_prompt_len=131072, expert_token_budget=16384)
RUNS = (("async", dict(par=Parallelism(attention_tp=8))), ("sync", dict(sync_ranks=4, par=Parallelism(sync_tp=8))))


def _times(res):
    return [(r.request_id, r.start_s, r.done_s, r.error) for r in res.records]


# ----------------------------------------------------------------------------- balanced: unchanged
@pytest.mark.parametrize("mode,kw", RUNS)
def test_balanced_routing_reproduces_the_simulator_exactly(cost, mode, kw):
    trace = _trace()
    plain = simulate(mode, trace, cost, cost.shapes, CFG, **kw)
    for routing in ("balanced", BALANCED, Routing()):
        res = simulate(mode, trace, cost, cost.shapes, CFG, routing=routing, **kw)
        assert _times(res) == _times(plain)
        assert res.makespan_s == plain.makespan_s and res.ranks == plain.ranks
    assert routed_cost(cost, "balanced") is cost


def test_balanced_shares_are_the_closed_forms():
    load = BALANCED.rank_load(256, 8, 32)
    assert load.row_frac == tuple([rows_per_rank_fraction(256, 8, 8)] * 32)
    assert all(q == 8 / 256 for s in load.pair_share for q in s)
    assert sorted(load.pairs(1000, 3), reverse=True) == [32, 32, 31, 31, 31, 31, 31, 31]  # as _pairs rounds


# ----------------------------------------------------------------------------- shares
def test_placement_is_the_runtimes_contiguous_blocks():
    assert block_placement(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    torch = pytest.importorskip("torch")
    from asap_comm.moe.plan import expert_placement
    owner = expert_placement(10, 4).tolist()
    assert block_placement(10, 4) == [[e for e in range(10) if owner[e] == r] for r in range(4)]
    assert rank_of_experts([5, 3, 4], 8, 3) == 1 and rank_of_experts([], 8, 3) is None
    assert torch is not None


@pytest.mark.parametrize("S", [0.5, 1.0, 1.5])
def test_zipf_concentrates_pairs_and_rows_on_a_hot_rank(S):
    R, N, k = 32, 256, 8
    load = parse_routing(f"zipf:{S}").rank_load(N, k, R)
    total = sum(sum(s) for s in load.pair_share)
    assert total == pytest.approx(k, abs=1e-9)  # every token makes k (token, expert) pairs
    for r in range(R):  # a rank is reached at least as often as its hottest expert, at most by all its pairs
        assert max(load.pair_share[r]) - 1e-9 <= load.row_frac[r] <= min(1.0, sum(load.pair_share[r])) + 1e-9
    d = load.describe()
    assert d["hot_rank_pairs_over_mean"] > 1.5 and d["hot_rank_rows_over_mean"] > 1.4
    hot = load.pairs(10_000)
    assert sum(hot) == round(10_000 * sum(load.pair_share[load.hot]))
    assert sum(hot) > 1.5 * sum(BALANCED.rank_load(N, k, R).pairs(10_000))
    assert load.rows(10_000) == round(10_000 * load.row_frac[load.hot])


def test_more_skew_loads_the_hot_rank_more_and_zero_skew_is_balanced():
    hot = [parse_routing(f"zipf:{S}").rank_load(256, 8, 32).describe()["hot_rank_pairs_over_mean"]
           for S in (0.0, 0.5, 1.0, 1.5)]
    assert hot == sorted(hot)
    flat = parse_routing("zipf:0").rank_load(256, 8, 32)
    bal = BALANCED.rank_load(256, 8, 32)
    for r in range(32):
        assert flat.row_frac[r] == pytest.approx(bal.row_frac[r], rel=0.03)
        assert sum(flat.pair_share[r]) == pytest.approx(sum(bal.pair_share[r]), rel=0.06)


def test_the_seed_moves_the_hot_experts():
    a = parse_routing("zipf:1.0").expert_share(256, 8)
    b = parse_routing("zipf:1.0:7").expert_share(256, 8)
    assert max(a) == pytest.approx(max(b), rel=0.05) and a.index(max(a)) != b.index(max(b))
    assert parse_routing("zipf:1.0:7").spec == "zipf:1:7"


# ----------------------------------------------------------------------------- specs and histograms
@pytest.mark.parametrize("spec,words", [("uniform", "uniform"), ("zipf:abc", "zipf:abc"), ("zipf:-1", "-1"),
                                        ("zipf:1:2:3", "zipf:1:2:3"), ("zipf:inf", "inf"),
                                        ("histogram:", "histogram:"),
                                        ("histogram:/no/such.json", "no such file"), (3, "3")])
def test_bad_specs_raise_naming_the_value(spec, words):
    with pytest.raises(ValueError, match="routing") as e:
        parse_routing(spec)
    assert words in str(e.value)


def _histogram(path, counts, **extra):
    path.write_text(json.dumps({"format": HISTOGRAM_FORMAT, "num_experts": len(counts[0]),
                                "layers": {str(i): c for i, c in enumerate(counts)}, **extra}))
    return path


def test_a_histogram_file_round_trips(tmp_path):
    # two layers with the same load curve, hot experts at different ids: the curve is what counts
    c1 = [400, 200, 100, 100, 50, 50, 50, 50]
    c2 = [50, 50, 100, 400, 50, 200, 50, 100]
    path = _histogram(tmp_path / "h.json", [c1, c2], model="toy", tokens=500, top_k=2)
    r = parse_routing(f"histogram:{path}")
    assert r.kind == "histogram" and r.spec == f"histogram:{path}"
    q = sorted(r.expert_share(8, 2), reverse=True)
    want = [2 * c / 1000 for c in sorted(c1, reverse=True)]
    assert q == pytest.approx(want, abs=0.01)  # the fitted router reproduces the measured frequencies
    assert r.describe()["recorded"]["model"] == "toy"
    # mapped onto 16 experts: the same cumulative curve, each measured expert's share split in two
    q16 = sorted(r.expert_share(16, 4), reverse=True)
    assert sum(q16) == pytest.approx(4)
    assert q16[0] == pytest.approx(q16[1], rel=0.05) and q16[0] > 2.5 * q16[-1]


def test_bad_histogram_files_are_named(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        parse_routing(f"histogram:{tmp_path / 'bad.json'}")
    (tmp_path / "fmt.json").write_text(json.dumps({"layers": {}}))
    with pytest.raises(ValueError, match="format"):
        parse_routing(f"histogram:{tmp_path / 'fmt.json'}")
    _histogram(tmp_path / "short.json", [[1, 2, 3, 4]])
    data = json.loads((tmp_path / "short.json").read_text())
    data["layers"]["1"] = [1, 2]
    (tmp_path / "short.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="layer 1 must have 4 non-negative counts"):
        parse_routing(f"histogram:{tmp_path / 'short.json'}")


def test_the_committed_histogram_loads():
    names = known_histograms()
    assert names, "a recorded histogram is committed under asap_comm/sim/routing_data/"
    for name in names:
        r = parse_routing(f"histogram:{name}")
        d = r.describe(256, 8)
        assert d["recorded"]["model"] and d["hot_expert_over_mean"] >= 1.0


# ----------------------------------------------------------------------------- the simulator charges it
def test_skew_slows_the_baseline_step_and_loads_the_hot_expert_rank(cost):
    trace = _trace()
    runs = {}
    for spec in ("balanced", "zipf:1.0"):
        for mode, kw in RUNS:
            res = simulate(mode, trace, cost, cost.shapes, CFG, routing=spec, **kw)
            ttft = sorted(r.ttft_s for r in res.records)
            runs[spec, mode] = (ttft[len(ttft) // 2], res)
    # the baseline's step waits for its hottest device: every request is slower
    assert runs["zipf:1.0", "sync"][0] > 1.3 * runs["balanced", "sync"][0]
    # ASAP's representative expert rank is the hottest: it computes more
    def busy(res):
        return next(r["busy_s"] for r in res.ranks if r["role"] == "expert")
    assert busy(runs["zipf:1.0", "async"][1]) > 1.5 * busy(runs["balanced", "async"][1])
    assert runs["zipf:1.0", "async"][0] >= runs["balanced", "async"][0]
    # the routing may ride on the cost model (what the study helpers pass along)
    again = simulate("sync", trace, routed_cost(cost, "zipf:1.0"), cost.shapes, CFG, **RUNS[1][1])
    assert _times(again) == _times(runs["zipf:1.0", "sync"][1])


def test_sim_run_records_the_routing_and_rejects_a_bad_one(tmp_path, capsys):
    from asap_comm.sim.cli import main
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--num-requests", "20", "--routing", "zipf:1.0", "--modes", "async"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["routing"]["spec"] == "zipf:1" and s["routing"]["hot_expert_over_mean"] > 1
    for cmd in ("run", "headline", "skew"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--out", str(out), "--routing" if cmd != "skew" else "--routings", "zipf:hot"])
        assert e.value.code == 2 and "zipf:hot" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the emulator holds it
def test_the_emulated_expert_time_follows_the_ranks_share(cost):
    real = ModelShapes.load("tiny")  # 8 experts over 8 expert ranks: one real expert each
    routing = parse_routing("zipf:1.0")
    load = routing.rank_load(256, 8, 8)
    hot = load.hot
    cold = min(range(8), key=lambda r: sum(load.pair_share[r]))

    def model(rank):
        spec = None if rank is None else (routing, rank)
        return EmulatedModel(object(), cost, real, "expert", 1, 1e-3, 16, 8, _Stats(None), routing=spec)

    bal, h, c = model(None), model(hot), model(cold)
    f_hot, rows_hot = emulated_scales(routing, 256, 8, 8, 1, hot)
    assert f_hot == pytest.approx(sum(load.pair_share[hot]) / 1.0)  # mean rank: 8 pairs / 8 ranks
    assert h._pairs_per_real_row == pytest.approx(f_hot * bal._pairs_per_real_row)
    assert h.emulated_rows(1000) == round(1000 * bal._rows_per_real_row * rows_hot)
    # large enough batches to be compute-bound (small ones read the weights whatever their rows)
    assert f_hot > 1.1
    assert h.expert_work_s(4000) / bal.expert_work_s(4000) == pytest.approx(f_hot, rel=0.05)
    assert bal.expert_work_s(4000) > c.expert_work_s(4000)
    # the factory hands each expert model its rank's share (the runtime's placement of the served experts)
    fac = EmulatedFactory(lambda role, experts: object(), PROFILE, EMU, token_scale=16, num_expert_ranks=8,
                          real_shapes=real, routing="zipf:1.0")
    assert fac(("expert"), [hot])._pairs_per_real_row == pytest.approx(h._pairs_per_real_row)
    assert fac.describe_emulation()["routing"] == "zipf:1"
    assert fac.with_stats_dir("/tmp/x").routing == fac.routing


def test_skew_study_rows_follow_the_routing(cost):
    from asap_comm.sim.studies.grids import skew_trace
    from asap_comm.sim.studies.skew import deployments, skew_study, table
    a, s = deployments(6, 8, 16, 8, 8, 16384, True)
    res = skew_study(["balanced", "zipf:1.5"], a, s, skew_trace(24, 1.0, 6000.0), cost, cost.shapes, bisections=1,
                     progress=False)
    assert [r["routing"] for r in res["rows"]] == ["balanced", "zipf:1.5"]
    bal, hot = res["rows"]
    assert bal["hot"]["sync_devices"]["hot_rank_pairs_over_mean"] == pytest.approx(1.0)
    assert hot["hot"]["sync_devices"]["hot_rank_pairs_over_mean"] > hot["hot"]["async_expert_ranks"][
        "hot_rank_pairs_over_mean"] > 1.5  # EP over 64 dies concentrates more than 16 expert dies
    assert hot["sync"] is None or bal["sync"] is None or hot["sync"] <= bal["sync"]
    assert "| zipf:1.5 |" in table(res)
    # slo_s (--slo): the SLO held instead of the rule, recorded as given
    held = skew_study(["balanced"], a, s, skew_trace(24, 1.0, 6000.0), cost, cost.shapes, bisections=1,
                      progress=False, slo_s=2.5 * res["slo_s"])
    assert held["slo_s"] == 2.5 * res["slo_s"] and held["slo_set_by"] == "given (--slo)" and held["slo_factor"] is None
    assert "given (--slo)" in table(held)
    assert held["rows"][0]["sync"] is None or bal["sync"] is None or held["rows"][0]["sync"] >= bal["sync"]


def test_the_memoised_expert_cost_tells_lists_with_the_same_ends_apart(cost):
    """Balanced pair lists [b+1]*x + [b]*(L-x) share their ends and length for every x; the memo once keyed them
    by those alone and charged the first x's cost to all (up to 0.25% of a TTFT on the local profile)."""
    from asap_comm.sim.core.common import _Memo
    memo = _Memo(cost)
    for pairs in ([9, 8, 8, 8], [9, 9, 9, 8], [9, 9, 8, 8], [40, 3, 9, 1], [3, 40, 9, 1]):
        assert memo.experts_s(pairs) == cost.experts_s(pairs)
