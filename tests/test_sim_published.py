"""``validate --regime published``: published figures, their sources and deployments, against the simulator."""
import json

import pytest

from asap_comm.serving.traces import Request
from asap_comm.sim.calibrate import published as P
from asap_comm.sim.calibrate import published_afd as PA
from asap_comm.sim.calibrate.target import TARGET
from asap_comm.sim.calibrate.validate import main as validate_main
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies.grids import mooncake_path


def test_every_figure_has_a_source_a_deployment_and_a_value():
    keys = [f.key for f in P.FIGURES]
    assert len(keys) == len(set(keys))
    kinds = {f.kind for f in P.FIGURES}
    assert {"solo_ttft", "fixed_batch", "capacity_ratio", "throughput_per_npu"} <= kinds
    for f in P.FIGURES:
        assert f.source.strip() and ("https://" in f.source or "arXiv" in f.source), f.key
        assert f.value > 0 and f.unit, f.key
        for name in f.deployment.split(" vs "):
            d = P.DEPLOYMENTS[name]
            assert d.dies > 0 and d.split and d.stack and d.model and d.dtype
            devices = d.sync_ranks * d.sync_tp if d.mode == "sync" else d.attention_ranks * d.attention_tp + d.expert_ranks
            assert devices == d.dies, name  # the split adds up to the published die count
    # the figures are there, with the published values
    by = {f.key: f for f in P.FIGURES}
    assert by["solo_63778_baseline"].value == 31.75 and by["solo_63778_afd"].value == 27.93
    assert by["batch_32k_baseline"].value == 10.010 and by["batch_32k_afd"].value == 7.058
    assert by["capacity_ratio"].value == 1.68 and by["cloudmatrix_prefill_per_npu"].value == 6688
    assert sum(by["batch_32k_afd"].params["prompt_lens"]) == 30857


def test_relative_error():
    assert P.relative_error(12.0, 10.0) == pytest.approx(0.2)
    assert P.relative_error(8.0, 10.0) == pytest.approx(-0.2)
    assert P.relative_error(None, 10.0) is None
    with pytest.raises(ValueError, match="published value"):
        P.relative_error(1.0, 0.0)


def test_stack_profile_applies_its_overrides_and_names_bad_ones(tmp_path):
    base = Profile.load("ascend-910c-cm384")
    eager = P.stack_profile("ascend-910c-cm384", "vllm-ascend-eager")
    overrides = base.data["stacks"]["vllm-ascend-eager"]["overrides"]
    assert overrides and base.data["stacks"]["vllm-ascend-eager"]["source"]
    assert eager.data["ops"]["attention"]["flops_per_s"]["gemm"]["eff"] == overrides["ops.attention.flops_per_s.gemm.eff"]
    assert eager.ops["attention"].s_per_flop["gemm"] > base.ops["attention"].s_per_flop["gemm"]
    assert P.stack_profile("ascend-910c-cm384", "cloudmatrix-infer").data == base.data
    with pytest.raises(ValueError, match="no stack 'nope'"):
        P.stack_profile("ascend-910c-cm384", "nope")
    bad = json.loads(json.dumps(base.data))
    bad["stacks"]["vllm-ascend-eager"]["overrides"] = {"ops.attention.no_such.eff": 0.1}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="ops.attention.no_such.eff"):
        P.stack_profile(str(path), "vllm-ascend-eager")


def test_pinned_batch_runs_on_one_group():
    shapes = ModelShapes.load("deepseek-v3")
    cost = CostModel(P.stack_profile("ascend-910c-cm384", "vllm-ascend-eager"), shapes)
    dep = P.DEPLOYMENTS["afd-baseline-dp4tp8"]
    reqs = [Request(i, 0.0, 4000) for i in range(8)]
    spread = max(r.ttft_s for r in P._run(dep, reqs, cost, shapes))
    pinned = max(r.ttft_s for r in P._run(dep, reqs, cost, shapes, pinned=True))
    assert pinned > 2 * spread  # 8 requests on one DP group, not two on each of four


