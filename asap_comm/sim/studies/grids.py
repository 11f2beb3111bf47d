"""The headline study's search space: its runtime settings, traces and the deployment grids of both modes
(``headline.py`` runs the search; ``skew.py``, ``bench/bench_sim.py`` and the tests build on the same grids), and
the Mooncake trace that ships with the package (:func:`mooncake_path`, also the validation regimes' trace)."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ...serving.protocol import RuntimeConfig
from ...serving.traces import LogNormalLengths, TraceError, load_trace, synthetic_trace, trace_path
from ..core.simulate import Parallelism
from ..core.sweep import Deployment, spread_buckets

MOONCAKE_MEDIAN, MOONCAKE_P90 = 6909, 27367  # summarize_trace of the Mooncake trace (asap_comm/data/traces)
PER_DIE_EXPERTS = 16  # the per-die reference split: devices - 16 attention + 16 expert devices


LANE = {"long_prompt_lane": True}  # --no-long-prompt-lane sets it off for every ASAP configuration of the run


def headline_config(attention: int = 32, expert: int = 32, chunk: int = 16384, budget: int = 16384,
                    expert_budget: int = 32768, expert_deadline: float = 0.001,
                    lane_tokens: "int | None" = None) -> RuntimeConfig:
    return RuntimeConfig(num_attention_ranks=attention, num_expert_ranks=expert, token_budget=budget,
                         chunk_len=chunk, max_prompt_len=131072, expert_token_budget=expert_budget,
                         expert_deadline_s=expert_deadline, long_prompt_lane=LANE["long_prompt_lane"],
                         lane_tokens=lane_tokens)


def mooncake_path() -> Path | None:
    """The public Mooncake trace that ships with the package (:func:`asap_comm.serving.traces.trace_path`), or
    None if ``$ASAP_TRACES_DIR`` points where it is not."""
    try:
        return trace_path("mooncake")
    except TraceError:
        return None


def mooncake_trace(n: int) -> tuple[list, str]:
    path = mooncake_path()
    if path is not None:
        trace, g = spread_buckets(load_trace(path, limit=n, max_prompt_len=131072))
        return trace, (f"mooncake file {path.name}, first {n} requests, arrivals spread over the file's "
                       f"{g:g}-s timestamp steps")
    sigma = math.log(MOONCAKE_P90 / MOONCAKE_MEDIAN) / 1.2816  # p90 of a log-normal = median * exp(1.2816 sigma)
    return (synthetic_trace(1.0, num_requests=n, arrival="gamma", cv=3.0,
                            lengths=LogNormalLengths(MOONCAKE_MEDIAN, sigma, 1, 131072), seed=0),
            f"synthetic Mooncake-like (file not found): median {MOONCAKE_MEDIAN}, sigma {sigma:.2f}")


def skew_trace(n: int, sigma: float, mean: float, seed: int = 0) -> list:
    """Equal mean prompt length, log-normal spread ``sigma`` (0: every prompt the same)."""
    median = max(1, round(mean * math.exp(-sigma * sigma / 2)))
    return synthetic_trace(1.0, num_requests=n, arrival="gamma", cv=2.0,
                           lengths=LogNormalLengths(median, sigma, 1, 131072), seed=seed)


# ----------------------------------------------------------------------------- the grid
def sync_grid(devices: int, tps, cps, chunks, heads: int, overlaps=(False,), budgets=(16384,)) -> list:
    """Baseline candidates: ``devices / T`` DP groups of ``T`` devices, CP threshold, chunk size, token budget of
    a step (each of ``budgets`` at least the chunk, and the chunk itself: SGLang's chunked-prefill size), overlap."""
    out = []
    for chunk in chunks:
        for budget in sorted({chunk, *(b for b in budgets if b >= chunk)}):
            for t in tps:
                if devices % t or heads % t:
                    continue
                for cp in cps:
                    for ov in overlaps:
                        out.append(Deployment("sync", headline_config(chunk=chunk, budget=budget),  # A/E: unused
                                              Parallelism(sync_tp=t, cp_threshold=cp, sync_overlap=ov),
                                              sync_ranks=devices // t))
    return out


def async_grid(devices: int, experts, tps, chunks, heads: int, budgets=(16384,), deadlines=(0.001,),
               expert_budgets=(32768,), lane_tokens=(None,)) -> list:
    """ASAP candidates: ``E`` expert devices and ``(devices - E) / T`` attention groups of ``T`` devices, chunk
    size, micro-batch token budget (each of ``budgets`` at least the chunk, and the chunk itself, as the
    baseline's), the expert ranks' batching: deadline (s) and row budget, and the lane's KV pool (``lane_tokens``;
    None: the longest prompt)."""
    out = []
    for chunk in chunks:
        for budget in sorted({chunk, *(b for b in budgets if b >= chunk)}):
            for e in experts:
                for t in tps:
                    if e >= devices or (devices - e) % t or heads % t:
                        continue
                    for dl in deadlines:
                        for eb in expert_budgets:
                            for lt in lane_tokens:
                                out.append(Deployment("async", headline_config((devices - e) // t, e, chunk, budget,
                                                                               eb, dl, lt),
                                                      Parallelism(attention_tp=t)))
    return out


def with_lane_wait(asyncs, slo_s: float, factors=(None,)) -> list:
    """ASAP candidates with each of the lane's wait bounds (``RuntimeConfig.lane_wait_s``) searched, given as
    multiples of the SLO (``headline --lane-wait-slo``; None: wait for room, the runtime's default), so that a
    search re-run under another SLO scales the bound with it (``examples/prefill.py --lane-wait-slo``: 2)."""
    out = []
    for d in asyncs:
        for f in factors:
            out.append(d if f is None and d.cfg.lane_wait_s is None else
                       Deployment("async", dataclasses.replace(d.cfg, lane_wait_s=None if f is None else f * slo_s),
                                  d.par))
    return out


def with_lane_chunks(asyncs, chunkings=("tokens",)) -> list:
    """ASAP candidates with each way of splitting a lane prompt searched (``RuntimeConfig.lane_chunks``: "tokens",
    equal lengths; "cost", equal attention cost; ``headline --lane-chunks``)."""
    return [d if d.cfg.lane_chunks == how else Deployment("async", dataclasses.replace(d.cfg, lane_chunks=how), d.par)
            for d in asyncs for how in chunkings]


def rebind_lane_wait(d, slo_s: float, new_slo_s: float):
    """``d`` with its lane wait bound (a multiple of ``slo_s``) re-scaled to ``new_slo_s``."""
    if d.mode != "async" or d.cfg.lane_wait_s is None:
        return d
    return Deployment("async", dataclasses.replace(d.cfg, lane_wait_s=d.cfg.lane_wait_s * new_slo_s / slo_s), d.par)


def search_breadth(syncs, asyncs, grid: dict) -> dict:
    """How broadly each mode was searched: candidate counts and the values of each searched dimension."""
    return {"async": len(asyncs), "sync": len(syncs),
            "async_dimensions": {k: grid.get(k, [None]) for k in ("experts", "attention_tp", "chunk", "budget",
                                                                  "expert_deadline", "expert_budget", "lane_tokens",
                                                                  "lane_wait_slo", "lane_chunks")},
            "sync_dimensions": {k: grid[k] for k in ("sync_tp", "cp", "sync_chunk", "sync_budget", "overlap")}}


def per_die(devices: int) -> tuple:
    """The comparison before the search: ASAP (devices - 16) + 16, baseline ``devices`` x 1, 16k chunks."""
    e = min(PER_DIE_EXPERTS, devices // 4)
    return (Deployment("async", headline_config(devices - e, e)),
            Deployment("sync", headline_config(), Parallelism(), sync_ranks=devices))
