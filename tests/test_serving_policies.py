"""The scheduling policies shared by the runtime and the simulator (pure functions and objects)."""
import pytest

from asap_comm.serving.policies import (LINEAR_WEIGHT, Chunk, ExpertBatcher, MicroBatcher, Placer, attention_cost,
                                        split_prompt)
from asap_comm.serving.protocol import RuntimeConfig


def test_attention_cost_by_hand():
    # 3 new tokens after 2 cached: pairs 3*2 + 3*4/2 = 12, plus 3 linear units
    assert attention_cost(3, 2, linear_weight=1.0) == 15.0
    assert attention_cost(0, 100) == 0.0
    # quadratic: doubling a long prompt costs about 4x its pairs
    big = attention_cost(8192, linear_weight=0.0) / attention_cost(4096, linear_weight=0.0)
    assert 3.99 < big < 4.01
    # a chunk late in a prompt costs more than the same chunk at the start
    assert attention_cost(1024, 3072) > attention_cost(1024, 0)
    with pytest.raises(ValueError, match="attention_cost: num_tokens=-1 must be >= 0"):
        attention_cost(-1)


def test_split_prompt_is_balanced_and_covers_the_prompt():
    chunks = split_prompt(7, 2500, 1024)
    assert [c.length for c in chunks] == [834, 833, 833]
    assert [c.start for c in chunks] == [0, 834, 1667] and chunks[-1].last and not chunks[0].last
    assert all(c.request_id == 7 and c.num_chunks == 3 for c in chunks)
    assert split_prompt(1, 1024, 1024) == [Chunk(1, 0, 0, 1024, 1)]
    assert split_prompt(1, 5, None) == [Chunk(1, 0, 0, 5, 1)]
    for n in (1, 2, 999, 1000, 1001, 4097):
        cs = split_prompt(0, n, 1000)
        assert sum(c.length for c in cs) == n and max(c.length for c in cs) <= 1000
        assert max(c.length for c in cs) - min(c.length for c in cs) <= 1
    with pytest.raises(ValueError, match="split_prompt: prompt_len=0 must be >= 1"):
        split_prompt(0, 0, 10)
    # the chunked work is less than whole-prompt work only by the linear term's rounding: same pairs
    whole = attention_cost(2500)
    assert abs(sum(c.cost for c in chunks) - whole) < 1e-6


def test_placer_least_outstanding_work_and_round_robin():
    p = Placer(3)
    long = split_prompt(0, 8000, None)
    assert p.place(0, long) == 0
    assert p.place(1, split_prompt(1, 100, None)) == 1
    assert p.place(2, split_prompt(2, 100, None)) == 2
    assert p.place(3, split_prompt(3, 100, None)) == 1  # ties between 1 and 2 go to the lower rank
    assert p.place(4, split_prompt(4, 100, None)) == 2
    assert p.outstanding[0] == long[0].cost
    assert p.complete(0) == 0 and p.outstanding[0] == 0.0
    assert p.place(5, split_prompt(5, 100, None)) == 0
    with pytest.raises(ValueError, match="request 5 is already placed"):
        p.place(5, split_prompt(5, 1, None))
    with pytest.raises(ValueError, match="request 42 is not placed"):
        p.complete(42)
    rr = Placer(2, load_aware=False)
    assert [rr.place(i, split_prompt(i, 10 ** (i % 3 + 1), None)) for i in range(5)] == [0, 1, 0, 1, 0]


def test_micro_batcher_budget_order_and_one_chunk_in_flight_per_request():
    mb = MicroBatcher(token_budget=100)
    a = split_prompt(1, 150, 60)  # 3 chunks of 50
    for c in a:
        mb.add(c)
    mb.add(Chunk(2, 0, 0, 40, 1))
    mb.add(Chunk(3, 0, 0, 30, 1))
    b1 = mb.next_batch()
    # request 1's first chunk, then request 2 (90 tokens); request 3 does not fit; 1's next chunk must wait
    assert [(c.request_id, c.index) for c in b1] == [(1, 0), (2, 0)]
    b2 = mb.next_batch()
    assert [(c.request_id, c.index) for c in b2] == [(3, 0)]  # request 1 still in flight
    assert mb.next_batch() == []
    mb.done(b1[0])
    mb.done(b1[1])
    assert [(c.request_id, c.index) for c in mb.next_batch()] == [(1, 1)]
    with pytest.raises(ValueError, match="chunk 0 of request 1 is not in flight"):
        mb.done(a[0])
    with pytest.raises(ValueError, match="chunk 0 of request 1 is out of order"):
        mb.add(a[0])
    big = MicroBatcher(token_budget=10)
    big.add(Chunk(9, 0, 0, 50, 1))  # longer than the budget: goes alone
    big.add(Chunk(8, 0, 0, 5, 1))
    assert [c.request_id for c in big.next_batch()] == [9]
    assert [c.request_id for c in big.next_batch()] == [8]
    assert len(big) == 0 and big.pending_tokens == 0


