"""``python -m asap_comm.sim COMMAND``: the simulator's command line (the commands below; most write ``--out DIR``).

* ``calibrate``: time this host's real operators and transfers, fit the ``local`` profile
  (``DIR/profile_local.json``, ``DIR/calibration.json``).
* ``run``: simulate both modes on a profile, model and trace; one load (``--rate``) or a list
  (``--rates``), or ``--sweep`` to search each mode's SLO-compliant throughput. ``DIR/summary.json``
  has the runtime's keys per mode, plus per-rank utilisation and idle time; plots beside it.
  Deployment: ``--attention-ranks A --attention-tp T`` (ASAP: A attention groups of T devices),
  ``--expert-ranks E`` (expert devices), ``--sync-ranks W --sync-tp T`` (baseline: W DP groups of T
  devices, EP over all W*T), ``--cp-threshold TOKENS`` (baseline context parallelism),
  ``--sync-overlap`` (the baseline hides its all_to_alls behind compute);
  ``--slo SECONDS`` (or auto) and ``--slo-percentile P`` (the share of requests that must meet it);
  ``--routing balanced|zipf:S|histogram:PATH`` (expert popularity, ``costmodel/routing.py``; summary key ``routing``).
* ``validate``: real runtime on this host against the simulator with the local profile
  (``DIR/validation.json``: the relative error of every compared metric).
* ``memory``: the per-die memory of an ASAP and a baseline deployment (``asap_comm.sim.costmodel.memory``); ``run``
  and ``headline`` refuse a deployment whose dies cannot hold it (exit 2, one line with ``memory``) unless
  ``--ignore-memory``; ``--weights {bf16,int8}`` overrides the profile's weight dtype.
* ``headline``: the documented CloudMatrix384 comparison (and the same on H800 nodes), with the
  sensitivity to length skew and load (``DIR/summary.json`` and plots).
* ``skew``: both modes' SLO-compliant throughput across routing skews (``studies/skew.py``, ``DIR/skew.json``).
* ``replot DIR [DIR...]``: redraw a study's figures from its result JSON (``studies/figures.py``; what the JSON
  lacks is listed as skipped).
* ``barrier``: the baseline's per-MoE-layer barrier stall against the expected-max-of-r-normals model, 8-96 DP
  groups x prompt spreads (``studies/barrier.py``, ``DIR/barrier.json``, ``DIR/barrier.png``).
* ``scaling``, ``plan``, ``lane-study``: best against best at each cluster size, the planner at one size, and the
  long-prompt lane's design study (``studies/``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from ..serving.runtime_args import add_runtime_args, given_flags, runtime_config_from_args
from ..serving.traces import LogNormalLengths, TraceError, load_trace, resolve_trace, synthetic_trace
from .core.failover import check_failures
from .core.simulate import Parallelism
from .core.sweep import capacity_rate, compare, parse_slo, percentile_target, run_point, spread_buckets, unloaded_slo
from .costmodel.costs import CostModel
from .costmodel.routing import parse_routing_arg, routed_cost, routing_arg
from .costmodel.shapes import ModelShapes
from .studies.figures import run_figures


# ``run``'s presets for the flags a user did not give (``--help`` shows the runtime's own defaults, RuntimeConfig's,
# the same on every command line; asap_comm.serving.runtime_args). The local profile keeps the toy sizes of this
# host's small model, prompts up to 512 tokens; a cluster profile (dedicated devices: no "cores" in its JSON) gets
# the headline's runtime settings (studies.grids.headline_config: 16k-token chunks and micro-batches, prompts up to
# 128k, expert batches of up to 32768 rows or 1 ms) on 32 attention + 32 expert devices, deepseek-v3 and
# Mooncake-like synthetic lengths
RUN_DEFAULTS = {
    "local": {"model": "small", "max_prompt_len": 512, "median_len": 48},
    "cluster": {"model": "deepseek-v3", "attention_ranks": 32, "expert_ranks": 32, "token_budget": 16384,
                "chunk_len": 16384, "max_prompt_len": 131072, "expert_token_budget": 32768,
                "expert_deadline_s": 0.001, "median_len": 6909},
}


def apply_run_defaults(args, given: set) -> tuple:
    """Fill every ``run`` flag the user did not give (not in ``given``, :func:`given_flags`) from
    :data:`RUN_DEFAULTS`: ``"cluster"`` for a profile of dedicated devices, ``"local"`` for one of shared CPU
    cores. Returns (kind, {flag: value filled in})."""
    from .costmodel.hardware import Profile

    kind = "local" if Profile.load(args.profile).cores is not None else "cluster"
    filled = {}
    for k, v in RUN_DEFAULTS[kind].items():
        if k not in given:
            setattr(args, k, v)
            filled["--" + k.replace("_", "-")] = v
    return kind, filled


def _deployment_args(p: argparse.ArgumentParser) -> None:
    """The runtime flags (``add_runtime_args``, shared with every command line) and the simulator's parallelism."""
    add_runtime_args(p, simulated=True)
    g = p.add_argument_group("parallelism (modelled devices)")
    g.add_argument("--sync-ranks", type=int, default=None,
                   help="baseline DP groups of --sync-tp devices each, EP over all of them "
                        "(default: the same devices as ASAP, (A * attention_tp + E) / sync_tp)")
    g.add_argument("--attention-tp", type=int, default=1, metavar="T",
                   help="devices per ASAP attention rank, tensor-parallel (cluster profiles; default 1)")
    g.add_argument("--sync-tp", type=int, default=1, metavar="T",
                   help="devices per baseline DP group, tensor-parallel (cluster profiles; default 1)")
    g.add_argument("--cp-threshold", type=int, default=None, metavar="TOKENS",
                   help="baseline: prompts longer than this run with context parallelism on "
                        "ceil(prompt / TOKENS) DP groups (default: never)")
    g.add_argument("--sync-overlap", action="store_true",
                   help="baseline: hide the all_to_alls behind compute (two micro-batches per step; cluster profiles)")


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
                   help="synthetic (Gamma arrivals, log-normal lengths), mooncake or azure (the public traces that "
                        "ship with the package; $ASAP_TRACES_DIR overrides their folder), or a Mooncake .jsonl / "
                        "Azure .csv file")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--burstiness", type=float, default=2.0, help="synthetic: CV of inter-arrival times")
    p.add_argument("--median-len", type=int, default=median, help="synthetic: median prompt length" + (
        f" (default {median})" if median is not None else " (default: 48 on the local profile, 6909 (Mooncake's) on "
                                                          "a cluster profile)"))
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
    try:
        trace = load_trace(resolve_trace(args.trace), limit=args.num_requests, length_scale=args.length_scale,
                           max_prompt_len=max_len)
    except (TraceError, OSError) as e:  # a missing or malformed file: one line naming the flag, exit 2
        print(f"python -m asap_comm.sim: --trace {args.trace}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
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
    p.add_argument("--model", default=None, help="model shapes: tiny, small, deepseek-v3, or a config.json "
                   "(default: small on the local profile, deepseek-v3 on a cluster profile)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: half the baseline's capacity)")
    p.add_argument("--rates", default="", help="comma-separated request rates (a load sweep)")
    p.add_argument("--sweep", action="store_true", help="search each mode's SLO-compliant throughput")
    p.add_argument("--slo", default="auto", metavar="SECONDS",
                   help="TTFT SLO in seconds, or auto (3x the baseline's unloaded TTFT of the p90 prompt)")
    p.add_argument("--slo-percentile", type=float, default=90.0, metavar="P",
                   help="SLO attainment target: at least P%% of requests must meet the SLO (default 90)")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--expert-failure", action="append", default=[], metavar="SECONDS:RANK",
                   help="kill a rank SECONDS into each run (repeatable; asap_comm.sim.core.failover): ASAP's expert rank "
                        "RANK (a spare of --spare-expert-ranks takes its place, or the group fails), the baseline's "
                        "device RANK (its run ends: no failover); fixed loads only (--rate / --rates), not --sweep")
    p.add_argument("--spare-expert-ranks", type=int, default=0, metavar="N",
                   help="ASAP's spare expert ranks for --expert-failure (default 0)")
    memory_args(p)
    routing_arg(p)
    _trace_args(p, median=None, max_len=None)
    _deployment_args(p)
    args = p.parse_args(argv)
    failures = _expert_failures(p, args)
    try:
        kind, filled = apply_run_defaults(args, given_flags(p, argv))
    except (ValueError, FileNotFoundError) as e:
        p.error(f"--profile {args.profile!r}: {e}")
    if filled:
        print(f"{kind} defaults for --profile {args.profile} (flags not given): "
              + ", ".join(f"{k} {v}" for k, v in filled.items()), file=sys.stderr, flush=True)
    par, W = parallel_args(p, args)
    target = slo_target(p, args)
    slo_s = slo_arg(p, args.slo)
    cost, shapes = CostModel.load(args.profile, args.model), ModelShapes.load(args.model)
    try:  # --lane-tokens auto: check_memory sizes the pool (its KV is charged too)
        cfg = runtime_config_from_args(args, **({"lane_tokens": None} if args.lane_tokens == "auto" else {}))
    except ValueError as e:
        p.error(str(e))
    cost, memory, cfg = check_memory(p, args, cost, shapes, cfg, par, W)
    if args.spare_expert_ranks:
        cfg = dataclasses.replace(cfg, spare_expert_ranks=args.spare_expert_ranks)
    routing = parse_routing_arg(p, args.routing)
    cost = routed_cost(cost, routing)  # every simulated run below charges this routing (routing.py)
    if max(par.attention_tp, par.sync_tp) > 1 and cost.cores is not None:
        p.error(f"--attention-tp / --sync-tp above 1 need a profile of dedicated devices; {cost.name!r} shares "
                f"{cost.cores} CPU cores between its ranks")
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
                          "slo_percentile": args.slo_percentile, "cost_model": cost.describe(),
                          "defaults": {"kind": kind, "filled": filled}}, "runs": [],
               "ignore_memory": args.ignore_memory, "weights": args.weights, "memory": memory,
               "routing": routing.describe(shapes.num_experts, shapes.top_k)}
    t0 = time.perf_counter()
    if args.sweep:
        res = compare(trace, cost, shapes, cfg, sync_ranks=W, slo=slo, progress="sweep", modes=modes,
                      target=target, par=par)
        for mode in modes:
            summary["runs"] += [{"mode": mode, **pt} for pt in res[mode]["points"]]
        rates = sorted({pt["rate_req_s"] for m in modes for pt in res[m]["points"]})
    else:
        rates = [float(x) for x in args.rates.split(",") if x] or [args.rate]
        if rates == [None]:
            rates = [0.5 * capacity_rate(trace, cost, shapes, cfg, sync_ranks=W, par=par)]
    mid = rates[len(rates) // 2]
    timelines = {}
    for mode in modes:
        at_mid = None  # the run at the middle load, with its timeline: each load is simulated once
        if not args.sweep:
            for rate in rates:
                try:
                    s, res = run_point(mode, trace, rate, cost, shapes, cfg, slo, sync_ranks=W, par=par,
                                       spans=at_mid is None and rate == mid, failures=failures or None)
                except ValueError as e:
                    if not failures:
                        raise
                    p.error(f"--expert-failure: {e}")
                if at_mid is None and rate == mid:
                    at_mid = s, res
                summary["runs"].append({"mode": mode, **s})
                print(f"  {mode:5s} {rate:10.3f} req/s  TTFT p50 {_f(s['ttft_p50_s'])}  p90 {_f(s['ttft_p90_s'])}  "
                      f"SLO att. {s['slo_attainment']:.2f}", file=sys.stderr, flush=True)
        # a sweep's runs keep no timeline: its middle load once more, for the plot
        s, res = at_mid or run_point(mode, trace, mid, cost, shapes, cfg, slo, sync_ranks=W, spans=True, par=par)
        summary[mode] = {**_mode_keys(s), "rate_req_s": mid, "ranks": res.ranks,
                         "idle_s_total": sum(r["idle_s"] * r["stands_for"] for r in res.ranks),
                         "sim_wall_s": res.wall_s, "sim_events": res.events}
        if res.lane:  # the long-prompt lane's counts at this load (serving.lane.LaneCounts)
            summary[mode]["lane"] = res.lane
        if res.failover:  # --expert-failure: the deaths, replacements and throughput around them at this load
            summary[mode]["failover"] = res.failover
            _print_failover(mode, res.failover)
        timelines[mode] = res.spans
    if args.sweep or len(rates) > 1:
        _compliance(summary, modes, target)
    summary["sim_wall_s"] = time.perf_counter() - t0
    _write(out, "summary.json", summary)
    made, _ = run_figures(out, summary, timelines)  # sim.figures (replot redraws all but the timelines)
    _print_summary(summary, modes, slo)
    print(f"artifacts in {out}/: summary.json" + "".join(f", {m}" for m in made))
    return 0


def _expert_failures(p: argparse.ArgumentParser, args) -> list:
    """``--expert-failure SECONDS:RANK`` flags as ``[(seconds, rank)]``; a usage error names the flag's value."""
    out = []
    for text in args.expert_failure:
        t, sep, r = text.partition(":")
        try:
            if not sep:
                raise ValueError
            pair = (float(t), int(r))
        except ValueError:
            p.error(f"--expert-failure {text!r}: give SECONDS:RANK, e.g. 5:0")
        try:  # the simulator's own check (the rank's upper bound is the deployment's: simulate checks it)
            check_failures([pair], sys.maxsize, "RANK", f"--expert-failure {text!r}")
        except ValueError as e:
            p.error(str(e))
        out.append(pair)
    if out and args.sweep:
        p.error("--expert-failure runs at fixed loads (--rate / --rates), not with --sweep")
    if args.spare_expert_ranks < 0:
        p.error(f"--spare-expert-ranks {args.spare_expert_ranks}: must be >= 0")
    return out


def _print_failover(mode: str, fo: dict) -> None:
    for d in fo["deaths"]:
        if "time_to_replace_s" in d:
            back = d.get("recovered_after_s")
            print(f"  {mode}: rank {d['expert_rank']} died at {d['time_s']:.2f} s; spare ready after "
                  f"{d['time_to_replace_s']:.2f} s, TTFT back after "
                  + ("- (not within the run)" if back is None else f"{back:.2f} s"), file=sys.stderr, flush=True)
    if fo.get("group_failed"):
        print(f"  {mode}: the group failed at {fo['group_failed']['time_s']:.2f} s ({fo['group_failed']['reason']})",
              file=sys.stderr, flush=True)
    print(f"  {mode}: {fo['requests_failed']} requests failed", file=sys.stderr, flush=True)


def _f(v) -> str:
    return "     -" if v is None else f"{v:8.3f}"


def _compliance(summary: dict, modes, target: float) -> None:
    """Each mode's SLO-compliant throughput over its runs (``serving.slo_compliant_throughput``: a load counts only
    where the SLO holds AND served >= 0.9 of offered), what it served there, why it is withheld where it is
    None; and the ratio ASAP / baseline, None with ``ratio_withheld`` (the reason) where either is None."""
    from ..serving.metrics import served_at_load, slo_compliant_throughput, throughput_ratio, withheld_reason

    pts = {m: [r for r in summary["runs"] if r["mode"] == m] for m in modes}
    for m in modes:
        sct = slo_compliant_throughput(pts[m], target)
        summary[m]["slo_compliant_throughput"] = sct
        summary[m]["at_slo_compliant_load"] = served_at_load(pts[m], sct)
        summary[m]["withheld"] = withheld_reason(pts[m], target)
    if "async" in modes and "sync" in modes:
        summary["slo_compliant_throughput_ratio"], summary["ratio_withheld"] = throughput_ratio(
            summary["async"]["slo_compliant_throughput"], summary["sync"]["slo_compliant_throughput"],
            points=(pts["async"], pts["sync"]), target=target)


def _print_summary(summary: dict, modes, slo: float) -> None:
    print(f"\n{'mode':6s} {'TTFT p50 s':>11s} {'p90 s':>9s} {'p99 s':>9s} {'tok/s':>11s} {'SLO att.':>9s} "
          f"{'failed':>7s} {'SLO-compliant tok/s':>20s}")
    for m in modes:
        s = summary[m]
        sct = s.get("slo_compliant_throughput")
        print(f"{m:6s} {_f(s['ttft_p50_s']):>11s} {_f(s['ttft_p90_s']):>9s} {_f(s['ttft_p99_s']):>9s} "
              f"{s['throughput_tokens_per_s']:11.0f} {s['slo_attainment']:9.2f} {s['num_failed']:7d} "
              f"{'-' if sct is None else f'{sct:.0f}':>20s}")
    for m in modes:
        at = summary[m].get("at_slo_compliant_load")
        if at is not None:
            lane = at.get("lane")
            print(f"{m}: at its SLO-compliant load served {at['served_tokens_per_s']:.0f} tok/s "
                  f"({at['served_fraction']:.0%} of offered), TTFT p99 {at['ttft_p99_s']:.3f} s"
                  + ("" if not lane else f"; long-prompt lane: {lane['opened']} opened, {lane['waited']} waited "
                     f"for room, {lane['gave_up']} gave up"))
    for m in modes:
        if summary[m].get("withheld"):
            print(f"{m}: no SLO-compliant throughput: {summary[m]['withheld']}")
    if "slo_compliant_throughput_ratio" in summary:
        r = summary["slo_compliant_throughput_ratio"]
        print("SLO-compliant throughput, ASAP / baseline: "
              + (f"- ({summary.get('ratio_withheld')})" if r is None else f"{r:.2f}x") + f" (TTFT SLO {slo:.3f} s)")


# ----------------------------------------------------------------------------- memory (asap_comm.sim.costmodel.memory)
def memory_args(p: argparse.ArgumentParser) -> None:
    """--weights and --ignore-memory (sim run, headline)."""
    from .costmodel.memory import WEIGHT_DTYPES

    p.add_argument("--weights", choices=WEIGHT_DTYPES, default=None,
                   help="weight dtype, overriding the profile's (int8: W8A8, 1 byte and the INT8 GEMM peak; bf16: "
                        "2 bytes and the BF16 peak); default: the profile's")
    p.add_argument("--ignore-memory", action="store_true",
                   help="do not refuse a deployment whose dies cannot hold it (sensitivity studies); recorded in "
                        "the summary")


def check_memory(p: argparse.ArgumentParser, args, cost: CostModel, shapes: ModelShapes, cfg, par, W: int) -> tuple:
    """(the cost model with --weights applied, the summary's memory table, ``cfg`` with the lane's KV pool); an
    infeasible deployment exits 2 with one line naming the die, what it needs and what it has, unless
    --ignore-memory. With ``--lane-tokens auto``, ASAP's lane pool holds the most longest prompts, up to
    ``LANE_POOL_PROMPTS``, that its attention dies hold (``fitting_lane_tokens``)."""
    import dataclasses

    from .costmodel.memory import fitting_lane_tokens, memory_of, memory_problems, refusal, with_weights

    try:
        cost = CostModel(with_weights(cost.profile, args.weights), shapes)
    except ValueError as e:
        p.error(str(e))
    pool = None
    if args.lane_tokens == "auto" and cfg.long_prompt_lane and cfg.load_aware and cfg.num_attention_ranks >= 2:
        tokens, prompts = fitting_lane_tokens(
            lambda n: memory_of("async", dataclasses.replace(cfg, lane_tokens=n), par, W, cost.profile, shapes),
            cfg.max_prompt_len)
        cfg = dataclasses.replace(cfg, lane_tokens=tokens)
        pool = {"tokens": tokens, "prompts": prompts, "auto": True}
        print(f"long-prompt lane: a KV pool of {tokens} tokens ({prompts} longest prompt{'s' if prompts > 1 else ''}"
              f", what the attention dies hold)", file=sys.stderr, flush=True)
    table = {m: [d.describe() for d in dies] for m, dies in
             (("async", memory_of("async", cfg, par, W, cost.profile, shapes)),
              ("sync", memory_of("sync", cfg, par, W, cost.profile, shapes)))}
    problems = [x for m in ("async", "sync") for x in memory_problems(
        memory_of(m, cfg, par, W, cost.profile, shapes), cost.name)]
    if problems and not args.ignore_memory:
        hint = ("give more --expert-ranks" if "expert die" in problems[0] else "give more devices or larger "
                "--sync-tp / --attention-tp groups") + (", --weights int8" if cost.w > 1 else "") \
            + " or --ignore-memory"
        print(refusal("sim " + p.prog.split()[-1], problems, hint), file=sys.stderr)
        sys.exit(2)
    return cost, {"per_die": table, "problems": problems, "lane_pool": pool}, cfg


def cmd_memory(argv) -> int:
    from .costmodel.memory import main

    return main(argv)


# ----------------------------------------------------------------------------- calibrate / validate / headline
def cmd_calibrate(argv) -> int:
    from .calibrate.host import main

    return main(argv)


def cmd_validate(argv) -> int:
    from .calibrate.validate import main

    return main(argv)


def cmd_headline(argv) -> int:
    from .studies.headline import main

    return main(argv)


def cmd_skew(argv) -> int:
    from .studies.skew import main
    return main(argv)


def cmd_lane_study(argv) -> int:
    from .studies.lane_study import main

    return main(argv)


def cmd_scaling(argv) -> int:
    from .studies.scaling import main

    return main(argv)


def cmd_plan(argv) -> int:
    from .studies.plan import main

    return main(argv)


def cmd_barrier(argv) -> int:
    from .studies.barrier import main

    return main(argv)


def cmd_replot(argv) -> int:
    from .studies.figures import main

    return main(argv)


COMMANDS = {
    "calibrate": cmd_calibrate, "run": cmd_run, "validate": cmd_validate, "headline": cmd_headline,
    "memory": cmd_memory, "skew": cmd_skew,
    "lane-study": cmd_lane_study,  # ASAP's long-prompt lane: the design study (studies/lane_study.py)
    "scaling": cmd_scaling,  # best vs best at each cluster size, p90/p99, Mooncake/Azure (studies/scaling.py)
    "plan": cmd_plan,  # which mode and deployment to run at one size, trace and SLO (studies/plan.py)
    "barrier": cmd_barrier,  # the baseline's per-layer barrier against the expected-max model (studies/barrier.py)
    "replot": cmd_replot,  # a study's figures again from its result JSON (studies/figures.py): replot DIR [DIR...]
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        print(f"usage: python -m asap_comm.sim {{{'|'.join(COMMANDS)}}} --out DIR [options]", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])
