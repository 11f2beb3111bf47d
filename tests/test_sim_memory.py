"""The per-die memory model (asap_comm.sim.costmodel.memory), its refusals and the --weights transform."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.hardware import Profile
from asap_comm.sim.costmodel.memory import (GB, deployment_memory, memory_problems, profile_hbm, weight_params,
                                            with_weights)
from asap_comm.sim.costmodel.shapes import ModelShapes

ROOT = Path(__file__).resolve().parents[1]
DSV3 = ModelShapes.preset("deepseek-v3")
CM = "ascend-910c-cm384"
RUN = dict(token_budget=16384, chunk_len=16384, max_prompt_len=131072)

# DeepSeek-V3 by hand: 61 layers, the first 3 dense; 256 routed experts of SwiGLU 7168 -> 2048 -> 7168
ROUTED_PARAMS = 58 * 256 * 3 * 7168 * 2048  # 653,908,770,816


def test_routed_experts_of_deepseek_v3_by_hand():
    p = weight_params(DSV3)
    assert p["routed"] == ROUTED_PARAMS
    assert 653e9 < ROUTED_PARAMS < 654e9  # the issue's "about 653 GB" in INT8
    int8 = Profile.load(CM)
    bf16 = with_weights(int8, "bf16")
    for prof, bytes_ in ((int8, 1), (bf16, 2)):
        # one expert die holding every expert: its routed weights are the model's
        die = deployment_memory("async", prof, DSV3, attention_ranks=1, expert_ranks=1, **RUN)[1]
        assert die.breakdown["routed experts"] == pytest.approx(ROUTED_PARAMS * bytes_ / GB, rel=1e-9)
    # 16 dies: ceil(256/16) = 16 experts each
    die = deployment_memory("async", int8, DSV3, attention_ranks=2, attention_tp=8, expert_ranks=16, **RUN)[1]
    assert die.breakdown["routed experts"] == pytest.approx(ROUTED_PARAMS / 16 / GB, rel=1e-9)
    # 6 dies: ceil(256/6) = 43 experts on the fullest die
    die = deployment_memory("async", int8, DSV3, attention_ranks=5, attention_tp=2, expert_ranks=6, **RUN)[1]
    assert die.breakdown["routed experts"] == pytest.approx(43 * 58 * 3 * 7168 * 2048 / GB, rel=1e-9)


def test_kv_cache_and_attention_shard_by_hand():
    prof = Profile.load(CM)
    att = deployment_memory("async", prof, DSV3, attention_ranks=2, attention_tp=8, expert_ranks=16, **RUN)[0]
    # MLA latent: (512 + 64) values x 2 bytes x 61 layers per token; one max prompt + 2 micro-batches of 16k
    per_token = (512 + 64) * 2 * 61
    assert att.breakdown["KV cache"] == pytest.approx((131072 + 2 * 16384) * per_token / GB, rel=1e-9)
    # attention: q_a (7168x1536) and kv_a (7168x576) whole, q_b, kv_b and o_proj split over 8, INT8
    rep = 7168 * 1536 + 7168 * 576
    split = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    assert att.breakdown["attention weights"] == pytest.approx(61 * (rep + split / 8) / GB, rel=1e-9)
    # the HTTP service's urgent slot: a third micro-batch of 16k in flight, KV and dispatch buffers alike
    att3 = deployment_memory("async", prof, DSV3, attention_ranks=2, attention_tp=8, expert_ranks=16,
                             urgent_slot=True, **RUN)[0]
    assert att3.breakdown["KV cache"] == pytest.approx((131072 + 3 * 16384) * per_token / GB, rel=1e-9)
    assert att3.needed_gb > att.needed_gb


def test_feasibility_of_the_issue_deployments():
    prof = Profile.load(CM)
    assert profile_hbm(prof).hbm_gb == 64
    # afd-plugin's 32 dies: ASAP 2 x TP8 + 16 expert dies, baseline 4 x TP8 (EP32): all fit
    a = deployment_memory("async", prof, DSV3, attention_ranks=2, attention_tp=8, expert_ranks=16, **RUN)
    s = deployment_memory("sync", prof, DSV3, sync_ranks=4, sync_tp=8, **RUN)
    assert not memory_problems(a + s, CM)
    # the old 16-device emulated default: 6 expert dies cannot hold 654 GB of experts
    a = deployment_memory("async", prof, DSV3, attention_ranks=5, attention_tp=2, expert_ranks=6, **RUN)
    probs = memory_problems(a, CM)
    assert len(probs) == 1 and "expert die" in probs[0] and "64 GB" in probs[0]
    assert a[1].needed_gb > 109  # 43 experts x 58 layers x 44 MB
    # a profile without a memory block: unknown, never refused
    data = copy.deepcopy(prof.data)
    del data["memory"]
    unknown = Profile(data)
    assert profile_hbm(unknown) is None
    assert not memory_problems(deployment_memory("async", unknown, DSV3, expert_ranks=1, **RUN), CM)


def test_bad_memory_block_and_arguments():
    data = copy.deepcopy(Profile.load(CM).data)
    data["memory"]["hbm_gb"] = -1
    with pytest.raises(ValueError, match="memory.hbm_gb"):
        profile_hbm(Profile(data))
    with pytest.raises(ValueError, match="expert_ranks=0"):
        deployment_memory("async", Profile.load(CM), DSV3, expert_ranks=0, **RUN)
    with pytest.raises(ValueError, match="mode='x'"):
        deployment_memory("x", Profile.load(CM), DSV3, **RUN)


def test_w8a8_halves_the_weights_and_changes_gemm_time():
    int8 = Profile.load(CM)
    bf16 = with_weights(int8, "bf16")
    assert int8.dtype["weight_bytes"] == 1 and bf16.dtype["weight_bytes"] == 2
    kw = dict(attention_ranks=2, attention_tp=8, expert_ranks=16, **RUN)
    m8, m16 = (deployment_memory("async", p, DSV3, **kw) for p in (int8, bf16))
    for d8, d16 in zip(m8, m16):
        for part in ("attention weights", "routed experts"):
            if part in d8.breakdown:
                assert d16.breakdown[part] == pytest.approx(2 * d8.breakdown[part], rel=1e-9)
    c8, c16 = CostModel(int8, DSV3), CostModel(bf16, DSV3)
    # a large expert call is compute-bound: the INT8 peak is twice the BF16 one on the 910C profile
    big = 65536
    assert c16.expert_s(big) > 1.8 * c8.expert_s(big)
    # a one-row call is weight-read bound: twice the bytes
    assert c16.expert_s(1) > 1.8 * c8.expert_s(1)
    assert with_weights(bf16, "int8").dtype == int8.dtype
    assert CostModel(with_weights(bf16, "int8"), DSV3).expert_s(big) == pytest.approx(c8.expert_s(big))
    # H800: FP8 (1 byte, FP8 peak) by default; bf16 doubles the bytes and uses the BF16 peak
    h = Profile.load("h800-node")
    hb = with_weights(h, "bf16")
    assert CostModel(hb, DSV3).expert_s(big) > 1.8 * CostModel(h, DSV3).expert_s(big)
    assert with_weights(h, None) is h
    with pytest.raises(ValueError, match="--weights int8: profile 'local'"):
        with_weights(Profile.load("local"), "int8")
    with pytest.raises(ValueError, match="--weights 'fp4'"):
        with_weights(h, "fp4")


def _sim(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "asap_comm.sim", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_sim_run_refuses_an_infeasible_deployment_and_ignore_memory_records_it(tmp_path):
    dep = ["--profile", CM, "--model", "deepseek-v3", "--attention-ranks", "5", "--attention-tp", "2",
           "--expert-ranks", "6", "--sync-tp", "4", "--num-requests", "6", "--rate", "1"]
    r = _sim("run", "--out", str(tmp_path / "a"), *dep)
    assert r.returncode == 2, r.stderr
    # (a cluster profile first says which defaults it filled in; then the refusal, one line)
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("cluster defaults for")]
    assert len(lines) == 1 and "memory" in lines[0] and "expert die" in lines[0] and "--ignore-memory" in lines[0]
    assert not (tmp_path / "a" / "summary.json").exists()
    r = _sim("run", "--out", str(tmp_path / "b"), *dep, "--ignore-memory")
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert s["ignore_memory"] is True and s["memory"]["problems"]
    assert {d["role"] for d in s["memory"]["per_die"]["async"]} == {"attention", "expert"}


def test_sim_memory_cli(tmp_path):
    r = _sim("memory", "--profile", CM, "--model", "deepseek-v3")
    assert r.returncode == 0, r.stderr
    assert "expert" in r.stdout and "57.6" in r.stdout
    r = _sim("memory", "--profile", CM, "--model", "deepseek-v3", "--expert-ranks", "6", "--attention-tp", "2",
             "--attention-ranks", "5")
    assert r.returncode == 2 and "memory: an expert die needs" in r.stdout


def test_headline_keeps_only_feasible_candidates(capsys):
    from asap_comm.sim.costmodel.memory import headline_memory
    from asap_comm.sim.studies.grids import async_grid, sync_grid

    cost = CostModel.load(CM, "deepseek-v3")
    syncs = sync_grid(32, (4, 8), (None,), (16384,), DSV3.heads)
    asyncs = async_grid(32, (8, 16), (8,), (16384,), DSV3.heads)
    cost2, s, a, rec = headline_memory(cost, DSV3, syncs, asyncs)
    # 32 dies: the baseline's TP4 groups (8 x TP4, EP32) and TP8 fit; ASAP with 8 expert dies does not
    assert [d.par.sync_tp for d in s] == [4, 8]
    assert [d.cfg.num_expert_ranks for d in a] == [16]
    assert len(rec["infeasible"]) == 1 and "expert die" in rec["infeasible"][0]["problem"]
    assert cost2.w == 1 and rec["ignore_memory"] is False
    _, s, a, rec = headline_memory(cost, DSV3, syncs, asyncs, ignore_memory=True)
    assert len(a) == 2 and rec["ignore_memory"] is True and rec["infeasible"]
    # bf16 weights: no baseline configuration of 32 dies fits -> exit 2, one line naming memory
    with pytest.raises(SystemExit) as e:
        headline_memory(cost, DSV3, syncs, asyncs, weights="bf16")
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("headline:")]
    assert len(err) == 1 and "memory" in err[0] and "baseline" in err[0]


def test_emulated_factory_check_and_per_die_transfer_rows():
    from asap_models import StageFactory

    from asap_comm.sim.emulate.emulator import EmulatedFactory

    base = StageFactory("tiny", 0)
    with pytest.raises(ValueError, match="memory: 6 devices hold deepseek-v3's routed experts at 109.8 GB"):
        EmulatedFactory(base, CM, "deepseek-v3", num_expert_ranks=6, check_memory=True)
    EmulatedFactory(base, CM, "deepseek-v3", num_expert_ranks=6)  # unchecked by default
    f = EmulatedFactory(base, CM, "deepseek-v3", token_scale=128, num_expert_ranks=4, expert_devices=4,
                        check_memory=True, weights="int8")
    assert f.describe_emulation()["expert_devices"] == 4 and f.cost().w == 1
    assert EmulatedFactory(base, CM, "deepseek-v3", weights="bf16").cost().w == 2
    m4 = f(role="expert", experts=[0, 1])
    m1 = EmulatedFactory(base, CM, "deepseek-v3", token_scale=128, num_expert_ranks=4)(role="expert",
                                                                                      experts=[0, 1])
    # four dies share the rank's 64 emulated experts: each die's link carries fewer rows than one die's would
    assert 0 < m4._die_rows_per_real_row < m4._rows_per_real_row == m1._rows_per_real_row
    assert m4.expert_work_s(64) == pytest.approx(m1.expert_work_s(64) / 4)


def _example(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "examples" / "prefill.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _example_in_process(*args, capsys) -> tuple:
    """examples/prefill.py's main(ARGS) in this process (loaded from its path): (exit code, stderr)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("example_prefill", ROOT / "examples" / "prefill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    try:
        rc = module.main(list(args))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_example_emulated_default_is_feasible_and_an_infeasible_one_is_refused(tmp_path):
    from asap_comm.sim.emulate import deploy

    p = deploy.build_parser()
    args = p.parse_args(["--emulate", CM])
    deploy.apply_emulate_defaults(args, set())
    assert deploy.memory_refusal(args) is None
    t = deploy.memory_table(args)
    assert [d.dies for d in t["async"]] == [16, 16] and [d.dies for d in t["sync"]] == [32]
    assert deploy.sync_workers(args) == 4
    r = _example("--emulate", CM, "--attention-ranks", "5", "--attention-tp", "2", "--expert-ranks", "6",
                 "--expert-dies", "1", "--sync-tp", "4", "--out", str(tmp_path))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "memory" in lines[0] and "expert die" in lines[0], r.stderr


