"""Cheapest tier: one PE in this process. Argument checking, errors, timeouts (numbers only; what a timeout
awaited), mailbox header validation and back-pressure at capacity, prepared handles' keyword forms, torch ops
registration. No spawn."""
import builtins

import pytest
import torch

import asap_comm
from asap_comm import CommError, PeerFailure


def test_init_argument_errors(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"init: rank not given and \$RANK is not set"):
        asap_comm.init()
    with pytest.raises(ValueError, match=r"init: rank=3 is out of range \[0, 2\)"):
        asap_comm.init(3, 2, master_addr="127.0.0.1", master_port=0)
    with pytest.raises(ValueError, match="backend='nccl' is not available"):
        asap_comm.init(0, 1, backend="nccl")
    with pytest.raises(ValueError, match="timeout"):
        asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=-1)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        asap_comm.init(0, 1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    with asap_comm.init(timeout=5.0) as comm:  # everything from the environment, as torchrun sets it
        assert (comm.rank, comm.world_size) == (0, 1)
    assert comm.closed


def test_symmetric_alloc_and_self_put_get(comm1):
    x = comm1.zeros((5, 7), torch.float32)
    assert x.shape == (5, 7) and x.dtype == torch.float32 and bool((x == 0).all())
    e = comm1.empty((3,), torch.int64)
    assert e.shape == (3,)
    src = torch.arange(21, dtype=torch.float32).view(3, 7)
    comm1.put(x[1:4], src, 0)
    assert torch.equal(x[1:4], src)
    out = torch.empty(2, 3)
    comm1.get(out, x[1:3, 2:5], 0)
    assert torch.equal(out, src[0:2, 2:5])
    z = comm1.zeros((0, 4), torch.float16)  # zero-size is allowed and a no-op to move
    comm1.put(z, torch.empty(0, 4, dtype=torch.float16), 0)


def test_heap_grows_beyond_one_chunk(monkeypatch):
    with asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0,
                        heap_chunk_bytes=1 << 16) as comm:
        a = comm.zeros((1 << 15,), torch.uint8)        # fits chunk 0
        b = comm.zeros((3 << 16,), torch.uint8)        # needs a bigger chunk
        c = comm.zeros((100,), torch.float64)
        assert len(comm._chunks) >= 2
        for t, v in ((a, 1), (b, 2), (c, 3)):
            comm.put(t, torch.full_like(t, v), 0)
        assert int(a.sum()) == a.numel() and int(b.sum()) == 2 * b.numel() and float(c.sum()) == 300.0


