"""Model-based tier: a hypothesis state machine drives 2-3 live PEs against a pure-Python model.

The driver (this pytest process) holds the reference model: every PE's
symmetric tensor (a torch tensor), its signal words (Python ints, wrapping
mod 2**64) and its inbox (pending messages per producer, received-but-held
Messages). It sends random operations to real PE processes and checks every
observation (a value, a message, a byte image, an exception type) against the
model.

* Workers: ``multiprocessing`` spawn processes, one per PE, each running
  ``_worker_main``: it executes commands that arrive over a Pipe against
  ``asap_comm`` and answers with the observation or with the exception
  (classified: Timeout, PeerFailure, CommError, ValueError, ...), its
  ``pe``/``reason`` and how long the call took. Every command carries a
  sequence number, so a late answer of an abandoned command is never mistaken
  for the answer of a later one.
* Reuse: one pool of worker processes serves the whole module (importing
  torch costs seconds per process), one group of W processes per world size
  W in {2, 3}. A group's communicator (``asap_comm.init(rank, W,
  master_addr="127.0.0.1", master_port=<free port>, shm_prefix=<unique>)``)
  lives across state-machine runs while no PE of it died or closed; each run
  starts with a collective "reset" (fresh mailbox, signals and symmetric
  tensor: the same allocation calls on every PE). A run that kills or closes
  a PE (or leaves a command unanswered) retires the communicator: survivors
  close, the dead are reaped, /dev/shm is checked, and the next run of that
  size inits a new one (spawning only replacement processes).
* Runs: each example draws W, the mailbox geometry (slot_bytes, num_slots
  1..4), the signal count, the tensor's shape and dtype, whether PEs may be
  killed, a focus (mixed, or mailbox / signals / memory rules only, to reach
  deep queue states) and a "hot" PE that half of the mailbox traffic targets.
  At the end of every passing example each live inbox is drained (nothing
  lost or duplicated) and every live PE's tensor and signals are compared.
* Bounded everywhere: every pipe receive is a ``conn.poll(timeout)``, every
  join has a timeout, workers that do not answer are killed; the pool kills
  leftovers at the end.
* Properties: mailboxes (per-producer FIFO, nothing lost, nothing duplicated,
  back-pressure exactly as documented: slots are reused in ring order, so a
  send waits exactly while the message ``num_slots`` positions before it is
  unreleased (pending, or received and held); Message tensors intact until
  released), signals (set/add
  from every PE with wrap-around, fetch, waits with every comparison: hold ->
  the model's value at once, else TimeoutError), put/get/put_signal on random
  slices between random PEs, and the failure scope after a PE is killed
  (SIGKILL, os._exit) or closes: scoped waits (``peers=``), mailbox recv
  (fails only when no live producer remains), sends to a full inbox of a gone
  PE, barrier, calls on a closed communicator.

CI: 60 examples of up to 50 steps (about 20-40 s on 2 cores). ``ASAP_SOAK=1``:
500 examples of up to 100 steps, and a breakdown of the checked operations by
command and outcome. ``ASAP_MODEL_EXAMPLES`` / ``ASAP_MODEL_STEPS`` override
the counts. The number of checked operations is printed at the end of the
module ("model-based tier: N operations checked", visible with ``-s``).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import secrets
import signal
import socket
import time
from collections import Counter, namedtuple

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import asap_comm
from distributed_utils import shm_files

pytestmark = pytest.mark.slow  # a hypothesis state machine against live PEs (thousands of operations)

SOAK = os.environ.get("ASAP_SOAK", "").strip() not in ("", "0")
MAX_EXAMPLES = int(os.environ.get("ASAP_MODEL_EXAMPLES", 500 if SOAK else 60))
STEPS = int(os.environ.get("ASAP_MODEL_STEPS", 100 if SOAK else 50))
SOAK_TIMEOUT = 3600

MAX_W = 3
COMM_TIMEOUT = 1.0       # each communicator's default wait bound (calls that pass timeout=None) and init timeout
REPLY_TIMEOUT = 30.0     # a worker that does not answer a command within this is stuck: the test fails
START_TIMEOUT = 180.0    # a spawned worker imports torch (seconds on a loaded 2-core host)
JOIN_TIMEOUT = 10.0
HEAP_CHUNK = 8192        # small heap chunks: resets grow the heap (segment creation/unlink) now and then
SHORT = 0.02             # the timeout of waits that must time out
FAIL_TIMEOUT = 2.0       # the timeout of waits that must fail with PeerFailure ...
FAIL_WITHIN = 1.5        # ... well before it (dead-PE detection takes ~20-50 ms)
U64 = 1 << 64

OPS_CHECKED = 0  # observations compared with the model, over the whole module
OPS_BY_KIND: "Counter[str]" = Counter()  # the same, by "command -> outcome"

# Mailboxes carry every dtype of asap_comm.mailbox._DTYPES.
MSG_DTYPES = ["float32", "float64", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
              "uint16", "uint32", "uint64", "complex64", "complex128"]
SYM_DTYPES = ["float32", "float64", "bfloat16", "int16", "int32", "int64", "uint8", "complex64"]
CMPS = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, ">": lambda a, b: a > b,
        ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b}


# --------------------------------------------------------------------------
# shared by the driver and the workers
# --------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _itemsize(name: str) -> int:
    return torch.empty((), dtype=_dtype(name)).element_size()


def payload(seed: int, dtype_name: str, shape: tuple) -> torch.Tensor:
    """Deterministic contents: random bytes (every bit pattern, NaNs included; bools 0/1)."""
    dtype = _dtype(dtype_name)
    n = math.prod(shape) * _itemsize(dtype_name)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def tbytes(t: torch.Tensor) -> bytes:
    """The exact byte image of a tensor (comparisons are bitwise: NaN payloads compare too)."""
    dense = torch.empty(t.shape, dtype=t.dtype)  # row-major, whatever t's strides are
    dense.copy_(t)
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def view_of(x: torch.Tensor, spec: tuple) -> torch.Tensor:
    kind = spec[0]
    if kind == "block":
        _, r0, r1, c0, c1, cstep = spec
        return x[r0:r1, c0:c1:cstep]
    if kind == "row":
        return x[spec[1]]
    if kind == "col":
        _, c, r0, rstep = spec
        return x[r0::rstep, c]
    if kind == "elem":
        return x[spec[1], spec[2]]
    raise ValueError(spec)


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------
def _classify(e: BaseException) -> str:
    if isinstance(e, asap_comm.TimeoutError):
        return "Timeout"
    if isinstance(e, asap_comm.PeerFailure):
        return "PeerFailure"
    if isinstance(e, asap_comm.CommError):
        return "CommError"
    if isinstance(e, (ValueError, TypeError)):
        return type(e).__name__
    return "other:" + type(e).__name__


class _PE:
    """One PE's state in a worker process; ``do_<cmd>`` executes a command."""

    def __init__(self) -> None:
        self.comm = None
        self.box = self.sig = self.x = None
        self.held: dict = {}

    def do_init(self, rank, world, port, prefix, timeout, chunk):
        self._drop()
        self.comm = asap_comm.init(rank, world, master_addr="127.0.0.1", master_port=port, timeout=timeout,
                                   shm_prefix=prefix, heap_chunk_bytes=chunk)
        return os.getpid()

    def _drop(self):
        self.held.clear()
        self.box = self.sig = self.x = None
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def do_close_comm(self):
        # Held Messages stay held (their slots occupied) until the next init drops them.
        if self.comm is not None:
            self.comm.close()
        return None

    def do_reset(self, slot_bytes, num_slots, nsig, shape, dtype_name, fill_seed):
        self.held.clear()
        comm = self.comm
        self.box = comm.mailbox(slot_bytes, num_slots)
        self.sig = comm.signals(nsig)
        self.x = comm.zeros(shape, _dtype(dtype_name))
        self.x.copy_(payload(fill_seed + comm.rank, dtype_name, tuple(shape)))
        comm.barrier()  # every PE's initial contents are visible to every PE
        return tbytes(self.x), [comm.signal_fetch(self.sig, i) for i in range(nsig)]

    # -- mailbox
    def do_send(self, dst, dtype_name, shape, tag, seed, timeout, via):
        t = payload(seed, dtype_name, tuple(shape))
        if via == "prepared":
            self.box.prepare_send(dst, t, tag)()
        elif via == "noncontig" and t.dim() >= 1 and t.shape[-1] > 1:
            # the same values through a non-contiguous tensor (send makes it contiguous)
            nc = torch.empty(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)[..., ::2]
            nc.copy_(t)
            self.box.send(dst, nc, tag, timeout)
        else:
            self.box.send(dst, t, tag=tag, timeout=timeout)

    def _describe(self, m, handle):
        t = m.tensor
        name = str(t.dtype).split(".")[1]
        self.held[handle] = m
        return handle, m.src, m.tag, name, tuple(t.shape), tbytes(t)

    def do_recv(self, timeout, handle):
        m = self.box.recv() if timeout == "default" else self.box.recv(timeout=timeout)
        return self._describe(m, handle)

    def do_poll(self, handle):
        m = self.box.poll()
        return None if m is None else self._describe(m, handle)

    def do_release(self, handle, how):
        m = self.held[handle]
        t = m.tensor
        seen = (m.src, m.tag, str(t.dtype).split(".")[1], tuple(t.shape), tbytes(t))  # checked before release
        del t
        if how == "release":
            m.release()
            del self.held[handle]
        elif how == "exit":
            m.__exit__(None, None, None)
            del self.held[handle]
        else:  # "drop": garbage collection releases it
            del m
            del self.held[handle]
        return seen

    # -- signals
    def do_sig_op(self, pe, idx, value, op, via):
        if via == "op":
            return int(torch.ops.asap_comm.signal_op(self.sig, idx, value, op, pe, self.comm.id).item())
        return self.comm.signal_op(self.sig, idx, value, op, pe)

    def do_sig_fetch(self, idx):
        return self.comm.signal_fetch(self.sig, idx)

    def do_sig_wait(self, idx, cmp, value, timeout, peers, via):
        comm = self.comm
        if via == "prepared":
            return comm.prepare_signal_wait(self.sig, idx, cmp, timeout, peers=peers)(value)
        if via == "op":
            return int(torch.ops.asap_comm.signal_wait_until(self.sig, idx, cmp, value, timeout, comm.id,
                                                             peers).item())
        if peers is None:
            if timeout is None:
                return comm.signal_wait_until(self.sig, idx, cmp, value)  # the native fast path
            return comm.signal_wait_until(self.sig, idx, cmp, value, timeout)
        return comm.signal_wait_until(self.sig, idx, cmp, value, timeout=timeout, peers=peers)

    def do_peer_state(self, pe):
        return self.comm.peer_alive(pe), self.comm.peer_state(pe)

    def do_barrier(self, timeout):
        self.comm.barrier(timeout=timeout)

    # -- symmetric memory
    def do_put(self, pe, spec, seed, via):
        dst = view_of(self.x, spec)
        src = payload(seed, str(dst.dtype).split(".")[1], tuple(dst.shape))
        if via == "op":
            torch.ops.asap_comm.put(dst, src, pe, self.comm.id)
        else:
            self.comm.put(dst, src, pe)
        self.comm.quiet()

    def do_get(self, pe, spec, via):
        src = view_of(self.x, spec)
        if via == "op":
            out = torch.ops.asap_comm.get(src, pe, self.comm.id)
        else:
            out = torch.empty(src.shape, dtype=src.dtype)
            self.comm.get(out, src, pe)
        return tuple(out.shape), tbytes(out)

    def do_put_signal(self, pe, spec, seed, idx, value, op, via):
        dst = view_of(self.x, spec)
        src = payload(seed, str(dst.dtype).split(".")[1], tuple(dst.shape))
        if via == "prepared":
            self.comm.prepare_put_signal(dst, src, pe, self.sig, idx, op)(value)
        else:
            self.comm.put_signal(dst, src, pe, self.sig, idx, value, op)

    def do_snapshot(self):
        return tbytes(self.x), [self.comm.signal_fetch(self.sig, i) for i in range(self.sig.numel())]

    def do_closed_call(self, what):
        comm, box = self.comm, self.box
        calls = {
            "signal_fetch": lambda: comm.signal_fetch(self.sig, 0),
            "signal_op": lambda: comm.signal_op(self.sig, 0, 1, "add", comm.rank),
            "signal_wait_until": lambda: comm.signal_wait_until(self.sig, 0, "==", 0, 0.05),
            "put": lambda: comm.put(self.x, self.x.clone(), comm.rank),
            "barrier": lambda: comm.barrier(timeout=0.05),
            "send": lambda: box.send(comm.rank, torch.zeros(0), timeout=0.05),
            "recv": lambda: box.recv(timeout=0.05),
            "poll": lambda: box.poll(),
        }
        calls[what]()

    def do_quit(self):
        self._drop()


