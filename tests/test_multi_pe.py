"""Multi-process tier: 2 to 4 PEs spawned through tests/distributed_utils.run,
every join bounded. Several checks share one launch where they can (each
spawned PE pays for importing torch). Also: a torch.compile'd consumer reads
what an eager producer wrote, mailboxes of every capacity, and the scope of
a PE's death (only the waits whose peers all died fail)."""
import os
import random
import signal
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import asap_comm
from asap_comm import PeerFailure
from distributed_utils import rank_info, run, shm_files

# --------------------------------------------------------------------------
# puts and gets on slices, odd offsets and strides, against a pure-torch model
# --------------------------------------------------------------------------
SHAPE = (13, 7)


def _apply_ops(comm, ops):
    """Every PE runs the same op list; PE `writer` puts or gets. Returns the
    final local tensor and every get result, to compare with the reference."""
    dtype = torch.float64
    x = comm.zeros(SHAPE, dtype)
    # Encode the owner in the initial contents (DeepEP style): PE p holds p*1000 + index.
    x.copy_(torch.arange(x.numel(), dtype=dtype).view(SHAPE) + comm.rank * 1000)
    comm.barrier()
    gets = []
    for step, (kind, writer, target, r0, r1, c0, c1, cstep) in enumerate(ops):
        if comm.rank == writer:
            view = x[r0:r1, c0:c1:cstep]
            if kind == "put":
                src = torch.full(view.shape, float(step + 1) * 10000 + writer, dtype=dtype)
                comm.put(view, src, target)
            else:
                out = torch.empty(view.shape, dtype=dtype)
                comm.get(out, view, target)
                gets.append((step, out))
        comm.barrier()
    return x.clone(), gets


def _reference(world, ops):
    state = [torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float64).view(SHAPE) + p * 1000 for p in range(world)]
    gets = {}
    for step, (kind, writer, target, r0, r1, c0, c1, cstep) in enumerate(ops):
        view = state[target][r0:r1, c0:c1:cstep]
        if kind == "put":
            view.copy_(torch.full(view.shape, float(step + 1) * 10000 + writer, dtype=torch.float64))
        else:
            gets[step] = view.clone()
    return state, gets


@st.composite
def _op(draw, world):
    r0 = draw(st.integers(0, SHAPE[0] - 1))
    r1 = draw(st.integers(r0, SHAPE[0]))
    c0 = draw(st.integers(0, SHAPE[1] - 1))
    c1 = draw(st.integers(c0, SHAPE[1]))
    return (draw(st.sampled_from(["put", "get"])), draw(st.integers(0, world - 1)), draw(st.integers(0, world - 1)),
            r0, r1, c0, c1, draw(st.integers(1, 3)))


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_put_get_slices_match_pure_torch_reference(data):
    world = data.draw(st.integers(2, 3))
    ops = data.draw(st.lists(_op(world), min_size=5, max_size=40))
    results = run(_apply_ops, world, ops)
    state, ref_gets = _reference(world, ops)
    for pe, (final, gets) in enumerate(results):
        assert torch.equal(final, state[pe]), f"PE {pe} memory differs from the reference"
        for step, out in gets:
            assert torch.equal(out, ref_gets[step]), f"get at step {step} on PE {pe} differs"


def _odd_offsets(comm):
    # Byte-level odd offsets: uint8 views starting at odd addresses, and a
    # bf16 view at an offset that is not 8-aligned; large non-contiguous too.
    x = comm.zeros((1001,), torch.uint8)
    y = comm.zeros((64, 33), torch.bfloat16)
    big = comm.zeros((600, 1000), torch.float32)  # 2.4 MB: takes the torch copy path
    peer = (comm.rank + 1) % comm.world_size
    comm.put(x[3:998:5], torch.full((199,), comm.rank + 7, dtype=torch.uint8), peer)
    comm.put(y[1:, 5], torch.full((63,), comm.rank + 0.5, dtype=torch.bfloat16), peer)
    comm.put(big[:, 1::2], torch.full((600, 500), float(comm.rank + 1)), peer)
    comm.barrier()
    left = (comm.rank - 1) % comm.world_size
    ex = torch.zeros(1001, dtype=torch.uint8)
    ex[3:998:5] = left + 7
    ey = torch.zeros(64, 33, dtype=torch.bfloat16)
    ey[1:, 5] = left + 0.5
    eb = torch.zeros(600, 1000)
    eb[:, 1::2] = left + 1
    got = torch.empty(600, 500)
    comm.get(got, big[:, 1::2], left)  # what I put into left's memory? no: left's own buffer holds left-1's data
    exp_get = torch.full((600, 500), float((left - 1) % comm.world_size + 1))
    return torch.equal(x, ex), torch.equal(y, ey), torch.equal(big, eb), torch.equal(got, exp_get), \
        shm_files(comm._shm_prefix)


