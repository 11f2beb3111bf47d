"""afd-plugin's capacity measurement, emulated: their 32-die deployment on their 128-request screening window.

vLLM afd-plugin issue 170 (and its stage report) measured the capacity of DeepSeek-V3.2 W8A8 on 32 Ascend A3 dies:
the highest offered input tokens/s whose TTFT p99 over a 128-request window of the Mooncake trace stays <= 50 s:
baseline DP4 x TP8 (EP32) about 2,600 tok/s, AFD 2 x TP8 + 16 FFN dies about 4,400 tok/s, **1.68x**. This script
measures the same in real processes on emulated accelerators (``asap_comm.sim.emulate.emulator``), the deployment of
``examples/prefill.py --emulate`` (ASAP 2 x TP8 + 16 expert dies against 4 x TP8 with EP over all 32 dies and
context parallelism, ``asap_comm.sim.emulate.deploy.EMULATE_DEFAULTS``):

* the devices: the 910C profile with the afd-plugin's software stack (``--stack``, default ``vllm-ascend-eager``:
  the three overrides ``validate --regime published`` fitted to their solo TTFTs; their eager stack is several
  times slower per token than CloudMatrix-Infer's, so the 50-s criterion means what it meant for them);
* the window: ``asap_comm.sim.calibrate.published.afd_screening_window`` (the shared trace's 128 requests nearest the
  published window: its bursts kept, prompts clipped at 63,778 tokens), lengths divided by the token scale;
* the criterion: TTFT p99 <= 50 modelled seconds (50 x the time scale in wall seconds);
* the points: the published screening table's offered loads (``--loads``, default 2,185 and 4,371 input tokens/s,
  where the report gives both sides' TTFT p50 and p99), each one real run per mode, every output checked against
  the reference, beside the published figures and the simulator's prediction of the same run;
* with ``--search``, each mode's capacity as well: from the simulator's prediction (``simulate_emulated``), up or
  down by 1.5x until the criterion flips, then geometric bisection to a bracket of ``--bound`` (slow: a low load
  stretches the window to many minutes, and the window's 20-request burst bounds the p99 from below, so the
  criterion may never flip).

    PYTHONPATH=. python bench/afd_window.py [--loads 2185,4371] [--search] [--cp-threshold 0]
        [--out bench/results/afd_window]

Writes ``afd_window.json`` (every point: offered tok/s, TTFT p50/p90/p99 in modelled seconds, the simulator's,
the published ones, overruns; with ``--search`` each mode's capacity and bracket, the ratio beside 1.68x).
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

from asap_comm.serving import Request, summarize_run
from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.runtime import PromptRequest
from asap_comm.sim.calibrate.published import stack_profile
from asap_comm.sim.calibrate.published_afd import afd_screening_window
from asap_comm.sim.core import sweep
from asap_comm.sim.emulate import deploy, job  # the example's deployment, reference and checking code
from asap_comm.sim.emulate.emulator import simulate_emulated

P99_SLO_S = 50.0  # the study's criterion, modelled seconds
PUBLISHED = {"baseline_tok_s": 2600.0, "afd_tok_s": 4400.0, "ratio": 1.68,
             "source": "vllm-project/afd-plugin issue 170, stage report section 1 (capacity search)",
             # (offered tok/s, mode) -> (TTFT p50, p99) s, the screening table (asap_comm.sim.calibrate.published)
             "points": {"2185": {"sync": [17.85, 46.78], "async": [12.50, 40.21]},
                        "4371": {"sync": [24.03, 52.30], "async": [18.10, 44.08]}}}


def emulate_args(args, profile_path: str) -> argparse.Namespace:
    """The example's --emulate deployment and flags (``deploy.parse_args``: its EMULATE_DEFAULTS), lane threshold
    auto."""
    argv = ["--emulate", profile_path, "--emulate-model", "deepseek-v3", "--seed", str(args.seed), "--num-requests",
            str(args.num_requests), "--time-scale", str(args.time_scale), "--token-scale", str(args.token_scale)]
    if args.cp_threshold is not None:
        argv += ["--cp-threshold", str(args.cp_threshold)]
    return deploy.parse_args(argv + (["--no-long-prompt-lane"] if args.no_long_prompt_lane else []))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=128, help="the window's requests (the study's 128)")
    p.add_argument("--loads", default="2185,4371", help="offered modelled input tokens/s of the fixed points")
    p.add_argument("--search", action="store_true", help="also search each mode's capacity (slow)")
    p.add_argument("--no-long-prompt-lane", action="store_true", help="ASAP without its long-prompt lane (ablation)")
    p.add_argument("--bound", type=float, default=1.15, help="stop when the capacity bracket is within this ratio")
    p.add_argument("--time-scale", type=float, default=deploy.DEFAULT_TIME_SCALE)
    p.add_argument("--token-scale", type=int, default=deploy.DEFAULT_TOKEN_SCALE)
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--cp-threshold", type=int, default=None,
                   help="the baseline's context parallelism: served tokens above which a prompt is shared by several "
                        "DP groups (default: the example's, 64 = 8,192 emulated tokens; 0: off, as afd-plugin's "
                        "baseline)")
    p.add_argument("--stack", default="vllm-ascend-eager",
                   help="the software stack of the 910C profile (cloudmatrix-infer: the profile as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/afd_window")
    args = p.parse_args(argv)
    if not args.bound > 1.0:
        p.error(f"--bound {args.bound}: must be > 1")
    if args.cp_threshold is not None and args.cp_threshold < 0:
        p.error(f"--cp-threshold {args.cp_threshold}: give a number of served tokens >= 1, or 0 for off")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile_path = out / f"profile_{args.stack}.json"
    profile_path.write_text(json.dumps(stack_profile("ascend-910c-cm384", args.stack).data, indent=1))
    ea = emulate_args(args, str(profile_path))
    K, S = ea.time_scale, ea.token_scale
    factory = load_model_factory(ea.model, seed=0)
    info = model_info_of(factory)
    window = afd_screening_window(args.num_requests)  # modelled seconds, emulated tokens
    g = torch.Generator().manual_seed(args.seed)
    lens = [min(ea.max_prompt_len, max(1, round(r.prompt_len / S))) for r in window]
    reqs = [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (n,), generator=g))
            for r, n in zip(window, lens)]
    refs, _ = job.references(factory, reqs)
    mean_emulated = S * sum(lens) / len(lens)
    cfgs = deploy.runtime_configs(ea, factory)  # each mode's, the placer weighing work as the emulated device does
    slo_wall = P99_SLO_S * K
    cfgs["async"] = dataclasses.replace(cfgs["async"], long_prompt_lane=not args.no_long_prompt_lane,
                                        lane_threshold=deploy.lane_threshold(ea, factory, cfgs["async"], slo_wall))
    t0 = time.time()
    print(f"window: {len(reqs)} requests, {S * sum(lens):,.0f} emulated tokens (mean {mean_emulated:,.0f}), "
          f"criterion TTFT p99 <= {P99_SLO_S:g} s modelled ({slo_wall:.2f} s wall at time scale {K:g}); lane "
          f"threshold {cfgs['async'].lane_threshold} served tokens", file=sys.stderr, flush=True)

    def load_at(tok_s: float) -> list:
        """The window at ``tok_s`` offered modelled input tokens/s, arrivals in wall seconds."""
        trace = sweep.at_rate([Request(r.request_id, r.arrival_s, n) for r, n in zip(window, lens)],
                              tok_s / mean_emulated)
        return [PromptRequest(r.request_id, t.arrival_s * K, r.token_ids) for r, t in zip(reqs, trace)]

    def simulated(mode: str, tok_s: float) -> dict:
        """The simulator's TTFT p50 / p90 / p99 (modelled seconds) of the run at ``tok_s``."""
        trace = [Request(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in load_at(tok_s)]
        res = simulate_emulated(deploy.emulated(ea, factory, mode), mode, trace, cfgs[mode])
        s = summarize_run(res.records, slo_wall).as_dict()
        return {k: (None if s[k] is None else s[k] / K) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")}

    counts = {"checked": 0, "mismatches": 0}

    def real_point(mode: str, tok_s: float, points: list) -> bool:
        """One real run of ``mode`` at ``tok_s``: its row appended to ``points``; True if it meets the criterion."""
        load = load_at(tok_s)
        with tempfile.TemporaryDirectory(prefix="asap-afd-") as stats_dir:
            res = job.run_mode(mode, deploy.emulated(ea, factory, mode, stats_dir), info, load, cfgs[mode])
            emu = job.emulation_stats(stats_dir)
        c, b, _ = job.check(res, refs)
        counts["checked"] += c
        counts["mismatches"] += b
        s = summarize_run(res.records, slo_wall).as_dict()
        sim = simulated(mode, tok_s)
        row = {"offered_tokens_per_s": tok_s, "failed": s["num_failed"],
               **{k: (None if s[k] is None else s[k] / K) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")},
               **{f"sim_{k}": v for k, v in sim.items()}, "overrun_fraction": emu["overrun_fraction"],
               "checked": c, "mismatches": b,
               "published": PUBLISHED["points"].get(f"{tok_s:.0f}", {}).get(mode)}
        points.append(row)
        ok = row["ttft_p99_s"] is not None and row["ttft_p99_s"] <= P99_SLO_S and not s["num_failed"]
        print(f"[{time.time() - t0:6.0f} s] {mode:5s} {tok_s:7.0f} tok/s: TTFT p50 {_s(row['ttft_p50_s'])} / p99 "
              f"{_s(row['ttft_p99_s'])} s (sim {_s(sim['ttft_p50_s'])} / {_s(sim['ttft_p99_s'])}), overruns "
              f"{emu['overrun_fraction']:.1%}, {'meets' if ok else 'misses'} {P99_SLO_S:g} s", file=sys.stderr,
              flush=True)
        return ok

    def search(passes, start: float) -> tuple:
        """(last passing load or None, first failing load or None) from ``start``: x/÷1.5, then bisection."""
        lo = hi = None
        x = start
        for _ in range(8):
            if passes(x):
                lo = x
                if hi is not None:
                    break
                x *= 1.5
            else:
                hi = x
                if lo is not None:
                    break
                x /= 1.5
        while lo is not None and hi is not None and hi / lo > args.bound:
            mid = (lo * hi) ** 0.5
            if passes(mid):
                lo = mid
            else:
                hi = mid
        return lo, hi

    result = {"published": PUBLISHED, "criterion_p99_s": P99_SLO_S, "profile": "ascend-910c-cm384",
              "stack": args.stack, "time_scale": K, "token_scale": S,
              "num_requests": len(reqs), "window_tokens": S * sum(lens), "deployment": {
                  "async": f"{ea.attention_ranks} x TP{ea.attention_tp} + {ea.expert_ranks * ea.expert_dies} expert "
                           f"dies", "sync": f"{deploy.sync_workers(ea)} x TP{ea.sync_tp}, EP over all dies, "
                                            + (f"CP > {ea.cp_threshold * S} tokens" if ea.cp_threshold else "no CP")},
              "long_prompt_lane": cfgs["async"].long_prompt_lane, "lane_threshold": cfgs["async"].lane_threshold,
              "modes": {}}
    loads = [float(x) for x in args.loads.split(",") if x]
    for mode in args.modes.split(","):
        points = []
        result["modes"][mode] = {"points": points}
        for tok_s in loads:
            real_point(mode, tok_s, points)
            (out / "afd_window.json").write_text(json.dumps(result, indent=2))
    for mode in args.modes.split(",") if args.search else []:
        sim_points: dict = {}

        def sim_passes(tok_s: float, mode=mode) -> bool:
            sim_points[tok_s] = simulated(mode, tok_s)["ttft_p99_s"]
            return sim_points[tok_s] is not None and sim_points[tok_s] <= P99_SLO_S

        sim_lo, sim_hi = search(sim_passes, 3000.0)
        if sim_hi is None:
            raise SystemExit(f"afd_window.py: the simulator puts {mode}'s capacity above {sim_lo:.0f} tok/s, beyond "
                             "the window's own arrival rate; nothing to search")
        print(f"[{time.time() - t0:6.0f} s] {mode}: simulated capacity {sim_lo} tok/s (bracket to {sim_hi})",
              file=sys.stderr, flush=True)
        points = result["modes"][mode]["points"]

        def real_passes(tok_s: float, mode=mode, points=points) -> bool:
            return real_point(mode, tok_s, points)

        lo, hi = search(real_passes, sim_lo if sim_lo is not None else (sim_hi or 3000.0) / 1.5)
        result["modes"][mode].update({"capacity_tokens_per_s": lo, "first_failing_tokens_per_s": hi,
                                      "sim_capacity_tokens_per_s": sim_lo, "sim_first_failing_tokens_per_s": sim_hi})
        points.sort(key=lambda r: r["offered_tokens_per_s"])
        (out / "afd_window.json").write_text(json.dumps(result, indent=2))
    m = result["modes"]
    if args.search and "async" in m and "sync" in m:
        a, b = m["async"]["capacity_tokens_per_s"], m["sync"]["capacity_tokens_per_s"]
        sa, sb = m["async"]["sim_capacity_tokens_per_s"], m["sync"]["sim_capacity_tokens_per_s"]
        result["ratio"] = None if not a or not b else a / b
        result["sim_ratio"] = None if not sa or not sb else sa / sb
    checked, mismatches = counts["checked"], counts["mismatches"]
    result.update(checked=checked, mismatches=mismatches, wall_s=time.time() - t0)
    (out / "afd_window.json").write_text(json.dumps(result, indent=2))
    for mode, v in m.items():
        for r in v["points"]:
            pub = PUBLISHED["points"].get(f"{r['offered_tokens_per_s']:.0f}", {}).get(mode)
            print(f"{mode:5s} {r['offered_tokens_per_s']:7.0f} tok/s: TTFT p50 {_s(r['ttft_p50_s'])} / p99 "
                  f"{_s(r['ttft_p99_s'])} s (simulated {_s(r['sim_ttft_p50_s'])} / {_s(r['sim_ttft_p99_s'])}"
                  + (f"; published {pub[0]:.2f} / {pub[1]:.2f}" if pub else "") + ")")
        if args.search:
            print(f"{mode:5s} capacity (TTFT p99 <= {P99_SLO_S:g} s): {v['capacity_tokens_per_s']} tok/s (first "
                  f"failing {v['first_failing_tokens_per_s']}); simulated {v['sim_capacity_tokens_per_s']}")
    if "ratio" in result:
        print(f"ratio ASAP / baseline: {result['ratio']} (published AFD / baseline {PUBLISHED['ratio']}x); "
              f"simulated {result['sim_ratio']}")
    print(f"{checked} outputs checked, {mismatches} mismatches; wrote {out / 'afd_window.json'}")
    return 0 if mismatches == 0 else 1


def _s(x) -> str:
    return "none" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
