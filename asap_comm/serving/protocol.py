"""The serving package's internal protocol, in one place: the shared types and the chunk message.

Everything that the asynchronous runtime (``runtime.py``), the synchronous
baseline (``sync.py``), their shared front end (``frontend.py``) and the
simulator (``asap_comm.sim``) must agree on lives here:

* the shared types: :class:`ModelInfo`, :class:`RuntimeConfig`,
  :class:`PromptRequest`, :class:`RunResult` (``runtime`` re-exports them);
* the front end's chunk message, one request chunk to the rank that runs it:
  ``HDR`` int64 header words (request id, chunk index, number of chunks,
  start, context-parallel group mask) followed by the chunk's token ids,
  tagged with the request id; :data:`STOP` is the tag of the "no more
  requests" message. :func:`encode_chunk` builds it and :func:`decode_chunk`
  reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .policies import Chunk

__all__ = ["ModelInfo", "RuntimeConfig", "PromptRequest", "RunResult", "HDR", "STOP", "encode_chunk",
           "decode_chunk"]

STOP = -1  # tag of the front end's "no more requests" message
# chunk message header words: request id, chunk index, number of chunks, start, context-parallel groups (a bit
# mask of the workers sharing the request; 0: none)
HDR = 5


def encode_chunk(chunk: Chunk, token_ids: torch.Tensor, groups: int = 0) -> torch.Tensor:
    """The payload of a chunk message: the header, then ``token_ids`` (the chunk's tokens) as int64."""
    hdr = torch.tensor([chunk.request_id, chunk.index, chunk.num_chunks, chunk.start, groups], dtype=torch.int64)
    return torch.cat([hdr, token_ids.to(torch.int64)])


def decode_chunk(payload: torch.Tensor) -> tuple:
    """``(Chunk, groups, token ids)`` of a chunk message's payload (the token ids are a copy)."""
    rid, index, n, start, groups = payload[:HDR].tolist()
    toks = payload[HDR:].clone()
    return Chunk(rid, index, start, toks.numel(), n), groups, toks


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


@dataclass(frozen=True)
class RuntimeConfig:
    """Ranks, budgets and the four optimizations (each switchable for ablation)."""

    num_attention_ranks: int = 2
    num_expert_ranks: int = 2
    token_budget: int = 512  # tokens per attention micro-batch
    max_prompt_len: int = 8192
    chunk_len: "int | None" = 512  # split longer prompts into chunks (with load_aware)
    barrier_free: bool = True  # (1) False: every MoE layer step is a barrier across the attention ranks
    ping_pong: bool = True  # (2) two micro-batches in flight per attention rank
    load_aware: bool = True  # (3) least-outstanding-work placement + long-prompt splitting
    expert_batching: bool = True  # (4) gather rows per layer across attention ranks
    expert_token_budget: int = 1024
    expert_deadline_s: float = 0.002
    timeout_s: float = 600.0  # bound on the whole run
    progress: bool = False  # a live progress line on stderr from the front end
    # run_sync only: the baseline's all-to-alls and all-reduces over "gloo" (torch.distributed) or "shm"
    # (asap_comm shared memory, what NCCL/HCCL are to devices: microseconds instead of gloo's milliseconds)
    sync_collectives: str = "gloo"
    # run_sync only, on emulated devices (asap_comm.sim.emulate): prompts longer than this many tokens run with
    # context parallelism over ceil(prompt / cp_threshold) DP groups (None: never; see sync.py)
    cp_threshold: "int | None" = None

    def __post_init__(self) -> None:
        for name in ("num_attention_ranks", "num_expert_ranks", "token_budget", "max_prompt_len",
                     "expert_token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RuntimeConfig: {name}={v!r} must be an int >= 1")
        if self.chunk_len is not None and (not isinstance(self.chunk_len, int) or self.chunk_len < 1):
            raise ValueError(f"RuntimeConfig: chunk_len={self.chunk_len!r} must be None or an int >= 1")
        c = self.cp_threshold
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"RuntimeConfig: cp_threshold={c!r} must be None or an int >= 1")
        if self.sync_collectives not in ("gloo", "shm"):
            raise ValueError(f"RuntimeConfig: sync_collectives={self.sync_collectives!r} must be 'gloo' or 'shm'")

    @property
    def effective_chunk_len(self) -> "int | None":
        return self.chunk_len if self.load_aware else None

    @property
    def max_chunk_tokens(self) -> int:
        c = self.effective_chunk_len
        return self.max_prompt_len if c is None else min(c, self.max_prompt_len)


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