def _bad_inputs(comm):
    """(description, callable, exception type, message regex)"""
    x = comm.zeros((4, 4), torch.float32)
    sig = comm.signals(2)
    box = comm.mailbox(64, 2)
    plain = torch.zeros(4, 4)
    return [
        ("put: non-symmetric dst", lambda: comm.put(plain, torch.ones(4, 4), 0), ValueError,
         r"put: dst .* is not a symmetric tensor"),
        ("put: dtype mismatch", lambda: comm.put(x, torch.ones(4, 4, dtype=torch.float64), 0), ValueError,
         r"put: dtype mismatch: dst torch.float32 vs src torch.float64"),
        ("put: past the end (shape mismatch)", lambda: comm.put(x[2:], torch.ones(4, 4), 0), ValueError,
         r"put: shape mismatch: dst \(2, 4\) vs src \(4, 4\)"),
        ("put: unknown PE", lambda: comm.put(x, torch.ones(4, 4), 5), ValueError,
         r"put: pe=5 is out of range \[0, 1\)"),
        ("put: PE not an int", lambda: comm.put(x, torch.ones(4, 4), "0"), TypeError, r"put: pe must be an int"),
        ("put: src not a tensor", lambda: comm.put(x, [1.0] * 16, 0), TypeError, r"put: src must be a torch.Tensor"),
        ("get: non-symmetric src", lambda: comm.get(plain, plain, 0), ValueError, r"get: src .* not a symmetric"),
        ("put_signal: bad op", lambda: comm.put_signal(x, torch.ones(4, 4), 0, sig, 0, 1, op="mul"), ValueError,
         r"put_signal: op must be 'set' or 'add', got 'mul'"),
        ("put_signal: signal index out of range", lambda: comm.put_signal(x, torch.ones(4, 4), 0, sig, 2, 1),
         ValueError, r"put_signal: idx=2 is out of range \[0, 2\)"),
        ("put_signal: sig not a signal array", lambda: comm.put_signal(x, torch.ones(4, 4), 0, x, 0, 1),
         ValueError, r"put_signal: sig must be a 1-D torch.uint64"),
        ("put_signal: negative value", lambda: comm.put_signal(x, torch.ones(4, 4), 0, sig, 0, -1), ValueError,
         r"put_signal: value=-1 does not fit"),
        ("signal_op: value > 2**64-1", lambda: comm.signal_op(sig, 0, 1 << 64, "add", 0), ValueError,
         r"signal_op: value=18446744073709551616 does not fit"),
        ("signal_op: bad op", lambda: comm.signal_op(sig, 0, 1, "xor", 0), ValueError,
         r"signal_op: op must be 'set' or 'add'"),
        ("signal_wait_until: bad cmp", lambda: comm.signal_wait_until(sig, 0, "=>", 1), ValueError,
         r"signal_wait_until: cmp must be one of"),
        ("signal_wait_until: negative timeout", lambda: comm.signal_wait_until(sig, 0, ">", 1, timeout=-1),
         ValueError, r"signal_wait_until: timeout must be finite and >= 0"),
        ("signal_wait_until: infinite timeout", lambda: comm.signal_wait_until(sig, 0, ">", 1,
                                                                               timeout=float("inf")),
         ValueError, r"signal_wait_until: timeout must be finite"),
        ("signal_fetch: idx not int", lambda: comm.signal_fetch(sig, 0.5), TypeError,
         r"signal_fetch: idx must be an int"),
        ("empty: negative shape", lambda: comm.empty((2, -1)), ValueError, r"empty: shape \(2, -1\) has a negative"),
        ("zeros: bad dtype", lambda: comm.zeros((2,), "float32"), TypeError, r"zeros: dtype must be a torch.dtype"),
        ("signals: n=0", lambda: comm.signals(0), ValueError, r"signals: n=0 must be positive"),
        ("mailbox: slot_bytes=0", lambda: comm.mailbox(0, 4), ValueError, r"mailbox: slot_bytes=0 must be positive"),
        ("send: message larger than a slot", lambda: box.send(0, torch.zeros(17)), ValueError,
         r"send: message of 68 bytes .* larger than the mailbox slot \(64 bytes\)"),
        ("send: unknown PE", lambda: box.send(1, torch.zeros(2)), ValueError, r"send: pe=1 is out of range"),
        ("send: tag too large", lambda: box.send(0, torch.zeros(2), tag=1 << 63), ValueError,
         r"send: tag=9223372036854775808 does not fit"),
        ("send: unsupported dtype", lambda: box.send(0, torch.zeros(2, dtype=torch.float8_e4m3fn)), ValueError,
         r"send: dtype torch.float8_e4m3fn is not supported"),
        ("send: too many dims", lambda: box.send(0, torch.zeros([1] * 9)), ValueError,
         r"send: tensor has 9 dimensions"),
        ("recv: negative timeout", lambda: box.recv(timeout=-2), ValueError, r"recv: timeout must be finite"),
    ], x, sig, box


def test_bad_inputs_raise_clear_errors_and_change_nothing(comm1):
    cases, x, sig, box = _bad_inputs(comm1)
    x.copy_(torch.arange(16, dtype=torch.float32).view(4, 4))
    comm1.signal_op(sig, 0, 5, "set", 0)
    before_x, before_sig = x.clone(), sig.clone()
    for desc, call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()
        assert torch.equal(x, before_x), f"{desc} changed x"
        assert torch.equal(sig, before_sig), f"{desc} changed the signals"
        assert box.poll() is None, f"{desc} left a message in the inbox"


