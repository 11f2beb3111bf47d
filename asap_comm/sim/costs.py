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

Profile JSON (``asap_comm/sim/profiles/<name>.json``)::

    {"name", "description", "rank": what one rank is, "cores": int or null,
     "hardware": {key: {"value", "unit", "source"}},        # referenced by "peak" below
     "dtype": {"weight_bytes", "activation_bytes", "dispatch_bytes", "combine_bytes", "source"},
     "ops": {op: {"overhead_s", ["per_item_s"], "flops_per_s": {class: RATE}, "bytes_per_s": RATE, "n_half", "source"}}
            for op in attention, router, shared_experts, dense_mlp, embed, head, expert;
            plus "experts_batch": {"overhead_s"},
     "links": {"p2p":        {"latency_s", "bytes_per_s": RATE, "per_row_s"},      # dispatch / combine
               "message":    {"latency_s", "bytes_per_s": RATE},                   # front end <-> attention
               "collective": {"latency_s", "latency_per_rank_s", "bytes_per_s": RATE,
                              ["inter_bytes_per_s": RATE, "ranks_per_node": int]},  # all_to_all
               "all_reduce": {"latency_s", "latency_per_rank_s"}},
     ["parallel": {"tp_eff_per_doubling": fraction, "source": why}],  # TP efficiency (default 1.0)
     ["fit": {...}]}                                          # calibrate's summary (local profile)

    RATE = a number, null (term dropped), or {"peak": hardware key, "eff": fraction, "source": why}
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Sequence

from .shapes import ModelShapes

__all__ = ["Profile", "CostModel", "OpCoef", "known_profiles", "COMPUTE_OPS", "FLOP_CLASSES"]

_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"

# op -> the flop classes it has (a profile gives a rate for each)
FLOP_CLASSES = {"attention": ("gemm", "core"), "router": ("gemm",), "shared_experts": ("gemm",),
                "dense_mlp": ("gemm",), "embed": (), "head": ("gemm",), "expert": ("gemm",)}
COMPUTE_OPS = tuple(FLOP_CLASSES)


def known_profiles() -> list[str]:
    return sorted(p.stem for p in _PROFILES_DIR.glob("*.json"))


class OpCoef:
    """Resolved coefficients of one compute op: seconds = overhead + max(sum flops_c * s_per_flop_c * (n+n_half)/n,
    bytes * s_per_byte)."""

    __slots__ = ("overhead_s", "per_item_s", "s_per_flop", "s_per_byte", "n_half")

    def __init__(self, overhead_s: float, s_per_flop: dict, s_per_byte: float, n_half: float,
                 per_item_s: float = 0.0) -> None:
        self.overhead_s, self.s_per_flop, self.s_per_byte, self.n_half = overhead_s, s_per_flop, s_per_byte, n_half
        self.per_item_s = per_item_s

    def time(self, n: float, flops: dict, nbytes: float, items: int = 1, eff: float = 1.0) -> float:
        """n rows (0: no call, 0 s); items: chunks (attention) or sequences (head) charged per_item_s each;
        ``eff``: a further efficiency (0, 1] dividing the roofline term (tensor parallelism's)."""
        if n <= 0:
            return 0.0
        compute = sum(f * self.s_per_flop.get(c, 0.0) for c, f in flops.items()) * (n + self.n_half) / n
        return self.overhead_s + items * self.per_item_s + max(compute, nbytes * self.s_per_byte) / eff

    def describe(self) -> dict:
        return {"overhead_s": self.overhead_s, "per_item_s": self.per_item_s,
                "flops_per_s": {c: (1.0 / s if s > 0 else None) for c, s in self.s_per_flop.items()},
                "bytes_per_s": 1.0 / self.s_per_byte if self.s_per_byte > 0 else None, "n_half": self.n_half}


RUNTIME_FACTORS = {
    "async_attention": 1.0, "async_expert": 1.0, "async_layer_overhead_s": 0.0,
    "sync_compute": 1.0, "sync_layer_overhead_s": 0.0, "sync_poll_weight": 1.0,
}


