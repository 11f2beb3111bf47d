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
  does not occupy the sender.
* **Baseline**: per MoE layer three collectives as ``run_sync`` does them
  (counts, dispatch and combine ``all_to_all``), plus the per-step
  ``all_reduce`` of "anyone working?"; a step ends when the slowest rank does.
  On a shared CPU host (``local``) the ranks waiting in a gloo collective keep
  polling and take a share of the cores from the ranks that compute
  (``sync_poll_weight`` of the profile, fitted in situ).
  An idle baseline notices new work at its next idle heartbeat
  (``run_sync`` polls every millisecond).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..serving.metrics import RequestRecord
from ..serving.policies import ExpertBatcher, MicroBatcher, Placer, split_prompt
from ..serving.runtime import RuntimeConfig
from ..serving.traces import Request
from .costs import RUNTIME_FACTORS
from .engine import Engine, Host, Rank, ps_makespan

__all__ = ["SimResult", "simulate", "rows_per_rank_fraction", "SYNC_IDLE_POLL_S"]

SYNC_IDLE_POLL_S = 0.001  # asap_comm.serving.sync._IDLE_S: the idle baseline's heartbeat
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
        self.runtime = {**RUNTIME_FACTORS, **(getattr(cost, "runtime", None) or {})}

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def experts_s(self, pairs: list) -> float:
        key = (pairs[0], pairs[-1], len(pairs))  # balanced lists (see _pairs) are fixed by these
        v = self._experts.get(key)
        if v is None:
            v = self._experts[key] = self._cost.experts_s(pairs)
        return v

    def all_to_all_s(self, rows: int, ranks: int) -> float:
        v = self._a2a.get((rows, ranks))
        if v is None:
            v = self._a2a[(rows, ranks)] = self._cost.all_to_all_s(rows, ranks)
        return v


