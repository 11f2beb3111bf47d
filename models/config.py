"""The model configuration: one flat dataclass that reads and writes the Hugging Face
``config.json`` of ``model_type: "deepseek_v3"``, plus named presets.

Rope parameters are flattened (``rope_type``, ``rope_factor``, ...). ``None`` means
"absent from config.json", which matters because ``transformers`` treats an absent
YaRN ``factor``, ``mscale`` or ``attention_factor`` differently from any value.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelConfig", "PRESETS", "preset", "ConfigError"]


class ConfigError(ValueError):
    """A config.json (or a ModelConfig) that this model cannot run: names the keys and values."""


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 shapes and hyper-parameters (field names as in Hugging Face config.json)."""

    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int
    first_k_dense_replace: int  # layers [0, first_k_dense_replace) use the dense MLP, the rest are MoE
    intermediate_size: int  # dense MLP width
    moe_intermediate_size: int  # width of one routed expert (shared experts: n_shared_experts times this)
    n_routed_experts: int  # E
    n_shared_experts: int
    num_experts_per_tok: int  # k
    n_group: int  # experts are split into n_group groups of E / n_group ...
    topk_group: int  # ... and only the best topk_group groups may be chosen from
    norm_topk_prob: bool  # renormalise the k chosen sigmoid scores to sum to 1
    routed_scaling_factor: float  # multiplies the routing weights (after normalisation)
    num_attention_heads: int  # nH
    q_lora_rank: int | None  # None: q is a plain projection (DeepSeek-V2-Lite)
    kv_lora_rank: int  # width of the compressed (latent) kv
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # decoupled rope part of q/k, shared by all heads for k
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # "default" or "yarn"
    rope_factor: float | None = None  # YaRN: context extension factor
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_truncate: bool = True
    rope_interleave: bool = True  # rope acts on (x0,x1),(x2,x3)... pairs, as DeepSeek's weights expect
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers in the checkpoint (not run; skipped on load)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """The attention logit scale: qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type != "default" and self.rope_mscale_all_dim:
            m = _yarn_mscale(self._yarn_factor(), self.rope_mscale_all_dim)
            scale = scale * m * m
        return scale

    def _yarn_factor(self) -> float:
        if self.rope_factor is not None:
            return float(self.rope_factor)
        # transformers: an absent factor is max_position_embeddings / original_max_position_embeddings
        return self.max_position_embeddings / self._yarn_original_max()

    def _yarn_original_max(self) -> int:
        if self.rope_original_max_position_embeddings is None:
            return self.max_position_embeddings
        return self.rope_original_max_position_embeddings

    def num_parameters(self) -> int:
        """Parameter count (embedding and head included, MTP layers excluded), for size estimates."""
        H, nH = self.hidden_size, self.num_attention_heads
        if self.q_lora_rank is None:
            q = H * nH * self.qk_head_dim
        else:
            q = H * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nH * self.qk_head_dim
        kv = H * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * nH * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + nH * self.v_head_dim * H + 2 * H
        dense = 3 * H * self.intermediate_size
        moe = 3 * H * self.moe_intermediate_size * (self.n_routed_experts + self.n_shared_experts)
        moe += self.n_routed_experts * H + self.n_routed_experts
        layers = self.num_hidden_layers * attn + self.first_k_dense_replace * dense + self.num_moe_layers * moe
        head = 0 if self.tie_word_embeddings else self.vocab_size * H
        return self.vocab_size * H + layers + H + head

    def num_active_parameters(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to."""
        idle = self.n_routed_experts - self.num_experts_per_tok
        return self.num_parameters() - self.num_moe_layers * idle * 3 * self.hidden_size * self.moe_intermediate_size

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        bad: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                bad.append(msg)

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "num_attention_heads",
            "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
        ):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"{name}={v!r} must be a positive int")
        for name in ("first_k_dense_replace", "n_shared_experts", "qk_nope_head_dim", "num_nextn_predict_layers"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"{name}={v!r} must be an int >= 0")
        for name in ("norm_topk_prob", "rope_interleave", "tie_word_embeddings", "rope_truncate"):
            v = getattr(self, name)
            need(isinstance(v, bool), f"{name}={v!r} must be a bool")
        for name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool), f"{name}={v!r} must be a number")
        if bad:  # the checks below assume ints and numbers
            raise ConfigError("ModelConfig: " + "; ".join(bad))
        q = self.q_lora_rank
        need(q is None or (isinstance(q, int) and q > 0), f"q_lora_rank={q!r} must be a positive int or None")
        need(self.first_k_dense_replace <= self.num_hidden_layers,
             f"first_k_dense_replace={self.first_k_dense_replace} > num_hidden_layers={self.num_hidden_layers}")
        need(self.n_routed_experts % self.n_group == 0,
             f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}")
        need(self.topk_group <= self.n_group, f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.n_routed_experts % self.n_group == 0 and self.topk_group <= self.n_group:
            per_group = self.n_routed_experts // self.n_group
            need(per_group >= 2, f"n_routed_experts/n_group={per_group}: group scores need >= 2 experts per group")
            need(self.num_experts_per_tok <= self.topk_group * per_group,
                 f"num_experts_per_tok={self.num_experts_per_tok} > topk_group*experts_per_group="
                 f"{self.topk_group * per_group}")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        need(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps!r} must be > 0")
        need(self.rope_theta > 0, f"rope_theta={self.rope_theta!r} must be > 0")
        need(self.routed_scaling_factor > 0, f"routed_scaling_factor={self.routed_scaling_factor!r} must be > 0")
        need(self.rope_type in ("default", "yarn"), f"rope_type={self.rope_type!r} (supported: 'default', 'yarn')")
        if self.rope_type == "yarn":
            need(self.rope_factor is None or self.rope_factor >= 1.0,
                 f"rope_factor={self.rope_factor!r} must be >= 1 for yarn")
            o = self.rope_original_max_position_embeddings
            need(o is None or (isinstance(o, int) and o > 0),
                 f"rope_original_max_position_embeddings={o!r} must be a positive int")
        else:
            set_yarn = [f.name for f in dataclasses.fields(self) if f.name.startswith("rope_") and f.name not in
                        ("rope_theta", "rope_type", "rope_truncate", "rope_interleave") and getattr(self, f.name) is not None]
            need(not set_yarn, f"{', '.join(set_yarn)} given but rope_type={self.rope_type!r} is not 'yarn'")
        if bad:
            raise ConfigError("ModelConfig: " + "; ".join(bad))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------ config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Reads a Hugging Face DeepSeek-V3 config dict (published or transformers-v5 layout)."""
        return _from_hf(cls, d)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"ModelConfig.from_json: cannot read {path}: {e}") from None
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that this class and transformers' DeepseekV3Config both read back."""
        d: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
        for f in dataclasses.fields(self):
            if not f.name.startswith("rope_") or f.name == "rope_interleave":
                d[f.name] = getattr(self, f.name)
        d["num_key_value_heads"] = self.num_attention_heads
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            for hf_key, name in _ROPE_KEYS.items():
                v = getattr(self, name)
                if v is not None and hf_key not in rope:
                    rope[hf_key] = v
        d["rope_parameters"] = rope
        return d

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2, sort_keys=True) + "\n")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# rope dict key in config.json -> flat field
_ROPE_KEYS = {
    "rope_type": "rope_type",
    "rope_theta": "rope_theta",
    "factor": "rope_factor",
    "original_max_position_embeddings": "rope_original_max_position_embeddings",
    "beta_fast": "rope_beta_fast",
    "beta_slow": "rope_beta_slow",
    "mscale": "rope_mscale",
    "mscale_all_dim": "rope_mscale_all_dim",
    "attention_factor": "rope_attention_factor",
    "truncate": "rope_truncate",
}
_REQUIRED = (
    "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
    "n_routed_experts", "num_experts_per_tok", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim",
)
# Keys that carry no information the forward pass needs (metadata, training-only, serving hints).
_IGNORED = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "attention_dropout", "output_router_logits", "aux_loss_alpha", "seq_aux",
    "ep_size", "pretraining_tp", "_name_or_path", "num_mtp_layers", "num_key_value_heads", "router_aux_loss_coef",
    "return_dict", "output_hidden_states", "output_attentions", "_attn_implementation",
}
# transformers' DeepseekV3Config defaults for the keys that are not required above.
_HF_DEFAULTS = {
    "first_k_dense_replace": 3, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "initializer_range": 0.02, "rope_interleave": True,
}
# Keys whose value must be exactly this (the only variant this model implements).
_FIXED = {
    "model_type": "deepseek_v3", "hidden_act": "silu", "attention_bias": False, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "moe_layer_freq": 1,
}


