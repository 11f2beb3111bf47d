"""Emulated accelerators (asap_comm.sim.emulate.emulator): holds, overruns, the layer/token/expert mapping, collectives,
and real runs of both modes whose outputs equal the reference forward."""
import multiprocessing as mp
import os
import struct
import time

import pytest
import torch

from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.emulate.emulator import EmulatedFactory, EmulatedModel
from asap_comm.sim.emulate.stats import _Stats, collective_summary, overrun_summary, read_stats

PROFILE, EMU = "ascend-910c-cm384", "deepseek-v3"


class _Cache:
    def __init__(self, n):
        self.n = n

    def length(self, layer):
        return self.n


class _FakeStages:
    """A stage model whose calls take a chosen real time (busy compute, to be an overrun when long)."""

    def __init__(self, busy_s=0.0):
        self.busy_s = busy_s
        self.calls = []

    def _work(self, name, out):
        end = time.monotonic() + self.busy_s
        while time.monotonic() < end:
            pass
        self.calls.append(name)
        return out

    def attention_stage(self, layer, hidden, cache=None):
        return self._work("attention", hidden + 1)

    def expert(self, layer, expert, x, weights=None):
        return self._work("expert", x * 2)

    def route(self, layer, x):
        return self._work("route", x)

    def shared_experts(self, layer, x):
        return self._work("shared", x)

    def dense_mlp(self, layer, x):
        return self._work("dense", x)

    def new_cache(self):
        return "cache"


def _emu_model(inner, tmp_path, time_scale=1.0, token_scale=64, local=1):
    real = ModelShapes.load("tiny")
    cost = CostModel.load(PROFILE, EMU)
    tmp_path.mkdir(parents=True, exist_ok=True)
    return EmulatedModel(inner, cost, real, "attention", local, time_scale, token_scale, 8,
                         _Stats(tmp_path / "attention-1-1.stat")), cost, real


def test_stage_is_held_for_its_modelled_time_and_computes_the_real_result(tmp_path):
    m, cost, real = _emu_model(_FakeStages(), tmp_path, time_scale=0.5, token_scale=64)
    h = torch.zeros(10, 4)
    layer = 1  # an MoE layer of tiny (first_k_dense_replace = 1)
    assert real.moe_layers[layer]
    t0 = time.monotonic()
    out = m.attention_stage(layer, h, _Cache(20))
    took = time.monotonic() - t0
    assert torch.equal(out, h + 1)  # the real result
    # hand-computed: each real MoE layer stands for 58 / 2 emulated MoE layers; tokens x 64; dilation 0.5
    weight = cost.shapes.num_moe_layers / real.num_moe_layers
    assert weight == 29.0
    modelled = 0.5 * weight * cost.attention_s([(10 * 64, 20 * 64)])
    stats = read_stats(tmp_path)[0]
    assert stats["calls"] == 1 and stats["overruns"] == 0
    assert stats["modelled_s"] == pytest.approx(modelled, rel=1e-12)
    assert took >= modelled  # the hold sleeps at least the modelled time, however loaded the host
    assert took < modelled + 5.0  # hang guard only


def test_the_hold_sleeps_and_does_not_spin(tmp_path):
    m, cost, _ = _emu_model(_FakeStages(), tmp_path, time_scale=1.0, token_scale=64)
    cpu0, t0 = time.process_time(), time.monotonic()
    for _ in range(3):
        m.attention_stage(1, torch.zeros(8, 4), _Cache(0))
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    assert wall >= 3 * cost.attention_s([(512, 0)]) * 29
    assert cpu < 0.5 * wall  # a waiting device costs no CPU


