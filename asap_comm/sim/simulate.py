"""Simulated runs of the prefill runtime: ASAP (``"async"``) and the synchronous DP+EP baseline (``"sync"``).

The simulated runtime is the one of ``asap_comm.serving``, decision for
decision: the front end validates, splits long prompts (``split_prompt``) and
places requests (``Placer``); attention ranks form micro-batches
(``MicroBatcher``), at most two in flight with ping-pong; expert ranks gather
rows per layer (``ExpertBatcher``); the baseline steps all ranks together with
dummy batches. Those objects are imported from ``asap_comm.serving.policies``
and called exactly as the runtime calls them; only time is simulated, by the
operator costs of a :class:`~asap_comm.sim.costs.CostModel`.

Modelling choices (each one is what the runtime does, or the stated
simplification):

* **Routing**: balanced in expectation (DeepSeek-V3's auxiliary-loss-free
  balancing): a micro-batch of ``T`` tokens sends ``T * p`` rows to each
  expert rank, where ``p`` is the chance that one of a token's ``k`` distinct
  experts lives on that rank, and every local expert gets ``T * k / N``
  (token, expert) pairs, rounded so the total is right. With identical row
  counts and link latencies every expert rank makes the same batching
  decisions at the same times, so ASAP's ``E`` expert ranks are simulated as
  one representative rank that stands for all ``E`` (exact under this
  routing model, and what makes 10k requests x 61 layers x 64 ranks fast).
* **Where transfers cost**: on a host whose ranks share CPU cores (the
  ``local`` profile) a put is a copy done by the sender's CPU, so it is part
  of the sender's job; on a cluster profile it is a DMA / link delay that
  does not occupy the sender's compute (but its link: see **Links**).
* **Baseline**: per MoE layer three collectives as ``run_sync`` does them
  (counts, dispatch and combine ``all_to_all``, costed with the dispatch and
  the combine row bytes), plus the per-step ``all_reduce`` of
  "anyone working?"; a step ends when the slowest rank does.
  On a shared CPU host (``local``) the ranks waiting in a gloo collective keep
  polling and take a share of the cores from the ranks that compute
  (``sync_poll_weight`` of the profile, fitted in situ).
  An idle baseline notices new work at its next idle heartbeat
  (``run_sync`` polls every millisecond).
* **Parallel attention groups** (:class:`Parallelism`, cluster profiles only;
  the runtime has no such groups, so this is the simulator's model of a
  production deployment): a baseline DP rank and an ASAP attention rank may
  be a group of ``t`` devices with tensor parallelism. The group is one
  simulated rank that stands for its ``t`` devices: its attention costs one
  device's share (``CostModel.attention_s(..., tp=t)``), the router, shared
  experts and dense MLP run data-parallel inside the group on ``ceil(T/t)``
  tokens per device (after a reduce-scatter of the attention output), and
  every layer pays the reduce-scatter + all-gather
  (``CostModel.tp_all_reduce_s``). Each device dispatches its own
  ``ceil(T/t)`` tokens. The baseline's EP spans all ``sync_ranks * t``
  devices (``ceil(N / (sync_ranks * t))`` experts each).
* **Context parallelism** (baseline, ``cp_threshold``): a prompt longer than
  the threshold runs on ``g = min(sync_ranks, ceil(prompt / threshold))`` DP
  groups at once, the ``g`` least loaded when it arrives (the placer's
  load-aware rule, extended to ``g`` groups; its work counts ``1/g`` on each).
  It is still split into ``chunk_len`` chunks, in order; each chunk is shared
  by the ``g`` groups (zig-zag halves: each computes ``1/g`` of the queries
  and of the causal query-key pairs, against all keys) in ONE step, and each
  group pays per layer the gather of the KV latents it does not hold
  (``CostModel.cp_exchange_s``). Scheduling: at each step the CP chunks go
  first, in arrival order (a CP chunk joins a step if each of its groups has
  no CP share yet or room left under the token budget); a group then takes a
  micro-batch of its own queue under the budget its CP shares leave, if a
  whole chunk still fits (so no micro-batch exceeds the budget). The head of
  the CP queue always runs, so every CP request progresses.
* **Links** (cluster profiles): a device's link carries all it sends. ASAP:
  an attention device sends its rows for each of the ``E`` expert ranks over
  its own link, and the (representative) expert rank's link receives every
  micro-batch's rows one after another (and sends the combined rows the same
  way): a transfer ends when both its sender's and its receiver's share have
  passed, plus the latency. Baseline: an ``all_to_all`` costs the rows of
  its busiest device, the larger of what it sends to its ``D - 1`` peers and
  what it receives from them. ``sync_overlap`` (DeepSeek's two-micro-batch
  overlap in prefill): a MoE layer takes ``max(compute, all_to_alls)``
  instead of their sum, an optimistic bound for the baseline (the halves'
  smaller kernels and the pipeline's fill are not charged).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..serving.metrics import RequestRecord
from ..serving.policies import ExpertBatcher, MicroBatcher, Placer, split_prompt
from ..serving.protocol import HDR, RuntimeConfig
from ..serving.traces import Request
from .costs import RUNTIME_FACTORS
from .engine import Engine, Host, Rank, ps_makespan

__all__ = ["SimResult", "Parallelism", "simulate", "rows_per_rank_fraction", "SYNC_IDLE_POLL_S"]

SYNC_IDLE_POLL_S = 0.001  # asap_comm.serving.sync_worker.IDLE_S: the idle baseline's heartbeat
_RESULT_BYTES_PER_HIDDEN = 4  # the result message carries the float32 final hidden state


@dataclass
class SimResult:
    """A simulated run: the same per-request records as the runtime, plus per-rank utilisation."""

    mode: str
    records: list
    ranks: list  # {"rank", "role", "busy_s", "idle_s", "utilisation", "jobs", "stands_for"}
    makespan_s: float
    events: int
    wall_s: float
    spans: list = field(default_factory=list)  # (rank name, label, start_s, dur_s) when asked for


@dataclass(frozen=True)
class Parallelism:
    """How attention groups are built (see the module docstring); the defaults are one device per rank.

    ``attention_tp``: devices per ASAP attention rank (tensor parallelism);
    ``sync_tp``: devices per baseline DP group; ``cp_threshold``: baseline prompts longer than this many tokens
    use context parallelism (None: never); ``sync_overlap``: the baseline hides its all_to_alls behind compute
    (two micro-batches per step, one's communication during the other's compute).
    """

    attention_tp: int = 1
    sync_tp: int = 1
    cp_threshold: "int | None" = None
    sync_overlap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sync_overlap, bool):
            raise ValueError(f"Parallelism: sync_overlap={self.sync_overlap!r} must be a bool")
        for name in ("attention_tp", "sync_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Parallelism: {name}={v!r} must be an int >= 1")
        c = self.cp_threshold
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"Parallelism: cp_threshold={c!r} must be None or an int >= 1")

    def describe(self) -> dict:
        return {"attention_tp": self.attention_tp, "sync_tp": self.sync_tp, "cp_threshold": self.cp_threshold,
                "sync_overlap": self.sync_overlap}


def rows_per_rank_fraction(num_experts: int, top_k: int, local_experts: int) -> float:
    """Chance that a token with ``top_k`` distinct experts out of ``num_experts`` has one of ``local_experts``."""
    if not 0 < top_k <= num_experts or not 0 <= local_experts <= num_experts:
        raise ValueError(f"rows_per_rank_fraction: top_k={top_k}, local_experts={local_experts} must be within "
                         f"num_experts={num_experts}")
    miss = math.comb(num_experts - local_experts, top_k) / math.comb(num_experts, top_k)
    return 1.0 - miss


def _pairs(tokens: int, shapes, local_experts: int) -> list:
    """(token, expert) pairs per local expert for ``tokens`` tokens, balanced, summing to the expected total."""
    total = round(tokens * shapes.top_k * local_experts / shapes.num_experts)
    base, extra = divmod(total, local_experts)
    return [base + 1] * extra + [base] * (local_experts - extra)


def _validate(r: Request, cfg: RuntimeConfig) -> str | None:
    if r.prompt_len < 1:
        return "empty prompt"
    if r.prompt_len > cfg.max_prompt_len:
        return f"prompt of {r.prompt_len} tokens is longer than max_prompt_len={cfg.max_prompt_len}"
    return None


class _Memo:
    """The cost model with its one-integer-argument operations memoised (a run asks the same sizes again and
    again); ``attention_s`` and the rest pass through."""

    _CACHED = ("router_s", "shared_experts_s", "dense_mlp_s", "embed_s", "head_s", "dispatch_s", "combine_s",
               "message_s", "all_reduce_s")

    def __init__(self, cost) -> None:
        self._cost = cost
        for name in self._CACHED:
            fn, cache = getattr(cost, name), {}

            def cached(n, fn=fn, cache=cache):
                v = cache.get(n)
                if v is None:
                    v = cache[n] = fn(n)
                return v
            setattr(self, name, cached)
        self._experts: dict = {}
        self._a2a: dict = {}
        self._attn: dict = {}
        self._tp_ar: dict = {}
        self.runtime = {**RUNTIME_FACTORS, **(getattr(cost, "runtime", None) or {})}

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def attention_s(self, chunks, tp: int = 1) -> float:
        if tp == 1:  # the plain call (cost models without tensor parallelism need not know ``tp``)
            return self._cost.attention_s(chunks)
        return self._cost.attention_s(chunks, tp=tp)

    def tp_all_reduce_s(self, tokens: int, tp: int) -> float:
        if tp == 1:
            return 0.0
        v = self._tp_ar.get((tokens, tp))
        if v is None:
            v = self._tp_ar[(tokens, tp)] = self._cost.tp_all_reduce_s(tokens, tp)
        return v

    def experts_s(self, pairs: list) -> float:
        key = (pairs[0], pairs[-1], len(pairs))  # balanced lists (see _pairs) are fixed by these
        v = self._experts.get(key)
        if v is None:
            v = self._experts[key] = self._cost.experts_s(pairs)
        return v

    def all_to_all_s(self, rows: int, ranks: int, combine: bool = False) -> float:
        v = self._a2a.get((rows, ranks, combine))
        if v is None:
            v = self._a2a[(rows, ranks, combine)] = self._cost.all_to_all_s(rows, ranks, combine=combine)
        return v


class _Common:
    def __init__(self, cost, shapes, cfg: RuntimeConfig, requests, record_spans: bool,
                 par: Parallelism = Parallelism(), layers=None) -> None:
        cost = _Memo(cost)
        self.cost, self.shapes, self.cfg, self.par = cost, shapes, cfg, par
        self.engine = Engine()
        self.cpu = cost.cores is not None  # ranks share this host's CPU cores
        self.host = Host(self.engine, cost.cores)
        self.spans = [] if record_spans else None
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, r.prompt_len) for r in requests}
        if len(self.records) != len(requests):
            raise ValueError("simulate: request ids must be unique")
        if layers is None:
            layers = [(bool(m), 1.0) for m in shapes.moe_layers]
        self.moe = [bool(m) for m, _w in layers]
        self.layer_weight = [float(w) for _m, w in layers]
        self.msg_result = cost.message_s(_RESULT_BYTES_PER_HIDDEN * (shapes.hidden + 1))

    def _arrivals(self, arrive) -> None:
        for r in self.requests:
            self.engine.at(r.arrival_s, arrive, r)

    def _admit(self, r: Request):
        """Front end: validate, split, place. Returns (rank, chunks) or None if rejected."""
        rec = self.records[r.request_id]
        error = _validate(r, self.cfg)
        if error is not None:
            rec.start_s = rec.done_s = self.engine.now
            rec.error = f"rejected: {error}"
            return None
        chunks = split_prompt(r.request_id, r.prompt_len, self.cfg.effective_chunk_len)
        rank = self.placer.place(r.request_id, chunks)
        rec.start_s = self.engine.now
        return rank, chunks

    def arrive(self, r: Request) -> None:
        """Front end: admit the request and send its chunks to the chosen rank."""
        admitted = self._admit(r)
        if admitted is not None:
            rank, chunks = admitted
            self.engine.after(self._delivery_s(chunks), self._deliver, rank, chunks)

    def _deliver(self, rank: int, chunks: list) -> None:
        for c in chunks:
            self.batchers[rank].add(c)
        self._queued(rank)

    def _queued(self, rank: int) -> None:
        """New chunks are queued on ``rank``: the mode reacts (start micro-batches, or a step)."""
        raise NotImplementedError

    def _result(self, request_id: int) -> None:
        """The front end receives a request's result."""
        self.records[request_id].done_s = self.engine.now
        self.placer.complete(request_id)

    def _delivery_s(self, chunks) -> float:
        return sum(self.cost.message_s(8 * (c.length + HDR)) for c in chunks)

    def _segments(self):
        """Per micro-batch: the layer runs between MoE layers: [(dense layers before, MoE layer)], each counted
        by its weight (the layers it stands for; 1 each unless ``layers=`` says otherwise); the MoE entry is 0.0
        for the run after the last MoE layer, which ends with the head."""
        segs, dense = [], 0.0
        for m, w in zip(self.moe, self.layer_weight):
            if m:
                segs.append((dense, w))
                dense = 0.0
            else:
                dense += w
        segs.append((dense, 0.0))  # the dense layers after the last MoE layer, then the head
        return segs

    def _finish_records(self) -> list:
        for rec in self.records.values():
            if rec.error is None and rec.done_s is None:
                rec.error = "not completed"
        return [self.records[r.request_id] for r in self.requests]


