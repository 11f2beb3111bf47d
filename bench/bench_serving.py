"""Serving benchmark: SLO-compliant throughput of ASAP against the synchronous DP+EP baseline, with the ablation.

Usage::

    python bench/bench_serving.py [--rates 6,8,10,12,14,16,18] [--num-requests 40] [--out bench/results]
    python bench/bench_serving.py --emulate ascend-910c-cm384 --rates auto --num-requests 240
        # the ablation on emulated accelerators, the example's --emulate deployment (about 45 minutes)
    python bench/bench_serving.py --emulate ascend-910c-cm384 --rates 3.5 --slo 3.9 --num-requests 240
        # every variant at one load and a fixed SLO (about 9 minutes)

The default workload of ``examples/prefill.py`` (``small`` model, random
weights, a Gamma-bursty trace with log-normal prompt lengths, A = 2 attention +
E = 2 expert processes; the baseline runs on A + E = 4 DP+EP processes) is
swept over request rates for each variant, in this order, in one run:

* ``sync``: the synchronous baseline (``run_sync``);
* ``async``: ASAP with all four optimizations;
* ``async -barrier_free`` ... ``async -expert_batching``: one optimization off;
* ``async -long_prompt_lane``: the long-prompt lane off.

The deployment, load and defaults are the example's for the same flags (``asap_comm.sim.emulate``'s
``deploy.parse_args``; with
``--emulate`` its memory check, emulated placer weight and lane threshold too).

Per variant: the SLO-compliant throughput (highest offered load, prompt
tokens/s, at which >= 90% of requests meet the TTFT SLO; the SLO is the
example's default, 3x the baseline's unloaded TTFT of the p90 prompt, measured
on the served processes) and its ratio over the
baseline's, and TTFT p50/p90 at the lowest swept rate (equal load). Every
output is checked against the reference forward. Writes ``serving.json`` and
``serving.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from asap_comm.serving import slo_compliant_throughput, summarize_run, throughput_ratio, withheld_reason
from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.slo import SLO_MULTIPLIER
from asap_comm.serving.traces import TraceError
from asap_comm.sim.emulate import deploy, job  # the example's load, reference and checking code

VARIANTS = [("sync", "sync", {}), ("async", "async", {})] + [
    (f"async -{opt}", "async", {opt: False})
    for opt in ("barrier_free", "ping_pong", "load_aware", "expert_batching", "long_prompt_lane")]


def example_args(args) -> argparse.Namespace:
    """The example's own arguments (``deploy.parse_args``) for this benchmark's flags: the same deployment, load
    and defaults as ``examples/prefill.py`` given those flags (with ``--emulate``, its EMULATE_DEFAULTS: tiny model,
    Mooncake trace, afd-plugin's 32 dies), so every flag the example adds reaches the benchmark too."""
    argv = ["--num-requests", str(args.num_requests), "--slo", str(args.slo)]
    if not args.emulate or args.model != "small":  # with --emulate the example's model (tiny) unless one is given
        argv += ["--model", args.model]
    given = [("--attention-ranks", args.attention_ranks), ("--expert-ranks", args.expert_ranks)]
    if args.emulate:
        argv += ["--emulate", args.emulate, "--emulate-model", args.emulate_model, "--time-scale",
                 repr(args.time_scale), "--token-scale", str(args.token_scale)]
        given += [("--attention-tp", args.attention_tp), ("--sync-tp", args.sync_tp),
                  ("--cp-threshold", args.cp_threshold)]
    for flag, value in given:
        if value is not None:
            argv += [flag, str(value)]
    return deploy.parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--rates", default="6,8,10,12,14,16,18", help="request rates (req/s) of the sweep")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--variants", default="", help="comma-separated subset of: " + ", ".join(v[0] for v in VARIANTS))
    p.add_argument("--slo", default="auto", help="TTFT SLO in seconds, or auto (3x the baseline's unloaded TTFT of "
                                                 "the p90 prompt, measured at the start: fix it to compare runs)")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulated accelerators (as examples/prefill.py --emulate, with its defaults: tiny model, "
                        "Mooncake trace, afd-plugin's 32 dies: 2 x TP8 attention + 4 expert processes of 4 dies against "
                        "4 x TP8 with CP, shm collectives); --rates auto searches each "
                        "variant's SLO-compliant rate")
    p.add_argument("--emulate-model", default="deepseek-v3")
    p.add_argument("--time-scale", type=float, default=deploy.DEFAULT_TIME_SCALE)
    p.add_argument("--token-scale", type=int, default=deploy.DEFAULT_TOKEN_SCALE)
    d = deploy.EMULATE_DEFAULTS
    p.add_argument("--attention-ranks", type=int, default=None,
                   help=f"default 2 ({d['attention_ranks']} with --emulate)")
    p.add_argument("--expert-ranks", type=int, default=None, help=f"default 2 ({d['expert_ranks']} with --emulate)")
    p.add_argument("--attention-tp", type=int, default=None,
                   help=f"with --emulate: devices per ASAP attention rank (default {d['attention_tp']})")
    p.add_argument("--sync-tp", type=int, default=None,
                   help=f"with --emulate: devices per baseline worker (default {d['sync_tp']})")
    p.add_argument("--cp-threshold", type=int, default=None,
                   help=f"with --emulate: the baseline's context parallelism above this many served tokens "
                        f"(default {d['cp_threshold']}; 0: off)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    eargs = example_args(args)
    if args.emulate:
        line = deploy.memory_refusal(eargs, "bench_serving.py")  # the example's: what the emulated dies cannot hold
        if line is not None:
            print(line, file=sys.stderr)
            return 2
    try:  # as the example: a bad trace line, an unknown preset, a missing file, a load that cannot be scaled
        factory = load_model_factory(eargs.model, seed=0)
        info = model_info_of(factory)
        requests = job.make_requests(eargs, info.vocab_size)
    except (TraceError, ValueError, LookupError, OSError) as e:
        print(f"bench_serving.py: {e}", file=sys.stderr)
        return 2
    refs, single_process_s = job.references(factory, requests)
    mean_len = sum(int(r.token_ids.numel()) for r in requests) / len(requests)
    auto_rates = args.rates.strip() == "auto"
    rates = [] if auto_rates else [float(x) for x in args.rates.split(",") if x]
    # as the example: each mode's config (with --emulate the placer weighs work as the emulated device does)
    cfgs = deploy.runtime_configs(eargs, factory)
    if args.emulate:
        single_process_s = max(single_process_s, deploy.emulated_p90_s(eargs, job.prompt_p90(requests)))
    slo_info = job.resolve_slo(eargs, {m: deploy.emulated(eargs, factory, m) for m in ("async", "sync")}, info,
                               cfgs, requests, single_process_s, ["sync"])
    slo = slo_info["ttft_s"]
    # as the example: the long-prompt lane's threshold (with --emulate, the simulator's predicted TTFT against the SLO)
    cfgs["async"] = dataclasses.replace(cfgs["async"], lane_threshold=deploy.lane_threshold(eargs, factory,
                                                                                            cfgs["async"], slo))
    print(job.describe_slo(slo_info), file=sys.stderr, flush=True)
    chosen = [v for v in VARIANTS if not args.variants or v[0] in args.variants.split(",")]
    print(f"{len(requests)} requests, mean prompt {mean_len:.0f} tokens, SLO {slo:.3f} s, rates {rates}",
          file=sys.stderr, flush=True)
    results, checked, mismatches = {}, 0, 0
    t_start = time.time()
    for name, mode, change in chosen:
        cfg = dataclasses.replace(cfgs[mode], **change)
        runs = []

        def run_at(rate: float) -> float:
            nonlocal checked, mismatches
            load = job.at_rate(job.probe_requests(requests, rate) if auto_rates else requests, rate)
            n = len(load)
            with tempfile.TemporaryDirectory(prefix="asap-emu-") as stats_dir:
                result = job.run_mode(mode, deploy.emulated(eargs, factory, mode, stats_dir), info, load, cfg)
                emu = job.emulation_stats(stats_dir) if args.emulate else None
            s = summarize_run(result.records, slo).as_dict()
            c, b, _ = job.check(result, refs)
            checked, mismatches = checked + c, mismatches + b
            load_mean = sum(int(r.token_ids.numel()) for r in load) / len(load)
            runs.append({"rate_req_s": rate, "offered_tokens_per_s": rate * load_mean, "requests": n, **s,
                         **({"overrun_fraction": emu["overrun_fraction"]} if emu else {})})
            p90 = "-" if s["ttft_p90_s"] is None else f"{s['ttft_p90_s']:.3f}"
            print(f"[{time.time() - t_start:6.0f} s] {name:24s} rate {rate:5.2f}: TTFT p90 {p90} s, "
                  f"SLO attainment {s['slo_attainment']:.2f}, served {runs[-1]['served_fraction']:.0%}"
                  + (f", overruns {emu['overrun_fraction']:.1%}" if emu else ""), file=sys.stderr, flush=True)
            return s["slo_attainment"], runs[-1]["served_fraction"]

        if auto_rates:
            workers = cfg.num_attention_ranks + (0 if mode == "async" else cfg.num_expert_ranks)
            unloaded = slo_info["unloaded_ttft_s"].get("sync") or slo / SLO_MULTIPLIER
            job.sweep_auto(run_at, job.sweep_start(workers, unloaded, mean_len, slo_info["p90_prompt_tokens"]))
        else:
            for rate in rates:
                run_at(rate)
        runs.sort(key=lambda r: r["rate_req_s"])
        sct = slo_compliant_throughput(runs)  # attainment >= 0.9 AND served >= 0.9 of offered (sustained)
        results[name] = {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "runs": runs,
                         "slo_compliant_throughput": sct, "withheld": withheld_reason(runs)}
    sync_sct = results.get("sync", {}).get("slo_compliant_throughput")
    lines = ["| variant | SLO-compliant throughput (tok/s) | ratio over sync | TTFT p50 / p90 at the lowest "
             "rate (s) |", "| --- | --- | --- | --- |"]
    fmt = (lambda v: "-" if v is None else f"{v:.3f}")
    for name, r in results.items():
        sct = r["slo_compliant_throughput"]
        r["ratio_over_sync"], why = throughput_ratio(sct, sync_sct, names=(name, "sync"),
                                                     points=(r["runs"], results.get("sync", {}).get("runs")))
        ratio = f"- ({why})" if why else f"{r['ratio_over_sync']:.2f}x"
        low = r["runs"][0]
        lines.append(f"| {name} | {sct if sct is None else round(sct)} | {ratio} | "
                     f"{fmt(low['ttft_p50_s'])} / {fmt(low['ttft_p90_s'])} ({low['rate_req_s']:.2f} req/s) |")
    md = "\n".join(lines) + (f"\n\n{job.describe_slo(slo_info)}; {len(requests)} requests, mean prompt "
                             f"{mean_len:.0f} tokens; correctness: {checked} outputs checked, {mismatches} mismatches\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps({"slo": slo_info, "rates": rates or "auto",
                                                  "emulation": deploy.emulated(eargs, factory, "async")
                                                  .describe_emulation() if args.emulate else None, "mean_prompt_tokens": mean_len,
                                                  "correctness": {"checked": checked, "mismatches": mismatches},
                                                  "variants": results}, indent=2, default=str))
    (out / "serving.md").write_text(md)
    print(md)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
