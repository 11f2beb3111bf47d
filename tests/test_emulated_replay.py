"""The simulator against the committed emulated 64-die sweep (``bench/emulated_replay.py``): every load the
emulated run measured, replayed through ``simulate_emulated`` and counted under the one metric."""
import json
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "docs" / "results" / "emulated-64"


_REPLAYED: dict = {}  # one replay for the module's tests (bench_script is per test)


@pytest.fixture
def replayed(bench_script):
    if "run" not in _REPLAYED:
        _REPLAYED["run"] = bench_script("emulated_replay").replay(RUN)
    return _REPLAYED["run"]


def test_the_real_side_counts_as_the_example_counted_it(replayed):
    """The replay's count of the real runs is the example's own (same points, same rule)."""
    summary = json.loads((RUN / "summary.json").read_text())
    assert len(replayed["rows"]) == len(summary["runs"])
    sct = replayed["real"]["slo_compliant_throughput"]
    assert sct["async"] == pytest.approx(summary["async"]["slo_compliant_throughput"])
    assert sct["sync"] == pytest.approx(summary["sync"]["slo_compliant_throughput"])
    assert replayed["real"]["ratio"] == pytest.approx(summary["slo_compliant_throughput_ratio"])


def test_the_simulator_predicts_the_emulated_64_die_ratio_within_15_percent(replayed):
    assert replayed["sim"]["ratio"] is not None, replayed["sim"]["ratio_withheld"]
    assert abs(replayed["ratio_error"]) <= 0.15, replayed["ratio_error"]
    # and load by load: each tested load passes or fails the same way on both sides, attainment within 0.05
    for row in replayed["rows"]:
        real, sim = row["real"], row["sim"]
        assert abs(sim["slo_attainment"] - real["slo_attainment"]) <= 0.05, row
        assert abs(sim["served_fraction"] - real["served_fraction"]) <= 0.08, row


def test_the_committed_replay_is_what_the_script_writes_now(replayed):
    committed = json.loads((RUN / "replay.json").read_text())
    assert committed["sim"]["ratio"] == pytest.approx(replayed["sim"]["ratio"], rel=1e-9)
    assert [r["sim"]["slo_attainment"] for r in committed["rows"]] == pytest.approx(
        [r["sim"]["slo_attainment"] for r in replayed["rows"]], abs=1e-12)


def test_a_run_without_the_served_fraction_is_refused(bench_script, tmp_path):
    old = json.loads((RUN / "summary.json").read_text())
    for r in old["runs"]:
        r.pop("served_fraction")
    (tmp_path / "summary.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="predates the served fraction"):
        bench_script("emulated_replay").replay(tmp_path)


def test_fitted_overheads_reads_the_committed_probe_and_refuses_a_file_without_one(tmp_path):
    from asap_comm.sim.calibrate.emulated import fitted_overheads
    root = Path(__file__).resolve().parents[1]
    host, skews = fitted_overheads(root / "docs" / "results" / "validation-emulated" / "validation_emulated.json")
    assert set(host) == {"async_job_s", "expert_job_s", "async_layer_s", "sync_layer_s"}
    assert all(v > 0 for v in host.values()) and skews["async"] >= 1.0 and skews["sync"] >= 1.0
    bare = tmp_path / "v.json"
    bare.write_text('{"configs": [{"host_overhead": null}]}')
    with pytest.raises(ValueError, match="no fitted host overhead"):
        fitted_overheads(bare)


def test_the_replay_charges_the_router_skew_the_run_recorded(bench_script, tmp_path, monkeypatch):
    """The served router's skew grows with the ranks (the validation probe measured it on 4): a summary whose loads
    record their own (``emulation.routing_skew``, since 2026-12-06) is replayed with the median of its mode's, and
    ``--expert-skew MODE=X`` overrides either."""
    run = json.loads((RUN / "summary.json").read_text())
    run["runs"] = [r for r in run["runs"] if r["mode"] == "sync"][:2]
    for r, skew in zip(run["runs"], (2.0, 2.2)):
        r.setdefault("emulation", {})["routing_skew"] = skew
    (tmp_path / "summary.json").write_text(json.dumps(run))
    script = bench_script("emulated_replay")
    charged = []
    real = script.simulate_emulated

    def spy(*args, **kw):
        charged.append(kw["expert_skew"])
        return real(*args, **kw)

    monkeypatch.setattr(script, "simulate_emulated", spy)
    out = script.replay(tmp_path)
    assert out["expert_skew"]["sync"] == 2.2 and out["expert_skew_from"]["sync"] == "this run"
    assert out["expert_skew_from"]["async"] == "validation probe"
    given = script.replay(tmp_path, expert_skew={"sync": 1.7})
    assert given["expert_skew"]["sync"] == 1.7 and given["expert_skew_from"]["sync"] == "given"
    assert charged == [2.2, 2.2, 1.7, 1.7]  # every replayed load of the baseline, with the skew it reports
