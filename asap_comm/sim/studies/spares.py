"""How many spare expert dies an ASAP deployment should hold (``plan --spare-expert-ranks N``; docs/failover.md,
"The simulator's model").

For the planned deployment at its planned load (its SLO-compliant throughput, on the plan's first trace window, long
enough to span :data:`SPAN_REPLACES` times the time to replace before and after the death where the trace allows),
one expert rank dies in the middle of the arrivals, once per spare count ``0..N`` (one simulation each,
``core/failover.py``): with a spare the run shows the dip (served tokens/s during the failover against before it),
the time to replace and to recover, and whether the SLO still held over the window; with none the group fails and
every request unfinished then fails. A spare is a die of the expert role that does no work until needed: the
deployment keeps its dies and adds ``s`` (``extra_die_fraction``: ``s / (dies + s)`` of the hardware idle), and a
spare die must hold what one expert die holds (``spare_die_memory``).

The recommendation: with ``die_failures_per_day`` (deaths per die per day) the fewest spares in ``0..N`` for which
more deaths than spares among the expert dies before a used spare is replaced (``repair_hours``) has a chance
below :data:`RISK` (Poisson), among the counts whose failover run held the SLO and failed no request; without a
rate, one spare where its run failed no request (a second one only covers a second death before the first is
repaired), else none.
"""
from __future__ import annotations

import dataclasses
import math

from ...serving.metrics import summarize_run
from ..core.simulate import simulate
from ..core.sweep import at_rate, mean_len
from ..costmodel.failover import DETECT_S, expert_rank_bytes, failover_params, spare_load_s

__all__ = ["RISK", "MAX_SPARES", "spare_plan", "more_deaths_than", "recommend_spares"]

RISK = 0.01  # the chance of more deaths than spares before a repair that the recommendation accepts
MAX_SPARES = 2
WINDOWS = ("before", "during", "drain", "after")  # core/failover.py's throughput windows
SPAN_REPLACES = 3  # the simulated arrivals span at least this many times the time to replace, before and after


def more_deaths_than(spares: int, expert_dies: int, per_day: float, repair_hours: float) -> float:
    """Chance of more than ``spares`` deaths among ``expert_dies`` dies (and the spares in use) within
    ``repair_hours``, deaths a Poisson process of ``per_day`` per die per day."""
    m = per_day * expert_dies * repair_hours / 24.0
    return max(0.0, 1.0 - sum(math.exp(-m) * m ** k / math.factorial(k) for k in range(spares + 1)))


def recommend_spares(runs: list, expert_dies: int, per_day: "float | None", repair_hours: float) -> tuple:
    """``(spares, reason)`` from the failover runs (``spare_plan``'s ``runs``, one per spare count from 0)."""
    ok = [r for r in runs if r["requests_failed"] == 0]
    if per_day is None:
        if any(r["spares"] == 1 for r in ok):
            return 1, ("one spare survives an expert death with no request failed; a second covers only a second "
                       "death before the first is repaired (give --die-failures-per-day to size it)")
        if len(runs) == 1:
            return 0, "with no spare an expert death fails the group (--spare-expert-ranks 1 tries one)"
        return 0, "no spare count tried survives an expert death without failed requests"
    for r in runs:
        risk = more_deaths_than(r["spares"], expert_dies, per_day, repair_hours)
        r["risk_more_deaths_than_spares"] = risk
        if risk < RISK and (r["spares"] == 0 or r in ok):
            return r["spares"], (f"more expert deaths than spares before a repair "
                                 f"({repair_hours:g} h, {per_day:g} deaths per die per day, {expert_dies} expert "
                                 f"dies) has a chance of {risk:.2g} < {RISK:g}")
    last = runs[-1]
    return last["spares"], (f"the most tried: more deaths than spares before a repair "
                            f"still has a chance of {last['risk_more_deaths_than_spares']:.2g} >= {RISK:g}")


