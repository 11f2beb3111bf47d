"""``python -m asap_comm.sim scaling``: where ASAP starts to win, best against best, at each cluster size.

``scaling --profile P --model M --dies 16,32,64,128,256,384,768 --out DIR`` searches, at each size, the best
memory-feasible deployment of each mode (``search_space.py``: the same breadth on both sides; the SLO rule, the
grids, the load lattice and the pruning are described there), at p90 and p99, on the Mooncake and the Azure
traces (``--traces``), and writes:

* ``DIR/scaling.json``: ``rows``, one per size, trace and percentile: ``dies``, ``trace``, ``percentile``,
  ``slo_s``, per mode (``async``, ``sync``) the ``deployment`` (its settings; null where none sustains a load
  within the SLO, or none fits in memory), its ``slo_compliant_throughput`` (prompt tokens/s; null: withheld)
  and ``served_fraction`` at that load, ``withheld`` (why null), and ``ratio`` (ASAP / baseline; null with
  ``ratio_withheld`` saying why where either figure is withheld: never a ratio built on an unsustained load);
  ``crossover_dies``: per percentile (``"90"``, ``"99"``) and trace, the smallest size from which ASAP wins at
  every larger size of the curve (ratio > 1, or ASAP sustains a load where the baseline sustains none); null
  where it does not win at the largest size;
* ``DIR/scaling.png``: the ratio against dies, one line per percentile and trace, 1.0 marked.

``--quick``: a smoke form for the test suite (a small grid, short windows, both traces).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...serving.metrics import throughput_ratio
from ...serving.traces import TraceError
from ..costmodel.costs import CostModel
from ..costmodel.memory import WEIGHT_DTYPES, with_weights
from ..costmodel.shapes import ModelShapes
from .search_space import (CPS, EXPERT_BATCHING, LANES, STEPS_PER_DOUBLING, TPS, CHUNK_BUDGETS, load_windows,
                           search_size, slo_rule, translate)

__all__ = ["asap_wins", "crossover_dies", "mode_entry", "make_row", "plot_scaling", "main"]

PERCENTILES = (90, 99)
QUICK_GRID = {"tps": (8,), "cps": (None, 8192), "chunk_budgets": ((16384, 16384),), "batching": EXPERT_BATCHING[:1],
              "lanes": LANES[:1], "stages": ()}
QUICK_REQUESTS = (150, 300)
FULL_REQUESTS = (600, 4000)


# ----------------------------------------------------------------------------- rows and the crossover
def asap_wins(row: dict) -> "bool | None":
    """Whether ASAP wins in ``row``: True if its SLO-compliant throughput beats the baseline's (ratio > 1) or it
    sustains a compliant load where the baseline sustains none; False if the baseline's figure stands and ASAP's
    is lower, equal or withheld; None where both are withheld (nothing to compare)."""
    a = row["async"]["slo_compliant_throughput"]
    s = row["sync"]["slo_compliant_throughput"]
    if a is None and s is None:
        return None
    if s is None:
        return True
    if a is None:
        return False
    return a > s


def crossover_dies(rows: list) -> dict:
    """``{percentile (str): {trace: dies or None}}``: for each percentile and trace, the smallest size of the
    curve from which ASAP wins (:func:`asap_wins` True) at that size and every larger one; None where it does
    not win at the largest size (or a larger size has nothing to compare)."""
    out: dict = {}
    for pct in sorted({r["percentile"] for r in rows}):
        out[str(pct)] = {}
        for trace in sorted({r["trace"] for r in rows if r["percentile"] == pct}):
            mine = sorted((r for r in rows if r["percentile"] == pct and r["trace"] == trace),
                          key=lambda r: r["dies"])
            cross = None
            for r in reversed(mine):
                if asap_wins(r) is True:
                    cross = r["dies"]
                else:
                    break
            out[str(pct)][trace] = cross
    return out


def mode_entry(found: "dict | None") -> dict:
    """One mode's part of a row from ``search_space.search_mode``'s result (None: not searched)."""
    if found is None or found["best"] is None:
        why = None
        if found is not None:
            if not found["candidates"] and found["infeasible"]:
                why = f"memory: no configuration fits (first: {found['infeasible'][0]['problem']})"
            elif not found["candidates"]:
                why = "no configuration of the grid has this many dies (TP degrees, expert splits)"
            else:
                why = "no configuration of the grid meets the SLO at a sustained load"
        return {"deployment": None, "slo_compliant_throughput": None, "served_fraction": None,
                "withheld": why or "not searched", "saturated": None,
                "searched": 0 if found is None else found["searched"],
                "infeasible": 0 if found is None else len(found["infeasible"])}
    r = found["result"]
    return {"deployment": found["best"].describe(), "slo_compliant_throughput": r["slo_compliant_throughput"],
            "served_fraction": r["served_fraction"], "withheld": r["withheld"], "saturated": r["saturated"],
            "arrival_span_over_slo": (r["at_slo_compliant_load"] or {}).get("arrival_span_over_slo"),
            "searched": found["searched"], "infeasible": len(found["infeasible"])}


def make_row(dies: int, trace: str, percentile: int, slo_s: float, a: dict, s: dict, points=(None, None)) -> dict:
    ratio, why = throughput_ratio(a["slo_compliant_throughput"], s["slo_compliant_throughput"], points=points,
                                  target=percentile / 100)
    if why is not None:  # say what is missing, with each mode's own reason where the points could not tell it
        parts = [f"{name} {e['withheld']}" for name, e in (("ASAP", a), ("baseline", s))
                 if e["slo_compliant_throughput"] is None]
        why = "ratio withheld: " + "; ".join(parts) if parts else why
    row = {"dies": dies, "trace": trace, "percentile": percentile, "slo_s": slo_s, "async": a, "sync": s,
           "ratio": ratio, "ratio_withheld": why}
    row["asap_wins"] = asap_wins(row)
    return row


# ----------------------------------------------------------------------------- the plot
def plot_scaling(path: Path, rows: list, title: str = "") -> list:
    """The ratio against dies (log 2), one line per percentile and trace; withheld ratios are gaps."""
    from .plots import fit_title, plain_ticks, pyplot, save

    plt = pyplot()
    if plt is None or not rows:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.4), layout="constrained")
    styles = {90: "o-", 99: "s--"}
    for pct in sorted({r["percentile"] for r in rows}):
        for trace in sorted({r["trace"] for r in rows}):
            pts = sorted((r["dies"], r["ratio"]) for r in rows if r["percentile"] == pct and r["trace"] == trace)
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = [float("nan") if y is None else y for _, y in pts]
            cross = crossover_dies(rows).get(str(pct), {}).get(trace)
            ax.plot(xs, ys, styles.get(pct, "o-"),
                    label=f"{trace}, p{pct} ({'no crossover' if cross is None else f'crossover {cross} dies'})")
    ax.axhline(1.0, color="black", lw=0.8, ls=":", label="1.0 (equal)")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["dies"] for r in rows})
    ax.set_xticks(sizes, [str(d) for d in sizes])
    ax.set_xlabel("dies (devices) of either deployment")
    ax.set_ylabel("SLO-compliant throughput, best ASAP / best baseline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    plain_ticks(ax, "y")
    fit_title(fig, title.split("\n"))  # fitted to the figure (serving.plotting), saved with a tight bbox
    return save(fig, path, dpi=110)


# ----------------------------------------------------------------------------- command line
def _int_list(p: argparse.ArgumentParser, flag: str, value: str, allowed=None) -> list:
    out = []
    for x in value.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            v = int(x)
        except ValueError:
            v = 0
        if v < 1 or (allowed is not None and v not in allowed):
            want = f"one of {', '.join(map(str, allowed))}" if allowed else "ints >= 1"
            p.error(f"{flag} {value!r}: expected comma-separated {want}")
        out.append(v)
    if not out:
        p.error(f"{flag} {value!r}: expected at least one value")
    return sorted(set(out))


def _fmt_tok(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _fmt_ratio(row: dict) -> str:
    """A row's ratio as printed: '-' with the reason where it is withheld."""
    if row["ratio"] is None:
        return f"- ({row['ratio_withheld']})"
    return f"{row['ratio']:.2f}x"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim scaling", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--dies", default="16,32,64,128,256,384,768", metavar="N[,N...]",
                   help="cluster sizes (devices of either deployment)")
    p.add_argument("--out", required=True)
    p.add_argument("--traces", default="mooncake,azure", metavar="T[,T...]",
                   help="public trace names (mooncake, azure) or trace files")
    p.add_argument("--percentiles", default="90,99", metavar="P[,P...]", help="SLO percentiles: 90 and/or 99")
    p.add_argument("--weights", choices=WEIGHT_DTYPES, default=None,
                   help="weight dtype, overriding the profile's (int8: W8A8)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run for the test suite: TP8 only, CP none/8k, 16k chunks, the middle ASAP knobs, "
                        f"{QUICK_REQUESTS[0]}-{QUICK_REQUESTS[1]} requests per point")
    args = p.parse_args(argv)
    dies = _int_list(p, "--dies", args.dies)
    pcts = _int_list(p, "--percentiles", args.percentiles, allowed=PERCENTILES)
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not traces:
        p.error(f"--traces {args.traces!r}: expected at least one trace")
    try:
        cost = CostModel.load(args.profile, args.model)
        shapes = ModelShapes.load(args.model)
        cost = CostModel(with_weights(cost.profile, args.weights), shapes)
    except (ValueError, FileNotFoundError, KeyError) as e:
        p.error(f"--profile {args.profile!r} / --model {args.model!r}: {e}")
    windows = {}
    for t in traces:
        try:
            windows[t] = load_windows(t)
        except (TraceError, ValueError) as e:
            p.error(f"--traces {t!r}: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = QUICK_GRID if args.quick else None
    n_min, n_max = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    targets = [q / 100 for q in pcts]
    t0 = time.perf_counter()
    summary = {"profile": cost.name, "model": shapes.name, "weights": args.weights, "quick": args.quick,
               "dies": dies, "percentiles": pcts, "traces": {}, "rows": [], "crossover_dies": {},
               "search": {"grid": {"tps": list((grid or {}).get("tps", TPS)), "cps": list((grid or {}).get("cps", CPS)),
                                   "chunk_budgets": [list(x) for x in (grid or {}).get("chunk_budgets", CHUNK_BUDGETS)],
                                   "expert_batching": [list(x) for x in (grid or {}).get("batching", EXPERT_BATCHING)],
                                   "lanes (pool tokens, wait in SLOs, chunks)": [list(x) for x in (grid or {}).get("lanes", LANES)],
                                   "stages": list((grid or {}).get("stages", ("chunk", "mode", "restructure")))},
                          "requests_per_point": [n_min, n_max], "lattice_step": 2 ** (1 / STEPS_PER_DOUBLING)},
               "timing": []}
    for t in traces:
        tw = windows[t]
        slo_s, rule = slo_rule(tw.requests, cost, shapes)
        summary["traces"][t] = {"slo_s": slo_s, "slo_rule": rule, "trace": tw.note}
        print(f"[scaling {t}] {tw.note}; SLO {slo_s:.3g} s ({rule})", file=sys.stderr, flush=True)
        hints: dict = {}
        for D in dies:
            ts = time.perf_counter()
            found = search_size(tw, cost, shapes, D, slo_s, targets, n_min=n_min, n_max=n_max, grid=grid,
                                hints={m: [x for x in (translate(d, D) for d in hs) if x is not None]
                                       for m, hs in hints.items()},
                                log=lambda m, D=D, t=t: print(f"  [{t} {D}] {m}", file=sys.stderr, flush=True))
            ev = found["evaluator"]
            for pct, target in zip(pcts, targets):
                f = found["by_target"][target]
                pts = tuple(None if f[m]["result"] is None else f[m]["result"]["points"] for m in ("async", "sync"))
                row = make_row(D, t, pct, slo_s, mode_entry(f["async"]), mode_entry(f["sync"]), points=pts)
                summary["rows"].append(row)
                for m in ("async", "sync"):
                    if f[m]["best"] is not None:
                        hints[m] = [f[m]["best"]] + [h for h in hints.get(m, []) if h is not f[m]["best"]][:1]
                a, s = row["async"], row["sync"]
                print(f"[scaling {t} {D} dies p{pct}] ASAP {_fmt_tok(a['slo_compliant_throughput'])} tok/s, "
                      f"baseline {_fmt_tok(s['slo_compliant_throughput'])} tok/s, ratio {_fmt_ratio(row)}",
                      file=sys.stderr, flush=True)
            summary["timing"].append({"trace": t, "dies": D, "wall_s": time.perf_counter() - ts, **ev.stats})
            summary["crossover_dies"] = crossover_dies(summary["rows"])
            summary["wall_s"] = time.perf_counter() - t0
            (out / "scaling.json").write_text(json.dumps(summary, indent=2, default=str))  # after every size
    title = (f"{cost.name}, {shapes.name}: best ASAP / best baseline (SLO-compliant throughput)\n"
             + "; ".join(f"{t} SLO {v['slo_s']:.3g} s" for t, v in summary["traces"].items()))
    summary["plots"] = plot_scaling(out / "scaling.png", summary["rows"], title)
    summary["wall_s"] = time.perf_counter() - t0
    (out / "scaling.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nbest ASAP vs best baseline on {cost.name}, {shapes.name} (prompt tokens/s within the SLO at a load "
          f"each sustains; '-': withheld)")
    print(f"{'trace':10s} {'pct':>4s} {'dies':>5s} {'SLO s':>7s} {'ASAP tok/s':>12s} {'baseline tok/s':>15s} "
          f"{'ratio':>7s}  best ASAP / best baseline")
    for r in summary["rows"]:
        a, s = r["async"], r["sync"]
        lab = " / ".join((e["deployment"] or {}).get("label", "-") for e in (a, s))
        print(f"{r['trace'][:10]:10s} {'p' + str(r['percentile']):>4s} {r['dies']:5d} {r['slo_s']:7.3g} "
              f"{_fmt_tok(a['slo_compliant_throughput']):>12s} {_fmt_tok(s['slo_compliant_throughput']):>15s} "
              f"{'-' if r['ratio'] is None else format(r['ratio'], '.2f') + 'x':>7s}  {lab}")
        if r["ratio_withheld"]:
            print(f"{'':30s}{r['ratio_withheld']}")
    for pct, by in summary["crossover_dies"].items():
        print(f"crossover p{pct}: " + ", ".join(f"{t} {'none' if d is None else f'from {d} dies'}"
                                               for t, d in by.items()))
    print(f"artifacts in {out}/ ({summary['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
