"""The online prefill service: ASAP (or the DP+EP baseline) behind an OpenAI-compatible HTTP API.

    python -m asap_comm.serving.server --model small --attention-ranks 2 --expert-ranks 2 --port 8000
    python -m asap_comm.serving.server --model small --mode sync --port 8000      # the baseline
    ASAP_API_KEY=secret python -m asap_comm.serving.server --model small --host 0.0.0.0 --port 8000

Processes: the same serving group as ``run_async`` / ``run_sync`` (workers
plus one front-end PE). The front-end PE runs an aiohttp server on
127.0.0.1 (``--host``) and drives the group through the same admission path
as the trace replay (``frontend.FrontEnd``): one asyncio loop owns both the
HTTP connections and the front end; while requests are in flight it polls
the result inbox every ~0.5 ms, and when idle it sleeps until a request
comes (checking the workers' health every 20 ms).

Endpoints:

* ``POST /v1/completions`` (OpenAI-compatible). ``prompt``: a list of token
  ids, a batch of such lists, or text (only with ``--tokenizer``).
  ``max_tokens`` must be 1 (or absent): this is a prefill tier; ``n`` and
  ``best_of`` must be 1 or absent, ``echo`` false or absent, ``logprobs``
  null or absent (each changes the answer, so it is refused, not ignored).
  The answer carries the first generated token (``choices[i].text`` as the
  token id string, or the decoded text with a tokenizer;
  ``choices[i].token_ids``), ``usage``, and per choice ``metrics``:
  ``request_id``, ``queue_time_s`` (admission until its last chunk entered
  its rank's inbox), ``ttft_s`` (admission until its result reached the
  front end) and ``attention_rank`` (the rank that computed it).
  ``"stream": true`` sends the answer as one SSE event, then
  ``data: [DONE]`` (an error is an ordinary JSON error answer).
  Extension: ``"return_hidden_states": true`` adds ``hidden_states`` (the
  final-normed hidden state of the last prompt token) to each choice.
* ``GET /health``: 200 and each worker's PE, role, pid, state and
  ``heartbeat_age_s`` while every worker lives and runs; 503 naming the
  dead worker, the stalled one (no heartbeat for ``--worker-stall-s``), or
  "shutting down" otherwise.
* ``GET /metrics``: Prometheus text (``prometheus_client``).
* ``GET /v1/models``.

With ``--api-key`` (or ``ASAP_API_KEY``), every path but ``/health`` and
``/metrics`` needs ``Authorization: Bearer <key>`` (401 otherwise; compared
in constant time).

Behaviour (statuses of ``/v1/completions``):

* **Bad input** gets a 400 naming the field (malformed JSON or UTF-8,
  nesting or integers the parser refuses, wrong types, ids outside the
  vocabulary); another ``model`` 404; a ``Content-Type`` other than
  ``application/json`` (or a charset other than UTF-8, or a
  ``Content-Encoding``) 415; nothing reaches a worker. No client input
  gives a 500.
* **Bodies are bounded** before they are read whole: ``--max-body-bytes``
  (default 1 MiB + 16 bytes per token of ``--max-queued-tokens``: 2 MiB
  for the default bound); a larger
  ``Content-Length`` gets 413 before a byte is read, a chunked body 413 as
  soon as it passes the bound; a body not received within the request
  timeout gets 408. Bodies held at once, across requests, are bounded by
  8x the bound (429 past it). Bodies over 64 KiB are parsed in a parse
  process beside the front end (``http_parse``: JSON parsing holds the GIL,
  and would stall this loop); text prompts are tokenized on a thread.
* **Fairness** (``waiting_room``): a call whose prompt tokens exceed
  ``--max-queued-tokens`` gets 413 at once. Any other call is admitted when
  nobody waits and it fits beside the admitted tokens; otherwise it waits,
  first come first served, in a waiting room of ``--max-waiting-tokens``
  tokens (default: twice the admission bound) and 1024 calls, and gets 429 with
  ``Retry-After`` (seconds, from the recent token throughput) only when the
  room is full. Memory: admitted + waiting prompt tokens, plus the body
  bound above; the HTTP layer holds nothing else per request.
* **Deadlines.** Every request has a deadline (``--request-timeout-s`` from
  its arrival); past it the answer is 504, never 200: a result that
  arrives late (the front end itself stalled, say) is checked when it
  completes. Waiting calls expire the same way. An admitted request that
  expires is cancelled: chunks not yet sent are dropped, its rank drops its
  queued chunks and KV cache (a chunk already running finishes first).
* **A client that disconnects** cancels its requests the same way (their
  admission tokens are released at once).
* **A stalled worker** (a live process whose statistics row has not changed
  for ``--worker-stall-s``, default 10 s, by the front end's clock) makes
  ``/health`` answer 503 naming it, and 200 again when it resumes. It is
  not a failure: requests are still admitted and keep their deadlines.
* **Worker death.** Requests in flight fail with 503 naming the worker,
  ``/health`` and new requests answer 503, and after ``--failure-exit-s``
  seconds (default 10, so that load balancers see it) the service stops the
  remaining workers and exits with status 3. It does not restart workers in
  place: a serving group is one ``asap_comm`` communicator, whose symmetric
  memory cannot take a new member. Run it under a supervisor (systemd
  ``Restart=on-failure``, a Kubernetes liveness probe on ``/health``).
* **Ctrl-C / SIGTERM:** stop admitting (503; waiting calls too), let
  in-flight requests finish for up to ``--drain-timeout-s``, fail the rest
  with 503, stop the workers, exit 0. Shared-memory segments are removed
  whatever happens. A second signal stops at once.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import CommError, LaunchError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from .frontend import FrontEnd, Rejected
from .heartbeat import Heartbeats
from .http_input import (BodyBudget, ClientErrorFilter, HttpError, api_key_matches, check_headers, completion_of,
                         default_max_body_bytes, read_body)
from .http_parse import INLINE_BYTES, ParseProcess, parse_call
from .protocol import BATCH_BUCKETS, RuntimeConfig
from .waiting_room import MAX_WAITING_CALLS, Waiter, WaitingRoom

__all__ = ["ServiceOptions", "HttpFront", "service_main", "service_options", "build_parser", "main"]

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_BLOCK_S = 0.0005  # while requests are in flight: the longest the loop blocks in the result inbox at a time
_IDLE_S = 0.02  # health check period while idle
_BODY_BUDGET_BODIES = 8  # request bodies held at once: at most this many times --max-body-bytes
_OPEN_PATHS = ("/health", "/metrics")  # what --api-key leaves open
# what each refused status counts as in asap_requests_total{outcome}
_OUTCOME = {401: "unauthorized", 429: "overloaded", 503: "unavailable", 504: "timeout"}


@dataclass(frozen=True)
class ServiceOptions:
    """The HTTP side's settings (the runtime's are a ``RuntimeConfig``). ``max_body_bytes`` and
    ``max_waiting_tokens`` of None take their defaults from ``max_queued_tokens`` (see :attr:`body_bound`,
    :attr:`waiting_bound`); ``api_key`` None: no authentication."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "small"
    mode: str = "async"
    max_queued_tokens: int = 65536
    request_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    failure_exit_s: float = 10.0
    tokenizer: "str | None" = None
    max_body_bytes: "int | None" = None
    max_waiting_tokens: "int | None" = None
    worker_stall_s: float = 10.0
    api_key: "str | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"ServiceOptions: port={self.port!r} must be in [0, 65536)")
        for name in ("max_queued_tokens", "max_body_bytes", "max_waiting_tokens"):
            v = getattr(self, name)
            if (v is not None or name == "max_queued_tokens") and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be an int >= 1")
        for name in ("request_timeout_s", "drain_timeout_s", "failure_exit_s", "worker_stall_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be a positive number of seconds")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"ServiceOptions: mode={self.mode!r} must be 'async' or 'sync'")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise ValueError("ServiceOptions: api_key must be a non-empty string (or None: no authentication)")

    @property
    def body_bound(self) -> int:
        """The largest request body read: ``max_body_bytes``, or ``default_max_body_bytes(max_queued_tokens)``."""
        return self.max_body_bytes if self.max_body_bytes is not None else default_max_body_bytes(
            self.max_queued_tokens)

    @property
    def waiting_bound(self) -> int:
        """Prompt tokens the waiting room holds: ``max_waiting_tokens``, or twice ``max_queued_tokens`` (room for
        a call at the bound and as much again of others)."""
        return self.max_waiting_tokens if self.max_waiting_tokens is not None else 2 * self.max_queued_tokens