@pytest.mark.slow
def test_odd_offsets_strides_and_large_copies():
    for ok_x, ok_y, ok_big, ok_get, leftover in run(_odd_offsets, 3):
        assert ok_x and ok_y and ok_big and ok_get
        assert leftover == [], f"segments still linked after init: {leftover}"


# --------------------------------------------------------------------------
# put_signal ordering under stress; add signals from every PE at once
# --------------------------------------------------------------------------
def _put_signal_stress(comm, iters, numel):
    """PE 0 streams payloads into a ring of 4 buffers on PE 1 with put_signal;
    PE 1 checks the whole payload every time a signal moves, then returns
    credit. The consumer is randomly delayed to provoke races."""
    nbuf = 4
    buf = comm.zeros((nbuf, numel), torch.int64)
    sig = comm.signals(nbuf)
    credit = comm.signals(1)
    rng = random.Random(comm.rank)
    bad = 0
    if comm.rank == 0:
        src = torch.empty(numel, dtype=torch.int64)
        for k in range(1, iters + 1):
            if k > nbuf:
                comm.signal_wait_until(credit, 0, ">=", k - nbuf)
            src.fill_(k)
            src[::97] = -k  # not a constant: a torn copy shows
            comm.put_signal(buf[k % nbuf], src, 1, sig, k % nbuf, k)
    else:
        for k in range(1, iters + 1):
            comm.signal_wait_until(sig, k % nbuf, "==", k)
            row = buf[k % nbuf]
            expect = torch.full((numel,), k, dtype=torch.int64)
            expect[::97] = -k
            bad += int(not torch.equal(row, expect))
            if rng.random() < 0.05:
                time.sleep(0.0005)
            comm.signal_op(credit, 0, 1, "add", 0)
    return bad


def _prepared_pingpong(comm, iters):
    one = torch.zeros(4, dtype=torch.int64)
    y = comm.zeros((4,), torch.int64)
    sig = comm.signals(1)
    peer = 1 - comm.rank
    ps = comm.prepare_put_signal(y, one, peer, sig, 0)
    w = comm.prepare_signal_wait(sig, 0, ">=")
    bad = 0
    for i in range(1, iters + 1):
        if comm.rank == 0:
            one.fill_(i)
            ps(i)
            w(i)
        else:
            w(i)
            bad += int(not bool((y == i).all()))
            one.fill_(i)
            ps(i)
    return bad


@pytest.mark.slow
def test_put_signal_data_visible_before_signal():
    assert run(_put_signal_stress, 2, 3000, 4096) == [0, 0]   # 32 KiB payloads
    assert run(_put_signal_stress, 2, 300, 300_000) == [0, 0]  # 2.4 MB: torch copy path
    assert run(_prepared_pingpong, 2, 20000) == [0, 0]


def _add_from_everyone(comm, n):
    sig = comm.signals(2)
    comm.barrier()
    for i in range(n):
        for pe in range(comm.world_size):
            comm.signal_op(sig, 0, 1, "add", pe)
            comm.signal_op(sig, 1, pe + 1, "add", pe)
    comm.barrier()
    return comm.signal_fetch(sig, 0), comm.signal_fetch(sig, 1)


@pytest.mark.slow
def test_add_signals_from_every_pe_exact_total():
    world, n = 4, 3000
    res = run(_add_from_everyone, world, n)
    for pe, (a, b) in enumerate(res):
        assert a == world * n
        assert b == world * n * (pe + 1)


# --------------------------------------------------------------------------
# mailboxes
# --------------------------------------------------------------------------
def _mailbox_many_producers(comm, per_producer, num_slots):
    box = comm.mailbox(512, num_slots)
    rng = random.Random(1234 + comm.rank)
    if comm.rank != 0:
        for seq in range(per_producer):
            n = rng.randrange(0, 64)  # 0..63 int64 = up to 504 bytes
            payload = torch.arange(n, dtype=torch.int64) * 1_000_003 + seq * 7 + comm.rank
            tag = (seq << 8) | comm.rank
            if rng.random() < 0.5:
                box.send(0, payload.view(torch.uint8) if n % 2 else payload, tag)
            else:
                box.send(0, payload.to(torch.float64), tag)
        return None
    expected = {pe: 0 for pe in range(1, comm.world_size)}
    problems = []
    total = per_producer * (comm.world_size - 1)
    for i in range(total):
        if i % 500 == 0:
            time.sleep(0.01)  # let the inbox fill up: producers must wait, not drop
        with box.recv(timeout=20) as m:
            seq, src = m.tag >> 8, m.tag & 0xFF
            if src != m.src:
                problems.append(f"tag says src {src}, header says {m.src}")
            if seq != expected[m.src]:
                problems.append(f"from PE {m.src}: got seq {seq}, expected {expected[m.src]}")
            expected[m.src] = seq + 1
            t = m.tensor
            vals = t.view(torch.int64) if t.dtype == torch.uint8 else t.to(torch.int64)
            exp = torch.arange(vals.numel(), dtype=torch.int64) * 1_000_003 + seq * 7 + m.src
            if not torch.equal(vals, exp):
                problems.append(f"payload of PE {m.src} seq {seq} corrupted")
    extra = box.poll()
    if extra is not None:
        problems.append(f"duplicate or extra message {extra}")
    return problems, expected


