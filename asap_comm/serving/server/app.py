"""The service's HTTP app: the routes over one :class:`~.engine.Engine`, and :class:`HttpFront`, the front-end
role of a service group that runs both on one asyncio loop.

Routes: ``POST /v1/completions`` (read and check the body, admit the call,
answer with its results: JSON or one SSE event), ``GET /health``,
``GET /metrics`` and ``GET /v1/models``; a middleware checks the API key and
turns every HTTP error into a JSON body. The package's docstring
(``asap_comm.serving.server``) lists every status they answer.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ...errors import CommError, PeerFailure
from ...errors import TimeoutError as CommTimeoutError
from .engine import Engine
from .options import ServiceOptions
from .frontdoor import ConnectionGuard, default_max_connections, install_accept_error_filter
from .request import BodyBudget, ClientErrorFilter, HttpError, api_key_matches, check_headers, completion_of, read_body
from .schemas import INLINE_BYTES, ParseProcess, parse_call

__all__ = ["HttpApp", "HttpFront", "client_of"]

_BODY_BUDGET_BODIES = 8  # request bodies held at once: at most this many times --max-body-bytes
_BODY_RESERVE_BODIES = 1  # of which this many times --max-body-bytes are kept for small bodies (<= INLINE_BYTES)
_BODY_CLIENT_BODIES = 2  # and one client's large bodies hold at most this many times --max-body-bytes
_MAX_REQUEST_ID = 128  # characters of an X-Request-Id
_OPEN_PATHS = ("/health", "/metrics")  # what --api-key leaves open
# what each refused status counts as in asap_requests_total{outcome}
_OUTCOME = {401: "unauthorized", 429: "overloaded", 503: "unavailable", 504: "timeout"}


def client_of(request) -> str:
    """Who sent ``request``, for fairness and the body budget: the peer's address (one API key is shared by all
    its users, so the address is what tells them apart; behind a proxy, every client is the proxy)."""
    return request.remote or "?"


class HttpApp:
    """The routes of one service: the body budget, the parse process, the tokenizer and the API key are theirs;
    everything else is the engine's (``svc``)."""

    def __init__(self, svc: Engine, opts: ServiceOptions) -> None:
        self.svc, self.opts = svc, opts
        info, cfg = svc.info, svc.cfg
        self.bodies = BodyBudget(_BODY_BUDGET_BODIES * opts.body_bound, reserve=_BODY_RESERVE_BODIES * opts.body_bound,
                                 per_client=_BODY_CLIENT_BODIES * opts.body_bound, small=INLINE_BYTES)
        self.guard: "ConnectionGuard | None" = None  # set by HttpFront once it listens
        self.parser = ParseProcess({"model_name": opts.model_name, "vocab_size": info.vocab_size,
                                    "max_prompt_len": cfg.max_prompt_len, "max_call_tokens": opts.max_queued_tokens})
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asap-tokenize")  # not thread-safe
        self.key_digest = (hashlib.sha256(opts.api_key.encode("utf-8", "surrogateescape")).digest()
                           if opts.api_key is not None else None)  # as api_key_matches encodes what it is given
        self.tokenizer = None
        if opts.tokenizer:
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer, local_files_only=True)
        self.started = time.time()

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

    def _has_key(self, request) -> bool:
        """Whether ``request`` may see everything: the right key, or a service without one."""
        return self.key_digest is None or api_key_matches(request.headers.get("Authorization"), self.key_digest)

    def _unauthorized(self) -> HttpError:
        return HttpError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                         headers={"WWW-Authenticate": 'Bearer realm="asap"'})

    async def _guard(self, request, handler):
        """Middleware: the connection guard's request span, the API key, and every HTTP error (an unknown path, a
        wrong method) as a JSON body. An answer given before a compressed body was read closes the connection:
        aiohttp would otherwise read (and decompress) the rest only to drop it."""
        if self.guard is not None:
            self.guard.begin(request.transport)
        try:
            return await self._guarded(request, handler)
        finally:
            if self.guard is not None:
                self.guard.end(request.transport)

    async def _guarded(self, request, handler):
        from aiohttp import web

        client = client_of(request)
        # a client sending bad calls fast waits first (.fairness.ErrorBrake); /health and /metrics never do
        braked = request.path not in _OPEN_PATHS and await self.svc.brake.wait(client)
        if not self._authorized(request):
            self.svc.metrics.count("unauthorized")
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
        if 400 <= resp.status < 500 and resp.status != 429:  # the caller's own error
            self.svc.brake.refused(client, braked)
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

    async def _read_call(self, request, arrived: float):
        """Read, decode and check the body (``request.Completion``). Bodies over ``INLINE_BYTES`` are parsed
        in the parse process (``schemas``), so they never hold this loop; a body holds its bytes of the body
        budget until its parse is over. Text goes through the tokenizer on its one thread."""
        info, cfg = self.svc.info, self.svc.cfg
        lease = self.bodies.lease(client_of(request))
        handed = False
        try:
            body = await read_body(request, self.opts.body_bound,
                                   self.opts.request_timeout_s - (time.monotonic() - arrived), lease,
                                   self.opts.min_body_rate)
            if len(body) <= INLINE_BYTES:
                call = parse_call(body, self.opts.model_name, info.vocab_size, cfg.max_prompt_len,
                                  self.opts.max_queued_tokens)
            else:
                handed = True  # released by the parse process's worker once it is done with the body
                call = await self.parser.parse(body, lease.release)
            del body
        finally:
            if not handed:
                lease.release()
        if call.ids is None:  # text: through the tokenizer, off the loop
            return await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, completion_of, call, info, cfg, self.tokenizer, self.opts.max_queued_tokens)
        return completion_of(call, info, cfg, self.tokenizer, self.opts.max_queued_tokens)

    async def completions(self, request):
        resp = await self._completions(request)
        base = request.get("asap_request_id")
        if base is not None and not resp.prepared:
            resp.headers["X-Request-Id"] = base
        return resp

    async def _completions(self, request):
        from aiohttp import web

        arrived = time.monotonic()
        try:
            given = request.headers.get("X-Request-Id")
            if given is not None and not (0 < len(given) <= _MAX_REQUEST_ID and given.isprintable()):
                raise HttpError(400, f"X-Request-Id must be 1 to {_MAX_REQUEST_ID} printable characters (got "
                                     f"{len(given)})")
            if given is not None:
                request["asap_request_id"] = given  # echoed on every answer, errors too
            err = self.svc.unavailable()
            if err is not None:
                raise err
            client = client_of(request)
            held = None  # a small body of a refused client waits in its connection (.fairness.HeldCalls)
            if (request.content_length or 0) <= INLINE_BYTES:
                held = await self.svc.held.hold(client)
            try:
                call = await self._read_call(request, arrived)
                rids, futs = await self.svc.admit(call, arrived, client, held)
            finally:
                if held is not None:
                    self.svc.held.unhold(client, held)
            if given is None:  # unique across restarts: a random prefix per start
                request["asap_request_id"] = f"{self.svc.id_prefix}-{rids[0]}"
        except HttpError as e:
            self.svc.metrics.count(_OUTCOME.get(e.status, "invalid"))
            return self._json_error(e)
        try:
            results = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # the client went away: free its slots now
            self.svc.cancel(rids)
            raise
        except HttpError as e:
            self.svc.cancel(rids)
            return self._json_error(e)
        answer = self._answer(request["asap_request_id"], call.prompts, results, call.hidden)
        if not call.stream:
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": request["asap_request_id"]})
        await resp.prepare(request)
        await resp.write(b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _answer(self, base: str, prompts: list, results: list, hidden: bool) -> dict:
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
        return {"id": f"cmpl-{base}", "object": "text_completion", "created": int(time.time()),
                "model": self.opts.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(prompts),
                          "total_tokens": prompt_tokens + len(prompts)}}

    async def health(self, request):
        from aiohttp import web

        svc = self.svc
        svc.check_failover()  # a dead expert PE a spare replaces (or a dead attention PE survived) is no failure
        workers = svc.workers()
        dead = [w for w in workers if w["state"] == "died" and not w.get("failed_over")]  # replaced: not a failure
        if svc.failure is None and dead:
            w = dead[0]
            svc.fail(f"{w['role']} PE {w['pe']} died")
        err = svc.unavailable()
        limit = self.opts.worker_stall_s
        stalled = sorted((w for w in workers if w["state"] == "alive" and w["heartbeat_age_s"] > limit),
                         key=lambda w: -w["heartbeat_age_s"])  # the oldest first: in lock-step, the one others wait on
        if err is None and stalled:
            err = HttpError(503, "stalled: " + "; ".join(
                f"{w['role']} PE {w['pe']} (pid {w['pid']}) sent no heartbeat for {w['heartbeat_age_s']:.1f} s"
                for w in stalled) + f" (--worker-stall-s {limit:g})")
        if not self._has_key(request):  # without the key: healthy or not, nothing else (no pids, no reasons)
            return web.json_response({"status": "ok" if err is None else "unhealthy"},
                                     status=200 if err is None else 503)
        body = {"status": "ok" if err is None else "unhealthy", "mode": self.opts.mode, "model": self.opts.model_name,
                "front_end_pid": os.getpid(), "worker_stall_s": limit, "workers": workers}
        if svc.fe.failover is not None:  # expert failover (docs/failover.md): spares left, each replacement
            body["failover"] = svc.fe.failover.summary()
        if svc.fe.attention is not None:  # attention failover: attention PEs lost, requests re-admitted
            body["attention_failover"] = svc.fe.attention.summary()
        if err is not None:
            body["error"] = err.message
        return web.json_response(body, status=200 if err is None else 503)

    async def metrics(self, request):
        from aiohttp import web
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.svc.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": self.opts.model_name, "object": "model", "created": int(self.started), "owned_by": "asap",
             "max_model_len": self.svc.cfg.max_prompt_len, "vocab_size": self.svc.info.vocab_size}]})


