"""The asynchronous disaggregated prefill runtime (ASAP mode).

Processes (one ``asap_comm`` group, ``A + E + 1`` PEs):

* PEs ``0..A-1``, attention ranks: embedding, attention with each request's
  KV cache, router, dense layers, shared experts, final norm and head. Each
  runs up to two micro-batches at once (ping-pong): a micro-batch is a
  generator that yields its ``DispatchHandle`` at every MoE layer, and the
  rank resumes whichever micro-batch's experts have answered.
* PEs ``A..A+E-1``, expert ranks: the routed experts of every MoE layer,
  served to any attention rank as rows arrive, gathered per layer up to a
  token budget or a deadline (``ExpertBatcher``).
* PE ``A+E``, the front end: replays the request trace in real time, places
  each request (``Placer``, after splitting long prompts with
  ``split_prompt``) and collects results through mailboxes.

No collective call and no barrier is on the data path. The ranks are
``async_ranks.py``, their MoE exchange ``exchange.AsyncExchange``, the group's
allocation and entry point ``group.py``, the front end ``frontend.py``. The runtime is
model-agnostic: ``model_factory(role, experts)`` returns an object with the
stage methods of ``models.DeepseekV3`` (``embed``, ``attention_stage``,
``route``, ``dense_mlp``, ``shared_experts``, ``expert``, ``final_norm``,
``lm_head_logits``, ``new_cache``); ``ModelInfo`` carries its shapes.

Result of a request: its first generated token (greedy) and the final-normed
hidden state of its last prompt token. TTFT = arrival to the moment the front
end receives that result.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Sequence

from .frontend import Replay
from .group import GroupSpec, role_of, run_group  # noqa: F401  (role_of: its old home)
from .protocol import ModelInfo, PromptRequest, RunResult, RuntimeConfig

__all__ = ["ModelInfo", "RuntimeConfig", "PromptRequest", "RunResult", "run_async"]


def run_async(model_factory: Callable[[str, list], Any], info: ModelInfo, requests: Sequence[PromptRequest],
              cfg: RuntimeConfig = RuntimeConfig()) -> RunResult:
    """Run ``requests`` through the asynchronous disaggregated runtime; return per-request results.

    ``model_factory(role, experts)`` (picklable; ``role`` is ``"attention"``
    or ``"expert"``) builds each worker's model. Runs ``A + E + S + 1``
    processes on this host (``S = cfg.spare_expert_ranks``). If a worker dies, the requests it held fail with
    an error and the run still returns (nothing hangs; ``timeout_s`` bounds it); an expert worker's death
    costs nothing while a spare is left (docs/failover.md: a spare takes over its experts, every request
    is answered; the run's timeline spans are then empty, as ``launch`` reports the dead PE).
    """
    if cfg.cp_threshold is not None:
        raise ValueError(f"run_async: cp_threshold={cfg.cp_threshold} is the baseline's context parallelism "
                         "(run_sync); ASAP's attention ranks chunk long prompts (chunk_len)")
    fd, report = tempfile.mkstemp(prefix="asap-run-", suffix=".pkl")
    os.close(fd)
    try:
        return run_group(GroupSpec("async", cfg, info, model_factory, Replay(list(requests), report)), requests,
                         report)
    finally:
        os.unlink(report)
