"""``python -m asap_comm.sim headline``: ASAP against synchronous DP+EP at CloudMatrix384 scale.

The documented comparison (DESIGN.md, "asap_comm.sim"; issue 6):

* **Hardware**: the ``ascend-910c-cm384`` profile (one rank = one 910C die on the
  UB network), and the same study on ``h800-node`` (8-GPU NVLink nodes, IB across).
* **Model**: ``deepseek-v3`` shapes (61 layers, 58 MoE, 256 routed experts, top 8).
* **Deployment**: 64 ranks either way. Baseline: 64 DP+EP ranks (DP attention,
  4 experts each). ASAP: 48 attention + 16 expert ranks (``--splits``; the
  first split is the headline). Why 48 + 16: the routed experts are 653 B
  parameters (58 layers x 256 x 3 x 7168 x 2048), 653 GB in INT8/FP8, so
  with 64 GB of HBM per 910C die (80 GB per H800) at least 11 (9) expert
  ranks are needed; 16 leaves room for buffers, and the remaining 48 ranks
  do attention, which dominates prefill of long prompts (at 32 + 32 the
  expert ranks sit mostly idle). The split 32 + 32 is reported too (the
  issue's example), as an ASAP-only sweep against the same baseline. Equal
  hardware is the fair comparison. The baseline runs the same policies
  (load-aware placement, long-prompt chunking, token budget).
* **Runtime settings**: micro-batches of up to 16384 tokens, prompts split into
  16384-token chunks, prompts up to 131072 tokens (the Mooncake trace's max is
  126k), expert batches up to 32768 rows or 1 ms.
* **Load**: the first ``--num-requests`` requests of the public Mooncake
  conversation trace (``shared/traces``; arrivals CV 3.0, prompt p50 6.9k / p90
  27k / max 126k tokens), arrivals rescaled to each tested rate. If the file is
  absent, a synthetic Mooncake-like trace (Gamma arrivals CV 3, log-normal
  lengths with the same median and p90) stands in, and the summary says so.
* **SLO**: 3x the unloaded TTFT of the trace's p90 prompt on the baseline
  (the runtime example's rule). SLO-compliant throughput: see ``study``.
* **Sensitivity**: the ratio against length skew (synthetic log-normal lengths
  of equal mean, sigma 0 = all prompts equal, to 1.5), against the long-prompt
  tail (the same Mooncake requests with prompts clipped at 32k and 8k tokens),
  against the ASAP split, and against load (both modes at fractions of the
  baseline's SLO-compliant rate).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from ..serving.runtime import RuntimeConfig
from ..serving.traces import LogNormalLengths, Request, load_trace, synthetic_trace
from . import plots
from .costs import CostModel
from .shapes import ModelShapes
from .study import compare, find_slo_throughput, mean_len, run_point
from .validate import _mooncake_path

MOONCAKE_MEDIAN, MOONCAKE_P90 = 6909, 27367  # summarize_trace of shared/traces/mooncake_conversation.jsonl


def headline_config(attention: int = 32, expert: int = 32) -> RuntimeConfig:
    return RuntimeConfig(num_attention_ranks=attention, num_expert_ranks=expert, token_budget=16384,
                         chunk_len=16384, max_prompt_len=131072, expert_token_budget=32768,
                         expert_deadline_s=0.001)


def mooncake_trace(n: int) -> tuple[list, str]:
    path = _mooncake_path()
    if path is not None:
        return load_trace(path, limit=n, max_prompt_len=131072), f"mooncake file {path.name}, first {n} requests"
    sigma = math.log(MOONCAKE_P90 / MOONCAKE_MEDIAN) / 1.2816  # p90 of a log-normal = median * exp(1.2816 sigma)
    return (synthetic_trace(1.0, num_requests=n, arrival="gamma", cv=3.0,
                            lengths=LogNormalLengths(MOONCAKE_MEDIAN, sigma, 1, 131072), seed=0),
            f"synthetic Mooncake-like (file not found): median {MOONCAKE_MEDIAN}, sigma {sigma:.2f}")


def skew_trace(n: int, sigma: float, mean: float, seed: int = 0) -> list:
    """Equal mean prompt length, log-normal spread ``sigma`` (0: every prompt the same)."""
    median = max(1, round(mean * math.exp(-sigma * sigma / 2)))
    return synthetic_trace(1.0, num_requests=n, arrival="gamma", cv=2.0,
                           lengths=LogNormalLengths(median, sigma, 1, 131072), seed=seed)


def study(profile: str, model: str, n: int, n_side: int, cfg: RuntimeConfig, W: int, out: Path,
          sigmas, loads, quick: bool, other_splits=(), caps=()) -> dict:
    cost, shapes = CostModel.load(profile, model), ModelShapes.load(model)
    trace, trace_desc = mooncake_trace(n)
    tag = cost.name
    print(f"[{tag}] main comparison: {trace_desc}; ASAP {cfg.num_attention_ranks}+{cfg.num_expert_ranks} vs "
          f"{W} DP+EP", file=sys.stderr, flush=True)
    bis = 2 if quick else 4
    main = compare(trace, cost, shapes, cfg, sync_ranks=W, progress=tag, bisections=bis)
    slo = main["slo_s"]
    res = {"profile": tag, "cost_model": cost.describe(), "trace": trace_desc, "slo_s": slo,
           "slo_rule": "3x unloaded TTFT of the trace's p90 prompt on the baseline",
           "async": None, "sync": None, "slo_compliant_throughput_ratio": main["ratio"], "runs": [],
           "sweep": {m: {k: main[m][k] for k in ("slo_compliant_rate_req_s", "saturated", "arrival_span_over_slo")}
                     for m in ("async", "sync")}}
    res["split_sensitivity"] = [{"attention_ranks": cfg.num_attention_ranks, "expert_ranks": cfg.num_expert_ranks,
                                 "async": main["async"]["slo_compliant_throughput"], "ratio": main["ratio"]}]
    for a, e in other_splits:
        r = find_slo_throughput("async", trace, cost, shapes, headline_config(a, e), slo, start_rate=main["start_rate"],
                                bisections=bis, progress=f"{tag} split {a}+{e}")
        sync = main["sync"]["slo_compliant_throughput"]
        ratio = r["slo_compliant_throughput"] / sync if r["slo_compliant_throughput"] and sync else None
        res["split_sensitivity"].append({"attention_ranks": a, "expert_ranks": e,
                                         "async": r["slo_compliant_throughput"], "ratio": ratio})
        print(f"[{tag}] split {a}+{e}: ratio {ratio}", file=sys.stderr, flush=True)
    base_rate = main["sync"]["slo_compliant_rate_req_s"] or main["sync"]["points"][0]["rate_req_s"]
    timelines = {}
    for mode in ("async", "sync"):
        s, r = run_point(mode, trace, base_rate, cost, shapes, cfg, slo, sync_ranks=W, spans=True)
        timelines[mode] = r.spans
        res[mode] = {k: s[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s",
                                        "slo_attainment", "num_requests", "num_failed")}
        res[mode].update(rate_req_s=base_rate, slo_compliant_throughput=main[mode]["slo_compliant_throughput"],
                         ranks=r.ranks, idle_s_total=sum(x["idle_s"] * x["stands_for"] for x in r.ranks),
                         mean_utilisation=s["mean_utilisation"])
        res["runs"] += [{"mode": mode, **p} for p in main[mode]["points"]]
    # sensitivity to load: both modes at fractions of the baseline's SLO-compliant rate
    res["load_sensitivity"] = []
    for f in loads:
        row = {"load_fraction_of_baseline_slo_rate": f, "rate_req_s": f * base_rate}
        for mode in ("async", "sync"):
            s, _ = run_point(mode, trace, f * base_rate, cost, shapes, cfg, slo, sync_ranks=W)
            row[mode] = {"ttft_p90_s": s["ttft_p90_s"], "ttft_p50_s": s["ttft_p50_s"],
                         "slo_attainment": s["slo_attainment"]}
        a, b = row["async"]["ttft_p90_s"], row["sync"]["ttft_p90_s"]
        row["ttft_p90_ratio_sync_over_async"] = b / a if a and b else None
        res["load_sensitivity"].append(row)
        print(f"[{tag}] load {f:.2f}x: TTFT p90 async {a:.3g} s, sync {b:.3g} s", file=sys.stderr, flush=True)
    # sensitivity to the long-prompt tail: the same trace with prompts clipped at a cap
    res["cap_sensitivity"] = []
    for cap in caps:
        clipped = [Request(r.request_id, r.arrival_s, min(r.prompt_len, cap), r.output_len) for r in trace]
        c = compare(clipped, cost, shapes, cfg, sync_ranks=W, progress=f"{tag} cap {cap}", bisections=bis)
        res["cap_sensitivity"].append({"max_prompt_tokens": cap, "mean_prompt_tokens": mean_len(clipped),
                                       "slo_s": c["slo_s"], "async": c["async"]["slo_compliant_throughput"],
                                       "sync": c["sync"]["slo_compliant_throughput"], "ratio": c["ratio"]})
        print(f"[{tag}] prompts clipped at {cap}: ratio {c['ratio']}", file=sys.stderr, flush=True)
    # sensitivity to length skew: equal mean length, more and more spread
    res["skew_sensitivity"] = []
    mean = mean_len(trace)
    for sigma in sigmas:
        t = skew_trace(n_side, sigma, mean)
        c = compare(t, cost, shapes, cfg, sync_ranks=W, progress=f"{tag} sigma {sigma}", bisections=bis)
        res["skew_sensitivity"].append({"sigma": sigma, "mean_prompt_tokens": mean_len(t), "slo_s": c["slo_s"],
                                        "async": c["async"]["slo_compliant_throughput"],
                                        "sync": c["sync"]["slo_compliant_throughput"], "ratio": c["ratio"]})
        print(f"[{tag}] length sigma {sigma}: ratio {c['ratio']}", file=sys.stderr, flush=True)
    made = plots.ttft_vs_load(out / f"ttft_{tag}.png", res["runs"], slo, title=f"{tag}, {shapes.name}, {trace_desc}")
    made += plots.ratio_plot(out / f"ratio_vs_skew_{tag}.png",
                             {"SLO-compliant throughput": [(r["sigma"], r["ratio"]) for r in res["skew_sensitivity"]]},
                             "log-normal sigma of prompt lengths (equal mean)", f"{tag}: ASAP / baseline vs skew",
                             target=1.9)
    made += plots.ratio_plot(out / f"ratio_vs_load_{tag}.png",
                             {"TTFT p90 (baseline / ASAP)": [(r["load_fraction_of_baseline_slo_rate"],
                                                              r["ttft_p90_ratio_sync_over_async"])
                                                             for r in res["load_sensitivity"]]},
                             "load (fraction of the baseline's SLO-compliant rate)", f"{tag}: TTFT p90 ratio vs load")
    made += plots.utilisation_timeline(out / f"utilisation_{tag}.png", timelines,
                                       f"{tag}: the baseline's SLO-compliant load ({base_rate:.3g} req/s)")
    res["plots"] = made
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim headline", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num-requests", type=int, default=2000, help="requests of the main comparison")
    p.add_argument("--num-requests-sensitivity", type=int, default=1000)
    p.add_argument("--splits", default="48+16,32+32",
                   help="ASAP attention+expert ranks; the first is the headline, the others ASAP-only sweeps")
    p.add_argument("--sync-ranks", type=int, default=64)
    p.add_argument("--profiles", default="ascend-910c-cm384,h800-node")
    p.add_argument("--quick", action="store_true", help="a small smoke run (few requests, two skews, two loads)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n, n_side = (200, 120) if args.quick else (args.num_requests, args.num_requests_sensitivity)
    sigmas = (0.0, 1.0) if args.quick else (0.0, 0.5, 1.0, 1.5)
    loads = (0.5, 1.0) if args.quick else (0.25, 0.5, 0.75, 1.0, 1.25)
    caps = (8192,) if args.quick else (32768, 8192)
    try:
        splits = [tuple(int(x) for x in sp.split("+")) for sp in args.splits.split(",") if sp]
        assert splits and all(len(sp) == 2 and min(sp) >= 1 for sp in splits)
    except (ValueError, AssertionError):
        p.error(f"--splits {args.splits!r}: expected A+E[,A+E...], e.g. 48+16,32+32")
    if args.quick:  # a smaller deployment, so that a few hundred requests still make a sustained load
        splits, args.sync_ranks = [(6, 2), (4, 4)], 8
    cfg = headline_config(*splits[0])
    t0 = time.perf_counter()
    summary = {"config": {"model": "deepseek-v3", "runtime": cfg.__dict__, "sync_ranks": args.sync_ranks,
                          "splits": splits,
                          "num_requests": n, "num_requests_sensitivity": n_side}, "profiles": {}}
    for prof in [x for x in args.profiles.split(",") if x]:
        summary["profiles"][prof] = study(prof, "deepseek-v3", n, n_side, cfg, args.sync_ranks, out, sigmas, loads,
                                          args.quick, splits[1:], caps)
    first = summary["profiles"][next(iter(summary["profiles"]))]
    for mode in ("async", "sync"):  # the runtime's summary.json keys, for the first (headline) profile
        summary[mode] = first[mode]
    summary["slo_compliant_throughput_ratio"] = first["slo_compliant_throughput_ratio"]
    summary["wall_s"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\nASAP {splits[0][0]}+{splits[0][1]} vs {args.sync_ranks} DP+EP ranks, deepseek-v3, SLO-compliant throughput")
    print(f"{'profile':20s} {'SLO s':>8s} {'ASAP tok/s':>12s} {'sync tok/s':>12s} {'ratio':>7s}   ratio vs skew (sigma)")
    for prof, r in summary["profiles"].items():
        a, s = r["async"]["slo_compliant_throughput"], r["sync"]["slo_compliant_throughput"]
        skew = ", ".join(f"{x['sigma']:g}: {x['ratio']:.2f}" if x["ratio"] else f"{x['sigma']:g}: -"
                         for x in r["skew_sensitivity"])
        ratio = r["slo_compliant_throughput_ratio"]
        print(f"{prof:20s} {r['slo_s']:8.2f} {a or 0:12.0f} {s or 0:12.0f} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>7s}   {skew}")
        for x in r["cap_sensitivity"]:
            xr = "-" if x["ratio"] is None else f"{x['ratio']:.2f}x"
            print(f"{'':20s} prompts clipped at {x['max_prompt_tokens']}: ASAP {x['async'] or 0:.0f}, "
                  f"sync {x['sync'] or 0:.0f} tok/s, ratio {xr}")
        for x in r["split_sensitivity"][1:]:
            xr = "-" if x["ratio"] is None else f"{x['ratio']:.2f}x"
            print(f"{'':20s} split {x['attention_ranks']}+{x['expert_ranks']}: ASAP {x['async'] or 0:.0f} tok/s, "
                  f"ratio {xr}")
    print(f"artifacts in {out}/ ({summary['wall_s']:.0f} s)")
    return 0
