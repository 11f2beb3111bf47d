"""asap_comm.sim cost models: hand-computed values, monotonicity, errors, shipped data, calibrate, the placer's
linear weight, and the host probe that refuses a host disagreeing with its profile."""
import copy
import glob
import json
import math
import os
from pathlib import Path

import pytest

from asap_comm.serving.policies import LINEAR_WEIGHT
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import COMPUTE_OPS, Profile, known_profiles
from asap_comm.sim.costmodel.shapes import ModelShapes, known_presets

SIM = Path(__file__).resolve().parent.parent / "asap_comm" / "sim"

# A profile with round numbers; every expected value below is worked out by hand from it.
ROUND = {
    "name": "round",
    "cores": None,
    "hardware": {"p": {"value": 2e12, "unit": "FLOP/s", "source": "test"}},
    "dtype": {"weight_bytes": 1, "activation_bytes": 2, "dispatch_bytes": 1, "combine_bytes": 2},
    "ops": {
        "attention": {"overhead_s": 1e-6, "flops_per_s": {"gemm": 1e12, "core": 5e11}, "bytes_per_s": 1e11,
                      "n_half": 0},
        "router": {"overhead_s": 1e-6, "flops_per_s": {"gemm": 1e12}, "bytes_per_s": 1e11},
        "shared_experts": {"overhead_s": 1e-6, "flops_per_s": {"gemm": 1e12}, "bytes_per_s": 1e11},
        "dense_mlp": {"overhead_s": 1e-6, "flops_per_s": {"gemm": 1e12}, "bytes_per_s": 1e11},
        "embed": {"overhead_s": 1e-6, "flops_per_s": {}, "bytes_per_s": 1e11},
        "head": {"overhead_s": 0.0, "per_item_s": 1e-6, "flops_per_s": {"gemm": 1e12}, "bytes_per_s": 1e11},
        # 2e12 * 0.5 = 1e12 through the hardware reference
        "expert": {"overhead_s": 2e-6, "flops_per_s": {"gemm": {"peak": "p", "eff": 0.5}}, "bytes_per_s": 1e11,
                   "n_half": 16},
        "experts_batch": {"overhead_s": 5e-6},
    },
    "links": {
        "p2p": {"latency_s": 1e-5, "bytes_per_s": 1e10, "per_row_s": 0.0},
        "message": {"latency_s": 2e-5, "bytes_per_s": 1e9},
        "collective": {"latency_s": 1e-5, "latency_per_rank_s": 1e-6, "bytes_per_s": 1e10,
                       "inter_bytes_per_s": 1e9, "ranks_per_node": 4},
        "all_reduce": {"latency_s": 5e-6, "latency_per_rank_s": 1e-6},
    },
}


@pytest.fixture
def tiny():
    # tiny preset: H=64, q_lora 32, kv_lora 32, heads 4, nope 16, rope 8, v 16, moe_inter 32, E 8, k 2, vocab 128
    return CostModel(Profile(copy.deepcopy(ROUND)), ModelShapes.preset("tiny"))


def close(a, b):
    return a == pytest.approx(b, rel=1e-9, abs=1e-15)


# ----------------------------------------------------------------------------------------- hand-computed values
def test_attention_hand_computed(tiny):
    # one chunk: T=10 new tokens after C=20 cached, S=30
    # q: 64*32 + 32*4*24 = 5120; kv_a: 64*40 = 2560; kv_b: 32*4*32 = 4096; o: 4*16*64 = 4096 (15872 params)
    # gemm = 2*10*(5120+2560+4096) + 2*30*4096 = 235520 + 245760 = 481280
    # pairs = 10*20 + 10*11/2 = 255; core = 2*255*4*(24+16) = 81600
    # bytes = 15872*1 + 30*40*2 + 4*10*64*2 = 15872 + 2400 + 5120 = 23392 -> 2.3392e-7 s (< compute)
    # t = 1e-6 + 481280/1e12 + 81600/5e11 = 1e-6 + 4.8128e-7 + 1.632e-7
    assert close(tiny.attention_s([(10, 20)]), 1e-6 + 4.8128e-7 + 1.632e-7)
    assert tiny.attention_s([]) == 0.0 and tiny.attention_s([(0, 5)]) == 0.0


