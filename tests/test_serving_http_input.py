"""The HTTP service's pieces in process, no server (the cheapest tier): the request side (content types, JSON
decoding, the completions schema, the API key) turns every input into a value or an ``HttpError`` with a 4xx,
never another exception; the waiting room is first come first served, bounded, and lets small calls through
past a hog; heartbeats age by the watcher's clock."""
import json
import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asap_comm.serving.heartbeat import Heartbeats
from asap_comm.serving.http_input import (BODY_SLACK_BYTES, BYTES_PER_TOKEN, HttpError, api_key_matches,
                                          check_content_type, check_headers, decode_body, default_max_body_bytes,
                                          describe, parse_completion)
from asap_comm.serving.waiting_room import Waiter, WaitingRoom

INFO = types.SimpleNamespace(vocab_size=128)
CFG = types.SimpleNamespace(max_prompt_len=64)
ALLOWED = {400, 404, 413, 415}


def _parse(body, tokenizer=None):
    return parse_completion(body, "tiny", INFO, CFG, tokenizer)


def _err(fn, *args) -> HttpError:
    with pytest.raises(HttpError) as e:
        fn(*args)
    return e.value


# ----------------------------------------------------------------------------- the body
@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays or objects deeper"),
    (b'{"prompt": [' + b"7" * 5000 + b"]}", "an integer of more than"),
    (b'{"prompt": [1, 2', "not valid JSON"),
    (b'\xff\xfe{"prompt": [1]}', "not valid UTF-8"),
    (b'\xef\xbb\xbf{"prompt": [1]}', "not valid JSON"),  # a byte-order mark
])
def test_decode_body_refuses_what_json_refuses_with_400(body, words):
    e = _err(decode_body, body)
    assert e.status == 400 and words in e.message, e.message


@pytest.mark.parametrize("ctype, encoding, status, words", [
    (None, None, None, None),
    ("application/json", None, None, None),
    ("Application/JSON; Charset=\"UTF-8\"", None, None, None),
    ("application/json; charset=bogus-xx", None, 415, "charset 'bogus-xx'"),
    ("application/json; charset=utf-16", None, 415, "charset 'utf-16'"),
    ("text/plain", None, 415, "'text/plain' is not supported"),
    ("application/x-www-form-urlencoded", None, 415, "send application/json"),
    ("", None, 415, "is not supported"),
    ("application/json", "gzip", 415, "Content-Encoding 'gzip'"),
    ("application/json", "identity", None, None),
])
def test_content_type_and_encoding(ctype, encoding, status, words):
    if status is None:
        check_content_type(ctype, encoding)
    else:
        e = _err(check_content_type, ctype, encoding)
        assert e.status == status and words in e.message, e.message


def test_content_length_over_the_bound_is_413_and_the_default_bound_follows_the_admission_bound():
    assert default_max_body_bytes(65536) == BODY_SLACK_BYTES + BYTES_PER_TOKEN * 65536 == 2 << 20
    check_headers({"Content-Length": "100"}, 100)
    e = _err(check_headers, {"Content-Length": "101"}, 100)
    assert e.status == 413 and "101 bytes" in e.message and "bound of 100 bytes (--max-body-bytes)" in e.message
    assert _err(check_headers, {"Content-Length": "12x"}, 100).status == 400
    # enough for every token the bound admits, as compact JSON ids of a large vocabulary, plus the slack
    ids = [129279] * 65536
    assert len(json.dumps({"prompt": ids, "max_tokens": 1}).encode()) <= default_max_body_bytes(65536)


