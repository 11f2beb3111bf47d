"""``python -m asap_comm.sim validate --regime emulated``: the simulator where its headline lives.

The first regime (``validate``'s default, ``validate.py``) compares light-load
TTFT on a shared-CPU host. The headline lives elsewhere: dedicated devices,
many ranks, loads up to saturation, a cluster profile. This regime checks the
simulator there, against the real runtime on emulated accelerators
(``asap_comm.sim.emulate.emulator``): both modes, their real processes, transport and
policies, every rank owning a modelled device of the profile.

For each configuration, load and mode:

* **real**: the real runtime serves the trace on emulated devices
  (``EmulatedFactory``), ``--repeats`` times (the host is noisy: each metric
  is the median of the repeats); the overrun fraction of every run is kept
  (above 5% the dilation is too small for the host, and the row says so);
* **simulated**: ``simulate_emulated`` replays the same requests (same
  arrivals, same prompts) through the simulator with the same profile,
  emulated model, dilation, token scale and device groups, plus the
  emulation's **host overhead** (the runtime's own work outside the held
  stages) and the **served router's skew** (each emulated expert rank holds
  for the rows the served model's router really sends it), measured and
  fitted first per mode on an unloaded probe of 12 other requests
  (``emulate.fit``; ``--no-host-overhead`` leaves both out). Only that probe
  enters the fit; the loads below are predictions.

The load is the shared Mooncake trace (lengths divided by the token scale;
its requests sharing a timestamp spread over the file's 3-s step, so that the
load, not one burst, sets the attainment) at rates from light to past
saturation.

Compared per run: TTFT p50 / p90 / p99 and input-token throughput; per mode,
the **SLO-compliant throughput**, and the **ratio** of ASAP's over the
baseline's. On a grid of loads the SLO-compliant throughput is the load where
the SLO attainment (median of the repeats) crosses the target, interpolated
linearly between the last load that meets it and the first that does not
(the last load of the grid if all meet it; None if the first fails), in
requests/s; a load counts only where it is sustained (served tokens/s >= 0.9
of offered, ``serving.slo_compliant_throughput``'s criterion: the first load
that is not caps it without interpolation); both sides use the same grid and
the same rule. A ratio with a None side is withheld ("-", JSON null). The SLO is
``--slo`` seconds, or 3 x the simulated unloaded TTFT of the baseline on the
trace's p90 prompt on one DP group (no CP). ``validation_emulated.json`` holds every number; the
table marks relative errors above 15%.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ...serving.metrics import MIN_SERVED, summarize_run, sustains_slo, throughput_ratio
from ...serving.slo import auto_slo
from ...serving.traces import Request, scale_trace
from .target import TARGET
from .target import validation_trace as validate_trace

METRICS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s")
_LABEL = {"ttft_p50_s": "p50", "ttft_p90_s": "p90", "ttft_p99_s": "p99", "throughput_tokens_per_s": "tok/s"}
PROBE_REQUESTS = 12  # the host-overhead probe's unloaded requests (emulate.fit; fewer for a shorter window)
OVERRUN_WARN = 0.05

# name -> (ASAP attention groups, their TP, expert ranks, baseline groups, their TP, baseline CP threshold (served
# tokens), trace, loads in requests/s)
CONFIGS = {
    # the emulated default deployment (examples/prefill.py --emulate): afd-plugin's 32 dies, which hold DeepSeek-V3
    # on both sides (sim/memory.py): ASAP 2 x TP8 + 16 expert dies (4 processes of 4 dies) against 4 x TP8, CP > 64
    "default": [("A2xTP8+E16 vs 4xTP8 CP>64", 2, 8, 4, 4, 8, 64, "mooncake-spread", (2.0, 4.0, 5.0, 6.0, 8.0), 4)],
    # the old 16-device default, whose 6 expert dies cannot hold DeepSeek-V3's experts (kept for comparison)
    "old16": [("A5xTP2+E6 vs 4xTP4 CP>64", 5, 2, 6, 4, 4, 64, "mooncake-spread", (2.0, 4.0, 5.0, 6.0, 8.0))],
    # the same baseline without context parallelism, ASAP with 8 expert dies
    "nocp": [("A4xTP2+E8 vs 4xTP4", 4, 2, 8, 4, 4, None, "mooncake-spread", (1.0, 2.0, 3.0, 4.0, 6.0))],
    # ASAP's attention per die (8 + 8 ranks) against 8 DP groups of 2 devices
    "perdie": [("A8+E8 vs 8xTP2", 8, 1, 8, 8, 2, None, "mooncake-spread", (1.0, 2.0, 3.0, 4.0))],
    "quick": [("A2+E2 vs 4x1 CP>96", 2, 1, 2, 4, 1, 96, "synthetic", (2.0, 4.0))],
}


def crossing_rate(points, target: float, *, min_served: float = MIN_SERVED) -> "float | None":
    """The load where the SLO stops holding on a grid, ``serving.slo_compliant_throughput``'s criterion (the
    attainment meets ``target`` AND the load is sustained, served >= ``min_served`` of offered) with the
    attainment interpolated: ``points`` are ``(load, attainment, served_fraction)``. Walking up from the lowest
    load: at the first load that fails, linear in the attainment between the last pass and it where it fails on
    the attainment alone, else (not sustained) the last pass; the highest load if all pass; None if the lowest
    fails."""
    pts = sorted(points)
    if not pts:
        raise ValueError("crossing_rate: no points")
    if any(len(p) != 3 for p in pts):
        raise ValueError(f"crossing_rate: points must be (load, attainment, served_fraction), got {pts[0]!r}")
    if not sustains_slo(pts[0][1], pts[0][2], target, min_served=min_served):
        return None
    for (l0, a0, _f0), (l1, a1, f1) in zip(pts, pts[1:]):
        if f1 < min_served:
            return l0
        if a1 < target:
            return l0 + (l1 - l0) * (a0 - target) / (a0 - a1)
    return pts[-1][0]


def _rel(sim, real):
    return None if real in (None, 0) or sim is None else (sim - real) / real


def _trace(kind: str, n: int, token_scale: float, max_len: int, seed: int) -> list:
    # lengths divided by the token scale: each real token stands for token_scale emulated ones
    trace = validate_trace("synthetic" if kind == "synthetic" else "mooncake", n, max_len, seed,
                           length_scale=1.0 / token_scale)
    if kind == "mooncake-spread":
        # the file's requests come in bursts sharing a timestamp (3-s steps): spread them over their step, so
        # that the load, not the first burst, decides the SLO attainment and the grid reaches saturation
        from ..core.sweep import spread_buckets

        trace = spread_buckets(trace)[0]
    return trace


def validate_emulated(out_dir, *, profile: str = "ascend-910c-cm384", emulate_model: str = "deepseek-v3",
                      model: str = "tiny", time_scale: "float | None" = None, token_scale: int = 128,
                      configs: str = "default", num_requests: int = 80, repeats: int = 3, slo: "float | None" = None,
                      target: float = 0.9, seed: int = 0, progress: bool = True, host_overhead: bool = True) -> dict:
    """Run every configuration real (on emulated devices, ``repeats`` times) and simulated; write and return
    ``validation_emulated.json``'s content (see the module docstring). ``host_overhead``: first fit the
    emulation's host overhead on an unloaded probe of other requests (``emulate.fit``) and simulate with it;
    False: simulate without it (the runtime's work outside the held stages left out)."""
    import dataclasses

    import torch

    from ...serving.plugins import load_model_factory, model_info_of
    from ...serving.runtime import PromptRequest, RuntimeConfig, run_async
    from ...serving.sync import run_sync
    from ..emulate.emulator import EmulatedFactory, simulate_emulated
    from ..emulate.stats import overrun_summary, read_stats

    from ..emulate.emulator import DEFAULT_TIME_SCALE

    time_scale = DEFAULT_TIME_SCALE if time_scale is None else time_scale
    if configs not in CONFIGS:
        raise ValueError(f"validate: configs={configs!r} is not one of {sorted(CONFIGS)}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"validate: repeats={repeats!r} must be an int >= 1")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 2:
        raise ValueError(f"validate: num_requests={num_requests!r} must be an int >= 2")
    if slo is not None and not slo > 0:
        raise ValueError(f"validate: slo={slo!r} must be > 0 seconds")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = load_model_factory(model, seed=seed)
    info = model_info_of(base)
    t0 = time.perf_counter()
    result_configs = []
    for name, A, atp, E, W, stp, cp, kind, rates, *rest in CONFIGS[configs]:
        edev = rest[0] if rest else 1  # dies per ASAP expert process
        cfg = RuntimeConfig(num_attention_ranks=A, num_expert_ranks=E, token_budget=128, chunk_len=128,
                            max_prompt_len=512, sync_collectives="shm")
        mode_cfg = {"async": cfg, "sync": dataclasses.replace(cfg, num_attention_ranks=W - 1, num_expert_ranks=1,
                                                              cp_threshold=cp)}

        def factory(mode: str, stats_dir=None):
            if mode == "async":
                return EmulatedFactory(base, profile, emulate_model, time_scale=time_scale, token_scale=token_scale,
                                       num_expert_ranks=E, attention_tp=atp, expert_devices=edev,
                                       stats_dir=stats_dir)
            return EmulatedFactory(base, profile, emulate_model, time_scale=time_scale, token_scale=token_scale,
                                   num_expert_ranks=W, attention_tp=stp, expert_devices=stp, stats_dir=stats_dir)

        mode_cfg = {m: dataclasses.replace(c, placer_linear_weight=factory(m).placer_linear_weight())
                    for m, c in mode_cfg.items()}

        base_trace = _trace(kind, num_requests, token_scale, cfg.max_prompt_len, seed)
        fitted = None
        if host_overhead:  # unloaded probe: the PROBE_REQUESTS requests after the window, up to two chunks
            from ..emulate.fit import fit_host_overhead

            n_probe = min(PROBE_REQUESTS, max(4, num_requests // 2))
            more = _trace(kind, num_requests + n_probe, token_scale, 2 * cfg.effective_chunk_len, seed)
            fitted = fit_host_overhead({m: factory(m) for m in mode_cfg}, mode_cfg, info,
                                       lengths=[r.prompt_len for r in more[num_requests:]], progress=progress)
        ho = {m: None if fitted is None else {k: fitted[k] for k in keys}
              for m, keys in (("async", ("async_job_s", "expert_job_s", "async_layer_s")), ("sync", ("sync_layer_s",)))}
        skew = {m: 1.0 if fitted is None else fitted[f"{m}_skew"] for m in ("async", "sync")}
        lens = sorted(r.prompt_len for r in base_trace)
        p90 = lens[min(len(lens) - 1, int(0.9 * len(lens)))]
        mean_len = sum(lens) / len(lens)
        if slo is None:  # the baseline's unloaded TTFT on one DP group (no CP), as examples/prefill.py's auto SLO
            cfg_slo = auto_slo(lens, lambda n: simulate_emulated(
                factory("sync"), "sync", [Request(0, 0.0, n)],
                dataclasses.replace(mode_cfg["sync"], cp_threshold=None)).records[0].ttft_s).ttft_s
        else:
            cfg_slo = float(slo)
        g = torch.Generator().manual_seed(seed)
        tokens = {r.request_id: torch.randint(0, info.vocab_size, (r.prompt_len,), generator=g) for r in base_trace}
        rows = []
        for rate in rates:
            trace = scale_trace(base_trace, target_rate=rate)
            reqs = [PromptRequest(r.request_id, r.arrival_s, tokens[r.request_id]) for r in trace]
            for mode in ("async", "sync"):
                sim = summarize_run(simulate_emulated(factory(mode), mode, trace, mode_cfg[mode], host_overhead=ho[mode],
                                                      expert_skew=skew[mode]).records, cfg_slo).as_dict()
                reals = []
                for rep in range(repeats):
                    stats_dir = out / "stats" / f"{configs}-{rate:g}-{mode}-{rep}"
                    runner = run_async if mode == "async" else run_sync
                    res = runner(factory(mode, stats_dir), info, reqs, mode_cfg[mode])
                    r = summarize_run(res.records, cfg_slo).as_dict()
                    r["overrun_fraction"] = overrun_summary(read_stats(stats_dir))["overrun_fraction"]
                    reals.append(r)
                    if progress:
                        print(f"  [{time.perf_counter() - t0:5.0f} s] {name} {rate:g} req/s {mode:5s} run {rep + 1}/"
                              f"{repeats}: p90 {_num(r['ttft_p90_s'])} s (sim {_num(sim['ttft_p90_s'])}), attainment "
                              f"{r['slo_attainment']:.2f} (sim {sim['slo_attainment']:.2f}), failed {r['num_failed']}, "
                              f"overruns {r['overrun_fraction']:.1%}", file=sys.stderr, flush=True)
                real = {m: (statistics.median(x[m] for x in reals) if all(x[m] is not None for x in reals) else None)
                        for m in METRICS + ("slo_attainment", "served_fraction")}
                real["overrun_fraction"] = max(x["overrun_fraction"] for x in reals)
                real["num_failed"] = max(x["num_failed"] for x in reals)
                rows.append({"rate_req_s": rate, "mode": mode, "num_requests": len(trace), "real": real,
                             "real_runs": reals, "sim": {m: sim[m] for m in METRICS + ("slo_attainment", "served_fraction", "num_failed")},
                             "relative_error": {m: _rel(sim[m], real[m]) for m in METRICS}})
        sct = {}
        for side in ("real", "sim"):
            for mode in ("async", "sync"):
                sct[(side, mode)] = crossing_rate([(x["rate_req_s"], x[side]["slo_attainment"],
                                                    x[side]["served_fraction"])
                                                   for x in rows if x["mode"] == mode], target)
        per_mode = {}
        for mode in ("async", "sync"):
            rr, ss = sct[("real", mode)], sct[("sim", mode)]
            per_mode[mode] = {"real_req_s": rr, "sim_req_s": ss,
                              "real_tokens_per_s": None if rr is None else rr * mean_len,
                              "sim_tokens_per_s": None if ss is None else ss * mean_len,
                              "relative_error": _rel(ss, rr)}
        rr, rr_why = throughput_ratio(sct[("real", "async")], sct[("real", "sync")])
        sr, sr_why = throughput_ratio(sct[("sim", "async")], sct[("sim", "sync")])
        result_configs.append({
            "config": name, "attention_ranks": A, "attention_tp": atp, "expert_ranks": E, "sync_ranks": W,
            "sync_tp": stp, "cp_threshold": cp, "trace": kind, "rates_req_s": list(rates), "slo_s": cfg_slo, "slo_target": target,
            "p90_prompt_tokens": p90, "mean_prompt_tokens": mean_len, "runs": rows,
            "slo_compliant_throughput": per_mode, "host_overhead": fitted,
            "ratio": {"real": rr, "sim": sr, "relative_error": _rel(sr, rr),
                      "withheld": {k: w for k, w in (("real", rr_why), ("sim", sr_why)) if w}}})
    errs = []
    for c in result_configs:
        errs += [abs(e) for row in c["runs"] for e in row["relative_error"].values() if e is not None]
        errs += [abs(v["relative_error"]) for v in c["slo_compliant_throughput"].values()
                 if v["relative_error"] is not None]
        if c["ratio"]["relative_error"] is not None:
            errs.append(abs(c["ratio"]["relative_error"]))
    overruns = [row["real"]["overrun_fraction"] for c in result_configs for row in c["runs"]]
    result = {"regime": "emulated", "target_abs_relative_error": TARGET, "profile": profile, "host_overhead": host_overhead,
              "emulate_model": emulate_model, "model": model, "time_scale": time_scale, "token_scale": token_scale,
              "repeats": repeats, "num_requests": num_requests, "configs": result_configs,
              "compared": len(errs), "within_target": sum(1 for e in errs if e <= TARGET),
              "median_abs_relative_error": sorted(errs)[len(errs) // 2] if errs else None,
              "max_abs_relative_error": max(errs) if errs else None,
              "max_overrun_fraction": max(overruns) if overruns else None,
              "wall_s": time.perf_counter() - t0}
    (out / "validation_emulated.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def fitted_overheads(path) -> tuple:
    """``(host costs, router skews)`` that a ``validate --regime emulated`` result file (``path``) measured on its
    probe, for replaying emulated runs in the simulator: the host costs in wall seconds (``async_job_s``,
    ``expert_job_s``, ``async_layer_s``, ``sync_layer_s``) and the hottest expert rank's rows over the mean per
    mode (``{"async": ..., "sync": ...}``)."""
    configs = json.loads(Path(path).read_text()).get("configs") or []
    h = configs[0].get("host_overhead") if configs else None
    if not h:
        raise ValueError(f"fitted_overheads: {path} holds no fitted host overhead (a run with --no-host-overhead, "
                         "or not a validate --regime emulated result)")
    return ({k: h[k] for k in ("async_job_s", "expert_job_s", "async_layer_s", "sync_layer_s")},
            {"async": h["async_skew"], "sync": h["sync_skew"]})


def _pct(e) -> str:
    if e is None:
        return "  n/a"
    return f"{e:+5.0%}" + (" !" if abs(e) > TARGET else "")


def _num(x) -> str:
    return "none" if x is None else f"{x:.3g}"


def table(result: dict) -> str:
    lines = []
    for c in result["configs"]:
        lines.append(f"{c['config']}  (SLO {c['slo_s']:.3g} s at {c['slo_target']:.0%}; real = median of "
                     f"{result['repeats']}; real -> simulated, relative error)")
        ho = c.get("host_overhead")
        lines.append("host overhead: not simulated (--no-host-overhead)" if not ho else
                     f"host overhead (unloaded probe, wall): ASAP measured {ho['async_job_s'] * 1e3:.1f} ms per "
                     f"attention job and {ho['expert_job_s'] * 1e3:.1f} ms per expert batch, fitted "
                     f"{ho['async_layer_s'] * 1e3:.1f} ms per expert round trip; baseline fitted "
                     f"{ho['sync_layer_s'] * 1e3:.1f} ms per MoE layer; served router's hottest expert rank "
                     f"{ho['async_skew']:.2f}x / {ho['sync_skew']:.2f}x the mean rows")
        lines.append(f"{'req/s':>5s} {'mode':5s} " + " ".join(f"{_LABEL[m]:>24s}" for m in METRICS)
                     + f" {'attainment':>12s} {'overruns':>8s}")
        for row in c["runs"]:
            cells = []
            for m in METRICS:
                r, s = row["real"][m], row["sim"][m]
                cells.append(("n/a" if r is None or s is None else
                              f"{r:7.3g} -> {s:7.3g} {_pct(row['relative_error'][m])}").rjust(24))
            lines.append(f"{row['rate_req_s']:5.1f} {row['mode']:5s} " + " ".join(cells)
                         + f" {row['real']['slo_attainment']:5.2f}/{row['sim']['slo_attainment']:5.2f}"
                         + f" {row['real']['overrun_fraction']:7.1%}"
                         + (" (above 5%: dilation too small)" if row['real']['overrun_fraction'] > OVERRUN_WARN else ""))
        for mode, v in c["slo_compliant_throughput"].items():
            lines.append(f"SLO-compliant throughput {mode:5s}: real {_num(v['real_req_s'])} req/s -> sim "
                         f"{_num(v['sim_req_s'])} req/s {_pct(v['relative_error'])}")
        ra = c["ratio"]
        rx = "-" if ra["real"] is None else f"{ra['real']:.3g}x"
        sx = "-" if ra["sim"] is None else f"{ra['sim']:.3g}x"
        lines.append(f"ratio ASAP / baseline: real {rx} -> sim {sx} {_pct(ra['relative_error'])}"
                     + "".join(f" ({k}: {w})" for k, w in (ra.get("withheld") or {}).items()))
    if result["compared"]:
        lines.append(f"{result['within_target']}/{result['compared']} within {TARGET:.0%}; median |error| "
                     f"{result['median_abs_relative_error']:.1%}, max {result['max_abs_relative_error']:.1%}; "
                     f"largest overrun fraction {result['max_overrun_fraction']:.1%}")
    return "\n".join(lines)