def test_quick_table_reports_every_figure_with_source_and_deployment(tmp_path):
    res = P.validate_published(tmp_path, configs="quick", progress=False)
    written = json.loads((tmp_path / "validation_published.json").read_text())
    assert written["rows"] == json.loads(json.dumps(res["rows"], default=str))
    quick = [f for f in P.FIGURES if f.quick]
    assert [r["key"] for r in res["rows"]] == [f.key for f in quick]
    assert any(r["kind"] == "solo_ttft" for r in res["rows"])
    for r in res["rows"]:
        assert r["source"] and r["deployments"] and r["deployments"][0]["dies"] > 0
        assert r["sim"] is not None and r["sim"] > 0
        assert r["relative_error"] == pytest.approx((r["sim"] - r["published"]) / r["published"])
        assert r["within_target"] == (abs(r["relative_error"]) <= res["target_abs_relative_error"])
    fitted = [r for r in res["rows"] if r["fitted"]]
    assert res["fitted"]["compared"] == len(fitted)
    assert res["held_out"]["compared"] == len(res["rows"]) - len(fitted)
    assert res["stacks"]["vllm-ascend-eager"]["overrides"]
    # the calibrated profile: the solo 63.8k TTFTs within the target (before calibration: -61% and -55%)
    by = {r["key"]: r for r in res["rows"]}
    assert by["solo_63778_baseline"]["within_target"] and by["solo_63778_afd"]["within_target"]


