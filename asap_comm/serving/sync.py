"""The synchronous prefill baseline (DP attention + EP experts, lock-step all-to-alls).

What ASAP is measured against: the same model, on the same number of worker
processes as :func:`asap_comm.serving.runtime.run_async` (``W = A + E``), run
the way SGLang and vLLM run DP attention with expert parallelism:

* PEs ``0..W-1``, workers: each is an attention rank for its own requests
  (data-parallel: its own KV caches, embedding, attention, router, dense
  layers, shared experts, final norm and head) *and* holds an equal share of
  the routed experts (contiguous blocks, as ``MoEPlan`` splits them). At every
  MoE layer, every worker routes its micro-batch, exchanges per-destination
  row counts with an ``all_to_all``, then a dispatch ``all_to_all_single``
  sends each token once to every worker holding one of its experts (packed:
  hidden state, expert ids with -1 for experts held elsewhere, weights), the
  workers compute their experts, and a combine ``all_to_all_single`` returns
  the weighted partial sums, added back in token order. The collectives run
  on a ``torch.distributed`` gloo group over the workers only.
* All workers step together: in each step every worker runs its next
  micro-batch (``MicroBatcher`` under the token budget, chunks from
  ``split_prompt``) or, if it has none, a dummy batch of 0 tokens that still
  joins every collective of every layer. A step starts with an
  ``all_reduce`` of two flags (does anyone have work; is anyone still
  active); when nobody has work the workers wait ~1 ms on their inboxes
  instead of stepping.
* PE ``W``, the front end: identical to the asynchronous runtime's (replays
  arrivals in real time, validates, ``Placer`` placement, mailboxes).
* **Context parallelism** (``cfg.cp_threshold``; emulated devices only, see
  below): a prompt longer than the threshold is shared by the
  ``g = min(W, ceil(prompt / cp_threshold))`` least-loaded workers
  (``Placer.place_group``; the front end marks its chunks with the group). Its
  chunks still run in order, each shared by the ``g`` groups in ONE step: at
  the start of a step every owner proposes its next shared chunk in the step's
  ``all_reduce`` (request, length, start, group), and every worker accepts the
  same proposals by the same rule, in request order: a chunk joins if each of
  its groups has no share yet or room under the token budget (the
  simulator's rule). A worker then takes its own micro-batch under the budget
  its shares leave, if a whole chunk still fits. *Emulated, not real*: the
  served model is small, so the owner computes the shared chunk for real (its
  KV cache stays whole, outputs stay checked), and the emulated devices hold
  what a real CP group would: the owner its share of the chunk's attention
  (``attention_stage(..., cp_groups=g)``) and the other groups theirs
  (``hold_cp_share``), each with the KV exchange of the cost model; the
  owner's MLP stages and dispatched rows count only its share
  (``cp_step``). A model factory without these hooks (a real model) is
  refused: on real devices the workers would have to split the chunk.

Same interface and result format as ``run_async``; ``RunResult.mode`` is
``"sync"``. ``cfg.ping_pong`` and ``cfg.expert_batching`` have no meaning
here (one micro-batch per step; experts compute each step's rows at once).
"""
from __future__ import annotations

import os
import tempfile
from collections import deque
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import TimeoutError as CommTimeoutError
from ..moe import ExpertBatch, apply_experts, expert_placement
from ..rendezvous import gloo_group, loopback_store
from .frontend import ChunkTaker, DeathWatch, Replay, finish_chunks, layer_loop, run_group, run_to_end
from .patience import wait_patiently
from .policies import MicroBatcher
from .protocol import Channels, ModelInfo, PromptRequest, RunResult, RuntimeConfig, open_channels

__all__ = ["run_sync"]

_CP_WORDS = 4  # a CP proposal in the step's all_reduce: request id + 1, chunk length, chunk start, group mask

_IDLE_S = 0.001  # how long workers wait for arrivals when no worker has work


