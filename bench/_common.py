"""Shared helpers of the benchmark suite: timing, statistics, process groups, result rows, tables.

Units used throughout:

* raw timing samples are nanoseconds per iteration (floats derived from
  ``time.perf_counter_ns``);
* latency rows are reported in microseconds (``us``);
* bandwidth rows are reported in GB/s (10**9 bytes per second, so
  ``bytes / ns`` is already GB/s).

Standard library only (no torch import), so that ``bench/mpi_pingpong.py``
can use it under ``mpirun`` without paying torch's import time.
"""
from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
from multiprocessing.connection import wait as mp_wait
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

US = "us"  # latency unit of a row: microseconds, lower is better
GBPS = "GB/s"  # bandwidth unit of a row: 10**9 bytes per second, higher is better


def log(msg: str) -> None:
    """A progress line on stderr (the result table goes to stdout)."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class BatchPlan:
    """How often to run a loop: ``warmup`` untimed iterations, then ``batches`` timed batches of ``iters``."""

    warmup: int
    batches: int
    iters: int

    def scaled(self, factor: float) -> "BatchPlan":
        """The same plan with ``factor`` times as many batches and warm-up iterations (at least 5 batches)."""
        return BatchPlan(max(1, int(self.warmup * factor)), max(5, int(self.batches * factor)), self.iters)


BatchFn = Callable[[int, int], int]
"""``batch(first, n)`` runs iterations ``first .. first+n-1`` and returns how many of them failed a check."""


def time_batches(batch: BatchFn, plan: BatchPlan) -> tuple[list[float], int]:
    """Run ``batch`` as ``plan`` says; return (ns per iteration of each timed batch, failed checks).

    The counter handed to ``batch`` starts at 1 and increases across the
    warm-up and all batches, so values carried by the messages are unique and
    monotonic. Both sides of a ping-pong call this with the same plan, so they
    run the same iterations; the responder just ignores its timings. The
    garbage collector is off while timing.
    """
    samples: list[float] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        bad = batch(1, plan.warmup)
        first = 1 + plan.warmup
        for _ in range(plan.batches):
            t0 = time.perf_counter_ns()
            bad += batch(first, plan.iters)
            samples.append((time.perf_counter_ns() - t0) / plan.iters)
            first += plan.iters
    finally:
        if gc_was_enabled:
            gc.enable()
    return samples, bad


def time_each(op: Callable[[], None]) -> float:
    """Nanoseconds one call of ``op`` takes."""
    t0 = time.perf_counter_ns()
    op()
    return float(time.perf_counter_ns() - t0)


def ns_to_us(samples_ns: Sequence[float], divisor: float = 1.0) -> list[float]:
    """Samples in ns -> us, each divided by ``divisor`` (2 turns a round trip into one-way latency)."""
    return [s / 1000.0 / divisor for s in samples_ns]


def ns_to_gbps(nbytes: int, samples_ns: Sequence[float]) -> list[float]:
    """Per-transfer durations in ns of ``nbytes`` each -> bandwidth samples in GB/s."""
    return [nbytes / s for s in samples_ns]


def digest(buf) -> str:
    """A short content hash of a buffer (anything exposing the buffer protocol), for data checks."""
    return hashlib.blake2b(memoryview(buf).cast("B"), digest_size=16).hexdigest()


def pattern(numel: int, seed: int = 1234):
    """A reproducible float32 torch test pattern of ``numel`` elements (imports torch on first use)."""
    import torch

    return torch.rand(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


@contextmanager
def pinned(index: int):
    """Pin this process to one CPU (the ``index``-th it may use, modulo their count) for the block.

    Latency benchmarks pin each of their two processes to its own CPU: left
    to the scheduler, a woken waiter is often placed on its waker's CPU, and
    two spinning processes sharing a CPU turn a sub-microsecond ping-pong into
    one that costs a full spin budget per message.
    """
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    os.sched_setaffinity(0, {cpus[index % len(cpus)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


# --------------------------------------------------------------------------- process groups
def _child_main(fn, args, conn) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # report everything to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


def run_processes(fn: Callable, args_per_proc: Sequence[tuple], timeout: float, what: str) -> list:
    """Run ``fn(*args)`` in one spawned process per entry of ``args_per_proc``; return their results in order.

    ``fn`` must be defined at module level. Raises ``RuntimeError`` with the
    child's traceback as soon as one raises or dies, ``TimeoutError`` if they
    are not all done within ``timeout`` seconds; every child is stopped
    either way.
    """
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for args in args_per_proc:
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child_main, args=(fn, args, w), daemon=True)
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        return _collect(conns, time.monotonic() + timeout, what)
    finally:
        _stop(procs)
        for c in conns:
            c.close()


def _collect(conns: list, end: float, what: str) -> list:
    """Each child's result, in order, as they arrive; the first failure or the deadline raises."""
    results = [None] * len(conns)
    pending = {conn: i for i, conn in enumerate(conns)}
    while pending:
        left = end - time.monotonic()
        ready = mp_wait(list(pending), timeout=left) if left > 0 else []
        if not ready:
            raise TimeoutError(f"{what}: processes {sorted(pending.values())} did not finish in time; "
                               "all were stopped")
        for conn in ready:
            i = pending.pop(conn)
            try:
                status, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"{what}: process {i} died without reporting a result") from None
            if status != "ok":
                raise RuntimeError(f"{what}: process {i} failed:\n{value}")
            results[i] = value
    return results


