"""The asynchronous runtime's workers: attention ranks and expert ranks (``runtime.py`` has the overview).

* An attention rank (:func:`attention_main`) takes chunks from the front end
  (``worker.ChunkTaker``), runs up to two micro-batches at once (ping-pong):
  each is a ``worker.layer_loop`` generator that yields its exchange handle
  (``exchange.AsyncExchange``) at every MoE layer, and the rank resumes
  whichever micro-batch's experts have answered.
* An expert rank (:func:`expert_main`) serves the routed experts of every MoE
  layer to any attention rank as rows arrive (``moe.ExpertEnd``), gathered per
  layer up to a token budget or a deadline (``ExpertBatcher``).
* The lock-step ablation (:class:`_Lockstep`, ``barrier_free=False``).

With spare expert PEs (``RuntimeConfig.spare_expert_ranks``), an expert PE's
death is expert failover's (``failover.py``): the ranks do not fail with it,
a spare waits in :func:`expert_main` until the front end hands it a dead
rank's experts, and an attention rank re-routes on the front end's word.
With attention failover (``RuntimeConfig.attention_failover``), no worker waits
for a dead attention PE: the expert ranks count it as finished and drop what
they computed for it (``ExpertEnd.lose_senders``), and an attention rank whose
lane chunk waits for the dead PE's KV waits for the front end's cancel.
"""
from __future__ import annotations

import time

from ..errors import CommError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from ..moe import ExpertBatch, MoEPlan, apply_experts
from .exchange import AsyncExchange
from .failover import TAKEOVER, check_route, decode_takeover, depended_on, fence_dead
from .hooks import model_hooks
from .lane import LaneAborted, LaneRank, LaneWait
from .patience import DeathWatch
from .policies import Chunk, ExpertBatcher, MicroBatcher
from .protocol import Channels, ModelInfo, RuntimeConfig
from .worker import ChunkTaker, finish_chunks, layer_loop, report_failure

__all__ = ["moe_plan", "attention_main", "expert_main"]


def moe_plan(cfg: RuntimeConfig, info: ModelInfo) -> MoEPlan:
    """The MoE plan of an async group."""
    return MoEPlan(num_attention_ranks=cfg.num_attention_ranks, num_expert_ranks=cfg.num_expert_ranks,
                   num_experts=info.num_experts, hidden=info.hidden, dtype=info.dtype,
                   max_tokens=max(cfg.token_budget, cfg.max_chunk_tokens), top_k=info.top_k,
                   max_inflight=(2 if cfg.ping_pong else 1) + int(cfg.urgent_slot), num_spare_ranks=cfg.spare_expert_ranks)


# ----------------------------------------------------------------------------- lock-step ablation
_DONE = 1 << 62  # a rank that has left the run: never waited for again


class _Lockstep:
    """Optimization (1) switched off: the attention ranks step through MoE layers together.

    Every dispatch is a barrier among the ``A`` attention ranks, as in the
    synchronous baseline (whose per-layer ``all_to_all`` every rank must
    join), but on the same disaggregated processes and transport, so the
    ablation isolates the barrier. ``steps[q]`` on a rank counts the steps
    attention rank ``q`` announced to it. A rank with no micro-batch ready to
    dispatch joins for free when someone waits for it (the dummy batch of the
    baseline, without its cost); a rank that has finished announces
    ``_DONE``.
    """

    def __init__(self, comm, steps, num_ranks: int, timeout_s: float, scoped: bool = False) -> None:
        self.comm, self.steps, self.ranks, self.timeout_s = comm, steps, range(num_ranks), timeout_s
        self.me, self.step = comm.rank, 0
        self.scoped = scoped  # with spares: a wait fails only with the rank it waits for (an expert's death does not)

    def _announce(self, delta: int) -> None:
        for q in self.ranks:
            self.comm.signal_op(self.steps, self.me, delta, "add", q)

    def arrive_and_wait(self) -> None:
        self.step += 1
        self._announce(1)
        for q in self.ranks:
            if q != self.me and self.scoped:
                self.comm.signal_wait_until(self.steps, q, ">=", self.step, timeout=self.timeout_s, peers=[q])
            elif q != self.me:
                self.comm.signal_wait_until(self.steps, q, ">=", self.step, timeout=self.timeout_s)

    def catch_up(self) -> None:
        """Join (without work) every step another rank is waiting at."""
        ahead = [v for q in self.ranks if q != self.me and (v := self.comm.signal_fetch(self.steps, q)) < _DONE]
        target = max(ahead, default=0)
        if target > self.step:
            self._announce(target - self.step)
            self.step = target

    def leave(self) -> None:
        for q in self.ranks:
            self.comm.signal_op(self.steps, self.me, _DONE, "set", q)


