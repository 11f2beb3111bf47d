"""The 384-die baseline with context parallelism above 2k and 4k tokens, at the headline's SLO held (2.58 s).

The headline's SLO rule (3x the fastest baseline's unloaded TTFT of the p90 prompt) ties the SLO to the
baseline grid; this searches the baseline alone with smaller CP thresholds at the same SLO, p99 and p90
(the same trace, coarse 1500 requests, the best two confirmed on 3000).
Run from the repository root: ``PYTHONPATH=. python docs/results/headline384/baseline_small_cp.py``.
"""
from asap_comm.sim.costmodel.costs import CostModel
from asap_comm.sim.costmodel.shapes import ModelShapes
from asap_comm.sim.studies.grids import sync_grid, mooncake_trace
from asap_comm.sim.costmodel.memory import deployment_problems
from asap_comm.sim.core.sweep import capacity_rate, search_best
cost, shapes = CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.load("deepseek-v3")
trace, _desc = mooncake_trace(3000)
probe = trace[:1500]
syncs = sync_grid(384, [4, 8], [2048, 4096], [4096, 8192, 16384], shapes.heads, [True], [16384])
syncs = [d for d in syncs if not deployment_problems(d, cost.profile, shapes)]
ref = [d for d in sync_grid(384, [8], [8192], [16384], shapes.heads, [True], [16384])][0]
start = 0.25 * capacity_rate(probe, cost, shapes, ref.cfg, sync_ranks=ref.sync_ranks)
for slo, target in ((2.58, 0.99), (2.58, 0.9)):
    f = search_best(syncs, probe, cost, shapes, slo, start_rate=start, bisections=2, target=target,
                    confirm_trace=trace, confirm_top=2, confirm_bisections=4, progress=f"base384 slo {slo} p{int(target*100)}")
    sct = f["best_sweep"]["slo_compliant_throughput"]
    print(f"SLO {slo} p{target}: best {f['best'].label}: {sct}", flush=True)
