"""The network transport: a peer on another host, reached through the UCX engine (``_C.NetEngine``).

:class:`NetLink` is the group's one engine and how it is set up: loading UCX, the authenticated handshake
with every remote peer, and the liveness lines; :class:`NetTransport` is one remote peer on it. On the
wire, heap chunk ``i`` is region ``i + 1`` (an offset within it from the allocation record) and the control
block is named by control-word id (docs/design.md, "Transports").
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import time

import torch

from .._native import _C
from ..errors import CommError, TimeoutError
from ..rendezvous import host_summary
from .base import CTRL_RECORDS, Transport, ctrl_span

__all__ = ["NetLink", "NetTransport", "load_net"]


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


class NetLink:
    """The network engine of a group that spans hosts, shared by its :class:`NetTransport` s.

    Built in bootstrap: ``NetLink(...)`` starts the engine and publishes its address; ``connect`` (once
    every PE published) connects to the remote PEs, authenticates them, opens the liveness lines and
    starts the engine's progress thread."""

    def __init__(self, rank: int, world_size: int, hosts: "list[str]", group, ghandle, ctrl_local: int, gs,
                 secret: bytes, timeout: float, master_addr: "str | None") -> None:
        self.rank, self.world_size, self.hosts, self.timeout = rank, world_size, hosts, timeout
        self.group, self.ghandle = group, ghandle
        self._gs, self._secret, self._master_addr = gs, secret, master_addr
        self._regions: "set[int]" = set()
        self.peers: "list[int]" = []  # the remote PEs, ascending (each NetTransport adds its own)
        tls, peer_timeout = load_net("this group spans hosts (" + host_summary(hosts) + ")")
        try:
            self.engine = _C.NetEngine(group, ctrl_local, peer_timeout, tls)
        except RuntimeError as e:
            raise CommError(f"init: starting the network engine failed: {e}") from None
        gs.set(f"net/{rank}", self.engine.address())

    def connect(self) -> None:
        gs, remote = self._gs, self.peers
        addrs = {pe: gs.get(f"net/{pe}", f"PE {pe}'s network address") for pe in remote}  # every one checked
        for pe, addr in addrs.items():  # before any is used
            self.engine.connect(pe, addr)
        self._handshake(remote)
        self._liveness_lines(remote)
        self.engine.start()

    def add_region(self, index: int, local) -> None:
        """Heap chunk ``index`` (``local``: this PE's mapping) as region ``index + 1`` for remote PEs."""
        if index not in self._regions:
            self._regions.add(index)
            self.engine.add_region(index + 1, local)

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()  # says goodbye to remote PEs, stops its thread, frees UCX's resources

    def _mac(self, challenger: int, answerer: int, nonce: bytes, what: bytes = b"asap-net-v1") -> bytes:
        return hmac.new(self._secret, b"\0".join([what, self._gs.prefix.encode(), str(challenger).encode(),
                                                   str(answerer).encode(), nonce]), "sha256").digest()

    def _handshake(self, remote: "list[int]") -> None:
        """Challenge-response with every remote PE on the endpoint opened to it: each PE sends each remote
        peer 32 random bytes and accepts the peer (``NetEngine.authenticate``) once the peer answers with the
        HMAC of them under the group secret, bound to this group, the challenger and the answerer. Until then
        the engine applies nothing the peer sends (it counts it as ``unauthenticated``)."""
        net = self.engine
        nonces = {pe: secrets.token_bytes(32) for pe in remote}
        for pe in remote:
            net.handshake_send(pe, False, nonces[pe])
        verified: "set[int]" = set()
        answered: "set[int]" = set()
        deadline = time.monotonic() + self.timeout
        while len(verified) < len(remote) or len(answered) < len(remote):
            net.poll()
            for pe, kind, payload in net.take_handshakes():
                if kind == "challenge" and pe not in answered:
                    net.handshake_send(pe, True, self._mac(pe, self.rank, payload))
                    answered.add(pe)
                elif kind == "answer" and pe not in verified:
                    if not hmac.compare_digest(payload, self._mac(self.rank, pe, nonces[pe])):
                        raise CommError(f"init: PE {pe} on host {self.hosts[pe]!r} failed the network "
                                        "challenge: the process at its published address does not hold this "
                                        "group's secret; nothing it sent was applied")
                    net.authenticate(pe)
                    verified.add(pe)
            if time.monotonic() > deadline:
                late = sorted(set(remote) - verified)
                raise TimeoutError(f"init: remote PEs {late} did not answer this PE's network challenge within "
                                   f"{self.timeout} s" + (f" (and PEs {sorted(set(remote) - answered)} sent no "
                                                          "challenge)" if len(answered) < len(remote) else ""))
            time.sleep(0.0005)

    def _liveness_lines(self, remote: "list[int]") -> None:
        """One TCP connection per remote peer that carries no data: the engine watches it (``NetEngine.watch``),
        and the peer's kernel keeps it up exactly as long as the peer's process lives, however loaded or stopped
        the process is; a lost host or link fails its keepalive within the peer timeout. Each PE dials its remote
        peers of higher rank and accepts those of lower rank; the acceptor challenges the dialer (an HMAC with
        the group secret over 32 random bytes, bound to both ranks), so a line stands for the PE it names. The
        listening socket is bound to this host's address toward the store and closed once every line stands."""
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
                s.sendall(self._mac(pe, self.rank, nonce, b"asap-line-v1"))
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
                            proof, self._mac(self.rank, pe, nonce, b"asap-line-v1")):
                        conn.close()
                        continue
                    conn.sendall(b"\1")
                except (OSError, CommError):
                    conn.close()
                    continue
                lines[pe] = conn
                expected.discard(pe)
            for pe, s in lines.items():
                self.engine.watch(pe, s.fileno())  # the engine keeps its own descriptor
        except CommError:
            raise
        except OSError as e:
            raise CommError(f"init: setting up the liveness lines to the remote PEs failed ({addr}): {e}") from None
        finally:
            lst.close()
            for s in lines.values():
                s.close()


