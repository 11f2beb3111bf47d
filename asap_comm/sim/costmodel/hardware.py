"""Hardware profiles of the simulator: the JSON files under ``asap_comm/sim/profiles/``, parsed and validated.

A profile gives the rates, overheads and links of one rank's hardware; the
cost model (``costs.py``) turns them and a model's shapes into seconds per
operation.

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
from typing import Any

__all__ = ["Profile", "OpCoef", "known_profiles", "COMPUTE_OPS", "FLOP_CLASSES", "RUNTIME_FACTORS"]

_PROFILES_DIR = Path(__file__).resolve().parents[1] / "profiles"

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
    "async_attention": 1.0, "async_expert": 1.0, "async_layer_overhead_s": 0.0, "async_job_overhead_s": 0.0,
    "async_expert_job_overhead_s": 0.0, "expert_skew": 1.0,
    "sync_compute": 1.0, "sync_layer_overhead_s": 0.0, "sync_poll_weight": 1.0,
}


def _runtime_factors(profile: "Profile") -> dict:
    """The profile's optional ``runtime`` block (in-situ factors fitted by ``asap_comm.sim.calibrate.insitu``).

    ``async_attention`` / ``async_expert`` / ``sync_compute`` multiply the work of the
    attention-rank jobs, expert-rank jobs and baseline compute; ``*_layer_overhead_s`` is a
    latency added per MoE layer (wake-ups and loop overhead the operator timings do not see; the baseline's
    lengthens its lock-step, so every rank pays it); ``async_job_overhead_s`` is busy time added to each
    attention-rank job (a layer segment up to a dispatch, or the tail): work the rank's own process does
    outside the operators (packing, puts, the loop), which keeps its other micro-batch waiting;
    ``async_expert_job_overhead_s`` the same for each expert-rank batch (merging, the loop, the combine's puts);
    ``expert_skew``: the slowest expert-holding rank's expert work over the mean's for one prompt's tokens, for a
    served router that does not spread them evenly over the ranks (both modes wait for the slowest; an emulated
    run's served model, measured by ``emulate.fit``): multiplies ASAP's expert-rank batch and the baseline's expert
    stage, its excess shrinking with the batch's spread over prompts (``core.common.batch_skew``);
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
