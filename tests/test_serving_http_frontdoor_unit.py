"""The front door's parts without a service (the cheap tier of tests/test_serving_http_frontdoor.py): the fair
waiting room, the front end's per-client turns past admission, the body budget's reserve and per-client cap, the connection guard's timeouts and limit, the
accept-error log filter, the stale-segment sweep, and the API key's whitespace."""
import argparse
import asyncio
import logging
import os
import resource
import time

import pytest
import torch

from asap_comm.serving.frontend import FrontEnd
from asap_comm.serving.runtime import RuntimeConfig
from asap_comm.serving.server import build_parser, service_options
from asap_comm.serving.server.fairness import BRAKE_REFUSALS_PER_S, ErrorBrake, FairRoom, FairWaiter, HeldCalls
from asap_comm.serving.server.frontdoor import (AcceptErrorFilter, ConnectionGuard, check_connection_limit,
                                                default_max_connections, remove_stale_segments)
from asap_comm.serving.server.options import ServiceOptions
from asap_comm.serving.server.request import BodyBudget

from serving_utils import CFG, INFO


# ----------------------------------------------------------------------------- fairness
def _w(client: str, tokens: int, deadline: float = 1e9) -> FairWaiter:
    return FairWaiter(tokens, deadline, client=client)


def test_fair_room_takes_turns_and_skips_a_client_over_its_share():
    room = FairRoom(max_tokens=10_000, max_calls=100)
    for _ in range(6):
        assert room.add(_w("A", 100)) == []
    room.add(_w("B", 100))
    # A holds 400 admitted tokens, its share is 500: A's next call fits, then B's, then A is over its share
    admit, expired = room.take_ready(free_tokens=1000, admitted={"A": 400}, share=500, now=0.0)
    assert [w.client for w in admit] == ["A", "B"] and not expired
    assert len(room) == 5 and room.tokens == 500 and room.held == {"A": 500}
    # a call within its share that does not fit stops the turns: nobody passes it
    room.add(_w("C", 300))
    admit, _ = room.take_ready(free_tokens=200, admitted={}, share=1000, now=0.0)
    assert [w.client for w in admit] == ["A"]  # A's turn came first, C's 300 does not fit the remaining 100
    admit, _ = room.take_ready(free_tokens=250, admitted={}, share=1000, now=0.0)
    assert admit == []  # C is next and waits for room; A does not pass it
    admit, _ = room.take_ready(free_tokens=300, admitted={}, share=1000, now=0.0)
    assert [w.client for w in admit] == ["C"]


def test_fair_room_expires_at_the_head_and_a_newcomer_pushes_out_the_flooder():
    room = FairRoom(max_tokens=1000, max_calls=10)
    for _ in range(10):
        assert room.add(_w("A", 100)) == []
    assert not room.has_room(1)
    pushed = room.add(_w("B", 100))  # B holds nothing: A's newest waiting call makes room
    assert [w.client for w in pushed] == ["A"] and room.held == {"A": 900, "B": 100}
    assert room.add(_w("A", 100)) is None  # A, over its share of the room, gets no room
    old = _w("B", 50, deadline=1.0)
    room2 = FairRoom(max_tokens=1000, max_calls=10)
    room2.add(old)
    admit, expired = room2.take_ready(free_tokens=1000, admitted={}, share=1000, now=2.0)
    assert expired == [old] and admit == [] and len(room2) == 0 and room2.clients() == set()
    with pytest.raises(ValueError, match="max_tokens"):
        FairRoom(0, 1)


def test_fair_room_knows_a_client_at_its_share():
    room = FairRoom(max_tokens=1000, max_calls=10)
    assert not room.holds_share("A")
    for _ in range(9):
        room.add(_w("A", 100))
    assert not room.holds_share("A") and not room.holds_share("B")  # alone, A's share is the whole room
    room.add(_w("A", 100))
    assert room.holds_share("A")  # 1000 tokens: its whole share (and a newcomer may push it out)
    assert not room.holds_share("B")  # B holds nothing of its share of 500
    room.add(_w("B", 100))  # pushes out A's newest
    assert room.holds_share("A") and not room.holds_share("B")
    calls = FairRoom(max_tokens=10_000, max_calls=4)
    for _ in range(4):
        calls.add(_w("A", 1))
    assert calls.holds_share("A")  # by calls: 4 of 4


