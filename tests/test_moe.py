"""asap_comm.moe: plans (single process), then dispatch/combine across 2+2 and 3+1 PEs.

Expert functions are exact in float32 (integer-valued tokens, weights in
multiples of 1/8), so results are compared with torch.equal against the
pure-torch reference. Expert ranks take several pending batches at once,
merge them by layer, process them in reverse order with random pauses, so
handles complete out of order and layers arrive interleaved.
"""
import os
import random
import signal
import time

import pytest
import torch

import asap_comm
from asap_comm.moe import (AttentionEnd, DispatchHandle, ExpertBatch, ExpertEnd, InflightLimitError, MoEPlan,
                           apply_experts, reference_combine, reference_dispatch)
from distributed_utils import run


def expert_fn(e: int, x: torch.Tensor) -> torch.Tensor:
    """A known, exactly computable expert: x * (e + 1) - e."""
    return x * (e + 1) - e


def make_batch(g: torch.Generator, plan: MoEPlan, T: int, only_rank: "int | None" = None):
    """Integer-valued tokens, distinct experts per token, weights in multiples of 1/8.

    only_rank: every choice lands on that expert rank's experts (all top-k on one rank).
    """
    x = torch.randint(-8, 9, (T, plan.hidden), generator=g).to(plan.dtype)
    if only_rank is None:
        pool = torch.arange(plan.num_experts)
    else:
        pool = torch.tensor(plan.local_experts(plan.num_attention_ranks + only_rank))
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:plan.top_k]] for _ in range(T)]) \
        if T else torch.empty(0, plan.top_k, dtype=torch.int64)
    w = torch.randint(1, 9, (T, plan.top_k), generator=g).float() / 8
    return x, ids, w


# --------------------------------------------------------------------------- plan (no processes)
def test_plan_placement_and_validation():
    plan = MoEPlan(num_attention_ranks=2, num_expert_ranks=3, num_experts=8, hidden=4, top_k=2)
    # 8 experts over 3 ranks: 3, 3, 2 in contiguous blocks; PEs 2, 3, 4
    assert [plan.expert_rank(e) for e in range(8)] == [2, 2, 2, 3, 3, 3, 4, 4]
    assert plan.local_experts(2) == [0, 1, 2] and plan.local_experts(4) == [6, 7] and plan.local_experts(0) == []
    assert plan.world_size == 5 and plan.combine_rows == plan.max_tokens * 2
    with pytest.raises(ValueError, match=r"expert_rank: expert=8 is out of range \[0, 8\)"):
        plan.expert_rank(8)
    with pytest.raises(ValueError, match="num_experts=2 < num_expert_ranks=3"):
        MoEPlan(num_attention_ranks=1, num_expert_ranks=3, num_experts=2, hidden=4, top_k=1)
    with pytest.raises(ValueError, match="top_k=9 > num_experts=8"):
        MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=8, hidden=4, top_k=9)
    with pytest.raises(ValueError, match="max_inflight=0 must be >= 1"):
        MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=8, hidden=4, top_k=2, max_inflight=0)
    with pytest.raises(ValueError, match="dtype must be a floating"):
        MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=8, hidden=4, top_k=2, dtype=torch.int32)


def test_reference_helpers_agree():
    plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=2, num_experts=6, hidden=5, top_k=3, max_tokens=16)
    g = torch.Generator().manual_seed(0)
    x, ids, w = make_batch(g, plan, 10)
    per_pe = reference_dispatch(plan, x, ids, w)
    # experts computed from what each rank receives reproduce the reference combine
    y = torch.zeros_like(x)
    for pe, (rows, tokens, eids, weights) in per_pe.items():
        b = ExpertBatch(0, tokens, eids, weights, [])
        y.index_add_(0, rows, apply_experts(b, expert_fn))
    assert torch.equal(y, reference_combine(x, ids, w, expert_fn))


# --------------------------------------------------------------------------- multi-process
def _expert_loop(comm, plan, seed):
    """Serve until every attention rank finishes: take what is pending, merge per layer,
    process in reverse order with random pauses; record every part received."""
    ex = ExpertEnd(comm, plan)
    rng = random.Random(seed + comm.rank)
    received = []  # (src, layer, tokens, expert_ids, weights) per part, in arrival order
    merged_batches = 0
    while True:
        batches = ex.dispatch_recv_many(max_batches=8, timeout=30)
        if not batches:
            break
        for b in batches:
            for a, _slot, _off, n, first in b.parts:
                received.append((a, b.layer, b.tokens[first:first + n].clone(), b.expert_ids[first:first + n].clone(),
                                 b.weights[first:first + n].clone()))
        work = ExpertEnd.by_layer(batches)
        merged_batches += sum(len(b.parts) > 1 for b in work)
        for b in reversed(work):
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.003)
            # half the time compute in place, into the origin's combine area (zero-copy combine)
            out = ex.output_buffer(b) if rng.random() < 0.5 else None
            ex.combine_send(b, apply_experts(b, expert_fn, out=out))
    return {"received": received, "merged": merged_batches, "experts": ex.experts,
            "node_aware": (ex.node_aware_parts, ex.node_aware_reductions)}