class _Service:
    """Everything the front-end PE runs: the admission path, the HTTP app and the metrics."""

    def __init__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of, opts: ServiceOptions,
                 stop_event) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.comm, self.cfg, self.info, self.opts, self.stop_event = comm, cfg, info, opts, stop_event
        self.role_of, self.stats = role_of, ch.stats
        self.fe = FrontEnd(comm, cfg, info, ch.box, num_targets, label, max_queued_tokens=opts.max_queued_tokens)
        self.futures: dict = {}  # request id -> asyncio future of its Completion
        self.deadline_of: dict = {}  # request id -> its deadline (time.monotonic())
        self.deadlines: list = []  # heap of (deadline, request id)
        self.room = WaitingRoom(opts.waiting_bound, MAX_WAITING_CALLS)
        self.bodies = BodyBudget(_BODY_BUDGET_BODIES * opts.body_bound)
        self.parser = ParseProcess({"model_name": opts.model_name, "vocab_size": info.vocab_size,
                                    "max_prompt_len": cfg.max_prompt_len, "max_call_tokens": opts.max_queued_tokens})
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asap-tokenize")  # not thread-safe
        self.key_digest = (hashlib.sha256(opts.api_key.encode("utf-8", "surrogateescape")).digest()
                           if opts.api_key is not None else None)  # as api_key_matches encodes what it is given
        self.beats = Heartbeats(ch.stats.table, range(comm.world_size - 1))
        self.stalled: set = set()  # PEs reported stalled (for the log's transitions)
        self.next_id = 1
        self.failure: "str | None" = None
        self.failed_at = 0.0
        self.stopping = False
        self.drain_until = 0.0
        self.tokens_done: deque = deque()  # (time, prompt tokens) of the last 10 s's completions, for Retry-After
        self.tokenizer = None
        if opts.tokenizer:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer, local_files_only=True)
        self.started = time.time()
        self.parent = os.getppid()
        r = self.registry = CollectorRegistry()
        self.m_ttft = Histogram("asap_time_to_first_token_seconds", "Server-side TTFT: admission to the result "
                                "reaching the front end", registry=r, buckets=TTFT_BUCKETS)
        self.m_queue = Histogram("asap_request_queue_time_seconds", "Admission until the request's last chunk "
                                 "entered its rank's inbox", registry=r, buckets=TTFT_BUCKETS)
        self.m_prompt = Counter("asap_prompt_tokens", "Prompt tokens of completed requests", registry=r)
        self.m_requests = Counter("asap_requests", "Requests by outcome (ok, invalid, unauthorized, overloaded, "
                                  "timeout, cancelled, unavailable)", ["outcome"], registry=r)
        self.m_running = Gauge("asap_num_requests_running", "Requests admitted and not finished", registry=r)
        self.m_running.set_function(lambda: len(self.fe.inflight))
        self.m_tokens = Gauge("asap_admitted_prompt_tokens", "Prompt tokens admitted and not finished (bounded by "
                              "--max-queued-tokens)", registry=r)
        self.m_tokens.set_function(lambda: self.fe.queued_tokens)
        self.m_waiting = Gauge("asap_num_requests_waiting", "Calls in the waiting room (first come, first served)",
                               registry=r)
        self.m_waiting.set_function(lambda: len(self.room))
        self.m_waiting_tokens = Gauge("asap_waiting_prompt_tokens", "Prompt tokens of the calls in the waiting "
                                      "room (bounded by --max-waiting-tokens)", registry=r)
        self.m_waiting_tokens.set_function(lambda: self.room.tokens)
        r.register(_WorkerCollector(self))
        self.wake = asyncio.Event()
        self.done = asyncio.Event()

    # ------------------------------------------------------------------ engine
    async def engine(self) -> None:
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
                    self._fail(f"{self.role_of(pe)} PE {pe} {reason}")
                except CommTimeoutError as e:
                    self._fail(str(e))
                except CommError as e:
                    self._fail(f"communication error: {e}")
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

    def _complete(self, c) -> None:
        fut = self.futures.pop(c.request_id, None)
        deadline = self.deadline_of.pop(c.request_id, math.inf)
        self.m_ttft.observe(c.done_s)
        self.m_queue.observe(c.queue_s)
        self.m_prompt.inc(c.tokens)
        now = time.monotonic()
        self.tokens_done.append((now, c.tokens))
        while now - self.tokens_done[0][0] >= 10.0:  # the window Retry-After looks at
            self.tokens_done.popleft()
        if now > deadline:  # the answer came late (the front end itself may have stalled): never a 200
            if fut is not None and not fut.done():
                fut.set_exception(HttpError(504, f"request {c.request_id} passed its deadline of "
                                                  f"{self.opts.request_timeout_s:g} s; its answer came "
                                                  f"{now - deadline:.1f} s late"))
            self.m_requests.labels("timeout").inc()
            return
        if fut is not None and not fut.done():
            fut.set_result(c)
        self.m_requests.labels("ok").inc()

    def _reject(self, rid: int, err: HttpError) -> None:
        fut = self.futures.pop(rid, None)
        self.deadline_of.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def _root_cause(self, pe, reason) -> tuple:
        """The PE to name for a failure first seen as ``pe`` ``reason``: a worker that closed usually did so
        because another one died (it left when its wait failed), so a worker that died is named first."""
        if reason != "died":
            for other in range(self.comm.world_size - 1):
                if self.comm.peer_state(other) == "died":
                    return other, "died"
        return pe, reason

    def _fail(self, what: str) -> None:
        self.failure = f"worker failure: {what}"
        self.failed_at = time.monotonic()
        print(f"asap serve: {self.failure}; answering 503, exiting in {self.opts.failure_exit_s:g} s",
              file=sys.stderr, flush=True)
        for rid in list(self.futures):
            self.fe.inflight.pop(rid, None)
            self._reject(rid, HttpError(503, f"{self.failure}: this request was lost"))
            self.m_requests.labels("unavailable").inc()
        self._empty_room(HttpError(503, self.failure))

    def _expire(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, rid = heapq.heappop(self.deadlines)
            if rid in self.futures:
                self.fe.cancel(rid)
                self._reject(rid, HttpError(504, f"request {rid} passed its deadline of "
                                                 f"{self.opts.request_timeout_s:g} s; its work was cancelled"))
                self.m_requests.labels("timeout").inc()

    # ------------------------------------------------------------------ admission
    def _drain_room(self) -> None:
        """Admit waiting calls from the head of the room while they fit; answer those whose deadline passed."""
        if not len(self.room):
            return
        admit, expired = self.room.take_ready(self.opts.max_queued_tokens - self.fe.queued_tokens,
                                              time.monotonic())
        for w in expired:
            if not w.future.done():
                w.future.set_exception(HttpError(504, f"this call waited for admission past its deadline of "
                                                      f"{self.opts.request_timeout_s:g} s"))
        for w in admit:
            if not w.future.done():
                w.future.set_result(self._start(w.call, w.deadline))

    def _empty_room(self, err: HttpError) -> None:
        """Answer every waiting call with ``err`` (the service failed or stops)."""
        for w in self.room.take_all():
            if not w.future.done():
                w.future.set_exception(err)

    async def _admit(self, call, arrived: float) -> tuple:
        """Admit every prompt of a call, or none: ``(request ids, futures)``. 413 past the bound on its own;
        waits its turn in the room when others wait or it does not fit; 429 when the room is full."""
        fe, bound, total = self.fe, self.opts.max_queued_tokens, call.num_tokens
        if total > bound:
            raise HttpError(413, f"prompt: {total} prompt tokens in one call are more than the admission bound of "
                                 f"{bound} tokens (--max-queued-tokens); send fewer or shorter prompts per call",
                            "prompt")
        deadline = arrived + self.opts.request_timeout_s
        if not len(self.room) and fe.queued_tokens + total <= bound:
            return self._start(call.prompts, deadline)
        if not self.room.has_room(total):
            raise HttpError(429, f"over the admission bound: {fe.queued_tokens} prompt tokens in flight (bound "
                                 f"{bound}) and {self.room.tokens} in {len(self.room)} waiting call(s) (bound "
                                 f"{self.room.max_tokens} tokens, {self.room.max_calls} calls); {total} more do "
                                 "not fit; retry later", retry_after=self.retry_after_s())
        w = Waiter(total, deadline, call.prompts, asyncio.get_running_loop().create_future())
        self.room.add(w)
        self.wake.set()
        try:
            done, _ = await asyncio.wait({w.future}, timeout=max(0.0, deadline - time.monotonic()))
        except asyncio.CancelledError:  # the client left while waiting
            if not self.room.remove(w) and w.future.done() and w.future.exception() is None:
                self._cancel(w.future.result()[0])  # admitted in the meantime
            raise
        if not done:
            self.room.remove(w)
            raise HttpError(504, f"this call waited for admission past its deadline of "
                                 f"{self.opts.request_timeout_s:g} s")
        return w.future.result()  # or its error (504, or 503 if the service failed or stops)

    def _start(self, prompts: list, deadline: float) -> tuple:
        """Hand a call's prompts to the front end: ``(request ids, futures)``."""
        loop = asyncio.get_running_loop()
        rids, futs = [], []
        for p in prompts:
            rid = self.next_id
            self.next_id += 1
            try:
                self.fe.admit(rid, p, check_bound=False)  # the whole call was checked against the bound
            except Rejected as e:  # validated already: not expected
                self._cancel(rids)
                raise HttpError(400, e.reason, "prompt") from None
            fut = loop.create_future()
            self.futures[rid] = fut
            self.deadline_of[rid] = deadline
            heapq.heappush(self.deadlines, (deadline, rid))
            rids.append(rid)
            futs.append(fut)
        self.wake.set()
        return rids, futs

    def _cancel(self, rids: list) -> None:
        for rid in rids:
            fut = self.futures.pop(rid, None)
            self.deadline_of.pop(rid, None)
            if self.fe.cancel(rid) and fut is not None:
                self.m_requests.labels("cancelled").inc()
            if fut is not None and not fut.done():
                fut.cancel()
        self.wake.set()  # tokens came back: the waiting room may move

    def retry_after_s(self) -> int:
        """How long the admitted and waiting tokens take to drain at the recent throughput (1..60 s)."""
        now = time.monotonic()
        while self.tokens_done and now - self.tokens_done[0][0] >= 10.0:
            self.tokens_done.popleft()
        if not self.tokens_done:
            return 1
        span = max(now - self.tokens_done[0][0], 0.5)
        rate = sum(n for _, n in self.tokens_done) / span
        return int(min(60, max(1, math.ceil((self.fe.queued_tokens + self.room.tokens) / max(rate, 1e-9)))))

    # ------------------------------------------------------------------ HTTP
    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=self.opts.body_bound, middlewares=[self._guard])
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    def _json_error(self, err: HttpError):
        from aiohttp import web

        resp = web.json_response(err.body(), status=err.status, headers=err.response_headers() or None)
        if err.close:  # a body left unread that is not worth reading
            resp.force_close()
        return resp

    def _authorized(self, request) -> bool:
        return (self.key_digest is None or request.path in _OPEN_PATHS
                or api_key_matches(request.headers.get("Authorization"), self.key_digest))

    def _unauthorized(self) -> HttpError:
        return HttpError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                         headers={"WWW-Authenticate": 'Bearer realm="asap"'})

    async def _guard(self, request, handler):
        """Middleware: the API key, and every HTTP error (an unknown path, a wrong method) as a JSON body. An
        answer given before a compressed body was read closes the connection: aiohttp would otherwise read
        (and decompress) the rest only to drop it."""
        from aiohttp import web

        if not self._authorized(request):
            self.m_requests.labels("unauthorized").inc()
            resp = self._json_error(self._unauthorized())
        else:
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
                resp = self._json_error(HttpError(e.status, f"{e.reason}: {request.method} {request.path[:80]}",
                                                  headers=headers))
        if "Content-Encoding" in request.headers and not request.content.is_eof() and not resp.prepared:
            resp.force_close()
        return resp
    _guard.__middleware_version__ = 1  # an aiohttp new-style middleware

    async def _expect(self, request):
        """``Expect: 100-continue``: refuse what the headers alone refuse (key, type, length) before the client
        sends the body; otherwise let it come."""
        expect = request.headers.get("Expect", "")
        if expect.lower() != "100-continue":
            return self._json_error(HttpError(417, f"Expect: {expect[:40]!r} is not supported", close=True))
        if not self._authorized(request):
            err = self._unauthorized()
            err.close = True
            return self._json_error(err)
        try:
            check_headers(request.headers, self.opts.body_bound)
        except HttpError as e:
            e.close = True
            return self._json_error(e)
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's own handler: the answer has not started
        return None

    def _unavailable(self) -> "HttpError | None":
        if self.failure is not None:
            return HttpError(503, self.failure)
        if self.stopping:
            return HttpError(503, "the service is shutting down")
        return None

    async def _read_call(self, request, arrived: float):
        """Read, decode and check the body (``http_input.Completion``). Bodies over ``INLINE_BYTES`` are parsed
        in the parse process (``http_parse``), so they never hold this loop; a body holds its bytes of the body
        budget until its parse is over. Text goes through the tokenizer on its one thread."""
        held = [0]
        try:
            body = await read_body(request, self.opts.body_bound,
                                   self.opts.request_timeout_s - (time.monotonic() - arrived), self.bodies, held)
            if len(body) <= INLINE_BYTES:
                call = parse_call(body, self.opts.model_name, self.info.vocab_size, self.cfg.max_prompt_len,
                                  self.opts.max_queued_tokens)
            else:
                n = held[0]
                held[0] = 0  # given back by the parse process's worker once it is done with the body
                call = await self.parser.parse(body, lambda: self.bodies.give(n))
            del body
        finally:
            self.bodies.give(held[0])
        if call.ids is None:  # text: through the tokenizer, off the loop
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, completion_of, call, self.info, self.cfg, self.tokenizer, self.opts.max_queued_tokens)
        return completion_of(call, self.info, self.cfg, self.tokenizer, self.opts.max_queued_tokens)

    async def completions(self, request):
        from aiohttp import web

        arrived = time.monotonic()
        try:
            err = self._unavailable()
            if err is not None:
                raise err
            call = await self._read_call(request, arrived)
            rids, futs = await self._admit(call, arrived)
        except HttpError as e:
            self.m_requests.labels(_OUTCOME.get(e.status, "invalid")).inc()
            return self._json_error(e)
        try:
            results = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # the client went away: free its slots now
            self._cancel(rids)
            raise
        except HttpError as e:
            self._cancel(rids)
            return self._json_error(e)
        answer = self._answer(call.prompts, results, call.hidden)
        if not call.stream:
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _answer(self, prompts: list, results: list, hidden: bool) -> dict:
        choices = []
        for i, c in enumerate(results):
            text = self.tokenizer.decode([c.token]) if self.tokenizer is not None else str(c.token)
            choice = {"index": i, "text": text, "token_ids": [c.token], "logprobs": None, "finish_reason": "length",
                      "metrics": {"request_id": c.request_id, "queue_time_s": c.queue_s, "ttft_s": c.done_s,
                                  "attention_rank": c.rank}}
            if hidden:
                choice["hidden_states"] = c.hidden.tolist()
            choices.append(choice)
        prompt_tokens = sum(int(p.numel()) for p in prompts)
        return {"id": f"cmpl-{results[0].request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.opts.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(prompts),
                          "total_tokens": prompt_tokens + len(prompts)}}

    # ------------------------------------------------------------------ health
    def _watch_heartbeats(self) -> None:
        """Look at the workers' rows; log when one stalls past ``--worker-stall-s`` and when it comes back."""
        self.beats.observe()
        ages = self.beats.ages()
        limit = self.opts.worker_stall_s
        for pe, age in ages.items():
            if age > limit and pe not in self.stalled:
                self.stalled.add(pe)
                print(f"asap serve: {self.role_of(pe)} PE {pe} sent no heartbeat for {age:.1f} s (stalled; "
                      f"/health answers 503 until it does)", file=sys.stderr, flush=True)
            elif age <= limit and pe in self.stalled:
                self.stalled.discard(pe)
                print(f"asap serve: {self.role_of(pe)} PE {pe} runs again", file=sys.stderr, flush=True)

    def workers(self) -> list:
        self.beats.observe()  # the engine looks every 20 ms, but it may itself have been stalled
        rows, ages = self.stats.rows(), self.beats.ages()
        out = []
        for pe in range(self.comm.world_size - 1):
            out.append({"pe": pe, "role": self.role_of(pe), "pid": rows[pe]["pid"] or None,
                        "state": self.comm.peer_state(pe), "heartbeat_age_s": round(ages[pe], 3)})
        return out

    async def health(self, request):
        from aiohttp import web

        workers = self.workers()
        dead = [w for w in workers if w["state"] == "died"]
        if self.failure is None and dead:
            w = dead[0]
            self._fail(f"{w['role']} PE {w['pe']} died")
        err = self._unavailable()
        limit = self.opts.worker_stall_s
        stalled = sorted((w for w in workers if w["state"] == "alive" and w["heartbeat_age_s"] > limit),
                         key=lambda w: -w["heartbeat_age_s"])  # the oldest first: in lock-step, the one others wait on
        if err is None and stalled:
            err = HttpError(503, "stalled: " + "; ".join(
                f"{w['role']} PE {w['pe']} (pid {w['pid']}) sent no heartbeat for {w['heartbeat_age_s']:.1f} s"
                for w in stalled) + f" (--worker-stall-s {limit:g})")
        body = {"status": "ok" if err is None else "unhealthy", "mode": self.opts.mode, "model": self.opts.model_name,
                "front_end_pid": os.getpid(), "worker_stall_s": limit, "workers": workers}
        if err is not None:
            body["error"] = err.message
        return web.json_response(body, status=200 if err is None else 503)

    async def metrics(self, request):
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.opts.model_name, "object": "model", "created": int(self.started), "owned_by": "asap",
             "max_model_len": self.cfg.max_prompt_len, "vocab_size": self.info.vocab_size}]})


