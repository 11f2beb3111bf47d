"""Mailboxes: a bounded multi-producer, single-consumer queue per PE.

Each PE's inbox lives in its own symmetric memory: ``num_slots`` slots of
``slot_bytes`` payload each, plus a library-owned 128-byte header per slot.
Producers reserve a position with a CAS on the inbox's tail and write the
message straight into the consumer's slot; the consumer reads it in place.

Guarantees: per-producer FIFO (messages from one PE are received in the order
they were sent), no loss, no duplication, back-pressure (a sender to a full
inbox waits, bounded by its timeout), headers bounds-checked before use.
Ordering: ``send`` publishes the slot with release semantics; ``recv``
observes it with acquire, so the whole payload is visible when it returns.
"""
from __future__ import annotations

import torch

from ._native import _C
from .errors import PeerFailure, TimeoutError

__all__ = ["Mailbox", "Message"]

# dtype <-> wire code (stable: codes are part of the message header format)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
           torch.complex128]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_C._set_itemsizes([torch.empty((), dtype=dt).element_size() for dt in _DTYPES])


class Message:
    """A received message: ``src`` (sending PE), ``tag`` (int), ``tensor``.

    ``tensor`` is a zero-copy view into the inbox slot with the dtype and
    shape that were sent. It is valid until :meth:`release` (or the end of a
    ``with`` block); clone it to keep it. Until released, the slot is not
    reused, so an unreleased message holds back that slot's producers.
    """

    __slots__ = ("src", "tag", "tensor", "_box", "_pos")

    def __init__(self, box: "Mailbox", pos: int, src: int, tag: int, tensor: torch.Tensor) -> None:
        self.src = src
        self.tag = tag
        self.tensor = tensor
        self._box = box
        self._pos = pos

    def release(self) -> None:
        """Give the slot back to producers (idempotent)."""
        box = self._box
        if box is not None:
            self._box = None
            self.tensor = None
            if not box._comm.closed:
                _C.mbox_release(box._base, box.num_slots, box.slot_bytes, self._pos, box._ctrl_local)

    @property
    def released(self) -> bool:
        return self._box is None

    def __enter__(self) -> "Message":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        t = self.tensor
        what = "released" if t is None else f"dtype={t.dtype}, shape={tuple(t.shape)}"
        return f"Message(src={self.src}, tag={self.tag}, {what})"