def _stop(procs, grace: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(grace)
        if p.is_alive():
            p.kill()
            p.join(grace)


# --------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class Stats:
    """Median and 10th/90th percentiles of ``n`` samples, in the samples' unit."""

    median: float
    p10: float
    p90: float
    n: int


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ascending values, linearly interpolated."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: Sequence[float]) -> Stats:
    """Median, p10 and p90 of a non-empty list of samples."""
    if not samples:
        raise ValueError("summarize: no samples")
    s = sorted(samples)
    return Stats(percentile(s, 50), percentile(s, 10), percentile(s, 90), len(s))


# --------------------------------------------------------------------------- result rows
@dataclass
class Measurement:
    """What one benchmark measured: samples in ``unit`` (``US`` or ``GBPS``) plus its data check.

    ``correct`` is None when the benchmark did not run (then ``note`` says why).
    """

    name: str
    what: str
    unit: str
    nbytes: int
    samples: Optional[list] = None
    correct: Optional[bool] = None
    note: str = ""

    @property
    def stats(self) -> Optional[Stats]:
        return summarize(self.samples) if self.samples else None

    @property
    def median(self) -> Optional[float]:
        st = self.stats
        return st.median if st else None


def advantage(unit: str, asap: Optional[float], base: Optional[float]) -> Optional[float]:
    """How many times better ASAP is than the baseline (>1: ASAP better), or None if either is missing.

    Latency (``US``): ``base / asap``; bandwidth (``GBPS``): ``asap / base``.
    """
    if not asap or not base:
        return None
    return base / asap if unit == US else asap / base


@dataclass(frozen=True)
class Target:
    """A goal from the issue: an absolute ceiling on the median and/or a minimum advantage over the baseline."""

    text: str
    max_median: Optional[float] = None  # in the row's unit (latency rows)
    min_ratio: Optional[float] = None  # advantage() over the row's baseline

    def met(self, median: Optional[float], ratio: Optional[float]) -> str:
        """"yes", "no", or "n/a" when only a missing baseline keeps it from being decided."""
        if median is None:
            return "no"
        if self.max_median is not None and median > self.max_median:
            return "no"
        if self.min_ratio is not None:
            if ratio is None:
                return "n/a"
            if ratio < self.min_ratio:
                return "no"
        return "yes"


def make_row(m: Measurement, baseline: Optional[Measurement] = None, target: Optional[Target] = None,
             gloo: Optional[Measurement] = None) -> dict:
    """One result row (a JSON-ready dict) for ``m``, compared with ``baseline`` and, optionally, gloo."""
    st = m.stats
    median = st.median if st else None
    base_median = baseline.median if baseline else None
    ratio = advantage(m.unit, median, base_median)
    return {
        "name": m.name,
        "what": m.what,
        "unit": m.unit,
        "bytes": m.nbytes,
        "median": median,
        "p10": st.p10 if st else None,
        "p90": st.p90 if st else None,
        "samples": st.n if st else 0,
        "baseline": baseline.name if baseline else None,
        "baseline_median": base_median,
        "ratio": ratio,
        "vs_gloo": advantage(m.unit, median, gloo.median) if gloo else None,
        "target": target.text if target else None,
        "target_met": target.met(median, ratio) if target else None,
        "correct": {True: "PASS", False: "FAIL", None: "SKIP"}[m.correct],
        "note": m.note,
    }


# --------------------------------------------------------------------------- tables
COLUMNS = [  # (row key, header, formatter kind)
    ("name", "name", "text"),
    ("bytes", "bytes", "bytes"),
    ("unit", "unit", "text"),
    ("median", "median", "num"),
    ("p10", "p10", "num"),
    ("p90", "p90", "num"),
    ("baseline", "baseline", "text"),
    ("baseline_median", "base median", "num"),
    ("ratio", "ratio (>1: ASAP better)", "ratio"),
    ("vs_gloo", "vs gloo (>1: ASAP better)", "ratio"),
    ("target", "target", "text"),
    ("target_met", "met", "text"),
    ("correct", "check", "text"),
    ("what", "what", "text"),
]


def fmt_cell(value, kind: str) -> str:
    """A table cell: ``kind`` is "num" (3 significant digits), "ratio", "bytes" or "text"; "-" for nothing."""
    if value is None or value == "":
        return "-"
    if kind == "num":
        return f"{value:.3g}" if value < 100 else f"{value:.0f}"
    if kind == "ratio":
        return f"{value:.2f}x"
    if kind == "bytes":
        return f"{value >> 20} MiB" if value >= 1 << 20 else str(value)
    return str(value)


def _cells(rows: Sequence[dict]) -> list[list[str]]:
    return [[fmt_cell(r.get(key), kind) for key, _, kind in COLUMNS] for r in rows]


def text_table(rows: Sequence[dict]) -> str:
    """The rows as an aligned plain-text table (one line per row)."""
    headers = [h for _, h, _ in COLUMNS]
    body = _cells(rows)
    widths = [max(len(c) for c in col) for col in zip(headers, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [headers, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows as a GitHub-flavoured markdown table."""
    headers = [h for _, h, _ in COLUMNS]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in _cells(rows)]
    return "\n".join(out)


def notes_of(rows: Sequence[dict]) -> list[str]:
    """``name: note`` for every row that carries a note (skips, errors, set-up details)."""
    return [f"{r['name']}: {r['note']}" for r in rows if r.get("note")]


def git_commit(cwd: str) -> str:
    """The short commit hash of the checkout at ``cwd``, or "unknown"."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
