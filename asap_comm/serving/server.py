"""The online prefill service: ASAP (or the DP+EP baseline) behind an OpenAI-compatible HTTP API.

    python -m asap_comm.serving.server --model small --attention-ranks 2 --expert-ranks 2 --port 8000
    python -m asap_comm.serving.server --model small --mode sync --port 8000      # the baseline

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
  ``max_tokens`` must be 1 (or absent): this is a prefill tier. The answer
  carries the first generated token (``choices[i].text`` as the token id
  string, or the decoded text with a tokenizer; ``choices[i].token_ids``),
  ``usage``, and per choice ``metrics``: ``request_id``, ``queue_time_s``
  (admission until its last chunk entered its rank's inbox), ``ttft_s``
  (admission until its result reached the front end) and
  ``attention_rank`` (the rank that computed it). ``"stream": true`` sends
  the answer as one SSE event, then ``data: [DONE]``.
  Extension: ``"return_hidden_states": true`` adds ``hidden_states`` (the
  final-normed hidden state of the last prompt token) to each choice.
* ``GET /health``: 200 and each worker's PE, role, pid and state while every
  worker lives; 503 naming the dead worker (or "shutting down") otherwise.
* ``GET /metrics``: Prometheus text (``prometheus_client``).
* ``GET /v1/models``.

Behaviour:

* **Back-pressure.** Admitted-but-unfinished prompt tokens are bounded by
  ``--max-queued-tokens``; past it the answer is 429 with ``Retry-After``
  (seconds, from the recent token throughput). Memory never grows without
  bound: the HTTP layer holds nothing a worker has not admitted.
* **Deadlines.** Every request has a deadline (``--request-timeout-s`` from
  its arrival); when it passes the answer is 504 and the request is
  cancelled: chunks not yet sent are dropped, its rank drops its queued
  chunks and KV cache (a chunk already running finishes first).
* **Bad input** gets a 400 naming the field; nothing reaches a worker.
* **A client that disconnects** cancels its requests the same way (their
  admission tokens are released at once).
* **Worker death.** Requests in flight fail with 503 naming the worker,
  ``/health`` and new requests answer 503, and after ``--failure-exit-s``
  seconds (default 10, so that load balancers see it) the service stops the
  remaining workers and exits with status 3. It does not restart workers in
  place: a serving group is one ``asap_comm`` communicator, whose symmetric
  memory cannot take a new member. Run it under a supervisor (systemd
  ``Restart=on-failure``, a Kubernetes liveness probe on ``/health``).
* **Ctrl-C / SIGTERM:** stop admitting (503), let in-flight requests finish
  for up to ``--drain-timeout-s``, fail the rest with 503, stop the workers,
  exit 0. Shared-memory segments are removed whatever happens. A second
  signal stops at once.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import CommError, LaunchError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from .frontend import FrontEnd, Rejected, validate
from .protocol import BATCH_BUCKETS, PromptRequest, RuntimeConfig

__all__ = ["ServiceOptions", "HttpFront", "service_main", "main"]

MAX_BATCH = 256  # prompts in one /v1/completions call
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_BLOCK_S = 0.0005  # while requests are in flight: the longest the loop blocks in the result inbox at a time
_IDLE_S = 0.02  # health check period while idle


@dataclass(frozen=True)
class ServiceOptions:
    """The HTTP side's settings (the runtime's are a ``RuntimeConfig``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "small"
    mode: str = "async"
    max_queued_tokens: int = 65536
    request_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    failure_exit_s: float = 10.0
    tokenizer: "str | None" = None

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"ServiceOptions: port={self.port!r} must be in [0, 65536)")
        if not (isinstance(self.max_queued_tokens, int) and self.max_queued_tokens >= 1):
            raise ValueError(f"ServiceOptions: max_queued_tokens={self.max_queued_tokens!r} must be an int >= 1")
        for name in ("request_timeout_s", "drain_timeout_s", "failure_exit_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be a positive number of seconds")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"ServiceOptions: mode={self.mode!r} must be 'async' or 'sync'")


