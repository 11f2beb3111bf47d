"""Scheduling policies of the prefill runtime, shared with the cluster simulator.

Pure decision code: no processes, no clocks (callers pass ``now``), no I/O.
The runtime and ``asap_comm.sim`` make their placement, chunking and batching
decisions by calling these same objects (docs/design.md: the simulator reuses the
runtime's policies; only time is simulated).

Legend: A = attention ranks, T = tokens of a chunk, C = tokens already in a
request's KV cache.

* :func:`attention_cost`: the estimated work of prefilling a chunk (quadratic
  in the prompt, because of causal attention over the cached prefix).
* :func:`split_prompt`: optimization 3b, very long prompts become balanced
  chunks (prefilled in order against the request's cache).
* :class:`Placer`: optimization 3a, each request goes to the attention rank
  with the least outstanding estimated work (or round-robin, for ablation).
* :class:`MicroBatcher`: micro-batches of whole chunks under a token budget on
  one attention rank; a request never has two chunks in flight.
* :class:`ExpertBatcher`: optimization 4, an expert rank gathers rows of one
  layer from several attention ranks until a token budget or a deadline.
"""
from __future__ import annotations

import math

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

__all__ = ["attention_cost", "Chunk", "split_prompt", "split_equal_cost", "Placer", "MicroBatcher", "ExpertBatcher"]

LINEAR_WEIGHT = 512.0  # per-token work (projections, MLPs) in units of one query-key pair