def test_example_sizes_an_expert_die_by_the_runtimes_expert_batch():
    """An expert process computes one gathered layer batch at a time (--expert-token-budget rows, in emulated rows as
    simulate_emulated scales them), not every in-flight row at once: the headline's best 64-die split fits so, and
    is refused when expert batching is off (every arrival computed as it comes: the in-flight bound)."""
    from asap_models import StageFactory

    from asap_comm.sim.emulate import deploy

    from asap_comm.sim.emulate.emulator import rows_per_real_row

    split = ["--emulate", CM, "--attention-ranks", "12", "--attention-tp", "4", "--expert-ranks", "4",
             "--expert-dies", "4", "--sync-tp", "8", "--cp-threshold", "128", "--chunk-len", "64"]
    args = deploy.parse_args(split)
    assert deploy.memory_refusal(args) is None
    expert = deploy.memory_table(args)["async"][1]
    assert expert.role == "expert" and expert.dies == 16
    prof, shapes = Profile.load(CM), ModelShapes.load("deepseek-v3")
    real = ModelShapes.from_hf_config(StageFactory(args.model, args.seed).describe()["hf_config"], name="served")
    budget = round(args.expert_token_budget * rows_per_real_row(real, shapes, args.token_scale, 16))
    want = deployment_memory("async", prof, shapes, attention_ranks=12, attention_tp=4, expert_ranks=16,
                             token_budget=args.token_budget * args.token_scale,
                             chunk_len=args.chunk_len * args.token_scale,
                             max_prompt_len=args.max_prompt_len * args.token_scale, long_prompt_lane=True,
                             expert_token_budget=budget)[1]
    assert expert.breakdown == pytest.approx(want.breakdown)
    bigger = deploy.memory_table(deploy.parse_args(split + ["--expert-token-budget", "4096"]))["async"][1]
    assert bigger.breakdown["activations"] > expert.breakdown["activations"]
    line = deploy.memory_refusal(deploy.parse_args(split + ["--no-expert-batching"]))
    assert line is not None and "memory" in line and "expert die" in line, line


