"""Plots of simulated and measured runs (PNG, matplotlib; skipped with a note on stderr when it is not installed).

Each function returns the list of file names it wrote (empty if none).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

_COLORS = {"async": "tab:blue", "sync": "tab:red"}


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("asap_comm.sim: matplotlib is not installed, skipping plots (pip install matplotlib)",
              file=sys.stderr)
        return None
    return plt


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def ttft_vs_load(path: Path, runs: list, slo: float, title: str = "",
                 heading: str = "simulated: ASAP (async) vs synchronous DP+EP") -> list:
    """TTFT p50/p90 against offered load (prompt tokens/s), one colour per mode (``runs``: dicts with ``mode``,
    ``offered_tokens_per_s``, ``ttft_p50_s`` and ``ttft_p90_s``, as a sweep's points or ``summary.json``'s runs)."""
    plt = _plt()
    if plt is None or not runs:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode in sorted({r["mode"] for r in runs}):
        pts = sorted((r["offered_tokens_per_s"], r["ttft_p90_s"], r["ttft_p50_s"]) for r in runs
                     if r["mode"] == mode and r["ttft_p90_s"] is not None)
        c = _COLORS.get(mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=f"{mode} TTFT p90")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=c, label=f"{mode} TTFT p50")
    ax.axhline(slo, color="gray", lw=0.8, ls=":", label=f"SLO {slo:.3g} s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load (prompt tokens/s)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{heading}\n{title}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [Path(path).name]


def utilisation_timeline(path: Path, timelines: dict, title: str = "", max_ranks: int = 16) -> list:
    """Per-rank busy spans (gaps are idle / stalled time), one panel per mode, the first ``max_ranks`` ranks."""
    plt = _plt()
    if plt is None or not any(timelines.values()):
        return []
    modes = [m for m in timelines if timelines[m]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.2 + 0.32 * max_ranks * len(modes)), squeeze=False)
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
        ax.set_title(f"{mode}: busy spans per rank (white = idle / waiting; baseline: each step's own "
                     "compute, drawn from the step's start)" if mode == "sync" else
                     f"{mode}: busy spans per rank (white = idle / waiting)", fontsize=8)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [Path(path).name]


def ratio_plot(path: Path, series: dict, xlabel: str, title: str = "", target: float | None = None) -> list:
    """ASAP / baseline ratio against one parameter: ``series`` maps a label to [(x, ratio)]."""
    plt = _plt()
    if plt is None or not series:
        return []
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, pts in series.items():
        pts = [(x, r) for x, r in pts if r is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    if target is not None:
        ax.axhline(target, color="gray", ls=":", lw=0.8, label=f"target {target:g}x")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ASAP / baseline")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [Path(path).name]


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


def ttft_cdf_and_ranks(path: Path, results: dict, slo: float, cfgs: dict) -> list:
    """One load point per mode (``results``: mode -> ``RunResult``; ``cfgs``: mode -> its ``RuntimeConfig``):
    the TTFT CDF of each mode, and per-rank compute / waiting / idle bars."""
    plt = _plt()
    if plt is None:
        return []
    import matplotlib.ticker

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    for mode, result in results.items():
        ttfts = sorted(r.ttft_s for r in result.records if r.ok)
        n = len(result.records)
        if ttfts:
            ax.step(ttfts, [(i + 1) / n for i in range(len(ttfts))], where="post", color=_COLORS.get(mode),
                    label=f"{mode} ({'ASAP' if mode == 'async' else 'DP+EP baseline'})")
    ax.axvline(slo, color="gray", lw=0.8, ls=":", label=f"SLO {slo:.2f} s")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("TTFT CDF (same trace, same load)")
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
    bx.set_title("per-rank time (A: attention, E: expert, W: DP+EP worker)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [Path(path).name]
