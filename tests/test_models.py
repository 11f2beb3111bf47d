"""The reference model (models/) against transformers' DeepseekV3ForCausalLM, and its stages.

Every checkpoint here is tiny and built in the test: no model hub.
Legend: T = tokens, H = hidden, E = routed experts, k = experts per token.
"""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

try:  # `python -m pytest` from the repository root
    import models as M
except ImportError:  # installed only
    import asap_models as M


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


# A tiny DeepSeek-V3 in transformers' own config; variants override some fields.
BASE = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3,
    n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
    kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
    max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
ROPE_PLAIN = {"rope_type": "default", "rope_theta": 5000.0}
VARIANTS = {
    "base": {},
    "no_q_lora_dense0": dict(q_lora_rank=None, first_k_dense_replace=0),
    "one_group_dense2_no_yarn_no_norm": dict(n_group=1, topk_group=1, first_k_dense_replace=2, norm_topk_prob=False,
                                             num_hidden_layers=4, rope_parameters=ROPE_PLAIN),
    "groups2of2_not_interleaved_tied": dict(n_group=2, topk_group=2, rope_interleave=False, tie_word_embeddings=True,
                                            n_shared_experts=2, routed_scaling_factor=1.0),
    "groups4of1_yarn_mscale_only": dict(n_group=4, topk_group=1, num_experts_per_tok=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 0.0, "beta_fast": 16, "beta_slow": 2}),
    "yarn_no_mscale_q_lora_none": dict(q_lora_rank=None, n_routed_experts=16, n_group=8, topk_group=3, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale_all_dim": 0.8, "truncate": False}),
}


