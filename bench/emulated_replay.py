"""The simulator against one emulated sweep, under the one metric: an ``examples/prefill.py --emulate ...
--sweep auto`` run replayed load by load through ``simulate_emulated``.

    python bench/emulated_replay.py RUN_DIR [--no-host-overhead] [--out FILE]

``RUN_DIR`` holds the example's ``summary.json`` (e.g. ``docs/results/emulated-64``). For every load the run
measured (each mode's ``--sweep auto`` probes), the same requests (the example's own window at that rate) go
through the simulator of the emulated run (``asap_comm.sim.emulate.emulator.simulate_emulated``: the same
profile, emulated model, dilation, token scale, device groups, SLO, lane threshold and wait bound), with the
host costs and router skew that ``validate --regime emulated`` measured on its unloaded probe
(``docs/results/validation-emulated``; ``--no-host-overhead`` leaves them out). Both sides are then counted the
same way (``serving.slo_compliant_throughput``: the SLO met at the target share AND served >= 0.9 of offered,
walking up from the lowest load), and the two ratios ASAP / baseline are compared: the check the scaling curve
needs at the sizes this host can emulate (issue: "the simulator's ratio within 15% of the emulated one").
One simulated run takes seconds; the emulated run it replays took minutes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from asap_comm.serving import slo_compliant_throughput, summarize_run, throughput_ratio
from asap_comm.serving.plugins import load_model_factory
from asap_comm.serving.traces import Request
from asap_comm.sim.calibrate.emulated import fitted_overheads
from asap_comm.sim.emulate import deploy, job
from asap_comm.sim.emulate.emulator import simulate_emulated

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "docs" / "results" / "validation-emulated" / "validation_emulated.json"
TARGET = 0.15  # the simulator's error target on a ratio (relative)


def replay(run_dir: Path, host_overhead: bool = True, expert_skew: "dict | None" = None) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    if not summary.get("runs") or "config" not in summary:
        raise SystemExit(f"emulated_replay: {run_dir / 'summary.json'} has no runs/config: is it an "
                         "examples/prefill.py --sweep run?")
    # the run's flags over today's defaults (a flag added since the run keeps its default)
    args = argparse.Namespace(**{**vars(deploy.build_parser().parse_args([])), **summary["config"]})
    if not args.emulate:
        raise SystemExit(f"emulated_replay: {run_dir} is not an emulated run (--emulate not given)")
    if any("served_fraction" not in r for r in summary["runs"]):
        raise SystemExit(f"emulated_replay: {run_dir / 'summary.json'} predates the served fraction (a load counts "
                         "only where it is sustained): re-run the example to compare it under the one metric")
    slo = summary["slo"]["ttft_s"]
    base = load_model_factory(args.model, seed=args.seed)
    requests = job.make_requests(args, base.describe()["vocab_size"])
    cfgs = deploy.runtime_configs(args, base)
    lane_tokens = (summary.get("lane_tokens") or {}).get("tokens")
    cfgs["async"] = dataclasses.replace(cfgs["async"], lane_threshold=summary["lane_threshold"],
                                        lane_wait_s=summary.get("lane_wait_s"),
                                        **({"lane_tokens": lane_tokens} if lane_tokens else {}))
    host, skews = fitted_overheads(VALIDATION) if host_overhead else (None, {"async": 1.0, "sync": 1.0})
    skew_from = {m: "validation probe" if host_overhead else "none" for m in skews}
    if host_overhead:  # the served router's skew grows with the ranks: the run's own measurement where it has one
        for m in skews:
            measured = sorted(r["emulation"]["routing_skew"] for r in summary["runs"]
                              if r["mode"] == m and "routing_skew" in r.get("emulation", {}))
            if measured:
                skews[m], skew_from[m] = measured[len(measured) // 2], "this run"
    for m, v in (expert_skew or {}).items():
        skews[m], skew_from[m] = v, "given"
    print("  expert skew: " + ", ".join(f"{m} {skews[m]:.2f} ({skew_from[m]})" for m in ("async", "sync")),
          flush=True)
    factories = {m: deploy.emulated(args, base, m) for m in ("async", "sync")}
    rows = []
    for run in summary["runs"]:
        mode, rate = run["mode"], run["rate_req_s"]
        load = job.at_rate(job.probe_requests(requests, rate), rate)
        trace = [Request(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in load]
        res = simulate_emulated(factories[mode], mode, trace, cfgs[mode], host_overhead=host,
                                expert_skew=skews[mode])
        s = summarize_run(res.records, slo).as_dict()
        mean = sum(t.prompt_len for t in trace) / len(trace)
        sim = {"offered_tokens_per_s": rate * mean, "slo_attainment": s["slo_attainment"],
               "served_fraction": s["served_fraction"], "ttft_p90_s": s["ttft_p90_s"], "ttft_p99_s": s["ttft_p99_s"]}
        real = {k: run[k] for k in ("offered_tokens_per_s", "slo_attainment", "served_fraction", "ttft_p90_s",
                                    "ttft_p99_s")}
        rows.append({"mode": mode, "rate_req_s": rate, "requests": len(trace), "real": real, "sim": sim})
        print(f"  [{mode}] {rate:6.3f} req/s  attainment real {real['slo_attainment']:.2f} sim "
              f"{sim['slo_attainment']:.2f}  served real {real['served_fraction']:.0%} sim "
              f"{sim['served_fraction']:.0%}  p90 real {real['ttft_p90_s']:.2f} sim {sim['ttft_p90_s']:.2f} s",
              flush=True)
    out = {"run": str(run_dir), "slo_s": slo, "host_overhead": host, "expert_skew": skews,
           "expert_skew_from": skew_from, "rows": rows}
    for side in ("real", "sim"):
        pts = {m: [r[side] for r in rows if r["mode"] == m] for m in ("async", "sync")}
        sct = {m: slo_compliant_throughput(pts[m]) if pts[m] else None for m in pts}
        ratio, why = throughput_ratio(sct["async"], sct["sync"], points=(pts["async"], pts["sync"]))
        out[side] = {"slo_compliant_throughput": sct, "ratio": ratio, "ratio_withheld": why}
    r, s = out["real"]["ratio"], out["sim"]["ratio"]
    out["ratio_error"] = None if r is None or s is None else s / r - 1.0
    return out


def _mode_skew(text: str) -> tuple:
    """``--expert-skew MODE=X``: ``(mode, X)``."""
    mode, _, value = text.partition("=")
    try:
        x = float(value)
    except ValueError:
        x = 0.0
    if mode not in ("async", "sync") or not 1.0 <= x < 100:
        raise argparse.ArgumentTypeError(f"{text!r}: give async=X or sync=X with X in [1, 100)")
    return mode, x


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="an examples/prefill.py --emulate --sweep auto output folder")
    p.add_argument("--no-host-overhead", action="store_true",
                   help="simulate without the measured host costs and router skew")
    p.add_argument("--expert-skew", action="append", default=[], metavar="MODE=X", type=_mode_skew,
                   help="the served router's skew to charge for MODE (async or sync), for a run whose summary "
                        "predates the recorded one (examples/prefill.py records it per load since 2026-12-06)")
    p.add_argument("--out", type=Path, default=None, help="write the rows and both ratios as JSON here")
    a = p.parse_args(argv)
    skew = dict(a.expert_skew)
    if not (a.run_dir / "summary.json").is_file():
        print(f"emulated_replay: no summary.json in {a.run_dir}", file=sys.stderr)
        return 2
    out = replay(a.run_dir, host_overhead=not a.no_host_overhead, expert_skew=skew)
    for side in ("real", "sim"):
        o = out[side]
        sct = {m: "-" if v is None else f"{v:,.0f}" for m, v in o["slo_compliant_throughput"].items()}
        ratio = "-" if o["ratio"] is None else f"{o['ratio']:.2f}x"
        print(f"{side:4s}: ASAP {sct['async']} tok/s, baseline {sct['sync']} tok/s, ratio {ratio}"
              + (f" ({o['ratio_withheld']})" if o["ratio_withheld"] else ""))
    e = out["ratio_error"]
    print("ratio error: " + ("- (a ratio is withheld)" if e is None else
                             f"{e:+.0%} ({'within' if abs(e) <= TARGET else 'outside'} the {TARGET:.0%} target)"))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
