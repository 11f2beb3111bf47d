"""The best-vs-best comparison of the simulator: tensor-parallel attention groups and context parallelism
(costs against hand-computed values, simulated critical paths), the combine all_to_all's row bytes, the
best-configuration search, and the command-line flags."""
import copy
import json
import math

import pytest

from asap_comm.serving.runtime import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.core.sweep import Deployment, search_best, spread_buckets
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies.grids import async_grid, sync_grid

from sim_fakes import CFG, LINK, SHAPES, ToyCost, sim_cli
from test_sim_costs import ROUND, close


@pytest.fixture
def tiny():
    # tiny preset: H=64, q_lora 32, kv_lora 32, heads 4, nope 16, rope 8, v 16; the ROUND profile (4 ranks a node)
    return CostModel(Profile(copy.deepcopy(ROUND)), ModelShapes.preset("tiny"))


# ----------------------------------------------------------------------------------------- costs
def test_tp_attention_hand_computed(tiny):
    # params: q_a 64*32 = 2048 and kv_a 64*40 = 2560 replicated (4608); q_b 32*4*24 = 3072, kv_b 4096, o 4096 split
    # chunk T=10 after C=20 (S=30), tp=2:
    # gemm = 2*10*(4608 + 7168/2) + 2*30*4096/2 = 163840 + 122880 = 286720
    # core = 2*255*4*40/2 = 40800; bytes = 30*40*2 + 4*10*64*2 + 4608 + 11264/2 = 17760 (< compute)
    expected = 286720 / 1e12 + 40800 / 5e11
    assert close(tiny.attention_s([(10, 20)], tp=2), 1e-6 + expected)
    assert close(tiny.attention_s([(10, 20)], tp=1), tiny.attention_s([(10, 20)]))
    # with a TP efficiency of 0.9 per doubling: the roofline term divided by 0.9 at tp=2, by 0.81 at tp=4
    data = copy.deepcopy(ROUND)
    data["parallel"] = {"tp_eff_per_doubling": 0.9, "source": "test"}
    cm = CostModel(Profile(data), ModelShapes.preset("tiny"))
    assert close(cm.attention_s([(10, 20)], tp=2), 1e-6 + expected / 0.9)
    assert close(cm.tp_eff(4), 0.81) and cm.tp_eff(1) == 1.0 and tiny.tp_eff(4) == 1.0
    assert cm.describe()["parallel"]["tp_eff_per_doubling"] == 0.9
    with pytest.raises(ValueError, match="tp=3 must divide the 4 attention heads"):
        tiny.attention_s([(10, 20)], tp=3)
    data["parallel"] = {"tp_eff_per_doubling": 1.5}
    with pytest.raises(ValueError, match="parallel.tp_eff_per_doubling"):
        Profile(data)


def test_cp_attention_share_hand_computed(tiny):
    # chunk T=10 after C=20 shared by g=2 groups: 5 queries; 255/2 pairs; kv_b expands all 30 latents
    # gemm = 2*5*(4608 + 7168) + 2*30*4096 = 117760 + 245760 = 363520; core = 2*127.5*4*40 = 40800
    # bytes = 30*80 + 4*5*128 + 15872 = 20832 (< compute)
    assert close(tiny.attention_s([(10, 20, 2)]), 1e-6 + 363520 / 1e12 + 40800 / 5e11)
    assert close(tiny.attention_s([(10, 20, 1)]), tiny.attention_s([(10, 20)]))
    with pytest.raises(ValueError, match="chunk 0 cp=0 must be >= 1"):
        tiny.attention_s([(10, 20, 0)])
    with pytest.raises(ValueError, match="triple"):
        tiny.attention_s([(10, 20, 2, 1)])