def test_held_calls_of_a_refused_client_leave_one_at_a_time_as_the_room_frees():
    async def main():
        room = FairRoom(max_tokens=300, max_calls=10)
        held = HeldCalls(room, hold_s=30.0, max_held=40)
        waiters = [_w("A", 100) for _ in range(3)]
        for w in waiters:
            room.add(w)
        assert await held.hold("A") is None  # never refused yet: not held
        assert room.add(_w("A", 100)) is None  # the full room refuses A's next call
        held.refused("A")
        assert await held.hold("B") is None  # another client is never held
        tasks = [asyncio.ensure_future(held.hold("A")) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert len(held) == 3 and not any(t.done() for t in tasks)
        held.release()
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in tasks)  # the room is still full
        room.remove(waiters[0])  # admitted: a place is free
        held.release()
        held.release()  # one leaves per client at a time, however often the room is looked at
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, False, False] and len(held) == 2
        first = tasks[0].result()
        room.add(_w("A", 100))  # it reached the room (the room is full again)
        held.unhold("A", first)
        held.unhold("A", first)  # twice does nothing more
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, False, False]
        room.remove(waiters[1])
        held.release()
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, True, False]
        held.unhold("A", tasks[1].result())  # failed before the room (a bad body): the next may leave
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, True, True] and len(held) == 0 and held.queues == {}
        held.unhold("A", tasks[2].result())  # it reached the room (or failed)
        # the service fails or stops: every held call goes on at once
        room.add(_w("A", 100))
        more = [asyncio.ensure_future(held.hold("A")) for _ in range(2)]
        await asyncio.sleep(0.01)
        assert len(held) == 2
        held.release_all()
        await asyncio.sleep(0.01)
        assert all(t.done() for t in more) and len(held) == 0
        # a caller that leaves just after its turn came does not keep the next held call waiting for its time
        room.add(_w("A", 100))
        a, b = asyncio.ensure_future(held.hold("A")), asyncio.ensure_future(held.hold("A"))
        await asyncio.sleep(0.01)
        room.remove(room.queues["A"][0])
        held.release()  # a's turn: it is released ...
        a.cancel()  # ... and its caller leaves before it ran on
        await asyncio.sleep(0.01)
        assert a.cancelled() and b.done() and held.leaving.get("A") is b.result()
        held.unhold("A", b.result())
        room.add(_w("A", 100))  # b's call reached the room: full again
        # at most max_held calls are held at once, over all clients: the next ones are answered at once
        many = [asyncio.ensure_future(held.hold("A")) for _ in range(held.max_held)]
        await asyncio.sleep(0.01)
        assert len(held) == held.max_held == 40 and await held.hold("A") is None
        held.release_all()
        await asyncio.gather(*many)
        # no bound per client below it: a flood of 400 calls in flight is held whole (with 64 per client, as
        # before, 336 of them were answered 429 at once and came back 50 ms later, 2,700 429s a second)
        big = HeldCalls(room, hold_s=30.0, max_held=1000)
        big.refused("A")
        many = [asyncio.ensure_future(big.hold("A")) for _ in range(400)]
        await asyncio.sleep(0.05)
        assert len(big) == 400 and not any(t.done() for t in many)
        big.release_all()
        await asyncio.gather(*many)

    asyncio.run(asyncio.wait_for(main(), 30))


def _check_seconds_option(flag: str, field: str, default: float) -> None:
    """A service option in seconds: a negative value refused naming it, the flag taken, its default."""
    with pytest.raises(ValueError, match=f"{field}=-0.5"):
        ServiceOptions(**{field: -0.5})
    assert getattr(service_options(build_parser().parse_args(["--model", "tiny", flag, "0.25"]), {}), field) == 0.25
    assert getattr(service_options(build_parser().parse_args(["--model", "tiny"]), {}), field) == default