class _WorkerCollector:
    """Prometheus collector of the workers' live statistics (``protocol.WorkerStats``) and heartbeat ages."""

    def __init__(self, svc: _Service) -> None:
        self.svc = svc

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        rows = self.svc.stats.rows()
        self.svc.beats.observe()
        ages = self.svc.beats.ages()
        busy = GaugeMetricFamily("asap_rank_busy_fraction", "Fraction of its lifetime a worker spent computing",
                                 labels=["pe", "role"])
        beat = GaugeMetricFamily("asap_worker_heartbeat_age_seconds", "Seconds since the front end saw the worker's "
                                 "statistics row change (it publishes every 0.1 s while it runs)",
                                 labels=["pe", "role"])
        hist = HistogramMetricFamily("asap_expert_batch_size_rows", "Rows per expert batch (async: per expert "
                                     "rank's gathered batch; sync: per worker's all-to-all share)", labels=["pe"])
        for pe in range(self.svc.comm.world_size - 1):
            r = rows[pe]
            role = self.svc.role_of(pe)
            busy.add_metric([str(pe), role], r["busy_fraction"])
            beat.add_metric([str(pe), role], ages[pe])
            if r["batches"]:
                cum, buckets = 0, []
                for ub, n in zip(list(BATCH_BUCKETS) + [math.inf], r["buckets"]):
                    cum += n
                    buckets.append(("+Inf" if ub == math.inf else str(float(ub)), cum))
                hist.add_metric([str(pe)], buckets, sum_value=r["rows"])
        yield busy
        yield beat
        yield hist


