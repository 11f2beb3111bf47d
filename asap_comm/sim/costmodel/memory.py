"""Per-die memory of a deployment: does the model fit on the dies it is given?

A deployment is feasible when every die's weights, KV cache, activations and
symmetric buffers fit in the usable part of its HBM. Sizes come from the model
shapes (``ModelShapes``) and the profile's dtypes, the same ones the cost model
uses (``costs.py``), and the die's memory from the profile's ``memory`` block::

    "memory": {"hbm_gb": 64, "usable_fraction": 0.9, "source": "..."}

(a profile without it is "unknown": nothing is checked, and the table says so).

**What each die holds** (``w``: weight bytes, ``a``: activation bytes; ``hp = max(w, a)``:
embedding, LM head and router gates stay in high precision, as W8A8 schemes keep them)

* an ASAP attention die, one of the ``t`` devices of a tensor-parallel group: the MLA
  weights of every layer as the cost model runs them (q_a and kv_a down-projections whole
  on every device; q_b, kv_b and o_proj split by heads, ``/ t``); the dense layers'
  MLPs, the shared experts and the router gates whole (the cost model runs them
  data-parallel inside the group, on ``T / t`` tokens per device); embedding and LM head
  split by vocabulary (``/ t``, vocab-parallel as vLLM and SGLang shard them);
* an ASAP expert die: its share of the routed experts of every MoE layer, ``ceil(N / E)``
  experts (the fullest die);
* a baseline die (DP group of ``t`` devices, EP over all ``W * t``): what an attention
  die holds plus ``ceil(N / (W * t))`` routed experts per MoE layer.

**KV cache.** Prefill keeps a request's KV until its prompt is done. Assumed in flight on
one attention group: one prompt of ``max_prompt_len`` tokens being chunked plus ``S``
micro-batches of ``T`` new tokens (``T = max(token_budget, chunk)``, ``S = 2`` with
ping-pong or the baseline's overlap, else 1, plus 1 with the HTTP service's urgent slot); queued requests hold no KV. Per token
``(kv_lora_rank + qk_rope) * a * layers`` bytes (the MLA latent), whole on every device of
a group (one latent serves every head; TP does not split it).

**Activations** of the ``S`` micro-batches in flight, per device: hidden-sized tensors
(residual, normed input, attention output, MLP output: ``4 H``) and the device's heads'
q, expanded k and v and output (``heads / t * (qk + qk_nope + 2 v)``) per token, plus the
MLP intermediate (``3 * max(dense_inter, n_shared * moe_inter)``) on ``T / t`` tokens.
The expansion of the *cached* context's keys (kv_b over every cached latent) is taken as
a bounded workspace, as vLLM's chunked MLA prefill does, and is not counted. An expert
die: the rows of one batch (``expert_token_budget``, or one micro-batch's ``T * top_k / E``
if more), at most its expected rows from every in-flight micro-batch (``A * S * T * top_k /
E``, balanced routing), with a headroom of 2 for hot experts, ``(2 H + 3 moe_inter) * a``
bytes per row. A baseline die: ``T * top_k / t`` received rows likewise.

**Symmetric buffers.** ASAP: the runtime's layout (``asap_comm.moe.plan._Buffers``): every
PE of the group allocates the dispatch area ``A * S * T`` rows of ``H * dispatch_bytes +
8 top_k`` bytes and the combine area ``S * T * min(top_k, E)`` rows of ``H *
combine_bytes``. Baseline: send and receive buffers of the all_to_all,
``2 * (T / t) * top_k`` rows of dispatch plus combine bytes (as DeepEP sizes them).

**Usable fraction.** ``usable_fraction`` of the HBM is what the serving engine may take
(vLLM's default ``gpu_memory_utilization`` is 0.9); the rest is the runtime's and the
driver's (communication libraries' workspaces, fragmentation).

``python -m asap_comm.sim memory --profile P --model M [deployment flags]`` prints the table.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .hardware import Profile
from .shapes import ModelShapes

__all__ = ["DieMemory", "HBM", "profile_hbm", "weight_params", "deployment_memory", "memory_of", "memory_problems",
           "fitting_lane_tokens", "LANE_POOL_PROMPTS", "deployment_problems", "headline_memory",
           "check_expert_devices", "memory_table", "memory_markdown", "reference_markdown", "refusal", "with_weights",
           "WEIGHT_DTYPES", "main"]

GB = 1e9
WEIGHT_DTYPES = ("bf16", "int8")
EXPERT_HEADROOM = 2.0  # expert-die activation rows: the balanced expectation times this (hot experts)


@dataclass(frozen=True)
class HBM:
    """A die's memory: ``hbm_gb`` in all, ``usable_fraction`` of it for the serving engine."""

    hbm_gb: float
    usable_fraction: float
    source: str = ""

    @property
    def usable_gb(self) -> float:
        return self.hbm_gb * self.usable_fraction


