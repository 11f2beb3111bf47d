"""Load sweeps over the simulator: the TTFT SLO, SLO-compliant throughput, and one comparison of both modes.

* :func:`unloaded_slo`: the default TTFT SLO, the one rule of every tool
  (``asap_comm.serving.slo.auto_slo``): ``factor`` (3) times the unloaded prefill
  time of the trace's 90th-percentile prompt, here simulated alone on an empty
  system of the mode being measured. Production SLOs are set as a multiple of
  unloaded latency, and tying it to the modelled hardware keeps the default
  meaningful on any profile.
* :func:`find_slo_throughput`: sweeps offered load for one mode: doubles the
  request rate from a low start until a load fails (fewer than ``target``,
  by default 90%, of requests within the SLO, OR served tokens/s below 0.9 of
  offered: the load is not sustained, ``asap_comm.serving.sustains_slo``), then
  bisects (geometrically) between the last pass and the first fail on that
  combined criterion; every tested point is kept and the result is
  ``asap_comm.serving.slo_compliant_throughput`` of them (tokens/s; None, the
  figure withheld, where no tested load is sustained and compliant). When the
  start already fails it first tries a near-zero load
  (``start / 4**max_doublings``, requests alone): if that fails the SLO
  fails at every load (None); else it divides the rate by 4 until a pass.

Every function takes ``par`` (:class:`~asap_comm.sim.core.simulate.Parallelism`:
TP groups, context parallelism; default one device per rank) and passes it
to :func:`~asap_comm.sim.core.simulate.simulate`.

* :func:`search_best`: the best :class:`Deployment` of a list under one SLO: a coarse load search of
  every candidate on a short trace, then the few best confirmed on the full trace (the headline's
  best-vs-best search).
"""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass

from ...serving.metrics import (MIN_SERVED, served_at_load, served_fraction, slo_compliant_throughput, summarize_run,
                                sustains_slo, throughput_ratio, withheld_reason)
from ...serving.protocol import RuntimeConfig
from ...serving.slo import SLO_MULTIPLIER, auto_slo, p90_prompt_len
from ...serving.traces import Request, scale_trace
from .simulate import Parallelism, simulate

__all__ = ["percentile_target", "parse_slo", "spread_buckets", "at_rate", "mean_len", "p90_prompt", "unloaded_slo", "run_point",
           "capacity_rate", "find_slo_throughput", "compare", "Deployment", "sweep_deployment", "search_best",
           "search_rate"]


def percentile_target(p: float) -> float:
    """An SLO percentile (the share of requests that must meet the SLO, in percent) as an attainment target."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 100:
        raise ValueError(f"SLO percentile {p!r} must be a number in (0, 100]")
    return p / 100.0


def parse_slo(value: str) -> "float | None":
    """A TTFT SLO argument: a positive number of seconds, or ``auto`` (None: the rule of the caller)."""
    if value == "auto":
        return None
    try:
        v = float(value)
    except ValueError:
        v = float("nan")
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{value!r} is not a positive number of seconds or 'auto'")
    return v


def spread_buckets(trace: list) -> tuple[list, float]:
    """Arrivals spread evenly over their timestamp bucket; returns (trace, bucket seconds).

    The published Mooncake conversation trace gives timestamps in 3-s steps (up to 28 requests share one),
    an artefact of its rounding, not arrivals at one instant: taken as is, every rescaled load has bursts of
    simultaneous arrivals that no deployment can serve within a few seconds. A bucket of ``k`` requests at
    ``t`` becomes arrivals ``t + i * g / k`` (``g``: the most common gap between distinct timestamps, the
    rounding step), in file order. The rate and the burstiness above ``g`` are unchanged.
    """
    times = sorted({r.arrival_s for r in trace})
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:]) if b > a]
    if not gaps:
        return list(trace), 0.0
    g = max(set(gaps), key=lambda x: (gaps.count(x), -x))
    out, i = [], 0
    while i < len(trace):
        j = i
        while j < len(trace) and trace[j].arrival_s == trace[i].arrival_s:
            j += 1
        k = j - i
        for m, r in enumerate(trace[i:j]):
            out.append(Request(r.request_id, r.arrival_s + m * g / k, r.prompt_len, r.output_len))
        i = j
    return out, g


def mean_len(trace) -> float:
    return sum(r.prompt_len for r in trace) / len(trace)


def at_rate(trace, rate: float) -> list:
    """The trace with arrivals rescaled to ``rate`` requests/s (same shape of arrivals, same prompts)."""
    return scale_trace(trace, target_rate=rate)


def p90_prompt(trace, cfg: RuntimeConfig) -> int:
    """The trace's 90th-percentile prompt length (clipped at ``cfg.max_prompt_len``; ``serving.slo``)."""
    return p90_prompt_len((r.prompt_len for r in trace), cfg.max_prompt_len)


