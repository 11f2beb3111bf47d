"""The communicators open in this process, by id: what ``torch.ops.asap_comm.*`` (``comm=<id>``, -1 for the
newest) and ``init`` (a store this process already hosts) look up."""
from __future__ import annotations

import threading
import weakref

from .errors import CommError

__all__ = ["hosting"]

_registry: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # id -> Communicator
_registry_lock = threading.Lock()


def _by_id(comm_id: int):
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


def hosting(addr: str, port: int):
    """An open communicator of this process that hosts the store at ``addr:port``, or None."""
    with _registry_lock:
        mine = [c for c in _registry.values() if not c.closed and c._hosted == (addr, port)]
    return mine[0] if mine else None