def profile_hbm(profile: Profile) -> "HBM | None":
    """The profile's ``memory`` block, or None when it has none (memory unknown: not checked)."""
    block = profile.data.get("memory")
    if block is None:
        return None
    where = f"Profile {profile.path}: field 'memory"
    if not isinstance(block, dict):
        raise ValueError(f"{where}' must be an object")
    hbm = block.get("hbm_gb")
    if isinstance(hbm, bool) or not isinstance(hbm, (int, float)) or not hbm > 0 or not math.isfinite(hbm):
        raise ValueError(f"{where}.hbm_gb'={hbm!r} must be a number > 0")
    frac = block.get("usable_fraction", 1.0)
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise ValueError(f"{where}.usable_fraction'={frac!r} must be a number in (0, 1]")
    return HBM(float(hbm), float(frac), str(block.get("source", "")))


@dataclass(frozen=True)
class DieMemory:
    """One role's die: ``dies`` of them, each needing ``breakdown`` (GB) against ``hbm`` (None: unknown)."""

    role: str
    dies: int
    breakdown: dict = field(default_factory=dict)
    hbm: "HBM | None" = None

    @property
    def needed_gb(self) -> float:
        return sum(self.breakdown.values())

    @property
    def have_gb(self) -> "float | None":
        return None if self.hbm is None else self.hbm.usable_gb

    @property
    def feasible(self) -> bool:
        return self.hbm is None or self.needed_gb <= self.hbm.usable_gb

    def describe(self) -> dict:
        return {"role": self.role, "dies": self.dies, "needed_gb": round(self.needed_gb, 3),
                "have_gb": None if self.hbm is None else round(self.hbm.usable_gb, 3),
                "hbm_gb": None if self.hbm is None else self.hbm.hbm_gb, "feasible": self.feasible,
                "breakdown_gb": {k: round(v, 3) for k, v in self.breakdown.items()}}

    def problem(self, profile_name: str) -> str:
        """One line: what this die needs, of what, and what it has."""
        top = sorted(self.breakdown.items(), key=lambda kv: -kv[1])
        parts = " + ".join(f"{k} {v:.1f}" for k, v in top if v >= 0.05)
        return (f"memory: {_article(self.role)} {self.role} die needs {self.needed_gb:.1f} GB ({parts}) but "
                f"{profile_name} dies have {self.hbm.usable_gb:.1f} GB usable ({self.hbm.hbm_gb:g} GB HBM x "
                f"{self.hbm.usable_fraction:g})")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def weight_params(shapes: ModelShapes) -> dict:
    """Parameter counts of the model by part (all layers): ``attention_replicated`` (q_a, kv_a),
    ``attention_split`` (q_b or q, kv_b, o_proj), ``router``, ``shared``, ``dense``, ``routed`` (every
    routed expert of every MoE layer), ``routed_per_expert_layer``, ``embed``, ``head``."""
    s = shapes
    H, qk = s.hidden, s.qk_nope + s.qk_rope
    q_down = 0 if s.q_lora_rank is None else H * s.q_lora_rank
    q_up = H * s.heads * qk if s.q_lora_rank is None else s.q_lora_rank * s.heads * qk
    kva = H * (s.kv_lora_rank + s.qk_rope)
    kvb = s.kv_lora_rank * s.heads * (s.qk_nope + s.v_head)
    o = s.heads * s.v_head * H
    L, M = s.num_layers, s.num_moe_layers
    per_expert = 3 * H * s.moe_inter
    return {"attention_replicated": L * (q_down + kva), "attention_split": L * (q_up + kvb + o),
            "router": M * s.num_experts * H, "shared": M * s.n_shared * per_expert,
            "dense": (L - M) * 3 * H * s.dense_inter, "routed": M * s.num_experts * per_expert,
            "routed_per_expert_layer": per_expert, "embed": s.vocab * H, "head": s.vocab * H}