def unloaded_slo(trace, cost, shapes, cfg: RuntimeConfig, *, factor: float = SLO_MULTIPLIER, mode: str = "sync",
                 sync_ranks: int | None = None, par: Parallelism | None = None) -> float:
    """``factor`` x the simulated unloaded TTFT of the trace's p90 prompt (``serving.slo.auto_slo``)."""

    def alone(p90: int) -> float:
        res = simulate(mode, [Request(0, 0.0, p90)], cost, shapes, cfg, sync_ranks=sync_ranks, par=par)
        if res.records[0].ttft_s is None:
            raise ValueError(f"unloaded_slo: the p90 prompt ({p90} tokens) failed: {res.records[0].error}")
        return res.records[0].ttft_s

    return auto_slo([r.prompt_len for r in trace], alone, max_prompt_len=cfg.max_prompt_len,
                    multiplier=factor).ttft_s


def run_point(mode: str, trace, rate: float, cost, shapes, cfg, slo: float, *, sync_ranks=None,
              spans: bool = False, par: Parallelism | None = None, failures=None):
    """One simulated run at ``rate`` requests/s: (summary dict with the runtime's keys + extras, SimResult).
    ``failures``: expert deaths ``[(time_s, rank)]`` (``simulate``'s); their outcome is the summary's ``failover``."""
    res = simulate(mode, at_rate(trace, rate), cost, shapes, cfg, sync_ranks=sync_ranks, spans=spans, par=par,
                   slo_s=slo, failures=failures)
    s = summarize_run(res.records, slo).as_dict()
    util = [r["utilisation"] for r in res.ranks for _ in range(r["stands_for"])]
    s.update(rate_req_s=rate, offered_tokens_per_s=rate * mean_len(trace),
             mean_utilisation=sum(util) / len(util), sim_events=res.events, sim_wall_s=res.wall_s)
    if res.lane:
        s["lane"] = res.lane
    if res.failover:
        s["failover"] = res.failover
    return s, res


def capacity_rate(trace, cost, shapes, cfg: RuntimeConfig, *, sync_ranks: int,
                  par: Parallelism | None = None) -> float:
    """A rough saturation rate (requests/s): the baseline's ranks over the unloaded time of a mean prompt."""
    n = max(1, min(cfg.max_prompt_len, round(mean_len(trace))))
    one = simulate("sync", [Request(0, 0.0, n)], cost, shapes, cfg, sync_ranks=sync_ranks,
                   par=par).records[0].ttft_s
    return sync_ranks / one


