"""``python -m asap_comm.sim lane-study --out DIR``: the design study of ASAP's long-prompt lane (issue 21).

Designs, each an ASAP deployment with the same devices (``lane.py`` has the models):

* **A** no lane, micro-batches filled first-come (ASAP before issue 21);
* **B** the sequence-pipelined lane (chunks over groups as a wavefront, per-layer KV latents put with a signal
  to the later chunks' groups) with token-balanced micro-batch pairs: what the runtime builds;
* **C** context parallelism across attention groups (each chunk shared by the groups, a KV all-gather and a
  group-local barrier every layer, chunks in order) with token-balanced pairs;
* **B4** B with lane chunks of ``chunk_len / 4`` tokens (a study knob, ``lane.LANE_SPLIT``: finer wavefront
  steps, shorter jobs beside the short prompts' micro-batches);
* **D** token-balanced micro-batch pairs alone.

For each deployment (910C profile, deepseek-v3; 32 dies: ASAP 2 x TP8 + 16 expert dies against the baseline
4 x TP8, EP32, with context parallelism; 64 dies: 4 x TP8 + 32 against 8 x TP8) and each trace (Mooncake,
arrivals spread over the file's 3-s timestamp steps, as the headline; and an afd-like one: the same file with
its same-timestamp bursts kept and prompts clipped at 64k, like the Mooncake-WildChat trace of the vLLM
afd-plugin study), it prints and writes: the TTFT of a solo 63.8k-token prompt, and the SLO-compliant
throughput at p90 and p99 (the share of requests within the TTFT SLO), against the best of three baseline
configurations (chunk 8k with CP above 16k, chunk 16k with CP above 32k, chunk 16k without CP; all_to_alls
hidden behind compute). SLO: Mooncake, 3 x the baseline's unloaded TTFT of the trace's p90 prompt (the
headline's rule); afd-like, their 50 s p99 SLO scaled by our time scale: the simulated solo 63.8k TTFT of the
baseline without CP (what they ran) over their measured 31.75 s. One
load search per design serves both percentiles (the points are shared; each percentile bisects on its own).
``DIR/lane_study.json`` and ``DIR/README.md`` (the table).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from ...serving.metrics import slo_compliant_throughput, sustains_slo, throughput_ratio, withheld_reason
from ...serving.protocol import RuntimeConfig
from ...serving.traces import Request, TraceError, load_trace, resolve_trace
from ..core import lane
from ..core.simulate import Parallelism, simulate
from ..core.sweep import capacity_rate, run_point, spread_buckets, unloaded_slo
from ..costmodel.costs import CostModel
from ..costmodel.shapes import ModelShapes

__all__ = ["DESIGNS", "DEPLOYMENTS", "main"]

SOLO = 63800  # tokens: the afd-plugin study's solo prompt (63.8k)
AFD_SLO_S, AFD_SOLO_BASELINE_S = 50.0, 31.75  # vLLM afd-plugin issue 170: p99 TTFT SLO; baseline solo 63.8k TTFT
DESIGNS = (  # (key, label, RuntimeConfig fields, lane design, lane chunks of chunk_len / this)
    ("A", "no lane", {"long_prompt_lane": False, "token_balanced": False}, "pipe", 1),
    ("B", "sequence-pipelined lane + token-balanced", {"long_prompt_lane": True, "token_balanced": True}, "pipe", 1),
    ("B4", "B with lane chunks of chunk_len / 4", {"long_prompt_lane": True, "token_balanced": True}, "pipe", 4),
    ("C", "CP across attention groups + token-balanced", {"long_prompt_lane": True, "token_balanced": True}, "cp", 1),
    ("D", "token-balanced alone", {"long_prompt_lane": False, "token_balanced": True}, "pipe", 1),
)


@contextlib.contextmanager
def _design(d: str, split: int):
    old = lane.LANE_SPLIT[0]
    lane.LANE_SPLIT[0] = split
    try:
        with lane.design(d):
            yield
    finally:
        lane.LANE_SPLIT[0] = old
# name: (ASAP attention groups, their TP, expert dies; baseline DP groups, their TP)
DEPLOYMENTS = {"32 dies": (2, 8, 16, 4, 8), "64 dies": (4, 8, 32, 8, 8)}
SYNC_CANDIDATES = ((8192, 16384), (16384, 32768), (16384, None))  # (chunk, CP threshold; None: no CP)


def _cfg(A: int, E: int, chunk: int, **kw) -> RuntimeConfig:
    return RuntimeConfig(num_attention_ranks=A, num_expert_ranks=E, token_budget=16384, chunk_len=chunk,
                         max_prompt_len=131072, expert_token_budget=32768, expert_deadline_s=0.001, **kw)


def traces(path: str, n: int) -> dict:
    mooncake, _g = spread_buckets(load_trace(path, limit=n, max_prompt_len=131072))
    afd = load_trace(path, limit=n, max_prompt_len=65536)  # same-timestamp bursts kept, prompts up to 64k
    return {"mooncake": mooncake, "afd-like": afd}


class _Sweep:
    """A load search of one configuration whose points serve several percentiles (``slo_compliant_throughput``
    of the shared points; each percentile doubles then bisects on its own, reusing every point run before).
    ``run(rate) -> (slo_attainment, served_fraction)``: a load passes where the SLO holds AND it is sustained
    (``serving.sustains_slo``)."""

    def __init__(self, run, start: float, tokens_per_req: float) -> None:
        self.run, self.start, self.mean = run, start, tokens_per_req
        self.points: dict = {}

    def ok(self, rate: float, target: float) -> bool:
        if rate not in self.points:
            self.points[rate] = self.run(rate)
        return sustains_slo(*self.points[rate], target)

    def search(self, target: float, bisections: int, max_steps: int = 8) -> dict:
        lo, hi, r = None, None, self.start
        for _ in range(max_steps):
            if self.ok(r, target):
                lo, r = r, r * 2
            else:
                hi = r
                break
        if lo is None:
            r = self.start
            for _ in range(max_steps):
                r /= 4
                if self.ok(r, target):
                    lo = r
                    break
                hi = r
        if lo is not None and hi is not None:
            for _ in range(bisections):
                mid = math.sqrt(lo * hi)
                if self.ok(mid, target):
                    lo = mid
                else:
                    hi = mid
        pts = [(rate * self.mean, a, f) for rate, (a, f) in self.points.items()]
        sct = slo_compliant_throughput(pts, target)
        return {"slo_compliant_throughput": sct, "saturated": hi is not None, "points": pts,
                "withheld": withheld_reason(pts, target)}


def _solo(mode, cost, shapes, cfg, sync_ranks, par) -> float:
    return simulate(mode, [Request(0, 0.0, SOLO)], cost, shapes, cfg, sync_ranks=sync_ranks, par=par).records[0].ttft_s


def study(cost, shapes, trace_path: str, n: int, bisections: int, deployments, progress: bool = True) -> dict:
    tr = traces(trace_path, n)
    out = {"deployments": {}}
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if progress:
            print(f"  [lane-study {time.perf_counter() - t0:6.0f} s] {msg}", file=sys.stderr, flush=True)

    for dname in deployments:
        A, tp, E, W, stp = DEPLOYMENTS[dname]
        apar = Parallelism(attention_tp=tp)
        syncs = [(f"DP+EP {W} x TP{stp}, {'no CP' if cp is None else f'CP > {cp}'}, chunk {ch}, overlap", _cfg(A, E, ch),
                  Parallelism(sync_tp=stp, cp_threshold=cp, sync_overlap=True)) for ch, cp in SYNC_CANDIDATES]
        asyncs = [(key, label, dataclasses.replace(_cfg(A, E, 8192), **fields), (d, sp))
                  for key, label, fields, d, sp in DESIGNS]
        dep = {"asap": f"ASAP {A} x TP{tp} + {E} expert dies, chunk 8192", "baseline_candidates": [s[0] for s in syncs],
               "solo_63k_ttft_s": {}, "traces": {}}
        for label, scfg, spar in syncs:
            dep["solo_63k_ttft_s"][label] = _solo("sync", cost, shapes, scfg, W, spar)
        for key, label, acfg, d in asyncs:
            with _design(*d):
                dep["solo_63k_ttft_s"][key] = _solo("async", cost, shapes, acfg, None, apar)
        say(f"{dname}: solo 63.8k TTFT " + "; ".join(f"{k} {v:.2f} s" for k, v in dep["solo_63k_ttft_s"].items()))
        # their baseline ran without context parallelism: its solo TTFT sets our time scale against theirs
        scale_solo = dep["solo_63k_ttft_s"][syncs[-1][0]]
        for tname, trace in tr.items():
            scfg0, spar0 = syncs[0][1], syncs[0][2]
            if tname == "afd-like":
                slo = AFD_SLO_S / AFD_SOLO_BASELINE_S * scale_solo
                rule = (f"their {AFD_SLO_S:g} s x our no-CP baseline's solo 63.8k ({scale_solo:.2f} s) / their "
                        f"{AFD_SOLO_BASELINE_S} s")
            else:
                slo = min(unloaded_slo(trace, cost, shapes, s[1], sync_ranks=W, par=s[2]) for s in syncs)
                rule = "3 x the baseline's unloaded TTFT of the p90 prompt"
            start = 0.25 * capacity_rate(trace, cost, shapes, scfg0, sync_ranks=W, par=spar0)
            mean = sum(r.prompt_len for r in trace) / len(trace)
            row = {"slo_s": slo, "slo_rule": rule, "num_requests": len(trace), "mean_prompt": mean, "results": {}}

            def runner(mode, cfg, par, sync_ranks, d=("pipe", 1)):
                def run(rate):
                    with _design(*d):
                        s, _ = run_point(mode, trace, rate, cost, shapes, cfg, slo, sync_ranks=sync_ranks, par=par)
                    return s["slo_attainment"], s["served_fraction"]
                return run

            row["results"] = {"p90": {}, "p99": {}}
            sweeps = [(label, runner("sync", c, p, W)) for label, c, p in syncs]
            sweeps += [(key, runner("async", c, apar, None, d)) for key, _l, c, d in asyncs]
            for label, run in sweeps:
                sw = _Sweep(run, start, mean)
                for pct, target in (("p90", 0.9), ("p99", 0.99)):
                    row["results"][pct][label] = sw.search(target, bisections)
                say(f"{dname} {tname} {label}: "
                    + ", ".join(f"{pct} {_k(row['results'][pct][label])}" for pct in ("p90", "p99"))
                    + f" ({len(sw.points)} runs)")
            for pct in ("p90", "p99"):
                res = row["results"][pct]
                base = max((res[s[0]]["slo_compliant_throughput"] or 0.0, -i, s[0]) for i, s in enumerate(syncs))
                base = (base[0], base[2] if base[0] else None)  # None: no baseline meets the SLO at any load
                row.setdefault("best_baseline", {})[pct] = base[1]
                target = 0.9 if pct == "p90" else 0.99
                got = {key: throughput_ratio(res[key]["slo_compliant_throughput"], base[0] or None,
                                             names=(key, "the best baseline"), target=target,
                                             points=(res[key]["points"], res[base[1]]["points"] if base[1] else
                                                     [p for s in syncs for p in res[s[0]]["points"]]))
                       for key, *_ in DESIGNS}
                row.setdefault("ratio", {})[pct] = {key: g[0] for key, g in got.items()}
                row.setdefault("ratio_withheld", {})[pct] = {key: g[1] for key, g in got.items() if g[1]}
            dep["traces"][tname] = row
        out["deployments"][dname] = dep
    out["wall_s"] = time.perf_counter() - t0
    return out


def _k(r: dict) -> str:
    v = r["slo_compliant_throughput"]
    return "-" if v is None else f"{'' if r['saturated'] else '>='}{v:,.0f} tok/s"


def table(res: dict) -> str:
    lines = ["| deployment | trace | SLO | design | solo 63.8k TTFT s | p90 tok/s | p90 ratio | p99 tok/s | p99 ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for dname, dep in res["deployments"].items():
        for tname, row in dep["traces"].items():
            for key, label, *_ in DESIGNS:
                cells = []
                for pct in ("p90", "p99"):
                    r = row["results"][pct][key]
                    ratio = row["ratio"][pct][key]
                    cells += [_k(r), "-" if ratio is None else f"{ratio:.2f}x"]
                lines.append(f"| {dname} | {tname} | {row['slo_s']:.2f} s | {key}: {label} | "
                             f"{dep['solo_63k_ttft_s'][key]:.2f} | " + " | ".join(cells) + " |")
            for pct in ("p90", "p99"):
                b = row["best_baseline"][pct]
                if b is None:
                    lines.append(f"| {dname} | {tname} | | best baseline at {pct}: none meets the SLO at any load | | "
                                 + ("- | | | |" if pct == "p90" else " | | - | |"))
                    continue
                r = row["results"][pct][b]
                lines.append(f"| {dname} | {tname} | | best baseline at {pct}: {b} | "
                             f"{dep['solo_63k_ttft_s'][b]:.2f} | " + (f"{_k(r)} | 1.00x | | |" if pct == "p90"
                                                                     else f" | | {_k(r)} | 1.00x |"))
    return "\n".join(lines)


def write_readme(out: Path, res: dict, notes: str = "") -> str:
    t = table(res)
    (out / "README.md").write_text("# Long-prompt lane: design study (simulator)\n\n" + (__doc__.split("\n\n", 1)[1])
                                   + f"\n\nCommand: `{res['config']['command']}` ({res['wall_s']:.0f} s).\n\n" + t
                                   + "\n" + notes)
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim lane-study", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trace", default="mooncake",
                   help="the Mooncake conversation trace: mooncake (the copy that ships with the package) or a .jsonl")
    p.add_argument("--num-requests", type=int, default=120, help="requests of each trace (the first ones)")
    p.add_argument("--bisections", type=int, default=2, help="bisection steps of each load search")
    p.add_argument("--deployments", default=",".join(DEPLOYMENTS), help="comma-separated: " + ", ".join(DEPLOYMENTS))
    p.add_argument("--profile", default="ascend-910c-cm384")
    args = p.parse_args(argv)
    deps = [d.strip() for d in args.deployments.split(",") if d.strip()]
    bad = [d for d in deps if d not in DEPLOYMENTS]
    if bad or not deps:
        p.error(f"--deployments {args.deployments!r}: each must be one of {list(DEPLOYMENTS)}")
    if args.num_requests < 10 or args.bisections < 0:
        p.error(f"--num-requests {args.num_requests} must be >= 10 and --bisections {args.bisections} >= 0")
    try:
        path = str(resolve_trace(args.trace))
    except TraceError as e:
        p.error(f"--trace {args.trace}: {e}")
    cost, shapes = CostModel.load(args.profile, "deepseek-v3"), ModelShapes.load("deepseek-v3")
    res = study(cost, shapes, path, args.num_requests, args.bisections, deps)
    res["config"] = {"profile": cost.name, "model": shapes.name, "trace": Path(path).name,
                     "num_requests": args.num_requests, "bisections": args.bisections,
                     "designs": {k: {"label": lab, "fields": f, "lane_design": d, "lane_chunk_divisor": sp}
                                 for k, lab, f, d, sp in DESIGNS},
                     "command": "python -m asap_comm.sim lane-study " + " ".join(argv or sys.argv[2:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lane_study.json").write_text(json.dumps(res, indent=2, default=str))
    print(write_readme(out, res))
    print(f"artifacts in {out}/ ({res['wall_s']:.0f} s)")
    return 0