def test_overruns_are_counted(tmp_path):
    slow, _, _ = _emu_model(_FakeStages(busy_s=0.05), tmp_path / "slow", time_scale=1e-6)
    fast, _, _ = _emu_model(_FakeStages(busy_s=0.0), tmp_path / "fast", time_scale=1.0)
    for _ in range(4):
        slow.route(1, torch.zeros(3, 4))
        fast.attention_stage(1, torch.zeros(3, 4), _Cache(0))
    s = read_stats(tmp_path / "slow")[0]
    assert (s["calls"], s["overruns"], s["overrun_calls_fraction"]) == (4, 4, 1.0)
    assert s["overrun_s"] > 4 * 0.04
    # by time: the overrun seconds over the (here almost nothing) modelled seconds
    assert s["overrun_fraction"] == pytest.approx(s["overrun_s"] / s["modelled_s"]) and s["overrun_fraction"] > 1
    f = read_stats(tmp_path / "fast")[0]
    assert (f["calls"], f["overruns"], f["overrun_fraction"]) == (4, 0, 0.0)
    summary = overrun_summary(read_stats(tmp_path / "slow") + read_stats(tmp_path / "fast"))
    assert summary["overrun_calls_fraction"] == 0.5 and summary["max_rank_overrun_fraction"] == s["overrun_fraction"]
    assert summary["overrun_fraction"] == pytest.approx(s["overrun_s"] / (s["modelled_s"] + f["modelled_s"]))
    assert 0 < summary["overrun_fraction"] < s["overrun_fraction"]  # the fast rank's long holds dilute it


def test_expert_calls_stand_for_the_emulated_experts_of_the_rank(tmp_path):
    # tiny: 8 experts, top 2; one real expert on this rank of 8 expert ranks -> 256 / 8 = 32 emulated experts
    m, cost, real = _emu_model(_FakeStages(), tmp_path, time_scale=1e-3, token_scale=16, local=1)
    rows = 10
    pairs = rows * 16 * cost.shapes.top_k / real.top_k  # 640 (token, expert) pairs
    per = round(pairs / 32)
    assert m.expert_work_s(rows) == pytest.approx(32 * cost.expert_s(per))
    x = torch.ones(rows, 4)
    assert torch.equal(m.expert(1, 0, x), 2 * x)
    # dispatched rows: token_scale x (chance a token reaches a rank: emulated / real)
    from asap_comm.sim.core.common import rows_per_rank_fraction
    ratio = rows_per_rank_fraction(256, 8, 32) / rows_per_rank_fraction(8, 2, 1)
    assert m.emulated_rows(100) == round(100 * 16 * ratio)


def test_an_uneven_split_of_the_served_experts_is_charged_evenly(tmp_path):
    """8 served experts over 6 expert ranks: ranks hold 2 or 1 of them, but the emulated deployment spreads
    DeepSeek-V3's 256 experts evenly (256 / 6 each). A rank with 2 served experts receives about twice the real
    rows of a rank with 1 for the same tokens; both must be charged the same emulated work and rows."""
    real = ModelShapes.load("tiny")
    cost = CostModel.load(PROFILE, EMU)
    tokens, S = 60, 16

    def rank(local):
        m = EmulatedModel(_FakeStages(), cost, real, "expert", local, 1e-3, S, 6, _Stats(None))
        pairs_per_expert = tokens * real.top_k / real.num_experts  # real (token, expert) pairs per served expert
        work = local * m.expert_work_s(int(pairs_per_expert))
        from asap_comm.sim.core.common import rows_per_rank_fraction
        rows = m.emulated_rows(round(tokens * rows_per_rank_fraction(8, 2, local)))
        return m, work, rows

    two, w2, r2 = rank(2)
    one, w1, r1 = rank(1)
    assert two._emu_local == one._emu_local == pytest.approx(256 / 6)
    assert w2 == pytest.approx(w1, rel=0.02)
    # the emulated pairs of either rank: tokens x S x top_k x (256/6) / 256
    per = round(tokens * S * 8 * (256 / 6) / 256 / (256 / 6))
    assert w1 == pytest.approx((256 / 6) * cost.expert_s(per), rel=0.02)
    assert r2 == pytest.approx(r1, rel=0.02)


