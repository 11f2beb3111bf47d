"""Plots of simulated, emulated and measured runs (PNG, matplotlib; skipped with a note on stderr when it is not
installed). Each function returns the list of file names it wrote (empty if none).

Every figure says what was run in a title that fits it (:class:`RunFacts`: what, hardware as dies or emulated
dies with the token scale, model, trace, load unit, the SLO and its percentile), plots the TTFT percentile the
SLO is judged at (``ttft_key``: p99 for a p99 study), leaves a sweep's far-below probe loads out of its axes and
says so (``serving.plotting.probe_loads``), and labels its ticks with plain numbers. The main figure of a study
is :func:`slo_throughput`: served against offered load with the sustained-load cut (served >= 0.9 of offered)
and each mode's SLO-compliant throughput, over the TTFT at the SLO's percentile against the SLO.
``asap_comm.sim.studies.figures`` builds each study's set from its JSON (``python -m asap_comm.sim replot DIR``).
"""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ...serving.metrics import MIN_SERVED, slo_compliant_throughput, withheld_reason
from ...serving.plotting import fit_footnote, fit_title, plain_number, plain_ticks, probe_loads, pyplot, save

_COLORS = {"async": "tab:blue", "sync": "tab:red"}
NAMES = {"async": "ASAP (async)", "sync": "baseline (sync DP+EP)"}


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def ttft_key(percentile: float) -> str:
    """The run-summary key of the TTFT percentile an SLO at ``percentile`` (percent of requests) is judged at:
    the stored percentile (50, 90, 99) at or above it, as ``study.tail_key``."""
    return "ttft_p99_s" if percentile > 90 else "ttft_p90_s" if percentile > 50 else "ttft_p50_s"


def _pname(key: str) -> str:
    return key.split("_")[1]  # "ttft_p99_s" -> "p99"


@dataclass
class RunFacts:
    """What a figure shows was run; :meth:`lines` is its title.

    ``what``: the comparison ("simulated: best ASAP vs best synchronous DP+EP"); ``hardware``: the profile and
    dies ("ascend-910c-cm384, 64 dies per deployment"), or the emulated dies with the token scale; ``model``;
    ``trace``; ``load_unit`` (the x axis: "prompt tokens/s"); ``slo_s`` and ``percentile`` (the share of
    requests that must meet it, percent); ``notes``: anything else a reader needs (printed under the title)."""

    what: str
    hardware: str
    model: str
    trace: str
    load_unit: str = "prompt tokens/s"
    slo_s: "float | None" = None
    percentile: float = 90.0
    notes: list = field(default_factory=list)

    def slo_text(self) -> str:
        if self.slo_s is None:
            return ""
        return f"SLO: TTFT <= {self.slo_s:.3g} s for {self.percentile:g}% of requests"

    def lines(self, *extra) -> list:
        head = "; ".join(x for x in (self.what, self.slo_text()) if x)
        return [head, f"{self.hardware}; model {self.model}; trace {self.trace}; load in {self.load_unit}",
                *self.notes, *extra]


def _served(r: dict, slo_s: "float | None") -> "tuple[float, str]":
    """(served fraction of one run, how it was had). The run's own ``served_fraction`` ("own"); for a result
    written before that key existed, rebuilt from the run's numbers ("rebuilt"): with no failed request and the
    arrivals rescaled to ``rate_req_s`` (``scale_trace``: span (n - 1) / rate), the window of
    ``serving.served_fraction`` is max(span, n x offered / (rate x throughput) - SLO), which gives the same
    value; else throughput / offered tokens/s ("lower": its window runs to the last first token)."""
    if r.get("served_fraction") is not None:
        return float(r["served_fraction"]), "own"
    off, thr = r.get("offered_tokens_per_s") or 0.0, r.get("throughput_tokens_per_s") or 0.0
    n, rate = r.get("num_requests") or 0, r.get("rate_req_s") or 0.0
    if off <= 0 or thr <= 0:
        return 0.0, "lower"
    if slo_s and n > 1 and rate > 0 and r.get("num_failed") == 0:
        span = (n - 1) / rate
        return span / max(span, n * off / (rate * thr) - slo_s), "rebuilt"
    return thr / off, "lower"


def _by_mode(runs: list) -> dict:
    modes = [m for m in ("async", "sync") if any(r["mode"] == m for r in runs)]
    modes += sorted({r["mode"] for r in runs} - set(modes))
    return {m: sorted((r for r in runs if r["mode"] == m and r.get("offered_tokens_per_s") is not None),
                      key=lambda r: r["offered_tokens_per_s"]) for m in modes}


def _probe_note(probes: set, unit: str) -> str:
    if not probes:
        return ""
    xs = ", ".join(plain_number(x) for x in sorted(probes))
    return (f"Left out of the axes: the load search's probe at {xs} {unit} (requests alone, far below the other "
            "loads; it still counts in the SLO-compliant throughput).")