def _worker_main(conn) -> None:
    torch.set_num_threads(1)
    pe = _PE()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            seq, cmd, args = conn.recv()  # EOF when the driver is gone: leave
        except (EOFError, OSError):
            break
        if cmd == "exit":
            os._exit(0)  # die without close(): looks like a crash to the peers
        t0 = time.monotonic()
        try:
            out = (seq, "ok", getattr(pe, "do_" + cmd)(*args), None, None, None)
        except BaseException as e:  # noqa: BLE001 - every outcome is an observation
            out = (seq, _classify(e), None, f"{type(e).__name__}: {e}", getattr(e, "pe", None),
                   getattr(e, "reason", None))
        try:
            conn.send(out + (time.monotonic() - t0,))
        except (EOFError, OSError):
            break
        if cmd == "quit":
            break
    try:
        pe._drop()
    finally:
        os._exit(0)


# --------------------------------------------------------------------------
# driver side: processes, groups
# --------------------------------------------------------------------------
Reply = namedtuple("Reply", "kind value msg pe reason elapsed cmd")


class _Proc:
    """The driver's handle on one worker process."""

    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="asap-model-pe")
        self.proc.start()
        child.close()
        self.seq = 0
        self.answered = 0
        self.pid = None

    def wait_ready(self) -> None:
        if not self.conn.poll(START_TIMEOUT):
            raise AssertionError(f"worker {self.proc.pid} did not start within {START_TIMEOUT} s")
        msg = self.conn.recv()
        assert msg[0] == "ready", msg
        self.pid = msg[1]

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, cmd: str, *args) -> int:
        self.seq += 1
        self.conn.send((self.seq, cmd, args))
        return self.seq

    def reply(self, seq: int, what: str = "", timeout: float = REPLY_TIMEOUT) -> Reply:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.conn.poll(left):
                raise AssertionError(f"PE process {self.pid} did not answer {what or 'a command'} within "
                                     f"{timeout} s (deadlock or hang)")
            try:
                r = self.conn.recv()
            except (EOFError, OSError):
                raise AssertionError(f"PE process {self.pid} died while running {what or 'a command'} "
                                     f"(exit code {self.proc.exitcode})") from None
            self.answered = r[0]
            if r[0] < seq:
                continue  # the answer of an earlier, abandoned command
            assert r[0] == seq, (r, seq)
            return Reply(*r[1:], what)

    def idle(self) -> bool:
        """True when every command sent has been answered."""
        return self.answered == self.seq

    def call(self, cmd: str, *args, timeout: float = REPLY_TIMEOUT) -> Reply:
        return self.reply(self.send(cmd, *args), cmd, timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(JOIN_TIMEOUT)
        assert not self.proc.is_alive(), f"PE process {self.proc.pid} survived SIGKILL"

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit", timeout=JOIN_TIMEOUT)
            except (AssertionError, OSError):
                pass
            self.proc.join(JOIN_TIMEOUT)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Group:
    """W worker processes and, while ``prefix`` is set, the communicator they share."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list = [None] * world
        self.prefix: "str | None" = None
        self.broken = False
        self.inits = 0


class _Pool:
    """Worker processes for the whole module: one group per world size, reused while no PE of it is gone."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.groups: dict = {}
        self.prefixes: list = []

    def ensure(self, world: int) -> _Group:
        g = self.groups.setdefault(world, _Group(world))
        if g.prefix is not None and g.broken:
            self.retire(g)
        fresh = []
        for i, p in enumerate(g.procs):
            if p is None or not p.alive():
                if p is not None:
                    p.stop()
                g.procs[i] = _Proc(self.ctx)
                fresh.append(g.procs[i])
        for p in fresh:
            p.wait_ready()
        if g.prefix is None:
            self._init_group(g)
        return g

    def _init_group(self, g: _Group) -> None:
        last = None
        for _attempt in range(4):  # TCPStore bootstrap is occasionally flaky on a loaded host: retry
            prefix = f"asapmbt{secrets.token_hex(4)}-"
            self.prefixes.append(prefix)
            port = _free_port()
            seqs = [p.send("init", rank, g.world, port, prefix, COMM_TIMEOUT, HEAP_CHUNK)
                    for rank, p in enumerate(g.procs)]
            replies = [p.reply(s, "init", timeout=60.0) for p, s in zip(g.procs, seqs)]
            if all(r.kind == "ok" for r in replies):
                assert [r.value for r in replies] == [p.pid for p in g.procs]
                g.prefix, g.broken = prefix, False
                g.inits += 1
                return
            last = replies
            for p in g.procs:
                p.call("close_comm", timeout=JOIN_TIMEOUT)
        raise AssertionError(f"init of a {g.world}-PE group failed four times: {last}")

    def retire(self, g: _Group) -> None:
        """Close the group's communicators (the dead are already reaped); nothing may stay in /dev/shm."""
        prefix, g.prefix = g.prefix, None
        if prefix is None:
            return
        for i, p in enumerate(g.procs):
            if p is not None and p.alive():
                try:
                    r = p.call("close_comm", timeout=REPLY_TIMEOUT)
                    assert r.kind == "ok", r
                except AssertionError:
                    p.kill()
                    g.procs[i] = None
        left = shm_files(prefix)
        assert left == [], f"segments of a retired group left in /dev/shm: {left}"

    def shutdown(self) -> None:
        try:
            for g in self.groups.values():
                self.retire(g)
        finally:
            for g in self.groups.values():
                for i, p in enumerate(g.procs):
                    if p is not None:
                        p.stop()
                        g.procs[i] = None
        left = [f for prefix in self.prefixes for f in shm_files(prefix)]
        assert left == [], f"segments left in /dev/shm: {left}"


# --------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------
U64_VALUES = st.one_of(st.integers(0, 3), st.integers(U64 - 3, U64 - 1), st.integers(0, U64 - 1),
                       st.sampled_from([1 << 63, (1 << 63) - 1, 1 << 32]))
TAGS = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-3, 3))