class _Common:
    def __init__(self, cost, shapes, cfg: RuntimeConfig, requests, record_spans: bool) -> None:
        cost = _Memo(cost)
        self.cost, self.shapes, self.cfg = cost, shapes, cfg
        self.engine = Engine()
        self.cpu = cost.cores is not None  # ranks share this host's CPU cores
        self.host = Host(self.engine, cost.cores)
        self.spans = [] if record_spans else None
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, r.prompt_len) for r in requests}
        if len(self.records) != len(requests):
            raise ValueError("simulate: request ids must be unique")
        self.moe = [bool(m) for m in shapes.moe_layers]
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
        return sum(self.cost.message_s(8 * (c.length + 4)) for c in chunks)

    def _segments(self):
        """Per micro-batch: the layer runs between MoE layers: [(dense layers before, MoE layer or None)]."""
        segs, dense = [], 0
        for m in self.moe:
            if m:
                segs.append((dense, True))
                dense = 0
            else:
                dense += 1
        segs.append((dense, False))  # the dense layers after the last MoE layer, then the head
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
    def __init__(self, cost, shapes, cfg, requests, record_spans) -> None:
        super().__init__(cost, shapes, cfg, requests, record_spans)
        A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
        self.A, self.E = A, E
        self.placer = Placer(A, load_aware=cfg.load_aware)
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(A)]
        self.running = [0] * A
        self.max_running = 2 if cfg.ping_pong else 1
        self.att = [Rank(self.engine, self.host, f"attention {r}", spans=self.spans) for r in range(A)]
        # one representative expert rank for all E (see the module docstring); the most-loaded share of experts
        self.local = -(-shapes.num_experts // E)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self.ex = Rank(self.engine, self.host, f"experts x{E}", weight=E, spans=self.spans)
        self.ex_batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s,
                                        enabled=cfg.expert_batching)
        self.ex_wake = None  # (time, handle) of the pending deadline wake-up
        self.segs = self._segments()
        rt = self.cost.runtime
        self.k_att, self.k_exp, self.layer_overhead = (rt["async_attention"], rt["async_expert"],
                                                       rt["async_layer_overhead_s"])

    def _rows(self, tokens: int) -> int:
        return max(1, round(tokens * self.frac)) if tokens else 0

    def _queued(self, rank: int) -> None:
        self._fill(rank)

    def _fill(self, rank: int) -> None:
        while self.running[rank] < self.max_running:
            batch = self.batchers[rank].next_batch()
            if not batch:
                return
            self.running[rank] += 1
            mb = _MicroBatch(rank, batch, self.cost.attention_s([(c.length, c.start) for c in batch]))
            self._segment(mb, first=True)

    def _segment(self, mb: _MicroBatch, first: bool = False) -> None:
        """Queue the attention-side work up to the next dispatch (or the end) of ``mb``."""
        cost, T = self.cost, mb.tokens
        dense, moe = self.segs[mb.seg]
        work = (cost.embed_s(T) if first else 0.0) + dense * (mb.attn_s + cost.dense_mlp_s(T))
        if moe:
            rows = self._rows(T)
            work += mb.attn_s + cost.router_s(T)
            if self.cpu:  # the attention rank's CPU copies the rows into each expert rank's memory
                work += self.E * cost.dispatch_s(rows)
            self.att[mb.rank].submit(work * self.k_att, lambda: self._dispatched(mb, rows), f"attn seg {mb.seg}")
        else:
            last = [c for c in mb.chunks if c.last]
            work += cost.head_s(len(last)) if last else 0.0
            self.att[mb.rank].submit(work * self.k_att, lambda: self._tail_done(mb), "attn tail")

    def _dispatched(self, mb: _MicroBatch, rows: int) -> None:
        mb.waiting = 2
        # shared experts run right after the dispatch on the same rank (same generator step)
        self.att[mb.rank].submit(self.cost.shared_experts_s(mb.tokens) * self.k_att, lambda: self._part_back(mb),
                                 "shared", front=True)
        delay = 0.0 if self.cpu else self.cost.dispatch_s(rows)
        self.engine.after(delay, self._expert_arrive, mb, rows)

    def _expert_arrive(self, mb: _MicroBatch, rows: int) -> None:
        self.ex_batcher.add(mb.seg, rows, (mb, rows), self.engine.now)
        self._poke()

    def _poke(self) -> None:
        if self.ex.busy:
            return  # looked at again when the running batch ends
        now = self.engine.now
        layer = self.ex_batcher.ready(now)
        if layer is None:
            wait = self.ex_batcher.wait_s(now)
            if wait is not None:
                t = now + max(wait, 1e-9)  # never "now" again: the deadline test must see time move
                if self.ex_wake is None or self.ex_wake[0] > t:
                    if self.ex_wake is not None:
                        Engine.cancel(self.ex_wake[1])
                    self.ex_wake = (t, self.engine.at(t, self._wake))
            return
        items = self.ex_batcher.take(layer)
        tokens = sum(mb.tokens for mb, _ in items)
        work = self.cost.experts_s(_pairs(tokens, self.shapes, self.local))
        if self.cpu:  # the expert rank's CPU copies each micro-batch's output rows back
            work += sum(self.cost.combine_s(rows) for _, rows in items)
        self.ex.submit(work * self.k_exp, lambda: self._experts_done(items), f"experts seg {layer} ({len(items)} mb)")

    def _wake(self) -> None:
        self.ex_wake = None
        self._poke()

    def _experts_done(self, items: list) -> None:
        for mb, rows in items:
            delay = (0.0 if self.cpu else self.cost.combine_s(rows)) + self.layer_overhead
            self.engine.after(delay, self._part_back, mb)
        self._poke()

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
        ranks = [(f"attention {r}", "attention", rk, 1) for r, rk in enumerate(self.att)]
        ranks += [(f"expert 0..{self.E - 1}", "expert", self.ex, self.E)]
        return end, ranks