# ----------------------------------------------------------------------------- attention rank
class _AttentionRank(ChunkTaker):
    def __init__(self, comm, cfg: RuntimeConfig, info: ModelInfo, model, ch: Channels) -> None:
        self.comm, self.cfg, self.info, self.model = comm, cfg, info, model
        self.exchange, self.box, self.stats = AsyncExchange(ch.moe), ch.box, ch.stats
        steps = ch.lockstep
        self.failover = cfg.spare_expert_ranks > 0
        self.lockstep = None if steps is None else _Lockstep(comm, steps, cfg.num_attention_ranks, cfg.timeout_s,
                                                              self.failover)
        self.front = comm.world_size - 1
        self.batcher = MicroBatcher(cfg.token_budget)
        self.tokens: dict = {}  # (request, chunk index) -> token ids
        self.caches: dict = {}  # request -> KV cache
        self.cancelled: set = set()  # requests cancelled while a chunk of theirs runs
        self.spans: list = []  # (pe, track, name, start on the host's monotonic clock, duration)
        self.lane = None if ch.lane is None else LaneRank(comm, cfg, model, ch.lane, self.cancelled, self.spans)
        A = cfg.num_attention_ranks
        self._expert_pes = range(A, A + cfg.num_expert_ranks + cfg.spare_expert_ranks)
        self._attention_pes = range(A) if cfg.attention_failover else range(0)  # their deaths are survived
        if cfg.attention_failover:  # a wait for experts fails with the expert PE it waits on, not another rank
            self.exchange.end.scoped_waits = True

    def _queue_chunk(self, chunk, groups: int, urgent: bool = False) -> None:
        if groups < 0 and self.lane is not None:  # a long-prompt lane's chunk (lane.py)
            key = (chunk.request_id, chunk.index)
            self.tokens[key], stride = self.lane.take(chunk, groups, self.tokens[key])
            chunk = Chunk(chunk.request_id, chunk.index, chunk.start, int(self.tokens[key].numel()), chunk.num_chunks)
            self.batcher.add(chunk, stride=stride)
        else:
            self.batcher.add(chunk, urgent=urgent)

    def _cancel(self, rid: int) -> None:
        super()._cancel(rid)
        if self.lane is not None and not self.batcher.running(rid):
            self.lane.drop(rid)

    def _busy(self, name: str, start: float) -> None:
        dur = time.monotonic() - start
        self.spans.append((self.comm.rank, 0, name, start, dur))
        self.stats.busy(dur)

    def _microbatch(self, chunks: list):
        """One micro-batch through every layer; yields its exchange handle at each MoE layer."""
        model, ex = self.model, self.exchange
        caches = [self.caches.setdefault(c.request_id, model.new_cache()) for c in chunks]
        hs = [model.embed(self.tokens.pop((c.request_id, c.index))) for c in chunks]
        t = [time.monotonic()]  # start of the current stretch of attention-side work

        lane = self.lane if self.lane is not None and self.lane.is_lane(chunks[0].request_id) else None

        def attend(layer, hs):
            outs = [model.attention_stage(layer, h, cache) for h, cache in zip(hs, caches)]
            if lane is not None:  # a lane chunk runs alone in its micro-batch
                lane.after(chunks[0], caches[0], layer)
            return outs

        def before(layer):
            self._busy(f"attn L{layer}", t[0])
            yield from lane.before(chunks[0], caches[0], layer)
            t[0] = time.monotonic()

        def moe(layer, mlp):
            routing = model.route(layer, mlp)
            if self.lockstep is not None:
                t_wait = time.monotonic()
                self.lockstep.arrive_and_wait()
                self.spans.append((self.comm.rank, 0, f"barrier L{layer}", t_wait, time.monotonic() - t_wait))
            handle = ex.send(mlp, routing.topk_ids, routing.topk_weights, layer)
            shared = model.shared_experts(layer, mlp)
            self._busy(f"attn L{layer}", t[0])
            yield handle
            t[0] = time.monotonic()
            return ex.receive(handle) + shared

        try:
            hs = yield from layer_loop(self.info, hs, attend, moe, model.dense_mlp, None if lane is None else before)
        except LaneAborted:  # its request was cancelled while it waited for KV: nothing to send
            for c in chunks:
                self.cancelled.discard(c.request_id)
                self.caches.pop(c.request_id, None)
                self.lane.drop(c.request_id)
                self.batcher.done(c)
            return
        dropped = lane is not None and chunks[0].request_id in self.cancelled
        finish_chunks(model, self.box, self.front, chunks, hs, self.caches, self.batcher, self.cancelled)
        if lane is not None and (lane.finished(chunks[0]) or dropped):  # this rank's last chunk, or cancelled
            lane.drop(chunks[0].request_id)
            self.caches.pop(chunks[0].request_id, None)
        self._busy("attn tail", t[0])

    def _route(self, src: int, msg: tuple) -> None:
        """Expert failover (``failover.py``): expert rank ``r``'s PE died; route it to the spare that took over and
        send the spare the parts in flight that the dead PE did not return (``AttentionEnd.replace``)."""
        r, new, dead = check_route(self.comm, self.cfg, src, msg)
        if new < 0:
            raise PeerFailure(f"attention worker PE {self.comm.rank}: expert rank {r}'s PE {dead} died and no spare "
                              "expert rank is left", pe=dead, reason="died")
        t = time.monotonic()
        sent = self.exchange.end.replace(r, new)
        self.spans.append((self.comm.rank, 0, f"failover: expert rank {r} PE {dead} -> {new}, {sent} part(s) "
                                              "sent again", t, time.monotonic() - t))

    def _wait_route(self, timeout: float) -> None:
        """An expert PE this rank waits on died and no route has come yet: wait for the front end's message."""
        try:
            self.stopped |= not self._take(self.box.recv(timeout=timeout))
        except CommTimeoutError:
            self.watch.check()
            self._check_front()

    def _check_front(self) -> None:
        """``PeerFailure`` once the front end is gone (died, or closed) without having stopped this rank: nobody
        is left to send it work or take its results. Its state is read before the inbox, so a stop message it
        placed before leaving is taken first."""
        if self.stopped:
            return
        state = self.comm.peer_state(self.front)
        if state == "alive":
            return
        while (m := self.box.poll()) is not None:
            self.stopped |= not self._take(m)
        if not self.stopped:
            raise PeerFailure(f"attention worker PE {self.comm.rank}: the front end (PE {self.front}) {state} "
                              "before it stopped this worker", pe=self.front, reason=state)

    def run(self) -> list:
        self.watch = DeathWatch(self.comm, depended_on(self.comm, self.cfg, "attention"))
        running: list = []  # [generator, handle or None, dispatch sequence number]
        seq = 0
        self.stopped = False
        max_running = 2 if self.cfg.ping_pong else 1
        while True:
            self.stats.publish()
            while (m := self.box.poll()) is not None:
                self.stopped |= not self._take(m)
            ready = None if self.lane is None else self.lane.can_start
            if not running and max_running == 2 and self.cfg.token_balanced:  # both ping-pong slots free
                for batch in self.batcher.next_batches(2, ready):
                    running.append([self._microbatch(batch), None, -1])
            while len(running) < max_running:
                batch = self.batcher.next_batch(ready)
                if not batch:
                    break
                running.append([self._microbatch(batch), None, -1])
            # an urgent chunk (a light client's, beside a flooding one's) does not wait for a micro-batch in
            # flight to end: it gets one more slot, at most one such at a time
            if self.cfg.urgent_slot and len(running) == max_running and self.batcher.urgent_ready(ready):
                running.append([self._microbatch(self.batcher.next_batch(ready)), None, -1])
            if self.stopped and not running and len(self.batcher) == 0:
                break
            progressed = False
            for entry in list(running):
                gen, handle, _ = entry
                if handle is None or (handle.ready() if isinstance(handle, LaneWait) else self.exchange.ready(handle)):
                    try:
                        entry[1], entry[2], seq = next(gen), seq, seq + 1
                    except StopIteration:
                        running.remove(entry)
                    progressed = True
            if progressed:
                continue
            if self.lockstep is not None:
                self.lockstep.catch_up()
            if running:  # every micro-batch waits for its experts: wait on the earliest dispatch, briefly
                # (it answers first as experts serve in arrival order; with room for another micro-batch,
                # come back sooner to pick up new chunks from the mailbox)
                h = min(running, key=lambda e: e[2])[1]
                if isinstance(h, LaneWait):  # a lane chunk waits for earlier chunks' KV
                    try:
                        h.wait(0.0005)
                    except PeerFailure as e:  # with spares, an expert PE's death (any PE's ends a lane wait); with
                        # attention failover, an attention PE's (the front end cancels the lane: its cancel comes)
                        if not ((self.failover and e.pe in self._expert_pes) or e.pe in self._attention_pes):
                            raise
                        time.sleep(0.0005)
                    self.watch.check()
                    self._check_front()
                else:
                    t_wait = 0.002 if len(running) >= max_running else 0.0005
                    if not self.exchange.wait(h, t_wait) and self.exchange.end.lost:
                        self._wait_route(t_wait)  # its expert PE died: the front end's route comes by mail
            else:
                try:  # with the lock-step ablation on (or a lane chunk waiting to start), come back soon
                    soon = self.lockstep is not None or len(self.batcher) > 0
                    self.stopped |= not self._take(self.box.recv(timeout=0.0005 if soon else 0.05))
                except CommTimeoutError:
                    self.watch.check()
                    self._check_front()
        if self.lockstep is not None:
            self.lockstep.leave()
        self.exchange.finish()
        self.stats.publish(force=True)
        return self.spans