def test_simulate_emulated_runs_the_dies_an_expert_rank_stands_for():
    from asap_models import StageFactory

    from asap_comm.serving.runtime import RuntimeConfig
    from asap_comm.serving.traces import Request
    from asap_comm.sim.emulate.emulator import EmulatedFactory, simulate_emulated

    base = StageFactory("tiny", 0)
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=4, token_budget=128, chunk_len=128, max_prompt_len=512)
    trace = [Request(i, 0.5 * i, 100 + 10 * i) for i in range(4)]
    out = {}
    for dies in (1, 4):
        f = EmulatedFactory(base, CM, "deepseek-v3", time_scale=0.25, token_scale=128, num_expert_ranks=4,
                            attention_tp=8, expert_devices=dies)
        r = simulate_emulated(f, "async", trace, cfg)
        out[dies] = r
        assert r.ranks[-1]["stands_for"] == 4 * dies  # the expert side: 4 ranks of `dies` dies each
    assert all(a.ok and b.ok for a, b in zip(out[1].records, out[4].records))


def test_the_long_prompt_lane_adds_one_received_prompt_of_kv_to_an_attention_die():
    """With the lane, an attention group also holds the latents another group's lane prompt puts into it: one
    max-length prompt of (kv_lora_rank + qk_rope) * 2 bytes * 61 layers per token; expert dies are unchanged, and a
    single attention group has no lane."""
    prof, shapes = Profile.load(CM), ModelShapes.load("deepseek-v3")
    kw = dict(attention_ranks=2, attention_tp=8, expert_ranks=16, token_budget=16384, chunk_len=16384,
              max_prompt_len=131072)
    off = deployment_memory("async", prof, shapes, **kw)
    on = deployment_memory("async", prof, shapes, long_prompt_lane=True, **kw)
    lane = on[0].breakdown["lane KV (received)"]
    assert lane == pytest.approx(131072 * (512 + 64) * 2 * 61 / GB)
    assert on[0].needed_gb == pytest.approx(off[0].needed_gb + lane)
    assert on[1].needed_gb == pytest.approx(off[1].needed_gb)
    one = deployment_memory("async", prof, shapes, long_prompt_lane=True, **dict(kw, attention_ranks=1))
    assert "lane KV (received)" not in one[0].breakdown
    # the pool (RuntimeConfig.lane_tokens) is what a die holds, whatever the lanes in flight: 2.5 prompts' worth
    pool = deployment_memory("async", prof, shapes, long_prompt_lane=True, lane_tokens=327680, **kw)
    assert pool[0].breakdown["lane KV (received)"] == pytest.approx(2.5 * lane)


