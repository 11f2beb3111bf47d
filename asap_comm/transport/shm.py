"""The shared-memory transport: a peer on this host (this PE included), reached through its mapped segments.

Data moves with plain copies into the peer's mapped heap; signals and control words are native atomics on
the mapped words, waking the peer if it sleeps (docs/design.md, "Transports").
"""
from __future__ import annotations

import torch

from .._native import _C
from ..errors import CommError
from .base import COPY_WITH_TORCH, CTRL_RECORDS, Transport, ctrl_addr, ctrl_span

__all__ = ["ShmTransport"]

_GE = 3  # _C wait comparison ">="


class ShmTransport(Transport):
    """PE ``pe`` on this host. ``ctrl_map``: its control segment as mapped here (this PE's own for itself)."""

    kind = "shm"
    engine = "shm"  # one CPU fence orders and completes every copy to every PE of this host

    def __init__(self, pe: int, rank: int, group, ghandle, heap, ctrl_map) -> None:
        self.pe, self.rank = pe, rank
        self._group, self._ghandle, self._heap = group, ghandle, heap
        self._ctrl_map = ctrl_map
        self.ctrl_base = ctrl_map.addr
        self._records = None
        self._waits: "dict[int, object]" = {}
        group.set_peer(pe, ctrl_map.addr, _C.ctrl_pid(ctrl_map.addr))

    @classmethod
    def open(cls, pe: int, rank: int, group, ghandle, heap, gs, own_ctrl) -> "ShmTransport":
        """Map PE ``pe``'s control segment (named in the store) and check it."""
        if pe == rank:
            return cls(pe, rank, group, ghandle, heap, own_ctrl)
        name = gs.get_str(f"ctrl/{pe}", f"PE {pe}'s control segment")
        mp = _C.map_segment(name, _C.CTRL_BYTES)
        if not _C.ctrl_check(mp.addr, pe):
            raise CommError(f"init: control segment of PE {pe} is not initialised")
        return cls(pe, rank, group, ghandle, heap, mp)

    def attach_chunk(self, gs, index: int, size: int, local):
        if self.pe == self.rank:
            return local
        pe = self.pe
        peer_name, peer_size = gs.get_str(f"chunk/{index}/{pe}", f"PE {pe}'s heap chunk {index}").rsplit(":", 1)
        if int(peer_size) != size:
            raise CommError(f"alloc: PE {pe} created heap chunk {index} with {peer_size} bytes, "
                            f"this PE with {size}: collective calls were made in a different order")
        return _C.map_segment(peer_name, size)

    def direct_view(self, t: torch.Tensor) -> torch.Tensor:
        if self.pe == self.rank:
            return t
        return self._heap.peer_view(t, self._heap.alloc_of("remote", "t", t), self.pe)

    def put(self, dst: torch.Tensor, a, src: torch.Tensor) -> None:
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes < COPY_WITH_TORCH:
            _C.copy_to(dst.data_ptr() + a.chunk.deltas[self.pe], src, dst.nbytes)
        else:
            self._heap.peer_view(dst, a, self.pe).copy_(src)

    def get(self, dst: torch.Tensor, src: torch.Tensor, a) -> None:
        if dst.is_contiguous() and src.is_contiguous() and dst.nbytes < COPY_WITH_TORCH:
            _C.copy_from(dst, src.data_ptr() + a.chunk.deltas[self.pe], dst.nbytes)
        else:
            dst.copy_(self._heap.peer_view(src, a, self.pe))

    def put_signal_handle(self, fn, dst, da, src, nbytes, op, sig, sa, sig_addr, keep, any_size):
        if nbytes >= COPY_WITH_TORCH and not any_size:
            return None
        pe = self.pe
        keep += (da.chunk.peers[pe], sa.chunk.peers[pe])
        return _C.make_put_signal(fn, self._ghandle, pe, src, nbytes, op, dst.data_ptr() + da.chunk.deltas[pe],
                                  sig_addr + sa.chunk.deltas[pe], self.ctrl_base, keep)

    def signal_op(self, fn, sig, sa, sig_addr, value, op, fetch):
        return _C.signal_update(sig_addr + sa.chunk.deltas[self.pe], value, op, self.ctrl_base)

    def ctrl_op(self, word, value, op, fetch, timeout):
        return _C.signal_update(ctrl_addr(self.ctrl_base, word), value, op, self.ctrl_base)

    def read_records(self) -> torch.Tensor:
        if self._records is None:
            off, n = ctrl_span(CTRL_RECORDS)
            self._records = torch.frombuffer(self._ctrl_map, dtype=torch.uint8)[off: off + n]
        return self._records

    def wait(self, fn, addr, cmp, timeout, dep, mask, what, keep):
        return _C.make_wait(fn, self._ghandle, addr, cmp, self.ctrl_base, timeout, dep, mask, what, keep)

    def ctrl_wait(self, word, what, dep, timeout):
        h = self._waits.get(word)
        if h is None:
            h = self._waits[word] = self.wait("barrier", ctrl_addr(self.ctrl_base, word), _GE, timeout, dep, None,
                                              what, (self._group,))
        return h

    fence = staticmethod(_C.fence)  # a CPU fence (called without a Python frame)

    def quiet(self, timeout: float) -> None:
        _C.fence()

    def close(self) -> None:
        self._records = None
        self._waits = {}
