"""``python -m asap_comm.sim plan``: the recommendation rule, the 3-seed spread, the --quick run's plan.json,
the memory refusal (exit 2, one line naming memory) and bad flags (exit 2 naming the flag)."""
import json

import pytest

from asap_comm.sim.cli import main as sim_main
from asap_comm.sim.studies.plan import SEEDS, recommend, spread_summary

BASE = ["plan", "--profile", "ascend-910c-cm384", "--model", "deepseek-v3"]


# ----------------------------------------------------------------------------- the rule
def test_recommend_by_the_majority_of_seeds():
    assert recommend([(120, 100), (130, 100), (90, 100)])[:2] == ("async", 2)
    assert recommend([(80, 100), (130, 100), (90, 100)])[:2] == ("sync", 2)
    assert recommend([(100, 100), (100, 100), (100, 100)])[:2] == ("sync", 3)  # equal: the baseline stays
    # a withheld figure loses to one that stands; both withheld is no vote
    assert recommend([(None, 100), (None, 90), (50, None)])[:2] == ("sync", 2)
    assert recommend([(10, None), (None, None), (None, None)])[:2] == ("async", 1)
    rec, agree, why = recommend([(None, None)] * 3)
    assert (rec, agree) == ("sync", 0) and "neither" in why
    rec, agree, why = recommend([(120, 100), (90, 100), (None, None)])
    assert (rec, agree) == ("sync", 1) and "split" in why


def test_spread_summary():
    s = spread_summary([(120.0, 100.0), (None, 100.0), (150.0, 100.0)])
    assert s["seeds"] == list(SEEDS) and s["async"] == [120.0, None, 150.0] and s["sync"] == [100.0] * 3
    assert s["ratio"] == [pytest.approx(1.2), None, pytest.approx(1.5)]
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(1.2), pytest.approx(1.5))
    assert s["ratio_median"] == pytest.approx(1.35)
    assert spread_summary([(None, 1.0)] * 3)["ratio_median"] is None


# ----------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One --quick plan for the module: (exit code, --out folder, what it printed)."""
    import contextlib
    import io

    out, text = tmp_path_factory.mktemp("plan"), io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = sim_main(BASE + ["--dies", "64", "--trace", "azure", "--slo-percentile", "99", "--quick", "--out",
                              str(out)])
    return rc, out, text.getvalue()


def test_quick_plan_writes_the_contract(quick, capsys):
    rc, out, _ = quick
    assert rc == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["recommended"] in ("async", "sync")
    assert plan["dies"] == 64 and plan["slo_percentile"] == 99 and plan["slo_s"] > 0
    for m in ("async", "sync"):
        e = plan[m]
        assert {"deployment", "slo_compliant_throughput", "served_fraction", "withheld"} <= set(e)
        assert e["deployment"]["devices"] == 64 and e["deployment"]["mode"] == m
        if e["slo_compliant_throughput"] is not None:
            assert e["served_fraction"] >= 0.9
        # the memory table of the chosen deployment: every role fits
        assert plan["memory"][m] and all(d["feasible"] for d in plan["memory"][m])
        assert sum(d["dies"] for d in plan["memory"][m]) == 64
    a, s = plan["async"]["slo_compliant_throughput"], plan["sync"]["slo_compliant_throughput"]
    if a is not None and s is not None:
        assert plan["ratio"] == pytest.approx(a / s) and plan["ratio_withheld"] is None
    else:
        assert plan["ratio"] is None and plan["ratio_withheld"].startswith("ratio withheld")
    assert "attention" in plan["memory_table"] and "baseline" in plan["memory_table"]


def test_quick_plan_spread_over_three_seeds(quick):
    _, out, _ = quick
    plan = json.loads((out / "plan.json").read_text())
    sp = plan["spread"]
    assert sp["seeds"] == [0, 1, 2]
    assert len(sp["async"]) == len(sp["sync"]) == len(sp["ratio"]) == 3
    # seed 0 is the search's own figures; the others are other windows of the trace
    assert sp["async"][0] == plan["async"]["slo_compliant_throughput"]
    assert sp["sync"][0] == plan["sync"]["slo_compliant_throughput"]
    assert len({w["first_request"] for w in sp["windows"]}) == 3
    have = [r for r in sp["ratio"] if r is not None]
    if have:
        assert sp["ratio_min"] <= sp["ratio_median"] <= sp["ratio_max"]
        assert sp["ratio_min"] == min(have) and sp["ratio_max"] == max(have)
    # the recommendation follows the seeds
    rec, agree, _ = recommend(list(zip(sp["async"], sp["sync"])))
    assert (plan["recommended"], sp["agree"]) == (rec, agree)


def test_plan_prints_one_screen(quick):
    rc, _, text = quick  # the module's --quick plan (64 dies, azure)
    assert rc == 0
    assert "recommended:" in text and "memory per die" in text
    assert len(text.splitlines()) <= 25


@pytest.mark.parametrize("dies", ["8", "16"])
def test_a_cluster_too_small_exits_2_with_one_line_naming_memory(dies, tmp_path, capsys):
    rc = sim_main(BASE + ["--dies", dies, "--trace", "azure", "--quick", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    if dies == "16":  # 16 dies hold the model in ASAP (3 + 13 expert dies) only: a plan, not a refusal
        assert rc == 0
        assert "memory" in json.loads((tmp_path / "plan.json").read_text())["sync"]["withheld"]
        return
    assert rc == 2
    assert len(err.splitlines()) == 1 and "memory" in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("flags, named", [
    (["--dies", "abc", "--trace", "azure"], "--dies"),
    (["--dies", "1", "--trace", "azure"], "--dies"),
    (["--dies", "64", "--trace", "azure", "--slo-percentile", "95"], "--slo-percentile"),
    (["--dies", "64", "--trace", "azure", "--slo", "-3"], "--slo"),
    (["--dies", "64", "--trace", "azure", "--slo", "soon"], "--slo"),
    (["--dies", "64", "--trace", "no-such-trace.jsonl"], "--trace"),
    (["--dies", "64"], "--trace"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(BASE + flags + ["--out", str(tmp_path)])
    assert e.value.code == 2
    assert named in capsys.readouterr().err
