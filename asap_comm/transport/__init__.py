"""Transports: how this PE reaches each peer, one interface (:class:`Transport`) and one module per kind.

``base`` the interface and the control-word ids; ``shm`` a peer on this host (mapped shared memory);
``net`` a peer on another host (the UCX engine, its handshake and liveness lines). The one place that
chooses a transport for a peer is :func:`open_transports`; a device transport would be chosen there too.
"""
from __future__ import annotations

from .base import Transport
from .net import NetLink, NetTransport, load_net
from .shm import ShmTransport

__all__ = ["Transport", "ShmTransport", "NetTransport", "NetLink", "load_net", "open_transports"]


def open_transports(rank: int, hosts: "list[str]", group, ghandle, heap, gs, own_ctrl,
                    link: "NetLink | None") -> "list[Transport]":
    """One transport per PE, chosen once from where it runs: shared memory for the PEs of this PE's host
    (this PE included; their control segments are mapped and checked here), the network engine ``link``
    for the others (connected afterwards, ``NetLink.connect``)."""
    return [ShmTransport.open(pe, rank, group, ghandle, heap, gs, own_ctrl) if host == hosts[rank]
            else NetTransport(pe, link) for pe, host in enumerate(hosts)]
