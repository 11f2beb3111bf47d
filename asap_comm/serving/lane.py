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

Buffers (:class:`LaneBuffers`, symmetric, on every PE of an async group): a
pool of :func:`lane_tokens` rows per layer for the received latents
(``[num_layers, lane_tokens, kv_row_width]``) and one signal per (slot, layer,
chunk) of ``lane_slots`` slots. The front end (:class:`FrontLane`,
:class:`LanePool`) gives each lane a slot and a contiguous range of pool rows
as long as its prompt; while no slot or no range is free, a prompt that wants
the lane waits for one, first come first served (a prompt longer than the pool
never takes the lane). So an attention die holds at most ``lane_tokens`` rows
of other ranks' latents per layer, whatever the lanes' lengths: the figure the
memory model charges. Signals hold the lane's sequence number, not a count, so
a slot is reused without resetting anything. A chunk message of the lane
carries ``groups = -(1 + slot)`` and, before its tokens, ``[seq, prompt
length, first pool row, g, ranks...]`` (:data:`LANE_WORDS` + ``g`` words).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..errors import TimeoutError as CommTimeoutError
from .hooks import model_hooks
from .policies import check_linear_weight, split_equal_cost, split_prompt

__all__ = ["LANE_WORDS", "lane_active", "lane_slots", "lane_tokens", "lane_split", "lane_groups", "chunk_may_start",
           "LanePool", "LaneBuffers", "FrontLane", "LaneRank", "LaneWait", "LaneAborted"]

LANE_WORDS = 4  # seq, prompt length, first row in the KV pool, number of ranks (then the ranks)


def lane_active(cfg, info) -> bool:
    """Whether a group with ``cfg`` runs the long-prompt lane: switched on, chunking on (``load_aware``), at
    least 2 attention ranks, and a model whose KV row width is known (``ModelInfo.kv_row_width``)."""
    return (cfg.long_prompt_lane and cfg.effective_chunk_len is not None and cfg.num_attention_ranks >= 2
            and info.kv_row_width > 0 and min(cfg.max_prompt_len, lane_tokens(cfg)) > cfg.effective_chunk_len)


def lane_groups(cfg, ranks: int, num_chunks: int) -> int:
    """How many of ``ranks`` attention ranks a lane prompt of ``num_chunks`` equal-length chunks shares:
    ``lane_groups`` (0: all) and no more than its chunks, or twice them with ``lane_chunks="cost"``."""
    want = 2 * num_chunks if cfg.lane_chunks == "cost" else num_chunks
    return min(cfg.lane_groups or ranks, ranks, want)


def lane_split(cfg, request_id: int, n_tokens: int, groups: int, linear_weight: "float | None" = None) -> list:
    """The chunks of a lane prompt of ``n_tokens`` on ``groups`` ranks (chunk ``j`` on the ``j % groups``-th):
    ``lane_chunks="tokens"``, ``split_prompt`` (near-equal lengths of at most ``chunk_len``); ``"cost"``, two per
    rank (at least as many as ``split_prompt`` gives) of near-equal attention cost, later ones shorter, none
    longer than ``chunk_len`` (``split_equal_cost``; ``linear_weight``: the placer's, None: the config's). The
    front end and every lane rank call it with the same arguments, so they agree on every chunk."""
    chunks = split_prompt(request_id, n_tokens, cfg.effective_chunk_len)
    if cfg.lane_chunks == "tokens":
        return chunks
    w = check_linear_weight("lane_split", cfg.placer_linear_weight if linear_weight is None else linear_weight)
    n = min(n_tokens, max(len(chunks), 2 * groups))
    return split_equal_cost(request_id, n_tokens, n, w, max_len=cfg.effective_chunk_len)


def lane_slots(cfg) -> int:
    """Lane slots per PE: at most as many long prompts run in the lane at once (their signals)."""
    return 8


def lane_tokens(cfg) -> int:
    """Rows per layer of every PE's lane KV pool: the prompt tokens the lanes in flight hold together at most
    (``RuntimeConfig.lane_tokens``; None: ``max_prompt_len``)."""
    return cfg.max_prompt_len if cfg.lane_tokens is None else cfg.lane_tokens


