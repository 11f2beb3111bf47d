"""The long-prompt lane of the asynchronous runtime (asap_comm/serving/lane.py): a long prompt's chunks pipelined
over several attention ranks, each layer's KV latents put one-sidedly to the later chunks' ranks. Outputs equal
the single-process reference; the chunks really run on several ranks; short prompts are not held up; a killed
rank fails the run cleanly; and the policies' pieces (placement, micro-batcher stride, config checks)."""
import os
import signal
import time

import pytest
import torch

from asap_comm.serving.frontend import FrontEnd
from asap_comm.serving.lane import FrontLane, LanePool, lane_active, lane_groups, lane_split, lane_tokens
from asap_comm.serving.policies import Chunk, MicroBatcher, Placer, attention_cost, split_equal_cost, split_prompt
from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async

from serving_utils import CFG, INFO, TinyFactory, check_against_reference, make_trace
from models import random_init


def _prompt(rid: int, n: int, arrival: float = 0.0, seed: int = 0) -> PromptRequest:
    g = torch.Generator().manual_seed(1000 + seed + rid)
    return PromptRequest(rid, arrival, torch.randint(0, CFG.vocab_size, (n,), generator=g))


def _lane_pes(result, rid: int) -> set:
    """The attention ranks that put KV latents of request ``rid`` (from the timeline)."""
    return {sp[0] for sp in result.spans if sp[2].startswith("lane kv") and f" req {rid} " in sp[2]}


def _cfg(**kw) -> RuntimeConfig:
    base = dict(num_attention_ranks=3, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=128,
                timeout_s=90)
    base.update(kw)
    return RuntimeConfig(**base)


# ----------------------------------------------------------------------------- policies (no processes)
def test_place_lane_round_robin_costs_and_complete():
    p = Placer(3)
    p.place(7, split_prompt(7, 10, None))  # rank 0 busy
    chunks = split_prompt(1, 64, 16)
    ranks = p.place_lane(1, chunks, 2)
    assert ranks == [1, 2]  # the two least loaded, least loaded first
    w = p.outstanding
    assert w[1] == pytest.approx(chunks[0].cost + chunks[2].cost)
    assert w[2] == pytest.approx(chunks[1].cost + chunks[3].cost)
    assert p.complete(1) == 1 and p.outstanding[1:] == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups=4 is more than the 3 ranks"):
        p.place_lane(2, chunks, 4)


def test_micro_batcher_stride_runs_a_ranks_lane_chunks_alone_and_in_order():
    b = MicroBatcher(64)
    chunks = split_prompt(5, 80, 16)  # 5 chunks; this rank runs 1 and 3 (stride 2)
    b.add(chunks[1], stride=2)
    b.add(Chunk(9, 0, 0, 4, 1))
    with pytest.raises(ValueError, match="out of order"):
        b.add(chunks[2], stride=2)
    b.add(chunks[3], stride=2)
    assert b.next_batch() == [chunks[1]]  # alone although the budget has room
    assert b.next_batch() == [Chunk(9, 0, 0, 4, 1)]  # chunk 3 waits for chunk 1
    b.done(chunks[1])
    assert b.next_batch() == [chunks[3]]
    b.done(chunks[3])  # the rank's last chunk of the request: forgotten
    assert b.running(5) is False and len(b) == 0
    b.add(split_prompt(5, 80, 16)[0])  # the id may come back as an ordinary request


def test_token_balanced_micro_batches_split_tokens_evenly():
    b = MicroBatcher(32)
    for rid, n in enumerate([20, 12, 10, 8, 6]):  # FIFO fill would give [20, 12] and [10, 8, 6]
        b.add(Chunk(rid, 0, 0, n, 1))
    one, two = b.next_batches(2)
    sizes = sorted([sum(c.length for c in one), sum(c.length for c in two)])
    assert sizes == [28, 28] and {c.request_id for c in one + two} == set(range(5))
    assert all(sum(c.length for c in x) <= 32 for x in (one, two))
    lane = split_prompt(9, 64, 16)
    b.add(lane[0], stride=2)
    b.add(Chunk(10, 0, 0, 5, 1))
    b.add(Chunk(11, 0, 0, 4, 1))
    x, y = b.next_batches(2)
    assert x == [lane[0]] and [c.request_id for c in y] == [10, 11]  # the lane chunk alone
    assert b.next_batches(2) == []
    with pytest.raises(ValueError, match="count"):
        b.next_batches(0)


