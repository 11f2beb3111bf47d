"""The synchronous baseline's per-layer barrier, measured in the simulator and against an independent model.

``python -m asap_comm.sim barrier --out DIR`` writes ``DIR/barrier.json`` and ``DIR/barrier.png`` and prints
the table (``docs/results/barrier/README.md`` holds it with the verdict).

**The model** (Song et al., "Analytical Provisioning for Attention-FFN Disaggregated LLM Serving under
Stochastic Workloads", arXiv 2601.21351, v3/v4; earlier versions "Theoretically Optimal Attention/FFN Ratios
in Disaggregated LLM Serving"): ``r`` workers that meet at a barrier every step finish the step when the
slowest does; with i.i.d. Gaussian loads of mean ``mu`` and standard deviation ``sigma`` the step takes
``E[max] = mu + sigma * e_r``, where ``e_r = E[max of r standard normals]`` (``e_2 = 1/sqrt(pi)``). The
barrier's cost, the time an average worker waits, is ``sigma * e_r``; the fastest worker waits about
``2 * sigma * e_r``. Only the paper's abstract and secondary summaries were reachable here, so the barrier term is
implemented as the brief states it, and the A:F rule (:func:`af_ratio_rule`) as the summaries state its shape
(``r* = max(r_A, r_C, r_peak)``: the attention-, communication- and FFN-peak-bound ratios), each term derived
below from this project's cost model, not taken from the paper's equations.

**The measurement.** The baseline (``core.sync_mode``) runs every DP group's share of a MoE layer, then an
all-to-all that waits for the slowest group: per MoE layer it charges ``max_r p_r`` where ``p_r`` is group
``r``'s compute since the previous collective. A group's compute of a step is what ``simulate(...,
spans=True)`` records per group and step (``SimResult.spans``: the group's busy time of that step, including
the expert work every group does alike). Its identical MoE layers each cost ``busy_r / L`` (``L`` MoE
layers; the first layer also carries the embedding and dense layers, the last the head, which this averages
over the layers); the stall at one layer is ``max_r p_r - p_r``, reported as the mean over groups
(``stall``, what the model's ``sigma * e_r`` predicts) and for the fastest group (``fastest_wait``, against
``2 * sigma * e_r``). :func:`layer_loads` and :func:`step_time` recompute one step the way ``core.sync_mode`` does
from the per-group chunks (balanced routing, no CP, no overlap, dedicated devices), which the tests hold against
the simulator's spans and step times.

Three readings of the model: **stationary** (the paper's: ``sigma`` is the standard deviation of one group's
per-layer load over all steps and groups of the run, workers i.i.d. from one distribution), **within step**
(``sigma`` from the groups' spread within each step, the unbiased variance pooled over steps: what is left when
the step's common level, which no group waits for, is taken out), and **empirical tail** (the same i.i.d.
barrier, the Gaussian replaced by the run's within-step residuals: ``E[max]`` from their order statistics).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from ...serving.protocol import RuntimeConfig
from ...serving.traces import LogNormalLengths, Request, load_trace, resolve_trace, synthetic_trace
from ..core.common import rows_per_rank_fraction
from ..core.simulate import simulate
from ..costmodel.costs import CostModel
from ..costmodel.hardware import Profile
from ..costmodel.shapes import ModelShapes
from .figures import barrier_figure

__all__ = ["expected_max_normal", "barrier_model", "step_group_loads", "measure_barrier", "layer_loads",
           "step_time", "af_ratio_rule", "barrier_sweep", "main"]

TARGET = 0.15


# ----------------------------------------------------------------------------- the model
def expected_max_normal(r: int) -> float:
    """``E[max of r i.i.d. standard normals]``: the integral of ``x * r * phi(x) * Phi(x)**(r-1)`` (Simpson,
    4,000 panels over [-12, 12]; 1e-9 accurate). ``e_1 = 0``, ``e_2 = 1/sqrt(pi)``, ``e_3 = 3/(2 sqrt(pi))``."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"expected_max_normal: r={r!r} must be an int >= 1")
    if r == 1:
        return 0.0
    n, a, b = 4000, -12.0, 12.0
    h = (b - a) / n
    total = 0.0
    for i in range(n + 1):
        x = a + i * h
        f = x * r * math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (r - 1)
        total += f * (1 if i in (0, n) else (4 if i % 2 else 2))
    return total * h / 3


def barrier_model(mean: float, std: float, r: int) -> float:
    """The model's expected step time of ``r`` workers at a barrier: ``mean + std * e_r``."""
    if not (math.isfinite(mean) and math.isfinite(std) and std >= 0):
        raise ValueError(f"barrier_model: mean={mean!r}, std={std!r} must be finite, std >= 0")
    return mean + std * expected_max_normal(r)


