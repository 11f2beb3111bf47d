"""Hugging Face DeepSeek-V3 checkpoints: `config.json` + one or many `*.safetensors`, weight
names as published (``model.layers.3.mlp.experts.17.gate_proj.weight``, ...).

Tensors are read one at a time from memory-mapped files straight into the model's own
storage, so a checkpoint is never held twice in memory.
"""
from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Iterable

import torch

from .config import ModelConfig
from .model import DeepseekV3

__all__ = ["load_checkpoint", "save_checkpoint", "random_init", "weight_shapes", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint directory this model cannot load: names the files, tensors and shapes at fault."""


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a full checkpoint of `cfg` (MTP layers excluded) -> its shape."""
    return {name: tuple(shape) for name, shape in _names(cfg, range(cfg.n_routed_experts), True)}


def _names(cfg: ModelConfig, experts: Iterable[int], attention_side: bool):
    """Yields (published name, shape) for the tensors a model holding `experts` / attention side has."""
    H, nH, V = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    I, Ie = cfg.intermediate_size, cfg.moe_intermediate_size
    experts = list(experts)
    if attention_side:
        yield "model.embed_tokens.weight", (V, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if attention_side:
            a = p + "self_attn."
            if cfg.q_lora_rank is None:
                yield a + "q_proj.weight", (nH * cfg.qk_head_dim, H)
            else:
                yield a + "q_a_proj.weight", (cfg.q_lora_rank, H)
                yield a + "q_a_layernorm.weight", (cfg.q_lora_rank,)
                yield a + "q_b_proj.weight", (nH * cfg.qk_head_dim, cfg.q_lora_rank)
            yield a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
            yield a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,)
            yield a + "kv_b_proj.weight", (nH * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            yield a + "o_proj.weight", (H, nH * cfg.v_head_dim)
            yield p + "input_layernorm.weight", (H,)
            yield p + "post_attention_layernorm.weight", (H,)
        if not cfg.is_moe_layer(i):
            if attention_side:
                for name, shape in _mlp(p + "mlp.", H, I):
                    yield name, shape
            continue
        if attention_side:
            yield p + "mlp.gate.weight", (cfg.n_routed_experts, H)
            yield p + "mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,)
            if cfg.n_shared_experts > 0:
                for name, shape in _mlp(p + "mlp.shared_experts.", H, Ie * cfg.n_shared_experts):
                    yield name, shape
        for e in experts:
            for name, shape in _mlp(f"{p}mlp.experts.{e}.", H, Ie):
                yield name, shape
    if attention_side:
        yield "model.norm.weight", (H,)
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", (V, H)


def _mlp(prefix: str, H: int, I: int):
    yield prefix + "gate_proj.weight", (I, H)
    yield prefix + "up_proj.weight", (I, H)
    yield prefix + "down_proj.weight", (H, I)


def weight_views(model: DeepseekV3) -> dict[str, torch.Tensor]:
    """Published name -> the view of the model's storage that holds that tensor."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    if model.attention_side:
        out["model.embed_tokens.weight"] = model.embed_tokens
        out["model.norm.weight"] = model.norm.weight
        if not cfg.tie_word_embeddings:
            out["lm_head.weight"] = model.lm_head
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        if model.attention_side:
            att = blk.self_attn
            a = p + "self_attn."
            if cfg.q_lora_rank is None:
                out[a + "q_proj.weight"] = att.q_proj
            else:
                out[a + "q_a_proj.weight"] = att.q_a_proj
                out[a + "q_a_layernorm.weight"] = att.q_a_layernorm.weight
                out[a + "q_b_proj.weight"] = att.q_b_proj
            out[a + "kv_a_proj_with_mqa.weight"] = att.kv_a_proj_with_mqa
            out[a + "kv_a_layernorm.weight"] = att.kv_a_layernorm.weight
            out[a + "kv_b_proj.weight"] = att.kv_b_proj
            out[a + "o_proj.weight"] = att.o_proj
            out[p + "input_layernorm.weight"] = blk.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = blk.post_attention_layernorm.weight
            if not blk.is_moe:
                _mlp_views(out, p + "mlp.", blk.mlp.gate_up, blk.mlp.down)
            else:
                out[p + "mlp.gate.weight"] = blk.gate.weight
                out[p + "mlp.gate.e_score_correction_bias"] = blk.gate.e_score_correction_bias
                if cfg.n_shared_experts > 0:
                    _mlp_views(out, p + "mlp.shared_experts.", blk.shared_experts.gate_up, blk.shared_experts.down)
        if blk.is_moe:
            ex = blk.experts
            for j, e in enumerate(ex.expert_ids):
                _mlp_views(out, f"{p}mlp.experts.{e}.", ex.gate_up[j], ex.down[j])
    return out


def _mlp_views(out: dict[str, torch.Tensor], prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    width = gate_up.shape[0] // 2
    out[prefix + "gate_proj.weight"] = gate_up[:width]
    out[prefix + "up_proj.weight"] = gate_up[width:]
    out[prefix + "down_proj.weight"] = down


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _list_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"load_checkpoint: bad index {index}: {e!r}") from None
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"load_checkpoint: {index.name} names shard files that do not exist: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"load_checkpoint: no *.safetensors file in {path}")
    return files


def _short(items: list, limit: int = 20) -> str:
    items = sorted(items)
    if len(items) <= limit:
        return str(items)
    return f"{items[:limit]} ... ({len(items)} in all)"


def load_checkpoint(path: str | Path, dtype: torch.dtype | None = None, *, experts: Iterable[int] | None = None,
                    attention_side: bool = True) -> DeepseekV3:
    """Loads a Hugging Face DeepSeek-V3 checkpoint directory -> DeepseekV3 (call it on token ids [T] for logits).

    dtype: the model's dtype; None keeps the checkpoint's (router weights and the score
    correction bias stay float32 either way, as in transformers). experts / attention_side:
    load only these routed experts / none of the non-expert weights (see DeepseekV3).
    Raises CheckpointError listing missing, unexpected and mis-shaped tensors, and
    ConfigError for a config.json this model cannot run.
    """
    from safetensors import safe_open  # safetensors is needed for loading only

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"load_checkpoint: {path} is not a directory")
    if not (path / "config.json").exists():
        raise CheckpointError(f"load_checkpoint: {path} has no config.json")
    cfg = ModelConfig.from_json(path / "config.json")
    files = _list_files(path)

    # Pass 1: names and shapes only (headers), checked against the config before allocating.
    shapes = weight_shapes(cfg)
    where: dict[str, Path] = {}
    stored_dtypes: set[torch.dtype] = set()
    wrong_shape, unexpected, duplicate = [], [], []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                m = _LAYER_RE.match(name)
                if m and cfg.num_hidden_layers <= int(m.group(1)) < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
                    continue  # multi-token-prediction layers: not part of the prefill model
                if name in where:
                    duplicate.append(name)
                    continue
                where[name] = f
                want = shapes.get(name)
                if want is None:
                    if not (cfg.tie_word_embeddings and name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                sl = sf.get_slice(name)
                got = tuple(sl.get_shape())
                if got != want:
                    wrong_shape.append(f"{name}: {list(got)} (config wants {list(want)})")
                if "gate." not in name:
                    stored_dtypes.add(_dtype_of(sl.get_dtype()))
    held = [n for n, _ in _names(cfg, _expert_list(cfg, experts), attention_side)]
    missing = [n for n in held if n not in where]
    problems = []
    if missing:
        problems.append(f"missing tensors {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_short(unexpected)}")
    if wrong_shape:
        problems.append(f"wrong shapes {_short(wrong_shape)}")
    if duplicate:
        problems.append(f"tensors stored twice {_short(duplicate)}")
    if problems:
        raise CheckpointError(f"load_checkpoint({path}): " + "; ".join(problems))
    if dtype is None:
        dtype = max(stored_dtypes, key=lambda d: torch.finfo(d).bits) if stored_dtypes else torch.float32

    model = DeepseekV3(cfg, dtype, experts=experts, attention_side=attention_side)
    views = weight_views(model)
    by_file: dict[Path, list[str]] = {}
    for name in views:
        by_file.setdefault(where[name], []).append(name)
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as sf:
                for name in names:
                    views[name].copy_(sf.get_tensor(name))
    return model


def _expert_list(cfg: ModelConfig, experts: Iterable[int] | None) -> list[int]:
    if experts is None:
        return list(range(cfg.n_routed_experts))
    ids = sorted(set(int(e) for e in experts))
    bad = [e for e in ids if not 0 <= e < cfg.n_routed_experts]
    if bad:
        raise ValueError(f"load_checkpoint: expert ids {bad} out of range [0, {cfg.n_routed_experts})")
    return ids


_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _dtype_of(st_dtype: str) -> torch.dtype:
    if st_dtype not in _ST_DTYPES:
        raise CheckpointError(f"load_checkpoint: stored dtype {st_dtype!r} is not supported "
                              f"(supported: {sorted(_ST_DTYPES)}); quantized checkpoints must be dequantized first")
    return _ST_DTYPES[st_dtype]


def save_checkpoint(model: DeepseekV3, path: str | Path, max_shard_bytes: int | None = None) -> None:
    """Writes config.json and safetensors (sharded, with an index, above max_shard_bytes) in the
    published layout. The model must hold every weight (all experts, attention side)."""
    from safetensors.torch import save_file

    cfg = model.config
    if not model.attention_side or len(model.expert_ids) != cfg.n_routed_experts:
        raise ValueError("save_checkpoint: the model holds only part of the weights (experts="
                         f"{len(model.expert_ids)}/{cfg.n_routed_experts}, attention_side={model.attention_side})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg.to_json(path / "config.json")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weight_views(model).items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def random_init(config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, *,
                experts: Iterable[int] | None = None, attention_side: bool = True) -> DeepseekV3:
    """A deterministic random model for demos and tests.

    Each tensor is drawn from its own generator seeded by (seed, published name), so a
    process holding a subset of the experts gets exactly the weights the full model has.
    Linear weights ~ N(0, initializer_range), norms = 1, score-correction bias ~ U(0, 0.1)
    (non-zero, so that selection and weighting differ as in trained checkpoints).
    """
    model = DeepseekV3(config, dtype, experts=experts, attention_side=attention_side)
    with torch.no_grad():
        for name, view in weight_views(model).items():
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                view.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                view.copy_(torch.rand(view.shape, generator=g) * 0.1)
            else:
                view.copy_(torch.randn(view.shape, generator=g) * config.initializer_range)
    return model
