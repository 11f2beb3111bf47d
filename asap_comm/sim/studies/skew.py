"""``python -m asap_comm.sim skew``: both modes' SLO-compliant throughput across routing skews.

One fixed pair of deployments (default: 32 dies of the 910C profile, ASAP 2 attention groups of TP8 + 16
expert dies against the baseline's 4 DP groups of TP8 with EP32, context parallelism above 16k tokens and its
two-micro-batch overlap; the headline's cluster-scale chunk and budgets), one trace (the headline's Mooncake
trace, arrivals spread over the timestamp steps) and one SLO (``--slo-factor`` x the faster deployment's
unloaded TTFT of the trace's p90 prompt, under balanced routing), held fixed while the routing changes
(``routing.py``: balanced, Zipf skews, a recorded histogram). Per routing: each mode's SLO-compliant
throughput, the ratio, and how hot the hottest rank of each side is (its (token, expert) pairs over the mean
rank's). Writes ``DIR/skew.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...serving.metrics import throughput_ratio
from ..core.simulate import Parallelism
from ..core.sweep import Deployment, capacity_rate, percentile_target, sweep_deployment
from ..costmodel.costs import CostModel
from ..costmodel.routing import known_histograms, parse_routing, routed_cost
from ..costmodel.shapes import ModelShapes

__all__ = ["skew_study", "main", "DEFAULT_ROUTINGS"]

DEFAULT_ROUTINGS = ("balanced", "zipf:0.5", "zipf:1.0", "zipf:1.5")


def deployments(attention: int, attention_tp: int, experts: int, sync_ranks: int, sync_tp: int,
                cp: "int | None", overlap: bool) -> tuple:
    from .grids import headline_config
    a = Deployment("async", headline_config(attention=attention, expert=experts), Parallelism(attention_tp=attention_tp))
    s = Deployment("sync", headline_config(attention=attention, expert=experts),
                   Parallelism(sync_tp=sync_tp, cp_threshold=cp, sync_overlap=overlap), sync_ranks=sync_ranks)
    return a, s


def skew_study(routings, a: Deployment, s: Deployment, trace, cost, shapes, *, slo_factor: float = 3.0,
               target: float = 0.9, bisections: int = 3, progress: bool = True, slo_s: "float | None" = None) -> dict:
    """Both deployments' SLO-compliant throughput under each routing (same trace and SLO); see the module
    docstring. ``slo_s``: the SLO in seconds instead of the rule (``--slo``: held while the pair changes).
    Returns ``{"slo_s", "rows": [{"routing", "async", "sync", "ratio", "hot": {...}}]}``."""
    from .headline import slo_rule
    if slo_s is None:
        slo, setter = slo_rule(trace, [a, s], cost, shapes, factor=slo_factor)
        by = setter.label
    else:
        slo, by, slo_factor = slo_s, "given (--slo)", None
    start = 0.25 * capacity_rate(trace, cost, shapes, s.cfg, sync_ranks=s.sync_ranks, par=s.par)
    rows = []
    for spec in routings:
        r = parse_routing(spec)
        c = routed_cost(cost, r)
        t0 = time.perf_counter()
        sweeps = {d.mode: sweep_deployment(d, trace, c, shapes, slo, start_rate=start, bisections=bisections,
                                           target=target) for d in (a, s)}
        got = {m: w["slo_compliant_throughput"] for m, w in sweeps.items()}
        hot = {"async_expert_ranks": r.rank_load(shapes.num_experts, shapes.top_k, a.cfg.num_expert_ranks).describe(),
               "sync_devices": r.rank_load(shapes.num_experts, shapes.top_k, s.devices).describe()}
        ratio, why = throughput_ratio(got["async"], got["sync"], target=target,
                                      points=(sweeps["async"]["points"], sweeps["sync"]["points"]))
        rows.append({"routing": r.spec, "describe": r.describe(shapes.num_experts, shapes.top_k),
                     "async": got["async"], "sync": got["sync"], "ratio": ratio, "ratio_withheld": why,
                     "served_fraction": {m: w["served_fraction"] for m, w in sweeps.items()}, "hot": hot,
                     "wall_s": time.perf_counter() - t0})
        if progress:
            print(f"[skew] {r.spec:32s} ASAP {_tok(got['async']):>8s} tok/s  baseline {_tok(got['sync']):>8s} tok/s  "
                  f"ratio {'-' if ratio is None else f'{ratio:.2f}'}  ({rows[-1]['wall_s']:.0f} s)"
                  + (f"  ({why})" if why else ""), file=sys.stderr, flush=True)
    return {"slo_s": slo, "slo_set_by": by, "slo_factor": slo_factor, "slo_percentile": 100 * target,
            "async": a.describe(), "sync": s.describe(), "rows": rows}


def _tok(v) -> str:
    return "-" if v is None else f"{v:.0f}"


def table(res: dict) -> str:
    rule = (res["slo_set_by"] if res["slo_factor"] is None else
            f"{res['slo_factor']:g}x the unloaded p90 prompt on {res['slo_set_by']}")
    lines = [f"SLO {res['slo_s']:.3g} s at p{res['slo_percentile']:g} ({rule}); {res['async']['label']} vs "
             f"{res['sync']['label']}",
             "| routing | hot expert / mean | hot rank pairs / mean (ASAP E, baseline D) | ASAP tok/s | baseline tok/s "
             "| ratio |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ha, hs = r["hot"]["async_expert_ranks"], r["hot"]["sync_devices"]
        ratio = f"- ({r['ratio_withheld']})" if r["ratio"] is None and r.get("ratio_withheld") else (
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}")
        lines.append(f"| {r['routing']} | {r['describe'].get('hot_expert_over_mean', 1.0):.2f} | "
                     f"{ha['hot_rank_pairs_over_mean']:.2f}, {hs['hot_rank_pairs_over_mean']:.2f} | "
                     f"{_tok(r['async'])} | {_tok(r['sync'])} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim skew", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--routings", default=",".join(DEFAULT_ROUTINGS + tuple(f"histogram:{h}" for h in known_histograms())),
                   help="comma-separated routings (balanced, zipf:S[:SEED], histogram:PATH|NAME)")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--attention-ranks", type=int, default=2)
    p.add_argument("--attention-tp", type=int, default=8)
    p.add_argument("--expert-ranks", type=int, default=16)
    p.add_argument("--sync-ranks", type=int, default=4)
    p.add_argument("--sync-tp", type=int, default=8)
    p.add_argument("--cp-threshold", type=int, default=16384, help="baseline context parallelism (0: off)")
    p.add_argument("--no-sync-overlap", action="store_true", help="the baseline does not overlap its all_to_alls")
    p.add_argument("--slo-factor", type=float, default=3.0)
    p.add_argument("--slo", type=float, default=None, metavar="SECONDS",
                   help="the TTFT SLO in seconds instead of --slo-factor x the faster deployment's unloaded p90 "
                        "prompt (hold it while the pair changes)")
    p.add_argument("--slo-percentile", type=float, default=90.0)
    p.add_argument("--bisections", type=int, default=3)
    args = p.parse_args(argv)
    try:
        target = percentile_target(args.slo_percentile)
        routings = [parse_routing(x) for x in args.routings.split(",") if x.strip()]
    except ValueError as e:
        p.error(str(e))
    if not routings or args.num_requests < 2 or not args.slo_factor > 0:
        p.error("--routings must name at least one routing, --num-requests be >= 2 and --slo-factor > 0")
    if args.slo is not None and not (args.slo > 0 and args.slo < float("inf")):
        p.error(f"--slo {args.slo}: expected seconds > 0")
    from .grids import mooncake_trace
    cost, shapes = CostModel.load(args.profile, args.model), ModelShapes.load(args.model)
    a, s = deployments(args.attention_ranks, args.attention_tp, args.expert_ranks, args.sync_ranks, args.sync_tp,
                       args.cp_threshold or None, not args.no_sync_overlap)
    trace, desc = mooncake_trace(args.num_requests)
    t0 = time.perf_counter()
    res = skew_study(routings, a, s, trace, cost, shapes, slo_factor=args.slo_factor, target=target,
                     bisections=args.bisections, slo_s=args.slo)
    res.update(profile=cost.name, model=shapes.name, trace=desc, wall_s=time.perf_counter() - t0,
               command="python -m asap_comm.sim skew " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "skew.json").write_text(json.dumps(res, indent=2, default=str))
    print(table(res))
    print(f"artifacts in {out}/: skew.json ({res['wall_s']:.0f} s)")
    return 0