def _from_hf(cls: type[ModelConfig], d: dict[str, Any]) -> ModelConfig:
    if not isinstance(d, dict):
        raise ConfigError(f"ModelConfig.from_hf_dict: expected a dict, got {type(d).__name__}")
    problems: list[str] = []
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        problems.append(f"missing keys {missing}")
    if "quantization_config" in d:
        q = d["quantization_config"]
        problems.append(f"quantization_config={q!r}: quantized (e.g. fp8) checkpoints are not supported; "
                        "dequantize to bf16 first")
    for key, want in _FIXED.items():
        if key in d and d[key] != want:
            problems.append(f"{key}={d[key]!r} (only {want!r} is supported)")
    field_names = {f.name for f in dataclasses.fields(cls)} - set(_ROPE_KEYS.values())
    rope_in = {"rope_parameters", "rope_scaling", "rope_theta", "head_dim", "qk_head_dim",
               "original_max_position_embeddings"}
    unknown = sorted(k for k in d if k not in field_names and k not in _IGNORED and k not in _FIXED
                     and k not in rope_in and k != "quantization_config")
    if unknown:
        problems.append(f"unknown keys {unknown}")
    # An absent key takes transformers' DeepseekV3Config default, so both read a file alike.
    kw: dict[str, Any] = dict(_HF_DEFAULTS)
    kw.update({k: d[k] for k in field_names if k in d})
    if kw["n_group"] is None:  # null: no group limit
        kw["n_group"] = 1
    if kw["topk_group"] is None:
        kw["topk_group"] = kw["n_group"]
    for key in ("first_k_dense_replace", "n_shared_experts"):
        if kw[key] is None:
            kw[key] = 0
    if kw["rope_interleave"] is None:
        kw["rope_interleave"] = True
    problems += _read_rope(d, kw)
    if not missing:
        rope_dim = d["qk_rope_head_dim"]
        if d.get("head_dim") is not None and d["head_dim"] != rope_dim:
            problems.append(f"head_dim={d['head_dim']} != qk_rope_head_dim={rope_dim} (DeepSeek-V3 sets head_dim "
                            "to the rope dim)")
        if d.get("qk_head_dim") is not None and d["qk_head_dim"] != d["qk_nope_head_dim"] + rope_dim:
            problems.append(f"qk_head_dim={d['qk_head_dim']} != qk_nope_head_dim+qk_rope_head_dim="
                            f"{d['qk_nope_head_dim'] + rope_dim}")
    if problems:
        raise ConfigError("config.json: " + "; ".join(problems))
    try:
        return cls(**kw)
    except TypeError as e:
        raise ConfigError(f"config.json: {e}") from None


