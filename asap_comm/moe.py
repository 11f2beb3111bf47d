"""Barrier-free asynchronous MoE dispatch and combine between attention and expert ranks.

Legend: A = attention ranks (PEs 0..A-1), E = expert ranks (PEs A..A+E-1),
N = routed experts, T = tokens of one micro-batch, H = hidden, k = top-k,
S = ``max_inflight`` (handles outstanding per attention rank), n = rows one
expert rank receives from one micro-batch.

The four halves, each a one-sided operation on pre-sized symmetric buffers::

    attention PE                                  expert PE
    h = att.dispatch_send(x, ids, w, layer) ──>  b = ex.dispatch_recv()
        rows for expert rank r are written           (tokens, expert_ids, weights:
        straight into r's dispatch region            zero-copy views of its region)
        (a, slot), then a descriptor is sent     out = f(b)  # [n, H]
        to r's inbox                         <──  ex.combine_send(b, out)
    y = att.combine_recv(h)                          rows go straight into a's combine
        waits for slot's counter only,               area at the offset a assigned, then
        reduces the returned rows                    a's slot counter is bumped (release)

Why it cannot deadlock (docs/design.md, "A buffer layout that cannot deadlock"):

* a handle owns its slot ``(a, s)`` of every expert rank's dispatch region and
  of ``a``'s combine area from ``dispatch_send`` to ``combine_recv``, so
  writing rows never waits for anyone;
* every expert inbox has ``A * (S + 1)`` slots and an attention rank has at
  most ``S`` descriptors (plus one final ``finish``) outstanding in it, so a
  descriptor send never waits;
* the attention rank knows, at dispatch, how many rows each expert rank will
  return and gives each its own offset in the combine area, so
  ``combine_send`` writes without coordination and bumps a counter;
* ``combine_recv`` waits on its own slot's counter, nothing else.

So with at most S handles outstanding per attention rank, every
``dispatch_send`` and ``combine_send`` completes whether or not any attention
rank has called ``combine_recv`` yet. No collective or barrier is on the path
(the constructors are collective, once).

Each token travels once per destination expert rank (whatever number of its
k experts live there); expert ranks with no token in a micro-batch are not
contacted. Routing metadata (global expert ids, -1 for experts held by other
ranks, and weights) travels in the same region as the rows.

Across hosts (node-aware, as DeepEP does between nodes): toward a host that
holds two or more of the expert ranks, a token travels once per *host*, not
once per rank, and returns once. The attention rank puts the rows every
expert rank of that host needs into one of them, its gateway for that host
(spread over the attention ranks), completes the put (``quiet``), then sends
each contacted rank of the host a descriptor naming the gateway. Each rank
gathers its own rows from the gateway's region over shared memory, computes,
and leaves its partial sums in its own ``red`` region; it then adds 1 to the
(attention rank, slot) counter on the gateway. The rank whose add completes
the count sums the host's partials (same host: shared memory) and returns one
row per token with one ``put_signal``. Nobody waits for anybody: the last to
finish reduces. This halves the bytes on the link between the hosts for
every token that has experts on two ranks of a host.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator

import torch

from .errors import CommError
from .errors import TimeoutError as CommTimeoutError

__all__ = ["MoEPlan", "expert_placement", "AttentionEnd", "ExpertEnd", "DispatchHandle", "ExpertBatch", "InflightLimitError",
           "join_as_bystander",
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
    """

    num_attention_ranks: int
    num_expert_ranks: int
    num_experts: int
    hidden: int
    dtype: torch.dtype = torch.float32
    max_tokens: int = 1024
    top_k: int = 8
    max_inflight: int = 4

    def __post_init__(self) -> None:
        fn = "MoEPlan"
        for name in ("num_attention_ranks", "num_expert_ranks", "num_experts", "hidden", "max_tokens", "top_k",
                     "max_inflight"):
            _check_int(fn, name, getattr(self, name), 1)
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"{fn}: dtype must be a floating torch.dtype, got {self.dtype!r}")
        if self.num_experts < self.num_expert_ranks:
            raise ValueError(f"{fn}: num_experts={self.num_experts} < num_expert_ranks={self.num_expert_ranks}: "
                             "every expert rank must hold at least one expert")
        if self.top_k > self.num_experts:
            raise ValueError(f"{fn}: top_k={self.top_k} > num_experts={self.num_experts}")

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_expert_ranks

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
        """Global ids of the routed experts PE ``pe`` holds (empty for an attention PE)."""
        if isinstance(pe, bool) or not isinstance(pe, int) or not 0 <= pe < self.world_size:
            raise ValueError(f"MoEPlan.local_experts: pe={pe!r} is out of range [0, {self.world_size})")
        if pe < self.num_attention_ranks:
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
                             f"{plan.num_attention_ranks} attention + {plan.num_expert_ranks} expert = "
                             f"{plan.world_size}")
        A, S, T, H, k = plan.num_attention_ranks, plan.max_inflight, plan.max_tokens, plan.hidden, plan.top_k
        # dispatch area (read on expert PEs): region (a, s) holds up to T rows and their routing
        self.tokens = comm.empty((A, S, T, H), plan.dtype)  # [A, S, T, H]
        self.expert_ids = comm.empty((A, S, T, k), torch.int32)  # [A, S, T, k], -1: not on this rank
        self.weights = comm.empty((A, S, T, k), torch.float32)  # [A, S, T, k]
        # combine area (read on attention PEs): slot s holds the rows every contacted rank returns
        self.combine = comm.empty((S, plan.combine_rows, H), plan.dtype)  # [S, R, H]
        self.done = comm.signals(S)  # per slot: how many expert ranks have returned their rows (cumulative)
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
    if os.environ.get("ASAP_MOE_NODE_AWARE", "1") == "0":  # every PE must see the same setting
        return {}
    hosts = getattr(comm, "hosts", None) or ["local"] * comm.world_size
    A = plan.num_attention_ranks
    groups: dict[str, list[int]] = {}
    for pe in range(A, plan.world_size):
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
    target: int  # value of the slot's counter once every contacted rank has returned
    parts: list = field(default_factory=list)  # (expert PE or gateway, rows [n] int64, combine offset, n)
    pes: list = field(default_factory=list)  # every expert PE contacted, ascending

    @property
    def expert_pes(self) -> list[int]:
        """The expert PEs this micro-batch contacted."""
        return list(self.pes)


