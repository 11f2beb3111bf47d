"""Serving benchmark: SLO-compliant throughput of ASAP against the synchronous DP+EP baseline, with the ablation.

Usage::

    python bench/bench_serving.py [--rates 6,8,10,12,14,16,18] [--num-requests 40] [--out bench/results]

The default workload of ``examples/prefill.py`` (``small`` model, random
weights, a Gamma-bursty trace with log-normal prompt lengths, A = 2 attention +
E = 2 expert processes; the baseline runs on A + E = 4 DP+EP processes) is
swept over request rates for each variant, in this order, in one run:

* ``sync``: the synchronous baseline (``run_sync``);
* ``async``: ASAP with all four optimizations;
* ``async -barrier_free`` ... ``async -expert_batching``: one optimization off.

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
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import prefill  # noqa: E402  (the example's load, reference and checking code)

from asap_comm.serving import slo_compliant_throughput, summarize_run  # noqa: E402
from asap_comm.serving.runtime import RuntimeConfig  # noqa: E402

VARIANTS = [("sync", "sync", {}), ("async", "async", {})] + [
    (f"async -{opt}", "async", {opt: False}) for opt in ("barrier_free", "ping_pong", "load_aware", "expert_batching")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--rates", default="6,8,10,12,14,16,18", help="request rates (req/s) of the sweep")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--variants", default="", help="comma-separated subset of: " + ", ".join(v[0] for v in VARIANTS))
    p.add_argument("--slo", default="auto", help="TTFT SLO in seconds, or auto (3x the baseline's unloaded TTFT of "
                                                 "the p90 prompt, measured at the start: fix it to compare runs)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    eargs = argparse.Namespace(trace="synthetic", rate=3.0, num_requests=args.num_requests, burstiness=2.0,
                               median_len=48, max_prompt_len=512, seed=0)
    torch.set_num_threads(1)
    factory = prefill.StageFactory(args.model, 0)
    mcfg = factory.config()
    info = prefill.model_info(mcfg)
    requests = prefill.make_requests(eargs, mcfg.vocab_size)
    refs, single_process_s = prefill.references(factory, requests)
    mean_len = sum(int(r.token_ids.numel()) for r in requests) / len(requests)
    rates = [float(x) for x in args.rates.split(",") if x]
    base = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=256, chunk_len=256,
                         max_prompt_len=512)
    slo_info = prefill.resolve_slo(argparse.Namespace(slo=args.slo, seed=0), factory, info, base, requests,
                                   single_process_s, ["sync"])
    slo = slo_info["ttft_s"]
    print(prefill.describe_slo(slo_info), file=sys.stderr, flush=True)
    chosen = [v for v in VARIANTS if not args.variants or v[0] in args.variants.split(",")]
    print(f"{len(requests)} requests, mean prompt {mean_len:.0f} tokens, SLO {slo:.3f} s, rates {rates}",
          file=sys.stderr, flush=True)
    results, checked, mismatches = {}, 0, 0
    t_start = time.time()
    for name, mode, change in chosen:
        cfg = dataclasses.replace(base, **change)
        runs = []
        for rate in rates:
            result = prefill.run_mode(mode, factory, info, prefill.at_rate(requests, rate), cfg)
            s = summarize_run(result.records, slo).as_dict()
            c, b, _ = prefill.check(result, refs)
            checked, mismatches = checked + c, mismatches + b
            runs.append({"rate_req_s": rate, "offered_tokens_per_s": rate * mean_len, **s})
            print(f"[{time.time() - t_start:6.0f} s] {name:24s} rate {rate:5.1f}: TTFT p90 {s['ttft_p90_s']:.3f} s, "
                  f"SLO attainment {s['slo_attainment']:.2f}", file=sys.stderr, flush=True)
        sct = slo_compliant_throughput([(r["offered_tokens_per_s"], r["slo_attainment"]) for r in runs])
        results[name] = {"config": {k: v for k, v in dataclasses.asdict(cfg).items()}, "runs": runs,
                         "slo_compliant_throughput": sct}
    sync_sct = results.get("sync", {}).get("slo_compliant_throughput")
    lines = ["| variant | SLO-compliant throughput (tok/s) | ratio over sync | TTFT p50 / p90 at "
             f"{rates[0]:g} req/s (s) |", "| --- | --- | --- | --- |"]
    for name, r in results.items():
        sct = r["slo_compliant_throughput"]
        ratio = f"{sct / sync_sct:.2f}x" if sct and sync_sct else "-"
        low = r["runs"][0]
        lines.append(f"| {name} | {sct if sct is None else round(sct)} | {ratio} | "
                     f"{low['ttft_p50_s']:.3f} / {low['ttft_p90_s']:.3f} |")
    md = "\n".join(lines) + (f"\n\n{prefill.describe_slo(slo_info)}; {len(requests)} requests, mean prompt "
                             f"{mean_len:.0f} tokens; correctness: {checked} outputs checked, {mismatches} mismatches\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps({"slo": slo_info, "rates": rates, "mean_prompt_tokens": mean_len,
                                                  "correctness": {"checked": checked, "mismatches": mismatches},
                                                  "variants": results}, indent=2, default=str))
    (out / "serving.md").write_text(md)
    print(md)
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
