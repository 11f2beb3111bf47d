"""The HTTP service's request side: the body bound, content types, the API key, and a checked call as tensors
(formerly ``asap_comm.serving.http_input``, which still re-exports it).

Everything a client sends to ``POST /v1/completions`` passes through here
before anything reaches the front end, and every way it can be wrong ends
in an :class:`HttpError` (a 4xx naming the problem), never in another
exception:

* :func:`check_headers`: ``Content-Type`` absent or ``application/json``
  with no charset or UTF-8 (415 otherwise, as vLLM answers), no
  ``Content-Encoding`` (415), a ``Content-Length`` within the bound (413
  before a byte is read);
* :func:`read_body`: at most ``max_bytes`` (413 as soon as a chunked body
  passes it), within the request's deadline and at a minimum rate (408),
  charged to a shared :class:`BodyBudget` (429);
* ``schemas.parse_call`` (in the front end for small bodies, in the
  parse process for large ones): UTF-8, JSON, the fields and the prompts;
* :func:`completion_of`: the prompts as int64 tensors ``[len_i]`` (text
  through the tokenizer first), checked by ``frontend.validate``.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from dataclasses import dataclass

import torch

from ..frontend import validate
from ..protocol import PromptRequest
from .schemas import MAX_BATCH, Call, HttpError, check_fields, check_id_lists, decode_body, describe

__all__ = ["HttpError", "BodyBudget", "BodyLease", "BODY_RATE_WINDOW_S", "Completion", "MAX_BATCH", "BYTES_PER_TOKEN",
           "BODY_SLACK_BYTES",
           "default_max_body_bytes", "check_content_type", "check_headers", "read_body", "decode_body",
           "completion_of", "parse_completion", "describe", "api_key_matches", "ClientErrorFilter"]

BYTES_PER_TOKEN = 16  # body bytes allowed per admissible prompt token: "123456, " is 8; room for whitespace
BODY_SLACK_BYTES = 1 << 20  # plus this much for the other fields, a batch's brackets and pretty-printing
BODY_RATE_WINDOW_S = 5.0  # --min-body-rate is averaged over windows of this long


def default_max_body_bytes(max_queued_tokens: int) -> int:
    """``--max-body-bytes`` when not given: ``BODY_SLACK_BYTES + BYTES_PER_TOKEN * max_queued_tokens`` (2 MiB for
    the default bound of 65536 tokens): room for every token the admission bound lets in, written as JSON ids of
    up to 6 digits, pretty-printed."""
    return BODY_SLACK_BYTES + BYTES_PER_TOKEN * max_queued_tokens


class ClientErrorFilter(logging.Filter):
    """For the HTTP server's logger: drops aiohttp's tracebacks of what a client did wrong at the protocol level
    (a malformed request line, header or chunk: answered 400 by aiohttp; a body that broke off; a client that
    left). Anything else, a fault of the server's own, keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        from aiohttp.http_exceptions import HttpProcessingError
        from aiohttp.web_protocol import RequestPayloadError
        if isinstance(exc, HttpProcessingError):
            return not (400 <= (exc.code or 400) < 500)
        return not isinstance(exc, (RequestPayloadError, ConnectionError))


# ----------------------------------------------------------------------------- authentication
def api_key_matches(authorization: "str | None", key_digest: bytes) -> bool:
    """Whether an ``Authorization`` header is ``Bearer <key>`` for the key whose SHA-256 is ``key_digest``.
    Compares digests in constant time (neither the key's length nor its prefix leaks through timing)."""
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    given = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(given, key_digest)


# ----------------------------------------------------------------------------- the body
def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n] + "..."