def test_every_timeout(comm1):
    sig = comm1.signals(1)
    box = comm1.mailbox(16, 2)
    with pytest.raises(asap_comm.TimeoutError, match=r"signal_wait_until: waiting for sig\[0\] >= 1: timed out"):
        comm1.signal_wait_until(sig, 0, ">=", 1, timeout=0.05)
    with pytest.raises(builtins.TimeoutError):  # also the builtin
        comm1.signal_wait_until(sig, 0, "==", 3, timeout=0.0)
    w = comm1.prepare_signal_wait(sig, 0, "!=", timeout=0.05)
    with pytest.raises(asap_comm.TimeoutError, match="timed out"):
        w(0)
    with pytest.raises(asap_comm.TimeoutError, match=r"recv: waiting for a message in PE 0.s inbox \(position 0, 2 slots\): timed out after [0-9.]+ s$"):
        box.recv(timeout=0.05)
    box.send(0, torch.zeros(2))
    box.send(0, torch.zeros(2))
    with pytest.raises(asap_comm.TimeoutError, match=r"send: waiting for a free slot in PE 0's inbox: timed out"):
        box.send(0, torch.zeros(2), timeout=0.1)
    assert isinstance(asap_comm.TimeoutError("x"), CommError)


def test_wait_returns_value_and_compares(comm1):
    sig = comm1.signals(3)
    comm1.signal_op(sig, 1, 41, "set", 0)
    assert comm1.signal_op(sig, 1, 1, "add", 0) == 41
    for cmp, ref in (("==", 42), ("!=", 0), (">", 41), (">=", 42), ("<", 43), ("<=", 42)):
        assert comm1.signal_wait_until(sig, 1, cmp, ref, timeout=0.1) == 42
    comm1.signal_op(sig, 2, (1 << 64) - 1, "set", 0)
    comm1.signal_op(sig, 2, 2, "add", 0)  # wraps mod 2**64
    assert comm1.signal_fetch(sig, 2) == 1


def test_mailbox_self_roundtrip_dtypes_and_zero_copy(comm1):
    box = comm1.mailbox(256, 4)
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.uint64):
        t = (torch.arange(12) % 2).to(dt).view(3, 4)
        box.send(0, t, tag=-7)
        with box.recv(timeout=1) as m:
            assert (m.src, m.tag) == (0, -7)
            assert m.tensor.dtype == dt and m.tensor.shape == (3, 4) and torch.equal(m.tensor, t)
            # zero copy: the tensor is a view into the inbox, not a private copy
            assert box._buf.untyped_storage().data_ptr() == m.tensor.untyped_storage().data_ptr()
        assert m.released and m.tensor is None
    box.send(0, torch.arange(6).view(2, 3).t())  # non-contiguous: sent contiguous
    m = box.poll()
    assert torch.equal(m.tensor, torch.arange(6).view(2, 3).t()) and m.tensor.is_contiguous()
    m.release()
    m.release()  # idempotent
    assert box.poll() is None
    box.send(0, torch.empty(0, 3))
    with box.recv() as m:
        assert m.tensor.shape == (0, 3)


def test_mailbox_rejects_corrupt_header_and_recovers(comm1):
    from asap_comm import _C

    box = comm1.mailbox(64, 4)
    box.send(0, torch.arange(4, dtype=torch.int32), tag=1)
    # Corrupt the published header: claim 1 MiB of payload in a 64-byte slot.
    hdr = box._buf[_C.MAILBOX_HEADER_BYTES: _C.MAILBOX_HEADER_BYTES + _C.SLOT_HEADER_BYTES]
    hdr[24:32].view(torch.int64).fill_(1 << 20)  # nbytes field
    with pytest.raises(CommError, match=r"mailbox: corrupt message header at position 0: nbytes 1048576 > slot_bytes 64"):
        box.recv(timeout=1)
    box.send(0, torch.arange(4, dtype=torch.int32), tag=2)
    with box.recv(timeout=1) as m:  # the next message is intact and the slot was not lost
        assert m.tag == 2 and torch.equal(m.tensor, torch.arange(4, dtype=torch.int32))
    for field, value, pattern in ((8, 0xDEAD, "bad magic"), (12, 9, "source PE 9 out of range"),
                                  (36, 8, "ndim 8 > 8|shape does not match"), (32, 99, "dtype code 99 unknown")):
        box.send(0, torch.arange(4, dtype=torch.int32))
        pos = box._buf[:8].view(torch.int64).item() - 1  # tail - 1: the slot just written
        base = _C.MAILBOX_HEADER_BYTES + (pos % 4) * _C.slot_stride(64)
        box._buf[base + field: base + field + 4].view(torch.int32).fill_(value)
        with pytest.raises(CommError, match=pattern):
            box.recv(timeout=1)


