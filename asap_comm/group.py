"""``init``: join a group of PEs (checks its arguments, hosts or reaches the store, builds the
:class:`asap_comm.Communicator`)."""
from __future__ import annotations

from .bootstrap import check_init_args, open_store
from .comm import Communicator, _registry, _registry_lock

__all__ = ["init"]

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
        store, addr, port, is_master = open_store(rank, world_size, master_addr, master_port, t, _hosting)
        comm = Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                            shm_prefix=shm_prefix, backend=backend, group_secret=group_secret, master_addr=addr)
        if is_master:
            comm._hosted = (addr, port)
        return comm
    return Communicator(rank, world_size, store, timeout=t, heap_chunk_bytes=heap_chunk_bytes,
                        shm_prefix=shm_prefix, backend=backend, group_secret=group_secret)


def _hosting(addr: str, port: int) -> "Communicator | None":
    """An open communicator of this process that hosts the store at ``addr:port``."""
    with _registry_lock:
        mine = [c for c in _registry.values() if not c.closed and c._hosted == (addr, port)]
    return mine[0] if mine else None