def test_the_brake_slows_a_client_of_many_refused_calls_and_no_other():
    async def main():
        brake = ErrorBrake(delay_s=0.2, max_waiting=3)
        for _ in range(BRAKE_REFUSALS_PER_S - 1):
            brake.refused("A")
        assert await brake.wait("A") is False  # under the rate: not braked
        brake.refused("A")  # the 32nd within a second
        t = time.monotonic()
        assert await brake.wait("A") is True and time.monotonic() - t >= 0.19
        assert await brake.wait("B") is False  # another client is never braked
        # at most max_waiting calls wait at once, over all clients
        brake.refused("A")  # its refusals keep coming (the 33rd in this window): braked for delay_s from now
        waits = [asyncio.ensure_future(brake.wait("A")) for _ in range(5)]
        await asyncio.sleep(0.05)
        assert len(brake) == 3
        assert sorted(await asyncio.gather(*waits)) == [False, False, True, True, True] and len(brake) == 0
        # a call refused after it waited holds the brake on, even in a new window of few refusals
        brake.windows["A"][0] -= 2.0
        await asyncio.sleep(0.25)
        brake.refused("A", braked=True)
        assert brake.windows["A"][1] == 1 and await brake.wait("A") is True
        # the brake lapses delay_s after the last refusal that kept it on
        await asyncio.sleep(0.25)
        assert await brake.wait("A") is False
        # refusals spread over more than a second each window do not brake
        slow = ErrorBrake(delay_s=0.2, max_waiting=3, per_s=4)
        for _ in range(3):
            slow.refused("C")
        slow.windows["C"][0] -= 1.5  # that window began 1.5 s ago: the next refusal opens a new one
        slow.refused("C")
        assert await slow.wait("C") is False and slow.windows["C"][1] == 1
        off = ErrorBrake(delay_s=0, max_waiting=3)
        for _ in range(100):
            off.refused("A")
        assert await off.wait("A") is False  # 0: no brake
        for bad, match in (((-1, 3), "delay_s=-1"), ((1.0, -1), "max_waiting=-1"), ((1.0, 3, 0), "per_s=0")):
            with pytest.raises(ValueError, match=match):
                ErrorBrake(*bad)
        _check_seconds_option("--bad-call-delay-s", "bad_call_delay_s", default=1.0)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_held_calls_wait_at_most_the_hold_and_never_with_hold_zero():
    async def main():
        room = FairRoom(max_tokens=100, max_calls=10)
        room.add(_w("A", 100))
        held = HeldCalls(room, hold_s=0.2, max_held=8)
        held.refused("A")
        t = time.monotonic()
        assert await held.hold("A") is not None  # held, and nobody released it: its time ran out
        assert time.monotonic() - t >= 0.19 and len(held) == 0 and held.queues == {}
        off = HeldCalls(room, hold_s=0, max_held=8)
        off.refused("A")
        assert await off.hold("A") is None
        held.refused("A")
        await asyncio.sleep(0.25)
        assert await held.hold("A") is None  # its last refusal is older than the hold
        with pytest.raises(ValueError, match="hold_s=-1"):
            HeldCalls(room, -1, 8)
        with pytest.raises(ValueError, match="max_held=-1"):
            HeldCalls(room, 1.0, -1)
        assert await HeldCalls(room, 1.0, 0).hold("A") is None  # max_held 0: never held
        _check_seconds_option("--refused-hold-s", "refused_hold_s", default=1.0)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_fair_room_remove_and_take_all_keep_the_counts():
    room = FairRoom(max_tokens=1000, max_calls=10)
    ws = [_w(c, 10 * (i + 1)) for i, c in enumerate("ABAB")]
    for w in ws:
        room.add(w)
    assert room.remove(ws[1]) and not room.remove(ws[1])
    assert room.tokens == 10 + 30 + 40 and room.held == {"A": 40, "B": 40}
    assert sorted(w.tokens for w in room.take_all()) == [10, 30, 40]
    assert len(room) == 0 and room.tokens == 0 and not room.turn


