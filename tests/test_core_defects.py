"""Regression tests for defects that gave wrong results or lost messages silently.

Each was reproduced as a failing test first:
* torch.compile dropped or reordered the waits (stale data, 12 of 12 rounds);
* a one-slot mailbox overwrote messages;
* prepared handles rejected the keyword forms the README documents;
* one dead PE failed every wait in the group (failure scope);
* sharp edges: string timeouts, mailbox timeout text, unguarded launch scripts,
  a second init on the same address, collective calls made on only some PEs.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import asap_comm
from asap_comm import CommError, PeerFailure
from distributed_utils import run

# --------------------------------------------------------------------------
# 1. torch.compile: a compiled consumer reads exactly what an eager producer wrote
# --------------------------------------------------------------------------
ROUNDS = 8  # per variant; the signal value changes every round
VARIANTS = [(backend, read) for backend in ("inductor", "aot_eager") for read in ("wait_read", "get", "get_value")]


def _counting_backend(name, counter):
    from torch._dynamo import lookup_backend

    inner = lookup_backend(name)

    def backend(gm, example_inputs):
        counter[0] += 1
        return inner(gm, example_inputs)

    return backend


def _consumer(kind):
    ops = torch.ops.asap_comm

    def consume(x, sig, k):
        if kind == "wait_read":  # the wait takes the guarded tensor and returns what it read after the wait
            y = ops.signal_wait_read(x, sig, 0, ">=", k)
        elif kind == "get":  # the wait's result unused; the read is an ordered op after it
            ops.signal_wait_until(sig, 0, ">=", k)
            y = ops.get(x, 0)
        else:  # the wait's result used
            v = ops.signal_wait_until(sig, 0, ">=", k)
            y = ops.get(x, 0) + (v.to(torch.float32) - k)
        y = y * 2.0
        ops.signal_op(sig, 1, k, "set", 1)  # ack: the producer may overwrite x now
        return y

    return consume


def _compile_rounds(comm):
    x = comm.zeros((256,), torch.float32)
    sig = comm.signals(2)
    total = ROUNDS * len(VARIANTS)
    if comm.rank == 1:  # eager producer: arrives late on purpose, so the consumer waits first
        src = torch.empty(256)
        put_times = []
        for k in range(1, total + 1):
            comm.signal_wait_until(sig, 1, ">=", k - 1, timeout=120)
            time.sleep(0.03)
            src.copy_(torch.arange(256, dtype=torch.float32) + 1000 * k)
            put_times.append(time.monotonic())
            comm.put_signal(x, src, 0, sig, 0, k)
        comm.signal_wait_until(sig, 1, ">=", total, timeout=120)
        return put_times
    report = []
    k = 0
    for backend, kind in VARIANTS:
        torch._dynamo.reset()
        compiles = [0]
        f = torch.compile(_consumer(kind), backend=_counting_backend(backend, compiles), fullgraph=True)
        stale, calls = 0, []
        for _ in range(ROUNDS):
            k += 1
            calls.append(time.monotonic())
            y = f(x, sig, k)
            expect = (torch.arange(256, dtype=torch.float32) + 1000 * k) * 2.0
            stale += int(not torch.equal(y, expect))
        report.append((backend, kind, stale, compiles[0], calls))
    return report


@pytest.mark.slow
def test_compiled_consumer_reads_what_eager_producer_wrote():
    report, put_times = run(_compile_rounds, 2, timeout=600)
    early = 0
    for i, (backend, kind, stale, compiles, calls) in enumerate(report):
        assert stale == 0, f"{backend}/{kind}: {stale} of {ROUNDS} rounds read stale data"
        # idx/value are SymInts: a changing signal value does not recompile per value
        assert compiles <= 2, f"{backend}/{kind}: compiled {compiles} times for {ROUNDS} signal values"
        early += sum(c < p for c, p in zip(calls, put_times[i * ROUNDS:(i + 1) * ROUNDS]))
    # the race was exercised: the consumer reached its wait before the data in most rounds
    assert early >= len(report) * ROUNDS // 2, early


# --------------------------------------------------------------------------
# 2. mailboxes of every capacity, back-pressure at capacity
# --------------------------------------------------------------------------
def _flood(comm, num_slots, count):
    box = comm.mailbox(64, num_slots)
    consumer = comm.world_size - 1
    if comm.rank != consumer:
        for i in range(count):  # no waiting between sends: back-pressure does it
            box.send(consumer, torch.tensor([comm.rank, i], dtype=torch.int64), tag=i)
        comm.barrier()
        return None
    seen = {p: [] for p in range(comm.world_size - 1)}
    for _ in range(count * (comm.world_size - 1)):
        with box.recv(timeout=30) as m:
            src, i = m.tensor.tolist()
            assert src == m.src and i == m.tag
            seen[m.src].append(i)
    extra = box.poll()
    comm.barrier()
    return seen, extra


@pytest.mark.slow
@pytest.mark.parametrize("world,num_slots", [(2, 1), (3, 1), (3, 2), (3, 3)])
def test_every_mailbox_capacity_keeps_every_message(world, num_slots):
    count = 50
    *_, (seen, extra) = run(_flood, world, num_slots, count)
    assert extra is None
    for p in range(world - 1):
        assert seen[p] == list(range(count)), (p, seen[p][:10])  # FIFO per producer, nothing lost or duplicated


def test_one_slot_mailbox_back_pressure(comm1):
    box = comm1.mailbox(64, 1)
    box.send(0, torch.ones(2))
    with pytest.raises(asap_comm.TimeoutError, match="send: waiting for a free slot in PE 0's inbox"):
        box.send(0, torch.ones(2), timeout=0.02)  # full at capacity 1
    m = box.recv(timeout=1)
    with pytest.raises(asap_comm.TimeoutError):
        box.send(0, torch.ones(2), timeout=0.02)  # received but not released: still occupied
    m.release()
    box.send(0, torch.full((2,), 7.0), tag=3, timeout=0.02)
    with box.recv(timeout=1) as m2:
        assert m2.tag == 3 and m2.tensor.tolist() == [7.0, 7.0]
    assert box.poll() is None


def test_slots_are_reused_in_ring_order(comm1):
    """Documented back-pressure: message p waits for the release of message p - num_slots, even if a later one
    was released first (found by the model-based tier)."""
    box = comm1.mailbox(64, 2)
    box.send(0, torch.tensor([0]))
    box.send(0, torch.tensor([1]))
    m0, m1 = box.recv(timeout=1), box.recv(timeout=1)
    m1.release()
    with pytest.raises(asap_comm.TimeoutError):
        box.send(0, torch.tensor([2]), timeout=0.02)  # position 2 reuses message 0's slot, still held
    assert m0.tensor.tolist() == [0]  # the held view is intact
    m0.release()
    box.send(0, torch.tensor([2]), timeout=0.02)
    box.send(0, torch.tensor([3]), timeout=0.02)
    assert [box.recv(timeout=1).tensor.tolist() for _ in range(2)] == [[2], [3]]


def _empty_put_signal(comm):
    x = comm.zeros((2, 2), torch.float32)
    sig = comm.signals(1)
    peer = 1 - comm.rank
    comm.put_signal(x[0:0], torch.empty(0, 2), peer, sig, 0, 1, "add")  # an empty view: the signal alone
    comm.prepare_put_signal(x[0:0], torch.empty(0, 2), peer, sig, 0, "add")(1)
    comm.signal_wait_until(sig, 0, ">=", 2, timeout=30)
    return comm.signal_fetch(sig, 0)


@pytest.mark.slow
def test_put_signal_of_an_empty_view_to_a_peer_only_signals():
    assert run(_empty_put_signal, 2) == [2, 2]


# --------------------------------------------------------------------------
# 3. prepared handles take the documented keyword forms
# --------------------------------------------------------------------------
def test_prepared_handles_take_keywords(comm1):
    box = comm1.mailbox(64, 4)
    t = torch.arange(4, dtype=torch.float32)
    f = box.prepare_send(0, t, tag=0)
    f(tag=9)
    f(5)
    f()
    assert [box.recv(timeout=1).tag for _ in range(3)] == [9, 5, 0]
    with pytest.raises(TypeError, match="unexpected keyword argument 'tg'"):
        f(tg=1)
    with pytest.raises(TypeError, match="at most one argument"):
        f(1, tag=2)
    x = comm1.zeros((4,))
    sig = comm1.signals(1)
    p = comm1.prepare_put_signal(x, t, 0, sig, 0, "add")
    p(value=5)
    p(2)
    assert comm1.signal_fetch(sig, 0) == 7 and torch.equal(x, t)
    w = comm1.prepare_signal_wait(sig, 0, ">=", timeout=0.05)
    assert w(value=7) == 7 and w(3) == 7
    with pytest.raises(TypeError, match="unexpected keyword argument 'v'"):
        w(v=1)
    with pytest.raises(TypeError, match="missing the argument value"):
        p()
    with pytest.raises(asap_comm.TimeoutError):
        w(value=8)


# --------------------------------------------------------------------------
# 4. failure scope: only the waits whose peers all died fail
# --------------------------------------------------------------------------
def _wait_dead(comm, pe, limit=10.0):
    end = time.monotonic() + limit
    while comm.peer_alive(pe):
        assert time.monotonic() < end, f"PE {pe} still alive"
        time.sleep(0.005)


def _scope(comm):
    sig = comm.signals(4)
    box = comm.mailbox(64, 4)
    comm.barrier()
    if comm.rank == 2:
        os._exit(3)  # dies without close
    _wait_dead(comm, 2)
    if comm.rank == 1:
        time.sleep(0.2)
        comm.signal_op(sig, 0, 1, "set", 0)  # satisfies PE 0's wait on peers=[1]
        time.sleep(0.2)
        box.send(0, torch.tensor([42]), tag=1)  # a live producer's message still flows
        comm.signal_wait_until(sig, 2, ">=", 1, timeout=30, peers=[0])
        return "done"
    out = {}
    out["peers_live"] = comm.signal_wait_until(sig, 0, ">=", 1, timeout=30, peers=[1])
    for key, peers in (("peers_dead", [2]), ("any", None)):
        t0 = time.monotonic()
        try:
            comm.signal_wait_until(sig, 1, ">=", 1, timeout=30, peers=peers)
            out[key] = "returned"
        except PeerFailure as e:
            out[key] = (e.pe, e.reason, str(e), time.monotonic() - t0 < 10)
    try:
        comm.signal_wait_until(sig, 1, ">=", 1, timeout=0.3, peers=[1, 2])
        out["mixed"] = "returned"
    except asap_comm.TimeoutError:
        out["mixed"] = "timeout"
    with box.recv(timeout=30) as m:
        out["recv"] = (m.src, m.tag, m.tensor.tolist())
    try:
        comm.barrier(timeout=30)
        out["barrier"] = "returned"
    except PeerFailure as e:
        out["barrier"] = e.pe
    comm.signal_op(sig, 2, 1, "set", 1)  # PE 1 may close now
    _wait_closed = time.monotonic() + 10
    while comm.peer_alive(1):
        assert time.monotonic() < _wait_closed
        time.sleep(0.005)
    try:
        box.recv(timeout=30)
        out["recv_none_left"] = "returned"
    except PeerFailure as e:
        out["recv_none_left"] = str(e)
    return out


def _observer_child(fn, rank, world, port, prefix, conn):
    try:
        with asap_comm.init(rank, world, master_addr="127.0.0.1", master_port=port, timeout=30,
                            shm_prefix=prefix) as comm:
            conn.send(("ok", fn(comm)))
    except BaseException as e:  # noqa: BLE001 - report everything to the test
        conn.send(("err", f"{type(e).__name__}: {e}"))


def _run_with_a_death(fn, world, dying, timeout=120):
    """Runs ``fn`` on ``world`` PEs of which PE ``dying`` dies on purpose.

    (``launch`` stops every rank once one dies, so these tests spawn their
    own.) Returns (results of the other ranks, exit code of the dying one);
    every wait is bounded, leftovers are killed, and no segment may remain.
    """
    import glob
    import multiprocessing as mp
    import secrets
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = f"asap-t{secrets.token_hex(4)}-"
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for r in range(world):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_observer_child, args=(fn, r, world, port, prefix, b), daemon=True)
        p.start()
        procs.append(p)
        conns.append(a)
    try:
        results = {}
        for r in range(world):
            if r == dying:
                continue
            assert conns[r].poll(timeout), f"rank {r} did not report within {timeout} s"
            status, value = conns[r].recv()
            assert status == "ok", f"rank {r}: {value}"
            results[r] = value
        procs[dying].join(timeout)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert glob.glob(f"/dev/shm/{prefix}*") == []
    return results, procs[dying].exitcode


@pytest.mark.slow
def test_failure_is_scoped_to_the_peers_a_wait_depends_on():
    results, code = _run_with_a_death(_scope, 3, dying=2)
    assert code == 3
    out = results[0]
    assert results[1] == "done"
    assert out["peers_live"] == 1  # PE 2's death does not concern a wait that PE 1 satisfies
    pe, reason, text, fast = out["peers_dead"]
    assert (pe, reason, fast) == (2, "died", True) and "every PE in peers has died or closed" in text
    pe, reason, _, fast = out["any"]  # peers=None: any PE's death fails it, as before
    assert (pe, reason, fast) == (2, "died", True)
    assert out["mixed"] == "timeout"  # PE 1 lives: the wait goes on until its own timeout
    assert out["recv"] == (1, 1, [42])  # a live producer's messages keep flowing
    assert out["barrier"] == 2  # collective: any death fails it
    assert "no live producer remains" in out["recv_none_left"]


def _half_written(comm):
    """PE 2 dies after claiming a slot in PE 0's inbox, before publishing it."""
    box = comm.mailbox(64, 4)
    sig = comm.signals(1)
    if comm.rank == 2:
        r = comm.remote(box._buf, 0)  # PE 0's inbox, as raw bytes
        hdr = r[:8].view(torch.int64)
        tail = int(hdr[0])
        off = asap_comm._C.MAILBOX_HEADER_BYTES + (tail % box.num_slots) * asap_comm._C.slot_stride(box.slot_bytes)
        seq = r[off: off + 8].view(torch.int64)
        assert int(seq[0]) == tail << 17  # free for position `tail`
        seq[0] = (tail << 17) | (2 + 1)  # claimed by PE 2 ...
        hdr[0] = tail + 1
        comm.fence()
        os._exit(0)  # ... which dies before writing the message
    _wait_dead(comm, 2)
    if comm.rank == 1:
        for i in range(3):
            box.send(0, torch.tensor([i]), tag=i)
        comm.signal_wait_until(sig, 0, ">=", 1, timeout=30, peers=[0])
        return None
    out = []
    try:
        box.recv(timeout=30)
        out.append("returned")
    except PeerFailure as e:
        out.append((e.pe, e.reason, str(e)))
    for _ in range(3):
        with box.recv(timeout=30) as m:
            out.append((m.src, m.tag))
    comm.signal_op(sig, 0, 1, "set", 1)
    return out