def _int(fn: str, name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{fn}: {name}={v} must be >= {minimum}")
    return v


def attention_cost(num_tokens: int, cached: int = 0, linear_weight: float = LINEAR_WEIGHT) -> float:
    """Estimated work of prefilling ``num_tokens`` new tokens after ``cached`` ones (relative units).

    Causal attention pairs each new token i (1-based) with ``cached + i`` keys:
    ``T*C + T*(T+1)/2`` query-key pairs, plus ``linear_weight * T`` for the
    per-token work (projections, router, dense and shared MLPs). Only ratios
    matter: it ranks ranks by load, it is not a time.
    """
    _int("attention_cost", "num_tokens", num_tokens, 0)
    _int("attention_cost", "cached", cached, 0)
    return num_tokens * cached + num_tokens * (num_tokens + 1) / 2 + linear_weight * num_tokens


def check_linear_weight(fn: str, value) -> float:
    """``value`` as the placer's linear weight (None: :data:`LINEAR_WEIGHT`); a clear error if not a number >= 0."""
    if value is None:
        return LINEAR_WEIGHT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{fn}: linear_weight={value!r} must be None or a finite number >= 0")
    return float(value)


@dataclass(frozen=True)
class Chunk:
    """Tokens ``[start, start + length)`` of request ``request_id``; chunk ``index`` of ``num_chunks``."""

    request_id: int
    index: int
    start: int
    length: int
    num_chunks: int

    @property
    def last(self) -> bool:
        """The chunk whose completion completes the request (its last token yields the first output)."""
        return self.index == self.num_chunks - 1

    @property
    def cost(self) -> float:
        """:func:`attention_cost` of this chunk against the cache of the chunks before it."""
        return attention_cost(self.length, self.start)


def split_prompt(request_id: int, prompt_len: int, chunk_len: "int | None") -> list[Chunk]:
    """Split a prompt into ``ceil(prompt_len / chunk_len)`` contiguous chunks of near-equal length.

    Balanced rather than "full chunks then a remainder", so no chunk is tiny.
    ``chunk_len=None`` (splitting off) gives one chunk.
    """
    fn = "split_prompt"
    _int(fn, "prompt_len", prompt_len, 1)
    if chunk_len is None:
        return [Chunk(request_id, 0, 0, prompt_len, 1)]
    _int(fn, "chunk_len", chunk_len, 1)
    n = -(-prompt_len // chunk_len)
    base, extra = divmod(prompt_len, n)
    chunks, start = [], 0
    for i in range(n):
        length = base + (1 if i < extra else 0)
        chunks.append(Chunk(request_id, i, start, length, n))
        start += length
    return chunks


def split_equal_cost(request_id: int, prompt_len: int, num_chunks: int, linear_weight: float = LINEAR_WEIGHT,
                     max_len: "int | None" = None) -> list[Chunk]:
    """Split a prompt into ``num_chunks`` contiguous chunks of near-equal :func:`attention_cost` (each chunk's
    causal attention to the chunks before it plus ``linear_weight`` per token), so later chunks are shorter;
    none longer than ``max_len`` tokens (None: no bound), the rest of the cost then shared by the chunks after.

    For a long prompt the attention to earlier tokens is most of a chunk's work (``linear_weight`` is a few
    thousand query-key pairs a token on the profiles here, the context tens of thousands), so equal-length
    chunks grow costlier down the prompt, and in a sequence-pipelined lane the last, costliest chunk sets the
    pace. Each boundary in turn solves ``w*(e - s) + (e*e - s*s) / 2 = rest / chunks left``; every chunk has one
    token at least."""
    fn = "split_equal_cost"
    _int(fn, "prompt_len", prompt_len, 1)
    _int(fn, "num_chunks", num_chunks, 1)
    if max_len is not None:
        _int(fn, "max_len", max_len, 1)
    if num_chunks > prompt_len:
        raise ValueError(f"{fn}: num_chunks={num_chunks} is more than prompt_len={prompt_len} (a chunk needs a "
                         "token)")
    if max_len is not None and num_chunks * max_len < prompt_len:
        raise ValueError(f"{fn}: {num_chunks} chunks of at most max_len={max_len} tokens cannot hold "
                         f"prompt_len={prompt_len}")
    w = check_linear_weight(fn, linear_weight)
    cap = prompt_len if max_len is None else max_len

    def cost_to(e: float) -> float:
        return w * e + e * e / 2

    bounds = [0]
    for i in range(1, num_chunks):
        s, left = bounds[-1], num_chunks - i + 1  # chunks left, this one included
        share = (cost_to(prompt_len) - cost_to(s)) / left
        e = int(round(-w + math.sqrt((s + w) ** 2 + 2 * share)))
        # one token at least for this chunk and each after it; none past the cap, and room for the rest
        e = max(e, s + 1, prompt_len - (left - 1) * cap)
        e = min(e, s + cap, prompt_len - (left - 1))
        bounds.append(e)
    bounds.append(prompt_len)
    return [Chunk(request_id, i, bounds[i], bounds[i + 1] - bounds[i], num_chunks) for i in range(num_chunks)]


class Placer:
    """Front-end placement of requests on attention ranks.

    ``load_aware=True``: the rank with the least outstanding estimated work
    (sum of its unfinished chunks' :func:`attention_cost`), ties to the lowest
    rank. ``load_aware=False``: round-robin (the ablation baseline).
    ``linear_weight``: the per-token work in query-key pairs of
    :func:`attention_cost` (None: :data:`LINEAR_WEIGHT`; the simulator and the
    emulator derive it from their cost model, ``CostModel.placer_linear_weight``).
    """

    def __init__(self, num_ranks: int, *, load_aware: bool = True, linear_weight: "float | None" = None) -> None:
        self.num_ranks = _int("Placer", "num_ranks", num_ranks, 1)
        self.load_aware = load_aware
        self.linear_weight = check_linear_weight("Placer", linear_weight)
        self._work = [0.0] * num_ranks
        self._held: dict[int, tuple[list, float]] = {}  # request -> (its ranks, work on each)
        self._next = 0
        self._out: set = set()  # ranks taken out of placement (exclude)

    def exclude(self, rank: int) -> None:
        """Place nothing on ``rank`` from now on (its process died: attention failover); at least one rank stays."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"Placer.exclude: rank={rank!r} is out of range [0, {self.num_ranks})")
        if len(self._out | {rank}) >= self.num_ranks:
            raise ValueError(f"Placer.exclude: rank {rank} is the last one placement may use")
        self._out.add(rank)

    @property
    def ranks(self) -> list:
        """The ranks placement may use."""
        return [r for r in range(self.num_ranks) if r not in self._out]

    @property
    def outstanding(self) -> list[float]:
        """Estimated unfinished work per rank."""
        return list(self._work)

    def place(self, request_id: int, chunks: Iterable[Chunk]) -> int:
        """Choose the rank for a request (all its chunks go there: they share its KV cache)."""
        self._check_new("place", request_id)
        work = self._work_of(chunks)
        if self.load_aware:
            rank = min(self.ranks, key=lambda r: (self._work[r], r))
        else:
            while self._next in self._out:
                self._next = (self._next + 1) % self.num_ranks
            rank = self._next
            self._next = (self._next + 1) % self.num_ranks
        self._work[rank] += work
        self._held[request_id] = ([rank], work)
        return rank

    def place_group(self, request_id: int, chunks: Iterable[Chunk], groups: int) -> list[int]:
        """Context parallelism: the ``groups`` least-loaded ranks share a request (ties to the lowest rank,
        whatever ``load_aware`` says); its work counts ``1/groups`` on each. Returns the ranks, least loaded
        first (the first owns the request's cache and result)."""
        self._check_new("place_group", request_id)
        g = _int("Placer.place_group", "groups", groups, 1)
        if g > len(self.ranks):
            raise ValueError(f"Placer.place_group: groups={g} is more than the {len(self.ranks)} ranks")
        ranks = sorted(self.ranks, key=lambda r: (self._work[r], r))[:g]
        work = self._work_of(chunks) / g
        for r in ranks:
            self._work[r] += work
        self._held[request_id] = (ranks, work)
        return ranks

    def _work_of(self, chunks: Iterable[Chunk]) -> float:
        return sum(attention_cost(c.length, c.start, self.linear_weight) for c in chunks)

    def place_lane(self, request_id: int, chunks: list, groups: int) -> list[int]:
        """The long-prompt lane (``lane.py``): the ``groups`` least-loaded ranks (ties to the lowest rank) share a
        request's chunks round-robin, chunk ``j`` on ``ranks[j % groups]``, and its cost counts there. Returns
        the ranks, least loaded first."""
        self._check_new("place_lane", request_id)
        g = _int("Placer.place_lane", "groups", groups, 1)
        if g > len(self.ranks):
            raise ValueError(f"Placer.place_lane: groups={g} is more than the {len(self.ranks)} ranks")
        ranks = sorted(self.ranks, key=lambda r: (self._work[r], r))[:g]
        works = [0.0] * g
        for j, c in enumerate(chunks):
            works[j % g] += self._work_of([c])
        for r, w in zip(ranks, works):
            self._work[r] += w
        self._held[request_id] = (ranks, works)
        return ranks

    def _check_new(self, fn: str, request_id: int) -> None:
        if request_id in self._held:
            raise ValueError(f"Placer.{fn}: request {request_id} is already placed on rank(s) "
                             f"{self._held[request_id][0]}")

    def complete(self, request_id: int) -> int:
        """The request finished (or failed): its work leaves its rank(s). Returns the (first) rank."""
        held = self._held.pop(request_id, None)
        if held is None:
            raise ValueError(f"Placer.complete: request {request_id} is not placed")
        ranks, work = held
        works = work if isinstance(work, list) else [work] * len(ranks)
        for r, w in zip(ranks, works):
            self._work[r] = max(0.0, self._work[r] - w)
        return ranks[0]


class MicroBatcher:
    """Forms the micro-batches of one attention rank from its queued chunks.

    FIFO by arrival. A micro-batch holds whole chunks whose tokens sum to at
    most ``token_budget`` (a chunk longer than the budget goes alone). A
    request's chunks run in order, one at a time: a chunk is eligible only
    when its predecessor has completed (its keys must be in the cache), so a
    request never appears twice in one micro-batch or in two in flight.

    Urgent chunks (``add(..., urgent=True)``: the HTTP front end marks the calls of a client holding less than
    its equal share of the calls in flight) go first: while one is eligible, the next micro-batch holds urgent
    chunks only (FIFO among them), so a light client's call neither waits behind nor shares a micro-batch with
    a flooding client's; :meth:`urgent_ready` tells the rank to open a micro-batch for it at once.
    """

    def __init__(self, token_budget: int) -> None:
        self.token_budget = _int("MicroBatcher", "token_budget", token_budget, 1)
        self._queue: deque[Chunk] = deque()
        self._busy: dict[int, Chunk] = {}  # request -> its chunk in flight
        self._next_index: dict[int, int] = {}  # request -> index of its next chunk to run
        self._cancelled: set[int] = set()  # requests cancelled while a chunk of theirs was in flight
        self._stride: dict[int, int] = {}  # long-prompt lane request -> its stride on this rank (solo chunks)
        self._queued: dict[int, int] = {}  # request -> its chunks in the queue (no scan of the queue per add)
        self._urgent_ids: set[int] = set()  # id() of the urgent chunks in the queue

    def add(self, chunk: Chunk, stride: int = 1, urgent: bool = False) -> None:
        """Queue a chunk (a request's chunks must be added in index order). ``stride > 1``: a long-prompt lane's
        chunk; this rank runs every ``stride``-th chunk of the request from the first one added, and each
        such chunk runs alone in its micro-batch. ``urgent``: the chunk goes ahead of the others (class doc);
        a lane chunk cannot be urgent."""
        if urgent and stride > 1:
            raise ValueError(f"MicroBatcher.add: chunk {chunk.index} of request {chunk.request_id}: a long-prompt "
                             f"lane chunk (stride {stride}) cannot be urgent")
        rid = chunk.request_id
        queued = self._queued.get(rid, 0)
        if stride > 1 and rid not in self._next_index and not queued and rid not in self._busy:
            self._next_index[rid] = chunk.index
            self._stride[rid] = stride
        step = self._stride.get(rid, 1)
        expected = self._next_index.get(rid, 0)
        if chunk.index != expected + step * (queued + (1 if rid in self._busy else 0)):
            raise ValueError(f"MicroBatcher.add: chunk {chunk.index} of request {chunk.request_id} is out of order")
        self._queue.append(chunk)
        self._queued[rid] = queued + 1
        if urgent:
            self._urgent_ids.add(id(chunk))

    def _taken(self, c: Chunk) -> None:
        """``c`` leaves the queue for a micro-batch."""
        self._queue.remove(c)
        self._busy[c.request_id] = c
        n = self._queued.pop(c.request_id, 1) - 1
        if n > 0:
            self._queued[c.request_id] = n
        self._urgent_ids.discard(id(c))

    def _eligible_urgent(self, ready) -> list:
        """The urgent chunks that may run now (FIFO): one per request, its predecessor done, ``ready`` true."""
        if not self._urgent_ids:
            return []
        out, seen = [], set()
        for c in self._queue:
            rid = c.request_id
            if rid in self._busy or rid in seen:
                continue
            seen.add(rid)
            if id(c) in self._urgent_ids and (ready is None or ready(c)):
                out.append(c)
        return out

    def urgent_ready(self, ready=None) -> bool:
        """Whether an urgent chunk may run now (``ready``: as :meth:`next_batch`)."""
        return bool(self._eligible_urgent(ready))

    @property
    def pending_tokens(self) -> int:
        return sum(c.length for c in self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def next_batch(self, ready=None) -> list[Chunk]:
        """The next micro-batch (possibly empty): eligible chunks in FIFO order under the budget. ``ready(chunk)``
        (optional): False keeps a chunk (and its request's later ones) queued for now (the long-prompt lane's
        chunk whose predecessor has not started). While an urgent chunk may run, the batch holds urgent chunks
        only."""
        urgent = self._eligible_urgent(ready)
        if urgent:
            batch, tokens = [], 0
            for c in urgent:
                if batch and tokens + c.length > self.token_budget:
                    continue
                batch.append(c)
                tokens += c.length
                if tokens >= self.token_budget:
                    break
            for c in batch:
                self._taken(c)
            return batch
        batch, tokens, taken_requests = [], 0, set()
        for c in self._queue:
            if c.request_id in self._busy or c.request_id in taken_requests:
                continue  # waits for its predecessor
            if ready is not None and not ready(c):
                taken_requests.add(c.request_id)
                continue
            solo = c.request_id in self._stride
            if batch and (solo or tokens + c.length > self.token_budget):
                taken_requests.add(c.request_id)  # its later chunks must wait for this one
                continue  # does not fit; a smaller chunk of another request may
            batch.append(c)
            taken_requests.add(c.request_id)
            tokens += c.length
            if tokens >= self.token_budget or solo:
                break
        for c in batch:
            self._taken(c)
        return batch

    def next_batches(self, count: int, ready=None) -> list[list[Chunk]]:
        """Token-balanced micro-batches (``RuntimeConfig.token_balanced``), up to ``count`` at once: the eligible
        chunks in FIFO order up to ``count * token_budget`` tokens (one chunk per request, as :meth:`next_batch`),
        assigned whole, largest first, to the micro-batch with the fewest tokens that has room (a chunk longer
        than the budget only to an empty one; a lane chunk alone). The non-empty ones, fullest first. ``ready``:
        as :meth:`next_batch`."""
        _int("MicroBatcher.next_batches", "count", count, 1)
        if self._eligible_urgent(ready):  # urgent chunks first, in a micro-batch of their own
            first = self.next_batch(ready)
            return [first] + (self.next_batches(count - 1, ready) if count > 1 else [])
        picked, total, seen = [], 0, set()
        for c in self._queue:
            if c.request_id in self._busy or c.request_id in seen:
                continue
            seen.add(c.request_id)
            if ready is not None and not ready(c):
                continue
            if picked and total + c.length > count * self.token_budget:
                continue
            picked.append(c)
            total += c.length
            if total >= count * self.token_budget:
                break  # full: no later chunk fits
        bins: list = [[] for _ in range(count)]
        load, solo = [0] * count, [False] * count
        for c in sorted(picked, key=lambda c: -c.length):
            alone = c.request_id in self._stride
            fits = [b for b in range(count) if not solo[b] and (not bins[b] or (
                not alone and load[b] + c.length <= self.token_budget))]
            if not fits:
                continue
            b = min(fits, key=lambda b: (load[b], b))
            bins[b].append(c)
            load[b] += c.length
            solo[b] = alone
        out = sorted((b for b in bins if b), key=lambda b: -sum(c.length for c in b))
        order = {id(c): i for i, c in enumerate(picked)}  # picked in queue order
        for batch in out:
            batch.sort(key=lambda c: order[id(c)])  # FIFO inside a micro-batch
            for c in batch:
                self._taken(c)
        return out

    def cancel(self, request_id: int) -> list[Chunk]:
        """Drop a request's queued chunks (returned); a chunk of it in flight stays until :meth:`done`,
        after which the request is forgotten."""
        dropped = [c for c in self._queue if c.request_id == request_id]
        if dropped:
            self._queue = deque(c for c in self._queue if c.request_id != request_id)
            self._queued.pop(request_id, None)
            self._urgent_ids.difference_update(id(c) for c in dropped)
        if request_id in self._busy:
            self._cancelled.add(request_id)
        else:
            self._next_index.pop(request_id, None)
            self._stride.pop(request_id, None)
        return dropped

    def running(self, request_id: int) -> bool:
        """Whether a chunk of the request is in flight."""
        return request_id in self._busy

    def done(self, chunk: Chunk) -> None:
        """A chunk's micro-batch completed: the request's next chunk becomes eligible."""
        if self._busy.get(chunk.request_id) != chunk:
            raise ValueError(f"MicroBatcher.done: chunk {chunk.index} of request {chunk.request_id} is not in flight")
        rid = chunk.request_id
        del self._busy[rid]
        step = self._stride.get(rid, 1)
        if rid in self._cancelled or chunk.index + step >= chunk.num_chunks:  # cancelled, or this rank's last
            self._cancelled.discard(rid)
            self._next_index.pop(rid, None)
            self._stride.pop(rid, None)
        else:
            self._next_index[rid] = chunk.index + step


@dataclass
class _Pending:
    rows: int
    since: float
    items: list


class ExpertBatcher:
    """When an expert rank computes, and on what (optimization 4).

    Rows arriving for a layer are held until that layer has ``token_budget``
    rows or its oldest rows have waited ``deadline_s``; then the whole layer
    is taken at once (one expert matmul per expert instead of one per
    micro-batch). ``enabled=False`` (ablation) gathers nothing: every arrival
    is computed on its own, oldest first, at once (one item per :meth:`take`;
    what arrived meanwhile waits its turn, as without optimization 4).
    """

    def __init__(self, token_budget: int, deadline_s: float, *, enabled: bool = True) -> None:
        self.token_budget = _int("ExpertBatcher", "token_budget", token_budget, 1)
        if not deadline_s >= 0:
            raise ValueError(f"ExpertBatcher: deadline_s={deadline_s!r} must be >= 0")
        self.deadline_s = float(deadline_s)
        self.enabled = enabled
        self._layers: dict[int, _Pending] = {}
        self._fifo: deque = deque()  # enabled=False: (layer, rows, item) in arrival order

    def add(self, layer: int, rows: int, item: Any, now: float) -> None:
        """Hold ``item`` (``rows`` rows of ``layer``) that arrived at time ``now``."""
        if not self.enabled:
            self._fifo.append((layer, rows, item))
            return
        p = self._layers.get(layer)
        if p is None:
            self._layers[layer] = _Pending(rows, now, [item])
        else:
            p.rows += rows
            p.items.append(item)

    def ready(self, now: float) -> "int | None":
        """The layer to compute now, or None to keep gathering.

        A layer at its token budget first (most rows), else the layer whose
        oldest rows passed the deadline (oldest first), else None.
        """
        if not self.enabled:
            return self._fifo[0][0] if self._fifo else None
        if not self._layers:
            return None
        full = [layer for layer, p in self._layers.items() if p.rows >= self.token_budget]
        if full:
            return max(full, key=lambda layer: self._layers[layer].rows)
        layer = min(self._layers, key=lambda layer: self._layers[layer].since)
        return layer if now - self._layers[layer].since >= self.deadline_s else None

    def poll(self, now: float) -> tuple:
        """``(ready(now), wait_s(now))`` in one pass over the held layers (the simulator asks both at every
        arrival)."""
        if not self.enabled:
            layer = self.ready(now)
            return layer, (0.0 if layer is not None else self.wait_s(now))
        if not self._layers:
            return None, None
        budget = self.token_budget
        full, full_rows, oldest, since = None, -1, None, None
        for layer, p in self._layers.items():  # ties: the first, as max() and min() in ready()
            if p.rows >= budget and p.rows > full_rows:
                full, full_rows = layer, p.rows
            if since is None or p.since < since:
                oldest, since = layer, p.since
        if full is not None:
            return full, 0.0
        if now - since >= self.deadline_s:
            return oldest, 0.0
        return None, max(0.0, since + self.deadline_s - now)

    def take(self, layer: int) -> list:
        """Remove and return everything held for ``layer`` (in arrival order); with ``enabled=False`` only its
        oldest item."""
        if not self.enabled:
            for i, (lay, _rows, item) in enumerate(self._fifo):
                if lay == layer:
                    del self._fifo[i]
                    return [item]
            return []
        p = self._layers.pop(layer, None)
        return [] if p is None else p.items

    def wait_s(self, now: float) -> "float | None":
        """How long the caller may wait for more arrivals before something becomes ready (None: nothing held)."""
        if not self.enabled:
            return 0.0 if self._fifo else None
        if not self._layers:
            return None
        if self.ready(now) is not None:
            return 0.0
        oldest = min(p.since for p in self._layers.values())
        return max(0.0, oldest + self.deadline_s - now)

    @property
    def held(self) -> bool:
        """Whether anything is held."""
        return bool(self._layers) or bool(self._fifo)

    @property
    def held_rows(self) -> int:
        return sum(p.rows for p in self._layers.values()) + sum(r for _, r, _ in self._fifo)