def test_collective_hold_and_transport_summary(tmp_path):
    from asap_comm.sim.emulate.stats import _CollectiveLog

    m, cost, _ = _emu_model(_FakeStages(), tmp_path, time_scale=1.0, token_scale=64)
    m.collectives = _CollectiveLog(tmp_path / "w-1-1.coll")
    t0 = time.monotonic()
    m.hold_collective("dispatch", 50, 16, t0, layer=1)
    assert time.monotonic() - t0 >= 29 * cost.all_to_all_s(m.emulated_rows(50), 16)
    with pytest.raises(ValueError, match="kind='bogus'"):
        m.hold_collective("bogus", 1, 2, t0)
    # two workers, three collectives: the transport's time is the shortest (the last arriver's)
    for name, recs in (("a-1-1", [(1.0, 0.5), (1.0, 3.0), (2.0, 2.5)]), ("b-2-1", [(1.5, 0.9), (1.0, 1.2), (1.0, 1.9)])):
        (tmp_path / "c" / f"{name}.coll").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"{name}.coll").write_bytes(b"".join(struct.pack("<dd", *r) for r in recs))
    c = collective_summary(tmp_path / "c")
    # collective 0: min real 0.5 <= max modelled 1.5; 1: 1.2 > 1.0 (late); 2: 1.9 <= 2.0
    assert (c["collectives"], c["late"]) == (3, 1)


def _write_and_die(path):
    s = _Stats(path)
    s.add(1.0, 2.0, 2.0)
    s.add(1.0, 0.5, 1.0)
    s.route(3.0, 2.0)
    os._exit(0)  # as a spawned worker ends: no atexit, no flush


def test_counters_survive_a_worker_exit_without_cleanup(tmp_path):
    p = mp.get_context("spawn").Process(target=_write_and_die, args=(tmp_path / "expert-42-1.stat",))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    (s,) = read_stats(tmp_path)
    assert (s["role"], s["pid"], s["calls"], s["overruns"]) == ("expert", 42, 2, 1)
    assert s["modelled_s"] == 2.0 and s["real_s"] == 2.5
    assert (s["route_rows_max"], s["route_rows_mean"]) == (3.0, 2.0)


def test_factory_validates_and_pickles(tmp_path):
    import pickle

    from asap_models import StageFactory

    base = StageFactory("tiny", 0)
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        EmulatedFactory(base, "nope", EMU)
    with pytest.raises(ValueError, match="time_scale=0"):
        EmulatedFactory(base, PROFILE, EMU, time_scale=0)
    f = EmulatedFactory(base, PROFILE, EMU, time_scale=0.1, token_scale=32, num_expert_ranks=2, stats_dir=tmp_path)
    g = pickle.loads(pickle.dumps(f))
    assert g.describe_emulation() == f.describe_emulation()
    assert g.config().vocab_size == base.config().vocab_size  # the real factory's API passes through


# ------------------------------------------------------------------------- real runs of both modes
def _assert_matches_reference(res, reqs, ref) -> None:
    """Every request's first token and final hidden state equal the reference forward's."""
    for r in reqs:
        token, hidden = res.outputs[r.request_id]
        o = ref[r.request_id]
        assert token == int(o.logits[-1].argmax())
        assert torch.allclose(hidden, o.final_hidden[-1], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_emulated_runs_of_both_modes_match_the_reference(tmp_path):
    from asap_models import StageFactory

    from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async
    from asap_comm.serving.sync import run_sync

    base = StageFactory("tiny", 0)
    mcfg = base.config()
    from asap_comm.serving.runtime import ModelInfo

    info = ModelInfo(mcfg.num_hidden_layers, tuple(mcfg.is_moe_layer(i) for i in range(mcfg.num_hidden_layers)),
                     mcfg.hidden_size, mcfg.vocab_size, mcfg.n_routed_experts, mcfg.num_experts_per_tok)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(i, 0.05 * i, torch.randint(0, mcfg.vocab_size, (n,), generator=g))
            for i, n in enumerate([5, 40, 17, 64, 9, 30])]
    full = base.full()
    with torch.no_grad():
        ref = {r.request_id: full.prefill(r.token_ids) for r in reqs}
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=64, chunk_len=32, max_prompt_len=128,
                        timeout_s=300)
    for mode, runner, ranks in (("async", run_async, 2), ("sync", run_sync, 4)):
        stats = tmp_path / mode
        emu = EmulatedFactory(base, PROFILE, EMU, time_scale=0.002, token_scale=16, num_expert_ranks=ranks,
                              stats_dir=stats)
        res = runner(emu, info, reqs, cfg)
        assert all(r.ok for r in res.records), [r.error for r in res.records]
        _assert_matches_reference(res, reqs, ref)
        per_rank = read_stats(stats)
        roles = {s["role"] for s in per_rank}
        assert sum(s["calls"] for s in per_rank) > 0
        if mode == "async":
            assert roles == {"attention", "expert"} and len(per_rank) == 4
        else:
            assert roles == {"attention+expert"} and len(per_rank) == 4
            assert collective_summary(stats)["collectives"] > 0  # the baseline's collectives were held
        # the example's per-load record carries the served router's skew on this run's ranks (a replay charges it)
        from asap_comm.sim.emulate.fit import routing_skew
        from asap_comm.sim.emulate.job import emulation_stats
        skew = emulation_stats(stats)["routing_skew"]
        assert skew == routing_skew(per_rank) and skew > 1.0