def test_the_simulator_and_sim_run_charge_the_lane_pool_and_refuse_one_that_does_not_fit(tmp_path):
    """memory_of passes RuntimeConfig.lane_tokens; sim run --lane-tokens too big for a die exits 2 naming memory
    and the lane KV; a bad value is a usage error naming the flag."""
    import subprocess
    import sys

    from asap_comm.serving.runtime import RuntimeConfig
    from asap_comm.sim.core.simulate import Parallelism
    from asap_comm.sim.costmodel.memory import memory_of

    prof, shapes = Profile.load(CM), ModelShapes.load("deepseek-v3")
    cfg = RuntimeConfig(num_attention_ranks=6, num_expert_ranks=16, token_budget=16384, chunk_len=4096,
                        max_prompt_len=131072)
    one = memory_of("async", cfg, Parallelism(attention_tp=8), None, prof, shapes)[0].breakdown["lane KV (received)"]
    cfg3 = RuntimeConfig(**{**cfg.__dict__, "lane_tokens": 3 * 131072})
    three = memory_of("async", cfg3, Parallelism(attention_tp=8), None, prof, shapes)[0].breakdown
    assert three["lane KV (received)"] == pytest.approx(3 * one)
    base = [sys.executable, "-m", "asap_comm.sim", "run", "--profile", CM, "--model", "deepseek-v3",
            "--attention-ranks", "6", "--attention-tp", "8", "--expert-ranks", "16", "--sync-ranks", "8",
            "--sync-tp", "8", "--num-requests", "4", "--out", str(tmp_path / "r")]
    r = subprocess.run(base + ["--lane-tokens", str(4 * 131072)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "memory" in r.stderr and "lane KV (received)" in r.stderr, r.stderr[-2000:]
    # without the lane nothing of it is charged (the memory check sees the lane flags)
    r = subprocess.run(base + ["--lane-tokens", str(4 * 131072), "--no-long-prompt-lane"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(base + ["--lane-tokens", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--lane-tokens 0:" in r.stderr, r.stderr[-2000:]


def test_fitting_lane_tokens_takes_the_most_longest_prompts_the_attention_dies_hold():
    """The deployment tools' default lane KV pool: up to LANE_POOL_PROMPTS longest prompts, fewer when the
    attention die cannot hold them (only the attention dies are asked), one when even that does not fit."""
    from asap_comm.serving.runtime import RuntimeConfig
    from asap_comm.sim.core.simulate import Parallelism
    from asap_comm.sim.costmodel.memory import LANE_POOL_PROMPTS, fitting_lane_tokens, memory_of

    prof, shapes = Profile.load(CM), ModelShapes.load("deepseek-v3")
    cfg = RuntimeConfig(num_attention_ranks=6, num_expert_ranks=16, token_budget=16384, chunk_len=4096,
                        max_prompt_len=131072)

    def dies(n):
        return memory_of("async", RuntimeConfig(**{**cfg.__dict__, "lane_tokens": n}), Parallelism(attention_tp=8),
                         None, prof, shapes)

    tokens, prompts = fitting_lane_tokens(dies, 131072)
    assert LANE_POOL_PROMPTS == 4 and 1 <= prompts < LANE_POOL_PROMPTS and tokens == prompts * 131072
    assert dies(tokens)[0].feasible and not dies(tokens + 131072)[0].feasible  # the most that fit
    # 32k prompts: four fit; most=2 caps it
    assert fitting_lane_tokens(dies, 32768) == (4 * 32768, 4)
    assert fitting_lane_tokens(dies, 32768, most=2) == (2 * 32768, 2)
    # an expert die that does not fit does not shrink the pool (the memory check refuses it by itself)
    small_e = lambda n: memory_of("async", RuntimeConfig(**{**cfg.__dict__, "num_expert_ranks": 4, "lane_tokens": n}),
                                  Parallelism(attention_tp=8), None, prof, shapes)
    assert not small_e(32768)[1].feasible and fitting_lane_tokens(small_e, 32768) == (4 * 32768, 4)
    # not even one prompt fits: one (what the refusal then names)
    assert fitting_lane_tokens(dies, 8 * 131072) == (8 * 131072, 1)
    for bad in ((0, 4), (131072, 0), (True, 4), (131072, 2.0)):
        with pytest.raises(ValueError, match="fitting_lane_tokens"):
            fitting_lane_tokens(dies, *bad)


def test_lane_tokens_auto_sizes_the_pool_to_what_memory_holds_in_sim_run_and_the_example(tmp_path, capsys):
    """--lane-tokens auto: sim run and examples/prefill.py --emulate size the lane's KV pool by the memory model
    (fitting_lane_tokens) and record it; without it the pool is one longest prompt; --lane-tokens auto needs
    --emulate in the example; bad --lane-tokens / --lane-wait-s / --lane-wait-slo values are usage errors naming the
    flag (the refusals are checked in this process: the same main() with the same argv, no interpreter to start)."""
    from sim_fakes import sim_cli

    base = [sys.executable, "-m", "asap_comm.sim", "run", "--profile", CM, "--model", "deepseek-v3",
            "--attention-ranks", "6", "--attention-tp", "8", "--expert-ranks", "16", "--sync-ranks", "8",
            "--sync-tp", "8", "--num-requests", "4", "--modes", "async"]
    r = subprocess.run(base + ["--lane-tokens", "auto", "--out", str(tmp_path / "auto")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads((tmp_path / "auto" / "summary.json").read_text())
    pool = s["memory"]["lane_pool"]
    assert pool["auto"] and pool["tokens"] == pool["prompts"] * 131072 and pool["prompts"] >= 2
    assert s["config"]["runtime"]["lane_tokens"] == pool["tokens"] and "KV pool of" in r.stderr
    att = s["memory"]["per_die"]["async"][0]
    assert att["feasible"] and att["breakdown_gb"]["lane KV (received)"] == pytest.approx(
        pool["prompts"] * 131072 * (512 + 64) * 2 * 61 / GB, rel=1e-3)
    r = subprocess.run(base + ["--lane-wait-s", "3.5", "--out", str(tmp_path / "one")], capture_output=True,
                       text=True, timeout=300)
    s = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert r.returncode == 0 and s["memory"]["lane_pool"] is None and s["config"]["runtime"]["lane_tokens"] is None
    assert s["config"]["runtime"]["lane_wait_s"] == 3.5
    lane = s["async"]["lane"]  # the lane's counts at the run's load (SimResult.lane)
    assert set(lane) == {"opened", "waited", "gave_up", "wait_s_mean", "wait_s_max"}, lane
    assert lane["opened"] + lane["gave_up"] <= 4 and lane["gave_up"] <= lane["waited"]
    for flag, value in (("--lane-tokens", "many"), ("--lane-wait-s", "-1")):
        rc, _, err = sim_cli(base[3:] + [flag, value, "--out", str(tmp_path / "bad")], capsys)
        assert rc == 2 and flag in err, err[-2000:]
    from asap_comm.sim.emulate import deploy

    args = deploy.parse_args(["--emulate", CM])
    assert args.lane_tokens is None and args.lane_wait_s is None and args.lane_wait_slo == 2.0
    assert deploy.default_lane_tokens(args) == (4 * args.max_prompt_len, 4)  # the emulated default holds four
    assert deploy.default_lane_tokens(deploy.parse_args(["--emulate", CM, "--no-long-prompt-lane"])) is None
    for argv, flag in ((["--lane-tokens", "auto"], "--lane-tokens auto needs --emulate"),
                       (["--lane-tokens", "0"], "--lane-tokens 0"), (["--lane-wait-s", "-2"], "--lane-wait-s -2"),
                       (["--lane-wait-slo", "soon"], "--lane-wait-slo")):
        rc, err = _example_in_process(*argv, "--out", str(tmp_path / "ex"), capsys=capsys)
        assert rc == 2 and flag in err, err[-2000:]
