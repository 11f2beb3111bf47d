"""sim/barrier.py: the expected max of r normals, the per-step group loads from the simulator, the barrier model."""
import math
import random

import pytest

from asap_comm.serving.protocol import RuntimeConfig
from asap_comm.serving.traces import Request
from asap_comm.sim.core.simulate import simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies import barrier as B


def test_expected_max_of_r_standard_normals():
    assert B.expected_max_normal(1) == 0.0
    assert B.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert B.expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-9)
    # tabulated values (e.g. Harter 1961): r = 4, 5, 10, 100
    for r, e in ((4, 1.029375), (5, 1.162964), (10, 1.538753), (100, 2.507594)):
        assert B.expected_max_normal(r) == pytest.approx(e, abs=1e-5)
    # against sampling
    rng = random.Random(1)
    est = sum(max(rng.gauss(0, 1) for _ in range(8)) for _ in range(20000)) / 20000
    assert est == pytest.approx(B.expected_max_normal(8), abs=0.02)
    assert B.barrier_model(2.0, 0.5, 2) == pytest.approx(2.0 + 0.5 / math.sqrt(math.pi))
    with pytest.raises(ValueError, match="r=0"):
        B.expected_max_normal(0)
    with pytest.raises(ValueError, match="std=-1"):
        B.barrier_model(1.0, -1, 2)


@pytest.fixture(scope="module")
def v3():
    shapes = ModelShapes.load("deepseek-v3")
    return CostModel(Profile.load("ascend-910c-cm384"), shapes), shapes


def _cfg(chunk):
    return RuntimeConfig(num_attention_ranks=1, num_expert_ranks=1, token_budget=chunk, chunk_len=chunk,
                         max_prompt_len=1 << 17)


