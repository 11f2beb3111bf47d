"""Argument checks shared by the communicator's calls; each raises the error its caller documents."""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["check_pair", "check_pe", "check_shape", "check_timeout", "check_value", "peer_mask", "signal_word",
           "tensor_info"]

_U64_MAX = (1 << 64) - 1


def check_pe(fn: str, pe, world_size: int) -> int:
    if isinstance(pe, bool) or not isinstance(pe, int):
        raise TypeError(f"{fn}: pe must be an int, got {type(pe).__name__}")
    if not 0 <= pe < world_size:
        raise ValueError(f"{fn}: pe={pe} is out of range [0, {world_size})")
    return pe


def check_timeout(fn: str, timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{fn}: timeout must be a number of seconds or None, got {timeout!r}")
    t = float(timeout)
    if not t >= 0 or math.isinf(t):
        raise ValueError(f"{fn}: timeout must be finite and >= 0, got {timeout!r}")
    return t


def check_value(fn: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: value must be an int, got {type(value).__name__}")
    if not 0 <= value <= _U64_MAX:
        raise ValueError(f"{fn}: value={value} does not fit an unsigned 64-bit signal word")
    return value


def check_shape(fn: str, shape, dtype) -> tuple:
    """(shape as a tuple of ints, dtype's item size)."""
    if isinstance(shape, int):
        shape = (shape,)
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        raise TypeError(f"{fn}: shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{fn}: shape {shape} has a negative dimension")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{fn}: dtype must be a torch.dtype, got {dtype!r}")
    return shape, torch.empty((), dtype=dtype).element_size()


def check_pair(fn: str, dst, src) -> None:
    for nm, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {nm} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"{fn}: {nm} is on {t.device}; the shm backend moves CPU tensors only")
    if dst.dtype != src.dtype:
        raise ValueError(f"{fn}: dtype mismatch: dst {dst.dtype} vs src {src.dtype}")
    if dst.shape != src.shape:
        raise ValueError(f"{fn}: shape mismatch: dst {tuple(dst.shape)} vs src {tuple(src.shape)}")


def peer_mask(fn: str, peers, world_size: int) -> bytes:
    """``peers`` (an iterable of PEs) as a world_size-byte mask for the native wait."""
    if isinstance(peers, (str, bytes, torch.Tensor)) or not hasattr(peers, "__iter__"):
        raise TypeError(f"{fn}: peers must be an iterable of PEs (ints) or None, got {peers!r}")
    mask = bytearray(world_size)
    for pe in peers:
        if isinstance(pe, bool) or not isinstance(pe, int):
            raise TypeError(f"{fn}: peers must hold ints, got {pe!r}")
        if not 0 <= pe < world_size:
            raise ValueError(f"{fn}: peers holds pe={pe}, out of range [0, {world_size})")
        mask[pe] = 1
    if not any(mask):
        raise ValueError(f"{fn}: peers is empty; name at least one PE that may satisfy the wait")
    return bytes(mask)


def tensor_info(fn: str, name: str, t, alloc_of) -> tuple:
    """Validated facts about symmetric tensor ``t`` (``alloc_of``: the heap's lookup, which raises for others):
    (tensor, data_ptr, nbytes, dtype, contiguous, shape, allocation, numel, stride0)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{fn}: {name} is on {t.device}; the shm backend moves CPU tensors only")
    a = alloc_of(fn, name, t)
    return (t, t.data_ptr(), t.nbytes, t.dtype, t.is_contiguous(), tuple(t.shape), a, t.numel(),
            t.stride(0) if t.dim() == 1 else 0)


def signal_word(fn: str, g: tuple, idx) -> int:
    """The address (on this PE) of word ``idx`` of the signal array ``g`` describes (``tensor_info``)."""
    if g[3] is not torch.uint64 or g[8] == 0:
        raise ValueError(f"{fn}: sig must be a 1-D torch.uint64 symmetric tensor (comm.signals(n)), "
                         f"got dtype {g[3]} shape {g[5]}")
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise TypeError(f"{fn}: idx must be an int, got {type(idx).__name__}")
    if not 0 <= idx < g[7]:
        raise ValueError(f"{fn}: idx={idx} is out of range [0, {g[7]}) of the signal array")
    return g[1] + idx * 8 * g[8]