def _bytes(profile: Profile) -> tuple:
    dt = profile.dtype
    w, a = dt["weight_bytes"], dt["activation_bytes"]
    return w, a, max(w, a), dt["dispatch_bytes"], dt["combine_bytes"]


def _attention_side(profile: Profile, shapes: ModelShapes, t: int, T: int, S: int, max_prompt_len: int) -> dict:
    """GB per device of a t-way attention group (weights, KV cache, activations), without expert weights."""
    s, P = shapes, weight_params(shapes)
    w, a, hp, _, _ = _bytes(profile)
    qk = s.qk_nope + s.qk_rope
    weights = (P["attention_replicated"] + P["attention_split"] / t) * w
    kv_tokens = max_prompt_len + S * T
    per_token_act = 4 * s.hidden + s.heads / t * (qk + s.qk_nope + 2 * s.v_head)
    mlp_inter = 3 * max(s.dense_inter if s.num_layers > s.num_moe_layers else 0, s.n_shared * s.moe_inter)
    act = S * a * (T * per_token_act + math.ceil(T / t) * mlp_inter)
    return {"attention weights": weights / GB,
            "dense MLP + shared experts + router": ((P["dense"] + P["shared"]) * w + P["router"] * hp) / GB,
            "embedding + head": (P["embed"] + P["head"]) * hp / t / GB,
            "KV cache": kv_tokens * (s.kv_lora_rank + s.qk_rope) * a * s.num_layers / GB,
            "activations": act / GB}


def _expert_rows_act(shapes: ModelShapes, a: float, rows: float) -> float:
    return rows * (2 * shapes.hidden + 3 * shapes.moe_inter) * a / GB


