"""The front end shared by the asynchronous runtime and the synchronous baseline.

It owns the request queue: replays arrivals in real time, rejects bad
requests, places requests on the ranks that run attention (``Placer``, with
``split_prompt`` for long prompts), sends their chunks through mailboxes and
collects each request's result (first token, final hidden state). Both
runtimes use it unchanged, so they differ only in how the workers run
(the workers' side of the chunk protocol: ``worker.py``).
"""
from __future__ import annotations

import pickle
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from .failover import READMIT_BASE, FrontAttention, FrontFailover
from .metrics import RequestRecord
from .lane import FrontLane, lane_split
from .patience import DeathWatch
from .policies import Placer, split_prompt
from .protocol import CANCEL, HDR, STOP, PromptRequest, decode_result, encode_cancel, encode_chunk, mark_urgent, request_mailbox
from .worker import FAILED, decode_failure
from .worker import ChunkTaker, layer_loop  # noqa: F401  (moved to worker.py; the README names them here)

__all__ = ["STOP", "HDR", "request_mailbox", "FrontEnd", "RankQueue", "Rejected", "Completion", "run_front_end",
           "replay_report", "validate", "Replay"]


def validate(req, info, cfg) -> "str | None":
    """Why a request must be rejected, or None."""
    t = req.token_ids
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        return "prompt must be a 1-D tensor of token ids"
    if t.numel() == 0:
        return "empty prompt"
    if t.numel() > cfg.max_prompt_len:
        return f"prompt of {t.numel()} tokens is longer than max_prompt_len={cfg.max_prompt_len}"
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= info.vocab_size:
        return f"token id out of the vocabulary [0, {info.vocab_size}): min {lo}, max {hi}"
    return None


class Rejected(Exception):
    """The front end refused a request. ``kind``: ``"invalid"`` (bad input: HTTP 400), ``"overloaded"``
    (over the admission bound: 429, ``retry_after_s``) or ``"unavailable"`` (a worker failed or the
    service is stopping: 503)."""

    def __init__(self, kind: str, reason: str, retry_after_s: float = 0.0) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.retry_after_s = kind, reason, retry_after_s


@dataclass
class Completion:
    """A request's result, as the front end received it."""

    request_id: int
    token: int
    hidden: torch.Tensor
    rank: int  # the attention rank (async) or worker (sync) that computed it
    queue_s: float  # admission to its last chunk entering the rank's inbox
    done_s: float  # admission to the result's arrival (server-side TTFT)
    tokens: int = 0  # its prompt tokens
    error: "str | None" = None  # set: the request failed alone (no token, an empty hidden state), for this reason


READMIT_LIMIT = 1  # attention failover: re-admissions of one request; a request in flight at a further death fails


@dataclass
class _Admitted:
    """The front end's record of an admitted request."""

    rank: int  # the rank (the first of its context-parallel group) that runs it
    tokens: int
    mask: int  # context-parallel group mask (0: none)
    admitted_at: float
    unsent: int  # chunks not yet in the rank's inbox
    chunks: int
    queue_s: "float | None" = None  # admission until its last chunk entered the inbox
    lane: tuple = ()  # the long-prompt lane's ranks (chunk j on lane[j % len(lane)]; empty: not in the lane)
    waiting: bool = False  # waits for room in the lane (rank -1 until its lane opens)
    token_ids: "torch.Tensor | None" = None  # its prompt (a reference), kept until its result: re-admission
    wire: int = -1  # the id its chunks, cancels and result carry now (the request id; a re-admission's: a new one)
    wires: tuple = ()  # the wire ids of its re-admissions (attention failover), forgotten with it
    client: "str | None" = None  # who sent it (the HTTP service's fairness key; None: the trace replay)
    started: tuple = ()  # the ranks that have a chunk of its current attempt (counted in FrontEnd.rank_calls)