# ------------------------------------------------------------------------- validate on a foreign host
def test_validate_detects_a_profile_fitted_on_another_host(tmp_path):
    import json

    from asap_comm.sim.calibrate.host import foreign_profile_reason, host_fingerprint
    from asap_comm.sim.calibrate.validate import validate
    from asap_comm.sim.costmodel.hardware import Profile

    here = host_fingerprint()
    assert set(here) == {"cpu_model", "cores", "torch"} and here["cores"] >= 1
    data = json.loads(Profile.load("local").path and open(Profile.load("local").path).read())
    data["fit"]["host_fingerprint"] = dict(here)
    assert foreign_profile_reason(data) is None  # fitted here
    data["fit"]["host_fingerprint"] = dict(here, cpu_model="Some Other CPU", cores=here["cores"] + 6)
    why = foreign_profile_reason(data)
    assert "cpu_model 'Some Other CPU' there" in why and "cores" in why
    del data["fit"]["host_fingerprint"]
    assert "records no host fingerprint" in foreign_profile_reason(data)
    assert foreign_profile_reason(Profile.load("ascend-910c-cm384").data) is None  # analytic: not tied to a host
    foreign = tmp_path / "foreign.json"
    data["fit"]["host_fingerprint"] = dict(here, cpu_model="Some Other CPU")
    foreign.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"does not describe this host .*validate --calibrate"):
        validate(tmp_path / "out", profile=str(foreign), recalibrate=False, progress=False)
    assert not (tmp_path / "out" / "validation.json").exists()  # refused before running anything


def test_a_rank_may_be_a_tensor_parallel_group(tmp_path):
    real = ModelShapes.load("tiny")
    cost = CostModel.load(PROFILE, EMU)
    tmp_path.mkdir(parents=True, exist_ok=True)
    one = EmulatedModel(_FakeStages(), cost, real, "attention", 1, 1e-3, 64, 8, _Stats(tmp_path / "a-1-1.stat"))
    grp = EmulatedModel(_FakeStages(), cost, real, "attention", 1, 1e-3, 64, 8, _Stats(tmp_path / "a-2-1.stat"),
                        attention_tp=4, expert_devices=4)
    h = torch.zeros(16, 4)
    one.attention_stage(1, h, _Cache(32))
    grp.attention_stage(1, h, _Cache(32))
    s1, s4 = (e["modelled_s"] for e in read_stats(tmp_path))  # pids 1 and 2
    chunk = (16 * 64, 32 * 64)
    assert s1 == pytest.approx(1e-3 * 29 * cost.attention_s([chunk]))
    assert s4 == pytest.approx(1e-3 * 29 * (cost.attention_s([chunk], tp=4) + cost.tp_all_reduce_s(chunk[0], 4)))
    assert s4 < s1  # four devices per group: faster attention, even with the all-reduces
    assert grp.expert_work_s(10) == pytest.approx(one.expert_work_s(10) / 4)  # experts spread over the group