def test_closed_communicator_rejects_calls():
    comm = asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0)
    x = comm.zeros((4,))
    sig = comm.signals(1)
    box = comm.mailbox(32, 2)
    ps = comm.prepare_put_signal(x, torch.ones(4), 0, sig, 0)
    comm.put_signal(x, torch.ones(4), 0, sig, 0, 1)  # warm the fast path cache
    comm.close()
    comm.close()  # idempotent
    for call in (lambda: comm.put(x, torch.ones(4), 0), lambda: comm.put_signal(x, torch.ones(4), 0, sig, 0, 2),
                 lambda: comm.signal_wait_until(sig, 0, ">=", 1), lambda: comm.barrier(),
                 lambda: box.send(0, torch.ones(1)), lambda: box.recv(), lambda: ps(3)):
        with pytest.raises(CommError, match="closed"):
            call()
    assert float(x.sum()) == 4.0  # the memory the caller holds stays valid after close


def test_torch_ops_registered_with_schemas_and_fakes(comm1):
    from torch._higher_order_ops.effects import _get_effect

    ops = torch.ops.asap_comm
    for name in ("put", "get", "put_signal", "signal_op", "signal_wait_until", "signal_wait_read"):
        op = getattr(ops, name).default
        # No local tensor is marked as written (the writes land in another PE's
        # memory), every op is an ordered side effect, and the values are symbolic.
        assert "!" not in str(op._schema), op._schema
        assert _get_effect(op) is not None, name
    assert "SymInt value" in str(ops.put_signal.default._schema)
    assert "SymInt idx" in str(ops.signal_wait_until.default._schema)
    x = comm1.zeros((2, 3))
    sig = comm1.signals(2)
    ops.put(x, torch.ones(2, 3), 0, comm1.id)
    assert float(x.sum()) == 6.0
    out = ops.get(x[1], 0)  # comm=-1: the newest open communicator
    assert torch.equal(out, torch.ones(3)) and out.data_ptr() != x[1].data_ptr()
    ops.put_signal(x, torch.full((2, 3), 2.0), 0, sig, 1, 9, "add", comm1.id)
    assert float(x.sum()) == 12.0 and comm1.signal_fetch(sig, 1) == 9
    prev = ops.signal_op(sig, 1, 1, "add", 0, comm1.id)
    assert prev.dtype == torch.uint64 and int(prev) == 9
    v = ops.signal_wait_until(sig, 1, "==", 10, 1.0, comm1.id)
    assert v.dtype == torch.uint64 and int(v) == 10
    v = ops.signal_wait_until(sig, 1, "==", 10, 1.0, comm1.id, [0])
    assert int(v) == 10
    r = ops.signal_wait_read(x, sig, 1, ">=", 10, 1.0, comm1.id)
    assert torch.equal(r, x) and r.data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match="signal_wait_read: data .* is not a symmetric tensor"):
        ops.signal_wait_read(torch.zeros(2, 3), sig, 1, ">=", 10, 1.0, comm1.id)
    with pytest.raises(asap_comm.TimeoutError):
        ops.signal_wait_until(sig, 0, ">", 0, 0.01, comm1.id)
    with pytest.raises(CommError, match="communicator id 12345 is unknown"):
        ops.put(x, torch.ones(2, 3), 0, 12345)
    # fake implementations: the ops trace under FakeTensorMode without touching memory
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fs = mode.from_tensor(sig)
        ops.put(fx, torch.empty(2, 3), 0, comm1.id)
        ops.put_signal(fx, torch.empty(2, 3), 0, fs, 0, 1, "set", comm1.id)
        r = ops.signal_wait_until(fs, 0, ">=", 1, None, comm1.id)
        assert r.shape == () and r.dtype == torch.uint64
        g = ops.get(fx[1], 0, comm1.id)
        assert g.shape == (3,) and g.dtype == torch.float32
        d = ops.signal_wait_read(fx, fs, 0, ">=", 1, None, comm1.id)
        assert d.shape == (2, 3)
    assert float(x.sum()) == 12.0


