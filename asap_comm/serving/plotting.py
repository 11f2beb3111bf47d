"""Figure helpers every plot of the project shares (matplotlib, imported only when a figure is drawn).

* :func:`pyplot`: ``matplotlib.pyplot`` on the Agg backend, or None with a note on stderr when matplotlib is
  not installed.
* :func:`fit_title`, :func:`fit_footnote`: the figure's title (what was run) and notes under it, wrapped and
  sized so that no line runs past the figure's edges.
* :func:`plain_ticks`: tick labels written as plain numbers (``0.5``, ``2``, ``20,000``: no ``10^x``, no
  offset), with at least three labelled ticks on a log axis that spans less than a decade.
* :func:`probe_loads`: the loads of a sweep that are probes far below the rest (a search's "requests alone"
  check), to be left out of a figure's axes.
* :func:`save`: ``savefig`` with ``bbox_inches="tight"`` (nothing cut at the edges), then close.

``asap_comm.sim.studies.plots`` (studies) and ``asap_comm.serving.client`` (the HTTP load client) draw with these.
"""
from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

#: a load more than this factor below the next tested load is a probe (:func:`probe_loads`)
PROBE_GAP = 100.0


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None (and a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("asap_comm: matplotlib is not installed, skipping plots (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def fit_title(fig, lines, *, fontsize: float = 8.5, min_fontsize: float = 6.0, margin: float = 0.02):
    """Set ``fig``'s suptitle to ``lines`` (a string or a list of lines; empty ones dropped), wrapped and sized
    by :func:`fit_text`. Returns the Text. Use with ``layout="constrained"`` so the axes make room for it."""
    return fit_text(fig, fig.suptitle(""), lines, fontsize=fontsize, min_fontsize=min_fontsize, margin=margin)


def fit_footnote(fig, lines, *, fontsize: float = 7.5, min_fontsize: float = 6.0, margin: float = 0.02):
    """Notes under the axes (``fig.supxlabel``, left-aligned), wrapped and sized by :func:`fit_text`; nothing
    when ``lines`` is empty. Returns the Text or None."""
    lines = [lines] if isinstance(lines, str) else [x for x in lines if x]
    if not lines:
        return None
    text = fig.supxlabel("", ha="left", x=margin, multialignment="left")
    return fit_text(fig, text, lines, fontsize=fontsize, min_fontsize=min_fontsize, margin=margin)


def fit_text(fig, text, lines, *, fontsize: float = 9.0, min_fontsize: float = 6.0, margin: float = 0.02):
    """Fill the figure-level Text ``text`` with ``lines`` (a string or a list of lines; empty ones dropped),
    each wrapped at word boundaries so that no rendered line is wider than the figure less ``margin`` on each
    side; the font shrinks in half points from ``fontsize`` to ``min_fontsize`` before lines are wrapped much
    shorter than the font allows. Returns ``text``."""
    if isinstance(lines, str):
        lines = [lines]
    lines = [str(x) for x in lines if x]
    renderer = fig.canvas.get_renderer()
    avail = fig.bbox.width * (1 - 2 * margin)

    def fits(fs: float, width: int) -> bool:
        text.set_text("\n".join(w for line in lines for w in _wrap(line, width)))
        text.set_fontsize(fs)
        return text.get_window_extent(renderer).width <= avail

    sizes = _sizes(fontsize, min_fontsize)
    for fs in sizes:  # characters per line from the font's mean advance, then shorter until every line fits
        guess = max(8, int(avail / max(1e-6, fs * fig.dpi / 72 * 0.55)))
        width = guess
        while width >= 8 and (fs == sizes[-1] or width >= 0.75 * guess):
            if fits(fs, width):
                return text
            width = int(width * 0.92) if width > 8 else 7
    return text


def _wrap(line: str, width: int) -> list:
    """``line`` wrapped at ``width`` characters into as many lines as that needs, as even in length as the
    words allow (no one-word last line)."""
    first = textwrap.wrap(line, width) or [""]
    n = len(first)
    if n == 1:
        return first
    for w in range(-(-len(line) // n), width):
        even = textwrap.wrap(line, w)
        if len(even) <= n:
            return even
    return first


def _sizes(hi: float, lo: float) -> list:
    out, fs = [], hi
    while fs > lo:
        out.append(fs)
        fs -= 0.5
    return out + [lo]


def plain_number(v: float) -> str:
    """A tick label: ``0.05``, ``2``, ``1.5``, ``20,000`` (thousands separated, no exponent)."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1:
        return f"{v:.4g}"
    return f"{v:.3g}" if a >= 1e-3 else f"{v:.2g}"


def plain_ticks(ax, which: str = "both") -> None:
    """Plain tick labels on ``ax``'s x and/or y axis (``which``: "x", "y" or "both"), for its current limits:
    numbers as :func:`plain_number` writes them, no offset, no scientific notation; on a log axis, ticks at
    1-2-5 steps when it spans under two decades and at evenly spaced values under one decade (so at least
    three are labelled), minor ticks unlabelled. Call after the data and limits are set."""
    import matplotlib.ticker as mt

    fmt = mt.FuncFormatter(lambda v, _pos: plain_number(v))
    for name in ("x", "y") if which == "both" else (which,):
        axis = ax.xaxis if name == "x" else ax.yaxis
        lo, hi = sorted(ax.get_xlim() if name == "x" else ax.get_ylim())
        if axis.get_scale() == "log" and lo > 0:
            decades = math.log10(hi / lo)
            if decades >= 2:
                axis.set_major_locator(mt.LogLocator(base=10, subs=(1.0,)))
            elif decades >= 0.9:
                axis.set_major_locator(mt.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            else:  # under a decade: evenly spaced values, no unlabelled minor ticks between them
                axis.set_major_locator(mt.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
                axis.set_minor_locator(mt.NullLocator())
            axis.set_minor_formatter(mt.NullFormatter())
        elif axis.get_scale() == "linear":
            axis.set_major_locator(mt.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        axis.set_major_formatter(fmt)


def probe_loads(loads, gap: float = PROBE_GAP) -> set:
    """The loads (of ``loads``, any order) that are probes: from the highest down, the first load more than
    ``gap`` times below the next higher one, and every load below it. A load search's "requests alone" check
    (``asap_comm.sim.core.sweep.find_slo_throughput``: the start rate / 4**10) is one; drawn on the main axes it
    would stretch a log axis over six decades, so figures leave such points out and say so."""
    xs = sorted({float(x) for x in loads if x is not None and x > 0}, reverse=True)
    for hi, lo in zip(xs, xs[1:]):
        if lo * gap < hi:
            return {x for x in xs if x <= lo}
    return set()


def save(fig, path, dpi: int = 120) -> list:
    """Write ``fig`` to ``path`` (PNG) with ``bbox_inches="tight"`` and close it; returns ``[file name]``."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return [Path(path).name]