def test_runtime_config_lane_fields_are_checked():
    with pytest.raises(ValueError, match="lane_groups=1"):
        RuntimeConfig(lane_groups=1)
    with pytest.raises(ValueError, match="lane_threshold=-1"):
        RuntimeConfig(lane_threshold=-1)
    with pytest.raises(ValueError, match="long_prompt_lane=1"):
        RuntimeConfig(long_prompt_lane=1)
    assert lane_active(_cfg(), INFO)
    assert not lane_active(_cfg(long_prompt_lane=False), INFO)
    assert not lane_active(_cfg(load_aware=False), INFO)
    assert not lane_active(_cfg(num_attention_ranks=1), INFO)


def test_front_lane_predicate_slots_and_pool():
    fl = FrontLane(_cfg(lane_threshold=40, lane_groups=2), INFO, 3)
    assert fl.groups_for(16, 1) == 0  # one chunk
    assert fl.groups_for(40, 3) == 0  # not longer than the threshold
    assert fl.groups_for(41, 3) == 2  # lane_groups
    assert FrontLane(_cfg(), INFO, 3, enabled=False).groups_for(100, 7) == 0  # the baseline's front end
    fl2 = FrontLane(_cfg(lane_tokens=300), INFO, 3)
    assert fl2.groups_for(17, 2) == 2 and fl2.groups_for(100, 7) == 3
    assert not fl2.wants(301, 19)  # longer than the pool: never the lane
    fl2.open(0, 100, [0, 1, 2])
    fl2.open(1, 128, [0, 1, 2])
    assert fl2.pool.tokens == 228 and fl2.groups_for(72, 5) == 3 and fl2.groups_for(73, 5) == 0  # 72 rows left
    fl2.close(0)
    assert fl2.groups_for(100, 7) == 3  # rows 0..99 free again
    fl2.waiting.append((9, None, None))
    assert fl2.groups_for(16 + 1, 2) == 0  # one waits already: first come, first served


def test_the_service_exports_the_lanes_counts_as_prometheus_metrics():
    """``GET /metrics`` of the HTTP service (server/metrics.py, LaneCollector): the front lane's counts and the
    prompts waiting now; nothing where the lane is off (the baseline's front end)."""
    pytest.importorskip("prometheus_client")
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from asap_comm.serving.server.metrics import LaneCollector

    def scrape(lane) -> dict:
        reg = CollectorRegistry()
        reg.register(LaneCollector(SimpleNamespace(fe=SimpleNamespace(lane=lane))))
        return {s.name: s.value for f in text_string_to_metric_families(generate_latest(reg).decode())
                for s in f.samples if not s.name.endswith("_created")}

    fl = FrontLane(_cfg(lane_tokens=300), INFO, 3)
    fl.counts.open(0.0)
    fl.counts.open(1.5)
    fl.counts.waited, fl.counts.gave_up = 3, 1
    fl.waiting.append((9, None, None))
    assert scrape(fl) == {"asap_lane_opened_total": 2.0, "asap_lane_waited_total": 3.0,
                          "asap_lane_gave_up_total": 1.0, "asap_lane_waiting": 1.0}
    assert fl.counts.as_dict() == {"opened": 2, "waited": 3, "gave_up": 1, "wait_s_mean": 0.75, "wait_s_max": 1.5}
    assert scrape(FrontLane(_cfg(), INFO, 3, enabled=False)) == {}