def test_peer_failure_is_comm_error():
    e = PeerFailure("x", pe=3, reason="died")
    assert isinstance(e, CommError) and e.pe == 3 and e.reason == "died"
    import pickle

    e2 = pickle.loads(pickle.dumps(e))
    assert e2.pe == 3 and str(e2) == "x"


def test_generic_put_signal_cache_follows_the_source(comm1):
    """The generic path serves a repeated (dst, src, ...) natively; it must
    notice when the source moves and never serve stale bytes."""
    x = comm1.zeros((4,), torch.float32)
    sig = comm1.signals(1)
    src = torch.ones(4)
    for v in range(1, 4):  # 1st: checked and registered, then native
        src.fill_(v)
        comm1.put_signal(x, src, 0, sig, 0, v)
        assert torch.equal(x, torch.full((4,), float(v))) and comm1.signal_fetch(sig, 0) == v
    src.resize_(1 << 16)  # reallocates: the cached address is stale now
    src.fill_(9)
    with pytest.raises(ValueError, match=r"put_signal: shape mismatch"):
        comm1.put_signal(x, src, 0, sig, 0, 10)
    src.resize_(4)
    comm1.put_signal(x, src, 0, sig, 0, 11)
    assert torch.equal(x, torch.full((4,), 9.0)) and comm1.signal_fetch(sig, 0) == 11
    with pytest.raises(ValueError, match=r"put_signal: value=-5 does not fit"):
        comm1.put_signal(x, src, 0, sig, 0, -5)  # a cached handle still reports with this call's name
    with pytest.raises(TypeError, match=r"signal_wait_until|value"):
        comm1.signal_wait_until(sig, 0, ">=", "3")
    assert comm1.signal_wait_until(sig, 0, ">=", 11) == 11  # cached wait handle
    assert comm1.signal_wait_until(sig, 0, ">=", 11) == 11


def test_prepared_handles(comm1):
    x = comm1.zeros((3,), torch.int64)
    sig = comm1.signals(2)
    src = torch.tensor([1, 2, 3])
    put = comm1.prepare_put_signal(x, src, 0, sig, 1, op="add")
    wait = comm1.prepare_signal_wait(sig, 1, ">=", timeout=0.05)
    put(2)
    src.add_(10)  # the handle reads src's current bytes
    put(3)
    assert x.tolist() == [11, 12, 13] and wait(5) == 5
    with pytest.raises(asap_comm.TimeoutError, match=r"signal_wait_until: waiting for sig\[1\] >= 6: timed out"):
        wait(6)
    with pytest.raises(TypeError, match="value must be an int"):
        put("1")
    with pytest.raises(ValueError, match="prepare_put_signal: dst and src must be contiguous"):
        comm1.prepare_put_signal(comm1.zeros((3, 2), torch.int64)[:, 0], src, 0, sig, 0)
    box = comm1.mailbox(64, 4)
    stage = torch.zeros(4, dtype=torch.int32)
    send = box.prepare_send(0, stage, tag=7)
    for k in range(6):
        stage.fill_(k)
        send() if k % 2 else send(100 + k)
        with box.recv(timeout=1) as m:
            assert m.tag == (7 if k % 2 else 100 + k) and m.tensor.tolist() == [k] * 4
    with pytest.raises(ValueError, match="prepare_send: message of 68 bytes"):
        box.prepare_send(0, torch.zeros(17))
    with pytest.raises(ValueError, match="prepare_send: tensor must be contiguous"):
        box.prepare_send(0, torch.zeros(4, 4).t())