class RankQueue:
    """One attention rank's messages not yet in its inbox (``FrontEnd.pending[rank]``): entries ``(request id or
    None, payload, tag, queued at)``.

    Control messages (request id None) go first: one put with :meth:`appendleft` (expert failover's routes) ahead
    of those appended (cancels); :data:`STOP` goes last, once no chunk is left. Chunks queue by *key* (the
    request's client; None: no client, a long-prompt lane's or a context-parallel chunk), first come first served
    within a key; the next chunk is the head of the key with the fewest requests in flight (``standing``), the
    keys taking turns among equals, one chunk each (:meth:`peek`). With one key (the trace replay: no client)
    that is first come first served, as one queue. Iteration: the control messages, then the chunks in the order
    they were queued, then the stop message."""

    def __init__(self) -> None:
        self.head: deque = deque()  # control messages
        self.tail: deque = deque()  # the stop message
        self.queues: dict = {}  # key -> deque of (seq, entry)
        self.turn: deque = deque()  # keys with chunks, the next to be served first
        self.chunks = 0
        self._seq = 0
        self._chosen = None  # what peek returned: ("head", None) or ("chunk", key)

    def __len__(self) -> int:
        return len(self.head) + self.chunks + len(self.tail)

    def __iter__(self):
        yield from self.head
        yield from (e for _, e in sorted(x for q in self.queues.values() for x in q))
        yield from self.tail

    def append(self, entry: tuple, key=None) -> None:
        """Queue a message: a chunk (request id not None) last among ``key``'s; a control message after the
        others (the stop message after everything)."""
        if entry[0] is None:
            (self.tail if entry[2] == STOP else self.head).append(entry)
            return
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = deque()
            self.turn.append(key)
        self._seq += 1
        q.append((self._seq, entry))
        self.chunks += 1

    def appendleft(self, entry: tuple) -> None:
        """Queue a control message ahead of every other message."""
        if entry[0] is not None:
            raise ValueError(f"RankQueue.appendleft: request {entry[0]}'s chunk; only control messages go first")
        self.head.appendleft(entry)

    def clear(self) -> None:
        self.head.clear()
        self.tail.clear()
        self.queues.clear()
        self.turn.clear()
        self.chunks = 0

    def drop(self, rid: int) -> None:
        """Take out every chunk of request ``rid``."""
        for key in list(self.queues):
            q = self.queues[key]
            kept = deque(x for x in q if x[1][0] != rid)
            if len(kept) != len(q):
                self.chunks -= len(q) - len(kept)
                self._set(key, kept)

    def _set(self, key, q: deque) -> None:
        if q:
            self.queues[key] = q
        else:
            del self.queues[key]
            self.turn.remove(key)

    def peek(self, may_start=None, standing=None) -> "tuple | None":
        """The next message to send, or None: a control message first; else the chunk at the head of the key with
        the least ``standing(key)`` (first in turn among equals; every key 0 without ``standing``) among those
        for which ``may_start(entry, key)`` is true (all of them without ``may_start``); else the stop message
        once no chunk is left. :meth:`pop` takes out what this returned."""
        if self.head:
            self._chosen = ("head", None)
            return self.head[0]
        found, best, best_standing = False, None, 0  # (a key may be None)
        for key in self.turn:
            entry = self.queues[key][0][1]
            if may_start is not None and not may_start(entry, key):
                continue  # not now
            st = 0 if standing is None else standing(key, 0)
            if not found or st < best_standing:
                found, best, best_standing = True, key, st
                if standing is None:
                    break
        if found:
            self._chosen = ("chunk", best)
            return self.queues[best][0][1]
        if self.tail and not self.chunks:
            self._chosen = ("tail", None)
            return self.tail[0]
        self._chosen = None
        return None

    @property
    def chosen_key(self):
        """The key of the chunk :meth:`peek` returned last (None: a control message, or a chunk of no client)."""
        return self._chosen[1] if self._chosen is not None else None

    def pop(self) -> None:
        """Take out the message :meth:`peek` returned last; a chunk's key's turn is over."""
        where, key = self._chosen
        self._chosen = None
        if where == "head":
            self.head.popleft()
        elif where == "tail":
            self.tail.popleft()
        else:
            q = self.queues[key]
            q.popleft()
            self.chunks -= 1
            if self.turn[0] == key:
                self.turn.popleft()
            else:
                self.turn.remove(key)
            if q:
                self.turn.append(key)  # its turn is over
            else:
                del self.queues[key]


