"""The DeepSeek-V3-style reference MoE model (torch only; never imports asap_comm).

Installed as ``asap_models``; from the repository root it is also importable as ``models``.

    model = load_checkpoint("path/to/hf_checkpoint")      # or random_init(preset("small"))
    logits = model(token_ids)                              # token_ids [T] int64 -> [T, vocab]

The stages the disaggregated runtime runs are methods of DeepseekV3: embed,
attention_stage, route, expert, routed_experts, shared_experts, dense_mlp, head.
"""
from .checkpoint import CheckpointError, load_checkpoint, random_init, save_checkpoint, weight_shapes
from .config import PRESETS, ConfigError, ModelConfig, preset
from .factory import StageFactory
from .layers import Routing
from .model import AttentionOutput, DeepseekV3, KVCache, PrefillOutput

__all__ = [
    "AttentionOutput", "CheckpointError", "ConfigError", "DeepseekV3", "KVCache", "ModelConfig", "PRESETS",
    "PrefillOutput", "Routing", "StageFactory", "load_checkpoint", "preset", "random_init", "save_checkpoint", "weight_shapes",
]
