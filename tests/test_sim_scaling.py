"""``python -m asap_comm.sim scaling``: the crossover on constructed rows, withheld ratios, the load search's
economy (incumbent pruning, the unloaded bound), the --quick run's JSON schema and plot, and bad flags."""
import json
import math

import pytest

from asap_comm.serving.metrics import sustains_slo
from asap_comm.serving.slo import SLO_MULTIPLIER
from asap_comm.serving.traces import Request
from asap_comm.sim.cli import main as sim_main
from asap_comm.sim.core.sweep import Deployment, run_point
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies import search_space as ss
from asap_comm.sim.studies.scaling import asap_wins, crossover_dies, make_row


def entry(sct, why=None):
    return {"deployment": None if sct is None else {"label": "x"}, "slo_compliant_throughput": sct,
            "served_fraction": None if sct is None else 0.97, "withheld": why if sct is None else None}


def row(dies, a, s, pct=90, trace="mooncake"):
    return make_row(dies, trace, pct, 5.0, entry(a, "meets the SLO at no tested load"),
                    entry(s, "meets the SLO at no tested load"))


# ----------------------------------------------------------------------------- rows and the crossover
def test_crossover_smallest_size_from_which_asap_wins_at_every_larger_size():
    rows = [row(32, 50, 100), row(64, 90, 100), row(128, 120, 100), row(256, 150, 100), row(384, 210, 100)]
    assert crossover_dies(rows) == {"90": {"mooncake": 128}}
    # a win below a loss does not count: from 256 on
    rows = [row(32, 150, 100), row(64, 90, 100), row(128, 99, 100), row(256, 101, 100), row(384, 130, 100)]
    assert crossover_dies(rows)["90"]["mooncake"] == 256
    # a loss at the largest size: no crossover
    rows = [row(32, 50, 100), row(64, 150, 100), row(128, 90, 100)]
    assert crossover_dies(rows)["90"]["mooncake"] is None
    # equal throughputs are not a win
    assert crossover_dies([row(64, 100, 100), row(128, 101, 100)])["90"]["mooncake"] == 128


def test_crossover_per_percentile_and_trace_and_withheld_figures():
    rows = [row(32, 50, 100, 90), row(64, 120, 100, 90),
            row(32, None, 100, 99), row(64, 110, None, 99),   # 99: ASAP withheld at 32 (loses), baseline at 64 (wins)
            row(32, 120, 100, 90, "azure"), row(64, None, None, 90, "azure")]  # nothing to compare at 64: no win
    got = crossover_dies(rows)
    assert got == {"90": {"azure": None, "mooncake": 64}, "99": {"mooncake": 64}}
    assert asap_wins(rows[2]) is False and asap_wins(rows[3]) is True and asap_wins(rows[5]) is None


def test_a_withheld_figure_never_makes_a_ratio():
    r = row(64, 120.0, 80.0)
    assert r["ratio"] == pytest.approx(1.5) and r["ratio_withheld"] is None
    for a, s, who in ((None, 80.0, "ASAP"), (120.0, None, "baseline"), (None, None, "ASAP")):
        r = row(64, a, s)
        assert r["ratio"] is None
        assert r["ratio_withheld"].startswith("ratio withheld: ") and who in r["ratio_withheld"]
        assert "meets the SLO at no tested load" in r["ratio_withheld"]


# ----------------------------------------------------------------------------- the search's economy
class FakeEv:
    """passes(d, k) iff k <= the deployment's threshold; counts the runs."""

    def __init__(self, thresholds):
        self.thr, self.calls = thresholds, []

    def passes(self, d, k, target):
        self.calls.append((d, k))
        return k <= self.thr[d]


@pytest.mark.parametrize("thr", [-40, -17, -16, 0, 5, 33])
def test_load_search_finds_the_threshold_to_one_lattice_step(thr):
    ev = FakeEv({"d": thr})
    assert ss.load_search(ev, "d", 0.9, None, -16) == thr
    assert len(set(ev.calls)) == len(ev.calls)  # no load run twice
    assert len(ev.calls) <= 12


def test_load_search_against_an_incumbent_costs_one_run_when_it_cannot_win():
    ev = FakeEv({"weak": 7, "strong": 30})
    assert ss.load_search(ev, "weak", 0.9, 7, -16) is None  # equal to the incumbent: ties keep the incumbent
    assert ev.calls == [("weak", 8)]
    assert ss.load_search(ev, "strong", 0.9, 7, -16) == 30


def test_load_search_none_when_no_load_passes():
    ev = FakeEv({"d": -10 ** 6})
    assert ss.load_search(ev, "d", 0.9, None, 0) is None


@pytest.fixture(scope="module")
def v3():
    return CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.load("deepseek-v3")


