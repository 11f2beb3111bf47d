"""The service engine: the one loop on the front-end PE that drives the serving group for the HTTP app.

:class:`Engine` owns the front end (``frontend.FrontEnd``), the requests in
flight and their deadlines, the waiting room (``..waiting_room``), the
workers' heartbeats (``..heartbeat``), the failure and shutdown state, and the
metrics it counts (``.metrics``). :meth:`Engine.run` is its loop: while
requests are in flight it polls the result inbox every ~0.5 ms, and when idle
it sleeps until a request comes (checking the workers' health every 20 ms).
The routes (``.app``) call :meth:`Engine.admit`, :meth:`Engine.cancel`,
:meth:`Engine.unavailable`, :meth:`Engine.workers` and :meth:`Engine.fail`;
every answer they wait for is an asyncio future the engine completes.
"""
from __future__ import annotations

import asyncio
import heapq
import math
import os
import secrets
import sys
import time
from collections import deque

from ...errors import CommError, PeerFailure
from ...errors import TimeoutError as CommTimeoutError
from ..frontend import FrontEnd, Rejected
from ..heartbeat import Heartbeats
from ..waiting_room import MAX_WAITING_CALLS
from .fairness import LINGER_S, ErrorBrake, FairRoom, FairWaiter, HeldCalls
from .frontdoor import default_max_connections
from .metrics import ServiceMetrics
from .options import ServiceOptions
from .schemas import HttpError

__all__ = ["Engine"]

_BLOCK_S = 0.0005  # while requests are in flight: the longest the loop blocks in the result inbox at a time
_IDLE_S = 0.02  # health check period while idle


