"""Expert failover in the simulator (``simulate(..., failures=)``, ``core/failover.py``; docs/failover.md, "The
simulator's model"): a spare replaces a dead expert rank after its load time, with none left the group fails, the
baseline ends at a death, no failure changes nothing, bad input names the call; the load-time formula; and
``plan --spare-expert-ranks``."""
import dataclasses
import json
import math

import pytest

from asap_comm.serving.metrics import summarize_run
from asap_comm.serving.protocol import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.failover import (CHECKPOINT_READ_GBPS, DETECT_S, SPARE_STARTUP_S, expert_rank_bytes,
                                              failover_params, spare_load_s)
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.memory import memory_of
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies.spares import more_deaths_than, recommend_spares

from sim_fakes import CFG, SHAPES, ToyCost, sim_cli

LOAD = 0.01  # s: the spare's load time in the toy runs (a few hundred micro-batch layers of the toy model)
CFG2 = dataclasses.replace(CFG, num_attention_ranks=2, num_expert_ranks=2, spare_expert_ranks=1)
STEP = 0.0005  # s between arrivals: a steady load the toy deployment serves (TTFT ~0.55 ms)
TRACE = [Request(i, i * STEP, 48) for i in range(200)]  # 0.1 s of arrivals
T_FAIL = 0.03


def run(cfg=CFG2, failures=None, trace=TRACE, cost=None, mode="async", **kw):
    return simulate(mode, trace, cost or ToyCost(), SHAPES, cfg, failures=failures, **kw)


def ttfts(res) -> dict:
    return {r.request_id: r.ttft_s for r in res.records}


@pytest.fixture(scope="module")
def base():
    return run()


@pytest.fixture(scope="module")
def spared():
    return run(failures=[(T_FAIL, 1)], spare_load_s=LOAD)


# ----------------------------------------------------------------------------- with a spare
def test_with_a_spare_every_request_finishes(spared):
    assert all(r.ok for r in spared.records)
    fo = spared.failover
    assert fo["requests_failed"] == 0 and fo["group_failed"] is None and fo["spares_used"] == 1
    (d,) = fo["deaths"]
    assert (d["time_s"], d["expert_rank"], d["spare"]) == (T_FAIL, 1, 0)
    assert d["time_to_replace_s"] == pytest.approx(DETECT_S + LOAD)
    assert d["ready_s"] == pytest.approx(T_FAIL + DETECT_S + LOAD)
    # the micro-batches in flight lost their rows at the dead rank; they (and any dispatched meanwhile) went again
    assert 1 <= d["lost_parts"] <= d["redispatched_parts"]
    assert d["ready_s"] <= d["caught_up_s"] <= d["recovered_s"]
    # the spare is a die of its own in the rank table
    assert [r["role"] for r in spared.ranks].count("expert spare") == 1


def test_a_request_in_flight_waits_for_the_spare(base, spared):
    before, after = ttfts(base), ttfts(spared)
    in_flight = [r for r in base.records if r.arrival_s <= T_FAIL < r.done_s]
    assert in_flight
    replace = DETECT_S + LOAD
    for r in in_flight:
        # its rows at the dead rank come back only after the spare has loaded: about the load time later
        assert after[r.request_id] >= before[r.request_id]
        assert after[r.request_id] == pytest.approx(before[r.request_id] + replace, abs=0.25 * replace)
        assert spared.records[r.request_id].done_s >= T_FAIL + replace
    # finished before the death: untouched
    for r in base.records:
        if r.done_s < T_FAIL:
            assert after[r.request_id] == before[r.request_id]


def test_throughput_before_during_after(spared):
    tp = spared.failover["throughput"]
    assert tp["windows"]["before"] == [0.0, T_FAIL]
    assert tp["during"] < 0.1 * tp["before"]  # no micro-batch passes its MoE layer without the dead rank's part
    # after the backlog: the offered load is served again, as before the death
    assert tp["after"] == pytest.approx(tp["offered"]["after"], rel=0.1)
    assert tp["before"] == pytest.approx(tp["offered"]["before"], rel=0.1)
    assert tp["after"] == pytest.approx(tp["before"], rel=0.15)