# ----------------------------------------------------------------------------- measurement from spans
def step_group_loads(result, groups: int) -> list:
    """Per baseline step, each group's compute of that step: ``[[busy_0, ..., busy_{W-1}], ...]`` in step order,
    from ``SimResult.spans`` (``simulate("sync", ..., spans=True)``: one span per group and step)."""
    if result.mode != "sync":
        raise ValueError(f"step_group_loads: a baseline ('sync') result is needed, got mode {result.mode!r}")
    if not result.spans:
        raise ValueError("step_group_loads: the result has no spans; simulate with spans=True")
    steps: dict = {}
    for name, _label, start, dur in result.spans:
        steps.setdefault(start, []).append(dur)
    out = []
    for start in sorted(steps):
        loads = steps[start]
        if len(loads) != groups:
            raise ValueError(f"step_group_loads: the step at {start:.6f} s has {len(loads)} spans, not one per "
                             f"group ({groups})")
        out.append(loads)
    return out


def measure_barrier(step_loads: list, moe_layers: int, *, active_only: bool = False) -> dict:
    """The barrier of ``step_loads`` (per step, each group's compute; :func:`step_group_loads`) over ``moe_layers``
    identical MoE layers, measured and modelled (module docstring). ``active_only``: only the steps where every
    group had work. All times in seconds per MoE layer."""
    if moe_layers < 1:
        raise ValueError(f"measure_barrier: moe_layers={moe_layers!r} must be >= 1")
    steps = [s for s in step_loads if not active_only or min(s) > max(s) * 1e-9]
    if not steps:
        raise ValueError("measure_barrier: no steps to measure")
    r = len(steps[0])
    e = expected_max_normal(r)
    per = [[x / moe_layers for x in s] for s in steps]
    stall = [max(p) - statistics.fmean(p) for p in per]
    fastest = [max(p) - min(p) for p in per]
    # within a step: the groups' spread, pooled over steps with the unbiased variance (a step's r loads
    # estimate sigma^2 with r - 1 degrees of freedom)
    sigma_w = math.sqrt(statistics.fmean(statistics.variance(p) for p in per)) if r > 1 else 0.0
    pooled = [x for p in per for x in p]
    mu, sigma = statistics.fmean(pooled), statistics.pstdev(pooled)
    # the groups' loads within a step are correlated through the step's common level: the share of the pooled
    # variance that is between steps (the means' variance)
    means = [statistics.fmean(p) for p in per]
    between = statistics.pvariance(means) / sigma ** 2 if sigma > 0 else 0.0
    m_stall = statistics.fmean(stall)
    # distribution-free: r i.i.d. draws from the run's within-step residuals (load - its step's mean), the
    # expected max from the order statistics: sum_i x_(i) * ((i/n)^r - ((i-1)/n)^r)
    # residuals scaled by sqrt(r / (r - 1)): a residual from its own step's mean has (r - 1) / r of the variance
    scale = math.sqrt(r / (r - 1)) if r > 1 else 0.0
    res = sorted(scale * (x - statistics.fmean(p)) for p in per for x in p)
    n = len(res)
    emp = sum(x * ((i / n) ** r - ((i - 1) / n) ** r) for i, x in enumerate(res, 1))
    mean_res = statistics.fmean(res)
    skew = (statistics.fmean((x - mean_res) ** 3 for x in res) / sigma_w ** 3) if sigma_w > 0 else 0.0
    return {"groups": r, "steps": len(steps), "e_r": e, "mean_layer_load_s": mu, "sigma_stationary_s": sigma,
            "between_step_variance_share": between,
            "stall_s": m_stall, "fastest_wait_s": statistics.fmean(fastest),
            "model_stationary_stall_s": sigma * e, "model_stationary_fastest_s": 2 * sigma * e,
            "model_per_step_stall_s": sigma_w * e,
            "stationary_error": (sigma * e - m_stall) / m_stall if m_stall > 0 else None,
            "per_step_error": (sigma_w * e - m_stall) / m_stall if m_stall > 0 else None,
            "sigma_within_step_s": sigma_w, "within_step_skewness": skew,
            "model_empirical_stall_s": emp,
            "empirical_error": (emp - m_stall) / m_stall if m_stall > 0 else None,
            "stall_share_of_layer": m_stall / statistics.fmean(max(p) for p in per) if mu > 0 else 0.0}


