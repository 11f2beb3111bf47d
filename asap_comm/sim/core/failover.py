"""Expert failover simulated (docs/failover.md, "The simulator's model"): ``simulate(..., failures=[(time_s,
expert_rank), ...])`` with ``cfg.spare_expert_ranks`` spares.

ASAP (``"async"``), as the runtime does it:

* At ``time_s`` the expert rank's PE is gone. The rows of every micro-batch whose combine from the expert ranks has
  not come back (in flight to the rank, held in its batcher, being computed, or on their way back) are lost for
  that rank; so are the rows dispatched to it later, until a spare serves it.
* With a spare left, it serves the rank ``detect_s + load_s`` after the death (``costmodel/failover.py``: the
  front end's 10 ms look, then the rank's expert bytes from the checkpoint plus a start-up term). Then every
  lost part is dispatched again, to the spare (same rows), and the micro-batches waiting for it go on when the
  spare's combine comes back; the other expert ranks are not held up, but no micro-batch passes that MoE layer
  without the dead rank's part, so the attention ranks stall. The spare is a die of its own (its batcher,
  compute and links, :class:`_Spare`), and gets every micro-batch's part, until it has caught up (returned
  every part that waited for it); from then on it is one of the ``E`` identical ranks that the representative
  expert rank stands for (the model's balanced routing, ``simulate.py``), and finishes the parts it holds.
  The rows of a rank are sent once over the attention devices' links at the dispatch; a re-dispatch costs its
  rows on the spare's own link. A second death of the same rank before its spare has caught up counts when it has.
* With no spare left the group fails at that time (the runtime's 503 and exit 3): every request not finished,
  and every later arrival, fails.

The baseline (``"sync"``) cannot fail over (its collectives bind every rank to every other): a death ends the run
at that time, every unfinished request failing. Without ``failures`` neither mode is touched: the ASAP run uses
:class:`_AsyncSim` itself, and no event is scheduled.
"""
from __future__ import annotations

import math

from ...serving.policies import ExpertBatcher
from .async_mode import _AsyncSim
from .common import batch_skew
from .engine import Engine, Rank

__all__ = ["check_failures", "fail_group", "failover_summary"]


def check_failures(failures, ranks: int, what: str, who: str = "simulate") -> list:
    """``failures`` as a sorted list of ``(time_s, rank)``; ValueError naming ``who`` and the bad entry."""
    if failures is None:
        return []
    try:
        items = list(failures)
    except TypeError:
        raise ValueError(f"{who}: failures={failures!r} must be a list of (time_s, {what})") from None
    out = []
    for i, f in enumerate(items):
        try:
            t, r = f
        except (TypeError, ValueError):
            raise ValueError(f"{who}: failures[{i}]={f!r} must be a pair (time_s, {what})") from None
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{who}: failures[{i}] time_s={t!r} must be a finite number of seconds >= 0")
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < ranks:
            raise ValueError(f"{who}: failures[{i}] {what}={r!r} must be an int in [0, {ranks})")
        out.append((float(t), r))
    return sorted(out)


def fail_group(sim, why: str) -> None:
    """The group fails now: no event runs after this one, and every request not finished fails with ``why``."""
    sim.engine.cancel_all()
    sim.group_failed = {"time_s": sim.engine.now, "reason": why}
    for rec in sim.records.values():
        if rec.error is None and rec.done_s is None:
            rec.error = f"failed: {why}"