def test_swiglu_router_embed_head_hand_computed(tiny):
    # expert: 3*64*32 = 6144 params; 100 rows: flops 2*100*6144 = 1228800 at 1e12, times (100+16)/100
    # bytes 6144 + 2*100*64*2 = 31744 -> 3.1744e-7 (< compute)
    assert close(tiny.expert_s(100), 2e-6 + 1228800 / 1e12 * 1.16)
    # 1 row: compute 12288/1e12*17 = 2.08896e-7; bytes 6144 + 256 = 6400 -> 6.4e-8
    assert close(tiny.expert_s(1), 2e-6 + 2.08896e-7)
    assert tiny.expert_s(0) == 0.0
    # experts_s: the non-zero experts one after another + the per-batch overhead
    assert close(tiny.experts_s([0, 100, 0, 1]), tiny.expert_s(100) + tiny.expert_s(1) + 5e-6)
    assert tiny.experts_s([0, 0]) == 0.0 and tiny.experts_s([]) == 0.0
    # router, 10 tokens: flops 2*10*64*8 = 10240 -> 1.024e-8; bytes 8*64 + 10*64*2 = 1792 -> 1.792e-8 (memory)
    assert close(tiny.router_s(10), 1e-6 + 1.792e-8)
    # shared (1 x width 32) = expert params: flops 2*10*6144 = 122880 -> 1.2288e-7; bytes 6144 + 2560 -> 8.704e-8
    assert close(tiny.shared_experts_s(10), 1e-6 + 1.2288e-7)
    # dense width 96: 3*64*96 = 18432; flops 2*10*18432 = 368640 -> 3.6864e-7; bytes 18432 + 2560 -> 2.0992e-7
    assert close(tiny.dense_mlp_s(10), 1e-6 + 3.6864e-7)
    # embed: bytes 10*64*(1+2) = 1920 -> 1.92e-8
    assert close(tiny.embed_s(10), 1e-6 + 1.92e-8)
    # head, 3 sequences: per-item 3e-6; flops 2*3*64*128 = 49152 -> 4.9152e-8; bytes 8192 + 3*192*2 = 9344 -> 9.344e-8
    assert close(tiny.head_s(3), 3e-6 + 9.344e-8)
    assert tiny.head_s(0) == 0.0


def test_links_hand_computed(tiny):
    # dispatch row: 64*1 + 8*k(2) = 80 bytes; combine row: 64*2 = 128 bytes
    assert close(tiny.dispatch_s(5), 1e-5 + 400 / 1e10)
    assert close(tiny.combine_s(5), 1e-5 + 640 / 1e10)
    assert tiny.dispatch_s(0) == 0.0 and tiny.combine_s(0) == 0.0
    # within a node (4 ranks): 1e-5 + 3*1e-6 + 100*80/1e10
    assert close(tiny.all_to_all_s(100, 4), 1.3e-5 + 8e-7)
    assert close(tiny.all_to_all_s(100, 4, combine=True), 1.3e-5 + 12800 / 1e10)
    # 10 ranks, 4 per node: 3 of 9 peers on-node over 1e10, 6 of 9 off-node over 1e9 (in parallel)
    assert close(tiny.all_to_all_s(100, 10), 1e-5 + 9e-6 + max(8000 / 3 / 1e10, 8000 * 6 / 9 / 1e9))
    assert tiny.all_to_all_s(100, 1) == 0.0
    assert close(tiny.all_to_all_s(0, 4), 1.3e-5)
    assert close(tiny.all_reduce_s(8), 5e-6 + 7e-6) and tiny.all_reduce_s(1) == 0.0
    assert close(tiny.message_s(1000), 2e-5 + 1e-6)


def test_roofline_switches_to_memory_bound():
    d = copy.deepcopy(ROUND)
    d["ops"]["expert"]["bytes_per_s"] = 1e9  # 1 row: bytes 6400 -> 6.4e-6 > compute 2.08896e-7
    cm = CostModel(Profile(d), ModelShapes.preset("tiny"))
    assert close(cm.expert_s(1), 2e-6 + 6.4e-6)
    d["ops"]["expert"]["bytes_per_s"] = None  # null drops the term
    assert close(CostModel(Profile(d), ModelShapes.preset("tiny")).expert_s(1), 2e-6 + 2.08896e-7)