def check_content_type(content_type: "str | None", content_encoding: "str | None") -> None:
    """415 unless the body is JSON in UTF-8, not compressed. An absent ``Content-Type`` is taken as JSON."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise HttpError(415, f"Content-Encoding {_clip(content_encoding)!r} is not supported: send the body "
                             "uncompressed")
    if content_type is None:
        return
    media, *params = content_type.split(";")
    media = media.strip().lower()
    if media != "application/json":
        raise HttpError(415, f"Content-Type {_clip(media)!r} is not supported: send application/json")
    for p in params:
        name, _, value = p.partition("=")
        if name.strip().lower() != "charset":
            continue
        charset = value.strip().strip('"').lower()
        if charset not in ("utf-8", "utf8", "us-ascii", "ascii"):
            raise HttpError(415, f"Content-Type charset {_clip(value.strip())!r} is not supported: JSON bodies "
                                 "are UTF-8")


class BodyBudget:
    """The request-body bytes held at once across all requests (read, or waiting to be parsed): bounds what many
    concurrent bodies cost, and keeps stalled large uploads from locking small calls out.

    ``total`` bytes in all. A body is *small* while it holds at most ``small`` bytes (it is parsed inline) and
    *large* after. Large bodies together hold at most ``total - reserve``: the ``reserve`` stays for small ones;
    the large bodies of one client (``BodyLease.client``) hold at most ``per_client``. Each body charges a
    :class:`BodyLease` (:meth:`lease`). One event loop owns it (not thread-safe)."""

    def __init__(self, total: int, reserve: int = 0, per_client: "int | None" = None, small: int = 0) -> None:
        if not 0 <= reserve < total:
            raise ValueError(f"BodyBudget: reserve={reserve} must be in [0, total={total})")
        self.total, self.reserve, self.small = total, reserve, small
        self.per_client = per_client if per_client is not None else total
        self.used = 0  # all bodies
        self.large = 0  # large bodies
        self.by_client: dict = {}  # client -> bytes of its large bodies

    def lease(self, client: str = "") -> "BodyLease":
        return BodyLease(self, client)

    def take(self, n: int) -> bool:
        """Charge ``n`` bytes of an anonymous small body (kept for callers without a lease)."""
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class BodyLease:
    """The bytes of one body, charged to a :class:`BodyBudget` as they arrive (:meth:`take`) and given back all at
    once (:meth:`release`, idempotent)."""

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget, self.client, self.held, self.is_large = budget, client, 0, False

    def take(self, n: int) -> "str | None":
        """Charge ``n`` more bytes; None, or why not (the message of a 429)."""
        b = self.budget
        if b.used + n > b.total:
            return f"the service holds {b.used} bytes of request bodies (bound {b.total})"
        if self.held + n > b.small:
            move = n if self.is_large else self.held + n  # a body that turns large brings what it held
            if b.large + move > b.total - b.reserve:
                return (f"large request bodies hold {b.large} bytes (bound {b.total - b.reserve}; the other "
                        f"{b.reserve} bytes are kept for bodies of up to {b.small} bytes)")
            mine = b.by_client.get(self.client, 0)
            if mine + move > b.per_client:
                return (f"this client ({self.client}) holds {mine} bytes of request bodies being received or parsed "
                        f"(bound {b.per_client} per client)")
            b.large += move
            b.by_client[self.client] = mine + move
            self.is_large = True
        b.used += n
        self.held += n
        return None

    def release(self) -> None:
        b, n = self.budget, self.held
        if not n:
            return
        b.used -= n
        if self.is_large:
            b.large -= n
            left = b.by_client.get(self.client, 0) - n
            if left > 0:
                b.by_client[self.client] = left
            else:
                b.by_client.pop(self.client, None)
        self.held, self.is_large = 0, False


def check_headers(headers, max_bytes: int) -> None:
    """What the headers alone refuse: an unsupported ``Content-Type``/``Content-Encoding`` (415) or a
    ``Content-Length`` over ``max_bytes`` (413)."""
    check_content_type(headers.get("Content-Type"), headers.get("Content-Encoding"))
    length = headers.get("Content-Length")
    if length is not None:
        if not (length.isascii() and length.strip().isdigit()):  # aiohttp's HTTP parser refuses these first
            raise HttpError(400, f"Content-Length {_clip(length)!r} is not a number of bytes")
        if int(length) > max_bytes:
            raise HttpError(413, f"request body of {int(length)} bytes is larger than this service's bound of "
                                 f"{max_bytes} bytes (--max-body-bytes)")


async def read_body(request, max_bytes: int, timeout_s: float, lease: BodyLease, min_rate: int = 0) -> bytes:
    """The body of an aiohttp ``request``, at most ``max_bytes`` (413 from ``Content-Length`` before reading a
    byte, or as soon as a chunked body passes the bound), read within ``timeout_s`` (408) and at ``min_rate``
    bytes/s or more, averaged over every ``BODY_RATE_WINDOW_S`` (408 as soon as a window falls short; 0: no
    minimum). Every byte is charged to ``lease`` first (429 when the budget refuses it); the caller releases
    the lease once the body is parsed or dropped."""
    from aiohttp.web_protocol import RequestPayloadError

    check_headers(request.headers, max_bytes)
    length = request.headers.get("Content-Length")
    length = int(length) if length is not None else None
    buf = bytearray()
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + timeout_s
    window_end, window_bytes, need = start + BODY_RATE_WINDOW_S, 0, min_rate * BODY_RATE_WINDOW_S
    while length is None or len(buf) < length:  # with a length, no read waits for the end
        now = loop.time()
        if now >= end:
            raise HttpError(408, f"the request body did not arrive within {timeout_s:.3g} s ({len(buf)} bytes came)",
                            close=True)
        if min_rate and now >= window_end:
            if len(buf) - window_bytes < need:
                raise HttpError(408, f"the request body came too slowly: {len(buf) - window_bytes} bytes in the last "
                                     f"{BODY_RATE_WINDOW_S:g} s ({len(buf)} in all), less than --min-body-rate "
                                     f"{min_rate} bytes/s", close=True)
            window_end, window_bytes = now + BODY_RATE_WINDOW_S, len(buf)
        try:
            async with _timeout((min(end, window_end) if min_rate else end) - now):
                chunk = await request.content.readany()
        except asyncio.TimeoutError:
            continue  # a bound passed: checked above
        except (ConnectionError, RequestPayloadError) as e:  # the client left, or broke the chunked framing
            raise HttpError(400, f"the request body broke off after {len(buf)} bytes: {_clip(str(e), 120)}",
                            close=True) from None
        if not chunk:
            break
        if len(buf) + len(chunk) > max_bytes:
            raise HttpError(413, f"request body is larger than this service's bound of {max_bytes} bytes "
                                 "(--max-body-bytes); it was cut off there", close=True)
        refused = lease.take(len(chunk))
        if refused is not None:
            raise HttpError(429, f"{refused}; retry later", retry_after=1, close=True)
        buf += chunk
    return bytes(buf)


class _Deadline:
    """``asyncio.timeout`` for Python 3.10 (which lacks it): cancels the task at the deadline, and turns that
    cancellation into ``asyncio.TimeoutError``."""

    def __init__(self, delay: float) -> None:
        self.delay, self.expired, self.handle = delay, False, None

    async def __aenter__(self):
        task = asyncio.current_task()
        self.handle = asyncio.get_running_loop().call_later(max(0.0, self.delay), self._expire, task)
        return self

    def _expire(self, task) -> None:
        self.expired = True
        task.cancel()

    async def __aexit__(self, kind, exc, tb):
        self.handle.cancel()
        if kind is asyncio.CancelledError and self.expired:
            raise asyncio.TimeoutError from None
        return False


_timeout = getattr(asyncio, "timeout", _Deadline)  # a timer per read, not a task per read


@dataclass
class Completion:
    """A checked ``/v1/completions`` call: its prompts (int64 ``[len_i]`` each) and what the answer carries."""

    prompts: list
    is_batch: bool
    stream: bool
    hidden: bool

    @property
    def num_tokens(self) -> int:
        return sum(int(p.numel()) for p in self.prompts)


def completion_of(call: Call, info, cfg, tokenizer, max_call_tokens: "int | None" = None) -> Completion:
    """The prompts of a checked call as tensors: text prompts through ``tokenizer`` (400 without one) and then
    the same checks as ids; ``frontend.validate`` on each (``HttpError(400)``)."""
    ids = call.ids
    if ids is None:
        if tokenizer is None:
            raise HttpError(400, "prompt: text needs a tokenizer, and this service has none (start it with "
                                 "--tokenizer DIR, a local tokenizer); send token ids instead", "prompt")
        lists = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in call.texts]
        ids = check_id_lists(lists, call.is_batch, info.vocab_size, cfg.max_prompt_len, max_call_tokens)
    prompts = []
    for i, b in enumerate(ids):
        t = torch.frombuffer(bytearray(b), dtype=torch.int64)  # [len_i]
        error = validate(PromptRequest(0, 0.0, t), info, cfg)
        if error is not None:
            raise HttpError(400, f"{f'prompt[{i}]' if call.is_batch else 'prompt'}: {error}", "prompt")
        prompts.append(t)
    return Completion(prompts, call.is_batch, call.stream, call.hidden)


def parse_completion(body, model_name: str, info, cfg, tokenizer, max_call_tokens: "int | None" = None) -> Completion:
    """A decoded ``/v1/completions`` body as a :class:`Completion`, or ``HttpError`` (all in this process)."""
    call = check_fields(body, model_name, info.vocab_size, cfg.max_prompt_len, max_call_tokens)
    return completion_of(call, info, cfg, tokenizer, max_call_tokens)
