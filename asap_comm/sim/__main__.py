"""``python -m asap_comm.sim calibrate | run | validate | headline`` (each with ``--out DIR``).

* ``calibrate``: time this host's real operators and transfers, fit the ``local`` profile
  (``DIR/profile_local.json``, ``DIR/calibration.json``).
* ``run``: simulate both modes on a profile, model and trace; one load (``--rate``) or a list
  (``--rates``), or ``--sweep`` to search each mode's SLO-compliant throughput. ``DIR/summary.json``
  has the runtime's keys per mode, plus per-rank utilisation and idle time; plots beside it.
  Deployment: ``--attention-ranks A --attention-tp T`` (ASAP: A attention groups of T devices),
  ``--expert-ranks E`` (expert devices), ``--sync-ranks W --sync-tp T`` (baseline: W DP groups of T
  devices, EP over all W*T), ``--cp-threshold TOKENS`` (baseline context parallelism),
  ``--sync-overlap`` (the baseline hides its all_to_alls behind compute);
  ``--slo SECONDS`` (or auto) and ``--slo-percentile P`` (the share of requests that must meet it).
* ``validate``: real runtime on this host against the simulator with the local profile
  (``DIR/validation.json``: the relative error of every compared metric).
* ``headline``: the documented CloudMatrix384 comparison (and the same on H800 nodes), with the
  sensitivity to length skew and load (``DIR/summary.json`` and plots).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..serving.protocol import RuntimeConfig
from ..serving.traces import LogNormalLengths, load_trace, synthetic_trace
from . import plots
from .costs import CostModel
from .shapes import ModelShapes
from .simulate import Parallelism
from .study import capacity_rate, compare, parse_slo, percentile_target, run_point, spread_buckets, unloaded_slo


def _runtime_args(p: argparse.ArgumentParser, *, a: int, e: int, budget: int, chunk: int, max_len: int,
                  ex_budget: int, deadline: float) -> None:
    p.add_argument("--attention-ranks", type=int, default=a,
                   help=f"ASAP attention ranks: DP groups of --attention-tp devices each (default {a})")
    p.add_argument("--expert-ranks", type=int, default=e, help=f"ASAP expert ranks, one device each (default {e})")
    p.add_argument("--sync-ranks", type=int, default=None,
                   help="baseline DP groups of --sync-tp devices each, EP over all of them "
                        "(default: the same devices as ASAP, (A * attention_tp + E) / sync_tp)")
    p.add_argument("--attention-tp", type=int, default=1, metavar="T",
                   help="devices per ASAP attention rank, tensor-parallel (cluster profiles; default 1)")
    p.add_argument("--sync-tp", type=int, default=1, metavar="T",
                   help="devices per baseline DP group, tensor-parallel (cluster profiles; default 1)")
    p.add_argument("--cp-threshold", type=int, default=None, metavar="TOKENS",
                   help="baseline: prompts longer than this run with context parallelism on "
                        "ceil(prompt / TOKENS) DP groups (default: never)")
    p.add_argument("--sync-overlap", action="store_true",
                   help="baseline: hide the all_to_alls behind compute (two micro-batches per step; cluster profiles)")
    p.add_argument("--token-budget", type=int, default=budget, help="tokens per attention micro-batch")
    p.add_argument("--chunk-len", type=int, default=chunk, help="split longer prompts into chunks of this size")
    p.add_argument("--max-prompt-len", type=int, default=max_len)
    p.add_argument("--expert-token-budget", type=int, default=ex_budget)
    p.add_argument("--expert-deadline", type=float, default=deadline, help="seconds")
    for opt in ("barrier-free", "ping-pong", "load-aware", "expert-batching"):
        p.add_argument(f"--no-{opt}", action="store_true", help=f"turn optimization '{opt}' off (ablation)")
    lane_args(p)


def lane_args(p: argparse.ArgumentParser) -> None:
    """ASAP's long-prompt lane and token-balanced micro-batch pairs (``asap_comm/sim/lane.py``)."""
    p.add_argument("--no-long-prompt-lane", action="store_true",
                   help="turn ASAP's long-prompt lane off (ablation; lane.py)")
    p.add_argument("--lane-threshold", type=int, default=None, metavar="TOKENS",
                   help="lane for prompts longer than this (default: predicted TTFT on one group vs the SLO)")
    p.add_argument("--lane-groups", type=int, default=0, metavar="G",
                   help="attention groups a lane prompt spreads over (default 0: all)")
    p.add_argument("--no-token-balanced", action="store_true",
                   help="fill the first ping-pong micro-batch up to the budget instead of balancing the pair")


