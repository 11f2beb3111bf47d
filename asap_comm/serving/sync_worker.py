"""The synchronous baseline's worker: DP attention for its own requests, EP experts for everyone (``sync.py``
has the overview).

A worker (:func:`worker_main`) takes chunks from the front end
(``worker.ChunkTaker``) and steps in lock-step with the others: each step
starts with an ``all_reduce`` of the step's flags (and, with context
parallelism, every owner's proposal), then runs one micro-batch (or a dummy
batch) through ``worker.layer_loop``, its MoE layers through the collective
exchange (``exchange.CollectiveExchange``, gloo or shared memory).
"""
from __future__ import annotations

import time
from collections import deque

import torch

from ..errors import TimeoutError as CommTimeoutError
from ..moe import expert_placement
from .exchange import CP_WORDS, CollectiveExchange, close_gloo_group, open_gloo_group
from .hooks import model_hooks
from .patience import DeathWatch
from .policies import MicroBatcher
from .protocol import Channels, ModelInfo, RuntimeConfig
from .worker import ChunkTaker, finish_chunks, layer_loop, run_to_end

__all__ = ["worker_main", "IDLE_S"]

IDLE_S = 0.001  # how long workers wait for arrivals when no worker has work


class _Worker(ChunkTaker):
    """One DP-attention + EP-expert worker; PE ``rank`` of ``W`` workers."""

    def __init__(self, comm, cfg: RuntimeConfig, info: ModelInfo, model_factory, workers: int) -> None:
        self.comm, self.cfg, self.info, self.W = comm, cfg, info, workers
        self.rank = comm.rank
        self.experts = (expert_placement(info.num_experts, workers) == self.rank).nonzero().flatten().tolist()
        self.model = model_factory("attention", [])
        # an emulated device holds each collective for its modelled time, and emulates context parallelism
        self.hooks = model_hooks(self.model)
        self.expert_model = model_factory("expert", self.experts) if self.experts else None
        self.front = workers
        self.batcher = MicroBatcher(cfg.token_budget)
        self.tokens: dict = {}  # (request, chunk index) -> token ids
        self.caches: dict = {}  # request -> KV cache
        self.cancelled: set = set()  # requests cancelled while a chunk of theirs runs
        self.spans: list = []
        self.stats = None  # protocol.WorkerStats, set by run
        self.exchange: "CollectiveExchange | None" = None  # set by run
        # context parallelism (cfg.cp_threshold): the shared requests this worker owns, in arrival order
        self.cp_on = cfg.cp_threshold is not None
        self.cp_owned: dict = {}  # request -> deque of its chunks not yet run
        self.cp_done = _Done()

    def _span(self, name: str, start: float, busy: bool = True) -> float:
        """Record a span (start on the host's monotonic clock); ``busy``: compute, not a wait."""
        now = time.monotonic()
        self.spans.append((self.rank, 0, name, start, now - start))
        if busy and self.stats is not None:
            self.stats.busy(now - start)
        return now

    def _queue_chunk(self, c, groups: int, urgent: bool = False) -> None:
        if groups:  # a context-parallel request this worker owns: its chunks run in order, shared
            self.cp_owned.setdefault(c.request_id, (groups, deque()))[1].append(c)
        else:
            self.batcher.add(c, urgent=urgent)

    # ------------------------------------------------------------------ context parallelism
    def _cp_propose(self, vec: torch.Tensor) -> None:
        """Write this worker's proposal (its oldest shared request's next chunk) into its slot of ``vec``."""
        for rid, (groups, chunks) in self.cp_owned.items():
            if chunks:
                c = chunks[0]
                base = 2 + CP_WORDS * self.rank
                vec[base:base + CP_WORDS] = torch.tensor([rid + 1, c.length, c.start, groups])
                return

    def _cp_accept(self, vec: list) -> tuple:
        """The step's accepted shared chunks, the same on every worker: (tokens each worker's shares take,
        {worker: [(request, length, start, groups, part tokens)]}, the workers whose proposal was accepted)."""
        W, budget = self.W, self.cfg.token_budget
        props = []
        for w in range(W):
            rid1, length, start, mask = vec[2 + CP_WORDS * w: 2 + CP_WORDS * (w + 1)]
            if rid1:
                props.append((rid1 - 1, w, length, start, mask))
        cp_tokens = [0] * W
        shares: dict = {}
        accepted = set()
        for rid, owner, length, start, mask in sorted(props):  # request order: arrival order of the trace
            groups = [j for j in range(W) if mask >> j & 1]
            g = len(groups)
            parts = [length // g + (1 if i < length % g else 0) for i in range(g)]
            if all(cp_tokens[j] == 0 or cp_tokens[j] + n <= budget for j, n in zip(groups, parts)):
                accepted.add(owner)
                for j, n in zip(groups, parts):
                    cp_tokens[j] += n
                    shares.setdefault(j, []).append((rid, length, start, g, n))
        return cp_tokens, shares, accepted

    def _cp_batch(self, cp_tokens: list) -> list:
        """This worker's own micro-batch under the budget its shares leave (none unless a whole chunk fits)."""
        mine = cp_tokens[self.rank]
        if mine == 0:
            return self.batcher.next_batch()
        left = self.cfg.token_budget - mine
        if left < self.cfg.max_chunk_tokens:
            return []
        self.batcher.token_budget = left
        try:
            return self.batcher.next_batch()
        finally:
            self.batcher.token_budget = self.cfg.token_budget

    # ------------------------------------------------------------------ one step
    def _step(self, chunks: list, cp_chunk=None, cp_share: tuple = (1, 0), helping: tuple = ()) -> None:
        """One micro-batch (``chunks``; empty = dummy batch) through every layer, in lock-step with the others.
        Context parallelism: ``cp_chunk`` (a shared chunk this worker owns, computed here and held as its share:
        ``cp_share = (groups, tokens)``) and ``helping`` (the shares of other workers' chunks this worker
        holds)."""
        cp_groups = cp_share[0]
        model, info = self.model, self.info
        own = chunks
        if cp_chunk is not None:
            chunks = chunks + [cp_chunk]
        caches = [self.caches.setdefault(c.request_id, model.new_cache()) for c in chunks]
        hs = [model.embed(self.tokens.pop((c.request_id, c.index))) for c in chunks]
        if self.cp_on:  # the tokens this worker's MLP stages and dispatches stand for in the emulated CP step
            excess = 0 if cp_chunk is None else cp_chunk.length - cp_share[1]
            self.hooks.cp_step(-excess, sum(share[-1] for share in helping) - excess)
        t = [time.monotonic()]  # start of the current span

        def attend(layer, hs):
            outs = []
            if chunks:
                outs = [model.attention_stage(layer, h, cache) for h, cache in zip(hs[:len(own)], caches)]
                if cp_chunk is not None:
                    outs.append(model.attention_stage(layer, hs[-1], caches[-1], cp_groups=cp_groups))
                t[0] = self._span(f"attn L{layer}", t[0])
            for _rid, length, start, g, n in helping:  # the shares of others' chunks: held, not computed here
                self.hooks.hold_cp_share(layer, length, start, g, n)
            if helping:
                t[0] = self._span(f"CP share L{layer}", t[0])
            return outs

        def moe(layer, mlp):
            if chunks:
                routing = model.route(layer, mlp)
                ids, weights = routing.topk_ids, routing.topk_weights
            else:
                ids = torch.empty(0, info.top_k, dtype=torch.int64)
                weights = torch.empty(0, info.top_k, dtype=torch.float32)
            ex = self.exchange
            routed = ex.receive(ex.send(mlp, ids, weights, layer))  # a dummy batch (no tokens) joins as well
            t[0] = time.monotonic()
            return (routed + model.shared_experts(layer, mlp)) if chunks else None
            yield  # a generator for layer_loop; the exchange above is synchronous

        hs = run_to_end(layer_loop(info, hs, attend, moe, model.dense_mlp))
        finish_chunks(model, self.box, self.front, own, hs[:len(own)], self.caches, self.batcher, self.cancelled)
        if cp_chunk is not None:
            finish_chunks(model, self.box, self.front, [cp_chunk], hs[-1:], self.caches, self.cp_done)
            self.cp_owned[cp_chunk.request_id][1].popleft()
            if cp_chunk.last:
                del self.cp_owned[cp_chunk.request_id]
        if chunks:
            self._span("tail", t[0])

    def run(self, ch: Channels) -> list:
        self.box, self.stats = ch.box, ch.stats
        self.exchange = CollectiveExchange(self.rank, self.W, self.info, self.expert_model, ch.shm, self.hooks,
                                           self._span, self.stats)
        box = self.box
        watch = DeathWatch(self.comm, range(self.comm.world_size))
        stopped = False
        words = 2 + (CP_WORDS * self.W if self.cp_on else 0)
        while True:
            self.stats.publish()
            while (m := box.poll()) is not None:
                stopped |= not self._take(m)
            flags = torch.zeros(words, dtype=torch.int64)
            if self.cp_on:
                self._cp_propose(flags)
                has_work = len(self.batcher) > 0 or any(q for _g, q in self.cp_owned.values())
                batch = None  # taken after the all_reduce, under the budget the accepted shares leave
            else:
                batch = self.batcher.next_batch()
                has_work = bool(batch)
            flags[0] = int(has_work)
            flags[1] = int(not (stopped and not has_work and len(self.batcher) == 0))
            t = time.monotonic()
            flags = self.exchange.all_reduce(flags)
            anyone_working, anyone_active = int(flags[0]), int(flags[1])
            if not anyone_active:
                break
            if anyone_working:
                cp_chunk, share, helping = None, (1, 0), ()
                if self.cp_on:
                    cp_tokens, shares, accepted = self._cp_accept(flags.tolist())
                    batch = self._cp_batch(cp_tokens)
                    mine = shares.get(self.rank, [])
                    if self.rank in accepted:
                        rid = int(flags[2 + CP_WORDS * self.rank]) - 1
                        cp_chunk = self.cp_owned[rid][1][0]
                        share = next((g, n) for r, _l, _s, g, n in mine if r == rid)
                        mine = [x for x in mine if x[0] != rid]
                    helping = tuple(mine)
                if not batch and cp_chunk is None and not helping:
                    self._span("step sync (idle)", t, busy=False)
                self._step(batch, cp_chunk, share, helping)
                continue
            if stopped:  # nobody has work: do not spin
                time.sleep(IDLE_S)
            else:
                try:
                    stopped |= not self._take(box.recv(timeout=IDLE_S))
                except CommTimeoutError:
                    watch.check()
        self.stats.publish(force=True)
        return self.spans


class _Done:
    """``finish_chunks``' batcher for shared chunks (they are not in the MicroBatcher)."""

    def done(self, chunk) -> None:
        pass


def worker_main(comm, cfg: RuntimeConfig, info: ModelInfo, model_factory, store, ch: Channels) -> list:
    """A baseline worker: build its models, join the workers' gloo group when the collectives are gloo's
    (``store``: see ``exchange.open_gloo_group``; with ``sync_collectives="shm"`` no gloo group and no store are
    used), run until the front end stops it; returns its spans."""
    W = comm.world_size - 1
    worker = _Worker(comm, cfg, info, model_factory, W)
    gloo = cfg.sync_collectives == "gloo"
    if gloo:
        open_gloo_group(comm, W, store, cfg.timeout_s)
    try:
        return worker.run(ch)
    finally:
        if gloo:
            close_gloo_group()