# ----------------------------------------------------------------------------------------- shape of the costs
@pytest.mark.parametrize("profile", ["ascend-910c-cm384", "h800-node", "local"])
def test_monotonicity(profile):
    cm = CostModel(Profile.load(profile), ModelShapes.preset("deepseek-v3" if profile != "local" else "small"))
    ts = [cm.attention_s([(T, 0)]) for T in (256, 1024, 4096, 16384)]
    assert all(b > a for a, b in zip(ts, ts[1:]))
    # quadratic in the prompt: doubling a long prompt more than doubles its attention cost
    assert cm.attention_s([(16384, 0)]) > 2.2 * cm.attention_s([(8192, 0)])
    assert cm.attention_s([(512, 4096)]) > cm.attention_s([(512, 1024)]) > cm.attention_s([(512, 0)])
    # a long prompt in two chunks costs about what it costs in one (plus per-call overheads), not less
    assert cm.attention_s([(2048, 0)]) + cm.attention_s([(2048, 2048)]) >= 0.95 * cm.attention_s([(4096, 0)])
    per_row = [cm.expert_s(n) / n for n in (1, 4, 16, 64, 256, 1024)]
    assert all(b < a for a, b in zip(per_row, per_row[1:])), per_row
    assert cm.dispatch_s(512) > cm.dispatch_s(1) > 0 and cm.combine_s(512) > cm.combine_s(1) > 0
    assert cm.all_to_all_s(256, 16) >= cm.all_to_all_s(256, 2) > 0
    for t in (cm.router_s(100), cm.shared_experts_s(100), cm.dense_mlp_s(100), cm.embed_s(100), cm.head_s(2),
              cm.all_reduce_s(4), cm.message_s(64)):
        assert t > 0 and math.isfinite(t)


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match=r"expert_s: rows=-1 must be >= 0"):
        tiny.expert_s(-1)
    with pytest.raises(TypeError, match="expert_s: rows must be an int"):
        tiny.expert_s(1.5)
    with pytest.raises(ValueError, match=r"attention_s: chunk 0 = \(1,\) must be a \(new_tokens, cached_tokens\)"):
        tiny.attention_s([(1,)])
    with pytest.raises(ValueError, match="attention_s: chunk 1 cached_tokens=-3"):
        tiny.attention_s([(1, 0), (2, -3)])
    with pytest.raises(TypeError, match="attention_s: chunks must be a sequence"):
        tiny.attention_s(5)
    with pytest.raises(ValueError, match="all_to_all_s: ranks=0 must be >= 1"):
        tiny.all_to_all_s(1, 0)
    with pytest.raises(ValueError, match=r"experts_s: rows_per_expert\[1\]=-2"):
        tiny.experts_s([1, -2])
    with pytest.raises(ValueError, match="dispatch_s: rows=-1"):
        tiny.dispatch_s(-1)
    with pytest.raises(TypeError, match="CostModel: profile must be a Profile"):
        CostModel({}, ModelShapes.preset("tiny"))


# ----------------------------------------------------------------------------------------- profile loading
def _write(tmp_path, d, name="p.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["ops"]["expert"].pop("overhead_s"), "ops.expert.overhead_s"),
    (lambda d: d["ops"].pop("router"), "ops.router"),
    (lambda d: d["ops"]["attention"]["flops_per_s"].pop("core"), "ops.attention.flops_per_s.core"),
    (lambda d: d["ops"]["expert"]["flops_per_s"]["gemm"].update(eff=1.5), "ops.expert.flops_per_s.gemm.eff"),
    (lambda d: d["ops"]["expert"]["flops_per_s"]["gemm"].update(peak="nope"), "ops.expert.flops_per_s.gemm.peak"),
    (lambda d: d["links"]["p2p"].update(latency_s=-1), "links.p2p.latency_s"),
    (lambda d: d["links"]["collective"].update(inter_bytes_per_s="fast"), "links.collective.inter_bytes_per_s"),
    (lambda d: d["dtype"].update(weight_bytes=0), "dtype.weight_bytes"),
    (lambda d: d.update(cores=0), "cores"),
    (lambda d: d.pop("links"), "links"),
])
def test_profile_errors_name_file_and_field(tmp_path, mutate, field):
    d = copy.deepcopy(ROUND)
    mutate(d)
    p = _write(tmp_path, d)
    with pytest.raises(ValueError) as e:
        Profile.load(str(p))
    assert str(p) in str(e.value) and f"'{field}" in str(e.value), str(e.value)