def test_cli(tmp_path, capsys):
    assert validate_main(["--regime", "published", "--configs", "quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "solo_63778_baseline" in out and "within" in out and "validation_published.json" in out
    assert validate_main(["--regime", "published", "--configs", "nope", "--out", str(tmp_path)]) == 2
    assert "configs='nope'" in capsys.readouterr().err


def test_the_capacity_window_matches_the_published_screening_window():
    assert mooncake_path() is not None, "the Mooncake trace ships with the package"
    import collections
    import statistics

    t = PA.afd_screening_window(128)
    assert len(t) == 128 and t[0].arrival_s == 0.0
    assert abs(sum(r.prompt_len for r in t) / 1340915 - 1) < 0.05
    assert abs(statistics.median(r.prompt_len for r in t) / 6702.5 - 1) < 0.05
    assert max(r.prompt_len for r in t) <= 63778
    assert max(collections.Counter(r.arrival_s for r in t).values()) == 20  # the published 20-request burst
    assert t[-1].arrival_s == pytest.approx(33.0)
    with pytest.raises(ValueError, match="num_requests=4"):
        P.validate_published("unused", num_requests=4, progress=False)


# ----------------------------------------------------------------------------- afd-plugin async-prefill rows
AFD_ASYNC = ("v4flash_", "v32r_")


def test_afd_async_figures_carry_the_published_values_and_recipes():
    by = {f.key: f for f in P.FIGURES}
    assert [by[f"v4flash_gain_{x}x"].value for x in ("1", "1.25", "1.5")] == [1.048, 1.066, 1.086]
    assert by["v4flash_p99_ratio_1x"].value == pytest.approx(1 - 0.221)
    assert (by["v4flash_slo10_baseline"].value, by["v4flash_slo10_afd"].value) == (0.652, 0.852)
    assert (by["v32r_median_baseline_12rps"].value, by["v32r_median_afd_12rps"].value) == (15.1, 8.0)
    for f in P.FIGURES:
        if f.key.startswith("v4flash_"):
            assert "deepseek_v4_flash/README.md" in f.source and "issues/227" in f.source
        if f.key.startswith("v32r_"):
            assert "deepseek_v3_2/README.md" in f.source
    afd = P.DEPLOYMENTS[PA.V4A]
    assert (afd.attention_ranks, afd.attention_tp, afd.expert_ranks, afd.dies) == (4, 2, 8, 16)
    assert len(PA.V4B.split(" vs ")) >= 2  # the best of several baseline layouts, as the recipe compares
    for name in ("v32r-baseline-dp4pcp8", "v32r-afd-dp3pcp8-ep8"):
        sh = ModelShapes.from_hf_config(json.loads((PA._PUBLISHED_MODELS / f"{P.DEPLOYMENTS[name].shapes}.json")
                                                   .read_text()))
        assert (sh.num_layers, sh.num_moe_layers) == (10, 7)  # "3 dense layers and 7 MoE layers"
    v4 = ModelShapes.from_hf_config(json.loads((PA._PUBLISHED_MODELS / "deepseek-v4-flash.json").read_text()))
    assert (v4.num_layers, v4.num_moe_layers, v4.hidden, v4.num_experts, v4.top_k, v4.moe_inter, v4.heads) == (
        43, 43, 4096, 256, 6, 2048, 64)


def test_hybrid_sparse_attention_cost():
    assert all(PA._sum_min(a, b, w) == sum(min(q, w) for q in range(a, b + 1))
               for a in (1, 5, 100, 300) for b in (0, 4, 99, 128, 700) for w in (1, 64, 128, 2048))
    config = json.loads((PA._PUBLISHED_MODELS / "deepseek-v4-flash.json").read_text())
    shapes = ModelShapes.from_hf_config(config, name="deepseek-v4-flash")
    profile = P.stack_profile("ascend-910c-cm384", "vllm-ascend-eager")
    dense, sparse = CostModel(profile, shapes), PA.HybridSparseCost(profile, shapes, config)
    _, fd, _ = dense.attention_work([(32768, 0)])
    _, fs, _ = sparse.attention_work([(32768, 0)])
    assert fs["core"] < fd["core"] / 10  # window + compressed keys instead of all 16k keys per query on average
    assert fs["gemm"] < fd["gemm"]  # no kv_b expansion, the grouped low-rank output projection
    # per query the sparse core grows only through the indexer and the 1/128-compressed layers (linear in the
    # context, small coefficients): a chunk late in a 64k prompt costs a few times an early one, not ~30x
    _, late, _ = sparse.attention_work([(4096, 60000)])
    _, early, _ = sparse.attention_work([(4096, 0)])
    assert late["core"] < 5 * early["core"]
    _, dlate, _ = dense.attention_work([(4096, 60000)])
    _, dearly, _ = dense.attention_work([(4096, 0)])
    assert dlate["core"] > 25 * dearly["core"]
    assert sparse.attention_s([(32768, 0)], tp=2) < dense.attention_s([(32768, 0)], tp=2)


def test_afd_async_rows_simulate_with_fits_and_reasons(tmp_path):
    """The new rows through the regime: the two fitted ones (the V4 cell's 1.0x load, the V3.2 lengths) within the
    target; every row outside it carries its reason; the V4 rows compare with the best baseline at each load."""
    shapes = ModelShapes.load("deepseek-v3")
    costs = {s: CostModel(P.stack_profile("ascend-910c-cm384", s), shapes)
             for s in ("vllm-ascend-eager", "cloudmatrix-infer")}
    cache, rows = {}, {}
    for f in P.FIGURES:
        if f.key.startswith(AFD_ASYNC):
            v = P.simulate_figure(f, costs, shapes, cache=cache)
            assert v is not None and v > 0, f.key
            rows[f.key] = (f, P.relative_error(v, f.value))
    for key in ("v4flash_afd_served_1x", "v32r_median_baseline_12rps"):
        f, err = rows[key]
        assert f.fitted and abs(err) <= TARGET, (key, err)
    notes = PA.async_notes(cache)
    for key, (f, err) in rows.items():
        assert abs(err) <= TARGET or key in notes or ("note", key) in cache, key
    for load in (1.0, 1.25, 1.5):
        pt = cache[("v4", load)]
        names = PA.V4B.split(" vs ")
        assert pt["best_baseline"] == max(names, key=lambda n: pt[n]["throughput_tokens_per_s"])
        gain = P.simulate_figure(P._by_key(f"v4flash_gain_{load:g}x"), costs, shapes, cache=cache)
        assert gain == pytest.approx(pt[PA.V4A]["throughput_tokens_per_s"]
                                     / pt[pt["best_baseline"]]["throughput_tokens_per_s"])
    # the load anchor: the simulated AFD serves the published 96.1% of the simulated 1.0x load
    served = cache[("v4", 1.0)][PA.V4A]
    share = served["throughput_tokens_per_s"] / served["offered_tokens_per_s"]
    assert share == pytest.approx(PA.V4_SERVED_1X, abs=0.02)
