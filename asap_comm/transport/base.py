"""The transport interface: how this PE reaches one peer (docs/design.md, "Transports").

A :class:`asap_comm.Communicator` builds one transport per PE when it joins the group (``open_transports``),
chosen once from where the peer runs, and hands every one-sided call for that PE to it; no other module
tells peers apart. The group-level code (collective records, barriers) is written once against the verbs
below. A transport of another kind (an accelerator's device memory, say) is one more module implementing
:class:`Transport`, chosen in ``asap_comm.transport.open_transports``.

Addressing is offset-free: data is named by this PE's view of a symmetric tensor and the tensor's
allocation record (``heap.Alloc``); a signal word by its address in this PE's copy; control words by their
id (``CTRL_ARRIVE``, ``CTRL_GEN``, ``CTRL_DONE``, ``CTRL_RECORDS``), laid out by the native core.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .._native import _C

__all__ = ["Transport", "CTRL_ARRIVE", "CTRL_GEN", "CTRL_DONE", "CTRL_RECORDS", "ctrl_addr", "ctrl_span",
           "OPS", "COPY_WITH_TORCH"]

OPS = {"set": 0, "add": 1}
COPY_WITH_TORCH = 1 << 20  # contiguous copies this large use torch's multithreaded copy_ on one host

# Control words by id; their offsets stay in native code (kernels/ctrl.hpp).
CTRL_ARRIVE, CTRL_GEN, CTRL_DONE, CTRL_RECORDS = _C.CTRL_ARRIVE, _C.CTRL_GEN, _C.CTRL_DONE, _C.CTRL_RECORDS
ctrl_addr, ctrl_span = _C.ctrl_addr, _C.ctrl_span  # (ctrl_base, word) -> address; word -> (offset, nbytes)

class Transport(ABC):
    """How this PE reaches PE ``pe``: one instance per PE of the group (this PE's own included).

    Attributes: ``pe``; ``kind`` (``"shm"``, ``"net"``); ``engine``: what completes this transport's puts
    (transports that share one are fenced and quieted once); ``ctrl_base``: the address of the peer's
    control block in this process, 0 where it is not mapped (the native inbox's routing table).

    Ordering contract (the communicator's, see ``asap_comm.comm``): ``put``/``get`` are blocking copies;
    ``signal_op`` and ``ctrl_op`` are atomics with release semantics, applied after every earlier put of
    this PE to the same peer; ``fence`` orders, ``quiet`` completes.
    """

    pe: int
    kind: str
    engine: object
    ctrl_base: int = 0

    # ---------------------------------------------------------------- heap
    @abstractmethod
    def attach_chunk(self, gs, index: int, size: int, local):
        """Collective heap growth: make the peer's copy of chunk ``index`` reachable (``local``: this PE's
        mapping of it); returns the peer's mapping where it is mapped here, else None."""

    def direct_view(self, t: torch.Tensor) -> "torch.Tensor | None":
        """``t`` (a symmetric tensor or view) as a tensor aliasing the peer's copy, or None where the
        peer's memory is not addressable from here (then use put/get)."""
        return None

    # ---------------------------------------------------------------- data
    @abstractmethod
    def put(self, dst: torch.Tensor, a, src: torch.Tensor) -> None:
        """Blocking: write ``src`` into the bytes ``dst`` (a view of allocation ``a``) names on the peer."""

    @abstractmethod
    def get(self, dst: torch.Tensor, src: torch.Tensor, a) -> None:
        """Blocking: read the bytes ``src`` (a view of allocation ``a``) names on the peer into ``dst``."""

    @abstractmethod
    def put_signal_handle(self, fn: str, dst: torch.Tensor, da, src: torch.Tensor, nbytes: int, op: int,
                          sig: torch.Tensor, sa, sig_addr: int, keep: tuple, any_size: bool):
        """The native handle (``_C.PreparedPutSignal``) that puts ``src`` into ``dst`` and then updates the
        signal word at ``sig_addr`` (in this PE's copy of ``sig``, allocation ``sa``) on the peer, or None
        for a copy this transport does better as put + ``signal_op`` (``any_size``: never None for size)."""

    @abstractmethod
    def signal_op(self, fn: str, sig: torch.Tensor, sa, sig_addr: int, value: int, op: int, fetch: bool) -> int:
        """Atomic ``op`` (``OPS``) of ``value`` on the peer's copy of the word at ``sig_addr``; returns the
        previous value when ``fetch`` (else anything)."""

    def send(self, box, tensor: torch.Tensor, tag: int = 0, timeout=None) -> None:
        """A mailbox message to the peer's inbox (the native inbox routes it on the table of ``ctrl_base``
        and mapped inboxes that the transports give it)."""
        box.send(self.pe, tensor, tag, timeout)

    # ---------------------------------------------------------------- control words
    @abstractmethod
    def ctrl_op(self, word: int, value: int, op: int, fetch: bool, timeout: float) -> int:
        """Atomic ``op`` on the peer's control word ``word`` (release); the previous value when ``fetch``."""

    @abstractmethod
    def read_records(self) -> torch.Tensor:
        """The peer's collective-call records (``CTRL_RECORDS``) as uint8: a live view where mapped, else a
        copy read now (zeros when the peer cannot answer: the caller reports that peer's state)."""

    def wait(self, fn: str, addr: int, cmp: int, timeout: float, dep: int, mask, what: str, keep: tuple):
        """A native wait handle (``_C.PreparedWait``) for the word at ``addr`` (in the peer's memory as mapped
        here) to compare ``cmp`` to a value; only where the peer's memory is mapped (this PE's own always is).
        ``dep``/``mask``: whose failure ends the wait (``_C.DEP_*``); ``what`` prefixes its errors."""
        raise NotImplementedError(f"{self.kind} transport: PE {self.pe}'s memory is not mapped here")

    def ctrl_wait(self, word: int, what: str, dep: int, timeout: float):
        """The wait handle (``>=``) on the peer's control word ``word``, as :meth:`wait`."""
        raise NotImplementedError(f"{self.kind} transport: PE {self.pe}'s control words are not mapped here")

    # ---------------------------------------------------------------- completion
    @abstractmethod
    def fence(self) -> None:
        """Order this PE's earlier puts through ``engine`` before its later ones."""

    @abstractmethod
    def quiet(self, timeout: float) -> None:
        """Complete every put this PE issued through ``engine``."""

    def fence_peer(self) -> bool:
        """Stop applying anything PE ``pe`` sends from now on (the group declared it dead); True when this did
        something. The default (a PE on this host): nothing to do, a dead process here writes nothing."""
        return False

    def close(self) -> None:
        """Leave: release what this transport holds (idempotent)."""
