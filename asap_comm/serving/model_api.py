"""The model contract of the serving runtime, as ``typing.Protocol``s: what ``run_async`` / ``run_sync`` call.

The runtime never imports a model package. It takes a *factory* and the model's shapes (``ModelInfo``) and
builds each worker's share of the model with ``factory(role, experts)``:

* ``factory("attention", [])`` on every attention rank (the baseline's workers too): an :class:`AttentionStage`
  (embedding, attention with a per-request cache, router, dense MLPs, shared experts, final norm, head);
* ``factory("expert", experts)`` on every expert rank, with the global ids of the routed experts it holds
  (``asap_comm.moe.expert_placement``): an :class:`ExpertStage`.

One micro-batch through the model, as the runtime drives it (``worker.layer_loop``), for each sequence ``s`` of
``len_s`` new tokens whose cache holds its earlier chunks::

    h = embed(token_ids)                                    # [len_s] int64 -> [len_s, H]
    for layer in range(info.num_layers):
        o = attention_stage(layer, h, cache)                # o.hidden, o.mlp_input: [len_s, H]; appends to cache
        m = o.mlp_input of every sequence, concatenated     # [T, H]
        if info.moe_layers[layer]:
            r = route(layer, m)                             # r.topk_ids [T, k] (global ids), r.topk_weights [T, k]
            y = sum_j r.topk_weights[:, j] * expert(layer, r.topk_ids[:, j], m)   # on the expert ranks
            y = y + shared_experts(layer, m)
        else:
            y = dense_mlp(layer, m)
        h = o.hidden + y (this sequence's rows)
    normed = final_norm(h[-1:]); token = lm_head_logits(normed).argmax(-1)       # on a request's last chunk

``expert(layer, e, x)`` returns the *unweighted* output of routed expert ``e`` (a global id) on rows ``x``; the
runtime applies the routing weights (``asap_comm.moe.apply_experts``). Tensors are CPU tensors of
``ModelInfo.dtype`` (token ids int64). A request's chunks arrive in order on one attention rank with one cache
(``new_cache()``), so ``attention_stage`` must attend to the cached earlier positions.

Optional: :class:`LaneStage` (``kv_rows``/``append_kv_rows``, only with ``ModelInfo.kv_row_width > 0``: the
long-prompt lane moves a chunk's cache rows between attention ranks), and the hooks of
``asap_comm.serving.hooks`` (emulated devices only). A factory found through the ``asap_comm.models`` entry
point (``plugins.load_model_factory``) is a :class:`DescribedModelFactory`.

Every protocol is ``runtime_checkable``: ``isinstance(model, AttentionStage)`` checks the method names (not
their signatures). ``examples/custom_model.py`` serves a model written against this contract alone.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["AttentionOutputLike", "RoutingLike", "AttentionStage", "LaneStage", "ExpertStage", "ModelFactory",
           "DescribedModelFactory", "DESCRIBE_KEYS"]

# the keys ``DescribedModelFactory.describe()`` returns (``plugins.model_info_of`` reads them; kv_row_width optional)
DESCRIBE_KEYS = ("num_layers", "moe_layers", "hidden", "vocab_size", "num_experts", "top_k")


@runtime_checkable
class AttentionOutputLike(Protocol):
    """What ``attention_stage`` returns: the residual stream after attention and the MLP's input."""

    hidden: torch.Tensor  # [len, H]
    mlp_input: torch.Tensor  # [len, H]: the post-attention norm of ``hidden``


@runtime_checkable
class RoutingLike(Protocol):
    """What ``route`` returns."""

    topk_ids: torch.Tensor  # [T, k] integer: global routed-expert ids in [0, num_experts)
    topk_weights: torch.Tensor  # [T, k] floating: the weights the runtime multiplies each expert's output by


@runtime_checkable
class AttentionStage(Protocol):
    """The attention side of a model: what ``factory("attention", [])`` returns."""

    def new_cache(self) -> Any:
        """An empty per-request cache (any object; the runtime only hands it back to ``attention_stage``)."""

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids [len]`` int64 -> ``[len, H]``."""

    def attention_stage(self, layer: int, hidden: torch.Tensor, cache: Any) -> AttentionOutputLike:
        """Layer ``layer``'s attention of ``hidden [len, H]``, the tokens that follow those ``cache`` holds for
        this layer; appends them to ``cache``."""

    def route(self, layer: int, mlp_input: torch.Tensor) -> RoutingLike:
        """The router of MoE layer ``layer``: ``mlp_input [T, H]`` -> top-k ids and weights."""

    def shared_experts(self, layer: int, mlp_input: torch.Tensor) -> torch.Tensor:
        """MoE layer ``layer``'s shared experts: ``[T, H]`` -> ``[T, H]`` (zeros when the model has none)."""

    def dense_mlp(self, layer: int, mlp_input: torch.Tensor) -> torch.Tensor:
        """The MLP of a dense (non-MoE) layer: ``[T, H]`` -> ``[T, H]``."""

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[n, H]``: the request's result is the final-normed hidden state of its last token."""

    def lm_head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[n, vocab]``: the first token is the argmax."""


@runtime_checkable
class LaneStage(AttentionStage, Protocol):
    """An attention side whose cache rows can move between ranks (the long-prompt lane, ``lane.py``); needed
    only when ``ModelInfo.kv_row_width > 0``. The cache must also answer ``cache.length(layer)``."""

    def kv_rows(self, cache: Any, layer: int, start: int, end: int) -> torch.Tensor:
        """Layer ``layer``'s cached rows of positions ``[start, end)``: ``[end - start, kv_row_width]`` (a copy)."""

    def append_kv_rows(self, cache: Any, layer: int, rows: torch.Tensor) -> None:
        """Append rows that ``kv_rows`` gave (on another rank) to ``cache``'s layer ``layer``."""


@runtime_checkable
class ExpertStage(Protocol):
    """The expert side of a model: what ``factory("expert", experts)`` returns."""

    def expert(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Routed expert ``expert`` (a global id, one of the ``experts`` the factory was given) of MoE layer
        ``layer`` on rows ``x [m, H]`` -> ``[m, H]``, unweighted."""


@runtime_checkable
class ModelFactory(Protocol):
    """What ``run_async`` / ``run_sync`` take: picklable (each worker process unpickles it and calls it once)."""

    def __call__(self, role: str, experts: list) -> Any:
        """``role`` is ``"attention"`` (``experts == []``; an :class:`AttentionStage`) or ``"expert"`` (the
        global ids this rank holds; an :class:`ExpertStage`)."""


@runtime_checkable
class DescribedModelFactory(ModelFactory, Protocol):
    """A factory that also states its shapes, as a model plug-in does (``plugins.model_info_of``)."""

    def describe(self) -> dict:
        """Plain data with at least :data:`DESCRIBE_KEYS` (``moe_layers``: a bool per layer) and optionally
        ``kv_row_width``."""
