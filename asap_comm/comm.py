"""The communicator: the group's calls, dispatched to one transport per peer.

Legend: PE = a process of the group, ``W`` = world size, ``pe`` in [0, W).

Memory model (OpenSHMEM 1.5 section 9 / NVSHMEM, restated for the shm backend):

* ``put``/``get`` are *blocking* one-sided copies: when ``put`` returns, the
  bytes have been written into the target's memory and the source buffer may
  be reused; they are not guaranteed visible to the target *in order* with
  respect to other words until a release operation follows (a signal update,
  ``fence``, ``quiet`` or ``barrier``).
* ``put_signal`` writes the data, then updates the signal word with release
  semantics: a PE that observes the new signal value with ``signal_wait_until``
  or ``signal_fetch`` (acquire) also observes the data.
* ``signal_op`` is an atomic (set or add) on one 64-bit word with release
  semantics; ``signal_fetch`` and ``signal_wait_until`` load with acquire.
* ``fence`` orders this PE's earlier puts before its later puts to every PE;
  ``quiet`` completes all of them (both are a full fence here, since puts on
  this backend complete before they return).
* ``barrier`` is a full fence on every PE plus a rendezvous: whatever any PE
  wrote before it is visible to every PE after it.

Every wait is bounded (``timeout`` per call, the communicator's default when
None) and raises :class:`asap_comm.TimeoutError`; a wait that can no longer be
satisfied because a PE died (or closed) raises :class:`asap_comm.PeerFailure`
within about 20 ms of the death.

Where the parts live (docs/design.md, "Where each concern lives"): joining the group in
``asap_comm.bootstrap``, the symmetric heap in ``asap_comm.heap``, collective-call records and the barrier in
``asap_comm.collective``, and how each peer is reached in ``asap_comm.transport`` (shared memory on this
host, the network engine across hosts).
"""
from __future__ import annotations

import itertools
import math
import os
import weakref

import torch

from ._native import _C
from .checks import check_pair, check_pe, check_shape, check_timeout, check_value, peer_mask, signal_word, tensor_info
from .bootstrap import Segments, bootstrap, check_init_args, open_store, unlink_quietly
from .bootstrap import host_id as _host_id
from .collective import collective
from .errors import CommError
from .heap import Alloc, SymmetricHeap
from .mailbox import Mailbox
from .registry import _by_id, _registry, _registry_lock, hosting  # noqa: F401  (_by_id: reachable here)
from .rendezvous import secret_token as _secret_token
from .transport import Transport, load_net  # noqa: F401  (load_net: reachable here, as before)
from .transport.base import OPS as _OPS

__all__ = ["Communicator", "init"]

_CMPS = {"==": 0, "!=": 1, ">": 2, ">=": 3, "<": 4, "<=": 5}
_FAST_CACHE_MAX = 4096
_COPY_WITH_TORCH = 1 << 20  # the fast path's table keeps handles of copies below this size

_ids = itertools.count(1)