class Mailbox:
    """One inbox per PE; create with ``comm.mailbox(slot_bytes, num_slots)`` (collective).

    Any PE may ``send`` to any PE (itself included); only the owning PE
    calls ``recv``/``poll`` on its inbox (single consumer, one thread).
    """

    def __init__(self, comm, buf: torch.Tensor, base: int, deltas: list, slot_bytes: int, num_slots: int) -> None:
        self._comm = comm
        self._buf = buf  # uint8 view of this PE's inbox; keeps the mapping alive
        self._base = base
        self._deltas = deltas
        self._stride = _C.slot_stride(slot_bytes)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._ctrl_local = comm._ctrl[comm.rank]
        self._views: list = [None] * num_slots  # per slot: (dtype, shape, tensor) of the last message

    def send(self, pe: int, tensor: torch.Tensor, tag: int = 0, timeout=None) -> None:
        """Copy ``tensor`` into PE ``pe``'s inbox as one message.

        ``tensor``: any CPU tensor of at most ``slot_bytes`` bytes and at most
        8 dimensions (non-contiguous ones are copied contiguous first).
        ``tag``: a signed 64-bit int delivered with it. Waits (bounded by
        ``timeout``, default the communicator's) while the inbox is full.
        Ordering: release: on return the message is published; the consumer
        sees the payload complete when ``recv`` returns it.
        Raises ``PeerFailure`` if ``pe`` died or closed while the inbox was full.
        """
        comm = self._comm
        if tensor.__class__ is not torch.Tensor or pe.__class__ is not int or tag.__class__ is not int \
                or timeout is not None:
            return self._send_checked(pe, tensor, tag, timeout)
        code = _CODE.get(tensor.dtype)
        nbytes = tensor.nbytes
        if code is None or nbytes > self.slot_bytes or not 0 <= pe < comm.world_size \
                or not tensor.is_contiguous() or comm.closed or not -(1 << 63) <= tag < (1 << 63):
            return self._send_checked(pe, tensor, tag, timeout)
        try:
            _C.mbox_send(self._base + self._deltas[pe], self.num_slots, self.slot_bytes, comm._ctrl[pe],
                         comm.rank, tag, code, tensor.shape, tensor.data_ptr(), nbytes, comm.timeout,
                         comm._ghandle, pe)
        except (TimeoutError, PeerFailure) as e:
            raise comm._wait_error("send", f"a free slot in PE {pe}'s inbox", e) from None

    def _send_checked(self, pe, tensor, tag, timeout) -> None:
        comm = self._comm
        comm._check_open("send")
        pe = comm._check_pe("send", pe)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"send: tensor is on {tensor.device}; the shm backend moves CPU tensors only")
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"send: tag must be an int, got {type(tag).__name__}")
        if not -(1 << 63) <= tag < (1 << 63):
            raise ValueError(f"send: tag={tag} does not fit a signed 64-bit int")
        code = _CODE.get(tensor.dtype)
        if code is None:
            raise ValueError(f"send: dtype {tensor.dtype} is not supported by mailboxes "
                             f"(supported: {[str(d) for d in _DTYPES]})")
        if tensor.dim() > _C.MAX_DIMS:
            raise ValueError(f"send: tensor has {tensor.dim()} dimensions; at most {_C.MAX_DIMS} are supported")
        if tensor.nbytes > self.slot_bytes:
            raise ValueError(f"send: message of {tensor.nbytes} bytes (shape {tuple(tensor.shape)}, "
                             f"{tensor.dtype}) is larger than the mailbox slot ({self.slot_bytes} bytes)")
        t = comm._timeout("send", timeout)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        try:
            _C.mbox_send(self._base + self._deltas[pe], self.num_slots, self.slot_bytes, comm._ctrl[pe],
                         comm.rank, tag, code, tuple(tensor.shape), tensor.data_ptr(), tensor.nbytes, t,
                         comm._ghandle, pe)
        except (TimeoutError, PeerFailure) as e:
            raise comm._wait_error("send", f"a free slot in PE {pe}'s inbox", e) from None

    def _message(self, r: tuple) -> Message:
        pos, src, nbytes, tag, code, shape = r
        slot = pos % self.num_slots
        dtype = _DTYPES[code]
        cached = self._views[slot]
        if cached is not None and cached[0] is dtype and cached[1] == shape:
            return Message(self, pos, src, tag, cached[2])
        start = _C.MAILBOX_HEADER_BYTES + slot * self._stride + _C.SLOT_HEADER_BYTES
        t = self._buf[start: start + nbytes].view(dtype).view(shape) if nbytes else \
            torch.empty(shape, dtype=dtype)
        self._views[slot] = (dtype, shape, t)
        return Message(self, pos, src, tag, t)

    def recv(self, timeout=None) -> Message:
        """Wait (bounded) for the next message in this PE's inbox and return it.

        Ordering: acquire: the payload is complete when this returns. Messages
        of one producer arrive in the order it sent them. Raises
        ``TimeoutError`` after ``timeout`` s, ``PeerFailure`` if a PE died (or
        every other PE closed) while the inbox was empty.
        """
        comm = self._comm
        if timeout is None:
            t = comm.timeout
            if comm.closed:
                comm._check_open("recv")
        else:
            comm._check_open("recv")
            t = comm._timeout("recv", timeout)
        try:
            r = _C.mbox_recv(self._base, self.num_slots, self.slot_bytes, comm.world_size, self._ctrl_local, t,
                             comm._ghandle)
        except (TimeoutError, PeerFailure) as e:
            raise comm._wait_error("recv", "a message", e) from None
        return self._message(r)

    def poll(self) -> "Message | None":
        """The next message if one is ready, else None; never waits."""
        comm = self._comm
        comm._check_open("poll")
        r = _C.mbox_recv(self._base, self.num_slots, self.slot_bytes, comm.world_size, self._ctrl_local, -1.0,
                         comm._ghandle)
        return None if r is None else self._message(r)

    def __repr__(self) -> str:
        return f"Mailbox(slot_bytes={self.slot_bytes}, num_slots={self.num_slots}, pe={self._comm.rank})"