def deployment_memory(mode: str, profile: Profile, shapes: ModelShapes, *, attention_ranks: int = 1,
                      attention_tp: int = 1, expert_ranks: int = 1, sync_ranks: int = 1, sync_tp: int = 1,
                      token_budget: int, chunk_len: "int | None", max_prompt_len: int,
                      ping_pong: bool = True, sync_overlap: bool = False,
                      expert_token_budget: "int | None" = None, long_prompt_lane: bool = False,
                      lane_tokens: "int | None" = None, urgent_slot: bool = False) -> list:
    """The dies of one deployment, one :class:`DieMemory` per role.

    ``mode="async"`` (ASAP): ``attention_ranks`` groups of ``attention_tp`` devices and ``expert_ranks`` expert
    dies; ``mode="sync"`` (baseline): ``sync_ranks`` DP groups of ``sync_tp`` devices, EP over all of them.
    ``token_budget``/``chunk_len``/``max_prompt_len``: the runtime's, in the modelled model's tokens;
    ``expert_token_budget``: the rows an expert die computes in one batch (None: every in-flight row at once).
    ``long_prompt_lane`` (ASAP with at least 2 attention groups): a group also holds the KV latents other groups'
    lane prompts put into it, in a pool of ``lane_tokens`` rows per layer (None: ``max_prompt_len``; the runtime's
    ``RuntimeConfig.lane_tokens``: the lanes in flight hold at most that many prompt tokens together, and a prompt
    waits for room, so the pool bounds what a die holds however many lanes share it).
    """
    for nm, v in (("attention_ranks", attention_ranks), ("attention_tp", attention_tp),
                  ("expert_ranks", expert_ranks), ("sync_ranks", sync_ranks), ("sync_tp", sync_tp),
                  ("token_budget", token_budget), ("max_prompt_len", max_prompt_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"deployment_memory: {nm}={v!r} must be an int >= 1")
    s, P = shapes, weight_params(shapes)
    w, a, _, d_bytes, c_bytes = _bytes(profile)
    hbm = profile_hbm(profile)
    T = max(token_budget, min(chunk_len, max_prompt_len) if chunk_len else max_prompt_len)
    H, k = s.hidden, s.top_k
    expert_layer_gb = P["routed_per_expert_layer"] * s.num_moe_layers * w / GB
    if mode == "async":
        A, t, E, S = attention_ranks, attention_tp, expert_ranks, (2 if ping_pong else 1) + int(urgent_slot)
        buffers = (A * S * T * (H * d_bytes + 8 * k) + S * T * min(k, E) * H * c_bytes) / GB
        att = _attention_side(profile, s, t, T, S, max_prompt_len)
        att["symmetric buffers"] = buffers
        if long_prompt_lane and A >= 2:
            rows = max_prompt_len if lane_tokens is None else lane_tokens
            att["lane KV (received)"] = rows * (s.kv_lora_rank + s.qk_rope) * a * s.num_layers / GB
        rows = min(A * S * T * min(k, math.ceil(s.num_experts / E)), EXPERT_HEADROOM * A * S * T * k / E)
        if expert_token_budget:  # one batch at a time: the budget, or one micro-batch's rows if more
            rows = min(rows, max(expert_token_budget, EXPERT_HEADROOM * T * k / E))
        exp = {"routed experts": math.ceil(s.num_experts / E) * expert_layer_gb,
               "activations": _expert_rows_act(s, a, rows), "symmetric buffers": buffers}
        return [DieMemory("attention", A * t, att, hbm), DieMemory("expert", E, exp, hbm)]
    if mode == "sync":
        W, t, S = sync_ranks, sync_tp, 2 if sync_overlap else 1
        dies = W * t
        side = _attention_side(profile, s, t, T, S, max_prompt_len)
        rows = EXPERT_HEADROOM * S * T * k / t
        side["routed experts"] = math.ceil(s.num_experts / dies) * expert_layer_gb
        side["activations"] += _expert_rows_act(s, a, rows)
        side["all_to_all buffers"] = 2 * S * math.ceil(T / t) * k * (H * (d_bytes + c_bytes) + 8 * k) / GB
        return [DieMemory("baseline", dies, side, hbm)]
    raise ValueError(f"deployment_memory: mode={mode!r} must be 'async' or 'sync'")


def memory_of(mode: str, cfg, par, sync_ranks: "int | None", profile: Profile, shapes: ModelShapes) -> list:
    """:func:`deployment_memory` of a simulator deployment (a ``RuntimeConfig``, a ``Parallelism`` and the
    baseline's DP groups), as ``sim run`` and ``headline`` build them."""
    return deployment_memory(mode, profile, shapes, attention_ranks=cfg.num_attention_ranks,
                             attention_tp=par.attention_tp, expert_ranks=cfg.num_expert_ranks,
                             sync_ranks=sync_ranks or 1, sync_tp=par.sync_tp, token_budget=cfg.token_budget,
                             chunk_len=cfg.effective_chunk_len, max_prompt_len=cfg.max_prompt_len,
                             ping_pong=cfg.ping_pong, sync_overlap=par.sync_overlap,
                             expert_token_budget=cfg.expert_token_budget,
                             long_prompt_lane=cfg.long_prompt_lane and cfg.load_aware, lane_tokens=cfg.lane_tokens,
                             urgent_slot=cfg.urgent_slot)


LANE_POOL_PROMPTS = 4  # --lane-tokens auto (sim run, examples/prefill.py): up to this many longest prompts


def fitting_lane_tokens(dies_of, max_prompt_len: int, most: int = LANE_POOL_PROMPTS) -> tuple:
    """The lane KV pool of ``--lane-tokens auto``: ``(tokens, prompts)``, the most longest prompts (``most`` down
    to 1) whose pool every attention die still holds. ``dies_of(lane_tokens)``
    returns the async deployment's dies (:func:`deployment_memory`) with that pool; only the attention dies
    are asked (the pool is theirs). With one prompt's pool too large, one prompt (the memory check then
    refuses the deployment, naming the lane).

    A bigger pool serves more long prompts at once but holds the short ones longer: four prompts starved no
    long prompt at 64 emulated dies (636 tok/s served against 377 with one) but cut the 32-die default from 1.04x
    to 0.90x, so the tools' default stays one prompt, with a wait bound (``RuntimeConfig.lane_wait_s``).
    """
    if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, int) or max_prompt_len < 1:
        raise ValueError(f"fitting_lane_tokens: max_prompt_len={max_prompt_len!r} must be an int >= 1")
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ValueError(f"fitting_lane_tokens: most={most!r} must be an int >= 1")
    for k in range(most, 0, -1):
        if all(d.feasible for d in dies_of(k * max_prompt_len) if d.role == "attention"):
            return k * max_prompt_len, k
    return max_prompt_len, 1


