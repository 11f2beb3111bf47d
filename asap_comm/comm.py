"""The communicator: bootstrap, symmetric heap, one-sided puts/gets, signals.

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
"""
from __future__ import annotations

import hmac
import itertools
import math
import numbers
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch

from ._native import _C
from .errors import CommError, OutOfSharedMemory, PeerFailure, TimeoutError
from .mailbox import Mailbox
from .rendezvous import GroupStore, bound_store, resolve_secret, spans_hosts_without_secret
from .rendezvous import secret_token as _secret_token

__all__ = ["Communicator", "init"]

_OPS = {"set": 0, "add": 1}
_CMPS = {"==": 0, "!=": 1, ">": 2, ">=": 3, "<": 4, "<=": 5}
_U64_MAX = (1 << 64) - 1
_ALIGN = 64
_DEFAULT_CHUNK = 64 << 20
_FAST_CACHE_MAX = 4096
_COPY_WITH_TORCH = 1 << 20  # contiguous copies this large use torch's multithreaded copy_

_ids = itertools.count(1)
_registry: "weakref.WeakValueDictionary[int, Communicator]" = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class _Chunk:
    """One segment of every PE's symmetric heap (all PEs have the same chunks)."""

    index: int
    size: int
    used: int
    local: object  # _C.Mapping of this PE
    peers: list  # _C.Mapping per PE (local one included)
    deltas: list  # peer base - local base, per PE
    base: int  # local base address
    u8: list  # per PE: lazily created torch.uint8 tensor over the mapping