def test_tp_all_reduce_and_cp_exchange_hand_computed(tiny):
    # 10 tokens x 64 x 2 bytes = 1280 bytes; reduce-scatter + all-gather: 2 latencies + 2*(t-1)/t of the bytes
    assert close(tiny.tp_all_reduce_s(10, 2), 2 * (5e-6 + 1e-6) + 1280 / 1e10)
    assert close(tiny.tp_all_reduce_s(10, 4), 2 * (5e-6 + 3e-6) + 1.5 * 1280 / 1e10)
    assert tiny.tp_all_reduce_s(10, 1) == 0.0 and tiny.tp_all_reduce_s(0, 2) == 0.0
    # CP over 2 groups of 1 device: half of S=30 tokens' latents (40 values x 2 bytes), on-node
    assert close(tiny.cp_exchange_s(10, 20, 2), 1e-5 + 1e-6 + 0.5 * 30 * 80 / 1e10)
    # 4 groups of 2 devices: 8 devices > 4 per node, so the inter-node link (1e9)
    assert close(tiny.cp_exchange_s(10, 20, 4, 2), 1e-5 + 3e-6 + 0.75 * 30 * 80 / 1e9)
    assert tiny.cp_exchange_s(10, 20, 1) == 0.0 and tiny.cp_exchange_s(0, 20, 2) == 0.0


# ----------------------------------------------------------------------------------------- simulated paths
def toy():
    """The shared fake cost model, its combine rows at 2e-9 s (twice a dispatch row) to tell the two apart."""
    return ToyCost(combine_row_s=2e-9)


def test_sync_tp_group_single_request_hand_computed():
    # 1 DP group of 2 devices: EP over 2 devices (2 experts each); each device holds 5 of the 10 tokens after the
    # reduce-scatter; it sends round(5 * 5/6) = 4 rows to its one peer (it misses a device with chance 1/6)
    cost = toy()
    res = simulate("sync", [Request(0, 0.0, 10)], cost, SHAPES, CFG, sync_ranks=1, par=Parallelism(sync_tp=2))
    attn = (1e-6 * 10 + 1e-9 * 55) / 2 + (6e-6 + 1e-8)  # one device's share + the group's RS + AG
    experts = 5e-6 + 2 * (1e-5 + 2e-6 * 5)  # 20 pairs over 4 experts: 10 on each device, 5 per expert
    # counts, dispatch (4 rows at 1e-9), combine (4 rows at 2e-9: combine row bytes) among 2 devices
    a2a = 3 * 2 * LINK * 2 + 4e-9 + 8e-9
    assert (4, 2, False) in cost.calls and (4, 2, True) in cost.calls
    step = (2 * LINK  # all_reduce "anyone working?" among the 2 devices
            + (1e-7 + attn + 5e-6 + attn + 5e-7) + a2a + experts  # embed, dense layer 0, layer 1's attention+router
            + (2.5e-6 + attn + 5e-7) + a2a + experts  # shared experts of layer 1 (5 tokens), layer 2
            + 2.5e-6 + 1e-5)  # shared experts of layer 2, head
    heartbeat = 0.0 + 2 * LINK  # one group: no other group's heartbeat to wait for
    assert res.records[0].ttft_s == pytest.approx(5e-6 + heartbeat + step + 5e-6, rel=1e-9)
    assert res.ranks[0]["stands_for"] == 2 and "TP 2" in res.ranks[0]["rank"]


def test_async_tp_group_single_request_hand_computed():
    # one attention group of 2 devices, one expert rank (all 4 experts): each device sends its 5 rows over its own
    # link, the expert rank receives all 10 (1e-8 s), so the transfer takes LINK + 1e-8; combine: 10 rows at 2e-9
    res = simulate("async", [Request(0, 0.0, 10)], toy(), SHAPES, CFG, par=Parallelism(attention_tp=2))
    a = (1e-6 * 10 + 1e-9 * 55) / 2 + (6e-6 + 1e-8)
    experts = 5e-6 + 4 * (1e-5 + 2e-6 * 5)
    cycle = (LINK + 1e-8) + experts + (LINK + 2e-8)  # shared experts (2.5e-6) overlap it
    expected = (5e-6 + 1e-7 + (a + 5e-6) + a + 5e-7 + cycle + a + 5e-7 + cycle + 1e-5 + 5e-6)
    assert res.records[0].ttft_s == pytest.approx(expected, rel=1e-9)
    assert res.ranks[0]["stands_for"] == 2 and res.ranks[-1]["stands_for"] == 1