class FrontEnd:
    """The admission path of both runtimes, used by the trace replay and by the HTTP service alike.

    One thread owns it. :meth:`admit` validates a request (``Rejected("invalid")``),
    bounds the admitted-but-unfinished prompt tokens (``max_queued_tokens``;
    ``Rejected("overloaded")``), places it (``Placer``; long prompts split by
    ``split_prompt``; the baseline's context-parallel groups) and queues its
    chunk messages. :meth:`pump` moves queued chunks into the ranks' inboxes
    without ever blocking on a full one, and returns the results that arrived;
    it raises ``PeerFailure`` when a PE the group needs died. :meth:`cancel`
    forgets a request, drops its chunks not yet sent and tells its rank to
    drop the rest. :meth:`stop` sends every rank the stop message.

    Per client (the HTTP service names each request's ``client`` in :meth:`admit`): each rank's queue
    (:class:`RankQueue`) sends first the chunk of the client with the fewest requests in flight (the clients
    taking turns among equals), not first come first served; and
    with ``max_rank_calls`` a rank holds at most that many requests with a chunk sent and no result yet (a
    request's further chunks always go: only its first chunk on a rank waits). The rank takes every chunk in its
    inbox into its micro-batcher at once, first come first served, so the turns decide the order only for what
    the front end holds back: the bound keeps what waits in the front end, where the turns apply. What decides
    the order at the rank is the urgent mark (:meth:`_light`): a chunk sent for a client holding fewer calls in
    flight than an equal share runs ahead of the others there (``MicroBatcher``, ``RuntimeConfig.urgent_slot``).
    """

    def __init__(self, comm, cfg, info, box, num_targets: int, label: str,
                 max_queued_tokens: "int | None" = None, max_rank_calls: "int | None" = None) -> None:
        self.comm, self.cfg, self.info, self.box, self.W, self.label = comm, cfg, info, box, num_targets, label
        if max_rank_calls is not None and not (isinstance(max_rank_calls, int) and max_rank_calls >= 1):
            raise ValueError(f"FrontEnd: max_rank_calls={max_rank_calls!r} must be an int >= 1 or None")
        self.max_queued_tokens, self.max_rank_calls = max_queued_tokens, max_rank_calls
        self.placer = Placer(num_targets, load_aware=cfg.load_aware, linear_weight=cfg.placer_linear_weight)
        self.pending = [RankQueue() for _ in range(num_targets)]  # per rank: [request id, payload, tag, queued at]
        self.rank_calls = [0] * num_targets  # per rank: requests with a chunk sent there and no result yet
        self.client_calls: dict = {}  # client (None: none given) -> its requests in flight
        self.inflight: dict = {}  # request -> _Admitted
        self.queued_tokens = 0
        # a worker that dies, or leaves before stop() told it to (it gave up), fails the group; with spare expert
        # PEs an expert PE's death is the failover's (failover.py) until no spare is left
        self.failover = None
        watched = range(comm.world_size)
        if label == "async" and cfg.spare_expert_ranks:
            self.failover = FrontFailover(comm, cfg, box, self.pending)
            watched = [pe for pe in watched if pe not in self.failover.pes]
        # with attention failover, an attention PE's death is the front end's to survive (_attention_check)
        self.attention = None
        if label == "async" and getattr(cfg, "attention_failover", False):
            self.attention = FrontAttention(comm, num_targets)
            watched = [pe for pe in watched if pe >= num_targets]
        self.alias: dict = {}  # wire id of a re-admission -> its request id
        self.poisoned: list = []  # Completions with an error: requests over READMIT_LIMIT, for the next pump
        self._next_wire = READMIT_BASE
        self._dead_seen = False  # a send found an attention PE dead: look at the states now, not in 10 ms
        self.watch = DeathWatch(comm, watched, must_stay=watched)
        self._cp = cfg.cp_threshold if label == "sync" else None
        self.lane = FrontLane(cfg, info, num_targets, enabled=label == "async")  # the long-prompt lane (lane.py)

    def admit(self, request_id: int, token_ids: torch.Tensor, check_bound: bool = True,
              client: "str | None" = None) -> int:
        """Admit a request or raise :class:`Rejected`; returns the rank it was placed on (-1: it waits for room in
        the long-prompt lane, placed when a lane closes). A request is over
        the bound only if others are in flight (a lone one always fits); ``check_bound=False``: the caller
        has decided already (the HTTP service admits a batch whole or not at all). ``client``: who sent it (its
        chunks take turns with other clients' on their rank; None: first come first served)."""
        error = validate(PromptRequest(request_id, 0.0, token_ids), self.info, self.cfg)
        if error is not None:
            raise Rejected("invalid", error)
        if request_id in self.inflight:
            raise Rejected("invalid", f"request id {request_id} is already in flight")
        if request_id >= READMIT_BASE:
            raise Rejected("invalid", f"request id {request_id} is in the range of re-admitted requests' wire ids "
                                      f"(>= {READMIT_BASE})")
        n = int(token_ids.numel())
        bound = self.max_queued_tokens
        if check_bound and bound is not None and self.queued_tokens + n > bound and self.inflight:
            raise Rejected("overloaded", f"{self.queued_tokens} prompt tokens are in flight; {n} more would pass "
                                         f"the admission bound of {bound}")
        chunks = split_prompt(request_id, n, self.cfg.effective_chunk_len)
        cp, W = self._cp, self.W
        if self.lane.wants(n, len(chunks)):  # the long-prompt lane, now or once it has room
            now = time.monotonic()
            self.inflight[request_id] = _Admitted(-1, n, 0, now, len(chunks), len(chunks), waiting=True,
                                                  token_ids=token_ids, wire=request_id, client=client)
            self.client_calls[client] = self.client_calls.get(client, 0) + 1
            self.queued_tokens += n
            self.lane.waiting.append((request_id, token_ids, chunks))
            self._open_lanes()
            if self.inflight[request_id].waiting:  # no room now: it waits (at most lane_wait_s)
                self.lane.counts.waited += 1
            return self.inflight[request_id].rank
        if cp is not None and n > cp and W > 1:  # context parallelism: the least-loaded groups share it
            groups = self.placer.place_group(request_id, chunks, min(W, -(-n // cp)))
            rank, mask = groups[0], sum(1 << j for j in groups)
        else:
            rank, mask = self.placer.place(request_id, chunks), 0
        now = time.monotonic()
        self.inflight[request_id] = _Admitted(rank, n, mask, now, len(chunks), len(chunks), token_ids=token_ids,
                                              wire=request_id, client=client)
        self.client_calls[client] = self.client_calls.get(client, 0) + 1
        self._queue_chunks(request_id, token_ids, chunks, rank, mask, now)
        self.queued_tokens += n
        return rank

    def _queue_chunks(self, request_id: int, token_ids: torch.Tensor, chunks: list, rank: int, mask: int,
                      now: float) -> None:
        """Queue a request's chunks for ``rank`` (each chunk carries its wire id: the request id, or a
        re-admission's), in turn with other clients' (a context-parallel request's: first come first served)."""
        a = self.inflight.get(request_id)
        key = a.client if a is not None and mask == 0 else None
        for c in chunks:
            self.pending[rank].append((request_id, encode_chunk(c, token_ids[c.start:c.start + c.length], mask),
                                       c.request_id, now), key)

    def _lane_give_up(self, now: "float | None" = None) -> None:
        """``RuntimeConfig.lane_wait_s``: a prompt that has waited that long for room in the lane runs the usual
        way, on the least-loaded attention rank (its wait counts in its TTFT; the simulator's lane does the same)."""
        wait = self.cfg.lane_wait_s
        if wait is None or not self.lane.waiting:
            return
        now = time.monotonic() if now is None else now
        keep = deque()
        for entry in self.lane.waiting:
            a = self.inflight.get(entry[0])
            if a is not None and now - a.admitted_at >= wait:
                request_id, token_ids, chunks = entry
                a.rank = self.placer.place(request_id, chunks)
                a.waiting = False
                self._queue_chunks(request_id, token_ids, chunks, a.rank, 0, now)
                self.lane.counts.gave_up += 1
            else:
                keep.append(entry)
        self.lane.waiting = keep

    def _open_lanes(self) -> None:
        """Open the lanes of the waiting prompts, first come first served, while the lane has room (``lane.py``):
        chunk ``j`` on ``ranks[j % g]``; the last chunk's rank answers."""
        while self.lane.waiting:
            a = self.inflight.get(self.lane.waiting[0][0])
            if a is None:  # forgotten without _forget (a failed group's requests): nothing to open
                self.lane.waiting.popleft()
                continue
            if not self.lane.pool.fits(a.tokens):
                return
            request_id, token_ids, chunks = self.lane.waiting.popleft()
            g = self.lane.groups(len(chunks))
            chunks = lane_split(self.cfg, request_id, a.tokens, g)  # equal-length ones as waiting, or by cost
            a.chunks = a.unsent = len(chunks)
            ranks = self.placer.place_lane(request_id, chunks, g)
            word, extra = self.lane.open(request_id, a.tokens, ranks)
            now = time.monotonic()
            for j, c in enumerate(chunks):
                toks = token_ids[c.start:c.start + c.length].to(torch.int64)
                payload = torch.cat([encode_chunk(c, extra, word), toks])
                self.pending[ranks[j % g]].append((request_id, payload, request_id, now))
            a.rank, a.lane, a.waiting = ranks[(len(chunks) - 1) % g], tuple(ranks), False
            self.lane.counts.open(now - a.admitted_at)

    def _unstart(self, a: "_Admitted") -> None:
        """``a``'s current attempt holds no rank any more (its result came, or it was taken back)."""
        for rank in a.started:
            self.rank_calls[rank] -= 1
        a.started = ()

    def _may_start(self, rank: int):
        """Whether a chunk may go to ``rank`` now (``max_rank_calls``): a request's first chunk there only while
        the rank holds fewer requests than the bound; every other chunk always (a request's further chunks, a
        lane's or a context-parallel request's, which other ranks' steps wait for)."""
        def ok(entry: tuple, key) -> bool:
            if self.max_rank_calls is None or self.rank_calls[rank] < self.max_rank_calls:
                return True
            a = self.inflight.get(entry[0])
            return a is None or rank in a.started or bool(a.lane) or a.mask != 0
        return ok

    def _forget(self, rid: int) -> "_Admitted":
        entry = self.inflight.pop(rid)
        self._unstart(entry)
        left = self.client_calls.get(entry.client, 0) - 1
        if left > 0:
            self.client_calls[entry.client] = left
        else:
            self.client_calls.pop(entry.client, None)
        for w in entry.wires:
            self.alias.pop(w, None)
        self.queued_tokens -= entry.tokens
        if entry.waiting:  # never placed: it leaves the lane's queue
            self.lane.waiting = deque(w for w in self.lane.waiting if w[0] != rid)
        else:
            self.placer.complete(rid)
            self.lane.close(rid)
        self._open_lanes()
        return entry

    def wait_ready(self, stats, timeout_s: float) -> float:
        """Wait until every worker has published its statistics (``protocol.WorkerStats``): it built its model
        and entered its loop, so a request's TTFT does not include the group's start-up. Returns the seconds
        waited; raises ``PeerFailure`` if a worker died, ``TimeoutError`` after ``timeout_s``."""
        t0 = time.monotonic()
        workers = [pe for pe in range(self.comm.world_size) if pe != self.comm.rank]
        while True:
            rows = stats.rows()
            gone = {} if self.failover is None else dict(self.failover.gone)
            if self.attention is not None:
                gone.update(self.attention.dead)
            if all(rows[pe]["published"] or pe in gone for pe in workers):
                return time.monotonic() - t0
            self.watch.check()
            if self.failover is not None:
                self.failover.check()
            if self.attention is not None:
                self._attention_check()
            if time.monotonic() - t0 > timeout_s:
                late = [pe for pe in workers if not rows[pe]["published"]]
                raise CommTimeoutError(f"front end: workers {late} were not ready within {timeout_s} s")
            time.sleep(0.005)

    def cancel(self, request_id: int) -> bool:
        """Forget an admitted request (its result, if it still comes, is dropped); False if not in flight.
        Its chunks not yet sent are dropped here; if some were sent, its rank gets a cancel message (not for
        a context-parallel request of the baseline, whose shared steps run to the end)."""
        if request_id not in self.inflight:
            return False
        if self.inflight[request_id].waiting:  # nothing of it was sent
            self._forget(request_id)
            return True
        self.lane.close(request_id, cancelled=True)
        self._drop_attempt(request_id, self._forget(request_id))
        return True

    def _drop_attempt(self, rid: int, a: "_Admitted") -> None:
        """Take back the request's current attempt: its chunks not yet sent are dropped; if some were sent, each
        rank that got them gets a cancel message for its wire id (not a context-parallel request of the baseline,
        whose shared steps run to the end)."""
        dead = {} if self.attention is None else self.attention.dead
        self._unstart(a)
        for rank in a.lane or (a.rank,):  # a lane request: every rank of its lane
            if rank in dead:
                continue
            self.pending[rank].drop(rid)
            if a.unsent < a.chunks and a.mask == 0:  # some chunks reached the rank
                self.pending[rank].append((None, encode_cancel(a.wire), CANCEL, time.monotonic()))

    def stop(self, timeout: float = 5.0) -> None:
        """Send every rank the stop message (after its queued chunks)."""
        self.watch.release()  # the workers may leave from now on
        self.max_rank_calls = None  # nothing is held back from now on: the stop message goes after every chunk
        if self.failover is not None:
            self.failover.release()
        if self.attention is not None:
            self.attention.release()
        for w in range(self.W):
            if self.attention is not None and w in self.attention.dead:
                continue
            self.pending[w].append((None, torch.zeros(1, dtype=torch.int64), STOP, time.monotonic()))
        deadline = time.monotonic() + timeout
        while True:
            self._flush()
            if not any(self.pending) or time.monotonic() > deadline:
                return
            while (m := self.box.poll()) is not None:  # results still arriving make room in no inbox, but are
                m.release()                             # released so the ranks never wait on this one
            self.watch.check()
            if self.failover is not None:  # an expert PE that dies while the ranks drain is still replaced
                self.failover.check()
            time.sleep(0.0005)

    @property
    def has_unsent(self) -> bool:
        return any(self.pending)

    def _flush(self) -> None:
        """Move queued messages into the ranks' inboxes; a full inbox is left for the next pump."""
        dead = {} if self.attention is None else self.attention.dead
        for rank, q in enumerate(self.pending):
            if rank in dead:  # nothing reaches a dead rank (its requests were re-admitted elsewhere)
                q.clear()
                continue
            may_start, standing = self._may_start(rank), self.client_calls.get
            while (e := q.peek(may_start, standing)) is not None:
                rid, payload, tag, _ = e
                key = q.chosen_key
                if key is not None:  # a client's chunk: urgent while its client holds under an equal share
                    mark_urgent(payload, self._light(key))
                try:
                    self.box.send(rank, payload, tag, timeout=1e-4)
                except CommTimeoutError:
                    break  # a live rank's full inbox is waited out (a dead rank: DeathWatch, in pump)
                except PeerFailure as e:  # across hosts the send can learn of the death first (its liveness line)
                    if self.attention is None or e.pe != rank:
                        raise
                    self._dead_seen = True
                    break  # attention failover: the next pump's _attention_check re-admits what it held
                q.pop()
                entry = self.inflight.get(rid) if rid is not None else None
                if entry is not None:
                    if rank not in entry.started:
                        entry.started += (rank,)
                        self.rank_calls[rank] += 1
                    entry.unsent -= 1
                    if entry.unsent == 0:
                        entry.queue_s = time.monotonic() - entry.admitted_at

    def _light(self, client) -> bool:
        """Whether ``client`` holds fewer requests in flight than an equal share among the clients with any: its
        chunks are urgent at the ranks (``MicroBatcher``), ahead of a flooding client's. One client alone, or
        clients with as many each, are never urgent (first come first served, as without clients)."""
        calls = self.client_calls
        return len(calls) > 1 and calls.get(client, 0) * len(calls) < sum(calls.values())

    def _result(self, m) -> "Completion | None":
        with m:
            rid, src = m.tag, m.src
            if rid == FAILED:  # a worker gives up: the group failed, for the reason it gives
                failure = decode_failure(src, m.tensor)
                print(f"front end: {failure}", file=sys.stderr, flush=True)
                raise failure
            token, hidden = decode_result(m.tensor)
        wire, rid = rid, self.alias.get(rid, rid)
        if rid not in self.inflight:
            return None  # cancelled meanwhile (or an attempt of a request another attempt answered)
        if wire != self.inflight[rid].wire:  # an earlier attempt answered first (a lane rank that had every KV)
            self._drop_attempt(rid, self.inflight[rid])
        a = self._forget(rid)
        done = time.monotonic() - a.admitted_at
        return Completion(rid, token, hidden, src, done if a.queue_s is None else a.queue_s, done, a.tokens)

    def pump(self, timeout: float = 0.0) -> list:
        """Send what is queued; return the results that arrived, waiting up to ``timeout`` for the first one
        (less while messages wait for room or prompts for the lane). Raises ``PeerFailure`` if a PE the group needs
        died."""
        self._lane_give_up()
        if self.failover is not None:
            self.failover.check()  # before the flush: a route goes out ahead of the chunks
        out = []
        if self.attention is not None:
            out, self._dead_seen = self._attention_check(force=self._dead_seen), False
        self._flush()
        while (m := self.box.poll()) is not None:
            c = self._result(m)
            if c is not None:
                out.append(c)
        if out:
            self._flush()
            return out
        wait = min(timeout, 0.001) if self.has_unsent else timeout
        if self.lane.waiting and self.cfg.lane_wait_s is not None:  # back in time to move a waiting prompt on
            wait = min(wait, 0.01)
        if wait > 0:
            try:
                c = self._result(self.box.recv(timeout=wait))
                if c is not None:
                    out.append(c)
            except CommTimeoutError:
                pass
        if not out:
            self.watch.check()
        return out

    def _attention_check(self, force: bool = False) -> list:
        """Attention failover (``RuntimeConfig.attention_failover``; docs/failover.md): when an attention PE died and
        another lives, take the results it sent before it died, then re-admit every request it held on the live
        ranks. Returns the results taken. ``PeerFailure`` when an attention PE closed before it was stopped (it gave
        up) or the last one died."""
        gone = self.attention.newly_gone(force)
        if not gone:
            return []
        out = []  # the states were read first: every message a dead PE sent is in the inbox now
        while (m := self.box.poll()) is not None:
            c = self._result(m)
            if c is not None:
                out.append(c)
        for pe, state in gone:
            if state != "died":
                raise PeerFailure(f"PE {pe} left (closed) before the front end stopped it: it gave up", pe=pe,
                                  reason=state)
            if len(self.attention.live) <= 1:
                raise PeerFailure(f"PE {pe} died and no other attention rank is left", pe=pe, reason="died")
            self.attention.dead[pe] = state  # live from now on excludes it
            self.attention.record(pe, self._readmit(pe))
        out.extend(self.poisoned)
        self.poisoned.clear()
        return out

    def _readmit(self, dead: int) -> int:
        """Re-admit the requests attention rank ``dead`` held (one of their chunks was, or was to be, computed
        there) on the live ranks, least loaded first; returns how many. A lane through ``dead`` is cancelled on
        its other ranks and its request runs on one rank. Each re-admission gets a new wire id, so no rank can
        confuse it with what it still holds of the old attempt."""
        self.pending[dead].clear()
        self.placer.exclude(dead)
        live = self.attention.live
        self.lane.lose_rank(len(live))
        now = time.monotonic()
        n = 0
        for rid, a in list(self.inflight.items()):
            if a.waiting or dead not in (a.lane or (a.rank,)):
                continue
            if a.lane:
                self.lane.close(rid, cancelled=True)
            self._drop_attempt(rid, a)
            if len(a.wires) >= READMIT_LIMIT:  # in flight at every death so far: it may be what kills the PEs
                self._forget(rid)
                self.poisoned.append(Completion(
                    rid, -1, torch.empty(0), dead, -1.0, time.monotonic() - a.admitted_at, a.tokens,
                    error=f"the attention PEs running it died {len(a.wires) + 1} times (PE {dead} last); it is not "
                          f"re-admitted again (attention failover re-admits a request at most {READMIT_LIMIT} "
                          f"time(s))"))
                continue
            self.placer.complete(rid)
            wire, self._next_wire = self._next_wire, self._next_wire + 1
            self.alias[wire] = rid
            chunks = split_prompt(wire, a.tokens, self.cfg.effective_chunk_len)
            a.rank = self.placer.place(rid, chunks)
            a.mask, a.lane, a.wire, a.wires = 0, (), wire, a.wires + (wire,)
            a.unsent = a.chunks = len(chunks)
            a.queue_s = None
            self._queue_chunks(rid, a.token_ids, chunks, a.rank, 0, now)
            n += 1
        if len(live) < 2:  # no lane opens any more: the prompts waiting for one run the usual way
            for request_id, token_ids, chunks in self.lane.waiting:
                a = self.inflight.get(request_id)
                if a is None:
                    continue
                a.rank, a.waiting = self.placer.place(request_id, chunks), False
                self._queue_chunks(request_id, token_ids, chunks, a.rank, 0, now)
            self.lane.waiting = deque()
        return n


def run_front_end(comm, cfg, info, requests, report_path: str, box, num_targets: int,
                  label: str, role_of: Callable[[int], str], stats=None) -> tuple:
    """The trace replay: one client of :class:`FrontEnd`, submitting each request at its arrival time.

    Rejects bad requests (recorded with their error), places every request's
    chunks on PEs ``0..num_targets-1`` and collects results. Appends every
    event to ``report_path`` so the records survive a worker's death
    (``replay_report``). Returns ``(records in request order, {request_id:
    (first token, hidden)}, the long-prompt lane's counts)`` (``LaneCounts.as_dict``; empty where the lane is
    off). With ``stats`` (the group's ``WorkerStats``),
    the trace clock starts once every worker is ready (:meth:`FrontEnd.wait_ready`).
    """
    fe = FrontEnd(comm, cfg, info, box, num_targets, label)
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests}
    outputs: dict = {}
    order = sorted(requests, key=lambda r: r.arrival_s)
    failure = None
    if stats is not None:
        try:
            fe.wait_ready(stats, cfg.timeout_s)
        except PeerFailure as e:
            failure = f"worker failure: {role_of(e.pe)} PE {e.pe} {e.reason} ({e})"
        except CommTimeoutError as e:
            failure = f"worker failure: {e}"
    t0 = time.monotonic()
    i = 0
    report = open(report_path, "ab")

    def log(event: tuple) -> None:
        """Append an event to the report, which survives a LaunchError caused by a dead worker."""
        pickle.dump(event, report)
        report.flush()

    progress = cfg.progress
    # On a terminal one live line rewrites itself ("\r"); into a pipe or a file, whole lines, less often.
    live = progress and sys.stderr.isatty()
    every_s = 0.5 if live else 5.0
    try:
        last_report = 0.0
        while failure is None and (i < len(order) or fe.inflight):
            now = time.monotonic() - t0
            if progress and now - last_report >= every_s:
                last_report = now
                done = len(outputs)
                line = f"  [{label}] {now:6.1f} s  arrived {i}/{len(order)}  done {done}  in flight {len(fe.inflight)}"
                print("\r" + line + "  " if live else line, end="" if live else "\n", file=sys.stderr, flush=True)
            while i < len(order) and order[i].arrival_s <= now:
                r = order[i]
                i += 1
                rec = records[r.request_id]
                try:
                    fe.admit(r.request_id, r.token_ids)
                except Rejected as e:
                    rec.start_s, rec.done_s, rec.error = now, now, f"rejected: {e.reason}"
                    log(("rejected", r.request_id, now, rec.error))
                    continue
                rec.start_s = now
                log(("start", r.request_id, now))
            next_arrival = order[i].arrival_s - (time.monotonic() - t0) if i < len(order) else 0.05
            for c in fe.pump(max(1e-4, min(0.05, next_arrival))):
                rec = records[c.request_id]
                rec.done_s = time.monotonic() - t0
                if c.error is not None:  # it failed alone (attention failover's limit): recorded, not answered
                    rec.done_s, rec.error = None, c.error
                    log(("failed", c.request_id, c.error))
                    continue
                outputs[c.request_id] = (c.token, c.hidden)
                log(("done", c.request_id, rec.done_s, c.token, c.hidden))
    except PeerFailure as e:
        failure = f"worker failure: {role_of(e.pe)} PE {e.pe} {e.reason} ({e})"
    except CommTimeoutError as e:
        failure = f"worker failure: {e}"
    if progress:
        line = f"  [{label}] {time.monotonic() - t0:6.1f} s  {len(outputs)}/{len(order)} completed"
        print("\r" + line + " " * 30 if live else line, file=sys.stderr, flush=True)
    for rid in fe.inflight:
        records[rid].done_s = None
        records[rid].error = failure or "not completed"
    for r in order[i:]:
        records[r.request_id].error = failure or "not admitted"
    result = ([records[r.request_id] for r in requests], outputs)
    log(("final", result))
    report.close()
    if failure is None:
        fe.stop(cfg.timeout_s)
    return (*result, fe.lane.counts.as_dict() if fe.lane.active else {})


class Replay:
    """The front-end role of a trace run (picklable): :func:`run_front_end` on the group's channels."""

    def __init__(self, requests: Sequence, report_path: str) -> None:
        self.requests, self.report_path = list(requests), report_path

    def __call__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of) -> tuple:
        return run_front_end(comm, cfg, info, self.requests, self.report_path, ch.box, num_targets, label, role_of,
                             ch.stats)


def replay_report(path: str, requests: Sequence) -> tuple:
    """``(records, outputs)`` from the front end's event log, however far it got."""
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests}
    outputs: dict = {}
    with open(path, "rb") as f:
        while True:
            try:
                event = pickle.load(f)
            except Exception:  # the end (EOFError), or a torn last event
                break
            kind, payload = event[0], event[1:]
            if kind == "final":
                return payload[0]
            rec = records[payload[0]]
            if kind == "start":
                rec.start_s = payload[1]
            elif kind == "rejected":
                rec.start_s = rec.done_s = payload[1]
                rec.error = payload[2]
            elif kind == "done":
                rec.done_s = payload[1]
                outputs[payload[0]] = (payload[2], payload[3])
            elif kind == "failed":
                rec.error = payload[1]
    return [records[r.request_id] for r in requests], outputs