# ----------------------------------------------------------------------------- the body budget
class _Comm:
    world_size, rank = 3, 2

    def peer_state(self, pe):
        return "alive"


class _Box:
    """A request mailbox whose inboxes always have room: records ``(rank, tag)`` of every message sent, and
    ``(payload copy, tag)`` in ``payloads``."""

    def __init__(self) -> None:
        self.sent, self.payloads = [], []

    def send(self, pe, payload, tag, timeout=None):
        self.sent.append((pe, tag))
        self.payloads.append((payload.clone(), tag))

    def poll(self):
        return None


def _front_end(max_rank_calls):
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=64, chunk_len=16,
                        max_prompt_len=128, timeout_s=90)
    box = _Box()
    return FrontEnd(_Comm(), cfg, INFO, box, 1, "async", max_rank_calls=max_rank_calls), box


def _ids(n: int) -> torch.Tensor:
    return torch.arange(n) % CFG.vocab_size


@pytest.mark.parametrize("clients", [True, False])
def test_front_end_serves_the_light_clients_chunk_ahead_of_a_flooders_held_ones(clients):
    """The rank holds at most 2 requests; A's others wait in the front end. B's request, admitted after A's six,
    goes to the rank as soon as one of A's answers: ahead of A's four held ones (with clients; without, the
    replay's first come first served: after them)."""
    fe, box = _front_end(max_rank_calls=2)
    for rid in range(1, 7):
        fe.admit(rid, _ids(8), client="A" if clients else None)
    fe._flush()
    assert [tag for _, tag in box.sent] == [1, 2] and fe.rank_calls == [2] and fe.has_unsent
    fe.admit(7, _ids(8), client="B" if clients else None)
    fe._flush()
    assert len(box.sent) == 2  # the rank is full: B waits too
    order = [1, 2]
    while fe.inflight:
        done = min(r for r, a in fe.inflight.items() if a.started)  # the oldest request on the rank answers
        fe._forget(done)
        fe._flush()
        order = [tag for _, tag in box.sent]
        assert fe.rank_calls == [sum(1 for a in fe.inflight.values() if a.started)] and fe.rank_calls[0] <= 2
    assert order == ([1, 2, 7, 3, 4, 5, 6] if clients else [1, 2, 3, 4, 5, 6, 7])


def test_front_end_marks_the_chunks_of_a_client_under_an_equal_share_urgent():
    """A client holding fewer calls in flight than an equal share among the active clients gets its chunks marked
    urgent (the rank runs them first, ``MicroBatcher``); a flooder's, a lone client's and equal clients' are not.
    A held chunk's mark is decided when it is sent, not when it was queued."""
    from asap_comm.serving.protocol import chunk_urgent, decode_chunk
    fe, box = _front_end(max_rank_calls=None)
    for rid in range(1, 4):
        fe.admit(rid, _ids(8), client="A")  # alone: first come first served, nobody urgent
    fe._flush()
    assert [chunk_urgent(p) for p, _ in box.payloads] == [False] * 3
    fe.admit(4, _ids(8), client="B")  # B holds 1 of 4 calls beside A's 3: under its share of 2
    fe._flush()
    (payload, tag), = box.payloads[3:]
    assert tag == 4 and chunk_urgent(payload)
    chunk, groups, toks = decode_chunk(payload)  # the mark is not part of the context-parallel group word
    assert groups == 0 and chunk.request_id == 4 and torch.equal(toks, _ids(8))
    fe.admit(5, _ids(8), client="A")  # A now holds 4 of 5: not urgent
    fe.admit(6, _ids(8), client="B")
    fe.admit(7, _ids(8), client="B")  # B, at 3 of 7 beside A's 4, is still under an equal share (3.5) and goes first (fewer in flight)
    fe._flush()
    assert [(tag, chunk_urgent(p)) for p, tag in box.payloads[4:]] == [(6, True), (7, True), (5, False)]
    fe.admit(8, _ids(8), client="B")  # 4 and 4: equal clients, nobody urgent
    fe._flush()
    assert [(tag, chunk_urgent(p)) for p, tag in box.payloads[7:]] == [(8, False)]
    fe, box = _front_end(max_rank_calls=None)  # the trace replay: no client, never urgent
    for rid in range(1, 4):
        fe.admit(rid, _ids(40))
    fe._flush()
    assert box.payloads and not any(chunk_urgent(p) for p, _ in box.payloads)