# ----------------------------------------------------------------------------- the completions body
@pytest.mark.parametrize("body, status, param, words", [
    ({"prompt": [2 ** 63]}, 400, "prompt", "does not even fit a 64-bit integer"),
    ({"prompt": [-2 ** 63 - 1]}, 400, "prompt", "does not even fit a 64-bit integer"),
    ({"prompt": [[1], [10 ** 30]]}, 400, "prompt", "prompt[1]: token id out of the vocabulary"),
    ({"prompt": [1], "n": 2}, 400, "n", "n: must be 1"),
    ({"prompt": [1], "n": True}, 400, "n", "n: must be 1"),
    ({"prompt": [1], "best_of": 3}, 400, "best_of", "best_of: must be 1"),
    ({"prompt": [1], "best_of": "1"}, 400, "best_of", "best_of: must be 1"),
    ({"prompt": [1], "echo": True}, 400, "echo", "echo: must be false"),
    ({"prompt": [1], "echo": 0}, 400, "echo", "echo: must be false"),
    ({"prompt": [1], "logprobs": 0}, 400, "logprobs", "logprobs: not supported"),
    ({"prompt": [1], "logprobs": 5}, 400, "logprobs", "logprobs: not supported"),
    ({"prompt": [1], "model": ["x"] * 10 ** 5}, 400, "model", "model: must be a string"),
    ({"prompt": [1], "model": "other"}, 404, "model", "'other' is not served"),
    ({"prompt": [1], "max_tokens": [[[[[[1]]]]]] * 1000}, 400, "max_tokens", "max_tokens: must be 1"),
    ({"prompt": [[1]] * 300}, 400, "prompt", "a batch of 300 prompts is more than the 256"),
    ({"prompt": [1] * 65}, 400, "prompt", "longer than the maximum 64"),
    ({"prompt": []}, 400, "prompt", "prompt: empty prompt"),
])
def test_completion_fields(body, status, param, words):
    e = _err(_parse, body)
    assert (e.status, e.param) == (status, param) and words in e.message, e.message
    assert len(e.message) < 400  # whatever the value's size


def test_sizes_are_checked_before_contents_and_a_call_over_the_bound_is_413():
    e = _err(parse_completion, {"prompt": [[1] * 40, [2] * 40]}, "tiny", INFO, CFG, None, 64)
    assert (e.status, e.param) == (413, "prompt") and "80 prompt tokens in one call are more than the admission " \
        "bound of 64 tokens" in e.message
    e = _err(_parse, {"prompt": ["x"] * 10 ** 6})  # refused by its length, whatever its items
    assert e.status == 400 and "a batch of 1000000 prompts" in e.message
    e = _err(_parse, {"prompt": [None] * 10 ** 6})
    assert e.status == 400 and "prompt of 1000000 tokens is longer than the maximum 64" in e.message
    call = parse_completion({"prompt": [[1] * 32, [2] * 32]}, "tiny", INFO, CFG, None, 64)
    assert call.num_tokens == 64


def test_fields_that_do_not_change_the_answer_are_accepted():
    for extra in ({}, {"n": 1, "best_of": 1, "echo": False, "logprobs": None}, {"n": None, "best_of": None,
                  "echo": None, "max_tokens": None}, {"temperature": 0.7, "user": "x", "stop": ["\n"]}):
        call = _parse({"prompt": [[1, 2], [3]], "model": "tiny", **extra})
        assert call.is_batch and call.num_tokens == 3 and not call.stream and not call.hidden
        assert [p.tolist() for p in call.prompts] == [[1, 2], [3]] and call.prompts[0].dtype == torch.int64


def test_describe_is_short_for_any_value():
    deep = []
    for _ in range(900):
        deep = [deep]
    for v in (deep, list(range(10 ** 5)), {"k" * 1000: "v" * 10 ** 5}, 10 ** 4000, "x" * 10 ** 6, 1.5, None):
        assert len(describe(v)) < 80


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5),
                    max_leaves=20)