@pytest.mark.slow
def test_torch_ops_compile_fullgraph(comm1):
    """The ops trace (schemas + fakes) and run inside torch.compile without graph breaks."""
    x = comm1.zeros((4,))
    sig = comm1.signals(1)

    def step(src, v: int):
        torch.ops.asap_comm.put_signal(x, src * 2, 0, sig, 0, v, "set", comm1.id)
        return torch.ops.asap_comm.signal_wait_until(sig, 0, ">=", v, None, comm1.id)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    assert int(compiled(torch.ones(4), 3)) == 3
    assert torch.equal(x, torch.full((4,), 2.0))


def test_generic_calls_with_keywords_and_timeouts_take_the_native_path_and_keep_their_errors(comm1):
    """Keyword arguments (op=, timeout=, or every argument by name) and explicit timeouts give the same results and
    the same errors as positional calls: the native path lays them out by name, and anything irregular still
    reaches the validating path."""
    dst = comm1.zeros((4,), torch.int64)
    sig = comm1.signals(2)
    src = torch.arange(4, dtype=torch.int64)
    for v in range(1, 4):  # the first call registers, the next ones are served natively
        comm1.put_signal(dst, src + 0, 0, sig, 0, v, op="set") if v == 1 else \
            comm1.put_signal(dst=dst, src=src, pe=0, sig=sig, idx=0, value=v, op="set")
        assert comm1.signal_wait_until(sig, 0, ">=", v, timeout=5) == v
        assert comm1.signal_wait_until(sig=sig, idx=0, cmp="==", value=v, timeout=5.0) == v
        assert comm1.signal_wait_until(sig, 0, ">=", v, 5) == v
    assert torch.equal(dst, src)
    for _ in range(2):
        comm1.put_signal(dst, src, 0, sig, 1, 10, op="add")
    assert comm1.signal_fetch(sig, 1) == 20
    with pytest.raises(asap_comm.TimeoutError, match="timed out"):
        comm1.signal_wait_until(sig, 0, ">=", 100, timeout=0.01)
    with pytest.raises(asap_comm.TimeoutError, match="timed out"):
        comm1.signal_wait_until(sig, 0, ">=", 100, timeout=0)
    with pytest.raises(ValueError, match="timeout must be finite and >= 0"):
        comm1.signal_wait_until(sig, 0, ">=", 1, timeout=-1.0)
    with pytest.raises(TypeError, match="timeout must be a number"):
        comm1.signal_wait_until(sig, 0, ">=", 1, timeout="5")
    with pytest.raises(ValueError, match="op must be 'set' or 'add'"):
        comm1.put_signal(dst, src, 0, sig, 0, 1, op="xor")
    with pytest.raises(TypeError):
        comm1.put_signal(dst, src, 0, sig, 0, 1, bogus=1)
    with pytest.raises(TypeError):
        comm1.signal_wait_until(sig, 0, ">=", 1, cmp=">=")  # given twice
    with pytest.raises(TypeError):
        comm1.put_signal(dst, src, 0, sig, 0)  # value missing
    assert comm1.signal_wait_until(sig, 0, ">=", 1, timeout=5, peers=[0]) == 3  # peers=: the validating path