def attention_main(comm, cfg, info, model_factory, ch: Channels):
    rank = _AttentionRank(comm, cfg, info, model_factory("attention", []), ch)
    try:
        return rank.run()
    except CommError as e:  # the front end fails the service with this reason (worker.report_failure)
        report_failure(ch.box, comm.world_size - 1, "attention worker", e)
        raise


# ----------------------------------------------------------------------------- expert rank
def expert_main(comm, cfg, info, model_factory, plan: MoEPlan, ch: Channels):
    try:
        return _expert_loop(comm, cfg, info, model_factory, plan, ch)
    except CommError as e:  # the front end fails the service with this reason (worker.report_failure)
        report_failure(ch.box, comm.world_size - 1, "expert worker", e)
        raise


def _take_over(comm, ex, box, model_factory, spans: list):
    """On a spare: the front end's :data:`~.failover.TAKEOVER` message, if one came: build the dead rank's experts
    with the model factory (``ExpertEnd.take_over`` names them) and return the model; else None."""
    m = box.poll()
    if m is None:
        return None
    with m:
        if m.tag != TAKEOVER or m.src != comm.world_size - 1:
            raise CommError(f"spare expert PE {comm.rank}: unexpected message (tag {m.tag}) from PE {m.src}")
        rank, dead = decode_takeover(m.tensor)
    fence_dead(comm, dead)
    t = time.monotonic()
    model = model_factory("expert", ex.take_over(rank))
    spans.append((comm.rank, 0, f"take over expert rank {rank} from PE {dead}", t, time.monotonic() - t))
    return model


