"""``python -m asap_comm.sim validate --regime published``: the simulator against published measurements.

Each :class:`Figure` is one number a publication reports, with its source (URL and where in it), the
deployment it came from (:class:`Deployment`: dies, the DP/TP/EP split, dtype, model, software stack) and
how it is simulated with the simulator's own machinery (:func:`~asap_comm.sim.core.simulate.simulate`,
:class:`~asap_comm.sim.costmodel.costs.CostModel`, :class:`~asap_comm.sim.core.simulate.Parallelism`; the baseline is
``sync_ranks`` DP groups of ``sync_tp`` devices with EP over all of them, ASAP ``A`` attention groups of
``attention_tp`` devices + ``E`` expert dies):

* ``solo_ttft``: one request alone on an empty system, its TTFT;
* ``fixed_batch``: a closed-loop batch submitted at once and pinned to attention group 0 (as the published
  runs pin it to DP rank 0); the batch's latency (its last TTFT; the publication's p50 over 10 repeats of a
  deterministic batch);
* ``loaded_ttft``: TTFT p50 / p99 of that window at a published offered load (input tokens/s; arrivals rescaled,
  bursts kept);
* ``capacity``: SLO-compliant throughput (input tokens/s) at TTFT p99 <= 50 s on a 128-request window of
  the shared Mooncake trace chosen to match the published window's statistics (same-timestamp bursts kept);
  ``capacity_ratio``: ASAP's over the baseline's;
* ``throughput_per_npu``: a saturating closed loop of equal prompts, input tokens/s per 910C package
  (two dies: CloudMatrix-Infer's "NPU", whose 4.45 tokens/s/TFLOPS = 6,688 / ~1,503 INT8 TOPS per package),
  measured in steady state: three batches of ``per_die`` prompts per die queued at once, the throughput between
  the first batch's last completion and the second's (the first steps start while the front end is still
  sending, with part of a batch: a one-batch burst measured that start-up, 12% low with 4 prompts per die);
* afd-plugin's asynchronous prefill connector (DeepSeek-V4-Flash on one node, DeepSeek-V3.2 cut to 10 layers on
  32 dies): ``published_afd.py`` (its deployments, figures and kinds, and the types and settings both share).

**Software stacks.** The same Ascend 910C die runs CloudMatrix-Infer's fused operators (graph mode, MC2
dispatch, micro-batch pipelining) and vLLM-Ascend's eager path (the afd-plugin study: eager mode, prefill
MC2 off, no dual-batch overlap in the baseline); they differ by several times per token. The profile
(``ascend-910c-cm384``) describes the first; its ``stacks`` block names the others as a few overrides of
profile fields, each with the published figures it is fitted to (:func:`stack_profile`). A figure is
either ``fitted`` (used to set a value of the profile or of its stack) or held out; the table reports
both, and the summary their errors separately.

**DeepSeek-V3.2.** The afd-plugin runs DeepSeek-V3.2, whose sparse attention (DSA) has a lightning indexer
that scores every (query, key) pair and a sparse core over the top 2,048 keys. The simulator models
DeepSeek-V3 shapes (dense MLA, same layers, experts and widths): the fitted causal-core efficiency of the
eager stack is an *effective* one that stands for the indexer's quadratic work plus the sparse core; the
indexer's projections (about 7% of the attention weights) are inside the fitted attention GEMM efficiency.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

from ...serving.policies import Placer
from ...serving.traces import Request
from ..core.async_mode import _AsyncSim
from ..core.sweep import mean_len, run_point
from ..core.sync_mode import _SyncSim
from ..costmodel.costs import CostModel
from ..costmodel.hardware import Profile
from ..costmodel.shapes import ModelShapes
from .published_afd import (AFD_V4, AFD_V32, ASYNC_DEPLOYMENTS, ASYNC_FIGURES, ASYNC_KINDS, V4A, async_notes,
                            simulate_async_figure)
from .published_afd import SLO_S, SLO_TARGET, Deployment, Figure, afd_screening_window
from .target import TARGET

__all__ = ["DEPLOYMENTS", "FIGURES", "SOURCES", "stack_profile", "simulate_figure", "validate_published",
           "published_table", "published_markdown", "relative_error"]

AFD_REPORT = ("https://github.com/vllm-project/afd-plugin/issues/170 (comment of 2026-08-25, 'Stage report: "
              "full 61-layer DeepSeek V3.2 prefill, 32-card resource-parity study'); the full report: "
              "https://github.com/ShwStone/afd-plugin/blob/3e183f293eaaf96454c2878004e7aed507dc70d0/bench_results/"
              "full_prefill_performance/report/STAGE_REPORT.zh-CN.md")
AFD_PLAN = ("https://github.com/ShwStone/afd-plugin/blob/b7bc043880309d3dc3da9cf5deddd326704dcbea/docs/npu/"
            "DEEPSEEK_V3_2_FULL_PREFILL_PERFORMANCE_PLAN.zh-CN.md")
CM_PAPER = "Zuo et al., 'Serving Large Language Models on Huawei CloudMatrix384', arXiv 2506.12708 (2025)"
SOURCES = {
    "afd-report": AFD_REPORT,
    "afd-plan": AFD_PLAN,
    "cloudmatrix": CM_PAPER + ", https://arxiv.org/abs/2506.12708",
    "afd-v4flash": AFD_V4,
    "afd-v32-async": AFD_V32,
}


DEPLOYMENTS = {d.name: d for d in (
    Deployment("afd-baseline-dp4tp8", "sync", 32, "DP4 x TP8 (EP32), eager, no dual-batch overlap",
               "vllm-ascend-eager", sync_ranks=4, sync_tp=8,
               note="2 Atlas A3 nodes of one super-node, 32 devices (the report writes '32 x 910B'; an A3 node's 8 "
                    "910C packages are 16 devices of 64 GB, and its ~51.5 GB peak per card fits a die: one device = "
                    "one die of this profile); max-num-batched-tokens 65,536, max-num-seqs 8 per DP replica (not "
                    "modelled), prefix cache off, output length 1"),
    Deployment("afd-a2-2tp8-ep16", "async", 32, "16 attention dies (DP2 x TP8) + 16 FFN dies (EP16), CAM async "
               "connector, A2 token-balanced dual micro-batches", "vllm-ascend-eager",
               attention_ranks=2, attention_tp=8, expert_ranks=16,
               note="A2 splits each step's batch in two by tokens; simulated as ASAP's ping-pong of two "
                    "micro-batches (fixed batches: whole requests, half of the batch each, the report's A1, "
                    "within 2% of A2); one prompt alone is one micro-batch (the runtime does not split it)"),
    Deployment("cloudmatrix-prefill-32", "sync", 32, "32 dies (16 910C packages): attention data-parallel per die, "
               "EP32 for the routed experts, two-micro-batch pipelining", "cloudmatrix-infer",
               sync_ranks=32, sync_tp=1, sync_overlap=True, chunk_len=16384, token_budget=16384,
               dtype="INT8 GEMMs, INT8 dispatch, BF16 combine", model="DeepSeek-R1 (deepseek-v3 shapes)",
               note="the prefill deployment as this project reads arXiv 2506.12708 (Table 2: 4,096-token prompts, "
                    "16,384 tokens per accelerator, perfect EPLB = the simulator's balanced routing); the split (16 "
                    "packages = 32 dies, attention DP per die, EP32) is this project's reading, not verified against "
                    "the PDF; simulated in steady state with batches of 4 prompts per die (8: the same to 0.1%)"),

    *ASYNC_DEPLOYMENTS,
)}


def _solo(key, mode, dep, n, value, fitted, where):
    return Figure(key, f"solo TTFT, {n:,}-token prompt, {'baseline' if mode == 'sync' else 'AFD A2'}", "solo_ttft",
                  value, "s", dep, f"{AFD_REPORT}, {where}", {"prompt_len": n}, fitted, quick=True)


def _batch(key, label, dep, lens, value, where):
    return Figure(key, label, "fixed_batch", value, "s", dep, f"{AFD_REPORT}, {where}", {"prompt_lens": lens})


def _balanced(total: int, n: int) -> list:
    base, extra = divmod(total, n)
    return [base + 1] * extra + [base] * (n - extra)


B, A = "afd-baseline-dp4tp8", "afd-a2-2tp8-ep16"
_SOLO_AT = "section 3 (solo single-request TTFT table)"
_FIXED_AT = ("section 2 (closed-loop fixed batches pinned to DP rank 0, median of 10 repeats); the batches: plan "
             "section 6.3 (8 requests closest to 1,024 / 4,096 tokens; 1 closest to 24,576 + 7 closest to 1,170)")
FIGURES = [
    _solo("solo_63778_baseline", "sync", B, 63778, 31.75, True, _SOLO_AT),
    _solo("solo_63778_afd", "async", A, 63778, 27.93, True, _SOLO_AT),
    _solo("solo_32850_baseline", "sync", B, 32850, 12.75, False, _SOLO_AT),
    _solo("solo_32850_afd", "async", A, 32850, 10.97, True, _SOLO_AT),
    _solo("solo_51976_baseline", "sync", B, 51976, 26.33, False, _SOLO_AT),
    _solo("solo_51976_afd", "async", A, 51976, 20.68, False, _SOLO_AT),
    _batch("batch_32k_baseline", "closed-loop 32K balanced batch (8 x ~3.9k, 30,857 tokens) p50, baseline", B,
           _balanced(30857, 8), 10.010, _FIXED_AT),
    _batch("batch_32k_afd", "closed-loop 32K balanced batch (8 x ~3.9k, 30,857 tokens) p50, AFD A2", A,
           _balanced(30857, 8), 7.058, _FIXED_AT),
    _batch("batch_8k_baseline", "closed-loop 8K balanced batch (8 x ~1k, 7,743 tokens) p50, baseline", B,
           _balanced(7743, 8), 2.095, _FIXED_AT),
    _batch("batch_8k_afd", "closed-loop 8K balanced batch (8 x ~1k, 7,743 tokens) p50, AFD A2", A,
           _balanced(7743, 8), 1.501, _FIXED_AT),
    _batch("batch_32k_mixed_baseline", "closed-loop 32K long+short batch (1 x 25.5k + 7 x 1,170, 33,704 tokens) "
           "p50, baseline", B, [33704 - 7 * 1170] + [1170] * 7, 12.735, _FIXED_AT),
    _batch("batch_32k_mixed_afd", "closed-loop 32K long+short batch (1 x 25.5k + 7 x 1,170, 33,704 tokens) p50, "
           "AFD A2", A, [33704 - 7 * 1170] + [1170] * 7, 9.691, _FIXED_AT),
    *[Figure(f"{stat}_at_{int(load)}_{side}", f"TTFT {stat} at {load:,} tok/s offered (screening window), "
             f"{'baseline' if side == 'baseline' else 'AFD A2'}", "loaded_ttft", value, "s",
             B if side == "baseline" else A, f"{AFD_REPORT}, section 1 (screening table: every tested point)",
             {"offered_tokens_per_s": load, "stat": stat})
      for load, side, stat, value in ((2185.5, "baseline", "p50", 17.85), (2185.5, "baseline", "p99", 46.78),
                                      (2185.5, "afd", "p50", 12.50), (2185.5, "afd", "p99", 40.21),
                                      (4371.0, "baseline", "p50", 24.03), (4371.0, "baseline", "p99", 52.30),
                                      (4371.0, "afd", "p50", 18.10), (4371.0, "afd", "p99", 44.08))],
    Figure("capacity_baseline", "capacity at TTFT p99 <= 50 s (128-request screening window), baseline",
           "capacity", 2600.0, "tok/s", B, f"{AFD_REPORT}, section 1 (last pass 2,599 tok/s, first fail 3,091)"),
    Figure("capacity_afd", "capacity at TTFT p99 <= 50 s (128-request screening window), AFD A2", "capacity",
           4400.0, "tok/s", A, f"{AFD_REPORT}, section 1 (last pass 4,371 tok/s, first fail 5,198)"),
    Figure("capacity_ratio", "capacity ratio AFD A2 / baseline at TTFT p99 <= 50 s", "capacity_ratio", 1.68, "x",
           f"{A} vs {B}", f"{AFD_REPORT}, TL;DR and section 1 (~4,400 / ~2,600 tok/s)"),
    Figure("cloudmatrix_prefill_per_npu", "CloudMatrix-Infer prefill throughput per NPU (910C package), 4k prompts",
           "throughput_per_npu", 6688.0, "tok/s/NPU", "cloudmatrix-prefill-32",
           f"{SOURCES['cloudmatrix']}: abstract (6,688 tokens/s per NPU) and Table 2 (prefill: input length 4,096, "
           "batch 16,384 tokens per accelerator, perfect EPLB; 5,655 with the default EPLB; 4.45 tokens/s/TFLOPS, "
           "so 'NPU' = 910C package: 6,688 / 4.45 = ~1,503 INT8 TOPS). The abstract was read here; Table 2 as "
           "quoted by secondary summaries (the PDF itself was not reachable)", {"prompt_len": 4096, "per_die": 4},
           fitted=True, quick=True),
    *ASYNC_FIGURES,
]


# ----------------------------------------------------------------------------- stacks
def stack_profile(profile: str, stack: str) -> Profile:
    """``profile`` with its ``stacks[stack]`` overrides applied (``"cloudmatrix-infer"``: the profile as is).

    An override is ``"dotted.path.into.the.profile": value``, e.g. ``"ops.attention.flops_per_s.core.eff"``."""
    base = Profile.load(profile)
    if stack == "cloudmatrix-infer":
        return base
    stacks = base.data.get("stacks") or {}
    if stack not in stacks:
        raise ValueError(f"stack_profile: profile {base.name!r} has no stack {stack!r} (known: "
                         f"{sorted(k for k in stacks if k != 'source')})")
    data = copy.deepcopy(base.data)
    for path, value in stacks[stack].get("overrides", {}).items():
        node, keys = data, path.split(".")
        for k in keys[:-1]:
            if not isinstance(node, dict) or k not in node:
                raise ValueError(f"stack_profile: stack {stack!r} overrides {path!r}, which profile {base.name!r} "
                                 "does not have")
            node = node[k]
        if not isinstance(node, dict) or keys[-1] not in node:
            raise ValueError(f"stack_profile: stack {stack!r} overrides {path!r}, which profile {base.name!r} does "
                             "not have")
        node[keys[-1]] = value
    return Profile(data, f"{base.path}#stacks.{stack}")


# ----------------------------------------------------------------------------- simulation of one figure
class _Pinned(Placer):
    """Every request on rank 0 (the published fixed batches are pinned to DP rank 0)."""

    def place(self, request_id, chunks) -> int:
        super().place(request_id, chunks)  # book-keeping (complete() needs it) ...
        held = self._held[request_id]
        rank = held[0][0]
        self._work[rank] -= held[1]  # ... then move the request to rank 0
        self._work[0] += held[1]
        self._held[request_id] = ([0], held[1])
        return 0


def _run(dep: Deployment, requests: list, cost, shapes, *, pinned: bool = False, token_budget=None) -> list:
    cfg = dep.cfg(token_budget)
    if dep.mode == "sync":
        sim = _SyncSim(cost, shapes, cfg, requests, False, dep.sync_ranks, dep.par(), None)
        ranks = dep.sync_ranks
    else:
        sim = _AsyncSim(cost, shapes, cfg, requests, False, dep.par(), None)
        ranks = dep.attention_ranks
    if pinned:
        sim.placer = _Pinned(ranks, load_aware=cfg.load_aware)
    sim.run()
    return sim._finish_records()


def _capacity(dep: Deployment, trace: list, cost, shapes, progress: bool) -> tuple:
    """The published capacity: the highest offered input tokens/s whose TTFT p99 over the window is <= 50 s
    (the study's criterion), searched as the study did (double from a start, then geometric midpoints) but to a
    bound ratio of 1.05 (the study stopped at 1.20). Returns (capacity or None when even 1/64 of the start
    fails, the tested points [(tok/s, p99 s)])."""
    points = []

    def passes(tok_s: float) -> bool:
        s, _ = run_point(dep.mode, trace, tok_s / mean_len(trace), cost, shapes, dep.cfg(), SLO_S,
                         sync_ranks=dep.sync_ranks if dep.mode == "sync" else None, par=dep.par())
        points.append((tok_s, s["ttft_p99_s"]))
        if progress:
            print(f"    capacity {dep.name}: {tok_s:8.0f} tok/s  TTFT p99 {s['ttft_p99_s']:7.2f} s", file=sys.stderr,
                  flush=True)
        return s["ttft_p99_s"] is not None and s["ttft_p99_s"] <= SLO_S

    lo, hi, rate = None, None, 1000.0
    if passes(rate):
        lo = rate
        for _ in range(10):
            if not passes(2 * lo):
                hi = 2 * lo
                break
            lo *= 2
    else:
        hi = rate
        while hi > 1000.0 / 64:
            if passes(hi / 2):
                lo = hi / 2
                break
            hi /= 2
    while lo is not None and hi is not None and hi / lo > 1.05:
        mid = (lo * hi) ** 0.5
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(points)


def simulate_figure(fig: Figure, costs: dict, shapes, *, cache: dict, num_requests: int = 128,
                    progress: bool = False) -> float:
    """The simulator's value of ``fig``; ``costs``: stack -> CostModel; ``cache`` keeps capacity searches."""
    if fig.kind == "capacity_ratio":
        b = simulate_figure(_by_key("capacity_baseline"), costs, shapes, cache=cache, num_requests=num_requests,
                            progress=progress)
        a = simulate_figure(_by_key("capacity_afd"), costs, shapes, cache=cache, num_requests=num_requests,
                            progress=progress)
        return None if not a or not b else a / b
    if fig.kind in ASYNC_KINDS:
        return simulate_async_figure(fig, costs, shapes, cache, progress)
    dep = DEPLOYMENTS[fig.deployment]
    cost = costs[dep.stack]
    if fig.kind == "solo_ttft":
        rec = _run(dep, [Request(0, 0.0, fig.params["prompt_len"])], cost, shapes)[0]
        return rec.ttft_s
    if fig.kind == "fixed_batch":
        lens = fig.params["prompt_lens"]
        budget = None
        if dep.mode == "async":  # two micro-batches of whole requests, half of the batch each (A1 ~ A2)
            acc, half = 0, sum(lens) / 2
            for n in sorted(lens, reverse=True):
                acc += n
                if acc >= half:
                    budget = max(acc, max(lens))
                    break
        recs = _run(dep, [Request(i, 0.0, n) for i, n in enumerate(lens)], cost, shapes, pinned=True,
                    token_budget=budget)
        return max(r.ttft_s for r in recs)
    if fig.kind == "loaded_ttft":
        if ("trace", num_requests) not in cache:
            cache[("trace", num_requests)] = afd_screening_window(num_requests)
        trace = cache[("trace", num_requests)]
        rate = fig.params["offered_tokens_per_s"] / mean_len(trace)
        s, _ = run_point(dep.mode, trace, rate, cost, shapes, dep.cfg(), SLO_S,
                         sync_ranks=dep.sync_ranks if dep.mode == "sync" else None, par=dep.par())
        return s[f"ttft_{fig.params['stat']}_s"]
    if fig.kind == "capacity":
        key = ("capacity", dep.name, num_requests)
        if key not in cache:
            if ("trace", num_requests) not in cache:
                cache[("trace", num_requests)] = afd_screening_window(num_requests)
            cache[key], cache[("points", fig.key)] = _capacity(dep, cache[("trace", num_requests)], cost, shapes,
                                                               progress)
        return cache[key]
    if fig.kind == "throughput_per_npu":  # steady state (module docstring): batch 2 of 3 queued at once
        n = dep.sync_ranks * fig.params["per_die"] if dep.mode == "sync" else 4 * dep.attention_ranks
        recs = _run(dep, [Request(i, 0.0, fig.params["prompt_len"]) for i in range(3 * n)], cost, shapes)
        done = sorted(r.done_s for r in recs)
        return 2.0 * n * fig.params["prompt_len"] / (done[2 * n - 1] - done[n - 1]) / dep.dies
    raise ValueError(f"simulate_figure: unknown kind {fig.kind!r}")


def _by_key(key: str) -> Figure:
    for f in FIGURES:
        if f.key == key:
            return f
    raise KeyError(key)


def relative_error(sim, published: float):
    """``(sim - published) / published``, or None when the simulator has no value."""
    if sim is None:
        return None
    if not published:
        raise ValueError(f"relative_error: published value {published!r} must be non-zero")
    return (sim - published) / published


# ----------------------------------------------------------------------------- the regime
def validate_published(out_dir, *, profile: str = "ascend-910c-cm384", model: str = "deepseek-v3",
                       configs: str = "default", num_requests: int = 128,
                       progress: bool = True) -> dict:
    """Simulate every published figure (``configs="quick"``: the cheap ones); write and return
    ``validation_published.json``'s content."""
    if configs not in ("default", "quick"):
        raise ValueError(f"validate --regime published: configs={configs!r} is not one of ['default', 'quick']")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 8:
        raise ValueError(f"validate --regime published: num_requests={num_requests!r} must be an int >= 8")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = ModelShapes.load(model)
    stacks = sorted({d.stack for d in DEPLOYMENTS.values()})
    profiles = {s: stack_profile(profile, s) for s in stacks}
    costs = {s: CostModel(p, shapes) for s, p in profiles.items()}
    figs = [f for f in FIGURES if configs == "default" or f.quick]
    rows, cache, t0 = [], {}, time.perf_counter()
    for f in figs:
        t1 = time.perf_counter()
        sim = simulate_figure(f, costs, shapes, cache=cache, num_requests=num_requests,
                              progress=progress)
        err = relative_error(sim, f.value)
        pts = cache.get(("points", f.key))
        note = None
        if f.kind == "capacity" and sim is None and pts:
            note = (f"the simulated TTFT p99 is above {SLO_S:g} s at every tested load (its floor "
                    f"{min(p for _, p in pts if p is not None):.1f} s, set by the window's same-timestamp bursts)")
        elif f.kind == "capacity_ratio" and sim is None:
            note = "undefined: a capacity is missing (see the capacity rows)"
        note = note or cache.get(("note", f.key))
        deps = [DEPLOYMENTS[d] for d in f.deployment.split(" vs ")]
        rows.append({"key": f.key, "figure": f.label, "kind": f.kind, "unit": f.unit, "published": f.value,
                     "sim": sim, "relative_error": err, "within_target": err is not None and abs(err) <= TARGET,
                     "fitted": f.fitted, "source": f.source, "params": f.params,
                     "deployment": f.deployment, "deployments": [d.describe() for d in deps],
                     "note": note, "points_tok_s_p99_s": pts, "wall_s": time.perf_counter() - t1})
        if progress:
            print(f"  [{time.perf_counter() - t0:5.0f} s] {f.key:28s} published {f.value:10.4g} sim "
                  f"{'-' if sim is None else f'{sim:10.4g}'} ({'-' if err is None else f'{err:+.1%}'})",
                  file=sys.stderr, flush=True)

    explain = async_notes(cache)
    for r in rows:
        if not r["note"] and r["key"] in explain and (not r["within_target"] or r["kind"] == "slo_attainment"):
            r["note"] = explain[r["key"]]

    def stats(sel):
        errs = [abs(r["relative_error"]) for r in sel if r["relative_error"] is not None]
        return {"compared": len(sel), "within_target": sum(r["within_target"] for r in sel),
                "median_abs_relative_error": statistics.median(errs) if errs else None,
                "max_abs_relative_error": max(errs) if errs else None}

    result = {"regime": "published", "target_abs_relative_error": TARGET, "profile": profile, "model": shapes.name,
              "configs": configs, "slo_s": SLO_S, "slo_percentile": 100 * SLO_TARGET,
              "num_requests": num_requests, "sources": SOURCES,
              "stacks": {s: (p.data.get("stacks") or {}).get(s, {"overrides": {}, "source": "the profile as is"})
                         for s, p in profiles.items()},
              "rows": rows, "all": stats(rows), "fitted": stats([r for r in rows if r["fitted"]]),
              "held_out": stats([r for r in rows if not r["fitted"]]), "wall_s": time.perf_counter() - t0}
    (out / "validation_published.json").write_text(json.dumps(result, indent=2, default=str))
    for s, p in profiles.items():  # each stack as a profile file, for --profile / --emulate elsewhere
        if s != "cloudmatrix-infer":
            data = {k: v for k, v in p.data.items() if k != "stacks"}
            data["name"] = f"{p.name}+{s}"
            data["description"] = f"{p.data.get('description', '')} With the {s!r} stack: {p.data['stacks'][s]['source']}"
            (out / f"profile_{s}.json").write_text(json.dumps(data, indent=2))
    return result


def _short_deployment(dep: str) -> str:
    """A row's deployment for the table (22 characters)."""
    if dep.startswith("v4flash-baseline-"):
        return "V4 best baseline"
    parts = dep.split(" vs ")
    if len(parts) == 1:
        return dep
    if parts[0] == A:
        return "afd A2 / baseline"
    return "V4 AFD / best baseline" if parts[0] == V4A else "V3.2 AFD vs baseline"


def published_table(result: dict) -> str:
    """The table ``validate --regime published`` prints."""
    lines = [f"{'figure':28s} {'deployment':22s} {'published':>11s} {'simulated':>11s} {'error':>7s}  within "
             f"{TARGET:.0%}  fit"]
    for r in result["rows"]:
        sim = "-" if r["sim"] is None else f"{r['sim']:.4g}"
        err = "-" if r["relative_error"] is None else f"{r['relative_error']:+.1%}"
        dep = _short_deployment(r["deployment"])
        lines.append(f"{r['key']:28s} {dep[:22]:22s} {r['published']:>9.4g} {r['unit'][:1] if r['unit'] == 's' else '':1s}"
                     f" {sim:>11s} {err:>7s}  {'yes' if r['within_target'] else 'NO ':>6s}    "
                     f"{'fitted' if r['fitted'] else 'held out'}")
    for name in ("fitted", "held_out", "all"):
        s = result[name]
        if s["compared"]:
            lines.append(f"{name.replace('_', ' '):9s}: {s['within_target']}/{s['compared']} within {TARGET:.0%}, "
                         f"median |error| {s['median_abs_relative_error']:.1%}, max {s['max_abs_relative_error']:.1%}")
    for r in result["rows"]:
        if r.get("note"):
            lines.append(f"{r['key']}: {r['note']}")
    lines.append("sources and deployments: validation_published.json (rows[].source, rows[].deployments)")
    return "\n".join(lines)


def published_markdown(result: dict, command: str) -> str:
    """The table ``validate --regime published --markdown FILE`` writes: every row with its source, the summary
    and the reason of each row outside the target (docs/results/validation_published.md)."""
    sources = []
    for r in result["rows"]:
        if r["source"] not in sources:
            sources.append(r["source"])
    lines = [f"<!-- generated by: {command}; edit the command, not this page -->\n",
             "# Validation against published measurements\n",
             f"The simulator (profile `{result['profile']}`, model `{result['model']}`, configs "
             f"`{result['configs']}`, capacity window of {result['num_requests']} requests) against published "
             f"figures. Target: within {TARGET:.0%}. *Fitted* rows set a value of the profile; the others are held "
             "out. Method and reading: [the validation page](../validation.md#against-published-measurements).\n",
             f"| figure | deployment | published | simulated | error | within {TARGET:.0%} | fit | source |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        unit = f" {r['unit']}" if r["unit"] == "s" else ""
        sim = "-" if r["sim"] is None else f"{r['sim']:.4g}{unit}"
        err = "-" if r["relative_error"] is None else f"{r['relative_error']:+.1%}"
        if not r["within_target"]:
            err = f"**{err}**"
        lines.append(f"| {r['figure'].replace('|', '/')} | {_short_deployment(r['deployment'])} | {r['published']:.4g}{unit} | {sim} | "
                     f"{err} | {'yes' if r['within_target'] else 'no'} | {'fitted' if r['fitted'] else 'held out'} | "
                     f"[{sources.index(r['source']) + 1}] |")
    lines.append("")
    for name in ("fitted", "held_out", "all"):
        st = result[name]
        if st["compared"]:
            lines.append(f"* {name.replace('_', ' ')}: {st['within_target']} of {st['compared']} within {TARGET:.0%}, "
                         f"median |error| {st['median_abs_relative_error']:.1%}, max {st['max_abs_relative_error']:.1%}")
    notes = [f"* {r['figure']}: {r['note']}" for r in result["rows"] if r.get("note")]
    if notes:
        lines += ["", "## Why rows miss", ""] + notes
    lines += ["", "## Sources", ""] + [f"{i}. {src}" for i, src in enumerate(sources, 1)]
    return "\n".join(lines) + "\n"
