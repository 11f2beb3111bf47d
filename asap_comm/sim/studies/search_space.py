"""The best-against-best search at one cluster size, shared by ``sim scaling`` and ``sim plan``.

**The SLO rule** (:func:`slo_rule`, ``asap_comm.serving.slo.auto_slo`` measured on one deployment): ``SLO_MULTIPLIER``
(3) x the unloaded TTFT of the trace's 90th-percentile prompt (over the whole trace file) on one reference deployment,
the same at every cluster size: the synchronous baseline of ``REFERENCE_DIES`` (32) dies in DP groups of TP8
(4 groups), no context parallelism, 16k chunks, all_to_alls overlapped. So the SLO depends on the profile, the
model and the trace, never on the size searched or on a grid. One SLO serves both percentiles: a deployment meets
it at p90 when 90% of requests do, at p99 when 99% do, so every simulated run answers both.

**The grids** (the same breadth on both sides, :func:`structures` and :func:`refinements`): TP degree
(``TPS``), chunk size and micro-batch / step token budget (``CHUNK_BUDGETS``) on both; the baseline's context
parallelism threshold (``CPS``); ASAP's attention:expert split (:func:`expert_splits`), its expert batching
(``EXPERT_BATCHING``: deadline, rows) and its long-prompt lane (``LANES``: KV pool, wait bound in SLOs, and
chunks of equal length or of equal attention cost, ``RuntimeConfig.lane_chunks``). The
baseline overlaps its all_to_alls with compute (DeepSeek's two-micro-batch overlap; never slower in this model).
Every candidate passes the memory check (``memory.deployment_problems``) or is left out.

**The search** (:func:`search_mode`, per mode, coordinate-wise): (1) every structure (TP x CP, TP x split) with
the middle knobs (8k chunks, 16k budget; ASAP 0.5 ms / 16384-row expert batches, the lane's default pool and no
wait bound); (2) the chunk/budget pairs on the two best structures; (3) on the best so far, the mode's own
knobs (the baseline's CP thresholds; ASAP's expert batching, then its lane), and where no structure met the SLO
in (1), each of those knobs on every structure first (the knob may be what a structure lacks: ASAP's lane split
under a strict p99 SLO); (4) every structure again with the winner's knobs (they interact: at 384 dies ASAP's lane pool of two prompts lifted its best by half). Offered loads lie on one lattice,
``rate0 * 2**(k / 16)`` (steps of 4.4%), so that points are shared: across candidates, stages and percentiles
(the :class:`Evaluator` caches every run by deployment and lattice index). The first candidate's load is
searched coarse to fine (steps of 2x up or down, then bisection to one lattice step); every later candidate
is first run at the lattice step just above the incumbent's SLO-compliant load: if it fails there it cannot win
(ties keep the incumbent) and costs one run; if it passes, its load is searched upward from there. A load
passes only where the mode meets the SLO percentile AND sustains it (served >= 0.9 of offered,
``serving.metrics.sustains_slo``); the reported figure is ``serving.metrics.slo_compliant_throughput`` of every
point tested for that deployment.

**A bound instead of a run.** A request is never faster than alone on an empty system, and a longer prompt never
faster than a shorter one: where the unloaded TTFT of the window's prompt at rank ``ceil(target * n) - 1``
(sorted by length) exceeds the SLO, the attainment is below the target at any load, and the point is recorded
as failed (``bounded``) without simulating it.

**The window.** A load of ``r`` requests/s runs the first ``n(r)`` requests of the window, enough for the
arrivals to span ``study.SPAN_SLOS`` (10) SLOs with a 20% margin (``served_fraction``'s window), at least
``n_min``, at most ``n_max``: fewer requests where the rate allows, and a point's span is recorded. A *seed* of
a public trace is a window of it: seed ``s`` starts at request ``s * len(trace) // 3`` (re-zeroed), so the three
seeds are disjoint stretches of the same hour. Mooncake's timestamps come in 3-s steps and are spread over them
(``study.spread_buckets``).
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field

from ...serving.metrics import (MIN_SERVED, served_at_load, slo_compliant_throughput, sustains_slo,
                                withheld_reason)
from ...serving.slo import auto_slo
from ...serving.traces import Request, load_trace, resolve_trace
from ..core.simulate import Parallelism, simulate
from ..core.sweep import SPAN_SLOS, Deployment, mean_len, run_point, spread_buckets
from ..costmodel.memory import deployment_problems
from .grids import headline_config

__all__ = ["REFERENCE_DIES", "TPS", "CPS", "CHUNK_BUDGETS", "EXPERT_BATCHING", "LANES",
           "MAX_PROMPT", "slo_rule", "reference_deployment", "TraceWindows", "expert_splits", "structures",
           "refinements", "translate", "Evaluator", "load_search", "search_mode", "search_size", "load_windows"]

REFERENCE_DIES = 32
MAX_PROMPT = 131072  # the runtime's longest prompt (Mooncake's longest is 126k)
TPS = (1, 2, 4, 8)
CPS = (None, 4096, 8192, 16384, 32768)
CHUNK_BUDGETS = ((4096, 4096), (4096, 16384), (8192, 8192), (8192, 16384), (16384, 16384))
BASE_CHUNK = (8192, 16384)
EXPERT_BATCHING = ((0.0005, 16384), (0.0005, 32768), (0.002, 16384), (0.002, 32768))
# the lane: (KV pool, wait bound in SLOs, how a lane prompt is split: RuntimeConfig.lane_chunks)
LANES = tuple((pool, wait, how) for how in ("tokens", "cost")
              for pool, wait in ((None, None), (2 * MAX_PROMPT, None), (None, 1.0), (2 * MAX_PROMPT, 1.0)))
STEPS_PER_DOUBLING = 16


# ----------------------------------------------------------------------------- the SLO rule
def reference_deployment(shapes) -> Deployment:
    """The deployment the SLO rule measures on: ``REFERENCE_DIES`` dies of the baseline, TP8 groups (or the
    largest TP dividing the heads), no CP, 16k chunks, overlap."""
    tp = next(t for t in (8, 4, 2, 1) if shapes.heads % t == 0)
    return Deployment("sync", headline_config(chunk=16384, budget=16384),
                      Parallelism(sync_tp=tp, sync_overlap=True), sync_ranks=max(1, REFERENCE_DIES // tp))


def slo_rule(trace, cost, shapes) -> tuple:
    """THE SLO of the scaling curve and of the planner: ``(seconds, description)``, ``serving.slo.auto_slo`` (
    ``SLO_MULTIPLIER`` x the unloaded TTFT of ``trace``'s 90th-percentile prompt, the whole trace, clipped at
    ``MAX_PROMPT``) measured on :func:`reference_deployment`. Fixed per profile, model and trace; the same at every
    size and percentile."""
    ref = reference_deployment(shapes)

    def alone(p90: int) -> float:
        res = simulate("sync", [Request(0, 0.0, p90)], cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks, par=ref.par)
        if res.records[0].ttft_s is None:
            raise ValueError(f"slo_rule: the p90 prompt ({p90} tokens) failed on {ref.label}: {res.records[0].error}")
        return res.records[0].ttft_s

    r = auto_slo([q.prompt_len for q in trace], alone, max_prompt_len=MAX_PROMPT)
    return r.ttft_s, (f"{r.multiplier:g}x the unloaded TTFT of the trace's p90 prompt ({r.p90_prompt_tokens} tokens: "
                      f"{r.unloaded_ttft_s:.3g} s) on the reference {ref.label} ({ref.devices} dies), at every size "
                      "and percentile")


# ----------------------------------------------------------------------------- traces and their windows
@dataclass
class TraceWindows:
    """A whole trace (``name``: its public name or file), its arrivals spread where they come in steps."""

    name: str
    requests: list
    note: str

    def window(self, seed: int, n: int) -> list:
        """The ``n`` requests of seed ``seed`` (starting at request ``seed * len // 3``), re-zeroed, renumbered."""
        stride = len(self.requests) // 3
        start = (seed % 3) * stride
        part = self.requests[start:start + min(n, stride if stride else n)]
        t0 = part[0].arrival_s
        return [Request(i, r.arrival_s - t0, r.prompt_len, r.output_len) for i, r in enumerate(part)]

    @property
    def max_window(self) -> int:
        return max(1, len(self.requests) // 3)


def load_windows(spec: str) -> TraceWindows:
    """``spec``: ``mooncake``, ``azure`` or a trace file. Prompts clipped at ``MAX_PROMPT``; timestamps that
    come in steps of a second or more are spread over their step (``study.spread_buckets``)."""
    path = resolve_trace(spec)
    trace = load_trace(path, max_prompt_len=MAX_PROMPT)
    spread, g = spread_buckets(trace)
    note = f"{spec}: {len(trace)} requests"
    if g >= 1.0:
        trace = spread
        note += f", arrivals spread over the file's {g:g}-s timestamp steps"
    return TraceWindows(str(spec), trace, note)


# ----------------------------------------------------------------------------- the grids
def expert_splits(dies: int, min_experts: int = 1) -> list:
    """ASAP's expert dies searched at ``dies``: about 1/8, 1/6, 1/4, 1/3 and 1/2 of the dies, each rounded to a
    multiple of 4 (8 from 64 dies on, so that TP8 groups divide the rest), at least ``min_experts`` (the fewest
    whose dies hold the routed experts), at most half the dies; the smallest feasible count when none of those
    is."""
    q = 8 if dies >= 64 else 4
    out = []
    for f in (8, 6, 4, 3, 2):
        e = max(q, q * round(dies / f / q))
        e = max(e, q * math.ceil(min_experts / q))
        if e <= dies // 2 and e not in out:
            out.append(e)
    if not out and min_experts < dies:
        out.append(min_experts)
    return sorted(out)


def _sync(dies, tp, cp, chunk, budget) -> Deployment:
    return Deployment("sync", headline_config(chunk=chunk, budget=budget),
                      Parallelism(sync_tp=tp, cp_threshold=cp, sync_overlap=True), sync_ranks=dies // tp)


def _async(dies, tp, e, chunk, budget, deadline=0.0005, rows=16384, lane_tokens=None, lane_wait=None,
           lane_chunks="tokens") -> Deployment:
    cfg = headline_config((dies - e) // tp, e, chunk, budget, rows, deadline, lane_tokens)
    if lane_wait is not None:
        cfg = dataclasses.replace(cfg, lane_wait_s=lane_wait)
    if lane_chunks != cfg.lane_chunks:
        cfg = dataclasses.replace(cfg, lane_chunks=lane_chunks)
    return Deployment("async", cfg, Parallelism(attention_tp=tp))


def min_expert_dies(cost, shapes, dies: int, tp: int) -> int:
    """The fewest expert dies whose memory holds ASAP's expert side at ``dies`` with TP ``tp`` attention groups
    (the expert dies' symmetric buffers grow with the number of groups), ``dies`` if none does."""
    for e in range(1, dies):
        if (dies - e) % tp:
            continue
        d = _async(dies, tp, e, *BASE_CHUNK)
        if not [p for p in deployment_problems(d, cost.profile, shapes) if "expert die" in p]:
            return e
    return dies


def structures(mode: str, dies: int, shapes, cost, tps=TPS, cps=CPS) -> list:
    """Stage 1 candidates: the baseline's TP x CP threshold, ASAP's TP x expert split; middle knobs."""
    out = []
    if mode == "sync":
        for tp in tps:
            if dies % tp or shapes.heads % tp:
                continue
            out += [_sync(dies, tp, cp, *BASE_CHUNK) for cp in cps]
        return out
    for tp in tps:
        if shapes.heads % tp or dies <= tp:
            continue
        splits = expert_splits(dies, min_expert_dies(cost, shapes, dies, tp))
        for e in splits or [max(1, dies // 2)]:  # none holds the experts: one split, for memory to name why
            if (dies - e) % tp == 0 and dies - e >= tp:
                out.append(_async(dies, tp, e, *BASE_CHUNK))
    return out


def _with(d: Deployment, **kw) -> Deployment:
    """``d`` with some knobs changed: chunk/budget (both modes), cp (baseline), deadline/rows/lane (ASAP)."""
    c, p = d.cfg, d.par
    chunk, budget = kw.get("chunk", c.chunk_len), kw.get("budget", c.token_budget)
    if d.mode == "sync":
        return _sync(d.devices, p.sync_tp, kw.get("cp", p.cp_threshold), chunk, budget)
    return _async(d.devices, p.attention_tp, c.num_expert_ranks, chunk, budget,
                  kw.get("deadline", c.expert_deadline_s), kw.get("rows", c.expert_token_budget),
                  kw.get("lane_tokens", c.lane_tokens), kw.get("lane_wait", c.lane_wait_s),
                  kw.get("lane_chunks", c.lane_chunks))


def with_knobs_of(d: Deployment, w: Deployment) -> Deployment:
    """Structure ``d`` (TP, CP threshold / expert split) with the knobs of ``w`` (chunk, budget; ASAP's expert
    batching and lane)."""
    c = w.cfg
    if d.mode == "sync":
        return _with(d, chunk=c.chunk_len, budget=c.token_budget)
    return _with(d, chunk=c.chunk_len, budget=c.token_budget, deadline=c.expert_deadline_s,
                 rows=c.expert_token_budget, lane_tokens=c.lane_tokens, lane_wait=c.lane_wait_s,
                 lane_chunks=c.lane_chunks)


def refinements(d: Deployment, stage: str, slo_s: float, chunk_budgets=CHUNK_BUDGETS, cps=CPS,
                batching=EXPERT_BATCHING, lanes=LANES) -> list:
    """Stage 2 (``"chunk"``: every chunk/budget pair) or stage 3 (``"cp"``: the baseline's CP thresholds;
    ``"batching"``: ASAP's expert deadline and rows; ``"lane"``: its lane's pool, wait bound (in multiples of
    ``slo_s``) and chunking, each entry of ``lanes`` ``(pool, wait)`` (chunks of equal length) or
    ``(pool, wait, lane_chunks)``) around ``d``."""
    if stage == "chunk":
        return [_with(d, chunk=c, budget=b) for c, b in chunk_budgets]
    if stage == "cp":
        return [_with(d, cp=cp) for cp in cps] if d.mode == "sync" else []
    if d.mode == "sync":
        return []
    if stage == "batching":
        return [_with(d, deadline=dl, rows=r) for dl, r in batching]
    if stage == "lane":
        return [_with(d, lane_tokens=lane[0], lane_wait=None if lane[1] is None else lane[1] * slo_s,
                      lane_chunks=lane[2] if len(lane) > 2 else "tokens") for lane in lanes]
    raise ValueError(f"refinements: stage={stage!r} must be 'chunk', 'cp', 'batching' or 'lane'")


def _key(d: Deployment) -> str:
    return repr(d)


# ----------------------------------------------------------------------------- the evaluator
@dataclass
class Evaluator:
    """Runs (and caches) one deployment at one lattice load of one trace window under one SLO.

    ``rate0``: the lattice's origin (requests/s); ``seed``: the trace window; ``n_min``/``n_max``: requests."""

    trace: TraceWindows
    cost: object
    shapes: object
    slo_s: float
    rate0: float
    seed: int = 0
    n_min: int = 600
    n_max: int = 4000
    progress: "str | None" = None
    cache: dict = field(default_factory=dict)
    unloaded: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: {"simulated": 0, "bounded": 0, "cached": 0, "sim_wall_s": 0.0})

    def rate(self, k: int) -> float:
        return self.rate0 * 2.0 ** (k / STEPS_PER_DOUBLING)

    def requests_at(self, rate: float) -> int:
        """``n(rate)``: enough arrivals to span ``SPAN_SLOS`` SLOs plus 20%, within [n_min, n_max]."""
        n = math.ceil(1.2 * SPAN_SLOS * self.slo_s * rate) + 1
        return max(min(self.n_min, self.trace.max_window), min(n, self.n_max, self.trace.max_window))

    def _unloaded(self, d: Deployment, prompt: int) -> float:
        key = (_key(d), prompt)
        if key not in self.unloaded:
            res = simulate(d.mode, [Request(0, 0.0, prompt)], self.cost, self.shapes, d.cfg, sync_ranks=d.sync_ranks,
                           par=d.par, slo_s=self.slo_s)
            t = res.records[0].ttft_s
            self.unloaded[key] = math.inf if t is None else t
        return self.unloaded[key]

    def point(self, d: Deployment, k: int, target: float) -> dict:
        """The run summary at lattice load ``k`` (simulated once per deployment and load; a failed bound for
        ``target`` stands in for the run where it decides, see the module docstring)."""
        key = (_key(d), k)
        if key in self.cache:
            s = self.cache[key]
            if not s.get("bounded") or s["bound_target"] <= target:  # a bound failing p90 fails p99 too
                self.stats["cached"] += 1
                return s
        rate = self.rate(k)
        trace = self.trace.window(self.seed, self.requests_at(rate))
        lens = sorted(r.prompt_len for r in trace)
        idx = max(0, math.ceil(target * len(lens)) - 1)
        if self._unloaded(d, lens[idx]) > self.slo_s:  # at least n - idx requests miss at any load
            s = {"rate_req_s": rate, "offered_tokens_per_s": rate * mean_len(trace), "slo_attainment": idx / len(lens),
                 "served_fraction": 1.0, "throughput_tokens_per_s": None, "ttft_p90_s": None, "ttft_p99_s": None,
                 "num_requests": len(trace), "bounded": True, "bound_target": target,
                 "bound": f"unloaded TTFT of the {lens[idx]}-token prompt {self._unloaded(d, lens[idx]):.3g} s > SLO"}
            self.stats["bounded"] += 1
            self.cache[key] = s
            return s
        s, _ = run_point(d.mode, trace, rate, self.cost, self.shapes, d.cfg, self.slo_s, sync_ranks=d.sync_ranks,
                         par=d.par)
        s["arrival_span_over_slo"] = (len(trace) - 1) / rate / self.slo_s  # at_rate: (n - 1) / span = rate
        self.stats["simulated"] += 1
        self.stats["sim_wall_s"] += s.get("sim_wall_s", 0.0)
        self.cache[key] = s
        if self.progress:
            print(f"  [{self.progress}] {d.label[:70]:70s} {rate:9.4g} req/s n={len(trace):5d} att "
                  f"{s['slo_attainment']:.3f} served {s['served_fraction']:4.0%} ({s['sim_wall_s']:.1f} s)",
                  file=sys.stderr, flush=True)
        return s

    def passes(self, d: Deployment, k: int, target: float) -> bool:
        s = self.point(d, k, target)
        return sustains_slo(s["slo_attainment"], s["served_fraction"], target, min_served=MIN_SERVED)

    def points_of(self, d: Deployment) -> list:
        key = _key(d)
        return sorted((s for (kd, _), s in self.cache.items() if kd == key), key=lambda s: s["rate_req_s"])

    def result(self, d: Deployment, target: float) -> dict:
        """The official figures of ``d`` over every point tested for it (any percentile's search)."""
        pts = self.points_of(d)
        sct = slo_compliant_throughput(pts, target, min_served=MIN_SERVED) if pts else None
        at = served_at_load([p for p in pts if not p.get("bounded")], sct)
        above = [p for p in pts if sct is None or p["offered_tokens_per_s"] > sct]
        return {"slo_compliant_throughput": sct, "served_fraction": None if at is None else at["served_fraction"],
                "withheld": withheld_reason(pts, target, min_served=MIN_SERVED) if pts else "not run",
                "at_slo_compliant_load": at,
                # False: even the highest load tested passed (the figure is a lower bound)
                "saturated": any(not sustains_slo(p["slo_attainment"], p["served_fraction"], target) for p in above),
                "points": pts}


# ----------------------------------------------------------------------------- one mode's search
MAX_STEPS = 8  # coarse steps (2x) up or down before giving up


def load_search(ev: Evaluator, d: Deployment, target: float, k_inc: "int | None", k_start: int,
                coarse: int = STEPS_PER_DOUBLING) -> "int | None":
    """The highest passing lattice index of ``d`` (None: none; with an incumbent ``k_inc``: None unless it
    passes above ``k_inc``): from ``k_start`` (or just above ``k_inc``) in steps of ``coarse`` lattice steps up
    (down while it fails), then bisection to one step."""
    S = max(1, coarse)
    hi = None  # the lowest index known to fail
    if k_inc is not None:
        if not ev.passes(d, k_inc + 1, target):
            return None
        lo = k_inc + 1
    else:
        lo = None
        k = k_start
        for _ in range(MAX_STEPS):
            if ev.passes(d, k, target):
                lo = k
                break
            hi, k = k, k - S
        if lo is None:
            return None
    if hi is None:
        for _ in range(MAX_STEPS):
            if ev.passes(d, lo + S, target):
                lo += S
            else:
                hi = lo + S
                break
    if hi is None:
        return lo  # passed even 2**MAX_STEPS above: saturated search (recorded by the caller)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ev.passes(d, mid, target):
            lo = mid
        else:
            hi = mid
    return lo


def search_mode(ev: Evaluator, mode: str, dies: int, target: float, *, first: "list | None" = None,
                grid: "dict | None" = None, k_start: int = -STEPS_PER_DOUBLING, log=None) -> dict:
    """The best memory-feasible deployment of ``mode`` at ``dies`` for ``target`` (see the module docstring).

    ``first``: deployments to try before the grid (e.g. the winner at the neighbouring size or percentile);
    ``grid``: overrides of the dimensions (``tps``, ``cps``, ``chunk_budgets``, ``batching``, ``lanes``,
    ``stages``). Returns ``{"best": Deployment | None, "result": Evaluator.result of it, "candidates": [...],
    "infeasible": [...]}``."""
    g = grid or {}
    cost, shapes = ev.cost, ev.shapes
    tried, infeasible, rows = set(), [], []
    state = {"best": None, "k": None, "order": []}

    longest = max(r.prompt_len for r in ev.trace.requests)

    def consider(d: Deployment, stage: str) -> None:
        if d.mode == "sync" and d.par.cp_threshold is not None and d.par.cp_threshold >= longest:
            d = _with(d, cp=None)  # a threshold no prompt of the trace exceeds: the same run as no CP
        key = _key(d)
        if key in tried:
            return
        tried.add(key)
        probs = deployment_problems(d, cost.profile, shapes)
        if probs:
            infeasible.append({"deployment": d.label, "problem": probs[0]})
            return
        k = load_search(ev, d, target, state["k"], k_start)
        won = k is not None
        if won:
            state["best"], state["k"] = d, k
            state["order"].append(d)
        rows.append({"deployment": d.label, "stage": stage, "won": won,
                     "slo_compliant_throughput": ev.result(d, target)["slo_compliant_throughput"]})
        if log:
            log(f"{mode} {stage:9s} {d.label[:75]:75s} {'BEST ' if won else 'out  '}"
                f"{'' if not won else f'{ev.rate(k):.4g} req/s'}")

    for d in first or []:
        if d.mode == mode and d.devices == dies:
            consider(d, "hint")
    structs = structures(mode, dies, shapes, cost, g.get("tps", TPS), g.get("cps", CPS))
    for d in structs:
        consider(d, "structure")
    stages = g.get("stages", ("chunk", "mode", "restructure"))
    if "mode" in stages and state["best"] is None:
        # no structure meets the SLO with the middle knobs: the mode's own knobs may be what it lacks (ASAP's lane
        # split under a strict p99 SLO), so each is tried on every structure (most fail on the unloaded bound)
        for sub in ("cp",) if mode == "sync" else ("batching", "lane"):
            for base in structs:
                for d in refinements(base, sub, ev.slo_s, cps=g.get("cps", CPS),
                                     batching=g.get("batching", EXPERT_BATCHING), lanes=g.get("lanes", LANES)):
                    consider(d, "fallback")
    if "chunk" in stages:
        for base in list(reversed(state["order"]))[:2]:
            for d in refinements(base, "chunk", ev.slo_s, chunk_budgets=g.get("chunk_budgets", CHUNK_BUDGETS)):
                consider(d, "chunk")
    if "mode" in stages and state["best"] is not None:  # one knob after the other, each around the best so far
        subs = ("cp",) if mode == "sync" else ("batching", "lane")
        for sub in subs:
            if state["best"] is None:
                break
            for d in refinements(state["best"], sub, ev.slo_s, cps=g.get("cps", CPS),
                                 batching=g.get("batching", EXPERT_BATCHING), lanes=g.get("lanes", LANES)):
                consider(d, "knobs")
    if "restructure" in stages and state["best"] is not None:
        # the knobs interact with the structure (ASAP's lane pool most): every other structure once more with the
        # winner's knobs (a structure that cannot beat the winner costs one run)
        for d in structures(mode, dies, shapes, cost, g.get("tps", TPS), g.get("cps", CPS)):
            consider(with_knobs_of(d, state["best"]), "restructure")
    best = state["best"]
    return {"best": best, "result": None if best is None else ev.result(best, target),
            "candidates": rows, "infeasible": infeasible, "searched": len(rows)}


def translate(d: Deployment, dies: int) -> "Deployment | None":
    """``d``'s settings at another size (a hint for the search there): the same TP, CP, chunk, budget and
    knobs; ASAP's expert dies scaled with the size (rounded as :func:`expert_splits` rounds). None if the TP
    does not divide the new size."""
    if d.mode == "sync":
        if dies % d.par.sync_tp:
            return None
        return _sync(dies, d.par.sync_tp, d.par.cp_threshold, d.cfg.chunk_len, d.cfg.token_budget)
    q = 8 if dies >= 64 else 4
    e = max(q, q * round(d.cfg.num_expert_ranks * dies / d.devices / q))
    tp = d.par.attention_tp
    if e >= dies or (dies - e) % tp:
        return None
    c = d.cfg
    return _async(dies, tp, e, c.chunk_len, c.token_budget, c.expert_deadline_s, c.expert_token_budget,
                  c.lane_tokens, c.lane_wait_s, c.lane_chunks)


def capacity_estimate(trace: list, cost, shapes, dies: int) -> float:
    """The lattice's origin (requests/s): TP8 DP groups of the baseline (or the largest TP dividing the heads)
    over the unloaded time of a mean prompt on one, a rough saturation rate."""
    tp = next(t for t in (8, 4, 2, 1) if shapes.heads % t == 0 and dies % t == 0)
    n = max(1, min(MAX_PROMPT, round(mean_len(trace))))
    d = _sync(dies, tp, None, 16384, 16384)
    one = simulate("sync", [Request(0, 0.0, n)], cost, shapes, d.cfg, sync_ranks=d.sync_ranks, par=d.par)
    return d.sync_ranks / one.records[0].ttft_s


def search_size(trace: TraceWindows, cost, shapes, dies: int, slo_s: float, targets, *, seed: int = 0,
                n_min: int = 600, n_max: int = 4000, hints: "dict | None" = None, grid: "dict | None" = None,
                progress: "str | None" = None, log=None) -> dict:
    """Both modes' best at ``dies`` for each of ``targets`` (attainment targets, e.g. (0.9, 0.99)), one
    :class:`Evaluator` shared by all (so by both percentiles). ``hints``: mode -> deployments tried first.
    Returns ``{"evaluator", "by_target": {target: {mode: search_mode result}}, "wall_s"}``."""
    t0 = time.perf_counter()
    rate0 = capacity_estimate(trace.window(seed, min(trace.max_window, n_max)), cost, shapes, dies)
    ev = Evaluator(trace, cost, shapes, slo_s, rate0, seed=seed, n_min=n_min, n_max=n_max, progress=progress)
    out = {}
    prev = dict(hints or {})
    for target in targets:
        out[target] = {}
        for mode in ("sync", "async"):
            r = search_mode(ev, mode, dies, target, first=prev.get(mode), grid=grid, log=log)
            out[target][mode] = r
            if r["best"] is not None:  # the next percentile starts from this winner (its points are cached)
                prev[mode] = [r["best"]] + list(prev.get(mode) or [])
    return {"evaluator": ev, "by_target": out, "wall_s": time.perf_counter() - t0}