def service_main(comm, mode: str, *args):
    """One PE of a service group: signals are the parent's business (it turns SIGINT/SIGTERM into the stop
    event the front end watches; a terminal's Ctrl-C and a supervisor's SIGTERM to the whole process group
    reach every PE), then the mode's ``group_main``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "async":
        from .runtime import group_main
    else:
        from .sync import group_main
    return group_main(comm, *args)


class HttpFront:
    """The front-end role of a service group (picklable): runs :class:`_Service` on the group's channels."""

    def __init__(self, opts: ServiceOptions, stop_event) -> None:
        self.opts, self.stop_event = opts, stop_event

    def __call__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of) -> dict:
        return asyncio.run(self._serve(comm, cfg, info, ch, num_targets, label, role_of))

    async def _serve(self, comm, cfg, info, ch, num_targets, label, role_of) -> dict:
        from aiohttp import web

        svc = _Service(comm, cfg, info, ch, num_targets, label, role_of, self.opts, self.stop_event)
        try:  # "listening" means ready: every worker built its model and entered its loop
            waited = svc.fe.wait_ready(ch.stats, cfg.timeout_s)
        except (PeerFailure, CommTimeoutError) as e:
            print(f"asap serve: the workers did not start: {e}", file=sys.stderr, flush=True)
            return {"failure": f"start-up: {e}", "requests": 0}
        print(f"asap serve: {num_targets} {'attention ranks' if label == 'async' else 'workers'} ready after "
              f"{waited:.1f} s", file=sys.stderr, flush=True)
        # auto_decompress off: a compressed body is refused (415), never inflated, not even to be dropped.
        # The logger keeps tracebacks for the server's own faults, not for malformed requests (aiohttp's 400s).
        logger = logging.getLogger("asap_comm.serving.http")
        if not any(isinstance(f, ClientErrorFilter) for f in logger.filters):
            logger.addFilter(ClientErrorFilter())
        runner = web.AppRunner(svc.app(), handler_cancellation=True, access_log=None, auto_decompress=False,
                               logger=logger)
        await svc.parser.start()
        await runner.setup()
        site = web.TCPSite(runner, self.opts.host, self.opts.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"asap serve: bodies up to {self.opts.body_bound} bytes; admission bound "
              f"{self.opts.max_queued_tokens} tokens, waiting room {self.opts.waiting_bound} tokens; "
              + ("/v1/* needs the API key" if self.opts.api_key is not None else "no API key"),
              file=sys.stderr, flush=True)
        print(f"asap serve: {self.opts.mode} mode, model {self.opts.model_name}, listening on "
              f"http://{self.opts.host}:{port}", flush=True)
        try:
            await svc.engine()
        finally:
            await runner.cleanup()
            await svc.parser.close()
            svc.tokenizing.shutdown(wait=False, cancel_futures=True)
        if svc.failure is None:
            svc.fe.stop(5.0)
        else:
            try:  # the live workers may still take the stop message
                svc.fe.stop(1.0)
            except CommError:
                pass
        return {"failure": svc.failure, "requests": svc.next_id - 1}


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m asap_comm.serving.server", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="small", help="a model preset (tiny, small, ...) or a checkpoint directory")
    ap.add_argument("--plugin", default="deepseek", help="the model plugin (entry-point group asap_comm.models)")
    ap.add_argument("--mode", choices=["async", "sync"], default="async",
                    help="async: ASAP; sync: the DP+EP baseline on the same processes")
    ap.add_argument("--attention-ranks", type=int, default=2)
    ap.add_argument("--expert-ranks", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    ap.add_argument("--served-model-name", default=None, help="the model id of the API (default: --model's name)")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer directory; enables text prompts")
    ap.add_argument("--max-prompt-len", type=int, default=8192)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--sync-collectives", choices=["gloo", "shm"], default="shm")
    ap.add_argument("--max-queued-tokens", type=int, default=65536,
                    help="admission bound: prompt tokens admitted and not finished; a call over it on its own gets "
                         "413, others wait their turn (first come, first served)")
    ap.add_argument("--max-waiting-tokens", type=int, default=None,
                    help="prompt tokens of the calls waiting for admission (429 past it); unset: twice "
                         "--max-queued-tokens")
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the largest request body read (413 past it); unset: 1 MiB + 16 bytes per token of "
                         "--max-queued-tokens")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every path but /health and /metrics; unset: "
                         "the environment variable ASAP_API_KEY (preferred: a command line is visible to ps)")
    ap.add_argument("--request-timeout-s", type=float, default=60.0, help="per-request deadline (504 past it)")
    ap.add_argument("--worker-stall-s", type=float, default=10.0,
                    help="/health answers 503 naming a worker whose heartbeat is older than this (not a failure)")
    ap.add_argument("--drain-timeout-s", type=float, default=30.0, help="on SIGTERM/Ctrl-C: in-flight grace")
    ap.add_argument("--failure-exit-s", type=float, default=10.0,
                    help="after a worker dies: answer 503 this long, then exit with status 3")
    ap.add_argument("--comm-timeout-s", type=float, default=30.0,
                    help="the communicator's default wait bound; the serving loops retry waits on a live peer "
                         "that is slow or stopped, so it does not limit how long a peer may stall")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset model")
    return ap