def make_hf(tmp_path, seed: int = 0, **overrides) -> tuple[DeepseekV3ForCausalLM, str]:
    """A random transformers DeepseekV3ForCausalLM (non-zero correction bias, non-unit norms), saved to tmp_path."""
    torch.manual_seed(seed)
    kw = dict(BASE, **overrides)
    kw["rope_parameters"] = dict(kw["rope_parameters"])  # transformers edits it in place
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**kw)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(kw["n_routed_experts"]) * 0.3)
    path = tmp_path / "ckpt"
    hf.save_pretrained(path)
    return hf, str(path)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers(tmp_path, variant):
    hf, path = make_hf(tmp_path, seed=len(variant), **VARIANTS[variant])
    model = M.load_checkpoint(path)
    ids = torch.randint(0, BASE["vocab_size"], (41,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    out = model.prefill(ids)
    assert out.logits.shape == (41, BASE["vocab_size"])
    assert rel_err(out.logits, ref.logits[0]) < 1e-5
    # transformers' hidden_states: embeddings, each layer's output, but the last one after the final norm
    assert len(out.hidden_states) == len(ref.hidden_states)
    for mine, theirs in zip(out.hidden_states[:-1], ref.hidden_states[:-1]):
        assert rel_err(mine, theirs[0]) < 1e-5
    assert rel_err(out.final_hidden, ref.hidden_states[-1][0]) < 1e-5
    assert torch.equal(model(ids), out.logits)

    # the router picks the same experts with the same weights, and the bias changed some choices
    cfg = model.config
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        x = out.hidden_states[layer]
        mlp_in = model.attention_stage(layer, x).mlp_input
        routing = model.route(layer, mlp_in)
        _, w_ref, ids_ref = hf.model.layers[layer].mlp.gate(mlp_in[None])
        mine_sorted, order = routing.topk_ids.sort(-1)
        ref_sorted, ref_order = ids_ref.sort(-1)
        assert torch.equal(mine_sorted, ref_sorted)
        assert rel_err(routing.topk_weights.gather(1, order), w_ref.gather(1, ref_order)) < 1e-6
        assert routing.topk_weights.dtype == torch.float32 and routing.topk_ids.dtype == torch.int64


def test_bias_is_used_for_selection_only(tmp_path):
    model = M.random_init(M.preset("tiny"), seed=3)
    layer = model.config.first_k_dense_replace
    x = torch.randn(64, model.config.hidden_size)
    gate = model.layers[layer].gate
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
        gate.e_score_correction_bias[5] = 10.0  # expert 5 always chosen ...
    routing = model.route(layer, x)
    assert (routing.topk_ids == 5).any(-1).all()
    scores = torch.sigmoid(x @ gate.weight.T)  # ... but weighted by its unbiased score
    raw = scores.gather(1, routing.topk_ids)
    expected = raw / raw.sum(-1, keepdim=True) * model.config.routed_scaling_factor
    assert torch.allclose(routing.topk_weights, expected, rtol=1e-6, atol=0)


def test_bf16_run(tmp_path):
    hf, path = make_hf(tmp_path)
    # bf16 rounding flips near-tie routing choices (in transformers as here), and a flipped token
    # changes all later ones through attention; a bias spread far apart fixes every choice
    with torch.no_grad():
        for layer in hf.model.layers[BASE["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randperm(BASE["n_routed_experts"]).float() * 2)
    hf.save_pretrained(path)
    model = M.load_checkpoint(path, dtype=torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert model.layers[1].gate.weight.dtype == torch.float32  # router stays float32, as in transformers
    ids = torch.arange(30) % BASE["vocab_size"]
    logits = model(ids)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    hf16 = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref16, ref32 = hf16(ids[None]).logits[0], hf(ids[None]).logits[0]
    assert rel_err(logits, ref16) < 3e-2 and rel_err(logits, ref32) < 3e-2


@pytest.mark.parametrize("chunks", [[1, 46], [16, 16, 15], [5] * 9 + [2], [40, 7]])
def test_chunked_prefill_equals_whole(chunks):
    model = M.random_init(M.preset("tiny"), seed=5)
    ids = torch.randint(0, model.config.vocab_size, (sum(chunks),), generator=torch.Generator().manual_seed(2))
    whole = model.prefill(ids)
    cache = model.new_cache()
    parts, start = [], 0
    for n in chunks:
        parts.append(model.prefill(ids[start:start + n], cache))
        start += n
    assert cache.length() == len(ids)
    assert rel_err(torch.cat([p.logits for p in parts]), whole.logits) < 1e-5
    for layer in range(model.config.num_hidden_layers + 1):
        got = torch.cat([p.hidden_states[layer] for p in parts])
        assert rel_err(got, whole.hidden_states[layer]) < 1e-5


def test_stage_composition_is_exact(tmp_path):
    """Attention side and two expert-only holders (even / odd experts), run stage by stage as the
    runtime does, give bit-identical logits to the reference forward."""
    path = tmp_path / "ck"
    full = M.random_init(M.preset("tiny"), seed=7)
    M.save_checkpoint(full, path)
    cfg = full.config
    attn = M.load_checkpoint(path, experts=[])
    holders = [M.load_checkpoint(path, experts=range(r, cfg.n_routed_experts, 2), attention_side=False)
               for r in (0, 1)]
    owner = {e: holders[e % 2] for e in range(cfg.n_routed_experts)}
    ids = torch.randint(0, cfg.vocab_size, (33,), generator=torch.Generator().manual_seed(3))

    h = attn.embed(ids)
    for layer in range(cfg.num_hidden_layers):
        a = attn.attention_stage(layer, h)
        if not cfg.is_moe_layer(layer):
            h = a.hidden + attn.dense_mlp(layer, a.mlp_input)
            continue
        r = attn.route(layer, a.mlp_input)
        routed = torch.zeros_like(a.mlp_input)
        for e in range(cfg.n_routed_experts):  # dispatch: each expert gets its tokens, weighted results come back
            token, slot = (r.topk_ids == e).nonzero(as_tuple=True)
            if len(token):
                routed.index_add_(0, token, owner[e].expert(layer, e, a.mlp_input[token], r.topk_weights[token, slot]))
        h = a.hidden + (routed + attn.shared_experts(layer, a.mlp_input))
    assert torch.equal(attn.head(h), full(ids))

    # partial sums over each holder's experts add up to the full routed output
    layer = cfg.first_k_dense_replace
    x = torch.randn(20, cfg.hidden_size)
    r = full.route(layer, x)
    parts = sum(hd.routed_experts(layer, x, r, local_only=True) for hd in holders)
    assert rel_err(parts, full.routed_experts(layer, x, r)) < 1e-6
    with pytest.raises(KeyError, match="routed expert 1 is not held"):
        holders[0].expert(layer, 1, x)
    with pytest.raises(RuntimeError, match="routed experts only"):
        holders[0].attention_stage(0, x)
    with pytest.raises(ValueError, match="dense layer"):
        full.route(0, x)
    with pytest.raises(ValueError, match=r"attention_stage: hidden must have shape \[T, H=64\], got \[20, 65\]"):
        full.attention_stage(0, torch.zeros(20, 65))
    with pytest.raises(ValueError, match=r"expert: weights must have shape \[N\]=\[20\]"):
        full.expert(layer, 0, x, torch.ones(3))
    with pytest.raises(ValueError, match="token ids must lie in"):
        full(torch.tensor([0, cfg.vocab_size]))


def test_random_init_deterministic_and_subset_consistent():
    cfg = M.preset("tiny")
    a, b = M.random_init(cfg, seed=11), M.random_init(cfg, seed=11)
    ids = torch.arange(12)
    assert torch.equal(a(ids), b(ids))
    assert not torch.equal(a(ids), M.random_init(cfg, seed=12)(ids))
    sub = M.random_init(cfg, seed=11, experts=[6, 2], attention_side=False)
    assert sub.expert_ids == (2, 6)
    x = torch.randn(5, cfg.hidden_size)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        assert torch.equal(sub.expert(layer, 6, x), a.expert(layer, 6, x))


def test_sharded_and_roundtrip(tmp_path):
    hf, path = make_hf(tmp_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = torch.arange(20)
    ref = M.load_checkpoint(path)(ids)
    assert torch.equal(M.load_checkpoint(sharded)(ids), ref)
    ours = tmp_path / "ours"
    M.save_checkpoint(M.load_checkpoint(sharded), ours, max_shard_bytes=30_000)
    assert len(list(ours.glob("*.safetensors"))) > 1
    assert torch.equal(M.load_checkpoint(ours)(ids), ref)
    # transformers reads what we write
    hf2 = DeepseekV3ForCausalLM.from_pretrained(ours, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(ref, hf2(ids[None]).logits[0]) < 1e-5


def _rewrite(path, drop=(), change=None, add=None):
    f = path / "model.safetensors"
    sd = load_file(f)
    for k in drop:
        del sd[k]
    for k, v in (change or {}).items():
        sd[k] = v
    sd.update(add or {})
    save_file(sd, f)


def test_bad_checkpoints(tmp_path):
    full = M.random_init(M.preset("tiny"), seed=1)
    path = tmp_path / "ck"
    M.save_checkpoint(full, path)
    _rewrite(path, drop=["model.layers.2.mlp.experts.3.up_proj.weight", "model.norm.weight"],
             change={"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(7, 7)},
             add={"model.layers.1.mlp.experts.99.up_proj.weight": torch.zeros(1)})
    with pytest.raises(M.CheckpointError) as err:
        M.load_checkpoint(path)
    msg = str(err.value)
    for s in ("missing tensors", "model.layers.2.mlp.experts.3.up_proj.weight", "model.norm.weight",
              "unexpected tensors", "model.layers.1.mlp.experts.99.up_proj.weight", "wrong shapes",
              "model.layers.1.self_attn.kv_b_proj.weight: [7, 7]"):
        assert s in msg, (s, msg)

    M.save_checkpoint(full, path)
    cfg_file = path / "config.json"
    good = json.loads(cfg_file.read_text())
    for change, expect in [
        ({"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
        ({"frobnicate": 1}, "unknown keys ['frobnicate']"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "dequantize"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1.0}}, "rope_type='llama3'"),
        ({"qk_head_dim": 5}, "qk_head_dim=5"),
        ({"hidden_size": None}, "hidden_size=None"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be a bool"),
    ]:
        cfg_file.write_text(json.dumps(dict(good, **change)))
        with pytest.raises(M.ConfigError, match="config.json") as err:
            M.load_checkpoint(path)
        assert expect in str(err.value)
    cfg_file.write_text(json.dumps({k: v for k, v in good.items() if k != "kv_lora_rank"}))
    with pytest.raises(M.ConfigError, match=r"missing keys \['kv_lora_rank'\]"):
        M.load_checkpoint(path)
    cfg_file.write_text(json.dumps(good))
    (path / "model.safetensors").unlink()
    with pytest.raises(M.CheckpointError, match=r"no \*\.safetensors"):
        M.load_checkpoint(path)
    with pytest.raises(M.CheckpointError, match="not a directory"):
        M.load_checkpoint(path / "nope")


def test_published_config_and_presets():
    published = {  # DeepSeek-V3's config.json as published (quantization_config and auto_map left out)
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
        "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
    }
    cfg = M.ModelConfig.from_hf_dict(published)
    assert cfg == M.preset("deepseek-v3")
    # an absent key means what it means to transformers
    sparse = {k: v for k, v in published.items() if k not in (
        "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "q_lora_rank",
        "n_shared_experts", "rope_scaling", "rope_theta")}
    hf_cfg = DeepseekV3Config(**sparse)
    ours = M.ModelConfig.from_hf_dict(sparse)
    for key in ("n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor",
                "q_lora_rank", "n_shared_experts", "rope_interleave"):
        assert getattr(ours, key) == getattr(hf_cfg, key), key
    assert (ours.rope_type, ours.rope_theta) == (hf_cfg.rope_parameters["rope_type"], hf_cfg.rope_parameters["rope_theta"])
    assert M.ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # DeepSeek-V3's model card: 671B main-model parameters (685B with the MTP module), 37B activated
    assert 670.5e9 < cfg.num_parameters() < 671.5e9
    assert 37e9 < cfg.num_active_parameters() < 38e9  # "37B activated"
    assert math.isclose(cfg.softmax_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    for name in ("tiny", "small"):
        c = M.preset(name)
        assert M.ModelConfig.from_hf_dict(c.to_hf_dict()) == c
        assert DeepseekV3Config(**{k: v for k, v in c.to_hf_dict().items() if k != "architectures"})
    with pytest.raises(M.ConfigError, match="unknown name 'huge'"):
        M.preset("huge")
    with pytest.raises(M.ConfigError, match="topk_group=5 > n_group=4"):
        M.preset("tiny", topk_group=5)


def test_package_layout():
    """models/ needs torch (and safetensors) only, imports itself relatively, and is installed as asap_models."""
    import importlib
    import re
    from pathlib import Path

    src = Path(M.__file__).parent
    for f in src.glob("*.py"):
        text = f.read_text()
        bad = re.findall(r"^\s*(?:from|import)\s+(?:models|asap_models)\b", text, flags=re.M)
        assert not bad, f"{f.name}: absolute self-import {bad}"
        for mod in re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", text, flags=re.M):
            assert mod in {"torch", "safetensors", "__future__", "dataclasses", "json", "math", "re", "zlib",
                           "pathlib", "typing"}, f"{f.name} imports {mod}"
    installed = importlib.import_module("asap_models")
    assert callable(installed.load_checkpoint) and set(installed.__all__) == set(M.__all__)