def _runtime_factors(profile: "Profile") -> dict:
    """The profile's optional ``runtime`` block (in-situ factors fitted by ``asap_comm.sim.insitu``).

    ``async_attention`` / ``async_expert`` / ``sync_compute`` multiply the work of the
    attention-rank jobs, expert-rank jobs and baseline compute; ``*_layer_overhead_s`` is a
    latency added per MoE layer (wake-ups and loop overhead the operator timings do not see);
    ``sync_poll_weight``: on a shared CPU host, the share of a core that a baseline rank waiting in a
    collective takes from the ranks computing (1: a full polling process, 0: it sleeps).
    Absent: the neutral values (cluster profiles).
    """
    block = profile.data.get("runtime") or {}
    if not isinstance(block, dict):
        raise ValueError(f"Profile {profile.path}: field 'runtime' must be an object")
    out = dict(RUNTIME_FACTORS)
    for k, v in block.items():
        if k in ("source", "fit"):
            continue
        if k not in RUNTIME_FACTORS:
            raise ValueError(f"Profile {profile.path}: unknown field 'runtime.{k}' (known: {sorted(RUNTIME_FACTORS)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ValueError(f"Profile {profile.path}: field 'runtime.{k}'={v!r} must be a number >= 0")
        out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------- Profile
class Profile:
    """A hardware profile (parsed and validated JSON); ``Profile.load(name_or_path)``."""

    def __init__(self, data: dict, path: str = "<dict>") -> None:
        self.data, self.path = data, str(path)
        self._where = f"Profile {self.path}"
        if not isinstance(data, dict):
            raise ValueError(f"{self._where}: expected a JSON object, got {type(data).__name__}")
        self.name = self._str(data, "name")
        cores = data.get("cores", None)
        if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
            raise ValueError(f"{self._where}: field 'cores'={cores!r} must be null or an int >= 1")
        self.cores: int | None = cores
        hw = data.get("hardware", {})
        if not isinstance(hw, dict):
            raise ValueError(f"{self._where}: field 'hardware' must be an object")
        self.hardware = hw
        dt = self._obj(data, "dtype")
        self.dtype = {k: self._num(dt, k, "dtype", positive=True)
                      for k in ("weight_bytes", "activation_bytes", "dispatch_bytes", "combine_bytes")}
        ops = self._obj(data, "ops")
        self.ops: dict[str, OpCoef] = {}
        for op, classes in FLOP_CLASSES.items():
            o = self._obj(ops, op, "ops")
            at = f"ops.{op}"
            rates = o.get("flops_per_s", {})
            if not isinstance(rates, dict):
                raise ValueError(f"{self._where}: field '{at}.flops_per_s' must be an object")
            s_flop = {}
            for c in classes:
                if c not in rates:
                    raise ValueError(f"{self._where}: field '{at}.flops_per_s.{c}' is missing")
                s_flop[c] = self._inv_rate(rates[c], f"{at}.flops_per_s.{c}")
            if "bytes_per_s" not in o:
                raise ValueError(f"{self._where}: field '{at}.bytes_per_s' is missing")
            self.ops[op] = OpCoef(self._num(o, "overhead_s", at), s_flop,
                                  self._inv_rate(o["bytes_per_s"], f"{at}.bytes_per_s"),
                                  self._num(o, "n_half", at) if "n_half" in o else 0.0,
                                  self._num(o, "per_item_s", at) if "per_item_s" in o else 0.0)
        self.experts_batch_overhead_s = self._num(self._obj(ops, "experts_batch", "ops"), "overhead_s",
                                                  "ops.experts_batch")
        links = self._obj(data, "links")
        p2p = self._obj(links, "p2p", "links")
        self.p2p = {"latency_s": self._num(p2p, "latency_s", "links.p2p"),
                    "s_per_byte": self._inv_rate(self._need(p2p, "bytes_per_s", "links.p2p"), "links.p2p.bytes_per_s"),
                    "per_row_s": self._num(p2p, "per_row_s", "links.p2p") if "per_row_s" in p2p else 0.0}
        msg = self._obj(links, "message", "links")
        self.message = {"latency_s": self._num(msg, "latency_s", "links.message"),
                        "s_per_byte": self._inv_rate(self._need(msg, "bytes_per_s", "links.message"),
                                                     "links.message.bytes_per_s")}
        col = self._obj(links, "collective", "links")
        self.collective = {"latency_s": self._num(col, "latency_s", "links.collective"),
                           "latency_per_rank_s": self._num(col, "latency_per_rank_s", "links.collective"),
                           "s_per_byte": self._inv_rate(self._need(col, "bytes_per_s", "links.collective"),
                                                        "links.collective.bytes_per_s"),
                           "inter_s_per_byte": None, "ranks_per_node": None}
        if "ranks_per_node" in col and col["ranks_per_node"] is not None:
            rpn = col["ranks_per_node"]
            if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
                raise ValueError(f"{self._where}: field 'links.collective.ranks_per_node'={rpn!r} must be an int >= 1")
            self.collective["ranks_per_node"] = rpn
            self.collective["inter_s_per_byte"] = self._inv_rate(
                self._need(col, "inter_bytes_per_s", "links.collective"), "links.collective.inter_bytes_per_s")
        ar = self._obj(links, "all_reduce", "links")
        self.all_reduce = {"latency_s": self._num(ar, "latency_s", "links.all_reduce"),
                           "latency_per_rank_s": self._num(ar, "latency_per_rank_s", "links.all_reduce")}
        par = data.get("parallel", {})
        if not isinstance(par, dict):
            raise ValueError(f"{self._where}: field 'parallel' must be an object")
        self.tp_eff_per_doubling = 1.0
        if "tp_eff_per_doubling" in par:
            v = par["tp_eff_per_doubling"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{self._where}: field 'parallel.tp_eff_per_doubling'={v!r} must be a number "
                                 "in (0, 1]")
            self.tp_eff_per_doubling = float(v)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, name_or_path: "str | Path") -> "Profile":
        """A profile name (``asap_comm/sim/profiles/<name>.json``) or a JSON file path."""
        p = Path(name_or_path)
        if isinstance(name_or_path, str) and not name_or_path.endswith(".json") and os.sep not in name_or_path:
            p = _PROFILES_DIR / f"{name_or_path}.json"
            if not p.is_file():
                raise ValueError(f"Profile.load: unknown profile {name_or_path!r} (known: {known_profiles()}, "
                                 "or give a path to a profile JSON)")
        try:
            data = json.loads(p.read_text())
        except OSError as e:
            raise ValueError(f"Profile.load: cannot read {p}: {e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"Profile {p}: invalid JSON: {e}") from None
        return cls(data, str(p))

    # ------------------------------------------------------------------ field helpers
    def _need(self, d: dict, key: str, at: str):
        if key not in d:
            raise ValueError(f"{self._where}: field '{at}.{key}' is missing")
        return d[key]

    def _obj(self, d: dict, key: str, at: str = "") -> dict:
        name = f"{at}.{key}" if at else key
        v = d.get(key)
        if not isinstance(v, dict):
            what = "is missing" if key not in d else f"must be an object, got {v!r}"
            raise ValueError(f"{self._where}: field '{name}' {what}")
        return v

    def _str(self, d: dict, key: str) -> str:
        v = d.get(key)
        if not isinstance(v, str) or not v:
            raise ValueError(f"{self._where}: field '{key}' must be a non-empty string, got {v!r}")
        return v

    def _num(self, d: dict, key: str, at: str, positive: bool = False) -> float:
        name = f"{at}.{key}"
        if key not in d:
            raise ValueError(f"{self._where}: field '{name}' is missing")
        v = d[key]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive
                                                                                              else v >= 0)
        if not ok:
            raise ValueError(f"{self._where}: field '{name}'={v!r} must be a finite number "
                             f"{'> 0' if positive else '>= 0'}")
        return float(v)

    def _inv_rate(self, spec: Any, name: str) -> float:
        """Seconds per unit of a RATE spec (0.0 for null: the term is dropped)."""
        if spec is None:
            return 0.0
        if isinstance(spec, dict):
            key = spec.get("peak")
            hw = self.hardware.get(key) if isinstance(key, str) else None
            peak = hw.get("value") if isinstance(hw, dict) else hw
            if not isinstance(peak, (int, float)) or isinstance(peak, bool) or not peak > 0:
                raise ValueError(f"{self._where}: field '{name}.peak'={key!r} must name a 'hardware' entry with a "
                                 f"positive value (hardware keys: {sorted(self.hardware)})")
            eff = spec.get("eff")
            if not isinstance(eff, (int, float)) or isinstance(eff, bool) or not 0 < eff <= 1:
                raise ValueError(f"{self._where}: field '{name}.eff'={eff!r} must be a number in (0, 1]")
            return 1.0 / (float(peak) * float(eff))
        if isinstance(spec, (int, float)) and not isinstance(spec, bool) and spec > 0 and math.isfinite(spec):
            return 1.0 / float(spec)
        raise ValueError(f"{self._where}: field '{name}'={spec!r} must be a positive number, null, or "
                         "{'peak': <hardware key>, 'eff': <fraction>}")

    def __repr__(self) -> str:
        return f"Profile({self.name!r}, path={self.path!r})"


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
