"""The prefill job: the same requests through ASAP (``run_async``) and the synchronous baseline (``run_sync``),
every output checked against the single-process reference forward, the TTFT SLO, one load or a sweep, and the
artifacts (``summary.json``, ``ttft.png``, with a sweep ``slo_throughput.png``, ``timeline_<mode>.json``).

``examples/prefill.py`` is its command line; benchmarks and tests import these
pieces. The model comes in as a factory (``asap_comm.serving.plugins
.load_model_factory``, or any ``DescribedModelFactory`` that also has
``full()``: the whole model in one process, whose ``prefill(token_ids)`` gives
``logits`` and ``final_hidden``), so ``asap_comm`` still never imports a model
package. The arguments are :func:`asap_comm.sim.emulate.deploy.build_parser`'s.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ...serving import (ChromeTrace, Request, load_trace, served_at_load, slo_compliant_throughput, summarize_run,
                        sustains_slo, throughput_ratio, withheld_reason)
from ...serving.lane import lane_tokens
from ...serving.protocol import PromptRequest
from ...serving.runtime import run_async
from ...serving.slo import SLO_MULTIPLIER, auto_slo, p90_prompt_len
from ...serving.sync import run_sync
from ...serving.traces import LogNormalLengths, TraceError, resolve_trace, synthetic_trace
from ..core.sweep import at_rate as _scaled_to, search_rate
from ..studies import plots
from ..studies.figures import example_facts, example_figures
from .deploy import emulated, lane_threshold, lane_wait_s, sync_workers

__all__ = ["SLO_BASIS", "CALIBRATION_REQUESTS", "make_requests", "at_rate", "check", "prompt_p90", "references",
           "unloaded_ttft", "resolve_slo", "describe_slo", "sweep_floor", "sweep_auto", "probe_requests",
           "sweep_start", "run_mode", "write_timeline", "table", "emulation_stats", "run_job", "print_report"]

SWEEP_AUTO_BISECTIONS = 3  # --sweep auto: bisection steps after the doubling phase
SWEEP_PROBE_S = 45.0  # --sweep auto: a probe's arrivals span at most this many seconds ...
SWEEP_MIN_REQUESTS = 60  # ... but hold at least this many requests
SWEEP_MAX_PROBE_S = 300.0  # --sweep auto halves no lower than a rate whose probe's arrivals span this long
SLO_BASIS = "sync"  # the mode whose unloaded TTFT the automatic SLO is based on
CALIBRATION_REQUESTS = 5  # per mode; the first is a warm-up of the fresh processes and is not counted
RUNNERS = {"async": run_async, "sync": run_sync}


# ----------------------------------------------------------------------------- the load and the reference
def make_requests(args, vocab: int) -> list:
    """The load: a trace file (Mooncake JSONL / Azure CSV) or a synthetic skewed trace."""
    if args.trace == "synthetic":
        trace = synthetic_trace(args.rate, num_requests=args.num_requests, arrival="gamma", cv=args.burstiness,
                                lengths=LogNormalLengths(args.median_len, 1.0, 4, args.max_prompt_len), seed=args.seed)
    else:
        try:
            trace = load_trace(resolve_trace(args.trace), limit=args.num_requests, target_rate=args.rate,
                               max_prompt_len=args.max_prompt_len, length_scale=args.length_scale)
        except TraceError as e:
            raise TraceError(e.path, e.line, f"{e.reason} (--trace {args.trace})") from None
    g = torch.Generator().manual_seed(args.seed)
    return [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, vocab, (r.prompt_len,), generator=g))
            for r in trace]


def at_rate(requests: list, rate: float) -> list:
    """The same prompts with arrivals rescaled to ``rate`` requests/s (``asap_comm.sim.core.sweep.at_rate``)."""
    scaled = _scaled_to([Request(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests], rate)
    return [PromptRequest(r.request_id, s.arrival_s, r.token_ids) for r, s in zip(requests, scaled)]


def check(result, references: dict) -> tuple[int, int, list]:
    """(checked, mismatches, details) of a run's outputs against the reference outputs."""
    checked, bad, details = 0, 0, []
    for rid, (token, hidden) in result.outputs.items():
        ref_token, ref_hidden = references[rid]
        checked += 1
        if token != ref_token or not torch.allclose(hidden, ref_hidden, rtol=1e-4, atol=1e-5):
            bad += 1
            details.append(f"{result.mode} request {rid}: token {token} vs {ref_token}, "
                           f"max |dh| {(hidden - ref_hidden).abs().max():.3g}")
    return checked, bad, details


