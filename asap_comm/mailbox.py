"""Mailboxes: a bounded multi-producer, single-consumer queue per PE.

Each PE's inbox lives in its own symmetric memory: ``num_slots`` slots of
``slot_bytes`` payload each, plus a library-owned 128-byte header per slot.
Producers reserve a position with a CAS on the inbox's tail and write the
message straight into the consumer's slot; the consumer reads it in place.

Guarantees: per-producer FIFO (messages from one PE are received in the order
it sent them), no loss, no duplication, back-pressure (a sender to a full
inbox waits, bounded by its timeout), headers copied and bounds-checked before
use. Ordering: ``send`` publishes the slot with release semantics; ``recv``
observes it with acquire, so the whole payload is visible when it returns.

The per-message path (``send``, ``recv``, ``poll``, ``Message.release``) is
native code (kernels/inbox_py.cpp); irregular arguments fall back to
``Mailbox._send_checked`` here, which validates and raises the errors.
"""
from __future__ import annotations

import torch

from ._native import _C

__all__ = ["Mailbox", "Message"]

# dtype <-> wire code (stable: codes are part of the message header format)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.complex64,
           torch.complex128]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_C._set_tensor_info(torch.Tensor, list(_DTYPES), [torch.empty((), dtype=dt).element_size() for dt in _DTYPES])

Message = _C.Message
Message.__module__ = "asap_comm"


class Mailbox(_C.Inbox):
    """One inbox per PE; create with ``comm.mailbox(slot_bytes, num_slots)`` (collective).

    Any PE may ``send`` to any PE (itself included); only the owning PE calls
    ``recv``/``poll`` on its inbox (single consumer, one thread).

    ``send(pe, tensor, tag=0, timeout=None)``: copy ``tensor`` (any CPU
    tensor of at most ``slot_bytes`` bytes and 8 dimensions; non-contiguous
    ones are made contiguous first) into PE ``pe``'s inbox with an int64
    ``tag``. Waits while the inbox is full, bounded by ``timeout`` (default:
    the communicator's); raises ``PeerFailure`` if ``pe`` died or closed
    meanwhile. Ordering: release; the consumer sees the payload complete.
    On one host a send that raises ``TimeoutError`` placed nothing. Toward
    a PE on another host the consumer's engine answers whether the message
    was placed; when that answer does not come in time (the peer's process
    lives but does not run: stopped) the send raises ``TimeoutError``
    saying so, and the message may still be placed once the peer runs
    again: offering the same message again (same tag, dtype, shape and
    bytes) awaits that same answer instead of sending a copy, so a caller
    that retries never places it twice (``Communicator.net_stats``:
    ``mbox_unanswered``, ``mbox_resumed``; ``mbox_abandoned`` counts
    unanswered messages given up for a different one, which may still be
    placed, before it).

    ``recv(timeout=None) -> Message``: wait (bounded) for the next message.
    Ordering: acquire. Raises ``TimeoutError``, or ``PeerFailure`` if a PE
    died (or every other PE closed) while the inbox was empty.

    ``poll() -> Message | None``: the next message if one is ready; never waits.

    ``prepare_send(pe, tensor, tag=0) -> f(tag=...)``: a pre-validated send
    of a fixed buffer (the lowest-latency path).

    A :class:`Message` has ``src``, ``tag`` and ``tensor``: a zero-copy view
    into the slot with the dtype and shape that were sent, valid until
    ``release()`` (or the end of its ``with`` block, or until the Message is
    garbage-collected, which releases it). Clone the tensor to keep it.
    Until released, the slot is not reused. Slots are reused in ring order:
    the inbox's message at position ``p`` waits until message
    ``p - num_slots`` is released, so hold Messages briefly and release them
    in the order received to keep the whole capacity.
    """

    def __init__(self, comm, buf: torch.Tensor, base: int, deltas: list, slot_bytes: int, num_slots: int) -> None:
        super().__init__(base, [0 if d is None else base + d for d in deltas], list(comm._ctrl), num_slots, slot_bytes, comm.world_size,
                         comm.rank, comm._ghandle, comm.timeout, (comm._group, buf))
        self._comm = comm
        self._buf = buf  # uint8 view of this PE's inbox; keeps the mapping alive
        self._stride = _C.slot_stride(slot_bytes)

    @property
    def comm(self):
        """The communicator this mailbox belongs to."""
        return self._comm

    def _check_message(self, fn: str, pe, tensor, tag) -> tuple:
        """Validates send arguments; returns (pe, code)."""
        comm = self._comm
        comm._check_open(fn)
        pe = comm._check_pe(fn, pe)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{fn}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{fn}: tensor is on {tensor.device}; the shm backend moves CPU tensors only")
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"{fn}: tag must be an int, got {type(tag).__name__}")
        if not -(1 << 63) <= tag < (1 << 63):
            raise ValueError(f"{fn}: tag={tag} does not fit a signed 64-bit int")
        code = _CODE.get(tensor.dtype)
        if code is None:
            raise ValueError(f"{fn}: dtype {tensor.dtype} is not supported by mailboxes "
                             f"(supported: {[str(d) for d in _DTYPES]})")
        if tensor.dim() > _C.MAX_DIMS:
            raise ValueError(f"{fn}: tensor has {tensor.dim()} dimensions; at most {_C.MAX_DIMS} are supported")
        if tensor.nbytes > self.slot_bytes:
            raise ValueError(f"{fn}: message of {tensor.nbytes} bytes (shape {tuple(tensor.shape)}, "
                             f"{tensor.dtype}) is larger than the mailbox slot ({self.slot_bytes} bytes)")
        return pe, code

    def _send_checked(self, pe, tensor, tag=0, timeout=None) -> None:
        """The validating path of ``send`` (native ``send`` hands irregular calls here)."""
        pe, _ = self._check_message("send", pe, tensor, tag)
        t = self._comm._timeout("send", timeout)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        self._ring_send(pe, tensor, tag, t)

    def prepare_send(self, pe: int, tensor: torch.Tensor, tag: int = 0):
        """Validate a send once; return ``f(tag=<the prepared tag>)`` that sends ``tensor``'s current bytes.

        The persistent-request form of :meth:`send` for a fixed staging
        buffer: fill ``tensor`` in place, call the handle. ``tensor`` must be
        contiguous and keep its storage (no resize or ``set_``); the handle
        holds it. Same ordering, waiting (communicator's timeout) and errors
        as ``send``.
        """
        pe, _ = self._check_message("prepare_send", pe, tensor, tag)
        if not tensor.is_contiguous():
            raise ValueError(f"prepare_send: tensor must be contiguous (strides {tensor.stride()})")
        return self._make_prepared_send(pe, tensor, tag)

    def _make_view(self, slot: int, code: int, shape: tuple, nbytes: int) -> torch.Tensor:
        """The tensor view of slot ``slot``'s payload (cached per slot by the native recv)."""
        dtype = _DTYPES[code]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        start = _C.MAILBOX_HEADER_BYTES + slot * self._stride + _C.SLOT_HEADER_BYTES
        return self._buf[start: start + nbytes].view(dtype).view(shape)

    def __repr__(self) -> str:
        return f"Mailbox(slot_bytes={self.slot_bytes}, num_slots={self.num_slots}, pe={self._comm.rank})"