IDS = st.lists(st.integers(-5, 140) | st.integers(), max_size=8)
BODIES = JSON | st.fixed_dictionaries(
    {"prompt": IDS | st.lists(IDS, max_size=3) | JSON},
    optional={k: JSON | st.sampled_from([0, 1, 2, True, False, None]) for k in
              ("model", "max_tokens", "n", "best_of", "echo", "logprobs", "stream", "return_hidden_states")})


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(BODIES)
def test_any_json_body_is_a_call_or_a_4xx(body):
    try:
        call = _parse(body)
    except HttpError as e:
        assert e.status in ALLOWED and e.message
        return
    assert call.num_tokens >= 1 and all(int(p.min()) >= 0 and int(p.max()) < 128 for p in call.prompts)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64) | BODIES.map(lambda b: json.dumps(b).encode()))
def test_any_bytes_are_json_or_a_400(raw):
    try:
        body = decode_body(raw)
    except HttpError as e:
        assert e.status == 400
        return
    try:
        _parse(body)
    except HttpError as e:
        assert e.status in ALLOWED


def test_api_key_is_a_bearer_token_compared_by_digest():
    import hashlib
    key = hashlib.sha256(b"s3cret").digest()
    assert api_key_matches("Bearer s3cret", key) and api_key_matches("bearer  s3cret ", key)
    for bad in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "Bearer \udcff"):
        assert not api_key_matches(bad, key), bad


def test_the_parse_process_parses_refuses_survives_its_death_and_drops_what_was_left():
    import asyncio

    from asap_comm.serving.http_parse import ParseProcess

    async def run():
        released = []
        pp = ParseProcess({"model_name": "tiny", "vocab_size": 128, "max_prompt_len": 64, "max_call_tokens": 100})
        await pp.start()
        try:
            call = await pp.parse(json.dumps({"prompt": [[1, 2], [127]], "stream": True}).encode(),
                                  lambda: released.append(1))
            assert call.is_batch and call.stream and call.texts is None
            assert [torch.frombuffer(bytearray(b), dtype=torch.int64).tolist() for b in call.ids] == [[1, 2], [127]]
            for body, status, words in ((b"[" * 100_000, 400, "nests"), (b'{"prompt": [[1] * 70]}', 400, "JSON"),
                                        (json.dumps({"prompt": [[1] * 60, [2] * 60]}).encode(), 413, "bound of 100"),
                                        (json.dumps({"prompt": [1], "n": 3}).encode(), 400, "n: must be 1")):
                with pytest.raises(HttpError) as e:
                    await pp.parse(body, lambda: released.append(1))
                assert e.value.status == status and words in e.value.message, e.value.message
            pp.proc.kill()  # the child dies: that body gets a 503, the next one a fresh child
            await pp.proc.wait()
            with pytest.raises(HttpError) as e:
                await pp.parse(b'{"prompt": [1]}', lambda: released.append(1))
            assert e.value.status == 503 and pp.restarts == 1
            assert (await pp.parse(b'{"prompt": [5]}', lambda: released.append(1))).ids is not None
            # a caller that leaves: its body is dropped (and released) without an answer
            task = asyncio.ensure_future(pp.parse(b'{"prompt": [5]}', lambda: released.append(1)))
            await asyncio.sleep(0)
            task.cancel()
            ok = await pp.parse(b'{"prompt": [6]}', lambda: released.append(1))
            assert torch.frombuffer(bytearray(ok.ids[0]), dtype=torch.int64).tolist() == [6]
            assert len(released) == 9  # every body given back
        finally:
            await pp.close()
        assert pp.proc.returncode is not None

    asyncio.run(run())