def prompt_p90(requests: list, max_prompt_len: "int | None" = None) -> int:
    """The load's 90th-percentile prompt length (``asap_comm.serving.slo.p90_prompt_len``)."""
    return p90_prompt_len((int(r.token_ids.numel()) for r in requests), max_prompt_len)


def references(factory, requests: list) -> tuple[dict, float]:
    """Reference outputs of every request (single process), and the single-process prefill time of the p90 prompt
    (seconds; it spaces the SLO's calibration requests)."""
    model = factory.full()
    out = {}
    for r in requests:
        with torch.no_grad():
            o = model.prefill(r.token_ids)
        out[r.request_id] = (int(o.logits[-1].argmax()), o.final_hidden[-1])
    p90 = torch.randint(0, factory.describe()["vocab_size"], (prompt_p90(requests),))
    t0 = time.perf_counter()
    with torch.no_grad():
        model.prefill(p90)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- the SLO
def unloaded_ttft(mode: str, factory, info, cfg, prompt_len: int, vocab: int, gap_s: float,
                  seed: int = 0) -> tuple[float, int]:
    """``(median TTFT in seconds, samples)`` of ``mode`` with nothing queued: the served system itself.

    Starts ``mode`` on ``cfg``'s ranks and configuration and sends it
    :data:`CALIBRATION_REQUESTS` random prompts of ``prompt_len`` tokens,
    ``gap_s`` apart. The first is a warm-up; of the rest, a sample counts only
    if the request was alone in the system (the one before had finished when
    it arrived, and it finished before the next arrived). With fewer than 3
    such samples it tries once more with 3x the gap; after that it takes
    every post-warm-up TTFT and says so.
    """
    cfg = dataclasses.replace(cfg, progress=False)
    g = torch.Generator().manual_seed(seed + 1)
    n = CALIBRATION_REQUESTS
    for _ in range(2):
        reqs = [PromptRequest(i, 0.02 + i * gap_s, torch.randint(0, vocab, (prompt_len,), generator=g))
                for i in range(n)]
        recs = sorted(RUNNERS[mode](factory, info, reqs, cfg).records, key=lambda r: r.arrival_s)
        bad = [r for r in recs if not r.ok]
        if bad:
            raise SystemExit(f"prefill.py: measuring the unloaded TTFT of {mode} failed: request "
                             f"{bad[0].request_id}: {bad[0].error}")
        alone = [recs[i].ttft_s for i in range(1, n)
                 if recs[i - 1].done_s <= recs[i].arrival_s and (i == n - 1 or recs[i].done_s <= recs[i + 1].arrival_s)]
        if len(alone) >= 3:
            return statistics.median(alone), len(alone)
        gap_s *= 3
    print(f"  warning: {mode}'s calibration requests overlapped even {gap_s / 3:.2f} s apart; its unloaded TTFT "
          "includes some queueing", file=sys.stderr, flush=True)
    samples = [r.ttft_s for r in recs[1:]]
    return statistics.median(samples), len(samples)


def resolve_slo(args, factory, info, cfg, requests, single_process_s: float, modes: list) -> dict:
    """The TTFT SLO and where it comes from: the ``"slo"`` entry of ``summary.json``. ``--slo auto`` is
    ``asap_comm.serving.slo.auto_slo`` on the :data:`SLO_BASIS` mode's measured unloaded TTFT (every mode of
    ``modes`` is measured and recorded, each on one DP group). ``factory`` and ``cfg``: one, or ``{mode: ...}``."""
    pick = (lambda x, m: x[m] if isinstance(x, dict) else x)
    max_len = pick(cfg, "sync").max_prompt_len
    if args.slo != "auto":
        return {"ttft_s": float(args.slo), "source": "flag", "multiplier": None,
                "p90_prompt_tokens": prompt_p90(requests, max_len), "unloaded_ttft_s": {}}
    gap = max(0.1, 2 * single_process_s)  # well above the unloaded TTFT: calibration requests meet no queue
    unloaded = {}

    def measure(prompt_len: int) -> float:
        for mode in sorted(set(modes) | {SLO_BASIS}):
            print(f"{mode}: unloaded TTFT of {prompt_len}-token prompts, one at a time ...", file=sys.stderr,
                  flush=True)
            f = pick(factory, mode)
            # on one DP group: context parallelism spreads a lone prompt over every group, which load takes away
            c = dataclasses.replace(pick(cfg, mode), cp_threshold=None)
            unloaded[mode], used = unloaded_ttft(mode, f, info, c, prompt_len, info.vocab_size, gap, args.seed)
            print(f"  {mode}: {unloaded[mode] * 1e3:.1f} ms (median of {used})", file=sys.stderr, flush=True)
        return unloaded[SLO_BASIS]

    rule = auto_slo([int(r.token_ids.numel()) for r in requests], measure, max_prompt_len=max_len)
    return {"ttft_s": rule.ttft_s, "source": "auto", "multiplier": rule.multiplier,
            "p90_prompt_tokens": rule.p90_prompt_tokens, "unloaded_ttft_s": unloaded}


