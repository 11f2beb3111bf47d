"""The serving package's internal protocol, in one place: the shared types and the chunk message.

Everything that the asynchronous runtime (``runtime.py``), the synchronous
baseline (``sync.py``), their shared front end (``frontend.py``) and the
simulator (``asap_comm.sim``) must agree on lives here:

* the shared types: :class:`ModelInfo`, :class:`RuntimeConfig` (the shared part and each mode's),
  :class:`PromptRequest`, :class:`RunResult` (``runtime`` re-exports them);
* the front end's chunk message, one request chunk to the rank that runs it:
  ``HDR`` int64 header words (request id, chunk index, number of chunks,
  start, context-parallel group mask; bit 62 of that word is :data:`URGENT`) followed by the chunk's token ids,
  tagged with the request id; :data:`STOP` is the tag of the "no more
  requests" message and :data:`CANCEL` the tag of "drop this request"
  (payload: its id; :func:`encode_cancel`). :func:`encode_chunk` builds a
  chunk message and :func:`decode_chunk` reads it; a rank answers with a
  result message (:func:`encode_result` / :func:`decode_result`: the final
  hidden state and the first token, tagged with the request id);
* what one PE of a serving group allocated (:class:`Channels`; the
  allocation order itself is ``group.open_channels``) and the request
  mailbox's sizing (:func:`request_mailbox`);
* the workers' live statistics (:class:`WorkerStats`): each worker publishes
  its busy time, expert-batch sizes and process id into the front end's copy
  of a symmetric table with one-sided puts, which the front end reads for
  ``/metrics`` and ``/health`` without asking anyone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import math
import os
import time

import torch

from .lane import LANE_WORDS
from .policies import Chunk, check_linear_weight

__all__ = ["ModelInfo", "RuntimeConfig", "SHARED_FIELDS", "ASYNC_FIELDS", "SYNC_FIELDS", "PromptRequest",
           "RunResult", "HDR", "STOP", "CANCEL", "URGENT", "encode_chunk", "decode_chunk", "chunk_urgent", "mark_urgent", "encode_cancel", "decode_cancel",
           "encode_result", "decode_result", "Channels", "WorkerStats", "BATCH_BUCKETS", "request_mailbox"]

STOP = -1  # tag of the front end's "no more requests" message
CANCEL = -2  # tag of the front end's "drop this request" message (payload: [request id])
# chunk message header words: request id, chunk index, number of chunks, start, context-parallel groups (a bit
# mask of the workers sharing the request; 0: none)
HDR = 5
# a bit of the fifth header word: the front end marks the chunk urgent (its client holds less than an equal share of
# the calls in flight; policies.MicroBatcher runs it first). Never set on a lane's (negative word) or a
# context-parallel chunk.
URGENT = 1 << 62


def encode_chunk(chunk: Chunk, token_ids: torch.Tensor, groups: int = 0) -> torch.Tensor:
    """The payload of a chunk message: the header, then ``token_ids`` (the chunk's tokens) as int64."""
    hdr = torch.tensor([chunk.request_id, chunk.index, chunk.num_chunks, chunk.start, groups], dtype=torch.int64)
    return torch.cat([hdr, token_ids.to(torch.int64)])


def decode_chunk(payload: torch.Tensor) -> tuple:
    """``(Chunk, groups, token ids)`` of a chunk message's payload (the token ids are a copy)."""
    rid, index, n, start, groups = payload[:HDR].tolist()
    if groups > 0:
        groups &= ~URGENT
    toks = payload[HDR:].clone()
    return Chunk(rid, index, start, toks.numel(), n), groups, toks


def chunk_urgent(payload: torch.Tensor) -> bool:
    """Whether a chunk message's payload is marked :data:`URGENT`."""
    word = int(payload[HDR - 1])
    return word > 0 and bool(word & URGENT)


def mark_urgent(payload: torch.Tensor, urgent: bool) -> None:
    """Set or clear a client chunk's :data:`URGENT` bit in place (its group word is 0 or the bit)."""
    payload[HDR - 1] = URGENT if urgent else 0


def encode_result(hidden: torch.Tensor, token: int) -> torch.Tensor:
    """The payload of a result message (rank -> front end, tagged with the request id): the final-normed hidden
    state of the request's last prompt token as float32, then its first token (exact in float32 below 2**24)."""
    return torch.cat([hidden.float().reshape(-1), torch.tensor([float(token)])])


def decode_result(payload: torch.Tensor) -> tuple:
    """``(first token, hidden [H] float32 copy)`` of a result message's payload."""
    return int(payload[-1]), payload[:-1].clone()


def encode_cancel(request_id: int) -> torch.Tensor:
    """The payload of a cancel message (tag :data:`CANCEL`)."""
    return torch.tensor([request_id], dtype=torch.int64)


def decode_cancel(payload: torch.Tensor) -> int:
    return int(payload[0])


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs to know about a model: shapes and which layers are MoE."""

    num_layers: int
    moe_layers: tuple  # bool per layer
    hidden: int
    vocab_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype = torch.float32
    kv_row_width: int = 0  # values per token of one layer's KV cache (MLA: kv_lora_rank + qk_rope); 0: no lane


# The fields of RuntimeConfig that only one mode reads (the rest, SHARED_FIELDS, both modes read).
ASYNC_FIELDS = ("barrier_free", "ping_pong", "token_balanced", "expert_batching", "expert_token_budget",
                "expert_deadline_s", "long_prompt_lane", "lane_threshold", "lane_groups", "lane_tokens", "lane_wait_s",
                "lane_chunks", "spare_expert_ranks", "attention_failover", "urgent_slot")
SYNC_FIELDS = ("sync_collectives", "cp_threshold")


def _is_int(v, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _is_seconds(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


@dataclass(frozen=True)
class RuntimeConfig:
    """The runtime's configuration: a part both modes read, then the parts only one mode reads.

    One declaration for every front door: the command lines take these fields
    through ``asap_comm.serving.runtime_args.add_runtime_args`` (one flag per
    field, ``--field-name``, defaults from here), so a default is written once.
    :data:`ASYNC_FIELDS` are ASAP's only (``run_async``; the baseline ignores
    them), :data:`SYNC_FIELDS` the baseline's only (``run_sync``; ``run_async``
    refuses a ``cp_threshold``); :meth:`for_mode` resets the other mode's part to
    its defaults. Times are seconds (``*_s``), sizes tokens or rows.
    """

    # ---- shared: both modes read these
    num_attention_ranks: int = 2  # ASAP: attention processes; run_sync: A + E DP+EP workers in all
    num_expert_ranks: int = 2
    token_budget: int = 256  # tokens per attention micro-batch (the baseline: per step of a worker)
    max_prompt_len: int = 8192  # the longest prompt served
    chunk_len: "int | None" = 256  # split longer prompts into chunks (with load_aware); None: never
    load_aware: bool = True  # optimization (3): least-outstanding-work placement + long-prompt splitting
    # the placer's per-token work in query-key pairs (policies.attention_cost); None: policies.LINEAR_WEIGHT (512).
    # The simulator and the emulator set it from their cost model (CostModel.placer_linear_weight)
    placer_linear_weight: "float | None" = None
    timeout_s: float = 600.0  # bound on the whole run
    progress: bool = False  # a live progress line on stderr from the front end

    # ---- async only (ASAP): optimizations (1), (2), (4), each switchable for ablation
    barrier_free: bool = True  # (1) False: every MoE layer step is a barrier across the attention ranks
    ping_pong: bool = True  # (2) two micro-batches in flight per attention rank
    token_balanced: bool = True  # the two ping-pong micro-batches formed together get near-equal tokens
    expert_batching: bool = True  # (4) gather rows per layer across attention ranks, up to:
    expert_token_budget: int = 1024  # rows of one layer, or
    expert_deadline_s: float = 0.002  # seconds after the first row waited
    # the long-prompt lane (serving/lane.py and sim/lane.py; acts only with load_aware and
    # num_attention_ranks >= 2): a long prompt's chunks run as a wavefront on up to lane_groups attention groups
    # (0: all), each layer's KV latents of a chunk put with a signal to the later chunks' groups; used for a prompt
    # of at least 2 chunks longer than lane_threshold tokens (None: any such prompt in the runtime; in the
    # simulator, one whose predicted TTFT on one group exceeds a fraction of the SLO when the SLO is known)
    long_prompt_lane: bool = True
    lane_threshold: "int | None" = None
    lane_groups: int = 0
    # the prompt tokens the lanes in flight hold together at most (None: max_prompt_len): every attention rank
    # keeps a pool of that many rows per layer for the KV latents other ranks put into it, which is what the
    # memory model charges an attention die; a prompt that wants the lane while the pool has no room waits for
    # one (first come, first served) instead of running on one rank
    lane_tokens: "int | None" = None
    # the lane's wait bound, in seconds: a prompt that has waited this long for room in the lane runs the usual
    # way, on one attention rank (the least loaded then), so a pool too small for the long prompts' arrival rate
    # does not queue them without bound; None: it waits until a lane closes
    lane_wait_s: "float | None" = None
    # how a lane prompt is split (serving/lane.py lane_split): "tokens", chunks of near-equal length
    # (split_prompt); "cost", two chunks per lane group of near-equal attention cost, later ones shorter, none
    # longer than chunk_len, at least as many as "tokens" gives, on up to twice as many groups
    lane_chunks: str = "tokens"
    # expert failover (docs/failover.md): spare expert PEs, holding no experts until one takes over the experts of
    # an expert rank whose PE died; with none left, a death fails the group as before
    spare_expert_ranks: int = 0
    # attention failover (docs/failover.md): when an attention PE dies and another one lives, the front end
    # re-admits the requests it held on the surviving attention ranks (a prefill is recomputed from its prompt);
    # off: an attention PE's death fails the group. Needs the barrier-free pipeline (barrier_free=True)
    attention_failover: bool = False
    # the HTTP service's fairness past admission (docs/server.md): a chunk the front end marks urgent (its client
    # holds fewer calls in flight than an equal share) runs ahead of the others in a micro-batch of urgent chunks
    # only, and this adds one micro-batch slot per attention rank (one more dispatch slot of symmetric memory) so
    # that it starts at once instead of after a micro-batch in flight; the service turns it on (--no-urgent-slot:
    # off). Without clients (the trace replay) no chunk is urgent
    urgent_slot: bool = False

    # ---- sync only (the baseline)
    # the baseline's all-to-alls and all-reduces over "gloo" (torch.distributed) or "shm" (asap_comm shared
    # memory, what NCCL/HCCL are to devices: microseconds instead of gloo's milliseconds)
    sync_collectives: str = "gloo"
    # on emulated devices (asap_comm.sim.emulate.emulator): prompts longer than this many tokens run with context
    # parallelism over ceil(prompt / cp_threshold) DP groups (None: never; see sync.py)
    cp_threshold: "int | None" = None

    def __post_init__(self) -> None:
        self._check_shared()
        self._check_async()
        self._check_sync()

    def _check_shared(self) -> None:
        for name in ("num_attention_ranks", "num_expert_ranks", "token_budget", "max_prompt_len"):
            if not _is_int(getattr(self, name), 1):
                raise ValueError(f"RuntimeConfig: {name}={getattr(self, name)!r} must be an int >= 1")
        if self.chunk_len is not None and not _is_int(self.chunk_len, 1):
            raise ValueError(f"RuntimeConfig: chunk_len={self.chunk_len!r} must be None or an int >= 1")
        for name in ("load_aware", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeConfig: {name}={getattr(self, name)!r} must be a bool")
        if not (_is_seconds(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"RuntimeConfig: timeout_s={self.timeout_s!r} must be seconds > 0")
        if self.placer_linear_weight is not None:
            check_linear_weight("RuntimeConfig: placer_linear_weight", self.placer_linear_weight)

    def _check_async(self) -> None:
        for name in ("barrier_free", "ping_pong", "expert_batching", "long_prompt_lane", "token_balanced", "urgent_slot"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeConfig: {name}={getattr(self, name)!r} must be a bool")
        if not _is_int(self.expert_token_budget, 1):
            raise ValueError(f"RuntimeConfig: expert_token_budget={self.expert_token_budget!r} must be an int >= 1")
        if not _is_seconds(self.expert_deadline_s):
            raise ValueError(f"RuntimeConfig: expert_deadline_s={self.expert_deadline_s!r} must be seconds >= 0")
        t = self.lane_threshold
        if t is not None and not _is_int(t, 0):
            raise ValueError(f"RuntimeConfig: lane_threshold={t!r} must be None or an int >= 0")
        g = self.lane_groups
        if not _is_int(g, 0) or g == 1:
            raise ValueError(f"RuntimeConfig: lane_groups={g!r} must be 0 (all attention ranks) or an int >= 2")
        lt = self.lane_tokens
        if lt is not None and not _is_int(lt, 1):
            raise ValueError(f"RuntimeConfig: lane_tokens={lt!r} must be None (max_prompt_len) or an int >= 1")
        w = self.lane_wait_s
        if w is not None and not _is_seconds(w):
            raise ValueError(f"RuntimeConfig: lane_wait_s={w!r} must be None (wait for room) or seconds >= 0")
        if self.lane_chunks not in ("tokens", "cost"):
            raise ValueError(f"RuntimeConfig: lane_chunks={self.lane_chunks!r} must be 'tokens' or 'cost'")
        if not _is_int(self.spare_expert_ranks, 0):
            raise ValueError(f"RuntimeConfig: spare_expert_ranks={self.spare_expert_ranks!r} must be an int >= 0")
        if not isinstance(self.attention_failover, bool):
            raise ValueError(f"RuntimeConfig: attention_failover={self.attention_failover!r} must be a bool")
        if self.attention_failover and not self.barrier_free:
            raise ValueError("RuntimeConfig: attention_failover=True needs barrier_free=True (the lock-step ablation's "
                             "every MoE layer waits for every attention rank, a dead one too)")

    def _check_sync(self) -> None:
        if self.sync_collectives not in ("gloo", "shm"):
            raise ValueError(f"RuntimeConfig: sync_collectives={self.sync_collectives!r} must be 'gloo' or 'shm'")
        c = self.cp_threshold
        if c is not None and not _is_int(c, 1):
            raise ValueError(f"RuntimeConfig: cp_threshold={c!r} must be None or an int >= 1")

    @staticmethod
    def mode_fields(mode: str) -> tuple:
        """The fields ``mode`` ("async" or "sync") reads: the shared part and its own."""
        if mode not in ("async", "sync"):
            raise ValueError(f"RuntimeConfig.mode_fields: mode={mode!r} must be 'async' or 'sync'")
        other = SYNC_FIELDS if mode == "async" else ASYNC_FIELDS
        return tuple(f.name for f in fields(RuntimeConfig) if f.name not in other)

    def for_mode(self, mode: str) -> "RuntimeConfig":
        """This configuration with the other mode's part at its defaults (what a summary of ``mode`` records)."""
        keep = set(self.mode_fields(mode))
        return replace(self, **{f.name: f.default for f in fields(self) if f.name not in keep})

    @property
    def effective_chunk_len(self) -> "int | None":
        return self.chunk_len if self.load_aware else None

    @property
    def max_chunk_tokens(self) -> int:
        c = self.effective_chunk_len
        return self.max_prompt_len if c is None else min(c, self.max_prompt_len)


