"""The symmetric heap: segments that every PE creates in the same order, and each tensor's allocation record.

A chunk is one shared-memory segment per PE, all of the same size; an allocation is the same byte range of
every PE's chunk, so a tensor allocated collectively names the same bytes on every PE. The record
(:class:`Alloc`: chunk, offset, size) is what a transport turns into the peer's copy of those bytes, a
mapped address on this host or a (region, offset) pair across hosts (docs/design.md, "Transports").
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from .errors import OutOfSharedMemory

__all__ = ["Alloc", "Chunk", "SymmetricHeap", "reserve", "round_up"]

ALIGN = 64


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass
class Chunk:
    """One segment of every PE's symmetric heap (all PEs have the same chunks)."""

    index: int
    size: int
    used: int
    local: object  # _C.Mapping of this PE
    peers: list  # per PE: its _C.Mapping where mapped here (this PE's own included), else None
    deltas: list  # per PE: peer base - local base where mapped, else None
    base: int  # local base address
    u8: list  # per PE: lazily created torch.uint8 tensor over the mapping


@dataclass
class Alloc:
    chunk: Chunk
    offset: int
    nbytes: int


def reserve(fn: str, mapping, offset: int, nbytes: int, what: str) -> None:
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


class SymmetricHeap:
    """This PE's chunks and the allocation record of every symmetric tensor (keyed by storage pointer).

    Growing is collective: :meth:`grow` creates this PE's segment, publishes it, lets every transport attach
    its peer's copy (``Transport.attach_chunk``) and ends with the group's barrier.
    """

    def __init__(self, rank: int, world_size: int, chunk_bytes: int) -> None:
        self.rank, self.world_size, self.chunk_bytes = rank, world_size, chunk_bytes
        self.chunks: "list[Chunk]" = []
        self.allocs: "dict[int, Alloc]" = {}  # storage data_ptr -> allocation

    def clear(self) -> None:
        self.chunks = []
        self.allocs = {}

    def alloc_of(self, fn: str, name: str, t) -> Alloc:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        a = self.allocs.get(t.untyped_storage().data_ptr())
        if a is None:
            raise ValueError(f"{fn}: {name} (shape {tuple(t.shape)}, dtype {t.dtype}) is not a symmetric "
                             "tensor of this communicator; allocate it with comm.empty/zeros/signals")
        return a

    def grow(self, min_bytes: int, segments, gs, transports, barrier) -> Chunk:
        """Collective: a new chunk of at least ``min_bytes`` on every PE (``segments``: this PE's
        ``bootstrap.Segments``; ``gs``: the authenticated store; ``barrier``: the group's)."""
        size = max(self.chunk_bytes, round_up(min_bytes, 4096))
        index = len(self.chunks)
        name, local = segments.create(size)
        try:
            gs.set(f"chunk/{index}/{self.rank}", f"{name}:{size}")
            peers = [t.attach_chunk(gs, index, size, local) for t in transports]
            barrier()  # every PE has mapped every chunk
        finally:
            segments.unlink_own()
        deltas = [None if mp is None else mp.addr - local.addr for mp in peers]
        chunk = Chunk(index, size, 0, local, peers, deltas, local.addr, [None] * self.world_size)
        self.chunks.append(chunk)
        return chunk

    def alloc(self, fn: str, nbytes: int, grow) -> Alloc:
        """``nbytes`` (rounded up to 64) from the first chunk with room, else from ``grow(need)``'s chunk."""
        need = round_up(max(nbytes, 1), ALIGN)
        for chunk in self.chunks:
            if chunk.size - chunk.used >= need:
                break
        else:
            chunk = grow(need)
        reserve(fn, chunk.local, chunk.used, need, "this PE's symmetric heap")
        a = Alloc(chunk, chunk.used, need)
        chunk.used += need
        return a

    def tensor_of(self, a: Alloc, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = math.prod(shape)
        raw = torch.frombuffer(a.chunk.local, dtype=torch.uint8, count=a.nbytes, offset=a.offset)
        t = raw[: numel * itemsize].view(dtype).view(shape)
        self.allocs[t.untyped_storage().data_ptr()] = a
        return t

    def register(self, buf: torch.Tensor, a: Alloc) -> None:
        """Record ``buf`` (a view of allocation ``a``) as symmetric."""
        self.allocs[buf.untyped_storage().data_ptr()] = a

    def peer_view(self, t: torch.Tensor, a: Alloc, pe: int) -> torch.Tensor:
        """``t`` (a view of allocation ``a``) as the same bytes in PE ``pe``'s chunk mapped here."""
        chunk = a.chunk
        u8 = chunk.u8[pe]
        if u8 is None:
            u8 = chunk.u8[pe] = torch.frombuffer(chunk.peers[pe], dtype=torch.uint8)
        typed = u8[a.offset: a.offset + a.nbytes].view(t.dtype)
        return typed.as_strided(t.shape, t.stride(), a.offset // t.element_size() + t.storage_offset())