def test_the_service_turns_the_urgent_slot_on_in_the_async_mode_only():
    from asap_comm.serving.server.cli import service_runtime_config
    assert service_runtime_config(build_parser().parse_args(["--model", "tiny"])).urgent_slot is True
    assert service_runtime_config(build_parser().parse_args(["--model", "tiny", "--no-urgent-slot"])).urgent_slot is False
    assert service_runtime_config(build_parser().parse_args(["--model", "tiny", "--mode", "sync"])).urgent_slot is False
    assert RuntimeConfig().urgent_slot is False  # the trace replay has no clients: no slot to pay for


def test_front_end_clients_take_turns_and_a_started_request_is_never_held():
    """Without a bound, the client with the fewest requests in flight goes first, clients with as many take turns,
    one chunk each, first come first served within a client; with a bound of 1, a request's further chunks still go
    (only a request's first chunk on a rank waits)."""
    fe, box = _front_end(max_rank_calls=None)
    for rid, client in ((1, "A"), (2, "A"), (3, "B"), (4, "B"), (5, "C")):
        fe.admit(rid, _ids(8), client=client)
    assert fe.client_calls == {"A": 2, "B": 2, "C": 1}
    fe._flush()
    assert [tag for _, tag in box.sent] == [5, 1, 3, 2, 4]
    fe, box = _front_end(max_rank_calls=1)
    fe.admit(1, _ids(40), client="A")  # 3 chunks of 16, 16, 8
    fe.admit(2, _ids(8), client="B")
    fe._flush()
    assert [tag for _, tag in box.sent] == [1, 1, 1] and fe.rank_calls == [1] and len(fe.pending[0]) == 1
    assert fe.cancel(2) and not fe.pending[0] and fe.rank_calls == [1]  # a held request leaves without a trace
    with pytest.raises(ValueError, match="max_rank_calls=0"):
        _front_end(max_rank_calls=0)


def test_body_budget_keeps_a_reserve_for_small_bodies_and_caps_a_client():
    b = BodyBudget(total=8000, reserve=1000, per_client=2000, small=100)
    big = [b.lease("A") for _ in range(3)]
    assert big[0].take(50) is None and big[0].take(950) is None  # turns large: all 1000 move to the large pool
    assert big[1].take(1000) is None
    assert "per client" in big[2].take(1000)  # A's third large body
    others = [b.lease(f"C{i}") for i in range(5)]
    assert [o.take(1000) for o in others[:5]][:5].count(None) == 5
    assert b.large == 7000 and "kept for bodies of up to 100" in b.lease("D").take(200)
    small = [b.lease("A") for _ in range(10)]
    assert all(s.take(100) is None for s in small)  # the reserve: small bodies of the capped client still fit
    assert b.used == 8000 and "bound 8000" in b.lease("E").take(1)
    for lease in big + others + small:
        lease.release()
        lease.release()  # idempotent
    assert b.used == 0 and b.large == 0 and b.by_client == {}


# ----------------------------------------------------------------------------- connections
class _Transport:
    def __init__(self) -> None:
        self.written, self.closed, self.aborted = b"", False, False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name, default=None):
        return default


class _Inner:
    def __init__(self) -> None:
        self.data, self.made, self.lost = b"", False, False

    def connection_made(self, t) -> None:
        self.made = True

    def data_received(self, data: bytes) -> None:
        self.data += data

    def connection_lost(self, exc) -> None:
        self.lost = True


