"""Simulated runs of the prefill runtime: ASAP (``"async"``) and the synchronous DP+EP baseline (``"sync"``).

The simulated runtime is the one of ``asap_comm.serving``, decision for
decision: the front end validates, splits long prompts (``split_prompt``) and
places requests (``Placer``); attention ranks form micro-batches
(``MicroBatcher``), at most two in flight with ping-pong; expert ranks gather
rows per layer (``ExpertBatcher``); the baseline steps all ranks together with
dummy batches. Those objects are imported from ``asap_comm.serving.policies``
and called exactly as the runtime calls them; only time is simulated, by the
operator costs of a :class:`~asap_comm.sim.costmodel.costs.CostModel`. The modes are
``async_mode.py`` and ``sync_mode.py``, what they share
``common.py``.

Modelling choices (each one is what the runtime does, or the stated
simplification):

* **The front end** is one sender: it sends a request's chunks (each one message, ``CostModel.message_s``) once
  the chunks of the requests admitted before it have left (``_Common._delivery_s``), so prompts that arrive
  together reach their ranks in arrival order, as ``FrontEnd._flush`` sends them.
* **Routing**: balanced in expectation by default (DeepSeek-V3's auxiliary-loss-free
  balancing; ``routing=`` takes a skewed one, see ``routing.py``: the hottest
  rank's rows and pairs then stand for every rank's): a micro-batch of ``T`` tokens sends ``T * p`` rows to each
  expert rank, where ``p`` is the chance that one of a token's ``k`` distinct
  experts lives on that rank, and every local expert gets ``T * k / N``
  (token, expert) pairs, rounded so the total is right. With identical row
  counts and link latencies every expert rank makes the same batching
  decisions at the same times, so ASAP's ``E`` expert ranks are simulated as
  one representative rank that stands for all ``E`` (exact under this
  routing model, and what makes 10k requests x 61 layers x 64 ranks fast).
* **Where transfers cost**: on a host whose ranks share CPU cores (the
  ``local`` profile) a put is a copy done by the sender's CPU, so it is part
  of the sender's job; on a cluster profile it is a DMA / link delay that
  does not occupy the sender's compute (but its link: see **Links**).
* **Baseline**: per MoE layer three collectives as ``run_sync`` does them
  (counts, dispatch and combine ``all_to_all``, costed with the dispatch and
  the combine row bytes), plus the per-step ``all_reduce`` of
  "anyone working?"; a step ends when the slowest rank does.
  On a shared CPU host (``local``) the ranks waiting in a gloo collective keep
  polling and take a share of the cores from the ranks that compute
  (``sync_poll_weight`` of the profile, fitted in situ).
  An idle baseline notices new work at its next idle heartbeat
  (``run_sync`` polls every millisecond).
* **Parallel attention groups** (:class:`Parallelism`, cluster profiles only;
  the runtime has no such groups, so this is the simulator's model of a
  production deployment): a baseline DP rank and an ASAP attention rank may
  be a group of ``t`` devices with tensor parallelism. The group is one
  simulated rank that stands for its ``t`` devices: its attention costs one
  device's share (``CostModel.attention_s(..., tp=t)``), the router, shared
  experts and dense MLP run data-parallel inside the group on ``ceil(T/t)``
  tokens per device (after a reduce-scatter of the attention output), and
  every layer pays the reduce-scatter + all-gather
  (``CostModel.tp_all_reduce_s``). Each device dispatches its own
  ``ceil(T/t)`` tokens. The baseline's EP spans all ``sync_ranks * t``
  devices (``ceil(N / (sync_ranks * t))`` experts each).
* **Context parallelism** (baseline, ``cp_threshold``): a prompt longer than
  the threshold runs on ``g = min(sync_ranks, ceil(prompt / threshold))`` DP
  groups at once, the ``g`` least loaded when it arrives (the placer's
  load-aware rule, extended to ``g`` groups; its work counts ``1/g`` on each).
  It is still split into ``chunk_len`` chunks, in order; each chunk is shared
  by the ``g`` groups (zig-zag halves: each computes ``1/g`` of the queries
  and of the causal query-key pairs, against all keys) in ONE step, and each
  group pays per layer the gather of the KV latents it does not hold
  (``CostModel.cp_exchange_s``). Scheduling, as ``run_sync``'s workers: at
  each step every owner (a CP request's first group) proposes the next chunk
  of its oldest CP request, one each; the proposals go first, in arrival
  order (a CP chunk joins a step if each of its groups has no CP share yet
  or room left under the token budget); a group then takes a
  micro-batch of its own queue under the budget its CP shares leave, if a
  whole chunk still fits (so no micro-batch exceeds the budget). The head of
  the CP queue always runs, so every CP request progresses.
* **Links** (cluster profiles): a device's link carries all it sends. ASAP:
  an attention device sends its rows for each of the ``E`` expert ranks over
  its own link, and the (representative) expert rank's link receives every
  micro-batch's rows one after another (and sends the combined rows the same
  way): a transfer ends when both its sender's and its receiver's share have
  passed, plus the latency. Baseline: an ``all_to_all`` costs the rows of
  its busiest device, the larger of what it sends to its ``D - 1`` peers and
  what it receives from them. ``sync_overlap`` (DeepSeek's two-micro-batch
  overlap in prefill): a MoE layer takes ``max(compute, all_to_alls)``
  instead of their sum, an optimistic bound for the baseline (the halves'
  smaller kernels and the pipeline's fill are not charged).
* **Expert failover** (``failures=``, ``failover.py``): an expert rank's death loses the rows not yet combined
  there; a spare (``cfg.spare_expert_ranks``) serves it after detection and its load time and gets them again,
  with none left the group fails; the baseline's run ends at a death. Without ``failures`` the run is untouched.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ...serving.protocol import RuntimeConfig
from ..costmodel.failover import DETECT_S, spare_load_s as _spare_load_s
from ..costmodel.routing import routed_cost
from . import native
from .async_mode import _AsyncSim
from .common import Parallelism
from .failover import _AsyncFailoverSim, check_failures, failover_summary, schedule_sync_failures
from .sync_mode import _SyncSim

__all__ = ["SimResult", "simulate"]


@dataclass
class SimResult:
    """A simulated run: the same per-request records as the runtime, plus per-rank utilisation."""

    mode: str
    records: list
    ranks: list  # {"rank", "role", "busy_s", "idle_s", "utilisation", "jobs", "stands_for"}
    makespan_s: float
    events: int
    wall_s: float
    spans: list = field(default_factory=list)  # (rank name, label, start_s, dur_s) when asked for
    lane: dict = field(default_factory=dict)  # the long-prompt lane's counts (serving.lane.LaneCounts; {}: none)
    failover: dict = field(default_factory=dict)  # deaths and failover (failover.failover_summary; {}: no failures)
    core: str = "python"  # which event loop ran: "native" (ASAP's C++ core, native.py) or "python"


def simulate(mode: str, requests, cost, shapes, cfg: RuntimeConfig = RuntimeConfig(), *,
             sync_ranks: int | None = None, spans: bool = False, par: Parallelism | None = None,
             layers=None, routing=None, slo_s: "float | None" = None, failures=None,
             spare_load_s: "float | None" = None) -> SimResult:
    """Simulate ``requests`` (``asap_comm.serving.traces.Request``: id, arrival, prompt length).

    ``mode``: ``"async"`` (``cfg.num_attention_ranks`` attention ranks of ``par.attention_tp`` devices each +
    ``cfg.num_expert_ranks`` expert ranks) or ``"sync"`` (``sync_ranks`` DP+EP groups of ``par.sync_tp``
    devices each, default as many groups as ASAP has ranks; context parallelism above ``par.cp_threshold``).
    ``layers``: the layer structure, ``[(is_moe, weight)]`` in order, where a layer of weight ``w`` costs ``w``
    layers of ``shapes`` (default: ``shapes.moe_layers``, weight 1 each). An emulated run
    (``asap_comm.sim.emulate.emulator``) serves a small model whose layers each stand for several emulated ones; this
    simulates that structure (see ``emulate.simulate_emulated``).
    ``routing``: a routing distribution (``routing.py``: ``"balanced"``, ``"zipf:S"``, ``"histogram:PATH"`` or a
    ``Routing``); None: the one the cost model carries (``routing.routed_cost``), balanced by default.
    ``slo_s``: the run's TTFT SLO, when known: ASAP's long-prompt lane takes a prompt whose predicted TTFT
    exceeds a fraction of it (``lane.py``; ``cfg.lane_threshold`` overrides).
    ``failures``: expert deaths, ``[(time_s, rank)]`` (``failover.py``): ASAP: ``rank`` is an expert rank in
    ``[0, cfg.num_expert_ranks)``, replaced by one of ``cfg.spare_expert_ranks`` spares ``spare_load_s`` (default:
    ``costmodel.failover.spare_load_s`` of the cost model's profile and shapes) plus 10 ms of detection after the
    death, or failing the group with none left; the baseline: a device in ``[0, sync_ranks * sync_tp)``, whose
    death ends the run. ``SimResult.failover`` then says what happened; None or ``[]``: the run is not touched.
    Returns records with the runtime's fields, so ``summarize_run`` applies.
    """
    if mode not in ("async", "sync"):
        raise ValueError(f"simulate: mode must be 'async' or 'sync', got {mode!r}")
    if layers is not None:
        layers = [tuple(x) for x in layers]
        if (not layers or any(len(x) != 2 or not isinstance(x[0], bool) or isinstance(x[1], bool)
                              or not isinstance(x[1], (int, float)) or not x[1] > 0 for x in layers)):
            raise ValueError(f"simulate: layers={layers!r} must be a non-empty list of (is_moe: bool, weight > 0)")
    par = Parallelism() if par is None else par
    if not isinstance(par, Parallelism):
        raise TypeError(f"simulate: par must be a Parallelism, got {type(par).__name__}")
    tp = par.attention_tp if mode == "async" else par.sync_tp
    if tp > 1 and cost.cores is not None:
        raise ValueError(f"simulate: tensor parallelism (tp={tp}) needs a profile of dedicated devices; "
                         f"{cost.name!r} shares {cost.cores} CPU cores between its ranks")
    if mode == "async":
        failures = check_failures(failures, cfg.num_expert_ranks, "expert_rank")
    else:
        W = cfg.num_attention_ranks + cfg.num_expert_ranks if sync_ranks is None else sync_ranks
        if isinstance(W, bool) or not isinstance(W, int) or W < 1:
            raise ValueError(f"simulate: sync_ranks={sync_ranks!r} must be an int >= 1")
        failures = check_failures(failures, W * par.sync_tp, "rank")
    load_s = 0.0
    if failures and mode == "async":
        if spare_load_s is None:
            profile = getattr(cost, "profile", None)
            if profile is None:
                raise ValueError(f"simulate: spare_load_s must be given for a cost model without a profile "
                                 f"({getattr(cost, 'name', type(cost).__name__)!r})")
            load_s = _spare_load_s(profile, shapes, cfg.num_expert_ranks)
        elif (isinstance(spare_load_s, bool) or not isinstance(spare_load_s, (int, float))
              or not math.isfinite(spare_load_s) or spare_load_s < 0):
            raise ValueError(f"simulate: spare_load_s={spare_load_s!r} must be None or a finite number of seconds >= 0")
        else:
            load_s = float(spare_load_s)
    if routing is not None:
        cost = routed_cost(cost, routing)
    t0 = time.perf_counter()
    if mode == "async":
        if failures:
            sim = _AsyncFailoverSim(cost, shapes, cfg, requests, spans, par, layers, failures=failures,
                                    detect_s=DETECT_S, load_s=load_s)
        else:
            sim = _AsyncSim(cost, shapes, cfg, requests, spans, par, layers)
        if slo_s is not None:
            if not (isinstance(slo_s, (int, float)) and not isinstance(slo_s, bool) and slo_s > 0):
                raise ValueError(f"simulate: slo_s={slo_s!r} must be None or a number of seconds > 0")
            sim.slo_s = float(slo_s)
    else:
        sim = _SyncSim(cost, shapes, cfg, requests, spans, W, par, layers)
        if failures:
            schedule_sync_failures(sim, failures)
    core = "python"
    if mode == "async" and native.unsupported(sim) is None:  # the C++ loop: the same answers, faster (native.py)
        end, ranks = native.run(sim)
        core = "native"
    else:
        end, ranks = sim.run()
    records = sim._finish_records()
    span = max(end, 1e-12)
    stats = [{"rank": name, "role": role, "busy_s": rk.busy_s, "idle_s": max(0.0, span - rk.busy_s),
              "utilisation": min(1.0, rk.busy_s / span), "jobs": rk.jobs, "stands_for": n}
             for name, role, rk, n in ranks]
    lane = getattr(sim, "lane", None)
    fo = {} if not failures else failover_summary(sim, mode, records, end, cfg.spare_expert_ranks,
                                                  DETECT_S if mode == "async" else 0.0, load_s)
    return SimResult(mode, records, stats, end, sim.engine.events, time.perf_counter() - t0,
                     sim.spans or [], {} if lane is None else lane.counts.as_dict(), fo, core)