def describe_slo(slo: dict) -> str:
    if slo["source"] == "flag":
        return f"TTFT SLO {slo['ttft_s']:.3f} s (--slo)"
    u = slo["unloaded_ttft_s"]
    others = ", ".join(f"{m} {v:.3f} s" for m, v in u.items() if m != SLO_BASIS)
    return (f"TTFT SLO {slo['ttft_s']:.3f} s = {slo['multiplier']:g} x the baseline's ({SLO_BASIS}) unloaded TTFT "
            f"{u[SLO_BASIS]:.3f} s ({slo['p90_prompt_tokens']}-token p90 prompt, on one DP group)"
            + (f"; unloaded TTFT of {others}" if others else ""))


# ----------------------------------------------------------------------------- --sweep auto
def sweep_floor(num_requests: int) -> float:
    """--sweep auto's lowest rate: below it a probe (``probe_requests``) spans more than SWEEP_MAX_PROBE_S."""
    return min(num_requests, SWEEP_MIN_REQUESTS) / SWEEP_MAX_PROBE_S


def sweep_auto(run_at, start_rate: float, bisections: int = SWEEP_AUTO_BISECTIONS, target: float = 0.9,
               min_rate: float = 0.0) -> "float | None":
    """Search the SLO-compliant rate without a hand-picked list (``asap_comm.sim.core.sweep.search_rate``): from
    ``start_rate``, double (or halve, not below ``min_rate``) until the SLO attainment crosses ``target``, then
    bisect (geometrically) ``bisections`` times; a load passes where the SLO holds AND it is sustained (served
    >= 0.9 of offered, ``asap_comm.serving.sustains_slo``). ``run_at(rate) -> (slo_attainment, served_fraction)``
    runs (and records) one load. Returns the lowest rate run when none passed (the search stopped there), else
    None."""
    seen = search_rate(run_at, start_rate, bisections=bisections, target=target, min_rate=min_rate)
    return None if any(sustains_slo(*v, target) for v in seen.values()) else min(seen)


def probe_requests(requests: list, rate: float) -> list:
    """--sweep auto: the first requests of the load, whose arrivals at ``rate`` span at most SWEEP_PROBE_S
    (at least SWEEP_MIN_REQUESTS, at most all)."""
    n = max(min(len(requests), SWEEP_MIN_REQUESTS), min(len(requests), int(rate * SWEEP_PROBE_S)))
    return requests[:n]


def sweep_start(workers: int, unloaded_s: float, mean_len: float, p90_len: int) -> float:
    """--sweep auto's first rate: a rough capacity, each worker serving one mean-length request in (unloaded TTFT
    of the p90 prompt) x (mean length / p90 length); doubling or halving from there finds the bracket."""
    per_request = max(unloaded_s * mean_len / max(1, p90_len), 1e-3)
    return max(0.05, 0.8 * workers / per_request)


# ----------------------------------------------------------------------------- one run
def run_mode(mode: str, factory, info, requests, cfg):
    if mode == "async":
        print(f"{mode}: {len(requests)} requests, {cfg.num_attention_ranks} attention + {cfg.num_expert_ranks} expert "
              f"processes", file=sys.stderr, flush=True)
    else:
        print(f"{mode}: {len(requests)} requests, {cfg.num_attention_ranks + cfg.num_expert_ranks} DP+EP workers",
              file=sys.stderr, flush=True)
    return RUNNERS[mode](factory, info, requests, cfg)


