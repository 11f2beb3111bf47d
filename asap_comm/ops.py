"""``torch.ops.asap_comm.*``: the data-moving and signalling calls as torch ops.

Schemas carry ``Tensor(a!)`` marks on what each op writes, and every op has a
fake (meta) implementation, so the ops trace under FakeTensorMode and
torch.compile. ``signal_op`` and ``signal_wait_until`` return a 0-d uint64
tensor (an int return would be data-dependent under tracing). ``comm`` is a communicator id (``comm.id``); -1, the default,
means the newest open communicator of this process. The direct
``Communicator`` methods remain the fast path.
"""
from __future__ import annotations

import torch

from ._native import _C
from .comm import _by_id

__all__ = ["LIBRARY"]

LIBRARY = torch.library.Library("asap_comm", "DEF")
LIBRARY.define("put(Tensor(a!) dst, Tensor src, int pe, int comm=-1) -> ()")
LIBRARY.define("get(Tensor(a!) dst, Tensor src, int pe, int comm=-1) -> ()")
LIBRARY.define("put_signal(Tensor(a!) dst, Tensor src, int pe, Tensor(b!) sig, int idx, int value, "
               "str op=\"set\", int comm=-1) -> ()")
LIBRARY.define("signal_op(Tensor(a!) sig, int idx, int value, str op, int pe, int comm=-1) -> Tensor")
LIBRARY.define("signal_wait_until(Tensor sig, int idx, str cmp, int value, float? timeout=None, "
               "int comm=-1) -> Tensor")


def _put(dst, src, pe, comm=-1):
    _by_id(comm).put(dst, src, pe)


def _get(dst, src, pe, comm=-1):
    _by_id(comm).get(dst, src, pe)


def _put_signal(dst, src, pe, sig, idx, value, op="set", comm=-1):
    _by_id(comm).put_signal(dst, src, pe, sig, idx, value, op)


def _u64(v: int) -> torch.Tensor:
    out = torch.empty((), dtype=torch.uint64)
    _C.store(out.data_ptr(), v)  # torch.tensor(v) costs ~5x more
    return out


def _signal_op(sig, idx, value, op, pe, comm=-1):
    return _u64(_by_id(comm).signal_op(sig, idx, value, op, pe))


def _signal_wait_until(sig, idx, cmp, value, timeout=None, comm=-1):
    return _u64(_by_id(comm).signal_wait_until(sig, idx, cmp, value, timeout))


for _name, _fn in (("put", _put), ("get", _get), ("put_signal", _put_signal), ("signal_op", _signal_op),
                   ("signal_wait_until", _signal_wait_until)):
    LIBRARY.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("asap_comm::put")
def _put_fake(dst, src, pe, comm=-1):
    return None


@torch.library.register_fake("asap_comm::get")
def _get_fake(dst, src, pe, comm=-1):
    return None


@torch.library.register_fake("asap_comm::put_signal")
def _put_signal_fake(dst, src, pe, sig, idx, value, op="set", comm=-1):
    return None


@torch.library.register_fake("asap_comm::signal_op")
def _signal_op_fake(sig, idx, value, op, pe, comm=-1):
    return sig.new_empty((), dtype=torch.uint64)


@torch.library.register_fake("asap_comm::signal_wait_until")
def _signal_wait_until_fake(sig, idx, cmp, value, timeout=None, comm=-1):
    return sig.new_empty((), dtype=torch.uint64)