def test_lane_pool_first_fit_slots_and_cancelled_rows_last():
    pool = LanePool(2, 100)
    assert pool.open(1, 30) == (0, 0) and pool.open(2, 50) == (1, 30)
    assert not pool.fits(10)  # no slot left although 20 rows are
    pool.close(1)
    assert pool.fits(30) and not pool.fits(31)  # rows 0..29 and 80..99: no run of 31
    assert pool.open(3, 20) == (0, 0)  # first fit
    pool.close(2, cancelled=True)  # rows 30..79 go last
    assert pool.open(4, 20) == (1, 80)  # not into the cancelled lane's rows while others are free
    pool.close(4)
    pool.close(3)
    assert pool.open(5, 70) == (0, 0)  # only by reusing them
    with pytest.raises(RuntimeError, match="no room for a lane of 40"):
        pool.open(6, 40)
    assert pool.close(6) is False and pool.tokens == 70


def test_runtime_config_lane_tokens_is_checked():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="lane_tokens="):
            RuntimeConfig(lane_tokens=bad)
    assert lane_tokens(_cfg()) == 128 and lane_tokens(_cfg(lane_tokens=500)) == 500
    assert not lane_active(_cfg(lane_tokens=16), INFO)  # a pool of one chunk holds no lane


def test_split_equal_cost_balances_attention_cost_and_keeps_the_bounds():
    w = 3473.0
    chunks = split_equal_cost(7, 85401, 24, w)
    assert [c.index for c in chunks] == list(range(24)) and all(c.request_id == 7 and c.num_chunks == 24
                                                               for c in chunks)
    assert chunks[0].start == 0 and all(a.start + a.length == b.start for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1].start + chunks[-1].length == 85401
    costs = [attention_cost(c.length, c.start, w) for c in chunks]
    assert max(costs) / min(costs) < 1.01  # equal cost
    assert all(a.length > b.length for a, b in zip(chunks, chunks[1:]))  # so later chunks are shorter
    capped = split_equal_cost(7, 85401, 24, w, max_len=4096)
    assert max(c.length for c in capped) == 4096 and sum(c.length for c in capped) == 85401
    tail = [attention_cost(c.length, c.start, w) for c in capped if c.length < 4096]
    assert max(tail) / min(tail) < 1.01  # the chunks after the capped ones share the rest equally
    assert [c.length for c in split_equal_cost(0, 5, 5, 0.0)] == [1] * 5
    with pytest.raises(ValueError, match="num_chunks=6 is more than prompt_len=5"):
        split_equal_cost(0, 5, 6)
    with pytest.raises(ValueError, match="cannot hold prompt_len=100"):
        split_equal_cost(0, 100, 3, max_len=32)
    with pytest.raises(ValueError, match="linear_weight=-1"):
        split_equal_cost(0, 100, 3, -1)


def test_lane_split_by_tokens_or_by_cost_and_its_groups():
    tok, cost = _cfg(), _cfg(lane_chunks="cost", placer_linear_weight=8.0)
    assert lane_split(tok, 3, 100, 3) == split_prompt(3, 100, 16)  # 7 chunks of near-equal length
    assert lane_groups(tok, 3, 7) == 3 and lane_groups(tok, 5, 2) == 2
    assert lane_groups(cost, 5, 2) == 4 and lane_groups(_cfg(lane_chunks="cost", lane_groups=2), 5, 2) == 2
    chunks = lane_split(cost, 3, 100, 3)  # two per group would be 6: the 7 of equal length are more
    assert len(chunks) == 7 and max(c.length for c in chunks) <= 16 and chunks[0].length > chunks[-1].length
    assert chunks == split_equal_cost(3, 100, 7, 8.0, max_len=16)
    assert len(lane_split(cost, 3, 40, 3)) == 6  # 3 equal-length chunks, but two per group
    with pytest.raises(ValueError, match="lane_chunks='rows'"):
        _cfg(lane_chunks="rows")


# ----------------------------------------------------------------------------- the runtime

@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3])
def test_lane_outputs_equal_the_reference_and_chunks_run_on_several_ranks(ranks):
    long_ = [_prompt(0, 100), _prompt(1, 61, 0.05)]
    requests = long_ + make_trace(8, seed=3, max_len=40, spread_s=0.2)
    requests = [PromptRequest(i, r.arrival_s, r.token_ids) for i, r in enumerate(requests)]
    result = run_async(TinyFactory(), INFO, requests, _cfg(num_attention_ranks=ranks, lane_threshold=50))
    assert [r.error for r in result.records] == [None] * len(requests)
    assert check_against_reference(requests, result) == []
    # 100 tokens in 7 chunks round-robin: every rank sends KV; the short ones (<= 50 tokens) take no lane
    assert len(_lane_pes(result, 0)) == ranks
    assert len(_lane_pes(result, 1)) >= 2
    assert not any(_lane_pes(result, i) for i in range(2, len(requests)))