def test_native_entry_points_refuse_addresses_outside_mapped_segments(comm1):
    """No raw address from Python reaches a native write unchecked: every entry point that takes one checks it
    against the live segment mappings (and group handles against the live groups) and changes nothing."""
    from asap_comm._native import _C

    x = comm1.zeros(4)
    s = comm1.signals(2)
    ctrl, grp = comm1._ctrl_local, comm1._ghandle
    outside = torch.zeros(8, dtype=torch.float64)  # ordinary process memory, not a segment
    bad = [
        (lambda: _C.copy_to(outside.data_ptr(), x, 8), "put: destination"),
        (lambda: _C.copy_from(outside, outside.data_ptr(), 8), "get: source"),
        (lambda: _C.signal_update(outside.data_ptr(), 1, 0, ctrl), "signal_update: signal word"),
        (lambda: _C.signal_update(s.data_ptr(), 1, 0, outside.data_ptr()), "signal_update: control block"),
        (lambda: _C.load(outside.data_ptr()), "load: signal word"),
        (lambda: _C.store(outside.data_ptr(), 7), "store: signal word"),
        (lambda: _C.make_put_signal("f", grp, 0, x, 8, 0, outside.data_ptr(), s.data_ptr(), ctrl, None),
         "f: destination"),
        (lambda: _C.make_put_signal("f", grp, 0, x, 8, 0, x.data_ptr(), outside.data_ptr(), ctrl, None),
         "f: signal word"),
        (lambda: _C.make_put_signal("f", grp, 0, x, 1 << 40, 0, x.data_ptr(), s.data_ptr(), ctrl, None),
         r"f: bytes \[0, 1099511627776\) of src lie outside"),
        (lambda: _C.make_put_signal("f", grp + 8, 0, x, 8, 0, x.data_ptr(), s.data_ptr(), ctrl, None),
         "f: group handle"),
        (lambda: _C.make_wait("f", grp, outside.data_ptr(), 3, ctrl, 1.0, _C.DEP_ANY, None, "w", None),
         "f: signal word"),
        (lambda: _C.make_wait("f", grp + 8, s.data_ptr(), 3, ctrl, 1.0, _C.DEP_ANY, None, "w", None),
         "f: group handle"),
        (lambda: _C.ctrl_set_state(outside.data_ptr(), 2), "ctrl_set_state"),
        (lambda: _C.mailbox_init(outside.data_ptr(), 64, 1), "mailbox_init"),
    ]
    for call, text in bad:
        with pytest.raises(ValueError, match=text):
            call()
    assert torch.equal(outside, torch.zeros(8, dtype=torch.float64))  # nothing written
    assert torch.equal(x, torch.zeros(4)) and comm1.signal_fetch(s, 0) == 0 and comm1.signal_fetch(s, 1) == 0
    # the checked paths still work
    comm1.put_signal(x, torch.ones(4), 0, s, 0, 1)
    assert torch.equal(x, torch.ones(4)) and comm1.signal_wait_until(s, 0, ">=", 1, timeout=1) == 1


def test_user_memory_reaches_native_code_as_tensors_not_addresses(comm1):
    """The user's side of a copy (the source of a put, the destination of a get, a message) is passed as the
    tensor: native code reads its address from it and refuses byte ranges outside it, changing nothing."""
    from asap_comm._native import _C

    x = comm1.zeros(4)  # 16 bytes of symmetric memory
    small = torch.zeros(2)  # 8 bytes of the user's
    with pytest.raises(ValueError, match=r"put: bytes \[0, 16\) of src lie outside the 8 bytes the tensor spans"):
        _C.copy_to(x.data_ptr(), small, 16)
    with pytest.raises(ValueError, match=r"get: bytes \[0, 16\) of dst lie outside the 8 bytes"):
        _C.copy_from(small, x.data_ptr(), 16)
    with pytest.raises(TypeError, match="put: src must be a torch.Tensor, got int"):
        _C.copy_to(x.data_ptr(), small.data_ptr(), 8)
    s = comm1.signals(1)
    with pytest.raises(ValueError, match=r"f: bytes \[0, 16\) of src lie outside"):
        _C.make_put_signal("f", comm1._ghandle, 0, small, 16, 0, x.data_ptr(), s.data_ptr(), comm1._ctrl_local, None)
    strided = torch.arange(16.0).reshape(4, 4)[:, 0]  # spans (3 * 4 + 1) elements from its first
    _C.copy_to(x.data_ptr(), strided, 16)  # inside its span: allowed (the first 4 floats of the storage)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"bytes \[0, 56\) of src lie outside the 52 bytes"):
        _C.copy_to(x.data_ptr(), strided, 56)
    assert torch.equal(small, torch.zeros(2)) and comm1.signal_fetch(s, 0) == 0