def lane_config(p: argparse.ArgumentParser, args, cfg: RuntimeConfig) -> RuntimeConfig:
    """``cfg`` with the lane flags of :func:`lane_args`; a bad value is a usage error naming the flag."""
    import dataclasses

    try:
        return dataclasses.replace(cfg, long_prompt_lane=not args.no_long_prompt_lane,
                                   lane_threshold=args.lane_threshold, lane_groups=args.lane_groups,
                                   token_balanced=not args.no_token_balanced)
    except ValueError as e:
        p.error(str(e).replace("RuntimeConfig: lane_threshold", "--lane-threshold")
                .replace("RuntimeConfig: lane_groups", "--lane-groups"))


def _runtime_config(args) -> RuntimeConfig:
    return RuntimeConfig(num_attention_ranks=args.attention_ranks, num_expert_ranks=args.expert_ranks,
                         token_budget=args.token_budget, chunk_len=args.chunk_len,
                         max_prompt_len=args.max_prompt_len, expert_token_budget=args.expert_token_budget,
                         expert_deadline_s=args.expert_deadline, barrier_free=not args.no_barrier_free,
                         ping_pong=not args.no_ping_pong, load_aware=not args.no_load_aware,
                         expert_batching=not args.no_expert_batching)


def parallel_args(p: argparse.ArgumentParser, args) -> tuple:
    """(Parallelism, baseline DP groups) from --attention-tp/--sync-tp/--cp-threshold/--sync-ranks; the default
    baseline has ASAP's device count, ``attention_ranks * attention_tp + expert_ranks`` devices."""
    try:
        par = Parallelism(attention_tp=args.attention_tp, sync_tp=args.sync_tp, cp_threshold=args.cp_threshold,
                          sync_overlap=args.sync_overlap)
    except ValueError as e:
        p.error(str(e).replace("Parallelism: ", "").replace("attention_tp", "--attention-tp")
                .replace("sync_tp", "--sync-tp").replace("cp_threshold", "--cp-threshold"))
    devices = args.attention_ranks * args.attention_tp + args.expert_ranks
    if args.sync_ranks is None:
        if devices % args.sync_tp:
            p.error(f"--sync-tp {args.sync_tp} does not divide ASAP's {devices} devices "
                    f"(--attention-ranks x --attention-tp + --expert-ranks): give --sync-ranks")
        return par, devices // args.sync_tp
    if args.sync_ranks < 1:
        p.error(f"--sync-ranks {args.sync_ranks} must be >= 1")
    return par, args.sync_ranks


def slo_target(p: argparse.ArgumentParser, args) -> float:
    """--slo-percentile P as the attainment target P/100."""
    try:
        return percentile_target(args.slo_percentile)
    except ValueError as e:
        p.error(f"--slo-percentile: {e}")


def slo_arg(p: argparse.ArgumentParser, value: str) -> "float | None":
    """--slo SECONDS, or None for auto."""
    try:
        return parse_slo(value)
    except ValueError as e:
        p.error(f"--slo: {e}")


def _trace_args(p: argparse.ArgumentParser, *, median: int, max_len: int) -> None:
    p.add_argument("--trace", default="synthetic",
                   help="synthetic (Gamma arrivals, log-normal lengths), or a Mooncake .jsonl / Azure .csv file")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--burstiness", type=float, default=2.0, help="synthetic: CV of inter-arrival times")
    p.add_argument("--median-len", type=int, default=median, help="synthetic: median prompt length")
    p.add_argument("--sigma", type=float, default=1.0, help="synthetic: log-normal sigma of prompt lengths (skew)")
    p.add_argument("--length-scale", type=float, default=1.0, help="scale the file's prompt lengths")
    p.add_argument("--spread-arrivals", action="store_true",
                   help="spread the requests that share a timestamp evenly over the file's timestamp step (the "
                        "Mooncake trace's timestamps come in 3-s steps; headline does this)")
    p.add_argument("--seed", type=int, default=0)


