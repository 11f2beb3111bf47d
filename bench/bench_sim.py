"""Speed of the simulator itself: 10,000 Mooncake requests, DeepSeek-V3 (61 layers), 64 ranks.

Usage::

    python bench/bench_sim.py [--num-requests 10000] [--profile ascend-910c-cm384] [--rate R] [--out bench/results]

ASAP with 32 attention + 32 expert ranks and the 64-rank DP+EP baseline, the
headline's runtime settings (``asap_comm.sim.headline.headline_config``), the
first ``--num-requests`` requests of the Mooncake trace that ships with the package
(or the synthetic stand-in) rescaled to ``--rate`` requests/s (default: half the
baseline's rough capacity). Reports wall time, events and events/s per mode
(target: under 60 s per run on the 2-core reference host); writes
``sim_speed.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from asap_comm.sim.costs import CostModel
from asap_comm.sim.headline import headline_config, mooncake_trace
from asap_comm.sim.shapes import ModelShapes
from asap_comm.sim.simulate import simulate
from asap_comm.sim.study import at_rate, capacity_rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--rate", type=float, default=None)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    cost, shapes = CostModel.load(args.profile, "deepseek-v3"), ModelShapes.preset("deepseek-v3")
    cfg = headline_config(32, 32)
    trace, desc = mooncake_trace(args.num_requests)
    rate = args.rate or 0.5 * capacity_rate(trace, cost, shapes, cfg, sync_ranks=64)
    trace = at_rate(trace, rate)
    rows = {}
    for mode in ("async", "sync"):
        t0 = time.perf_counter()
        res = simulate(mode, trace, cost, shapes, cfg, sync_ranks=64)
        wall = time.perf_counter() - t0
        done = sum(1 for r in res.records if r.ok)
        rows[mode] = {"wall_s": wall, "events": res.events, "events_per_s": res.events / wall,
                      "requests_completed": done, "simulated_s": res.makespan_s}
        print(f"{mode:5s} {len(trace)} requests x {shapes.num_layers} layers, 64 ranks: {wall:6.1f} s wall, "
              f"{res.events} events ({res.events / wall:,.0f}/s), {done} completed, {res.makespan_s:.0f} s simulated",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_speed.json").write_text(json.dumps({"trace": desc, "rate_req_s": rate, "profile": cost.name,
                                                    "num_requests": len(trace), "modes": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
