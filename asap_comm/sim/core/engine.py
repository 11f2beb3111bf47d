"""The discrete-event engine of the simulator: a clock, an event heap, ranks, and shared hosts.

* :class:`Engine`: events are ``(time, sequence)``-ordered, so events at the
  same time run in the order they were scheduled (FIFO ties, deterministic
  runs). An event can be cancelled; scheduling in the past is an error.
* :class:`Host`: where jobs get their compute. ``cores=None``: every rank has
  its own device and a job of ``work`` seconds takes ``work`` seconds. An int:
  all ranks share that many CPU cores with processor sharing: ``n`` running
  jobs each progress at ``min(1, cores / n)`` (what the OS scheduler gives
  busy single-threaded processes; the ``local`` profile, where every rank is a
  process of this host).
* :class:`Rank`: one process / device: runs its jobs one at a time in FIFO
  order (``submit``; ``submit(front=True)`` continues the job that just
  ended), and keeps its busy time and, optionally, its timeline spans;
  ``hold``/``release`` make it wait at a barrier (the lock-step ablation).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

__all__ = ["Engine", "Host", "Rank", "ps_makespan"]


class Engine:
    """A discrete-event clock. ``at``/``after`` schedule ``fn(*args)``; ``run`` processes events in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0
        self.events = 0  # events processed

    def at(self, t: float, fn: Callable, *args) -> list:
        """Schedule ``fn(*args)`` at time ``t`` (>= now). Returns a handle for :meth:`cancel`."""
        if not t >= self.now:  # also rejects NaN
            raise ValueError(f"Engine.at: time {t!r} is before now ({self.now!r}) or not a number")
        entry = [t, self._seq, fn, args]
        self._seq += 1
        heapq.heappush(self._heap, entry)
        return entry

    def after(self, delay: float, fn: Callable, *args) -> list:
        """Schedule ``fn(*args)`` ``delay`` (>= 0) seconds from now."""
        if not delay >= 0 or delay == math.inf:
            raise ValueError(f"Engine.after: delay {delay!r} must be finite and >= 0")
        entry = [self.now + delay, self._seq, fn, args]  # at(), without its check (now + delay >= now)
        self._seq += 1
        heapq.heappush(self._heap, entry)
        return entry

    @staticmethod
    def cancel(handle: list) -> None:
        """Cancel a scheduled event (a no-op if it already ran)."""
        handle[2] = None

    def run(self, until: float | None = None) -> float:
        """Process events until none is left (or the next is after ``until``); returns the clock."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            t, _, fn, args = pop(heap)
            if fn is None:
                continue
            self.now = t
            self.events += 1
            fn(*args)
        return self.now

    def cancel_all(self) -> None:
        """Cancel every scheduled event: ``run`` then returns at the current time (a failed group stops)."""
        for entry in self._heap:
            entry[2] = None

    @property
    def pending(self) -> int:
        return sum(1 for e in self._heap if e[2] is not None)


def ps_makespan(works, cores: int | None) -> float:
    """When the last of jobs started together ends, under processor sharing on ``cores`` cores.

    ``cores=None``: one device each, so the longest job. With ``n`` jobs left,
    each progresses at ``min(1, cores / n)``.
    """
    ws = sorted(w for w in works if w > 0)
    if not ws:
        return 0.0
    if cores is None or len(ws) <= cores:
        return ws[-1]
    t, done, n = 0.0, 0.0, len(ws)
    for i, w in enumerate(ws):
        rate = min(1.0, cores / (n - i))
        t += (w - done) / rate
        done = w
    return t


class _Job:
    __slots__ = ("remaining", "weight", "callback", "event")

    def __init__(self, remaining: float, weight: int, callback: Callable) -> None:
        self.remaining, self.weight, self.callback, self.event = remaining, weight, callback, None


class Host:
    """Compute shared by ranks: dedicated (``cores=None``) or processor-shared ``cores`` CPU cores."""

    def __init__(self, engine: Engine, cores: int | None) -> None:
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            raise ValueError(f"Host: cores={cores!r} must be None or an int >= 1")
        self.engine, self.cores = engine, cores
        self._jobs: list[_Job] = []
        self._last = 0.0

    def run(self, work: float, callback: Callable[[], None], weight: int = 1) -> None:
        """Run ``work`` seconds of single-core compute, then ``callback()``.

        ``weight``: how many identical jobs this one stands for (they all run
        at once on as many processes); it only matters for sharing.
        """
        if not work >= 0:
            raise ValueError(f"Host.run: work={work!r} must be >= 0")
        if self.cores is None:
            self.engine.after(work, callback)
            return
        self._advance()
        self._jobs.append(_Job(work, weight, callback))
        self._reschedule()

    def _rate(self) -> float:
        n = sum(j.weight for j in self._jobs)
        return 1.0 if n <= self.cores else self.cores / n

    def _advance(self) -> None:
        now = self.engine.now
        if self._jobs and now > self._last:
            done = (now - self._last) * self._rate()
            for j in self._jobs:
                j.remaining = max(0.0, j.remaining - done)
        self._last = now

    def _reschedule(self) -> None:
        rate = self._rate()
        for j in self._jobs:
            if j.event is not None:
                Engine.cancel(j.event)
            j.event = self.engine.after(j.remaining / rate, self._finish, j)

    def _finish(self, job: _Job) -> None:
        self._advance()
        self._jobs.remove(job)
        job.remaining = 0.0
        self._reschedule()
        job.callback()


class Rank:
    """A rank: FIFO jobs run one at a time on ``host``; busy time and optional spans.

    ``weight``: how many identical ranks this one stands for (see :meth:`Host.run`).
    """

    def __init__(self, engine: Engine, host: Host, name: str, *, weight: int = 1,
                 spans: list | None = None) -> None:
        self.engine, self.host, self.name, self.weight = engine, host, name, weight
        self._queue: deque = deque()
        self.busy = False
        self.busy_s = 0.0
        self.jobs = 0
        self._spans = spans  # (rank name, label, start, duration) appended when not None
        self._started = 0.0
        self._current = None
        self.held = False  # waiting at a barrier (hold/release): queued jobs wait
        self.on_idle: "Callable[[], None] | None" = None  # called when the rank runs out of jobs

    def submit(self, work: float, callback: Callable[[], None] | None, label: str = "", *,
               front: bool = False) -> None:
        """Queue ``work`` seconds of compute; ``callback()`` when it ends. ``front``: run it next."""
        item = (work, callback, label)
        if front:
            self._queue.appendleft(item)
        else:
            self._queue.append(item)
        if not self.busy:
            self._start()

    def _start(self) -> None:
        work, callback, label = self._queue.popleft()
        self.busy = True
        self._started = self.engine.now
        self._current = (callback, label)
        if self.host.cores is None:  # a dedicated device (Host.run's first case, inlined: the hot path)
            if not work >= 0:
                raise ValueError(f"Host.run: work={work!r} must be >= 0")
            self.engine.after(work, self._done)
        else:
            self.host.run(work, self._done, self.weight)

    def _done(self) -> None:
        callback, label = self._current
        now = self.engine.now
        self.busy_s += now - self._started
        self.jobs += 1
        if self._spans is not None:
            self._spans.append((self.name, label, self._started, now - self._started))
        self.busy = False
        if callback is not None:
            callback()
        if not self.busy and self._queue:
            self._start()
        elif not self.busy and self.on_idle is not None:
            self.on_idle()

    def hold(self) -> None:
        """The rank waits (a barrier): it starts no job until :meth:`release`; the wait is not busy time."""
        if self.busy:
            raise ValueError(f"Rank.hold: {self.name} is running a job")
        self.busy = self.held = True
        self._started = self.engine.now

    def release(self) -> None:
        """End a :meth:`hold`: record the wait as a span labelled ``barrier`` and start the next queued job."""
        if not self.held:
            raise ValueError(f"Rank.release: {self.name} is not held")
        self.busy = self.held = False
        if self._spans is not None and self.engine.now > self._started:
            self._spans.append((self.name, "barrier", self._started, self.engine.now - self._started))
        if self._queue:
            self._start()

    @property
    def queued(self) -> int:
        return len(self._queue)