@pytest.mark.slow
def test_lane_chunks_of_equal_cost_keep_the_outputs_and_spread_over_more_ranks():
    # lane_chunks="cost": a 100-token prompt (7 chunks of 16 by length) in 7 chunks of equal cost, later ones
    # shorter; a 40-token one (3 by length) in 6, two per rank of 3; every output equals the reference, the KV
    # of each comes from every rank, and the ranks import exactly the rows the front end's split says
    requests = [_prompt(0, 100), _prompt(1, 40, 0.05)] + [_prompt(i, 9, 0.01 * i) for i in range(2, 5)]
    cfg = _cfg(lane_threshold=30, lane_chunks="cost", placer_linear_weight=8.0, lane_tokens=256)
    result = run_async(TinyFactory(), INFO, requests, cfg)
    assert [r.error for r in result.records] == [None] * len(requests)
    assert check_against_reference(requests, result) == []
    assert len(_lane_pes(result, 0)) == 3 and len(_lane_pes(result, 1)) == 3
    assert not any(_lane_pes(result, i) for i in range(2, 5))


@pytest.mark.slow
def test_lane_prompts_sharing_ranks_with_one_micro_batch_per_rank():
    # one micro-batch per rank (ping-pong off) and three lane prompts at once over the same 2 ranks: each rank's
    # only slot is held by a chunk that may wait for the other rank; they all complete (a lane chunk starts only
    # once its predecessor started, LaneRank.can_start; this load also completes without that rule, so it guards
    # the mixed load, not the rule itself)
    requests = [_prompt(i, 70 + 13 * i, 0.0) for i in range(3)]
    result = run_async(TinyFactory(), INFO, requests, _cfg(num_attention_ranks=2, ping_pong=False, timeout_s=60,
                                                           lane_tokens=256))  # room for all three
    assert [r.error for r in result.records] == [None] * 3
    assert check_against_reference(requests, result) == []
    assert all(len(_lane_pes(result, i)) == 2 for i in range(3))


@pytest.mark.slow
def test_lane_prompts_wait_for_room_in_the_kv_pool_and_keep_their_outputs():
    # a pool of 128 rows (max_prompt_len): three lane prompts of 70-96 tokens arriving together take the lane one
    # after another, first come first served, each once the one before has answered; short prompts are not held
    requests = [_prompt(i, 70 + 13 * i, 0.0) for i in range(3)] + [_prompt(3, 9, 0.01), _prompt(4, 12, 0.02)]
    result = run_async(TinyFactory(), INFO, requests, _cfg(num_attention_ranks=2, timeout_s=60))
    assert [r.error for r in result.records] == [None] * 5
    assert check_against_reference(requests, result) == []
    puts = {i: [sp[3] for sp in result.spans if sp[2].startswith("lane kv") and f" req {i} " in sp[2]]
            for i in range(3)}
    assert all(len({sp[0] for sp in result.spans if sp[2].startswith("lane kv") and f" req {i} " in sp[2]}) == 2
               for i in range(3))
    assert max(puts[0]) < min(puts[1]) and max(puts[1]) < min(puts[2]), puts  # one lane at a time, in order
    done = {r.request_id: r.ttft_s for r in result.records}
    assert done[3] < done[2] and done[4] < done[2]  # the short ones did not wait for the lane


