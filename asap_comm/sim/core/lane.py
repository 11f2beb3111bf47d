"""The long-prompt lane of ASAP's attention side, simulated (issue 21), and token-balanced micro-batch pairs.

**Sequence-pipelined lane** (``RuntimeConfig.long_prompt_lane``, the design the runtime builds too): a long
prompt is split into its chunks (``chunk_len``) and chunk ``j`` runs on group ``ranks[j % g]``, the ``g = min(lane_groups
or A, chunks)`` least-loaded attention groups when it arrives (``Placer.place_lane``). Each group computes its chunk
layer by layer as usual (attention, then the MoE layer through the expert ranks as usual). After the attention stage
of layer ``l`` of chunk ``j`` its group puts that layer's KV latents of chunk ``j`` (``(kv_lora_rank + qk_rope) *
activation bytes`` a token) to every group holding a later chunk, with a signal (:func:`kv_put_s`: one p2p transfer
per receiving group over the sender's link; on a shared CPU host a copy by the sender). Before the attention stage of
layer ``l`` of chunk ``j`` the group waits for the layer-``l`` KV of every chunk ``< j`` (no barrier: a wait on
signals from the chunks before it only; meanwhile the group computes its other ping-pong slot's work). Chunks
advance as a wavefront: TTFT about ``L + n - 1`` chunk-layer steps instead of ``n * L`` on one group.

**Admission and scheduling** (``admission("runtime")``, the default; the runtime's ``serving.lane.FrontLane`` and
``LaneRank``): a prompt of two chunks or more takes the lane (lanes may share groups) once one of ``lane_slots``
slots and ``len`` contiguous rows of the ``lane_tokens`` KV pool are free (``serving.lane.LanePool``); until then it
waits, first come first served (a prompt longer than the pool goes the usual way). Its chunks queue in their groups' micro-batchers (``MicroBatcher.add(stride=g)``) beside the short
prompts' chunks, in arrival order; each runs alone in a micro-batch, in either ping-pong slot, and starts only once
every earlier chunk computed elsewhere has put its first layer's KV (:meth:`Lane.ready_fn`, as
``LaneRank.can_start``), so lanes sharing groups never hold each other in a cycle of waits. The slot is free again
when the result reaches the front end.

**Which prompts** (:meth:`Lane.wants`): the lane needs ``long_prompt_lane``, two groups or more and a prompt of
two chunks or more; then ``lane_threshold`` (an int) takes prompts longer than that many tokens; with
``lane_threshold=None`` a run that knows its SLO (``simulate(..., slo_s=)``) takes a prompt whose predicted
TTFT alone on one group (compute and MoE round trips of its chunks in order; no queueing) exceeds
``LANE_SLO_FRACTION`` of the SLO (the runtime's ``--lane-threshold auto`` of ``examples/prefill.py``), and one that
does not takes every prompt of more than one chunk.

**The simulator's earlier admission** (``admission("exclusive")``, for studies; the runtime does not have it): the
prompt spreads over the ``k <= g`` least-loaded groups that minimise its expected finish (:meth:`Lane.idle_enough`:
the ``k``-th least outstanding work plus its own over ``k``; ``k = 1``: no lane), only if none of them holds a
lane already; its chunks wait in a lane queue per group that goes before the short prompts, one lane chunk per group
at a time, and a group keeps a slot free for a lane chunk waiting to start. Until 2026-12-02 this was the
simulator's only rule, while the runtime had the one above: the emulated validation's ASAP tails were 18-60% off.

**Design study alternatives** (``lane_study.py``; :func:`design` switches, default ``"pipe"``): ``"cp"`` is
context parallelism across attention groups per layer: each chunk's tokens are shared by the ``g`` groups
(zig-zag halves, as the baseline's CP: ``attention_s((T, C, g))`` each), every layer all-gathers the KV latents
among them (``cp_exchange_s``) and couples the ``g`` groups (a group-local barrier before each layer's
attention); the ``g`` shares of a chunk start together (gang), the chunks run in order (admitted by the exclusive
rule). ``LANE_SPLIT > 1`` (finer lane chunks) also runs with the exclusive rule.

**Token-balanced pairs** (``RuntimeConfig.token_balanced``): when both ping-pong slots of a group are free, the
two micro-batches are formed together by the runtime's ``MicroBatcher.next_batches(2)`` (eligible chunks in arrival
order up to twice the budget, assigned largest first to the lighter micro-batch).
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict, deque

from ...serving.lane import LaneCounts, LanePool, chunk_may_start, lane_groups, lane_slots, lane_split, lane_tokens
from ...serving.policies import split_prompt
from .common import _pairs, _validate

__all__ = ["LANE_SLO_FRACTION", "LANE_WAIT_SLO", "DESIGNS", "ADMISSIONS", "design", "admission", "kv_put_s", "Lane"]

LANE_SLO_FRACTION = 0.5  # lane when the predicted TTFT alone on one group exceeds this share of the SLO
# the tools' default RuntimeConfig.lane_wait_s: a prompt waits at most this many SLOs for room in the lane, then runs
# on one group (replays of the emulated runs through simulate_emulated: at 64 dies, 6 x TP8 + 16, a pool of one
# prompt and no bound served 377-389 tok/s at 8-12 req/s with p99 29-41 s; 2 SLOs served 575-605 with p99 18-20 s
# at the same p90 attainment; at 32 dies 2 SLOs left the attainment at 3.77 req/s unchanged, 1 SLO cut it to 0.82)
LANE_WAIT_SLO = 2.0
DESIGNS = ("pipe", "cp")
_DESIGN = ["pipe"]
LANE_SPLIT = [1]  # study knob: lane chunks of chunk_len / this (1: the runtime's chunks)
ADAPTIVE = [True]  # the "exclusive" admission: spread over the groups idle enough only (Lane.idle_enough)
ADMISSIONS = ("runtime", "exclusive")
_ADMISSION = ["runtime"]


@contextlib.contextmanager
def _switched(cell: list, name: str, allowed: tuple, who: str):
    """Within the block, the study knob ``cell`` holds ``name`` (one of ``allowed``; ``who`` names the caller)."""
    if name not in allowed:
        raise ValueError(f"lane.{who}: {name!r} is not one of {allowed}")
    old = cell[0]
    cell[0] = name
    try:
        yield
    finally:
        cell[0] = old


def design(name: str):
    """Within the block, simulated lanes use design ``name`` (``"pipe"``: the sequence-pipelined lane;
    ``"cp"``: context parallelism across attention groups). For the design study; the runtime has ``"pipe"``."""
    return _switched(_DESIGN, name, DESIGNS, "design")


def admission(name: str):
    """Within the block, simulated sequence-pipelined lanes admit prompts by rule ``name``: ``"runtime"`` (the
    default; the runtime's front end, ``serving.lane.FrontLane``) or ``"exclusive"`` (the simulator's rule before
    2026-12-02: groups idle enough, one lane per group, lane chunks first). For studies; the runtime has
    ``"runtime"``."""
    return _switched(_ADMISSION, name, ADMISSIONS, "admission")


def kv_put_s(cost, shapes, tokens: int, fanout: int) -> float:
    """One layer's KV latents of ``tokens`` tokens put to ``fanout`` groups over the sender's p2p link (the
    profile's ``p2p`` latency once, then ``fanout * tokens * (kv_lora_rank + qk_rope) * activation_bytes``
    bytes; a TP group's devices each send their replica of the latents to their counterparts, in parallel).
    A cost model without a profile (tests): ``fanout * dispatch_s(tokens)``."""
    if not tokens or not fanout:
        return 0.0
    p2p = getattr(getattr(cost, "profile", None), "p2p", None)
    if p2p is None or not hasattr(shapes, "kv_lora_rank"):
        return fanout * cost.dispatch_s(tokens)
    row = (shapes.kv_lora_rank + shapes.qk_rope) * cost.a
    return p2p["latency_s"] + fanout * tokens * row * p2p["s_per_byte"]


class _LaneMB:
    """A lane micro-batch: ``_AsyncSim``'s micro-batch fields (one chunk, or one share of it) and where it is."""
    __slots__ = ("rank", "chunks", "tokens", "attn_s", "seg", "waiting", "lane", "sub", "sub_seg")

    def __init__(self, rank: int, chunk, tokens: int, attn_s: float, lane: tuple) -> None:
        self.rank, self.chunks, self.tokens, self.attn_s, self.lane = rank, [chunk], tokens, attn_s, lane
        self.seg = self.waiting = self.sub = self.sub_seg = 0


class _LaneRequest:
    __slots__ = ("rid", "chunks", "ranks", "g", "design", "ready", "waiters", "started", "next", "done", "arrived",
                 "gate", "fanout")

    def __init__(self, rid: int, chunks: list, ranks: list, design_: str, steps: int) -> None:
        self.fanout: dict = {}  # pipe: chunk -> one layer's KV put to the later chunks' other groups (s)
        self.rid, self.chunks, self.ranks, self.g, self.design = rid, chunks, ranks, len(ranks), design_
        n = len(chunks)
        self.ready = [[False] * n for _ in range(steps)]  # pipe: layer k's KV of chunk j has arrived
        self.waiters: list = [[] for _ in range(steps)]  # mbs waiting for layer k's KV (pipe) / barrier (cp)
        self.started = 0  # pipe: chunks started (in index order)
        self.next = 0  # cp: the chunk whose shares run or run next
        self.done = 0  # cp: shares of the current chunk done
        self.arrived = [0] * steps  # cp: shares of the current chunk at layer k's barrier
        self.gate = False  # cp: the current chunk's shares are started

    def chunk_rank(self, j: int) -> int:
        return self.ranks[j % self.g]


class Lane:
    """The lane of one simulated ASAP run (``_AsyncSim`` calls it through its hooks; see the module docstring)."""

    def __init__(self, sim) -> None:
        self.sim = sim
        self.design = _DESIGN[0]
        A = sim.A
        self.queue = [deque() for _ in range(A)]  # lane micro-batches waiting for a slot, per group
        self.busy = [0] * A  # lane micro-batches running per group (at most one)
        self.cp_waiting: list = []  # cp requests whose current chunk waits to start (gang)
        # the attention layers of each segment: (weight, is_moe) of its dense layers, then its MoE layer
        self.seg_layers, self.offset, k, cur = [], [], 0, []
        for m, w in zip(sim.moe, sim.layer_weight):
            cur.append((w, m))
            if m:
                self.seg_layers.append(cur)
                cur = []
        self.seg_layers.append(cur)
        for layers in self.seg_layers:
            self.offset.append(k)
            k += len(layers)
        self.steps = k
        self.counts = LaneCounts()  # lanes opened, prompts that waited, gave up (SimResult.lane), as the runtime
        # the runtime's admission (FrontLane): lane_slots lanes in flight at most; their chunks queue in the groups'
        # micro-batchers like any chunk (alone in a micro-batch, gated by Lane.ready_fn)
        self.fifo = self.design == "pipe" and LANE_SPLIT[0] == 1 and _ADMISSION[0] == "runtime"
        if sim.cfg.lane_chunks != "tokens" and not self.fifo:
            raise ValueError(f"Lane: lane_chunks={sim.cfg.lane_chunks!r} is modelled for the runtime's lane only "
                             f"(design 'pipe', admission 'runtime', LANE_SPLIT 1; here {self.design!r}, "
                             f"{_ADMISSION[0]!r}, {LANE_SPLIT[0]})")
        self.pool = LanePool(lane_slots(sim.cfg), lane_tokens(sim.cfg))  # slots and KV pool rows, as FrontLane
        # request id -> (request, chunks) waiting for room in the pool, first come first served (ordered: O(1) to
        # take the first, or to drop one that gives up)
        self.waiting: OrderedDict = OrderedDict()
        self.live: dict = {}  # request -> _LaneRequest, lanes in flight (runtime admission)
        self._predicted: dict = {}  # (prompt length, chunks) -> predicted_s

    # ------------------------------------------------------------------ admission
    def groups_for(self, n_chunks: int) -> int:
        """The groups a lane prompt of ``n_chunks`` equal-length chunks shares (``serving.lane.lane_groups``)."""
        return lane_groups(self.sim.cfg, self.sim.A, n_chunks)

    def idle_enough(self, chunks: list, g: int) -> int:
        """How many of the least-loaded groups the prompt should spread over: the ``k <= g`` that minimises
        its expected finish, the ``k``-th least outstanding work (``Placer``) plus its own work over ``k``;
        1 where the other groups are busier than the prompt's gain (no lane)."""
        work = sorted(self.sim.placer.outstanding)
        own = sum(c.cost for c in chunks)
        return min(range(1, g + 1), key=lambda k: (work[k - 1] + own / k, k))

    def predicted_s(self, chunks: list) -> float:
        """TTFT of the chunks alone on one group, in order: attention, dense, router, shared and expert compute
        of every layer and each MoE layer's dispatch, combine and expert-batch deadline (no queueing, no link contention): the lane's
        predicate, not a simulation."""
        sim, cost, tp, cfg = self.sim, self.sim.cost, self.sim.tp, self.sim.cfg
        t = 0.0
        for c in chunks:
            Td = -(-c.length // tp)
            attn = cost.attention_s([(c.length, c.start)], tp) + cost.tp_all_reduce_s(c.length, tp)
            for layers in self.seg_layers:
                for w, moe in layers:
                    if moe:
                        ex = cost.experts_s(_pairs(c.length, sim.shapes, sim.local))
                        rows = sim._rows(Td)
                        if cfg.expert_batching and sim._rows(c.length) < cfg.expert_token_budget:
                            t += cfg.expert_deadline_s  # alone, the expert batch waits for its deadline
                        t += w * ((attn + cost.router_s(Td) + cost.shared_experts_s(Td)) * sim.k_att
                                  + ex * sim.k_exp + cost.dispatch_s(rows) + cost.combine_s(rows)) + sim.layer_overhead
                        t += sim.job_overhead
                    else:
                        t += w * (attn + cost.dense_mlp_s(Td)) * sim.k_att
        return t

    def wants(self, r, chunks: list) -> bool:
        cfg = self.sim.cfg
        if not cfg.long_prompt_lane or self.groups_for(len(chunks)) < 2:
            return False
        if cfg.lane_threshold is not None:
            return r.prompt_len > cfg.lane_threshold
        slo = getattr(self.sim, "slo_s", None)
        if slo is None:
            return True
        key = (r.prompt_len, len(chunks))
        if key not in self._predicted:
            self._predicted[key] = self.predicted_s(chunks)
        return self._predicted[key] > LANE_SLO_FRACTION * slo

    def arrive(self, r) -> bool:
        """Admit ``r`` to the lane if it qualifies (True), else leave it to the usual front end (False)."""
        sim = self.sim
        if _validate(r, sim.cfg) is not None or sim.cfg.effective_chunk_len is None:
            return False
        chunks = split_prompt(r.request_id, r.prompt_len, sim.cfg.effective_chunk_len)
        if len(chunks) < 2 or not self.wants(r, chunks):
            return False
        g = self.groups_for(len(chunks))
        if self.fifo:  # the runtime's front end: a slot and pool rows (or wait for them), the g least-loaded
            if r.prompt_len > self.pool.rows:  # groups, lanes may share them
                return False
            # the lane's own chunks (RuntimeConfig.lane_chunks: equal length as above, or equal cost), as FrontLane
            chunks = lane_split(sim.cfg, r.request_id, r.prompt_len, g, sim.placer.linear_weight)
            self.waiting[r.request_id] = (r, chunks, g)
            self._open_waiting()
            if r.request_id in self.waiting:  # no room now: it waits (the usual way after lane_wait_s)
                self.counts.waited += 1
                if sim.cfg.lane_wait_s is not None:
                    sim.engine.after(sim.cfg.lane_wait_s, self._give_up, r)
            return True
        if ADAPTIVE[0]:
            g = self.idle_enough(chunks, g)
            if g < 2:
                return False
        ranks = sim.placer.place_group(r.request_id, chunks, g)
        if any(self.busy[k] or self.queue[k] or any(k in q.ranks for q in self.cp_waiting) for k in ranks):
            sim.placer.complete(r.request_id)  # a lane already holds one of them: the usual way
            return False
        if LANE_SPLIT[0] > 1 and self.design == "pipe":  # study knob: finer lane chunks (chunk_len / LANE_SPLIT)
            chunks = split_prompt(r.request_id, r.prompt_len, max(1, sim.cfg.effective_chunk_len // LANE_SPLIT[0]))
        sim.records[r.request_id].start_s = sim.engine.now
        req = _LaneRequest(r.request_id, chunks, ranks, self.design, self.steps)
        self.counts.open(0.0)
        sim.engine.after(sim._delivery_s(chunks), self._deliver, req)
        return True

    def _give_up(self, r) -> None:
        """``lane_wait_s`` after it arrived, a prompt still waiting for room in the lane runs the usual way, on one
        group (``FrontEnd`` in the runtime)."""
        if self.waiting.pop(r.request_id, None) is not None:
            self.counts.gave_up += 1
            self.sim.arrive_usual(r)

    def _open_waiting(self) -> None:
        """Open the waiting prompts' lanes, first come first served, while the pool has room (``FrontLane``)."""
        sim = self.sim
        while self.waiting and self.pool.fits(self.waiting[next(iter(self.waiting))][0].prompt_len):
            r, chunks, g = self.waiting.popitem(last=False)[1]
            self.pool.open(r.request_id, r.prompt_len)
            ranks = sim.placer.place_lane(r.request_id, chunks, g)
            sim.records[r.request_id].start_s = sim.engine.now
            req = _LaneRequest(r.request_id, chunks, ranks, self.design, self.steps)
            self.live[r.request_id] = req
            self.counts.open(sim.engine.now - r.arrival_s)
            sim.engine.after(sim._delivery_s(chunks), self._deliver_fifo, req)

    def _deliver_fifo(self, req: _LaneRequest) -> None:
        for j, c in enumerate(req.chunks):
            self.sim.batchers[req.chunk_rank(j)].add(c, stride=req.g)
        for rank in sorted(set(req.ranks)):
            self.sim._queued(rank)

    def ready_fn(self, rank: int):
        """``MicroBatcher.next_batch(ready=)`` of ``rank`` (runtime admission; None otherwise): a lane chunk may
        start once every earlier chunk that another group computes has put its first layer's KV, as
        ``serving.lane.LaneRank.can_start`` (so lanes sharing groups never hold each other in a cycle of waits)."""
        if not self.fifo or not self.live:
            return None

        def ready(chunk) -> bool:
            req = self.live.get(chunk.request_id)
            return req is None or chunk_may_start(chunk.index, req.ranks, rank, lambda k: req.ready[0][k])
        return ready

    def takes(self, batch: list) -> bool:
        """Whether a micro-batch the batcher formed is a lane chunk (runtime admission)."""
        return self.fifo and len(batch) == 1 and batch[0].request_id in self.live

    def run_chunk(self, rank: int, chunk) -> None:
        """Start a lane chunk the group's batcher handed out (runtime admission)."""
        req = self.live[chunk.request_id]
        self._run(self._mb(req, chunk.index, 0, rank))

    def _result(self, rid: int) -> None:
        self.sim._result(rid)
        if self.live.pop(rid, None) is not None:  # the front end frees the lane's slot and rows on the result
            self.pool.close(rid)
            self._open_waiting()

    def _deliver(self, req: _LaneRequest) -> None:
        if req.design == "pipe":
            for j, c in enumerate(req.chunks):
                self.queue[req.chunk_rank(j)].append(self._mb(req, j, 0, req.chunk_rank(j)))
            for rank in sorted(set(req.ranks)):
                self.sim._fill(rank)
        else:
            self.cp_waiting.append(req)
            self._try_cp()

    def _mb(self, req: _LaneRequest, j: int, share: int, rank: int):
        cost, tp = self.sim.cost, self.sim.tp
        c = req.chunks[j]
        if req.design == "pipe":
            attn = cost.attention_s([(c.length, c.start)], tp) + cost.tp_all_reduce_s(c.length, tp)
            tokens = c.length
        else:
            base, extra = divmod(c.length, req.g)
            tokens = base + (1 if share < extra else 0)
            attn = (cost.attention_s([(c.length, c.start, req.g)], tp) + cost.cp_exchange_s(c.length, c.start, req.g, tp)
                    + cost.tp_all_reduce_s(tokens, tp))
        return _LaneMB(rank, c, tokens, attn, (req, j, share))

    # ------------------------------------------------------------------ slots
    def reserved(self, rank: int) -> bool:
        """Whether ``rank`` keeps a slot free of short prompts' micro-batches for a lane micro-batch that waits
        to start on it (its queue, or a cp chunk of which it is a group)."""
        if self.busy[rank]:
            return False
        return bool(self.queue[rank]) or any(rank in req.ranks for req in self.cp_waiting)

    def _may_start(self, rank: int) -> bool:
        """A free slot and no lane micro-batch running on ``rank``."""
        sim = self.sim
        return sim.running[rank] < sim.max_running and not self.busy[rank]

    def start(self, rank: int) -> None:
        """A slot of ``rank`` may be free: start its next startable lane micro-batch (pipe: one whose earlier
        chunks have all started; cp: a chunk whose groups all have a free slot)."""
        sim = self.sim
        if self.cp_waiting:
            self._try_cp()
        if not self.queue[rank] or not self._may_start(rank):
            return
        for mb in self.queue[rank]:
            req, j, _ = mb.lane
            if req.started == j:
                break
        else:
            return
        self.queue[rank].remove(mb)
        req.started += 1
        self._run(mb)
        if req.started < len(req.chunks):
            nxt = req.chunk_rank(req.started)
            if nxt != rank:
                sim._fill(nxt)

    def _run(self, mb) -> None:
        self.busy[mb.rank] += 1
        self.sim.running[mb.rank] += 1
        self.segment(mb)

    def _try_cp(self) -> None:
        """Start every waiting cp chunk whose groups all have a free slot (its shares start together)."""
        for req in list(self.cp_waiting):
            if all(self._may_start(r) for r in req.ranks):
                self.cp_waiting.remove(req)
                req.done, req.arrived, req.gate = 0, [0] * self.steps, True
                for i, r in enumerate(req.ranks):
                    self._run(self._mb(req, req.next, i, r))

    # ------------------------------------------------------------------ layers
    def segment(self, mb) -> None:
        """``_AsyncSim._segment`` of a lane micro-batch: its layers one at a time (each may wait for signals)."""
        if mb.seg != mb.sub_seg:
            mb.sub_seg, mb.sub = mb.seg, 0
        self._step(mb)

    def _step(self, mb) -> None:
        sim = self.sim
        layers = self.seg_layers[mb.seg]
        req, j, share = mb.lane
        if mb.sub == len(layers):  # after the last layer: the head (the last chunk; its first share), then done
            last = j == len(req.chunks) - 1 and share == 0
            if last:
                sim.att[mb.rank].submit(sim.cost.head_s(1) * sim.k_att, lambda: self._done(mb), "lane head")
            else:
                self._done(mb)
            return
        k = self.offset[mb.seg] + mb.sub
        if req.design == "pipe":
            if all(req.ready[k][:j]):
                self._layer(mb, k)
            else:
                req.waiters[k].append(mb)
        else:
            req.arrived[k] += 1
            req.waiters[k].append(mb)
            if req.arrived[k] == req.g:  # the group-local barrier of this layer
                ready, req.waiters[k] = req.waiters[k], []
                for m in ready:
                    self._layer(m, k)

    def _layer(self, mb, k: int) -> None:
        sim, cost = self.sim, self.sim.cost
        req, j, _share = mb.lane
        w, moe = self.seg_layers[mb.seg][mb.sub]
        T = mb.tokens
        Td = sim._per_device(T)
        work = (cost.embed_s(T) if k == 0 else 0.0) + w * mb.attn_s
        rows = 0
        if moe:
            rows = sim._rows(Td)
            work += w * cost.router_s(Td)
            if sim.cpu:
                work += w * sim.E * cost.dispatch_s(rows)
        else:
            work += w * cost.dense_mlp_s(Td)
        put = 0.0
        if req.design == "pipe":
            one = req.fanout.get(j)
            if one is None:  # one layer's put to the groups holding a later chunk, other than this one's
                fan = len({req.chunk_rank(i) for i in range(j + 1, len(req.chunks))} - {mb.rank})
                one = req.fanout[j] = kv_put_s(cost, sim.shapes, req.chunks[j].length, fan)
            put = w * one
            if sim.cpu:
                work, put = work + put, 0.0
        sim.att[mb.rank].submit(work * sim.k_att + (sim.job_overhead if moe else 0.0),
                                lambda: self._layer_done(mb, k, moe, rows, put),
                                f"lane layer {k} chunk {j}" if sim.spans is not None else "")

    def _layer_done(self, mb, k: int, moe: bool, rows: int, put: float) -> None:
        sim = self.sim
        req, j, _ = mb.lane
        if req.design == "pipe":
            sim.engine.after(put, self._kv_arrived, req, j, k)
        if moe:
            sim._dispatched(mb, rows)
        else:
            mb.sub += 1
            self._step(mb)

    def _kv_arrived(self, req: _LaneRequest, j: int, k: int) -> None:
        req.ready[k][j] = True
        if self.fifo and k == 0:  # a later chunk gated on this one may start now
            for rank in sorted(set(req.ranks) - {req.chunk_rank(j)}):
                self.sim._fill(rank)
        if req.waiters[k]:
            ready = [m for m in req.waiters[k] if all(req.ready[k][:m.lane[1]])]
            req.waiters[k] = [m for m in req.waiters[k] if m not in ready]
            for m in ready:
                self._layer(m, k)

    def _done(self, mb) -> None:
        sim = self.sim
        req, j, _share = mb.lane
        self.busy[mb.rank] -= 1
        sim.running[mb.rank] -= 1
        if req.design == "pipe":
            if self.fifo:
                sim.batchers[mb.rank].done(mb.chunks[0])
            if j == len(req.chunks) - 1:
                sim.engine.after(sim.msg_result, self._result, req.rid)
        else:
            req.done += 1
            if req.done == req.g:
                req.next += 1
                if req.next == len(req.chunks):
                    sim.engine.after(sim.msg_result, sim._result, req.rid)
                else:
                    self.cp_waiting.insert(0, req)  # its next chunk first: the request holds its groups
        if self.cp_waiting:
            self._try_cp()
        sim._fill(mb.rank)