# ----------------------------------------------------------------------------- ASAP
class _MicroBatch:
    __slots__ = ("rank", "chunks", "tokens", "attn_s", "seg", "waiting")

    def __init__(self, rank: int, chunks: list, attn_s: float) -> None:
        self.rank, self.chunks, self.attn_s = rank, chunks, attn_s
        self.tokens = sum(c.length for c in chunks)
        self.seg = 0
        self.waiting = 0  # parts still to come back: shared-expert job + combine


class _AsyncSim(_Common):
    def __init__(self, cost, shapes, cfg, requests, record_spans, par: Parallelism = Parallelism(),
                 layers=None) -> None:
        super().__init__(cost, shapes, cfg, requests, record_spans, par, layers)
        A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
        self.A, self.E = A, E
        self.tp = par.attention_tp  # devices per attention rank
        self.placer = Placer(A, load_aware=cfg.load_aware)
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(A)]
        self.running = [0] * A
        self.max_running = 2 if cfg.ping_pong else 1
        name = "attention" if self.tp == 1 else f"attention group (TP {self.tp})"
        self.att = [Rank(self.engine, self.host, f"{name} {r}", spans=self.spans) for r in range(A)]
        # one representative expert rank for all E (see the module docstring); the most-loaded share of experts
        self.local = -(-shapes.num_experts // E)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self.ex = Rank(self.engine, self.host, f"experts x{E}", weight=E, spans=self.spans)
        self.ex_batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s,
                                        enabled=cfg.expert_batching)
        self.ex_wake = None  # (time, handle) of the pending deadline wake-up
        self.ex_in_free = self.ex_out_free = 0.0  # when the expert rank's link is free to receive / to send
        self.segs = self._segments()
        rt = self.cost.runtime
        self.k_att, self.k_exp, self.layer_overhead = (rt["async_attention"], rt["async_expert"],
                                                       rt["async_layer_overhead_s"])

    def _rows(self, tokens: int) -> int:
        return max(1, round(tokens * self.frac)) if tokens else 0

    def _per_device(self, tokens: int) -> int:
        """Tokens of one device of the attention group after the reduce-scatter (all of them when tp=1)."""
        return -(-tokens // self.tp)

    def _queued(self, rank: int) -> None:
        self._fill(rank)

    def _fill(self, rank: int) -> None:
        while self.running[rank] < self.max_running:
            batch = self.batchers[rank].next_batch()
            if not batch:
                return
            self.running[rank] += 1
            attn = self.cost.attention_s([(c.length, c.start) for c in batch], self.tp)
            # a TP group's layer also pays its reduce-scatter + all-gather (0 when tp=1)
            attn += self.cost.tp_all_reduce_s(sum(c.length for c in batch), self.tp)
            mb = _MicroBatch(rank, batch, attn)
            self._segment(mb, first=True)

    def _segment(self, mb: _MicroBatch, first: bool = False) -> None:
        """Queue the attention-side work up to the next dispatch (or the end) of ``mb``."""
        cost, T = self.cost, mb.tokens
        Td = self._per_device(T)
        dense, moe = self.segs[mb.seg]
        work = (cost.embed_s(T) if first else 0.0) + dense * (mb.attn_s + cost.dense_mlp_s(Td))
        if moe:
            rows = self._rows(Td)  # rows one device of the group sends to one expert rank
            work += moe * (mb.attn_s + cost.router_s(Td))
            if self.cpu:  # the attention rank's CPU copies the rows into each expert rank's memory
                work += moe * self.E * cost.dispatch_s(rows)
            self.att[mb.rank].submit(work * self.k_att, lambda: self._dispatched(mb, rows), f"attn seg {mb.seg}")
        else:
            last = [c for c in mb.chunks if c.last]
            work += cost.head_s(len(last)) if last else 0.0
            self.att[mb.rank].submit(work * self.k_att, lambda: self._tail_done(mb), "attn tail")

    def _dispatched(self, mb: _MicroBatch, rows: int) -> None:
        mb.waiting = 2
        # shared experts run right after the dispatch on the same rank (same generator step)
        w = self.segs[mb.seg][1]
        self.att[mb.rank].submit(w * self.cost.shared_experts_s(self._per_device(mb.tokens)) * self.k_att,
                                 lambda: self._part_back(mb), "shared", front=True)
        self.engine.after(0.0 if self.cpu else self._dispatch_delay(mb, rows), self._expert_arrive, mb, rows)

    def _link(self, fn, rows: int, weight: float = 1.0) -> tuple:
        """(latency, bandwidth time of ``rows`` rows) of a p2p transfer ``fn`` (``dispatch_s`` / ``combine_s``),
        for a layer that stands for ``weight`` layers."""
        if not rows:
            return 0.0, 0.0
        one, two = fn(rows), fn(2 * rows)
        return weight * (2 * one - two), weight * (two - one)

    def _dispatch_delay(self, mb: _MicroBatch, rows: int) -> float:
        """When the rows reach the (representative) expert rank, on a cluster profile: the sending device's link
        carries its ``rows`` for each of the E expert ranks; the expert rank's link receives every micro-batch's
        rows, one after another (``ex_in_free``: when it is free)."""
        now, w = self.engine.now, self.segs[mb.seg][1]
        lat, _ = self._link(self.cost.dispatch_s, rows, w)
        _, send = self._link(self.cost.dispatch_s, self.E * rows, w)
        _, recv = self._link(self.cost.dispatch_s, self._rows(mb.tokens) if self.tp > 1 else rows, w)
        self.ex_in_free = max(now, self.ex_in_free) + recv
        return max(send, self.ex_in_free - now) + lat

    def _expert_arrive(self, mb: _MicroBatch, rows: int) -> None:
        # an expert rank holds rows from every device of the group: the micro-batch's rows for it
        self.ex_batcher.add(mb.seg, rows if self.tp == 1 else self._rows(mb.tokens), (mb, rows), self.engine.now)
        self._poke()

    def _poke(self) -> None:
        if self.ex.busy:
            return  # looked at again when the running batch ends
        now = self.engine.now
        layer = self.ex_batcher.ready(now)
        if layer is None:
            wait = self.ex_batcher.wait_s(now)
            if wait is not None:
                # never "now" again: the deadline test must see time move (also where 1e-9 s is below the
                # clock's resolution, late in a long simulated run)
                t = max(now + max(wait, 1e-9), math.nextafter(now, math.inf))
                if self.ex_wake is None or self.ex_wake[0] > t:
                    if self.ex_wake is not None:
                        Engine.cancel(self.ex_wake[1])
                    self.ex_wake = (t, self.engine.at(t, self._wake))
            return
        items = self.ex_batcher.take(layer)
        tokens = sum(mb.tokens for mb, _ in items)
        w = self.segs[layer][1]
        work = w * self.cost.experts_s(_pairs(tokens, self.shapes, self.local))
        if self.cpu:  # the expert rank's CPU copies each micro-batch's output rows back
            work += w * sum(self.cost.combine_s(rows) for _, rows in items)
        self.ex.submit(work * self.k_exp, lambda: self._experts_done(items), f"experts seg {layer} ({len(items)} mb)")

    def _wake(self) -> None:
        self.ex_wake = None
        self._poke()

    def _experts_done(self, items: list) -> None:
        for mb, rows in items:
            delay = (0.0 if self.cpu else self._combine_delay(mb, rows)) + self.layer_overhead
            self.engine.after(delay, self._part_back, mb)
        self._poke()

    def _combine_delay(self, mb: _MicroBatch, rows: int) -> float:
        """When a micro-batch's combined rows are back, on a cluster profile: the expert rank's link sends the
        micro-batches of a batch one after another (``ex_out_free``); the receiving device's link takes ``rows``
        from each of the E expert ranks."""
        now, w = self.engine.now, self.segs[mb.seg][1]
        lat, _ = self._link(self.cost.combine_s, rows, w)
        _, recv = self._link(self.cost.combine_s, self.E * rows, w)
        _, send = self._link(self.cost.combine_s, self._rows(mb.tokens) if self.tp > 1 else rows, w)
        self.ex_out_free = max(now, self.ex_out_free) + send
        return max(recv, self.ex_out_free - now) + lat

    def _part_back(self, mb: _MicroBatch) -> None:
        mb.waiting -= 1
        if mb.waiting == 0:
            mb.seg += 1
            self._segment(mb)

    def _tail_done(self, mb: _MicroBatch) -> None:
        for c in mb.chunks:
            self.batchers[mb.rank].done(c)
            if c.last:
                self.engine.after(self.msg_result, self._result, c.request_id)
        self.running[mb.rank] -= 1
        self._fill(mb.rank)

    def run(self) -> tuple:
        self._arrivals(self.arrive)
        end = self.engine.run()
        ranks = [(rk.name, "attention", rk, self.tp) for rk in self.att]
        ranks += [(f"expert 0..{self.E - 1}", "expert", self.ex, self.E)]
        return end, ranks


# ----------------------------------------------------------------------------- synchronous DP+EP baseline
def _even_parts(n: int, parts: int) -> list:
    """``n`` tokens in ``parts`` near-equal shares (as ``split_prompt`` balances chunks)."""
    base, extra = divmod(n, parts)
    return [base + 1] * extra + [base] * (parts - extra)


class _CpRequest:
    """A request run with context parallelism: its chunks, the DP groups that share each of them, progress."""
    __slots__ = ("request_id", "chunks", "groups", "next", "busy")

    def __init__(self, request_id: int, chunks: list, groups: list) -> None:
        self.request_id, self.chunks, self.groups = request_id, chunks, groups
        self.next = 0  # index of the chunk to run next
        self.busy = False


class _SyncSim(_Common):
    def __init__(self, cost, shapes, cfg, requests, record_spans, num_ranks: int,
                 par: Parallelism = Parallelism(), layers=None) -> None:
        super().__init__(cost, shapes, cfg, requests, record_spans, par, layers)
        W = self.W = num_ranks  # DP groups
        self.tp = par.sync_tp  # devices per DP group
        self.D = W * self.tp  # devices; EP spans all of them
        self.placer = Placer(W, load_aware=cfg.load_aware)
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(W)]
        self.local = -(-shapes.num_experts // self.D)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self.busy = [0.0] * W
        self.stepping = False
        self.check_at = None  # a pending step check (heartbeat)
        self.segs = self._segments()
        self.steps = 0
        self.k, self.layer_overhead = self.cost.runtime["sync_compute"], self.cost.runtime["sync_layer_overhead_s"]
        self.cp_threshold = par.cp_threshold if W > 1 else None
        self.cp: list = []  # unfinished context-parallel requests, in arrival order

    # ------------------------------------------------------------------ context parallelism
    def arrive(self, r: Request) -> None:
        if (self.cp_threshold is None or r.prompt_len <= self.cp_threshold
                or _validate(r, self.cfg) is not None):
            super().arrive(r)
            return
        # a long prompt: the g least loaded DP groups share it (the placer's load-aware rule for g groups)
        g = min(self.W, -(-r.prompt_len // self.cp_threshold))
        chunks = split_prompt(r.request_id, r.prompt_len, self.cfg.effective_chunk_len)
        groups = self.placer.place_group(r.request_id, chunks, g)
        self.records[r.request_id].start_s = self.engine.now
        self.engine.after(self._delivery_s(chunks), self._deliver_cp, _CpRequest(r.request_id, chunks, groups))

    def _deliver_cp(self, req: _CpRequest) -> None:
        self.cp.append(req)
        self._queued(req.groups[0])

    def _result_cp(self, req: _CpRequest) -> None:
        self.records[req.request_id].done_s = self.engine.now
        self.placer.complete(req.request_id)

    def _batches(self) -> tuple:
        """This step's micro-batch per group, and its CP shares [(request, chunk, tokens, part)] (module docstring)."""
        if not self.cp:
            return [b.next_batch() for b in self.batchers], None
        budget = self.cfg.token_budget
        cp_tokens = [0] * self.W
        shares: list = [[] for _ in range(self.W)]
        for req in self.cp:
            if req.busy:
                continue
            c = req.chunks[req.next]
            parts = _even_parts(c.length, len(req.groups))
            if all(cp_tokens[j] == 0 or cp_tokens[j] + n <= budget for j, n in zip(req.groups, parts)):
                req.busy = True
                for i, (j, n) in enumerate(zip(req.groups, parts)):
                    cp_tokens[j] += n
                    shares[j].append((req, c, n, i))
        batches = []
        for j, b in enumerate(self.batchers):
            left = budget - cp_tokens[j]
            if cp_tokens[j] == 0:
                batches.append(b.next_batch())
            elif left >= self.cfg.max_chunk_tokens:  # a whole chunk still fits under the budget
                b.token_budget = left
                try:
                    batches.append(b.next_batch())
                finally:
                    b.token_budget = budget
            else:
                batches.append([])
        return batches, shares

    # ------------------------------------------------------------------ lock-step
    def _queued(self, rank: int) -> None:
        if not self.stepping and self.check_at is None:
            # the idle ranks notice at their next heartbeat: the others' 1 ms receive timeouts must expire
            delay = (1.0 - 1.0 / self.W) * SYNC_IDLE_POLL_S + self.cost.all_reduce_s(self.D)
            self.check_at = self.engine.after(delay, self._step)

    def _step(self) -> None:
        self.check_at = None
        batches, shares = self._batches()
        if not any(batches) and not (shares and any(shares)):
            self.stepping = False
            return
        self.stepping = True
        self.steps += 1
        cost, W, D, tp, cores = self.cost, self.W, self.D, self.tp, self.cost.cores
        tokens = [sum(c.length for c in b) for b in batches]
        attn = [cost.attention_s([(c.length, c.start) for c in b], tp) if b else 0.0 for b in batches]
        last = [sum(1 for c in b if c.last) for b in batches]
        if shares:
            for r, sh in enumerate(shares):
                if not sh:
                    continue
                chunks = [(c.length, c.start) for c in batches[r]]
                chunks += [(c.length, c.start, len(req.groups)) for req, c, _n, _i in sh]
                tokens[r] += sum(n for _req, _c, n, _i in sh)
                attn[r] = (cost.attention_s(chunks, tp)
                           + sum(cost.cp_exchange_s(c.length, c.start, len(req.groups), tp) for req, c, _n, _i in sh))
                last[r] += sum(1 for _req, c, _n, i in sh if c.last and i == 0)  # one group computes the head
        if tp > 1:  # every layer: the group's reduce-scatter + all-gather
            attn = [a + cost.tp_all_reduce_s(T, tp) if T else a for a, T in zip(attn, tokens)]
        per_dev = [-(-T // tp) for T in tokens]  # tokens of one device after the reduce-scatter
        rows = [round(T * self.frac) for T in per_dev]  # rows one device sends to one peer
        # every token of every rank may choose this rank's experts: its share of the (token, expert) pairs
        # is sum(tokens) * top_k * local / N (see _pairs)
        k = self.k
        expert_work = k * cost.experts_s(_pairs(sum(tokens), self.shapes, self.local)) if sum(tokens) else 0.0
        # the busiest device: what it sends (its rows for each of its D - 1 peers) or receives (from D - 1 devices)
        a2a_rows = max(max(rows) * (D - 1), round(sum(rows) * tp * (D - 1) / D))
        # counts, dispatch (dispatch rows), combine (combine rows)
        a2a = cost.all_to_all_s(0, D) + cost.all_to_all_s(a2a_rows, D) + cost.all_to_all_s(a2a_rows, D, True)
        t = cost.all_reduce_s(D)
        busy_before = list(self.busy)
        pending = [0.0] * W  # rank-local work since the last collective
        # On a shared CPU host the ranks that wait in a gloo collective stay runnable (they poll): a phase
        # where n ranks compute runs at min(1, cores / (n + poll * (W - n))), poll fitted in situ.
        poll = cost.runtime["sync_poll_weight"]
        n_att = sum(1 for t in tokens if t)
        spin = 1.0 if cores is None else max(1.0, (n_att + poll * (W - n_att)) / cores)
        spin_ex = 1.0 if cores is None else max(1.0, W / cores)  # every rank computes its experts
        for i, (dense, moe) in enumerate(self.segs):
            for r in range(W):
                T = tokens[r]
                if not T:
                    continue
                Td = per_dev[r]
                # the previous MoE layer's shared experts run after its combine
                w = (cost.embed_s(T) if i == 0 else self.segs[i - 1][1] * cost.shared_experts_s(Td))
                w += dense * (attn[r] + cost.dense_mlp_s(Td))
                if moe:
                    w += moe * (attn[r] + cost.router_s(Td))
                else:
                    w += cost.head_s(last[r]) if last[r] else 0.0
                pending[r] += k * w
            if not moe:
                break
            seg = spin * max(pending) if cores is not None else ps_makespan(pending, None)
            ex = spin_ex * expert_work * moe
            if self.par.sync_overlap:  # the all_to_alls hidden behind compute as far as it lasts
                t += max(seg + ex, moe * a2a) + self.layer_overhead
            else:
                t += seg + moe * a2a + ex + self.layer_overhead
            for r in range(W):
                self.busy[r] += pending[r] + expert_work * moe
            pending = [0.0] * W
        tail = spin * max(pending)
        for r in range(W):
            self.busy[r] += pending[r]
        t += tail
        if self.spans is not None:  # each rank's own compute of the step (the rest of the step it waits)
            for r in range(W):
                label = "step" if batches[r] or (shares and shares[r]) else "dummy step (experts only)"
                self.spans.append((self._name(r), label, self.engine.now, self.busy[r] - busy_before[r]))
        self.engine.after(t, self._step_done, batches, shares)

    def _name(self, r: int) -> str:
        return f"rank {r}" if self.tp == 1 else f"group {r} (TP {self.tp})"

    def _step_done(self, batches: list, shares) -> None:
        for r, b in enumerate(batches):
            for c in b:
                self.batchers[r].done(c)
                if c.last:
                    self.engine.after(self.msg_result, self._result, c.request_id)
        if shares:
            for sh in shares:
                for req, c, _n, i in sh:
                    if i:
                        continue  # once per request: its first group's share
                    req.busy = False
                    req.next += 1
                    if c.last:
                        self.cp.remove(req)
                        self.engine.after(self.msg_result, self._result_cp, req)
        # the loop comes straight back to the next step's all_reduce
        self._step()

    def run(self) -> tuple:
        self._arrivals(self.arrive)
        end = self.engine.run()

        class _Busy:  # the per-rank busy time in the Rank interface
            def __init__(self, busy_s: float, jobs: int) -> None:
                self.busy_s, self.jobs = busy_s, jobs

        role = "dp+ep" if self.tp == 1 else f"dp+ep (TP {self.tp})"
        ranks = [(self._name(r), role, _Busy(self.busy[r], self.steps), self.tp) for r in range(self.W)]
        return end, ranks


def simulate(mode: str, requests, cost, shapes, cfg: RuntimeConfig = RuntimeConfig(), *,
             sync_ranks: int | None = None, spans: bool = False, par: Parallelism | None = None,
             layers=None) -> SimResult:
    """Simulate ``requests`` (``asap_comm.serving.traces.Request``: id, arrival, prompt length).

    ``mode``: ``"async"`` (``cfg.num_attention_ranks`` attention ranks of ``par.attention_tp`` devices each +
    ``cfg.num_expert_ranks`` expert ranks) or ``"sync"`` (``sync_ranks`` DP+EP groups of ``par.sync_tp``
    devices each, default as many groups as ASAP has ranks; context parallelism above ``par.cp_threshold``).
    ``layers``: the layer structure, ``[(is_moe, weight)]`` in order, where a layer of weight ``w`` costs ``w``
    layers of ``shapes`` (default: ``shapes.moe_layers``, weight 1 each). An emulated run
    (``asap_comm.sim.emulate``) serves a small model whose layers each stand for several emulated ones; this
    simulates that structure (see ``emulate.simulate_emulated``).
    Returns records with the runtime's fields, so ``summarize_run`` applies.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"simulate: mode must be 'async' or 'sync', got {mode!r}")
    if layers is not None:
        layers = [tuple(x) for x in layers]
        if (not layers or any(len(x) != 2 or not isinstance(x[0], bool) or isinstance(x[1], bool)
                              or not isinstance(x[1], (int, float)) or not x[1] > 0 for x in layers)):
            raise ValueError(f"simulate: layers={layers!r} must be a non-empty list of (is_moe: bool, weight > 0)")
    par = Parallelism() if par is None else par
    if not isinstance(par, Parallelism):
        raise TypeError(f"simulate: par must be a Parallelism, got {type(par).__name__}")
    tp = par.attention_tp if mode == "async" else par.sync_tp
    if tp > 1 and cost.cores is not None:
        raise ValueError(f"simulate: tensor parallelism (tp={tp}) needs a profile of dedicated devices; "
                         f"{cost.name!r} shares {cost.cores} CPU cores between its ranks")
    t0 = time.perf_counter()
    if mode == "async":
        sim = _AsyncSim(cost, shapes, cfg, requests, spans, par, layers)
    else:
        W = cfg.num_attention_ranks + cfg.num_expert_ranks if sync_ranks is None else sync_ranks
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"simulate: sync_ranks={sync_ranks!r} must be an int >= 1")
        sim = _SyncSim(cost, shapes, cfg, requests, spans, W, par, layers)
    end, ranks = sim.run()
    records = sim._finish_records()
    span = max(end, 1e-12)
    stats = [{"rank": name, "role": role, "busy_s": rk.busy_s, "idle_s": max(0.0, span - rk.busy_s),
              "utilisation": min(1.0, rk.busy_s / span), "jobs": rk.jobs, "stands_for": n}
             for name, role, rk, n in ranks]
    return SimResult(mode, records, stats, end, sim.engine.events, time.perf_counter() - t0,
                     sim.spans or [])
