"""Per-request records, run summaries, SLO-compliant throughput, Chrome traces.

All times are seconds on one clock (the runtime's, e.g. ``time.perf_counter()``
minus the run start); the Chrome trace writer converts them to microseconds.

Percentiles use **linear interpolation between closest ranks** (Hyndman & Fan
type 7, numpy's default ``method="linear"``): for sorted values ``v[0..n-1]``
the q-th percentile sits at position ``h = (n - 1) * q / 100`` and is
``v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)])``. It is pure
Python, so numbers match ``numpy.percentile(values, q)`` without depending on
numpy.

**SLO-compliant throughput** (:func:`slo_compliant_throughput`, the one definition every sweep uses): the highest
tested offered load at which the mode meets the SLO percentile AND sustains the load, i.e. served tokens/s >= 0.9
of offered over the window from the first arrival to the last first token less one SLO (:func:`served_fraction`;
the arrivals should span >= 10 SLOs). Where no tested load counts the figure is None and any ratio built on it is withheld
(:func:`throughput_ratio`, :func:`withheld_reason`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "percentile",
    "RequestRecord",
    "RunSummary",
    "summarize_run",
    "MIN_SERVED",
    "served_fraction",
    "sustains_slo",
    "slo_compliant_throughput",
    "withheld_reason",
    "throughput_ratio",
    "served_at_load",
    "ChromeTrace",
]


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of ``values``, linear interpolation.

    Raises ``ValueError`` on an empty input, a q outside [0, 100], or a
    non-finite value.
    """
    if not (0.0 <= q <= 100.0):
        raise ValueError(f"percentile: q={q!r} is outside [0, 100]")
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("percentile: no values")
    if not all(math.isfinite(x) for x in v):
        raise ValueError("percentile: values must be finite")
    h = (len(v) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (h - lo) * (v[hi] - v[lo])


@dataclass
class RequestRecord:
    """What happened to one request; filled in by the runtime as it goes.

    ``arrival_s``: when the request arrived; ``start_s``: when it was first
    scheduled on a rank (None until then); ``done_s``: when its first token was
    produced (None until then); ``error``: why it failed (None while it has
    not). A request succeeded (:attr:`ok`) iff it has a ``done_s`` and no
    ``error``; one that never finished counts as failed in :func:`summarize_run`.
    """

    request_id: int
    arrival_s: float
    prompt_len: int
    start_s: float | None = None
    done_s: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (``done_s - arrival_s``); None unless :attr:`ok`."""
        return self.done_s - self.arrival_s if self.ok else None

    @property
    def queue_s(self) -> float | None:
        """Time from arrival to first scheduling; None if never scheduled."""
        return None if self.start_s is None else self.start_s - self.arrival_s


@dataclass(frozen=True)
class RunSummary:
    """The numbers one run reports; :meth:`as_dict` gives the ``summary.json`` keys.

    ``ttft_*_s`` are over successful requests only (None if there is none);
    ``throughput_tokens_per_s`` is the prompt tokens of successful requests
    over ``(last done) - (first arrival)`` (0.0 if none succeeded or that span
    is zero); ``slo_attainment`` is the fraction
    of ALL requests that succeeded with a TTFT <= the SLO (failed requests are
    misses); ``served_fraction`` is served over offered tokens/s over the
    window (:func:`served_fraction`: whether the run sustained its load).
    """

    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    throughput_tokens_per_s: float
    slo_attainment: float
    num_requests: int
    num_failed: int
    served_fraction: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize_run(records: Sequence[RequestRecord], slo_ttft_s: float) -> RunSummary:
    """Summarize one run's records against a TTFT SLO (seconds, inclusive).

    Raises ``ValueError`` on no records, a non-positive SLO, or a successful
    record that finished before it arrived (the message names the request).
    """
    if not (isinstance(slo_ttft_s, (int, float)) and math.isfinite(slo_ttft_s) and slo_ttft_s > 0):
        raise ValueError(f"summarize_run: slo_ttft_s={slo_ttft_s!r} must be a positive number of seconds")
    if not records:
        raise ValueError("summarize_run: no records")
    ok = [r for r in records if r.ok]
    for r in ok:
        if not (math.isfinite(r.arrival_s) and math.isfinite(r.done_s)) or r.done_s < r.arrival_s:
            raise ValueError(f"summarize_run: request {r.request_id} has done_s={r.done_s!r} "
                             f"before arrival_s={r.arrival_s!r}")
    ttfts = [r.ttft_s for r in ok]
    p50, p90, p99 = ((percentile(ttfts, q) for q in (50, 90, 99)) if ttfts else (None, None, None))
    if ok:
        span = max(r.done_s for r in ok) - min(r.arrival_s for r in records)
        tokens = sum(r.prompt_len for r in ok)
        throughput = tokens / span if span > 0 else 0.0
    else:
        throughput = 0.0
    met = sum(1 for t in ttfts if t <= slo_ttft_s)
    return RunSummary(
        ttft_p50_s=p50, ttft_p90_s=p90, ttft_p99_s=p99,
        throughput_tokens_per_s=throughput,
        slo_attainment=met / len(records),
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        served_fraction=_served_fraction(records, ok, slo_ttft_s),
    )


def _served_fraction(records: Sequence[RequestRecord], ok: Sequence[RequestRecord], slo_s: float) -> float:
    """See :func:`served_fraction` (the window and why)."""
    if not ok:
        return 0.0
    t0 = min(r.arrival_s for r in records)
    span = max(r.arrival_s for r in records) - t0
    window = max(span, max(r.done_s for r in ok) - t0 - slo_s)
    offered = sum(r.prompt_len for r in records)
    share = sum(r.prompt_len for r in ok) / offered if offered > 0 else len(ok) / len(records)
    return share * (span / window if window > 0 else 1.0)


#: The served share of the offered load below which a load is not sustained (``slo_compliant_throughput``).
MIN_SERVED = 0.9


def served_fraction(run: dict) -> float:
    """Served over offered tokens/s of one run: its summary's ``served_fraction`` (:func:`summarize_run`).

    **The window.** Offered tokens/s: the prompt tokens of all requests over the arrivals' span (first to last
    arrival). Served tokens/s: the prompt tokens of the requests that got their first token, over the window
    from the first arrival to the last first token less one SLO (the time the last arrival is allowed), and
    never shorter than the arrivals' span. So a mode that keeps up and finishes within an SLO of the last
    arrival reads 1.0 (less its failed requests' share), and one that leaves a backlog when the arrivals stop
    (requests queued without bound) reads below 1 by the backlog's excess drain. Measure loads whose arrivals
    span at least 10 SLOs (the simulator's load searches warn below that, ``arrival_span_over_slo``): a window
    of a few SLOs is a burst, and a backlog there hides in the one SLO allowed.

    ``run``: a dict with ``served_fraction`` (a run summary's ``as_dict()``). Raises ``ValueError`` otherwise:
    a load cannot count as sustained without it.
    """
    v = run.get("served_fraction")
    if v is None:
        raise ValueError(f"served_fraction: the run summary has no 'served_fraction' (keys: {sorted(run)}); "
                         "make it with summarize_run")
    return float(v)


def _point(point) -> tuple[float, float, float]:
    """(load, attainment, served fraction) of one sweep point: a triple, or a run summary dict."""
    if isinstance(point, dict):
        try:
            return float(point["offered_tokens_per_s"]), float(point["slo_attainment"]), served_fraction(point)
        except KeyError as e:
            raise ValueError(f"slo_compliant_throughput: a point dict needs {e.args[0]!r} (has {sorted(point)})") \
                from None
    point = tuple(point)
    if len(point) != 3 or point[2] is None:
        raise ValueError(f"slo_compliant_throughput: point {point!r} must be (offered_load, slo_attainment, "
                         "served_fraction): a load counts only where the mode sustains it (served >= min_served "
                         "of offered), so the served fraction is required")
    return float(point[0]), float(point[1]), float(point[2])


def sustains_slo(attainment: float, served: float, target: float = 0.9, *, min_served: float = MIN_SERVED) -> bool:
    """Whether one load counts: the SLO attainment meets ``target`` AND the mode sustains the load (served
    tokens/s >= ``min_served`` of offered over the window, :func:`served_fraction`). The load searches
    (``asap_comm.sim.core.sweep``, ``examples/prefill.py --sweep auto``) bisect on this."""
    return attainment >= target and served >= min_served


def slo_compliant_throughput(points: Iterable, target: float = 0.9, *, min_served: float = MIN_SERVED) -> float | None:
    """The highest offered load of a sweep at which the mode meets the SLO **and sustains the load**.

    ``points``, any order: ``(offered_load, slo_attainment, served_fraction)`` triples (load in requests/s or
    tokens/s, as the sweep measured it; the result is in the same unit), or run summary dicts (load
    ``offered_tokens_per_s``, ``slo_attainment`` and ``served_fraction``, see :func:`served_fraction`). A pair
    or a dict without the served fraction is an error, not a silent pass.

    A load passes iff its attainment is >= ``target`` and its served fraction >= ``min_served`` (0.9: at a
    p90 SLO a mode could otherwise pass by letting its longest tenth queue without bound on a finite window).
    Convention: sort by load and walk up from the lowest; the result is the last load before the first one
    that fails. So a load counts only if it AND every lower tested load pass: a noisy pass above the knee is
    ignored, and nothing is interpolated or extrapolated. Several points at one load pass only if all of them
    do. Returns None (the figure is withheld) if the lowest tested load already fails; :func:`withheld_reason`
    says why.
    """
    if not (isinstance(target, (int, float)) and 0.0 < target <= 1.0):
        raise ValueError(f"slo_compliant_throughput: target={target!r} is outside (0, 1]")
    if not (isinstance(min_served, (int, float)) and 0.0 <= min_served <= 1.0):
        raise ValueError(f"slo_compliant_throughput: min_served={min_served!r} is outside [0, 1]")
    by_load: dict[float, bool] = {}
    for point in points:
        load, att, served = _point(point)
        if not (math.isfinite(load) and load >= 0):
            raise ValueError(f"slo_compliant_throughput: offered load {load!r} must be finite and >= 0")
        if not (0.0 <= att <= 1.0):
            raise ValueError(f"slo_compliant_throughput: attainment {att!r} at load {load!r} is outside [0, 1]")
        if not (math.isfinite(served) and served >= 0):
            raise ValueError(f"slo_compliant_throughput: served fraction {served!r} at load {load!r} must be "
                             "finite and >= 0")
        by_load[load] = by_load.get(load, True) and sustains_slo(att, served, target, min_served=min_served)
    if not by_load:
        raise ValueError("slo_compliant_throughput: no points")
    best = None
    for load in sorted(by_load):
        if not by_load[load]:
            break
        best = load
    return best


def withheld_reason(points: Iterable, target: float = 0.9, *, min_served: float = MIN_SERVED) -> "str | None":
    """Why a sweep has no SLO-compliant throughput (None if it has one): what failed at the lowest tested load,
    e.g. ``"sustains no tested load (served 9% of offered at the lowest)"`` or ``"meets the SLO at no tested
    load (attainment 0.42 < 0.90 at the lowest)"``. Same points as :func:`slo_compliant_throughput`."""
    pts = [_point(p) for p in points]
    if not pts or slo_compliant_throughput(pts, target, min_served=min_served) is not None:
        return None
    lowest = min(p[0] for p in pts)
    at = [p for p in pts if p[0] == lowest]
    att, served = min(p[1] for p in at), min(p[2] for p in at)
    why = []
    if served < min_served:
        why.append(f"sustains no tested load (served {served:.0%} of offered at the lowest)")
    if att < target:
        why.append(f"meets the SLO at no tested load (attainment {att:.2f} < {target:.2f} at the lowest)")
    return "; ".join(why)


def throughput_ratio(numerator: "float | None", denominator: "float | None", *, names=("ASAP", "baseline"),
                     points=(None, None), target: float = 0.9,
                     min_served: float = MIN_SERVED) -> "tuple[float | None, str | None]":
    """(ratio, reason): ``numerator / denominator`` of two SLO-compliant throughputs, or ``(None, "ratio
    withheld: ASAP sustains no tested load (served 9% of offered at the lowest)")`` where either is None
    (``points``: the two sweeps' points, for the reason; ``names``: the two modes' names). Print the ratio as
    "-" with the reason and write it as JSON null, never as a number."""
    if numerator is not None and denominator is not None and denominator > 0:
        return numerator / denominator, None
    why = []
    for name, v, pts in zip(names, (numerator, denominator), points):
        if v is None:
            r = withheld_reason(pts, target, min_served=min_served) if pts else None
            why.append(f"{name} {r or 'has no SLO-compliant load'}")
        elif v <= 0:
            why.append(f"{name}'s SLO-compliant throughput is {v!r}")
    return None, "ratio withheld: " + "; ".join(why)


def served_at_load(runs: Iterable[dict], load: "float | None") -> "dict | None":
    """What a sweep served at one offered load, beside its SLO-compliant throughput (which counts a load only where
    the served fraction is >= ``min_served``; this reports it, with the tail, at the load chosen).

    ``runs``: a sweep's run summaries (dicts with ``offered_tokens_per_s``, ``throughput_tokens_per_s``,
    ``ttft_p99_s``), any order; ``load``: an offered load in tokens/s (None: returns None). Returns the
    median over the runs at exactly that load of ``served_tokens_per_s``, ``served_fraction`` (the runs'
    own, :func:`served_fraction`; for runs without one, served over the nominal offered load, the rate times
    the mean prompt) and ``ttft_p99_s``, with ``runs`` (how many), and where the runs report the long-prompt lane's counts
    (``lane``: opened, waited, gave_up, summed; wait_s_max), those; None if no run is at that load."""
    if load is None:
        return None
    at = [r for r in runs if r["offered_tokens_per_s"] == load]
    if not at:
        return None
    served = statistics.median(r["throughput_tokens_per_s"] for r in at)
    p99 = [r["ttft_p99_s"] for r in at if r.get("ttft_p99_s") is not None]
    fractions = [r["served_fraction"] for r in at if r.get("served_fraction") is not None]
    out = {"offered_tokens_per_s": load, "served_tokens_per_s": served,
           "served_fraction": (statistics.median(fractions) if fractions else served / load if load > 0 else None),
           "ttft_p99_s": statistics.median(p99) if p99 else None, "runs": len(at)}
    lanes = [r["lane"] for r in at if r.get("lane")]
    if lanes:  # the long-prompt lane's counts there (LaneCounts), summed over the runs
        out["lane"] = {k: sum(x[k] for x in lanes) for k in ("opened", "waited", "gave_up")}
        out["lane"]["wait_s_max"] = max(x["wait_s_max"] for x in lanes)
    return out


@dataclass
class ChromeTrace:
    """A per-rank timeline in Chrome trace-event format (Perfetto and chrome://tracing open it).

    ``pid`` is the process row (a rank), ``tid`` a track inside it (e.g.
    0 = compute, 1 = communication). Every span is an ``"X"`` complete event;
    :meth:`name_process`/:meth:`name_track` add ``"M"`` metadata events so
    rows read "attention 0" instead of a number. Times go in as seconds and
    come out as microseconds (``ts``, ``dur``)::

        tl = ChromeTrace()
        tl.name_process(0, "attention 0"); tl.name_track(0, 0, "compute")
        tl.complete("layer 3 attn", pid=0, tid=0, start_s=0.012, dur_s=0.004, args={"tokens": 512})
        tl.write(out_dir / "timeline.json")
    """

    events: list[dict[str, Any]] = field(default_factory=list)

    def name_process(self, pid: int, name: str, sort_index: int | None = None) -> None:
        self.events.append({"name": "process_name", "ph": "M", "pid": int(pid), "tid": 0, "args": {"name": str(name)}})
        if sort_index is not None:
            self.events.append({"name": "process_sort_index", "ph": "M", "pid": int(pid), "tid": 0,
                                "args": {"sort_index": int(sort_index)}})

    def name_track(self, pid: int, tid: int, name: str) -> None:
        self.events.append({"name": "thread_name", "ph": "M", "pid": int(pid), "tid": int(tid),
                            "args": {"name": str(name)}})

    def complete(self, name: str, pid: int, tid: int, start_s: float, dur_s: float,
                 args: dict[str, Any] | None = None, cat: str | None = None) -> None:
        """Add one span ``[start_s, start_s + dur_s)`` on row ``pid``, track ``tid``."""
        if not (math.isfinite(start_s) and math.isfinite(dur_s) and dur_s >= 0):
            raise ValueError(f"ChromeTrace.complete: {name!r} has start_s={start_s!r}, dur_s={dur_s!r}; "
                             "need finite values and dur_s >= 0")
        ev: dict[str, Any] = {"name": str(name), "ph": "X", "ts": start_s * 1e6, "dur": dur_s * 1e6,
                              "pid": int(pid), "tid": int(tid)}
        if cat:
            ev["cat"] = str(cat)
        if args:
            ev["args"] = dict(args)
        self.events.append(ev)

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": list(self.events), "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> Path:
        """Write the JSON to ``path`` (atomically: a temporary file, then a rename)."""
        path = Path(path)
        text = json.dumps(self.to_dict(), allow_nan=False)  # NaN is not JSON; fail here, not in the viewer
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path