def find_slo_throughput(mode: str, trace, cost, shapes, cfg: RuntimeConfig, slo: float, *, start_rate: float,
                        sync_ranks=None, bisections: int = 4, max_doublings: int = 10,
                        progress: str | None = None, target: float = 0.9, par: Parallelism | None = None,
                        min_served: float = MIN_SERVED) -> dict:
    """Sweep one mode's load (see the module docstring). Returns the points and the SLO-compliant throughput.

    ``saturated`` is False when even the highest tested rate passed (the result is then a lower bound),
    ``arrival_span_over_slo`` how many SLOs the trace's arrivals span at the SLO-compliant rate: a
    trace much shorter than that (10) measures a burst, not a sustained load (a backlog hides in the one SLO
    of drain that ``serving.served_fraction``'s window allows). ``served_fraction``: served over offered tokens/s at the SLO-compliant load
    (None where there is none); ``withheld``: why there is none (``withheld_reason``), else None.
    """
    points = []

    def point(rate: float) -> bool:
        s, _ = run_point(mode, trace, rate, cost, shapes, cfg, slo, sync_ranks=sync_ranks, par=par)
        points.append(s)
        if progress:
            p90 = s["ttft_p90_s"] if s["ttft_p90_s"] is not None else float("nan")
            print(f"  [{progress}] {mode:5s} {rate:10.4g} req/s {s['offered_tokens_per_s']:12.0f} tok/s  "
                  f"TTFT p90 {p90:8.3f} s  SLO att. {s['slo_attainment']:.2f}  served {s['served_fraction']:4.0%}"
                  f"  ({s['sim_wall_s']:.1f} s)", file=sys.stderr, flush=True)
        return sustains_slo(s["slo_attainment"], s["served_fraction"], target, min_served=min_served)

    lo, hi, rate = None, None, start_rate
    for _ in range(max_doublings):
        if point(rate):
            lo, rate = rate, rate * 2
        else:
            hi = rate
            break
    if lo is None:  # even the start failed: look lower
        floor = start_rate / 4 ** max_doublings
        if not point(floor):  # requests alone: no load can do better, so the SLO fails at every load
            hi = floor
        else:
            rate = start_rate
            for _ in range(max_doublings - 1):
                rate /= 4
                if point(rate):
                    lo = rate
                    break
                hi = rate
            if lo is None:
                lo = floor
    if lo is not None and hi is not None:
        for _ in range(bisections):
            mid = math.sqrt(lo * hi)
            if point(mid):
                lo = mid
            else:
                hi = mid
    sct = slo_compliant_throughput(points, target, min_served=min_served)
    at = served_at_load(points, sct)
    span = None
    if lo is not None and len(trace) > 1:
        arrivals = at_rate(trace, lo)
        span = (arrivals[-1].arrival_s - arrivals[0].arrival_s) / slo
    return {"points": sorted(points, key=lambda p: p["rate_req_s"]), "slo_compliant_throughput": sct,
            "at_slo_compliant_load": at, "served_fraction": None if at is None else at["served_fraction"],
            "withheld": withheld_reason(points, target, min_served=min_served),
            "slo_compliant_rate_req_s": lo, "saturated": hi is not None, "arrival_span_over_slo": span}


def compare(trace, cost, shapes, cfg: RuntimeConfig, *, sync_ranks: int, slo: float | None = None,
            progress: str | None = None, modes=("async", "sync"), bisections: int = 4, target: float = 0.9,
            par: Parallelism | None = None, sync_cfg: RuntimeConfig | None = None) -> dict:
    """Both modes' sweeps on one trace; the SLO defaults to :func:`unloaded_slo` of the baseline.

    ``sync_cfg``: the baseline's runtime settings when they differ from ASAP's (its chunk size), else ``cfg``.
    """
    scfg = cfg if sync_cfg is None else sync_cfg
    if slo is None:
        slo = unloaded_slo(trace, cost, shapes, scfg, sync_ranks=sync_ranks, par=par)
    start = 0.25 * capacity_rate(trace, cost, shapes, scfg, sync_ranks=sync_ranks, par=par)
    out = {"slo_s": slo, "mean_prompt_tokens": mean_len(trace), "num_requests": len(trace), "start_rate": start,
           "target": target}
    for mode in modes:
        out[mode] = find_slo_throughput(mode, trace, cost, shapes, cfg if mode == "async" else scfg, slo,
                                        sync_ranks=sync_ranks, progress=progress, start_rate=start,
                                        bisections=bisections, target=target, par=par)
        if out[mode]["arrival_span_over_slo"] is not None and out[mode]["arrival_span_over_slo"] < SPAN_SLOS:
            print(f"  warning: at {mode}'s SLO-compliant rate the {len(trace)} arrivals span only "
                  f"{out[mode]['arrival_span_over_slo']:.1f} SLOs (< {SPAN_SLOS}): a burst, not a sustained load; "
                  "use more requests", file=sys.stderr, flush=True)
    out["ratio"], out["ratio_withheld"] = None, None
    if "async" in out and "sync" in out:
        out["ratio"], out["ratio_withheld"] = throughput_ratio(
            out["async"]["slo_compliant_throughput"], out["sync"]["slo_compliant_throughput"],
            points=(out["async"]["points"], out["sync"]["points"]), target=target)
    return out


