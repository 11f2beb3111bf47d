"""Model factories found through the ``asap_comm.models`` entry-point group.

``asap_comm`` never imports a model package; a model package registers a
factory class (``factory(role, experts) -> stage model``, picklable, with
``describe() -> dict`` giving the shapes) in its ``pyproject.toml``::

    [project.entry-points."asap_comm.models"]
    deepseek = "asap_models.factory:StageFactory"
"""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from .protocol import ModelInfo

__all__ = ["load_model_factory", "model_info_of"]

GROUP = "asap_comm.models"


def load_model_factory(model: str = "small", *, plugin: str = "deepseek", seed: int = 0) -> Any:
    """``plugin``'s factory for ``model`` (a preset name or a checkpoint directory)."""
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if plugin not in found:
        raise LookupError(f"load_model_factory: no model plugin {plugin!r} in entry-point group {GROUP!r} "
                          f"(installed: {sorted(found) or 'none'}; `pip install -e .` from the repository "
                          "registers 'deepseek')")
    return found[plugin].load()(model, seed=seed)


def model_info_of(factory: Any) -> ModelInfo:
    """The runtime's ``ModelInfo`` from a factory's ``describe()``."""
    d = factory.describe()
    return ModelInfo(d["num_layers"], tuple(d["moe_layers"]), d["hidden"], d["vocab_size"], d["num_experts"],
                     d["top_k"], kv_row_width=int(d.get("kv_row_width", 0)))