@pytest.mark.slow
def test_mailbox_many_producers_fifo_no_loss_no_dup():
    res = run(_mailbox_many_producers, 4, 1500, 8)
    problems, counts = res[0]
    assert problems == []
    assert counts == {1: 1500, 2: 1500, 3: 1500}


def _backpressure(comm, num_slots, extra):
    box = comm.mailbox(64, num_slots)
    sig = comm.signals(2)  # [0]: the producer is done (on PE 0); [1]: the consumer started draining (on PE 1)
    if comm.rank == 1:
        draining = []  # per send: had the consumer started draining when it returned?
        for i in range(num_slots + extra):
            box.send(0, torch.tensor([i]), i)
            draining.append(comm.signal_fetch(sig, 1) == 1)
        comm.signal_op(sig, 0, 1, "set", 0)
        return draining
    time.sleep(0.6)  # the producer fills the inbox and must wait (the assertions do not depend on this time)
    comm.signal_op(sig, 1, 1, "set", 1)
    got = []
    for _ in range(num_slots + extra):
        with box.recv(timeout=10) as m:
            got.append((m.tag, int(m.tensor[0])))
    comm.signal_wait_until(sig, 0, "==", 1)
    return got


def test_mailbox_backpressure_waits_then_resumes():
    got, draining = run(_backpressure, 2, 4, 6)
    assert got == [(i, i) for i in range(10)]
    # a send past the inbox's 4 slots can only return once the consumer has released a slot, after it set the flag
    assert all(draining[4:]), f"a send into the full inbox returned before the consumer drained it: {draining}"


# --------------------------------------------------------------------------
# failures: SIGKILL mid-wait, clean close, launch error reporting
# --------------------------------------------------------------------------
def _killed_mid_wait(comm, report_dir, kind):
    sig = comm.signals(1)
    box = comm.mailbox(64, 2)
    info = rank_info(comm)
    if comm.rank == 1:
        if kind == "send":  # fill PE 0's... no: PE 1 is the consumer here; it dies, PE 0 is blocked sending to it
            pass
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    err = None
    try:
        if kind == "wait":
            comm.signal_wait_until(sig, 0, ">=", 1, timeout=15)
        elif kind == "barrier":
            comm.barrier(timeout=15)
        else:
            for i in range(10):
                box.send(1, torch.tensor([i]), timeout=15)
    except PeerFailure as e:
        err = (e.pe, e.reason, str(e))
    took = time.monotonic() - t0
    time.sleep(0.2)
    with open(os.path.join(report_dir, f"{kind}.txt"), "w") as f:
        f.write(repr((err, took, shm_files(info.shm_prefix))))
    return err


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wait", "barrier", "send"])
def test_sigkill_mid_wait_gives_peer_failure_and_leaks_nothing(tmp_path, kind):
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_killed_mid_wait, 2, str(tmp_path), kind, timeout=60)
    assert ei.value.rank == 1 and ei.value.exitcode == -signal.SIGKILL, str(ei.value)
    err, took, leftover = eval((tmp_path / f"{kind}.txt").read_text())
    assert err is not None and err[0] == 1 and err[1] == "died", err
    assert "PE 1 died" in err[2]
    # PeerFailure (not TimeoutError) is the liveness check; the guard, well under the 15-s bound, is a hang guard
    assert took < 12, f"PeerFailure took {took:.2f} s"
    assert leftover == []


def _close_early(comm):
    sig = comm.signals(1)
    if comm.rank == 1:
        comm.signal_op(sig, 0, 5, "set", 0)
        return "closed"
    # PE 1 set the signal and closed: the value is there, the wait succeeds.
    v = comm.signal_wait_until(sig, 0, "==", 5, timeout=10)
    try:
        comm.signal_wait_until(sig, 0, "==", 6, timeout=10)  # nobody left to set it
    except PeerFailure as e:
        return v, e.reason
    return v, None


