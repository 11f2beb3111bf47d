"""Speed of the simulator itself: 100,000 Mooncake requests, DeepSeek-V3 (61 layers), 384 and 768 dies.

Usage::

    python bench/bench_sim.py [--num-requests 100000] [--dies 384,768] [--chunks 2048,16384] [--modes async,sync]
                              [--profile ascend-910c-cm384] [--rate-per-die R] [--out bench/results]

Per size: ASAP with ``dies / 3`` expert dies and the rest as TP8 attention groups (384 dies: 32 x TP8 + 128)
against the baseline's ``dies / 8`` TP8 DP groups with context parallelism above 4096 tokens (384 dies: 48 x TP8),
the headline's runtime settings (``asap_comm.sim.studies.headline.headline_config``) at each chunk size (token budget 16k).
The trace: the Mooncake conversation trace that ships with the package, repeated end to end until it has
``--num-requests`` requests (the file has about 12k), arrivals rescaled to ``--rate-per-die`` x dies requests/s
(default 8 req/s at 384 dies, the issue's load; the served fraction is printed, since a mode that does not sustain
the load queues without bound: measured 2026-12-05, ASAP's 32 x TP8 + 128 with 16k chunks served 0.48 of it and the
baseline with 2k chunks 0.82). Reports per mode and point
the event loop that ran (``core``: ASAP's native one, ``asap_comm/sim/core/native.py``, unless ``ASAP_SIM_NATIVE=0``),
the wall time, events, events/s, requests/s and the served fraction; writes ``sim_speed.json`` under ``--out``.
The issue's target: 30 s per mode at 384 dies, one core (``taskset -c 1``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from asap_comm.serving.traces import Request
from asap_comm.sim.core.simulate import Parallelism, simulate
from asap_comm.sim.core.sweep import at_rate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies.grids import headline_config, mooncake_trace

RATE_PER_DIE = 8.0 / 384  # requests/s per die: 8 req/s at 384 dies


def repeated_trace(n: int) -> tuple[list, str]:
    """The Mooncake trace (``headline.mooncake_trace``) repeated end to end up to ``n`` requests (ids renumbered,
    each copy after the last one's arrivals, one mean gap later)."""
    base, desc = mooncake_trace(n)
    if len(base) >= n:
        return base[:n], desc
    span = base[-1].arrival_s - base[0].arrival_s
    gap = span / max(1, len(base) - 1)
    out, k = [], 0
    while len(out) < n:
        off = k * (span + gap)
        out += [Request(len(out) + i, r.arrival_s + off, r.prompt_len) for i, r in enumerate(base[:n - len(out)])]
        k += 1
    return out, f"{desc}, repeated {k} times to {n} requests"


def deployments(dies: int, chunk: int) -> dict:
    """(cfg, par, sync_ranks) per mode at ``dies`` (a multiple of 24)."""
    if dies % 24:
        raise SystemExit(f"bench_sim: --dies {dies} must be a multiple of 24 (TP8 groups and a third for experts)")
    e = dies // 3
    cfg = headline_config((dies - e) // 8, e, chunk=chunk, budget=16384)
    return {"async": (cfg, Parallelism(attention_tp=8), None),
            "sync": (cfg, Parallelism(sync_tp=8, cp_threshold=4096), dies // 8)}


def measure(mode: str, trace, cost, shapes, dies: int, chunk: int) -> dict:
    cfg, par, W = deployments(dies, chunk)[mode]
    t0 = time.perf_counter()
    res = simulate(mode, trace, cost, shapes, cfg, sync_ranks=W, par=par)
    wall = time.perf_counter() - t0
    ok = [r for r in res.records if r.ok]
    span = max(r.done_s for r in ok) - min(r.arrival_s for r in trace) if ok else 0.0
    offered = sum(r.prompt_len for r in trace) / max(1e-9, trace[-1].arrival_s - trace[0].arrival_s)
    served = sum(r.prompt_len for r in ok) / span if span else 0.0
    return {"core": res.core, "wall_s": wall, "events": res.events, "events_per_s": res.events / wall,
            "requests_per_s": len(trace) / wall, "requests_completed": len(ok), "simulated_s": res.makespan_s,
            "served_fraction": served / offered}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=100000)
    p.add_argument("--dies", default="384,768")
    p.add_argument("--chunks", default="2048,16384")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--rate-per-die", type=float, default=RATE_PER_DIE)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    cost, shapes = CostModel.load(args.profile, "deepseek-v3"), ModelShapes.preset("deepseek-v3")
    base, desc = repeated_trace(args.num_requests)
    rows = []
    for dies in [int(x) for x in args.dies.split(",") if x]:
        rate = args.rate_per_die * dies
        trace = at_rate(base, rate)
        for chunk in [int(x) for x in args.chunks.split(",") if x]:
            for mode in [m for m in args.modes.split(",") if m]:
                row = {"dies": dies, "chunk": chunk, "mode": mode, "rate_req_s": rate,
                       **measure(mode, trace, cost, shapes, dies, chunk)}
                rows.append(row)
                print(f"{mode:5s} ({row['core']}) {dies} dies, chunk {chunk:5d}, {len(trace)} requests at "
                      f"{rate:g} req/s: "
                      f"{row['wall_s']:7.1f} s wall, {row['events']} events ({row['events_per_s']:,.0f}/s, "
                      f"{row['requests_per_s']:,.0f} requests/s), served {row['served_fraction']:.2f} of offered",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_speed.json").write_text(json.dumps({"trace": desc, "profile": cost.name,
                                                    "num_requests": len(base), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
