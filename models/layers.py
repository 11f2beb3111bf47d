"""Building blocks of the DeepSeek-V3 model, each on a single request's tokens (no batch dim).

Legend: T = tokens in this call, S = tokens attended to (cached + new), H = hidden size,
nH = attention heads, E = routed experts, k = experts per token, N = tokens sent to one expert,
I = MLP width, r = qk_rope_head_dim, c = kv_lora_rank.

Parameters never require grad: this is an inference model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

__all__ = ["RMSNorm", "Rope", "LatentAttention", "SwiGLU", "Router", "Routing", "RoutedExperts"]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32, scaled in x's dtype."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)  # [D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rope:
    """Rotary embedding of the decoupled rope part (r dims), plain or YaRN-scaled.

    Rotates pairs ``(x[2i], x[2i+1])`` when ``interleave`` (DeepSeek's layout), or ``(x[i], x[i+r/2])``
    otherwise, and returns the rotated pairs de-interleaved: ``[x1', x2']`` with x1 the first
    elements of the pairs. That reorders the rope dims of q and k alike, so q.k is unchanged;
    it is what ``transformers`` returns too.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        r = cfg.qk_rope_head_dim
        theta = cfg.rope_theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))  # [r/2]
        self.attention_factor = 1.0  # scales cos and sin
        if cfg.rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(cfg, inv_freq)
        self.inv_freq = inv_freq
        self.interleave = cfg.rope_interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, r/2] in dtype (angles computed in float32)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        cos = freqs.cos() * self.attention_factor
        sin = freqs.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, r], cos/sin [T, r/2] -> rotated [T, heads, r]."""
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _yarn_inv_freq(cfg: ModelConfig, inv_freq_extra: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: blend interpolated and original
    frequencies with a linear ramp over the dims between the beta_fast and beta_slow
    correction dims; cos/sin scaled by attention_factor."""
    r = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    factor = cfg._yarn_factor()
    orig_max = cfg._yarn_original_max()

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = cfg.rope_attention_factor
    if attention_factor is None:
        if cfg.rope_mscale and cfg.rope_mscale_all_dim:
            attention_factor = float(mscale(factor, cfg.rope_mscale) / mscale(factor, cfg.rope_mscale_all_dim))
        else:
            attention_factor = mscale(factor)
    beta_fast = cfg.rope_beta_fast or 32
    beta_slow = cfg.rope_beta_slow or 1

    def correction_dim(num_rotations: float) -> float:
        return (r * math.log(orig_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low), 0, 1)  # [r/2]
    extra_weight = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r)
    inv_freq_extra = 1.0 / pos_freqs
    inv_freq_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_freq_inter * (1 - extra_weight) + inv_freq_extra * extra_weight
    return inv_freq, float(attention_factor)