def test_expert_batcher_budget_deadline_and_ablation():
    eb = ExpertBatcher(token_budget=100, deadline_s=0.01)
    assert eb.ready(0.0) is None and eb.wait_s(0.0) is None
    eb.add(layer=3, rows=40, item="a", now=0.0)
    eb.add(layer=5, rows=30, item="b", now=0.001)
    assert eb.ready(0.002) is None
    assert eb.wait_s(0.002) == pytest.approx(0.008)
    eb.add(layer=5, rows=80, item="c", now=0.003)  # layer 5 reaches the budget
    assert eb.ready(0.003) == 5 and eb.wait_s(0.003) == 0.0
    assert eb.take(5) == ["b", "c"] and eb.held_rows == 40
    assert eb.ready(0.005) is None
    assert eb.ready(0.010) == 3  # layer 3's oldest rows passed the deadline
    assert eb.take(3) == ["a"] and eb.take(3) == []
    off = ExpertBatcher(token_budget=100, deadline_s=1.0, enabled=False)
    off.add(1, 1, "x", now=0.0)
    off.add(2, 1, "y", now=0.5)
    assert off.ready(0.0) == 1  # no gathering: oldest first, at once
    with pytest.raises(ValueError, match="deadline_s=-1"):
        ExpertBatcher(10, -1)


def test_micro_batcher_never_runs_a_later_chunk_before_an_earlier_one():
    """Regression: chunk 0 skipped for the budget must hold back chunk 1 of the same request."""
    mb = MicroBatcher(token_budget=32)
    mb.add(Chunk(1, 0, 0, 24, 1))
    for c in split_prompt(2, 17, 9):  # 9 + 8
        mb.add(c)
    first = mb.next_batch()
    assert [(c.request_id, c.index) for c in first] == [(1, 0)]
    assert mb.next_batch() == [Chunk(2, 0, 0, 9, 2)]


def test_micro_batcher_runs_urgent_chunks_first_in_batches_of_their_own():
    """An urgent chunk (a light client's) goes ahead of every queued chunk, in a micro-batch of urgent chunks only
    (FIFO among them, under the budget); a request's later urgent chunk waits for its predecessor as any chunk;
    once no urgent chunk may run, FIFO resumes. Cancelling forgets the marks; a lane chunk cannot be urgent."""
    mb = MicroBatcher(token_budget=512)
    for rid in range(10):
        mb.add(Chunk(rid, 0, 0, 64, 1))
    assert not mb.urgent_ready()
    two = split_prompt(101, 512, 256)
    mb.add(Chunk(100, 0, 0, 256, 1), urgent=True)
    for c in two:
        mb.add(c, urgent=True)
    mb.add(Chunk(102, 0, 0, 256, 1), urgent=True)
    assert mb.urgent_ready()
    first = mb.next_batch()
    assert [c.request_id for c in first] == [100, 101]  # 102 does not fit beside them: it waits for the next
    assert mb.urgent_ready() and [c.request_id for c in mb.next_batch()] == [102]
    assert not mb.urgent_ready()  # 101's second chunk waits for its first
    assert [c.request_id for c in mb.next_batch()] == list(range(8))  # FIFO again, 8 x 64
    mb.done(first[1])
    assert mb.urgent_ready(ready=lambda c: False) is False  # ``ready`` holds it back as any chunk
    batches = mb.next_batches(2)  # token-balanced: the urgent chunk alone in the first micro-batch
    assert [[(c.request_id, c.index) for c in b] for b in batches] == [[(101, 1)], [(8, 0), (9, 0)]]
    mb.add(Chunk(103, 0, 0, 32, 1), urgent=True)
    assert mb.cancel(103) and not mb.urgent_ready() and len(mb) == 0
    with pytest.raises(ValueError, match="cannot be urgent"):
        mb.add(Chunk(104, 0, 0, 8, 4), stride=2, urgent=True)


