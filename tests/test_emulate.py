"""Emulated accelerators (asap_comm.sim.emulate): holds, overruns, the layer/token/expert mapping, collectives,
and real runs of both modes whose outputs equal the reference forward."""
import multiprocessing as mp
import os
import struct
import time

import pytest
import torch

from asap_comm.sim.costs import CostModel
from asap_comm.sim.emulate import (EmulatedFactory, EmulatedModel, _Stats, collective_summary, overrun_summary,
                                   read_stats)
from asap_comm.sim.shapes import ModelShapes

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
    assert (s["calls"], s["overruns"], s["overrun_fraction"]) == (4, 4, 1.0)
    assert s["overrun_s"] > 4 * 0.04
    f = read_stats(tmp_path / "fast")[0]
    assert (f["calls"], f["overruns"]) == (4, 0)
    summary = overrun_summary(read_stats(tmp_path / "slow") + read_stats(tmp_path / "fast"))
    assert summary["overrun_fraction"] == 0.5 and summary["max_rank_overrun_fraction"] == 1.0


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
    from asap_comm.sim.simulate import rows_per_rank_fraction
    ratio = rows_per_rank_fraction(256, 8, 32) / rows_per_rank_fraction(8, 2, 1)
    assert m.emulated_rows(100) == round(100 * 16 * ratio)


def test_collective_hold_and_transport_summary(tmp_path):
    from asap_comm.sim.emulate import _CollectiveLog

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
    os._exit(0)  # as a spawned worker ends: no atexit, no flush


def test_counters_survive_a_worker_exit_without_cleanup(tmp_path):
    p = mp.get_context("spawn").Process(target=_write_and_die, args=(tmp_path / "expert-42-1.stat",))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    (s,) = read_stats(tmp_path)
    assert (s["role"], s["pid"], s["calls"], s["overruns"]) == ("expert", 42, 2, 1)
    assert s["modelled_s"] == 2.0 and s["real_s"] == 2.5


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
        for r in reqs:
            token, hidden = res.outputs[r.request_id]
            o = ref[r.request_id]
            assert token == int(o.logits[-1].argmax())
            assert torch.allclose(hidden, o.final_hidden[-1], rtol=1e-4, atol=1e-5)
        per_rank = read_stats(stats)
        roles = {s["role"] for s in per_rank}
        assert sum(s["calls"] for s in per_rank) > 0
        if mode == "async":
            assert roles == {"attention", "expert"} and len(per_rank) == 4
        else:
            assert roles == {"attention+expert"} and len(per_rank) == 4
            assert collective_summary(stats)["collectives"] > 0  # the baseline's collectives were held


# ------------------------------------------------------------------------- validate on a foreign host
def test_validate_detects_a_profile_fitted_on_another_host(tmp_path):
    import json

    from asap_comm.sim.calibrate import foreign_profile_reason, host_fingerprint
    from asap_comm.sim.costs import Profile
    from asap_comm.sim.validate import validate

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