@pytest.mark.slow
def test_a_prompt_that_waits_lane_wait_s_runs_on_one_rank_and_keeps_its_output():
    # the pool holds one prompt (128 rows); three lane prompts arrive together. With lane_wait_s=0 the two that
    # find no room run the usual way at once, each on one rank (no lane KV of theirs); outputs stay the reference
    requests = [_prompt(i, 70 + 13 * i, 0.0) for i in range(3)]
    result = run_async(TinyFactory(), INFO, requests, _cfg(num_attention_ranks=2, timeout_s=60, lane_wait_s=0.0))
    assert [r.error for r in result.records] == [None] * 3
    assert check_against_reference(requests, result) == []
    assert len(_lane_pes(result, 0)) == 2 and not _lane_pes(result, 1) and not _lane_pes(result, 2)
    # what the front end's lane admission did (RunResult.lane, LaneCounts): one lane, two waited and gave up
    lane = result.lane
    assert (lane["opened"], lane["waited"], lane["gave_up"]) == (1, 2, 2), lane
    assert 0.0 <= lane["wait_s_mean"] <= lane["wait_s_max"]


@pytest.mark.slow
def test_lane_off_is_the_old_runtime():
    requests = [_prompt(0, 100)] + [PromptRequest(i + 1, r.arrival_s, r.token_ids)
                                    for i, r in enumerate(make_trace(5, seed=4))]
    result = run_async(TinyFactory(), INFO, requests, _cfg(long_prompt_lane=False))
    assert check_against_reference(requests, result) == []
    assert not [sp for sp in result.spans if sp[2].startswith("lane kv")]
    assert result.lane == {}  # no lane, no counts


@pytest.mark.slow
def test_short_prompts_complete_while_a_lane_prompt_runs():
    # a 120-token prompt (8 chunks) over 2 ranks, then short prompts just after it: each short one finishes
    # before the long one (they run in the other ping-pong slot while its chunks wait for KV)
    requests = [_prompt(0, 120)] + [_prompt(i, 6, 0.001 * i) for i in range(1, 5)]
    result = run_async(TinyFactory(), INFO, requests,
                       _cfg(num_attention_ranks=2, num_expert_ranks=1, max_prompt_len=128))
    assert check_against_reference(requests, result) == []
    done = {r.request_id: r.done_s for r in result.records}
    assert len(_lane_pes(result, 0)) == 2
    assert all(done[i] < done[0] for i in range(1, 5)), done


class _DyingAttention(TinyFactory):
    """The first attention rank to attend past position 48 (a lane chunk of the long prompt, after it imported
    the earlier chunks' latents) dies there, in the middle of the lane."""

    def __call__(self, role: str, experts: list):
        model = super().__call__(role, experts)
        if role != "attention":
            return model
        inner = model.attention_stage

        def attention_stage(layer, hidden, cache=None):
            if cache is not None and cache.length(layer) >= 48:
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(layer, hidden, cache)

        model.attention_stage = attention_stage
        return model


@pytest.mark.slow
def test_killed_rank_mid_lane_fails_the_run_without_hanging():
    requests = [_prompt(0, 100), _prompt(1, 5, 0.01)]
    result = run_async(_DyingAttention(), INFO, requests, _cfg(num_attention_ranks=2, timeout_s=60))
    rec = {r.request_id: r for r in result.records}
    assert rec[0].error and 0 not in result.outputs, rec[0]


