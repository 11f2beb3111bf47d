"""A serving group: what it runs (:class:`GroupSpec`), what every PE allocates (:func:`open_channels`) and one
entry point for every PE of either mode (:func:`group_main`).

A group is one ``asap_comm`` group of ``A + E + 1`` PEs (``A`` =
``cfg.num_attention_ranks``, ``E`` = ``cfg.num_expert_ranks``), the front end
last. ``mode="async"``: PEs ``0..A-1`` attention ranks, ``A..A+E-1`` expert
ranks (``async_ranks.py``); ``mode="sync"``: PEs ``0..W-1`` baseline workers,
``W = A + E`` (``sync_worker.py``). The front end's role is
``spec.front(comm, cfg, info, channels, num_targets, label, role_of)``: the
trace replay (``frontend.Replay``) or the HTTP service. :func:`run_group`
launches a group on this host and builds a trace run's :class:`RunResult`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import CommError, LaunchError
from ..launch import launch
from ..moe import AttentionEnd, ExpertEnd, join_as_bystander
from .async_ranks import attention_main, expert_main, moe_plan
from .exchange import shm_collectives
from .frontend import replay_report
from .lane import LaneBuffers, lane_active
from .protocol import STATS_COLUMNS, Channels, ModelInfo, RunResult, RuntimeConfig, WorkerStats, request_mailbox
from .sync_worker import worker_main

__all__ = ["GroupSpec", "group_main", "open_channels", "run_group", "role_of", "MODES"]

MODES = ("async", "sync")


@dataclass(frozen=True)
class GroupSpec:
    """Everything a PE of a serving group needs (picklable: ``launch`` hands it to every PE).

    ``mode``: ``"async"`` (ASAP) or ``"sync"`` (the baseline); ``model_factory(role, experts)``: builds each
    worker's model; ``front``: the front end's role (see the module docstring); ``store`` (``"sync"`` only): where
    the workers' gloo group meets: None (the default) for the group's own store (``launch``'s is a FileStore
    only this user can reach, and gloo's keys carry a prefix only the group can name), the port of a TCPStore
    on 127.0.0.1, or a ``torch.distributed.Store`` every worker reaches (``examples/prefill_multihost.py``).
    """

    mode: str
    cfg: RuntimeConfig
    info: ModelInfo
    model_factory: Callable[[str, list], Any]
    front: Callable[..., Any]
    store: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"GroupSpec: mode={self.mode!r} must be 'async' or 'sync'")

    @property
    def world_size(self) -> int:
        """Workers (with ASAP's spare expert PEs) and the front end."""
        spares = self.cfg.spare_expert_ranks if self.mode == "async" else 0
        return self.cfg.num_attention_ranks + self.cfg.num_expert_ranks + spares + 1


def open_channels(comm, cfg: RuntimeConfig, info: ModelInfo, mode: str, plan=None) -> Channels:
    """Collective: every symmetric object of a serving group, in THE order every PE allocates them.

    ``mode`` ``"async"`` (``plan``: the group's ``moe.MoEPlan``; PEs ``0..A-1``
    attention, ``A..A+E-1`` experts, the last the front end) or ``"sync"``
    (PEs ``0..W-1`` workers, the last the front end). Every PE of the group
    calls this once, before anything else collective, whatever its role: the
    allocation order lives here and nowhere else.
    """
    front = comm.world_size - 1
    me = comm.rank
    moe = lockstep = shm = lane = None
    if mode == "async":
        A, E, S = cfg.num_attention_ranks, cfg.num_expert_ranks, cfg.spare_expert_ranks
        if comm.world_size != A + E + S + 1:
            raise ValueError(f"open_channels: an async group of A={A} + E={E} + S={S} spare ranks + 1 front end has "
                             f"{A + E + S + 1} PEs, not {comm.world_size}")
        role = "attention" if me < A else "expert" if me < A + E + S else "front"  # a spare is an expert PE
        if role == "attention":
            moe = AttentionEnd(comm, plan)
        elif role == "expert":
            moe = ExpertEnd(comm, plan)
        else:
            join_as_bystander(comm, plan)
        box = request_mailbox(comm, cfg, info, A)
        if not cfg.barrier_free:
            lockstep = comm.signals(A)
        if lane_active(cfg, info):  # the long-prompt lane's KV slots (lane.py)
            lane = LaneBuffers(comm, cfg, info)
    elif mode == "sync":
        W = front
        role = "worker" if me < W else "front"
        if cfg.sync_collectives == "shm":
            shm = shm_collectives(comm, cfg, info, W)
        box = request_mailbox(comm, cfg, info, W)
    else:
        raise ValueError(f"open_channels: mode={mode!r} must be 'async' or 'sync'")
    table = comm.zeros((comm.world_size, STATS_COLUMNS), torch.float64)
    stats = WorkerStats(comm, table, front)
    return Channels(role, box, stats, moe, lockstep, shm if role != "front" else None, lane)


def role_of(cfg: RuntimeConfig, pe) -> str:
    """What PE ``pe`` of an async group is, for error messages."""
    if pe is not None and pe < cfg.num_attention_ranks:
        return "attention worker"
    if pe is not None and 0 <= pe - cfg.num_attention_ranks - cfg.num_expert_ranks < cfg.spare_expert_ranks:
        return "spare expert worker"
    return "expert worker"


class _RoleOf:
    """``role_of`` of an async group (picklable)."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg

    def __call__(self, pe) -> str:
        return role_of(self.cfg, pe)


def _worker_role(pe) -> str:
    return "worker"


def group_main(comm, spec: GroupSpec) -> tuple:
    """One PE of a serving group: allocate the group's channels (:func:`open_channels`), then run this PE's role.
    Returns ``(role, payload)``: a worker's spans, or what the front end's role returned."""
    torch.set_num_threads(1)
    cfg, info, factory = spec.cfg, spec.info, spec.model_factory
    if spec.mode == "async":
        plan = moe_plan(cfg, info)
        ch = open_channels(comm, cfg, info, "async", plan)
        if ch.role == "attention":
            return ("attention", attention_main(comm, cfg, info, factory, ch))
        if ch.role == "expert":
            return ("expert", expert_main(comm, cfg, info, factory, plan, ch))
        return ("front", spec.front(comm, cfg, info, ch, cfg.num_attention_ranks, "async", _RoleOf(cfg)))
    W = comm.world_size - 1
    ch = open_channels(comm, cfg, info, "sync")
    if ch.role == "worker":
        return ("worker", worker_main(comm, cfg, info, factory, comm._store if spec.store is None else spec.store,
                                      ch))
    return ("front", spec.front(comm, cfg, info, ch, W, "sync", _worker_role))


def run_group(spec: GroupSpec, requests: Sequence, report_path: str) -> RunResult:
    """Launch ``group_main(comm, spec)`` on this host's ``spec.world_size`` PEs (the front end last: a trace
    replay that logs to ``report_path``) and build the run's result.

    Spans of the workers are re-based on the first one (CLOCK_MONOTONIC is
    shared by the host's processes). If a PE dies, the front end's event log
    gives the records anyway and requests left unfinished get the error.
    """
    # with spare expert PEs or attention failover the front end leads: a PE's death is the failover's, not the end
    # of the run
    failover = spec.cfg.spare_expert_ranks or spec.cfg.attention_failover
    lead = {"leader": spec.world_size - 1} if spec.mode == "async" and failover else {}
    try:
        results = launch(group_main, spec.world_size, spec, timeout=spec.cfg.timeout_s, **lead)
    except (LaunchError, CommError) as e:
        records, outputs = replay_report(report_path, requests)
        for rec in records:
            if rec.error is None and rec.done_s is None:
                rec.error = f"run aborted: {str(e).splitlines()[0]}"
        return RunResult(records, outputs, [], spec.mode)
    spans = [s for role, payload in results if role != "front" for s in payload]
    origin = min((s[3] for s in spans), default=0.0)
    spans = [(pe, track, name, start - origin, dur) for pe, track, name, start, dur in spans]
    records, outputs, lane = results[-1][1]
    return RunResult(records, outputs, spans, spec.mode, lane)
