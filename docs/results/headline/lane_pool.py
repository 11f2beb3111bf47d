"""64 dies: ASAP's headline splits re-searched with the long-prompt lane's KV pool charged (2026-12-03).

16 expert dies, TP 2/4/8, chunks 4k/8k, budget 16k, experts 0.5 ms / 16k rows, pool one prompt (131072, the
default) or two (262144), memory checked; coarse on 200 requests, the best two confirmed on 600 (the headline's
trace and windows). The baseline has no lane: its figures stand (headline-p90.log / headline-p99.log).
Run from the repository root: ``PYTHONPATH=. python docs/results/headline/lane_pool.py 0.90 4.53 none,262144``
(p90 at the 3x SLO, 5 min) and ``... 0.99 15.1 none,262144`` (p99 at the 10x SLO, 8 min); a 4th argument
names the profile: ``... 0.90 1.73 none,262144 h800-node`` and ``... 0.99 5.77 none,262144 h800-node`` (the H800
headline's SLOs; logs in docs/results/headline-h800/lane_pool-*).
"""
import sys

from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.studies.grids import async_grid, mooncake_trace, sync_grid
from asap_comm.sim.costmodel.memory import deployment_problems
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.core.sweep import capacity_rate, search_best

target, slo = float(sys.argv[1]), float(sys.argv[2])
pools = [None if x == "none" else int(x) for x in sys.argv[3].split(",")]
profile = sys.argv[4] if len(sys.argv) > 4 else "ascend-910c-cm384"
cost, shapes = CostModel.load(profile, "deepseek-v3"), ModelShapes.load("deepseek-v3")
trace, _desc = mooncake_trace(600)
probe = trace[:200]
cands = async_grid(64, [16], [2, 4, 8], [4096, 8192], shapes.heads, [16384], [0.0005], [16384], pools)
for d in cands:
    pr = deployment_problems(d, cost.profile, shapes)
    if pr:
        print("infeasible:", d.label, pr[0][:220], flush=True)
cands = [d for d in cands if not deployment_problems(d, cost.profile, shapes) and d.cfg.token_budget == 16384]
ref = [d for d in sync_grid(64, [8], [16384], [16384], shapes.heads, [True], [16384])][0]
start = 0.25 * capacity_rate(probe, cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks)
f = search_best(cands, probe, cost, shapes, slo, start_rate=start, bisections=2, target=target,
                confirm_trace=trace, confirm_top=2, confirm_bisections=4,
                progress=f"64 pool p{int(target * 100)} slo {slo}")
print(f"SLO {slo} p{target}: best {f['best'].label}: {f['best_sweep']['slo_compliant_throughput']}", flush=True)
