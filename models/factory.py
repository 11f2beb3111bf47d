"""A picklable stage-model factory, the plug-in the serving runtime and the simulator load.

``asap_comm`` never imports this package; it finds the factory through the
``asap_comm.models`` entry point (``pyproject.toml``), so any other model
package can register its own under another name.

    factory = StageFactory("small", seed=0)       # a preset with seeded random weights
    factory = StageFactory("path/to/checkpoint")  # or a Hugging Face checkpoint directory
    attention_model = factory("attention", [])    # embed, attention, router, dense, shared, head
    expert_model = factory("expert", [0, 1, 2])   # the routed experts 0, 1, 2 of every MoE layer
    factory.describe()                            # the shapes, as plain data
"""
from __future__ import annotations

from pathlib import Path

from .checkpoint import load_checkpoint, random_init
from .config import ConfigError, ModelConfig, preset

__all__ = ["StageFactory"]


class StageFactory:
    """Builds each worker's share of a model: a preset with seeded random weights, or a checkpoint."""

    def __init__(self, model: str = "small", seed: int = 0) -> None:
        if not isinstance(model, str) or not model:
            raise ConfigError(f"StageFactory: model must be a preset name or a checkpoint directory, got {model!r}")
        self.model, self.seed = model, seed
        self.config()  # fail now, in the caller, on an unknown preset or a bad config.json

    def config(self) -> ModelConfig:
        if Path(self.model).is_dir():
            return ModelConfig.from_json(Path(self.model) / "config.json")
        return preset(self.model)

    def __call__(self, role: str, experts: list):
        if role not in ("attention", "expert"):
            raise ValueError(f"StageFactory: role must be 'attention' or 'expert', got {role!r}")
        attention = role == "attention"
        if Path(self.model).is_dir():
            return load_checkpoint(self.model, experts=experts, attention_side=attention)
        return random_init(self.config(), seed=self.seed, experts=experts, attention_side=attention)

    def full(self):
        """The whole model in one process (the reference forward)."""
        return load_checkpoint(self.model) if Path(self.model).is_dir() else random_init(self.config(), seed=self.seed)

    def describe(self) -> dict:
        """Shapes as plain data (no torch types): what the runtime's ModelInfo and the simulator need."""
        c = self.config()
        return {"num_layers": c.num_hidden_layers,
                "moe_layers": [c.is_moe_layer(i) for i in range(c.num_hidden_layers)],
                "hidden": c.hidden_size, "vocab_size": c.vocab_size, "num_experts": c.n_routed_experts,
                "top_k": c.num_experts_per_tok, "kv_row_width": c.kv_lora_rank + c.qk_rope_head_dim,
                "hf_config": c.to_hf_dict()}

    def __repr__(self) -> str:
        return f"StageFactory({self.model!r}, seed={self.seed})"