def service_options(args, environ) -> ServiceOptions:
    """The HTTP side's settings from parsed arguments; the API key from ``--api-key`` or else
    ``environ["ASAP_API_KEY"]``. ``ValueError`` for an empty key (a typo must not switch authentication off)."""
    api_key = args.api_key if args.api_key is not None else environ.get("ASAP_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key / ASAP_API_KEY is empty: give a key, or unset it for no authentication")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ServiceOptions(host=args.host, port=args.port, model_name=name, mode=args.mode,
                          max_queued_tokens=args.max_queued_tokens, request_timeout_s=args.request_timeout_s,
                          drain_timeout_s=args.drain_timeout_s, failure_exit_s=args.failure_exit_s,
                          tokenizer=args.tokenizer, max_body_bytes=args.max_body_bytes,
                          max_waiting_tokens=args.max_waiting_tokens, worker_stall_s=args.worker_stall_s,
                          api_key=api_key)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    missing = [m for m in ("aiohttp", "prometheus_client") if _missing(m)]
    if missing:
        print(f"asap serve: missing {', '.join(missing)}: pip install -e \".[serve]\"", file=sys.stderr)
        return 2
    if args.tokenizer is not None and _missing("transformers"):
        print("asap serve: --tokenizer needs transformers: pip install transformers", file=sys.stderr)
        return 2
    from .plugins import load_model_factory, model_info_of
    try:
        factory = load_model_factory(args.model, plugin=args.plugin, seed=args.seed)
        info = model_info_of(factory)
        cfg = RuntimeConfig(num_attention_ranks=args.attention_ranks, num_expert_ranks=args.expert_ranks,
                            token_budget=args.token_budget, max_prompt_len=args.max_prompt_len,
                            chunk_len=args.chunk_len, sync_collectives=args.sync_collectives)
        opts = service_options(args, os.environ)
    except (ValueError, LookupError, OSError) as e:
        print(f"asap serve: {e}", file=sys.stderr)
        return 2
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # started by torchrun: one PE of a group across hosts
        return _serve_one_pe(args, factory, info, cfg, opts)
    if not _can_listen(opts):
        return 2
    stop = mp.get_context("spawn").Event()
    front = HttpFront(opts, stop)
    old = _stop_on_signals(stop)
    from ..launch import launch
    store = None
    try:
        world = cfg.num_attention_ranks + cfg.num_expert_ranks + 1
        if args.mode == "async":
            fnargs = ("async", cfg, info, factory, front)
        else:
            from ..rendezvous import loopback_store
            from .sync import check_config
            check_config(factory, cfg)
            store = loopback_store(cfg.timeout_s)  # the workers' gloo group: on 127.0.0.1 only
            fnargs = ("sync", cfg, info, factory, store.port, front)
        print(f"asap serve: starting {world - 1} {args.mode} workers for {opts.model_name} ...", file=sys.stderr,
              flush=True)
        results = launch(service_main, world, *fnargs, timeout=1e9, comm_timeout=args.comm_timeout_s,
                         leader=world - 1, leader_grace=5.0)
    except LaunchError as e:
        first = str(e).splitlines()[0]
        if e.remote_type == "OutOfSharedMemory":  # a setting of this machine, not a failure of the service
            print(f"asap serve: {first.split('raised OutOfSharedMemory: ', 1)[-1]}", file=sys.stderr)
            return 2
        print(f"asap serve: stopped: {first}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("asap serve: stopped at once (second signal)", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        del store
    return _exit_status(results[-1][1])


def _can_listen(opts: ServiceOptions) -> bool:
    """Whether the HTTP port can be bound (said at once, not from a group that took seconds to start)."""
    if opts.port:
        import socket
        try:
            with socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((opts.host, opts.port))
        except OSError as e:
            print(f"asap serve: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr)
            return False
    if opts.api_key is None and opts.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"asap serve: warning: listening on {opts.host} without an API key (--api-key or ASAP_API_KEY)",
              file=sys.stderr, flush=True)
    return True


def _stop_on_signals(stop) -> dict:
    """SIGINT/SIGTERM set ``stop`` (the front end drains, then stops the workers); a second one stops at once.
    Returns the previous handlers."""
    signals = [0]

    def on_signal(signum, frame):
        signals[0] += 1
        if signals[0] > 1:
            raise KeyboardInterrupt
        stop.set()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _exit_status(summary: dict) -> int:
    if summary["failure"]:
        print(f"asap serve: exited after {summary['failure']}", file=sys.stderr)
        return 3
    print(f"asap serve: stopped cleanly after {summary['requests']} request(s)", file=sys.stderr)
    return 0


def _serve_one_pe(args, factory, info, cfg: RuntimeConfig, opts: ServiceOptions) -> int:
    """One PE of a service whose workers span hosts, started by torchrun on every host (README, "The service
    across hosts"). torchrun's rank 0, on node 0, is the front end and the HTTP server (the group's last PE,
    as on one host); torchrun's rank r > 0 is PE r - 1. The group needs ``$ASAP_GROUP_SECRET``, the same on
    every host. Exit status as on one host (2: bad arguments or settings, 3: a worker failed); a worker's own
    status is 0 once the front end stopped it, 3 if the group failed under it."""
    from ..comm import init
    from ..errors import OutOfSharedMemory

    W, r = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
    if A + E + 1 != W:
        if r == 0:
            print(f"asap serve: torchrun started {W} processes, but --attention-ranks {A} + --expert-ranks {E} + "
                  f"the front end make {A + E + 1}", file=sys.stderr)
        return 2
    pe = W - 1 if r == 0 else r - 1
    is_front = pe == W - 1
    if is_front and not _can_listen(opts):
        return 2
    stop = threading.Event()
    if is_front:
        old = _stop_on_signals(stop)
    else:  # the front end stops the workers (a worker that died would fail the service)
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            comm = init(pe, W, timeout=args.comm_timeout_s)
        except CommError as e:
            print(f"asap serve: PE {pe}: {e}", file=sys.stderr)
            return 2
        with comm:
            if is_front:
                where = ", ".join(f"PE {p}@{h}" for p, h in enumerate(comm.hosts))
                print(f"asap serve: {W - 1} {args.mode} workers for {opts.model_name} on "
                      f"{len(set(comm.hosts))} hosts ({where})", file=sys.stderr, flush=True)
            front = HttpFront(opts, stop)
            try:
                if args.mode == "async":
                    from .runtime import group_main
                    role, payload = group_main(comm, cfg, info, factory, front)
                else:
                    from .sync import check_config
                    from .sync import group_main
                    check_config(factory, cfg)
                    role, payload = group_main(comm, cfg, info, factory, comm._store, front)
            except OutOfSharedMemory as e:
                print(f"asap serve: PE {pe}: {e}", file=sys.stderr)
                return 2
            except CommError as e:  # PeerFailure, TimeoutError: the group failed under this worker
                print(f"asap serve: PE {pe}: stopped: {e}", file=sys.stderr, flush=True)
                if not is_front:  # leave after the front end: torchrun stops a node's processes once one fails,
                    _outlive_front_end(comm, opts)  # which would cut short the front end's 503 answers
                return 3
    except KeyboardInterrupt:
        print("asap serve: stopped at once (second signal)", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return _exit_status(payload) if role == "front" else 0


def _outlive_front_end(comm, opts: ServiceOptions) -> None:
    """A worker whose group failed waits (bounded) until the front end has answered 503 for its
    ``--failure-exit-s`` and left."""
    front = comm.world_size - 1
    deadline = time.monotonic() + opts.failure_exit_s + 15.0
    while time.monotonic() < deadline and comm.peer_state(front) == "alive":
        time.sleep(0.1)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    sys.exit(main())