class Communicator:
    """A group of PEs sharing a symmetric heap. Create with :func:`asap_comm.init`.

    Attributes: ``rank``, ``world_size``, ``timeout`` (default wait bound in
    seconds), ``id`` (the handle that ``torch.ops.asap_comm.*`` take as
    ``comm``).
    """

    def __init__(self, rank: int, world_size: int, store, *, timeout: float, heap_chunk_bytes: int, shm_prefix: str,
                 backend: str = "auto", host_id: "str | None" = None, group_secret: "str | None" = None,
                 master_addr: "str | None" = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.id = next(_ids)
        self._store = store
        self._group_secret = group_secret
        self._master_addr = master_addr or os.environ.get("MASTER_ADDR")  # where this host's address is seen from
        self._secret_file: "str | None" = None  # one host, no secret given: rank 0's 0600 secret file
        self._shm_prefix = shm_prefix
        self._segments = Segments(shm_prefix)
        self._linked = self._segments.linked  # segment names this PE created and has not unlinked
        self._closed = False
        self._heap = SymmetricHeap(rank, world_size, heap_chunk_bytes)
        self._fast: dict[int, tuple] = {}  # id(symmetric tensor) -> validated info (holds the tensor)
        self._hosted: "tuple | None" = None  # (addr, port) of the TCPStore this PE hosts, if any
        self._group = _C.Group(rank, world_size)
        self._ghandle = self._group.handle
        self._pid = os.getpid()
        self._backend_arg = backend
        self.host_id = host_id if host_id is not None else _host_id()
        self.hosts: "list[str]" = [self.host_id] * world_size  # host id of every PE
        self._transports: "list[Transport]" = []  # per PE, chosen once in bootstrap
        self._completers: "list[Transport]" = []  # one transport per engine: fence and quiet
        self._link = None  # transport.NetLink once a PE of this group is on another host
        self._net = None  # its _C.NetEngine
        try:
            bootstrap(self)
        except BaseException:
            self._teardown()
            raise
        # The per-call path of put_signal/signal_wait_until is native; instance
        # attributes make `comm.put_signal(...)` reach it without a Python frame.
        self._fastpath = _C.FastPath(self._put_signal_slow, self._signal_wait_slow, self._group, self._ghandle)
        self.put_signal = self._fastpath.put_signal
        self.signal_wait_until = self._fastpath.signal_wait_until
        with _registry_lock:
            _registry[self.id] = self
        self._finalizer = weakref.finalize(self, Segments.finalize, self._linked)

    # ------------------------------------------------------------------ setup
    @property
    def _chunks(self) -> list:
        return self._heap.chunks

    def _teardown(self) -> None:
        gs = getattr(self, "_gs", None)
        if gs is not None:
            gs.close()  # stops its store keeper (asap_comm.rendezvous)
        link = getattr(self, "_link", None)
        if link is not None:
            link.close()  # says goodbye to remote PEs, stops its thread, frees UCX's resources
            self._link = self._net = None
        for t in getattr(self, "_transports", ()):
            t.close()
        self._segments.unlink_own()
        if getattr(self, "_secret_file", None) is not None:
            unlink_quietly(self._secret_file)
            self._secret_file = None
        self._heap.clear()
        self._fast = {}
        fastpath = getattr(self, "_fastpath", None)
        if fastpath is not None:
            fastpath.clear()

    def close(self) -> None:
        """Leave the group (local, not collective; idempotent).

        Marks this PE closed so that peers waiting on it get ``PeerFailure``
        instead of a hang, and drops the mappings. Symmetric tensors that the
        caller still holds stay valid memory (their mapping lives as long as
        they do) but no peer writes into them any more.
        """
        if self._closed:
            return
        self._closed = True
        self._group.mark_closed()
        try:
            _C.fence()
            if getattr(self, "_ctrl_local", None) is not None:
                _C.ctrl_set_state(self._ctrl_local, _C.STATE_CLOSED)
        finally:
            self._teardown()
            self._transports = []
            self._completers = []
            self._store = None
            self._gs = None
            with _registry_lock:
                _registry.pop(self.id, None)
            self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
                f"host={self.host_id!r}, {state})")

    @property
    def backend(self) -> str:
        """``'shm'`` when every PE shares this host, ``'auto'`` (shm within a host + net across) otherwise."""
        return "shm" if len(set(self.hosts)) == 1 else "auto"

    def is_remote(self, pe: int) -> bool:
        """True when PE ``pe`` is on another host (reached through the network engine)."""
        pe = self._check_pe("is_remote", pe)
        return self.hosts[pe] != self.host_id

    def transport(self, pe: int) -> Transport:
        """How this PE reaches PE ``pe`` (``asap_comm.transport.Transport``), e.g. ``direct_view(t)``: ``t``
        as the peer's copy where its memory is addressable from here, else None."""
        self._check_open("transport")
        return self._transports[self._check_pe("transport", pe)]

    def secret_token(self, label: str) -> str:
        """A string only this group's members can compute (32 hex characters, from the group secret and
        ``label``): the key prefix of a side channel's rendezvous (the baseline's gloo group), so that a
        process without the secret cannot name its keys."""
        self._check_open("secret_token")
        if not isinstance(label, str):
            raise TypeError(f"secret_token: label must be a str, got {type(label).__name__}")
        return _secret_token(self._secret, self._gs.prefix + label)

    def net_stats(self) -> dict:
        """Counters of the network engine (``{}`` on one host): messages sent and received, heart-beats,
        ``disorder`` (messages applied out of send order: must stay 0), ``bad_messages`` and ``fenced`` (messages
        dropped because their sender is dead to this PE: :meth:`fence_peer`)."""
        return {} if self._net is None else dict(self._net.stats())

    # ------------------------------------------------------------ checks
    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise CommError(f"{fn}: the communicator is closed")

    def _check_pe(self, fn: str, pe) -> int:
        return check_pe(fn, pe, self.world_size)

    def _timeout(self, fn: str, timeout) -> float:
        return self.timeout if timeout is None else check_timeout(fn, timeout)

    def _alloc_of(self, fn: str, name: str, t) -> Alloc:
        return self._heap.alloc_of(fn, name, t)

    def _info(self, fn: str, name: str, t) -> tuple:
        """Validated facts about symmetric tensor ``t`` (``checks.tensor_info``), cached by id for the fast path
        (the tensor is held so its id cannot be reused while cached; symmetric storage cannot be resized)."""
        self._check_open(fn)
        info = tensor_info(fn, name, t, self._heap.alloc_of)
        if len(self._fast) >= _FAST_CACHE_MAX:
            self._fast.clear()
        self._fast[id(t)] = info
        return info

    def _sig_addr(self, fn: str, sig, idx) -> tuple:
        """(info, address of word idx on this PE) for a signal array."""
        g = self._fast.get(id(sig)) or self._info(fn, "sig", sig)
        return g, signal_word(fn, g, idx)

    # ------------------------------------------------------------ symmetric heap
    def _grow(self, min_bytes: int):
        return self._heap.grow(min_bytes, self._segments, self._gs, self._transports, self.barrier)

    def _alloc(self, fn: str, nbytes: int) -> Alloc:
        self._check_open(fn)
        return self._heap.alloc(fn, nbytes, self._grow)

    # ------------------------------------------------------------ collective calls
    def _collective(self, fn: str, desc: str, body):
        """Runs a collective allocation ``body`` then the closing barrier, naming the call on failure."""
        return collective(self, fn, desc, body)

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a symmetric tensor, uninitialised (zero on first use).

        Every PE must call it with the same shape and dtype in the same order.
        Returns once every PE's copy exists, so peers may put into it at once.
        """
        return self._symmetric("empty", shape, dtype, zero=False)

    def zeros(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a symmetric tensor filled with zeros on every PE.

        On return every PE's copy is zeroed (a barrier follows the fill).
        """
        return self._symmetric("zeros", shape, dtype)

    def _symmetric(self, fn: str, shape, dtype, desc: "str | None" = None, zero: bool = True) -> torch.Tensor:
        """The collective allocation of ``empty``/``zeros``/``signals`` (``desc``: the call, for its record)."""
        shape, itemsize = check_shape(fn, shape, dtype)
        desc = desc or f"{fn}(shape={shape}, dtype={dtype})"

        def body():
            t = self._heap.tensor_of(self._alloc(fn, math.prod(shape) * itemsize), shape, dtype)
            if zero and t.numel():
                t.zero_()
            return t

        return self._collective(fn, desc, body)

    def signals(self, n: int) -> torch.Tensor:
        """Collective: ``n`` zeroed uint64 signal words, a 1-D symmetric tensor ``[n]``."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"signals: n must be an int, got {type(n).__name__}")
        if n <= 0:
            raise ValueError(f"signals: n={n} must be positive")
        return self._symmetric("signals", (n,), torch.uint64, f"signals(n={n})")

    def mailbox(self, slot_bytes: int, num_slots: int) -> Mailbox:
        """Collective: one bounded MPSC inbox per PE (see :class:`asap_comm.Mailbox`).

        ``slot_bytes``: the largest payload one message may carry;
        ``num_slots``: how many messages an inbox holds before senders wait
        (any capacity >= 1).
        """
        for nm, v in (("slot_bytes", slot_bytes), ("num_slots", num_slots)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"mailbox: {nm} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"mailbox: {nm}={v} must be positive")
        if self.world_size > _C.MAILBOX_MAX_PES:
            raise ValueError(f"mailbox: world_size={self.world_size} exceeds the {_C.MAILBOX_MAX_PES} PEs a mailbox "
                             "slot can name")

        def body():
            nbytes = _C.mailbox_bytes(slot_bytes, num_slots)
            a = self._alloc("mailbox", nbytes)
            base = a.chunk.base + a.offset
            _C.mailbox_init(base, slot_bytes, num_slots)
            buf = torch.frombuffer(a.chunk.local, dtype=torch.uint8, count=a.nbytes, offset=a.offset)
            self._heap.register(buf, a)
            return Mailbox(self, buf, base, a.chunk.deltas, slot_bytes, num_slots)

        return self._collective("mailbox", f"mailbox(slot_bytes={slot_bytes}, num_slots={num_slots})", body)

    # ------------------------------------------------------------ direct views
    def remote(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        """``t`` (a symmetric tensor or any view of one) as PE ``pe``'s copy of the same bytes.

        The analogue of ``shmem_ptr``: a tensor that aliases the peer's memory
        directly (the shm backend maps every peer), so torch kernels can write
        results straight into it (``torch.index_select(x, 0, rows, out=...)``)
        without a staging copy. Writes through it are plain stores: publish
        them with a release (``signal_op``, ``put_signal``, a mailbox send,
        ``fence``/``barrier``) before a peer relies on them. Valid until
        ``close()``.
        """
        self._check_open("remote")
        pe = self._check_pe("remote", pe)
        self._alloc_of("remote", "t", t)
        view = self._transports[pe].direct_view(t)
        if view is None:
            raise CommError(f"remote: PE {pe} is on host {self.hosts[pe]!r}, this PE on {self.host_id!r}: remote() "
                            "aliases a peer's memory and exists only between PEs of one host (backend 'shm'); "
                            "use put/get/put_signal, which work on every backend")
        return view

    # ------------------------------------------------------------ one-sided ops
    def put(self, dst: torch.Tensor, src: torch.Tensor, pe: int) -> None:
        """Write ``src`` into the bytes that ``dst`` names on PE ``pe``.

        ``dst``: a symmetric tensor or any view of one (slices, odd offsets,
        strides); ``src``: any CPU tensor of the same shape and dtype.
        Ordering: blocking; on return the data is in ``pe``'s memory and
        ``src`` may be reused. Visible to ``pe`` in order only after a later
        release (``put_signal``/``signal_op``/``fence``/``quiet``/``barrier``).
        """
        self._check_open("put")
        pe = self._check_pe("put", pe)
        a = self._alloc_of("put", "dst", dst)
        check_pair("put", dst, src)
        if dst.numel() == 0:
            return
        self._transports[pe].put(dst, a, src)

    def get(self, dst: torch.Tensor, src: torch.Tensor, pe: int) -> None:
        """Read the bytes that ``src`` (a symmetric tensor or view) names on PE ``pe`` into ``dst``.

        Ordering: blocking; on return ``dst`` holds the values. To read what
        ``pe`` published, first observe its signal (acquire), then ``get``.
        """
        self._check_open("get")
        pe = self._check_pe("get", pe)
        a = self._alloc_of("get", "src", src)
        check_pair("get", dst, src)
        if dst.numel() == 0:
            return
        self._transports[pe].get(dst, src, a)

    def put_signal(self, dst: torch.Tensor, src: torch.Tensor, pe: int, sig: torch.Tensor, idx: int,
                   value: int, op: str = "set") -> None:
        """``put(dst, src, pe)`` then ``signal_op(sig, idx, value, op, pe)``.

        Ordering: the data is visible on ``pe`` before the signal is: a PE that
        observes the new signal value (acquire) observes all of ``dst``.
        ``op``: ``"set"`` stores ``value``; ``"add"`` adds it (mod 2**64).
        The first call with given (dst, src, pe, sig, idx, op) is validated
        into the same native handle ``prepare_put_signal`` returns; a call
        repeating them runs that handle (``_C.FastPath``) after checking that
        ``src`` still has the same data pointer, so do not re-stride ``src``
        in place between calls. The native table keeps references to the
        tensors and handles of up to 64 recent calls (contiguous, and on this
        host smaller than 1 MiB). (Instances bind this name to the native path
        directly.)
        """
        return self._fastpath.put_signal(dst, src, pe, sig, idx, value, op)

    def _put_signal_handle(self, fn: str, dst, src, pe, sig, idx, op, any_size: bool):
        """The one validating path of put_signal: checks a call's arguments and returns the native handle
        (``_C.PreparedPutSignal``) that PE ``pe``'s transport builds for it, or None for a call no handle
        expresses (a strided view; on this host, a copy of ``_COPY_WITH_TORCH`` bytes or more unless
        ``any_size``), which ``_put_signal_slow`` composes from ``put`` and the signal. Returns (pe, op code,
        handle)."""
        self._check_open(fn)
        pe = self._check_pe(fn, pe)
        if op not in _OPS:
            raise ValueError(f"{fn}: op must be 'set' or 'add', got {op!r}")
        d = self._info(fn, "dst", dst)
        check_pair(fn, dst, src)
        g, addr = self._sig_addr(fn, sig, idx)
        if not (d[4] and src.is_contiguous()):
            return pe, _OPS[op], None
        return pe, _OPS[op], self._transports[pe].put_signal_handle(fn, dst, d[6], src, d[2], _OPS[op], sig, g[6],
                                                                    addr, (dst, src, sig, self._group), any_size)

    def _put_signal_slow(self, dst, src, pe, sig, idx, value, op="set") -> None:
        pe, code, h = self._put_signal_handle("put_signal", dst, src, pe, sig, idx, op, any_size=False)
        if h is None:  # a strided or large put: the data, then the signal (applied after it)
            value = check_value("put_signal", value)
            self.put(dst, src, pe)
            g, addr = self._sig_addr("put_signal", sig, idx)
            self._transports[pe].signal_op("put_signal", sig, g[6], addr, value, code, False)
            return None
        if src.__class__ is torch.Tensor and dst.__class__ is torch.Tensor and h.nbytes < _COPY_WITH_TORCH:
            # Later calls with these objects run this handle natively (the
            # table holds dst, src and sig, so their identities stay theirs;
            # the size bound caps what 64 entries keep alive).
            self._fastpath.add_put_signal(dst, src, pe, sig, idx, code, h)
        return h(value)

    def signal_op(self, sig: torch.Tensor, idx: int, value: int, op: str, pe: int) -> int:
        """Atomically update word ``idx`` of ``sig`` on PE ``pe``; returns its previous value.

        ``op``: ``"set"`` or ``"add"`` (wraps mod 2**64). Ordering: release:
        every put this PE issued before is visible to whoever observes the
        new value. Wakes ``pe`` only if it sleeps in a wait.
        """
        self._check_open("signal_op")
        if op not in _OPS:
            raise ValueError(f"signal_op: op must be 'set' or 'add', got {op!r}")
        pe = self._check_pe("signal_op", pe)
        value = check_value("signal_op", value)
        g, addr = self._sig_addr("signal_op", sig, idx)
        return self._transports[pe].signal_op("signal_op", sig, g[6], addr, value, _OPS[op], True)

    def signal_fetch(self, sig: torch.Tensor, idx: int) -> int:
        """Atomic (acquire) read of this PE's word ``idx`` of ``sig``."""
        self._check_open("signal_fetch")
        _, addr = self._sig_addr("signal_fetch", sig, idx)
        return _C.load(addr)

    def signal_wait_until(self, sig: torch.Tensor, idx: int, cmp: str, value: int, timeout=None, *,
                          peers=None) -> int:
        """Wait until ``sig[idx] <cmp> value`` holds on this PE; returns the value seen.

        ``cmp``: one of ``== != > >= < <=``. Ordering: acquire: data put
        before the signal that satisfied the wait is visible on return.
        Spins briefly, then sleeps on a futex. Raises ``TimeoutError`` after
        ``timeout`` s (default: the communicator's).

        ``peers``: the PEs that may satisfy the wait (an iterable of PEs). The
        wait raises ``PeerFailure`` only once every one of them has died or
        closed (without the condition holding); deaths of other PEs do not
        concern it. ``None`` (the default) means any PE: the wait fails as
        soon as any PE dies, or once every other PE has closed.
        (Instances bind this name to the native path directly.)
        """
        if peers is None:
            return self._fastpath.signal_wait_until(sig, idx, cmp, value, timeout)
        return self._fastpath.signal_wait_until(sig, idx, cmp, value, timeout, peers=peers)

    def _wait_handle(self, fn: str, sig, idx, cmp, timeout, peers):
        """The one validating path of signal_wait_until: the native handle (``_C.PreparedWait``) waiting for
        ``sig[idx] <cmp> value``, with ``timeout`` as its default (None: the communicator's)."""
        self._check_open(fn)
        c = _CMPS.get(cmp) if isinstance(cmp, str) else None
        if c is None:
            raise ValueError(f"{fn}: cmp must be one of {list(_CMPS)}, got {cmp!r}")
        t = self._timeout(fn, timeout)
        mask = None if peers is None else peer_mask(fn, peers, self.world_size)
        _, addr = self._sig_addr(fn, sig, idx)
        return self._transports[self.rank].wait(fn, addr, c, t, _C.DEP_ANY if mask is None else _C.DEP_SET, mask,
                                                f"signal_wait_until: waiting for sig[{idx}] {cmp} ", (sig, self._group))

    def _signal_wait_slow(self, sig, idx, cmp, value, timeout=None, *, peers=None) -> int:
        h = self._wait_handle("signal_wait_until", sig, idx, cmp, None, peers)
        if peers is None and sig.__class__ is torch.Tensor:
            self._fastpath.add_wait(sig, idx, _CMPS[cmp], h)  # holds sig: its identity stays its own
        return h(value, timeout)

    def prepare_put_signal(self, dst: torch.Tensor, src: torch.Tensor, pe: int, sig: torch.Tensor, idx: int,
                           op: str = "set"):
        """Validate a ``put_signal`` once; return a callable ``f(value)`` that performs it.

        The persistent-request form of :meth:`put_signal` (MPI_Send_init /
        MPI_Start): every check happens here, the call only copies and
        signals, so it is the lowest-latency path from Python. The handle
        holds ``dst``, ``src`` and ``sig``; it reads ``src``'s bytes at call
        time, so refill ``src`` in place between calls (do not resize or
        ``set_`` it). Same ordering as ``put_signal``. Raises ``CommError``
        if called after ``close()``.
        """
        pe, _, h = self._put_signal_handle("prepare_put_signal", dst, src, pe, sig, idx, op, any_size=True)
        if h is None:
            raise ValueError("prepare_put_signal: dst and src must be contiguous "
                             f"(dst strides {dst.stride()}, src strides {src.stride()})")
        return h

    def prepare_signal_wait(self, sig: torch.Tensor, idx: int, cmp: str, timeout=None, *, peers=None):
        """Validate a ``signal_wait_until`` once; return ``f(value) -> int`` that performs it.

        Same semantics, ordering and errors as :meth:`signal_wait_until` with
        the given ``timeout`` (default: the communicator's) and ``peers``.
        The handle takes ``value`` positionally or as ``value=``.
        """
        return self._wait_handle("prepare_signal_wait", sig, idx, cmp, timeout, peers)

    def fence(self) -> None:
        """Order: this PE's puts issued before reach every PE before those issued after.

        Across hosts every message from one PE to another is applied in the
        order it was sent, so the fence costs nothing there."""
        self._check_open("fence")
        self._fence()

    def quiet(self) -> None:
        """Complete: every put this PE issued is in its target's memory on return.

        Across hosts this is one round trip to each remote PE written to since
        the last ``quiet``."""
        self._check_open("quiet")
        self._quiet(self.timeout)

    def barrier(self, timeout=None) -> None:
        """Collective rendezvous and full fence: writes of every PE before it are visible to all after it.

        Raises ``PeerFailure`` if a PE died or closed before arriving, and
        ``TimeoutError`` after ``timeout`` s; this PE's arrival stays counted,
        so calling ``barrier`` again retries the same round. A PE that
        completed a round and then closes never fails a peer still finishing
        that round: each PE records the last round it completed in its control
        block (and its goodbye carries it across hosts), and the waits of a
        round skip PEs that left after completing it.
        """
        self._check_open("barrier")
        t = self._timeout("barrier", timeout)
        self._barrier(t)

    # ------------------------------------------------------------ liveness
    def peer_alive(self, pe: int) -> bool:
        """True while PE ``pe`` is running and has not closed."""
        self._check_open("peer_alive")
        pe = self._check_pe("peer_alive", pe)
        return self._group.check(pe) is None

    def peer_state(self, pe: int) -> str:
        """``"alive"``, ``"closed"`` (left with ``close()``) or ``"died"`` (exited or killed without it)."""
        self._check_open("peer_state")
        pe = self._check_pe("peer_state", pe)
        bad = self._group.check(pe)
        return "alive" if bad is None else ("closed" if bad[1].startswith("closed") else "died")

    def fence_peer(self, pe: int) -> bool:
        """Declare PE ``pe``, on another host, dead (the group decided so: the front end's failover, before this
        PE's own liveness line to it may have failed): from now on it counts as ``"died"`` here, every wait on it
        fails, and nothing it sends is applied (dropped and counted: ``net_stats()["fenced"]``), so a PE cut off
        and later back on the network cannot write into memory its replacement owns. The PE is not told (a PE
        cut off learns it from its own liveness lines, which fail). True when this call gave the verdict;
        False, and nothing done, for a PE on this host (a dead process there writes nothing) or one that is
        dead or closed already."""
        self._check_open("fence_peer")
        pe = self._check_pe("fence_peer", pe)
        if pe == self.rank:
            raise ValueError(f"fence_peer: pe={pe} is this PE")
        if self.peer_state(pe) != "alive":
            return False
        return self._transports[pe].fence_peer()