def test_a_tensor_parallel_groups_mlp_stages_cost_one_devices_share_of_the_tokens(tmp_path):
    """After the attention's reduce-scatter every device of a TP group holds 1/tp of the tokens: the router, shared
    experts and dense MLP are charged on that share, with no collective of their own (the layer's reduce-scatter
    and all-gather are in the attention's hold), as the simulator charges them in both modes. (A regression: they
    were charged as a TP split of all the tokens plus another all-reduce per stage, 42x the simulator's shared-expert
    time on the afd-plugin stack, which made every emulated TP group 30% slower than simulated under load.)"""
    real = ModelShapes.load("tiny")
    cost = CostModel.load(PROFILE, EMU)
    tmp_path.mkdir(parents=True, exist_ok=True)
    grp = EmulatedModel(_FakeStages(), cost, real, "attention", 1, 1e-3, 64, 8, _Stats(tmp_path / "a-3-1.stat"),
                        attention_tp=8, expert_devices=8)
    x = torch.zeros(100, 4)  # 100 real tokens = 6400 emulated, 800 per device
    grp.route(1, x)
    grp.shared_experts(1, x)
    grp.dense_mlp(0, x)  # layer 0 is the served model's dense layer (standing for 3)
    (st,) = read_stats(tmp_path)
    expected = 1e-3 * (29 * (cost.router_s(800) + cost.shared_experts_s(800)) + 3 * cost.dense_mlp_s(800))
    assert st["modelled_s"] == pytest.approx(expected)
    assert st["modelled_s"] < 1e-3 * 29 * cost.tp_all_reduce_s(6400, 8)  # less than the old extra all-reduce alone


# ------------------------------------------------------------------------- the simulator of an emulated run
def test_a_simulated_layer_may_stand_for_several():
    """simulate(..., layers=): a layer of weight w costs what w layers cost; the served model's 3 layers standing
    for DeepSeek-V3's 61 give the same unloaded TTFT as the 61 layers, in both modes."""
    from asap_comm.serving.runtime import RuntimeConfig
    from asap_comm.serving.traces import Request
    from asap_comm.sim.core.simulate import Parallelism, simulate

    cost, shapes = CostModel.load(PROFILE, EMU), ModelShapes.load(EMU)
    # without the long-prompt lane: its wavefront advances by (weighted) layers, so 3 layers standing for 61 pipeline
    # a 2-chunk prompt more coarsely than the 61 layers (what the emulated runtime does too)
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=16384, chunk_len=16384,
                        max_prompt_len=65536, expert_deadline_s=0.0, long_prompt_lane=False)
    collapsed = [(False, 3.0), (True, 29.0), (True, 29.0)]
    for mode, par in (("sync", Parallelism(sync_tp=2)), ("async", Parallelism(attention_tp=2))):
        ttft = {}
        for n in (700, 20000):
            full = simulate(mode, [Request(0, 0.0, n)], cost, shapes, cfg, par=par, sync_ranks=4).records[0]
            coll = simulate(mode, [Request(0, 0.0, n)], cost, shapes, cfg, par=par, sync_ranks=4,
                            layers=collapsed).records[0]
            assert full.ok and coll.ok
            assert coll.ttft_s == pytest.approx(full.ttft_s, rel=1e-6), (mode, n)
            ttft[n] = full.ttft_s
        # a heavier layer costs more
        heavier = simulate(mode, [Request(0, 0.0, 700)], cost, shapes, cfg, par=par, sync_ranks=4,
                           layers=[(False, 3.0), (True, 40.0), (True, 29.0)]).records[0]
        assert heavier.ttft_s > ttft[700]
    for bad in ([], [(True, 0.0)], [(1, 2.0)], [(True,)]):
        with pytest.raises(ValueError, match="layers="):
            simulate("sync", [Request(0, 0.0, 10)], cost, shapes, cfg, layers=bad)


