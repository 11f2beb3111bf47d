"""The MoE group's shared records: the plan and expert placement, the symmetric buffers every PE allocates,
the dispatch handle, the expert batch, and the pure-torch reference of what dispatch and combine compute
(the protocol: ``asap_comm.moe``'s docstring and docs/design.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator

import torch

from ..errors import CommError

__all__ = ["MoEPlan", "expert_placement", "DispatchHandle", "ExpertBatch", "InflightLimitError", "join_as_bystander",
           "apply_experts", "reference_combine", "reference_dispatch"]

_DESC_WORDS = 6  # descriptor: (slot, layer, rows, combine offset, gateway PE or -1, contacted mask), int64
_FIN = -1  # slot value of the "this attention rank is finished" descriptor


class InflightLimitError(CommError):
    """``dispatch_send`` with ``max_inflight`` handles already outstanding (never a silent wait)."""


def _check_int(fn: str, name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{fn}: {name}={v} must be >= {minimum}")
    return v


def expert_placement(num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[num_experts]`` int64: the rank (0..num_ranks-1) holding each routed expert: contiguous near-equal
    blocks, the first ``num_experts % num_ranks`` ranks one larger. The one placement of the project: ASAP's
    expert ranks (``MoEPlan``), the baseline's workers (``serving.sync``) and the benchmarks use it."""
    for name, v in (("num_experts", num_experts), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"expert_placement: {name}={v!r} must be an int >= 1")
    base, extra = divmod(num_experts, num_ranks)
    sizes = [base + (1 if r < extra else 0) for r in range(num_ranks)]
    return torch.repeat_interleave(torch.arange(num_ranks), torch.tensor(sizes, dtype=torch.int64))


@dataclass(frozen=True)
class MoEPlan:
    """Shapes and placement shared by every PE of an MoE group (a plain, frozen record).

    ``num_experts`` routed experts are split over the expert ranks in
    contiguous blocks, as evenly as possible (the first ``N % E`` ranks hold
    one more). ``max_tokens``: the most tokens one micro-batch may carry;
    ``max_inflight``: handles an attention rank may have outstanding.
    ``num_spare_ranks``: expert PEs after the ``E`` expert ranks that hold no
    experts until one takes over a dead expert rank's experts
    (``ExpertEnd.take_over``, ``AttentionEnd.replace``; docs/failover.md).
    Expert rank ``r`` (an index, 0..E-1) starts on PE ``A + r``.
    """

    num_attention_ranks: int
    num_expert_ranks: int
    num_experts: int
    hidden: int
    dtype: torch.dtype = torch.float32
    max_tokens: int = 1024
    top_k: int = 8
    max_inflight: int = 4
    num_spare_ranks: int = 0

    def __post_init__(self) -> None:
        fn = "MoEPlan"
        for name in ("num_attention_ranks", "num_expert_ranks", "num_experts", "hidden", "max_tokens", "top_k",
                     "max_inflight"):
            _check_int(fn, name, getattr(self, name), 1)
        _check_int(fn, "num_spare_ranks", self.num_spare_ranks, 0)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"{fn}: dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.num_experts < self.num_expert_ranks:
            raise ValueError(f"{fn}: num_experts={self.num_experts} < num_expert_ranks={self.num_expert_ranks}: "
                             "every expert rank must hold at least one expert")
        if self.top_k > self.num_experts:
            raise ValueError(f"{fn}: top_k={self.top_k} > num_experts={self.num_experts}")

    @property
    def world_size(self) -> int:
        """Attention, expert and spare expert PEs."""
        return self.num_attention_ranks + self.num_expert_ranks + self.num_spare_ranks

    @property
    def spare_pes(self) -> range:
        """The spare expert PEs (after the expert ranks' first PEs)."""
        return range(self.num_attention_ranks + self.num_expert_ranks, self.world_size)

    @cached_property
    def rank_of_expert(self) -> torch.Tensor:
        """``[N]`` int64: expert-rank index (0..E-1, not the PE) holding each routed expert."""
        return expert_placement(self.num_experts, self.num_expert_ranks)

    def expert_rank(self, expert: int) -> int:
        """The PE holding routed expert ``expert``."""
        if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.num_experts:
            raise ValueError(f"MoEPlan.expert_rank: expert={expert!r} is out of range [0, {self.num_experts})")
        return self.num_attention_ranks + int(self.rank_of_expert[expert])

    def local_experts(self, pe: int) -> list[int]:
        """Global ids of the routed experts PE ``pe`` holds at start (empty for an attention PE and a spare)."""
        if isinstance(pe, bool) or not isinstance(pe, int) or not 0 <= pe < self.world_size:
            raise ValueError(f"MoEPlan.local_experts: pe={pe!r} is out of range [0, {self.world_size})")
        if pe < self.num_attention_ranks or pe >= self.num_attention_ranks + self.num_expert_ranks:
            return []
        return (self.rank_of_expert == pe - self.num_attention_ranks).nonzero().flatten().tolist()

    @property
    def combine_rows(self) -> int:
        """Rows of one combine slot: every token may come back once from each of min(k, E) ranks."""
        return self.max_tokens * min(self.top_k, self.num_expert_ranks)


