"""The ``/v1/completions`` request schema and its validation, in the front end or in a parse process beside it
(formerly ``asap_comm.serving.http_parse``, which still re-exports it).

:func:`parse_call` turns the body's bytes into a checked call (:class:`Call`: flags, and the prompts as
int64 arrays in native byte order, or texts for a tokenizer) or raises :class:`HttpError` naming what is
wrong: UTF-8, JSON (nesting and integer sizes the standard library refuses become 400s), the fields, the
prompts' shapes, sizes (checked before contents: a prompt over ``max_prompt_len`` or a call over
``max_call_tokens`` is refused before its ids are looked at), types and ids (inside the vocabulary).

Why a process. ``json`` and the conversion of ids are C loops that hold the GIL: about 35 ms per MiB of
one-digit ids on the reference VM. On a thread of the front end's process they stall its event loop at
every wake-up while they run (the loop waits for the GIL each time it returns from ``select``), so a few
large bodies at once delay every ``/health`` and every result by tens to hundreds of ms.
:class:`ParseProcess` runs :func:`parse_call` in a child process instead (this file as a script, standard
library only, started with ``python -I``): the front end only copies the body into a pipe and reads back a
small ``marshal`` record. Bodies up to ``INLINE_BYTES`` are parsed in place (at most ~2 ms, less than the
hop). The child exits when the front end closes its pipe or dies; it ignores SIGINT and SIGTERM, which are
the launcher's business.

This module imports nothing outside the standard library: keep it so (the child runs it as a script).
"""
from __future__ import annotations

import array
import asyncio
import json
import marshal
import os
import signal
import sys
from dataclasses import dataclass

__all__ = ["HttpError", "Call", "MAX_BATCH", "INLINE_BYTES", "parse_call", "decode_body", "check_id_lists",
           "describe", "ParseProcess"]

MAX_BATCH = 256  # prompts in one /v1/completions call
INLINE_BYTES = 64 * 1024  # bodies up to this size are parsed in the front end itself
PARSE_TIMEOUT_S = 30.0  # a parse process that takes longer is killed and restarted (it never should)
_INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 4300


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


@dataclass
class Call:
    """A checked call. ``ids``: per prompt, its token ids as int64 in native byte order (``[len_i]``), or None
    when the prompts are ``texts`` (for the front end's tokenizer). ``is_batch``: the prompt was a list."""

    ids: "list | None"
    texts: "list | None"
    is_batch: bool
    stream: bool
    hidden: bool

    def to_record(self) -> tuple:
        return ("ok", self.ids, self.texts, self.is_batch, self.stream, self.hidden)

    @staticmethod
    def from_record(r: tuple) -> "Call":
        if r[0] == "err":
            raise HttpError(r[1], r[2], r[3])
        return Call(*r[1:])


def _clip(s: str, n: int = 60) -> str:
    return s if len(s) <= n else s[:n] + "..."


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


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _only_ints(xs: list) -> bool:
    return set(map(type, xs)) <= {int}  # a C loop; bool is not int here


def parse_call(body: bytes, model_name: str, vocab_size: int, max_prompt_len: int,
               max_call_tokens: "int | None" = None) -> Call:
    """The checked call of a body, or ``HttpError`` (400; 404 for another model; 413 past ``max_call_tokens``
    prompt tokens) naming the field."""
    return check_fields(decode_body(body), model_name, vocab_size, max_prompt_len, max_call_tokens)


def check_fields(body, model_name: str, vocab_size: int, max_prompt_len: int,
                 max_call_tokens: "int | None" = None) -> Call:
    """:func:`parse_call` on a decoded body."""
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
    if "prompt" not in body:
        raise HttpError(400, "prompt: required (a list of token ids, a batch of such lists, or text)", "prompt")
    p = body["prompt"]
    shape_error = HttpError(400, "prompt: must be a list of token ids (integers), a batch of such lists, or text; "
                                 f"got {describe(p)}", "prompt")
    if isinstance(p, list) and p and isinstance(p[0], (list, str)) and len(p) > MAX_BATCH:
        raise HttpError(400, f"prompt: a batch of {len(p)} prompts is more than the {MAX_BATCH} one call takes",
                        "prompt")
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        if not (isinstance(p, str) or all(isinstance(x, str) for x in p)):
            raise shape_error
        texts, batch = ([p], False) if isinstance(p, str) else (p, True)
        return Call(None, texts, batch, stream, hidden)
    if isinstance(p, list) and p and isinstance(p[0], list):
        for i, x in enumerate(p):
            if not isinstance(x, list):
                raise HttpError(400, f"prompt[{i}]: must be a list of token ids (integers), got {describe(x)}",
                                "prompt")
        lists, batch = p, True
    elif isinstance(p, list):
        lists, batch = [p], False
    else:
        raise shape_error
    ids = check_id_lists(lists, batch, vocab_size, max_prompt_len, max_call_tokens, shape_error)
    return Call(ids, None, batch, stream, hidden)


