"""The baseline alone re-searched with CP > 4k and 8k added to the headline's grid (2026-12-03 night).

TP {1, 2, 4, 8} x CP {none, 4k, 8k, 16k, 32k} x chunk {4k, 8k, 16k} x step budget, overlap, memory checked; coarse
on 200 Mooncake requests, the best two confirmed on 600 (the headline's windows). Checks whether the rows searched
over CP {none, 16k, 32k} only (H800, 32 dies) stand. From the repository root:
``PYTHONPATH=. python docs/results/headline/baseline_cp.py PROFILE DEVICES TARGET SLO``, e.g. ``h800-node 64 0.99
5.77`` (a few minutes each); logs ``baseline_cp-*.log`` beside it.
"""
import sys
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.studies.grids import mooncake_trace, sync_grid
from asap_comm.sim.costmodel.memory import deployment_problems
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.core.sweep import capacity_rate, search_best

profile, D, target, slo = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
cost, shapes = CostModel.load(profile, "deepseek-v3"), ModelShapes.load("deepseek-v3")
trace, _desc = mooncake_trace(600)
probe = trace[:200]
cands = sync_grid(D, [1, 2, 4, 8], [None, 4096, 8192, 16384, 32768], [4096, 8192, 16384], shapes.heads, [True],
                  [16384])
cands = [d for d in cands if not deployment_problems(d, cost.profile, shapes)]
ref = [d for d in sync_grid(D, [8], [16384], [16384], shapes.heads, [True], [16384])][0]
start = 0.25 * capacity_rate(probe, cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks)
f = search_best(cands, probe, cost, shapes, slo, start_rate=start, bisections=2, target=target,
                confirm_trace=trace, confirm_top=2, confirm_bisections=4, progress=f"{profile} {D} p{target} slo {slo}")
print(f"{profile} {D} dies SLO {slo} p{target}: {len(cands)} baselines; best {f['best'].label}: "
      f"{f['best_sweep']['slo_compliant_throughput']}", f"at: {f['best_sweep'].get('at_slo_compliant_load')}", flush=True)
