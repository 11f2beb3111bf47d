"""Per-operation cost models of the simulator: hardware profiles and the one functional form they share.

Every compute operation costs

    t = overhead_s + items * per_item_s + max( sum_c flops_c / rate_c * (n + n_half) / n ,  bytes / bytes_per_s )

* ``flops_c``: the operation's floating-point (or integer) operations of class
  ``c`` ("gemm": the weight matrices; "core": attention's query-key and
  probability-value products), computed from the model shapes (below);
* ``rate_c``: the achieved rate of that class at large sizes, either a fitted
  number (``local`` profile) or a published peak times a stated efficiency
  (cluster profiles), so ``rate = peak * eff_max``;
* ``items``: the chunks of an attention call, the sequences of a head call, else 1;
  ``per_item_s`` (default 0) models per-chunk / per-sequence calls (the CPU
  runtime calls ``attention_stage`` per chunk; a GPU runs one varlen kernel);
* ``(n + n_half) / n`` with ``n`` the rows (tokens) of the call: the efficiency
  curve ``eff(n) = eff_max * n / (n + n_half)``. Small calls fill the matrix
  units' tiles poorly; ``n_half`` is the row count at which half of
  ``eff_max`` is reached;
* ``bytes``: weights read (once per call, whatever the row count) plus
  activation traffic; ``bytes_per_s``: achieved memory bandwidth. The max() is
  the roofline: a call is bound by compute or by memory, whichever is slower.
  A rate of ``null`` in a profile drops that term.

Transfers cost ``latency_s + rows * per_row_s + bytes / bytes_per_s`` (one-sided
dispatch/combine to one peer, mailbox messages), and collectives
``latency_s + latency_per_rank_s * (ranks - 1) + bytes / bytes_per_s`` where a
two-level topology (``ranks_per_node``) sends the off-node share of the bytes
over the slower inter-node link in parallel with the on-node share.

Work of each operation (``H`` hidden, ``T`` new tokens of a chunk, ``C`` its
cached tokens, ``S = C + T``, ``nH`` heads, ``qk = qk_nope + qk_rope``, ``c``
kv_lora_rank, ``r`` qk_rope, ``v`` v_head, ``E`` routed experts, ``I`` a width,
``w``/``a`` weight/activation bytes per value)::

    attention  gemm  2*T*(Pq + H*(c+r) + nH*v*H) + 2*S*c*nH*(qk_nope+v)     (kv_b expands every cached latent)
               core  2*P*nH*(qk + v),  P = T*C + T*(T+1)/2 query-key pairs (causal)
               bytes (Pq + H*(c+r) + c*nH*(qk_nope+v) + nH*v*H)*w  +  sum over chunks of S*(c+r)*a + 4*T*H*a
               Pq = H*q_lora + q_lora*nH*qk, or H*nH*qk without q_lora
    router     gemm 2*T*H*E;              bytes E*H*w + T*H*a
    swiglu(I)  gemm 2*T*3*H*I;            bytes 3*H*I*w + 2*T*H*a   (expert: I = moe_inter; shared:
                                                                     n_shared*moe_inter; dense: dense_inter)
    embed      no flops;                  bytes T*H*(w + a)
    head       gemm 2*n*H*V;              bytes V*H*w + n*(H + V)*a  (n finished sequences, last token each)

Parallel attention groups (the baseline's DP groups and ASAP's attention
ranks may be groups of ``t`` devices; ``tp``/``cp`` arguments below)::

    tensor parallelism (t devices, heads split; as SGLang / vLLM run MLA):
        per device: q_a and kv_a down-projections replicated (2*T*(H*q_lora + H*(c+r)), every device),
                    q_b / q (without q_lora), kv_b, o_proj and the core split by heads (/ t);
                    bytes: the split weights / t, the replicated ones whole, the KV latents S*(c+r)*a whole
                    (one latent serves every head), activations whole;
        the compute and memory terms are divided by tp_eff(t) = eff_per_doubling ** log2(t)
        (profile "parallel" block, with its source; absent: 1.0);
        router, shared experts and dense MLP run data-parallel inside the group on ceil(T/t) tokens
        per device (the simulator asks for them at that size), so they need no factor;
        per layer: reduce-scatter of the attention output + all-gather before the next attention,
        :meth:`CostModel.tp_all_reduce_s`: 2 * (latency_s + latency_per_rank_s*(t-1))
                                           + 2*(t-1)/t * T*H*a / bytes_per_s   (ring, on-node link)
    context parallelism (a chunk shared by g groups, zig-zag halves so causal work is balanced):
        per group: T/g of the queries against all S keys: projections and gemm on T/g tokens,
                   kv_b expanded for all S latents (every group needs every key), P/g query-key pairs;
        per layer: the KV latents the group does not hold, all-gathered (ring attention's exchange,
                   charged without overlap, an upper bound), :meth:`CostModel.cp_exchange_s`:
                   latency_s + latency_per_rank_s*(g-1) + (g-1)/g * S*(c+r)*a / bytes_per_s
                   (collective link; inter-node when g*t devices span more than a node)

A dispatched row carries ``H * dispatch_bytes + 8 * top_k`` bytes (hidden state
plus int32 expert id and float32 weight per choice); a combined row ``H *
combine_bytes``. ``dispatch_bytes`` may include quantisation scales (1.03125 =
FP8 plus one float32 scale per 128 channels).

The hardware profiles (their JSON format, parsing and validation) are
``hardware.py``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

# the profiles live in hardware.py; COMPUTE_OPS, RUNTIME_FACTORS, known_profiles ... are still imported from here
from .hardware import Profile, _runtime_factors
from .shapes import ModelShapes

__all__ = ["CostModel"]


# ---------------------------------------------------------------------------------------------- work
def _check_count(fn: str, name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numbers
            if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                v = int(v)
            else:
                raise TypeError
        except TypeError:
            raise TypeError(f"{fn}: {name} must be an int, got {v!r} ({type(v).__name__})") from None
    if v < 0:
        raise ValueError(f"{fn}: {name}={v} must be >= 0")
    return v


class CostModel:
    """Seconds per operation of one rank, for one model on one hardware profile."""

    def __init__(self, profile: Profile, shapes: ModelShapes) -> None:
        if not isinstance(profile, Profile):
            raise TypeError(f"CostModel: profile must be a Profile, got {type(profile).__name__}")
        if not isinstance(shapes, ModelShapes):
            raise TypeError(f"CostModel: shapes must be a ModelShapes, got {type(shapes).__name__}")
        self.profile, self.shapes = profile, shapes
        self.name = profile.name
        self.cores = profile.cores
        self.runtime = _runtime_factors(profile)
        s, dt = shapes, profile.dtype
        self.w, self.a = dt["weight_bytes"], dt["activation_bytes"]
        H = s.hidden
        qk = s.qk_nope + s.qk_rope
        self.q_params = H * s.heads * qk if s.q_lora_rank is None else H * s.q_lora_rank + s.q_lora_rank * s.heads * qk
        self.kva_params = H * (s.kv_lora_rank + s.qk_rope)
        self.kvb_params = s.kv_lora_rank * s.heads * (s.qk_nope + s.v_head)
        self.o_params = s.heads * s.v_head * H
        self.attn_params = self.q_params + self.kva_params + self.kvb_params + self.o_params
        self.expert_params = 3 * H * s.moe_inter
        self.shared_params = 3 * H * s.moe_inter * s.n_shared
        self.dense_params = 3 * H * s.dense_inter
        self.dispatch_row_bytes = H * dt["dispatch_bytes"] + 8 * s.top_k
        self.combine_row_bytes = H * dt["combine_bytes"]

    @classmethod
    def load(cls, profile: "str | Path", model: "str | Path") -> "CostModel":
        """``CostModel(Profile.load(profile), ModelShapes.load(model))``."""
        return cls(Profile.load(profile), ModelShapes.load(model))

    # ------------------------------------------------------------------ work (flops by class, bytes)
    def attention_work(self, chunks: Sequence, tp: int = 1) -> tuple[float, dict, float]:
        """(new tokens, flops by class, bytes) of one attention stage over ``chunks`` on ONE device.

        ``chunks``: ``[(new, cached), ...]`` or ``(new, cached, cp)`` where ``cp`` groups share the chunk
        (this device's group computes ``new / cp`` of its queries; see the module docstring).
        ``tp``: the devices of the tensor-parallel group (heads split, down-projections replicated).
        With ``tp=1`` and no ``cp`` the work of the whole stage, as before.
        """
        s, a = self.shapes, self.a
        qk = s.qk_nope + s.qk_rope
        # replicated: the low-rank down-projections (q_a, kv_a); split by heads: q_b (or q), kv_b, o_proj, core
        q_down = 0 if s.q_lora_rank is None else s.hidden * s.q_lora_rank
        rep = q_down + self.kva_params
        split = (self.q_params - q_down + self.o_params) / tp
        tokens, gemm, core, nbytes = 0.0, 0.0, 0.0, 0.0
        for c in chunks:
            T, C = c[0], c[1]
            g = c[2] if len(c) > 2 else 1
            S = T + C
            Tq = T / g if g > 1 else T  # this group's share of the queries
            tokens += Tq
            gemm += 2.0 * Tq * (rep + split) + 2.0 * S * self.kvb_params / tp
            pairs = (T * C + T * (T + 1) / 2) / g
            core += 2.0 * pairs * s.heads * (qk + s.v_head) / tp
            nbytes += S * (s.kv_lora_rank + s.qk_rope) * a + 4.0 * Tq * s.hidden * a
        nbytes += (rep + (self.attn_params - rep) / tp) * self.w
        if tokens == int(tokens):
            tokens = int(tokens)
        return tokens, {"gemm": gemm, "core": core}, nbytes

    def tp_eff(self, tp: int) -> float:
        """Kernel efficiency of a ``tp``-way shard relative to one device: ``eff_per_doubling ** log2(tp)``
        (the profile's ``parallel.tp_eff_per_doubling``, 1.0 if absent)."""
        t = self._tp("tp_eff", tp)
        return self.profile.tp_eff_per_doubling ** math.log2(t) if t > 1 else 1.0

    def _tp(self, fn: str, tp) -> int:
        t = _check_count(fn, "tp", tp)
        if t < 1:
            raise ValueError(f"{fn}: tp={t} must be >= 1")
        if self.shapes.heads % t:
            raise ValueError(f"{fn}: tp={t} must divide the {self.shapes.heads} attention heads")
        return t

    def _swiglu_work(self, n: int, params: int) -> tuple[dict, float]:
        return {"gemm": 2.0 * n * params}, params * self.w + 2.0 * n * self.shapes.hidden * self.a

    # ------------------------------------------------------------------ compute ops
    def attention_s(self, chunks: Sequence, *, tp: int = 1) -> float:
        """One layer's attention stage (norms, MLA projections, causal attention, o_proj) for one micro-batch.

        ``chunks``: a sequence of ``(new_tokens, cached_tokens)``, one per request chunk, or
        ``(new_tokens, cached_tokens, cp)`` for a chunk that ``cp`` groups share by context parallelism
        (the time of one group's share). ``tp``: the micro-batch runs on a tensor-parallel group of ``tp``
        devices; the time of one device (all run in parallel), without the group's all-reduces
        (:meth:`tp_all_reduce_s`) or the CP exchange (:meth:`cp_exchange_s`).
        """
        t = self._tp("attention_s", tp)
        checked = self._chunks("attention_s", chunks)
        n, flops, nbytes = self.attention_work(checked, t)
        return self.profile.ops["attention"].time(n, flops, nbytes, items=sum(1 for c in checked if c[0]),
                                                  eff=self.tp_eff(t))

    @staticmethod
    def _chunks(fn: str, chunks) -> list:
        try:
            items = [tuple(c) for c in chunks]
        except TypeError:
            raise TypeError(f"{fn}: chunks must be a sequence of (new_tokens, cached_tokens) pairs, "
                            f"got {chunks!r}") from None
        checked = []
        for i, c in enumerate(items):
            if len(c) not in (2, 3):
                raise ValueError(f"{fn}: chunk {i} = {c!r} must be a (new_tokens, cached_tokens) pair "
                                 "or a (new_tokens, cached_tokens, cp) triple")
            one = (_check_count(fn, f"chunk {i} new_tokens", c[0]), _check_count(fn, f"chunk {i} cached_tokens", c[1]))
            if len(c) == 3:
                g = _check_count(fn, f"chunk {i} cp", c[2])
                if g < 1:
                    raise ValueError(f"{fn}: chunk {i} cp={g} must be >= 1")
                one += (g,)
            checked.append(one)
        return checked

    def router_s(self, tokens: int) -> float:
        n = _check_count("router_s", "tokens", tokens)
        s = self.shapes
        return self.profile.ops["router"].time(n, {"gemm": 2.0 * n * s.hidden * s.num_experts},
                                               s.num_experts * s.hidden * self.w + n * s.hidden * self.a)

    def shared_experts_s(self, tokens: int) -> float:
        n = _check_count("shared_experts_s", "tokens", tokens)
        if self.shapes.n_shared == 0:
            return 0.0
        return self.profile.ops["shared_experts"].time(n, *self._swiglu_work(n, self.shared_params))

    def dense_mlp_s(self, tokens: int) -> float:
        n = _check_count("dense_mlp_s", "tokens", tokens)
        return self.profile.ops["dense_mlp"].time(n, *self._swiglu_work(n, self.dense_params))

    def embed_s(self, tokens: int) -> float:
        n = _check_count("embed_s", "tokens", tokens)
        return self.profile.ops["embed"].time(n, {}, n * self.shapes.hidden * (self.w + self.a))

    def head_s(self, num_sequences: int) -> float:
        """Final norm + LM head on the last token of each of ``num_sequences`` finished requests."""
        n = _check_count("head_s", "num_sequences", num_sequences)
        s = self.shapes
        return self.profile.ops["head"].time(n, {"gemm": 2.0 * n * s.hidden * s.vocab},
                                             s.vocab * s.hidden * self.w + n * (s.hidden + s.vocab) * self.a, items=n)

    def expert_s(self, rows: int) -> float:
        """One routed expert's SwiGLU on ``rows`` rows (0 rows: 0)."""
        n = _check_count("expert_s", "rows", rows)
        return self.profile.ops["expert"].time(n, *self._swiglu_work(n, self.expert_params))

    def experts_s(self, rows_per_expert: Sequence[int]) -> float:
        """One expert rank computing its local experts one after another for one batch."""
        try:
            rows = [_check_count("experts_s", f"rows_per_expert[{i}]", r) for i, r in enumerate(rows_per_expert)]
        except TypeError as e:
            if "rows_per_expert[" in str(e):
                raise
            raise TypeError(f"experts_s: rows_per_expert must be a sequence of ints, got {rows_per_expert!r}") from None
        if not any(rows):
            return 0.0
        return sum(self.expert_s(r) for r in rows if r) + self.profile.experts_batch_overhead_s

    # ------------------------------------------------------------------ communication
    def _p2p(self, fn: str, rows, row_bytes: float) -> float:
        n = _check_count(fn, "rows", rows)
        if n == 0:
            return 0.0  # that expert rank is not contacted
        p = self.profile.p2p
        return p["latency_s"] + n * p["per_row_s"] + n * row_bytes * p["s_per_byte"]

    def dispatch_s(self, rows: int) -> float:
        """One-sided transfer of ``rows`` routed rows (hidden + routing metadata) from an attention rank to ONE
        expert rank, packing included; 0 rows: 0 (not contacted)."""
        return self._p2p("dispatch_s", rows, self.dispatch_row_bytes)

    def combine_s(self, rows: int) -> float:
        """The return of ``rows`` weighted rows from ONE expert rank to an attention rank; 0 rows: 0."""
        return self._p2p("combine_s", rows, self.combine_row_bytes)

    def all_to_all_s(self, max_rows_per_rank: int, ranks: int, *, combine: bool = False) -> float:
        """One dispatch (``combine=True``: combine, with the combine row bytes) all_to_all of the synchronous
        baseline among ``ranks`` ranks, the busiest sending or receiving ``max_rows_per_rank`` rows in all (to or
        from all its peers together). 1 rank: 0 (no peer)."""
        rows = _check_count("all_to_all_s", "max_rows_per_rank", max_rows_per_rank)
        r = _check_count("all_to_all_s", "ranks", ranks)
        if r < 1:
            raise ValueError(f"all_to_all_s: ranks={r} must be >= 1")
        if r == 1:
            return 0.0
        c = self.profile.collective
        nbytes = rows * (self.combine_row_bytes if combine else self.dispatch_row_bytes)
        rpn = c["ranks_per_node"]
        if rpn is None or r <= rpn:
            wire = nbytes * c["s_per_byte"]
        else:  # peers spread evenly: (rpn-1)/(r-1) of them on-node, the rest over the inter-node link
            on = (rpn - 1) / (r - 1)
            wire = max(nbytes * on * c["s_per_byte"], nbytes * (1 - on) * c["inter_s_per_byte"])
        return c["latency_s"] + c["latency_per_rank_s"] * (r - 1) + wire

    def _link_s_per_byte(self, devices: int) -> float:
        """Seconds per byte of a collective among ``devices`` devices: on-node link, or the inter-node one when
        a two-level profile's node is smaller than the group (the ring then crosses nodes)."""
        c = self.profile.collective
        rpn = c["ranks_per_node"]
        return c["s_per_byte"] if rpn is None or devices <= rpn else c["inter_s_per_byte"]

    def tp_all_reduce_s(self, tokens: int, tp: int) -> float:
        """Per layer, a tensor-parallel group of ``tp`` devices holding ``tokens`` tokens: the reduce-scatter of
        the attention output and the all-gather before the next attention (ring: together the bytes of one
        all_reduce of ``tokens * hidden * activation_bytes``; the all_reduce link's latencies twice, the
        collective link's bandwidth). 1 device or 0 tokens: 0."""
        n = _check_count("tp_all_reduce_s", "tokens", tokens)
        t = self._tp("tp_all_reduce_s", tp)
        if t == 1 or n == 0:
            return 0.0
        ar = self.profile.all_reduce
        nbytes = n * self.shapes.hidden * self.a
        return (2 * (ar["latency_s"] + ar["latency_per_rank_s"] * (t - 1))
                + 2 * (t - 1) / t * nbytes * self._link_s_per_byte(t))

    def cp_exchange_s(self, new_tokens: int, cached_tokens: int, cp: int, tp: int = 1) -> float:
        """Per layer, context parallelism over ``cp`` groups (of ``tp`` devices each) of a chunk of ``new_tokens``
        after ``cached_tokens``: every device gathers the KV latents of the ``S = new + cached`` tokens that its
        group does not hold, ``(cp-1)/cp * S * (kv_lora_rank + qk_rope) * activation_bytes`` (an all-gather /
        ring-attention pass; charged without overlap with compute: an upper bound). 1 group: 0."""
        T = _check_count("cp_exchange_s", "new_tokens", new_tokens)
        C = _check_count("cp_exchange_s", "cached_tokens", cached_tokens)
        g = _check_count("cp_exchange_s", "cp", cp)
        t = self._tp("cp_exchange_s", tp)
        if g < 1:
            raise ValueError(f"cp_exchange_s: cp={g} must be >= 1")
        if g == 1 or T == 0:
            return 0.0
        c, s = self.profile.collective, self.shapes
        nbytes = (g - 1) / g * (T + C) * (s.kv_lora_rank + s.qk_rope) * self.a
        return c["latency_s"] + c["latency_per_rank_s"] * (g - 1) + nbytes * self._link_s_per_byte(g * t)

    def all_reduce_s(self, ranks: int) -> float:
        """The small per-step all_reduce (two int64 flags) among ``ranks`` ranks. 1 rank: 0."""
        r = _check_count("all_reduce_s", "ranks", ranks)
        if r < 1:
            raise ValueError(f"all_reduce_s: ranks={r} must be >= 1")
        if r == 1:
            return 0.0
        ar = self.profile.all_reduce
        return ar["latency_s"] + ar["latency_per_rank_s"] * (r - 1)

    def message_s(self, nbytes: int) -> float:
        """A front-end <-> attention-rank mailbox message of ``nbytes`` bytes."""
        n = _check_count("message_s", "nbytes", nbytes)
        m = self.profile.message
        return m["latency_s"] + n * m["s_per_byte"]

    # ------------------------------------------------------------------ the placer's weight
    def placer_linear_weight(self, tp: int = 1) -> float:
        """The placer's ``linear_weight`` (``serving.policies.attention_cost``) for this model on this profile:
        the per-token time of the linear work of a prompt token, averaged over the model's layers (attention
        projections and the kv_b expansion of the token's own latent; router + shared experts on a MoE layer,
        the dense MLP on a dense one), divided by the time of one query-key pair of the causal core (both on
        one device of a ``tp``-way attention group, at the compute-bound rates: large calls, where the
        placement matters). Routed experts run elsewhere (ASAP) or scale like the linear work, so they are
        left out, as in the default of 512."""
        t = self._tp("placer_linear_weight", tp)
        s, ops = self.shapes, self.profile.ops
        qk = s.qk_nope + s.qk_rope
        q_down = 0 if s.q_lora_rank is None else s.hidden * s.q_lora_rank
        rep = q_down + self.kva_params
        split = (self.q_params - q_down + self.o_params + self.kvb_params) / t

        def per_flop(op: str, cls: str = "gemm") -> float:
            return ops[op].s_per_flop.get(cls, 0.0)

        attn = 2.0 * (rep + split) * per_flop("attention")
        pair = 2.0 * s.heads * (qk + s.v_head) / t * per_flop("attention", "core")
        if not pair > 0:
            raise ValueError(f"placer_linear_weight: profile {self.name!r} has no rate for attention's core flops")
        moe = sum(1 for m in s.moe_layers if m)
        dense = len(s.moe_layers) - moe
        # router, shared experts and dense MLP run data-parallel in the group: 1/t of the tokens per device
        mlp_moe = (2.0 * s.hidden * s.num_experts * per_flop("router")
                   + (2.0 * self.shared_params * per_flop("shared_experts") if s.n_shared else 0.0)) / t
        mlp_dense = 2.0 * self.dense_params * per_flop("dense_mlp") / t
        mlp = (moe * mlp_moe + dense * mlp_dense) / max(1, moe + dense)
        return (attn + mlp) / pair

    # ------------------------------------------------------------------ summary
    def describe(self) -> dict:
        """Every derived coefficient (rates in units per second), for summary.json."""
        p = self.profile

        def rate(s):
            return 1.0 / s if s else None

        return {
            "profile": p.name, "path": p.path, "description": p.data.get("description"), "rank": p.data.get("rank"),
            "model": self.shapes.name, "cores": self.cores,
            "dtype": dict(p.dtype),
            "ops": {op: c.describe() for op, c in p.ops.items()},
            "experts_batch_overhead_s": p.experts_batch_overhead_s,
            "links": {
                "p2p": {"latency_s": p.p2p["latency_s"], "per_row_s": p.p2p["per_row_s"],
                        "bytes_per_s": rate(p.p2p["s_per_byte"])},
                "message": {"latency_s": p.message["latency_s"], "bytes_per_s": rate(p.message["s_per_byte"])},
                "collective": {"latency_s": p.collective["latency_s"],
                               "latency_per_rank_s": p.collective["latency_per_rank_s"],
                               "bytes_per_s": rate(p.collective["s_per_byte"]),
                               "inter_bytes_per_s": rate(p.collective["inter_s_per_byte"]),
                               "ranks_per_node": p.collective["ranks_per_node"]},
                "all_reduce": dict(p.all_reduce)},
            "parallel": {"tp_eff_per_doubling": p.tp_eff_per_doubling,
                         "source": (p.data.get("parallel") or {}).get("source")},
            "row_bytes": {"dispatch": self.dispatch_row_bytes, "combine": self.combine_row_bytes},
            "params": {"attention": self.attn_params, "expert": self.expert_params, "shared": self.shared_params,
                       "dense": self.dense_params},
            "fit": p.data.get("fit"),
        }
