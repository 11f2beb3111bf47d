"""384 dies, p99 at the held SLO 2.58 s: the baseline with 2k chunks (ASAP's best lane step), 48 x TP8, CP none /
> 2k / > 8k, budget 2k or 16k (coarse on the first 1500 Mooncake requests, the best two confirmed on 3000).
Every one meets p99 at no load (baseline_2k_chunks.log): smaller chunks only add steps to the baseline.
Run from the repository root: ``PYTHONPATH=. python docs/results/headline384/baseline_2k_chunks.py`` (5 min).
"""
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.studies.grids import mooncake_trace, sync_grid
from asap_comm.sim.costmodel.memory import deployment_problems
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.core.sweep import capacity_rate, search_best

cost, shapes = CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.load("deepseek-v3")
trace, _desc = mooncake_trace(3000)
probe = trace[:1500]
cands = [d for d in sync_grid(384, [8], [None, 2048, 8192], [2048], shapes.heads, [True], [16384])
         if not deployment_problems(d, cost.profile, shapes)]
ref = [d for d in sync_grid(384, [8], [8192], [16384], shapes.heads, [True], [16384])][0]
start = 0.25 * capacity_rate(probe, cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks)
f = search_best(cands, probe, cost, shapes, 2.58, start_rate=start, bisections=2, target=0.99,
                confirm_trace=trace, confirm_top=2, confirm_bisections=4, progress="sync384 2k p99")
print(f"SLO 2.58 p0.99: best {f['best'].label}: {f['best_sweep']['slo_compliant_throughput']}", flush=True)