SHARED_FIELDS = tuple(f.name for f in fields(RuntimeConfig) if f.name not in ASYNC_FIELDS + SYNC_FIELDS)


@dataclass(frozen=True)
class PromptRequest:
    """A request: prompt token ids (1-D int64) arriving ``arrival_s`` after the run starts."""

    request_id: int
    arrival_s: float
    token_ids: torch.Tensor


@dataclass
class RunResult:
    """Per-request records, outputs ``{request_id: (first_token, hidden [H])}``, and the timeline."""

    records: list
    outputs: dict
    spans: list = field(default_factory=list)  # (pe, track, name, start_s from the first span, dur_s)
    mode: str = "async"
    lane: dict = field(default_factory=dict)  # the long-prompt lane's counts (lane.LaneCounts.as_dict; {}: off)


# ----------------------------------------------------------------------------- live worker statistics
# Expert-batch size histogram bucket upper bounds (rows); the last bucket is +inf.
BATCH_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)
# Columns of a worker's row in the statistics table (float64).
_PID, _STARTED, _PUBLISHED, _BUSY, _BATCHES, _ROWS = range(6)
_HIST = 6  # len(BATCH_BUCKETS) + 1 cumulative-free bucket counts from here
STATS_COLUMNS = _HIST + len(BATCH_BUCKETS) + 1