class LatentAttention(nn.Module):
    """Multi-head latent attention (MLA) with decoupled rope.

    q = W_qb(norm(W_qa x)) (or W_q x when q_lora_rank is None); the kv side keeps one latent
    per token, c = norm(W_kva x)[:c] plus a shared rope key k_r = rope(W_kva x)[c:]; heads are
    expanded from the latent with W_kvb. The cache holds (c, k_r) only.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        H, nH = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = nH
        self.nope, self.rope_dim, self.v_dim, self.latent = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        self.q_lora_rank = cfg.q_lora_rank
        qk = cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = _param(nH * qk, H, dtype=dtype)
        else:
            self.q_a_proj = _param(cfg.q_lora_rank, H, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = _param(nH * qk, cfg.q_lora_rank, dtype=dtype)
        self.kv_a_proj_with_mqa = _param(cfg.kv_lora_rank + cfg.qk_rope_head_dim, H, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = _param(nH * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, dtype=dtype)
        self.o_proj = _param(H, nH * cfg.v_head_dim, dtype=dtype)
        self.scale = cfg.softmax_scale

    def latent_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Rope
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T,H] -> (c [T,c] normalised latent, k_r [T,r] rotated rope key): what the cache stores."""
        ckv = F.linear(x, self.kv_a_proj_with_mqa)  # [T, c + r]
        c, k_r = ckv.split([self.latent, self.rope_dim], dim=-1)
        k_r = rope.apply(k_r[:, None, :], cos, sin)[:, 0, :]
        return self.kv_a_layernorm(c), k_r

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Rope,
                cache: "LayerCache | None" = None) -> torch.Tensor:
        """x [T,H] at positions given by cos/sin [T,r/2]; appends to cache (if any); -> [T,H]."""
        T = x.shape[0]
        nH = self.num_heads
        if self.q_lora_rank is None:
            q = F.linear(x, self.q_proj)
        else:
            q = F.linear(self.q_a_layernorm(F.linear(x, self.q_a_proj)), self.q_b_proj)
        q = q.view(T, nH, self.nope + self.rope_dim)  # [T, nH, qk]
        q_nope, q_r = q.split([self.nope, self.rope_dim], dim=-1)
        q = torch.cat((q_nope, rope.apply(q_r, cos, sin)), dim=-1)

        c, k_r = self.latent_kv(x, cos, sin, rope)  # [T, c], [T, r]
        prefix = 0
        if cache is not None:
            prefix = cache.length
            c, k_r = cache.append(c, k_r)  # [S, c], [S, r]
        S = c.shape[0]
        kv = F.linear(c, self.kv_b_proj).view(S, nH, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [S, nH, nope], [S, nH, v]
        k = torch.cat((k_nope, k_r[:, None, :].expand(S, nH, self.rope_dim)), dim=-1)  # [S, nH, qk]

        o = _attention(q, k, v, prefix, self.scale)  # [T, nH, v]
        return F.linear(o.reshape(T, nH * self.v_dim), self.o_proj)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """Causal softmax attention of q [T,nH,d] at positions prefix.. over k [S,nH,d], v [S,nH,dv] -> [T,nH,dv].

    Zero-pads the smaller of d and dv (zeros change no dot product) and passes 4-D tensors,
    so that torch takes its fused (flash) CPU kernel, which wants both; otherwise it falls
    back to materialising the [T,S] score matrix.
    """
    T, S, d, dv = q.shape[0], k.shape[0], q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif d < dv:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, nH, T|S, max(d, dv)]
    if prefix == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=T > 1, scale=scale)
    else:  # query i sits at position prefix + i and sees keys 0 .. prefix + i
        allowed = (torch.arange(S, device=q.device)[None, :]
                   <= torch.arange(prefix, prefix + T, device=q.device)[:, None])  # [T, S]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=scale)
    return o[0, :, :, :dv].transpose(0, 1)  # [T, nH, dv]