class KnobEv(FakeEv):
    """An evaluator where a deployment passes up to lattice step 0 iff ``wins(d)``."""

    def __init__(self, cost, shapes, wins):
        super().__init__({})
        self.cost, self.shapes, self.slo_s, self.wins = cost, shapes, 4.53, wins
        self.trace = type("T", (), {"requests": [Request(0, 0.0, 99000)]})()

    def passes(self, d, k, target):
        self.calls.append((d, k))
        return self.wins(d) and k <= 0

    def result(self, d, target):
        return {"slo_compliant_throughput": 1.0 if self.wins(d) else None}


def test_where_no_structure_passes_the_modes_knobs_are_tried_on_every_structure(v3):
    """A strict p99 SLO that no structure meets with the middle knobs, but one does with the lane's equal-cost
    split: the search tries the mode's knobs on every structure and finds it (before, it gave up after (1))."""
    cost, shapes = v3
    grid = {"tps": (4,)}
    ev = KnobEv(cost, shapes, lambda d: d.cfg.lane_chunks == "cost" and d.cfg.num_attention_ranks == 12)
    r = ss.search_mode(ev, "async", 64, 0.99, grid=grid)
    assert r["best"] is not None and r["best"].cfg.lane_chunks == "cost" and r["best"].cfg.num_attention_ranks == 12
    stages = [c["stage"] for c in r["candidates"]]
    assert "fallback" in stages and stages.index("fallback") > stages.index("structure")
    # a structure that passes with the middle knobs: no fallback, the usual stages around it
    ev = KnobEv(cost, shapes, lambda d: d.cfg.num_attention_ranks == 12)
    r = ss.search_mode(ev, "async", 64, 0.99, grid=grid)
    assert r["best"].cfg.num_attention_ranks == 12
    assert "fallback" not in [c["stage"] for c in r["candidates"]]
    # nothing passes: every knob on every structure was tried, and the answer is none
    ev = KnobEv(cost, shapes, lambda d: False)
    r = ss.search_mode(ev, "async", 64, 0.99, grid=grid)
    fallback = [c for c in r["candidates"] if c["stage"] == "fallback"]
    structs = [c for c in r["candidates"] if c["stage"] == "structure"]
    assert r["best"] is None and len(fallback) >= len(structs) * (len(ss.LANES) + len(ss.EXPERT_BATCHING) - 2)


def test_the_unloaded_bound_only_fails_loads_that_do_fail(v3):
    cost, shapes = v3
    tw = ss.load_windows("azure")
    d = ss.structures("sync", 64, shapes, cost, tps=(8,), cps=(None,))[0]
    # an SLO between the unloaded TTFTs of the median and the p99 prompt of the window: p99 is bounded
    ev = ss.Evaluator(tw, cost, shapes, 1.0, 1.0, n_min=200, n_max=200)
    lens = sorted(r.prompt_len for r in tw.window(0, 200))
    t50, t99 = ev._unloaded(d, lens[100]), ev._unloaded(d, lens[197])
    assert t50 < t99
    ev.slo_s = (t50 + t99) / 2
    ev.unloaded.clear()
    k = -20  # a light load
    s = ev.point(d, k, 0.99)
    assert s.get("bounded") and ev.stats["simulated"] == 0 and s["slo_attainment"] < 0.99
    # the simulated run at that load agrees: the p99 target fails there
    real, _ = run_point("sync", tw.window(0, 200), ev.rate(k), cost, shapes, d.cfg, ev.slo_s,
                        sync_ranks=d.sync_ranks, par=d.par)
    assert real["slo_attainment"] < 0.99
    assert real["slo_attainment"] <= s["slo_attainment"] + 1e-12
    # the p90 target is not decided by the bound: that point is simulated (and cached for p99 too)
    s90 = ev.point(d, k, 0.9)
    assert not s90.get("bounded") and ev.stats["simulated"] == 1
    assert s90["slo_attainment"] == pytest.approx(real["slo_attainment"])
    assert ev.point(d, k, 0.99) is s90 and ev.stats["cached"] == 1


def test_one_slo_per_trace_at_every_size(v3):
    cost, shapes = v3
    tw = ss.load_windows("mooncake")
    slo, rule = ss.slo_rule(tw.requests, cost, shapes)
    ref = ss.reference_deployment(shapes)
    assert ref.devices == ss.REFERENCE_DIES and ref.par.cp_threshold is None
    lens = sorted(r.prompt_len for r in tw.requests)
    from asap_comm.sim.core.simulate import simulate
    one = simulate("sync", [Request(0, 0.0, lens[int(0.9 * len(lens))])], cost, shapes, ref.cfg,
                   sync_ranks=ref.sync_ranks, par=ref.par).records[0].ttft_s
    assert slo == pytest.approx(SLO_MULTIPLIER * one) and "p90 prompt" in rule


def test_seeds_are_disjoint_windows_of_the_trace():
    tw = ss.load_windows("azure")
    stride = len(tw.requests) // 3
    w = [tw.window(s, 500) for s in range(3)]
    for s, win in enumerate(w):
        assert len(win) == 500 and win[0].arrival_s == 0.0
        src = tw.requests[s * stride:s * stride + 500]
        assert [r.prompt_len for r in win] == [r.prompt_len for r in src]
    assert w[0] != w[1] and w[1] != w[2]