class WorkerStats:
    """A worker's live statistics, published into the front end's copy of the group's statistics table.

    Worker side: :meth:`busy` adds busy seconds (compute, not waits),
    :meth:`batch` counts an expert batch's rows, :meth:`publish` puts the
    worker's row into the front end's table (at most every ``every_s``
    seconds unless ``force``). Front-end side: :meth:`rows` reads the whole
    table (one row per PE; the front end's own row stays zero). The front
    end never waits for a worker to answer: a dead worker's row just stops
    changing. Values are float64; a row read during a put may mix two
    publications, which a counter-style metric tolerates.
    """

    def __init__(self, comm, table: torch.Tensor, front: int, every_s: float = 0.1) -> None:
        self.comm, self.table, self.front, self.every_s = comm, table, front, every_s
        self.row = torch.zeros(STATS_COLUMNS, dtype=torch.float64)
        self.row[_PID] = os.getpid()
        self.row[_STARTED] = time.monotonic()
        self._next = 0.0

    def busy(self, seconds: float) -> None:
        self.row[_BUSY] += seconds

    def batch(self, rows: int) -> None:
        self.row[_BATCHES] += 1
        self.row[_ROWS] += rows
        b = next((i for i, ub in enumerate(BATCH_BUCKETS) if rows <= ub), len(BATCH_BUCKETS))
        self.row[_HIST + b] += 1

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        self.row[_PUBLISHED] = now
        if self.comm.rank != self.front:
            self.comm.put(self.table[self.comm.rank], self.row, self.front)

    def rows(self) -> list:
        """Front end: ``[{pid, busy_fraction, batches, rows, buckets}]`` per PE (zeros until it published)."""
        out = []
        for r in self.table.tolist():
            wall = r[_PUBLISHED] - r[_STARTED]
            out.append({"pid": int(r[_PID]), "busy_s": r[_BUSY], "busy_fraction": r[_BUSY] / wall if wall > 0 else 0.0,
                        "batches": int(r[_BATCHES]), "rows": r[_ROWS],
                        "buckets": [int(x) for x in r[_HIST:_HIST + len(BATCH_BUCKETS) + 1]],
                        "published": r[_PUBLISHED] > 0})
        return out


@dataclass
class Channels:
    """What one PE of a serving group allocated (its role's view): see ``group.open_channels``."""

    role: str  # "attention" | "expert" | "worker" | "front"
    box: object  # the request mailbox (requests front end -> ranks, results back)
    stats: WorkerStats
    moe: object = None  # async: this PE's AttentionEnd / ExpertEnd (None on the front end)
    lockstep: object = None  # async, barrier_free=False: the lock-step ablation's step counters
    shm: object = None  # sync, sync_collectives="shm": this worker's ShmCollectives (None on the front end)
    lane: object = None  # async with the long-prompt lane: this PE's lane.LaneBuffers


def request_mailbox(comm, cfg: RuntimeConfig, info: ModelInfo, num_targets: int):
    """Collective: requests (front end -> ranks) and results (ranks -> front end) share one mailbox."""
    # a lane chunk carries LANE_WORDS + A more words (its lane's sequence number, prompt length, pool row and ranks)
    lane = LANE_WORDS + cfg.num_attention_ranks if cfg.long_prompt_lane else 0
    slot = max(8 * (cfg.max_chunk_tokens + HDR + lane), 4 * (info.hidden + 1), 256)
    return comm.mailbox(slot, 8 * (num_targets + 4))
