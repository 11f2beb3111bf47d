"""The DeepSeek-V3 model as the stages the disaggregated runtime runs, and the reference
forward built from those same stages.

Legend: T = tokens of one request (or chunk), H = hidden size, V = vocab size,
E = routed experts, k = experts per token, N = tokens given to one expert.

A layer, as stages::

    a = attention_stage(layer, h, cache)        # norm, MLA (+cache), residual, post-attn norm
    if dense layer:  h = a.hidden + dense_mlp(layer, a.mlp_input)
    else:            r = route(layer, a.mlp_input)                       # topk_ids/weights [T,k]
                     h = a.hidden + (routed_experts(layer, a.mlp_input, r) + shared_experts(layer, a.mlp_input))

routed_experts is, per chosen expert e, ``expert(layer, e, x[tokens_e], weights_e)``
scatter-added back: that call is what an expert rank runs on tokens from any request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import LatentAttention, LayerCache, RMSNorm, Rope, RoutedExperts, Router, Routing, SwiGLU

__all__ = ["DeepseekV3", "KVCache", "AttentionOutput", "PrefillOutput"]


class KVCache:
    """Per-request MLA cache: for each layer, the latents of the tokens prefilled so far.

    A prompt prefilled chunk by chunk into one KVCache gives the same result as in one go.
    """

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]

    def length(self, layer: int = 0) -> int:
        """Tokens already cached for `layer`; the next chunk starts at this position."""
        return self.layers[layer].length


@dataclass(frozen=True)
class AttentionOutput:
    """hidden: `[T,H]` the residual stream after attention; mlp_input: `[T,H]` its post-attention norm."""

    hidden: torch.Tensor
    mlp_input: torch.Tensor


@dataclass(frozen=True)
class PrefillOutput:
    """logits `[T,V]`; hidden_states: L+1 tensors `[T,H]` (the embeddings, then each layer's
    output, as transformers' output_hidden_states); final_hidden `[T,H]`: the final norm of the last."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    final_hidden: torch.Tensor


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, experts: list[int], attention_side: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer)
        H = cfg.hidden_size
        if attention_side:
            self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            self.self_attn = LatentAttention(cfg, dtype)
            self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps, dtype)
            if not self.is_moe:
                self.mlp = SwiGLU(H, cfg.intermediate_size, dtype)
            else:
                self.gate = Router(cfg)
                if cfg.n_shared_experts > 0:
                    self.shared_experts = SwiGLU(H, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)
        if self.is_moe:
            self.experts = RoutedExperts(cfg, experts, dtype)