@pytest.mark.slow
def test_simulate_emulated_is_a_lower_bound_of_the_emulated_run_in_its_units(tmp_path):
    """Every emulated stage is held at least its modelled time, so the simulator's prediction of an unloaded
    emulated run (in wall seconds and real tokens) cannot exceed the run's TTFT (beyond rounding); and the
    prediction leaves out no work: the modelled seconds the run's workers held (counted by each worker, not
    timed) are the busy seconds the simulator charged, exactly for the attention ranks, within the small model's
    routing imbalance for the expert work. (No upper bound on the run's wall time: a loaded host only adds to it.)"""
    from asap_models import StageFactory

    from asap_comm.serving.plugins import model_info_of
    from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async
    from asap_comm.serving.sync import run_sync
    from asap_comm.serving.traces import Request
    from asap_comm.sim.emulate.emulator import simulate_emulated

    base = StageFactory("tiny", 0)
    info = model_info_of(base)
    g = torch.Generator().manual_seed(1)
    lens = [40, 100]
    # a dilation of 0.2: the first prompt's TTFT is about 0.2 s, well before the second arrives (0.8 s)
    reqs = [PromptRequest(i, 0.8 * i, torch.randint(0, info.vocab_size, (n,), generator=g))
            for i, n in enumerate(lens)]
    trace = [Request(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in reqs]
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=128, chunk_len=128,
                        max_prompt_len=512, sync_collectives="shm", timeout_s=300)
    for mode, runner, ranks, tp in (("async", run_async, 2, 2), ("sync", run_sync, 4, 2)):
        emu = EmulatedFactory(base, PROFILE, EMU, time_scale=0.2, token_scale=128, num_expert_ranks=ranks,
                              attention_tp=tp, expert_devices=1 if mode == "async" else tp)
        sim = simulate_emulated(emu, mode, trace, cfg)
        assert [r.prompt_len for r in sim.records] == lens  # real tokens
        assert [r.arrival_s for r in sim.records] == pytest.approx([0.0, 0.8])  # wall seconds
        res = runner(emu.with_stats_dir(tmp_path / mode), info, reqs, cfg)
        assert all(r.ok for r in res.records), [r.error for r in res.records]
        for real, pred in zip(res.records, sim.records):
            assert pred.ttft_s > 0
            assert real.ttft_s >= 0.95 * pred.ttft_s, (mode, real.ttft_s, pred.ttft_s)
        held = read_stats(tmp_path / mode)
        assert held and all(w["calls"] > 0 for w in held if w["modelled_s"] > 0), held
        charged = [r for r in sim.ranks if r["busy_s"] > 0]
        if mode == "async":  # attention ranks: the same work, to rounding; expert ranks: per rank, on average
            assert sorted(w["modelled_s"] for w in held if w["role"] == "attention") == pytest.approx(
                sorted(r["busy_s"] for r in sim.ranks if r["role"] == "attention"), rel=1e-6), (held, sim.ranks)
            real_ex = [w["modelled_s"] for w in held if w["role"] == "expert"]
            sim_ex = [r["busy_s"] for r in charged if r["role"] == "expert"]
            assert sum(real_ex) / len(real_ex) == pytest.approx(sum(sim_ex) / len(sim_ex), rel=0.15), (held, sim.ranks)
        else:  # each DP rank holds attention and experts: the group's total
            assert sum(w["modelled_s"] for w in held) == pytest.approx(sum(r["busy_s"] for r in charged), rel=0.15), \
                (held, sim.ranks)
    with pytest.raises(ValueError, match="num_expert_ranks=16 is more than the served model's 8 experts"):
        EmulatedFactory(base, PROFILE, EMU, num_expert_ranks=16)
    with pytest.raises(ValueError, match="expert_devices"):
        simulate_emulated(EmulatedFactory(base, PROFILE, EMU, num_expert_ranks=4, attention_tp=2), "sync", trace, cfg)


def test_crossing_rate_interpolates_on_the_grid():
    from asap_comm.sim.calibrate.emulated import crossing_rate

    assert crossing_rate([(3.0, 0.7, 1.0), (1.0, 1.0, 1.0), (2.0, 0.95, 1.0)], 0.9) == pytest.approx(2.2)
    assert crossing_rate([(1.0, 1.0, 1.0), (2.0, 0.95, 1.0)], 0.9) == 2.0  # all meet it: the highest load
    assert crossing_rate([(1.0, 0.5, 1.0), (2.0, 0.95, 1.0)], 0.9) is None  # the lowest fails
    # a load not sustained (served < 90% of offered) stops the walk at the last sustained one, no interpolation
    assert crossing_rate([(3.0, 0.7, 1.0), (1.0, 1.0, 1.0), (2.0, 0.95, 0.5)], 0.9) == 1.0
    assert crossing_rate([(1.0, 1.0, 0.8), (2.0, 0.95, 1.0)], 0.9) is None
    with pytest.raises(ValueError, match="served_fraction"):
        crossing_rate([(1.0, 1.0)], 0.9)
    with pytest.raises(ValueError, match="no points"):
        crossing_rate([], 0.9)