def _trace(args, max_len: int) -> list:
    if args.trace == "synthetic":
        return synthetic_trace(1.0, num_requests=args.num_requests, arrival="gamma", cv=args.burstiness,
                               lengths=LogNormalLengths(args.median_len, args.sigma, 1, max_len), seed=args.seed)
    trace = load_trace(args.trace, limit=args.num_requests, length_scale=args.length_scale, max_prompt_len=max_len)
    if args.spread_arrivals:
        trace = spread_buckets(trace)[0]
    return trace


def _write(out: Path, name: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=2, default=str))


def _mode_keys(s: dict) -> dict:
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s", "slo_attainment", "num_requests",
            "num_failed")
    return {k: s[k] for k in keys}


# ----------------------------------------------------------------------------- run
def cmd_run(argv) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim run", description="simulate ASAP and the baseline")
    p.add_argument("--out", required=True)
    p.add_argument("--profile", default="local", help="local, ascend-910c-cm384, h800-node, or a profile .json")
    p.add_argument("--model", default="small", help="model shapes: tiny, small, deepseek-v3, or a config.json")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: half the baseline's capacity)")
    p.add_argument("--rates", default="", help="comma-separated request rates (a load sweep)")
    p.add_argument("--sweep", action="store_true", help="search each mode's SLO-compliant throughput")
    p.add_argument("--slo", default="auto", metavar="SECONDS",
                   help="TTFT SLO in seconds, or auto (3x the baseline's unloaded TTFT of the p90 prompt)")
    p.add_argument("--slo-percentile", type=float, default=90.0, metavar="P",
                   help="SLO attainment target: at least P%% of requests must meet the SLO (default 90)")
    p.add_argument("--modes", default="async,sync")
    _trace_args(p, median=48, max_len=512)
    _runtime_args(p, a=2, e=2, budget=256, chunk=256, max_len=512, ex_budget=1024, deadline=0.002)
    args = p.parse_args(argv)
    par, W = parallel_args(p, args)
    target = slo_target(p, args)
    slo_s = slo_arg(p, args.slo)
    cost, shapes = CostModel.load(args.profile, args.model), ModelShapes.load(args.model)
    if max(par.attention_tp, par.sync_tp) > 1 and cost.cores is not None:
        p.error(f"--attention-tp / --sync-tp above 1 need a profile of dedicated devices; {cost.name!r} shares "
                f"{cost.cores} CPU cores between its ranks")
    cfg = lane_config(p, args, _runtime_config(args))
    trace = _trace(args, cfg.max_prompt_len)
    try:
        slo = unloaded_slo(trace, cost, shapes, cfg, sync_ranks=W, par=par) if slo_s is None else slo_s
    except ValueError as e:
        p.error(str(e))
    modes = [m for m in args.modes.split(",") if m]
    out = Path(args.out)
    summary = {"config": {"profile": cost.name, "model": shapes.name, "runtime": cfg.__dict__, "sync_ranks": W,
                          "parallelism": par.describe(),
                          "devices": {"async": cfg.num_attention_ranks * par.attention_tp + cfg.num_expert_ranks,
                                      "sync": W * par.sync_tp},
                          "trace": args.trace, "num_requests": len(trace), "slo_s": slo,
                          "slo_percentile": args.slo_percentile, "cost_model": cost.describe()}, "runs": []}
    t0 = time.perf_counter()
    if args.sweep:
        res = compare(trace, cost, shapes, cfg, sync_ranks=W, slo=slo, progress="sweep", modes=modes,
                      target=target, par=par)
        for mode in modes:
            summary["runs"] += [{"mode": mode, **pt} for pt in res[mode]["points"]]
        rates = sorted({pt["rate_req_s"] for m in modes for pt in res[m]["points"]})
        summary["slo_compliant_throughput_ratio"] = res["ratio"]
    else:
        rates = [float(x) for x in args.rates.split(",") if x] or [args.rate]
        if rates == [None]:
            rates = [0.5 * capacity_rate(trace, cost, shapes, cfg, sync_ranks=W, par=par)]
    mid = rates[len(rates) // 2]
    timelines = {}
    for mode in modes:
        if not args.sweep:
            for rate in rates:
                s, _ = run_point(mode, trace, rate, cost, shapes, cfg, slo, sync_ranks=W, par=par)
                summary["runs"].append({"mode": mode, **s})
                print(f"  {mode:5s} {rate:10.3f} req/s  TTFT p50 {_f(s['ttft_p50_s'])}  p90 {_f(s['ttft_p90_s'])}  "
                      f"SLO att. {s['slo_attainment']:.2f}", file=sys.stderr, flush=True)
        s, res = run_point(mode, trace, mid, cost, shapes, cfg, slo, sync_ranks=W, spans=True, par=par)
        summary[mode] = {**_mode_keys(s), "rate_req_s": mid, "ranks": res.ranks,
                         "idle_s_total": sum(r["idle_s"] * r["stands_for"] for r in res.ranks),
                         "sim_wall_s": res.wall_s, "sim_events": res.events}
        timelines[mode] = res.spans
        if args.sweep or len(rates) > 1:
            from ..serving.metrics import slo_compliant_throughput

            pts = [(r["offered_tokens_per_s"], r["slo_attainment"]) for r in summary["runs"] if r["mode"] == mode]
            summary[mode]["slo_compliant_throughput"] = slo_compliant_throughput(pts, target)
    summary["sim_wall_s"] = time.perf_counter() - t0
    _write(out, "summary.json", summary)
    made = plots.ttft_vs_load(out / "ttft.png", summary["runs"], slo, title=f"{cost.name}, {shapes.name}")
    made += plots.utilisation_timeline(out / "utilisation.png", timelines, f"{cost.name}, {mid:g} req/s")
    _print_summary(summary, modes, slo)
    print(f"artifacts in {out}/: summary.json" + "".join(f", {m}" for m in made))
    return 0


def _f(v) -> str:
    return "     -" if v is None else f"{v:8.3f}"


def _print_summary(summary: dict, modes, slo: float) -> None:
    print(f"\n{'mode':6s} {'TTFT p50 s':>11s} {'p90 s':>9s} {'p99 s':>9s} {'tok/s':>11s} {'SLO att.':>9s} "
          f"{'failed':>7s} {'SLO-compliant tok/s':>20s}")
    for m in modes:
        s = summary[m]
        sct = s.get("slo_compliant_throughput")
        print(f"{m:6s} {_f(s['ttft_p50_s']):>11s} {_f(s['ttft_p90_s']):>9s} {_f(s['ttft_p99_s']):>9s} "
              f"{s['throughput_tokens_per_s']:11.0f} {s['slo_attainment']:9.2f} {s['num_failed']:7d} "
              f"{'-' if sct is None else f'{sct:.0f}':>20s}")
    if "slo_compliant_throughput_ratio" in summary and summary["slo_compliant_throughput_ratio"]:
        print(f"SLO-compliant throughput, ASAP / baseline: {summary['slo_compliant_throughput_ratio']:.2f}x "
              f"(TTFT SLO {slo:.3f} s)")


# ----------------------------------------------------------------------------- calibrate / validate / headline
def cmd_calibrate(argv) -> int:
    from .calibrate import main

    return main(argv)


def cmd_validate(argv) -> int:
    from .validate import main

    return main(argv)


def cmd_headline(argv) -> int:
    from .headline import main

    return main(argv)


def cmd_lane_study(argv) -> int:
    from .lane_study import main

    return main(argv)


COMMANDS = {"calibrate": cmd_calibrate, "run": cmd_run, "validate": cmd_validate, "headline": cmd_headline}
COMMANDS["lane-study"] = cmd_lane_study  # ASAP's long-prompt lane: the design study (lane_study.py)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        print(f"usage: python -m asap_comm.sim {{{'|'.join(COMMANDS)}}} --out DIR [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