@pytest.mark.parametrize("variant", ["batching", "lockstep", "tp2", "shared-cpu", "two-spares-two-ranks"])
def test_every_request_finishes_in_each_variant(variant):
    cfg, par, cost, failures = CFG2, Parallelism(), ToyCost(), [(T_FAIL, 1)]
    if variant == "batching":
        cfg = dataclasses.replace(cfg, expert_batching=True, expert_deadline_s=0.0002)
    elif variant == "lockstep":
        cfg = dataclasses.replace(cfg, barrier_free=False)
    elif variant == "tp2":
        par = Parallelism(attention_tp=2)
    elif variant == "shared-cpu":
        cost.cores = 2
    else:
        cfg = dataclasses.replace(cfg, spare_expert_ranks=2)
        failures = [(T_FAIL, 1), (T_FAIL + 0.005, 0)]
    res = run(cfg, failures, cost=cost, par=par, spare_load_s=LOAD)
    assert all(r.ok for r in res.records), variant
    assert res.failover["spares_used"] == len(failures)
    ok = run(cfg, cost=ToyCost() if variant != "shared-cpu" else cost, par=par)
    assert max(r.done_s for r in res.records) >= max(r.done_s for r in ok.records)


def test_a_second_death_of_the_same_rank_waits_for_its_spare():
    cfg = dataclasses.replace(CFG2, spare_expert_ranks=2)
    res = run(cfg, [(T_FAIL, 1), (T_FAIL + 0.001, 1)], spare_load_s=LOAD)
    assert all(r.ok for r in res.records)
    first, second = res.failover["deaths"]
    assert second["time_s"] >= first["caught_up_s"] and second["spare"] == 1


# ----------------------------------------------------------------------------- no spare left
def test_with_no_spare_the_group_fails(base):
    res = run(dataclasses.replace(CFG2, spare_expert_ranks=0), [(T_FAIL, 1)], spare_load_s=LOAD)
    fo = res.failover
    assert fo["group_failed"]["time_s"] == T_FAIL and "no spare" in fo["group_failed"]["reason"]
    assert res.makespan_s == T_FAIL
    before = ttfts(base)
    for r in res.records:
        if r.ok:  # finished before the death, as without it
            assert r.done_s < T_FAIL and r.ttft_s == before[r.request_id]
        else:
            assert r.error.startswith("failed:") and "expert rank 1" in r.error
    assert fo["requests_failed"] == sum(1 for r in base.records if r.done_s >= T_FAIL) > 0
    assert summarize_run(res.records, 1.0).num_failed == fo["requests_failed"]


def test_one_spare_two_deaths_fails_at_the_second():
    res = run(failures=[(T_FAIL, 1), (T_FAIL + 0.02, 0)], spare_load_s=LOAD)
    assert res.failover["spares_used"] == 1
    assert res.failover["group_failed"]["time_s"] == pytest.approx(T_FAIL + 0.02)
    assert res.failover["requests_failed"] > 0


# ----------------------------------------------------------------------------- the baseline
def test_the_baseline_ends_at_a_death(base):
    sync_base = run(mode="sync", sync_ranks=4)
    res = run(mode="sync", sync_ranks=4, failures=[(T_FAIL, 3)])
    assert res.makespan_s == T_FAIL
    fo = res.failover
    assert "cannot fail over" in fo["note"] and fo["spares_used"] == 0  # the spare in cfg is no use to it
    assert fo["group_failed"]["time_s"] == T_FAIL
    done_before = {r.request_id for r in sync_base.records if r.done_s < T_FAIL}
    assert {r.request_id for r in res.records if r.ok} == done_before
    assert all(r.error.startswith("failed:") for r in res.records if not r.ok)


# ----------------------------------------------------------------------------- no failure
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_no_failure_is_the_run_without_the_option(mode):
    kw = {"sync_ranks": 4} if mode == "sync" else {}
    plain = simulate(mode, TRACE, ToyCost(), SHAPES, dataclasses.replace(CFG2, spare_expert_ranks=0), **kw)
    for failures in (None, []):
        res = run(mode=mode, failures=failures, **kw)
        assert [(r.request_id, r.done_s, r.error) for r in res.records] == \
               [(r.request_id, r.done_s, r.error) for r in plain.records]
        assert res.failover == {} and res.events == plain.events and res.ranks == plain.ranks


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("failures, named", [
    ([(-0.1, 0)], "-0.1"),
    ([(math.nan, 0)], "nan"),
    ([(0.01, 2)], "expert_rank=2"),
    ([(0.01, -1)], "expert_rank=-1"),
    ([(0.01, 1.0)], "expert_rank=1.0"),
    ([(0.01,)], "failures[0]"),
    ([0.01], "failures[0]"),
    (0.01, "failures=0.01"),
])
def test_bad_failures_name_the_call_and_value(failures, named):
    with pytest.raises(ValueError, match="simulate") as e:
        run(failures=failures, spare_load_s=LOAD)
    assert named in str(e.value)


