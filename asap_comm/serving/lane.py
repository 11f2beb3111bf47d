"""The long-prompt lane of the asynchronous runtime: one long prompt's chunks pipelined over several attention ranks.

A prompt of more than one chunk (``RuntimeConfig.long_prompt_lane``,
``lane_threshold``) is placed by the front end (:class:`FrontLane`,
``Placer.place_lane``) on up to ``lane_groups`` of the least-loaded attention
ranks: chunk ``j`` runs on ``ranks[j % g]``. Each rank computes its chunks
layer by layer as usual (the MoE through the expert ranks as usual). After the
attention stage of layer ``l`` of chunk ``j``, its rank puts that layer's KV
latents of the chunk into the lane slot of every rank that runs a later chunk
of the request (``put_signal``: the data, then the signal
``sig[slot, l, j] = seq``; no barrier, no collective). Before the attention
stage of layer ``l`` of chunk ``j``, the rank waits for layer ``l`` of every
earlier chunk it did not compute (its micro-batch yields a :class:`LaneWait`,
as it yields its exchange handle at MoE layers, so the rank's other
micro-batch runs meanwhile) and appends their latents to its cache: the
attention stage sees positions ``[0, start_j)`` and the result equals the
one-rank prefill. Only the last chunk's rank sends the result; every rank drops
the request's cache after its own last chunk (or on cancel).

Buffers (:class:`LaneBuffers`, symmetric, on every PE of an async group):
``slots`` lane slots of ``[num_layers, max_prompt_len, kv_row_width]`` and
one signal per (slot, layer, chunk). The front end hands out slots; with none
free a long prompt runs the normal way on one rank. Signals hold the lane's
sequence number, not a count, so a slot is reused without resetting anything.
A chunk message of the lane carries ``groups = -(1 + slot)`` and, before its
tokens, ``[seq, prompt length, g, ranks...]`` (:data:`LANE_WORDS` + ``g``
words).
"""
from __future__ import annotations

import time

import torch

from ..errors import TimeoutError as CommTimeoutError
from .hooks import model_hooks
from .policies import split_prompt

__all__ = ["LANE_WORDS", "lane_active", "lane_slots", "chunk_may_start", "LaneBuffers", "FrontLane", "LaneRank",
           "LaneWait", "LaneAborted"]

LANE_WORDS = 3  # seq, prompt length, number of ranks (then the ranks)


def lane_active(cfg, info) -> bool:
    """Whether a group with ``cfg`` runs the long-prompt lane: switched on, chunking on (``load_aware``), at
    least 2 attention ranks, and a model whose KV row width is known (``ModelInfo.kv_row_width``)."""
    return (cfg.long_prompt_lane and cfg.effective_chunk_len is not None and cfg.num_attention_ranks >= 2
            and info.kv_row_width > 0 and cfg.max_prompt_len > cfg.effective_chunk_len)


def lane_slots(cfg) -> int:
    """Lane slots per PE: as many long prompts may run in the lane at once."""
    return 4


def chunk_may_start(index: int, ranks: list, me: int, has_put) -> bool:
    """The lane's start rule for chunk ``index`` of a prompt whose chunk ``k`` runs on ``ranks[k % len(ranks)]``, on
    rank ``me``: every earlier chunk another rank computes has put its layer 0 (``has_put(k)``), down to the last
    one ``me`` ran (it started, and so had every chunk before it). ``LaneRank.can_start`` and the simulator's lane
    (``asap_comm.sim.lane``) both decide with it."""
    g = len(ranks)
    for k in range(index - 1, -1, -1):
        if ranks[k % g] == me:
            return True
        if not has_put(k):
            return False
    return True