class HttpError(Exception):
    """An HTTP error answer: status, message, and the request field it is about."""

    def __init__(self, status: int, message: str, param: "str | None" = None, retry_after: "int | None" = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after

    _TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
              504: "timeout_error"}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self._TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}


def parse_prompts(body, info, cfg, tokenizer) -> tuple:
    """``([token id tensors], is_batch)`` of a /v1/completions body, or ``HttpError(400)`` naming the field."""
    if "prompt" not in body:
        raise HttpError(400, "prompt: required (a list of token ids, a batch of such lists, or text)", "prompt")
    p = body["prompt"]
    shape_error = HttpError(400, "prompt: must be a list of token ids (integers), a batch of such lists, or text; "
                                 f"got {_describe(p)}", "prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        if tokenizer is None:
            raise HttpError(400, "prompt: text needs a tokenizer, and this service has none (start it with "
                                 "--tokenizer DIR, a local tokenizer); send token ids instead", "prompt")
        texts, batch = ([p], False) if isinstance(p, str) else (p, True)
        lists = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    elif isinstance(p, list) and (not p or all(_is_id(x) for x in p)):
        lists, batch = [p], False
    elif isinstance(p, list) and all(isinstance(x, list) for x in p):
        for i, x in enumerate(p):
            if not all(_is_id(t) for t in x):
                raise HttpError(400, f"prompt[{i}]: must be a list of token ids (integers), got {_describe(x)}",
                                "prompt")
        lists, batch = p, True
        if not lists:
            raise HttpError(400, "prompt: empty batch", "prompt")
    else:
        raise shape_error
    if len(lists) > MAX_BATCH:
        raise HttpError(400, f"prompt: a batch of {len(lists)} prompts is more than the {MAX_BATCH} one call takes",
                        "prompt")
    out = []
    for i, ids in enumerate(lists):
        name = f"prompt[{i}]" if batch else "prompt"
        if len(ids) > cfg.max_prompt_len:  # before building a tensor of it
            raise HttpError(400, f"{name}: prompt of {len(ids)} tokens is longer than the maximum "
                                 f"{cfg.max_prompt_len}", "prompt")
        try:
            t = torch.tensor(ids, dtype=torch.int64)
        except (OverflowError, RuntimeError):
            raise HttpError(400, f"{name}: token ids must fit a 64-bit integer", "prompt") from None
        error = validate(PromptRequest(0, 0.0, t), info, cfg)
        if error is not None:
            raise HttpError(400, f"{name}: {error}", "prompt")
        out.append(t)
    return out, batch


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _describe(x) -> str:
    s = json.dumps(x)
    return f"{type(x).__name__} {s[:60]}{'...' if len(s) > 60 else ''}"


class _Service:
    """Everything the front-end PE runs: the admission path, the HTTP app and the metrics."""

    def __init__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of, opts: ServiceOptions,
                 stop_event) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.comm, self.cfg, self.info, self.opts, self.stop_event = comm, cfg, info, opts, stop_event
        self.role_of, self.stats = role_of, ch.stats
        self.fe = FrontEnd(comm, cfg, info, ch.box, num_targets, label, max_queued_tokens=opts.max_queued_tokens)
        self.futures: dict = {}  # request id -> asyncio future of its Completion
        self.deadlines: list = []  # heap of (deadline, request id)
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
        self.m_requests = Counter("asap_requests", "Requests by outcome (ok, invalid, overloaded, timeout, "
                                  "cancelled, unavailable)", ["outcome"], registry=r)
        self.m_running = Gauge("asap_num_requests_running", "Requests admitted and not finished", registry=r)
        self.m_running.set_function(lambda: len(self.fe.inflight))
        self.m_tokens = Gauge("asap_admitted_prompt_tokens", "Prompt tokens admitted and not finished (bounded by "
                              "--max-queued-tokens)", registry=r)
        self.m_tokens.set_function(lambda: self.fe.queued_tokens)
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
            if stop_requested and not self.stopping:
                self.stopping = True
                self.drain_until = time.monotonic() + self.opts.drain_timeout_s
                print(f"asap serve: stopping: draining {len(fe.inflight)} request(s) in flight "
                      f"(at most {self.opts.drain_timeout_s:g} s)", file=sys.stderr, flush=True)
            busy = bool(fe.inflight or fe.has_unsent)
            if self.failure is None:
                try:  # busy: block in the inbox (a result wakes it at once), then let HTTP run
                    for c in fe.pump(_BLOCK_S if busy else 0.0):
                        self._complete(c)
                except PeerFailure as e:
                    self._fail(f"{self.role_of(e.pe)} PE {e.pe} {e.reason}")
                except CommTimeoutError as e:
                    self._fail(str(e))
                except CommError as e:
                    self._fail(f"communication error: {e}")
            self._expire()
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
        self.m_ttft.observe(c.done_s)
        self.m_queue.observe(c.queue_s)
        self.m_prompt.inc(c.tokens)
        now = time.monotonic()
        self.tokens_done.append((now, c.tokens))
        while now - self.tokens_done[0][0] >= 10.0:  # the window Retry-After looks at
            self.tokens_done.popleft()
        if fut is not None and not fut.done():
            fut.set_result(c)
        self.m_requests.labels("ok").inc()

    def _reject(self, rid: int, err: HttpError) -> None:
        fut = self.futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(err)

    def _fail(self, what: str) -> None:
        self.failure = f"worker failure: {what}"
        self.failed_at = time.monotonic()
        print(f"asap serve: {self.failure}; answering 503, exiting in {self.opts.failure_exit_s:g} s",
              file=sys.stderr, flush=True)
        for rid in list(self.futures):
            self.fe.inflight.pop(rid, None)
            self._reject(rid, HttpError(503, f"{self.failure}: this request was lost"))
            self.m_requests.labels("unavailable").inc()

    def _expire(self) -> None:
        now = time.monotonic()
        while self.deadlines and self.deadlines[0][0] <= now:
            _, rid = heapq.heappop(self.deadlines)
            if rid in self.futures:
                self.fe.cancel(rid)
                self._reject(rid, HttpError(504, f"request {rid} passed its deadline of "
                                                 f"{self.opts.request_timeout_s:g} s; its work was cancelled"))
                self.m_requests.labels("timeout").inc()

    def retry_after_s(self) -> int:
        """How long the admitted tokens take to drain at the recent throughput (1..60 s)."""
        now = time.monotonic()
        while self.tokens_done and now - self.tokens_done[0][0] >= 10.0:
            self.tokens_done.popleft()
        if not self.tokens_done:
            return 1
        span = max(now - self.tokens_done[0][0], 0.5)
        rate = sum(n for _, n in self.tokens_done) / span
        return int(min(60, max(1, math.ceil(self.fe.queued_tokens / max(rate, 1e-9)))))

    # ------------------------------------------------------------------ HTTP
    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    def _json_error(self, err: HttpError):
        from aiohttp import web

        headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        return web.json_response(err.body(), status=err.status, headers=headers)

    def _unavailable(self) -> "HttpError | None":
        if self.failure is not None:
            return HttpError(503, self.failure)
        if self.stopping:
            return HttpError(503, "the service is shutting down")
        return None

    async def completions(self, request):
        from aiohttp import web

        arrived = time.monotonic()
        try:
            err = self._unavailable()
            if err is not None:
                self.m_requests.labels("unavailable").inc()
                raise err
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise HttpError(400, f"request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise HttpError(400, f"request body must be a JSON object, got {_describe(body)}")
            stream, hidden = self._flags(body)
            prompts, _batch = parse_prompts(body, self.info, self.cfg, self.tokenizer)
            rids, futs = self._admit(prompts, arrived)
        except HttpError as e:
            if e.status == 400 or e.status == 404:
                self.m_requests.labels("invalid").inc()
            elif e.status == 429:
                self.m_requests.labels("overloaded").inc()
            return self._json_error(e)
        if not stream:
            try:
                results = await asyncio.gather(*futs)
            except asyncio.CancelledError:  # the client went away: free its slots now
                self._cancel(rids)
                raise
            except HttpError as e:
                self._cancel(rids)
                return self._json_error(e)
            return web.json_response(self._answer(prompts, results, hidden))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            try:
                results = await asyncio.gather(*futs)
                event = self._answer(prompts, results, hidden)
            except HttpError as e:
                self._cancel(rids)
                event = e.body()
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self._cancel(rids)
            raise
        return resp

    def _flags(self, body: dict) -> tuple:
        name = body.get("model")
        if name is not None and name != self.opts.model_name:
            raise HttpError(404, f"model: {name!r} is not served here (this service serves "
                                 f"{self.opts.model_name!r})", "model")
        mt = body.get("max_tokens", 1)
        if not _is_id(mt) or mt != 1:
            raise HttpError(400, f"max_tokens: must be 1 (this is a prefill tier: it returns the first token); "
                                 f"got {json.dumps(mt)}", "max_tokens")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HttpError(400, f"stream: must be true or false, got {json.dumps(stream)}", "stream")
        hidden = body.get("return_hidden_states", False)
        if not isinstance(hidden, bool):
            raise HttpError(400, f"return_hidden_states: must be true or false, got {json.dumps(hidden)}",
                            "return_hidden_states")
        return stream, hidden

    def _admit(self, prompts: list, arrived: float) -> tuple:
        """Admit every prompt of a call, or none (429 past the bound)."""
        fe, bound = self.fe, self.opts.max_queued_tokens
        total = sum(int(p.numel()) for p in prompts)
        if fe.inflight and fe.queued_tokens + total > bound:
            raise HttpError(429, f"over the admission bound: {fe.queued_tokens} prompt tokens in flight, "
                                 f"{total} more would pass the bound of {bound}; retry later",
                            retry_after=self.retry_after_s())
        loop = asyncio.get_running_loop()
        rids, futs = [], []
        deadline = arrived + self.opts.request_timeout_s
        for p in prompts:
            rid = self.next_id
            self.next_id += 1
            try:
                fe.admit(rid, p, check_bound=False)  # the whole call was checked against the bound above
            except Rejected as e:  # validated above: not expected
                self._cancel(rids)
                raise HttpError(400, e.reason, "prompt") from None
            fut = loop.create_future()
            self.futures[rid] = fut
            heapq.heappush(self.deadlines, (deadline, rid))
            rids.append(rid)
            futs.append(fut)
        self.wake.set()
        return rids, futs

    def _cancel(self, rids: list) -> None:
        for rid in rids:
            fut = self.futures.pop(rid, None)
            if self.fe.cancel(rid) and fut is not None:
                self.m_requests.labels("cancelled").inc()
            if fut is not None and not fut.done():
                fut.cancel()

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

    def workers(self) -> list:
        rows = self.stats.rows()
        out = []
        for pe in range(self.comm.world_size - 1):
            out.append({"pe": pe, "role": self.role_of(pe), "pid": rows[pe]["pid"] or None,
                        "state": self.comm.peer_state(pe)})
        return out

    async def health(self, request):
        from aiohttp import web

        workers = self.workers()
        dead = [w for w in workers if w["state"] == "died"]
        if self.failure is None and dead:
            w = dead[0]
            self._fail(f"{w['role']} PE {w['pe']} died")
        err = self._unavailable()
        body = {"status": "ok" if err is None else "unhealthy", "mode": self.opts.mode, "model": self.opts.model_name,
                "workers": workers}
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
    """Prometheus collector of the workers' live statistics (``protocol.WorkerStats``)."""

    def __init__(self, svc: _Service) -> None:
        self.svc = svc

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        rows = self.svc.stats.rows()
        busy = GaugeMetricFamily("asap_rank_busy_fraction", "Fraction of its lifetime a worker spent computing",
                                 labels=["pe", "role"])
        hist = HistogramMetricFamily("asap_expert_batch_size_rows", "Rows per expert batch (async: per expert "
                                     "rank's gathered batch; sync: per worker's all-to-all share)", labels=["pe"])
        for pe in range(self.svc.comm.world_size - 1):
            r = rows[pe]
            role = self.svc.role_of(pe)
            busy.add_metric([str(pe), role], r["busy_fraction"])
            if r["batches"]:
                cum, buckets = 0, []
                for ub, n in zip(list(BATCH_BUCKETS) + [math.inf], r["buckets"]):
                    cum += n
                    buckets.append(("+Inf" if ub == math.inf else str(float(ub)), cum))
                hist.add_metric([str(pe)], buckets, sum_value=r["rows"])
        yield busy
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
        runner = web.AppRunner(svc.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.opts.host, self.opts.port)
        await site.start()
        port = runner.addresses[0][1]
        print(f"asap serve: {self.opts.mode} mode, model {self.opts.model_name}, listening on "
              f"http://{self.opts.host}:{port}", flush=True)
        try:
            await svc.engine()
        finally:
            await runner.cleanup()
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
                    help="admission bound: prompt tokens admitted and not finished (429 past it)")
    ap.add_argument("--request-timeout-s", type=float, default=60.0, help="per-request deadline (504 past it)")
    ap.add_argument("--drain-timeout-s", type=float, default=30.0, help="on SIGTERM/Ctrl-C: in-flight grace")
    ap.add_argument("--failure-exit-s", type=float, default=10.0,
                    help="after a worker dies: answer 503 this long, then exit with status 3")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset model")
    return ap


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
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        opts = ServiceOptions(args.host, args.port, name, args.mode, args.max_queued_tokens, args.request_timeout_s,
                              args.drain_timeout_s, args.failure_exit_s, args.tokenizer)
    except (ValueError, LookupError, OSError) as e:
        print(f"asap serve: {e}", file=sys.stderr)
        return 2
    if opts.port:  # say it now, not from a worker group that took seconds to start
        import socket
        try:
            with socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((opts.host, opts.port))
        except OSError as e:
            print(f"asap serve: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr)
            return 2
    front = HttpFront(opts, stop)
    signals = [0]

    def on_signal(signum, frame):
        signals[0] += 1
        if signals[0] > 1:
            raise KeyboardInterrupt
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    from ..launch import launch
    store = None
    try:
        world = cfg.num_attention_ranks + cfg.num_expert_ranks + 1
        if args.mode == "async":
            fnargs = ("async", cfg, info, factory, front)
        else:
            from datetime import timedelta

            import torch.distributed as dist

            from .sync import check_config
            check_config(factory, cfg)
            store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=cfg.timeout_s),
                                  wait_for_workers=False)
            fnargs = ("sync", cfg, info, factory, store.port, front)
        print(f"asap serve: starting {world - 1} {args.mode} workers for {name} ...", file=sys.stderr, flush=True)
        results = launch(service_main, world, *fnargs, timeout=1e9, leader=world - 1, leader_grace=5.0)
    except LaunchError as e:
        print(f"asap serve: stopped: {str(e).splitlines()[0]}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("asap serve: stopped at once (second signal)", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        del store
    summary = results[-1][1]
    if summary["failure"]:
        print(f"asap serve: exited after {summary['failure']}", file=sys.stderr)
        return 3
    print(f"asap serve: stopped cleanly after {summary['requests']} request(s)", file=sys.stderr)
    return 0


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


if __name__ == "__main__":
    sys.exit(main())