def _expert_loop(comm, cfg, info, model_factory, plan: MoEPlan, ch: Channels):
    experts = plan.local_experts(comm.rank)
    # a spare holds no experts until the front end gives it a dead rank's (failover.py)
    model = model_factory("expert", experts) if comm.rank not in plan.spare_pes else None
    hooks = model_hooks(model)  # an emulated device holds its modelled transfers (hooks.py)
    ex, stats = ch.moe, ch.stats
    batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s, enabled=cfg.expert_batching)
    spans = []
    watch = DeathWatch(comm, depended_on(comm, cfg, "expert"))
    ex.lose_senders = cfg.attention_failover  # a dead attention PE counts as finished (attention failover)
    while True:
        stats.publish()
        if model is None and (model := _take_over(comm, ex, ch.box, model_factory, spans)) is not None:
            hooks = model_hooks(model)
        now = time.monotonic()
        layer = batcher.ready(now) if model is not None else None
        if layer is not None:
            batch = ExpertBatch.merge(batcher.take(layer))
            out = apply_experts(batch, lambda e, x: model.expert(layer, e, x), out=ex.output_buffer(batch))
            hooks.hold_transfer(batch.num_rows, time.monotonic(), layer)  # the batch's dispatch + combine
            ex.combine_send(batch, out)
            spans.append((comm.rank, 0, f"experts L{layer} ({batch.num_rows} rows)", now, time.monotonic() - now))
            stats.busy(time.monotonic() - now)
            stats.batch(batch.num_rows)
            continue
        if ex.finished and batcher.held_rows == 0:
            break
        wait = batcher.wait_s(now) if model is not None else 0.01  # a spare looks at its inbox every 10 ms
        try:
            batches = ex.dispatch_recv_many(timeout=0.05 if wait is None else max(wait, 1e-4))
        except CommTimeoutError:
            watch.check()
            batches = []
        now = time.monotonic()
        for b in batches:
            batcher.add(b.layer, b.num_rows, b, now)
    stats.publish(force=True)
    return spans