class _Buffers:
    """The symmetric buffers of one MoE group; allocated collectively, in this order, on every PE."""

    def __init__(self, comm, plan: MoEPlan) -> None:
        if comm.world_size < plan.world_size:
            raise ValueError(f"MoE: the communicator has {comm.world_size} PEs but the plan needs "
                             f"{plan.num_attention_ranks} attention + {plan.num_expert_ranks} expert + "
                             f"{plan.num_spare_ranks} spare = {plan.world_size}")
        A, S, T, H, k = plan.num_attention_ranks, plan.max_inflight, plan.max_tokens, plan.hidden, plan.top_k
        # dispatch area (read on expert PEs): region (a, s) holds up to T rows and their routing
        self.tokens = comm.empty((A, S, T, H), plan.dtype)  # [A, S, T, H]
        self.expert_ids = comm.empty((A, S, T, k), torch.int32)  # [A, S, T, k], -1: not on this rank
        self.weights = comm.empty((A, S, T, k), torch.float32)  # [A, S, T, k]
        # combine area (read on attention PEs): slot s holds the rows every contacted rank returns
        self.combine = comm.empty((S, plan.combine_rows, H), plan.dtype)  # [S, R, H]
        # per (slot, expert rank r): how many times r's rows came back (cumulative), word s * E + r: a return is
        # told apart by who made it, so a dead expert rank's missing return is known (AttentionEnd.replace)
        self.done = comm.signals(S * plan.num_expert_ranks)
        self.inbox = comm.mailbox(_DESC_WORDS * 8, A * (S + 1))  # descriptors, never full
        # node-aware groups (module docstring): the expert PEs of each host that holds two or more of them,
        # when an attention PE is on another host; the same on every PE (comm.hosts is)
        self.host_groups = _host_groups(comm, plan)
        self.red = self.red_count = None
        if self.host_groups:
            self.red = comm.empty((A, S, T, H), plan.dtype)  # [A, S, T, H]: this rank's partial sums
            self.red_count = comm.signals(A * S)  # on a gateway: partials left in red, per (a, slot)


def _host_groups(comm, plan: MoEPlan) -> "dict[str, list[int]]":
    """{host: its expert PEs, ascending} for every host holding two or more expert PEs of ``plan`` while some
    attention PE is on another host: the hosts that dispatch and combine reach once per token.
    ``ASAP_MOE_NODE_AWARE=0`` (in every PE's environment) turns this off: every expert rank is reached
    directly, for comparisons."""
    if os.environ.get("ASAP_MOE_NODE_AWARE", "1") == "0" or plan.num_spare_ranks:  # every PE sees the same
        return {}
    hosts = getattr(comm, "hosts", None) or ["local"] * comm.world_size
    A = plan.num_attention_ranks
    groups: dict[str, list[int]] = {}
    for pe in range(A, A + plan.num_expert_ranks):
        groups.setdefault(hosts[pe], []).append(pe)
    attention_hosts = {hosts[a] for a in range(A)}
    return {h: pes for h, pes in groups.items()
            if len(pes) >= 2 and (attention_hosts - {h})}


def join_as_bystander(comm, plan: MoEPlan) -> None:
    """On a PE outside the plan (``rank >= plan.world_size``, e.g. a front end): take part in the
    collective allocation that the ``AttentionEnd``/``ExpertEnd`` constructors make, and nothing else."""
    if comm.rank < plan.world_size:
        raise ValueError(f"join_as_bystander: PE {comm.rank} is part of the plan (PEs 0..{plan.world_size - 1})")
    _Buffers(comm, plan)


@dataclass(eq=False)
class DispatchHandle:
    """One micro-batch in flight: returned by ``dispatch_send``, consumed by ``combine_recv``."""

    slot: int
    layer: int
    num_tokens: int
    target: int  # parts that come back (one per expert rank contacted, or per host reached node-aware)
    parts: list = field(default_factory=list)  # (expert PE or gateway, rows [n] int64, combine offset, n)
    pes: list = field(default_factory=list)  # every expert PE contacted, ascending
    waits: list = field(default_factory=list)  # per part: (expert rank r, value of word (slot, r) once it is back)
    source: "tuple | None" = None  # with spares: (x, ids32, weights, rank_of), to send a part again

    @property
    def expert_pes(self) -> list[int]:
        """The expert PEs this micro-batch contacted."""
        return list(self.pes)


