"""ASAP (``"async"``) simulated: attention ranks with ping-pong micro-batches and one representative expert rank
that batches rows per layer (``simulate.py`` has the modelling choices)."""
from __future__ import annotations

import math

from ...serving.policies import ExpertBatcher, MicroBatcher, Placer
from .common import Parallelism, _Common, batch_skew, rows_per_rank_fraction
from .engine import Engine, Rank
from .lane import Lane


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
        self.placer = Placer(A, load_aware=cfg.load_aware, linear_weight=self._placer_weight())
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(A)]
        self.running = [0] * A
        self.max_running = 2 if cfg.ping_pong else 1
        name = "attention" if self.tp == 1 else f"attention group (TP {self.tp})"
        self.att = [Rank(self.engine, self.host, f"{name} {r}", spans=self.spans) for r in range(A)]
        # one representative expert rank for all E (see the module docstring); the most-loaded share of experts
        self.local = -(-shapes.num_experts // E)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self._skew(E)  # a skewed routing: the representative is the hottest expert rank
        self.ex = Rank(self.engine, self.host, f"experts x{E}", weight=E, spans=self.spans)
        self.ex_batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s,
                                        enabled=cfg.expert_batching)
        self.ex_wake = None  # (time, handle) of the pending deadline wake-up
        # a dedicated expert device (not a shared CPU): its batches are scheduled directly (_poke), it is busy
        # until ex_free, and ex_end is the pending look at its batcher when the running batch ends
        self.direct = not self.cpu
        self.ex_free, self.ex_end = 0.0, None
        self._ex_memo: dict = {}  # tokens -> the expert compute of a batch of that many tokens (operators only)
        self._link_memo: dict = {}  # (transfer, rows, tokens, weight) -> (latency, fan-out time, serial time)
        self.ex_in_free = self.ex_out_free = 0.0  # when the expert rank's link is free to receive / to send
        self.segs = self._segments()
        # the lock-step ablation (barrier_free=False): every dispatch is a barrier among the A attention ranks
        self.lockstep = not cfg.barrier_free and A > 1
        self.at_barrier: dict = {}  # rank -> (micro-batch, rows) waiting at the current step
        if self.lockstep:
            for rk in self.att:
                rk.on_idle = self._try_release
        rt = self.cost.runtime
        self.k_att, self.k_exp, self.layer_overhead = (rt["async_attention"], rt["async_expert"],
                                                       rt["async_layer_overhead_s"])
        self.job_overhead = rt["async_job_overhead_s"]  # busy time of each attention-rank job outside operators
        # busy time of each expert-rank batch outside operators; the slowest expert rank's work over the mean's
        self.ex_job_overhead, self.ex_skew = rt["async_expert_job_overhead_s"], rt["expert_skew"]
        self.serial_tx = par.serial_expert_transfers  # transfers held by the expert rank after computing
        self.slo_s = None  # the run's TTFT SLO when known (simulate(..., slo_s=)): the lane's predicate
        self.lane = Lane(self) if cfg.long_prompt_lane and A > 1 else None  # lane.py
        self.fill_pending: set = set()  # idle groups that form their micro-batch pair at the end of this instant

    def arrive(self, r) -> None:
        if self.lane is not None and self.lane.arrive(r):
            return
        super().arrive(r)

    def arrive_usual(self, r) -> None:
        """Admit ``r`` the usual way (one group), now: a prompt that waited too long for the lane (lane.py)."""
        super().arrive(r)

    def _rows(self, tokens: int) -> int:
        return max(1, round(tokens * self.frac)) if tokens else 0

    def _per_device(self, tokens: int) -> int:
        """Tokens of one device of the attention group after the reduce-scatter (all of them when tp=1)."""
        return -(-tokens // self.tp)

    def _queued(self, rank: int) -> None:
        if self.cfg.token_balanced and self.max_running - self.running[rank] >= 2:
            # an idle group forms its balanced pair from every chunk that reaches it at this instant
            if rank not in self.fill_pending:
                self.fill_pending.add(rank)
                self.engine.after(0.0, self._fill_pending, rank)
            return
        self._fill(rank)

    def _fill_pending(self, rank: int) -> None:
        self.fill_pending.discard(rank)
        self._fill(rank)

    def _fill(self, rank: int) -> None:
        limit = self.max_running
        if self.lane is not None:  # a lane micro-batch first; a slot kept for one that waits to start
            self.lane.start(rank)
            limit -= self.lane.reserved(rank)
        ready = None if self.lane is None else self.lane.ready_fn(rank)
        if self.cfg.token_balanced and limit - self.running[rank] >= 2:  # the pair formed together, balanced
            for batch in self.batchers[rank].next_batches(2, ready):  # as the runtime's rank forms it
                self._start_batch(rank, batch)
        while self.running[rank] < limit:
            batch = self.batchers[rank].next_batch(ready)
            if not batch:
                return
            self._start_batch(rank, batch)

    def _start_batch(self, rank: int, batch: list) -> None:
        if self.lane is not None and self.lane.takes(batch):  # a lane chunk, alone in its micro-batch
            self.lane.run_chunk(rank, batch[0])
            return
        self.running[rank] += 1
        attn = self.cost.attention_s([(c.length, c.start) for c in batch], self.tp)
        # a TP group's layer also pays its reduce-scatter + all-gather (0 when tp=1)
        attn += self.cost.tp_all_reduce_s(sum(c.length for c in batch), self.tp)
        mb = _MicroBatch(rank, batch, attn)
        self._segment(mb, first=True)

    def _segment(self, mb: _MicroBatch, first: bool = False) -> None:
        """Queue the attention-side work up to the next dispatch (or the end) of ``mb``."""
        if hasattr(mb, "lane"):
            self.lane.segment(mb)
            return
        cost, T = self.cost, mb.tokens
        Td = self._per_device(T)
        dense, moe = self.segs[mb.seg]
        work = (cost.embed_s(T) if first else 0.0) + dense * (mb.attn_s + cost.dense_mlp_s(Td))
        if moe:
            rows = self._rows(Td)  # rows one device of the group sends to one expert rank
            work += moe * (mb.attn_s + cost.router_s(Td))
            if self.cpu:  # the attention rank's CPU copies the rows into each expert rank's memory
                work += moe * (self.E * cost.dispatch_s(rows) if self.load is None
                               else sum(cost.dispatch_s(self.load.rows(Td, r)) for r in range(self.E)))
            then = self._dispatched if not self.lockstep else self._arrive_barrier
            self.att[mb.rank].submit(work * self.k_att + self.job_overhead, lambda: then(mb, rows),
                                     f"attn seg {mb.seg}" if self.spans is not None else "")
        else:
            last = [c for c in mb.chunks if c.last]
            work += cost.head_s(len(last)) if last else 0.0
            self.att[mb.rank].submit(work * self.k_att + self.job_overhead, lambda: self._tail_done(mb), "attn tail")

    # ------------------------------------------------------------------ lock-step ablation (asap_comm.serving
    # .async_ranks._Lockstep): a rank that reaches a dispatch waits (blocked: its other micro-batch waits too)
    # until every other attention rank has reached one or has nothing to compute (it joins the step for free);
    # the step's signals cost one small all_reduce among the A ranks
    def _arrive_barrier(self, mb: _MicroBatch, rows: int) -> None:
        self.att[mb.rank].hold()
        self.at_barrier[mb.rank] = (mb, rows)
        self._try_release()

    def _try_release(self) -> None:
        if not self.at_barrier:
            return
        for r, rk in enumerate(self.att):
            if r not in self.at_barrier and (rk.busy or rk.queued):
                return  # still computing: it will reach a dispatch or run out of work
        step, self.at_barrier = list(self.at_barrier.values()), {}
        self.engine.after(self.cost.all_reduce_s(self.A), self._release_step, step)

    def _release_step(self, step: list) -> None:
        for mb, rows in step:
            self._dispatched(mb, rows)  # queues the shared-expert job first on the held rank
            self.att[mb.rank].release()
        self._try_release()

    def _dispatched(self, mb: _MicroBatch, rows: int) -> None:
        mb.waiting = 2
        # shared experts run right after the dispatch on the same rank (same generator step)
        w = self.segs[mb.seg][1]
        self.att[mb.rank].submit(w * self.cost.shared_experts_s(self._per_device(mb.tokens)) * self.k_att,
                                 lambda: self._part_back(mb), "shared", front=True)
        self.engine.after(0.0 if self.cpu or self.serial_tx else self._dispatch_delay(mb, rows), self._expert_arrive,
                          mb, rows)

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
        delay, self.ex_in_free = self._through_expert_link(self.cost.dispatch_s, mb, rows, self.ex_in_free)
        return delay

    def _expert_arrive(self, mb: _MicroBatch, rows: int) -> None:
        # an expert rank holds rows from every device of the group: the micro-batch's rows for it
        self.ex_batcher.add(mb.seg, rows if self.tp == 1 else self._rows(mb.tokens), (mb, rows), self.engine.now)
        self._poke()

    def _poke(self) -> None:
        now = self.engine.now
        if self.ex.busy or (self.direct and now < self.ex_free):
            if self.direct and self.ex_end is None:  # look again when the running batch ends
                self.ex_end = self.engine.at(self.ex_free, self._ex_end)
            return  # looked at again when the running batch ends
        layer, wait = self.ex_batcher.poll(now)
        if layer is None:
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
        ex_s = self._ex_memo.get(tokens)
        if ex_s is None:  # the expert compute of a batch depends on its tokens only
            ex_s = self._ex_memo[tokens] = self.cost.experts_s(self._expert_pairs(tokens))
        work = w * ex_s
        if self.cpu:  # the expert rank's CPU copies each micro-batch's output rows back
            work += w * sum(self.cost.combine_s(rows) for _, rows in items)
        elif self.serial_tx:  # the batch's dispatch + combine held after computing it (the emulator's hold_transfer)
            r = sum(rows if self.tp == 1 else self._rows(mb.tokens) for mb, rows in items)
            work += w * (self.cost.dispatch_s(r) + self.cost.combine_s(r)) / self.k_exp
        # a served router's skew, averaged over the batch's prompts
        skew = (1.0 if self.ex_skew == 1.0 else
                batch_skew(self.ex_skew, ((c.request_id, c.length) for mb, _ in items for c in mb.chunks)))
        work = work * self.k_exp * skew + self.ex_job_overhead
        label = f"experts seg {layer} ({len(items)} mb)" if self.spans is not None else ""
        if not self.direct:
            self.ex.submit(work, lambda: self._experts_done(items), label)
            return
        # a dedicated expert device: the batch's end is known now, so each micro-batch's combine return is
        # scheduled now (the expert link sends them in batch order, as at the end), and the rank looks at its
        # batcher again at the end only if rows wait for it (held now, or arrived meanwhile: _poke above)
        end = now + work
        ex = self.ex
        ex.busy_s += end - now
        ex.jobs += 1
        if ex._spans is not None:
            ex._spans.append((ex.name, label, now, end - now))
        self.ex_free = end
        at = self.engine.at
        if self.ex_wake is not None:  # a deadline passing while the batch runs is seen at its end (below)
            Engine.cancel(self.ex_wake[1])
            self.ex_wake = None
        if self.ex_batcher.held:  # rows of other layers wait: look again at the end
            self.ex_end = at(end, self._ex_end)
        for mb, rows in items:
            delay = (0.0 if self.serial_tx else self._combine_delay(mb, rows, end)) + self.layer_overhead
            at(end + delay, self._combine_back, mb)

    def _ex_end(self) -> None:
        self.ex_end = None
        self._poke()

    def _wake(self) -> None:
        self.ex_wake = None
        self._poke()

    def _experts_done(self, items: list) -> None:
        for mb, rows in items:
            delay = (0.0 if self.cpu or self.serial_tx else self._combine_delay(mb, rows)) + self.layer_overhead
            self.engine.after(delay, self._combine_back, mb)
        self._poke()

    def _combine_delay(self, mb: _MicroBatch, rows: int, now: "float | None" = None) -> float:
        """When a micro-batch's combined rows are back, on a cluster profile: the expert rank's link sends the
        micro-batches of a batch one after another (``ex_out_free``); the receiving device's link takes ``rows``
        from each of the E expert ranks. ``now``: when the batch ends (default: the clock)."""
        delay, self.ex_out_free = self._through_expert_link(self.cost.combine_s, mb, rows, self.ex_out_free, now)
        return delay

    def _through_expert_link(self, transfer_s, mb: _MicroBatch, rows: int, link_free: float,
                             now: "float | None" = None) -> "tuple[float, float]":
        """(delay, when the expert rank's link is free again) of one transfer between an attention device and the
        expert ranks, either way: the device's side moves ``rows`` to or from each of the E expert ranks at once;
        the expert rank's link takes the micro-batches one after another from ``link_free``."""
        if now is None:
            now = self.engine.now
        lat, fan, serial = self._link_times(transfer_s, rows, mb.tokens, self.segs[mb.seg][1])
        link_free = max(now, link_free) + serial
        return max(fan, link_free - now) + lat, link_free

    def _link_times(self, transfer_s, rows: int, tokens: int, w: float) -> tuple:
        """(latency, the device's fan-out time, the expert link's time) of one transfer of a micro-batch of
        ``tokens`` tokens sending ``rows`` rows to each expert rank, in a layer of weight ``w`` (memoised; the
        native core, ``native.py``, asks it too)."""
        key = (transfer_s, rows, tokens, w)
        got = self._link_memo.get(key)
        if got is None:
            lat, _ = self._link(transfer_s, rows, w)
            fan_rows = self.E * rows if self.load is None else round(rows * self.load.rows_per_token / self.frac)
            _, fan = self._link(transfer_s, fan_rows, w)  # skewed: the rows for every expert rank together
            _, serial = self._link(transfer_s, self._rows(tokens) if self.tp > 1 else rows, w)
            got = self._link_memo[key] = (lat, fan, serial)
        return got

    def _part_back(self, mb: _MicroBatch) -> None:
        mb.waiting -= 1
        if mb.waiting == 0:
            mb.seg += 1
            self._segment(mb)

    # a micro-batch's combined rows are back from the expert ranks (the shared-expert part comes back through
    # _part_back itself); failover.py's subclass overrides it to know which rows are still out at a failure
    _combine_back = _part_back

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
