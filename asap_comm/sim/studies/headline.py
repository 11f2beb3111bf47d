"""``python -m asap_comm.sim headline``: the best ASAP deployment against the best synchronous one, same hardware.

The documented comparison (docs/design.md, "asap_comm.sim"; issue 6, best-vs-best part):

* **Hardware**: ``--devices`` (64) devices either way, on the ``ascend-910c-cm384``
  profile (one device = one 910C die on the UB network) and on ``h800-node``
  (8-GPU NVLink nodes, IB across).
* **Model**: ``deepseek-v3`` shapes (61 layers, 58 MoE, 256 routed experts, top 8).
* **Baseline, searched** (what production deployments run): ``devices / T`` DP
  groups of ``T`` devices with tensor parallelism (``--sync-tp``, 1, 2, 4, 8),
  EP over all devices, context parallelism for prompts above a threshold
  (``--cp-threshold``: none, 4k, 8k, 16k, 32k tokens; 4k and 8k since 2026-12-03 night: with them the
  64-die baseline's best at p99 rose by a third), chunk size (``--sync-chunk-len``:
  4k, 8k, 16k) with a step's token budget equal to it (SGLang's
  chunked-prefill size) or 16k (``--sync-token-budget``), all_to_alls hidden
  behind compute (``--sync-overlap``: DeepSeek's two-micro-batch overlap, an
  optimistic bound; ``off,on`` searches both). ``simulate.py``'s docstring
  has the models.
* **ASAP, searched** (as broadly as the baseline: ``search_breadth`` in the
  summary has both counts): ``E`` expert devices (``--expert-ranks``: 16, 32) and
  ``(devices - E) / T`` attention groups of ``T`` devices (``--attention-tp``:
  1, 2, 4, 8), chunk size (``--chunk-len``: 4k, 8k, 16k, the baseline's sizes; the chunk is the
  long-prompt lane's wavefront step, so 4k chunks shorten long prompts on many groups: at 384 dies, 44 x TP8
  + 32, a 126k prompt's unloaded TTFT is 3.5 s with 4k chunks and 5.9 s with 8k) with a micro-batch budget
  equal to it or ``--token-budget`` (16k), the expert ranks' batching deadline
  (``--expert-deadline-s``: 0.5, 2 ms) and row budget (``--expert-token-budget``:
  16384, 32768), the long-prompt lane's KV pool (``--lane-tokens``: default one longest prompt) and its wait
  bound (``--lane-wait-slo``, in multiples of each search's SLO: default none, wait for room; a prompt that waited
  that long runs on one group). Why at least 16 expert devices:
  the routed experts are 653 B parameters (58 layers x 256 x 3 x 7168 x 2048),
  653 GB in INT8/FP8, so with 64 GB of HBM per 910C die (80 GB per H800) at
  least 11 (9) expert devices are needed; 16 leaves room for buffers. The
  baseline spreads the experts over all its devices (10 GB each at 64).
* **Search**: every candidate's SLO-compliant throughput on the first
  ``--num-requests-search`` requests with a coarse load search (2 bisection
  steps), then the ``--confirm-top`` best of each mode again on the full
  ``--num-requests`` with 4 steps; the best confirmed of each mode is its
  headline (``study.search_best``). The ratio is best ASAP / best baseline.
* **Runtime settings**: prompts up to 131072 tokens (the Mooncake trace's max
  is 126k); the per-die reference's expert batches up to 32768 rows or 1 ms.
* **Load**: the first ``--num-requests`` requests of the public Mooncake
  conversation trace (``asap_comm/data/traces``; prompt p50 6.9k / p90 27k / max 126k
  tokens), arrivals rescaled to each tested rate. The file's timestamps come
  in 3-s steps (up to 28 requests share one), so the requests of a step are
  spread evenly over it (``study.spread_buckets``; the interarrival CV of the
  first 2000 falls from 2.8 to 0.4, the per-3-s counts keep theirs): taken as
  is, every load would have bursts of simultaneous arrivals that no
  deployment serves within a few seconds. If the file is absent, a synthetic
  Mooncake-like trace (Gamma arrivals CV 3, log-normal lengths with the same
  median and p90) stands in, and the summary says so.
* **SLO**: ``--slo SECONDS``, or by default ``F`` x the unloaded TTFT of the
  trace's p90 prompt on the fastest baseline configuration of the grid
  (``--slo-factors``, first ``F`` = 3: the runtime example's rule applied to
  the best latency the baseline's hardware offers). A deployment meets it
  when ``--slo-percentile`` (90) percent of requests do.
* **Sensitivity** (the SLO rule re-applied to each trace; on the clipped and
  skewed traces, ``--num-requests-sensitivity`` requests, the best of each
  mode's finalists: its winner and the best configuration of the coarse
  search for each other TP degree): the SLO (the search re-run at other
  multiples, ``--slo-factors``); the per-die comparison (ASAP ``devices - 16`` + 16 against ``devices``
  DP+EP ranks of one device, no TP, no CP, 16k chunks: the headline before
  the best-vs-best search), also under its own SLO rule (3x that baseline's
  unloaded p90 TTFT); the long-prompt tail (the same requests with prompts
  clipped at 32k and 8k); length skew (synthetic log-normal lengths of equal
  mean, sigma 0 = all prompts equal, to 1.5); the ASAP split (the best of the
  coarse search for each expert count); load (both winners at fractions of
  the baseline's SLO-compliant rate).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ...serving.metrics import throughput_ratio
from ...serving.slo import SLO_MULTIPLIER, auto_slo
from ...serving.traces import Request
from ..core.simulate import simulate
from ..core.sweep import (Deployment, capacity_rate, mean_len, parse_slo, percentile_target, run_point,
                          search_best, sweep_deployment)
from ..costmodel.costs import CostModel
from ..costmodel.memory import WEIGHT_DTYPES, deployment_problems, headline_memory
from ..costmodel.routing import parse_routing_arg, routed_cost, routing_arg
from ..costmodel.shapes import ModelShapes
from .figures import headline_figures

from .grids import (LANE, async_grid, headline_config, mooncake_trace, per_die, rebind_lane_wait,  # noqa: F401
                    search_breadth, skew_trace, sync_grid, with_lane_chunks, with_lane_wait)


def unloaded_ttft(d: Deployment, prompt: int, cost, shapes) -> float:
    res = simulate(d.mode, [Request(0, 0.0, prompt)], cost, shapes, d.cfg, sync_ranks=d.sync_ranks, par=d.par)
    t = res.records[0].ttft_s
    if t is None:
        raise ValueError(f"headline: the p90 prompt ({prompt} tokens) failed on {d.label}: {res.records[0].error}")
    return t


def slo_rule(trace, candidates, cost, shapes, factor: float = SLO_MULTIPLIER) -> tuple:
    """(SLO seconds, the candidate that set it): ``factor`` x the fastest unloaded TTFT of the p90 prompt
    (``serving.slo.auto_slo``, measured on the fastest of ``candidates``)."""
    times = {}

    def fastest(p90: int) -> float:
        times.update({i: unloaded_ttft(d, p90, cost, shapes) for i, d in enumerate(candidates)})
        return min(times.values())

    rule = auto_slo([r.prompt_len for r in trace], fastest, multiplier=factor,
                    max_prompt_len=min(d.cfg.max_prompt_len for d in candidates))
    return rule.ttft_s, candidates[min(times, key=lambda i: (times[i], i))]


def _sct(sweep) -> "float | None":
    return None if sweep is None else sweep["slo_compliant_throughput"]


def _ratio(a, b) -> "float | None":
    return a / b if a and b else None


def _withheld(a_sweep, s_sweep, target: float) -> "tuple[float | None, str | None]":
    """(ratio, why it is withheld) of two sweeps (``serving.throughput_ratio``: None where a mode sustains no
    tested load within the SLO)."""
    return throughput_ratio(_sct(a_sweep), _sct(s_sweep), target=target,
                            points=((a_sweep or {}).get("points"), (s_sweep or {}).get("points")))


def _pair(a: Deployment, s: Deployment, trace, cost, shapes, slo: float, start: float, bisections: int,
          target: float, progress: str) -> dict:
    """Both deployments swept on one trace under one SLO."""
    out = {"slo_s": slo, "mean_prompt_tokens": mean_len(trace)}
    for d in (a, s):
        out[d.mode] = sweep_deployment(d, trace, cost, shapes, slo, start_rate=start, bisections=bisections,
                                       target=target, progress=progress)
    out["ratio"], out["ratio_withheld"] = _withheld(out["async"], out["sync"], target)
    return out


# ----------------------------------------------------------------------------- one profile
def best_vs_best(syncs, asyncs, probe, trace, cost, shapes, slo: float, *, start: float, target: float,
                 confirm_top: int, bisections: int, progress: str) -> dict:
    """:func:`~asap_comm.sim.core.sweep.search_best` for each mode under one SLO; the winners and their ratio."""
    found = {}
    for mode, cands in (("sync", syncs), ("async", asyncs)):
        found[mode] = search_best(cands, probe, cost, shapes, slo, start_rate=start, bisections=2, target=target,
                                  confirm_trace=trace, confirm_top=confirm_top, confirm_bisections=bisections,
                                  progress=f"{progress} search {mode}")
    out = {"found": found, "slo_s": slo}
    for mode in ("async", "sync"):
        out[mode] = found[mode]["best"]
        out[f"{mode}_sct"] = _sct(found[mode]["best_sweep"])
    out["ratio"], out["ratio_withheld"] = _withheld(found["async"]["best_sweep"], found["sync"]["best_sweep"],
                                                    target)
    print(f"[{progress}] SLO {slo:.3g} s: best baseline {out['sync'].label} ({out['sync_sct'] or 0:.0f} tok/s), best "
          f"ASAP {out['async'].label} ({out['async_sct'] or 0:.0f} tok/s), ratio {_fmt(out['ratio'])}"
          + (f" ({out['ratio_withheld']})" if out["ratio_withheld"] else ""), file=sys.stderr, flush=True)
    return out


def study(profile: str, model: str, n: int, n_search: int, n_side: int, grid: dict, out: Path, sigmas, loads,
          caps, quick: bool, slo_s: "float | None", target: float, confirm_top: int, slo_factors,
          weights: "str | None" = None, ignore_memory: bool = False, routing=None) -> dict:
    cost, shapes = CostModel.load(profile, model), ModelShapes.load(model)
    trace, trace_desc = mooncake_trace(n)
    probe = trace[:n_search]
    tag = cost.name
    D = grid["devices"]
    syncs = sync_grid(D, grid["sync_tp"], grid["cp"], grid["sync_chunk"], shapes.heads, grid["overlap"],
                      grid["sync_budget"])
    asyncs = async_grid(D, grid["experts"], grid["attention_tp"], grid["chunk"], shapes.heads, grid["budget"],
                        grid["expert_deadline"], grid["expert_budget"], grid.get("lane_tokens", [None]))
    if not syncs or not asyncs:
        raise ValueError(f"headline: the grid has no {'baseline' if not syncs else 'ASAP'} configuration for "
                         f"{D} devices")
    # memory (asap_comm.sim.costmodel.memory): only deployments whose dies hold them, unless --ignore-memory
    cost, syncs, asyncs, memory = headline_memory(cost, shapes, syncs, asyncs, weights, ignore_memory)
    waits = grid.get("lane_wait_slo", [None])  # the lane's wait bounds, in SLOs: bound to each search's SLO
    if routing is not None:  # --routing: every simulated run charges it (routing.py; after --weights)
        cost = routed_cost(cost, routing)
    ref_a, ref_s = per_die(D)
    bis = 2 if quick else 4
    slo_given = slo_s is not None
    unloaded, slo_by = slo_rule(trace, syncs, cost, shapes, factor=1.0)
    if slo_given:
        rule, factors = "given (--slo)", []
    else:
        f0, factors = slo_factors[0], list(slo_factors[1:])
        slo_s = f0 * unloaded
        rule = (f"{f0:g}x the unloaded TTFT of the trace's p90 prompt ({unloaded:.3g} s) on the fastest baseline "
                f"of the grid ({slo_by.label})")
    async_cands = with_lane_chunks(with_lane_wait(asyncs, slo_s, waits), grid.get("lane_chunks", ["tokens"]))
    print(f"[{tag}] {trace_desc}; {D} devices; search breadth: {len(syncs)} baseline and {len(async_cands)} ASAP "
          "configurations; "
          f"SLO {slo_s:.3g} s ({rule}), {100 * target:g}% of requests", file=sys.stderr, flush=True)
    start = 0.25 * capacity_rate(probe, cost, shapes, ref_s.cfg, sync_ranks=ref_s.sync_ranks)
    main = best_vs_best(syncs, async_cands, probe, trace, cost, shapes, slo_s, start=start, target=target,
                        confirm_top=confirm_top, bisections=bis, progress=tag)
    found, best_a, best_s, ratio = main["found"], main["async"], main["sync"], main["ratio"]
    res = {"profile": tag, "cost_model": cost.describe(), "trace": trace_desc, "devices": D, "slo_s": slo_s,
           "slo_rule": rule, "slo_percentile": 100 * target, "unloaded_p90_ttft_s": unloaded,
           "async": None, "sync": None, "slo_compliant_throughput_ratio": ratio,
           "ratio_withheld": main["ratio_withheld"], "runs": [],
           "best": {**{m: {**found[m]["best"].describe(), "slo_compliant_throughput": main[f"{m}_sct"],
                           "served_fraction": found[m]["served_fraction"], "withheld": found[m]["withheld"]}
                       for m in ("async", "sync")}, "ratio": ratio, "ratio_withheld": main["ratio_withheld"]},
           "search": {mode: [{**row["deployment"].describe(), "coarse_slo_compliant_throughput": _sct(row["coarse"]),
                              "confirmed_slo_compliant_throughput": _sct(row["confirmed"])}
                             for row in found[mode]["candidates"]] for mode in ("async", "sync")},
           "search_requests": {"coarse": len(probe), "confirm": len(trace), "confirm_top": confirm_top},
           "search_breadth": search_breadth(syncs, async_cands, grid),
           "sweep": {m: {k: found[m]["best_sweep"][k] for k in ("slo_compliant_rate_req_s", "saturated",
                                                                 "arrival_span_over_slo")}
                     for m in ("async", "sync")}, "memory": memory}
    # the SLO: best-vs-best searched again at other multiples of the same unloaded TTFT
    res["slo_sensitivity"] = [{"slo_factor": slo_factors[0] if not slo_given else None, "slo_s": slo_s,
                               "async_label": best_a.label, "sync_label": best_s.label, "async": main["async_sct"],
                               "sync": main["sync_sct"], "ratio": ratio, "ratio_withheld": main["ratio_withheld"],
                               "saturated": {k: found[k]["best_sweep"]["saturated"] for k in ("async", "sync")}}]
    for f in factors:
        m = best_vs_best(syncs, with_lane_chunks(with_lane_wait(asyncs, f * unloaded, waits),
                                                 grid.get("lane_chunks", ["tokens"])), probe, trace, cost, shapes,
                         f * unloaded,
                         start=start, target=target,
                         confirm_top=1, bisections=bis, progress=f"{tag} SLO x{f:g}")
        res["slo_sensitivity"].append({"slo_factor": f, "slo_s": f * unloaded, "async_label": m["async"].label,
                                       "sync_label": m["sync"].label, "async": m["async_sct"],
                                       "sync": m["sync_sct"], "ratio": m["ratio"],
                                       "ratio_withheld": m["ratio_withheld"],
                                       "saturated": {k: m["found"][k]["best_sweep"]["saturated"]
                                                     for k in ("async", "sync")},
                                       "arrival_span_over_slo": {k: m["found"][k]["best_sweep"]["arrival_span_over_slo"]
                                                                 for k in ("async", "sync")}})
    # the ASAP split: the best coarse configuration of each expert count, against the best baseline's coarse figure
    coarse_s = _sct(found["sync"]["candidates"][found["sync"]["ranking"][0]]["coarse"])
    res["split_sensitivity"] = []
    for e in grid["experts"]:
        rows = [r for r in found["async"]["candidates"] if r["deployment"].cfg.num_expert_ranks == e]
        if not rows:
            continue
        r = max(rows, key=lambda r: _sct(r["coarse"]) or -1.0)
        d = r["deployment"]
        res["split_sensitivity"].append({"attention_ranks": d.cfg.num_attention_ranks,
                                         "attention_tp": d.par.attention_tp, "expert_ranks": e,
                                         "label": d.label, "async": _sct(r["coarse"]),
                                         "ratio": _ratio(_sct(r["coarse"]), coarse_s),
                                         "note": f"coarse search ({len(probe)} requests)"})
    # the per-die comparison (the headline before this search), under this SLO and under its own rule
    res["per_die"] = []
    per_die_slos = [("headline SLO", slo_s)]
    if not quick:
        per_die_slos.append((f"its own SLO rule ({SLO_MULTIPLIER:g}x the per-die baseline's unloaded p90 TTFT)",
                             slo_rule(trace, [ref_s], cost, shapes)[0]))
    per_die_problems = [x for d in (ref_a, ref_s) for x in deployment_problems(d, cost.profile, shapes)]
    if per_die_problems and not ignore_memory:  # the per-die reference does not fit: left out, said why
        res["per_die_infeasible"], per_die_slos = per_die_problems, []
    for what, slo in per_die_slos:
        c = _pair(ref_a, ref_s, trace, cost, shapes, slo, start, bis, target, f"{tag} per-die")
        res["per_die"].append({"slo": what, "slo_s": slo, "async_label": ref_a.label, "sync_label": ref_s.label,
                               "async": _sct(c["async"]), "sync": _sct(c["sync"]), "ratio": c["ratio"],
                               "ratio_withheld": c["ratio_withheld"],
                               "arrival_span_over_slo": {k: c[k]["arrival_span_over_slo"] for k in ("async", "sync")},
                               "saturated": {k: c[k]["saturated"] for k in ("async", "sync")}})
        print(f"[{tag}] per-die ({what}, {slo:.3g} s): ratio {_fmt(c['ratio'])}", file=sys.stderr, flush=True)
    base_rate = (found["sync"]["best_sweep"]["slo_compliant_rate_req_s"]
                 or found["sync"]["best_sweep"]["points"][0]["rate_req_s"])
    timelines = {}
    for d in (best_a, best_s):
        s, r = run_point(d.mode, trace, base_rate, cost, shapes, d.cfg, slo_s, sync_ranks=d.sync_ranks, spans=True,
                         par=d.par)
        timelines[d.mode] = r.spans
        res[d.mode] = {k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s",
                                         "slo_attainment", "num_requests", "num_failed")}
        res[d.mode].update(rate_req_s=base_rate, slo_compliant_throughput=_sct(found[d.mode]["best_sweep"]),
                           at_slo_compliant_load=found[d.mode]["best_sweep"]["at_slo_compliant_load"],
                           deployment=d.label, ranks=r.ranks,
                           idle_s_total=sum(x["idle_s"] * x["stands_for"] for x in r.ranks),
                           mean_utilisation=s["mean_utilisation"])
        res["runs"] += [{"mode": d.mode, **p} for p in found[d.mode]["best_sweep"]["points"]]
    # sensitivity to load: both winners at fractions of the best baseline's SLO-compliant rate
    res["load_sensitivity"] = []
    for f in loads:
        row = {"load_fraction_of_baseline_slo_rate": f, "rate_req_s": f * base_rate}
        for d in (best_a, best_s):
            s, _ = run_point(d.mode, trace, f * base_rate, cost, shapes, d.cfg, slo_s, sync_ranks=d.sync_ranks,
                             par=d.par)
            row[d.mode] = {"ttft_p99_s": s["ttft_p99_s"], "ttft_p90_s": s["ttft_p90_s"],
                           "ttft_p50_s": s["ttft_p50_s"], "slo_attainment": s["slo_attainment"]}
        a, b = row["async"]["ttft_p90_s"], row["sync"]["ttft_p90_s"]
        row["ttft_p90_ratio_sync_over_async"] = b / a if a and b else None
        res["load_sensitivity"].append(row)
        print(f"[{tag}] load {f:.2f}x: TTFT p90 async {a:.3g} s, sync {b:.3g} s", file=sys.stderr, flush=True)

    # the finalists, re-ranked on each side trace: the winner and, for each TP degree, the best of the coarse search
    finalists = {}
    for m, best in (("async", best_a), ("sync", best_s)):
        finalists[m] = [best]
        for i in found[m]["ranking"]:
            d = found[m]["candidates"][i]["deployment"]
            tp = d.par.attention_tp if m == "async" else d.par.sync_tp
            if all(tp != (f.par.attention_tp if m == "async" else f.par.sync_tp) for f in finalists[m]):
                finalists[m].append(d)
    res["finalists"] = {m: [d.label for d in finalists[m]] for m in finalists}

    def side(t, label: str) -> dict:
        slo = slo_s if slo_given else slo_factors[0] * slo_rule(t, syncs, cost, shapes, factor=1.0)[0]
        st = 0.25 * capacity_rate(t, cost, shapes, ref_s.cfg, sync_ranks=ref_s.sync_ranks)
        row, sweeps = {"mean_prompt_tokens": mean_len(t), "slo_s": slo}, {}
        for m in ("async", "sync"):  # a lane wait bound is so many SLOs: re-scaled to this trace's
            cands = [rebind_lane_wait(d, slo_s, slo) for d in finalists[m]]
            f = search_best(cands, t, cost, shapes, slo, start_rate=st, bisections=2, target=target,
                            confirm_top=1, confirm_bisections=bis)
            row[m], row[f"{m}_label"] = _sct(f["best_sweep"]), f["best"].label
            row[f"{m}_saturated"] = f["best_sweep"]["saturated"]
            sweeps[m] = f["best_sweep"]
        row["ratio"], row["ratio_withheld"] = _withheld(sweeps["async"], sweeps["sync"], target)
        return row

    # sensitivity to the long-prompt tail: the same trace with prompts clipped at a cap
    res["cap_sensitivity"] = []
    for cap in caps:
        clipped = [Request(r.request_id, r.arrival_s, min(r.prompt_len, cap), r.output_len) for r in trace[:n_side]]
        row = {"max_prompt_tokens": cap, **side(clipped, f"cap {cap}")}
        res["cap_sensitivity"].append(row)
        print(f"[{tag}] prompts clipped at {cap}: ratio {_fmt(row['ratio'])}", file=sys.stderr, flush=True)
    # sensitivity to length skew: equal mean length, more and more spread
    res["skew_sensitivity"] = []
    mean = mean_len(trace)
    for sigma in sigmas:
        row = {"sigma": sigma, **side(skew_trace(n_side, sigma, mean), f"sigma {sigma}")}
        res["skew_sensitivity"].append(row)
        print(f"[{tag}] length sigma {sigma}: ratio {_fmt(row['ratio'])}", file=sys.stderr, flush=True)
    # the figures (sim.figures; `python -m asap_comm.sim replot DIR` redraws all but the timelines from the JSON)
    made, _ = headline_figures(out, res, {"model": shapes.name, "num_requests_sensitivity": n_side}, timelines)
    res["plots"] = made
    return res


# ----------------------------------------------------------------------------- command line
def _ints(p: argparse.ArgumentParser, flag: str, value: str, *, none_ok: bool = False) -> list:
    out = []
    for x in value.split(","):
        x = x.strip()
        if not x:
            continue
        if none_ok and x.lower() == "none":
            out.append(None)
            continue
        try:
            v = int(x)
        except ValueError:
            v = 0
        if v < 1:
            p.error(f"{flag} {value!r}: expected comma-separated ints >= 1{' or none' if none_ok else ''}")
        out.append(v)
    if not out:
        p.error(f"{flag} {value!r}: expected at least one value")
    return out


def _floats(p: argparse.ArgumentParser, flag: str, value: str, *, none_ok: bool = False) -> list:
    try:
        out = [None if none_ok and x.strip().lower() == "none" else float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or not all(v is None or (v >= 0 and math.isfinite(v)) for v in out):
        p.error(f"{flag} {value!r}: expected comma-separated numbers >= 0{' or none' if none_ok else ''}")
    return out


def _onoff(p: argparse.ArgumentParser, value: str) -> list:
    out = []
    for x in value.split(","):
        x = x.strip().lower()
        if x in ("on", "off"):
            out.append(x == "on")
        elif x:
            p.error(f"--sync-overlap {value!r}: expected off, on or off,on")
    if not out:
        p.error(f"--sync-overlap {value!r}: expected off, on or off,on")
    return out


def _lane_chunks(p, text: str) -> list:
    """``--lane-chunks``: comma-separated ``tokens`` / ``cost``, each once."""
    got = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in got if x not in ("tokens", "cost")]
    if not got or bad:
        p.error(f"--lane-chunks {text!r}: give tokens, cost or both (comma-separated)")
    return got


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim headline", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=2000,
                   help="requests of the main comparison (the confirmation of the search's best)")
    p.add_argument("--num-requests-search", type=int, default=400,
                   help="requests of the coarse search over the grid (the first ones of the same trace)")
    p.add_argument("--num-requests-sensitivity", type=int, default=600,
                   help="requests of each clipped and skewed trace (0: leave those sensitivities out, e.g. at "
                        "hundreds of devices, where each needs thousands of requests to be a sustained load)")
    p.add_argument("--confirm-top", type=int, default=2,
                   help="the best configurations of each mode confirmed on the full --num-requests")
    p.add_argument("--devices", type=int, default=64, help="devices of either deployment (same hardware)")
    p.add_argument("--expert-ranks", default="16,32", metavar="E[,E...]",
                   help="ASAP expert devices searched (the expert weights need >= 11 910C dies / 9 H800s)")
    p.add_argument("--attention-tp", default="1,2,4,8", metavar="T[,T...]",
                   help="ASAP: devices per attention group (tensor parallelism) searched; "
                        "(devices - E) / T attention groups")
    p.add_argument("--sync-tp", default="1,2,4,8", metavar="T[,T...]",
                   help="baseline: devices per DP group (tensor parallelism) searched; devices / T groups")
    p.add_argument("--cp-threshold", default="none,4096,8192,16384,32768", metavar="TOKENS[,TOKENS...]",
                   help="baseline: context-parallelism thresholds searched (none: no CP)")
    p.add_argument("--chunk-len", default="4096,8192,16384", metavar="TOKENS[,TOKENS...]",
                   help="ASAP: chunk sizes searched (the baseline's; micro-batch budget 16384 tokens); the chunk is "
                        "the long-prompt lane's wavefront step")
    p.add_argument("--token-budget", default="16384", metavar="TOKENS[,TOKENS...]",
                   help="ASAP: micro-batch token budgets searched, with each chunk size (a budget smaller than the "
                        "chunk is skipped; the chunk size itself is always tried)")
    p.add_argument("--expert-deadline-s", default="0.0005,0.002", metavar="SECONDS[,SECONDS...]",
                   help="ASAP: expert ranks' batching deadlines searched, seconds")
    p.add_argument("--expert-token-budget", default="16384,32768", metavar="ROWS[,ROWS...]",
                   help="ASAP: expert ranks' batch row budgets searched")
    p.add_argument("--lane-tokens", default="none", metavar="TOKENS[,TOKENS...]",
                   help="ASAP: the long-prompt lane's KV pools searched (prompt tokens the lanes in flight hold "
                        "together, charged to every attention die; none: the longest prompt, 131072)")
    p.add_argument("--lane-wait-slo", default="none", metavar="SLOS[,SLOS...]",
                   help="ASAP: the lane's wait bounds searched, in multiples of the SLO (a long prompt that waited "
                        "that long for room in the lane runs on one attention group; none: it waits for room; each is "
                        "RuntimeConfig.lane_wait_s = SLOS x the search's SLO in seconds)")
    p.add_argument("--lane-chunks", default="tokens", metavar="tokens|cost[,...]",
                   help="ASAP: how a lane prompt is split, searched: tokens (equal lengths, the runtime's default), "
                        "cost (equal attention cost, RuntimeConfig.lane_chunks), or both")
    p.add_argument("--sync-chunk-len", default="4096,8192,16384", metavar="TOKENS[,TOKENS...]",
                   help="baseline: chunk sizes searched")
    p.add_argument("--sync-token-budget", default="16384", metavar="TOKENS[,TOKENS...]",
                   help="baseline: token budgets of a step searched, with each chunk size (a budget smaller than "
                        "the chunk is skipped; the chunk size itself is always tried)")
    p.add_argument("--sync-overlap", default="on", metavar="off|on[,...]",
                   help="baseline: all_to_alls hidden behind compute (on), not (off), or both searched (off,on); "
                        "on is never slower in this model")
    p.add_argument("--slo", default="auto", metavar="SECONDS",
                   help="TTFT SLO in seconds, or auto: 3x the unloaded TTFT of the trace's p90 prompt on the "
                        "fastest baseline configuration of the grid")
    p.add_argument("--slo-percentile", type=float, default=90.0, metavar="P",
                   help="SLO attainment target: at least P%% of requests must meet the SLO")
    p.add_argument("--slo-factors", default="3,10", metavar="F[,F...]",
                   help="with --slo auto: the SLO is F x the fastest baseline's unloaded TTFT of the p90 prompt; the "
                        "first F is the headline, the others re-run the search (SLO sensitivity)")
    p.add_argument("--profiles", default="ascend-910c-cm384,h800-node")
    routing_arg(p)
    p.add_argument("--quick", action="store_true",
                   help="a small smoke run (8 devices, a small grid, few requests, two skews, two loads; memory not "
                        "checked: 8 devices cannot hold deepseek-v3)")
    p.add_argument("--weights", choices=WEIGHT_DTYPES, default=None,
                   help="weight dtype, overriding each profile's (int8: W8A8; default: the profile's)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="keep configurations whose dies cannot hold them (sensitivity studies; recorded)")
    p.add_argument("--no-long-prompt-lane", action="store_true",
                   help="ASAP without its long-prompt lane (ablation; asap_comm/sim/core/lane.py)")
    args = p.parse_args(argv)
    LANE["long_prompt_lane"] = not args.no_long_prompt_lane
    routing = parse_routing_arg(p, args.routing)
    try:
        target = percentile_target(args.slo_percentile)
    except ValueError as e:
        p.error(f"--slo-percentile: {e}")
    try:
        slo_s = parse_slo(args.slo)
    except ValueError as e:
        p.error(f"--slo: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = {"devices": args.devices, "experts": _ints(p, "--expert-ranks", args.expert_ranks),
            "attention_tp": _ints(p, "--attention-tp", args.attention_tp),
            "sync_tp": _ints(p, "--sync-tp", args.sync_tp),
            "cp": _ints(p, "--cp-threshold", args.cp_threshold, none_ok=True),
            "chunk": _ints(p, "--chunk-len", args.chunk_len), "budget": _ints(p, "--token-budget", args.token_budget),
            "expert_deadline": _floats(p, "--expert-deadline-s", args.expert_deadline_s),
            "expert_budget": _ints(p, "--expert-token-budget", args.expert_token_budget),
            "lane_tokens": _ints(p, "--lane-tokens", args.lane_tokens, none_ok=True),
            "lane_wait_slo": list(dict.fromkeys(_floats(p, "--lane-wait-slo", args.lane_wait_slo, none_ok=True))),
            "lane_chunks": _lane_chunks(p, args.lane_chunks),
            "sync_chunk": _ints(p, "--sync-chunk-len", args.sync_chunk_len),
            "sync_budget": _ints(p, "--sync-token-budget", args.sync_token_budget),
            "overlap": _onoff(p, args.sync_overlap)}
    n, n_search, n_side = args.num_requests, min(args.num_requests_search, args.num_requests), \
        args.num_requests_sensitivity
    sigmas = (0.0, 0.5, 1.0, 1.5)
    loads = (0.25, 0.5, 0.75, 1.0, 1.25)
    caps = (32768, 8192)
    if n_side < 0 or n < 1 or n_search < 1:
        p.error(f"--num-requests {n} and --num-requests-search {args.num_requests_search} must be >= 1 and "
                f"--num-requests-sensitivity {n_side} >= 0")
    if args.quick:  # a smaller deployment, so that a few hundred requests still make a sustained load
        n, n_search, n_side = 200, 120, 120 if n_side else 0
        sigmas, loads, caps = (0.0, 1.0), (0.5, 1.0), (8192,)
        grid = {"devices": 8, "experts": [2, 4], "attention_tp": [1, 2], "sync_tp": [1, 2], "cp": [None, 16384],
                "chunk": [16384], "sync_chunk": [16384], "sync_budget": [16384], "overlap": [False],
                "budget": [16384], "expert_deadline": [0.001], "expert_budget": [32768], "lane_tokens": [None],
                "lane_wait_slo": grid["lane_wait_slo"], "lane_chunks": grid["lane_chunks"]}
    if n_side == 0:  # the clipped and skewed traces left out (recorded: num_requests_sensitivity 0)
        sigmas, caps = (), ()
    try:
        factors = [float(x) for x in args.slo_factors.split(",") if x.strip()]
        assert factors and all(f > 0 and math.isfinite(f) for f in factors)
    except (ValueError, AssertionError):
        p.error(f"--slo-factors {args.slo_factors!r}: expected comma-separated positive numbers")
    if args.quick:
        factors = factors[:1]
        if not args.ignore_memory:  # 8 devices cannot hold DeepSeek-V3 (asap_comm.sim.costmodel.memory): a smoke run only
            print("headline --quick: 8 devices cannot hold deepseek-v3's experts; memory is not checked in this "
                  "smoke run (ignore_memory recorded)", file=sys.stderr, flush=True)
            args.ignore_memory = True
    if args.devices < 2 or args.confirm_top < 1:
        p.error("--devices must be >= 2 and --confirm-top >= 1")
    t0 = time.perf_counter()
    summary = {"config": {"model": "deepseek-v3", "runtime": headline_config().__dict__, "grid": grid,
                          "num_requests": n, "num_requests_search": n_search, "num_requests_sensitivity": n_side,
                          "slo_percentile": args.slo_percentile, "slo": args.slo}, "profiles": {},
               "ignore_memory": args.ignore_memory, "weights": args.weights, "routing": routing.describe()}
    for prof in [x for x in args.profiles.split(",") if x]:
        summary["profiles"][prof] = study(prof, "deepseek-v3", n, n_search, n_side, grid, out, sigmas, loads, caps,
                                          args.quick, slo_s, target, args.confirm_top, factors,
                                          weights=args.weights, ignore_memory=args.ignore_memory, routing=routing)
    first = summary["profiles"][next(iter(summary["profiles"]))]
    for mode in ("async", "sync"):  # the runtime's summary.json keys, for the first (headline) profile
        summary[mode] = first[mode]
    summary["slo_compliant_throughput_ratio"] = first["slo_compliant_throughput_ratio"]
    summary["ratio_withheld"] = first["ratio_withheld"]
    summary["wall_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nbest ASAP vs best synchronous DP+EP on {grid['devices']} devices, deepseek-v3, SLO-compliant throughput "
          f"(prompt tokens/s; {args.slo_percentile:g}% of requests within the SLO; >= : even the highest load tested "
          "passed)")
    for prof, r in summary["profiles"].items():
        b, sat = r["best"], r["slo_sensitivity"][0]["saturated"]
        print(f"\n{prof}: SLO {r['slo_s']:.3g} s ({r['slo_rule']}); search breadth: "
              f"{r['search_breadth']['sync']} baseline, {r['search_breadth']['async']} ASAP configurations")
        for mode, name in (("sync", "best baseline"), ("async", "best ASAP")):
            at = (r.get(mode) or {}).get("at_slo_compliant_load")
            served = "" if at is None else (f"  (served {at['served_tokens_per_s']:,.0f} tok/s there, "
                                            f"{at['served_fraction']:.0%} of offered, p99 {at['ttft_p99_s']:.3g} s)")
            print(f"  {name:14s} {b[mode]['label']:50s} {_tok(b[mode]['slo_compliant_throughput'], sat[mode])}"
                  + served)
        print(f"  ratio          {_fmt(b['ratio'], sat)}" + (f" ({b['ratio_withheld']})" if b.get("ratio_withheld")
                                                               else ""))
        print("  sensitivity:")
        for x in r["slo_sensitivity"][1:]:
            print(f"    SLO {x['slo_factor']:g}x unloaded ({x['slo_s']:.3g} s): best ASAP {x['async_label']} "
                  f"{_tok(x['async'], x['saturated']['async'])}, best baseline {x['sync_label']} "
                  f"{_tok(x['sync'], x['saturated']['sync'])}, ratio {_fmt(x['ratio'], x['saturated'])}")
        for x in r["per_die"]:
            print(f"    per-die, {x['slo']} ({x['slo_s']:.3g} s): ASAP {_tok(x['async'], x['saturated']['async'])}, "
                  f"baseline {_tok(x['sync'], x['saturated']['sync'])}, ratio {_fmt(x['ratio'], x['saturated'])}")
        for x in r["cap_sensitivity"]:
            print(f"    prompts clipped at {x['max_prompt_tokens']} (SLO {x['slo_s']:.3g} s): ASAP {x['async_label']} "
                  f"{_tok(x['async'], x['async_saturated'])}, baseline {x['sync_label']} "
                  f"{_tok(x['sync'], x['sync_saturated'])}, "
                  f"ratio {_fmt(x['ratio'], {'async': x['async_saturated'], 'sync': x['sync_saturated']})}")
        if r["skew_sensitivity"]:
            print("    length skew (sigma: ratio): " + ", ".join(f"{x['sigma']:g}: {_fmt(x['ratio'])}"
                                                             for x in r["skew_sensitivity"]))
        for x in r["split_sensitivity"]:
            print(f"    ASAP split, {x['label']}: {_tok(x['async'], True)}, ratio {_fmt(x['ratio'])} ({x['note']})")
    print(f"artifacts in {out}/ ({summary['wall_s']:.0f} s)")
    return 0


def _fmt(r, saturated: "dict | None" = None) -> str:
    """A ratio; with the two sweeps' ``saturated`` flags, '>=' / '<=' / '~' where one or both are lower bounds."""
    if r is None:
        return "-"
    a, s = (True, True) if saturated is None else (saturated["async"], saturated["sync"])
    return f"{'' if a and s else '>= ' if s else '<= ' if a else '~ '}{r:.2f}x"


def _tok(v, saturated: bool) -> str:
    """A throughput for the table: '-' when the SLO fails at every load, '>= v' when no tested load failed."""
    if v is None:
        return "- tok/s"
    return f"{'' if saturated else '>= '}{v:,.0f} tok/s"