def test_context_parallel_request_hand_computed():
    # 2 DP groups of 1 device; a 10-token prompt above the threshold 6 runs on both (ceil(10/6) = 2 groups):
    # 5 queries each against all 10 keys, plus the KV exchange; each device sends round(5 * 5/6) = 4 rows
    res = simulate("sync", [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2,
                   par=Parallelism(cp_threshold=6))
    attn = (1e-6 * 10 + 1e-9 * 55) / 2 + 7e-6
    experts = 5e-6 + 2 * (1e-5 + 2e-6 * 5)
    a2a = 3 * 2 * LINK * 2 + 4e-9 + 8e-9  # busiest device: 4 rows to its 1 peer
    step = (2 * LINK + (5e-8 + attn + 5e-6 + attn + 5e-7) + a2a + experts
            + (2.5e-6 + attn + 5e-7) + a2a + experts + 2.5e-6 + 1e-5)  # the head on one group only
    heartbeat = 0.5 * 1e-3 + 2 * LINK
    assert res.records[0].ttft_s == pytest.approx(5e-6 + heartbeat + step + 5e-6, rel=1e-9)
    # below the threshold: plain DP on one group (slower here: 10 queries on one device)
    plain = simulate("sync", [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2,
                     par=Parallelism(cp_threshold=10))
    assert plain.records[0].ttft_s > res.records[0].ttft_s


def test_context_parallel_requests_all_complete_and_long_prompts_gain():
    # a mixed load on 4 groups: every request completes (CP chunks are scheduled first, no deadlock), and the
    # long prompts' TTFT falls with CP at a light load
    reqs = [Request(i, 0.002 * i, 60 if i % 3 == 0 else 8) for i in range(30)]
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=64, chunk_len=16, max_prompt_len=64,
                        expert_batching=False)
    on = simulate("sync", reqs, toy(), SHAPES, cfg, sync_ranks=4, par=Parallelism(cp_threshold=16))
    off = simulate("sync", reqs, toy(), SHAPES, cfg, sync_ranks=4)
    assert all(r.ok for r in on.records) and all(r.ok for r in off.records)
    t_on = sum(r.ttft_s for r in on.records if r.prompt_len == 60)
    t_off = sum(r.ttft_s for r in off.records if r.prompt_len == 60)
    assert t_on < t_off


def test_context_parallel_owners_propose_one_chunk_per_step(monkeypatch):
    """As run_sync's workers (sync_worker._cp_propose): in a step each owner (a CP request's first group) proposes
    the next chunk of its oldest CP request only. The simulator used to let every CP request join a step, so
    several requests of one owner filled groups that the runtime leaves to short prompts (seen in the emulated
    validation: the simulated baseline kept short prompts waiting behind long ones)."""
    from asap_comm.sim.core import sync_mode

    steps = []
    batches = sync_mode._SyncSim._batches

    def record(self):
        out = batches(self)
        if out[1] is not None:
            steps.append([(req.request_id, req.groups[0]) for sh in out[1] for req, _c, _n, i in sh if i == 0])
        return out

    monkeypatch.setattr(sync_mode._SyncSim, "_batches", record)
    # long prompts on 3 or 4 of 4 groups arriving together: the least-loaded rule gives some owners two of them
    lens = [165, 229, 136, 256, 203, 256]
    reqs = [Request(i, 1e-4 * i, n) for i, n in enumerate(lens)] + [Request(6 + i, 0.003 + 1e-4 * i, 8)
                                                                     for i in range(4)]
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=128, chunk_len=128,
                        max_prompt_len=256, expert_batching=False)
    res = simulate("sync", reqs, toy(), SHAPES, cfg, sync_ranks=4, par=Parallelism(cp_threshold=64))
    assert all(r.ok for r in res.records)
    assert steps
    for step in steps:
        per_owner = [o for _rid, o in step]
        assert len(per_owner) == len(set(per_owner)), f"an owner proposed twice in one step: {step}"
    # some owner held two CP requests at once (what the old rule would have run together)
    held: dict = {}
    for rid, o in (x for step in steps for x in step):
        held.setdefault(o, set()).add(rid)
    assert any(len(v) > 1 for v in held.values())


