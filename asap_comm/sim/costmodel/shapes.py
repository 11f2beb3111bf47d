"""Model shapes for the simulator's cost models, read from a Hugging Face ``config.json``.

The simulator never builds the model: it needs only the sizes that set the
cost of each operation. ``ModelShapes`` reads them from a config dict (the
DeepSeek-V3 layout), from a preset shipped with this package
(``asap_comm/sim/models/<name>.json``, written from the reference model's
presets and checked against them by the tests), from a ``config.json`` path,
or from a checkpoint directory holding one. This module does not import the
reference model package.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelShapes", "known_presets"]

_MODELS_DIR = Path(__file__).resolve().parents[1] / "models"

# Keys that must be present, and the defaults transformers' DeepseekV3Config uses for the others.
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "num_attention_heads", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_DEFAULTS = {"first_k_dense_replace": 3, "n_shared_experts": 1, "q_lora_rank": 1536}


def known_presets() -> list[str]:
    """Names of the model presets shipped with the simulator."""
    return sorted(p.stem for p in _MODELS_DIR.glob("*.json"))


def _int(d: dict, key: str, minimum: int, src: str, allow_none: bool = False):
    v = d[key] if key in d else _DEFAULTS[key]
    if v is None and key in ("first_k_dense_replace", "n_shared_experts"):
        v = 0
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"ModelShapes: {src}: {key}={v!r} must be an int >= {minimum}")
    return v


@dataclass(frozen=True)
class ModelShapes:
    """The sizes that set operation costs (names as in the Hugging Face config, plus short aliases)."""

    hidden_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    name: str = "custom"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_hf_config(cls, d: dict[str, Any], name: str = "custom") -> "ModelShapes":
        """From a Hugging Face DeepSeek-V3 ``config.json`` dict (absent optional keys take transformers' defaults)."""
        src = f"config {name!r}"
        if not isinstance(d, dict):
            raise ValueError(f"ModelShapes.from_hf_config: expected a dict, got {type(d).__name__}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"ModelShapes: {src}: missing keys {missing}")
        kw: dict[str, Any] = {}
        for key in _REQUIRED:
            kw[key] = _int(d, key, 0 if key == "qk_nope_head_dim" else 1, src)
        kw["first_k_dense_replace"] = _int(d, "first_k_dense_replace", 0, src)
        kw["n_shared_experts"] = _int(d, "n_shared_experts", 0, src)
        kw["q_lora_rank"] = _int(d, "q_lora_rank", 1, src, allow_none=True)
        if kw["first_k_dense_replace"] > kw["num_hidden_layers"]:
            raise ValueError(f"ModelShapes: {src}: first_k_dense_replace={kw['first_k_dense_replace']} > "
                             f"num_hidden_layers={kw['num_hidden_layers']}")
        if kw["num_experts_per_tok"] > kw["n_routed_experts"]:
            raise ValueError(f"ModelShapes: {src}: num_experts_per_tok={kw['num_experts_per_tok']} > "
                             f"n_routed_experts={kw['n_routed_experts']}")
        return cls(name=name, **kw)

    @classmethod
    def preset(cls, name: str) -> "ModelShapes":
        """A preset shipped with the simulator: ``tiny``, ``small``, ``deepseek-v3``."""
        path = _MODELS_DIR / f"{name}.json"
        if not isinstance(name, str) or "/" in name or not path.is_file():
            raise ValueError(f"ModelShapes.preset: unknown model preset {name!r} (known: {known_presets()})")
        return cls.from_hf_config(json.loads(path.read_text()), name=name)

    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelShapes":
        """A preset name, a ``config.json`` path, or a checkpoint directory containing ``config.json``."""
        p = Path(name_or_path)
        if isinstance(name_or_path, str) and name_or_path in known_presets():
            return cls.preset(name_or_path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ValueError(f"ModelShapes.load: {str(name_or_path)!r} is neither a model preset "
                             f"(known: {known_presets()}) nor a config.json / checkpoint directory")
        try:
            d = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"ModelShapes.load: cannot read {p}: {e}") from None
        return cls.from_hf_config(d, name=str(name_or_path))

    # ------------------------------------------------------------------ short names
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: True for an MoE layer (layer >= first_k_dense_replace)."""
        return tuple(i >= self.first_k_dense_replace for i in range(self.num_hidden_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def hidden(self) -> int:
        return self.hidden_size

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def top_k(self) -> int:
        return self.num_experts_per_tok

    @property
    def moe_inter(self) -> int:
        return self.moe_intermediate_size

    @property
    def dense_inter(self) -> int:
        return self.intermediate_size

    @property
    def n_shared(self) -> int:
        return self.n_shared_experts

    @property
    def heads(self) -> int:
        return self.num_attention_heads

    @property
    def qk_nope(self) -> int:
        return self.qk_nope_head_dim

    @property
    def qk_rope(self) -> int:
        return self.qk_rope_head_dim

    @property
    def v_head(self) -> int:
        return self.v_head_dim

    @property
    def vocab(self) -> int:
        return self.vocab_size

    def describe(self) -> dict:
        return {"name": self.name, "num_layers": self.num_layers, "num_moe_layers": self.num_moe_layers,
                "hidden": self.hidden, "num_experts": self.num_experts, "top_k": self.top_k,
                "moe_inter": self.moe_inter, "dense_inter": self.dense_inter, "n_shared": self.n_shared,
                "heads": self.heads, "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
                "qk_nope": self.qk_nope, "qk_rope": self.qk_rope, "v_head": self.v_head, "vocab": self.vocab}