def _max_chunks(cfg) -> int:
    return -(-cfg.max_prompt_len // cfg.effective_chunk_len)


class LaneBuffers:
    """Collective: the lane's symmetric KV slots and signals (every PE of the group allocates them)."""

    def __init__(self, comm, cfg, info) -> None:
        self.slots, self.layers, self.chunks = lane_slots(cfg), info.num_layers, _max_chunks(cfg)
        # not zeroed: a row is read only after its signal says it was written, and pages nobody writes (the
        # front end's, the expert ranks', a short run's) are never touched
        self.kv = comm.empty((self.slots, self.layers, cfg.max_prompt_len, info.kv_row_width), info.dtype)
        self.sig = comm.signals(self.slots * self.layers * self.chunks)

    def index(self, slot: int, layer: int, chunk: int) -> int:
        return (slot * self.layers + layer) * self.chunks + chunk


class FrontLane:
    """The front end's side: which prompt takes the lane, its slot, ranks and chunk messages' lane words."""

    def __init__(self, cfg, info, num_targets: int, *, enabled: bool = True) -> None:
        """``enabled=False``: never (the baseline's front end)."""
        self.cfg, self.W = cfg, num_targets
        self.active = enabled and num_targets >= 2 and lane_active(cfg, info)
        self.free = list(range(lane_slots(cfg))) if self.active else []
        self.seq = 0
        self.slot_of: dict = {}  # request -> its slot

    def groups_for(self, n_tokens: int, num_chunks: int) -> int:
        """How many ranks a prompt of ``n_tokens`` in ``num_chunks`` chunks shares in the lane (0: none)."""
        t = self.cfg.lane_threshold
        if not self.active or num_chunks < 2 or not self.free or (t is not None and n_tokens <= t):
            return 0
        g = self.cfg.lane_groups or self.W
        return min(g, self.W, num_chunks)

    def open(self, request_id: int, n_tokens: int, ranks: list) -> tuple:
        """Take a slot: returns ``(groups word, lane words)`` of the request's chunk messages."""
        slot = self.free.pop(0)
        self.seq += 1
        self.slot_of[request_id] = slot
        words = torch.tensor([self.seq, n_tokens, len(ranks), *ranks], dtype=torch.int64)
        return -(1 + slot), words

    def close(self, request_id: int, cancelled: bool = False) -> None:
        """The request finished (its result arrived: every put of its lane has landed, since the last chunk waited
        for all of them) or was ``cancelled``: its slot is free again. A finished lane's slot is reused first; a
        cancelled one's last, since a rank that has not yet seen the cancel may still put into it (the signals'
        sequence numbers tell lanes apart, but a late put's rows could overwrite a new lane's)."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            if cancelled:
                self.free.append(slot)
            else:
                self.free.insert(0, slot)


class LaneAborted(Exception):
    """A lane chunk's request was cancelled while the chunk waited for KV."""


class _Lane:
    """One lane request as an attention rank sees it."""

    def __init__(self, slot: int, seq: int, chunks: list, ranks: list, mine: int) -> None:
        self.slot, self.seq, self.chunks, self.ranks, self.left = slot, seq, chunks, ranks, mine

    def targets(self, j: int, me: int) -> list:
        """The other ranks that run a chunk after chunk ``j``."""
        g = len(self.ranks)
        return sorted({self.ranks[k % g] for k in range(j + 1, min(len(self.chunks), j + 1 + g))} - {me})


class LaneWait:
    """What a lane chunk's micro-batch yields while the latents of earlier chunks of one layer are missing."""

    def __init__(self, rank: "LaneRank", rid: int, lane: _Lane, layer: int, need: list) -> None:
        self.rank, self.rid, self.lane, self.layer, self.need = rank, rid, lane, layer, need

    def _idx(self, k: int) -> int:
        return self.rank.buf.index(self.lane.slot, self.layer, k)

    def ready(self) -> bool:
        """All the chunks' latents arrived (or the request was cancelled)."""
        if self.rid in self.rank.cancelled:
            return True
        comm, sig = self.rank.comm, self.rank.buf.sig
        while self.need and comm.signal_fetch(sig, self._idx(self.need[0])) == self.lane.seq:
            self.need.pop(0)
        return not self.need

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the first missing chunk (a dead PE raises ``PeerFailure``)."""
        if self.ready():
            return
        try:
            self.rank.comm.signal_wait_until(self.rank.buf.sig, self._idx(self.need[0]), "==", self.lane.seq,
                                             timeout=timeout_s)
        except CommTimeoutError:
            pass


class LaneRank:
    """An attention rank's side of the lane: takes lane chunks, waits for and imports earlier chunks' latents,
    puts its own chunks' latents to the later chunks' ranks."""

    def __init__(self, comm, cfg, model, buf: LaneBuffers, cancelled: set, spans: list) -> None:
        self.comm, self.cfg, self.model, self.buf, self.cancelled = comm, cfg, model, buf, cancelled
        self.spans = spans  # the rank's timeline: one "lane kv L<layer> req <id> -> <pe>" span per put
        self.hooks = model_hooks(model)
        self.lanes: dict = {}  # request -> _Lane
        self.puts = 0  # KV puts made (statistics)

    def take(self, chunk, groups: int, toks: torch.Tensor) -> tuple:
        """A chunk message with lane words (``groups < 0``): register the request; returns ``(its tokens,
        stride)`` for the micro-batcher."""
        seq, n_tokens, g = (int(x) for x in toks[:LANE_WORDS].tolist())
        ranks = [int(x) for x in toks[LANE_WORDS:LANE_WORDS + g].tolist()]
        rid = chunk.request_id
        if rid not in self.lanes:
            chunks = split_prompt(rid, n_tokens, self.cfg.effective_chunk_len)
            mine = sum(1 for k in range(len(chunks)) if ranks[k % g] == self.comm.rank)
            self.lanes[rid] = _Lane(-groups - 1, seq, chunks, ranks, mine)
        return toks[LANE_WORDS + g:].clone(), g

    def is_lane(self, rid: int) -> bool:
        return rid in self.lanes

    def can_start(self, chunk) -> bool:
        """Whether a chunk may start (``MicroBatcher.next_batch(ready=)``): not a lane chunk, or every earlier
        chunk that another rank computes has put its layer 0. So a started lane chunk only ever waits for chunks
        that have started too, down to chunk 0, which waits for nothing: two lane prompts sharing ranks cannot
        hold each other's ranks in a cycle of waits."""
        lane = self.lanes.get(chunk.request_id)
        if lane is None:
            return True
        return chunk_may_start(chunk.index, lane.ranks, self.comm.rank, lambda k: self.comm.signal_fetch(
            self.buf.sig, self.buf.index(lane.slot, 0, k)) == lane.seq)

    def before(self, chunk, cache, layer: int):
        """Generator, before the attention stage of ``layer`` of a lane chunk: wait for (yielding
        :class:`LaneWait`) and append the latents of the earlier chunks this rank did not compute."""
        lane = self.lanes[chunk.request_id]
        pos = cache.length(layer)
        if pos >= chunk.start:
            return
        need = [k for k in range(chunk.index) if lane.chunks[k].start >= pos]
        w = LaneWait(self, chunk.request_id, lane, layer, need)
        while not w.ready():
            yield w
        if chunk.request_id in self.cancelled:
            raise LaneAborted(chunk.request_id)
        rows = self.buf.kv[lane.slot, layer, pos:chunk.start].clone()
        self.model.append_kv_rows(cache, layer, rows)

    def after(self, chunk, cache, layer: int) -> None:
        """After the attention stage of ``layer`` of a lane chunk: put its latents to the later chunks' ranks."""
        lane = self.lanes[chunk.request_id]
        targets = lane.targets(chunk.index, self.comm.rank)
        if not targets or chunk.request_id in self.cancelled:
            return
        end = chunk.start + chunk.length
        rows = self.model.kv_rows(cache, layer, chunk.start, end).contiguous()
        dst = self.buf.kv[lane.slot, layer, chunk.start:end]
        idx = self.buf.index(lane.slot, layer, chunk.index)
        for pe in targets:
            t0 = time.monotonic()
            self.comm.put_signal(dst, rows, pe, self.buf.sig, idx, lane.seq, "set")
            self.hooks.hold_kv_put(chunk.length, t0, layer)
            self.puts += 1
            self.spans.append((self.comm.rank, 1, f"lane kv L{layer} req {chunk.request_id} -> {pe}", t0,
                               time.monotonic() - t0))

    def finished(self, chunk) -> bool:
        """A lane chunk of this rank completed: True when it was the rank's last one of the request (the lane
        entry is gone; the caller drops the request's cache)."""
        lane = self.lanes.get(chunk.request_id)
        if lane is None:
            return False
        lane.left -= 1
        if lane.left <= 0:
            del self.lanes[chunk.request_id]
            return True
        return False

    def drop(self, rid: int) -> None:
        """Forget a request (cancelled)."""
        self.lanes.pop(rid, None)
