"""The HTTP service's request side: error answers, the body bound, JSON decoding and the completions schema.

Everything a client sends to ``POST /v1/completions`` passes through here
before anything reaches the front end, and every way it can be wrong ends
in an :class:`HttpError` (a 4xx naming the problem), never in another
exception:

* :func:`check_content_type`: ``Content-Type`` absent or ``application/json``
  with no charset or UTF-8 (415 otherwise, as vLLM answers), no
  ``Content-Encoding`` (415);
* :func:`read_body`: at most ``max_bytes`` (413 from ``Content-Length``
  before reading, or as soon as a chunked body passes it), within the
  request's deadline (408), from a shared :class:`BodyBudget` (429);
* :func:`decode_body`: UTF-8 and JSON, with nesting and integer sizes that
  the standard library refuses turned into 400s (never a ``RecursionError``
  or ``ValueError`` out of ``json``);
* :func:`parse_completion`: the fields (``model``, ``max_tokens``,
  ``stream``, ``return_hidden_states``; ``n``, ``best_of``, ``echo``,
  ``logprobs`` that would change the answer) and the prompts, as int64
  token-id tensors ``[len_i]`` checked against the model (:func:`validate`).

Cost: decoding and parsing hold the GIL (``json`` and the conversion to
int64 are C loops that never release it), about 20 ms + 10 ms per MiB of
token ids on the reference VM, so the body bound is what keeps the event
loop responsive (:func:`default_max_body_bytes`).
"""
from __future__ import annotations

import array
import hashlib
import hmac
import json
import logging
import sys
from dataclasses import dataclass

import torch

from .frontend import validate
from .protocol import PromptRequest

__all__ = ["HttpError", "BodyBudget", "Completion", "MAX_BATCH", "BYTES_PER_TOKEN", "BODY_SLACK_BYTES",
           "default_max_body_bytes", "check_content_type", "check_headers", "read_body", "decode_body", "parse_completion",
           "parse_prompts", "describe", "api_key_matches", "ClientErrorFilter"]

MAX_BATCH = 256  # prompts in one /v1/completions call
BYTES_PER_TOKEN = 16  # body bytes allowed per admissible prompt token: "123456, " is 8; room for whitespace
BODY_SLACK_BYTES = 1 << 20  # plus this much for the other fields, a batch's brackets and pretty-printing
_INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


def default_max_body_bytes(max_queued_tokens: int) -> int:
    """``--max-body-bytes`` when not given: ``BODY_SLACK_BYTES + BYTES_PER_TOKEN * max_queued_tokens`` (2 MiB for
    the default bound of 65536 tokens): room for every token the admission bound lets in, written as JSON."""
    return BODY_SLACK_BYTES + BYTES_PER_TOKEN * max_queued_tokens


