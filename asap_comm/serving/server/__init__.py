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
* ``GET /health``: with ``--api-key`` and a request without it, only
  ``{"status": "ok"}`` (200) or ``{"status": "unhealthy"}`` (503); else 200 and each worker's PE, role, pid, state and
  ``heartbeat_age_s`` while every worker lives and runs; 503 naming the
  dead worker, the stalled one (no heartbeat for ``--worker-stall-s``), or
  "shutting down" otherwise.
* ``GET /metrics``: Prometheus text (``prometheus_client``).
* ``GET /v1/models``.

With ``--api-key`` (or ``ASAP_API_KEY``, stripped of surrounding whitespace,
with a log line), every path but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (401 otherwise; compared in constant time).
Response ids are ``cmpl-<X-Request-Id>`` when the call sends one, else
``cmpl-<random prefix per start>-<n>``; the answer echoes ``X-Request-Id``.

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
  timeout, or slower than ``--min-body-rate`` bytes/s over a 5 s window,
  gets 408. Bodies held at once, across requests, are bounded by 8x the
  bound (429 past it), 1x of it kept for small bodies (<= 64 KiB), 2x at
  most for one client's large bodies. Bodies over 64 KiB are parsed in a parse
  process beside the front end (``schemas``: JSON parsing holds the GIL,
  and would stall this loop); text prompts are tokenized on a thread.
* **Connections** (``frontdoor``): headers within ``--header-timeout-s``
  (10 s) of a request's first byte, idle connections closed after
  ``--idle-timeout-s`` (60 s), at most ``--max-connections`` open (the file
  limit less 128): the oldest idle one is closed to make room, 503 only
  when all are in a request; accept errors logged once per 10 s.
* **Fairness per client** (``fairness``; a client is the peer address): a
  call whose prompt tokens exceed ``--max-queued-tokens`` gets 413 at once.
  Calls wait per client, first come first served, clients taking turns; an
  active client holds at most its share (1/n) of the bound. The waiting room
  holds ``--max-waiting-tokens`` tokens (default: twice the admission bound)
  and 1024 calls; a call that finds it full gets 429 with ``Retry-After``
  (seconds, from the recent token throughput), unless its client holds less
  than its share of the room: then the newest calls of the client holding
  the most get the 429. A client refused so, while it still holds its share,
  has its next small calls held unread in their connections (at most half
  of ``--max-connections`` over all clients, up to ``--refused-hold-s``,
  default 1 s; they leave one at a time as the room frees:
  ``fairness.HeldCalls``). A client that had 32 calls refused as its own
  error (a 4xx other than 429) within a second has each of its calls wait
  ``--bad-call-delay-s`` (default 1 s) before it is handled, while its
  refusals keep coming (``fairness.ErrorBrake``). Past admission, each attention rank holds at most
  ``--max-rank-calls`` requests (default 0: no bound) and the front end sends the
  next one from the client with the fewest requests in flight
  (``frontend.RankQueue``). Memory: admitted + waiting prompt tokens, plus the
  body bound above; the HTTP layer holds nothing else per request.
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
  whatever happens; what a crash of the whole tree left (files of this user
  in ``/dev/shm`` no live process holds) is removed at the next start. A second signal stops at once.

Modules: ``options`` (:class:`ServiceOptions`), ``schemas`` (the request
body's schema and validation; the parse process), ``request`` (content
types, the body bound, the API key, a checked call as tensors), ``engine``
(the one loop that drives the group: admission, deadlines, failures,
health), ``metrics`` (Prometheus), ``app`` (the routes, and
:class:`HttpFront`, the front-end role that runs both), ``workers`` (the
processes: one host, or one PE under torchrun) and ``cli`` (the flags,
``main``), ``frontdoor`` (connections; crash leftovers) and ``fairness``
(admission per client). Worker heartbeats (``..heartbeat``) are a module of
``asap_comm.serving``.
"""
from .app import HttpFront
from .cli import build_parser, main, service_options
from .options import ServiceOptions
from .workers import service_main

__all__ = ["ServiceOptions", "HttpFront", "service_main", "service_options", "build_parser", "main"]
