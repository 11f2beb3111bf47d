"""The MoE exchange of a serving worker, behind one interface: the asynchronous one and the baseline's collective one.

``T`` tokens, ``H`` hidden, ``k`` experts per token (``top_k``), ``W`` workers.

:class:`Exchange` is the token side of one MoE layer: :meth:`~Exchange.send`
routes ``x [T, H]`` to the experts of ``topk_ids [T, k]`` (weights
``topk_weights [T, k]``) and returns a handle; :meth:`~Exchange.ready` says
whether the routed experts' weighted sum has come back; :meth:`~Exchange.receive`
returns it, ``[T, H]`` in ``x``'s order and dtype. Two implementations:

* :class:`AsyncExchange` (``run_async``'s attention ranks): one-sided dispatch
  to the expert ranks and combine back, over ``asap_comm.moe.AttentionEnd``;
  ``send`` returns at once and the rank runs other work until ``ready``. The
  expert ranks' side is ``moe.ExpertEnd``, used directly.
* :class:`CollectiveExchange` (``run_sync``'s workers): the baseline's
  lock-step all-to-alls among the ``W`` workers, over a gloo group
  (``torch.distributed``) or ``asap_comm`` shared memory
  (:class:`ShmCollectives`); ``send`` runs the whole exchange (counts,
  dispatch, this worker's experts, combine) and its handle is ready at once.
  Every worker joins every call, a worker without tokens with ``T = 0``.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..moe import ExpertBatch, apply_experts, expert_placement
from ..rendezvous import gloo_group
from .hooks import ModelHooks
from .patience import wait_patiently

__all__ = ["Exchange", "AsyncExchange", "CollectiveExchange", "CollectiveHandle", "ShmCollectives",
           "shm_collectives", "open_gloo_group", "close_gloo_group", "CP_WORDS"]

# a context-parallel proposal in the baseline step's all_reduce: request id + 1, chunk length, chunk start, group mask
CP_WORDS = 4


class Exchange(ABC):
    """The token side of a MoE layer's exchange (see the module docstring)."""

    @abstractmethod
    def send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int) -> Any:
        """Send ``x [T, H]`` to the experts of ``topk_ids [T, k]`` (``topk_weights [T, k]``) at ``layer``;
        returns a handle for :meth:`ready` / :meth:`receive`."""

    @abstractmethod
    def ready(self, handle) -> bool:
        """Whether :meth:`receive` of ``handle`` would return without waiting."""

    def wait(self, handle, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``handle``; whether it is ready."""
        return self.ready(handle)

    @abstractmethod
    def receive(self, handle) -> torch.Tensor:
        """The routed experts' weighted sum ``[T, H]`` of ``handle``'s tokens, in their order."""

    def finish(self) -> None:
        """This worker sends nothing more."""


# ----------------------------------------------------------------------------- asynchronous
class AsyncExchange(Exchange):
    """One-sided dispatch and combine over an ``asap_comm.moe.AttentionEnd`` (its ``DispatchHandle`` is the
    handle)."""

    def __init__(self, end) -> None:
        self.end = end

    def send(self, x, topk_ids, topk_weights, layer):
        return self.end.dispatch_send(x, topk_ids, topk_weights, layer)

    def ready(self, handle) -> bool:
        return self.end.is_ready(handle)

    def wait(self, handle, timeout: float) -> bool:
        return self.end.wait_ready(handle, timeout)

    def receive(self, handle) -> torch.Tensor:
        return self.end.combine_recv(handle)

    def finish(self) -> None:
        self.end.finish()


# ----------------------------------------------------------------------------- collective (the baseline)
def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` any dtype -> ``[n, m * itemsize]`` uint8 (a view when contiguous)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


@dataclass
class CollectiveHandle:
    """A collective exchange's result, complete when ``send`` returns."""

    output: torch.Tensor  # [T, H]


class CollectiveExchange(Exchange):
    """The baseline's MoE exchange among ``workers`` workers (this one is ``rank``), in lock-step.

    ``send``: the rows are packed per destination worker (hidden state, the
    ``k`` expert ids with -1 for experts held elsewhere, the ``k`` weights;
    each token once per worker holding one of its experts); their counts are
    exchanged, then the rows (one exchange with ``shm``: the counts travel
    with the rows); this worker computes its experts (``experts``: the stage
    model holding them, None if it holds none) on what arrived; a combine
    all-to-all returns the weighted partial sums, added back in token order.
    ``shm``: a :class:`ShmCollectives`, or None for the default
    ``torch.distributed`` (gloo) group. ``span(name, start, busy)`` records a
    span and returns the time it ended; ``stats`` (a ``protocol.WorkerStats``
    or None) counts expert batches; ``hooks.hold_collective`` follows each
    collective. :meth:`all_reduce` sums the step's small flag vector.
    """

    def __init__(self, rank: int, workers: int, info, experts, shm: "ShmCollectives | None", hooks: ModelHooks,
                 span: Callable[..., float], stats=None) -> None:
        self.rank, self.W, self.info, self.experts, self.shm = rank, workers, info, experts, shm
        self.hooks, self.span, self.stats = hooks, span, stats
        self.rank_of = expert_placement(info.num_experts, workers)  # the worker holding each routed expert
        self.hbytes = info.hidden * torch.empty(0, dtype=info.dtype).element_size()
        self.width = self.hbytes + 8 * info.top_k  # packed row: hidden bytes, k int32 ids, k float32 weights

    def all_reduce(self, vec: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every worker's int64 ``vec`` (the step's flags and proposals)."""
        t = time.monotonic()
        if self.shm is not None:
            vec = self.shm.all_reduce_sum(vec)
        else:
            dist.all_reduce(vec)
        self.hooks.hold_collective("all_reduce", 0, self.W, t)
        return vec

    def send(self, x, topk_ids, topk_weights, layer) -> CollectiveHandle:
        W, H, k, dtype = self.W, self.info.hidden, self.info.top_k, self.info.dtype
        hold, span = self.hooks.hold_collective, self.span
        T = x.shape[0]
        tag = "" if T else "dummy "  # a worker without tokens joins with a dummy batch
        t = time.monotonic()
        dest = self.rank_of[topk_ids] if T else torch.empty(0, k, dtype=torch.int64)  # [T,k] worker of each choice
        masks = [dest == r for r in range(W)]
        index = [m.any(1).nonzero().flatten() for m in masks]  # tokens for each worker
        send_counts = [int(i.numel()) for i in index]
        send = torch.empty(sum(send_counts), self.width, dtype=torch.uint8)
        first = 0
        ids32, w32 = topk_ids.to(torch.int32), topk_weights.to(torch.float32)
        for mine, rows in zip(masks, index):
            n = rows.numel()
            if n == 0:
                continue
            part = send[first:first + n]
            part[:, :self.hbytes] = _as_bytes(x[rows])
            part[:, self.hbytes:self.hbytes + 4 * k] = _as_bytes(torch.where(mine[rows], ids32[rows], -1))
            part[:, self.hbytes + 4 * k:] = _as_bytes(w32[rows])
            first += n
        t = span(f"{tag}route+pack L{layer}", t)
        if self.shm is not None:  # counts travel with the rows: one exchange
            recv, recv_counts = self.shm.all_to_all(send, send_counts)
            hold("counts+dispatch", max(sum(send_counts), sum(recv_counts)), W, t, layer)
        else:
            recv_counts_t = torch.empty(W, dtype=torch.int64)
            dist.all_to_all_single(recv_counts_t, torch.tensor(send_counts, dtype=torch.int64))
            hold("counts", 0, W, t, layer)
            recv_counts = recv_counts_t.tolist()
            t_d = time.monotonic()
            recv = torch.empty(sum(recv_counts), self.width, dtype=torch.uint8)
            dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts)
            hold("dispatch", max(sum(send_counts), sum(recv_counts)), W, t_d, layer)
        busiest = max(sum(send_counts), sum(recv_counts))
        t = span(f"{tag}dispatch a2a L{layer}", t, busy=False)
        m = recv.shape[0]
        if m:
            batch = ExpertBatch(layer, _from_bytes(recv[:, :self.hbytes], dtype),
                                _from_bytes(recv[:, self.hbytes:self.hbytes + 4 * k], torch.int32),
                                _from_bytes(recv[:, self.hbytes + 4 * k:], torch.float32), [])
            model = self.experts
            out = apply_experts(batch, lambda e, rows: model.expert(layer, e, rows))
            t = span(f"experts L{layer} ({m} rows)", t)
            if self.stats is not None:
                self.stats.batch(m)
        else:
            out = torch.empty(0, H, dtype=dtype)
        t_c = time.monotonic()
        if self.shm is not None:
            back, _ = self.shm.all_to_all(out.contiguous(), recv_counts)
        else:
            back = torch.empty(sum(send_counts), H, dtype=dtype)
            dist.all_to_all_single(back, out.contiguous(), output_split_sizes=send_counts,
                                   input_split_sizes=recv_counts)
        hold("combine", busiest, W, t_c, layer)
        span(f"{tag}combine a2a L{layer}", t, busy=False)
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        y = torch.zeros(T, H, dtype=acc)
        if T:
            y.index_add_(0, torch.cat(index), back.to(acc))
        return CollectiveHandle(y.to(dtype))

    def ready(self, handle: CollectiveHandle) -> bool:
        return True

    def receive(self, handle: CollectiveHandle) -> torch.Tensor:
        return handle.output


class ShmCollectives:
    """The baseline's collectives over ``asap_comm`` shared memory instead of gloo (``RuntimeConfig.sync_collectives
    = "shm"``): what a deployment's fast collective library (NCCL, HCCL) is to its devices.

    ``all_to_all(send, send_counts)`` has ``dist.all_to_all_single``'s meaning for row-split 2-D tensors (every
    worker joins every call, in the same order); ``all_reduce_sum(vec)`` sums a small int64 vector. Each call
    writes this worker's rows (and their count) straight into every peer's receive area with one-sided puts and
    adds 1 to the peer's arrival counter; it returns once all ``W`` workers' rows have arrived. Receive areas are
    double-buffered by call parity: a worker cannot start call ``k + 2`` before every worker has finished
    reading call ``k`` (call ``k + 1`` needs their arrivals), so no area is overwritten while read.
    Collective allocation: every PE (the front end too, which never joins a call) constructs it, in order.
    """

    def __init__(self, comm, workers: int, max_rows: int, row_bytes: int) -> None:
        self.comm, self.W, self.max_rows, self.row_bytes = comm, workers, max_rows, row_bytes
        self.buf = comm.zeros((2, workers, max_rows * row_bytes), torch.uint8)  # [parity, source, bytes]
        self.counts = comm.zeros((2, workers), torch.int64)  # [parity, source]: rows the source sent here
        self.arrived = comm.signals(2)  # per parity: sources arrived, cumulative
        self.calls = 0

    def _exchange(self, parts: list) -> list:
        """``parts[d]``: a uint8 [n, row_bytes] tensor for worker ``d``. Returns what each worker sent here."""
        comm, W = self.comm, self.W
        par, k = self.calls % 2, self.calls // 2
        self.calls += 1
        me = comm.rank
        for d in range(W):
            part = parts[d]
            n = int(part.shape[0])
            if n > self.max_rows:
                raise ValueError(f"ShmCollectives: {n} rows for worker {d} exceed the {self.max_rows} it was sized for")
            if n:
                comm.put(self.buf[par, me, : n * self.row_bytes], part.reshape(-1), d)
            comm.put(self.counts[par, me: me + 1], torch.tensor([n], dtype=torch.int64), d)
            comm.signal_op(self.arrived, par, 1, "add", d)
        wait_patiently(comm, self.arrived, par, ">=", (k + 1) * W, range(W))  # a stopped worker is waited out
        counts = self.counts[par].tolist()
        return [self.buf[par, s, : counts[s] * self.row_bytes].view(-1, self.row_bytes).clone() for s in range(W)]

    def all_to_all(self, send: torch.Tensor, send_counts: list) -> tuple:
        """``send`` [sum(send_counts), ...] split by rows -> (received rows [m, ...] in source order, recv_counts)."""
        shape, dtype = send.shape[1:], send.dtype
        raw = send.contiguous().view(torch.uint8).reshape(send.shape[0], -1) if send.numel() else \
            torch.empty(send.shape[0], self.row_bytes, dtype=torch.uint8)
        if raw.shape[1] != self.row_bytes:
            pad = torch.zeros(raw.shape[0], self.row_bytes, dtype=torch.uint8)
            pad[:, : raw.shape[1]] = raw
            raw = pad
        parts, first = [], 0
        for n in send_counts:
            parts.append(raw[first: first + n])
            first += n
        got = self._exchange(parts)
        recv_counts = [int(g.shape[0]) for g in got]
        width = torch.empty((), dtype=dtype).element_size() * (int(torch.tensor(shape).prod()) if len(shape) else 1)
        rows = torch.cat(got)[:, :width] if got else torch.empty(0, width, dtype=torch.uint8)
        return rows.contiguous().view(dtype).reshape(-1, *shape), recv_counts

    def all_reduce_sum(self, vec: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of every worker's small int64 ``vec``."""
        row = vec.to(torch.int64).contiguous().view(torch.uint8).reshape(1, -1)
        pad = torch.zeros(1, self.row_bytes, dtype=torch.uint8)
        pad[:, : row.shape[1]] = row
        got = self._exchange([pad] * self.W)
        n = vec.numel()
        return torch.stack([g[0, : 8 * n].view(torch.int64) for g in got]).sum(0)