@pytest.mark.slow
def test_half_written_message_of_a_dead_producer_is_dropped_and_reported():
    results, code = _run_with_a_death(_half_written, 3, dying=2)
    assert code == 0
    first, *rest = results[0]
    pe, reason, text = first
    assert (pe, reason) == (2, "died")
    assert "dropped half-written" in text and "PE 2 died while writing a message" in text
    assert rest == [(1, 0), (1, 1), (1, 2)]  # the messages behind it, in order, none lost


# --------------------------------------------------------------------------
# 5. sharp edges a new user hits
# --------------------------------------------------------------------------
def test_timeouts_must_be_numbers(comm1):
    sig = comm1.signals(1)
    box = comm1.mailbox(64, 2)
    calls = {
        "signal_wait_until": lambda: comm1.signal_wait_until(sig, 0, "==", 0, timeout="1"),
        "barrier": lambda: comm1.barrier(timeout="1"),
        "recv": lambda: box.recv(timeout="1"),
        "send": lambda: box.send(0, torch.ones(1), timeout="1"),
        "prepare_signal_wait": lambda: comm1.prepare_signal_wait(sig, 0, "==", timeout="1"),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"{name}: timeout must be a number of seconds or None, got '1'"):
            call()
    with pytest.raises(TypeError, match="signal_wait_until: timeout must be a number"):
        comm1.signal_wait_until(sig, 0, "==", 0, timeout=True)
    assert box.poll() is None  # nothing was sent by the rejected call