def write_timeline(path: Path, result, cfg) -> None:
    """Chrome trace of the run: one row per worker process, a span per unit of work (gaps are stalls)."""
    trace = ChromeTrace()
    for pe in sorted({s[0] for s in result.spans}):
        role = "attention" if pe < cfg.num_attention_ranks or result.mode == "sync" else "expert"
        trace.name_process(pe, f"{result.mode} {role} PE {pe}")
    for pe, track, name, start, dur in result.spans:
        trace.complete(name, pe, track, start, dur)
    trace.write(path)


def table(rows: list, emulated: bool = False) -> str:
    head = ["mode", "rate req/s", "offered tok/s", "TTFT p50 s", "p90 s", "p99 s", "tok/s", "SLO att.", "failed"]
    head += ["overruns"] if emulated else []
    lines = [head] + rows
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in lines)


def emulation_stats(stats_dir) -> dict:
    """Overruns of an emulated run, whether the baseline's transport kept to the modelled collectives, and the
    served router's skew on this run's expert-holding ranks (``fit.routing_skew``: the rows its router calls
    sent to the most loaded rank over the mean rank's; it grows with the number of ranks, so a replay of this run
    through the simulator charges this one, not the validation probe's)."""
    from .fit import routing_skew
    from .stats import collective_summary, overrun_summary, read_stats

    stats = read_stats(stats_dir)
    o = overrun_summary(stats)
    o["collectives"] = collective_summary(stats_dir)
    o["routing_skew"] = routing_skew(stats)
    return o