# ----------------------------------------------------------------------------- the waiting room
def test_waiting_room_is_fifo_bounded_and_expires_at_the_head():
    room = WaitingRoom(max_tokens=100, max_calls=3)
    a, b, c = Waiter(60, 10.0, "a"), Waiter(10, 5.0, "b"), Waiter(30, 10.0, "c")
    for w in (a, b, c):
        assert room.has_room(w.tokens)
        room.add(w)
    assert room.tokens == 100 and not room.has_room(1)
    with pytest.raises(ValueError, match="no room"):
        room.add(Waiter(1, 1.0))
    # the head does not fit: nothing behind it passes (no backfilling), even what would fit
    assert room.take_ready(50, now=0.0) == ([], [])
    assert room.take_ready(75, now=6.0) == ([a], [b])  # a fits; b expired meanwhile; c (30) no longer fits
    assert room.tokens == 30 and len(room) == 1
    assert room.remove(c) and not room.remove(c) and room.tokens == 0
    room.add(Waiter(5, 1.0, "d"))
    assert [w.call for w in room.take_all()] == ["d"] and len(room) == 0 and room.tokens == 0


def test_a_hog_at_the_bound_does_not_starve_small_calls():
    """A discrete model of the service: the bound admits `BOUND` tokens, a call runs for its tokens / speed
    ticks. A hog sends one call at the bound after another; three small clients send one small call at a
    time. Every small call is served, and none waits behind a hog call sent after it."""
    BOUND, SPEED = 2048, 512  # tokens; tokens per tick
    room = WaitingRoom(2 * BOUND)
    running: list = []  # [(end tick, waiter)]
    queued = 0
    sent: dict = {}  # waiter -> tick sent
    admitted: list = []  # in admission order
    hog = None
    smalls = {k: 0 for k in range(3)}  # client -> calls answered
    outstanding: dict = {}
    for tick in range(200):
        for end, w in [x for x in running if x[0] <= tick]:  # completions
            running.remove((end, w))
            queued -= w.tokens
            if w.call == "hog":
                hog = None
            else:
                smalls[w.call] += 1
                outstanding.pop(w.call)
        if hog is None:  # the hog sends again at once
            hog = Waiter(BOUND, 1e9, "hog")
            sent[hog] = tick
            assert room.has_room(BOUND)
            room.add(hog)
        for k in smalls:
            if k not in outstanding and smalls[k] < 10:
                w = outstanding[k] = Waiter(40 + k, 1e9, k)
                sent[w] = tick
                assert room.has_room(w.tokens), "a small call found the room full"
                room.add(w)
        admit, _ = room.take_ready(BOUND - queued, tick)
        for w in admit:
            queued += w.tokens
            running.append((tick + max(1, w.tokens // SPEED), w))
            admitted.append(w)
    assert all(n == 10 for n in smalls.values()), smalls
    assert sum(1 for w in admitted if w.call == "hog") >= 10  # the hog was served too
    for i, w in enumerate(admitted):  # first come, first served: nobody sent later was admitted earlier
        assert all(sent[v] <= sent[w] for v in admitted[:i]), (w.call, i)


# ----------------------------------------------------------------------------- heartbeats
def test_heartbeats_age_by_the_watchers_clock():
    table = torch.zeros(3, 4, dtype=torch.float64)
    now = [100.0]
    beats = Heartbeats(table, [0, 1], clock=lambda: now[0])
    beats.observe()
    now[0] = 103.0
    table[0, 0] = 1.0  # PE 0 published; PE 1 did not
    beats.observe()
    assert beats.ages() == {0: 0.0, 1: 3.0} and beats.stale(2.0) == [(1, 3.0)]
    now[0] = 110.0  # the watcher itself was stopped for 7 s; PE 1 published meanwhile
    table[1, 0] = 5.0
    beats.observe()
    assert beats.ages() == {0: 7.0, 1: 0.0} and [pe for pe, _ in beats.stale(2.0)] == [0]


# ----------------------------------------------------------------------------- reading a body
class _Content:
    """aiohttp's ``request.content`` as ``read_body`` uses it: ``readany`` gives the next piece, b"" at the end;
    a piece that is None never comes (a client that stopped sending)."""

    def __init__(self, pieces: list) -> None:
        self.pieces = list(pieces)

    async def readany(self) -> bytes:
        import asyncio
        piece = self.pieces.pop(0) if self.pieces else b""
        if piece is None:
            await asyncio.sleep(3600)
        return piece


def _read(pieces, headers=None, max_bytes=100, timeout_s=5.0, budget=None):
    import asyncio

    from asap_comm.serving.http_input import BodyBudget, read_body
    request = types.SimpleNamespace(headers=headers or {}, content=_Content(pieces))
    budget = budget if budget is not None else BodyBudget(1000)
    lease = budget.lease("client-a")
    try:
        return asyncio.run(read_body(request, max_bytes, timeout_s, lease)), lease.held
    finally:
        lease.release()


def test_read_body_is_bounded_in_bytes_time_and_shared_budget():
    from asap_comm.serving.http_input import BodyBudget
    assert _read([b'{"a":', b" 1}"]) == (b'{"a": 1}', 8)
    e = _err(_read, [b"x" * 60, b"x" * 60])  # chunked (no Content-Length): cut off once past the bound
    assert e.status == 413 and "cut off" in e.message and e.close
    e = _err(_read, [b"x"], {"Content-Length": "101"})  # refused from the header, nothing read
    assert e.status == 413 and "101 bytes" in e.message
    e = _err(_read, [b"xx", None], {}, 100, 0.2)  # a client that stops sending
    assert e.status == 408 and "did not arrive within 0.2 s (2 bytes came)" in e.message
    budget = BodyBudget(100)
    assert budget.take(90)  # other requests' bodies hold 90 of 100 bytes
    e = _err(_read, [b"x" * 20], {}, 100, 5.0, budget)
    assert e.status == 429 and e.retry_after == 1 and budget.used == 90  # what this call took came back
    assert _err(_read, [b"{}"], {"Content-Type": "text/html"}).status == 415


def test_service_options_take_the_api_key_from_the_flag_or_the_environment():
    from asap_comm.serving.server import build_parser, service_options
    parse = build_parser().parse_args
    assert service_options(parse([]), {}).api_key is None
    assert service_options(parse([]), {"ASAP_API_KEY": "env"}).api_key == "env"
    assert service_options(parse(["--api-key", "flag"]), {"ASAP_API_KEY": "env"}).api_key == "flag"
    with pytest.raises(ValueError, match="empty"):
        service_options(parse([]), {"ASAP_API_KEY": " "})
    opts = service_options(parse(["--api-key", "s3cret", "--max-queued-tokens", "1000"]), {})
    assert "s3cret" not in repr(opts)  # never printed with the options
    assert opts.body_bound == default_max_body_bytes(1000) and opts.waiting_bound == 2000
    opts = service_options(parse(["--max-body-bytes", "5000", "--max-waiting-tokens", "7"]), {})
    assert (opts.body_bound, opts.waiting_bound, opts.worker_stall_s) == (5000, 7, 10.0)


def test_the_deadline_of_python_3_10_times_out_and_otherwise_stays_out_of_the_way():
    import asyncio

    from asap_comm.serving.http_input import _Deadline

    async def run():
        async with _Deadline(5.0):
            await asyncio.sleep(0)
        with pytest.raises(asyncio.TimeoutError):
            async with _Deadline(0.01):
                await asyncio.sleep(3600)
        return "ok"

    assert asyncio.run(run()) == "ok"


def test_the_service_takes_the_lane_flags_and_refuses_a_bad_wait(capsys):
    """--lane-tokens / --lane-wait-s reach the runtime's config; a negative wait is refused at start-up with one
    line naming the flag (exit 2), before any process starts."""
    from asap_comm.serving.server import build_parser
    from asap_comm.serving.server.cli import main

    args = build_parser().parse_args(["--lane-tokens", "4096", "--lane-wait-s", "2.5"])
    assert args.lane_tokens == 4096 and args.lane_wait_s == 2.5
    assert build_parser().parse_args([]).lane_wait_s is None
    assert main(["--lane-wait-s", "-1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "--lane-wait-s -1.0" in err and err.count("\n") == 1, err