class _Spare:
    """A spare expert die serving expert rank ``rank`` from ``ready_s``: its own batcher, compute and links, given
    every part until it has caught up (module docstring). ``add`` gives it one micro-batch's part (the micro-batch
    then waits for one more return)."""

    def __init__(self, sim, number: int, rank: int, failed_s: float, ready_s: float) -> None:
        self.sim, self.number, self.rank, self.failed_s, self.ready_s = sim, number, rank, failed_s, ready_s
        cfg = sim.cfg
        self.batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s, enabled=cfg.expert_batching)
        self.rk = Rank(sim.engine, sim.host, f"spare {number} (expert rank {rank})", spans=sim.spans)
        self.backlog: list = []  # (micro-batch, rows) waiting for the spare to be ready
        self.out = 0  # parts given to it and not back
        self.owed = 0  # parts of the backlog not back yet (it has caught up when none is left)
        self.in_free = self.out_free = ready_s  # when its link is free to receive / to send
        self.wake = None
        self.ready = False
        self.lost = 0  # micro-batch parts in flight at the death
        self.redispatched = 0  # parts sent to it when it became ready (the lost ones and those dispatched meanwhile)
        self.caught_up_s: "float | None" = None

    def add(self, mb, rows: int) -> None:
        mb.waiting += 1
        self.out += 1
        if self.ready:
            self._send(mb, rows, False)
        else:
            self.backlog.append((mb, rows))

    def start(self) -> None:
        """The spare holds the rank's experts: the attention ranks send it every part it lacks."""
        self.ready = True
        backlog, self.backlog = self.backlog, []
        self.redispatched = self.owed = len(backlog)
        for mb, rows in backlog:
            self._send(mb, rows, True)
        self._check()

    def _rows(self, mb, rows: int) -> int:
        return rows if self.sim.tp == 1 else self.sim._rows(mb.tokens)

    def _send(self, mb, rows: int, owed: bool) -> None:
        sim, now = self.sim, self.sim.engine.now
        r = self._rows(mb, rows)
        if sim.cpu:  # the attention rank's CPU copy, charged as a delay
            delay = sim.cost.dispatch_s(r)
        else:
            lat, serial = sim._link(sim.cost.dispatch_s, r, sim.segs[mb.seg][1])
            self.in_free = max(now, self.in_free) + serial
            delay = self.in_free - now + lat
        sim.engine.after(delay, self._arrive, mb, rows, r, owed)

    def _arrive(self, mb, rows: int, r: int, owed: bool) -> None:
        self.batcher.add(mb.seg, r, (mb, rows, owed), self.sim.engine.now)
        self._poke()

    def _poke(self) -> None:
        sim = self.sim
        now = sim.engine.now
        if self.rk.busy:
            return  # looked at again when its batch ends (_done)
        layer, wait = self.batcher.poll(now)
        if layer is None:
            if wait is not None:
                t = max(now + max(wait, 1e-9), math.nextafter(now, math.inf))
                if self.wake is None or self.wake[0] > t:
                    if self.wake is not None:
                        Engine.cancel(self.wake[1])
                    self.wake = (t, sim.engine.at(t, self._wake))
            return
        items = self.batcher.take(layer)
        tokens = sum(it[0].tokens for it in items)
        w = sim.segs[layer][1]
        work = w * sim.cost.experts_s(sim._expert_pairs(tokens))
        if sim.cpu:  # its CPU copies the output rows back
            work += w * sum(sim.cost.combine_s(self._rows(mb, rows)) for mb, rows, _ in items)
        skew = (1.0 if sim.ex_skew == 1.0 else
                batch_skew(sim.ex_skew, ((c.request_id, c.length) for it in items for c in it[0].chunks)))
        work = work * sim.k_exp * skew + sim.ex_job_overhead
        self.rk.submit(work, lambda: self._done(items),
                       f"spare experts seg {layer} ({len(items)} mb)" if sim.spans is not None else "")

    def _wake(self) -> None:
        self.wake = None
        self._poke()

    def _done(self, items: list) -> None:
        sim = self.sim
        now = sim.engine.now
        for mb, rows, owed in items:
            delay = 0.0
            if not sim.cpu:
                lat, serial = sim._link(sim.cost.combine_s, self._rows(mb, rows), sim.segs[mb.seg][1])
                self.out_free = max(now, self.out_free) + serial
                delay = self.out_free - now + lat
            sim.engine.after(delay + sim.layer_overhead, self._back, mb, owed)
        self._poke()

    def _back(self, mb, owed: bool) -> None:
        self.out -= 1
        self.owed -= owed
        self.sim._part_back(mb)
        self._check()

    def _check(self) -> None:
        if self.ready and self.owed == 0 and self.caught_up_s is None:
            self.caught_up_s = self.sim.engine.now
            self.sim._caught_up(self)


class _AsyncFailoverSim(_AsyncSim):
    """ASAP with expert deaths at ``failures`` (``[(time_s, expert_rank)]``) and ``cfg.spare_expert_ranks`` spares,
    each taking ``detect_s + load_s`` to serve a dead rank (module docstring)."""

    def __init__(self, *args, failures: list, detect_s: float, load_s: float, **kw) -> None:
        super().__init__(*args, **kw)
        self.failures, self.detect_s, self.load_s = failures, detect_s, load_s
        self.spares_left = self.cfg.spare_expert_ranks
        self.out: dict = {}  # micro-batch -> rows: dispatched, the expert ranks' combine not back yet
        self.active: list = []  # spares that have not caught up: every dispatch gives them their part
        self.spares: list = []  # every spare that took over, in order
        self.deaths: list = []  # {"time_s", "expert_rank", "spare"} per death handled
        self.deferred: dict = {}  # expert rank -> deaths waiting for its spare to catch up
        self.group_failed = None

    def _dispatched(self, mb, rows: int) -> None:
        _AsyncSim._dispatched(self, mb, rows)
        self.out[mb] = rows
        for sp in self.active:
            sp.add(mb, rows)

    def _combine_back(self, mb) -> None:
        self.out.pop(mb, None)
        self._part_back(mb)

    def _fail(self, rank: int) -> None:
        now = self.engine.now
        if any(sp.rank == rank for sp in self.active):
            self.deferred[rank] = self.deferred.get(rank, 0) + 1
            return
        if self.spares_left == 0:
            self.deaths.append({"time_s": now, "expert_rank": rank, "spare": None})
            fail_group(self, f"expert rank {rank} died at {now:.6g} s with no spare left: the group failed (503)")
            return
        self.spares_left -= 1
        sp = _Spare(self, len(self.spares), rank, now, now + self.detect_s + self.load_s)
        self.deaths.append({"time_s": now, "expert_rank": rank, "spare": sp.number})
        sp.lost = len(self.out)
        for mb, rows in self.out.items():
            sp.add(mb, rows)
        self.spares.append(sp)
        self.active.append(sp)
        self.engine.at(sp.ready_s, sp.start)

    def _caught_up(self, sp: _Spare) -> None:
        self.active.remove(sp)
        for _ in range(self.deferred.pop(sp.rank, 0)):
            self._fail(sp.rank)

    def run(self) -> tuple:
        for t, rank in self.failures:
            self.engine.at(t, self._fail, rank)
        end, ranks = super().run()
        ranks += [(sp.rk.name, "expert spare", sp.rk, 1) for sp in self.spares]
        return end, ranks


