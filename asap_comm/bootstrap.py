"""Joining a group: the authenticated store exchange, this PE's segments, its peers' hosts, the transports.

``bootstrap(comm)`` runs once, inside :class:`asap_comm.Communicator`'s constructor: it resolves the group
secret, publishes this PE's host and control segment, learns every PE's host, refuses a group that spans
hosts without a shared secret (or with ``backend='shm'``), opens one transport per PE
(``asap_comm.transport.open_transports``) and, across hosts, connects and authenticates the network engine.
``check_init_args``/``open_store`` are the argument checks and the store of :func:`asap_comm.init`.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import socket
from datetime import timedelta

from ._native import _C
from .collective import Barrier, Records
from .errors import CommError
from .heap import reserve, round_up
from .rendezvous import GroupStore, Keeper, bound_store, host_summary, resolve_secret, spans_hosts_without_secret
from .transport import NetLink, open_transports

__all__ = ["Segments", "bootstrap", "check_init_args", "host_id", "open_store", "unlink_quietly"]

DEFAULT_CHUNK = 64 << 20
_log = logging.getLogger("asap_comm.rendezvous")


class Segments:
    """The shared-memory segments this PE created under the group's name prefix; each is unlinked as soon as
    every peer has mapped it (``unlink_own``), or at exit (``finalize``) if the PE never got that far."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.linked: "list[str]" = []  # names this PE created and has not unlinked

    def create(self, size: int) -> tuple:
        """(name, mapping) of a new segment of ``size`` bytes (sparse until reserved)."""
        name = f"/{self.prefix}{secrets.token_hex(16)}"
        mapping = _C.create_segment(name, size)
        self.linked.append(name)
        return name, mapping

    def unlink_own(self) -> None:
        while self.linked:
            _C.unlink_segment(self.linked.pop())

    @staticmethod
    def finalize(linked) -> None:
        # Runs at garbage collection or interpreter exit if close() was not called.
        for name in linked:
            _C.unlink_segment(name)
        linked.clear()


def bootstrap(comm) -> None:
    """Fill in ``comm``'s group state (see the module docstring); ``comm.close`` undoes what was done."""
    # Everything read from the store is authenticated with the group secret (asap_comm.rendezvous): a
    # value that fails the check is ignored (and counted) before anything it names is mapped or connected,
    # and this PE's own values are kept in place (Keeper) until every PE has passed the first barrier.
    rank, world = comm.rank, comm.world_size
    keeper = Keeper(comm._store)
    try:
        _form(comm, rank, world, keeper)
    except BaseException:
        keeper.close()
        raise


def _form(comm, rank: int, world: int, keeper: Keeper) -> None:
    found = resolve_secret(comm._store, rank, world, comm.host_id, comm._group_secret, comm._shm_prefix,
                           keeper, comm.timeout)
    comm._group_secret = None
    comm._secret, comm._secret_file = found.key, found.file  # the key stays for secret_token
    gs = comm._gs = GroupStore(comm._store, found.key, rank, world, comm.timeout, keeper)
    gs.join()
    name, comm._ctrl_map = comm._segments.create(_C.CTRL_BYTES)
    reserve("init", comm._ctrl_map, 0, _C.CTRL_BYTES, "this PE's control block")
    comm._ctrl_local = comm._ctrl_map.addr
    _C.ctrl_init(comm._ctrl_local, rank, comm._pid)
    gs.set(f"host/{rank}", comm.host_id)
    gs.set(f"ctrl/{rank}", name)
    comm.hosts = hosts = [comm.host_id if pe == rank else gs.get_str(f"host/{pe}", f"PE {pe}'s host")
                          for pe in range(world)]
    gs.rendezvous("hosts")  # every PE read every host before any refuses (a refusing store host ends the store)
    spans = len(set(hosts)) > 1
    refusal = None  # every PE reaches the same verdict from the same hosts
    if spans and found.source == "file":
        refusal = spans_hosts_without_secret(hosts)
    elif spans and comm._backend_arg == "shm":
        refusal = CommError(f"init: backend='shm' needs every PE on one host, but this group spans "
                            f"{len(set(hosts))} hosts ({host_summary(hosts)}); use backend='auto'")
    if refusal is not None:
        try:  # rank 0 (which usually hosts the store) leaves after every PE read its release of "hosts"
            gs.arrive("refused")
        except CommError:
            pass
        raise refusal
    comm.local_pes = [pe for pe in range(world) if hosts[pe] == comm.host_id]
    comm.local_rank = comm.local_pes.index(rank)
    comm.local_world_size = len(comm.local_pes)
    link = None
    if spans:
        link = comm._link = NetLink(rank, world, hosts, comm._group, comm._ghandle, comm._ctrl_local, gs,
                                    found.key, comm.timeout, comm._master_addr)
        comm._net = link.engine
    transports = comm._transports = open_transports(rank, hosts, comm._group, comm._ghandle, comm._heap, gs,
                                                    comm._ctrl_map, link)
    comm._ctrl = [t.ctrl_base for t in transports]  # the native inbox's routing table (0: another host)
    completers = comm._completers = list({id(t.engine): t for t in transports}.values())  # one per engine
    if len(completers) == 1:  # one host: the transport's own methods, no loop on the per-call path
        comm._fence, comm._quiet = completers[0].fence, completers[0].quiet
    else:
        comm._fence, comm._quiet = _each(completers, "fence"), _each(completers, "quiet")
    comm._records = Records(rank, world, transports)
    comm._barrier = Barrier(rank, world, transports, comm._completers, central=not spans)
    if link is not None:
        link.connect()
    gs.rendezvous("ctrl_mapped")  # every PE mapped its peers and authenticated the remote ones
    comm._segments.unlink_own()
    if comm._secret_file is not None:
        unlink_quietly(comm._secret_file)
        comm._secret_file = None
    comm.barrier()  # every PE is past every store read of the formation
    gs.formed()
    if gs.forged:
        _log.warning("asap_comm: PE %d ignored %d store values that failed the group secret's check while its "
                     "group formed (a process without the secret wrote under the group's keys)", rank, gs.forged)