@st.composite
def msg_shapes(draw, slot_bytes: int):
    """(dtype name, shape) of a message that fits the slot: 0 to 8 dims, empty tensors included."""
    name = draw(st.sampled_from(MSG_DTYPES))
    cap = slot_bytes // _itemsize(name)  # elements that fit
    ndim = draw(st.integers(0, 8))
    shape, prod = [], 1
    for _ in range(ndim):
        hi = 4 if prod == 0 else min(4, cap // prod)
        d = draw(st.integers(0, hi))
        shape.append(d)
        prod *= d
    if prod > cap:  # only when ndim == 0 and nothing fits: make it empty
        shape = [0]
    return name, tuple(shape)


@st.composite
def views(draw, rows: int, cols: int):
    kind = draw(st.sampled_from(["block", "block", "row", "col", "elem"]))
    if kind == "block":
        r0 = draw(st.integers(0, rows - 1))
        r1 = draw(st.integers(r0, rows))
        c0 = draw(st.integers(0, cols - 1))
        c1 = draw(st.integers(c0, cols))
        return ("block", r0, r1, c0, c1, draw(st.integers(1, 3)))
    if kind == "row":
        return ("row", draw(st.integers(0, rows - 1)))
    if kind == "col":
        return ("col", draw(st.integers(0, cols - 1)), draw(st.integers(0, rows - 1)), draw(st.integers(1, 3)))
    return ("elem", draw(st.integers(0, rows - 1)), draw(st.integers(0, cols - 1)))


Msg = namedtuple("Msg", "src tag dtype shape data pos")  # pos: the message's position in its inbox's ring


def _apply(cur: int, op: str, value: int) -> int:
    return value if op == "set" else (cur + value) % U64


# --------------------------------------------------------------------------
# the state machine
# --------------------------------------------------------------------------
class ModelMachine(RuleBasedStateMachine):
    pool: "_Pool | None" = None  # set by the test

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.ok = True  # False while a step runs; stays False if it failed
        self.gone: dict = {}  # pe -> "died" | "closed"
        self.handles = 0
        self.seeds = 0

    # ---------------------------------------------------------------- helpers
    def _seed(self) -> int:
        self.seeds += 1
        return self.seeds

    @property
    def live(self) -> list:
        return [pe for pe in range(self.world) if pe not in self.gone]

    def on(self, kind: str) -> bool:
        """Whether rules of ``kind`` run in this example (focused examples reach deeper states)."""
        return self.ready and self.focus in ("mixed", kind)

    def pick(self, data, pes: list, label: str) -> int:
        """A PE of ``pes``, the example's hot PE half of the time (queues build up on it)."""
        hot = [self.hot] if self.hot in pes else []
        return data.draw(st.one_of(st.sampled_from(pes), st.sampled_from(hot or pes)), label=label)

    def pick_consumer(self, data) -> int:
        """A live PE to receive on: one with pending messages half of the time, if there is one."""
        busy = [pe for pe in self.live if self.pending[pe]]
        return data.draw(st.one_of(st.sampled_from(self.live), st.sampled_from(busy or self.live)), label="pe")

    def proc(self, pe: int) -> _Proc:
        return self.group.procs[pe]

    def occupancy(self, pe: int) -> int:
        return len(self.pending[pe]) + len(self.held[pe])

    def full(self, pe: int) -> bool:
        """Slots are reused in ring order (README, "Memory ordering"): the next message, position ``tail``,
        waits until message ``tail - num_slots`` (pending, or received and held) is released."""
        blocking = self.tail[pe] - self.num_slots
        if blocking < 0:
            return False
        unreleased = [m.pos for m in self.pending[pe]] + [m.pos for m in self.held[pe].values()]
        return blocking in unreleased

    @staticmethod
    def check(cond: bool, what: str) -> None:
        assert cond, what

    @staticmethod
    def counted(r: Reply) -> None:
        """One more operation whose observation is compared with the model."""
        global OPS_CHECKED
        OPS_CHECKED += 1
        OPS_BY_KIND[f"{r.cmd} -> {r.kind}"] += 1

    def expect_ok(self, r: Reply, what: str):
        self.counted(r)
        self.check(r.kind == "ok", f"{what}: expected success, got {r.kind}: {r.msg}")
        return r.value

    def expect_timeout(self, r: Reply, what: str, timeout: float) -> None:
        self.counted(r)
        self.check(r.kind == "Timeout", f"{what}: expected asap_comm.TimeoutError, got {r.kind}: "
                                        f"{r.msg if r.kind != 'ok' else r.value}")
        self.check(r.elapsed >= 0.9 * timeout, f"{what}: timed out after {r.elapsed:.4f} s, before its "
                                                f"{timeout} s timeout")

    def expect_peer_failure(self, r: Reply, what: str, culprits) -> None:
        self.counted(r)
        self.check(r.kind == "PeerFailure", f"{what}: expected PeerFailure (gone: {self.gone}), got {r.kind}: "
                                            f"{r.msg if r.kind != 'ok' else r.value}")
        self.check(r.pe in culprits, f"{what}: PeerFailure names PE {r.pe}, expected one of {sorted(culprits)}")
        self.check(isinstance(r.reason, str) and r.reason.split()[0] == self.gone[r.pe],
                   f"{what}: PeerFailure reason {r.reason!r}, but PE {r.pe} {self.gone[r.pe]}")
        self.check(r.elapsed < FAIL_WITHIN, f"{what}: PeerFailure took {r.elapsed:.3f} s")

    def wait_failure(self, pe: int, peers) -> "set | None":
        """The PEs a not-yet-satisfied wait on ``pe`` may name in its PeerFailure, or None if it must time out."""
        others = [q for q in range(self.world) if q != pe]
        if peers is None:
            died = {q for q in others if self.gone.get(q) == "died"}
            if died:
                return died
            if others and all(q in self.gone for q in others):
                return set(others)
            return None
        s = set(peers)
        if pe in s or not all(q in self.gone for q in s):
            return None
        return s

    def collect_message(self, pe: int, got, what: str) -> None:
        """A Message ``got`` came out of ``pe``'s inbox: it must be the oldest pending one of its producer."""
        handle, src, tag, dtype, shape, data = got
        mine = [i for i, m in enumerate(self.pending[pe]) if m.src == src]
        self.check(bool(mine), f"{what}: PE {pe} received a message from PE {src} that is not pending "
                               f"(lost order, duplicate or invented): tag {tag}, {dtype} {shape}")
        exp = self.pending[pe][mine[0]]
        self.check((tag, dtype, shape) == (exp.tag, exp.dtype, exp.shape),
                   f"{what}: PE {pe} got (tag {tag}, {dtype}, {shape}) from PE {src}, but the oldest pending "
                   f"message of that producer is (tag {exp.tag}, {exp.dtype}, {exp.shape}): per-producer FIFO "
                   "broken")
        self.check(data == exp.data, f"{what}: payload of PE {src}'s message (tag {tag}) differs")
        del self.pending[pe][mine[0]]
        self.held[pe][handle] = exp

    def broadcast(self, pes, cmd, *args) -> list:
        seqs = [(pe, self.proc(pe).send(cmd, *args)) for pe in pes]
        return [self.proc(pe).reply(s, cmd) for pe, s in seqs]

    # ---------------------------------------------------------------- setup
    @initialize(world=st.integers(2, MAX_W), slot_bytes=st.sampled_from([1, 16, 40, 64, 256]),
                num_slots=st.integers(1, 4), nsig=st.integers(1, 4), rows=st.integers(1, 6),
                cols=st.integers(1, 6), xdtype=st.sampled_from(SYM_DTYPES),
                failures=st.sampled_from([False, False, True]),
                focus=st.sampled_from(["mixed", "mailbox", "signals", "memory"]), hot=st.integers(0, MAX_W - 1),
                seed=st.integers(0, 1 << 40))
    def start(self, world, slot_bytes, num_slots, nsig, rows, cols, xdtype, failures, focus, hot, seed):
        self.world, self.slot_bytes, self.num_slots, self.nsig = world, slot_bytes, num_slots, nsig
        self.rows, self.cols, self.xdtype, self.failures = rows, cols, xdtype, failures
        self.focus, self.hot = focus, hot % world
        self.seeds = seed * 1024  # payload seeds: deterministic, so a replayed example sends the same bytes
        self.ok = False
        self.group = None
        self.group = self.pool.ensure(world)
        fill = self._seed() * 8
        replies = self.broadcast(range(world), "reset", slot_bytes, num_slots, nsig, (rows, cols), xdtype, fill)
        self.x = [payload(fill + pe, xdtype, (rows, cols)).clone() for pe in range(world)]
        self.sig = [[0] * nsig for _ in range(world)]
        self.pending = [[] for _ in range(world)]
        self.tail = [0] * world  # positions taken in each inbox
        self.held = [{} for _ in range(world)]
        for pe, r in enumerate(replies):
            data, sigs = self.expect_ok(r, f"reset on PE {pe}")
            self.check(data == tbytes(self.x[pe]), f"reset: PE {pe}'s initial tensor differs")
            self.check(sigs == [0] * nsig, f"reset: PE {pe}'s new signals are not zero: {sigs}")
        self.check(shm_files(self.group.prefix) == [], "segments left linked after a collective allocation")
        self.ready = True
        self.ok = True

    def teardown(self) -> None:
        g = getattr(self, "group", None)
        if not self.ready:
            if g is not None and not self.ok:
                g.broken = True  # a failed reset: a new communicator next time
            return
        try:
            if self.ok:
                self.ok = False
                self._final_checks()
                self.ok = True
        finally:
            # A failed step that left a command unanswered (or any PE gone) leaves the group unusable;
            # after a failed check with every command answered, the next run's reset starts afresh.
            if self.gone or not (self.ok or all(p.idle() for p in g.procs)):
                g.broken = True
                self.pool.retire(g)

    def _final_checks(self) -> None:
        """Nothing lost, nothing duplicated: drain every live inbox; memory and signals equal the model."""
        for pe in self.live:
            while True:
                h = self._new_handle()
                r = self.proc(pe).call("poll", h)
                got = self.expect_ok(r, f"final poll on PE {pe}")
                if got is None:
                    break
                self.collect_message(pe, got, "final drain")
                self._release(pe, h, "release", "final drain")
            self.check(self.pending[pe] == [], f"PE {pe}: poll found nothing while {len(self.pending[pe])} "
                                               f"messages were sent to it and not received (lost)")
            for h in list(self.held[pe]):
                self._release(pe, h, "release", "final release")
            data, sigs = self.expect_ok(self.proc(pe).call("snapshot"), f"snapshot of PE {pe}")
            self.check(data == tbytes(self.x[pe]), f"final: PE {pe}'s symmetric tensor differs from the model")
            self.check(sigs == self.sig[pe], f"final: PE {pe}'s signals {sigs} != model {self.sig[pe]}")

    def _new_handle(self) -> int:
        self.handles += 1
        return self.handles

    @invariant()
    def nothing_in_dev_shm(self):
        if self.ready:
            self.check(shm_files(self.group.prefix) == [], "a segment of the group is still linked in /dev/shm")

    # ---------------------------------------------------------------- mailboxes
    @precondition(lambda self: self.on('mailbox'))
    @rule(data=st.data())
    def send(self, data):
        """One to three sends (so that inboxes fill up), each from a random live PE."""
        self.ok = False
        for _ in range(data.draw(st.integers(1, 3), label="sends")):
            if not self._send_one(data):
                break  # it timed out (back-pressure): more of the same would only take time
        self.ok = True

    def _send_one(self, data) -> bool:
        """One send; False if it (rightly) timed out."""
        src = data.draw(st.sampled_from(self.live), label="src")
        targets = self.live + sorted(q for q in self.gone if self.full(q))
        dst = self.pick(data, targets, "dst")
        oversize = data.draw(st.integers(0, 19), label="oversize die") == 0
        if oversize:
            dtype, shape = "uint8", (self.slot_bytes + data.draw(st.integers(1, 8), label="extra bytes"),)
        else:
            dtype, shape = data.draw(msg_shapes(self.slot_bytes), label="dtype, shape")
        tag = data.draw(TAGS, label="tag")
        seed = self._seed()
        what = f"send PE {src} -> PE {dst} ({dtype} {shape}, tag {tag}; inbox {self.occupancy(dst)}/" \
               f"{self.num_slots})"
        if oversize:
            r = self.proc(src).call("send", dst, dtype, shape, tag, seed, SHORT, "send")
            self.counted(r)
            self.check(r.kind == "ValueError" and "larger than the mailbox slot" in r.msg,
                       f"{what}: expected ValueError (larger than the slot), got {r.kind}: {r.msg}")
        elif dst in self.gone:
            r = self.proc(src).call("send", dst, dtype, shape, tag, seed, FAIL_TIMEOUT, "send")
            self.expect_peer_failure(r, what + f" to a full inbox of a PE that {self.gone[dst]}", {dst})
        elif self.full(dst):
            r = self.proc(src).call("send", dst, dtype, shape, tag, seed, SHORT, "send")
            self.expect_timeout(r, what + ": the inbox is full (back-pressure)", SHORT)
            return False
        else:
            via = data.draw(st.sampled_from(["send", "send", "prepared", "noncontig"]), label="via")
            r = self.proc(src).call("send", dst, dtype, shape, tag, seed, SHORT, via)
            self.expect_ok(r, what + f" via {via}: the inbox has a free slot")
            self.pending[dst].append(Msg(src, tag, dtype, shape, tbytes(payload(seed, dtype, shape)), self.tail[dst]))
            self.tail[dst] += 1
        return True

    @precondition(lambda self: self.on('mailbox'))
    @rule(data=st.data())
    def recv(self, data):
        self.ok = False
        pe = self.pick_consumer(data)
        h = self._new_handle()
        if self.pending[pe]:
            timeout = data.draw(st.sampled_from([0.0, SHORT, "default"]), label="timeout")
            r = self.proc(pe).call("recv", timeout, h)
            self.collect_message(pe, self.expect_ok(r, f"recv on PE {pe} (a message is pending)"), "recv")
        elif all(q in self.gone for q in range(self.world) if q != pe):
            r = self.proc(pe).call("recv", FAIL_TIMEOUT, h)
            self.expect_peer_failure(r, f"recv on PE {pe}: empty inbox, no live producer (gone: {self.gone})",
                                     set(self.gone))
        else:
            timeout = data.draw(st.sampled_from([0.0, SHORT]), label="timeout")
            r = self.proc(pe).call("recv", timeout, h)
            self.expect_timeout(r, f"recv on PE {pe}: empty inbox, live producers remain", timeout)
        self.ok = True

    @precondition(lambda self: self.on('mailbox'))
    @rule(data=st.data())
    def poll(self, data):
        self.ok = False
        pe = self.pick_consumer(data)
        h = self._new_handle()
        got = self.expect_ok(self.proc(pe).call("poll", h), f"poll on PE {pe}")
        if self.pending[pe]:
            self.check(got is not None, f"poll on PE {pe} returned None with {len(self.pending[pe])} "
                                        "messages pending")
            self.collect_message(pe, got, "poll")
        else:
            self.check(got is None, f"poll on PE {pe} returned a message from an empty inbox: "
                                    f"{got[1:5] if got else None}")
        self.ok = True

    def _release(self, pe: int, h: int, how: str, what: str) -> None:
        exp = self.held[pe][h]
        seen = self.expect_ok(self.proc(pe).call("release", h, how), f"{what}: release on PE {pe}")
        self.check(seen == (exp.src, exp.tag, exp.dtype, exp.shape, exp.data),
                   f"{what}: PE {pe}'s held Message (from PE {exp.src}, tag {exp.tag}) changed before its "
                   "release: its slot was reused")
        del self.held[pe][h]

    @precondition(lambda self: self.on('mailbox') and any(self.held[pe] for pe in self.live))
    @rule(data=st.data())
    def release(self, data):
        self.ok = False
        pe = self.pick(data, [pe for pe in self.live if self.held[pe]], "pe")
        h = data.draw(st.sampled_from(sorted(self.held[pe])), label="handle")
        how = data.draw(st.sampled_from(["release", "exit", "drop"]), label="how")
        self._release(pe, h, how, f"release ({how})")
        self.ok = True

    # ---------------------------------------------------------------- signals
    @precondition(lambda self: self.on('signals'))
    @rule(data=st.data())
    def signal_op(self, data):
        self.ok = False
        actor = data.draw(st.sampled_from(self.live), label="actor")
        target = data.draw(st.sampled_from(self.live), label="target")
        idx = data.draw(st.integers(0, self.nsig - 1), label="idx")
        op = data.draw(st.sampled_from(["set", "add"]), label="op")
        value = data.draw(U64_VALUES, label="value")
        cur = self.sig[target][idx]
        via = "method"
        if value < (1 << 63) and cur < (1 << 63):
            via = data.draw(st.sampled_from(["method", "op"]), label="via")
        r = self.proc(actor).call("sig_op", target, idx, value, op, via)
        prev = self.expect_ok(r, f"signal_op {op} {value} by PE {actor} on PE {target}'s sig[{idx}] via {via}")
        self.check(prev == cur, f"signal_op by PE {actor} on PE {target}'s sig[{idx}] returned {prev}, the model "
                                f"holds {cur}")
        self.sig[target][idx] = _apply(cur, op, value)
        self.ok = True

    @precondition(lambda self: self.on('signals'))
    @rule(data=st.data())
    def signal_fetch(self, data):
        self.ok = False
        pe = data.draw(st.sampled_from(self.live), label="pe")
        idx = data.draw(st.integers(0, self.nsig - 1), label="idx")
        v = self.expect_ok(self.proc(pe).call("sig_fetch", idx), f"signal_fetch on PE {pe}")
        self.check(v == self.sig[pe][idx], f"signal_fetch on PE {pe} sig[{idx}] = {v}, model {self.sig[pe][idx]}")
        self.ok = True

    def _peers(self, data, must_hold_live: bool, waiter: int):
        """A peers= argument: None or a nonempty list of PEs (with a live one or the waiter, if asked)."""
        choice = data.draw(st.one_of(st.none(), st.lists(st.integers(0, self.world - 1), min_size=1,
                                                         max_size=self.world + 1)), label="peers")
        if choice is not None and must_hold_live and not any(q == waiter or q not in self.gone for q in choice):
            choice = choice + [data.draw(st.sampled_from(self.live), label="live peer")]
        return choice

    @precondition(lambda self: self.on('signals'))
    @rule(data=st.data())
    def signal_wait(self, data):
        """A wait whose outcome is decided now: the condition holds, or it fails, or it times out."""
        self.ok = False
        pe = data.draw(st.sampled_from(self.live), label="pe")
        idx = data.draw(st.integers(0, self.nsig - 1), label="idx")
        cmp = data.draw(st.sampled_from(list(CMPS)), label="cmp")
        cur = self.sig[pe][idx]
        value = data.draw(st.one_of(st.sampled_from([cur, (cur + 1) % U64, (cur - 1) % U64, 0, U64 - 1]),
                                    U64_VALUES), label="value")
        peers = self._peers(data, False, pe)
        vias = ["method", "prepared"] + (["op"] if value < (1 << 63) and cur < (1 << 63) else [])
        via = data.draw(st.sampled_from(vias), label="via")
        what = f"signal_wait_until on PE {pe}: sig[{idx}] (model {cur}) {cmp} {value}, peers={peers}, via {via}"
        if CMPS[cmp](cur, value):
            timeout = data.draw(st.sampled_from([None, 0.0, SHORT]), label="timeout")
            r = self.proc(pe).call("sig_wait", idx, cmp, value, timeout, peers, via)
            v = self.expect_ok(r, what + ": the condition holds")
            self.check(v == cur, f"{what}: returned {v}, the model holds {cur}")
            self.check(r.elapsed < FAIL_WITHIN, f"{what}: took {r.elapsed:.3f} s though the condition held")
            return self._done()
        culprits = self.wait_failure(pe, peers)
        if culprits is not None:
            timeout = data.draw(st.sampled_from([None, FAIL_TIMEOUT]), label="timeout")
            r = self.proc(pe).call("sig_wait", idx, cmp, value, timeout, peers, via)
            self.expect_peer_failure(r, what + f": every PE that may satisfy it is gone ({self.gone})", culprits)
        else:
            timeout = data.draw(st.sampled_from([0.0, SHORT]), label="timeout")
            r = self.proc(pe).call("sig_wait", idx, cmp, value, timeout, peers, via)
            self.expect_timeout(r, what + f": the condition does not hold (gone: {self.gone})", timeout)
        self._done()

    def _done(self):
        self.ok = True

    @precondition(lambda self: self.on('signals') and len(self.live) >= 2)
    @rule(data=st.data())
    def wait_then_signal(self, data):
        """PE a waits for a condition that does not hold yet; live PE b then makes it hold: the wait returns."""
        self.ok = False
        a = data.draw(st.sampled_from(self.live), label="waiter")
        b = data.draw(st.sampled_from([q for q in self.live if q != a]), label="signaller")
        idx = data.draw(st.integers(0, self.nsig - 1), label="idx")
        op = data.draw(st.sampled_from(["set", "add"]), label="op")
        cur = self.sig[a][idx]
        value = data.draw(U64_VALUES, label="value")
        if _apply(cur, op, value) == cur:
            value = (value + 1) % U64
        new = _apply(cur, op, value)
        cands = {"==": new, "!=": cur}
        if new > cur:
            cands.update({">": cur, ">=": new})
        else:
            cands.update({"<": cur, "<=": new})
        cmp = data.draw(st.sampled_from(sorted(cands)), label="cmp")
        thr = cands[cmp]
        assert not CMPS[cmp](cur, thr) and CMPS[cmp](new, thr)
        peers = self._peers(data, True, a)
        if peers is None and self.wait_failure(a, None) is not None:
            peers = [b]
        via = data.draw(st.sampled_from(["method", "prepared"]), label="via")
        seq = self.proc(a).send("sig_wait", idx, cmp, thr, 10.0, peers, via)
        prev = self.expect_ok(self.proc(b).call("sig_op", a, idx, value, op, "method"),
                              f"signal_op by PE {b} while PE {a} waits")
        self.check(prev == cur, f"signal_op by PE {b} on PE {a}'s sig[{idx}] returned {prev}, model {cur}")
        self.sig[a][idx] = new
        r = self.proc(a).reply(seq, "sig_wait")
        v = self.expect_ok(r, f"signal_wait_until on PE {a}: sig[{idx}] {cmp} {thr} (was {cur}), peers={peers}, "
                              f"satisfied by PE {b} ({op} {value}; gone: {self.gone})")
        self.check(v == new, f"the wait on PE {a} returned {v}, PE {b} made it {new}")
        self.ok = True

    # ---------------------------------------------------------------- symmetric memory
    @precondition(lambda self: self.on('memory'))
    @rule(data=st.data())
    def put(self, data):
        self.ok = False
        writer = data.draw(st.sampled_from(self.live), label="writer")
        target = data.draw(st.sampled_from(self.live), label="target")
        spec = data.draw(views(self.rows, self.cols), label="view")
        via = data.draw(st.sampled_from(["method", "op"]), label="via")
        seed = self._seed()
        dst = view_of(self.x[target], spec)
        self.expect_ok(self.proc(writer).call("put", target, spec, seed, via),
                       f"put by PE {writer} into PE {target}'s x{spec} via {via}")
        dst.copy_(payload(seed, self.xdtype, tuple(dst.shape)))
        self.ok = True

    @precondition(lambda self: self.on('memory'))
    @rule(data=st.data())
    def get(self, data):
        self.ok = False
        reader = data.draw(st.sampled_from(self.live), label="reader")
        target = data.draw(st.sampled_from(self.live), label="target")
        spec = data.draw(views(self.rows, self.cols), label="view")
        via = data.draw(st.sampled_from(["method", "op"]), label="via")
        shape, got = self.expect_ok(self.proc(reader).call("get", target, spec, via),
                                    f"get by PE {reader} from PE {target}'s x{spec} via {via}")
        exp = view_of(self.x[target], spec)
        self.check(shape == tuple(exp.shape), f"get x{spec}: shape {shape}, expected {tuple(exp.shape)}")
        self.check(got == tbytes(exp), f"get by PE {reader} from PE {target}'s x{spec} differs from the model")
        self.ok = True

    @precondition(lambda self: self.on('memory'))
    @rule(data=st.data())
    def put_signal(self, data):
        self.ok = False
        writer = data.draw(st.sampled_from(self.live), label="writer")
        target = data.draw(st.sampled_from(self.live), label="target")
        spec = data.draw(views(self.rows, self.cols), label="view")
        idx = data.draw(st.integers(0, self.nsig - 1), label="idx")
        op = data.draw(st.sampled_from(["set", "add"]), label="op")
        value = data.draw(U64_VALUES, label="value")
        dst = view_of(self.x[target], spec)
        via = data.draw(st.sampled_from(["method", "prepared"]), label="via") if dst.is_contiguous() else "method"
        seed = self._seed()
        self.expect_ok(self.proc(writer).call("put_signal", target, spec, seed, idx, value, op, via),
                       f"put_signal by PE {writer} into PE {target}'s x{spec}, sig[{idx}] {op} {value} via {via}")
        dst.copy_(payload(seed, self.xdtype, tuple(dst.shape)))
        self.sig[target][idx] = _apply(self.sig[target][idx], op, value)
        self.ok = True

    @precondition(lambda self: self.on('memory'))
    @rule(data=st.data())
    def local_memory(self, data):
        self.ok = False
        pe = data.draw(st.sampled_from(self.live), label="pe")
        got, sigs = self.expect_ok(self.proc(pe).call("snapshot"), f"snapshot of PE {pe}")
        self.check(got == tbytes(self.x[pe]), f"PE {pe}'s own symmetric tensor differs from the model")
        self.check(sigs == self.sig[pe], f"PE {pe}'s signals {sigs} != model {self.sig[pe]}")
        self.ok = True

    # ---------------------------------------------------------------- collectives, failures
    @precondition(lambda self: self.ready and (self.focus == "mixed" or bool(self.gone)))
    @rule()
    def barrier(self):
        self.ok = False
        timeout = FAIL_TIMEOUT if self.gone else 10.0
        replies = self.broadcast(self.live, "barrier", timeout)
        for pe, r in zip(self.live, replies):
            if self.gone:
                self.expect_peer_failure(r, f"barrier on PE {pe} (gone: {self.gone})", set(self.gone))
            else:
                self.expect_ok(r, f"barrier on PE {pe}")
        self.ok = True

    @precondition(lambda self: self.ready and self.failures and len(self.live) >= 2)
    @rule(data=st.data())
    def kill(self, data):
        self.ok = False
        pe = data.draw(st.sampled_from(self.live), label="victim")
        how = data.draw(st.sampled_from(["sigkill", "exit", "close"]), label="how")
        p = self.proc(pe)
        if how == "sigkill":
            p.kill()
            self.gone[pe] = "died"
        elif how == "exit":
            p.send("exit")
            p.proc.join(JOIN_TIMEOUT)
            assert not p.alive(), f"PE {pe} did not exit"
            self.gone[pe] = "died"
        else:
            self.expect_ok(p.call("close_comm"), f"close on PE {pe}")
            self.gone[pe] = "closed"
        observer = data.draw(st.sampled_from(self.live), label="observer")
        alive, state = self.expect_ok(self.proc(observer).call("peer_state", pe), f"peer_state({pe}) on PE {observer}")
        self.check(alive is False and state == self.gone[pe],
                   f"PE {observer} sees PE {pe} as alive={alive}, state {state!r} after it {self.gone[pe]}")
        self.ok = True

    @precondition(lambda self: self.ready and "closed" in self.gone.values())
    @rule(data=st.data())
    def call_after_close(self, data):
        self.ok = False
        pe = data.draw(st.sampled_from(sorted(q for q, how in self.gone.items() if how == "closed")), label="pe")
        what = data.draw(st.sampled_from(["signal_fetch", "signal_op", "signal_wait_until", "put", "barrier",
                                          "send", "recv", "poll"]), label="call")
        r = self.proc(pe).call("closed_call", what)
        self.counted(r)
        self.check(r.kind == "CommError" and "the communicator is closed" in r.msg,
                   f"{what} on closed PE {pe}: expected CommError (closed), got {r.kind}: {r.msg}")
        self.ok = True


SETTINGS = settings(max_examples=MAX_EXAMPLES, stateful_step_count=STEPS, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def pool():
    p = _Pool()
    t0 = time.monotonic()
    try:
        yield p
    finally:
        p.shutdown()
        print(f"\nmodel-based tier: {OPS_CHECKED} operations checked in {time.monotonic() - t0:.1f} s "
              f"(max_examples={MAX_EXAMPLES}, steps={STEPS}{', soak' if SOAK else ''})")
        if SOAK or os.environ.get("ASAP_MODEL_STATS"):
            for kind, n in sorted(OPS_BY_KIND.items()):
                print(f"    {kind}: {n}")


@pytest.mark.timeout(SOAK_TIMEOUT if SOAK else 300)
def test_model_based_live_pes(pool, monkeypatch):
    # Shrinking a failure replays examples on live processes; keep it well inside the test's timeout
    # so that the minimal failing sequence is reported (Hypothesis' own cap is 300 s).
    from hypothesis.internal.conjecture import engine
    monkeypatch.setattr(engine, "MAX_SHRINKING_SECONDS", 90, raising=False)
    ModelMachine.pool = pool
    run_state_machine_as_test(ModelMachine, settings=SETTINGS)