# ----------------------------------------------------------------------------- synchronous DP+EP baseline
class _SyncSim(_Common):
    def __init__(self, cost, shapes, cfg, requests, record_spans, num_ranks: int) -> None:
        super().__init__(cost, shapes, cfg, requests, record_spans)
        W = self.W = num_ranks
        self.placer = Placer(W, load_aware=cfg.load_aware)
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(W)]
        self.local = -(-shapes.num_experts // W)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self.busy = [0.0] * W
        self.stepping = False
        self.check_at = None  # a pending step check (heartbeat)
        self.segs = self._segments()
        self.steps = 0
        self.k, self.layer_overhead = self.cost.runtime["sync_compute"], self.cost.runtime["sync_layer_overhead_s"]

    def _queued(self, rank: int) -> None:
        if not self.stepping and self.check_at is None:
            # the idle ranks notice at their next heartbeat: the others' 1 ms receive timeouts must expire
            delay = (1.0 - 1.0 / self.W) * SYNC_IDLE_POLL_S + self.cost.all_reduce_s(self.W)
            self.check_at = self.engine.after(delay, self._step)

    def _step(self) -> None:
        self.check_at = None
        batches = [b.next_batch() for b in self.batchers]
        if not any(batches):
            self.stepping = False
            return
        self.stepping = True
        self.steps += 1
        cost, W, cores = self.cost, self.W, self.cost.cores
        tokens = [sum(c.length for c in b) for b in batches]
        attn = [cost.attention_s([(c.length, c.start) for c in b]) if b else 0.0 for b in batches]
        rows = [round(t * self.frac) for t in tokens]
        # every token of every rank may choose this rank's experts: its share of the (token, expert) pairs
        # is sum(tokens) * top_k * local / N (see _pairs)
        k = self.k
        expert_work = k * cost.experts_s(_pairs(sum(tokens), self.shapes, self.local)) if sum(tokens) else 0.0
        a2a_rows = max(max(rows), round(sum(rows) / W))  # the busiest sender / receiver
        a2a = cost.all_to_all_s(0, W) + 2 * cost.all_to_all_s(a2a_rows, W)  # counts, dispatch, combine
        t = cost.all_reduce_s(W)
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
                w = (cost.embed_s(T) if i == 0 else cost.shared_experts_s(T))
                w += dense * (attn[r] + cost.dense_mlp_s(T))
                if moe:
                    w += attn[r] + cost.router_s(T)
                else:
                    last = sum(1 for c in batches[r] if c.last)
                    w += cost.head_s(last) if last else 0.0
                pending[r] += k * w
            if not moe:
                break
            seg = spin * max(pending) if cores is not None else ps_makespan(pending, None)
            ex = spin_ex * expert_work
            t += seg + a2a + ex + self.layer_overhead
            for r in range(W):
                self.busy[r] += pending[r] + expert_work
            pending = [0.0] * W
        tail = spin * max(pending)
        for r in range(W):
            self.busy[r] += pending[r]
        t += tail
        if self.spans is not None:  # each rank's own compute of the step (the rest of the step it waits)
            for r in range(W):
                self.spans.append((f"rank {r}", "step" if batches[r] else "dummy step (experts only)",
                                   self.engine.now, self.busy[r] - busy_before[r]))
        self.engine.after(t, self._step_done, batches)

    def _step_done(self, batches: list) -> None:
        for r, b in enumerate(batches):
            for c in b:
                self.batchers[r].done(c)
                if c.last:
                    self.engine.after(self.msg_result, self._result, c.request_id)
        # the loop comes straight back to the next step's all_reduce
        self._step()

    def run(self) -> tuple:
        self._arrivals(self.arrive)
        end = self.engine.run()

        class _Busy:  # the per-rank busy time in the Rank interface
            def __init__(self, busy_s: float, jobs: int) -> None:
                self.busy_s, self.jobs = busy_s, jobs

        ranks = [(f"rank {r}", "dp+ep", _Busy(self.busy[r], self.steps), 1) for r in range(self.W)]
        return end, ranks


def simulate(mode: str, requests, cost, shapes, cfg: RuntimeConfig = RuntimeConfig(), *,
             sync_ranks: int | None = None, spans: bool = False) -> SimResult:
    """Simulate ``requests`` (``asap_comm.serving.traces.Request``: id, arrival, prompt length).

    ``mode``: ``"async"`` (``cfg.num_attention_ranks`` + ``cfg.num_expert_ranks``
    ranks) or ``"sync"`` (``sync_ranks`` DP+EP ranks, default the same total).
    Returns records with the runtime's fields, so ``summarize_run`` applies.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"simulate: mode must be 'async' or 'sync', got {mode!r}")
    t0 = time.perf_counter()
    if mode == "async":
        sim = _AsyncSim(cost, shapes, cfg, requests, spans)
    else:
        W = cfg.num_attention_ranks + cfg.num_expert_ranks if sync_ranks is None else sync_ranks
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"simulate: sync_ranks={sync_ranks!r} must be an int >= 1")
        sim = _SyncSim(cost, shapes, cfg, requests, spans, W)
    end, ranks = sim.run()
    records = sim._finish_records()
    span = max(end, 1e-12)
    stats = [{"rank": name, "role": role, "busy_s": rk.busy_s, "idle_s": max(0.0, span - rk.busy_s),
              "utilisation": min(1.0, rk.busy_s / span), "jobs": rk.jobs, "stands_for": n}
             for name, role, rk, n in ranks]
    return SimResult(mode, records, stats, end, sim.engine.events, time.perf_counter() - t0,
                     sim.spans or [])