@pytest.mark.slow
def test_validate_in_the_emulated_regime(tmp_path):
    """The second validation regime end to end, on its quick configuration: real emulated runs of both modes
    against simulate_emulated, every metric compared, overruns kept, SLO-compliant throughputs and ratio.
    (Four requests per load and a dilation of 0.1 wall s per modelled s keep it short: what is checked here is the
    regime's pipeline and its result's contract, which depend on neither; the holds stay longer than the tiny
    model's real compute, so the overruns stay small.)"""
    import json

    from asap_comm.sim.calibrate.validate import main

    assert main(["--regime", "emulated", "--configs", "quick", "--repeats", "1", "--num-requests", "4",
                 "--time-scale", "0.1", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "validation_emulated.json").read_text())
    assert res["regime"] == "emulated" and res["profile"] == PROFILE and res["emulate_model"] == EMU
    assert res["time_scale"] == 0.1 and res["num_requests"] == 4  # the flags reached the run
    (c,) = res["configs"]
    assert [(r["rate_req_s"], r["mode"]) for r in c["runs"]] == [(2.0, "async"), (2.0, "sync"),
                                                                  (4.0, "async"), (4.0, "sync")]
    for r in c["runs"]:
        assert r["real"]["num_failed"] == 0 and r["sim"]["num_failed"] == 0
        assert 0.0 <= r["real"]["overrun_fraction"] <= 1.0 and len(r["real_runs"]) == 1
        for m in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s"):
            assert r["real"][m] > 0 and r["sim"][m] > 0
            assert r["relative_error"][m] == pytest.approx((r["sim"][m] - r["real"][m]) / r["real"][m])
    assert set(c["slo_compliant_throughput"]) == {"async", "sync"}
    assert set(c["ratio"]) == {"real", "sim", "relative_error", "withheld"}
    for side in ("real", "sim"):  # a side's ratio is withheld (null, with its reason) exactly when it is missing
        assert (c["ratio"][side] is None) == (side in c["ratio"]["withheld"])
    assert c["slo_s"] > 0 and res["compared"] >= 16 and c["cp_threshold"] == 96
    # the host overhead was fitted first, on an unloaded probe of 4 other requests, both modes
    ho = c["host_overhead"]
    assert res["host_overhead"] is True
    for key in ("async_job_s", "expert_job_s", "async_layer_s", "sync_layer_s"):
        assert 0.0 <= ho[key] <= 0.1, key
    # the served router's skew, measured in each mode's probe (the tiny model's random router is not balanced)
    assert ho["async_skew"] >= 1.0 and ho["sync_skew"] >= 1.0 and ho["measured"]["attention_jobs"] > 0
    assert ho["measured"]["expert_batches"] > 0 and ho["measured"]["async_skew"] == ho["async_skew"]
    for mode in ("async", "sync"):
        pr = ho["probe"][mode]
        assert len(pr["real_ttft_s"]) == len(pr["sim_ttft_s"]) == len(pr["lengths"]) == 4
        # the fitted overhead only lengthens the simulated TTFTs, and the recorded fit is no worse on the probe than
        # leaving the overhead out (a loaded CI host may make some real TTFTs shorter than predicted: the lane and
        # the placer see different timings, so no per-request bound holds)
        assert all(s >= n - 1e-9 for s, n in zip(pr["sim_ttft_s"], pr["sim_ttft_none_s"]))
        assert all(r > 0 for r in pr["real_ttft_s"])

        def rms(pred):
            return (sum((p - r) ** 2 for p, r in zip(pred, pr["real_ttft_s"])) / len(pred)) ** 0.5

        assert pr["rms_s"] == pytest.approx(rms(pr["sim_ttft_s"])) and pr["rms_s"] <= rms(pr["sim_ttft_none_s"]) + 1e-9
    with pytest.raises(SystemExit):
        main(["--regime", "emulated", "--configs", "nope", "--out", str(tmp_path)])


