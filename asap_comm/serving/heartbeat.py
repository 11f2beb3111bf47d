"""Worker heartbeats as the front end sees them: how long since each worker's statistics row last changed.

Every worker puts its row of the group's statistics table into the front
end's memory at most every 0.1 s from its main loop
(``protocol.WorkerStats.publish``; the row's ``published`` column is the
worker's own clock, so it changes with every publication). A worker whose
process lives but does not run (stopped, swapped out, stuck in a step) stops
changing its row. :class:`Heartbeats` watches the rows and measures each
one's age with the front end's own clock, so it needs no clock shared with
the worker (it works across hosts). A front end that was itself stopped sees
the rows changed at its first look afterwards, so its own stall never makes
a live worker look frozen.

A stale heartbeat is not a failure: the process may resume. The service
reports it (``/health`` 503 naming the worker) and goes on.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

__all__ = ["Heartbeats"]


class Heartbeats:
    """Per worker PE: seconds since the front end saw its statistics row change.

    ``table``: the front end's copy of the statistics table, ``[num_pes, columns]`` (``WorkerStats.table``);
    ``workers``: the PEs to watch. :meth:`observe` looks at the rows (cheap: one small copy), :meth:`ages`
    reports. Ages count from the front end's first look at a worker.
    """

    def __init__(self, table, workers: Sequence[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.table, self.workers, self.clock = table, list(workers), clock
        now = clock()
        self._rows: dict = {pe: None for pe in self.workers}
        self._seen: dict = {pe: now for pe in self.workers}

    def observe(self) -> None:
        """Look at every watched row; a row that differs from the last look counts as a heartbeat now."""
        rows = self.table.tolist()
        now = self.clock()
        for pe in self.workers:
            if rows[pe] != self._rows[pe]:
                self._rows[pe], self._seen[pe] = rows[pe], now

    def ages(self) -> dict:
        """``{pe: seconds since its row last changed}`` as of the last :meth:`observe` and now."""
        now = self.clock()
        return {pe: now - self._seen[pe] for pe in self.workers}

    def stale(self, threshold_s: float) -> list:
        """``[(pe, age)]`` of the workers whose age is past ``threshold_s``, oldest first."""
        return sorted(((pe, a) for pe, a in self.ages().items() if a > threshold_s), key=lambda x: -x[1])