class DeepseekV3(nn.Module):
    """DeepSeek-V3 (MLA + DeepSeekMoE) for prefill, on one request's tokens at a time.

    experts: the routed experts held (global ids, in every MoE layer); None means all.
    attention_side: hold everything that is not a routed expert (embedding, attention,
    norms, routers, dense MLPs, shared experts, head). An expert-only process sets it False.
    Weights are left uninitialised: fill them with ``load_checkpoint`` or ``random_init``.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, *,
                 experts: Iterable[int] | None = None, attention_side: bool = True) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"DeepseekV3: dtype={dtype} must be a floating point dtype")
        self.config = config
        self.dtype = dtype
        E = config.n_routed_experts
        ids = list(range(E)) if experts is None else sorted(set(int(e) for e in experts))
        bad = [e for e in ids if not 0 <= e < E]
        if bad:
            raise ValueError(f"DeepseekV3: expert ids {bad} out of range [0, {E})")
        self.expert_ids = tuple(ids)
        self.attention_side = attention_side
        self.rope = Rope(config)
        if attention_side:
            self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                             requires_grad=False)  # [V, H]
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
                                            requires_grad=False)  # [V, H]
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, ids, attention_side, dtype) for i in range(config.num_hidden_layers))

    # ------------------------------------------------------------------ stages
    def new_cache(self) -> KVCache:
        """An empty per-request cache, for chunked prefill."""
        return KVCache(self.config.num_hidden_layers)

    @property
    def kv_row_width(self) -> int:
        """Values per token of one layer's cache: the latent (kv_lora_rank) and the rope key (qk_rope_head_dim)."""
        return self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def kv_rows(self, cache: KVCache, layer: int, start: int, end: int) -> torch.Tensor:
        """Layer ``layer``'s cached latents of positions ``[start, end)`` as one ``[end - start, c + r]`` tensor
        (a copy): what another process appends with :meth:`append_kv_rows` to continue the prefill."""
        lc = cache.layers[layer]
        if not 0 <= start <= end <= lc.length:
            raise ValueError(f"kv_rows: positions [{start}, {end}) of layer {layer} are not all cached "
                             f"({lc.length} tokens are)")
        return torch.cat((lc.c[start:end], lc.k_rope[start:end]), dim=-1)

    def append_kv_rows(self, cache: KVCache, layer: int, rows: torch.Tensor) -> None:
        """Append ``rows`` (``[n, c + r]``, as :meth:`kv_rows` gives them; copied) to layer ``layer``'s cache: the
        next tokens attend to them as if this process had prefilled them."""
        w, c = self.kv_row_width, self.config.kv_lora_rank
        if rows.dim() != 2 or rows.shape[1] != w:
            raise ValueError(f"append_kv_rows: rows must be [n, {w}], got {tuple(rows.shape)}")
        rows = rows.to(self.dtype).clone()
        cache.layers[layer].append(rows[:, :c], rows[:, c:])

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] int64 -> hidden [T,H]."""
        self._need_attention_side("embed")
        if token_ids.dim() != 1 or token_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"embed: token_ids must be a 1-D integer tensor, got shape {tuple(token_ids.shape)} "
                             f"dtype {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"embed: token ids must lie in [0, {self.config.vocab_size}), got "
                             f"[{int(token_ids.min())}, {int(token_ids.max())}]")
        return F.embedding(token_ids, self.embed_tokens)

    def attention_stage(self, layer: int, hidden: torch.Tensor, cache: KVCache | None = None) -> AttentionOutput:
        """hidden [T,H] (tokens at positions cache.length(layer) ...) -> AttentionOutput; appends to cache."""
        self._need_attention_side("attention_stage")
        blk = self._layer(layer, "attention_stage")
        self._check_hidden("attention_stage", "hidden", hidden)
        layer_cache = None if cache is None else cache.layers[layer]
        start = 0 if layer_cache is None else layer_cache.length
        positions = torch.arange(start, start + hidden.shape[0], device=hidden.device)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)
        h = hidden + blk.self_attn(blk.input_layernorm(hidden), cos, sin, self.rope, layer_cache)
        return AttentionOutput(h, blk.post_attention_layernorm(h))

    def route(self, layer: int, mlp_input: torch.Tensor) -> Routing:
        """mlp_input [T,H] -> Routing(topk_ids [T,k] int64, topk_weights [T,k] float32)."""
        self._need_attention_side("route")
        blk = self._moe_layer(layer, "route")
        self._check_hidden("route", "mlp_input", mlp_input)
        return blk.gate(mlp_input)

    def expert(self, layer: int, expert: int, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Routed expert `expert` of `layer` on a token batch x [N,H]; times weights [N] if given -> [N,H]."""
        blk = self._moe_layer(layer, "expert")
        self._check_hidden("expert", "x", x)
        if weights is not None and tuple(weights.shape) != (x.shape[0],):
            raise ValueError(f"expert: weights must have shape [N]=[{x.shape[0]}], got {list(weights.shape)}")
        return blk.experts.one(expert, x, weights)

    def routed_experts(self, layer: int, mlp_input: torch.Tensor, routing: Routing,
                       local_only: bool = False) -> torch.Tensor:
        """The weighted sum of each token's k routed experts: mlp_input [T,H] -> [T,H].
        local_only: the partial sum over the experts this model holds."""
        blk = self._moe_layer(layer, "routed_experts")
        self._check_hidden("routed_experts", "mlp_input", mlp_input)
        want = (mlp_input.shape[0], self.config.num_experts_per_tok)
        if tuple(routing.topk_ids.shape) != want or tuple(routing.topk_weights.shape) != want:
            raise ValueError(f"routed_experts: routing topk_ids {list(routing.topk_ids.shape)} / topk_weights "
                             f"{list(routing.topk_weights.shape)} must both be [T, k]={list(want)}")
        return blk.experts(mlp_input, routing, local_only)

    def shared_experts(self, layer: int, mlp_input: torch.Tensor) -> torch.Tensor:
        """mlp_input [T,H] -> [T,H] (zeros when n_shared_experts is 0)."""
        self._need_attention_side("shared_experts")
        blk = self._moe_layer(layer, "shared_experts")
        if self.config.n_shared_experts == 0:
            return torch.zeros_like(mlp_input)
        return blk.shared_experts(mlp_input)

    def dense_mlp(self, layer: int, mlp_input: torch.Tensor) -> torch.Tensor:
        """The MLP of a dense layer (layer < first_k_dense_replace): mlp_input [T,H] -> [T,H]."""
        self._need_attention_side("dense_mlp")
        blk = self._layer(layer, "dense_mlp")
        if blk.is_moe:
            raise ValueError(f"dense_mlp: layer {layer} is an MoE layer (first_k_dense_replace="
                             f"{self.config.first_k_dense_replace})")
        return blk.mlp(mlp_input)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T,H] -> normed [T,H]."""
        self._need_attention_side("final_norm")
        return self.norm(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T,H] (last layer's output) -> logits [T,V]."""
        return self.lm_head_logits(self.final_norm(hidden))

    def lm_head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [T,H] -> logits [T,V]."""
        self._need_attention_side("head")
        w = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        return F.linear(normed, w)

    # --------------------------------------------------------------- reference
    def layer_forward(self, layer: int, hidden: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """One decoder layer from the stages above: hidden [T,H] -> [T,H]."""
        a = self.attention_stage(layer, hidden, cache)
        if not self.config.is_moe_layer(layer):
            return a.hidden + self.dense_mlp(layer, a.mlp_input)
        routing = self.route(layer, a.mlp_input)
        moe = self.routed_experts(layer, a.mlp_input, routing) + self.shared_experts(layer, a.mlp_input)
        return a.hidden + moe

    def prefill(self, token_ids: torch.Tensor, cache: KVCache | None = None) -> PrefillOutput:
        """Prefill token_ids [T] (continuing `cache`, if given, which is extended) -> PrefillOutput."""
        h = self.embed(token_ids)
        hidden_states = [h]
        for layer in range(self.config.num_hidden_layers):
            h = self.layer_forward(layer, h, cache)
            hidden_states.append(h)
        final = self.final_norm(h)
        return PrefillOutput(self.lm_head_logits(final), tuple(hidden_states), final)

    def forward(self, token_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """token_ids [T] -> logits [T,V]."""
        h = self.embed(token_ids)
        for layer in range(self.config.num_hidden_layers):
            h = self.layer_forward(layer, h, cache)
        return self.head(h)

    # ----------------------------------------------------------------- helpers
    def _layer(self, layer: int, caller: str) -> DecoderLayer:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise IndexError(f"{caller}: layer {layer} out of range [0, {self.config.num_hidden_layers})")
        return self.layers[layer]

    def _moe_layer(self, layer: int, caller: str) -> DecoderLayer:
        blk = self._layer(layer, caller)
        if not blk.is_moe:
            raise ValueError(f"{caller}: layer {layer} is a dense layer (first_k_dense_replace="
                             f"{self.config.first_k_dense_replace}); it has no experts or router")
        return blk

    def _check_hidden(self, caller: str, name: str, x: torch.Tensor) -> None:
        H = self.config.hidden_size
        if x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"{caller}: {name} must have shape [T, H={H}], got {list(x.shape)}")

    def _need_attention_side(self, caller: str) -> None:
        if not self.attention_side:
            raise RuntimeError(f"{caller}: this model holds routed experts only (attention_side=False)")
