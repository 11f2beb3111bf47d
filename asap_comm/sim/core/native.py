"""The native core of the simulator's ASAP mode (``kernels/sim_async.cpp``, in ``asap_comm._C``).

The C++ loop is a port of :class:`~asap_comm.sim.core.async_mode._AsyncSim` decision for decision: the same events
in the same order (time, then the order they were scheduled), the same policies (``Placer``, ``MicroBatcher``,
``ExpertBatcher``, the long-prompt lane's runtime admission) and the same float operations in the same order, so a
run gives the Python engine's answers (``tests/test_sim_native.py`` compares every request's times). The cost
model stays in Python: the loop asks each operation once per distinct size (attention once per distinct micro-batch,
its ``(tokens, cached)`` list) through :class:`_Costs` and memoises the answers.

What it covers (:func:`unsupported` says why not otherwise, and ``simulate`` then runs the Python engine):
dedicated devices (``cost.cores is None``), no lock-step ablation, no failures, the lane off or in its
default design and admission (``"pipe"``, ``"runtime"``, whole chunks); balanced or skewed routing, expert batching
on or off, token-balanced pairs or not, ping-pong or not, any tensor parallelism and layer structure.
``ASAP_SIM_NATIVE=0`` in the environment forces the Python engine.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

from ...serving.lane import LanePool
from ...serving.policies import ExpertBatcher, MicroBatcher, Placer, split_prompt
from ...serving.protocol import HDR
from . import lane as _lane
from .async_mode import _AsyncSim
from .common import _validate
from .lane import Lane

__all__ = ["available", "unsupported", "run"]

try:
    from ..._C import sim_async_run as _run
except ImportError:  # a build without the native module (or an older one): the Python engine runs
    _run = None

# the methods the native loop stands for: a subclass or a patched one (a test's spy) runs the Python engine
_PORTED = {name: getattr(_AsyncSim, name) for name in (
    "arrive", "arrive_usual", "_rows", "_per_device", "_queued", "_fill_pending", "_fill", "_start_batch",
    "_segment", "_dispatched", "_link", "_dispatch_delay", "_expert_arrive", "_poke", "_ex_end", "_wake",
    "_combine_delay", "_through_expert_link", "_link_times", "_part_back", "_combine_back", "_tail_done", "run",
    "_deliver", "_result", "_admit", "_delivery_s", "_arrivals")}
_PORTED_LANE = {name: getattr(Lane, name) for name in (
    "arrive", "_give_up", "_open_waiting", "_deliver_fifo", "ready_fn", "takes", "run_chunk", "_result", "_mb",
    "reserved", "start", "_run", "segment", "_step", "_layer", "_layer_done", "_kv_arrived", "_done")}

# the policies it ports (serving/policies.py): a replaced method (a test's spy) runs the Python engine too
_PORTED_POLICIES = {cls: {name: getattr(cls, name) for name in names} for cls, names in (
    (Placer, ("place", "place_lane", "complete", "_work_of", "_check_new")),
    (MicroBatcher, ("add", "_taken", "next_batch", "next_batches", "done")),
    (ExpertBatcher, ("add", "poll", "take", "ready", "wait_s", "held")),
    (LanePool, ("fits", "open", "close", "_place", "_first_fit")))}


def available() -> bool:
    """Whether this build has the native core."""
    return _run is not None


def unsupported(sim) -> "str | None":
    """Why ``sim`` (an ``_AsyncSim`` ready to run) cannot run natively, or None if it can."""
    if _run is None:
        return "asap_comm._C has no sim_async_run (built without it)"
    if os.environ.get("ASAP_SIM_NATIVE", "1").strip() == "0":
        return "ASAP_SIM_NATIVE=0"
    cls = type(sim)
    if cls is not _AsyncSim:
        return f"{cls.__name__} is not _AsyncSim (failures)"
    for name, fn in _PORTED.items():
        if getattr(cls, name) is not fn:
            return f"_AsyncSim.{name} is replaced"
    for obj in (sim.placer, sim.batchers[0], sim.ex_batcher) + (() if sim.lane is None else (sim.lane.pool,)):
        cls = type(obj)
        if cls not in _PORTED_POLICIES or any(getattr(cls, n) is not f for n, f in _PORTED_POLICIES[cls].items()):
            return f"{cls.__name__} is replaced"
    if sim.cpu:
        return "ranks share CPU cores (cost.cores is not None)"
    if sim.lockstep:
        return "the lock-step ablation (barrier_free=False)"
    if sim.lane is not None:
        if type(sim.lane) is not Lane or any(getattr(Lane, n) is not f for n, f in _PORTED_LANE.items()):
            return "the lane is replaced"
        if not sim.lane.fifo or sim.lane.design != "pipe" or _lane.LANE_SPLIT[0] != 1:
            return "a lane design or admission other than the runtime's (pipe, runtime admission)"
    return None


class _Costs:
    """The cost model as the native loop asks it: each call is what ``_AsyncSim`` computes at that point."""

    def __init__(self, sim) -> None:
        self.sim = sim
        c = sim.cost
        # the order of kernels/sim_async.cpp's Op
        self._ops = (c.embed_s, c.dense_mlp_s, c.router_s, c.shared_experts_s, c.head_s, c.message_s,
                     c.dispatch_s, c.combine_s)
        self._link = (c.dispatch_s, c.combine_s)

    def op(self, kind: int):
        return self._ops[kind]

    def attn(self, lengths: list, starts: list) -> float:
        sim = self.sim
        attn = sim.cost.attention_s(list(zip(lengths, starts)), sim.tp)
        attn += sim.cost.tp_all_reduce_s(sum(lengths), sim.tp)
        return attn

    def experts(self, tokens: int) -> float:
        sim = self.sim
        return sim.cost.experts_s(sim._expert_pairs(tokens))

    def link(self, kind: int, rows: int, tokens: int, seg: int) -> tuple:
        sim = self.sim
        return sim._link_times(self._link[kind], rows, tokens, sim.segs[seg][1])

    def kv_put(self, length: int, fanout: int) -> float:
        return _lane.kv_put_s(self.sim.cost, self.sim.shapes, length, fanout)  # the lane's own (a study may patch it)

    def lane_wants(self, prompt_len: int) -> bool:
        """``Lane.wants`` of a prompt of ``prompt_len`` tokens (asked only where it depends on the SLO)."""
        sim = self.sim
        r = SimpleNamespace(prompt_len=prompt_len)  # Lane.wants reads the prompt's length only
        return sim.lane.wants(r, split_prompt(0, prompt_len, sim.cfg.effective_chunk_len))


def _params(sim) -> dict:
    cfg, lane = sim.cfg, sim.lane
    p = {"A": sim.A, "E": sim.E, "tp": sim.tp, "max_running": sim.max_running,
         "token_balanced": bool(cfg.token_balanced), "token_budget": cfg.token_budget,
         "chunk_len": cfg.effective_chunk_len or 0, "max_prompt_len": cfg.max_prompt_len,
         "load_aware": bool(sim.placer.load_aware), "linear_weight": float(sim.placer.linear_weight),
         "frac": float(sim.frac), "k_att": float(sim.k_att), "k_exp": float(sim.k_exp),
         "layer_overhead": float(sim.layer_overhead), "job_overhead": float(sim.job_overhead),
         "ex_job_overhead": float(sim.ex_job_overhead), "ex_skew": float(sim.ex_skew),
         "serial_tx": bool(sim.serial_tx), "msg_result": float(sim.msg_result), "hdr": HDR,
         "expert_batching": bool(sim.ex_batcher.enabled), "expert_token_budget": sim.ex_batcher.token_budget,
         "expert_deadline_s": float(sim.ex_batcher.deadline_s),
         "segs": [(float(d), float(m)) for d, m in sim.segs], "lane": lane is not None,
         "spans": sim.spans is not None}
    if lane is not None:
        if lane.pool.spans or lane.pool.stale or lane.waiting or lane.live:
            raise ValueError("native.run: the lane has already admitted prompts (run a fresh _AsyncSim)")
        p.update({"lane_groups": cfg.lane_groups or 0, "pool_rows": lane.pool.rows,
                  "pool_slots": len(lane.pool.free),
                  "lane_threshold": -1 if cfg.lane_threshold is None else int(cfg.lane_threshold),
                  "lane_slo": getattr(sim, "slo_s", None) is not None, "lane_cost": cfg.lane_chunks == "cost",
                  "lane_wait_s": -1.0 if cfg.lane_wait_s is None else float(cfg.lane_wait_s),
                  "seg_layers": [[(float(w), bool(m)) for w, m in layers] for layers in lane.seg_layers]})
    return p


def run(sim) -> tuple:
    """Run ``sim`` natively (``unsupported(sim)`` must be None): fills its records, ranks' busy time and jobs,
    engine clock and events and lane counts as ``sim.run()`` does, and returns what ``sim.run()`` returns."""
    why = unsupported(sim)
    if why is not None:
        raise ValueError(f"native.run: this run cannot run natively: {why}")
    reqs = sim.requests
    out = _run(_params(sim), _Costs(sim), [float(r.arrival_s) for r in reqs], [int(r.prompt_len) for r in reqs])
    for r, start, done, err in zip(reqs, out["start_s"], out["done_s"], out["error"]):
        rec = sim.records[r.request_id]
        if not math.isnan(start):
            rec.start_s = start
        if not math.isnan(done):
            rec.done_s = done
        if err:
            rec.error = f"rejected: {_validate(r, sim.cfg)}"
    for rk, busy, jobs in zip(sim.att, out["att_busy_s"], out["att_jobs"]):
        rk.busy_s, rk.jobs = busy, jobs
    sim.ex.busy_s, sim.ex.jobs = out["ex_busy_s"], out["ex_jobs"]
    sim.engine.now, sim.engine.events = out["end"], out["events"]
    if sim.spans is not None:  # the labels _AsyncSim and Lane give their jobs, by kernels/sim_async.cpp's JobKind
        labels = {1: "attn seg {}", 2: "attn tail", 3: "shared", 4: "lane head", 5: "lane layer {} chunk {}"}
        for rank, kind, a, b, start, dur in out["spans"]:
            if rank < 0:
                sim.spans.append((sim.ex.name, f"experts seg {a} ({b} mb)", start, dur))
            else:
                sim.spans.append((sim.att[rank].name, labels[kind].format(a, b), start, dur))
    if sim.lane is not None:
        counts = sim.lane.counts
        for w in out["lane_waits"]:
            counts.open(w)
        counts.waited, counts.gave_up = out["lane_waited"], out["lane_gave_up"]
    ranks = [(rk.name, "attention", rk, sim.tp) for rk in sim.att]
    ranks += [(f"expert 0..{sim.E - 1}", "expert", sim.ex, sim.E)]
    return out["end"], ranks