def test_waiting_on_a_group_whose_peers_closed_fails_fast():
    res = run(_close_early, 2)
    assert res[1] == "closed"
    assert res[0][0] == 5 and res[0][1].startswith("closed")


def _raise_on_rank(comm, bad_rank):
    if comm.rank == bad_rank:
        raise ValueError("boom from the test")
    comm.signal_wait_until(comm.signals(1), 0, ">", 0, timeout=600)  # nobody sets it: launch must stop this rank


def _sleep(comm, secs):
    time.sleep(secs)


@pytest.mark.slow
def test_launch_reports_the_failing_rank_and_stops_the_others():
    # the other ranks wait 600 s for a signal nobody sets; a LaunchError (not launch's TimeoutError after 90 s)
    # means launch stopped them when rank 1 failed
    with pytest.raises(asap_comm.LaunchError, match="rank 1 raised ValueError: boom from the test") as ei:
        run(_raise_on_rank, 3, 1)
    assert ei.value.rank == 1 and "Traceback" in ei.value.remote_traceback
    with pytest.raises(asap_comm.TimeoutError, match=r"launch: ranks \[0, 1\] did not finish within 3"):
        run(_sleep, 2, 60, timeout=3)


# --------------------------------------------------------------------------
# torch ops across processes
# --------------------------------------------------------------------------
def _ops_pingpong(comm, iters):
    ops = torch.ops.asap_comm
    y = comm.zeros((8,), torch.float32)
    sig = comm.signals(1)
    src = torch.zeros(8)
    peer = 1 - comm.rank
    bad = 0
    for i in range(1, iters + 1):
        if comm.rank == 0:
            src.fill_(i)
            ops.put_signal(y, src, peer, sig, 0, i, "set", comm.id)
            ops.signal_wait_until(sig, 0, ">=", i, None, comm.id)
        else:
            ops.signal_wait_until(sig, 0, ">=", i, None, comm.id)
            bad += int(not bool((y == i).all()))
            src.fill_(-i)
            ops.put_signal(y, src, peer, sig, 0, i, "set", comm.id)
    comm.barrier()
    out = ops.get(y, peer, comm.id)
    return bad, out.tolist()


def test_torch_ops_between_processes():
    (b0, out0), (b1, out1) = run(_ops_pingpong, 2, 200)
    assert b0 == 0 and b1 == 0
    assert out0 == [200.0] * 8     # PE 0 read PE 1's y, last written by PE 0
    assert out1 == [-200.0] * 8


# --------------------------------------------------------------------------
# torch.compile: a compiled consumer reads exactly what an eager producer wrote
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
# mailboxes of every capacity keep every message; an empty put_signal only signals
# --------------------------------------------------------------------------
def _flood(comm, slot_counts, count):
    """One flood per mailbox capacity in ``slot_counts``, one after another on the same group (a fresh mailbox
    each): the consumer's ``[(seen, extra)]`` per capacity."""
    consumer = comm.world_size - 1
    rounds = []
    for num_slots in slot_counts:
        box = comm.mailbox(64, num_slots)
        if comm.rank != consumer:
            for i in range(count):  # no waiting between sends: back-pressure does it
                box.send(consumer, torch.tensor([comm.rank, i], dtype=torch.int64), tag=i)
            comm.barrier()
            continue
        seen = {p: [] for p in range(comm.world_size - 1)}
        for _ in range(count * (comm.world_size - 1)):
            with box.recv(timeout=30) as m:
                src, i = m.tensor.tolist()
                assert src == m.src and i == m.tag
                seen[m.src].append(i)
        extra = box.poll()
        comm.barrier()
        rounds.append((seen, extra))
    return rounds if comm.rank == consumer else None


@pytest.mark.slow
@pytest.mark.parametrize("world,slot_counts", [(2, (1,)), (3, (1, 2, 3))], ids=["2-1", "3-1,2,3"])
def test_every_mailbox_capacity_keeps_every_message(world, slot_counts):
    """Producers flood one consumer through a mailbox of each capacity (the three capacities of the 3-PE case on
    one group, a fresh mailbox each): per producer FIFO, nothing lost or duplicated, nothing left over."""
    count = 50
    *_, rounds = run(_flood, world, slot_counts, count)
    assert len(rounds) == len(slot_counts)
    for num_slots, (seen, extra) in zip(slot_counts, rounds):
        assert extra is None, num_slots
        for p in range(world - 1):
            assert seen[p] == list(range(count)), (num_slots, p, seen[p][:10])  # FIFO, nothing lost or duplicated


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
# failure scope: only the waits whose peers all died fail
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