def test_guard_times_out_headers_and_idle_connections_and_makes_room_at_the_limit():
    closed = []
    g = ConnectionGuard(_Inner, header_timeout_s=2.0, idle_timeout_s=5.0, max_connections=3, count=closed.append)
    conns = []
    for _ in range(3):
        c = g.protocol()
        c.connection_made(_Transport())
        conns.append(c)
    slow, idle, busy = conns
    slow.data_received(b"GET / HTTP/1.1\r\nHost")  # headers that never end
    busy.data_received(b"GET / HTTP/1.1\r\nHost: x\r")
    busy.data_received(b"\n\r\n")  # complete across two reads
    assert busy.busy and not slow.busy and busy.inner.data == b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    now = time.monotonic()
    g.sweep(now + 1.0)
    assert closed == []
    g.sweep(now + 2.5)
    assert closed == ["header_timeout"] and slow.transport.written.startswith(b"HTTP/1.1 408 ")
    assert slow.transport.closed and len(g) == 2
    # at the limit, the oldest connection not in a request is closed to make room
    g.end(busy.transport)  # the request ended: busy is idle now, newer than `idle`
    extra = [g.protocol() for _ in range(2)]
    for c in extra:
        c.connection_made(_Transport())
    assert closed == ["header_timeout", "evicted"] and idle.transport.aborted and not busy.transport.aborted
    # every open connection in a request: a new one gets 503
    for c in [busy] + extra:
        g.begin(c.transport)
    late = g.protocol()
    late.connection_made(_Transport())
    assert closed[-1] == "refused" and late.transport.written.startswith(b"HTTP/1.1 503 ") and not late.inner.made
    late.connection_lost(None)  # never started: aiohttp's protocol is not told
    assert not late.inner.lost
    for c in [busy] + extra:
        g.end(c.transport)
    g.sweep(time.monotonic() + 6.0)
    assert closed.count("idle") == 3 and len(g) == 0


def test_accept_errors_are_logged_once_per_interval_without_a_traceback():
    f = AcceptErrorFilter(interval_s=60.0)
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        import sys
        exc_info = sys.exc_info()
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                                 (), exc_info) for _ in range(100)]
    passed = [r for r in records if f.filter(r)]
    assert len(passed) == 1 and passed[0].exc_info is None and "Too many open files" in passed[0].getMessage()
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", (), exc_info)
    assert f.filter(other) and other.exc_info is exc_info


def test_connection_limit_is_below_the_file_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_connections() < soft
    check_connection_limit(None)
    check_connection_limit(default_max_connections())
    with pytest.raises(ValueError, match=r"--max-connections .* RLIMIT_NOFILE is"):
        check_connection_limit(soft)
    with pytest.raises(ValueError, match="max_connections"):
        ServiceOptions(max_connections=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        ServiceOptions(header_timeout_s=0)


# ----------------------------------------------------------------------------- what a crash leaves
def test_stale_segments_are_removed_only_when_nobody_holds_them(tmp_path):
    def plant(name: str, age_s: float) -> str:
        p = tmp_path / name
        p.write_bytes(b"x")
        os.utime(p, (time.time() - age_s, time.time() - age_s))
        return str(p)

    stale = [plant("asap-aaaa", 600), plant("sem.mp-bbbb", 600)]
    young = plant("asap-cccc", 5)
    other = plant("unrelated", 600)
    held = plant("asap-dddd", 600)
    fd = os.open(held, os.O_RDONLY)
    try:
        removed = remove_stale_segments(str(tmp_path))
    finally:
        os.close(fd)
    assert sorted(removed) == sorted(stale)
    assert all(os.path.exists(p) for p in (young, other, held))


# ----------------------------------------------------------------------------- the API key
def test_the_key_is_stripped_of_surrounding_whitespace_and_said_so(capsys):
    args = build_parser().parse_args([])
    opts = service_options(args, {"ASAP_API_KEY": "s3cret\n"})
    assert opts.api_key == "s3cret" and "stripped" in capsys.readouterr().err
    opts = service_options(argparse.Namespace(**{**vars(args), "api_key": " k "}), {})
    assert opts.api_key == "k"
    with pytest.raises(ValueError, match="empty"):
        service_options(args, {"ASAP_API_KEY": "\n"})
    with pytest.raises(ValueError, match="whitespace"):
        ServiceOptions(api_key="k\n")