#: The fewest SLOs the arrivals should span at a measured load (``serving.metrics.served_fraction``'s window).
SPAN_SLOS = 10




# ----------------------------------------------------------------------------- best configuration
@dataclass(frozen=True)
class Deployment:
    """One configuration of one mode (what the best-configuration search ranges over).

    ``cfg``: the runtime settings (ASAP's attention and expert ranks, chunk size, budgets); ``par``: attention
    groups' TP degree and the baseline's context parallelism; ``sync_ranks``: the baseline's DP groups.
    """

    mode: str
    cfg: RuntimeConfig
    par: Parallelism = Parallelism()
    sync_ranks: "int | None" = None

    def __post_init__(self) -> None:
        if self.mode not in ("async", "sync"):
            raise ValueError(f"Deployment: mode must be 'async' or 'sync', got {self.mode!r}")
        if self.mode == "sync" and self.sync_ranks is None:
            raise ValueError("Deployment: a 'sync' deployment needs sync_ranks")

    @property
    def devices(self) -> int:
        """Devices it occupies: ``A * attention_tp + E`` (ASAP) or ``sync_ranks * sync_tp`` (baseline)."""
        if self.mode == "async":
            return self.cfg.num_attention_ranks * self.par.attention_tp + self.cfg.num_expert_ranks
        return self.sync_ranks * self.par.sync_tp

    @property
    def label(self) -> str:
        chunk = "whole prompts" if self.cfg.effective_chunk_len is None else f"chunk {self.cfg.effective_chunk_len}"
        if self.cfg.token_budget != self.cfg.effective_chunk_len and (
                self.mode == "sync" or self.cfg.effective_chunk_len is not None):
            chunk += f", budget {self.cfg.token_budget}"
        if self.mode == "async":
            tp = "" if self.par.attention_tp == 1 else f" x TP{self.par.attention_tp}"
            c = self.cfg
            # the expert side's batching, where it is not the headline's default (1 ms, 32768 rows)
            ex = ("" if (c.expert_deadline_s, c.expert_token_budget) == (0.001, 32768)
                  else f", experts {1e3 * c.expert_deadline_s:g} ms / {c.expert_token_budget} rows")
            lane = "" if c.lane_tokens is None or not c.long_prompt_lane else f", lane pool {c.lane_tokens}"
            if c.lane_wait_s is not None and c.long_prompt_lane:
                lane += f", lane wait {c.lane_wait_s:.3g} s"
            if c.lane_chunks != "tokens" and c.long_prompt_lane:
                lane += f", lane chunks by {c.lane_chunks}"
            return f"ASAP {c.num_attention_ranks}{tp} + {c.num_expert_ranks}, {chunk}{ex}{lane}"
        tp = "" if self.par.sync_tp == 1 else f" x TP{self.par.sync_tp}"
        cp = "no CP" if self.par.cp_threshold is None else f"CP > {self.par.cp_threshold}"
        overlap = ", overlap" if self.par.sync_overlap else ""
        return f"DP+EP {self.sync_ranks}{tp}, {cp}, {chunk}{overlap}"

    def describe(self) -> dict:
        c = self.cfg
        d = {"mode": self.mode, "label": self.label, "devices": self.devices, "chunk_len": c.effective_chunk_len,
             "token_budget": c.token_budget}
        if self.mode == "async":
            d.update(attention_ranks=c.num_attention_ranks, attention_tp=self.par.attention_tp,
                     expert_ranks=c.num_expert_ranks, expert_deadline_s=c.expert_deadline_s,
                     expert_token_budget=c.expert_token_budget, lane_tokens=c.lane_tokens, lane_chunks=c.lane_chunks)
        else:
            d.update(sync_ranks=self.sync_ranks, sync_tp=self.par.sync_tp, cp_threshold=self.par.cp_threshold,
                     sync_overlap=self.par.sync_overlap)
        return d