def test_front_end_lane_messages_reach_every_lane_rank():
    """The front end's admission of a lane prompt: chunk j queued to ranks[j % g], lane words before the tokens,
    the last chunk's rank recorded; cancel frees the slot and tells every lane rank (no processes: a stub
    mailbox)."""
    class _Comm:
        world_size, rank = 4, 3

        def peer_state(self, pe):
            return "alive"

    cfg = _cfg(num_attention_ranks=3)
    fe = FrontEnd(_Comm(), cfg, INFO, None, 3, "async")
    toks = torch.arange(100) % CFG.vocab_size
    rank = fe.admit(0, toks)
    sent = [[e[1] for e in q] for q in fe.pending]
    assert [len(s) for s in sent] == [3, 2, 2]  # 7 chunks round-robin over 3 ranks (all idle: 0, 1, 2)
    assert rank == 0  # chunk 6 on ranks[6 % 3]
    p = sent[1][0]
    # seq 1, 100 tokens from pool row 0, 3 ranks, then the ranks and the chunk's tokens
    assert int(p[4]) < 0 and p[5:9].tolist() == [1, 100, 0, 3] and p[9:12].tolist() == [0, 1, 2]
    assert torch.equal(p[12:], toks[15:30])  # chunk 1: tokens 15..29 (7 balanced chunks of 14-15)
    # the pool (max_prompt_len = 128 rows) has no room for a second long prompt: it waits, nothing of it sent
    assert fe.admit(1, toks[:60]) == -1 and fe.admit(2, toks[:50]) == -1  # and the next waits behind it
    assert fe.admit(3, toks[:10]) >= 0  # one chunk: not the lane, placed at once
    assert sum(len(q) for q in fe.pending) == 8 and fe.queued_tokens == 220
    free = len(fe.lane.free)
    assert fe.cancel(0)
    assert not any(e[0] == 0 for q in fe.pending for e in q)  # its chunks were dropped (none had been sent)
    # its rows went to the first waiting prompt (60 tokens: only by reusing them), then the second (50) beside
    # it; each took a slot of its own (the cancelled lane's slot goes last)
    assert len(fe.lane.free) == free + 1 - 2 and fe.lane.free[-1] == 0
    assert fe.inflight[1].lane and fe.inflight[2].lane and not fe.lane.waiting
    assert [fe.inflight[r].waiting for r in (1, 2)] == [False, False]
    assert sorted((b, n) for _, b, n in fe.lane.pool.spans.values()) == [(0, 60), (60, 50)]
    fe.admit(4, toks[:100])  # waits (18 rows free) ...
    assert fe.inflight[4].waiting and fe.cancel(4) and 4 not in fe.inflight and not fe.lane.waiting  # ... until cancelled
    ref = random_init(CFG, seed=0)  # kv rows round trip through the model hooks
    cache = ref.new_cache()
    ref.prefill(toks[:20], cache)
    rows = ref.kv_rows(cache, 1, 5, 20)
    other = ref.new_cache()
    ref.append_kv_rows(other, 1, ref.kv_rows(cache, 1, 0, 5))
    ref.append_kv_rows(other, 1, rows)
    assert torch.equal(ref.kv_rows(other, 1, 0, 20), ref.kv_rows(cache, 1, 0, 20))
    with pytest.raises(ValueError, match="not all cached"):
        ref.kv_rows(cache, 1, 0, 21)


class _SlowAttention(TinyFactory):
    """Attention stages that take 10 ms each: a lane prompt is still running when the front end cancels it."""

    def __call__(self, role: str, experts: list):
        model = super().__call__(role, experts)
        if role == "attention":
            inner = model.attention_stage

            def attention_stage(layer, hidden, cache=None):
                time.sleep(0.01)
                return inner(layer, hidden, cache)

            model.attention_stage = attention_stage
        return model


class _CancelFront:
    """A front-end role: two lane prompts, cancel the first mid-lane, a third and short ones, then a fourth lane
    prompt in a finished lane's slot."""

    def __init__(self, prompts: dict) -> None:
        self.prompts = prompts

    def __call__(self, comm, cfg, info, ch, num_targets, label, role_of):
        fe = FrontEnd(comm, cfg, info, ch.box, num_targets, label)
        fe.wait_ready(ch.stats, 60)
        out, slots, rows = {}, [], []

        def pump_until(pred, limit_s=60.0):
            end = time.monotonic() + limit_s
            while not pred():
                for c in fe.pump(0.005):
                    out[c.request_id] = (c.token, c.hidden)
                assert time.monotonic() < end, f"front end: no progress ({sorted(out)})"

        fe.admit(0, self.prompts[0])
        fe.admit(1, self.prompts[1])
        slots.append({r: sp[0] for r, sp in fe.lane.pool.spans.items()})
        rows.append({r: sp[1:] for r, sp in fe.lane.pool.spans.items()})
        pump_until(lambda: not fe.has_unsent)
        t = time.monotonic()
        pump_until(lambda: time.monotonic() - t > 0.15)  # request 0's chunks are running on both ranks
        assert fe.cancel(0)
        fe.admit(2, self.prompts[2])  # a fresh slot: the cancelled one is reused last
        slots.append({r: sp[0] for r, sp in fe.lane.pool.spans.items()})
        rows.append({r: sp[1:] for r, sp in fe.lane.pool.spans.items()})
        for rid in (3, 4):
            fe.admit(rid, self.prompts[rid])
        pump_until(lambda: all(r in out for r in (1, 2, 3, 4)))
        fe.admit(5, self.prompts[5])  # reuses request 1's or 2's slot (finished: reused first)
        slots.append({r: sp[0] for r, sp in fe.lane.pool.spans.items()})
        rows.append({r: sp[1:] for r, sp in fe.lane.pool.spans.items()})
        pump_until(lambda: 5 in out)
        pump_until(lambda: time.monotonic() - t > 0.3)  # a late result of request 0 would be dropped here
        fe.stop()
        return out, slots, rows