def shm_collectives(comm, cfg, info, workers: int) -> ShmCollectives:
    """The collective allocation of the baseline's shm collectives (``group.open_channels`` makes it)."""
    max_rows = max(cfg.token_budget, cfg.max_chunk_tokens)
    esize = torch.empty(0, dtype=info.dtype).element_size()
    row_bytes = max(info.hidden * esize + 8 * info.top_k, info.hidden * esize, 16)
    if cfg.cp_threshold is not None:  # the step's all_reduce carries every worker's CP proposal
        row_bytes = max(row_bytes, 8 * (2 + CP_WORDS * workers))
    return ShmCollectives(comm, workers, max_rows, row_bytes)


def open_gloo_group(comm, workers: int, store, timeout_s: float) -> None:
    """Join the workers' gloo group (the default ``torch.distributed`` group) as worker ``comm.rank``.

    ``store``: the port of a TCPStore on 127.0.0.1, or a ``torch.distributed.Store`` every worker reaches (a
    group across hosts). Keys live under a prefix only the group can name; on one host gloo listens on loopback
    only. :func:`close_gloo_group` leaves it."""
    if not isinstance(store, dist.Store):
        store = dist.TCPStore("127.0.0.1", store, None, False, timedelta(seconds=timeout_s))
    gloo_group(store, comm.secret_token("sync-gloo"), comm.rank, workers, timeout_s, loopback=comm.backend == "shm")


def close_gloo_group() -> None:
    dist.destroy_process_group()