def test_tp_needs_dedicated_devices_and_defaults_are_unchanged():
    local = CostModel.load("local", "tiny")
    with pytest.raises(ValueError, match="dedicated devices"):
        simulate("async", [Request(0, 0.0, 10)], local, ModelShapes.preset("tiny"), CFG,
                 par=Parallelism(attention_tp=2))
    with pytest.raises(ValueError, match="sync_tp"):
        Parallelism(sync_tp=0)
    with pytest.raises(ValueError, match="cp_threshold"):
        Parallelism(cp_threshold=0)
    # tp=1, no CP: the same as no Parallelism at all
    for mode in ("async", "sync"):
        a = simulate(mode, [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2).records[0].ttft_s
        b = simulate(mode, [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2,
                     par=Parallelism(cp_threshold=None)).records[0].ttft_s
        assert a == b


def test_baseline_combine_all_to_all_uses_combine_row_bytes():
    cm = CostModel.load("h800-node", "deepseek-v3")
    assert cm.combine_row_bytes != cm.dispatch_row_bytes
    seen = []

    class Spy(CostModel):
        def all_to_all_s(self, rows, ranks, *, combine=False):
            seen.append(combine)
            return super().all_to_all_s(rows, ranks, combine=combine)

    spy = Spy(cm.profile, cm.shapes)
    simulate("sync", [Request(0, 0.0, 50)], spy, cm.shapes, CFG, sync_ranks=16)
    assert True in seen and False in seen


def test_sync_overlap_hides_the_all_to_alls():
    base = simulate("sync", [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2).records[0].ttft_s
    over = simulate("sync", [Request(0, 0.0, 10)], toy(), SHAPES, CFG, sync_ranks=2,
                    par=Parallelism(sync_overlap=True)).records[0].ttft_s
    a = 1e-6 * 10 + 1e-9 * 55
    a2a = 3 * 2 * LINK * 2 + 8e-9 + 16e-9  # 8 rows to the one peer
    experts = 5e-6 + 2 * (1e-5 + 2e-6 * 5)
    # layer 1: compute (1e-7 + a + 1e-5 + a + 1e-6 + experts) vs a2a; layer 2: (5e-6 + a + 1e-6 + experts) vs a2a
    c1, c2 = 1e-7 + a + 1e-5 + a + 1e-6 + experts, 5e-6 + a + 1e-6 + experts
    saved = (c1 + a2a - max(c1, a2a)) + (c2 + a2a - max(c2, a2a))
    assert base - over == pytest.approx(saved, rel=1e-9)


# ----------------------------------------------------------------------------------------- search
def _fake(values):
    """A sweep whose SLO-compliant throughput is values[label] (None: fails even unloaded)."""
    calls = []

    def sweep(d, trace, cost, shapes, slo, *, start_rate, bisections, target, progress):
        calls.append((d.label, len(trace), bisections))
        v = values[d.label]
        return {"slo_compliant_throughput": v(len(trace)) if callable(v) else v, "points": []}
    return sweep, calls


def test_search_best_picks_the_best_by_construction():
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1)
    cands = [Deployment("sync", cfg, Parallelism(sync_tp=t), sync_ranks=8 // t) for t in (1, 2, 4, 8)]
    labels = [d.label for d in cands]
    # coarse: TP4 best, TP2 second; on the confirmation trace TP2 overtakes it
    sweep, calls = _fake({labels[0]: None, labels[1]: lambda n: 90.0 if n == 3 else 200.0,
                          labels[2]: lambda n: 100.0 if n == 3 else 150.0, labels[3]: 50.0})
    r = search_best(cands, [0] * 3, None, None, 1.0, start_rate=1.0, confirm_trace=[0] * 9, confirm_top=2,
                    sweep=sweep)
    assert r["best"] is cands[1] and r["best_sweep"]["slo_compliant_throughput"] == 200.0
    assert r["ranking"] == [2, 1, 3, 0]  # coarse order; the one that never passes last
    confirmed = [c for c in calls if c[1] == 9]
    assert sorted(c[0] for c in confirmed) == sorted(labels[1:3]) and all(c[2] == 4 for c in confirmed)
    assert r["candidates"][0]["confirmed"] is None and r["candidates"][3]["confirmed"] is None
    # ties go to the earlier candidate; without a confirmation trace the coarse sweep is the result
    sweep, calls = _fake({lb: 10.0 for lb in labels})
    r = search_best(cands, [0] * 3, None, None, 1.0, start_rate=1.0, confirm_bisections=2, sweep=sweep)
    assert r["best"] is cands[0] and len(calls) == 4
    with pytest.raises(ValueError, match="no candidates"):
        search_best([], [0], None, None, 1.0, start_rate=1.0)


def _fake_run_point(knee_rate: float, served_above: float):
    """A stand-in for sweep.run_point: every load meets the SLO (attainment 1), but above ``knee_rate`` only
    ``served_above`` of the offered tokens/s is served (the longest requests queue without bound)."""
    def run_point(mode, trace, rate, cost, shapes, cfg, slo, *, sync_ranks=None, spans=False, par=None):
        served = 1.0 if rate <= knee_rate else served_above
        s = {"rate_req_s": rate, "offered_tokens_per_s": rate * 100.0, "throughput_tokens_per_s": rate * 100.0 * served,
             "slo_attainment": 1.0, "ttft_p50_s": 0.1, "ttft_p90_s": 0.2, "ttft_p99_s": 0.3, "sim_wall_s": 0.0}
        s["served_fraction"] = served
        return s, None
    return run_point


def test_the_load_search_finds_the_highest_sustained_compliant_load(monkeypatch):
    """find_slo_throughput bisects on the combined criterion: attainment 1 at every load, served 50% of offered
    above 3 req/s: the SLO-compliant throughput is the highest tested load <= 300 tok/s (before: the attainment
    alone, every doubling passed and the result was the highest load tried, unsaturated)."""
    from asap_comm.sim.core import sweep

    monkeypatch.setattr(sweep, "run_point", _fake_run_point(3.0, 0.5))
    r = sweep.find_slo_throughput("sync", [Request(i, float(i), 100) for i in range(20)], None, None, CFG, 1.0,
                                  start_rate=1.0, bisections=4)
    assert r["saturated"] and 2.0 * 100 <= r["slo_compliant_throughput"] <= 300.0
    assert r["served_fraction"] == 1.0 and r["withheld"] is None
    failed = [p for p in r["points"] if p["served_fraction"] < 0.9]
    assert failed and min(p["rate_req_s"] for p in failed) < 4.0  # bisected between 2 and 4 req/s
    # a mode that never sustains: None, the reason, and search_best carries both
    monkeypatch.setattr(sweep, "run_point", _fake_run_point(0.0, 0.09))
    r = sweep.find_slo_throughput("sync", [Request(i, float(i), 100) for i in range(20)], None, None, CFG, 1.0,
                                  start_rate=1.0, bisections=2)
    assert r["slo_compliant_throughput"] is None and r["served_fraction"] is None
    assert r["withheld"] == "sustains no tested load (served 9% of offered at the lowest)"
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1)
    d = Deployment("sync", cfg, Parallelism(), sync_ranks=2)
    best = search_best([d], [Request(i, float(i), 100) for i in range(20)], None, None, 1.0, start_rate=1.0)
    assert best["slo_compliant_throughput"] is None and best["served_fraction"] is None
    assert "sustains no tested load" in best["withheld"]
    monkeypatch.setattr(sweep, "run_point", _fake_run_point(3.0, 0.5))
    best = search_best([d], [Request(i, float(i), 100) for i in range(20)], None, None, 1.0, start_rate=1.0)
    assert best["slo_compliant_throughput"] == best["best_sweep"]["slo_compliant_throughput"] <= 300.0
    assert best["served_fraction"] == 1.0 and best["withheld"] is None


def test_search_best_breaks_coarse_ties_by_the_next_load_then_the_targets_percentile():
    """Equal coarse throughputs (the coarse grid of loads ties often): the candidate that came closest to passing
    the next load tested goes first, then the lower TTFT at the target's percentile (p99 for a p99 SLO)."""
    from asap_comm.sim.core.sweep import tail_key

    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=1)
    cands = [Deployment("sync", cfg, Parallelism(sync_tp=t), sync_ranks=8 // t) for t in (1, 2, 4, 8)]

    def pts(next_att, p90, p99):  # passes 100 tok/s, fails 200 with ``next_att`` (None: no higher load tested)
        out = [{"offered_tokens_per_s": 100.0, "slo_attainment": 1.0, "ttft_p90_s": p90, "ttft_p99_s": p99}]
        if next_att is not None:
            out.append({"offered_tokens_per_s": 200.0, "slo_attainment": next_att, "ttft_p90_s": 9.0,
                        "ttft_p99_s": 9.0})
        return out
    sweeps = {cands[0].label: pts(0.50, 1.0, 5.0), cands[1].label: pts(0.97, 2.0, 4.0),
              cands[2].label: pts(0.97, 3.0, 3.0), cands[3].label: pts(None, 4.0, 6.0)}

    def sweep(d, trace, cost, shapes, slo, *, start_rate, bisections, target, progress):
        return {"slo_compliant_throughput": 100.0, "points": sweeps[d.label]}
    r = search_best(cands, [0], None, None, 1.0, start_rate=1.0, target=0.99, confirm_bisections=2, sweep=sweep)
    # TP8 never failed (attainment 1 above), then TP4 and TP2 (0.97: TP4's lower p99 first), TP1 last
    assert r["ranking"] == [3, 2, 1, 0] and r["best"] is cands[3]
    r = search_best(cands, [0], None, None, 1.0, start_rate=1.0, target=0.9, confirm_bisections=2, sweep=sweep)
    assert r["ranking"] == [3, 1, 2, 0]  # a p90 SLO: TP2's lower p90 first
    assert (tail_key(0.99), tail_key(0.9), tail_key(0.5)) == ("ttft_p99_s", "ttft_p90_s", "ttft_p50_s")


def test_search_best_on_a_tiny_grid_of_real_simulations():
    # the same groups, more of them: 4 DP groups serve more load than 1 under the same SLO, by construction
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=64, chunk_len=64, max_prompt_len=64)
    cands = [Deployment("sync", cfg, Parallelism(), sync_ranks=w) for w in (1, 4)]
    cands += [Deployment("async", RuntimeConfig(num_attention_ranks=a, num_expert_ranks=1, token_budget=64,
                                                chunk_len=64, max_prompt_len=64)) for a in (1, 3)]
    trace = [Request(i, 0.01 * i, 20 + 7 * (i % 5)) for i in range(60)]
    for group in (cands[:2], cands[2:]):
        r = search_best(group, trace, toy(), SHAPES, 0.01, start_rate=100.0, bisections=2, confirm_bisections=2)
        small, big = (r["candidates"][i]["coarse"]["slo_compliant_throughput"] for i in (0, 1))
        assert big is not None and (small is None or big > small), (small, big)
        assert r["best"] is group[1] and r["ranking"] == [1, 0]


def test_grids_keep_the_device_count_and_spread_buckets():
    for d in sync_grid(64, [1, 2, 4, 8], [None, 16384], [8192, 16384], 128, [False, True]):
        assert d.devices == 64
    grid = async_grid(64, [16, 32], [1, 2, 4, 8], [16384], 128)
    assert len(grid) == 8 and all(d.devices == 64 for d in grid)
    assert {(d.cfg.num_attention_ranks, d.par.attention_tp) for d in grid if d.cfg.num_expert_ranks == 16} == \
        {(48, 1), (24, 2), (12, 4), (6, 8)}
    assert async_grid(64, [16], [3], [16384], 128) == []  # 48 / 3 = 16 groups, but 3 does not divide 128 heads
    trace = [Request(0, 0.0, 5), Request(1, 0.0, 6), Request(2, 0.0, 7), Request(3, 3.0, 8), Request(4, 6.0, 9),
             Request(5, 6.0, 1)]
    spread, g = spread_buckets(trace)
    assert g == 3.0 and [r.arrival_s for r in spread] == [0.0, 1.0, 2.0, 3.0, 6.0, 7.5]
    assert [r.prompt_len for r in spread] == [5, 6, 7, 8, 9, 1]


# ----------------------------------------------------------------------------------------- command line
@pytest.mark.slow
def test_cli_flags_parse(tmp_path, capsys):
    rc, _, err = sim_cli(["run", "--out", str(tmp_path), "--profile", "h800-node", "--model", "tiny",
                       "--attention-ranks", "2", "--attention-tp", "2", "--expert-ranks", "2", "--sync-tp", "2",
                       "--cp-threshold", "300", "--sync-overlap", "--slo", "0.5", "--slo-percentile", "80",
                       "--num-requests", "30", "--rates", "20"], capsys)
    assert rc == 0, err
    c = json.loads((tmp_path / "summary.json").read_text())["config"]
    assert c["parallelism"] == {"attention_tp": 2, "sync_tp": 2, "cp_threshold": 300, "sync_overlap": True}
    assert c["sync_ranks"] == 3 and c["devices"] == {"async": 6, "sync": 6}  # (2 x 2 + 2) / 2 groups
    assert c["slo_s"] == 0.5 and c["slo_percentile"] == 80
    for bad, msg in ((["--slo-percentile", "0"], "--slo-percentile"), (["--slo", "-1"], "--slo"),
                     (["--sync-tp", "3"], "--sync-tp 3 does not divide"),
                     (["--profile", "local", "--attention-tp", "2"], "dedicated devices")):
        rc, _, err = sim_cli(["run", "--out", str(tmp_path), "--model", "tiny", *bad], capsys)
        assert rc == 2 and msg in err, (bad, err)
    rc, out, _ = sim_cli(["headline", "--help"], capsys)
    assert rc == 0
    for flag in ("--attention-tp", "--sync-tp", "--cp-threshold", "--slo ", "--slo-percentile", "--expert-ranks",
                 "--chunk-len", "--sync-overlap", "--slo-factors", "--devices"):
        assert flag in out, flag
    for bad, msg in ((["--sync-tp", "0"], "--sync-tp"), (["--cp-threshold", "x"], "--cp-threshold"),
                     (["--slo-percentile", "101"], "--slo-percentile"), (["--sync-overlap", "maybe"], "--sync-overlap"),
                     (["--slo", "soon"], "--slo")):
        rc, _, err = sim_cli(["headline", "--out", str(tmp_path), *bad], capsys)
        assert rc == 2 and msg in err, (bad, err)