def _emulation_warnings(mode: str, emu: dict, transport: str) -> None:
    if emu["overrun_fraction"] > 0.05:
        print(f"  warning: {mode}: the held stages' real compute overran their modelled time by "
              f"{emu['overrun_fraction']:.1%} of it: the dilation is too small for this host (raise --time-scale)",
              file=sys.stderr, flush=True)
    late = emu["collectives"]
    busiest = max((r["held_s"] for r in emu["per_rank"]), default=0.0)
    late["late_share"] = late["late_s"] / busiest if busiest else 0.0
    if late["collectives"] and late["late_share"] > 0.05:
        print(f"  warning: {mode}: the host's transport ({transport}) was slower than the modelled collective in "
              f"{late['late_fraction']:.1%} of {late['collectives']} collectives, {late['late_share']:.1%} of the "
              f"busiest worker's time (median {late['median_transport_s']:.2e} s vs {late['median_modelled_s']:.2e} s "
              "modelled): the baseline is slowed by this host; raise --time-scale or use --sync-collectives shm",
              file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the job
def run_job(args, modes: list, rates: list, auto_sweep: bool, factory, info, requests: list, cfgs: dict,
            lane_pool: "tuple | None" = None) -> tuple:
    """The whole job on ``requests`` with each mode's ``cfgs[mode]`` (``deploy.runtime_configs``): references,
    the SLO, the lane's threshold and wait bound, the runs (one load per rate, or ``--sweep auto``), the artifacts
    in ``args.out``. Returns ``(summary, rows of the table)``; ``summary["correctness"]`` counts the mismatches."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    refs, single_process_s = references(factory, requests)
    if args.emulate:  # calibration requests take emulated (long) times: space them by the emulated prefill time
        from .deploy import emulated_p90_s

        single_process_s = max(single_process_s, emulated_p90_s(args, prompt_p90(requests)))
    slo_info = resolve_slo(args, {m: emulated(args, factory, m) for m in ("async", "sync")}, info, cfgs, requests,
                           single_process_s, modes)
    slo = slo_info["ttft_s"]
    print(describe_slo(slo_info), file=sys.stderr, flush=True)
    threshold, wait = lane_threshold(args, factory, cfgs["async"], slo), lane_wait_s(args, slo)
    cfgs = {**cfgs, "async": dataclasses.replace(cfgs["async"], lane_threshold=threshold, lane_wait_s=wait)}
    if cfgs["async"].long_prompt_lane and "async" in modes:
        print("long-prompt lane: " + ("prompts of 2+ chunks" if threshold is None else
                                      f"prompts longer than {threshold} tokens")
              + ("" if wait is None else f"; one that waits {wait:.3g} s for room runs on one attention rank"),
              file=sys.stderr, flush=True)
    mean_len = sum(int(r.token_ids.numel()) for r in requests) / len(requests)
    summary = {"config": vars(args), "slo": slo_info, "runs": [], "lane_threshold": threshold,
               "lane_tokens": {"tokens": lane_tokens(cfgs["async"]), "auto": lane_pool is not None},
               "lane_wait_s": wait}
    if args.emulate:
        from .deploy import memory_table

        summary["emulation"] = emulated(args, factory, "async").describe_emulation()
        summary["ignore_memory"] = args.ignore_memory
        summary["memory"] = {m: [d.describe() for d in v] if m in ("async", "sync") else v
                             for m, v in memory_table(args).items()}
    rows, counts, details, emu_runs, last = [], [0, 0], [], {m: [] for m in modes}, {}

    def run_at(mode: str, rate: "float | None") -> tuple:
        """One run of ``mode`` at ``rate`` req/s (None: the load as made), recorded; returns its SLO attainment
        and served fraction (served over offered tokens/s)."""
        load = requests if rate is None else at_rate(probe_requests(requests, rate) if auto_sweep else requests, rate)
        rate = args.rate if rate is None else rate
        mean = sum(int(r.token_ids.numel()) for r in load) / len(load)  # of this load's prompts
        with tempfile.TemporaryDirectory(prefix="asap-emu-") as stats_dir:
            result = run_mode(mode, emulated(args, factory, mode, stats_dir), info, load, cfgs[mode])
            emu = emulation_stats(stats_dir) if args.emulate else None
        s = summarize_run(result.records, slo).as_dict()
        c, b, d = check(result, refs)
        counts[0], counts[1] = counts[0] + c, counts[1] + b
        details.extend(d)
        entry = {"mode": mode, "rate_req_s": rate, "offered_tokens_per_s": rate * mean, "requests": len(load), **s}
        if result.lane:  # what the long-prompt lane's admission did in this run (serving.lane.LaneCounts)
            entry["lane"] = result.lane
        if emu is not None:
            entry["overrun_fraction"] = emu["overrun_fraction"]
            entry["emulation"] = {k: v for k, v in emu.items() if k != "overrun_fraction"}
            emu_runs[mode].append(emu)
            _emulation_warnings(mode, emu, args.sync_collectives)
        summary["runs"].append(entry)
        last[mode] = result
        summary.setdefault(mode, dict(s))  # the first load's numbers, per mode
        write_timeline(out / f"timeline_{mode}.json", result, cfgs[mode])
        fmt = (lambda v: "-" if v is None else f"{v:.3f}")
        rows.append([mode, f"{rate:g}", f"{rate * mean:.0f}", fmt(s["ttft_p50_s"]), fmt(s["ttft_p90_s"]),
                     fmt(s["ttft_p99_s"]), f"{s['throughput_tokens_per_s']:.0f}", f"{s['slo_attainment']:.2f}",
                     s["num_failed"]] + ([f"{emu['overrun_fraction']:.3f}"] if emu is not None else []))
        lane = result.lane
        print(f"  [{mode}] {rate:g} req/s: SLO attainment {s['slo_attainment']:.2f}, TTFT p90 {fmt(s['ttft_p90_s'])} s"
              f", served {entry['served_fraction']:.0%} of offered"
              + (f", overruns {emu['overrun_fraction']:.1%}" if emu is not None else "")
              + (f", lanes {lane['opened']} (waited {lane['waited']}, gave up {lane['gave_up']})" if lane else ""),
              file=sys.stderr, flush=True)
        return s["slo_attainment"], entry["served_fraction"]

    if auto_sweep:
        for mode in modes:
            workers = args.attention_ranks if mode == "async" else sync_workers(args)
            unloaded = slo_info["unloaded_ttft_s"].get(mode) or slo / SLO_MULTIPLIER
            start = sweep_start(workers, unloaded, mean_len, slo_info["p90_prompt_tokens"])
            print(f"{mode}: searching the SLO-compliant rate from {start:.3g} req/s ...", file=sys.stderr, flush=True)
            floor = sweep_floor(len(requests))
            lowest = sweep_auto(lambda r, m=mode: run_at(m, r), max(start, floor), min_rate=floor)
            if lowest is not None:
                summary[mode]["sweep_lowest_failing_req_s"] = lowest
                print(f"{mode}: no load met the SLO down to {lowest:.3g} req/s; lower rates are not probed (a probe "
                      f"there spans over {SWEEP_MAX_PROBE_S:g} s)", file=sys.stderr, flush=True)
    else:
        for rate in rates:
            for mode in modes:
                run_at(mode, rate if len(rates) > 1 or args.trace != "synthetic" else None)
    summary["correctness"] = {"checked": counts[0], "mismatches": counts[1], "details": details[:20]}
    sweep = auto_sweep or len(rates) > 1
    if sweep:
        _compliance(summary, modes)
    if args.emulate:
        for mode in modes:  # by time (asap_comm.sim.emulate.stats.overrun_summary), and by calls
            calls = sum(e["calls"] for e in emu_runs[mode])
            over = sum(e["overruns"] for e in emu_runs[mode])
            modelled = sum(e["modelled_s"] for e in emu_runs[mode])
            summary[mode]["overrun_fraction"] = (sum(e["overrun_s"] for e in emu_runs[mode]) / modelled
                                                 if modelled else 0.0)
            summary[mode]["overrun_calls_fraction"] = over / calls if calls else 0.0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if sweep:  # slo_throughput.png (served against offered, the SLO-compliant loads) and ttft.png (TTFT vs load)
        example_figures(out, summary)
    else:  # one load point per mode: the TTFT CDFs and per-rank compute / waiting / idle
        plots.ttft_cdf_and_ranks(out / "ttft.png", last, slo, cfgs, facts=example_facts(summary))
    return summary, rows


def _compliance(summary: dict, modes: list) -> None:
    """Per mode: the SLO-compliant throughput (a load counts only where the SLO holds AND served >= 0.9 of offered,
    sustained), what it served there, why it is withheld; and the ratio ASAP / baseline."""
    pts = {m: [r for r in summary["runs"] if r["mode"] == m] for m in modes}
    for mode in modes:
        summary[mode]["slo_compliant_throughput"] = slo_compliant_throughput(pts[mode])
        summary[mode]["at_slo_compliant_load"] = served_at_load(pts[mode], summary[mode]["slo_compliant_throughput"])
        summary[mode]["withheld"] = withheld_reason(pts[mode])
    if "async" in modes and "sync" in modes:
        summary["slo_compliant_throughput_ratio"], summary["ratio_withheld"] = throughput_ratio(
            summary["async"]["slo_compliant_throughput"], summary["sync"]["slo_compliant_throughput"],
            points=(pts["async"], pts["sync"]))


def print_report(summary: dict, rows: list, modes: list, out: Path, emulated_run: bool) -> None:
    """The table, the SLO, the correctness count, SLO-compliant throughputs (a sweep) and the artifacts, on
    stdout."""
    print()
    print(table(rows, emulated=emulated_run))
    print(f"\n{describe_slo(summary['slo'])}")
    c = summary["correctness"]
    print(f"correctness: {c['checked']} outputs checked, {c['mismatches']} mismatches")
    if any("slo_compliant_throughput" in summary.get(m, {}) for m in modes):
        for mode in modes:
            sct, at = summary[mode].get("slo_compliant_throughput"), summary[mode].get("at_slo_compliant_load")
            print(f"SLO-compliant throughput ({mode}): {'-' if sct is None else sct} tokens/s" + (
                "" if at is None else f" (there: served {at['served_tokens_per_s']:.0f} tokens/s, "
                f"{at['served_fraction']:.0%} of offered, TTFT p99 {at['ttft_p99_s']:.2f} s)")
                + (f" ({summary[mode]['withheld']})" if summary[mode].get("withheld") else ""))
        if "slo_compliant_throughput_ratio" in summary:
            r = summary["slo_compliant_throughput_ratio"]
            print("ASAP / baseline: " + (f"- ({summary['ratio_withheld']})" if r is None else f"{r:.2f}x"))
    if emulated_run:
        print("overruns: " + ", ".join(f"{m} {summary[m]['overrun_fraction']:.2%}" for m in modes))
    figures = "ttft.png, slo_throughput.png" if len({r["rate_req_s"] for r in summary["runs"]}) > 1 else "ttft.png"
    print(f"artifacts in {out}/: summary.json, {figures}, " + ", ".join(f"timeline_{m}.json" for m in modes))