def test_expert_splits_hold_the_experts_and_leave_tp8_groups():
    for dies in (64, 128, 384, 768):
        for e in ss.expert_splits(dies, 16):
            assert 16 <= e <= dies // 2 and (dies - e) % 8 == 0
    assert ss.expert_splits(16, 13) == [13]  # only the fewest that fit



def test_the_lane_stage_searches_both_splits_and_the_winners_split_carries_over():
    """The lane stage tries each pool and wait bound with chunks of equal length and of equal attention cost
    (``RuntimeConfig.lane_chunks``); the winner's split goes with its knobs to other structures and sizes."""
    base = ss._async(64, 4, 16, 8192, 16384)
    lanes = ss.refinements(base, "lane", 4.5)
    assert len(lanes) == len(ss.LANES) == 8
    got = {(d.cfg.lane_tokens, d.cfg.lane_wait_s, d.cfg.lane_chunks) for d in lanes}
    assert got == {(p, None if w is None else w * 4.5, how) for p, w, how in ss.LANES}
    assert {how for *_, how in got} == {"tokens", "cost"}
    assert ss.refinements(base, "lane", 4.5, lanes=[(None, 1.0)])[0].cfg.lane_chunks == "tokens"  # (pool, wait)
    win = next(d for d in lanes if d.cfg.lane_chunks == "cost" and d.cfg.lane_tokens)
    assert "lane chunks by cost" in win.label and len({repr(d) for d in lanes}) == 8
    other = ss.with_knobs_of(ss._async(64, 8, 24, 16384, 16384), win)
    assert (other.cfg.lane_chunks, other.cfg.lane_tokens, other.par.attention_tp) == ("cost", win.cfg.lane_tokens, 8)
    assert ss.translate(win, 128).cfg.lane_chunks == "cost"

# ----------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    rc = sim_main(["scaling", "--profile", "ascend-910c-cm384", "--model", "deepseek-v3", "--dies", "16,64",
                   "--quick", "--out", str(out)])
    return rc, out


def test_quick_scaling_writes_the_contract(quick):
    rc, out = quick
    assert rc == 0
    data = json.loads((out / "scaling.json").read_text())
    rows = data["rows"]
    assert {(r["dies"], r["trace"], r["percentile"]) for r in rows} == {
        (d, t, p) for d in (16, 64) for t in ("mooncake", "azure") for p in (90, 99)}
    for r in rows:
        assert {"dies", "percentile", "slo_s", "async", "sync", "ratio"} <= set(r)
        for m in ("async", "sync"):
            assert {"deployment", "slo_compliant_throughput", "served_fraction"} <= set(r[m])
        a, s = r["async"]["slo_compliant_throughput"], r["sync"]["slo_compliant_throughput"]
        if r["ratio"] is None:
            assert r["ratio_withheld"].startswith("ratio withheld")
        else:
            assert a is not None and s is not None and r["ratio"] == pytest.approx(a / s)
        for m in ("async", "sync"):
            e = r[m]
            if e["slo_compliant_throughput"] is None:
                assert e["served_fraction"] is None and e["withheld"]
            else:  # a counted load is one the mode sustains
                assert e["served_fraction"] >= 0.9 and e["deployment"]["devices"] == r["dies"]
        # one SLO per trace, whatever the size or percentile
        assert r["slo_s"] == data["traces"][r["trace"]]["slo_s"]
    # 16 910C dies hold DeepSeek-V3 in neither mode
    for r in rows:
        if r["dies"] == 16:
            assert r["ratio"] is None and "memory" in r["ratio_withheld"]
            assert r["async"]["deployment"] is None and r["sync"]["deployment"] is None
        else:
            assert r["sync"]["slo_compliant_throughput"] is not None
    assert data["crossover_dies"] == crossover_dies(rows)
    assert set(data["crossover_dies"]) == {"90", "99"}
    assert all(set(v) == {"mooncake", "azure"} for v in data["crossover_dies"].values())
    assert data["timing"] and all(t["wall_s"] > 0 for t in data["timing"])


def test_quick_scaling_plot(quick):
    pytest.importorskip("matplotlib")
    _, out = quick
    png = (out / "scaling.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.parametrize("flags, named", [
    (["--dies", "16,x"], "--dies"), (["--dies", "0"], "--dies"), (["--percentiles", "95"], "--percentiles"),
    (["--traces", "no-such-trace"], "--traces"), (["--traces", ","], "--traces")])
def test_bad_flags_exit_2_naming_the_flag(flags, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(["scaling", "--profile", "ascend-910c-cm384", "--model", "deepseek-v3", "--out", str(tmp_path),
                  *flags])
    assert e.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "scaling.json").exists()