def _attention_scenarios(comm, plan, seed):
    att = AttentionEnd(comm, plan)
    g = torch.Generator().manual_seed(seed * 100 + comm.rank)
    rng = random.Random(seed + comm.rank)
    problems, sent = [], []  # sent: (layer, per-PE reference dispatch) in dispatch order

    def dispatch(x, ids, w, layer):
        h = att.dispatch_send(x, ids, w, layer)
        ref = reference_dispatch(plan, x, ids, w)
        if sorted(ref) != sorted(h.expert_pes):
            problems.append(f"contacted {h.expert_pes}, reference {sorted(ref)}")
        sent.append((layer, ref))
        return h, reference_combine(x, ids, w, expert_fn)

    def check(h, expect, what):
        y = att.combine_recv(h, timeout=30)
        if not torch.equal(y, expect):
            problems.append(f"{what}: max error {(y - expect).abs().max()}")

    # 1. fill every slot before any combine, then combine in random order (no deadlock, any order)
    for rnd in range(6):
        pending = [dispatch(*make_batch(g, plan, rng.randint(1, plan.max_tokens)), layer=rng.randrange(4))
                   for _ in range(plan.max_inflight)]
        try:
            att.dispatch_send(*make_batch(g, plan, 2), layer=0)
            problems.append("dispatch_send beyond max_inflight did not raise")
        except InflightLimitError:
            pass
        rng.shuffle(pending)
        for h, expect in pending:
            check(h, expect, f"round {rnd}")
    # 2. all top-k of every token on one rank; and a micro-batch that touches only one rank
    for r in range(plan.num_expert_ranks):
        h, expect = dispatch(*make_batch(g, plan, plan.max_tokens, only_rank=r), layer=1)
        if h.expert_pes != [plan.num_attention_ranks + r]:
            problems.append(f"single-rank batch contacted {h.expert_pes}")
        check(h, expect, f"all on rank {r}")
    # 3. bad input while a batch is in flight: clear errors, the in-flight batch is intact
    h, expect = dispatch(*make_batch(g, plan, min(5, plan.max_tokens)), layer=2)
    x, ids, w = make_batch(g, plan, 3)
    bad = [
        (lambda: att.dispatch_send(x[:, :-1], ids, w, 0), ValueError, "x must be"),
        (lambda: att.dispatch_send(x.double(), ids, w, 0), ValueError, "dtype"),
        (lambda: att.dispatch_send(x, ids + plan.num_experts, w, 0), ValueError, "expert ids must be in"),
        (lambda: att.dispatch_send(x, ids[:2], w, 0), ValueError, "topk_ids must be"),
        (lambda: att.dispatch_send(x, ids.float(), w, 0), ValueError, "integer"),
        (lambda: att.dispatch_send(*make_batch(g, plan, plan.max_tokens + 1), layer=0), ValueError, "max_tokens"),
        (lambda: att.dispatch_send(x, ids, w, -1), ValueError, "layer=-1"),
        (lambda: att.combine_recv(DispatchHandle(0, 0, 3, 1)), ValueError, "unknown handle"),
    ]
    for call, exc, text in bad:
        try:
            call()
            problems.append(f"no error for {text}")
        except exc as e:
            if text not in str(e):
                problems.append(f"message {e!r} lacks {text!r}")
    check(h, expect, "in flight during bad input")
    try:
        att.combine_recv(h)
        problems.append("second combine_recv of one handle did not raise")
    except ValueError:
        pass
    # 4. zero tokens: no rank contacted, empty result
    h0 = att.dispatch_send(*make_batch(g, plan, 0), layer=0)
    if h0.parts or att.combine_recv(h0).shape != (0, plan.hidden):
        problems.append("empty micro-batch")
    att.finish()
    return {"problems": problems, "sent": sent}


def _moe_group(comm, plan, seed):
    if comm.rank < plan.num_attention_ranks:
        return _attention_scenarios(comm, plan, seed)
    return _expert_loop(comm, plan, seed)


def _check_group(results, plan):
    A = plan.num_attention_ranks
    for a in range(A):
        assert results[a]["problems"] == [], f"attention PE {a}: {results[a]['problems']}"
    merged = 0
    for pe in range(A, plan.world_size):
        got = results[pe]["received"]
        merged += results[pe]["merged"]
        assert results[pe]["experts"] == plan.local_experts(pe)
        for a in range(A):
            # what PE pe got from a, in order (per-producer FIFO), equals the reference dispatch
            mine = [(layer, ref[pe]) for layer, ref in results[a]["sent"] if pe in ref]
            theirs = [r for r in got if r[0] == a]
            assert len(mine) == len(theirs), f"PE {pe} got {len(theirs)} parts from {a}, expected {len(mine)}"
            for (layer, (_rows, tokens, ids, weights)), (_a, l2, t2, i2, w2) in zip(mine, theirs):
                assert layer == l2 and torch.equal(tokens, t2) and torch.equal(ids, i2) and torch.equal(weights, w2)
    return merged