@pytest.mark.slow
def test_cancel_mid_lane_then_reuse_a_finished_slot():
    from asap_comm.launch import launch
    from asap_comm.serving.group import GroupSpec, group_main

    prompts = {0: _prompt(0, 120).token_ids, 1: _prompt(1, 90).token_ids, 2: _prompt(2, 100).token_ids,
               3: _prompt(3, 5).token_ids, 4: _prompt(4, 9).token_ids, 5: _prompt(5, 110).token_ids}
    cfg = _cfg(num_attention_ranks=2, num_expert_ranks=1, timeout_s=90, lane_tokens=400)
    spec = GroupSpec("async", cfg, INFO, _SlowAttention(), _CancelFront(prompts))
    results = launch(group_main, spec.world_size, spec, timeout=120)
    out, slots, rows = results[-1][1]
    assert slots[0][0] != slots[1][2] and slots[2][5] in (slots[0][1], slots[1][2]), slots  # a finished one
    # the pool's rows too: request 2 does not take the cancelled request 0's rows (0..119) while others are free
    assert rows[0] == {0: (0, 120), 1: (120, 90)} and rows[1][2] == (210, 100), rows
    assert 0 not in out and sorted(out) == [1, 2, 3, 4, 5]
    reqs = [PromptRequest(r, 0.0, prompts[r]) for r in (1, 2, 3, 4, 5)]

    class _R:
        outputs = out
    assert check_against_reference(reqs, _R()) == []


def test_can_start_waits_for_the_predecessors_layer_zero():
    """LaneRank.can_start on a one-PE communicator: a lane chunk may start only once every earlier chunk computed
    elsewhere put its layer 0 (signals hold the lane's sequence number)."""
    import asap_comm
    from asap_comm.serving.lane import LaneBuffers, LaneRank

    cfg = _cfg(num_attention_ranks=3)
    comm = asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0)
    try:
        buf = LaneBuffers(comm, cfg, INFO)
        lr = LaneRank(comm, cfg, random_init(CFG, seed=0, experts=[]), buf, set(), [])
        words = torch.tensor([7, 100, 0, 3, 1, 2, 0], dtype=torch.int64)  # seq 7, 100 tokens at row 0, ranks [1, 2, 0]
        chunks = split_prompt(4, 100, 16)
        toks, stride = lr.take(chunks[2], -(1 + 3), torch.cat([words, torch.arange(14)]))
        assert stride == 3 and toks.tolist() == list(range(14)) and lr.is_lane(4)
        assert not lr.can_start(chunks[2])
        comm.signal_op(buf.sig, buf.index(3, 0, 1), 7, "set", 0)
        assert not lr.can_start(chunks[2])  # chunk 0 has not put layer 0
        comm.signal_op(buf.sig, buf.index(3, 0, 0), 6, "set", 0)
        assert not lr.can_start(chunks[2])  # an older lane's value in the same slot
        comm.signal_op(buf.sig, buf.index(3, 0, 0), 7, "set", 0)
        assert lr.can_start(chunks[2]) and lr.can_start(chunks[0])
        assert not lr.can_start(chunks[5])
        for k in (3, 4):
            comm.signal_op(buf.sig, buf.index(3, 0, k), 7, "set", 0)
        assert lr.can_start(chunks[5])  # chunks 3, 4 put layer 0; this rank (PE 0) ran chunk 2: no further back
        assert lr.finished(chunks[2]) is False and lr.finished(chunks[5]) is True and not lr.is_lane(4)
    finally:
        comm.close()