class AttentionEnd:
    """The attention-rank half: ``dispatch_send`` and ``combine_recv``.

    Construct on every attention PE while every expert PE constructs its
    ``ExpertEnd`` (collective allocation, once). Single-threaded.
    """

    def __init__(self, comm, plan: MoEPlan) -> None:
        if not 0 <= comm.rank < plan.num_attention_ranks:
            raise ValueError(f"AttentionEnd: PE {comm.rank} is not an attention rank "
                             f"(attention ranks are 0..{plan.num_attention_ranks - 1})")
        self.comm, self.plan = comm, plan
        self._buf = _Buffers(comm, plan)
        a, A, S = comm.rank, plan.num_attention_ranks, plan.max_inflight
        # Views of every expert PE's dispatch region (a, s), writable in place.
        # Views of every same-host expert PE's dispatch region (a, s), writable in place; None for expert
        # PEs on other hosts, whose rows are staged here and put (the path every backend has).
        self._remote = {(pe, s): None if comm.is_remote(pe) else
                        (comm.remote(self._buf.tokens[a, s], pe), comm.remote(self._buf.expert_ids[a, s], pe),
                         comm.remote(self._buf.weights[a, s], pe))
                        for pe in range(A, plan.world_size) for s in range(S)}
        # what dispatch_send reaches, ascending by first PE: an expert rank index, or a host's expert PEs
        # (node-aware; only toward other hosts)
        grouped = {pe: pes for pes in self._buf.host_groups.values() for pe in pes if comm.is_remote(pe)}
        self._targets: list = []
        for r in range(plan.num_expert_ranks):
            pe = A + r
            if pe not in grouped:
                self._targets.append(r)
            elif grouped[pe][0] == pe:
                self._targets.append(tuple(grouped[pe]))
        # Below this many bytes of rows per host, the quiet and the host-side reduction cost more than the
        # bytes they save (bench/bench_net.py: T=128 x 4 KiB rows is faster direct, T=1024 node-aware).
        self.node_aware_bytes = int(os.environ.get("ASAP_MOE_NODE_AWARE_BYTES", 1 << 20))
        self._stage = None
        if any(v is None for v in self._remote.values()):
            self._stage = (torch.empty(plan.max_tokens, plan.hidden, dtype=plan.dtype),
                           torch.empty(plan.max_tokens, plan.top_k, dtype=torch.int32),
                           torch.empty(plan.max_tokens, plan.top_k, dtype=torch.float32))
        self._minus1 = torch.tensor(-1, dtype=torch.int32)
        self._desc = torch.zeros(_DESC_WORDS, dtype=torch.int64)  # staging for descriptors
        self._desc_words = memoryview(self._desc.numpy()).cast("B").cast("q")
        self._send_desc = {pe: self._buf.inbox.prepare_send(pe, self._desc) for pe in range(A, plan.world_size)}
        self._free = list(range(S - 1, -1, -1))  # free slots, pop() takes the lowest
        self._outstanding: dict[int, DispatchHandle] = {}
        self._counted = [0] * S  # per slot: rows-returns expected so far (the counter is cumulative)
        self._finished = False

    @property
    def num_inflight(self) -> int:
        return len(self._outstanding)

    def _check(self, x, topk_ids, topk_weights, layer) -> int:
        fn, plan = "dispatch_send", self.plan
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{fn}: {name} is on {t.device}; the shm backend moves CPU tensors only")
        _check_int(fn, "layer", layer, 0)
        if x.dim() != 2 or x.shape[1] != plan.hidden:
            raise ValueError(f"{fn}: x must be [T, hidden={plan.hidden}], got {tuple(x.shape)}")
        if x.dtype != plan.dtype:
            raise ValueError(f"{fn}: x dtype {x.dtype} != plan dtype {plan.dtype}")
        T = x.shape[0]
        if T > plan.max_tokens:
            raise ValueError(f"{fn}: {T} tokens > max_tokens={plan.max_tokens}")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(t.shape) != (T, plan.top_k):
                raise ValueError(f"{fn}: {name} must be [T={T}, top_k={plan.top_k}], got {tuple(t.shape)}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
            raise ValueError(f"{fn}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"{fn}: topk_weights must be a floating tensor, got {topk_weights.dtype}")
        if T:
            lo, hi = (int(v) for v in torch.aminmax(topk_ids))
            if lo < 0 or hi >= plan.num_experts:
                raise ValueError(f"{fn}: expert ids must be in [0, {plan.num_experts}), got min {lo} max {hi}")
        if self._finished:
            raise CommError(f"{fn}: finish() was called on this AttentionEnd")
        if not self._free:
            raise InflightLimitError(f"{fn}: {len(self._outstanding)} handles already in flight "
                                     f"(max_inflight={plan.max_inflight}); combine_recv one first")
        return T

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      layer: int) -> DispatchHandle:
        """Send micro-batch ``x [T,H]`` with routing ``topk_ids [T,k]``, ``topk_weights [T,k]``; returns at once.

        Never waits: the handle owns a slot (an error if ``max_inflight`` are
        outstanding). Each token is written once into each expert rank that
        holds any of its experts, with the ids (-1 for experts elsewhere) and
        weights; then that rank gets a descriptor (release: it sees the rows).
        Toward another host with two or more expert ranks, once per host (the
        module docstring's node-aware path).
        """
        T = self._check(x, topk_ids, topk_weights, layer)
        plan = self.plan
        slot = self._free.pop()
        h = DispatchHandle(slot, layer, T, 0)
        if T:
            ids32 = topk_ids.to(torch.int32)
            weights = topk_weights.to(torch.float32)
            rank_of = plan.rank_of_expert[topk_ids]  # [T, k] expert-rank index of each choice
            off = 0
            for target in self._targets:
                if isinstance(target, tuple):  # the expert PEs of another host: node-aware when large enough
                    n = self._dispatch_host(target, h, x, ids32, weights, rank_of, off)
                    if n is not None:
                        off += n
                        continue
                    ranks = [pe - plan.num_attention_ranks for pe in target]
                else:
                    ranks = [target]
                for r in ranks:
                    off += self._dispatch_rank(r, h, x, ids32, weights, rank_of, off)
        self._counted[slot] += len(h.parts)
        h.target = self._counted[slot]
        self._outstanding[slot] = h
        return h

    def _dispatch_rank(self, r: int, h: DispatchHandle, x, ids32, weights, rank_of, off: int) -> int:
        """Dispatch ``h``'s rows for expert rank ``r`` to it directly; returns the combine rows reserved."""
        on_r = rank_of == r  # [T, k]
        rows = on_r.any(1).nonzero().flatten()  # [n] tokens with an expert on r
        n = rows.numel()
        if n == 0:
            return 0  # not contacted
        pe, slot = self.plan.num_attention_ranks + r, h.slot
        views = self._remote[(pe, slot)]
        tok, eid, w = views if views is not None else self._stage
        # rows, routing ids (-1: expert elsewhere) and weights straight into the peer's region
        self._fill(tok, eid, w, x, ids32, weights, on_r, rows, h.num_tokens)
        if views is None:  # another host: put the staged rows (applied before the descriptor below)
            self._put_staged(pe, slot, n)
        self._send_descriptor(pe, slot, h.layer, n, off, -1, 0)  # release: rows before it
        h.parts.append((pe, rows, off, n))
        h.pes.append(pe)
        return n

    def _fill(self, tok, eid, w, x, ids32, weights, on, rows, T) -> None:
        """Rows ``rows`` of the micro-batch, their routing ids (-1 where ``on`` is False) and weights, into
        ``tok``/``eid``/``w``."""
        n = rows.numel()
        if n == T:  # every token: plain copies, rows are 0..T-1
            tok[:n].copy_(x)
            torch.where(on, ids32, self._minus1, out=eid[:n])
            w[:n].copy_(weights)
        else:
            torch.index_select(x, 0, rows, out=tok[:n])
            torch.index_select(torch.where(on, ids32, self._minus1), 0, rows, out=eid[:n])
            torch.index_select(weights, 0, rows, out=w[:n])

    def _put_staged(self, pe: int, slot: int, n: int) -> None:
        """The staged rows, ids and weights into PE ``pe``'s region (this rank, ``slot``) on another host."""
        a, comm, buf = self.comm.rank, self.comm, self._buf
        tok, eid, w = self._stage
        comm.put(buf.tokens[a, slot, :n], tok[:n], pe)
        comm.put(buf.expert_ids[a, slot, :n], eid[:n], pe)
        comm.put(buf.weights[a, slot, :n], w[:n], pe)

    def _send_descriptor(self, pe: int, slot: int, layer: int, n: int, off: int, gateway: int, mask: int) -> None:
        words = self._desc_words
        words[0], words[1], words[2], words[3], words[4], words[5] = slot, layer, n, off, gateway, mask
        self._send_desc[pe]()

    def _dispatch_host(self, pes: tuple, h: DispatchHandle, x, ids32, weights, rank_of, off: int) -> "int | None":
        """Node-aware dispatch of ``h``'s micro-batch to the expert PEs ``pes`` of one other host (module
        docstring); returns the combine rows it reserved at ``off``, or None (nothing sent) when the host's
        rows are fewer than ``node_aware_bytes``: those go to each rank directly."""
        plan, A, slot = self.plan, self.plan.num_attention_ranks, h.slot
        ranks = torch.tensor([pe - A for pe in pes])
        on = torch.isin(rank_of, ranks)  # [T, k] choices held on that host
        rows = on.any(1).nonzero().flatten()
        n = rows.numel()
        if n == 0:
            return 0
        if n * plan.hidden * x.element_size() < self.node_aware_bytes:
            return None
        contacted = [pe for pe in pes if bool((rank_of[rows] == pe - A).any())]
        gateway = pes[self.comm.rank % len(pes)]
        tok, eid, w = self._stage
        self._fill(tok, eid, w, x, ids32, weights, on, rows, h.num_tokens)
        self._put_staged(gateway, slot, n)
        if contacted != [gateway]:
            self.comm.quiet()  # the rows are in the gateway's memory before any other rank hears of them
        mask = sum(1 << i for i, pe in enumerate(pes) if pe in contacted)
        for pe in contacted:
            self._send_descriptor(pe, slot, h.layer, n, off, gateway, mask)
        h.parts.append((gateway, rows, off, n))  # one reduced row per token comes back
        h.pes.extend(contacted)
        return n

    def is_ready(self, handle: DispatchHandle) -> bool:
        """True once every expert rank ``handle`` contacted has returned its rows (never waits)."""
        return not handle.parts or self.comm.signal_fetch(self._buf.done, handle.slot) >= handle.target

    def wait_ready(self, handle: DispatchHandle, timeout: float) -> bool:
        """Wait at most ``timeout`` s until :meth:`is_ready` (``handle`` stays outstanding: read it with
        :meth:`combine_recv`). Returns whether it is ready; raises ``PeerFailure`` if a PE died."""
        if not handle.parts:
            return True
        try:
            self.comm.signal_wait_until(self._buf.done, handle.slot, ">=", handle.target, timeout=timeout)
        except CommTimeoutError:
            return False
        return True

    def combine_recv(self, handle: DispatchHandle, timeout=None) -> torch.Tensor:
        """Wait for ``handle``'s micro-batch only; return its routed-expert output ``[T,H]``.

        ``y[t] = sum_j topk_weights[t,j] * expert_{topk_ids[t,j]}(x[t])``: the
        partial sums each contacted expert rank returned, reduced (in float32
        for lower-precision dtypes). Frees the handle's slot. Raises
        ``TimeoutError`` after ``timeout`` s, ``PeerFailure`` if a PE died.
        """
        if not isinstance(handle, DispatchHandle) or self._outstanding.get(handle.slot) is not handle:
            raise ValueError(f"combine_recv: unknown handle {handle!r} (already combined, or from another "
                             "AttentionEnd)")
        plan, buf, s = self.plan, self._buf, handle.slot
        if handle.parts:
            self.comm.signal_wait_until(buf.done, s, ">=", handle.target, timeout)
        acc_dtype = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
        area, T = buf.combine[s], handle.num_tokens
        # Parts that cover every token are added whole (rows are 0..T-1); the rest by index.
        full = [area[off:off + n] for _pe, _rows, off, n in handle.parts if n == T]
        if len(full) >= 2:
            first = full[0] if acc_dtype == plan.dtype else full[0].to(acc_dtype)
            y = torch.add(first, full[1])  # one pass: reads both parts, writes y
            for part in full[2:]:
                y += part
        elif full:
            y = full[0].to(acc_dtype, copy=True)
        else:
            y = torch.zeros(T, plan.hidden, dtype=acc_dtype)
        for _pe, rows, off, n in handle.parts:
            if n != T:
                y.index_add_(0, rows, area[off:off + n].to(acc_dtype))
        del self._outstanding[s]
        self._free.append(s)
        return y if acc_dtype == plan.dtype else y.to(plan.dtype)

    def finish(self) -> None:
        """Tell every expert rank that this attention rank sends no more micro-batches.

        An ``ExpertEnd`` returns None from ``dispatch_recv`` (and ends
        iteration) once every attention rank has finished and it has served
        everything before.
        """
        if self._finished:
            return
        self._finished = True
        for pe in self._send_desc:
            self._send_descriptor(pe, _FIN, 0, 0, 0, -1, 0)


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


class ExpertEnd:
    """The expert-rank half: ``dispatch_recv``, ``output_buffer`` and ``combine_send``.

    Construct on every expert PE while every attention PE constructs its
    ``AttentionEnd`` (collective allocation, once). Single-threaded.
    Iterating yields batches until every attention rank has called ``finish``.
    """

    def __init__(self, comm, plan: MoEPlan) -> None:
        if not plan.num_attention_ranks <= comm.rank < plan.world_size:
            raise ValueError(f"ExpertEnd: PE {comm.rank} is not an expert rank (expert ranks are "
                             f"{plan.num_attention_ranks}..{plan.world_size - 1})")
        self.comm, self.plan = comm, plan
        self._buf = _Buffers(comm, plan)
        self.experts = plan.local_experts(comm.rank)
        self._finished: set[int] = set()
        # address of combine[0, 0] on each attention PE, as mapped here
        # (None for attention PEs on other hosts: their rows travel with put_signal)
        self._combine_remote = [None if comm.is_remote(a) else comm.remote(self._buf.combine, a).data_ptr()
                                for a in range(plan.num_attention_ranks)]
        self._mine = torch.zeros(plan.num_experts, dtype=torch.bool)  # [N]: experts held here
        self._mine[self.experts] = True
        self._minus1 = torch.tensor(-1, dtype=torch.int32)
        # node-aware parts received and not yet combined: (a, slot) -> (gateway, host PEs, union rows n, combine
        # offset, contacted mask, rows of the union that are this rank's)
        self._host_parts: dict = {}
        self._group = next((pes for pes in self._buf.host_groups.values() if comm.rank in pes), None)
        self.node_aware_parts = 0  # node-aware parts received (each gathered from a gateway)
        self.node_aware_reductions = 0  # node-aware parts this rank reduced and returned

    @property
    def finished(self) -> bool:
        """True once every attention rank has called ``finish`` and its descriptor was received."""
        return len(self._finished) == self.plan.num_attention_ranks

    def _batch(self, msg) -> "ExpertBatch | None":
        plan = self.plan
        a = msg.src
        slot, layer, n, off, gateway, mask = (msg.tensor.tolist() if msg.tensor.numel() == _DESC_WORDS
                                              else (None,) * _DESC_WORDS)
        msg.release()
        if slot == _FIN and 0 <= a < plan.num_attention_ranks:
            self._finished.add(a)
            return None
        ok = (slot is not None and 0 <= a < plan.num_attention_ranks and 0 <= slot < plan.max_inflight
              and 0 < n <= plan.max_tokens and 0 <= off and off + n <= plan.combine_rows and layer >= 0)
        group = self._group
        ok = ok and (gateway == -1 or (group is not None and gateway in group and (a, slot) not in self._host_parts
                                       and 0 < mask < (1 << len(group))))
        if not ok:
            raise CommError(f"dispatch_recv: corrupt descriptor from PE {a}: slot={slot} layer={layer} "
                            f"rows={n} offset={off} gateway={gateway} mask={mask}")
        buf = self._buf
        if gateway != -1:
            return self._host_batch(a, slot, layer, n, off, gateway, mask)
        return ExpertBatch(layer, buf.tokens[a, slot, :n], buf.expert_ids[a, slot, :n], buf.weights[a, slot, :n],
                           [(a, slot, off, n, 0)])

    def _union(self, a: int, slot: int, n: int, gateway: int) -> tuple:
        """(tokens, expert_ids, weights) of the ``n`` rows attention PE ``a`` put for this host in ``gateway``'s
        region (``slot``): views over shared memory (the gateway is on this host)."""
        buf, comm = self._buf, self.comm
        views = (buf.tokens[a, slot, :n], buf.expert_ids[a, slot, :n], buf.weights[a, slot, :n])
        return views if gateway == comm.rank else tuple(comm.remote(v, gateway) for v in views)

    def _rows_of(self, pe: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Indices of the union rows (``expert_ids`` [n, k], this host's experts, -1 elsewhere) that have an
        expert on ``pe``."""
        owner = self.plan.rank_of_expert[expert_ids.clamp(min=0).to(torch.int64)] + self.plan.num_attention_ranks
        return ((owner == pe) & (expert_ids >= 0)).any(1).nonzero().flatten()

    def _host_batch(self, a: int, slot: int, layer: int, n: int, off: int, gateway: int, mask: int) -> ExpertBatch:
        """This rank's rows of a node-aware part: gathered from the gateway's region (shared memory)."""
        tokens, ids, weights = self._union(a, slot, n, gateway)
        rows = self._rows_of(self.comm.rank, ids)
        if rows.numel() == 0:
            raise CommError(f"dispatch_recv: descriptor from PE {a} (slot {slot}) names no row for this rank")
        self._host_parts[(a, slot)] = (gateway, n, off, mask, rows)
        self.node_aware_parts += 1
        mine = torch.where(self._mine[ids.clamp(min=0).to(torch.int64)] & (ids >= 0), ids, self._minus1)
        if rows.numel() == n:
            return ExpertBatch(layer, tokens, mine, weights, [(a, slot, off, n, 0)])
        return ExpertBatch(layer, tokens.index_select(0, rows), mine.index_select(0, rows),
                           weights.index_select(0, rows), [(a, slot, off, rows.numel(), 0)])

    def dispatch_recv(self, timeout=None) -> "ExpertBatch | None":
        """The next micro-batch from any attention rank, any layer (waits, bounded).

        Returns None once every attention rank has finished. Ordering:
        acquire: the rows are complete. Raises ``TimeoutError``, or
        ``PeerFailure`` if a PE died.
        """
        while not self.finished:
            b = self._batch(self._buf.inbox.recv(timeout))
            if b is not None:
                return b
        return None

    def dispatch_recv_many(self, max_batches: "int | None" = None, timeout=None) -> list:
        """Wait (bounded) for one micro-batch, then take every other one already pending, up to ``max_batches``.

        For adaptive batching: merge the ones of the same layer with
        ``ExpertBatch.merge`` (or ``by_layer``). Empty once every attention
        rank has finished.
        """
        first = self.dispatch_recv(timeout)
        if first is None:
            return []
        out = [first]
        while max_batches is None or len(out) < max_batches:
            msg = self._buf.inbox.poll()
            if msg is None:
                break
            b = self._batch(msg)
            if b is not None:
                out.append(b)
        return out

    @staticmethod
    def by_layer(batches: list) -> list:
        """Merge a list of batches into one ``ExpertBatch`` per layer (layers in first-seen order)."""
        groups: dict[int, list] = {}
        for b in batches:
            groups.setdefault(b.layer, []).append(b)
        return [ExpertBatch.merge(g) for g in groups.values()]

    def __iter__(self) -> Iterator[ExpertBatch]:
        while True:
            b = self.dispatch_recv()
            if b is None:
                return
            yield b

    def output_buffer(self, batch: ExpertBatch) -> torch.Tensor:
        """Where to compute ``batch``'s output ``[n,H]`` so that ``combine_send`` need not copy it.

        For a batch from one micro-batch: a view of the origin attention
        rank's combine area at the rows reserved for this rank (``comm.remote``);
        write the result into it (``torch.mul(..., out=buf)``, ``apply_experts(...,
        out=buf)``) and pass it to ``combine_send``, which then only signals.
        For a merged batch: a new local tensor.
        """
        if len(batch.parts) != 1:
            return torch.empty(batch.num_rows, self.plan.hidden, dtype=self.plan.dtype)
        a, slot, off, n, _first = batch.parts[0]
        if (a, slot) in self._host_parts:  # node-aware: this rank's partial sums, read by the host's reducer
            return self._buf.red[a, slot, :n]
        if self._combine_remote[a] is None:  # another host: computed here, then put
            return torch.empty(n, self.plan.hidden, dtype=self.plan.dtype)
        return self.comm.remote(self._buf.combine[slot, off:off + n], a)

    def combine_send(self, batch: ExpertBatch, out: torch.Tensor) -> None:
        """Return ``out [n,H]`` (each row's weighted sum over this rank's experts) to the origin rank(s).

        Rows go straight into each origin attention rank's combine area at
        the offset it assigned; then that slot's counter gets +1 (release:
        the rows are visible first). Never waits.
        """
        fn, plan = "combine_send", self.plan
        if not isinstance(batch, ExpertBatch):
            raise TypeError(f"{fn}: batch must be an ExpertBatch, got {type(batch).__name__}")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{fn}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (batch.num_rows, plan.hidden):
            raise ValueError(f"{fn}: out must be [n={batch.num_rows}, hidden={plan.hidden}], got {tuple(out.shape)}")
        if out.dtype != plan.dtype:
            raise ValueError(f"{fn}: out dtype {out.dtype} != plan dtype {plan.dtype}")
        if out.device.type != "cpu":
            raise ValueError(f"{fn}: out is on {out.device}; the shm backend moves CPU tensors only")
        buf, comm = self._buf, self.comm
        row_bytes = plan.hidden * out.element_size()
        for a, slot, off, n, first in batch.parts:
            if (a, slot) in self._host_parts:
                self._combine_host(a, slot, out[first:first + n])
                continue
            if self._combine_remote[a] is None:  # another host: rows and counter in one message
                comm.put_signal(buf.combine[slot, off:off + n], out[first:first + n], a, buf.done, slot, 1, op="add")
                continue
            dst = self._combine_remote[a] + (slot * plan.combine_rows + off) * row_bytes
            if len(batch.parts) != 1 or out.data_ptr() != dst or not out.is_contiguous():
                comm.remote(buf.combine[slot, off:off + n], a).copy_(out[first:first + n])
            # else: computed in place by output_buffer(): nothing to copy
            comm.signal_op(buf.done, slot, 1, "add", a)  # release: rows first

    def _combine_host(self, a: int, slot: int, out: torch.Tensor) -> None:
        """Node-aware combine of one part: leave ``out`` (this rank's rows) in ``red``, count it on the
        gateway; the rank whose count completes the part reduces the host's partials and returns them."""
        gateway, n, off, mask, rows = self._host_parts.pop((a, slot))
        buf, comm, S = self._buf, self.comm, self.plan.max_inflight
        mine = buf.red[a, slot, :rows.numel()]
        if out.data_ptr() != mine.data_ptr() or not out.is_contiguous():
            mine.copy_(out)
        done = comm.signal_op(buf.red_count, a * S + slot, 1, "add", gateway) + 1  # release: red first
        if done == bin(mask).count("1"):  # the last partial of this part: reduce (acquire: every red is seen)
            self._reduce(a, slot, gateway, n, off, mask, rows)

    def _reduce(self, a: int, slot: int, gateway: int, n: int, off: int, mask: int, own_rows) -> None:
        """Sum the contacted host ranks' partials of attention PE ``a``'s part (``slot``) in PE order and
        return them with one put_signal. ``own_rows``: this rank's rows of the union (known from dispatch)."""
        plan, buf, comm, S = self.plan, self._buf, self.comm, self.plan.max_inflight
        acc_dtype = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
        ids = self._union(a, slot, n, gateway)[1]
        y = torch.zeros(n, plan.hidden, dtype=acc_dtype)
        for i, pe in enumerate(self._group):
            if not mask >> i & 1:
                continue
            rows = own_rows if pe == comm.rank else self._rows_of(pe, ids)
            part = buf.red[a, slot, :rows.numel()]
            if pe != comm.rank:
                part = comm.remote(part, pe)
            y.index_add_(0, rows, part if acc_dtype == plan.dtype else part.to(acc_dtype))
        comm.signal_op(buf.red_count, a * S + slot, 0, "set", gateway)  # the next use of the slot counts anew
        self.node_aware_reductions += 1
        comm.put_signal(buf.combine[slot, off:off + n], y if acc_dtype == plan.dtype else y.to(plan.dtype), a,
                        buf.done, slot, 1, op="add")


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