def sweep_deployment(d: Deployment, trace, cost, shapes, slo: float, *, start_rate: float, bisections: int = 4,
                     target: float = 0.9, progress: str | None = None) -> dict:
    """:func:`find_slo_throughput` of one deployment."""
    return find_slo_throughput(d.mode, trace, cost, shapes, d.cfg, slo, start_rate=start_rate,
                               sync_ranks=d.sync_ranks, bisections=bisections, target=target, par=d.par,
                               progress=progress)


def tail_key(target: float) -> str:
    """The summary key of the TTFT percentile an SLO attainment target looks at (p99 for 0.99, p90 for 0.9)."""
    return "ttft_p99_s" if target > 0.9 else "ttft_p90_s" if target > 0.5 else "ttft_p50_s"


def search_best(candidates, trace, cost, shapes, slo: float, *, start_rate: float, bisections: int = 2,
                target: float = 0.9, confirm_trace=None, confirm_top: int = 2, confirm_bisections: int = 4,
                progress: str | None = None, sweep=sweep_deployment) -> dict:
    """The deployment of ``candidates`` with the highest SLO-compliant throughput.

    A coarse pass sweeps every candidate on ``trace`` (``bisections`` steps of the load search); then the
    ``confirm_top`` best of it are swept again on ``confirm_trace`` (default: ``trace``) with
    ``confirm_bisections``, and the best of those wins. Equal throughputs rank by the SLO attainment at the next
    load tested above (higher first: the one that came closest to passing it; 1 where no load failed), then by
    the TTFT at that load at the target's percentile (``tail_key``: p99 for a p99 SLO, lower first), then by
    candidate order; a candidate that fails the SLO (or does not sustain the load, served < 0.9 of offered)
    even at the lowest tested load ranks last. ``sweep(d, trace, cost, shapes, slo, ...)`` is
    :func:`sweep_deployment` (a parameter for tests). Returns ``{"candidates": [{"deployment", "coarse",
    "confirmed"}...] in candidate order, "best": Deployment, "best_sweep": its confirmed sweep, "ranking":
    [candidate indices, best first, by coarse throughput], "slo_compliant_throughput": the best's (tokens/s;
    None when no candidate sustains any tested load within the SLO), "served_fraction": served over offered
    at that load (None with it), "withheld": why it is None (else None)}``.
    """
    candidates = list(candidates)
    if not candidates:
        raise ValueError("search_best: no candidates")
    rows = []
    for i, d in enumerate(candidates):
        r = sweep(d, trace, cost, shapes, slo, start_rate=start_rate, bisections=bisections, target=target,
                  progress=None)
        sct = r["slo_compliant_throughput"]
        rows.append({"deployment": d, "coarse": r, "confirmed": None})
        if progress:
            print(f"  [{progress}] {d.label:45s} coarse SLO-compliant {sct or 0:12.0f} tok/s", file=sys.stderr,
                  flush=True)
    tail = tail_key(target)

    def key(i):  # highest throughput; among equals (the coarse grid of loads ties often) the one that came closest
        r = rows[i]["coarse"]  # to passing the next load tested, then the lower TTFT at the target's percentile
        sct = r["slo_compliant_throughput"]
        above = [p for p in r["points"] if sct is None or p["offered_tokens_per_s"] > sct]
        nxt = min(above, key=lambda p: p["offered_tokens_per_s"])["slo_attainment"] if above else 1.0
        at = [p[tail] for p in r["points"] if p["offered_tokens_per_s"] == sct and p[tail] is not None]
        return (-(sct if sct is not None else -1.0), -nxt, min(at) if at else math.inf, i)
    ranking = sorted(range(len(rows)), key=key)
    top = ranking[:max(1, confirm_top)]
    if confirm_trace is None and confirm_bisections == bisections:
        for i in top:
            rows[i]["confirmed"] = rows[i]["coarse"]
    else:
        for i in top:
            d = rows[i]["deployment"]
            rows[i]["confirmed"] = sweep(d, trace if confirm_trace is None else confirm_trace, cost, shapes, slo,
                                         start_rate=start_rate, bisections=confirm_bisections, target=target,
                                         progress=None)
            if progress:
                sct = rows[i]["confirmed"]["slo_compliant_throughput"]
                print(f"  [{progress}] {d.label:45s} confirmed SLO-compliant {sct or 0:12.0f} tok/s",
                      file=sys.stderr, flush=True)
    def ckey(i):  # equal confirmed throughputs: the coarse ranking decides
        sct = rows[i]["confirmed"]["slo_compliant_throughput"]
        return (-(sct if sct is not None else -1.0), top.index(i))
    win = min(top, key=ckey)
    best = rows[win]["confirmed"]
    return {"candidates": rows, "best": rows[win]["deployment"], "best_sweep": best, "ranking": ranking,
            "slo_compliant_throughput": best["slo_compliant_throughput"],
            "served_fraction": _served_at_best(best), "withheld": _withheld(best, target)}


