"""The long-prompt lane's pool and wait bound, replayed through the simulator of the emulated runs.

    PYTHONPATH=. python bench/lane_policy_replay.py [--deployment 32|64|both] [--out FILE]

For the two emulated deployments of the README (``examples/prefill.py --emulate ascend-910c-cm384
--emulate-model deepseek-v3``: the default 32 dies, 2 x TP8 + 16 expert dies; and 6 x TP8 + 16 at 64 dies),
runs the example's own request windows (the first 240 Mooncake requests, same-timestamp bursts, probes at each
rate as ``--sweep auto`` builds them) through ``simulate_emulated`` with the host costs and router skew that
``validate --regime emulated`` measured (``docs/results/validation-emulated``), for each lane policy: the KV
pool (one or more longest prompts, ``--lane-tokens``) and the wait bound (``lane_wait_s``, here in SLOs). Prints
per rate the SLO attainment, served tokens/s and TTFT p99; ASAP only (the baseline has no lane). Seconds, not
minutes: the simulator predicted the emulated runs' attainment within a few points (README), so this is how
the policies were compared before any emulated run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from asap_comm.serving import summarize_run
from asap_comm.serving.plugins import load_model_factory
from asap_comm.serving.runtime_args import runtime_config_from_args
from asap_comm.serving.traces import Request
from asap_comm.sim.calibrate.emulated import fitted_overheads
from asap_comm.sim.emulate import deploy, job  # the example's request windows, deployment flags and rate scaling
from asap_comm.sim.emulate.emulator import simulate_emulated

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "docs" / "results" / "validation-emulated" / "validation_emulated.json"

EMU = ["--emulate", "ascend-910c-cm384", "--emulate-model", "deepseek-v3"]
# name -> (example flags, the run's automatic SLO in wall seconds as the emulated run measured it, rates req/s)
DEPLOYMENTS = {
    "32": (EMU, 3.329, (1.9, 2.67, 3.17, 3.77, 4.5)),
    "64": (EMU + ["--attention-ranks", "6", "--attention-tp", "8", "--expert-ranks", "4", "--expert-dies", "4",
                  "--sync-tp", "8", "--cp-threshold", "128", "--chunk-len", "64", "--time-scale", "0.5"],
           4.86, (4.0, 6.0, 8.0, 10.0, 12.0)),
}
# (pool in longest prompts, wait bound in SLOs or None)
POLICIES = ((1, None), (1, 1.0), (1, 2.0), (1, 3.0), (2, None), (4, None))


def setup(flags: list) -> tuple:
    args = deploy.parse_args(flags)
    base = load_model_factory(args.model, seed=args.seed)
    reqs = job.make_requests(args, base.describe()["vocab_size"])
    cfg = deploy.mode_config(runtime_config_from_args(args), "async", args)
    factory = deploy.emulated(args, base, "async")
    # the lane threshold the emulated runs used (--lane-threshold auto: 256 served tokens on both deployments)
    cfg = dataclasses.replace(cfg, placer_linear_weight=factory.placer_linear_weight(), lane_threshold=256)
    return args, factory, cfg, reqs


def replay(name: str, host: dict, skew: float) -> list:
    flags, slo, rates = DEPLOYMENTS[name]
    args, factory, cfg, reqs = setup(flags)
    rows = []
    for prompts, wait in POLICIES:
        c = dataclasses.replace(cfg, lane_tokens=prompts * args.max_prompt_len,
                                lane_wait_s=None if wait is None else wait * slo)
        for rate in rates:
            load = job.at_rate(job.probe_requests(reqs, rate), rate)
            trace = [Request(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in load]
            res = simulate_emulated(factory, "async", trace, c, host_overhead=host, expert_skew=skew)
            s = summarize_run(res.records, slo).as_dict()
            offered = rate * sum(t.prompt_len for t in trace) / len(trace)
            rows.append({"deployment": name, "pool_prompts": prompts, "wait_slos": wait, "rate_req_s": rate,
                         "offered_tokens_per_s": offered, "served_tokens_per_s": s["throughput_tokens_per_s"],
                         "slo_attainment": s["slo_attainment"], "ttft_p90_s": s["ttft_p90_s"],
                         "ttft_p99_s": s["ttft_p99_s"], "slo_s": slo})
            r = rows[-1]
            print(f"  {name} dies  pool {prompts}  wait {'none' if wait is None else f'{wait:g} SLO':8s} "
                  f"{rate:5.2f} req/s  offered {offered:6.0f}  served {r['served_tokens_per_s']:6.0f}  "
                  f"att {r['slo_attainment']:.3f}  p90 {r['ttft_p90_s']:6.2f}  p99 {r['ttft_p99_s']:6.2f} s",
                  flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deployment", choices=("32", "64", "both"), default="both")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    host, skews = fitted_overheads(VALIDATION)  # the probe bench/emulated_replay.py uses too
    skew = skews["async"]
    rows = []
    for name in (("32", "64") if a.deployment == "both" else (a.deployment,)):
        print(f"{name} dies: SLO {DEPLOYMENTS[name][1]} s wall; lane pool in longest prompts, wait bound in SLOs",
              flush=True)
        rows += replay(name, host, skew)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"host_overhead": host, "expert_skew": skew, "rows": rows}, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