def test_step_loads_and_step_time_match_the_simulator(v3):
    """A constructed case: 4 groups, one two-chunk prompt each (different lengths), all at t = 0: two steps. The
    spans give each group's compute per step; layer_loads recomputes it, step_time the step's duration."""
    cost, shapes = v3
    chunk = 4096
    lens = [8192, 6000, 5000, 4200]  # each: two equal chunks (split_prompt balances them)
    res = simulate("sync", [Request(i, 0.0, n) for i, n in enumerate(lens)], cost, shapes, _cfg(chunk),
                   sync_ranks=4, spans=True)
    loads = B.step_group_loads(res, 4)
    assert len(loads) == 2
    starts = sorted({s[2] for s in res.spans})
    # the placer puts one prompt on each group (compared sorted: which one where does not matter)
    step1 = [[(n // 2, 0, False)] for n in lens]
    step2 = [[(n // 2, n // 2, True)] for n in lens]
    for step, batches in ((0, step1), (1, step2)):
        mine = B.layer_loads(cost, shapes, batches)
        # a group's span = its layer loads + the expert work every group does alike
        common = [b - m for b, m in zip(sorted(loads[step]), sorted(sum(x) for x in mine))]
        assert max(common) - min(common) == pytest.approx(0, abs=1e-12)
        assert common[0] > 0
    # the first step's duration is the gap to the second (the loop comes straight back)
    assert starts[1] - starts[0] == pytest.approx(B.step_time(cost, shapes, step1), rel=1e-9)
    # the second step ends each request: done = step start + step time + the result message
    done = max(r.done_s for r in res.records)
    t2 = B.step_time(cost, shapes, step2)
    assert done - starts[1] - t2 == pytest.approx(min(r.done_s for r in res.records) - starts[1] - t2, abs=1e-12)
    assert 0 < done - starts[1] - t2 < 1e-3  # only the result message left
    # the barrier: the simulator charges the slowest group's layer; the others wait the difference
    m = B.measure_barrier([loads[1]], shapes.num_moe_layers)
    per = [x / shapes.num_moe_layers for x in loads[1]]
    assert m["stall_s"] == pytest.approx(max(per) - sum(per) / 4)
    assert m["fastest_wait_s"] == pytest.approx(max(per) - min(per))
    assert m["stall_s"] > 0


def test_gaussian_model_matches_the_measured_stall_on_a_constructed_case(v3):
    """Steps of r = 6 groups whose prompts are drawn i.i.d. from a narrow normal, in waves far apart so that every
    step is one wave: the per-layer loads are nearly linear in the prompt, so nearly Gaussian, and the model
    predicts the measured stall within 5%."""
    cost, shapes = v3
    r, steps = 6, 120
    rng = random.Random(7)
    reqs, t = [], 0.0
    for s in range(steps):
        for g in range(r):
            reqs.append(Request(len(reqs), t, max(256, round(rng.gauss(3000, 400)))))
        t += 5.0  # far longer than a step: each step holds exactly this wave
    res = simulate("sync", reqs, cost, shapes, _cfg(8192), sync_ranks=r, spans=True)
    loads = B.step_group_loads(res, r)
    assert len(loads) == steps and all(min(s) > 0 for s in loads)
    m = B.measure_barrier(loads, shapes.num_moe_layers)
    assert abs(m["per_step_error"]) < 0.05, m  # the Gaussian model, sigma from the groups' spread in a step
    assert abs(m["empirical_error"]) < 0.05, m
    # the stationary sigma also counts the step-to-step level that every group shares (the expert work of the
    # step's total tokens): above the within-step one, so the stationary model over-predicts
    assert m["sigma_stationary_s"] > m["sigma_within_step_s"] and m["stationary_error"] > m["per_step_error"]
    assert m["between_step_variance_share"] < 0.5
    # a heavy-tailed spread over 32 groups: the Gaussian model underestimates the slowest of r, the empirical
    # tail does not
    reqs, t, r = [], 0.0, 32
    for s in range(60):
        for g in range(r):
            reqs.append(Request(len(reqs), t, min(60000, max(64, round(1500 * math.exp(rng.gauss(0, 1.2)))))))
        t += 60.0
    res = simulate("sync", reqs, cost, shapes, _cfg(65536), sync_ranks=r, spans=True)
    m2 = B.measure_barrier(B.step_group_loads(res, r), shapes.num_moe_layers)
    assert m2["within_step_skewness"] > 1.5
    assert m2["per_step_error"] < -0.2  # Gaussian (within-step sigma) well below the measured stall
    assert abs(m2["empirical_error"]) < 0.15


def test_step_group_loads_needs_a_baseline_with_spans(v3):
    cost, shapes = v3
    res = simulate("sync", [Request(0, 0.0, 100)], cost, shapes, _cfg(4096), sync_ranks=2)
    with pytest.raises(ValueError, match="spans=True"):
        B.step_group_loads(res, 2)
    with pytest.raises(ValueError, match="moe_layers=0"):
        B.measure_barrier([[1.0, 2.0]], 0)


def test_af_rule_terms(v3):
    cost, shapes = v3
    a = B.af_ratio_rule(cost, shapes, 16384, attention_tp=8, expert_dies=64)
    assert a["r_star"] == max(a["r_A"], a["r_C"], a["r_peak"])
    assert a["r_A"] > 0 and a["r_C"] > 0 and a["r_peak"] > 0
    # the barrier-aware refinement lengthens the attention side: more attention dies per expert die
    b = B.af_ratio_rule(cost, shapes, 16384, attention_tp=8, expert_dies=64, groups=40, load_cv=0.5)
    assert b["r_A"] > 1.5 * a["r_A"]


def test_cli_writes_json_plot_and_rejects_bad_flags(tmp_path, capsys):
    assert B.main(["--out", str(tmp_path), "--groups", "4,8", "--spreads", "0.5", "--per-group", "20"]) == 0
    import json

    d = json.loads((tmp_path / "barrier.json").read_text())
    assert [r["groups"] for r in d["rows"]] == [4, 8] and (tmp_path / "barrier.png").stat().st_size > 0
    assert d["af_splits"][0]["searched_ratio"] == 3.0
    assert "| 0.5" in capsys.readouterr().out
    assert B.main(["--out", str(tmp_path), "--groups", "x"]) == 2
    assert "--groups 'x'" in capsys.readouterr().err