def test_bad_spares_and_load_time():
    with pytest.raises(ValueError, match=r"spare_expert_ranks=-1"):
        dataclasses.replace(CFG2, spare_expert_ranks=-1)
    with pytest.raises(ValueError, match=r"simulate: spare_load_s=-1"):
        run(failures=[(0.01, 0)], spare_load_s=-1)
    with pytest.raises(ValueError, match=r"simulate: spare_load_s must be given"):
        run(failures=[(0.01, 0)])  # the toy cost model has no profile to derive it from
    with pytest.raises(ValueError, match=r"simulate: failures\[0\] rank=4"):
        run(mode="sync", sync_ranks=4, failures=[(0.01, 4)])


# ----------------------------------------------------------------------------- the load time
def test_load_time_is_the_rank_experts_over_the_read_rate():
    cost = CostModel.load("ascend-910c-cm384", "deepseek-v3")
    shapes = ModelShapes.load("deepseek-v3")
    E = 32
    cfg = RuntimeConfig(num_attention_ranks=4, num_expert_ranks=E)
    expert = next(d for d in memory_of("async", cfg, Parallelism(attention_tp=8), None, cost.profile, shapes)
                  if d.role == "expert")
    # what a spare reads is what an expert die holds as routed experts (memory.py)
    assert expert_rank_bytes(cost.profile, shapes, E) / 1e9 == pytest.approx(expert.breakdown["routed experts"])
    want = SPARE_STARTUP_S + expert_rank_bytes(cost.profile, shapes, E) / (CHECKPOINT_READ_GBPS * 1e9)
    assert spare_load_s(cost.profile, shapes, E) == pytest.approx(want)
    # a profile's failover block overrides the defaults
    data = dict(cost.profile.data, failover={"checkpoint_read_gbps": 20.0, "spare_startup_s": 0.5})
    prof = Profile(data, "test")
    assert failover_params(prof)["checkpoint_read_gbps"] == 20.0
    assert spare_load_s(prof, shapes, E) == pytest.approx(0.5 + expert_rank_bytes(prof, shapes, E) / 20e9)
    with pytest.raises(ValueError, match="failover.checkpoint_read_gbps"):
        failover_params(Profile(dict(cost.profile.data, failover={"checkpoint_read_gbps": 0}), "bad"))
    with pytest.raises(ValueError, match="expert_rank_bytes: expert_ranks=0"):
        expert_rank_bytes(cost.profile, shapes, 0)


def test_simulate_derives_the_load_time_from_the_cost_model():
    cost = CostModel.load("ascend-910c-cm384", "deepseek-v3")
    shapes = cost.shapes
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=16, spare_expert_ranks=1, token_budget=4096,
                        chunk_len=4096, max_prompt_len=4096)
    trace = [Request(i, 0.05 * i, 2048) for i in range(40)]
    res = simulate("async", trace, cost, shapes, cfg, par=Parallelism(attention_tp=8), failures=[(0.5, 3)])
    assert res.failover["load_s"] == pytest.approx(spare_load_s(cost.profile, shapes, 16))
    assert res.failover["deaths"][0]["time_to_replace_s"] == pytest.approx(DETECT_S + res.failover["load_s"])
    assert all(r.ok for r in res.records)


# ----------------------------------------------------------------------------- sizing spares
def test_more_deaths_than_spares_is_poisson():
    assert more_deaths_than(0, 10, 0.0, 24) == 0.0
    m = 0.1 * 10 * 12 / 24  # 0.5 deaths expected
    assert more_deaths_than(0, 10, 0.1, 12) == pytest.approx(1 - math.exp(-m))
    assert more_deaths_than(1, 10, 0.1, 12) == pytest.approx(1 - math.exp(-m) * (1 + m))


def test_recommend_spares():
    runs = [{"spares": 0, "requests_failed": 5}, {"spares": 1, "requests_failed": 0},
            {"spares": 2, "requests_failed": 0}]
    assert recommend_spares([dict(r) for r in runs], 32, None, 24)[0] == 1
    assert recommend_spares([dict(r) for r in runs[:1]], 32, None, 24)[0] == 0
    assert recommend_spares([dict(r) for r in runs], 32, 1e-6, 24)[0] == 0  # deaths so rare that none is needed
    assert recommend_spares([dict(r) for r in runs], 32, 1e-3, 24)[0] == 1
    n, why = recommend_spares([dict(r) for r in runs], 32, 0.05, 24)  # 1.6 deaths a day: even 2 are too few
    assert n == 2 and "the most tried" in why