# ----------------------------------------------------------------------------- one step, as core.sync_mode does it
def layer_loads(cost: CostModel, shapes: ModelShapes, batches: list) -> list:
    """Each group's compute before each MoE layer's all-to-all (and, last, the tail with the head), for one
    step of ``batches`` (per group, chunks ``(length, start, last)``), one device per group, no CP:
    ``[[p_group_layer, ...] per group]``, as ``core.sync_mode._SyncSim._step`` charges them."""
    k = cost.runtime["sync_compute"]
    segs, dense = [], 0
    for m in shapes.moe_layers:
        if m:
            segs.append((dense, 1))
            dense = 0
        else:
            dense += 1
    segs.append((dense, 0))
    out = []
    for b in batches:
        T = sum(c[0] for c in b)
        row = []
        if not T:
            out.append([0.0] * len(segs))
            continue
        attn = cost.attention_s([(c[0], c[1]) for c in b], tp=1)
        last = sum(1 for c in b if c[2])
        for i, (d, moe) in enumerate(segs):
            w = cost.embed_s(T) if i == 0 else segs[i - 1][1] * cost.shared_experts_s(T)
            w += d * (attn + cost.dense_mlp_s(T))
            w += moe * (attn + cost.router_s(T)) if moe else (cost.head_s(last) if last else 0.0)
            row.append(k * w)
        out.append(row)
    return out