@pytest.mark.slow
def test_emulated_context_parallelism_in_the_baseline(tmp_path):
    """run_sync with cp_threshold on emulated devices: long prompts are shared by several DP groups (their workers
    hold CP shares), outputs still equal the reference forward, the shared prompt's TTFT drops, and the run is
    never faster than the simulator's CP model of it (every hold lasts at least its modelled time)."""
    from asap_models import StageFactory

    from asap_comm.serving.plugins import model_info_of
    from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async
    from asap_comm.serving.sync import run_sync
    from asap_comm.serving.traces import Request
    from asap_comm.sim.emulate.emulator import simulate_emulated

    base = StageFactory("tiny", 0)
    info = model_info_of(base)
    g = torch.Generator().manual_seed(1)
    lens = [300, 30]
    # a dilation of 0.1 (the shared prompt alone takes about 3 s without CP); the short prompt arrives 1.2 s later
    reqs = [PromptRequest(i, 1.2 * i, torch.randint(0, info.vocab_size, (n,), generator=g))
            for i, n in enumerate(lens)]
    trace = [Request(r.request_id, r.arrival_s, n) for r, n in zip(reqs, lens)]
    full = base.full()
    with torch.no_grad():
        ref = {r.request_id: full.prefill(r.token_ids) for r in reqs}
    ttft = {}
    for cp in (None, 128):
        cfg = RuntimeConfig(num_attention_ranks=3, num_expert_ranks=1, token_budget=128, chunk_len=128,
                            max_prompt_len=512, sync_collectives="shm", cp_threshold=cp, timeout_s=300)
        emu = EmulatedFactory(base, PROFILE, EMU, time_scale=0.1, token_scale=128, num_expert_ranks=4)
        sim = simulate_emulated(emu, "sync", trace, cfg)
        res = run_sync(emu, info, reqs, cfg)
        assert all(r.ok for r in res.records), [r.error for r in res.records]
        _assert_matches_reference(res, reqs, ref)
        helpers = {s[0] for s in res.spans if s[2].startswith("CP share")}
        # 300 tokens over a 128-token threshold: 3 groups, the owner and two helpers
        assert len(helpers) == (2 if cp else 0), helpers
        for real, pred in zip(res.records, sim.records):
            assert real.ttft_s >= 0.95 * pred.ttft_s, (cp, real.ttft_s, pred.ttft_s)
        ttft[cp] = res.records[0].ttft_s
    assert ttft[128] < 0.75 * ttft[None], ttft  # the simulator predicts about 0.37x for this prompt
    with pytest.raises(ValueError, match="cp_threshold=128 needs emulated devices"):
        run_sync(base, info, reqs, RuntimeConfig(num_attention_ranks=3, num_expert_ranks=1, cp_threshold=128))
    with pytest.raises(ValueError, match="run_async: cp_threshold"):
        run_async(base, info, reqs, RuntimeConfig(cp_threshold=128))
    with pytest.raises(ValueError, match="cp_threshold=0"):
        RuntimeConfig(cp_threshold=0)


# ----------------------------------------------------------------------------- the placer's weight in served tokens
def test_emulator_sets_the_weight_in_served_tokens():
    from asap_comm.sim.costmodel.shapes import ModelShapes as MS
    from asap_comm.sim.emulate.emulator import EmulatedFactory

    real = MS.load("tiny")
    f = EmulatedFactory(lambda role, experts: None, "ascend-910c-cm384", "deepseek-v3", token_scale=128,
                        real_shapes=real, num_expert_ranks=2, attention_tp=2)
    want = CostModel.load("ascend-910c-cm384", "deepseek-v3").placer_linear_weight(2) / 128
    assert f.placer_linear_weight() == pytest.approx(want)