def test_plan_quick_sizes_spares(tmp_path, capsys):
    rc, out, err = sim_cli(["plan", "--profile", "ascend-910c-cm384", "--model", "deepseek-v3", "--dies", "64",
                            "--trace", "azure", "--quick", "--spare-expert-ranks", "1", "--out", str(tmp_path)],
                           capsys)
    assert rc == 0, err
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["recommended"] in ("async", "sync") and {"async", "sync", "spread", "memory"} <= set(plan)
    fo = plan["failover"]
    assert [r["spares"] for r in fo["runs"]] == [0, 1]
    none, one = fo["runs"]
    assert none["group_failed"] and none["requests_failed"] > 0
    assert not one["group_failed"] and one["requests_failed"] == 0
    assert one["time_to_replace_s"] == pytest.approx(fo["detect_s"] + fo["load_s"])
    assert one["recovered_after_s"] >= one["time_to_replace_s"]
    assert one["extra_die_fraction"] == pytest.approx(1 / 65)
    assert fo["spare_die_memory"]["fits"] and fo["recommended_spares"] == 1
    assert "spares:" in out and "recommended: 1 spare(s)" in out


@pytest.mark.parametrize("flags, named", [
    (["--spare-expert-ranks", "3"], "--spare-expert-ranks"),
    (["--spare-expert-ranks", "x"], "--spare-expert-ranks"),
    (["--die-failures-per-day", "0.01"], "--die-failures-per-day"),
    (["--spare-expert-ranks", "1", "--die-failures-per-day", "-1"], "--die-failures-per-day"),
    (["--spare-expert-ranks", "1", "--repair-hours", "0"], "--repair-hours"),
])
def test_plan_bad_spare_flags_exit_2(flags, named, tmp_path, capsys):
    rc, _out, err = sim_cli(["plan", "--profile", "ascend-910c-cm384", "--model", "deepseek-v3", "--dies", "64",
                             "--trace", "azure", "--quick", "--out", str(tmp_path)] + flags, capsys)
    assert rc == 2 and named in err


_RUN = ["run", "--profile", "ascend-910c-cm384", "--attention-ranks", "6", "--attention-tp", "8", "--expert-ranks",
        "16", "--sync-ranks", "8", "--sync-tp", "8", "--num-requests", "120", "--rate", "1.0"]


def test_sim_run_kills_an_expert_rank_with_a_spare_and_the_baseline_ends(tmp_path, capsys):
    """``sim run --expert-failure 40:0 --spare-expert-ranks 1``: ASAP replaces the rank and fails nothing; the
    baseline's run ends at the death, every request after it failed; both in summary.json's ``failover``."""
    rc, _out, err = sim_cli(_RUN + ["--expert-failure", "40:0", "--spare-expert-ranks", "1", "--out", str(tmp_path)],
                            capsys)
    assert rc == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    a, s = summary["async"]["failover"], summary["sync"]["failover"]
    (death,) = a["deaths"]
    assert death["expert_rank"] == 0 and death["time_s"] == pytest.approx(40.0)
    assert death["time_to_replace_s"] == pytest.approx(a["detect_s"] + a["load_s"])
    assert a["requests_failed"] == 0 and not a["group_failed"] and summary["async"]["num_failed"] == 0
    assert s["group_failed"] and s["requests_failed"] == summary["sync"]["num_failed"] > 0
    assert "died at 40.00 s; spare ready after" in err and "the group failed at 40.00 s" in err
    assert summary["runs"][0]["failover"]["deaths"][0]["expert_rank"] == 0


def test_sim_run_without_a_spare_fails_the_group(tmp_path, capsys):
    rc, _out, err = sim_cli(_RUN + ["--modes", "async", "--expert-failure", "40:3", "--out", str(tmp_path)], capsys)
    assert rc == 0, err
    fo = json.loads((tmp_path / "summary.json").read_text())["async"]["failover"]
    assert fo["group_failed"] and fo["requests_failed"] > 0 and fo["spares_used"] == 0


@pytest.mark.parametrize("flags, named", [
    (["--expert-failure", "40"], "--expert-failure '40'"),
    (["--expert-failure", "x:0"], "--expert-failure 'x:0'"),
    (["--expert-failure=-1:0"], "--expert-failure '-1:0'"),
    (["--expert-failure", "40:16", "--modes", "async"], "expert_rank=16"),
    (["--expert-failure", "40:0", "--sweep"], "not with --sweep"),
    (["--spare-expert-ranks", "-1"], "--spare-expert-ranks -1"),
])
def test_sim_run_bad_failure_flags_exit_2(flags, named, tmp_path, capsys):
    rc, _out, err = sim_cli(_RUN + flags + ["--out", str(tmp_path)], capsys)
    assert rc == 2 and named in err, err
    assert not (tmp_path / "summary.json").exists()