@dataclass(eq=False)
class ExpertBatch:
    """Rows an expert rank received (one micro-batch, or several merged).

    ``tokens [n,H]``, ``expert_ids [n,k]`` int32 (global ids; -1 where that
    choice's expert is held by another rank), ``weights [n,k]`` float32 are
    zero-copy views into this PE's dispatch region while the batch is not
    merged; they stay valid until ``combine_send``. ``parts``: per origin
    micro-batch, (attention PE, slot, combine offset, rows, first row here).
    """

    layer: int
    tokens: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    parts: list

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def sources(self) -> list[int]:
        """Attention PEs whose micro-batches this batch holds."""
        return [p[0] for p in self.parts]

    def groups(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(expert, rows [m] int64, weights [m] float32)`` per local expert present, experts ascending.

        ``rows`` index this batch's rows; each row appears at most once per
        expert. Compute each expert once on ``tokens[rows]``.
        """
        n, k = self.expert_ids.shape
        flat = self.expert_ids.reshape(-1).to(torch.int64)  # [n*k]
        pairs = (flat >= 0).nonzero().flatten()  # choices held here
        if pairs.numel() == 0:
            return
        experts = flat[pairs]
        order = experts.argsort(stable=True)
        pairs, experts = pairs[order], experts[order]
        uniq, counts = torch.unique_consecutive(experts, return_counts=True)
        w = self.weights.reshape(-1)
        start = 0
        for e, c in zip(uniq.tolist(), counts.tolist()):
            sel = pairs[start:start + c]
            start += c
            yield e, sel // k, w[sel]

    @staticmethod
    def merge(batches: "list[ExpertBatch]") -> "ExpertBatch":
        """One batch from several of the same layer (rows concatenated; ``combine_send`` splits them back)."""
        if not batches:
            raise ValueError("ExpertBatch.merge: no batches")
        layers = {b.layer for b in batches}
        if len(layers) != 1:
            raise ValueError(f"ExpertBatch.merge: batches of different layers {sorted(layers)}")
        if len(batches) == 1:
            return batches[0]
        parts, row = [], 0
        for b in batches:
            for a, slot, off, n, first in b.parts:
                parts.append((a, slot, off, n, row + first))
            row += b.num_rows
        return ExpertBatch(batches[0].layer, torch.cat([b.tokens for b in batches]),
                           torch.cat([b.expert_ids for b in batches]), torch.cat([b.weights for b in batches]),
                           parts)


def apply_experts(batch: ExpertBatch, expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
                  out: "torch.Tensor | None" = None) -> torch.Tensor:
    """``[n,H]``: for each row, sum over its local choices j of ``weights[i,j] * expert_fn(e, tokens[i])``.

    ``expert_fn(expert, x [m,H]) -> [m,H]`` runs once per local expert on all
    its rows (no loop over tokens). Accumulates in float32 for 16-bit dtypes.
    ``out``: write the result there (e.g. ``ExpertEnd.output_buffer(batch)``).
    """
    tokens = batch.tokens
    acc_dtype = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
    acc = out if out is not None and acc_dtype == tokens.dtype else torch.empty(tokens.shape, dtype=acc_dtype)
    acc.zero_()
    for e, rows, w in batch.groups():
        y = expert_fn(e, tokens[rows])
        acc.index_add_(0, rows, y.to(acc_dtype) * w[:, None].to(acc_dtype))
    if acc is out:
        return out
    if out is not None:
        return out.copy_(acc)
    return acc if acc_dtype == tokens.dtype else acc.to(tokens.dtype)


# ----------------------------------------------------------------------------- pure-torch reference
def reference_combine(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """What dispatch + experts + combine must compute, on one process: ``[T,H]``.

    ``y[t] = sum_j topk_weights[t,j] * expert_fn(topk_ids[t,j], x[t:t+1])``.
    """
    T = x.shape[0]
    y = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for t in range(T):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            y[t] += float(topk_weights[t, j]) * expert_fn(e, x[t:t + 1])[0].double()
    return y.to(x.dtype)


def reference_dispatch(plan: MoEPlan, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> dict:
    """What each expert PE must receive from one micro-batch: ``{pe: (rows, tokens, expert_ids, weights)}``.

    ``rows [n]`` ascending token indices with at least one expert on ``pe``;
    ``expert_ids [n,k]`` global ids with -1 for experts elsewhere. PEs with
    nothing to receive are absent.
    """
    out = {}
    for pe in range(plan.num_attention_ranks, plan.world_size):
        held = set(plan.local_experts(pe))
        rows = [t for t in range(x.shape[0]) if any(int(e) in held for e in topk_ids[t])]
        if not rows:
            continue
        ids = torch.tensor([[int(e) if int(e) in held else -1 for e in topk_ids[t]] for t in rows], dtype=torch.int32)
        out[pe] = (torch.tensor(rows, dtype=torch.int64), x[rows], ids, topk_weights[rows].float())
    return out