def test_profile_load_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown profile 'nope' \(known: \["):
        Profile.load("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match=f"Profile {bad}: invalid JSON"):
        Profile.load(bad)
    with pytest.raises(ValueError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


# ----------------------------------------------------------------------------------------- shipped data
def test_preset_configs_equal_the_models_presets():
    from asap_models.config import PRESETS, preset

    assert sorted(PRESETS) == known_presets()
    for name in PRESETS:
        shipped = json.loads((SIM / "models" / f"{name}.json").read_text())
        assert shipped == json.loads(json.dumps(preset(name).to_hf_dict())), name
        cfg, s = preset(name), ModelShapes.preset(name)
        assert (s.hidden, s.num_layers, s.num_moe_layers, s.num_experts, s.top_k, s.moe_inter, s.dense_inter,
                s.n_shared, s.heads, s.q_lora_rank, s.kv_lora_rank, s.qk_nope, s.qk_rope, s.v_head, s.vocab) == (
            cfg.hidden_size, cfg.num_hidden_layers, cfg.num_moe_layers, cfg.n_routed_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.intermediate_size, cfg.n_shared_experts, cfg.num_attention_heads,
            cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
            cfg.vocab_size)
        assert s.moe_layers == tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_model_shapes_load(tmp_path):
    from asap_models.config import preset

    with pytest.raises(ValueError, match=r"unknown model preset 'nope' \(known: \['deepseek-v3', 'small', 'tiny'\]\)"):
        ModelShapes.preset("nope")
    ck = tmp_path / "ck"
    ck.mkdir()
    preset("small").to_json(ck / "config.json")
    assert ModelShapes.load(str(ck)).hidden == 512
    assert ModelShapes.load(ck / "config.json").num_experts == 32
    assert ModelShapes.load("tiny").hidden == 64
    d = preset("tiny").to_hf_dict()
    del d["q_lora_rank"]
    assert ModelShapes.from_hf_config(d).q_lora_rank == 1536  # transformers' default
    d["q_lora_rank"] = None
    assert ModelShapes.from_hf_config(d).q_lora_rank is None
    del d["hidden_size"]
    with pytest.raises(ValueError, match=r"missing keys \['hidden_size'\]"):
        ModelShapes.from_hf_config(d)
    with pytest.raises(ValueError, match="neither a model preset"):
        ModelShapes.load(str(tmp_path / "nothing"))


def test_shipped_profiles_load_with_sources():
    assert {"local", "ascend-910c-cm384", "h800-node"} <= set(known_profiles())
    for name in ("ascend-910c-cm384", "h800-node"):
        d = json.loads((SIM / "profiles" / f"{name}.json").read_text())
        p = Profile.load(name)
        assert p.cores is None and p.name == name
        for key, fig in d["hardware"].items():
            assert fig["source"] and fig["value"] > 0, key
        for op in COMPUTE_OPS:
            assert d["ops"][op]["source"], op
            for c, rate in d["ops"][op]["flops_per_s"].items():
                assert rate["source"] and 0 < rate["eff"] <= 1, (op, c)
        desc = CostModel(p, ModelShapes.preset("deepseek-v3")).describe()
        assert set(desc["ops"]) == set(COMPUTE_OPS) and desc["cores"] is None
    local = Profile.load("local")
    assert isinstance(local.cores, int) and local.cores >= 1
    assert json.loads((SIM / "profiles" / "local.json").read_text())["fit"]["median_abs_rel_error"] < 0.5


def _dsv3_attention_flops(T):
    # DeepSeek-V3, one 4k prompt: q 7168*1536 + 1536*128*192; kv_a 7168*576; kv_b 512*128*256; o 128*128*7168
    gemm = 2 * T * (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 128 * 128 * 7168) + 2 * T * 512 * 128 * 256
    core = 2 * (T * (T + 1) / 2) * 128 * (192 + 128)
    return gemm, core


@pytest.mark.parametrize("name, gemm_peak, core_peak, hbm", [
    ("ascend-910c-cm384", 752e12, 376e12, 1.6e12),  # per die: INT8, BF16, HBM
    ("h800-node", 1979e12, 989e12, 3.35e12),        # FP8, BF16, HBM3
])
def test_deepseek_v3_numbers_are_plausible(name, gemm_peak, core_peak, hbm):
    cm = CostModel(Profile.load(name), ModelShapes.preset("deepseek-v3"))
    # one attention layer, one 4k-token prompt: at least the time at 100% of peak, at most 5x that
    gemm, core = _dsv3_attention_flops(4096)
    floor = gemm / gemm_peak + core / core_peak
    t = cm.attention_s([(4096, 0)])
    assert floor < t < 5 * floor, (t, floor)
    assert 1e-3 < t < 2e-2  # milliseconds, as a sanity range
    # one routed expert on 256 rows: 2*256*3*7168*2048 flops, 3*7168*2048 one-byte weights read
    flops, wbytes = 2 * 256 * 3 * 7168 * 2048, 3 * 7168 * 2048
    floor = max(flops / gemm_peak, wbytes / hbm)
    t = cm.expert_s(256)
    assert floor < t < 5 * floor, (t, floor)
    # dispatching 512 tokens' rows (7 kB each) to one rank: tens to hundreds of microseconds
    assert 1e-5 < cm.dispatch_s(512) < 1e-3


# ----------------------------------------------------------------------------------------- calibrate
@pytest.mark.slow
def test_calibrate_quick_tiny(validate_calibrated_tiny):
    """A quick calibration of this host for the tiny model: what ``validate --calibrate`` wrote (it calls
    ``calibrate(out, "tiny", quick=True)``; the session runs that command once, see ``conftest.py``)."""
    p, out, before, t0 = validate_calibrated_tiny
    assert p.returncode == 0, p.stderr[-3000:]
    prof = Profile.load(out / "profile_local.json")  # the same schema as the shipped profiles
    assert isinstance(prof, Profile) and prof.name == "local" and prof.cores == os.cpu_count()
    d = json.loads((out / "profile_local.json").read_text())
    assert set(COMPUTE_OPS) | {"experts_batch"} <= set(d["ops"])
    assert {"p2p", "message", "collective", "all_reduce"} <= set(d["links"])
    assert d["memory"]["hbm_gb"] >= 1  # a recalibrated profile keeps its memory block (checked, not "unknown")
    cal = json.loads((out / "calibration.json").read_text())
    ops = {"attention", "router", "shared_experts", "dense_mlp", "expert", "embed", "head", "p2p_round_trip",
           "all_to_all", "all_reduce"}
    assert ops <= set(cal["points"])
    for op in ops:
        for p_ in cal["points"][op]:
            assert p_["seconds"] > 0 and math.isfinite(p_["predicted"]) and p_["rel_error"] is not None
    assert math.isfinite(cal["fit"]["median_abs_rel_error"])
    cm = CostModel(prof, ModelShapes.preset("tiny"))
    assert cm.expert_s(64) > 0 and cm.attention_s([(64, 0)]) > 0
    left = set(glob.glob("/dev/shm/asap-*")) - before
    left = {f for f in left if os.path.getmtime(f) >= t0}  # a concurrent run's files are not ours to judge
    assert not left, f"leftover shared-memory segments: {sorted(left)}"


def test_sim_cost_modules_import_no_models():
    import subprocess
    import sys

    code = ("import sys, asap_comm.sim.costmodel.shapes, asap_comm.sim.costmodel.costs, asap_comm.sim.calibrate.host; "
            "bad = [m for m in sys.modules if m == 'models' or m.startswith(('models.', 'asap_models'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ----------------------------------------------------------------------------- the placer's linear weight from the cost model
def test_placer_linear_weight_from_the_cost_model():
    w910 = CostModel.load("ascend-910c-cm384", "deepseek-v3").placer_linear_weight()
    wh800 = CostModel.load("h800-node", "deepseek-v3").placer_linear_weight()
    wsmall = CostModel.load("local", "small").placer_linear_weight()
    # deepseek-v3's per-token linear work is thousands of query-key pairs (its projections alone: ~340 MFLOP a
    # token against 82 kFLOP a pair), several times the old constant
    assert 3 * LINEAR_WEIGHT < w910 < 20 * LINEAR_WEIGHT and 3 * LINEAR_WEIGHT < wh800 < 20 * LINEAR_WEIGHT
    assert 0 < wsmall < w910
    # tensor parallelism splits the core by heads but replicates the down-projections: the weight grows with tp
    c = CostModel.load("ascend-910c-cm384", "deepseek-v3")
    assert c.placer_linear_weight(1) < c.placer_linear_weight(2) < c.placer_linear_weight(8)
    with pytest.raises(ValueError, match="tp=3"):
        c.placer_linear_weight(3)


# ----------------------------------------------------------------------------- the host probe (local regime): a host that disagrees with its profile is refused
def _fitted_here(tmp_path, probe=None):
    """The committed local profile, marked as fitted on this host (its fingerprint matches)."""
    from asap_comm.sim.calibrate.host import host_fingerprint
    from asap_comm.sim.costmodel.hardware import Profile

    data = dict(Profile.load("local").data)
    data["fit"] = {**(data.get("fit") or {}), "host_fingerprint": host_fingerprint()}
    if probe is not None:
        data["probe"] = probe
    path = tmp_path / "profile_here.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_probe_verdict_catches_a_host_twice_as_slow(tmp_path):
    from asap_comm.sim.calibrate.probe import probe_verdict
    from asap_comm.sim.costmodel.hardware import Profile

    shapes = ModelShapes.load("small")
    ref = {"swiglu": {"16": 1e-4, "256": 2e-3}, "p2p": {"1": 1e-4, "256": 4e-4}}
    prof = Profile.load(_fitted_here(tmp_path, probe=ref))
    same = probe_verdict({k: {n: 1.1 * t for n, t in v.items()} for k, v in ref.items()}, prof, shapes)
    assert same["agrees"] and same["reason"] is None and "recorded" in same["reference"]
    slow = probe_verdict({"swiglu": {n: 2 * t for n, t in ref["swiglu"].items()}, "p2p": ref["p2p"]}, prof, shapes)
    assert not slow["agrees"] and "swiglu" in slow["worst"] and "2.00x" in slow["reason"]
    # without a recorded probe: the profile's own predictions are the reference
    cm = CostModel(Profile.load("local"), shapes)
    pred = probe_verdict({"swiglu": {"256": cm.expert_s(256)}}, Profile.load("local"), shapes)
    assert pred["agrees"] and pred["ratios"] == {"swiglu 256": pytest.approx(1.0)}
    with pytest.raises(ValueError, match="tolerance"):
        probe_verdict(ref, prof, shapes, tolerance=1.0)


def test_probe_host_times_the_operators():
    from asap_comm.sim.calibrate.probe import probe_host

    m = probe_host(ModelShapes.load("small"), p2p=False, reps=3)
    assert set(m["swiglu"]) == {"16", "256"} and all(t > 0 for t in m["swiglu"].values())
    assert m["swiglu"]["256"] > m["swiglu"]["16"]  # 16x the rows: more work, whatever the host


def test_validate_refuses_a_host_that_disagrees(tmp_path, monkeypatch):
    import asap_comm.sim.calibrate.probe as probe
    from asap_comm.sim.calibrate.validate import validate

    ref = {"swiglu": {"16": 1e-4, "256": 2e-3}, "p2p": {"1": 1e-4, "256": 4e-4}}
    path = _fitted_here(tmp_path, probe=ref)
    monkeypatch.setattr(probe, "probe_host", lambda shapes, **kw: {
        "swiglu": {n: 2.5 * t for n, t in ref["swiglu"].items()}, "p2p": ref["p2p"], "wall_s": 0.1})
    with pytest.raises(ValueError, match="disagrees with the profile.*swiglu.*2.50x"):
        validate(tmp_path / "v", profile=path, recalibrate=False, progress=False)