def _read_rope(d: dict[str, Any], kw: dict[str, Any]) -> list[str]:
    """Fills the flat rope_* fields from `rope_parameters` (transformers v5) or `rope_scaling` + `rope_theta`."""
    problems: list[str] = []
    rope = d.get("rope_parameters")
    if rope is None:
        rope = d.get("rope_scaling")
    rope = dict(rope or {})
    if not isinstance(rope, dict):
        return [f"rope_parameters={rope!r} must be a dict"]
    if "type" in rope:  # the published configs spell it "type"
        t = rope.pop("type")
        if rope.setdefault("rope_type", t) != t:
            problems.append(f"rope type={t!r} and rope_type={rope['rope_type']!r} disagree")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={rope['partial_rotary_factor']!r} (only 1.0 is supported)")
    rope.pop("partial_rotary_factor", None)
    unknown = sorted(k for k in rope if k not in _ROPE_KEYS)
    if unknown:
        problems.append(f"unknown rope keys {unknown}")
    if d.get("rope_theta") is not None:
        rope.setdefault("rope_theta", d["rope_theta"])
    if rope.get("rope_theta") is None:
        rope.pop("rope_theta", None)
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] == "yarn" and d.get("original_max_position_embeddings") is not None:
        # transformers gives a top-level original_max_position_embeddings priority
        rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    for hf_key, name in _ROPE_KEYS.items():
        if hf_key in rope:
            v = rope[hf_key]
            if rope["rope_type"] != "yarn" and hf_key not in ("rope_type", "rope_theta", "truncate"):
                continue  # transformers ignores yarn keys under another rope type; so do we
            kw[name] = bool(v) if hf_key == "truncate" else v
    return problems


def _preset_tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, num_attention_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=128, rope_beta_fast=32,
        rope_beta_slow=1, rope_mscale=1.0, rope_mscale_all_dim=1.0, max_position_embeddings=512,
    )


def _preset_small() -> ModelConfig:
    # About 80M parameters: a 2k-token prompt prefills in about 1.5 s on two CPU cores (float32).
    return ModelConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=6, first_k_dense_replace=1, intermediate_size=1536,
        moe_intermediate_size=256, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4, n_group=4,
        topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, num_attention_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=4096, rope_beta_fast=32,
        rope_beta_slow=1, rope_mscale=1.0, rope_mscale_all_dim=1.0, max_position_embeddings=16384,
    )


def _preset_deepseek_v3() -> ModelConfig:
    # The published DeepSeek-V3 / R1 shapes (671B parameters, 37B active). For size and cost estimates only.
    return ModelConfig(
        vocab_size=129280, hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8,
        topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        rope_type="yarn", rope_factor=40.0, rope_original_max_position_embeddings=4096, rope_beta_fast=32,
        rope_beta_slow=1, rope_mscale=1.0, rope_mscale_all_dim=1.0, max_position_embeddings=163840,
        num_nextn_predict_layers=1,
    )


PRESETS = {"tiny": _preset_tiny, "small": _preset_small, "deepseek-v3": _preset_deepseek_v3}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A named preset (`tiny`, `small`, `deepseek-v3`), optionally with some fields replaced."""
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown name {name!r} (known: {sorted(PRESETS)})")
    cfg = PRESETS[name]()
    return cfg.replace(**overrides) if overrides else cfg