class LanePool:
    """The lanes' admission: ``slots`` slots and a pool of ``rows`` rows, each lane a slot and a contiguous range
    as long as its prompt (first fit). The runtime's front end and the simulator's lane both admit with it.

    A cancelled lane's slot and rows are reused last: a rank that has not seen the cancel yet may still put
    into them (the signals' sequence numbers tell lanes apart, but a late put's rows could overwrite a new
    lane's), so they are taken again only when nothing else is free."""

    def __init__(self, slots: int, rows: int) -> None:
        self.rows = rows
        self.free = list(range(slots))
        self.spans: dict = {}  # request -> (slot, first row, rows)
        self.stale: list = []  # (first row, rows) of cancelled lanes, oldest first: reused last

    def _first_fit(self, n: int, taken: list) -> "int | None":
        at = 0
        for b, m in sorted(taken):
            if b - at >= n:
                return at
            at = max(at, b + m)
        return at if self.rows - at >= n else None

    def _place(self, n: int) -> "int | None":
        live = [(b, m) for _, b, m in self.spans.values()]
        at = self._first_fit(n, live + self.stale)
        while at is None and self.stale:
            self.stale.pop(0)
            at = self._first_fit(n, live + self.stale)
        return at

    def fits(self, n: int) -> bool:
        """A lane of ``n`` tokens could open now."""
        return bool(self.free) and self._place(n) is not None

    def open(self, request_id: int, n: int) -> tuple:
        """Take a slot and ``n`` rows (``fits(n)`` must hold): ``(slot, first row)``."""
        at = self._place(n)
        if not self.free or at is None:
            raise RuntimeError(f"LanePool.open: no room for a lane of {n} tokens")
        slot = self.free.pop(0)
        self.spans[request_id] = (slot, at, n)
        return slot, at

    def close(self, request_id: int, cancelled: bool = False) -> bool:
        """Free the request's slot and rows; False if it held none."""
        span = self.spans.pop(request_id, None)
        if span is None:
            return False
        slot, at, n = span
        if cancelled:
            self.free.append(slot)
            self.stale.append((at, n))
        else:
            self.free.insert(0, slot)
        return True

    @property
    def tokens(self) -> int:
        """Rows the lanes in flight hold."""
        return sum(m for _, _, m in self.spans.values())


def chunk_may_start(index: int, ranks: list, me: int, has_put) -> bool:
    """The lane's start rule for chunk ``index`` of a prompt whose chunk ``k`` runs on ``ranks[k % len(ranks)]``, on
    rank ``me``: every earlier chunk another rank computes has put its layer 0 (``has_put(k)``), down to the last
    one ``me`` ran (it started, and so had every chunk before it). ``LaneRank.can_start`` and the simulator's lane
    (``asap_comm.sim.core.lane``) both decide with it."""
    g = len(ranks)
    for k in range(index - 1, -1, -1):
        if ranks[k % g] == me:
            return True
        if not has_put(k):
            return False
    return True