class HttpError(Exception):
    """An HTTP error answer: status, message, the request field it is about, ``Retry-After`` seconds, extra
    headers, and whether to close the connection after it (a body left unread that is not worth reading)."""

    def __init__(self, status: int, message: str, param: "str | None" = None, retry_after: "int | None" = None,
                 headers: "dict | None" = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after
        self.headers, self.close = dict(headers or {}), close

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large_error",
             415: "unsupported_media_type_error", 417: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable", 504: "timeout_error"}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}

    def response_headers(self) -> dict:
        h = dict(self.headers)
        if self.retry_after is not None:
            h["Retry-After"] = str(self.retry_after)
        return h


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
    concurrent bodies cost. One event loop owns it (``take`` and ``give`` are not thread-safe)."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


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


async def read_body(request, max_bytes: int, timeout_s: float, budget: BodyBudget, held: list) -> bytes:
    """The body of an aiohttp ``request``, at most ``max_bytes`` (413 from ``Content-Length`` before reading a
    byte, or as soon as a chunked body passes the bound), read within ``timeout_s`` (408). Every byte is taken
    from ``budget`` first (429 when other bodies hold it); ``held[0]`` counts what this call took, for the
    caller to give back once the body is parsed or dropped."""
    import asyncio

    from aiohttp.web_protocol import RequestPayloadError

    check_headers(request.headers, max_bytes)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    buf = bytearray()
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise HttpError(408, f"the request body did not arrive within {timeout_s:.3g} s ({len(buf)} bytes "
                                 "came)", close=True)
        try:
            chunk = await asyncio.wait_for(request.content.readany(), remaining)
        except asyncio.TimeoutError:
            continue  # reported at the top of the loop
        except (ConnectionError, RequestPayloadError) as e:  # the client left, or broke the chunked framing
            raise HttpError(400, f"the request body broke off after {len(buf)} bytes: {_clip(str(e), 120)}",
                            close=True) from None
        if not chunk:
            return bytes(buf)
        if len(buf) + len(chunk) > max_bytes:
            raise HttpError(413, f"request body is larger than this service's bound of {max_bytes} bytes "
                                 "(--max-body-bytes); it was cut off there", close=True)
        if not budget.take(len(chunk)):
            raise HttpError(429, f"the service holds {budget.used} bytes of other request bodies (bound "
                                 f"{budget.total}); retry later", retry_after=1, close=True)
        held[0] += len(chunk)
        buf += chunk


def decode_body(body: bytes):
    """The JSON value of a UTF-8 body, or ``HttpError(400)``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise HttpError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise HttpError(400, "request body is not valid JSON here: it nests arrays or objects deeper than this "
                             "service parses") from None
    except ValueError:  # an integer longer than int's string-conversion limit
        raise HttpError(400, f"request body has an integer of more than {_INT_DIGITS} digits") from None


def describe(x) -> str:
    """``type value`` of a JSON value for an error message: short whatever the value's size or depth."""
    return f"{type(x).__name__} {_clip(_sketch(x, 0))}"


def _sketch(x, depth: int) -> str:
    if isinstance(x, list):
        if depth >= 2:
            return "[...]" if x else "[]"
        inner = ", ".join(_sketch(v, depth + 1) for v in x[:4])
        return "[" + inner + (", ..." if len(x) > 4 else "") + "]"
    if isinstance(x, dict):
        if depth >= 2:
            return "{...}" if x else "{}"
        inner = ", ".join(f"{json.dumps(_clip(str(k), 20))}: {_sketch(v, depth + 1)}" for k, v in list(x.items())[:4])
        return "{" + inner + (", ..." if len(x) > 4 else "") + "}"
    if isinstance(x, str):
        return json.dumps(_clip(x, 40))
    if isinstance(x, int) and not isinstance(x, bool):
        s = str(x)  # at most the JSON parser's digit limit
        return s if len(s) <= 24 else f"{s[:12]}...({len(s)} digits)"
    return json.dumps(x)  # bool, None, float


# ----------------------------------------------------------------------------- the completions body
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


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _only_ints(xs: list) -> bool:
    return set(map(type, xs)) <= {int}  # a C loop; bool is not int here


def parse_completion(body, model_name: str, info, cfg, tokenizer) -> Completion:
    """Check a decoded ``/v1/completions`` body: ``HttpError`` (400, or 404 for another model) naming the field,
    or the call."""
    if not isinstance(body, dict):
        raise HttpError(400, f"request body must be a JSON object, got {describe(body)}")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise HttpError(400, f"model: must be a string, got {describe(name)}", "model")
    if name is not None and name != model_name:
        raise HttpError(404, f"model: {_clip(name)!r} is not served here (this service serves {model_name!r})",
                        "model")
    mt = body.get("max_tokens", 1)
    if not (_is_id(mt) and mt == 1) and mt is not None:
        raise HttpError(400, f"max_tokens: must be 1 (this is a prefill tier: it returns the first token); "
                             f"got {describe(mt)}", "max_tokens")
    for field in ("n", "best_of"):
        v = body.get(field)
        if v is not None and not (_is_id(v) and v == 1):
            raise HttpError(400, f"{field}: must be 1 (this service returns one completion per prompt); got "
                                 f"{describe(v)}", field)
    echo = body.get("echo")
    if echo is not None and echo is not False:
        raise HttpError(400, f"echo: must be false (this service does not return the prompt); got {describe(echo)}",
                        "echo")
    if body.get("logprobs") is not None:
        raise HttpError(400, f"logprobs: not supported (this service returns the first token only); got "
                             f"{describe(body['logprobs'])}", "logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, f"stream: must be true or false, got {describe(stream)}", "stream")
    hidden = body.get("return_hidden_states", False)
    if not isinstance(hidden, bool):
        raise HttpError(400, f"return_hidden_states: must be true or false, got {describe(hidden)}",
                        "return_hidden_states")
    prompts, is_batch = parse_prompts(body, info, cfg, tokenizer)
    return Completion(prompts, is_batch, stream, hidden)


def parse_prompts(body: dict, info, cfg, tokenizer) -> tuple:
    """``([token id tensors], is_batch)`` of a /v1/completions body, or ``HttpError(400)`` naming the field."""
    if "prompt" not in body:
        raise HttpError(400, "prompt: required (a list of token ids, a batch of such lists, or text)", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) > MAX_BATCH and p and isinstance(p[0], (list, str)):
        raise HttpError(400, f"prompt: a batch of {len(p)} prompts is more than the {MAX_BATCH} one call takes",
                        "prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
        if tokenizer is None:
            raise HttpError(400, "prompt: text needs a tokenizer, and this service has none (start it with "
                                 "--tokenizer DIR, a local tokenizer); send token ids instead", "prompt")
        texts, batch = ([p], False) if isinstance(p, str) else (p, True)
        lists = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    elif isinstance(p, list) and _only_ints(p):
        lists, batch = [p], False
    elif isinstance(p, list) and all(isinstance(x, list) for x in p):
        for i, x in enumerate(p):
            if not _only_ints(x):
                raise HttpError(400, f"prompt[{i}]: must be a list of token ids (integers), got {describe(x)}",
                                "prompt")
        lists, batch = p, True
    else:
        raise HttpError(400, "prompt: must be a list of token ids (integers), a batch of such lists, or text; "
                             f"got {describe(p)}", "prompt")
    out = []
    for i, ids in enumerate(lists):
        name = f"prompt[{i}]" if batch else "prompt"
        if not ids:
            raise HttpError(400, f"{name}: empty prompt", "prompt")
        if len(ids) > cfg.max_prompt_len:  # before building a tensor of it
            raise HttpError(400, f"{name}: prompt of {len(ids)} tokens is longer than the maximum "
                                 f"{cfg.max_prompt_len}", "prompt")
        try:
            t = torch.frombuffer(array.array("q", ids), dtype=torch.int64)  # [len_i]; shares the array's memory
        except (OverflowError, TypeError, ValueError):
            raise HttpError(400, f"{name}: token id out of the vocabulary [0, {info.vocab_size}): it does not "
                                 "even fit a 64-bit integer", "prompt") from None
        error = validate(PromptRequest(0, 0.0, t), info, cfg)
        if error is not None:
            raise HttpError(400, f"{name}: {error}", "prompt")
        out.append(t)
    return out, batch
