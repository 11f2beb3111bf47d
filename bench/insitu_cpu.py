"""Per-stage CPU time of the real runtime against the simulator's modelled busy time (issue 21, section 4b).

CPU time (``time.process_time`` around every stage call, in each worker: ``insitu_cpu_wrap.CpuFactory``) is what a
process itself consumed, so unlike wall-clock spans it does not grow when other processes load the host. Per
worker role it prints the CPU of the model's stage calls, the CPU the process spent between them (the runtime
loop, packing, waits that spin, messages: "non_stage"), and the simulator's busy time of the same requests
(with the profile's in-situ factors).

    PYTHONPATH=. python bench/insitu_cpu.py async 3 [local | path/to/profile.json]

Measured on the shared 2-core VM at load 26-30 (issue 21): A2E2, 40 synthetic requests, small model, local
profile; stage / non-stage CPU s: 3 req/s attention 1.58 / 0.58, expert 1.55 / 1.15 (sim busy 1.39 / 1.60);
8 req/s attention 1.59 / 0.50, expert 1.34 / 1.14 (sim 1.47 / 1.72). The operators match the model within
15% on CPU time; the ranks burn another 35% (attention) and 75-85% (expert) of their operator CPU outside the
operators, which the simulator's processor sharing does not charge.
"""
import glob, json, os, shutil, sys, tempfile
import torch
from insitu_cpu_wrap import CpuFactory
from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.runtime import PromptRequest, RuntimeConfig, run_async
from asap_comm.serving.sync import run_sync
from asap_comm.serving.traces import scale_trace
from asap_comm.sim.calibrate.target import validation_trace
from asap_comm.sim.core.simulate import simulate
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.shapes import ModelShapes

if __name__ == "__main__":
    mode, rate, prof = sys.argv[1], float(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else "local")
    base = load_model_factory("small", seed=0); info = model_info_of(base)
    d = tempfile.mkdtemp()
    factory = CpuFactory(base, d)
    cost, shapes = CostModel.load(prof, "small"), ModelShapes.load("small")
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=256, chunk_len=256, max_prompt_len=512,
                        placer_linear_weight=cost.placer_linear_weight())
    trace = scale_trace(validation_trace("synthetic", 40, 512, 0), target_rate=rate)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (r.prompt_len,), generator=g)) for r in trace]
    real = (run_async if mode == "async" else run_sync)(factory, info, reqs, cfg)
    sim = simulate(mode, trace, cost, shapes, cfg)
    rows = [json.load(open(f)) for f in glob.glob(os.path.join(d, "*.json"))]
    shutil.rmtree(d)
    out = {"mode": mode, "rate": rate, "profile": prof, "load1": open("/proc/loadavg").read().split()[0], "workers": []}
    for r in rows:
        st = r["stats"]
        stage_cpu = sum(v[1] for v in st.values()); stage_wall = sum(v[2] for v in st.values())
        span = r["cpu_now"] - r["cpu_first"]
        out["workers"].append({"role": r["role"], "stage_cpu_s": round(stage_cpu, 3), "stage_wall_s": round(stage_wall, 3),
                               "cpu_between_first_and_last_dump_s": round(span, 3),
                               "non_stage_cpu_s": round(span - stage_cpu, 3),
                               "per_stage": {k: [v[0], round(v[1], 4), round(v[2], 4)] for k, v in st.items()}})
    out["sim_busy_by_role"] = {}
    for x in sim.ranks:
        out["sim_busy_by_role"][x["role"]] = out["sim_busy_by_role"].get(x["role"], 0) + x["busy_s"] * x["stands_for"]
    out["real_busy_spans_s"] = round(sum(dd for _, _, name, _, dd in real.spans), 3)
    print(json.dumps(out, indent=1))
    tot = {}
    for w in out["workers"]:
        t = tot.setdefault(w["role"], [0, 0, 0])
        t[0] += w["stage_cpu_s"]; t[1] += w["non_stage_cpu_s"]; t[2] += w["stage_wall_s"]
    print("SUMMARY", json.dumps({"mode": mode, "rate": rate, "load1": out["load1"],
          "real_cpu_by_role(stage, non_stage, stage_wall)": tot, "sim_busy_by_role": out["sim_busy_by_role"]}))
