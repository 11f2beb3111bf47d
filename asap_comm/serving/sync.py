"""The synchronous prefill baseline (DP attention + EP experts, lock-step all-to-alls).

What ASAP is measured against: the same model, on the same number of worker
processes as :func:`asap_comm.serving.runtime.run_async` (``W = A + E``), run
the way SGLang and vLLM run DP attention with expert parallelism:

* PEs ``0..W-1``, workers: each is an attention rank for its own requests
  (data-parallel: its own KV caches, embedding, attention, router, dense
  layers, shared experts, final norm and head) *and* holds an equal share of
  the routed experts (contiguous blocks, as ``MoEPlan`` splits them). At every
  MoE layer, every worker routes its micro-batch, exchanges per-destination
  row counts with an ``all_to_all``, then a dispatch ``all_to_all_single``
  sends each token once to every worker holding one of its experts (packed:
  hidden state, expert ids with -1 for experts held elsewhere, weights), the
  workers compute their experts, and a combine ``all_to_all_single`` returns
  the weighted partial sums, added back in token order. The collectives run
  on a ``torch.distributed`` gloo group over the workers only.
* All workers step together: in each step every worker runs its next
  micro-batch (``MicroBatcher`` under the token budget, chunks from
  ``split_prompt``) or, if it has none, a dummy batch of 0 tokens that still
  joins every collective of every layer. A step starts with an
  ``all_reduce`` of two flags (does anyone have work; is anyone still
  active); when nobody has work the workers wait ~1 ms on their inboxes
  instead of stepping.
* PE ``W``, the front end: identical to the asynchronous runtime's (replays
  arrivals in real time, validates, ``Placer`` placement, mailboxes).
* **Context parallelism** (``cfg.cp_threshold``; emulated devices only, see
  below): a prompt longer than the threshold is shared by the
  ``g = min(W, ceil(prompt / cp_threshold))`` least-loaded workers
  (``Placer.place_group``; the front end marks its chunks with the group). Its
  chunks still run in order, each shared by the ``g`` groups in ONE step: at
  the start of a step every owner proposes its next shared chunk in the step's
  ``all_reduce`` (request, length, start, group), and every worker accepts the
  same proposals by the same rule, in request order: a chunk joins if each of
  its groups has no share yet or room under the token budget (the
  simulator's rule). A worker then takes its own micro-batch under the budget
  its shares leave, if a whole chunk still fits. *Emulated, not real*: the
  served model is small, so the owner computes the shared chunk for real (its
  KV cache stays whole, outputs stay checked), and the emulated devices hold
  what a real CP group would: the owner its share of the chunk's attention
  (``attention_stage(..., cp_groups=g)``) and the other groups theirs
  (``hold_cp_share``), each with the KV exchange of the cost model; the
  owner's MLP stages and dispatched rows count only its share
  (``cp_step``). A model factory without these hooks (a real model) is
  refused: on real devices the workers would have to split the chunk.

The worker is ``sync_worker.py``, its MoE exchange and collectives
``exchange.CollectiveExchange`` (gloo, or ``ShmCollectives`` with
``sync_collectives="shm"``), the group's allocation and entry point
``group.py``, the front end ``frontend.py``.

Same interface and result format as ``run_async``; ``RunResult.mode`` is
``"sync"``. ``cfg.ping_pong`` and ``cfg.expert_batching`` have no meaning
here (one micro-batch per step; experts compute each step's rows at once).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Sequence

from ..moe import expert_placement
from .exchange import ShmCollectives, shm_collectives  # noqa: F401  (their old home)
from .frontend import Replay
from .group import GroupSpec, run_group
from .hooks import emulates_context_parallelism
from .protocol import ModelInfo, PromptRequest, RunResult, RuntimeConfig

__all__ = ["run_sync"]

rank_of_expert = expert_placement  # the worker holding each routed expert: the same placement as MoEPlan


def check_config(model_factory, cfg: RuntimeConfig) -> None:
    """The baseline's refusals (raises ValueError)."""
    W = cfg.num_attention_ranks + cfg.num_expert_ranks
    if cfg.cp_threshold is not None and not emulates_context_parallelism(model_factory):
        raise ValueError(f"run_sync: cp_threshold={cfg.cp_threshold} needs emulated devices (a model factory with "
                         "emulates_context_parallelism, such as asap_comm.sim.emulate.emulator.EmulatedFactory): context "
                         "parallelism is emulated (the owner computes a shared chunk; the devices hold their "
                         "shares), and on this model factory the workers would have to split the chunk for real")
    if cfg.cp_threshold is not None and W > 62:
        raise ValueError(f"run_sync: cp_threshold needs at most 62 workers (a group is a 64-bit mask), got {W}")


def run_sync(model_factory: Callable[[str, list], Any], info: ModelInfo, requests: Sequence[PromptRequest],
             cfg: RuntimeConfig = RuntimeConfig()) -> RunResult:
    """Run ``requests`` through the synchronous DP+EP baseline; same interface and results as ``run_async``.

    ``W = cfg.num_attention_ranks + cfg.num_expert_ranks`` workers (each
    attention for its own requests plus ``1/W`` of the routed experts, built
    from ``model_factory("attention", [])`` and ``model_factory("expert",
    experts)``) and one front end, ``W + 1`` processes on this host. If a
    worker dies, its requests fail with an error and the run still returns
    (``timeout_s`` bounds the run and every collective).
    """
    check_config(model_factory, cfg)
    fd, report = tempfile.mkstemp(prefix="asap-sync-", suffix=".pkl")
    os.close(fd)
    # The workers' gloo group rendezvous through the group's own store (launch's: only this user reaches it).
    try:
        return run_group(GroupSpec("sync", cfg, info, model_factory, Replay(list(requests), report)),
                         requests, report)
    finally:
        os.unlink(report)