def memory_problems(dies: list, profile_name: str) -> list:
    """One line per role whose die does not fit (empty: feasible or unknown)."""
    return [d.problem(profile_name) for d in dies if not d.feasible]


def memory_table(dies_by_mode: dict) -> str:
    """The feasibility table: deployment, role, dies, GB per die needed vs usable."""
    lines = [f"{'deployment':10s} {'role':10s} {'dies':>5s} {'needed GB':>10s} {'have GB':>8s}  fits  breakdown (GB)"]
    for mode, dies in dies_by_mode.items():
        for d in dies:
            have = "?" if d.have_gb is None else f"{d.have_gb:.1f}"
            parts = ", ".join(f"{k} {v:.2f}" for k, v in d.breakdown.items())
            lines.append(f"{mode:10s} {d.role:10s} {d.dies:5d} {d.needed_gb:10.2f} {have:>8s}  "
                         f"{'yes' if d.feasible else 'NO ':4s}  {parts}")
    return "\n".join(lines)


def refusal(prog: str, problems: list, hint: str) -> str:
    """The one line a command prints when it refuses an infeasible deployment (the first problem)."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{prog}: {problems[0]}{more}; {hint}"


def deployment_problems(d, profile: Profile, shapes: ModelShapes) -> list:
    """:func:`memory_problems` of a ``study.Deployment`` (its mode, runtime config, parallelism, DP groups)."""
    return memory_problems(memory_of(d.mode, d.cfg, d.par, d.sync_ranks, profile, shapes), profile.name)


def headline_memory(cost, shapes: ModelShapes, syncs: list, asyncs: list, weights: "str | None" = None,
                    ignore_memory: bool = False, prog: str = "headline") -> tuple:
    """The headline's candidates through the memory check: ``(cost with --weights applied, feasible baselines,
    feasible ASAP configurations, the summary's memory record)``. With ``ignore_memory`` every candidate stays
    (recorded). No feasible candidate on a side: exits 2 with one line naming the first problem."""
    from .costs import CostModel

    cost = CostModel(with_weights(cost.profile, weights), shapes)
    dropped, kept = [], {"sync": [], "async": []}
    for d in list(syncs) + list(asyncs):
        probs = deployment_problems(d, cost.profile, shapes)
        if probs:
            dropped.append({"deployment": d.label, "mode": d.mode, "problem": probs[0]})
        if not probs or ignore_memory:
            kept[d.mode].append(d)
    for mode, what in (("sync", "baseline"), ("async", "ASAP")):
        if not kept[mode]:
            first = next(x["problem"] for x in dropped if x["mode"] == mode)
            print(f"{prog}: memory: no {what} configuration of the grid fits on {cost.name} dies (first: "
                  f"{first.removeprefix('memory: ')}); give more devices"
                  + (", --weights int8" if cost.w > 1 else "") + " or --ignore-memory",
                  file=sys.stderr)
            sys.exit(2)
    if dropped:
        print(f"[{cost.name}] memory: {len(dropped)} configuration(s) of the grid do not fit"
              + (" (kept: --ignore-memory)" if ignore_memory else " and are left out") + f"; e.g. "
              f"{dropped[0]['deployment']}: {dropped[0]['problem']}", file=sys.stderr, flush=True)
    record = {"ignore_memory": ignore_memory, "weights": weights, "weight_bytes": cost.w,
              "hbm": None if profile_hbm(cost.profile) is None else vars(profile_hbm(cost.profile)),
              "infeasible": dropped}
    return cost, kept["sync"], kept["async"], record


def check_expert_devices(cost, dies: int, who: str) -> None:
    """Raise ``ValueError`` (naming ``memory``) unless the model's routed experts, spread over ``dies`` devices,
    fit in one device's usable HBM: the least any deployment needs (the emulator's check; the caller that knows
    the whole deployment checks the rest with :func:`deployment_memory`)."""
    hbm = profile_hbm(cost.profile)
    d = deployment_memory("async", cost.profile, cost.shapes, expert_ranks=dies, token_budget=1, chunk_len=1,
                          max_prompt_len=1)[1]
    need = d.breakdown["routed experts"]
    if hbm is not None and need > hbm.usable_gb:
        raise ValueError(f"{who}: memory: {dies} devices hold {cost.shapes.name}'s routed experts at {need:.1f} GB "
                         f"each but {cost.name} devices have {hbm.usable_gb:.1f} GB usable; give more expert "
                         "devices (or do not check: --ignore-memory)")


# ---------------------------------------------------------------------------------------------- W8A8
_INT8_PEAK_KEYS = ("int8_ops_per_s", "int8_flops_per_s")
_HIGH_PEAK_KEYS = ("fp8_flops_per_s", "int8_ops_per_s", "int8_flops_per_s")


def with_weights(profile: Profile, weights: "str | None") -> Profile:
    """``profile`` with its weights in ``weights`` (``"bf16"``: 2 bytes, ``"int8"``: 1 byte; None: unchanged).

    Both the bytes (``dtype.weight_bytes``: the memory model and every weight read of the cost model) and the
    GEMM rate change: with ``int8`` every GEMM rate that names the profile's BF16 peak uses its INT8 peak
    (``hardware.int8_ops_per_s``) if it has one, else stays (an H800's FP8 peak is its INT8 peak);
    with ``bf16`` every rate naming an INT8 or FP8 peak uses ``bf16_flops_per_s``. Only GEMM classes of the
    weight-bearing ops change (attention projections, shared/dense MLPs, experts); the attention core, the
    router gate and the LM head keep their rates. Profiles of CPU ranks (``cores``) are refused: their rates
    are fitted for their own dtype.
    """
    if weights is None:
        return profile
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_DTYPES)}")
    if profile.cores is not None:
        raise ValueError(f"--weights {weights}: profile {profile.name!r} is of CPU ranks (fitted rates in its own "
                         "dtype); --weights applies to the cluster profiles")
    data = copy.deepcopy(profile.data)
    hw = data.get("hardware", {})
    data["dtype"]["weight_bytes"] = 1 if weights == "int8" else 2
    if weights == "int8":
        peak = next((k for k in _INT8_PEAK_KEYS if k in hw), None)
        old = ("bf16_flops_per_s",)
    else:
        peak = "bf16_flops_per_s" if "bf16_flops_per_s" in hw else None
        old = _HIGH_PEAK_KEYS
    if peak is not None:
        for op in ("attention", "shared_experts", "dense_mlp", "expert"):
            spec = data["ops"][op]["flops_per_s"].get("gemm")
            if isinstance(spec, dict) and spec.get("peak") in old:
                spec["peak"] = peak
    data["dtype"]["source"] = f"--weights {weights}: weight_bytes {data['dtype']['weight_bytes']}, GEMM peak " \
                              f"{peak or 'unchanged'}; was: {profile.data['dtype'].get('source', '')}"
    data["weights_override"] = weights
    return Profile(data, profile.path)


# ------------------------------------------------------------------------------------- markdown (the docs)
# The docs' reference table (``memory --reference``, docs/results/memory.md): DeepSeek-V3 on nine deployments.
REFERENCE_SETTINGS = dict(token_budget=16384, chunk_len=16384, max_prompt_len=131072, expert_token_budget=32768,
                          long_prompt_lane=True)
REFERENCE_DEPLOYMENTS = (
    ("ASAP 5×TP2 + 6 (16 dies)", "async", dict(attention_ranks=5, attention_tp=2, expert_ranks=6)),
    ("ASAP 1×TP4 + 12 (16)", "async", dict(attention_ranks=1, attention_tp=4, expert_ranks=12)),
    ("ASAP 2×TP8 + 16 (32, afd-plugin's)", "async", dict(attention_ranks=2, attention_tp=8, expert_ranks=16)),
    ("ASAP 48×1 + 16 (64, the headline's per-die reference)", "async",
     dict(attention_ranks=48, attention_tp=1, expert_ranks=16)),
    ("ASAP 8×TP4 + 32 (64)", "async", dict(attention_ranks=8, attention_tp=4, expert_ranks=32)),
    ("baseline 4×TP4, EP16 (16)", "sync", dict(sync_ranks=4, sync_tp=4)),
    ("baseline 4×TP8, EP32 (32, afd-plugin's)", "sync", dict(sync_ranks=4, sync_tp=8)),
    ("baseline 64×1, EP64 (64)", "sync", dict(sync_ranks=64, sync_tp=1)),
    ("baseline 16×TP4, EP64 (64)", "sync", dict(sync_ranks=16, sync_tp=4)))
REFERENCE_PROFILES = (("910C INT8", "ascend-910c-cm384", None), ("910C BF16", "ascend-910c-cm384", "bf16"),
                      ("H800 FP8", "h800-node", None))


def _generated(command: str) -> str:
    return f"<!-- generated by: {command}; edit the command, not this page -->\n"


def memory_markdown(dies_by_mode: dict, title: str, command: str) -> str:
    """:func:`memory_table` as a markdown page (``memory --markdown FILE``)."""
    lines = [_generated(command), f"# {title}\n", "| deployment | role | dies | needed GB | have GB | fits | breakdown (GB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, dies in dies_by_mode.items():
        for d in dies:
            have = "?" if d.have_gb is None else f"{d.have_gb:.1f}"
            parts = ", ".join(f"{k} {v:.2f}" for k, v in d.breakdown.items())
            lines.append(f"| {mode} | {d.role} | {d.dies} | {d.needed_gb:.2f} | {have} | "
                         f"{'yes' if d.feasible else '**no**'} | {parts} |")
    return "\n".join(lines) + "\n"


def reference_markdown(command: str, model: str = "deepseek-v3") -> str:
    """The docs' reference table: GB per die of :data:`REFERENCE_DEPLOYMENTS` on :data:`REFERENCE_PROFILES`."""
    shapes = ModelShapes.load(model)
    profiles = [(label, with_weights(Profile.load(name), w)) for label, name, w in REFERENCE_PROFILES]
    st = REFERENCE_SETTINGS
    usable = "; ".join(f"{label} {profile_hbm(p).usable_gb:.1f} of {profile_hbm(p).hbm_gb:g} GB"
                       for label, p in profiles if profile_hbm(p))
    lines = [_generated(command), f"# Memory per die: {shapes.name} on nine deployments\n",
             f"GB per die needed, {shapes.name} with token budget and chunk {st['token_budget']:,} tokens, prompts "
             f"to {st['max_prompt_len']:,}, expert batches of {st['expert_token_budget']:,} rows; ASAP's attention "
             "dies include the long-prompt lane's received KV (one longest prompt's latents). Usable per die: "
             f"{usable}. **Bold**: does not fit. What each die holds: `asap_comm/sim/costmodel/memory.py`; one deployment "
             "with its breakdown: `python -m asap_comm.sim memory --profile P --model M [deployment flags]`.\n",
             "| deployment | " + " | ".join(label for label, _ in profiles) + " |",
             "| --- |" + " --- |" * len(profiles)]
    for label, mode, dep in REFERENCE_DEPLOYMENTS:
        cells = []
        for _, p in profiles:
            dies = deployment_memory(mode, p, shapes, **dep, **st)
            fmt = [f"{d.needed_gb:.1f}" if d.feasible else f"**{d.needed_gb:.1f}**" for d in dies]
            cells.append(fmt[0] if mode == "sync" else f"attention {fmt[0]}; expert {fmt[1]}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _command(argv: list) -> str:
    """The command line, with ``--markdown``'s path shown as FILE so that the page does not depend on it."""
    out, skip = [], False
    for a in argv:
        if skip:
            out.append("FILE")
            skip = False
        elif a == "--markdown":
            out.append(a)
            skip = True
        elif a.startswith("--markdown="):
            out.append("--markdown=FILE")
        else:
            out.append(a)
    return " ".join(["python -m asap_comm.sim memory", *out])


# ---------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim memory",
                                description="per-die memory of an ASAP and a baseline deployment")
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--weights", choices=WEIGHT_DTYPES, default=None, help="override the profile's weight dtype")
    p.add_argument("--attention-ranks", type=int, default=2)
    p.add_argument("--attention-tp", type=int, default=8)
    p.add_argument("--expert-ranks", type=int, default=16, help="ASAP expert dies")
    p.add_argument("--sync-ranks", type=int, default=None, help="baseline DP groups (default: ASAP's dies / T)")
    p.add_argument("--sync-tp", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--chunk-len", type=int, default=16384)
    p.add_argument("--max-prompt-len", type=int, default=131072)
    p.add_argument("--sync-overlap", action="store_true")
    p.add_argument("--no-ping-pong", action="store_true")
    p.add_argument("--no-long-prompt-lane", action="store_true", help="ASAP without the lane's received KV")
    p.add_argument("--expert-token-budget", type=int, default=None, metavar="ROWS",
                   help="rows an expert die computes in one batch (default: every in-flight row at once)")
    p.add_argument("--reference", action="store_true",
                   help="print the docs' reference table instead: DeepSeek-V3 on nine deployments, 910C INT8/BF16 and "
                        "H800 (the deployment flags do not apply)")
    p.add_argument("--markdown", default=None, metavar="FILE", help="also write the table as a markdown page to FILE")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    if args.reference:
        page = reference_markdown(_command(argv))
        print(page)
        if args.markdown:
            Path(args.markdown).write_text(page)
        return 0
    try:
        profile = with_weights(Profile.load(args.profile), args.weights)
        shapes = ModelShapes.load(args.model)
        W = args.sync_ranks
        if W is None:
            W = max(1, (args.attention_ranks * args.attention_tp + args.expert_ranks) // args.sync_tp)
        kw = dict(token_budget=args.token_budget, chunk_len=args.chunk_len, max_prompt_len=args.max_prompt_len,
                  expert_token_budget=args.expert_token_budget)
        dies = {"ASAP": deployment_memory("async", profile, shapes, attention_ranks=args.attention_ranks,
                                          attention_tp=args.attention_tp, expert_ranks=args.expert_ranks,
                                          ping_pong=not args.no_ping_pong,
                                          long_prompt_lane=not args.no_long_prompt_lane, **kw),
                "baseline": deployment_memory("sync", profile, shapes, sync_ranks=W, sync_tp=args.sync_tp,
                                              sync_overlap=args.sync_overlap, **kw)}
    except ValueError as e:
        p.error(str(e))
    hbm = profile_hbm(profile)
    print(f"{shapes.name} on {profile.name} (weights {profile.dtype['weight_bytes']:g} B, HBM "
          f"{'unknown' if hbm is None else f'{hbm.hbm_gb:g} GB, {hbm.usable_fraction:g} usable'}); ASAP "
          f"{args.attention_ranks} x TP{args.attention_tp} + {args.expert_ranks} expert dies, baseline {W} x "
          f"TP{args.sync_tp}")
    print(memory_table(dies))
    if args.markdown:
        title = (f"Memory per die: {shapes.name} on {profile.name}, ASAP {args.attention_ranks} x TP{args.attention_tp} "
                 f"+ {args.expert_ranks}, baseline {W} x TP{args.sync_tp}")
        Path(args.markdown).write_text(memory_markdown(dies, title, _command(argv)))
    bad = [x for m in dies.values() for x in memory_problems(m, profile.name)]
    for line in bad:
        print(line)
    return 0 if not bad else 2


if __name__ == "__main__":
    sys.exit(main())