class Engine:
    """Everything the front-end PE runs but HTTP: the admission path, deadlines, health and the metrics."""

    def __init__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of, opts: ServiceOptions,
                 stop_event) -> None:
        self.comm, self.cfg, self.info, self.opts, self.stop_event = comm, cfg, info, opts, stop_event
        self.role_of, self.stats = role_of, ch.stats
        self.fe = FrontEnd(comm, cfg, info, ch.box, num_targets, label, max_queued_tokens=opts.max_queued_tokens,
                           max_rank_calls=opts.max_rank_calls)  # the clients' chunks take turns per rank
        self.futures: dict = {}  # request id -> asyncio future of its Completion
        self.deadline_of: dict = {}  # request id -> its deadline (time.monotonic())
        self.deadlines: list = []  # heap of (deadline, request id)
        self.room = FairRoom(opts.waiting_bound, MAX_WAITING_CALLS)  # per client, in turn (.fairness)
        self.client_tokens: dict = {}  # client -> its admitted prompt tokens
        self.client_of: dict = {}  # request id -> (client, its prompt tokens)
        self.linger: dict = {}  # client -> until when it counts as active after its last call ended
        # a refused client's next calls wait unread, and a client sending bad calls fast waits before each: in at
        # most half of the connection limit each
        half = (opts.max_connections or default_max_connections()) // 2
        self.held = HeldCalls(self.room, opts.refused_hold_s, half)
        self.brake = ErrorBrake(opts.bad_call_delay_s, half)
        self.id_prefix = secrets.token_hex(4)  # response ids: unique across restarts
        self.beats = Heartbeats(ch.stats.table, range(comm.world_size - 1))
        self.stalled: set = set()  # PEs reported stalled (for the log's transitions)
        self.next_id = 1
        self.failure: "str | None" = None
        self.failed_at = 0.0
        self.stopping = False
        self.drain_until = 0.0
        self.tokens_done: deque = deque()  # (time, prompt tokens) of the last 10 s's completions, for Retry-After
        self.tokens_done_sum = 0  # their tokens (kept with the deque: a 429 under a flood must not scan it)
        self.parent = os.getppid()
        self.metrics = ServiceMetrics(self)
        self.wake = asyncio.Event()
        self.done = asyncio.Event()

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """The one place that drives the group: admission results, deadlines, health, shutdown."""
        fe = self.fe
        next_check, stop_requested = 0.0, False
        while True:
            now = time.monotonic()
            if now >= next_check:  # the launcher's signals: often enough to react, not on every turn
                next_check = now + _IDLE_S
                if os.getppid() != self.parent and not self.stopping:  # the launcher is gone: nobody to report to
                    self.stop_event.set()
                stop_requested = self.stop_event.is_set()
                self._watch_heartbeats()
            if stop_requested and not self.stopping:
                self.stopping = True
                self.drain_until = time.monotonic() + self.opts.drain_timeout_s
                print(f"asap serve: stopping: draining {len(fe.inflight)} request(s) in flight "
                      f"(at most {self.opts.drain_timeout_s:g} s)", file=sys.stderr, flush=True)
                self._empty_room(HttpError(503, "the service is shutting down"))
            busy = bool(fe.inflight or fe.has_unsent)
            if self.failure is None:
                try:  # busy: block in the inbox (a result wakes it at once), then let HTTP run
                    for c in fe.pump(_BLOCK_S if busy else 0.0):
                        self._complete(c)
                except PeerFailure as e:
                    pe, reason = self._root_cause(e.pe, e.reason)
                    self.fail(f"{self.role_of(pe)} PE {pe} {reason}")
                except CommTimeoutError as e:
                    self.fail(str(e))
                except CommError as e:
                    self.fail(f"communication error: {e}")
            self._expire()
            if self.failure is None and not self.stopping:
                self._drain_room()
            now = time.monotonic()
            if self.failure is not None:
                if now - self.failed_at >= self.opts.failure_exit_s or stop_requested:
                    break
            elif self.stopping and (not fe.inflight or now >= self.drain_until):
                for rid in list(self.futures):
                    fe.cancel(rid)
                    self._reject(rid, HttpError(503, "the service stopped before this request finished"))
                break
            if fe.inflight or fe.has_unsent:
                await asyncio.sleep(0)
            else:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), _IDLE_S)
                except asyncio.TimeoutError:
                    pass
        self.done.set()

    def _release(self, rid: int) -> None:
        """A request left flight (done, failed, cancelled): its client's admitted tokens go down."""
        entry = self.client_of.pop(rid, None)
        if entry is None:
            return
        client, n = entry
        left = self.client_tokens.get(client, 0) - n
        if left > 0:
            self.client_tokens[client] = left
        else:
            self.client_tokens.pop(client, None)
            self.linger[client] = time.monotonic() + LINGER_S

    def share(self) -> int:
        """The admitted prompt tokens each active client may hold (``.fairness``)."""
        now = time.monotonic()
        if len(self.linger) > 1024:
            self.linger = {c: t for c, t in self.linger.items() if t > now}
        active = set(self.client_tokens) | self.room.clients() | {c for c, t in self.linger.items() if t > now}
        return max(1, self.opts.max_queued_tokens // max(1, len(active)))

    def _complete(self, c) -> None:
        if c.error is not None:  # the request failed alone (attention failover's limit); the service goes on
            self._reject(c.request_id, HttpError(503, f"request {c.request_id}: {c.error}"))
            self.metrics.count("unavailable")
            return
        self._release(c.request_id)
        fut = self.futures.pop(c.request_id, None)
        deadline = self.deadline_of.pop(c.request_id, math.inf)
        self.metrics.completed(c)
        now = time.monotonic()
        self.tokens_done.append((now, c.tokens))
        self.tokens_done_sum += c.tokens
        self._expire_done(now)
        if now > deadline:  # the answer came late (the front end itself may have stalled): never a 200
            if fut is not None and not fut.done():
                fut.set_exception(HttpError(504, f"request {c.request_id} passed its deadline of "
                                                  f"{self.opts.request_timeout_s:g} s; its answer came "
                                                  f"{now - deadline:.1f} s late"))
            self.metrics.count("timeout")
            return
        if fut is not None and not fut.done():
            fut.set_result(c)
        self.metrics.count("ok")

    def _reject(self, rid: int, err: HttpError) -> None:
        self._release(rid)
        fut = self.futures.pop(rid, None)
        self.deadline_of.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def _root_cause(self, pe, reason) -> tuple:
        """The PE to name for a failure first seen as ``pe`` ``reason``: a worker that closed usually did so
        because another one died (it left when its wait failed), so a worker that died is named first (not one
        that expert failover replaced)."""
        if reason != "died":
            for other in range(self.comm.world_size - 1):
                if self.comm.peer_state(other) == "died" and other not in self._failed_over():
                    return other, "died"
        return pe, reason

    def fail(self, what: str) -> None:
        """The group failed (``what``: the worker and how): fail every request in flight and every waiting call
        with 503; the loop ends ``--failure-exit-s`` later."""
        self.failure = f"worker failure: {what}"
        self.failed_at = time.monotonic()
        print(f"asap serve: {self.failure}; answering 503, exiting in {self.opts.failure_exit_s:g} s",
              file=sys.stderr, flush=True)
        for rid in list(self.futures):
            self.fe.inflight.pop(rid, None)
            self._reject(rid, HttpError(503, f"{self.failure}: this request was lost"))
            self.metrics.count("unavailable")
        self._empty_room(HttpError(503, self.failure))

    def unavailable(self) -> "HttpError | None":
        """The 503 every request gets now (the group failed, or the service stops), or None."""
        if self.failure is not None:
            return HttpError(503, self.failure)
        if self.stopping:
            return HttpError(503, "the service is shutting down")
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, rid = heapq.heappop(self.deadlines)
            if rid in self.futures:
                self.fe.cancel(rid)
                self._reject(rid, HttpError(504, f"request {rid} passed its deadline of "
                                                 f"{self.opts.request_timeout_s:g} s; its work was cancelled"))
                self.metrics.count("timeout")

    # ------------------------------------------------------------------ admission
    def _drain_room(self) -> None:
        """Admit waiting calls in turn while they fit (``.fairness``); answer those whose deadline passed."""
        if not len(self.room):
            self.held.release()
            return
        admit, expired = self.room.take_ready(self.opts.max_queued_tokens - self.fe.queued_tokens,
                                              self.client_tokens, self.share(), time.monotonic())
        for w in expired:
            if not w.future.done():
                w.future.set_exception(HttpError(504, f"this call waited for admission past its deadline of "
                                                      f"{self.opts.request_timeout_s:g} s"))
        for w in admit:
            if not w.future.done():
                w.future.set_result(self._start(w.call, w.deadline, w.client))
        self.held.release()

    def _empty_room(self, err: HttpError) -> None:
        """Answer every waiting call with ``err`` (the service failed or stops); held calls go on to get it."""
        self.held.release_all()
        for w in self.room.take_all():
            if not w.future.done():
                w.future.set_exception(err)

    async def admit(self, call, arrived: float, client: str = "", held=None) -> tuple:
        """Admit every prompt of a call of ``client``, or none: ``(request ids, futures)``. 413 past the bound on
        its own; waits its turn in the room (``.fairness``) when it may not start now; 429 when the room is
        full (and the client holds its share of it). ``held``: the call's hold, if ``self.held`` held it
        (``.fairness.HeldCalls``)."""
        fe, bound, total = self.fe, self.opts.max_queued_tokens, call.num_tokens
        if total > bound:
            raise HttpError(413, f"prompt: {total} prompt tokens in one call are more than the admission bound of "
                                 f"{bound} tokens (--max-queued-tokens); send fewer or shorter prompts per call",
                            "prompt")
        err = self.unavailable()  # the service may have failed or begun to stop while the body came
        if err is not None:
            raise err
        deadline = arrived + self.opts.request_timeout_s
        w = FairWaiter(total, deadline, call.prompts, asyncio.get_running_loop().create_future(), client)
        pushed = self.room.add(w)
        if held is not None:  # a held call of this client reached the room: the next may leave
            self.held.unhold(client, held)
        if pushed is None:
            self.held.refused(client)
            raise HttpError(429, f"over the admission bound: {fe.queued_tokens} prompt tokens in flight (bound "
                                 f"{bound}) and {self.room.tokens} in {len(self.room)} waiting call(s) (bound "
                                 f"{self.room.max_tokens} tokens, {self.room.max_calls} calls; this client "
                                 f"holds {self.room.held.get(client, 0)} of them); {total} more do not fit; retry "
                                 "later", retry_after=self.retry_after_s())
        for p in pushed:  # counted by the route that answers them
            self.held.refused(p.client)
            if not p.future.done():
                p.future.set_exception(HttpError(429, f"this call waited in a full waiting room while its client "
                                                      f"({p.client}) held more than its share of it; a call of "
                                                      "another client took its place; retry later",
                                                      retry_after=self.retry_after_s()))
        self._drain_room()
        if w.future.done():  # admitted at once
            return w.future.result()
        self.wake.set()
        try:
            done, _ = await asyncio.wait({w.future}, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:  # the client left while waiting
            if not self.room.remove(w) and w.future.done() and w.future.exception() is None:
                self.cancel(w.future.result()[0])  # admitted in the meantime
            raise
        if not done:
            self.room.remove(w)
            raise HttpError(504, f"this call waited for admission past its deadline of "
                                 f"{self.opts.request_timeout_s:g} s")
        return w.future.result()  # or its error (504, or 503 if the service failed or stops)

    def _start(self, prompts: list, deadline: float, client: str = "") -> tuple:
        """Hand a call's prompts (of ``client``) to the front end: ``(request ids, futures)``."""
        loop = asyncio.get_running_loop()
        rids, futs = [], []
        for p in prompts:
            rid = self.next_id
            self.next_id += 1
            try:
                self.fe.admit(rid, p, check_bound=False, client=client)  # the call was checked against the bound
            except Rejected as e:  # validated already: not expected
                self.cancel(rids)
                raise HttpError(400, e.reason, "prompt") from None
            n = int(p.numel())
            self.client_of[rid] = (client, n)
            self.client_tokens[client] = self.client_tokens.get(client, 0) + n
            fut = loop.create_future()
            self.futures[rid] = fut
            self.deadline_of[rid] = deadline
            heapq.heappush(self.deadlines, (deadline, rid))
            rids.append(rid)
            futs.append(fut)
        self.wake.set()
        return rids, futs

    def cancel(self, rids: list) -> None:
        """Cancel admitted requests (their client left, or the call failed): their tokens come back at once."""
        for rid in rids:
            self._release(rid)
            fut = self.futures.pop(rid, None)
            self.deadline_of.pop(rid, None)
            if self.fe.cancel(rid) and fut is not None:
                self.metrics.count("cancelled")
            if fut is not None and not fut.done():
                fut.cancel()
        self.wake.set()  # tokens came back: the waiting room may move

    def _expire_done(self, now: float) -> None:
        """Forget the completions older than the 10 s window Retry-After looks at."""
        while self.tokens_done and now - self.tokens_done[0][0] >= 10.0:
            self.tokens_done_sum -= self.tokens_done.popleft()[1]

    def retry_after_s(self) -> int:
        """How long the admitted and waiting tokens take to drain at the recent throughput (1..60 s)."""
        now = time.monotonic()
        self._expire_done(now)
        if not self.tokens_done:
            return 1
        span = max(now - self.tokens_done[0][0], 0.5)
        rate = self.tokens_done_sum / span
        return int(min(60, max(1, math.ceil((self.fe.queued_tokens + self.room.tokens) / max(rate, 1e-9)))))

    # ------------------------------------------------------------------ health
    def _watch_heartbeats(self) -> None:
        """Look at the workers' rows; log when one stalls past ``--worker-stall-s`` and when it comes back."""
        self.beats.observe()
        ages = self.beats.ages()
        limit = self.opts.worker_stall_s
        gone = self._failed_over()
        for pe, age in ages.items():
            if pe in gone:  # died and replaced (or a spare that died unused): no heartbeat is expected
                continue
            if age > limit and pe not in self.stalled:
                self.stalled.add(pe)
                print(f"asap serve: {self.role_of(pe)} PE {pe} sent no heartbeat for {age:.1f} s (stalled; "
                      f"/health answers 503 until it does)", file=sys.stderr, flush=True)
            elif age <= limit and pe in self.stalled:
                self.stalled.discard(pe)
                print(f"asap serve: {self.role_of(pe)} PE {pe} runs again", file=sys.stderr, flush=True)

    def workers(self) -> list:
        """Each worker's ``pe``, ``role``, ``pid``, ``state`` and ``heartbeat_age_s`` (``/health``)."""
        # The engine looks every 20 ms, but it may itself have been stalled, and /health may answer between two
        # looks: look now, and log a stall or a recovery before /health reports it, so the two always agree.
        self._watch_heartbeats()
        rows, ages = self.stats.rows(), self.beats.ages()
        fo = self.fe.failover
        out = []
        for pe in range(self.comm.world_size - 1):
            w = {"pe": pe, "role": self.role_of(pe), "pid": rows[pe]["pid"] or None,
                 "state": self.comm.peer_state(pe), "heartbeat_age_s": round(ages[pe], 3)}
            if fo is not None and pe in fo.pes:  # expert failover: which expert rank it serves, who replaced it
                w["expert_rank"] = fo.serves(pe)
                w["replaced_by"] = next((e.new_pe for e in fo.replacements if e.dead_pe == pe), None)
                w["failed_over"] = pe in fo.gone
            at = self.fe.attention
            if at is not None and pe < at.A:  # attention failover: its requests re-admitted on the live ranks
                loss = next((e for e in at.losses if e.pe == pe), None)
                w["failed_over"] = loss is not None
                w["readmitted"] = None if loss is None else loss.readmitted
            out.append(w)
        return out

    def check_failover(self) -> None:
        """Failover now (``/health`` asks before it judges the workers): a dead expert PE is replaced first, or
        fails the service when no spare is left; a dead attention PE's requests are re-admitted on the live
        attention ranks (attention failover), or it fails the service when none is left."""
        fo = self.fe.failover
        if self.failure is not None:
            return
        try:
            if fo is not None:
                fo.check(force=True)
            if self.fe.attention is not None:  # attention failover: a dead attention PE's requests re-admitted
                for c in self.fe._attention_check(force=True):
                    self._complete(c)
        except PeerFailure as e:
            pe, reason = self._root_cause(e.pe, e.reason)
            self.fail(f"{self.role_of(pe)} PE {pe} {reason}")

    def _failed_over(self) -> dict:
        """The expert and spare PEs expert failover has handled (``failover.FrontFailover.gone``): their death is
        not the service's."""
        fo, at = self.fe.failover, self.fe.attention
        if self.failure is not None:
            return {}
        return {**({} if fo is None else fo.gone), **({} if at is None else at.dead)}
