"""``python -m asap_comm.sim plan``: at my cluster size, with my trace and SLO, does ASAP beat my best synchronous
deployment, and with which split?

``plan --profile P --model M --dies N --trace T [--slo SECONDS] [--slo-percentile 90|99] --out DIR`` searches
the best memory-feasible deployment of each mode on ``N`` dies (``search_space.py``: the same breadth on both
sides, the load lattice, the pruning; the SLO, unless ``--slo`` gives it, is ``search_space.slo_rule``: 3x the
unloaded TTFT of the trace's p90 prompt on a fixed 32-die reference baseline) on the first window of the trace
(seed 0), then sweeps both winners again on two more windows (seeds 1 and 2: disjoint stretches of the trace)
for the spread. It writes ``DIR/plan.json`` and prints one screen:

* ``recommended``: ``"async"`` (run ASAP) or ``"sync"`` (run the synchronous baseline): the mode whose
  SLO-compliant throughput is higher on the median seed; a mode that sustains no load within the SLO, or whose
  deployments do not fit in memory, is never recommended over one that does;
* per mode (``async``, ``sync``): its best ``deployment``, ``slo_compliant_throughput`` (prompt tokens/s at the
  highest load it sustains within the SLO; null where none), ``served_fraction`` there, ``withheld`` (why null);
* ``ratio`` (ASAP / baseline on seed 0; null with ``ratio_withheld`` where either is withheld);
* ``memory``: the per-die memory of the two chosen deployments (``memory_table``: the same as text);
* ``spread``: both figures and the ratio on each of the 3 seeds, the ratio's min / median / max, and how many
  seeds agree with the recommendation;
* ``failover`` (only with ``--spare-expert-ranks N``, N in 0..2): for the chosen ASAP deployment at its planned load,
  one expert death in the middle of the window simulated with 0..N spares (the dip, the time to replace and to
  recover, requests failed, whether the SLO held), what the spares cost (dies that do no work until needed, and
  their memory) and ``recommended_spares`` with its ``reason`` (``spares.py``; ``--die-failures-per-day R`` and
  ``--repair-hours H`` size it against a death rate). Null figures with ``withheld`` where ASAP has no planned
  load.

A cluster too small to hold the model in either mode exits 2 with one line naming memory.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from ...serving.metrics import throughput_ratio
from ...serving.traces import TraceError
from ..costmodel.costs import CostModel
from ..costmodel.memory import WEIGHT_DTYPES, deployment_problems, memory_of, memory_table, with_weights
from ..costmodel.shapes import ModelShapes
from .scaling import QUICK_GRID, QUICK_REQUESTS, FULL_REQUESTS, mode_entry
from .search_space import (STEPS_PER_DOUBLING, Evaluator, load_search, load_windows, search_size, slo_rule,
                           structures)
from .spares import MAX_SPARES, spare_plan

__all__ = ["SEEDS", "recommend", "spread_summary", "memory_refusal", "main"]

SEEDS = (0, 1, 2)


def memory_refusal(cost, shapes, dies: int) -> "str | None":
    """One line naming memory when no structure of either mode fits on ``dies`` dies (None: one does)."""
    problems = {}
    for mode in ("async", "sync"):
        cands = structures(mode, dies, shapes, cost)
        probs = [deployment_problems(d, cost.profile, shapes) for d in cands]
        if cands and any(not p for p in probs):
            return None
        problems[mode] = next((p[0] for p in probs if p), "no deployment of this mode has that many dies")
    hint = "give more dies" + (" or --weights int8" if cost.w > 1 else "")
    return (f"plan: memory: neither mode holds {shapes.name} on {dies} {cost.name} dies (ASAP: "
            f"{problems['async'].removeprefix('memory: ')}; baseline: {problems['sync'].removeprefix('memory: ')}); "
            f"{hint}")


def recommend(per_seed: list) -> tuple:
    """``(recommended, agreeing seeds, reason)`` from each seed's ``(async, sync)`` SLO-compliant throughputs
    (None: withheld). A seed votes ``async`` where ASAP's figure is higher or the baseline's withheld, ``sync``
    where the baseline's is at least as high or ASAP's withheld, and nothing where both are withheld; the
    majority of votes decides (a tie, or no vote: ``sync``, the deployment the user runs today)."""
    votes = []
    for a, s in per_seed:
        if a is None and s is None:
            votes.append(None)
        elif s is None or (a is not None and a > s):
            votes.append("async")
        else:
            votes.append("sync")
    n_a, n_s = votes.count("async"), votes.count("sync")
    if n_a == 0 and n_s == 0:
        return "sync", 0, ("neither mode meets the SLO at a sustained load on any seed: loosen the SLO or add dies; "
                           "the baseline stays")
    rec = "async" if n_a > n_s else "sync"
    agree = max(n_a, n_s)
    why = (f"{'ASAP' if rec == 'async' else 'the baseline'} has the higher SLO-compliant throughput on "
           f"{agree} of {len(per_seed)} seeds")
    if n_a == n_s:
        why = f"the seeds split {n_a}-{n_s}: the baseline stays"
    return rec, agree, why


def spread_summary(per_seed: list, seeds=SEEDS) -> dict:
    """The spread over the seeds: each seed's figures and ratio, the ratio's min / median / max (over the seeds
    where it is not withheld)."""
    ratios = [throughput_ratio(a, s)[0] for a, s in per_seed]
    have = [r for r in ratios if r is not None]
    return {"seeds": list(seeds), "async": [a for a, _ in per_seed], "sync": [s for _, s in per_seed],
            "ratio": ratios, "ratio_min": min(have) if have else None,
            "ratio_median": statistics.median(have) if have else None, "ratio_max": max(have) if have else None}


def _lattice_index(ev: Evaluator, sct: float, mean_prompt: float) -> int:
    return round(STEPS_PER_DOUBLING * math.log2(sct / mean_prompt / ev.rate0))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:,.0f} tok/s"


def _percentile(p: argparse.ArgumentParser, value: str) -> int:
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    if v not in (90.0, 99.0):
        p.error(f"--slo-percentile {value!r}: expected 90 or 99")
    return int(v)


def _print_failover(fo: dict) -> None:
    """The spares' lines of the screen."""
    if fo.get("withheld"):
        print(f"\nspares: not sized: {fo['withheld']}")
        return
    print(f"\nspares: one expert rank dies at {fo['failure']['time_s']:.3g} s at the planned load; a spare serves it "
          f"after {fo['detect_s'] + fo['load_s']:.3g} s (its {fo['expert_rank_gb']:.3g} GB of experts at "
          f"{fo['checkpoint_read_gbps']:g} GB/s + {fo['spare_startup_s']:g} s)")
    for r in fo["runs"]:
        if r["group_failed"]:
            what = f"the group fails, {r['requests_failed']} requests failed"
        else:
            tp = r["served_tokens_per_s"]
            dip = "-" if r["dip"] is None else f"{r['dip']:.0%}"
            rec = "-" if r["recovered_after_s"] is None else f"{r['recovered_after_s']:.3g} s"
            off = r["offered_tokens_per_s"]["after"]
            after = "-" if not off or tp["after"] is None else f"{tp['after'] / off:.0%}"
            what = (f"served {dip} of before while replacing, the delayed requests done {rec} after the death, "
                    f"then {after} of offered; {r['requests_failed']} failed")
        print(f"  {r['spares']} spare(s) (+{r['extra_die_fraction']:.1%} dies): {what}; SLO "
              f"{'held' if r['slo_held'] else 'missed'} ({r['slo_attainment']:.1%} within it)")
    print(f"  recommended: {fo['recommended_spares']} spare(s): {fo['reason']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--profile", required=True, help="hardware profile (e.g. ascend-910c-cm384, h800-node)")
    p.add_argument("--model", required=True, help="model shapes (e.g. deepseek-v3)")
    p.add_argument("--dies", required=True, help="devices of the cluster (either deployment uses all of them)")
    p.add_argument("--trace", required=True, help="mooncake, azure, or a trace file (.jsonl Mooncake, .csv Azure)")
    p.add_argument("--slo", default=None, metavar="SECONDS",
                   help="TTFT SLO (default: 3x the unloaded TTFT of the trace's p90 prompt on the 32-die reference "
                        "baseline, search_space.slo_rule)")
    p.add_argument("--slo-percentile", default="90", metavar="90|99",
                   help="the share of requests that must meet the SLO")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", choices=WEIGHT_DTYPES, default=None,
                   help="weight dtype, overriding the profile's (int8: W8A8)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: TP8 only, CP none/8k, 16k chunks, the middle ASAP knobs, few requests")
    p.add_argument("--spare-expert-ranks", default=None, metavar="N",
                   help=f"size spare expert dies: simulate one expert death with 0..N spares (N <= {MAX_SPARES}) "
                        "on the chosen ASAP deployment at its planned load (plan.json 'failover')")
    p.add_argument("--die-failures-per-day", default=None, metavar="R",
                   help="deaths per die per day, to size the spares against (with --spare-expert-ranks)")
    p.add_argument("--repair-hours", default="24", metavar="H",
                   help="hours until a used spare is replaced (with --die-failures-per-day)")
    args = p.parse_args(argv)
    try:
        dies = int(args.dies)
    except ValueError:
        dies = 0
    if dies < 2:
        p.error(f"--dies {args.dies!r}: expected an int >= 2")
    pct = _percentile(p, args.slo_percentile)
    spares = per_day = None
    if args.spare_expert_ranks is not None:
        try:
            spares = int(args.spare_expert_ranks)
        except ValueError:
            spares = -1
        if not 0 <= spares <= MAX_SPARES:
            p.error(f"--spare-expert-ranks {args.spare_expert_ranks!r}: expected an int in 0..{MAX_SPARES}")
    if args.die_failures_per_day is not None:
        if spares is None:
            p.error("--die-failures-per-day needs --spare-expert-ranks")
        try:
            per_day = float(args.die_failures_per_day)
        except ValueError:
            per_day = float("nan")
        if not (per_day >= 0 and math.isfinite(per_day)):
            p.error(f"--die-failures-per-day {args.die_failures_per_day!r}: expected a number >= 0")
    try:
        repair_hours = float(args.repair_hours)
    except ValueError:
        repair_hours = float("nan")
    if not (repair_hours > 0 and math.isfinite(repair_hours)):
        p.error(f"--repair-hours {args.repair_hours!r}: expected a positive number of hours")
    slo_given = None
    if args.slo is not None:
        try:
            slo_given = float(args.slo)
        except ValueError:
            slo_given = float("nan")
        if not (slo_given > 0 and math.isfinite(slo_given)):
            p.error(f"--slo {args.slo!r}: expected a positive number of seconds")
    try:
        shapes = ModelShapes.load(args.model)
    except (ValueError, FileNotFoundError, KeyError) as e:
        p.error(f"--model {args.model!r}: {e}")
    try:
        cost = CostModel(with_weights(CostModel.load(args.profile, args.model).profile, args.weights), shapes)
    except (ValueError, FileNotFoundError, KeyError) as e:
        p.error(f"--profile {args.profile!r}: {e}")
    try:
        tw = load_windows(args.trace)
    except (TraceError, ValueError) as e:
        p.error(f"--trace {args.trace!r}: {e}")
    refusal = memory_refusal(cost, shapes, dies)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if slo_given is None:
        slo_s, rule = slo_rule(tw.requests, cost, shapes)
    else:
        slo_s, rule = slo_given, "given (--slo)"
    target = pct / 100
    grid = QUICK_GRID if args.quick else None
    n_min, n_max = QUICK_REQUESTS if args.quick else FULL_REQUESTS
    print(f"[plan] {tw.note}; {dies} dies; SLO {slo_s:.3g} s at p{pct} ({rule})", file=sys.stderr, flush=True)
    found = search_size(tw, cost, shapes, dies, slo_s, [target], n_min=n_min, n_max=n_max, grid=grid,
                        log=lambda m: print(f"  [plan] {m}", file=sys.stderr, flush=True))
    ev0, f = found["evaluator"], found["by_target"][target]
    entries = {m: mode_entry(f[m]) for m in ("async", "sync")}
    # the spread: both winners swept again on the other seeds' windows, from near seed 0's load
    per_seed = [(entries["async"]["slo_compliant_throughput"], entries["sync"]["slo_compliant_throughput"])]
    windows = [{"seed": 0, "first_request": 0}]
    for seed in SEEDS[1:]:
        ev = Evaluator(tw, cost, shapes, slo_s, ev0.rate0, seed=seed, n_min=n_min, n_max=n_max)
        windows.append({"seed": seed, "first_request": (seed % 3) * (len(tw.requests) // 3)})
        got = []
        for m in ("async", "sync"):
            best = f[m]["best"]
            if best is None:
                got.append(None)
                continue
            sct0 = entries[m]["slo_compliant_throughput"]
            mean = sum(r.prompt_len for r in tw.window(seed, n_min)) / n_min
            k0 = _lattice_index(ev, sct0, mean) if sct0 else -STEPS_PER_DOUBLING
            load_search(ev, best, target, None, k0, coarse=4)
            got.append(ev.result(best, target)["slo_compliant_throughput"])
            print(f"  [plan seed {seed}] {m}: {_fmt(got[-1])}", file=sys.stderr, flush=True)
        per_seed.append(tuple(got))
        for k in ("simulated", "bounded", "cached", "sim_wall_s"):
            ev0.stats[k] += ev.stats[k]
    spread = spread_summary(per_seed)
    spread["windows"] = windows
    rec, agree, why = recommend(per_seed)
    spread["agree"] = agree
    ratio, ratio_why = throughput_ratio(entries["async"]["slo_compliant_throughput"],
                                        entries["sync"]["slo_compliant_throughput"], target=target)
    if ratio_why:
        parts = [f"{n} {entries[m]['withheld']}" for n, m in (("ASAP", "async"), ("baseline", "sync"))
                 if entries[m]["slo_compliant_throughput"] is None]
        ratio_why = "ratio withheld: " + "; ".join(parts)
    dies_by_mode, memory = {}, {}
    for m, name in (("async", "ASAP"), ("sync", "baseline")):
        d = f[m]["best"]
        if d is not None:
            dies_by_mode[name] = memory_of(d.mode, d.cfg, d.par, d.sync_ranks, cost.profile, shapes)
            memory[m] = [x.describe() for x in dies_by_mode[name]]
        else:
            memory[m] = None
    table = memory_table(dies_by_mode) if dies_by_mode else "(no deployment chosen)"
    failover = None
    if spares is not None:
        sct = entries["async"]["slo_compliant_throughput"]
        if f["async"]["best"] is None or sct is None:
            failover = {"withheld": f"ASAP has no planned load ({entries['async']['withheld']})",
                        "recommended_spares": None}
        else:
            mean = sum(r.prompt_len for r in tw.window(0, n_min)) / n_min
            failover = spare_plan(f["async"]["best"], tw, cost, shapes, slo_s, target, sct,
                                  ev0.requests_at(sct / mean), dies, spares, memory["async"], per_day=per_day,
                                  repair_hours=repair_hours,
                                  log=lambda m: print(f"  [plan] {m}", file=sys.stderr, flush=True))
    wall = time.perf_counter() - t0
    plan = {"recommended": rec, "reason": why, "profile": cost.name, "model": shapes.name, "dies": dies,
            "trace": tw.note, "slo_s": slo_s, "slo_rule": rule, "slo_percentile": pct, "weights": args.weights,
            "quick": args.quick, "async": entries["async"], "sync": entries["sync"], "ratio": ratio,
            "ratio_withheld": ratio_why, "memory": memory, "memory_table": table, "spread": spread,
            "search": {"async": {"searched": entries["async"]["searched"], "infeasible": entries["async"]["infeasible"]},
                       "sync": {"searched": entries["sync"]["searched"], "infeasible": entries["sync"]["infeasible"]},
                       "requests_per_point": [n_min, n_max], **ev0.stats},
            "wall_s": wall}
    if failover is not None:
        plan["failover"] = failover
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=2, default=str))
    # one screen
    lab = {m: (entries[m]["deployment"] or {}).get("label", "none") for m in ("async", "sync")}
    print(f"plan: {shapes.name} on {dies} {cost.name} dies, trace {tw.note}")
    print(f"SLO {slo_s:.3g} s for {pct}% of requests ({rule})")
    r_txt = "-" if ratio is None else f"{ratio:.2f}x"
    print(f"\nrecommended: {'ASAP (async)' if rec == 'async' else 'the synchronous baseline (sync)'}: {why}")
    print(f"  ratio ASAP / baseline {r_txt}" + (f" ({ratio_why})" if ratio_why else "")
          + ("" if spread["ratio_min"] is None else
             f"; over {len(SEEDS)} seeds {spread['ratio_min']:.2f}x-{spread['ratio_max']:.2f}x "
             f"(median {spread['ratio_median']:.2f}x)"))
    for m, name in (("async", "best ASAP"), ("sync", "best baseline")):
        e = entries[m]
        served = "" if e["served_fraction"] is None else f", served {e['served_fraction']:.0%} of offered"
        seeds = " / ".join("-" if v is None else f"{v:,.0f}" for v in spread[m])
        print(f"  {name:14s} {lab[m]}")
        print(f"  {'':14s} {_fmt(e['slo_compliant_throughput'])}{served}"
              + (f" ({e['withheld']})" if e["slo_compliant_throughput"] is None else "") + f"; seeds {seeds}")
    print("\nmemory per die (GB) of the chosen deployments:")
    print(table)
    if failover is not None:
        _print_failover(failover)
    st = plan["search"]
    print(f"\nsearched {st['sync']['searched']} baseline and {st['async']['searched']} ASAP configurations "
          f"({st['sync']['infeasible'] + st['async']['infeasible']} left out for memory); {st['simulated']} runs "
          f"simulated, {st['bounded']} decided by the unloaded bound; {wall:.0f} s. {out / 'plan.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
