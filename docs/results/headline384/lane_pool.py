"""384 dies, the headline's SLO held (2.58 s): ASAP re-searched with the long-prompt lane's KV pool charged.

Until 2026-12-03 a lane took one of 4 slots of max_prompt_len rows each and lanes shared groups, while the memory
model charged an attention die one prompt's received latents: four 128k lanes over the same groups would need
36.8 GB of a die's 57.6. Now every attention die holds a pool of ``lane_tokens`` rows per layer (RuntimeConfig,
``--lane-tokens``), charged by the memory model, and a prompt waits for room in it. This searches ASAP's TP8
splits with 2k and 4k chunks (the lane's wavefront step; 2k shortens a 98k prompt alone from 2.71 to 1.74 s on
44 x TP8 + 32), micro-batch budget 16k, experts 0.5 ms / 16k rows, the pool at one prompt (131072, the default)
or two (262144), memory checked (coarse on the first 1500 Mooncake requests, the best two confirmed on 3000).
The baseline needs no re-run (it has no lane): its best at 2.58 s is in baseline_small_cp.log (48 x TP8,
CP > 2k, chunk 16k: 105,041 tok/s at p90, 52,521 at p99); with 2k chunks it meets p99 at no load
(baseline_2k_chunks.log).

Run from the repository root (about 35 min each on 2 busy cores):
``PYTHONPATH=. python docs/results/headline384/lane_pool.py 0.99 2048,4096 none,262144`` (and ``0.90``).
"""
import sys

from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.studies.grids import async_grid, mooncake_trace, sync_grid
from asap_comm.sim.costmodel.memory import deployment_problems
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.core.sweep import capacity_rate, search_best

target = float(sys.argv[1])
chunks = [int(x) for x in sys.argv[2].split(",")]
pools = [None if x == "none" else int(x) for x in sys.argv[3].split(",")]
experts = [int(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [32, 64]
cost, shapes = CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.load("deepseek-v3")
trace, _desc = mooncake_trace(3000)
probe = trace[:1500]
cands = async_grid(384, experts, [8], chunks, shapes.heads, [16384], [0.0005], [16384], pools)
for d in cands:
    pr = deployment_problems(d, cost.profile, shapes)
    if pr:
        print("infeasible:", d.label, pr[0][:200], flush=True)
cands = [d for d in cands if not deployment_problems(d, cost.profile, shapes) and d.cfg.token_budget == 16384]
ref = [d for d in sync_grid(384, [8], [8192], [16384], shapes.heads, [True], [16384])][0]
start = 0.25 * capacity_rate(probe, cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks)
f = search_best(cands, probe, cost, shapes, 2.58, start_rate=start, bisections=2, target=target,
                confirm_trace=trace, confirm_top=2, confirm_bisections=4, progress=f"pool p{int(target * 100)}")
print(f"SLO 2.58 p{target}: best {f['best'].label}: {f['best_sweep']['slo_compliant_throughput']}", flush=True)