def spare_plan(d, tw, cost, shapes, slo_s: float, target: float, sct: float, n_requests: int, dies: int,
               max_spares: int, memory: list, *, per_day: "float | None" = None, repair_hours: float = 24.0,
               log=None) -> dict:
    """The ``failover`` block of ``plan.json`` for ASAP deployment ``d`` (a ``sweep.Deployment``) at ``sct``
    prompt tokens/s (its SLO-compliant throughput) on ``n_requests`` of the trace's first window."""
    if isinstance(max_spares, bool) or not isinstance(max_spares, int) or not 0 <= max_spares <= MAX_SPARES:
        raise ValueError(f"spare_plan: max_spares={max_spares!r} must be an int in [0, {MAX_SPARES}]")
    E = d.cfg.num_expert_ranks
    replace_s = DETECT_S + spare_load_s(cost.profile, shapes, E)
    window = tw.window(0, n_requests)
    rate = sct / mean_len(window)
    # long enough for windows before and after the failover: SPAN_REPLACES times the time to replace on each side
    want = math.ceil(rate * 2 * SPAN_REPLACES * replace_s) + 1
    if want > len(window):
        window = tw.window(0, min(want, tw.max_window))
        rate = sct / mean_len(window)
    trace = at_rate(window, rate)
    t_fail = 0.5 * (trace[0].arrival_s + trace[-1].arrival_s)
    params = failover_params(cost.profile)
    expert = next((m for m in memory if m["role"] == "expert"), None)
    runs = []
    for s in range(max_spares + 1):
        cfg = dataclasses.replace(d.cfg, spare_expert_ranks=s)
        res = simulate("async", trace, cost, shapes, cfg, par=d.par, slo_s=slo_s, failures=[(t_fail, 0)])
        summ = summarize_run(res.records, slo_s)
        fo = res.failover
        death = fo["deaths"][0]
        tp = fo.get("throughput", {})
        before, during = tp.get("before"), tp.get("during")
        runs.append({
            "spares": s, "extra_dies": s, "extra_die_fraction": s / (dies + s),
            "time_to_replace_s": death.get("time_to_replace_s"),
            "recovered_after_s": death.get("recovered_after_s"),
            "served_tokens_per_s": {k: tp.get(k) for k in WINDOWS},
            "offered_tokens_per_s": {k: (tp.get("offered") or {}).get(k) for k in WINDOWS},
            "dip": None if not before or during is None else during / before,
            "requests_failed": fo["requests_failed"], "group_failed": fo["group_failed"] is not None,
            "slo_attainment": summ.slo_attainment, "served_fraction": summ.served_fraction,
            "ttft_p99_s": summ.ttft_p99_s, "slo_held": summ.slo_attainment >= target,
            "sim_wall_s": res.wall_s})
        if log:
            r = runs[-1]
            log(f"failover with {s} spare(s): {r['requests_failed']} failed, SLO attainment {r['slo_attainment']:.3f}"
                f" ({res.wall_s:.1f} s)")
    n, why = recommend_spares(runs, E, per_day, repair_hours)
    return {"deployment": d.label, "load_tokens_per_s": sct, "rate_req_s": rate, "requests": len(trace),
            "failure": {"time_s": t_fail, "expert_rank": 0},
            "load_s": replace_s - DETECT_S, "detect_s": DETECT_S,
            "expert_rank_gb": expert_rank_bytes(cost.profile, shapes, E) / 1e9,
            "checkpoint_read_gbps": params["checkpoint_read_gbps"], "spare_startup_s": params["spare_startup_s"],
            "load_source": params["source"],
            "spare_die_memory": None if expert is None else {
                "needed_gb": expert["needed_gb"], "have_gb": expert["have_gb"], "fits": expert["feasible"]},
            "die_failures_per_day": per_day, "repair_hours": repair_hours,
            "runs": runs, "recommended_spares": n, "reason": why}

