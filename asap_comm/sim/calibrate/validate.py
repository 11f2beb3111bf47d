"""``python -m asap_comm.sim validate``: the simulator against the real runtime on this host.

For each configuration (ranks, trace, load) and each mode, the real runtime
(``asap_comm.serving.run_async`` / ``run_sync``, the model loaded through the
``asap_comm.models`` plug-in) serves the trace, then the simulator replays the
same requests (same arrivals, same prompt lengths) with the ``local`` profile
(``--profile``, or ``--calibrate`` to fit one first; a fitted profile whose
recorded host fingerprint (CPU model, usable cores, torch version) is not this
host's is refitted first, or refused with ``--no-recalibrate``: a profile
fitted elsewhere is never used silently). ``validation.json`` has,
per run and metric (TTFT p50, TTFT p90, input-token throughput), the real and
simulated values and the relative error ``(sim - real) / real``; the table
on stdout marks errors above the 15% target.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ...serving.metrics import summarize_run
from ...serving.runtime import PromptRequest, RuntimeConfig, run_async
from ...serving.traces import scale_trace
from ..core.simulate import simulate
from ..costmodel.costs import CostModel
from ..costmodel.shapes import ModelShapes
from ..emulate.emulator import DEFAULT_TIME_SCALE
from .emulated import CONFIGS as ECONFIGS
from .emulated import table, validate_emulated
from .target import TARGET
from .target import validation_trace as _trace

METRICS = ("ttft_p50_s", "ttft_p90_s", "throughput_tokens_per_s")
_LABEL = {"ttft_p50_s": "TTFT p50", "ttft_p90_s": "TTFT p90", "throughput_tokens_per_s": "tok/s"}
# (name, attention ranks, expert ranks, trace, request rates)
CONFIGS = {
    "default": [
        ("A2E2 synthetic", 2, 2, "synthetic", (3.0, 8.0)),
        ("A1E2 synthetic", 1, 2, "synthetic", (3.0,)),
        ("A2E2 mooncake", 2, 2, "mooncake", (4.0,)),
    ],
    "quick": [("A2E1 synthetic", 2, 1, "synthetic", (6.0,))],
}


def _real(mode: str, factory, info, trace, cfg, seed: int):
    import torch

    from ...serving.sync import run_sync

    g = torch.Generator().manual_seed(seed)
    reqs = [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (r.prompt_len,),
                                                                    generator=g)) for r in trace]
    return (run_async if mode == "async" else run_sync)(factory, info, reqs, cfg)


def validate(out_dir, *, model: str = "small", profile: str = "local", configs: str = "default",
             num_requests: int = 40, calibrate_first: bool = False, seed: int = 0, progress: bool = True,
             recalibrate: bool = True, probe: bool = True) -> dict:
    """Run every configuration for real and simulated; write and return ``validation.json``'s content.

    ``probe``: before trusting a fitted profile whose fingerprint matches, time this host's probe operators
    (``asap_comm.sim.calibrate.probe``, a few seconds); where the host disagrees with the profile, calibrate first (or, with
    ``recalibrate=False``, refuse). The probe's verdict is ``validation.json``'s ``host_probe``."""
    from ...serving.plugins import load_model_factory, model_info_of

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if configs not in CONFIGS:
        raise ValueError(f"validate: configs={configs!r} is not one of {sorted(CONFIGS)}")
    if not calibrate_first:
        from .host import foreign_profile_reason
        from ..costmodel.hardware import Profile

        why = foreign_profile_reason(Profile.load(profile).data)
        if why is not None:
            if not recalibrate:
                raise ValueError(f"validate: the profile {profile!r} does not describe this host ({why}); its "
                                 "predictions would be checked against another machine. Run `python -m asap_comm.sim "
                                 "validate --calibrate` (fits this host first, about 40 s), or give --profile a "
                                 "profile fitted here")
            if progress:
                print(f"validate: the profile {profile!r} does not describe this host ({why}): calibrating this "
                      "host first", file=sys.stderr, flush=True)
            calibrate_first = True
    host_probe = None
    if not calibrate_first and probe:
        host_probe = _probe(profile, model, recalibrate, progress)
        calibrate_first = not host_probe["agrees"]
    if calibrate_first:
        from .host import calibrate

        calibrate(out, model, quick=configs == "quick", progress=progress)
        profile = str(out / "profile_local.json")
    cost, shapes = CostModel.load(profile, model), ModelShapes.load(model)
    factory = load_model_factory(model, seed=seed)
    info = model_info_of(factory)
    rows, t0 = [], time.perf_counter()
    for name, A, E, kind, rates in CONFIGS[configs]:
        # the real runtime's placer weighs work as the simulated one (CostModel.placer_linear_weight)
        cfg = RuntimeConfig(num_attention_ranks=A, num_expert_ranks=E, token_budget=256, chunk_len=256,
                            max_prompt_len=512, placer_linear_weight=cost.placer_linear_weight())
        base = _trace(kind, num_requests, cfg.max_prompt_len, seed)
        for rate in rates:
            trace = scale_trace(base, target_rate=rate)
            for mode in ("async", "sync"):
                real = _real(mode, factory, info, trace, cfg, seed)
                sim = simulate(mode, trace, cost, shapes, cfg)
                slo = 1.0  # attainment is not compared; summarize_run needs an SLO
                r = summarize_run(real.records, slo).as_dict()
                s = summarize_run(sim.records, slo).as_dict()
                errors = {m: (None if not r[m] or s[m] is None else (s[m] - r[m]) / r[m]) for m in METRICS}
                rows.append({"config": name, "attention_ranks": A, "expert_ranks": E, "trace": kind,
                             "rate_req_s": rate, "mode": mode, "num_requests": len(trace),
                             "real": {m: r[m] for m in METRICS} | {"num_failed": r["num_failed"]},
                             "sim": {m: s[m] for m in METRICS} | {"num_failed": s["num_failed"]},
                             "relative_error": errors})
                if progress:
                    print(f"  [{time.perf_counter() - t0:5.0f} s] {name:16s} {rate:4.1f} req/s {mode:5s} " +
                          "  ".join(f"{_LABEL[m]} real {r[m]:.3g} sim {s[m]:.3g} "
                                    f"({errors[m]:+.0%})" for m in METRICS if errors[m] is not None),
                          file=sys.stderr, flush=True)
    errs = [abs(e) for row in rows for e in row["relative_error"].values() if e is not None]
    result = {"target_abs_relative_error": TARGET, "model": model, "profile": cost.name, "configs": configs,
              "runs": rows,
              "max_abs_relative_error": max(errs) if errs else None,
              "median_abs_relative_error": sorted(errs)[len(errs) // 2] if errs else None,
              "within_target": sum(1 for e in errs if e <= TARGET), "compared": len(errs),
              "per_metric_max_abs_error": {m: max((abs(row["relative_error"][m]) for row in rows
                                                   if row["relative_error"][m] is not None), default=None)
                                           for m in METRICS},
              "wall_s": time.perf_counter() - t0, "host_probe": host_probe}
    (out / "validation.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _probe(profile: str, model: str, recalibrate: bool, progress: bool) -> dict:
    """The host probe against ``profile`` (see :func:`validate`); raises ValueError to refuse."""
    from ..costmodel.hardware import Profile
    from .probe import probe_host, probe_verdict

    prof, shapes = Profile.load(profile), ModelShapes.load(model)
    if prof.data.get("fit") is None:  # an analytic profile: not tied to a host
        return {"agrees": True, "reference": None, "reason": "not a fitted profile: nothing to probe"}
    verdict = probe_verdict(probe_host(shapes), prof, shapes)
    verdict["action"] = "used the profile" if verdict["agrees"] else "recalibrated first"
    if progress:
        print(f"validate: host probe ({verdict['measured']['wall_s']:.1f} s) against {profile!r}: median ratio "
              f"{verdict['median_ratio']:.2f}x, " + ("agrees" if verdict["agrees"] else
                                                      f"DISAGREES ({verdict['reason']})"), file=sys.stderr, flush=True)
    if not verdict["agrees"] and not recalibrate:
        raise ValueError(f"validate: this host disagrees with the profile {profile!r} although its fingerprint "
                         f"matches ({verdict['reason']}). Run `python -m asap_comm.sim validate --calibrate` (fits "
                         "this host first), or --no-probe to check the profile anyway")
    if not verdict["agrees"] and progress:
        print("validate: calibrating this host first", file=sys.stderr, flush=True)
    return verdict


def _table(result: dict) -> str:
    lines = [f"{'config':16s} {'req/s':>5s} {'mode':5s} " + " ".join(f"{m:>26s}" for m in METRICS)]
    for row in result["runs"]:
        cells = []
        for m in METRICS:
            e = row["relative_error"][m]
            flag = "" if e is None or abs(e) <= TARGET else " !"
            cells.append(f"{row['real'][m]:9.3g} -> {row['sim'][m]:9.3g} {'' if e is None else f'{e:+5.0%}'}{flag}"
                         .rjust(26))
        lines.append(f"{row['config']:16s} {row['rate_req_s']:5.1f} {row['mode']:5s} " + " ".join(cells))
    lines.append(f"(real -> simulated, relative error; ! = above {TARGET:.0%}) {result['within_target']}/"
                 f"{result['compared']} within target; median |error| {result['median_abs_relative_error']:.1%}, "
                 f"max {result['max_abs_relative_error']:.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m asap_comm.sim validate", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, help="the served model (default: small; tiny with --regime emulated)")
    p.add_argument("--profile", default="local", help="the profile to check (default: the committed local one)")
    p.add_argument("--calibrate", action="store_true", help="calibrate this host first and check that profile")
    p.add_argument("--no-recalibrate", action="store_true",
                   help="refuse (instead of calibrating first) when the profile was fitted on another host")
    p.add_argument("--no-probe", action="store_true",
                   help="do not probe this host (a few seconds of operator timings) before trusting a fitted profile "
                        "whose fingerprint matches; by default a host that disagrees with it is recalibrated first "
                        "(refused with --no-recalibrate)")
    p.add_argument("--configs", default="default",
                   help=f"local: {sorted(CONFIGS)}; emulated: default, nocp, perdie, quick")
    p.add_argument("--num-requests", type=int, default=None, help="requests per load (default 40; 80 with --regime "
                   "emulated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--regime", choices=("local", "emulated", "published"), default="local",
                   help="local: this host's shared CPU against the local profile (default); emulated: the real "
                        "runtime on emulated accelerators against the simulator with a cluster profile "
                        "(asap_comm.sim.calibrate.emulated); published: the simulator against published measurements "
                        "(asap_comm.sim.calibrate.published; --configs default or quick, --num-requests: the "
                        "capacity window, default 128 as published)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="--regime published: also write the table as a markdown page to FILE (the docs' "
                        "docs/results/validation_published.md)")
    e = p.add_argument_group("--regime emulated")
    e.add_argument("--emulate", default="ascend-910c-cm384", metavar="PROFILE", help="the emulated hardware profile")
    e.add_argument("--emulate-model", default="deepseek-v3", help="the emulated model's shapes")
    e.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help=f"the dilation (wall s per modelled s; default {DEFAULT_TIME_SCALE}, the example's)")
    e.add_argument("--token-scale", type=int, default=128, help="emulated tokens per real token")
    e.add_argument("--repeats", type=int, default=3, help="real runs per point; each metric is their median")
    e.add_argument("--no-host-overhead", action="store_true",
                   help="simulate without the emulation's host overhead and the served router's skew (by "
                        "default both are measured and fitted first on an unloaded probe of other requests: "
                        "asap_comm.sim.emulate.fit)")
    e.add_argument("--slo", type=float, default=None, help="SLO in seconds (default: 3x the simulated unloaded "
                   "TTFT of the baseline on the p90 prompt)")
    args = p.parse_args(argv)
    if args.markdown and args.regime != "published":
        p.error(f"--markdown {args.markdown}: only --regime published writes a markdown page (got --regime {args.regime})")
    if args.regime == "published":
        return _main_published(p, args, sys.argv[1:] if argv is None else list(argv))
    if args.regime == "emulated":
        configs = args.configs
        if configs not in ECONFIGS:
            p.error(f"--configs {configs}: --regime emulated has {sorted(ECONFIGS)}")
        model = args.model or "tiny"
        num = args.num_requests or 80
        try:
            result = validate_emulated(args.out, profile=args.emulate, emulate_model=args.emulate_model, model=model,
                                       time_scale=args.time_scale, token_scale=args.token_scale, configs=configs,
                                       num_requests=num, repeats=args.repeats, slo=args.slo, seed=args.seed,
                                       host_overhead=not args.no_host_overhead)
        except (ValueError, FileNotFoundError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(table(result))
        print(f"wrote {Path(args.out) / 'validation_emulated.json'}")
        return 0
    try:
        result = validate(args.out, model=args.model or "small", profile=args.profile, configs=args.configs,
                          num_requests=args.num_requests or 40, calibrate_first=args.calibrate, seed=args.seed,
                          recalibrate=not args.no_recalibrate, probe=not args.no_probe)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    hp = result.get("host_probe")
    if hp and hp.get("reference"):
        print(f"host probe: median ratio {hp['median_ratio']:.2f}x against {hp['reference']}: {hp['action']}")
    print(_table(result))
    print(f"wrote {Path(args.out) / 'validation.json'}")
    return 0


def _main_published(p, args, argv: list) -> int:
    """``validate --regime published``: the table of published figures against the simulator."""
    from .published import published_markdown, published_table, validate_published

    profile = args.profile if args.profile != "local" else "ascend-910c-cm384"
    try:
        result = validate_published(args.out, profile=profile, model=args.model or "deepseek-v3",
                                    configs=args.configs, num_requests=args.num_requests or 128)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(published_table(result))
    print(f"wrote {Path(args.out) / 'validation_published.json'}")
    if args.markdown:
        shown = ["DIR" if i and argv[i - 1] == "--out" else "FILE" if i and argv[i - 1] == "--markdown" else a
                 for i, a in enumerate(argv)]
        Path(args.markdown).write_text(published_markdown(result, " ".join(["python -m asap_comm.sim validate", *shown])))
        print(f"wrote {args.markdown}")
    return 0
