"""Load sweeps over the simulator: the TTFT SLO, SLO-compliant throughput, and one comparison of both modes.

* :func:`unloaded_slo`: the default TTFT SLO, the same rule as the runtime's
  example (``examples/prefill.py``): ``factor`` (3) times the unloaded prefill
  time of the trace's 90th-percentile prompt, here simulated alone on an empty
  system of the mode being measured. Production SLOs are set as a multiple of
  unloaded latency, and tying it to the modelled hardware keeps the default
  meaningful on any profile.
* :func:`find_slo_throughput`: sweeps offered load for one mode: doubles the
  request rate from a low start until the SLO fails (at least 90% of requests
  within it), then bisects (geometrically) between the last pass and the
  first fail; every tested point is kept and the result is
  ``asap_comm.serving.slo_compliant_throughput`` of them (tokens/s).
"""
from __future__ import annotations

import math
import sys

from ..serving.metrics import slo_compliant_throughput, summarize_run
from ..serving.runtime import RuntimeConfig
from ..serving.traces import Request, scale_trace
from .simulate import simulate

__all__ = ["at_rate", "mean_len", "unloaded_slo", "run_point", "capacity_rate", "find_slo_throughput", "compare"]


def mean_len(trace) -> float:
    return sum(r.prompt_len for r in trace) / len(trace)


def at_rate(trace, rate: float) -> list:
    """The trace with arrivals rescaled to ``rate`` requests/s (same shape of arrivals, same prompts)."""
    return scale_trace(trace, target_rate=rate)


def unloaded_slo(trace, cost, shapes, cfg: RuntimeConfig, *, factor: float = 3.0, mode: str = "sync",
                 sync_ranks: int | None = None) -> float:
    """``factor`` x the simulated unloaded TTFT of the trace's p90 prompt (see the module docstring)."""
    lens = sorted(min(r.prompt_len, cfg.max_prompt_len) for r in trace)
    p90 = lens[min(len(lens) - 1, int(0.9 * len(lens)))]
    res = simulate(mode, [Request(0, 0.0, p90)], cost, shapes, cfg, sync_ranks=sync_ranks)
    t = res.records[0].ttft_s
    if t is None:
        raise ValueError(f"unloaded_slo: the p90 prompt ({p90} tokens) failed: {res.records[0].error}")
    return factor * t


def run_point(mode: str, trace, rate: float, cost, shapes, cfg, slo: float, *, sync_ranks=None,
              spans: bool = False):
    """One simulated run at ``rate`` requests/s: (summary dict with the runtime's keys + extras, SimResult)."""
    res = simulate(mode, at_rate(trace, rate), cost, shapes, cfg, sync_ranks=sync_ranks, spans=spans)
    s = summarize_run(res.records, slo).as_dict()
    util = [r["utilisation"] for r in res.ranks for _ in range(r["stands_for"])]
    s.update(rate_req_s=rate, offered_tokens_per_s=rate * mean_len(trace),
             mean_utilisation=sum(util) / len(util), sim_events=res.events, sim_wall_s=res.wall_s)
    return s, res


def capacity_rate(trace, cost, shapes, cfg: RuntimeConfig, *, sync_ranks: int) -> float:
    """A rough saturation rate (requests/s): the baseline's ranks over the unloaded time of a mean prompt."""
    n = max(1, min(cfg.max_prompt_len, round(mean_len(trace))))
    one = simulate("sync", [Request(0, 0.0, n)], cost, shapes, cfg, sync_ranks=sync_ranks).records[0].ttft_s
    return sync_ranks / one


def find_slo_throughput(mode: str, trace, cost, shapes, cfg: RuntimeConfig, slo: float, *, start_rate: float,
                        sync_ranks=None, bisections: int = 4, max_doublings: int = 10,
                        progress: str | None = None, target: float = 0.9) -> dict:
    """Sweep one mode's load (see the module docstring). Returns the points and the SLO-compliant throughput.

    ``saturated`` is False when even the highest tested rate passed (the result is then a lower bound),
    ``arrival_span_over_slo`` how many SLOs the trace's arrivals span at the SLO-compliant rate: a
    trace much shorter than that measures a burst, not a sustained load.
    """
    points = []

    def point(rate: float) -> bool:
        s, _ = run_point(mode, trace, rate, cost, shapes, cfg, slo, sync_ranks=sync_ranks)
        points.append(s)
        if progress:
            p90 = s["ttft_p90_s"] if s["ttft_p90_s"] is not None else float("nan")
            print(f"  [{progress}] {mode:5s} {rate:10.4g} req/s {s['offered_tokens_per_s']:12.0f} tok/s  "
                  f"TTFT p90 {p90:8.3f} s  SLO att. {s['slo_attainment']:.2f}  ({s['sim_wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)
        return s["slo_attainment"] >= target

    lo, hi, rate = None, None, start_rate
    for _ in range(max_doublings):
        if point(rate):
            lo, rate = rate, rate * 2
        else:
            hi = rate
            break
    if lo is None:  # even the start failed: look lower
        rate = start_rate
        for _ in range(max_doublings):
            rate /= 4
            if point(rate):
                lo = rate
                break
            hi = rate
    if lo is not None and hi is not None:
        for _ in range(bisections):
            mid = math.sqrt(lo * hi)
            if point(mid):
                lo = mid
            else:
                hi = mid
    sct = slo_compliant_throughput([(p["offered_tokens_per_s"], p["slo_attainment"]) for p in points], target)
    span = None
    if lo is not None and len(trace) > 1:
        arrivals = at_rate(trace, lo)
        span = (arrivals[-1].arrival_s - arrivals[0].arrival_s) / slo
    return {"points": sorted(points, key=lambda p: p["rate_req_s"]), "slo_compliant_throughput": sct,
            "slo_compliant_rate_req_s": lo, "saturated": hi is not None, "arrival_span_over_slo": span}


def compare(trace, cost, shapes, cfg: RuntimeConfig, *, sync_ranks: int, slo: float | None = None,
            progress: str | None = None, modes=("async", "sync"), bisections: int = 4) -> dict:
    """Both modes' sweeps on one trace; the SLO defaults to :func:`unloaded_slo` of the baseline."""
    if slo is None:
        slo = unloaded_slo(trace, cost, shapes, cfg, sync_ranks=sync_ranks)
    start = 0.25 * capacity_rate(trace, cost, shapes, cfg, sync_ranks=sync_ranks)
    out = {"slo_s": slo, "mean_prompt_tokens": mean_len(trace), "num_requests": len(trace), "start_rate": start}
    for mode in modes:
        out[mode] = find_slo_throughput(mode, trace, cost, shapes, cfg, slo, sync_ranks=sync_ranks,
                                        progress=progress, start_rate=start, bisections=bisections)
        if out[mode]["arrival_span_over_slo"] is not None and out[mode]["arrival_span_over_slo"] < 3:
            print(f"  warning: at {mode}'s SLO-compliant rate the {len(trace)} arrivals span only "
                  f"{out[mode]['arrival_span_over_slo']:.1f} SLOs: use more requests for a sustained load",
                  file=sys.stderr, flush=True)
    a, s = (out.get("async", {}).get("slo_compliant_throughput"), out.get("sync", {}).get("slo_compliant_throughput"))
    out["ratio"] = a / s if a and s else None
    return out