def test_one_native_form_per_primitive_and_one_error_text_per_failure(comm1):
    """A generic call, a repeated generic call (served from the native table) and a prepared handle run the same
    native handle and raise the same errors, word for word."""
    from asap_comm._native import _C

    x = comm1.zeros((2,), torch.int64)
    sig = comm1.signals(1)
    src = torch.ones(2, dtype=torch.int64)
    comm1.put_signal(x, src, 0, sig, 0, 1, op="set")  # validated, then registered as a handle
    assert comm1.signal_wait_until(sig, 0, ">=", 1, timeout=1) == 1
    puts, waits = comm1._fastpath.handles()
    assert len(puts) == 1 and type(puts[0]) is _C.PreparedPutSignal and puts[0].nbytes == 16 and puts[0].pe == 0
    assert len(waits) == 1 and type(waits[0]) is _C.PreparedWait and waits[0].timeout == comm1.timeout
    prepared = comm1.prepare_put_signal(x, src, 0, sig, 0)
    wait = comm1.prepare_signal_wait(sig, 0, ">=")
    assert type(prepared) is _C.PreparedPutSignal and type(wait) is _C.PreparedWait

    def error(call):
        with pytest.raises(Exception) as e:
            call()
        return type(e.value), str(e.value)

    forms = {  # failure -> the same failure through each form
        "value type": [lambda: comm1.put_signal(x, src, 0, sig, 0, "2"), lambda: prepared("2")],
        "value range": [lambda: comm1.put_signal(x, src, 0, sig, 0, -1), lambda: prepared(-1),
                        lambda: comm1.put_signal(x, src, 0, sig, 0, value=-1, op="set")],
        "value too large": [lambda: comm1.put_signal(x, src, 0, sig, 0, 1 << 64), lambda: prepared(1 << 64)],
        "timeout": [lambda: comm1.signal_wait_until(sig, 0, ">=", 9, timeout=0.01),
                    lambda: comm1.signal_wait_until(sig, 0, ">=", 9, 0.01), lambda: wait(9, timeout=0.01),
                    lambda: comm1.signal_wait_until(sig, 0, ">=", 9, timeout=0.01, peers=[0])],
        "timeout value": [lambda: comm1.signal_wait_until(sig, 0, ">=", 9, timeout=-1), lambda: wait(9, -1)],
        "timeout type": [lambda: comm1.signal_wait_until(sig, 0, ">=", 9, timeout="1"), lambda: wait(9, "1")],
    }
    for failure, calls in forms.items():
        seen = {error(c) for c in calls}
        assert len(seen) == 1, (failure, seen)
    assert error(lambda: prepared("2")) == (TypeError, "put_signal: value must be an int, got str")
    assert x.tolist() == [1, 1] and comm1.signal_fetch(sig, 0) == 1  # no failure wrote anything
    with pytest.raises(TypeError, match="unexpected keyword argument 'tg' for a prepared handle"):
        wait(1, tg=1)
    assert wait(value=1, timeout=2) == 1
    c = asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0)
    y, s2 = c.zeros((2,), torch.int64), c.signals(1)
    c.put_signal(y, src, 0, s2, 0, 1)
    h, w = c.prepare_put_signal(y, src, 0, s2, 0), c.prepare_signal_wait(s2, 0, ">=")
    c.close()
    closed = [lambda: c.put_signal(y, src, 0, s2, 0, 2), lambda: h(2)]
    assert {error(f) for f in closed} == {(asap_comm.CommError, "put_signal: the communicator is closed")}
    closed_waits = [lambda: c.signal_wait_until(s2, 0, ">=", 1), lambda: w(1)]
    assert {error(f) for f in closed_waits} == {(asap_comm.CommError, "signal_wait_until: the communicator is closed")}


# --------------------------------------------------------------------------
# a one-slot mailbox: back-pressure at capacity, slots reused in ring order
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# prepared handles take the documented keyword forms
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
# timeouts must be numbers; a recv timeout says what was awaited
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
