"""The emulator's counters (``emulator.py``): per process, how many held calls overran their modelled
(dilated) time and by how much, in a small memory-mapped file under ``stats_dir`` that survives the worker's
``os._exit``; and the baseline's collectives, whose shortest real duration is the transport's own time."""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

__all__ = ["STAT_FIELDS", "read_stats", "overrun_summary", "collective_summary"]

# route_rows_max / route_rows_mean: summed over the model's router calls, the rows its tokens send to the most
# loaded expert-holding rank and to the mean rank (the served router's skew; fit.fit_host_overhead)
STAT_FIELDS = ("calls", "overruns", "modelled_s", "real_s", "overrun_s", "held_s", "route_rows_max", "route_rows_mean")
_FMT = "<" + "d" * len(STAT_FIELDS)
_SIZE = struct.calcsize(_FMT)


class _Stats:
    """Counters of one wrapped model in a memory-mapped file (updated in place, readable after any exit)."""

    def __init__(self, path: "Path | None") -> None:
        self.values = [0.0] * len(STAT_FIELDS)
        self._mm = None
        if path is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, _SIZE)
                self._mm = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)

    def add(self, modelled: float, real: float, held: float) -> None:
        v = self.values
        v[0] += 1
        v[2] += modelled
        v[3] += real
        v[5] += held
        if real > modelled:
            v[1] += 1
            v[4] += real - modelled
        if self._mm is not None:
            struct.pack_into(_FMT, self._mm, 0, *v)

    def route(self, max_rows: float, mean_rows: float) -> None:
        """One router call: the rows its tokens send to the most loaded expert-holding rank, and to the mean one."""
        v = self.values
        v[6] += max_rows
        v[7] += mean_rows
        if self._mm is not None:
            struct.pack_into(_FMT, self._mm, 0, *v)


class _CollectiveLog:
    """(modelled, real) seconds of every held collective, appended to a file (one write per collective)."""

    def __init__(self, path: "Path | None") -> None:
        self._fd = None if path is None else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)

    def add(self, modelled: float, real: float) -> None:
        if self._fd is not None:
            os.write(self._fd, struct.pack("<dd", modelled, real))


def collective_summary(stats_dir: "str | Path") -> dict:
    """Is the host's transport slower than the modelled collectives?

    Every baseline worker joins every collective in the same order, so the
    k-th record of each worker is the same collective. Its real duration on
    the worker that arrived last (the shortest) is the transport's own time;
    the collective is *late* when that exceeds its modelled time (the largest
    of the workers', whose rows differ). Returns ``{"collectives", "late",
    "late_fraction", "late_s" (the summed excess), "median_transport_s",
    "median_modelled_s"}``.
    """
    logs = []
    for f in sorted(Path(stats_dir).glob("*.coll")):
        raw = f.read_bytes()
        n = len(raw) // 16
        if n:  # a model that joined no collective (an expert-side model) writes nothing
            logs.append([struct.unpack_from("<dd", raw, 16 * i) for i in range(n)])
    if not logs:
        return {"collectives": 0, "late": 0, "late_fraction": 0.0, "late_s": 0.0, "median_transport_s": None,
                "median_modelled_s": None}
    n = min(len(x) for x in logs)
    late, late_s, transport, modelled = 0, 0.0, [], []
    for i in range(n):
        m = max(log[i][0] for log in logs)
        r = min(log[i][1] for log in logs)
        transport.append(r)
        modelled.append(m)
        if r > m:
            late += 1
            late_s += r - m
    transport.sort()
    modelled.sort()
    return {"collectives": n, "late": late, "late_fraction": late / n if n else 0.0, "late_s": late_s,
            "median_transport_s": transport[n // 2] if n else None,
            "median_modelled_s": modelled[n // 2] if n else None}


def read_stats(stats_dir: "str | Path") -> list[dict]:
    """Every wrapped model's counters under ``stats_dir``, summed per process:
    ``[{"role", "pid", "calls", "overruns", "overrun_fraction" (overrun seconds / modelled seconds),
    "overrun_calls_fraction" (overruns / calls), "modelled_s", "real_s", "overrun_s", "held_s"}]``."""
    per_pid: dict = {}
    for f in sorted(Path(stats_dir).glob("*.stat")):
        role, pid, _n = f.stem.rsplit("-", 2)
        raw = f.read_bytes()
        if len(raw) != _SIZE:
            continue
        vals = dict(zip(STAT_FIELDS, struct.unpack(_FMT, raw)))
        entry = per_pid.setdefault(int(pid), {"roles": set(), **{k: 0.0 for k in STAT_FIELDS}})
        entry["roles"].add(role)
        for k in STAT_FIELDS:
            entry[k] += vals[k]
    out = []
    for pid, e in sorted(per_pid.items()):
        calls = int(e["calls"])
        out.append({"role": "+".join(sorted(e["roles"])), "pid": pid, "calls": calls, "overruns": int(e["overruns"]),
                    "overrun_fraction": e["overrun_s"] / e["modelled_s"] if e["modelled_s"] else 0.0,
                    "overrun_calls_fraction": e["overruns"] / calls if calls else 0.0,
                    **{k: e[k] for k in ("modelled_s", "real_s", "overrun_s", "held_s", "route_rows_max",
                                         "route_rows_mean")}})
    return out


def overrun_summary(stats: list[dict]) -> dict:
    """``{"overrun_fraction", "max_rank_overrun_fraction", "overrun_calls_fraction", "calls", "overruns",
    "overrun_s", "modelled_s", "per_rank": stats}``.

    ``overrun_fraction`` is by **time**: the seconds by which held calls' real compute exceeded their modelled
    (dilated) time, over the modelled seconds of all held calls: how far the host's own compute stretched the
    emulated devices' timeline. ``overrun_calls_fraction`` counts calls instead; it overstates the distortion
    when many holds are short (a TP group's router and shared-expert holds are one device's share of the
    tokens, often under a millisecond, which the served model's Python call exceeds by a fraction of a
    millisecond: 8.6% of the calls but 0.2-0.6% of the time in an unloaded run at time scale 0.35)."""
    calls = sum(s["calls"] for s in stats)
    over = sum(s["overruns"] for s in stats)
    over_s = sum(s["overrun_s"] for s in stats)
    modelled = sum(s["modelled_s"] for s in stats)
    return {"overrun_fraction": over_s / modelled if modelled else 0.0,
            "max_rank_overrun_fraction": max((s["overrun_fraction"] for s in stats), default=0.0),
            "overrun_calls_fraction": over / calls if calls else 0.0,
            "calls": calls, "overruns": over, "overrun_s": over_s, "modelled_s": modelled, "per_rank": stats}