rank_of_expert = expert_placement  # the worker holding each routed expert: the same placement as MoEPlan


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` any dtype -> ``[n, m * itemsize]`` uint8 (a view when contiguous)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return b.contiguous().view(dtype)


# ----------------------------------------------------------------------------- worker
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
    """The collective allocation of the baseline's shm collectives (``protocol.open_channels`` makes it)."""
    max_rows = max(cfg.token_budget, cfg.max_chunk_tokens)
    esize = torch.empty(0, dtype=info.dtype).element_size()
    row_bytes = max(info.hidden * esize + 8 * info.top_k, info.hidden * esize, 16)
    if cfg.cp_threshold is not None:  # the step's all_reduce carries every worker's CP proposal
        row_bytes = max(row_bytes, 8 * (2 + _CP_WORDS * workers))
    return ShmCollectives(comm, workers, max_rows, row_bytes)


class _Worker(ChunkTaker):
    """One DP-attention + EP-expert worker; PE ``rank`` of ``W`` workers."""

    def __init__(self, comm, cfg: RuntimeConfig, info: ModelInfo, model_factory, workers: int) -> None:
        self.comm, self.cfg, self.info, self.W = comm, cfg, info, workers
        self.rank = comm.rank
        self.rank_of = rank_of_expert(info.num_experts, workers)
        self.experts = (self.rank_of == self.rank).nonzero().flatten().tolist()
        self.model = model_factory("attention", [])
        # Optional hook of an emulated model (asap_comm.sim.emulate): hold a collective for its modelled time.
        self.hold = getattr(self.model, "hold_collective", None)
        self.expert_model = model_factory("expert", self.experts) if self.experts else None
        self.front = workers
        self.batcher = MicroBatcher(cfg.token_budget)
        self.tokens: dict = {}  # (request, chunk index) -> token ids
        self.caches: dict = {}  # request -> KV cache
        self.cancelled: set = set()  # requests cancelled while a chunk of theirs runs
        self.spans: list = []
        self.stats = None  # protocol.WorkerStats, set by run
        k = info.top_k
        self.hbytes = info.hidden * torch.empty(0, dtype=info.dtype).element_size()
        self.width = self.hbytes + 8 * k  # packed row: hidden bytes, k int32 ids, k float32 weights
        self.shm: "ShmCollectives | None" = None  # set by _worker_main when cfg.sync_collectives == "shm"
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

    def _queue_chunk(self, c, groups: int) -> None:
        if groups:  # a context-parallel request this worker owns: its chunks run in order, shared
            self.cp_owned.setdefault(c.request_id, (groups, deque()))[1].append(c)
        else:
            self.batcher.add(c)

    # ------------------------------------------------------------------ context parallelism
    def _cp_propose(self, vec: torch.Tensor) -> None:
        """Write this worker's proposal (its oldest shared request's next chunk) into its slot of ``vec``."""
        for rid, (groups, chunks) in self.cp_owned.items():
            if chunks:
                c = chunks[0]
                base = 2 + _CP_WORDS * self.rank
                vec[base:base + _CP_WORDS] = torch.tensor([rid + 1, c.length, c.start, groups])
                return

    def _cp_accept(self, vec: list) -> tuple:
        """The step's accepted shared chunks, the same on every worker: (tokens each worker's shares take,
        {worker: [(request, length, start, groups, part tokens)]}, the workers whose proposal was accepted)."""
        W, budget = self.W, self.cfg.token_budget
        props = []
        for w in range(W):
            rid1, length, start, mask = vec[2 + _CP_WORDS * w: 2 + _CP_WORDS * (w + 1)]
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

    # ------------------------------------------------------------------ one MoE layer's exchange
    def _moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, tag: str) -> torch.Tensor:
        """Routed experts of ``x [T,H]`` (``T`` may be 0) across all workers: counts, dispatch, compute, combine."""
        W, H, k, dtype = self.W, self.info.hidden, self.info.top_k, self.info.dtype
        T = x.shape[0]
        t = time.monotonic()
        dest = self.rank_of[ids] if T else torch.empty(0, k, dtype=torch.int64)  # [T,k] worker of each choice
        masks = [dest == r for r in range(W)]
        index = [m.any(1).nonzero().flatten() for m in masks]  # tokens for each worker
        send_counts = [int(i.numel()) for i in index]
        send = torch.empty(sum(send_counts), self.width, dtype=torch.uint8)
        first = 0
        ids32, w32 = ids.to(torch.int32), weights.to(torch.float32)
        for mine, rows in zip(masks, index):
            n = rows.numel()
            if n == 0:
                continue
            part = send[first:first + n]
            part[:, :self.hbytes] = _as_bytes(x[rows])
            part[:, self.hbytes:self.hbytes + 4 * k] = _as_bytes(torch.where(mine[rows], ids32[rows], -1))
            part[:, self.hbytes + 4 * k:] = _as_bytes(w32[rows])
            first += n
        t = self._span(f"{tag}route+pack L{layer}", t)
        hold = self.hold  # an emulated device's modelled collective time (None: real time only)
        if self.shm is not None:  # counts travel with the rows: one exchange
            recv, recv_counts = self.shm.all_to_all(send, send_counts)
            if hold is not None:
                hold("counts+dispatch", max(sum(send_counts), sum(recv_counts)), W, t, layer)
        else:
            recv_counts_t = torch.empty(W, dtype=torch.int64)
            dist.all_to_all_single(recv_counts_t, torch.tensor(send_counts, dtype=torch.int64))
            if hold is not None:
                hold("counts", 0, W, t, layer)
            recv_counts = recv_counts_t.tolist()
            t_d = time.monotonic()
            recv = torch.empty(sum(recv_counts), self.width, dtype=torch.uint8)
            dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts)
            if hold is not None:
                hold("dispatch", max(sum(send_counts), sum(recv_counts)), W, t_d, layer)
        busiest = max(sum(send_counts), sum(recv_counts))
        t = self._span(f"{tag}dispatch a2a L{layer}", t, busy=False)
        m = recv.shape[0]
        if m:
            batch = ExpertBatch(layer, _from_bytes(recv[:, :self.hbytes], dtype),
                                _from_bytes(recv[:, self.hbytes:self.hbytes + 4 * k], torch.int32),
                                _from_bytes(recv[:, self.hbytes + 4 * k:], torch.float32), [])
            model = self.expert_model
            out = apply_experts(batch, lambda e, rows: model.expert(layer, e, rows))
            t = self._span(f"experts L{layer} ({m} rows)", t)
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
        if hold is not None:
            hold("combine", busiest, W, t_c, layer)
        t = self._span(f"{tag}combine a2a L{layer}", t, busy=False)
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        y = torch.zeros(T, H, dtype=acc)
        if T:
            y.index_add_(0, torch.cat(index), back.to(acc))
        return y.to(dtype)

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
        tag = "" if chunks else "dummy "
        caches = [self.caches.setdefault(c.request_id, model.new_cache()) for c in chunks]
        hs = [model.embed(self.tokens.pop((c.request_id, c.index))) for c in chunks]
        if self.cp_on:  # the tokens this worker's MLP stages and dispatches stand for in the emulated CP step
            excess = 0 if cp_chunk is None else cp_chunk.length - cp_share[1]
            model.cp_step(-excess, sum(share[-1] for share in helping) - excess)
        t = [time.monotonic()]  # start of the current span

        def attend(layer, hs):
            outs = []
            if chunks:
                outs = [model.attention_stage(layer, h, cache) for h, cache in zip(hs[:len(own)], caches)]
                if cp_chunk is not None:
                    outs.append(model.attention_stage(layer, hs[-1], caches[-1], cp_groups=cp_groups))
                t[0] = self._span(f"attn L{layer}", t[0])
            for _rid, length, start, g, n in helping:  # the shares of others' chunks: held, not computed here
                model.hold_cp_share(layer, length, start, g, n)
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
            routed = self._moe(layer, mlp, ids, weights, tag)
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
        self.box, self.shm, self.stats = ch.box, ch.shm, ch.stats
        box = self.box
        watch = DeathWatch(self.comm, range(self.comm.world_size))
        stopped = False
        words = 2 + (_CP_WORDS * self.W if self.cp_on else 0)
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
            if self.shm is not None:
                flags = self.shm.all_reduce_sum(flags)
            else:
                dist.all_reduce(flags)
            if self.hold is not None:
                self.hold("all_reduce", 0, self.W, t)
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
                        rid = int(flags[2 + _CP_WORDS * self.rank]) - 1
                        cp_chunk = self.cp_owned[rid][1][0]
                        share = next((g, n) for r, _l, _s, g, n in mine if r == rid)
                        mine = [x for x in mine if x[0] != rid]
                    helping = tuple(mine)
                if not batch and cp_chunk is None and not helping:
                    self._span("step sync (idle)", t, busy=False)
                self._step(batch, cp_chunk, share, helping)
                continue
            if stopped:  # nobody has work: do not spin
                time.sleep(_IDLE_S)
            else:
                try:
                    stopped |= not self._take(box.recv(timeout=_IDLE_S))
                except CommTimeoutError:
                    watch.check()
        self.stats.publish(force=True)
        return self.spans


class _Done:
    """``finish_chunks``' batcher for shared chunks (they are not in the MicroBatcher)."""

    def done(self, chunk) -> None:
        pass


def _worker_main(comm, cfg: RuntimeConfig, info: ModelInfo, model_factory, store_port, ch: Channels):
    W = comm.world_size - 1
    worker = _Worker(comm, cfg, info, model_factory, W)
    if isinstance(store_port, dist.Store):  # a group that spans hosts passes a store every host reaches
        store = store_port
    else:
        store = dist.TCPStore("127.0.0.1", store_port, None, False, timedelta(seconds=cfg.timeout_s))
    # keys under a prefix only the group can name; on one host gloo listens on loopback only
    gloo_group(store, comm.secret_token("sync-gloo"), comm.rank, W, cfg.timeout_s, loopback=comm.backend == "shm")
    try:
        return worker.run(ch)
    finally:
        dist.destroy_process_group()


def group_main(comm, cfg, info, model_factory, store_port, front):
    """One PE of a baseline group: allocate the group's channels (``open_channels``), then run this PE's role;
    the front end's role is ``front(comm, cfg, info, channels, num_targets, label, role_of)``. ``store_port``:
    the port of a TCPStore on 127.0.0.1 for the workers' gloo group, or a ``torch.distributed.Store`` that
    every worker reaches (a group across hosts: ``examples/prefill_multihost.py``)."""
    torch.set_num_threads(1)
    W = comm.world_size - 1
    ch = open_channels(comm, cfg, info, "sync")
    if ch.role == "worker":
        return ("worker", _worker_main(comm, cfg, info, model_factory, store_port, ch))
    return ("front", front(comm, cfg, info, ch, W, "sync", _worker_role))


def _worker_role(pe) -> str:
    return "worker"


def check_config(model_factory, cfg: RuntimeConfig) -> None:
    """The baseline's refusals (raises ValueError)."""
    W = cfg.num_attention_ranks + cfg.num_expert_ranks
    if cfg.cp_threshold is not None and not getattr(model_factory, "emulates_context_parallelism", False):
        raise ValueError(f"run_sync: cp_threshold={cfg.cp_threshold} needs emulated devices (a model factory with "
                         "emulates_context_parallelism, such as asap_comm.sim.emulate.EmulatedFactory): context "
                         "parallelism is emulated (the owner computes a shared chunk; the devices hold their "
                         "shares), and on this model factory the workers would have to split the chunk for real")
    if cfg.cp_threshold is not None and W > 62:
        raise ValueError(f"run_sync: cp_threshold needs at most 62 workers (a group is a 64-bit mask), got {W}")


def run_sync(model_factory: Callable[[str, list], Any], info: ModelInfo, requests: Sequence[PromptRequest],
             cfg: RuntimeConfig = RuntimeConfig()) -> RunResult:
    """Run ``requests`` through the synchronous DP+EP baseline; same interface and results as ``run_async``.

    ``W = cfg.num_attention_ranks + cfg.num_expert_ranks`` workers (each
    attention for its own requests plus ``1/W`` of the routed experts, built
    from ``model_factory("attention", [])`` and ``model_factory("expert",
    experts)``) and one front end, ``W + 1`` processes on this host. If a
    worker dies, its requests fail with an error and the run still returns
    (``timeout_s`` bounds the run and every collective).
    """
    W = cfg.num_attention_ranks + cfg.num_expert_ranks
    check_config(model_factory, cfg)
    fd, report = tempfile.mkstemp(prefix="asap-sync-", suffix=".pkl")
    os.close(fd)
    # The workers' gloo group rendezvous through a store this process hosts on a free port.
    store = loopback_store(cfg.timeout_s)
    try:
        return run_group(group_main, W + 1, (cfg, info, model_factory, store.port, Replay(list(requests), report)),
                         requests, report, cfg.timeout_s, RunResult, "sync")
    finally:
        del store
        os.unlink(report)