def step_time(cost: CostModel, shapes: ModelShapes, batches: list) -> float:
    """One baseline step of ``batches`` (as :func:`layer_loads`; balanced routing, no overlap, dedicated devices):
    the all-reduce, then per MoE layer the slowest group, the three all-to-alls, the experts and the layer
    overhead, then the slowest tail."""
    W = len(batches)
    loads = layer_loads(cost, shapes, batches)
    tokens = [sum(c[0] for c in b) for b in batches]
    N, k_top = shapes.num_experts, shapes.top_k
    local = -(-N // W)
    frac = rows_per_rank_fraction(N, k_top, local)
    rows = [round(T * frac) for T in tokens]
    a2a_rows = max(max(rows) * (W - 1), round(sum(rows) * (W - 1) / W))
    a2a = cost.all_to_all_s(0, W) + cost.all_to_all_s(a2a_rows, W) + cost.all_to_all_s(a2a_rows, W, combine=True)
    total = round(sum(tokens) * k_top * local / N)
    base, extra = divmod(total, local)
    pairs = [base + 1] * extra + [base] * (local - extra)
    k = cost.runtime["sync_compute"]
    ex = k * cost.runtime["expert_skew"] * cost.experts_s(pairs) if sum(tokens) else 0.0
    t = cost.all_reduce_s(W)
    n_seg = len(loads[0])
    for i in range(n_seg - 1):
        t += max(l[i] for l in loads) + a2a + ex + cost.runtime["sync_layer_overhead_s"]
    return t + max(l[-1] for l in loads)


# ----------------------------------------------------------------------------- the A:F rule
def af_ratio_rule(cost: CostModel, shapes: ModelShapes, batch_tokens: int, *, attention_tp: int = 8,
                  expert_dies: int = 64, groups: int | None = None, load_cv: float = 0.0) -> dict:
    """The A:F ratio rule ``r* = max(r_A, r_C, r_peak)`` in attention dies per expert die, for prefill
    micro-batches of ``batch_tokens`` tokens on attention groups of ``attention_tp`` dies and ``expert_dies``
    expert dies, from this project's cost model (the shape of the paper's rule; the terms derived here):

    * ``r_A`` (attention-bound): the ratio at which an expert die's work for ``r`` attention dies' tokens of one
      layer takes as long as that layer's attention side (attention, TP all-reduce, router, shared experts);
      with ``groups`` attention groups whose loads have coefficient of variation ``load_cv``, the attention
      side's step is ``mu * (1 + load_cv * e_groups)``: the paper's barrier-aware refinement;
    * ``r_C`` (communication-bound): the ratio at which an expert die's link needs one attention layer's time
      to receive ``r`` attention dies' dispatch rows (each token to ``top_k`` experts; an upper bound);
    * ``r_peak``: the smallest ratio at which an expert's batch is large enough to be compute-bound on the
      profile's ``expert`` op (its time per row within 10% of the large-batch one).
    """
    B, t = batch_tokens, attention_tp
    per_die = -(-B // t)
    t_attn = (cost.attention_s([(B, 0)], tp=t) + cost.tp_all_reduce_s(B, t) + cost.router_s(per_die)
              + cost.shared_experts_s(per_die))
    e = expected_max_normal(groups) if groups and groups > 1 else 0.0
    t_side = t_attn * (1 + load_cv * e)
    N, k = shapes.num_experts, shapes.top_k
    local = max(1, -(-N // expert_dies))

    def expert_die_s(r: float) -> float:  # r attention dies per expert die: r * per_die * k pairs on this die
        per_expert = max(1, round(r * per_die * k / local))
        return cost.experts_s([per_expert] * local)

    def solve(f, target: float) -> float:  # the r at which the increasing f reaches target
        lo, hi = 1e-3, 1e5
        for _ in range(100):
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
        return hi

    r_a = solve(expert_die_s, t_side)
    c = cost.profile.collective
    inter = c.get("ranks_per_node") and expert_dies > c["ranks_per_node"]
    s_per_byte = c["inter_s_per_byte"] if inter else c["s_per_byte"]
    per_row = cost.dispatch_row_bytes * s_per_byte
    r_c = t_side / (per_die * k * per_row) if per_row > 0 else float("inf")
    big = cost.expert_s(1 << 16) / (1 << 16)
    rows = solve(lambda n: -cost.expert_s(max(1, round(n))) / max(1, round(n)), -1.1 * big)
    r_peak = rows * local / (per_die * k)
    return {"batch_tokens": B, "attention_tp": t, "expert_dies": expert_dies, "t_attention_side_s": t_side,
            "r_A": r_a, "r_C": r_c, "r_peak": r_peak, "r_star": max(r_a, r_c, r_peak),
            "expert_knee_rows": rows, "load_cv": load_cv, "groups": groups}


# ----------------------------------------------------------------------------- the sweep
def _trace(kind: str, sigma: float, n: int, seed: int) -> list:
    if kind == "mooncake":
        t = load_trace(resolve_trace("mooncake"), max_prompt_len=131072)[:n]
        return [Request(i, r.arrival_s - t[0].arrival_s, r.prompt_len) for i, r in enumerate(t)]
    # a log-normal spread with the same mean for every sigma: median = mean * exp(-sigma^2 / 2)
    mean = 4096.0
    return synthetic_trace(1.0, num_requests=n, lengths=LogNormalLengths(mean * math.exp(-sigma * sigma / 2), sigma,
                                                                        16, 131072), seed=seed)


def barrier_sweep(groups=(8, 16, 32, 48, 64, 96), spreads=(0.25, 0.5, 1.0, 1.5), *, profile="ascend-910c-cm384",
                  model="deepseek-v3", per_group=300, utilisation=0.7, chunk=16384, seed=0,
                  progress=True) -> list:
    """Simulate the baseline (``groups`` DP groups of one die, EP over all, 16k chunks and budget, no CP) on
    Poisson arrivals with log-normal prompt lengths of mean 4,096 tokens and log-space spread ``spreads`` (and the
    Mooncake trace's own, ``"mooncake"`` in ``spreads``), ``per_group`` requests per group, at ``utilisation``
    of a rough capacity; measure the barrier (:func:`measure_barrier`) of each run."""
    from ..core.sweep import at_rate, capacity_rate

    shapes = ModelShapes.load(model)
    cost = CostModel(Profile.load(profile), shapes)
    cfg = RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=chunk, chunk_len=chunk,
                        max_prompt_len=131072)
    L = shapes.num_moe_layers
    rows = []
    for spread in spreads:
        for W in groups:
            t0 = time.perf_counter()
            kind = "mooncake" if spread == "mooncake" else "lognormal"
            trace = _trace(kind, 0.0 if kind == "mooncake" else float(spread), per_group * W, seed)
            rate = utilisation * capacity_rate(trace, cost, shapes, cfg, sync_ranks=W)
            res = simulate("sync", at_rate(trace, rate), cost, shapes, cfg, sync_ranks=W, spans=True)
            loads = step_group_loads(res, W)
            lens = [r.prompt_len for r in trace]
            row = {"groups": W, "spread": spread, "prompt_mean": statistics.fmean(lens),
                   "prompt_cv": statistics.pstdev(lens) / statistics.fmean(lens), "rate_req_s": rate,
                   "makespan_s": res.makespan_s,
                   "all_steps": measure_barrier(loads, L),
                   "busy_steps": (measure_barrier(loads, L, active_only=True)
                                  if any(min(s) > 0 for s in loads) else None),
                   "wall_s": time.perf_counter() - t0}
            rows.append(row)
            if progress:
                a = row["all_steps"]
                print(f"  spread {spread!s:8s} W={W:3d}: {a['steps']:5d} steps, "
                      f"stall {a['stall_s'] * 1e3:7.3f} ms/layer, "
                      f"model {a['model_stationary_stall_s'] * 1e3:7.3f} ({a['stationary_error']:+.1%}), per-step "
                      f"{a['model_per_step_stall_s'] * 1e3:7.3f} ({a['per_step_error']:+.1%})  [{row['wall_s']:.0f} s]",
                      file=sys.stderr, flush=True)
    return rows


def _headline_splits() -> list:
    """The best ASAP deployments of the committed headline studies (README, 'At 384 dies'; headline/p90)."""
    return [{"dies": 64, "deployment": "ASAP 6 x TP8 + 16, chunk 16384", "attention_dies": 48, "expert_dies": 16,
             "chunk": 16384, "attention_tp": 8, "groups": 6,
             "source": "docs/results/headline/p90/summary.json and p99/summary.json (async.deployment)"},
            {"dies": 384, "deployment": "ASAP 40 x TP8 + 64, chunk 2k, budget 16k, pool 262k", "attention_dies": 320,
             "expert_dies": 64, "chunk": 16384, "attention_tp": 8, "groups": 40,
             "source": "README 'At 384 dies, the lane's memory charged' (docs/results/headline384/lane_pool*)"}]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim barrier", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--groups", default="8,16,32,48,64,96")
    p.add_argument("--spreads", default="0.25,0.5,1.0,1.5,mooncake")
    p.add_argument("--per-group", type=int, default=300)
    p.add_argument("--utilisation", type=float, default=0.7)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--model", default="deepseek-v3")
    a = p.parse_args(argv)
    try:
        groups = tuple(int(x) for x in a.groups.split(","))
        spreads = tuple(x if x == "mooncake" else float(x) for x in a.spreads.split(","))
    except ValueError:
        print(f"barrier: --groups {a.groups!r} / --spreads {a.spreads!r} must be comma-separated numbers "
              "('mooncake' allowed in --spreads)", file=sys.stderr)
        return 2
    if any(g < 2 for g in groups) or a.per_group < 1 or not 0 < a.utilisation < 1.5:
        print(f"barrier: --groups {a.groups!r} must be >= 2, --per-group {a.per_group} >= 1, --utilisation "
              f"{a.utilisation} in (0, 1.5)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = barrier_sweep(groups, spreads, profile=a.profile, model=a.model, per_group=a.per_group,
                         utilisation=a.utilisation)
    shapes = ModelShapes.load(a.model)
    cost = CostModel(Profile.load(a.profile), shapes)
    splits = []
    for s in _headline_splits():
        rule = af_ratio_rule(cost, shapes, s["chunk"], attention_tp=s["attention_tp"], expert_dies=s["expert_dies"])
        rule_b = af_ratio_rule(cost, shapes, s["chunk"], attention_tp=s["attention_tp"], expert_dies=s["expert_dies"],
                               groups=s["groups"], load_cv=0.5)
        splits.append({**s, "searched_ratio": s["attention_dies"] / s["expert_dies"], "rule": rule,
                       "rule_barrier_cv0.5": rule_b})
    result = {"profile": a.profile, "model": shapes.name, "target_abs_relative_error": TARGET,
              "paper": "arXiv 2601.21351 (Song et al.): E[step] = mu + sigma * E[max of r standard normals]",
              "settings": {"per_group": a.per_group, "utilisation": a.utilisation, "chunk": 16384,
                           "token_budget": 16384, "sync_tp": 1, "cp": None, "moe_layers": shapes.num_moe_layers},
              "rows": rows, "af_splits": splits, "wall_s": time.perf_counter() - t0}
    (out / "barrier.json").write_text(json.dumps(result, indent=2))
    barrier_figure(out / "barrier.png", result)  # sim.figures (replot redraws it from barrier.json)
    print(table(result))
    return 0


def table(result: dict) -> str:
    """The markdown table of ``barrier.json``'s rows (ms per MoE layer; errors relative to the measured stall)."""
    lines = ["| spread (prompt CV) | groups | steps | measured stall | Gaussian, stationary sigma | Gaussian, "
             "within-step sigma | empirical tail | within-step skewness | between-step share of variance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        a = r["all_steps"]
        lines.append(f"| {r['spread']} ({r['prompt_cv']:.2f}) | {r['groups']} | {a['steps']} | "
                     f"{a['stall_s'] * 1e3:.2f} | "
                     f"{a['model_stationary_stall_s'] * 1e3:.2f} ({a['stationary_error']:+.0%}) | "
                     f"{a['model_per_step_stall_s'] * 1e3:.2f} ({a['per_step_error']:+.0%}) | "
                     f"{a['model_empirical_stall_s'] * 1e3:.2f} ({a['empirical_error']:+.0%}) | "
                     f"{a['within_step_skewness']:.2f} | {a['between_step_variance_share']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