def test_recv_timeout_says_what_was_awaited(comm1):
    box = comm1.mailbox(64, 2)
    with pytest.raises(asap_comm.TimeoutError) as ei:
        box.recv(timeout=0.01)
    text = str(ei.value)
    assert text.startswith("recv: waiting for a message in PE 0's inbox") and "last value seen" not in text


@pytest.mark.slow
def test_launch_without_main_guard_says_so(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import asap_comm

        def work(comm):
            return comm.rank

        print(asap_comm.launch(work, 2, timeout=60))
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode != 0
    assert 'no `if __name__ == "__main__":` guard' in p.stderr, p.stderr[-2000:]
    assert "LaunchError" in p.stderr


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_by_a_signal(tmp_path):
    """A launcher killed by SIGKILL (or an unhandled SIGTERM) runs no cleanup: its ranks, daemonic children, used to
    live on, polling forever. The ranks now get SIGHUP when it dies (Linux PR_SET_PDEATHSIG) and exit, even a rank
    that ignores SIGTERM (as a service's workers do: with SIGTERM as the signal they outlived it), after removing
    any of the group's shared-memory segments still named (a group's segments are unlinked once every peer has
    mapped them, so only a launcher killed while the group starts could leave one)."""
    import glob
    import signal

    script = tmp_path / "launcher.py"
    pids = tmp_path / "pids"
    script.write_text(textwrap.dedent(f"""
        import os, signal, time
        import asap_comm

        def work(comm):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as asap_comm.serving.server's workers
            comm.empty((1024,))  # a heap segment in /dev/shm
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{comm._shm_prefix}}\\n")
            time.sleep(120)

        if __name__ == "__main__":
            asap_comm.launch(work, 2, timeout=300)
    """))
    log = open(tmp_path / "launcher.log", "w")
    p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and p.poll() is None
               and (not pids.exists() or len(pids.read_text().splitlines()) < 2)):  # a line per rank
            time.sleep(0.1)
        assert pids.exists(), (tmp_path / "launcher.log").read_text()[-3000:]
        lines = [x.split() for x in pids.read_text().splitlines()]
        ranks = [int(pid) for pid, _ in lines]
        (prefix,) = {pfx for _, pfx in lines}
        assert len(ranks) == 2
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        log.close()

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:  # a zombie is dead
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30  # hang guard only: the signal arrives at once
    while time.monotonic() < deadline and any(alive(r) for r in ranks):
        time.sleep(0.1)
    left = [r for r in ranks if alive(r)]
    for r in left:
        os.kill(r, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
    segments = glob.glob(f"/dev/shm/{prefix}*")
    for path in segments:
        os.unlink(path)
    assert not segments, f"the killed launcher's group left {segments}"


def test_second_init_on_the_same_address_names_the_open_communicator():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=port, timeout=5) as c:
        with pytest.raises(CommError, match=rf"init: a communicator is already open on 127.0.0.1:{port} in this "
                                            rf"process \(id {c.id}, rank 0 of 1"):
            asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=port, timeout=5)
        assert not c.closed


def _mismatched(comm, kind):
    comm.zeros((4,))
    if kind == "different":
        if comm.rank == 0:
            comm.zeros((8,), torch.float64)
        else:
            comm.signals(2)
    else:  # only PE 0 makes the call
        if comm.rank == 0:
            comm.signals(3)
        else:
            time.sleep(3)
    return "returned"


@pytest.mark.slow
def test_collective_call_mismatch_names_the_calls():
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_mismatched, 2, "different")
    text = str(ei.value)
    assert "collective calls do not match" in text
    assert "zeros(shape=(8,), dtype=torch.float64)" in text and "signals(n=2)" in text
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_mismatched, 2, "missing", comm_timeout=1.0)
    text = str(ei.value)
    assert "signals: collective call #2, signals(n=3), did not complete" in text
    assert "PE 1 has made 1 collective calls (its last: zeros(shape=(4,), dtype=torch.float32))" in text
