"""Plots of simulated runs (PNG, matplotlib; skipped with a note on stderr when it is not installed).

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


def ttft_vs_load(path: Path, runs: list, slo: float, title: str = "") -> list:
    """TTFT p50/p90 against offered load (prompt tokens/s), one colour per mode."""
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
    ax.set_title(f"simulated: ASAP (async) vs synchronous DP+EP\n{title}", fontsize=9)
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