def _max_chunks(cfg) -> int:
    n = -(-cfg.max_prompt_len // cfg.effective_chunk_len)
    if cfg.lane_chunks == "cost":  # two per lane rank when that is more
        n = max(n, 2 * min(cfg.lane_groups or cfg.num_attention_ranks, cfg.num_attention_ranks))
    return n


class LaneBuffers:
    """Collective: the lane's symmetric KV slots and signals (every PE of the group allocates them)."""

    def __init__(self, comm, cfg, info) -> None:
        self.slots, self.layers, self.chunks = lane_slots(cfg), info.num_layers, _max_chunks(cfg)
        # not zeroed: a row is read only after its signal says it was written, and pages nobody writes (the
        # front end's, the expert ranks', a short run's) are never touched
        self.kv = comm.empty((self.layers, lane_tokens(cfg), info.kv_row_width), info.dtype)
        self.sig = comm.signals(self.slots * self.layers * self.chunks)

    def index(self, slot: int, layer: int, chunk: int) -> int:
        return (slot * self.layers + layer) * self.chunks + chunk


class LaneCounts:
    """What the lane's admission did in a run (the runtime's front end and the simulator's lane keep one each):
    lanes ``opened``, prompts that found no room on arrival and ``waited``, those that waited ``lane_wait_s`` and
    ``gave_up`` (ran on one rank), and how long the opened ones waited (seconds, mean and max)."""

    def __init__(self) -> None:
        self.opened = self.waited = self.gave_up = 0
        self.wait_s: list = []  # per opened lane: seconds from arrival to open

    def open(self, waited_s: float) -> None:
        self.opened += 1
        self.wait_s.append(max(0.0, waited_s))

    def as_dict(self) -> dict:
        w = self.wait_s
        return {"opened": self.opened, "waited": self.waited, "gave_up": self.gave_up,
                "wait_s_mean": sum(w) / len(w) if w else 0.0, "wait_s_max": max(w, default=0.0)}


class FrontLane:
    """The front end's side: which prompt takes the lane, its slot, pool rows, ranks and chunk messages' words,
    and the prompts that wait for room (``waiting``: the front end's entries, first come first served)."""

    def __init__(self, cfg, info, num_targets: int, *, enabled: bool = True) -> None:
        """``enabled=False``: never (the baseline's front end)."""
        self.cfg, self.W = cfg, num_targets
        self.active = enabled and num_targets >= 2 and lane_active(cfg, info)
        self.pool = LanePool(lane_slots(cfg) if self.active else 0, lane_tokens(cfg) if self.active else 0)
        self.seq = 0
        self.counts = LaneCounts()  # opened, waited, gave up (the run's summary: RunResult.lane)
        self.waiting: deque = deque()

    @property
    def free(self) -> list:
        return self.pool.free

    def wants(self, n_tokens: int, num_chunks: int) -> bool:
        """Whether a prompt of ``n_tokens`` in ``num_chunks`` chunks goes to the lane (now or once there is room):
        two chunks or more, longer than ``lane_threshold`` and no longer than the pool."""
        t = self.cfg.lane_threshold
        return (self.active and self.W >= 2 and num_chunks >= 2 and n_tokens <= self.pool.rows
                and (t is None or n_tokens > t))

    def lose_rank(self, live: int) -> None:
        """An attention rank died (attention failover): lanes open on the ``live`` ranks left; with fewer than 2,
        none opens any more."""
        self.W = live

    def groups(self, num_chunks: int) -> int:
        """How many ranks a lane prompt of ``num_chunks`` equal-length chunks shares (:func:`lane_groups`)."""
        return lane_groups(self.cfg, self.W, num_chunks)

    def fits(self, n_tokens: int) -> bool:
        """A lane of ``n_tokens`` could open now, and none waits before it."""
        return not self.waiting and self.pool.fits(n_tokens)

    def groups_for(self, n_tokens: int, num_chunks: int) -> int:
        """How many ranks the prompt shares in the lane if it may open one now (0: not now or never)."""
        if not self.wants(n_tokens, num_chunks) or not self.fits(n_tokens):
            return 0
        return self.groups(num_chunks)

    def open(self, request_id: int, n_tokens: int, ranks: list) -> tuple:
        """Take a slot and rows: returns ``(groups word, lane words)`` of the request's chunk messages."""
        slot, base = self.pool.open(request_id, n_tokens)
        self.seq += 1
        words = torch.tensor([self.seq, n_tokens, base, len(ranks), *ranks], dtype=torch.int64)
        return -(1 + slot), words

    def close(self, request_id: int, cancelled: bool = False) -> None:
        """The request finished (its result arrived: every put of its lane has landed, since the last chunk waited
        for all of them) or was ``cancelled``: its slot and rows are free again (a cancelled one's last:
        :class:`LanePool`)."""
        self.pool.close(request_id, cancelled)


class LaneAborted(Exception):
    """A lane chunk's request was cancelled while the chunk waited for KV."""


class _Lane:
    """One lane request as an attention rank sees it."""

    def __init__(self, slot: int, seq: int, base: int, chunks: list, ranks: list, mine: int) -> None:
        self.slot, self.seq, self.base, self.chunks, self.ranks, self.left = slot, seq, base, chunks, ranks, mine

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
        seq, n_tokens, base, g = (int(x) for x in toks[:LANE_WORDS].tolist())
        ranks = [int(x) for x in toks[LANE_WORDS:LANE_WORDS + g].tolist()]
        rid = chunk.request_id
        if rid not in self.lanes:
            chunks = lane_split(self.cfg, rid, n_tokens, g)
            mine = sum(1 for k in range(len(chunks)) if ranks[k % g] == self.comm.rank)
            self.lanes[rid] = _Lane(-groups - 1, seq, base, chunks, ranks, mine)
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
        rows = self.buf.kv[layer, lane.base + pos:lane.base + chunk.start].clone()
        self.model.append_kv_rows(cache, layer, rows)

    def after(self, chunk, cache, layer: int) -> None:
        """After the attention stage of ``layer`` of a lane chunk: put its latents to the later chunks' ranks."""
        lane = self.lanes[chunk.request_id]
        targets = lane.targets(chunk.index, self.comm.rank)
        if not targets or chunk.request_id in self.cancelled:
            return
        end = chunk.start + chunk.length
        rows = self.model.kv_rows(cache, layer, chunk.start, end).contiguous()
        dst = self.buf.kv[layer, lane.base + chunk.start:lane.base + end]
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