def check_id_lists(lists: list, batch: bool, vocab_size: int, max_prompt_len: int,
                   max_call_tokens: "int | None" = None, shape_error: "HttpError | None" = None) -> list:
    """Per prompt (a list of token ids), its ids as int64 bytes in native byte order, or ``HttpError``: sizes
    first (empty, over ``max_prompt_len``, the call over ``max_call_tokens``: 413), then each element (an
    integer, inside ``[0, vocab_size)``)."""
    names = [f"prompt[{i}]" if batch else "prompt" for i in range(len(lists))]
    for name, ids in zip(names, lists):
        if not ids:
            raise HttpError(400, f"{name}: empty prompt", "prompt")
        if len(ids) > max_prompt_len:
            raise HttpError(400, f"{name}: prompt of {len(ids)} tokens is longer than the maximum {max_prompt_len}",
                            "prompt")
    total = sum(len(ids) for ids in lists)
    if max_call_tokens is not None and total > max_call_tokens:
        raise HttpError(413, f"prompt: {total} prompt tokens in one call are more than the admission bound of "
                             f"{max_call_tokens} tokens (--max-queued-tokens); send fewer or shorter prompts per "
                             "call", "prompt")
    out = []
    for name, ids in zip(names, lists):
        if not _only_ints(ids):
            if not batch and shape_error is not None:
                raise shape_error
            raise HttpError(400, f"{name}: must be a list of token ids (integers), got {describe(ids)}", "prompt")
        try:
            a = array.array("q", ids)
        except OverflowError:
            raise HttpError(400, f"{name}: token id out of the vocabulary [0, {vocab_size}): it does not even fit "
                                 "a 64-bit integer", "prompt") from None
        lo, hi = min(a), max(a)
        if lo < 0 or hi >= vocab_size:  # the words of frontend.validate
            raise HttpError(400, f"{name}: token id out of the vocabulary [0, {vocab_size}): min {lo}, max {hi}",
                            "prompt")
        out.append(a.tobytes())
    return out


# ----------------------------------------------------------------------------- the parse process
class ParseProcess:
    """:func:`parse_call` in a child process, one body at a time, for an asyncio loop.

    ``options``: ``parse_call``'s keyword arguments after the body. :meth:`start` starts the child,
    :meth:`parse` queues a body and returns its :class:`Call` (or raises its ``HttpError``; 503 if the child
    failed, which restarts it), :meth:`close` ends it. ``release(n)`` (optional, per :meth:`parse` call) runs
    once the child is done with a body, or it was dropped unparsed: the body's bytes are free then.
    """

    def __init__(self, options: dict) -> None:
        self.options = dict(options)
        self.proc = None
        self.queue: "asyncio.Queue | None" = None
        self.worker: "asyncio.Task | None" = None
        self.restarts = 0

    async def start(self) -> None:
        self.queue = asyncio.Queue()
        await self._spawn()
        self.worker = asyncio.get_running_loop().create_task(self._serve())

    async def _spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", os.path.abspath(__file__), json.dumps(self.options),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def parse(self, body: bytes, release=None) -> Call:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((body, fut, release))
        return await fut  # cancelled: the worker skips the body, or drops its answer

    async def _serve(self) -> None:
        while True:
            body, fut, release = await self.queue.get()
            try:
                if fut.done():  # the caller left while the body waited
                    continue
                try:
                    record = await asyncio.wait_for(self._exchange(body), PARSE_TIMEOUT_S)
                    result = Call.from_record(record)
                except HttpError as e:
                    result = e
                except Exception as e:  # the child died or hung (it never should): a fresh one for the next
                    if not isinstance(e, (asyncio.TimeoutError, OSError, EOFError, asyncio.IncompleteReadError)):
                        import traceback
                        traceback.print_exc()
                    await self._restart()
                    result = HttpError(503, f"the body parser failed ({type(e).__name__}) and was restarted; "
                                            "retry", retry_after=1)
                if not fut.done():
                    if isinstance(result, HttpError):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
            finally:
                del body
                if release is not None:
                    release()

    async def _exchange(self, body: bytes) -> tuple:
        p = self.proc
        p.stdin.write(len(body).to_bytes(8, "little"))
        p.stdin.write(body)
        await p.stdin.drain()
        n = int.from_bytes(await p.stdout.readexactly(8), "little")
        return marshal.loads(await p.stdout.readexactly(n))

    async def _restart(self) -> None:
        self.restarts += 1
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self._spawn()

    async def close(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
        p = self.proc
        if p is not None and p.returncode is None:
            p.stdin.close()
            try:
                await asyncio.wait_for(p.wait(), 5.0)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()


def _child(options: dict) -> None:
    """The parse process: ``[8-byte length][body]`` in on stdin, ``[8-byte length][marshal record]`` out on
    stdout, until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    src, dst = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = src.read(8)
        if len(head) < 8:
            return
        body = src.read(int.from_bytes(head, "little"))
        try:
            record = parse_call(body, **options).to_record()
        except HttpError as e:
            record = ("err", e.status, e.message, e.param)
        except MemoryError:
            record = ("err", 413, "request body: too large to parse", None)
        del body
        out = marshal.dumps(record)
        dst.write(len(out).to_bytes(8, "little") + out)
        dst.flush()


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