def _served_at_best(sweep: dict) -> "float | None":
    """The served fraction at a sweep's SLO-compliant load (None where it has none)."""
    sct = sweep.get("slo_compliant_throughput")
    if "served_fraction" in sweep or sct is None:
        return sweep.get("served_fraction") if sct is not None else None
    at = [served_fraction(p) for p in sweep.get("points") or []
          if p.get("offered_tokens_per_s") == sct and p.get("served_fraction") is not None]
    return statistics.median(at) if at else None


def _withheld(sweep: dict, target: float) -> "str | None":
    if sweep.get("slo_compliant_throughput") is not None:
        return None
    return sweep.get("withheld") or (withheld_reason(sweep["points"], target) if sweep.get("points") else
                                     "no tested load is sustained and SLO-compliant")


# ----------------------------------------------------------------------------- a load search over any runner
def search_rate(attainment_at, start_rate: float, *, bisections: int = 3, target: float = 0.9,
                steps: int = 8, min_rate: float = 0.0, min_served: float = MIN_SERVED) -> dict:
    """Search the SLO-compliant rate of any runner (measured runs: ``examples/prefill.py --sweep auto``): from
    ``start_rate``, double (or halve) until a load stops passing (at most ``steps`` times), then bisect
    (geometrically) ``bisections`` times. A load passes where the SLO attainment is >= ``target`` AND the
    load is sustained (served fraction >= ``min_served``: ``serving.sustains_slo``).
    ``attainment_at(rate) -> (slo_attainment, served_fraction)`` runs (and records) one load; each rate runs
    once. ``min_rate``: halving stops before a rate below it (a measured run there takes too long). Returns
    ``{rate: (attainment, served_fraction)}`` of every rate run; when nothing passed, even ``2**steps`` below
    the start or down to ``min_rate``, no bisection runs."""
    if not (isinstance(start_rate, (int, float)) and start_rate > 0) or not (
            isinstance(min_rate, (int, float)) and min_rate >= 0):
        raise ValueError(f"search_rate: start_rate={start_rate!r} must be > 0 and min_rate={min_rate!r} >= 0")
    seen: dict = {}

    def ok(rate: float) -> bool:
        if rate not in seen:
            got = attainment_at(rate)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise ValueError(f"search_rate: attainment_at({rate!r}) returned {got!r}; it must return "
                                 "(slo_attainment, served_fraction)")
            seen[rate] = got
        return sustains_slo(*seen[rate], target, min_served=min_served)

    r = start_rate
    if ok(r):
        for _ in range(steps):
            if not ok(r * 2):
                break
            r *= 2
        lo, hi = r, r * 2
    else:
        for _ in range(steps):
            if r / 2 < min_rate:
                break
            r /= 2
            if ok(r):
                break
        lo, hi = r, r * 2
    if not ok(lo):  # nothing met the target
        return seen
    for _ in range(bisections):
        mid = (lo * hi) ** 0.5
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return seen