@dataclass
class _Alloc:
    chunk: _Chunk
    offset: int
    nbytes: int


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
        self._chunk_bytes = heap_chunk_bytes
        self._shm_prefix = shm_prefix
        self._closed = False
        self._chunks: list[_Chunk] = []
        self._allocs: dict[int, _Alloc] = {}  # storage data_ptr -> allocation
        self._fast: dict[int, tuple] = {}  # id(symmetric tensor) -> validated info (holds the tensor)
        self._linked: list[str] = []  # segment names this PE created and has not unlinked
        self._epoch = 0
        self._barrier_pending: "int | None" = None  # round this PE arrived at but timed out in
        self._barrier_released = 0  # PE 0 across hosts: the last round it released
        self._hosted: "tuple | None" = None  # (addr, port) of the TCPStore this PE hosts, if any
        self._group = _C.Group(rank, world_size)
        self._ghandle = self._group.handle
        self._pid = os.getpid()
        self._backend_arg = backend
        self.host_id = host_id if host_id is not None else _host_id()
        self.hosts: "list[str]" = [self.host_id] * world_size  # host id of every PE
        self._remote = [False] * world_size  # True for PEs on another host
        self._net = None  # _C.NetEngine once a PE of this group is on another host
        try:
            self._bootstrap()
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
        self._finalizer = weakref.finalize(self, Communicator._finalize, self._linked)

    # ------------------------------------------------------------------ setup
    def _new_name(self) -> str:
        return f"/{self._shm_prefix}{secrets.token_hex(16)}"

    def _bootstrap(self) -> None:
        # Everything read from the store is authenticated with the group secret (asap_comm.rendezvous): a
        # value that fails the check raises CommError before anything it names is mapped or connected.
        found = resolve_secret(self._store, self.rank, self.world_size, self.host_id, self._group_secret,
                               self._shm_prefix)
        self._group_secret = None
        self._secret, self._secret_file = found.key, found.file  # the key stays for the network handshake
        gs = self._gs = GroupStore(self._store, found.key, self.world_size, self.timeout)
        gs.join()
        name = self._new_name()
        self._ctrl_map = _C.create_segment(name, _C.CTRL_BYTES)
        self._linked.append(name)
        _reserve("init", self._ctrl_map, 0, _C.CTRL_BYTES, "this PE's control block")
        self._ctrl_local = self._ctrl_map.addr
        _C.ctrl_init(self._ctrl_local, self.rank, self._pid)
        gs.set(f"host/{self.rank}", self.host_id)
        gs.set(f"ctrl/{self.rank}", name)
        self.hosts = [self.host_id if pe == self.rank else gs.get_str(f"host/{pe}", f"PE {pe}'s host")
                      for pe in range(self.world_size)]
        self._remote = [h != self.host_id for h in self.hosts]
        gs.rendezvous("hosts")  # every PE read every host before any refuses (a refusing store host ends the store)
        spans = any(self._remote)
        if spans and found.source == "file":
            raise spans_hosts_without_secret(self.hosts)
        if spans and self._backend_arg == "shm":
            raise CommError(f"init: backend='shm' needs every PE on one host, but this group spans "
                            f"{len(set(self.hosts))} hosts ({_host_summary(self.hosts)}); use backend='auto'")
        self.local_pes = [pe for pe in range(self.world_size) if not self._remote[pe]]
        self.local_rank = self.local_pes.index(self.rank)
        self.local_world_size = len(self.local_pes)
        if spans:
            self._net = _net_engine(self)
            gs.set(f"net/{self.rank}", self._net.address())
        self._ctrl_maps = []
        for pe in range(self.world_size):
            if pe == self.rank:
                mp = self._ctrl_map
            elif self._remote[pe]:
                self._ctrl_maps.append(None)
                continue
            else:
                peer_name = gs.get_str(f"ctrl/{pe}", f"PE {pe}'s control segment")
                mp = _C.map_segment(peer_name, _C.CTRL_BYTES)
                if not _C.ctrl_check(mp.addr, pe):
                    raise CommError(f"init: control segment of PE {pe} is not initialised")
            self._ctrl_maps.append(mp)
            self._group.set_peer(pe, mp.addr, _C.ctrl_pid(mp.addr))
        self._ctrl = [0 if mp is None else mp.addr for mp in self._ctrl_maps]
        if spans:
            addrs = {pe: gs.get(f"net/{pe}", f"PE {pe}'s network address")
                     for pe in range(self.world_size) if self._remote[pe]}  # every one checked before any is used
            for pe, addr in addrs.items():
                self._net.connect(pe, addr)
            self._net_handshake()
            self._liveness_lines()
            self._net.start()
        gs.rendezvous("ctrl_mapped")  # every PE mapped its peers and authenticated the remote ones
        self._unlink_own()
        if self._secret_file is not None:
            _unlink_quietly(self._secret_file)
            self._secret_file = None
        self.barrier()

    def _net_handshake(self) -> None:
        """Challenge-response with every remote PE on the endpoint opened to it: each PE sends each remote
        peer 32 random bytes and accepts the peer (``NetEngine.authenticate``) once the peer answers with the
        HMAC of them under the group secret, bound to this group, the challenger and the answerer. Until then
        the engine applies nothing the peer sends (it counts it as ``unauthenticated``)."""
        remote = [pe for pe in range(self.world_size) if self._remote[pe]]
        nonces = {pe: secrets.token_bytes(32) for pe in remote}
        for pe in remote:
            self._net.handshake_send(pe, False, nonces[pe])
        verified: "set[int]" = set()
        answered: "set[int]" = set()
        deadline = time.monotonic() + self.timeout
        while len(verified) < len(remote) or len(answered) < len(remote):
            self._net.poll()
            for pe, kind, payload in self._net.take_handshakes():
                if kind == "challenge" and pe not in answered:
                    self._net.handshake_send(pe, True, self._handshake_mac(pe, self.rank, payload))
                    answered.add(pe)
                elif kind == "answer" and pe not in verified:
                    if not hmac.compare_digest(payload, self._handshake_mac(self.rank, pe, nonces[pe])):
                        raise CommError(f"init: PE {pe} on host {self.hosts[pe]!r} failed the network "
                                        "challenge: the process at its published address does not hold this "
                                        "group's secret; nothing it sent was applied")
                    self._net.authenticate(pe)
                    verified.add(pe)
            if time.monotonic() > deadline:
                late = sorted(set(remote) - verified)
                raise TimeoutError(f"init: remote PEs {late} did not answer this PE's network challenge within "
                                   f"{self.timeout} s" + (f" (and PEs {sorted(set(remote) - answered)} sent no "
                                                          "challenge)" if len(answered) < len(remote) else ""))
            time.sleep(0.0005)

    def _handshake_mac(self, challenger: int, answerer: int, nonce: bytes, what: bytes = b"asap-net-v1") -> bytes:
        return hmac.new(self._secret, b"\0".join([what, self._gs.prefix.encode(), str(challenger).encode(),
                                                   str(answerer).encode(), nonce]), "sha256").digest()

    def _liveness_lines(self) -> None:
        """One TCP connection per remote peer that carries no data: the engine watches it (``NetEngine.watch``),
        and the peer's kernel keeps it up exactly as long as the peer's process lives, however loaded or stopped
        the process is; a lost host or link fails its keepalive within the peer timeout. Each PE dials its remote
        peers of higher rank and accepts those of lower rank; the acceptor challenges the dialer (an HMAC with
        the group secret over 32 random bytes, bound to both ranks), so a line stands for the PE it names. The
        listening socket is bound to this host's address toward the store and closed once every line stands."""
        remote = [pe for pe in range(self.world_size) if self._remote[pe]]
        addr = _address_towards(self._master_addr)
        lst = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        lines: "dict[int, socket.socket]" = {}
        deadline = time.monotonic() + self.timeout
        try:
            lst.bind((addr, 0))
            lst.listen(max(1, len(remote)))
            self._gs.set(f"alive/{self.rank}", f"{addr} {lst.getsockname()[1]}")
            for pe in remote:
                if pe < self.rank:
                    continue
                host, port = self._gs.get_str(f"alive/{pe}", f"PE {pe}'s liveness address").split()
                s = socket.create_connection((host, int(port)), timeout=max(0.1, deadline - time.monotonic()))
                lines[pe] = s
                s.sendall(struct.pack("<I", self.rank))
                nonce = _recv_exact(s, 32, f"PE {pe}'s liveness challenge")
                s.sendall(self._handshake_mac(pe, self.rank, nonce, b"asap-line-v1"))
                if _recv_exact(s, 1, f"PE {pe}'s liveness verdict") != b"\1":
                    raise CommError(f"init: PE {pe} refused this PE's liveness line")
            expected = {pe for pe in remote if pe < self.rank}
            while expected:
                lst.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = lst.accept()
                except socket.timeout:
                    raise TimeoutError(f"init: remote PEs {sorted(expected)} did not open their liveness line to "
                                       f"this PE within {self.timeout} s") from None
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                try:  # an outsider's connection is dropped without an answer that could help it
                    (pe,) = struct.unpack("<I", _recv_exact(conn, 4, "a liveness line's rank"))
                    nonce = secrets.token_bytes(32)
                    conn.sendall(nonce)
                    proof = _recv_exact(conn, 32, f"PE {pe}'s liveness proof")
                    if pe not in expected or not hmac.compare_digest(
                            proof, self._handshake_mac(self.rank, pe, nonce, b"asap-line-v1")):
                        conn.close()
                        continue
                    conn.sendall(b"\1")
                except (OSError, CommError):
                    conn.close()
                    continue
                lines[pe] = conn
                expected.discard(pe)
            for pe, s in lines.items():
                self._net.watch(pe, s.fileno())  # the engine keeps its own descriptor
        except CommError:
            raise
        except OSError as e:
            raise CommError(f"init: setting up the liveness lines to the remote PEs failed ({addr}): {e}") from None
        finally:
            lst.close()
            for s in lines.values():
                s.close()

    def _unlink_own(self) -> None:
        while self._linked:
            _C.unlink_segment(self._linked.pop())

    @staticmethod
    def _finalize(linked) -> None:
        # Runs at garbage collection or interpreter exit if close() was not called.
        for name in linked:
            _C.unlink_segment(name)
        linked.clear()

    def _teardown(self) -> None:
        net = getattr(self, "_net", None)
        if net is not None:
            net.shutdown()  # says goodbye to remote PEs, stops its thread, frees UCX's resources
            self._net = None
        self._unlink_own()
        if getattr(self, "_secret_file", None) is not None:
            _unlink_quietly(self._secret_file)
            self._secret_file = None
        self._chunks = []
        self._allocs = {}
        self._fast = {}
        self.__dict__.pop("_coll_views", None)
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
            self._ctrl_maps = []
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
        return "shm" if not any(self._remote) else "auto"

    def is_remote(self, pe: int) -> bool:
        """True when PE ``pe`` is on another host (reached through the network engine)."""
        pe = self._check_pe("is_remote", pe)
        return self._remote[pe]

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
        ``disorder`` (messages applied out of send order: must stay 0) and ``bad_messages``."""
        return {} if self._net is None else dict(self._net.stats())

    # ------------------------------------------------------------ checks
    def _check_open(self, fn: str) -> None:
        if self._closed:
            raise CommError(f"{fn}: the communicator is closed")

    def _check_pe(self, fn: str, pe) -> int:
        if isinstance(pe, bool) or not isinstance(pe, int):
            raise TypeError(f"{fn}: pe must be an int, got {type(pe).__name__}")
        if not 0 <= pe < self.world_size:
            raise ValueError(f"{fn}: pe={pe} is out of range [0, {self.world_size})")
        return pe

    def _timeout(self, fn: str, timeout) -> float:
        if timeout is None:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"{fn}: timeout must be a number of seconds or None, got {timeout!r}")
        t = float(timeout)
        if not t >= 0 or math.isinf(t):
            raise ValueError(f"{fn}: timeout must be finite and >= 0, got {timeout!r}")
        return t

    def _alloc_of(self, fn: str, name: str, t) -> _Alloc:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        a = self._allocs.get(t.untyped_storage().data_ptr())
        if a is None:
            raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, dtype {t.dtype}) is not a symmetric "
                             "tensor of this communicator; allocate it with comm.empty/zeros/signals")
        return a

    def _info(self, fn: str, name: str, t, symmetric: bool) -> tuple:
        """Validated, cached facts about a tensor for the fast path.

        (tensor, data_ptr, nbytes, dtype, contiguous, shape, deltas|None, numel, stride0)
        The tensor is held so its id cannot be reused while cached; symmetric
        storage cannot be resized, so the cached layout stays true for it.
        """
        self._check_open(fn)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{fn}: {name} is on {t.device}; the shm backend moves CPU tensors only")
        deltas = None
        if symmetric:
            deltas = self._alloc_of(fn, name, t).chunk.deltas
        info = (t, t.data_ptr(), t.nbytes, t.dtype, t.is_contiguous(), tuple(t.shape), deltas, t.numel(),
                t.stride(0) if t.dim() == 1 else 0)
        if symmetric:
            if len(self._fast) >= _FAST_CACHE_MAX:
                self._fast.clear()
            self._fast[id(t)] = info
        return info

    def _sig_addr(self, fn: str, sig, idx) -> tuple:
        """(info, address of word idx on this PE) for a signal array."""
        g = self._fast.get(id(sig)) or self._info(fn, "sig", sig, symmetric=True)
        if g[3] is not torch.uint64 or g[8] == 0:
            raise ValueError(f"{fn}: sig must be a 1-D torch.uint64 symmetric tensor (comm.signals(n)), "
                             f"got dtype {g[3]} shape {g[5]}")
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise TypeError(f"{fn}: idx must be an int, got {type(idx).__name__}")
        if not 0 <= idx < g[7]:
            raise ValueError(f"{fn}: idx={idx} is out of range [0, {g[7]}) of the signal array")
        return g, g[1] + idx * 8 * g[8]

    @staticmethod
    def _check_value(fn: str, value) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: value must be an int, got {type(value).__name__}")
        if not 0 <= value <= _U64_MAX:
            raise ValueError(f"{fn}: value={value} does not fit an unsigned 64-bit signal word")
        return value

    # ------------------------------------------------------------ symmetric heap
    def _grow(self, min_bytes: int) -> _Chunk:
        size = max(self._chunk_bytes, _round_up(min_bytes, 4096))
        index = len(self._chunks)
        name = self._new_name()
        local = _C.create_segment(name, size)
        self._linked.append(name)
        try:
            self._gs.set(f"chunk/{index}/{self.rank}", f"{name}:{size}")
            peers = []
            for pe in range(self.world_size):
                if pe == self.rank:
                    peers.append(local)
                    continue
                if self._remote[pe]:
                    peers.append(None)
                    continue
                peer_name, peer_size = self._gs.get_str(f"chunk/{index}/{pe}",
                                                        f"PE {pe}'s heap chunk {index}").rsplit(":", 1)
                if int(peer_size) != size:
                    raise CommError(f"alloc: PE {pe} created heap chunk {index} with {peer_size} bytes, "
                                    f"this PE with {size}: collective calls were made in a different order")
                peers.append(_C.map_segment(peer_name, size))
            if self._net is not None:
                self._net.add_region(index + 1, local)  # remote PEs name it as region index + 1
            self.barrier()  # every PE has mapped every chunk
        finally:
            self._unlink_own()
        deltas = [None if mp is None else mp.addr - local.addr for mp in peers]
        chunk = _Chunk(index, size, 0, local, peers, deltas, local.addr, [None] * self.world_size)
        self._chunks.append(chunk)
        return chunk

    def _alloc(self, fn: str, nbytes: int) -> _Alloc:
        self._check_open(fn)
        need = _round_up(max(nbytes, 1), _ALIGN)
        for chunk in self._chunks:
            if chunk.size - chunk.used >= need:
                break
        else:
            chunk = self._grow(need)
        _reserve(fn, chunk.local, chunk.used, need, "this PE's symmetric heap")
        a = _Alloc(chunk, chunk.used, need)
        chunk.used += need
        return a

    def _tensor_of(self, a: _Alloc, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        raw = torch.frombuffer(a.chunk.local, dtype=torch.uint8, count=a.nbytes, offset=a.offset)
        t = raw[: numel * itemsize].view(dtype).view(shape)
        self._allocs[t.untyped_storage().data_ptr()] = a
        return t

    @staticmethod
    def _shape(fn: str, shape) -> tuple:
        if isinstance(shape, int):
            shape = (shape,)
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError:
            raise TypeError(f"{fn}: shape must be an int or a sequence of ints, got {shape!r}") from None
        if any(s < 0 for s in shape):
            raise ValueError(f"{fn}: shape {shape} has a negative dimension")
        return shape

    # ------------------------------------------------------------ collective calls
    # Every collective allocation publishes "call #k is <description>" in this
    # PE's control page (two slots, k % 2: a PE can be at most one collective
    # call ahead of any other, because each ends with a barrier). After the
    # barrier every PE checks that every peer made the same call #k; when the
    # call cannot complete, the error names the call and what each peer did.
    def _coll_view(self, pe: int) -> torch.Tensor:
        if self._remote[pe]:  # a copy, read across the network (collective calls are set-up time)
            v = torch.zeros(2 * _C.CTRL_COLL_SLOT_BYTES, dtype=torch.uint8)
            try:
                self._net.get(pe, 0, _C.CTRL_COLL_OFFSET, v, 0, v.numel(), min(self.timeout, 5.0))
            except Exception:  # a dead or closed peer: reported by the caller's own error
                pass
            return v
        views = self.__dict__.setdefault("_coll_views", {})
        v = views.get(pe)
        if v is None:
            page = torch.frombuffer(self._ctrl_maps[pe], dtype=torch.uint8)
            v = page[_C.CTRL_COLL_OFFSET: _C.CTRL_COLL_OFFSET + 2 * _C.CTRL_COLL_SLOT_BYTES]
            views[pe] = v
        return v

    def _coll_read(self, pe: int, k: int) -> "tuple[int, str]":
        """(call number, description) in slot k % 2 of PE ``pe``'s control page."""
        slot = self._coll_view(pe)[(k % 2) * _C.CTRL_COLL_SLOT_BYTES:][: _C.CTRL_COLL_SLOT_BYTES]
        head = slot[:16].view(torch.int64)
        n, length = int(head[0]), int(head[1])
        length = max(0, min(length, _C.CTRL_COLL_SLOT_BYTES - 16))
        return n, bytes(slot[16: 16 + length].tolist()).decode("utf-8", "replace")

    def _coll_last(self, pe: int) -> "tuple[int, str]":
        """The newest collective call PE ``pe`` published: (number, description); (0, '') if none."""
        a, b = self._coll_read(pe, 0), self._coll_read(pe, 1)
        return max(a, b)

    def _coll_progress(self, pe: int, verb: str) -> str:
        """'PE p <verb> n collective calls (its last: ...)', for error messages."""
        n, d = self._coll_last(pe)
        return f"PE {pe} {verb} {n} collective calls" + (f" (its last: {d})" if d else "")

    def _coll_publish(self, desc: str) -> int:
        k = self.__dict__.get("_coll_n", 0) + 1
        self._coll_n = k
        raw = desc.encode()[: _C.CTRL_COLL_SLOT_BYTES - 16]
        slot = self._coll_view(self.rank)[(k % 2) * _C.CTRL_COLL_SLOT_BYTES:][: _C.CTRL_COLL_SLOT_BYTES]
        slot[16: 16 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else slot[16:16]
        slot[:16].view(torch.int64).copy_(torch.tensor([k, len(raw)], dtype=torch.int64))
        _C.fence()  # published before this PE arrives at the call's barrier
        return k

    def _coll_mismatch(self, k: int, desc: str) -> "str | None":
        """After call #k's barrier: a description of every peer whose call #k differs, or None."""
        bad = []
        for pe in range(self.world_size):
            if pe == self.rank:
                continue
            n, d = self._coll_read(pe, k)
            if n != k:
                bad.append(self._coll_progress(pe, "had made"))
            elif d != desc:
                bad.append(f"PE {pe}'s call #{k} is {d}")
        return "; ".join(bad) or None

    def _collective(self, fn: str, desc: str, body):
        """Runs a collective allocation ``body`` then the closing barrier, naming the call on failure."""
        self._check_open(fn)
        k = self._coll_publish(desc)
        try:
            result = body()
            self.barrier()
        except (TimeoutError, PeerFailure) as e:
            late = [self._coll_progress(pe, "has made") for pe in range(self.world_size)
                    if pe != self.rank and self._coll_last(pe)[0] < k and self.peer_alive(pe)]
            hint = ("; ".join(late) + "; " if late else "") + \
                "every PE must make the same collective calls (empty, zeros, signals, mailbox) in the same order"
            msg = f"{fn}: collective call #{k}, {desc}, did not complete: {hint} ({e})"
            if isinstance(e, PeerFailure):
                raise PeerFailure(msg, pe=e.pe, reason=e.reason) from None
            raise TimeoutError(msg) from None
        bad = self._coll_mismatch(k, desc)
        if bad is not None:
            raise CommError(f"{fn}: collective calls do not match: this PE's call #{k} is {desc}, but {bad}; every PE "
                            "must make the same collective calls (empty, zeros, signals, mailbox) with the same "
                            "arguments in the same order")
        return result

    def empty(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a symmetric tensor, uninitialised (zero on first use).

        Every PE must call it with the same shape and dtype in the same order.
        Returns once every PE's copy exists, so peers may put into it at once.
        """
        shape = self._shape("empty", shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"empty: dtype must be a torch.dtype, got {dtype!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()

        def body():
            a = self._alloc("empty", math.prod(shape) * itemsize)
            return self._tensor_of(a, shape, dtype)

        return self._collective("empty", f"empty(shape={shape}, dtype={dtype})", body)

    def zeros(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Collective: a symmetric tensor filled with zeros on every PE.

        On return every PE's copy is zeroed (a barrier follows the fill).
        """
        return self._zeros("zeros", shape, dtype)

    def _zeros(self, fn: str, shape, dtype, desc: "str | None" = None) -> torch.Tensor:
        shape = self._shape(fn, shape)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()

        def body():
            a = self._alloc(fn, math.prod(shape) * itemsize)
            t = self._tensor_of(a, shape, dtype)
            if t.numel():
                t.zero_()
            return t

        return self._collective(fn, desc or f"zeros(shape={shape}, dtype={dtype})", body)

    def signals(self, n: int) -> torch.Tensor:
        """Collective: ``n`` zeroed uint64 signal words, a 1-D symmetric tensor ``[n]``."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"signals: n must be an int, got {type(n).__name__}")
        if n <= 0:
            raise ValueError(f"signals: n={n} must be positive")
        return self._zeros("signals", (n,), torch.uint64, f"signals(n={n})")

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
            self._allocs[buf.untyped_storage().data_ptr()] = a
            return Mailbox(self, buf, base, a.chunk.deltas, slot_bytes, num_slots)

        return self._collective("mailbox", f"mailbox(slot_bytes={slot_bytes}, num_slots={num_slots})", body)

    # ------------------------------------------------------------ remote views
    def _peer_u8(self, chunk: _Chunk, pe: int) -> torch.Tensor:
        t = chunk.u8[pe]
        if t is None:
            t = torch.frombuffer(chunk.peers[pe], dtype=torch.uint8)
            chunk.u8[pe] = t
        return t

    def _remote_view(self, t: torch.Tensor, a: _Alloc, pe: int) -> torch.Tensor:
        """``t`` (a view of a symmetric allocation) as the same bytes on PE ``pe``."""
        itemsize = t.element_size()
        typed = self._peer_u8(a.chunk, pe)[a.offset: a.offset + a.nbytes].view(t.dtype)
        return typed.as_strided(t.shape, t.stride(), a.offset // itemsize + t.storage_offset())

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
        a = self._alloc_of("remote", "t", t)
        if pe == self.rank:
            return t
        if self._remote[pe]:
            raise CommError(f"remote: PE {pe} is on host {self.hosts[pe]!r}, this PE on {self.host_id!r}: remote() "
                            "aliases a peer's memory and exists only between PEs of one host (backend 'shm'); "
                            "use put/get/put_signal, which work on every backend")
        return self._remote_view(t, a, pe)

    def _check_pair(self, fn: str, dst, src) -> None:
        for nm, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {nm} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{fn}: {nm} is on {t.device}; the shm backend moves CPU tensors only")
        if dst.dtype != src.dtype:
            raise ValueError(f"{fn}: dtype mismatch: dst {dst.dtype} vs src {src.dtype}")
        if dst.shape != src.shape:
            raise ValueError(f"{fn}: shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")

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
        self._check_pair("put", dst, src)
        if dst.numel() == 0:
            return
        if self._remote[pe]:
            self._net_put(pe, a, dst, src)
            return
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes < _COPY_WITH_TORCH:
            _C.copy_to(dst.data_ptr() + a.chunk.deltas[pe], src, dst.nbytes)
        else:
            self._remote_view(dst, a, pe).copy_(src)

    def get(self, dst: torch.Tensor, src: torch.Tensor, pe: int) -> None:
        """Read the bytes that ``src`` (a symmetric tensor or view) names on PE ``pe`` into ``dst``.

        Ordering: blocking; on return ``dst`` holds the values. To read what
        ``pe`` published, first observe its signal (acquire), then ``get``.
        """
        self._check_open("get")
        pe = self._check_pe("get", pe)
        a = self._alloc_of("get", "src", src)
        self._check_pair("get", dst, src)
        if dst.numel() == 0:
            return
        if self._remote[pe]:
            self._net_get(pe, a, dst, src)
            return
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes < _COPY_WITH_TORCH:
            _C.copy_from(dst, src.data_ptr() + a.chunk.deltas[pe], dst.nbytes)
        else:
            dst.copy_(self._remote_view(src, a, pe))

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
        (``_C.PreparedPutSignal``) that performs it, or None for a call no handle expresses (a strided view;
        on this host, a copy of ``_COPY_WITH_TORCH`` bytes or more unless ``any_size``), which
        ``_put_signal_slow`` composes from ``put`` and the signal. Returns (pe, op code, handle)."""
        self._check_open(fn)
        pe = self._check_pe(fn, pe)
        if op not in _OPS:
            raise ValueError(f"{fn}: op must be 'set' or 'add', got {op!r}")
        d = self._info(fn, "dst", dst, symmetric=True)
        self._check_pair(fn, dst, src)
        g, addr = self._sig_addr(fn, sig, idx)
        if not (d[4] and src.is_contiguous()) or (d[2] >= _COPY_WITH_TORCH and not any_size and not self._remote[pe]):
            return pe, _OPS[op], None
        keep = (dst, src, sig, self._group)
        if self._remote[pe]:
            da = self._alloc_of(fn, "dst", dst)
            target = (da.chunk.index + 1, d[1] - da.chunk.base) if d[2] else (0, 0)
            sig_target = self._region_of(fn, sig, addr, 8)
            owner = 0
        else:
            keep += (self._alloc_of(fn, "dst", dst).chunk.peers[pe], self._alloc_of(fn, "sig", sig).chunk.peers[pe])
            target, sig_target, owner = d[1] + d[6][pe], addr + g[6][pe], self._ctrl[pe]
        return pe, _OPS[op], _C.make_put_signal(fn, self._ghandle, pe, src, d[2], _OPS[op], target, sig_target,
                                                owner, keep)

    def _put_signal_slow(self, dst, src, pe, sig, idx, value, op="set") -> None:
        pe, code, h = self._put_signal_handle("put_signal", dst, src, pe, sig, idx, op, any_size=False)
        if h is None:  # a strided or large put: the data, then the signal (applied after it)
            value = self._check_value("put_signal", value)
            self.put(dst, src, pe)
            g, addr = self._sig_addr("put_signal", sig, idx)
            if self._remote[pe]:
                region, off = self._region_of("put_signal", sig, addr, 8)
                self._net.signal(pe, region, off, value, code, False, self.timeout)
            else:
                _C.signal_update(addr + g[6][pe], value, code, self._ctrl[pe])
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
        value = self._check_value("signal_op", value)
        g, addr = self._sig_addr("signal_op", sig, idx)
        if self._remote[pe]:
            region, off = self._region_of("signal_op", sig, addr, 8)
            return self._net.signal(pe, region, off, value, _OPS[op], True, self.timeout)
        return _C.signal_update(addr + g[6][pe], value, _OPS[op], self._ctrl[pe])

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

    def _peer_mask(self, fn: str, peers) -> bytes:
        """``peers`` (an iterable of PEs) as a world_size-byte mask for the native wait."""
        if isinstance(peers, (str, bytes, torch.Tensor)) or not hasattr(peers, "__iter__"):
            raise TypeError(f"{fn}: peers must be an iterable of PEs (ints) or None, got {peers!r}")
        mask = bytearray(self.world_size)
        for pe in peers:
            if isinstance(pe, bool) or not isinstance(pe, int):
                raise TypeError(f"{fn}: peers must hold ints, got {pe!r}")
            if not 0 <= pe < self.world_size:
                raise ValueError(f"{fn}: peers holds pe={pe}, out of range [0, {self.world_size})")
            mask[pe] = 1
        if not any(mask):
            raise ValueError(f"{fn}: peers is empty; name at least one PE that may satisfy the wait")
        return bytes(mask)

    def _wait_handle(self, fn: str, sig, idx, cmp, timeout, peers):
        """The one validating path of signal_wait_until: the native handle (``_C.PreparedWait``) waiting for
        ``sig[idx] <cmp> value``, with ``timeout`` as its default (None: the communicator's)."""
        self._check_open(fn)
        c = _CMPS.get(cmp) if isinstance(cmp, str) else None
        if c is None:
            raise ValueError(f"{fn}: cmp must be one of {list(_CMPS)}, got {cmp!r}")
        t = self._timeout(fn, timeout)
        mask = None if peers is None else self._peer_mask(fn, peers)
        _, addr = self._sig_addr(fn, sig, idx)
        return _C.make_wait(fn, self._ghandle, addr, c, self._ctrl_local, t,
                            _C.DEP_ANY if mask is None else _C.DEP_SET, mask,
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
        _C.fence()

    def quiet(self) -> None:
        """Complete: every put this PE issued is in its target's memory on return.

        Across hosts this is one round trip to each remote PE written to since
        the last ``quiet``."""
        self._check_open("quiet")
        _C.fence()
        if self._net is not None:
            self._net.quiet(self.timeout)

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
        if self.world_size == 1:
            _C.fence()
            return
        if self._net is not None:
            self._barrier_net(t)
            return
        ctrl0 = self._ctrl[0]
        gen = ctrl0 + _C.BARRIER_GEN_OFFSET
        if self._barrier_pending is None:
            self._epoch += 1
            k = self._epoch
            if _C.signal_update(ctrl0 + _C.BARRIER_ARRIVE_OFFSET, 1, 1, ctrl0) == k * self.world_size - 1:
                _C.signal_update(gen, k, 0, ctrl0)  # last to arrive: release everyone
                self._barrier_done(k)
                return
        else:
            k = self._barrier_pending  # a retry after a timeout: already arrived
        self._barrier_pending = k
        self._ctrl_wait(gen, ctrl0, "barrier: waiting for barrier #", _C.DEP_BARRIER)(k, t)
        self._barrier_pending = None
        self._barrier_done(k)

    def _barrier_done(self, k: int) -> None:
        """Record round ``k`` as completed by this PE (read by peers that outlive it, see ``barrier``)."""
        _C.signal_update(self._ctrl_local + _C.BARRIER_DONE_OFFSET, k, 0, self._ctrl_local)

    def _ctrl_wait(self, addr: int, owner: int, what: str, dep: int):
        """The barrier's wait handle (``>=``) for control word ``addr`` of PE ``owner``'s control block; ``what``
        prefixes its errors, completed by the awaited value. ``dep``: ``DEP_BARRIER`` for a wait whose value is
        the round (a PE that closed after completing it is not a failure), ``DEP_ALL`` otherwise."""
        waits = self.__dict__.setdefault("_ctrl_waits", {})
        h = waits.get(addr)
        if h is None:
            h = waits[addr] = _C.make_wait("barrier", self._ghandle, addr, _CMPS[">="], owner, self.timeout,
                                           dep, None, what, (self._group,))
        return h

    def _barrier_net(self, t: float) -> None:
        """The barrier of a group that spans hosts: every PE completes its puts (``quiet``), then
        announces itself to PE 0 (an atomic add on PE 0's arrival word); PE 0 waits for all, then
        raises every PE's own generation word. Each message is applied after everything its
        sender issued before it, so whatever any PE wrote before the barrier is visible after."""
        ctrl = self._ctrl_local
        arrive_off, gen_off = _C.BARRIER_ARRIVE_OFFSET, _C.BARRIER_GEN_OFFSET
        if self._barrier_pending is None:
            self._epoch += 1
            k = self._epoch
            self._net.quiet(t)
            _C.fence()
            if self.rank == 0:
                _C.signal_update(ctrl + arrive_off, 1, 1, ctrl)
            elif self._remote[0]:
                self._net.signal(0, 0, arrive_off, 1, 1, False, t)
            else:
                _C.signal_update(self._ctrl[0] + arrive_off, 1, 1, self._ctrl[0])
        else:
            k = self._barrier_pending
        self._barrier_pending = k
        if self.rank == 0:
            if self._barrier_released < k:
                self._ctrl_wait(ctrl + arrive_off, ctrl, "barrier: waiting for every PE to arrive, count >= ",
                                _C.DEP_ALL)(k * self.world_size, t)
                for pe in range(1, self.world_size):
                    if self._remote[pe]:
                        self._net.signal(pe, 0, gen_off, k, 0, False, t)
                    else:
                        _C.signal_update(self._ctrl[pe] + gen_off, k, 0, self._ctrl[pe])
                self._barrier_released = k
        else:
            self._ctrl_wait(ctrl + gen_off, ctrl, "barrier: waiting for barrier #", _C.DEP_BARRIER)(k, t)
        self._barrier_pending = None
        self._barrier_done(k)

    # ------------------------------------------------------------ across hosts
    def _region_of(self, fn: str, t: torch.Tensor, addr: int, nbytes: int) -> "tuple[int, int]":
        """(region, offset) naming ``nbytes`` at ``addr`` inside symmetric tensor ``t`` for remote PEs."""
        a = self._alloc_of(fn, "tensor", t)
        off = addr - a.chunk.base
        if not 0 <= off <= a.chunk.size - nbytes:
            raise ValueError(f"{fn}: range [{off}, {off + nbytes}) lies outside heap chunk {a.chunk.index}")
        return a.chunk.index + 1, off

    @staticmethod
    def _runs(t: torch.Tensor) -> "list[tuple[int, int]]":
        """Byte runs (offset from t.data_ptr(), nbytes) covering view ``t`` in element order."""
        es = t.element_size()
        if t.is_contiguous():
            return [(0, t.numel() * es)]
        idx = torch.as_strided(torch.arange(t.storage_offset() + 1 + sum((s - 1) * abs(st) for s, st in
                                                                         zip(t.shape, t.stride()))),
                               t.shape, t.stride(), t.storage_offset()).reshape(-1) - t.storage_offset()
        runs: "list[tuple[int, int]]" = []
        if idx.numel() == 0:
            return runs
        brk = torch.nonzero(idx[1:] - idx[:-1] != 1).reshape(-1) + 1
        starts = [0] + brk.tolist()
        ends = brk.tolist() + [idx.numel()]
        first = idx[starts].tolist()
        return [(f * es, (e - s) * es) for f, s, e in zip(first, starts, ends)]

    def _net_put(self, pe: int, a: _Alloc, dst: torch.Tensor, src: torch.Tensor) -> None:
        src = src.contiguous()
        base = dst.data_ptr() - a.chunk.base
        pos = 0
        for off, n in self._runs(dst):
            self._net.put(pe, a.chunk.index + 1, base + off, src, pos, n)
            pos += n

    def _net_get(self, pe: int, a: _Alloc, dst: torch.Tensor, src: torch.Tensor) -> None:
        out = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype)
        base = src.data_ptr() - a.chunk.base
        pos = 0
        for off, n in self._runs(src):
            self._net.get(pe, a.chunk.index + 1, base + off, out, pos, n, self.timeout)
            pos += n
        if out is not dst:
            dst.copy_(out)

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


def _reserve(fn: str, mapping, offset: int, nbytes: int, what: str) -> None:
    """Allocate ``nbytes`` at ``offset`` of this PE's own segment for real (segments are created sparse, and a
    page that a full /dev/shm cannot back would raise SIGBUS when first touched, in this PE or in a peer)."""
    err = mapping.reserve(offset, nbytes)
    if err == 0:
        return
    try:
        st = os.statvfs("/dev/shm")
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = total = 0
    raise OutOfSharedMemory(f"{fn}: cannot allocate {what} in shared memory: /dev/shm has {free} bytes free "
                            f"(of {total}), {nbytes} wanted ({os.strerror(err)}); free space there or enlarge it "
                            "(e.g. mount -o remount,size=4g /dev/shm, or docker run --shm-size=4g)",
                            path="/dev/shm", wanted=nbytes, free=free)


def _recv_exact(s: socket.socket, n: int, what: str) -> bytes:
    out = b""
    while len(out) < n:
        got = s.recv(n - len(out))
        if not got:
            raise CommError(f"init: the connection closed while waiting for {what}")
        out += got
    return out


def _address_towards(target: "str | None") -> str:
    """The address peers on other hosts reach this host at: ``$ASAP_NET_ADDR`` if set, else this host's address
    on the route toward ``target`` (the store's host), else a non-loopback address its hostname resolves to."""
    override = os.environ.get("ASAP_NET_ADDR")
    if override:
        return override
    candidates = []
    if target:
        try:
            family = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # a datagram socket's connect sends nothing: it picks the route
                candidates.append(s.getsockname()[0])
        except OSError:
            pass
    for name in (socket.gethostname(), socket.getfqdn()):
        try:
            candidates += [info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)]
        except OSError:
            pass
    for addr in candidates:
        if not addr.startswith("127.") and addr != "::1":
            return addr
    raise CommError(f"init: this group spans hosts, but no address of this host ({socket.gethostname()}) other "
                    f"than loopback was found toward {target or 'the store'} (seen: {sorted(set(candidates))}); "
                    "set ASAP_NET_ADDR to the address its peers reach it at")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _host_id() -> str:
    """This host's identity: ``$ASAP_HOST_ID`` if set, else the hostname (as on real clusters)."""
    v = os.environ.get("ASAP_HOST_ID")
    if v:
        return v
    import socket

    return socket.gethostname()


def _host_summary(hosts: "list[str]") -> str:
    by: "dict[str, list[int]]" = {}
    for pe, h in enumerate(hosts):
        by.setdefault(h, []).append(pe)
    return ", ".join(f"{h!r}: PEs {pes}" for h, pes in by.items())


def load_net(why: str) -> "tuple[str, float]":
    """Load UCX (from the libucx wheel) for the network engine; returns (UCX transports, peer timeout in s).
    ``why`` says who needs it, for the error when the backend is missing."""
    if not getattr(_C, "NET_AVAILABLE", False):
        raise CommError(f"init: {why}, but asap_comm was built without the network backend (UCX headers were "
                        "missing at build time): reinstall with pip install -e \".[net]\" (or set UCX_HOME) so "
                        "that kernels/net.cpp is compiled")
    try:
        import libucx
    except ImportError:
        raise CommError(f"init: {why} and needs the network backend: pip install 'asap-comm[net]' (from a clone: "
                        "pip install -e \".[net]\"), which installs UCX (libucx-cu12)") from None
    # UCX's InfiniBand and CUDA modules are left out unless the user asks for them: without the hardware they
    # only slow start-up, and the bundled InfiniBand module crashes at exit on hosts without it.
    os.environ.setdefault("UCX_MODULES", "^ib,cuda")
    lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
    libucx.load_library()
    _C.net_load(os.path.join(lib, "libucp.so"), os.path.join(lib, "libucs.so"))
    tls = "" if "UCX_TLS" in os.environ else "tcp"  # same-host peers use shared memory, not UCX
    return tls, float(os.environ.get("ASAP_NET_PEER_TIMEOUT_S", "5"))


def _net_engine(comm: "Communicator"):
    """The network engine of a group that spans hosts."""
    tls, peer_timeout = load_net("this group spans hosts (" + _host_summary(comm.hosts) + ")")
    try:
        return _C.NetEngine(comm._group, comm._ctrl_local, peer_timeout, tls)
    except RuntimeError as e:
        raise CommError(f"init: starting the network engine failed: {e}") from None


def _env_int(name: str, fn: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise ValueError(f"{fn}: {name.lower()} not given and ${name} is not set "
                         "(pass it, or start the processes with torchrun or asap_comm.launch)")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{fn}: ${name}={v!r} is not an integer") from None


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
    if backend is None:
        backend = os.environ.get("ASAP_BACKEND") or "auto"
    if backend not in ("auto", "shm"):
        raise ValueError(f"init: backend={backend!r} is not available; built backends: ['auto', 'shm'] "
                         "(auto: shared memory within a host, the network engine across hosts; cuda and npu "
                         "are planned, see DESIGN.md)")
    rank = _env_int("RANK", "init") if rank is None else rank
    world_size = _env_int("WORLD_SIZE", "init") if world_size is None else world_size
    for nm, v in (("rank", rank), ("world_size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"init: {nm} must be an int, got {type(v).__name__}")
    if world_size < 1:
        raise ValueError(f"init: world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"init: rank={rank} is out of range [0, {world_size})")
    t = float(timeout)
    if not t > 0 or math.isinf(t):
        raise ValueError(f"init: timeout={timeout!r} must be a finite number of seconds > 0")
    if heap_chunk_bytes is None:
        heap_chunk_bytes = int(os.environ.get("ASAP_HEAP_CHUNK_BYTES", _DEFAULT_CHUNK))
    if heap_chunk_bytes < 4096:
        raise ValueError(f"init: heap_chunk_bytes={heap_chunk_bytes} must be >= 4096")
    heap_chunk_bytes = _round_up(heap_chunk_bytes, 4096)
    if shm_prefix is None:
        shm_prefix = os.environ.get("ASAP_SHM_PREFIX", "asap-")
    if "/" in shm_prefix or len(shm_prefix) > 64:
        raise ValueError(f"init: shm_prefix={shm_prefix!r} must not contain '/' and be at most 64 chars")
    if store is None:
        addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR")
        port = master_port if master_port is not None else os.environ.get("MASTER_PORT")
        if addr is None or port is None:
            raise ValueError("init: master_addr/master_port not given and $MASTER_ADDR/$MASTER_PORT not set")
        try:
            port = int(port)
        except ValueError:
            raise ValueError(f"init: master_port={port!r} is not an integer") from None
        from torch.distributed import TCPStore

        is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        try:
            if is_master:  # listens on master_addr only, not on every interface
                store = bound_store(addr, port, world_size, t)
            else:
                store = TCPStore(addr, port, None, False, timedelta(seconds=t))
        except Exception as e:
            if is_master and port != 0 and ("in use" in str(e).lower() or getattr(e, "errno", None) == 98):
                with _registry_lock:
                    mine = [c for c in _registry.values() if not c.closed and c._hosted == (addr, port)]
                if mine:
                    raise CommError(f"init: a communicator is already open on {addr}:{port} in this process "
                                    f"(id {mine[0].id}, rank {mine[0].rank} of {mine[0].world_size}, hosting its "
                                    "store); close it first, or pass another master_port") from None
                raise CommError(f"init: cannot host the TCPStore at {addr}:{port}: the address is in use by another "
                                f"process (a communicator still open elsewhere?); pick a free port ({e})") from None
            raise CommError(f"init: cannot {'host' if is_master else 'reach'} the TCPStore at "
                            f"{addr}:{port}: {e}") from None
        comm = Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                            shm_prefix=shm_prefix, backend=backend, group_secret=group_secret, master_addr=addr)
        if is_master:
            comm._hosted = (addr, port)
        return comm
    return Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                        shm_prefix=shm_prefix, backend=backend, group_secret=group_secret)


def _by_id(comm_id: int) -> Communicator:
    """The communicator an op refers to: ``comm_id`` or, for -1, the newest open one."""
    with _registry_lock:
        if comm_id == -1:
            live = [c for c in _registry.values() if not c.closed]
            if not live:
                raise CommError("asap_comm op: no open communicator in this process (call asap_comm.init)")
            return max(live, key=lambda c: c.id)
        c = _registry.get(comm_id)
    if c is None or c.closed:
        raise CommError(f"asap_comm op: communicator id {comm_id} is unknown or closed")
    return c