class LayerCache:
    """One layer's share of a request's cache: the latents (c [S,c], k_r [S,r]) of earlier chunks."""

    def __init__(self) -> None:
        self.c: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.c is None else self.c.shape[0]

    def append(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.c is None:
            self.c, self.k_rope = c, k_rope
        else:
            self.c = torch.cat((self.c, c))
            self.k_rope = torch.cat((self.k_rope, k_rope))
        return self.c, self.k_rope


class SwiGLU(nn.Module):
    """down(silu(gate x) * up x), gate and up stored as one [2I, H] matrix (gate rows first)."""

    def __init__(self, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = width
        self.gate_up = _param(2 * width, hidden, dtype=dtype)  # [2I, H]
        self.down = _param(hidden, width, dtype=dtype)  # [H, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T,H] -> [T,H]."""
        return swiglu(x, self.gate_up, self.down)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [N,H], gate_up [2I,H], down [H,I] -> [N,H]."""
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)  # [N, I] each
    return F.linear(F.silu(g) * u, down)


@dataclass(frozen=True)
class Routing:
    """Which experts each token goes to and with what weight.

    topk_ids: `[T, k]` int64, global routed-expert ids; topk_weights: `[T, k]` float32, the
    final multipliers (normalised if norm_topk_prob, times routed_scaling_factor).
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


class Router(nn.Module):
    """DeepSeek-V3 routing (``noaux_tc``), computed in float32.

    scores = sigmoid(W x); experts are *chosen* by scores + e_score_correction_bias, limited to
    the topk_group groups whose two best biased scores sum highest; the chosen experts are
    *weighted* by their unbiased scores.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E = cfg.n_routed_experts
        self.num_experts, self.k = E, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = _param(E, cfg.hidden_size, dtype=torch.float32)  # [E, H]
        self.e_score_correction_bias = _param(E, dtype=torch.float32)  # [E]

    def forward(self, x: torch.Tensor) -> Routing:
        T, E, G = x.shape[0], self.num_experts, self.n_group
        scores = F.linear(x.float(), self.weight).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias  # [T, E], for selection only
        group_score = biased.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
        best_groups = group_score.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_ok = torch.zeros_like(group_score).scatter_(1, best_groups, 1.0).bool()  # [T, G]
        expert_ok = group_ok[:, :, None].expand(T, G, E // G).reshape(T, E)  # [T, E]
        biased = biased.masked_fill(~expert_ok, float("-inf"))
        topk_ids = biased.topk(self.k, dim=-1, sorted=False).indices  # [T, k]
        w = scores.gather(1, topk_ids)  # [T, k]
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return Routing(topk_ids, w * self.scaling)


class RoutedExperts(nn.Module):
    """The routed experts of one MoE layer that this process holds (any subset of the E).

    gate_up: `[E_local, 2I, H]`, down: `[E_local, H, I]`; ``expert_ids[j]`` is the global id of
    local expert j.
    """

    def __init__(self, cfg: ModelConfig, expert_ids: list[int], dtype: torch.dtype) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.expert_ids = list(expert_ids)
        self.num_experts = cfg.n_routed_experts
        self.local = {e: j for j, e in enumerate(self.expert_ids)}
        self.gate_up = _param(len(expert_ids), 2 * I, H, dtype=dtype)
        self.down = _param(len(expert_ids), H, I, dtype=dtype)

    def local_index(self, expert: int, caller: str) -> int:
        j = self.local.get(expert)
        if j is None:
            held = self.expert_ids if len(self.expert_ids) <= 16 else f"{len(self.expert_ids)} experts"
            raise KeyError(f"{caller}: routed expert {expert} is not held by this model (holds {held})")
        return j

    def one(self, expert: int, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Expert `expert` on x [N,H]; times weights [N] (any float dtype) if given -> [N,H] in x's dtype."""
        j = self.local_index(expert, "expert")
        y = swiglu(x, self.gate_up[j], self.down[j])
        if weights is not None:
            y = (y * weights[:, None]).to(x.dtype)
        return y

    def forward(self, x: torch.Tensor, routing: Routing, local_only: bool = False) -> torch.Tensor:
        """sum_k w[t,k] * expert_{ids[t,k]}(x[t]) for x [T,H] -> [T,H].

        Groups the T*k (token, expert) pairs by expert and runs each expert once on its
        gathered tokens. local_only: skip experts not held (a partial sum, as an expert
        rank returns); otherwise every chosen expert must be held.
        """
        T, k = routing.topk_ids.shape
        flat_ids = routing.topk_ids.reshape(-1)  # [T*k]
        flat_w = routing.topk_weights.reshape(-1)  # [T*k]
        order = flat_ids.argsort(stable=True)  # pair indices grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # [E]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]  # [N]
            start += n
            if local_only and expert not in self.local:
                continue
            tokens = pairs // k  # [N]
            out.index_add_(0, tokens, self.one(expert, x[tokens], flat_w[pairs]))
        return out
