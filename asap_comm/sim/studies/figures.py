"""Each study's figures, from the study's own result JSON; ``python -m asap_comm.sim replot DIR [DIR...]``.

The studies call these when they finish (``headline``, ``run``, ``barrier``; ``examples/prefill.py`` through
:func:`example_figures`), and ``replot`` calls them again on committed results, so a figure can be redrawn
without re-running its study. What a result file does not hold (a run's per-rank spans, a load point's TTFT at
a percentile it did not record) is listed as skipped, with why, never drawn from something else.

* ``DIR/summary.json`` of ``sim headline`` (``profiles``): per profile ``slo_throughput_<profile>.png`` (the main
  figure), ``ttft_<profile>.png``, ``ratio_vs_skew_<profile>.png``, ``ratio_vs_load_<profile>.png``; and
  ``utilisation_<profile>.png`` only at study time (spans).
* ``DIR/summary.json`` of ``sim run`` (``config.profile``): ``slo_throughput.png`` (sweeps), ``ttft.png``;
  ``utilisation.png`` at study time.
* ``DIR/summary.json`` of ``examples/prefill.py`` (``config.modes``): ``slo_throughput.png``, ``ttft.png``
  (sweeps; a single load's CDF needs the run's records: study time only).
* ``DIR/barrier.json`` of ``sim barrier``: ``barrier.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import plots
from .plots import RunFacts, ttft_key

Made = "tuple[list, list]"  # (file names written, [(file name, why not)])


def _pct(x) -> float:
    return 90.0 if x is None else float(x)


# ----------------------------------------------------------------------------- sim headline
def headline_facts(res: dict, config: dict) -> RunFacts:
    """The title of a ``sim headline`` profile result (``res``: ``summary.json``'s ``profiles[name]``)."""
    best = res.get("best") or {}
    labels = [f"{w}: {best[m]['label']}" for m, w in (("async", "best ASAP"), ("sync", "best baseline"))
              if (best.get(m) or {}).get("label")]
    return RunFacts(what="simulated: best ASAP vs best synchronous DP+EP (each searched)",
                    hardware=f"{res['profile']}, {res['devices']} dies per deployment",
                    model=config.get("model", "?"), trace=res.get("trace", "?"), slo_s=res.get("slo_s"),
                    percentile=_pct(res.get("slo_percentile")), notes=["; ".join(labels)] if labels else [])


def headline_figures(out: Path, res: dict, config: dict, timelines: "dict | None" = None) -> Made:
    """Every figure of one ``sim headline`` profile result into ``out``."""
    out, tag = Path(out), res["profile"]
    facts = headline_facts(res, config)
    made, skipped = [], []
    recorded = {m: (res.get("best") or {}).get(m, {}).get("slo_compliant_throughput") for m in ("async", "sync")}
    made += plots.slo_throughput(out / f"slo_throughput_{tag}.png", res["runs"], facts, recorded=recorded)
    made += plots.ttft_vs_load(out / f"ttft_{tag}.png", res["runs"], res["slo_s"], facts=facts)
    pct = facts.percentile
    if res.get("skew_sensitivity"):
        rows = res["skew_sensitivity"]
        slos = ", ".join(f"{r['slo_s']:.3g}" for r in rows)
        skew = RunFacts(what="simulated: best ASAP vs best baseline of the main search's finalists, re-searched on "
                             "each trace", hardware=facts.hardware, model=facts.model,
                        trace=f"synthetic log-normal prompt lengths of the Mooncake trace's mean, "
                              f"{config.get('num_requests_sensitivity', '?')} requests each",
                        load_unit="prompt tokens/s", slo_s=None, percentile=pct,
                        notes=[f"SLO: TTFT for {pct:g}% of requests, set per trace by the study's rule: {slos} s"])
        made += plots.ratio_plot(out / f"ratio_vs_skew_{tag}.png",
                                 {"SLO-compliant throughput, best ASAP / best baseline":
                                  [(r["sigma"], r["ratio"]) for r in rows]},
                                 "log-normal sigma of prompt lengths (equal mean; 0: all prompts equal)",
                                 skew.lines(), target=1.9,
                                 ylabel="SLO-compliant throughput, best ASAP / best baseline")
    key = ttft_key(pct)
    rows = res.get("load_sensitivity") or []
    name = f"ratio_vs_load_{tag}.png"
    if rows and all(key in r["async"] and key in r["sync"] for r in rows):
        p = key.split("_")[1]
        base = (res.get("sweep") or {}).get("sync", {}).get("slo_compliant_rate_req_s")
        made += plots.ratio_plot(
            out / name,
            {f"TTFT {p}, baseline / ASAP": [(r["load_fraction_of_baseline_slo_rate"],
                                            _ratio(r["sync"][key], r["async"][key])) for r in rows]},
            "load, as a fraction of the best baseline's SLO-compliant rate"
            + (f" ({base:.3g} req/s)" if base else ""),
            facts.lines(), ylabel=f"TTFT {p}, baseline / ASAP", equal="1.0 (equal; above: ASAP faster)")
    elif rows:
        skipped.append((name, f"its load_sensitivity rows have no {key} (the study's percentile); re-run the "
                              "headline to record it"))
    if timelines:
        base = (res.get("async") or {}).get("rate_req_s")
        made += plots.utilisation_timeline(out / f"utilisation_{tag}.png", timelines, facts.lines(
            f"at the best baseline's SLO-compliant load ({base:.3g} req/s)" if base else ""))
    else:
        skipped.append((f"utilisation_{tag}.png", "the per-rank spans are not in the JSON (drawn at study time)"))
    return made, skipped


def _ratio(num, den) -> "float | None":
    return num / den if num and den else None


# ----------------------------------------------------------------------------- sim run
def run_facts(summary: dict) -> RunFacts:
    """The title of a ``sim run`` summary."""
    c = summary["config"]
    dev = c.get("devices") or {}
    hw = ", ".join(f"{plots.NAMES.get(m, m)} {n} dies" for m, n in dev.items())
    return RunFacts(what="simulated: ASAP (async) vs synchronous DP+EP", hardware=f"{c['profile']}: {hw}",
                    model=c.get("model", "?"), trace=f"{c.get('trace', '?')}, {c.get('num_requests', '?')} requests",
                    slo_s=c.get("slo_s"), percentile=_pct(c.get("slo_percentile")))


def run_figures(out: Path, summary: dict, timelines: "dict | None" = None) -> Made:
    """The figures of one ``sim run`` into ``out``."""
    out, facts = Path(out), run_facts(summary)
    made, skipped = [], []
    rates = {r["rate_req_s"] for r in summary["runs"]}
    if len(rates) > 1:
        recorded = {m: summary[m].get("slo_compliant_throughput") for m in ("async", "sync")
                    if "slo_compliant_throughput" in (summary.get(m) or {})}
        made += plots.slo_throughput(out / "slo_throughput.png", summary["runs"], facts, recorded=recorded or None)
    made += plots.ttft_vs_load(out / "ttft.png", summary["runs"], facts.slo_s, facts=facts)
    if timelines:
        mid = (summary.get("async") or summary.get("sync") or {}).get("rate_req_s")
        made += plots.utilisation_timeline(out / "utilisation.png", timelines,
                                           facts.lines(f"at {mid:g} req/s" if mid else ""))
    else:
        skipped.append(("utilisation.png", "the per-rank spans are not in the JSON (drawn at study time)"))
    return made, skipped


# ----------------------------------------------------------------------------- examples/prefill.py
def example_facts(summary: dict) -> RunFacts:
    """The title of an ``examples/prefill.py`` summary: emulated dies with the token and time scales, or this
    host's processes."""
    c = summary["config"]
    A, E = c.get("attention_ranks"), c.get("expert_ranks")
    slo = summary.get("slo") or {}
    trace = f"{c.get('trace', '?')}, {c.get('num_requests', '?')} requests per load"
    modes = [m for m in ("async", "sync") if m in str(c.get("modes", "async,sync")).split(",")] or ["async", "sync"]
    who = {"async": "ASAP (async) only", "sync": "synchronous DP+EP baseline only"}.get(
        modes[0] if len(modes) == 1 else "", "ASAP (async) vs synchronous DP+EP")
    if c.get("emulate"):
        tp, ed, stp = c.get("attention_tp", 1), c.get("expert_dies", 1), c.get("sync_tp", 1)
        mem = summary.get("memory") or {}
        a_dies = {x["role"]: x["dies"] for x in mem.get("async", [])} or {"attention": A * tp, "expert": E * ed}
        s_dies = sum(x["dies"] for x in mem.get("sync", [])) or (c.get("sync_ranks") or (A * tp + E * ed) // stp) * stp
        ts = c.get("token_scale", 1)
        sides = {"async": f"ASAP {a_dies.get('attention')} attention ({A} groups x TP{tp}) + "
                          f"{a_dies.get('expert')} expert",
                 "sync": f"baseline {s_dies} ({s_dies // stp} DP groups x TP{stp})"}
        hw = (f"emulated {c['emulate']} dies: {', '.join(sides[m] for m in modes)}; each served token stands for "
              f"{ts:g} emulated tokens; times x{c.get('time_scale', 1):g}")
        model = f"{c.get('emulate_model', '?')} emulated (served: {c.get('model', '?')})"
        unit = f"served prompt tokens/s (x{ts:g} emulated)"
        what = f"emulated: {who}, real runtime"
        ls = c.get("length_scale")
        if ls not in (None, 1, 1.0):
            inv = 1 / ls
            trace += f", lengths / {inv:g}" if abs(inv - round(inv)) < 1e-9 else f", lengths x{ls:g}"
    else:
        sides = {"async": f"ASAP {A} attention + {E} expert processes",
                 "sync": f"baseline {c.get('sync_ranks') or A + E} processes"}
        hw = f"this host: {', '.join(sides[m] for m in modes)}"
        model, unit, what = c.get("model", "?"), "prompt tokens/s", f"measured: {who}"
    return RunFacts(what=what, hardware=hw, model=model, trace=trace, load_unit=unit, slo_s=slo.get("ttft_s"),
                    percentile=_pct(slo.get("percentile")))


def example_figures(out: Path, summary: dict) -> Made:
    """The figures of an ``examples/prefill.py`` sweep into ``out``: ``slo_throughput.png`` and ``ttft.png``.
    The example calls this after writing ``summary.json``; one load (no sweep) draws its CDF at run time
    (:func:`asap_comm.sim.studies.plots.ttft_cdf_and_ranks`, with :func:`example_facts`)."""
    out, facts = Path(out), example_facts(summary)
    if len({r["rate_req_s"] for r in summary["runs"]}) < 2:
        return [], [("ttft.png", "one load: its TTFT CDF needs the run's records (drawn at run time)")]
    recorded = {m: summary[m].get("slo_compliant_throughput") for m in ("async", "sync")
                if "slo_compliant_throughput" in (summary.get(m) or {})}
    made = plots.slo_throughput(out / "slo_throughput.png", summary["runs"], facts, recorded=recorded or None)
    made += plots.ttft_vs_load(out / "ttft.png", summary["runs"], facts.slo_s, facts=facts)
    return made, []


# ----------------------------------------------------------------------------- sim barrier
def barrier_figure(path: Path, result: dict) -> list:
    """``barrier.png`` of a ``sim barrier`` result (``barrier.json``): the measured per-MoE-layer stall against
    the expected-max-of-r-normals model, per prompt spread."""
    plt = plots.pyplot()
    rows = result.get("rows") or []
    if plt is None or not rows:
        return []
    s = result.get("settings") or {}
    fig, ax = plt.subplots(figsize=(7.5, 5.0), layout="constrained")
    for spread in dict.fromkeys(r["spread"] for r in rows):
        sel = [r for r in rows if r["spread"] == spread]
        g = [r["groups"] for r in sel]
        line, = ax.plot(g, [r["all_steps"]["stall_s"] * 1e3 for r in sel], "o-", label=f"measured, spread {spread}")
        ax.plot(g, [r["all_steps"]["model_stationary_stall_s"] * 1e3 for r in sel], "--", color=line.get_color(),
                label=f"model (stationary sigma), {spread}")
        ax.plot(g, [r["all_steps"]["model_per_step_stall_s"] * 1e3 for r in sel], ":", color=line.get_color())
        ax.plot(g, [r["all_steps"]["model_empirical_stall_s"] * 1e3 for r in sel], "x", color=line.get_color())
    ax.set_xlabel("DP groups (r)")
    ax.set_ylabel("barrier stall per MoE layer (ms, mean group)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    plots.plain_ticks(ax)
    tp = s.get("sync_tp", 1)
    plots.fit_title(fig, [
        "simulated baseline (synchronous DP+EP): per-layer barrier stall vs mu + sigma x E[max of r normals] "
        "(dashed: stationary sigma, dotted: within-step sigma, x: empirical tail)",
        f"{result.get('profile', '?')}, r DP groups x TP{tp} dies, EP over all; model {result.get('model', '?')}; "
        f"trace: Poisson arrivals, log-normal prompts of mean 4,096 tokens with log-space sigma = spread (and the "
        f"Mooncake trace), {s.get('per_group', '?')} requests per group; load {s.get('utilisation', '?')} of a rough "
        f"capacity; chunks and step budget {plots.plain_number(s['chunk']) if 'chunk' in s else '?'} tokens, no CP"])
    return plots.save(fig, path)


# ----------------------------------------------------------------------------- re-simulated points
def _deployment(b: dict, res: dict, config: dict):
    """The :class:`~asap_comm.sim.core.sweep.Deployment` of a headline winner from its ``describe()`` record (``b``);
    the lane's wait bound, which its label rounds, is the grid's multiple of the SLO nearest it."""
    import dataclasses
    import re as _re

    from ..core.simulate import Parallelism
    from ..core.sweep import Deployment
    from .grids import headline_config

    lane = (config.get("runtime") or {}).get("long_prompt_lane", True)
    if b["mode"] == "sync":
        cfg = dataclasses.replace(headline_config(chunk=b["chunk_len"], budget=b["token_budget"]), long_prompt_lane=lane)
        return Deployment("sync", cfg, Parallelism(sync_tp=b["sync_tp"], cp_threshold=b["cp_threshold"],
                                                   sync_overlap=b["sync_overlap"]), sync_ranks=b["sync_ranks"])
    cfg = headline_config(b["attention_ranks"], b["expert_ranks"], b["chunk_len"], b["token_budget"],
                          b["expert_token_budget"], b["expert_deadline_s"], b.get("lane_tokens"))
    cfg = dataclasses.replace(cfg, long_prompt_lane=lane)
    m = _re.search(r"lane wait ([0-9.e+-]+) s", b["label"])
    if m:
        slo = res["slo_s"]
        factors = [f for f in (config.get("grid") or {}).get("lane_wait_slo", []) if f]
        f = min(factors, key=lambda f: abs(f * slo - float(m.group(1)))) if factors else float(m.group(1)) / slo
        cfg = dataclasses.replace(cfg, lane_wait_s=f * slo)
    d = Deployment("async", cfg, Parallelism(attention_tp=b["attention_tp"]))
    if d.label != b["label"]:
        raise ValueError(f"the rebuilt deployment reads {d.label!r}, the JSON {b['label']!r}")
    return d


def rerun_headline(data: dict, res: dict) -> "tuple[dict, list]":
    """What a headline JSON lacks for its figures, simulated again: each winner at the best baseline's
    SLO-compliant load with its per-rank spans (the utilisation timeline) and, where the load sensitivity lacks
    the study's percentile, at each of its loads. First the winners' runs at that load must reproduce the JSON's
    TTFT p50/p90/p99 and attainment (to 1e-9): else nothing is re-run (the simulator or its inputs changed
    since) and the error says so. Returns (timelines, load_sensitivity rows with every percentile)."""
    from ..core.sweep import run_point
    from ..costmodel.costs import CostModel
    from ..costmodel.memory import with_weights
    from ..costmodel.routing import routed_cost
    from ..costmodel.shapes import ModelShapes
    from .grids import mooncake_trace

    config = data.get("config") or {}
    shapes = ModelShapes.load(config.get("model", "deepseek-v3"))
    cost = CostModel.load(res["profile"], shapes.name)
    cost = routed_cost(CostModel(with_weights(cost.profile, data.get("weights")), shapes),
                       (data.get("routing") or {}).get("spec", "balanced"))
    trace, desc = mooncake_trace(config["num_requests"])
    if desc != res["trace"]:
        raise ValueError(f"the trace reads {desc!r}, the JSON {res['trace']!r}")
    best = {m: _deployment(res["best"][m], res, config) for m in ("async", "sync")}
    base, slo = res["async"]["rate_req_s"], res["slo_s"]
    timelines = {}
    for m, d in best.items():
        s, r = run_point(m, trace, base, cost, shapes, d.cfg, slo, sync_ranks=d.sync_ranks, spans=True, par=d.par)
        _same_run(s, res[m], d, base)
        timelines[m] = r.spans
    rows = []
    for row in res.get("load_sensitivity") or []:
        row = {**row, "async": dict(row["async"]), "sync": dict(row["sync"])}
        for m, d in best.items():
            if "ttft_p99_s" not in row[m]:
                s, _ = run_point(m, trace, row["rate_req_s"], cost, shapes, d.cfg, slo, sync_ranks=d.sync_ranks,
                                 par=d.par)
                _same_run(s, row[m], d, row["rate_req_s"])  # what the JSON has of this run, reproduced
                row[m]["ttft_p99_s"] = s["ttft_p99_s"]
        rows.append(row)
    return timelines, rows


def _same_run(s: dict, want: dict, d, rate: float) -> None:
    for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "slo_attainment"):
        w = want.get(k)
        if w is not None and (s[k] is None or abs(s[k] - w) > 1e-9 * max(1.0, abs(w))):
            raise ValueError(f"{d.label} at {rate:.4g} req/s: {k} {s[k]!r} now, {w!r} in the JSON (the simulator "
                             "or its inputs changed since the study ran)")


# ----------------------------------------------------------------------------- replot
def replot(path: Path, rerun: bool = False) -> Made:
    """Redraw the figures of the result in ``path`` (a directory with ``summary.json`` or ``barrier.json``, or
    that file) beside it. ``rerun``: a headline's missing points simulated again (:func:`rerun_headline`; the
    JSON itself is not changed)."""
    path = Path(path)
    if path.is_dir():
        found = [path / n for n in ("summary.json", "barrier.json") if (path / n).is_file()]
        if not found:
            raise ValueError(f"replot {path}: no summary.json or barrier.json in it")
        path = found[0]
    out, data = path.parent, json.loads(path.read_text())
    if "profiles" in data:
        made, skipped = [], []
        for res in data["profiles"].values():
            timelines = None
            if rerun:
                timelines, rows = rerun_headline(data, res)
                res = {**res, "load_sensitivity": rows}
            m, s = headline_figures(out, res, data.get("config") or {}, timelines)
            made, skipped = made + m, skipped + s
        return made, skipped
    if "rows" in data and "paper" in data:
        return barrier_figure(out / "barrier.png", data), []
    if "runs" in data and "profile" in (data.get("config") or {}):
        return run_figures(out, data)
    if "runs" in data and "modes" in (data.get("config") or {}):
        return example_figures(out, data)
    raise ValueError(f"replot {path}: not a result of sim headline, sim run, sim barrier or examples/prefill.py "
                     f"(keys: {sorted(data)[:12]})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim replot",
                                description="Redraw a study's figures from its result JSON, beside it.")
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="a result directory (summary.json or barrier.json), or the file itself")
    p.add_argument("--rerun-points", action="store_true",
                   help="sim headline: simulate again what the JSON lacks (the winners' per-rank spans at the base "
                        "load; the load sensitivity at the study's percentile), after checking that the winners' "
                        "runs at the base load reproduce the JSON; a few runs per profile")
    args = p.parse_args(argv)
    rc = 0
    for d in args.dirs:
        try:
            made, skipped = replot(Path(d), rerun=args.rerun_points)
        except (ValueError, OSError, KeyError) as e:
            print(f"replot: {e}", file=sys.stderr)
            rc = 2
            continue
        print(f"{d}: wrote {', '.join(made) or 'nothing'}")
        for name, why in skipped:
            print(f"{d}: skipped {name}: {why}")
    return rc