def init(rank: "int | None" = None, world_size: "int | None" = None, *, master_addr: "str | None" = None,
         master_port: "int | None" = None, backend: "str | None" = None, timeout: float = 30.0, store=None,
         heap_chunk_bytes: "int | None" = None, shm_prefix: "str | None" = None,
         group_secret: "str | None" = None) -> Communicator:
    """Join (collectively) a group of ``world_size`` PEs, on one host or several.

    ``rank``/``world_size``/``master_addr``/``master_port`` default to
    ``$RANK``/``$WORLD_SIZE``/``$MASTER_ADDR``/``$MASTER_PORT`` as torchrun
    sets them. Bootstraps through a ``torch.distributed.TCPStore`` (rank 0
    hosts it unless torchrun's agent does, or ``store`` is given).
    PEs are grouped by host: the hostname, or ``$ASAP_HOST_ID`` when set
    (``comm.hosts``, ``comm.local_rank``, ``comm.local_world_size``).
    ``backend``: ``"auto"`` (default) uses shared memory between PEs of one
    host and the network engine (UCX, ``pip install "asap-comm[net]"``)
    between hosts; ``"shm"`` insists on one host and fails otherwise. Default: ``$ASAP_BACKEND``, else
    ``"auto"``.
    ``timeout`` is the default bound of every wait, in seconds.
    ``heap_chunk_bytes``: symmetric heap growth step (default 64 MiB, env
    ``ASAP_HEAP_CHUNK_BYTES``); a chunk costs only the bytes handed out of it,
    which are allocated for real when they are (``OutOfSharedMemory`` naming
    /dev/shm if it is full, never SIGBUS later). Returns a :class:`Communicator` (also a context manager).
    ``group_secret``: the secret that admits a PE to the group (default ``$ASAP_GROUP_SECRET``; every PE of a
    group that spans hosts needs the same one; on one host without it, rank 0 generates one and hands it to
    the others through a file only this user can read). Everything a PE reads from the store is authenticated
    with it, and across hosts every peer proves it holds it before anything it sends is applied
    (``asap_comm.rendezvous``). A store that rank 0 hosts listens on ``master_addr`` only (127.0.0.1 for a
    group on one host), not on every interface.
    """
    rank, world_size, backend, t, heap_chunk_bytes, shm_prefix = check_init_args(
        rank, world_size, backend, timeout, heap_chunk_bytes, shm_prefix)
    if store is None:
        store, addr, port, is_master = open_store(rank, world_size, master_addr, master_port, t, hosting)
        comm = Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                            shm_prefix=shm_prefix, backend=backend, group_secret=group_secret, master_addr=addr)
        if is_master:
            comm._hosted = (addr, port)
        return comm
    return Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                        shm_prefix=shm_prefix, backend=backend, group_secret=group_secret)