class HttpFront:
    """The front-end role of a service group (picklable): runs an :class:`~.engine.Engine` and its
    :class:`HttpApp` on the group's channels."""

    def __init__(self, opts: ServiceOptions, stop_event) -> None:
        self.opts, self.stop_event = opts, stop_event

    def __call__(self, comm, cfg, info, ch, num_targets: int, label: str, role_of) -> dict:
        return asyncio.run(self._serve(comm, cfg, info, ch, num_targets, label, role_of))

    async def _serve(self, comm, cfg, info, ch, num_targets, label, role_of) -> dict:
        from aiohttp import web

        svc = Engine(comm, cfg, info, ch, num_targets, label, role_of, self.opts, self.stop_event)
        http = HttpApp(svc, self.opts)
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
        runner = web.AppRunner(http.app(), handler_cancellation=True, access_log=None, auto_decompress=False,
                               logger=logger, keepalive_timeout=self.opts.idle_timeout_s + 5.0)  # the guard's first
        install_accept_error_filter()
        await http.parser.start()
        await runner.setup()
        limit = self.opts.max_connections or default_max_connections()
        guard = http.guard = ConnectionGuard(runner.server, self.opts.header_timeout_s, self.opts.idle_timeout_s, limit,
                                             svc.metrics.connection_closed)
        svc.metrics.watch_connections(guard)
        server = await asyncio.get_running_loop().create_server(guard.protocol, self.opts.host, self.opts.port,
                                                                reuse_address=True)
        guard.start()
        port = server.sockets[0].getsockname()[1]
        print(f"asap serve: connections: at most {limit} open (--max-connections), headers within "
              f"{self.opts.header_timeout_s:g} s, idle ones closed after {self.opts.idle_timeout_s:g} s; bodies at "
              f"{self.opts.min_body_rate} bytes/s or more", file=sys.stderr, flush=True)
        print(f"asap serve: bodies up to {self.opts.body_bound} bytes; admission bound "
              f"{self.opts.max_queued_tokens} tokens, waiting room {self.opts.waiting_bound} tokens; "
              + ("/v1/* needs the API key" if self.opts.api_key is not None else "no API key"),
              file=sys.stderr, flush=True)
        print(f"asap serve: {self.opts.mode} mode, model {self.opts.model_name}, listening on "
              f"http://{self.opts.host}:{port}", flush=True)
        try:
            await svc.run()
        finally:
            guard.stop()
            server.close()
            await runner.cleanup()
            await http.parser.close()
            http.tokenizing.shutdown(wait=False, cancel_futures=True)
        if svc.failure is None:
            svc.fe.stop(5.0)
            if hasattr(self.stop_event, "ended_cleanly"):  # (on one host: workers.StopFlag)
                self.stop_event.ended_cleanly()
        else:
            try:  # the live workers may still take the stop message
                svc.fe.stop(1.0)
            except CommError:
                pass
        return {"failure": svc.failure, "requests": svc.next_id - 1}