def test_placer_place_group_shares_a_request_among_the_least_loaded():
    from asap_comm.serving.policies import Chunk, Placer

    p = Placer(4)
    a = [Chunk(0, 0, 0, 100, 1)]
    assert p.place(0, a) == 0
    big = [Chunk(1, 0, 0, 300, 2), Chunk(1, 1, 300, 300, 2)]
    groups = p.place_group(1, big, 3)
    assert groups == [1, 2, 3]  # rank 0 holds work: the three idle ranks, lowest first
    each = sum(c.cost for c in big) / 3
    assert p.outstanding == pytest.approx([a[0].cost, each, each, each])
    assert p.complete(1) == 1 and p.outstanding == pytest.approx([a[0].cost, 0, 0, 0])
    with pytest.raises(ValueError, match="groups=5 is more than the 4 ranks"):
        p.place_group(2, big, 5)
    with pytest.raises(ValueError, match="already placed"):
        p.place_group(0, big, 2)
    assert p.outstanding == pytest.approx([a[0].cost, 0, 0, 0])  # refused calls changed nothing


def test_chunk_message_round_trip():
    """protocol: the chunk message the front end sends is what both runtimes read."""
    import torch

    from asap_comm.serving.protocol import HDR, decode_chunk, encode_chunk

    c = Chunk(7, 1, 128, 3, 2)
    payload = encode_chunk(c, torch.tensor([5, 6, 9], dtype=torch.int32), groups=0b1010)
    assert payload.dtype == torch.int64 and payload.numel() == HDR + 3
    chunk, groups, toks = decode_chunk(payload)
    assert chunk == c and groups == 0b1010 and toks.tolist() == [5, 6, 9]
    from asap_comm.serving.protocol import URGENT, chunk_urgent, mark_urgent
    plain = encode_chunk(c, torch.tensor([5, 6, 9]))
    assert not chunk_urgent(plain)
    mark_urgent(plain, True)
    assert chunk_urgent(plain) and int(plain[HDR - 1]) == URGENT and decode_chunk(plain)[1] == 0
    mark_urgent(plain, False)
    assert not chunk_urgent(plain) and decode_chunk(plain)[:2] == (c, 0)
    lane = encode_chunk(c, torch.tensor([5]), groups=-3)  # a lane's negative word is never read as urgent
    assert not chunk_urgent(lane) and decode_chunk(lane)[1] == -3


def test_micro_batcher_cancel_drops_queued_chunks_and_forgets_a_running_request():
    mb = MicroBatcher(token_budget=8)
    a, b = split_prompt(1, 16, 8), split_prompt(2, 4, None)
    for c in a + b:
        mb.add(c)
    first = mb.next_batch()
    assert [(c.request_id, c.index) for c in first] == [(1, 0)]  # request 1's first chunk runs
    assert mb.cancel(1) == [a[1]] and mb.running(1)  # its queued second chunk is dropped
    assert mb.cancel(2) == b and not mb.running(2) and len(mb) == 0
    mb.done(first[0])
    assert not mb.running(1) and mb.next_batch() == []
    mb.add(split_prompt(1, 3, None)[0])  # a reused id starts from chunk 0 again: nothing was left behind
    assert [c.request_id for c in mb.next_batch()] == [1]


# ----------------------------------------------------------------------------- the placer's linear weight
def test_placer_uses_its_linear_weight():
    short = [Chunk(0, 0, 0, 100, 1)]
    long_ = [Chunk(1, 0, 0, 400, 1)]
    for w in (0.0, 5000.0):
        p = Placer(2, linear_weight=w)
        p.place(1, long_)
        assert p.outstanding[0] == attention_cost(400, 0, w)
    assert Placer(2).linear_weight == LINEAR_WEIGHT
    # rank 0 holds one prompt of 400 tokens; prompts of 100 follow. Counting pairs only (weight 0) a 100-token
    # prompt is 1/16 of the long one, so the first 6 all go to rank 1; at weight 5000 one is about 1/4: the 6th
    # goes back to rank 0
    heavy, light = Placer(2, linear_weight=5000.0), Placer(2, linear_weight=0.0)
    placed = {}
    for name, p in (("heavy", heavy), ("light", light)):
        p.place(1, long_)
        placed[name] = [p.place(i, [Chunk(i, 0, 0, 100, 1)]) for i in range(2, 8)]
    assert placed["light"] == [1] * 6
    assert placed["heavy"] == [1] * 5 + [0]
    assert Placer(2, linear_weight=5000.0).place(0, short) == 0
    for bad in (-1.0, float("nan"), "512", True):
        with pytest.raises(ValueError, match="linear_weight"):
            Placer(2, linear_weight=bad)
        with pytest.raises(ValueError, match="placer_linear_weight"):
            RuntimeConfig(placer_linear_weight=bad)