def sweep_cut(runs: list, target: float, slo_s: "float | None" = None) -> "tuple[float | None, str | None, set]":
    """(SLO-compliant throughput, why it is withheld, how the served fractions were had: see :func:`_served`)
    of one mode's sweep points: ``serving.slo_compliant_throughput`` (a load counts where the SLO holds at
    ``target`` and served >= 0.9 of offered, there and at every lower load)."""
    pts, how = [], set()
    for r in runs:
        served, h = _served(r, slo_s)
        how.add(h)
        pts.append((r["offered_tokens_per_s"], r["slo_attainment"], served))
    if not pts:
        return None, "no runs", how
    return slo_compliant_throughput(pts, target), withheld_reason(pts, target), how


def slo_throughput(path: Path, runs: list, facts: RunFacts, *, recorded: "dict | None" = None) -> list:
    """The main figure of a study: top, served (``serving.served_fraction`` x offered) against offered per mode with the sustained-load cut
    (served = 0.9 x offered) and each mode's SLO-compliant throughput (a vertical line: the highest load that
    counts); bottom, the TTFT at the SLO's percentile against the SLO. Filled markers: loads that count (SLO
    met and sustained, there and at every lower load). ``runs``: sweep points (``mode``,
    ``offered_tokens_per_s``, ``throughput_tokens_per_s``, ``slo_attainment``, the TTFT percentiles, and
    ``served_fraction`` where the run has it). ``recorded``: mode -> the SLO-compliant throughput the result
    file states, to flag where it differs from the cut drawn here."""
    plt = pyplot()
    if plt is None or not runs:
        return []
    target, key = facts.percentile / 100.0, ttft_key(facts.percentile)
    by_mode = _by_mode(runs)
    probes = probe_loads(r["offered_tokens_per_s"] for r in runs)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9.4, 6.6), sharex=True, layout="constrained",
                                 gridspec_kw={"height_ratios": [1.15, 1]})
    notes, xs_all, how_all = [], [], set()
    for mode, pts in by_mode.items():
        c = _COLORS.get(mode)
        sct, why, how = sweep_cut(pts, target, facts.slo_s)
        how_all |= how
        shown = [r for r in pts if r["offered_tokens_per_s"] not in probes]
        x = [r["offered_tokens_per_s"] for r in shown]
        xs_all += x
        counts = [sct is not None and r["offered_tokens_per_s"] <= sct for r in shown]
        served = [_served(r, facts.slo_s)[0] * r["offered_tokens_per_s"] for r in shown]
        tail = [r.get(key) for r in shown]
        name = NAMES.get(mode, mode)
        ax.plot(x, served, "-", color=c, lw=1.2, label=name)
        bx.plot([a for a, t in zip(x, tail) if t is not None], [t for t in tail if t is not None], "-", color=c,
                lw=1.2, label=f"{name}, TTFT {_pname(key)}")
        for axis, ys in ((ax, served), (bx, tail)):
            for xi, yi, ok in zip(x, ys, counts):
                if yi is not None:
                    axis.plot([xi], [yi], "o", color=c, mfc=c if ok else "white", ms=6)
        if sct is not None and sct not in probes:
            for axis in (ax, bx):
                axis.axvline(sct, color=c, ls="--", lw=1.0)
            ax.plot([], [], "--", color=c, label=f"{name}: SLO-compliant throughput {plain_number(sct)}")
        elif sct is not None:
            notes.append(f"{name}: SLO-compliant throughput {plain_number(sct)} {facts.load_unit} (the probe load "
                         "only).")
        else:
            notes.append(f"{name}: SLO-compliant throughput withheld ({why}).")
        rec = (recorded or {}).get(mode)
        if recorded is not None and mode in recorded and not _same(rec, sct):
            notes.append(f"{name}: the result file states {plain_number(rec) if rec is not None else 'none'} "
                         f"{facts.load_unit}; drawn here: {plain_number(sct) if sct is not None else 'withheld'} "
                         "(a load counts only where served >= 0.9 of offered).")
    if xs_all:
        lo, hi = min(xs_all), max(xs_all)
        ax.set_xlim(lo / 1.15, hi * 1.15)
        grid = [lo / 1.15 * (hi * 1.15 / (lo / 1.15)) ** (i / 50) for i in range(51)]
        ax.plot(grid, grid, color="gray", lw=0.7, label="served = offered")
        ax.plot(grid, [MIN_SERVED * g for g in grid], color="black", ls=":", lw=1.0,
                label=f"sustained-load cut: served = {MIN_SERVED:g} x offered")
        ax.fill_between(grid, [1e-9] * len(grid), [MIN_SERVED * g for g in grid], color="gray", alpha=0.12, lw=0)
    if facts.slo_s is not None:
        bx.axhline(facts.slo_s, color="black", ls=":", lw=1.0, label=f"SLO {facts.slo_s:.3g} s")
    ax.plot([], [], "o", color="gray", mfc="gray", label="load counts (SLO met and served >= 0.9 x offered, "
            "here and at every lower load)")
    ax.plot([], [], "o", color="gray", mfc="white", label="load does not count")
    for axis in (ax, bx):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.grid(alpha=0.3, which="both")
    if xs_all:
        top = [_served(r, facts.slo_s)[0] * r["offered_tokens_per_s"] for p in by_mode.values() for r in p
               if r["offered_tokens_per_s"] not in probes]
        top = [y for y in top if y > 0]
        ax.set_ylim(min(top + [lo]) / 1.3, max(top + [hi]) * 1.3)
    ax.set_ylabel(f"served ({facts.load_unit.split(' (')[0]})", fontsize=9)  # the unit's note is on the x axis
    bx.set_ylabel(f"TTFT {_pname(key)} (s)", fontsize=9)
    bx.set_xlabel(f"offered load ({facts.load_unit})")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [textwrap.fill(x, 34, break_on_hyphens=False) for x in labels], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=7, frameon=False, borderaxespad=0)
    bx.legend(fontsize=7, loc="upper left")
    plain_ticks(ax)
    plain_ticks(bx)
    if "rebuilt" in how_all:
        notes.append("Served: serving.served_fraction x offered. Served fraction rebuilt from each run's requests, rate, throughput and the SLO (this result "
                     "predates the runs' own served_fraction; the same value for runs without failures).")
    if "lower" in how_all:
        notes.append("Where a run had failures: served = throughput / offered (reads lower than served_fraction).")
    fit_title(fig, facts.lines())
    fit_footnote(fig, [_probe_note(probes, facts.load_unit), *notes])
    return save(fig, path)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def ttft_vs_load(path: Path, runs: list, slo: float, title: str = "",
                 heading: str = "simulated: ASAP (async) vs synchronous DP+EP", *, facts: "RunFacts | None" = None,
                 percentile: float = 90.0) -> list:
    """TTFT at the SLO's percentile (solid) and p50 (dashed) against offered load, one colour per mode
    (``runs``: dicts with ``mode``, ``offered_tokens_per_s`` and ``ttft_p50_s`` / ``ttft_p90_s`` / ``ttft_p99_s``,
    as a sweep's points or ``summary.json``'s runs). ``facts`` makes the title (else ``heading`` and ``title``);
    its percentile (else ``percentile``) picks the plotted one. Probe loads are left out (noted)."""
    plt = pyplot()
    if plt is None or not runs:
        return []
    pct = facts.percentile if facts is not None else percentile
    key = ttft_key(pct)
    probes = probe_loads(r.get("offered_tokens_per_s") for r in runs)
    fig, ax = plt.subplots(figsize=(7.6, 5.0), layout="constrained")
    for mode, pts in _by_mode(runs).items():
        pts = [r for r in pts if r["offered_tokens_per_s"] not in probes]
        c = _COLORS.get(mode)
        for k, style in ((key, "o-"), ("ttft_p50_s", "x--")):
            xy = [(r["offered_tokens_per_s"], r[k]) for r in pts if r.get(k) is not None]
            ax.plot([p[0] for p in xy], [p[1] for p in xy], style, color=c,
                    label=f"{NAMES.get(mode, mode)}, TTFT {_pname(k)}")
    ax.axhline(slo, color="gray", lw=1.0, ls=":", label=f"SLO {slo:.3g} s ({pct:g}% of requests)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    unit = facts.load_unit if facts is not None else "prompt tokens/s"
    ax.set_xlabel(f"offered load ({unit})")
    ax.set_ylabel("TTFT (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    plain_ticks(ax)
    fit_title(fig, facts.lines() if facts is not None else [heading, title])
    fit_footnote(fig, [_probe_note(probes, unit)])
    return save(fig, path, dpi=110)


def utilisation_timeline(path: Path, timelines: dict, title="", max_ranks: int = 16) -> list:
    """Per-rank busy spans (gaps are idle / stalled time), one panel per mode, the first ``max_ranks`` ranks.
    ``title``: a string or title lines (e.g. ``RunFacts.lines(...)``)."""
    plt = pyplot()
    if plt is None or not any(timelines.values()):
        return []
    modes = [m for m in timelines if timelines[m]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.6 + 0.32 * max_ranks * len(modes)), squeeze=False,
                             layout="constrained")
    for ax, mode in zip(axes[:, 0], modes):
        spans = timelines[mode]
        names = []
        for name, *_ in spans:
            if name not in names:
                names.append(name)
        names = sorted(names, key=_natural)[:max_ranks]
        window = max(s + d for _, _, s, d in spans)
        for i, n in enumerate(names):
            bars = [(s, d) for name, _, s, d in spans if name == n and s < window]
            ax.broken_barh(bars, (i - 0.4, 0.8), color=_COLORS.get(mode, "gray"))
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=6)
        ax.set_xlim(0, window)
        plain_ticks(ax, "x")
        ax.set_title(f"{NAMES.get(mode, mode)}: busy spans per rank (white = idle / waiting"
                     + ("; each step's own compute, drawn from the step's start)" if mode == "sync" else ")"),
                     fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fit_title(fig, title)
    return save(fig, path, dpi=110)


def ratio_plot(path: Path, series: dict, xlabel: str, title="", target: "float | None" = None, *,
               ylabel: str = "best ASAP / best baseline", notes=(), equal: str = "1.0 (equal)") -> list:
    """One ratio against one parameter: ``series`` maps a label to [(x, ratio or None)] (None: withheld, left
    out and listed under the figure). ``ylabel`` says which way the ratio runs; ``title``: a string or lines."""
    plt = pyplot()
    if plt is None or not series:
        return []
    fig, ax = plt.subplots(figsize=(7.2, 4.8), layout="constrained")
    notes = list(notes)
    for label, pts in series.items():
        gone = [x for x, r in pts if r is None]
        pts = [(x, r) for x, r in pts if r is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        if gone:
            notes.append(f"{label}: withheld at {', '.join(plain_number(x) for x in gone)}.")
    if target is not None:
        ax.axhline(target, color="gray", ls=":", lw=0.8, label=f"target {target:g}x")
    ax.axhline(1.0, color="black", lw=0.6, label=equal)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plain_ticks(ax)
    fit_title(fig, title)
    fit_footnote(fig, notes)
    return save(fig, path, dpi=110)


# ----------------------------------------------------------------------------- measured runs
WAIT_SPANS = ("a2a", "barrier", "idle")  # span names that are waits (collectives, barriers), not compute


def rank_usage(result) -> list:
    """``[(pe, compute fraction, waiting fraction)]`` of a run's workers over the run (from its spans: a
    ``RunResult`` of ``run_async`` / ``run_sync``)."""
    if not result.spans:
        return []
    end = max(start + dur for _pe, _t, _n, start, dur in result.spans)
    per: dict = {}
    for pe, _track, name, _start, dur in result.spans:
        c, w = per.get(pe, (0.0, 0.0))
        per[pe] = (c, w + dur) if any(k in name for k in WAIT_SPANS) else (c + dur, w)
    return [(pe, min(1.0, c / end), min(1.0, w / end)) for pe, (c, w) in sorted(per.items())] if end > 0 else []


def ttft_cdf_and_ranks(path: Path, results: dict, slo: float, cfgs: dict, *, facts: "RunFacts | None" = None) -> list:
    """One load point per mode (``results``: mode -> ``RunResult``; ``cfgs``: mode -> its ``RuntimeConfig``):
    the TTFT CDF of each mode, and per-rank compute / waiting / idle bars; ``facts`` makes the title."""
    plt = pyplot()
    if plt is None:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [1, 1.3]},
                                 layout="constrained")
    for mode, result in results.items():
        ttfts = sorted(r.ttft_s for r in result.records if r.ok)
        n = len(result.records)
        if ttfts:
            ax.step(ttfts, [(i + 1) / n for i in range(len(ttfts))], where="post", color=_COLORS.get(mode),
                    label=NAMES.get(mode, mode))
    ax.axvline(slo, color="gray", lw=0.8, ls=":", label=f"SLO {slo:.2f} s")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("TTFT CDF (same trace, same load)", fontsize=9)
    plain_ticks(ax, "x")
    labels, compute, waiting = [], [], []
    for mode, result in results.items():
        A = cfgs[mode].num_attention_ranks
        for pe, c, w in rank_usage(result):
            role = "W" if mode == "sync" else ("A" if pe < A else "E")
            labels.append(f"{mode}\n{role}{pe}")
            compute.append(c)
            waiting.append(w)
    x = range(len(labels))
    bx.bar(x, compute, color="tab:green", label="compute")
    bx.bar(x, waiting, bottom=compute, color="tab:orange", label="waiting (all-to-all, barrier)")
    bx.bar(x, [1 - c - w for c, w in zip(compute, waiting)], bottom=[c + w for c, w in zip(compute, waiting)],
           color="lightgray", label="idle")
    bx.set_xticks(list(x), labels, fontsize=7)
    bx.set_ylabel("fraction of the run")
    bx.set_ylim(0, 1)
    bx.legend(fontsize=8, loc="upper right")
    bx.set_title("per-rank time (A: attention, E: expert, W: DP+EP worker)", fontsize=9)
    fit_title(fig, facts.lines() if facts is not None else ["ASAP (async) vs synchronous DP+EP, one load"])
    return save(fig, path)
