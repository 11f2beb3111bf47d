"""``torch.ops.asap_comm.*``: the data-moving and signalling calls as torch ops.

The direct ``Communicator`` methods are the fast path; these ops exist so the
primitives compose with the torch ecosystem, above all ``torch.compile``.
They are written so that a compiled program moves and reads exactly the data
an eager one would:

* **Every op is an ordered side effect.** Each is registered as an effectful
  op (``EffectType.ORDERED``): under ``torch.compile`` an effect token is
  threaded through them, so they are never removed (even when their result is
  unused) and never reordered among themselves.
* **No op claims to mutate a local tensor.** ``put``/``put_signal``/
  ``signal_op`` write *another PE's* memory, which no local value in the graph
  represents; marking the local tensor as mutated (``Tensor(a!)``) would make
  functionalization hand the op a temporary copy and write stale bytes back
  afterwards. The ops therefore take the real symmetric tensors as plain
  inputs.
* **Data a wait guards is read through an op.** Reading a symmetric tensor
  directly in compiled code after a wait is *not* ordered after it (the graph
  has no dependency between the two). Read it with
  ``signal_wait_read(data, sig, idx, cmp, value)``, which waits and returns a
  copy of ``data`` taken after the wait, or with ``get(src, pe)`` issued after
  the wait (ordered by the effect token). Both return new tensors.
* ``idx``, ``value`` and ``pe`` are ``SymInt``: a compiled loop whose signal
  value changes every step does not recompile per value. Values given to the
  ops must be in ``[0, 2**63)`` (a ``SymInt`` is a signed 64-bit int); the
  direct methods take the whole unsigned range.

``signal_op``, ``signal_wait_until`` return a 0-d ``torch.uint64`` tensor (an
int return would be data-dependent under tracing). ``comm`` is a communicator
id (``comm.id``); -1, the default, means the newest open communicator of this
process.
"""
from __future__ import annotations

import torch

from ._native import _C
from .registry import _by_id

__all__ = ["LIBRARY", "SCHEMAS"]

SCHEMAS = {
    "put": "put(Tensor dst, Tensor src, SymInt pe, int comm=-1) -> ()",
    "get": "get(Tensor src, SymInt pe, int comm=-1) -> Tensor",
    "put_signal": "put_signal(Tensor dst, Tensor src, SymInt pe, Tensor sig, SymInt idx, SymInt value, "
                  "str op=\"set\", int comm=-1) -> ()",
    "signal_op": "signal_op(Tensor sig, SymInt idx, SymInt value, str op, SymInt pe, int comm=-1) -> Tensor",
    "signal_wait_until": "signal_wait_until(Tensor sig, SymInt idx, str cmp, SymInt value, float? timeout=None, "
                         "int comm=-1, int[]? peers=None) -> Tensor",
    "signal_wait_read": "signal_wait_read(Tensor data, Tensor sig, SymInt idx, str cmp, SymInt value, "
                        "float? timeout=None, int comm=-1, int[]? peers=None) -> Tensor",
}

LIBRARY = torch.library.Library("asap_comm", "DEF")
for _schema in SCHEMAS.values():
    LIBRARY.define(_schema)


def _u64(v: int) -> torch.Tensor:
    out = torch.empty((), dtype=torch.uint64)
    out.view(torch.int64).fill_(v - (1 << 64) if v >= 1 << 63 else v)  # same bits; torch.tensor(v) costs more
    return out


def _put(dst, src, pe, comm=-1):
    _by_id(comm).put(dst, src, pe)


def _get(src, pe, comm=-1):
    out = torch.empty_like(src)
    _by_id(comm).get(out, src, pe)
    return out


def _put_signal(dst, src, pe, sig, idx, value, op="set", comm=-1):
    _by_id(comm).put_signal(dst, src, pe, sig, idx, value, op)


def _signal_op(sig, idx, value, op, pe, comm=-1):
    return _u64(_by_id(comm).signal_op(sig, idx, value, op, pe))


def _signal_wait_until(sig, idx, cmp, value, timeout=None, comm=-1, peers=None):
    return _u64(_by_id(comm).signal_wait_until(sig, idx, cmp, value, timeout, peers=peers))


def _signal_wait_read(data, sig, idx, cmp, value, timeout=None, comm=-1, peers=None):
    c = _by_id(comm)
    c._alloc_of("signal_wait_read", "data", data)  # a symmetric tensor of this communicator, checked before waiting
    c.signal_wait_until(sig, idx, cmp, value, timeout, peers=peers)
    return data.clone()  # read after the acquire


_IMPLS = {"put": _put, "get": _get, "put_signal": _put_signal, "signal_op": _signal_op,
          "signal_wait_until": _signal_wait_until, "signal_wait_read": _signal_wait_read}
for _name, _fn in _IMPLS.items():
    LIBRARY.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("asap_comm::put")
def _put_fake(dst, src, pe, comm=-1):
    return None


@torch.library.register_fake("asap_comm::get")
def _get_fake(src, pe, comm=-1):
    return torch.empty_like(src)


@torch.library.register_fake("asap_comm::put_signal")
def _put_signal_fake(dst, src, pe, sig, idx, value, op="set", comm=-1):
    return None


@torch.library.register_fake("asap_comm::signal_op")
def _signal_op_fake(sig, idx, value, op, pe, comm=-1):
    return sig.new_empty((), dtype=torch.uint64)


@torch.library.register_fake("asap_comm::signal_wait_until")
def _signal_wait_until_fake(sig, idx, cmp, value, timeout=None, comm=-1, peers=None):
    return sig.new_empty((), dtype=torch.uint64)


@torch.library.register_fake("asap_comm::signal_wait_read")
def _signal_wait_read_fake(data, sig, idx, cmp, value, timeout=None, comm=-1, peers=None):
    return torch.empty_like(data)


def _register_ordered_effects() -> None:
    """Marks every op as an ordered side effect (never removed, never reordered among themselves)."""
    try:
        from torch._library.effects import EffectType
    except ImportError:  # pragma: no cover - older torch
        from torch._higher_order_ops.effects import _EffectType as EffectType

    for name in SCHEMAS:
        qualname = f"asap_comm::{name}"
        if hasattr(LIBRARY, "_register_effectful_op"):  # torch >= 2.10
            LIBRARY._register_effectful_op(qualname, EffectType.ORDERED)
        else:  # pragma: no cover - older torch
            from torch._higher_order_ops.effects import _register_effectful_op

            _register_effectful_op(getattr(torch.ops.asap_comm, name).default, EffectType.ORDERED)


_register_ordered_effects()