def _each(transports: list, verb: str):
    """``verb`` (fence or quiet) on every transport of ``transports``, in order."""
    def call(*args) -> None:
        for t in transports:
            getattr(t, verb)(*args)
    return call


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def host_id() -> str:
    """This host's identity: ``$ASAP_HOST_ID`` if set, else the hostname (as on real clusters)."""
    v = os.environ.get("ASAP_HOST_ID")
    if v:
        return v
    return socket.gethostname()


def _env_int(name: str, fn: str) -> int:
    v = os.environ.get(name)
    if v is None:
        raise ValueError(f"{fn}: {name.lower()} not given and ${name} is not set "
                         "(pass it, or start the processes with torchrun or asap_comm.launch)")
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{fn}: ${name}={v!r} is not an integer") from None


def check_init_args(rank, world_size, backend, timeout, heap_chunk_bytes, shm_prefix) -> tuple:
    """``init``'s arguments checked, defaults from the environment applied:
    (rank, world_size, backend, timeout, heap_chunk_bytes, shm_prefix)."""
    if backend is None:
        backend = os.environ.get("ASAP_BACKEND") or "auto"
    if backend not in ("auto", "shm"):
        raise ValueError(f"init: backend={backend!r} is not available; built backends: ['auto', 'shm'] "
                         "(auto: shared memory within a host, the network engine across hosts; cuda and npu "
                         "are planned, see docs/design.md)")
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
        heap_chunk_bytes = int(os.environ.get("ASAP_HEAP_CHUNK_BYTES", DEFAULT_CHUNK))
    if heap_chunk_bytes < 4096:
        raise ValueError(f"init: heap_chunk_bytes={heap_chunk_bytes} must be >= 4096")
    heap_chunk_bytes = round_up(heap_chunk_bytes, 4096)
    if shm_prefix is None:
        shm_prefix = os.environ.get("ASAP_SHM_PREFIX", "asap-")
    if "/" in shm_prefix or len(shm_prefix) > 64:
        raise ValueError(f"init: shm_prefix={shm_prefix!r} must not contain '/' and be at most 64 chars")
    return rank, world_size, backend, t, heap_chunk_bytes, shm_prefix


def open_store(rank: int, world_size: int, master_addr, master_port, t: float, hosting) -> tuple:
    """(store, addr, port, is_master): host (rank 0, unless torchrun's agent does) or reach the TCPStore.
    ``hosting(addr, port)``: a communicator of this process already hosting a store there, or None."""
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
            mine = hosting(addr, port)
            if mine is not None:
                raise CommError(f"init: a communicator is already open on {addr}:{port} in this process "
                                f"(id {mine.id}, rank {mine.rank} of {mine.world_size}, hosting its "
                                "store); close it first, or pass another master_port") from None
            raise CommError(f"init: cannot host the TCPStore at {addr}:{port}: the address is in use by another "
                            f"process (a communicator still open elsewhere?); pick a free port ({e})") from None
        raise CommError(f"init: cannot {'host' if is_master else 'reach'} the TCPStore at "
                        f"{addr}:{port}: {e}") from None
    return store, addr, port, is_master