def schedule_sync_failures(sim, failures: list) -> None:
    """The baseline: the first death ends the run (its collectives bind every rank; no failover)."""
    sim.group_failed = None
    sim.deaths = []

    def die(rank: int) -> None:
        sim.deaths.append({"time_s": sim.engine.now, "expert_rank": rank, "spare": None})
        fail_group(sim, f"rank {rank} died at {sim.engine.now:.6g} s: the baseline's collectives bind every rank, "
                        "so the group failed (no failover)")

    for t, rank in failures:
        sim.engine.at(t, die, rank)


def _served(records, lo: float, hi: "float | None") -> "float | None":
    """Prompt tokens/s of the requests that finished in ``[lo, hi)`` (None: an empty window)."""
    if hi is None or not hi > lo:
        return None
    return sum(r.prompt_len for r in records if r.ok and lo <= r.done_s < hi) / (hi - lo)


def failover_summary(sim, mode: str, records: list, end: float, spares: int, detect_s: float,
                     load_s: float) -> dict:
    """``SimResult.failover``: each death, its replacement's times, the group's failure, the requests failed, and
    the served prompt tokens/s (by the requests' completion) in windows around the first death: ``before`` (from
    the first arrival to the death), ``during`` (the death until its spare has caught up; with no spare, until the
    run's end), ``drain`` (until the TTFT is back: ``recovered_s``, when every request that arrived before the
    first one after the catch-up whose TTFT is within 10% of the longest before the death has finished; None if
    none is) and ``after`` (from then, as long as ``before`` and within the arrivals); ``offered``: the prompt
    tokens/s that arrived in each window."""
    deaths = []
    by_number = {sp.number: sp for sp in getattr(sim, "spares", [])}
    for d in sim.deaths:
        sp = by_number.get(d["spare"])
        e = dict(d)
        if sp is not None:
            e.update(ready_s=sp.ready_s, time_to_replace_s=sp.ready_s - sp.failed_s,
                     lost_parts=sp.lost, redispatched_parts=sp.redispatched, caught_up_s=sp.caught_up_s)
        deaths.append(e)
    failed = sum(1 for r in records if r.error is not None and r.error.startswith("failed:"))
    out = {"spare_expert_ranks": spares, "spares_used": len(by_number), "detect_s": detect_s, "load_s": load_s,
           "deaths": deaths, "group_failed": sim.group_failed, "requests_failed": failed}
    if mode == "sync":
        out["note"] = ("the synchronous baseline cannot fail over: its collectives bind every rank, so a death "
                       "ends the run")
    if deaths and records:
        t0 = min(r.arrival_s for r in records)
        last = max(r.arrival_s for r in records)
        first = deaths[0]
        tf, tc = first["time_s"], first.get("caught_up_s")
        tr = None
        if tc is not None:
            # back to normal: from the first request arriving after the spare caught up whose TTFT is within 10% of
            # the longest one that finished before the death, every earlier arrival done
            normal = 1.1 * max((r.ttft_s for r in records if r.ok and r.done_s < tf), default=0.0)
            by_arrival = sorted((r for r in records if r.ok), key=lambda r: r.arrival_s)
            back = next((r.arrival_s for r in by_arrival if r.arrival_s >= tc and r.ttft_s <= normal), None)
            if back is not None:
                tr = max([tc] + [r.done_s for r in by_arrival if r.arrival_s < back])
                first["recovered_s"], first["recovered_after_s"] = tr, tr - tf
        windows = {"before": (t0, tf), "during": (tf, end if tc is None else tc),
                   "drain": None if tr is None else (tc, tr),
                   "after": None if tr is None or last <= tr else (tr, min(last, tr + (tf - t0)))}
        tput = {k: None if w is None else _served(records, *w) for k, w in windows.items()}
        tput["windows"] = {k: None if w is None else list(w) for k, w in windows.items()}
        # what arrived in each window (tokens/s): a real trace's load varies, so compare served with offered
        tput["offered"] = {k: None if w is None or not w[1] > w[0] else
                           sum(r.prompt_len for r in records if w[0] <= r.arrival_s < w[1]) / (w[1] - w[0])
                           for k, w in windows.items()}
        out["throughput"] = tput
    return out