class NetTransport(Transport):
    """PE ``pe`` on another host, through ``link``'s engine. Its memory is never mapped here."""

    kind = "net"

    def __init__(self, pe: int, link: NetLink) -> None:
        self.pe, self.engine, self._link = pe, link, link
        link.peers.append(pe)

    @property
    def _net(self):
        return self._link.engine

    def attach_chunk(self, gs, index: int, size: int, local):
        self._link.add_region(index, local)
        return None

    def put(self, dst: torch.Tensor, a, src: torch.Tensor) -> None:
        src = src.contiguous()
        base = dst.data_ptr() - a.chunk.base
        pos = 0
        for off, n in _runs(dst):
            self._net.put(self.pe, a.chunk.index + 1, base + off, src, pos, n)
            pos += n

    def get(self, dst: torch.Tensor, src: torch.Tensor, a) -> None:
        out = dst if dst.is_contiguous() else torch.empty(dst.shape, dtype=dst.dtype)
        base = src.data_ptr() - a.chunk.base
        pos = 0
        for off, n in _runs(src):
            self._net.get(self.pe, a.chunk.index + 1, base + off, out, pos, n, self._link.timeout)
            pos += n
        if out is not dst:
            dst.copy_(out)

    def put_signal_handle(self, fn, dst, da, src, nbytes, op, sig, sa, sig_addr, keep, any_size):
        target = (da.chunk.index + 1, dst.data_ptr() - da.chunk.base) if nbytes else (0, 0)
        return _C.make_put_signal(fn, self._link.ghandle, self.pe, src, nbytes, op, target,
                                  _region_of(fn, sa, sig_addr, 8), 0, keep)

    def signal_op(self, fn, sig, sa, sig_addr, value, op, fetch):
        region, off = _region_of(fn, sa, sig_addr, 8)
        return self._net.signal(self.pe, region, off, value, op, fetch, self._link.timeout)

    def ctrl_op(self, word, value, op, fetch, timeout):
        return self._net.signal_ctrl(self.pe, word, value, op, fetch, timeout)

    def read_records(self) -> torch.Tensor:
        v = torch.zeros(ctrl_span(CTRL_RECORDS)[1], dtype=torch.uint8)  # a copy: collective calls are set-up time
        try:
            self._net.get_ctrl(self.pe, CTRL_RECORDS, v, min(self._link.timeout, 5.0))
        except Exception:  # a dead or closed peer: reported by the caller's own error
            pass
        return v

    def fence(self) -> None:
        pass  # every message from one PE to another is applied in the order it was sent

    def fence_peer(self) -> bool:
        """Drop (and count, ``net_stats()["fenced"]``) whatever PE ``pe`` sends from now on; its waits fail."""
        self._net.fence(self.pe)
        return True

    def quiet(self, timeout: float) -> None:
        self._net.quiet(timeout)


def _region_of(fn: str, a, addr: int, nbytes: int) -> "tuple[int, int]":
    """(region, offset) naming ``nbytes`` at ``addr`` inside allocation ``a``'s chunk for remote PEs."""
    off = addr - a.chunk.base
    if not 0 <= off <= a.chunk.size - nbytes:
        raise ValueError(f"{fn}: range [{off}, {off + nbytes}) lies outside heap chunk {a.chunk.index}")
    return a.chunk.index + 1, off


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