@pytest.mark.slow
def test_dispatch_combine_two_attention_two_expert_ranks():
    plan = MoEPlan(num_attention_ranks=2, num_expert_ranks=2, num_experts=8, hidden=32, top_k=3, max_tokens=24,
                   max_inflight=4)
    merged = _check_group(run(_moe_group, 4, plan, 1), plan)
    assert merged > 0, "expert ranks never merged batches of one layer"


@pytest.mark.slow
def test_dispatch_combine_three_attention_one_expert_rank_tiny_buffers():
    # One slot per attention rank and 4-token micro-batches: everything waits on everything else's slot.
    plan = MoEPlan(num_attention_ranks=3, num_expert_ranks=1, num_experts=4, hidden=8, top_k=2, max_tokens=4,
                   max_inflight=1, dtype=torch.float32)
    _check_group(run(_moe_group, 4, plan, 2), plan)


def _bf16_group(comm, plan):
    if comm.rank >= plan.num_attention_ranks:
        ex = ExpertEnd(comm, plan)
        for b in ex:
            ex.combine_send(b, apply_experts(b, lambda e, x: x * (e + 1)))
        return None
    att = AttentionEnd(comm, plan)
    g = torch.Generator().manual_seed(comm.rank)
    x, ids, w = make_batch(g, plan, 16)
    y = att.combine_recv(att.dispatch_send(x, ids, w, 0))
    att.finish()
    expect = (w * (ids + 1)).sum(1, keepdim=True) * x.float()
    # each expert rank rounds its partial sum to bf16 once, the reduction rounds again
    return y.dtype, torch.allclose(y.float(), expect, rtol=2 ** -7, atol=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [2, 4])  # 4 of 4 experts: every token goes to both ranks (whole-part adds)
def test_bf16_micro_batches(top_k):
    plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=2, num_experts=4, hidden=8, top_k=top_k, max_tokens=16,
                   dtype=torch.bfloat16)
    dtype, ok = run(_bf16_group, 3, plan)[0]
    assert dtype == torch.bfloat16 and ok


def _killed_expert(comm, plan, report):
    if comm.rank >= plan.num_attention_ranks:
        ex = ExpertEnd(comm, plan)
        b = ex.dispatch_recv(timeout=20)
        if comm.rank == plan.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)  # dies holding a batch
        ex.combine_send(b, apply_experts(b, expert_fn))
        return None
    att = AttentionEnd(comm, plan)
    x, ids, w = make_batch(torch.Generator().manual_seed(0), plan, plan.max_tokens)
    t0 = time.monotonic()
    try:
        att.combine_recv(att.dispatch_send(x, ids, w, 0), timeout=20)
        outcome = "completed"
    except asap_comm.PeerFailure as e:
        outcome = f"PeerFailure pe={e.pe} {e}"
    with open(report, "w") as f:
        f.write(f"{outcome}|{time.monotonic() - t0:.3f}")
    return outcome


@pytest.mark.slow
def test_killed_expert_rank_gives_peer_failure(tmp_path):
    plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=2, num_experts=4, hidden=8, top_k=4, max_tokens=8)
    report = tmp_path / "outcome.txt"
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_killed_expert, 3, plan, str(report), timeout=60)
    assert ei.value.rank == 2 and ei.value.exitcode == -signal.SIGKILL
    outcome, took = report.read_text().split("|")
    assert outcome.startswith("PeerFailure pe=2"), outcome
    # PeerFailure (not TimeoutError) is the liveness check; the guard, under the wait's 20-s bound, a hang guard
    assert float(took) < 15.0


def _wrong_roles(comm, plan):
    try:
        ExpertEnd(comm, plan) if comm.rank == 0 else AttentionEnd(comm, plan)
    except ValueError as e:
        return str(e)
    return None


def test_roles_are_checked():
    plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=2, hidden=4, top_k=1)
    r0, r1 = run(_wrong_roles, 2, plan)
    assert "PE 0 is not an expert rank" in r0 and "PE 1 is not an attention rank" in r1


def test_expert_placement_is_the_one_placement():
    """moe.expert_placement: contiguous near-equal blocks; MoEPlan and the baseline's workers use it."""
    from asap_comm.moe import MoEPlan, expert_placement
    from asap_comm.serving.sync import rank_of_expert

    assert expert_placement(8, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert expert_placement(8, 6).tolist() == [0, 0, 1, 1, 2, 3, 4, 5]
    plan = MoEPlan(num_attention_ranks=2, num_expert_ranks=3, num_experts=8, hidden=4, max_tokens=8, top_k=2)
    assert torch.equal(plan.rank_of_expert, expert_placement(8, 3))
    assert torch.equal(rank_of_expert(8, 3), expert_placement(8, 3))
    with pytest.raises(ValueError, match="num_ranks=0"):
        expert_placement(8, 0)
