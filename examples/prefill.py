"""MoE prefill, ASAP against the synchronous DP+EP baseline, on one host.

    python examples/prefill.py                       # defaults: `small` model, skewed trace
    python examples/prefill.py --sweep 2,4,8 --out runs/sweep
    python examples/prefill.py --help                # every flag, with its default

Runs the same requests through the asynchronous disaggregated runtime
(``asap_comm.serving.run_async``: A attention + E expert processes) and the
synchronous baseline (``run_sync``: A + E processes doing DP attention + EP
experts with gloo all-to-alls), checks every request's first token and final
hidden state against the single-process reference forward, prints a table
and writes ``summary.json``, ``ttft.png`` and ``timeline_<mode>.json``
(Chrome trace format: open in https://ui.perfetto.dev) into ``--out``.

The TTFT SLO (``--slo auto``, the default) is 3x the *unloaded* TTFT of the
served baseline: before the runs, each mode is started on the same ranks and
configuration and sent a few prompts of the trace's 90th-percentile length
one at a time (each alone in the system); the median TTFT (after a warm-up
request) is that mode's unloaded latency. Both modes' values and the SLO are
printed and stored under ``"slo"`` in ``summary.json``. Production SLOs are
set as a multiple of unloaded latency; basing it on the baseline's, measured
on the processes that serve the load, keeps it meaningful on any host (a
request that meets no queue meets it; compare the printed unloaded TTFTs).
``--slo SECONDS`` overrides it (and skips the measurement).

Progress goes to stderr: one live line, rewritten in place, on a terminal;
whole lines when stderr is a pipe or a file.

Emulated accelerators (``--emulate PROFILE``): the same runtime, processes and
code, with every rank's compute held (sleeping) for the time a modelled device
takes (``asap_comm.sim.emulate``): the work of ``--emulate-model`` (default
deepseek-v3) on the hardware profile, times ``--time-scale``; each real token
stands for ``--token-scale`` emulated tokens. Unless given, the defaults then
become: the tiny model; afd-plugin's 32 dies, which hold DeepSeek-V3 on both
sides (``EMULATE_DEFAULTS``): ASAP 2 attention groups x TP8 + 16 expert dies
(4 expert processes of ``--expert-dies 4``), the baseline 4 DP groups x TP8
with EP over all 32 and CP above 64 served tokens; the Mooncake trace
that ships with the package with lengths divided by the token scale, 128-token chunks
and micro-batches, 240 requests per load, and the baseline's collectives on
shared memory (``--sync-collectives shm``: gloo's milliseconds would slow the
baseline below what the modelled collectives take). A deployment whose
emulated dies cannot hold the model is refused (exit 2, one line naming
``memory``; ``asap_comm.sim.memory``) unless ``--ignore-memory``.
``summary.json`` then carries ``overrun_fraction`` per mode, the memory table
(``memory``) and ``ignore_memory``.

    python examples/prefill.py --emulate ascend-910c-cm384 --emulate-model deepseek-v3 --sweep auto --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asap_comm.serving import (ChromeTrace, load_trace, served_at_load, slo_compliant_throughput,
                               summarize_run, sustains_slo, throughput_ratio, withheld_reason)
from asap_comm.serving.lane import lane_tokens
from asap_comm.serving.runtime import ModelInfo, PromptRequest, RuntimeConfig, run_async
from asap_comm.serving.traces import LogNormalLengths, TraceError, resolve_trace, synthetic_trace
from asap_comm.sim import plots, study
from asap_comm.sim.costs import known_profiles
from asap_comm.sim.emulate import DEFAULT_TIME_SCALE as EMULATE_TIME_SCALE
from asap_comm.sim.lane import LANE_WAIT_SLO
from asap_comm.sim.memory import LANE_POOL_PROMPTS

try:
    from asap_comm.serving.sync import run_sync
except ImportError:  # pragma: no cover - the baseline lands separately
    run_sync = None

from asap_models import StageFactory


def model_info(cfg) -> ModelInfo:
    return ModelInfo(cfg.num_hidden_layers, tuple(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)),
                     cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                     kv_row_width=_kv_row_width(cfg))


def _kv_row_width(cfg) -> int:
    """The KV row width the long-prompt lane needs, if the model package has the lane's cache hooks (an older
    ``asap_models`` without ``DeepseekV3.kv_rows`` runs without the lane)."""
    import asap_models

    return cfg.kv_lora_rank + cfg.qk_rope_head_dim if hasattr(asap_models.DeepseekV3, "append_kv_rows") else 0


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
    """The same prompts with arrivals rescaled to ``rate`` requests/s (``asap_comm.sim.study.at_rate``)."""
    scaled = study.at_rate([_as_trace(r) for r in requests], rate)
    return [PromptRequest(r.request_id, s.arrival_s, r.token_ids) for r, s in zip(requests, scaled)]


def _as_trace(r: PromptRequest):
    from asap_comm.serving import Request

    return Request(r.request_id, r.arrival_s, int(r.token_ids.numel()))


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


def p90_prompt_len(requests: list) -> int:
    """The trace's 90th-percentile prompt length (the nearest rank at or above it), in tokens."""
    lens = sorted(int(r.token_ids.numel()) for r in requests)
    return lens[min(len(lens) - 1, int(0.9 * len(lens)))]


def references(factory: StageFactory, requests: list) -> tuple[dict, float]:
    """Reference outputs of every request (single process), and the single-process prefill time of the
    p90 prompt (seconds; not the SLO basis any more, see :func:`unloaded_ttft`; it sizes the calibration)."""
    model = factory.full()
    out = {}
    for r in requests:
        with torch.no_grad():
            o = model.prefill(r.token_ids)
        out[r.request_id] = (int(o.logits[-1].argmax()), o.final_hidden[-1])
    p90 = torch.randint(0, factory.config().vocab_size, (p90_prompt_len(requests),))
    t0 = time.perf_counter()
    with torch.no_grad():
        model.prefill(p90)
    return out, time.perf_counter() - t0


SLO_MULTIPLIER = 3.0  # the automatic SLO: this many times the baseline's unloaded TTFT
# --emulate: wall seconds per modelled second (asap_comm.sim.emulate: 0.25 overran 5.1-5.6% at afd-plugin's 32 dies)
DEFAULT_TIME_SCALE = EMULATE_TIME_SCALE
DEFAULT_TOKEN_SCALE = 128  # --emulate: emulated tokens per real token
# --emulate: defaults of the flags a user did not give
# --emulate's deployment: afd-plugin's 32 dies (vLLM afd-plugin issue 170), memory-feasible for deepseek-v3 on
# ascend-910c-cm384 (asap_comm.sim.memory): ASAP 2 attention groups x TP8 + 16 expert dies (4 expert processes
# of 4 dies each: the served model has 8 experts), the baseline 4 DP groups x TP8 with EP over all 32 dies
EMULATE_DEFAULTS = {"model": "tiny", "attention_ranks": 2, "attention_tp": 8, "expert_ranks": 4, "expert_dies": 4,
                    "trace": "mooncake", "num_requests": 240, "max_prompt_len": 512, "token_budget": 128,
                    "chunk_len": 128, "sync_collectives": "shm", "sync_tp": 8, "cp_threshold": 64}
SWEEP_AUTO_BISECTIONS = 3  # --sweep auto: bisection steps after the doubling phase
SWEEP_PROBE_S = 45.0  # --sweep auto: a probe's arrivals span at most this many seconds ...
SWEEP_MIN_REQUESTS = 60  # ... but hold at least this many requests
SWEEP_MAX_PROBE_S = 300.0  # --sweep auto halves no lower than a rate whose probe's arrivals span this long
SLO_BASIS = "sync"  # the mode whose unloaded TTFT the automatic SLO is based on
CALIBRATION_REQUESTS = 5  # per mode; the first is a warm-up of the fresh processes and is not counted


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
    runner = run_async if mode == "async" else run_sync
    if runner is None:
        raise SystemExit("prefill.py: the synchronous baseline (asap_comm.serving.sync) is not available")
    cfg = dataclasses.replace(cfg, progress=False)
    g = torch.Generator().manual_seed(seed + 1)
    n = CALIBRATION_REQUESTS
    for _ in range(2):
        reqs = [PromptRequest(i, 0.02 + i * gap_s, torch.randint(0, vocab, (prompt_len,), generator=g))
                for i in range(n)]
        recs = sorted(runner(factory, info, reqs, cfg).records, key=lambda r: r.arrival_s)
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
    """The TTFT SLO and where it comes from: the ``"slo"`` entry of ``summary.json``."""
    prompt_len = min(p90_prompt_len(requests), (cfg["sync"] if isinstance(cfg, dict) else cfg).max_prompt_len)
    if args.slo != "auto":
        return {"ttft_s": float(args.slo), "source": "flag", "multiplier": None, "p90_prompt_tokens": prompt_len,
                "unloaded_ttft_s": {}}
    gap = max(0.1, 2 * single_process_s)  # well above the unloaded TTFT: calibration requests meet no queue
    unloaded = {}
    for mode in sorted(set(modes) | {SLO_BASIS}):
        print(f"{mode}: unloaded TTFT of {prompt_len}-token prompts, one at a time ...", file=sys.stderr, flush=True)
        f = factory[mode] if isinstance(factory, dict) else factory
        # on one DP group: context parallelism spreads a lone prompt over every group, which load takes away
        c = dataclasses.replace(cfg[mode] if isinstance(cfg, dict) else cfg, cp_threshold=None)
        unloaded[mode], used = unloaded_ttft(mode, f, info, c, prompt_len, f.config().vocab_size, gap, args.seed)
        print(f"  {mode}: {unloaded[mode] * 1e3:.1f} ms (median of {used})", file=sys.stderr, flush=True)
    return {"ttft_s": SLO_MULTIPLIER * unloaded[SLO_BASIS], "source": "auto", "multiplier": SLO_MULTIPLIER,
            "p90_prompt_tokens": prompt_len, "unloaded_ttft_s": unloaded}


def describe_slo(slo: dict) -> str:
    if slo["source"] == "flag":
        return f"TTFT SLO {slo['ttft_s']:.3f} s (--slo)"
    u = slo["unloaded_ttft_s"]
    others = ", ".join(f"{m} {v:.3f} s" for m, v in u.items() if m != SLO_BASIS)
    return (f"TTFT SLO {slo['ttft_s']:.3f} s = {slo['multiplier']:g} x the baseline's ({SLO_BASIS}) unloaded TTFT "
            f"{u[SLO_BASIS]:.3f} s ({slo['p90_prompt_tokens']}-token p90 prompt, on one DP group)"
            + (f"; unloaded TTFT of {others}" if others else ""))


def given_flags(parser: argparse.ArgumentParser, argv: list) -> set:
    """The destinations of the options present on the command line (``--flag value`` or ``--flag=value``)."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {a.dest for a in parser._actions if any(o in words for o in a.option_strings)}


def apply_emulate_defaults(args, given: set) -> None:
    """``--emulate``: the defaults of :data:`EMULATE_DEFAULTS` for every flag not given, and trace lengths divided
    by the token scale."""
    if args.emulate is None:
        return
    for k, v in EMULATE_DEFAULTS.items():
        if k not in given:
            setattr(args, k, v)
    if "length_scale" not in given:
        args.length_scale = 1.0 / args.token_scale


def emulated(args, base, mode: str, stats_dir=None):
    """The model factory of one run: ``base`` itself, or with ``--emulate`` the emulated device around it."""
    if not args.emulate:
        return base
    from asap_comm.sim.emulate import EmulatedFactory

    if mode == "async":
        return EmulatedFactory(base, args.emulate, args.emulate_model, time_scale=args.time_scale,
                               token_scale=args.token_scale, num_expert_ranks=args.expert_ranks, stats_dir=stats_dir,
                               attention_tp=args.attention_tp, expert_devices=getattr(args, "expert_dies", 1),
                               weights=getattr(args, "weights", None),
                               check_memory=not getattr(args, "ignore_memory", False), routing=args.routing)
    return EmulatedFactory(base, args.emulate, args.emulate_model, time_scale=args.time_scale,
                           token_scale=args.token_scale, num_expert_ranks=sync_workers(args), stats_dir=stats_dir,
                           attention_tp=args.sync_tp, expert_devices=args.sync_tp,
                           weights=getattr(args, "weights", None),
                           check_memory=not getattr(args, "ignore_memory", False), routing=args.routing)


def memory_table(args) -> dict:
    """The emulated deployment's per-die memory (asap_comm.sim.memory), both modes, in emulated tokens."""
    from asap_comm.sim.costs import Profile
    from asap_comm.sim.emulate import rows_per_real_row
    from asap_comm.sim.memory import deployment_memory, with_weights
    from asap_comm.sim.shapes import ModelShapes

    prof, shapes, S = with_weights(Profile.load(args.emulate), args.weights), ModelShapes.load(args.emulate_model), \
        args.token_scale
    kw = dict(token_budget=args.token_budget * S, chunk_len=None if args.no_load_aware else args.chunk_len * S,
              max_prompt_len=args.max_prompt_len * S)
    # an expert die computes one gathered batch at a time: the runtime's --expert-token-budget rows, in emulated rows
    # per die as simulate_emulated scales them (without --no-expert-batching; with it, one arrival at a time)
    E_dies = args.expert_ranks * args.expert_dies
    real = ModelShapes.from_hf_config(StageFactory(args.model, args.seed).describe()["hf_config"], name="served")
    ex_budget = max(1, int(round(args.expert_token_budget * rows_per_real_row(real, shapes, S, E_dies))))
    return {"profile": prof.name, "weight_bytes": prof.dtype["weight_bytes"],
            "async": deployment_memory("async", prof, shapes, attention_ranks=args.attention_ranks,
                                       attention_tp=args.attention_tp,
                                       expert_ranks=E_dies, ping_pong=not args.no_ping_pong,
                                       expert_token_budget=None if args.no_expert_batching else ex_budget,
                                       long_prompt_lane=not args.no_long_prompt_lane and not args.no_load_aware,
                                       lane_tokens=None if args.lane_tokens in (None, "auto")  # auto: not sized yet
                                       else int(args.lane_tokens) * S, **kw),
            "sync": deployment_memory("sync", prof, shapes, sync_ranks=sync_workers(args), sync_tp=args.sync_tp, **kw)}


def default_lane_tokens(args) -> "tuple | None":
    """``--lane-tokens auto`` (with --emulate): ``(tokens, prompts)``, the lanes' KV pool of the most longest prompts
    (up to ``LANE_POOL_PROMPTS``) that the emulated attention dies hold (``asap_comm.sim.memory.fitting_lane_tokens``),
    in served tokens; None without --emulate or with the lane off (then the runtime's default: one longest
    prompt)."""
    from asap_comm.sim.memory import fitting_lane_tokens

    if not args.emulate or args.no_long_prompt_lane or args.no_load_aware:
        return None
    return fitting_lane_tokens(lambda n: memory_table(argparse.Namespace(**{**vars(args), "lane_tokens": n}))["async"],
                               args.max_prompt_len)


def memory_refusal(args) -> "str | None":
    """--emulate: the one line refusing a deployment whose emulated dies cannot hold it (None: it fits, or
    --ignore-memory)."""
    from asap_comm.sim.memory import memory_problems, refusal

    try:
        table = memory_table(args)
    except ValueError as e:
        return f"prefill.py: {e}"
    problems = [x for m in ("async", "sync") for x in memory_problems(table[m], table["profile"])]
    if not problems or args.ignore_memory:
        return None
    return refusal("prefill.py", problems, "give more --expert-ranks / --expert-dies or larger TP groups"
                   + (", --weights int8" if table["weight_bytes"] > 1 else "") + " or --ignore-memory")


def sync_workers(args) -> int:
    """The baseline's workers (DP groups): --sync-ranks, or as many groups of --sync-tp devices as ASAP has devices
    (A x attention_tp + E x expert_dies) when emulating, else A + E processes."""
    if args.sync_ranks is not None:
        return args.sync_ranks
    if not args.emulate:
        return args.attention_ranks + args.expert_ranks
    dies = args.attention_ranks * args.attention_tp + args.expert_ranks * getattr(args, "expert_dies", 1)
    return max(1, dies // args.sync_tp)


LANE_SLO_FRACTION = 0.5  # --lane-threshold auto: the lane takes a prompt predicted to need over half the SLO alone


def lane_threshold(args, factory, cfg: RuntimeConfig, slo: float) -> "int | None":
    """``--lane-threshold``: a number, or ``auto``: with ``--emulate``, the longest prompt (in chunk steps) whose
    TTFT alone on one attention group, as the simulator predicts it for this emulated deployment
    (``simulate_emulated``, lane off), stays within ``LANE_SLO_FRACTION`` of the SLO (the simulator's own lane
    predicate, ``asap_comm.sim.lane``); without ``--emulate`` None (the runtime's default: any prompt of 2+
    chunks)."""
    if args.lane_threshold != "auto":
        return int(args.lane_threshold)
    if not args.emulate or args.no_long_prompt_lane or cfg.chunk_len is None:
        return None
    from asap_comm.serving import Request
    from asap_comm.sim.emulate import simulate_emulated

    f, alone = emulated(args, factory, "async"), dataclasses.replace(cfg, long_prompt_lane=False)
    n = 2 * cfg.chunk_len
    while n <= cfg.max_prompt_len:
        ttft = simulate_emulated(f, "async", [Request(0, 0.0, n)], alone).records[0].ttft_s
        if ttft > LANE_SLO_FRACTION * slo:
            return n - cfg.chunk_len
        n += cfg.chunk_len
    return cfg.max_prompt_len


def mode_config(cfg: RuntimeConfig, mode: str, args) -> RuntimeConfig:
    """The RuntimeConfig of a mode: the baseline's worker count is sync_workers (run_sync runs A + E workers)."""
    if mode == "async":
        return cfg
    w = sync_workers(args)
    cp = getattr(args, "cp_threshold", None) or None  # 0: off
    if cp is not None:
        cfg = dataclasses.replace(cfg, cp_threshold=cp)
    if w == cfg.num_attention_ranks + cfg.num_expert_ranks:
        return cfg
    if w < 2:
        raise SystemExit(f"prefill.py: the baseline needs at least 2 workers, got {w} (--sync-ranks / --sync-tp)")
    return dataclasses.replace(cfg, num_attention_ranks=w - 1, num_expert_ranks=1)


def emulation_stats(stats_dir) -> dict:
    """Overruns of an emulated run (and, for the baseline, whether gloo kept to the modelled collectives)."""
    from asap_comm.sim.emulate import collective_summary, overrun_summary, read_stats

    o = overrun_summary(read_stats(stats_dir))
    o["collectives"] = collective_summary(stats_dir)
    return o


def sweep_floor(num_requests: int) -> float:
    """--sweep auto's lowest rate: below it a probe (``probe_requests``) spans more than SWEEP_MAX_PROBE_S."""
    return min(num_requests, SWEEP_MIN_REQUESTS) / SWEEP_MAX_PROBE_S


def sweep_auto(run_at, start_rate: float, bisections: int = SWEEP_AUTO_BISECTIONS, target: float = 0.9,
               min_rate: float = 0.0) -> "float | None":
    """Search the SLO-compliant rate without a hand-picked list (``asap_comm.sim.study.search_rate``): from
    ``start_rate``, double (or halve, not below ``min_rate``) until the SLO attainment crosses ``target``, then
    bisect (geometrically) ``bisections`` times; a load passes where the SLO holds AND it is sustained (served
    >= 0.9 of offered, ``asap_comm.serving.sustains_slo``). ``run_at(rate) -> (slo_attainment, served_fraction)``
    runs (and records) one load. Returns the lowest rate run when none passed (the search stopped there), else
    None."""
    seen = study.search_rate(run_at, start_rate, bisections=bisections, target=target, min_rate=min_rate)
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


def run_mode(mode: str, factory, info, requests, cfg):
    runner = run_async if mode == "async" else run_sync
    if runner is None:
        raise SystemExit("prefill.py: the synchronous baseline (asap_comm.serving.sync) is not available")
    if mode == "async":
        print(f"{mode}: {len(requests)} requests, {cfg.num_attention_ranks} attention + {cfg.num_expert_ranks} expert "
              f"processes", file=sys.stderr, flush=True)
    else:
        print(f"{mode}: {len(requests)} requests, {cfg.num_attention_ranks + cfg.num_expert_ranks} DP+EP workers",
              file=sys.stderr, flush=True)
    return runner(factory, info, requests, cfg)


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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in ``--help``; the description keeps its line breaks."""


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n")
    p = argparse.ArgumentParser(description="\n".join(doc[:4] + doc[5:]).strip(), formatter_class=_HelpFormatter)
    p.add_argument("--model", default="small", help="model preset (tiny, small) or a checkpoint directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights, the trace and the prompts")
    p.add_argument("--attention-ranks", type=int, default=2,
                   help="A: attention processes of ASAP (the baseline runs A + E DP+EP workers)")
    p.add_argument("--expert-ranks", type=int, default=2, help="E: expert processes of ASAP")
    p.add_argument("--trace", default="synthetic",
                   help="the load: 'synthetic' (Gamma-bursty arrivals, log-normal prompt lengths), 'mooncake' or "
                        "'azure' (the public traces that ship with the package; $ASAP_TRACES_DIR overrides their "
                        "folder), or a Mooncake .jsonl / Azure .csv trace file")
    p.add_argument("--num-requests", type=int, default=24, help="requests in the load (at most, for a file)")
    p.add_argument("--rate", type=float, default=3.0,
                   help="offered load in requests/s (a file's arrivals are rescaled to it); --sweep overrides it")
    p.add_argument("--burstiness", type=float, default=2.0,
                   help="coefficient of variation of the synthetic inter-arrival times (1 = Poisson)")
    p.add_argument("--median-len", type=int, default=48, help="median synthetic prompt length, tokens")
    p.add_argument("--max-prompt-len", type=int, default=512,
                   help="longest prompt, tokens (longer prompts of the trace are clipped to it)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply a trace file's prompt lengths by this (to size a real trace for CPUs)")
    p.add_argument("--token-budget", type=int, default=256, help="tokens per attention micro-batch")
    p.add_argument("--expert-token-budget", type=int, default=RuntimeConfig.expert_token_budget,
                   help="rows an expert process gathers for one layer before it computes (optimization 4; with "
                        "--emulate the memory check sizes an expert die's activations by it, in emulated rows)")
    p.add_argument("--chunk-len", type=int, default=256,
                   help="split longer prompts into chunks of at most this many tokens (with load-aware placement)")
    p.add_argument("--slo", default="auto",
                   help=f"TTFT SLO in seconds, or 'auto': {SLO_MULTIPLIER:g}x the baseline's ({SLO_BASIS}) unloaded "
                        "TTFT of the trace's p90 prompt, measured on the same ranks and configuration before the "
                        "runs")
    p.add_argument("--sweep", default="",
                   help="comma-separated request rates (req/s): run each and report SLO-compliant throughput; or "
                        "'auto': search each mode's SLO-compliant throughput (doubling, then bisection) "
                        "(default: %(default)r, one run at --rate)")
    p.add_argument("--emulate", default=None, metavar="PROFILE",
                   help="emulated accelerators: hold every stage for its modelled time on this hardware profile "
                        f"({', '.join(known_profiles())}, or a profile .json)")
    p.add_argument("--emulate-model", default="deepseek-v3",
                   help="with --emulate: the model whose work is costed (deepseek-v3, small, tiny, or a config.json)")
    p.add_argument("--routing", default="balanced", metavar="balanced|zipf:S|histogram:PATH",
                   help="with --emulate: the emulated model's routing (asap_comm/sim/routing.py); a hot expert "
                        "rank's emulated expert work and rows are scaled by its share (default: balanced)")
    p.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                   help="with --emulate: wall seconds per modelled second (the dilation; raise it if overruns "
                        "exceed 5%%)")
    p.add_argument("--token-scale", type=int, default=DEFAULT_TOKEN_SCALE,
                   help="with --emulate: emulated tokens per real token (prompt lengths of a trace file are divided "
                        "by it unless --length-scale is given)")
    p.add_argument("--attention-tp", type=int, default=1,
                   help="with --emulate: devices per ASAP attention rank (a tensor-parallel group)")
    p.add_argument("--expert-dies", type=int, default=1,
                   help="with --emulate: devices per ASAP expert process (its experts spread over them; default with "
                        "--emulate: 4)")
    p.add_argument("--weights", choices=("bf16", "int8"), default=None,
                   help="with --emulate: weight dtype of the emulated devices, overriding the profile's (int8: W8A8)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="with --emulate: run a deployment whose emulated dies cannot hold the model (recorded)")
    p.add_argument("--sync-tp", type=int, default=1,
                   help="with --emulate: devices per baseline worker (a tensor-parallel DP group; its experts spread "
                        "over them)")
    p.add_argument("--sync-ranks", type=int, default=None,
                   help="baseline workers (DP groups) (default: A + E; with --emulate, ASAP's devices / --sync-tp)")
    p.add_argument("--cp-threshold", type=int, default=None, metavar="TOKENS",
                   help="with --emulate: the baseline's context parallelism: a prompt longer than TOKENS (served "
                        "tokens; x --token-scale emulated) is shared by ceil(prompt / TOKENS) DP groups, each "
                        "holding its share (default with --emulate: 64; 0: off)")
    p.add_argument("--sync-collectives", choices=("gloo", "shm"), default="gloo",
                   help="the baseline's all-to-alls: gloo (torch.distributed), or shm (asap_comm shared memory, "
                        "what NCCL/HCCL are to devices; the default with --emulate)")
    p.add_argument("--modes", default="async,sync", help="comma-separated modes to run: async (ASAP), sync (baseline)")
    for opt, what in (("barrier-free", "(1), the barrier-free pipeline (off: a barrier across the attention ranks "
                                       "at every MoE layer)"),
                      ("ping-pong", "(2), ping-pong (two micro-batches in flight per attention rank)"),
                      ("load-aware", "(3), load-aware placement (least outstanding work) and long-prompt splitting"),
                      ("expert-batching", "(4), expert-side batching (rows of a layer across attention ranks)")):
        p.add_argument(f"--no-{opt}", action="store_true", help=f"ablation: turn off ASAP's optimization {what}")
    p.add_argument("--no-long-prompt-lane", action="store_true",
                   help="ablation: turn off ASAP's long-prompt lane (a prompt of several chunks pipelined over the "
                        "attention ranks, each layer's KV put to the later chunks' ranks)")
    p.add_argument("--lane-threshold", default="auto", metavar="TOKENS|auto",
                   help="the long-prompt lane takes prompts longer than this many tokens; auto: with --emulate, "
                        "those whose predicted TTFT alone on one attention group (the simulator's, "
                        "simulate_emulated) exceeds half the SLO, as the simulator's lane decides; without "
                        "--emulate, any prompt of 2+ chunks")
    p.add_argument("--lane-tokens", default=None, metavar="TOKENS|auto",
                   help="the prompt tokens the long-prompt lanes in flight hold together: every attention rank's "
                        "pool of received KV rows (the memory check charges it); a prompt that wants the lane waits "
                        "for room (default: --max-prompt-len, one longest prompt; auto, with --emulate: the most "
                        "longest prompts, up to 4, that the emulated attention dies hold)")
    p.add_argument("--lane-wait", default="auto", metavar="SECONDS|auto|none",
                   help="a prompt that has waited this long for room in the lane runs on one attention rank instead, "
                        "so a lane pool too small for the long prompts' arrivals does not queue them without bound "
                        f"(auto: {LANE_WAIT_SLO:g} x the TTFT SLO; none: it waits for a lane to close)")
    p.add_argument("--no-token-balanced", action="store_true",
                   help="ablation: fill an attention rank's first ping-pong micro-batch up to the budget instead of "
                        "balancing the two micro-batches' tokens")
    p.add_argument("--out", default="runs/prefill",
                   help="directory for summary.json, ttft.png and timeline_<mode>.json")
    return p


def parse_args(argv: list, parser: "argparse.ArgumentParser | None" = None) -> argparse.Namespace:
    """The example's arguments as its command line ``argv`` gives them: :func:`build_parser`'s, then the
    ``--emulate`` defaults for every flag not in ``argv`` (what :func:`main` runs; scripts that reuse the
    example's deployment, such as ``bench/afd_window.py``, build theirs the same way)."""
    parser = build_parser() if parser is None else parser
    args = parser.parse_args(argv)
    apply_emulate_defaults(args, given_flags(parser, argv))
    return args


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, parser)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"async", "sync"}:
        parser.error(f"--modes {args.modes!r}: give async, sync or both")
    if args.slo != "auto":
        try:
            if not float(args.slo) > 0:
                raise ValueError
        except ValueError:
            parser.error(f"--slo {args.slo!r}: give a positive number of seconds or auto")
    auto_sweep = args.sweep.strip() == "auto"
    try:
        rates = [] if auto_sweep else [float(x) for x in args.sweep.split(",") if x] or [args.rate]
    except ValueError:
        parser.error(f"--sweep {args.sweep!r}: give comma-separated rates (req/s) or auto")
    lane_pool = None  # --lane-tokens auto: (tokens, prompts) of the lanes' KV pool the emulated memory allows
    if args.lane_tokens is not None and args.lane_tokens != "auto":
        try:
            args.lane_tokens = int(args.lane_tokens)
            if args.lane_tokens < 1:
                raise ValueError
        except ValueError:
            parser.error(f"--lane-tokens {args.lane_tokens}: give a number of tokens >= 1 (the lanes' KV pool), "
                         "or auto")
    if args.lane_tokens == "auto" and not args.emulate:
        parser.error("--lane-tokens auto needs --emulate (the memory model of the emulated dies sizes the pool)")
    if args.lane_wait not in ("auto", "none"):
        try:
            args.lane_wait = float(args.lane_wait)
            if not (args.lane_wait >= 0 and math.isfinite(args.lane_wait)):
                raise ValueError
        except ValueError:
            parser.error(f"--lane-wait {args.lane_wait}: give seconds >= 0, auto or none")
    if args.emulate:
        if args.expert_dies < 1:
            parser.error(f"--expert-dies {args.expert_dies}: give a number of devices >= 1")
        if args.lane_tokens == "auto":
            args.lane_tokens = None
            try:
                lane_pool = default_lane_tokens(args)
            except ValueError:
                lane_pool = None  # a bad deployment: memory_refusal names it
            if lane_pool is not None:
                args.lane_tokens = lane_pool[0]
                print(f"long-prompt lane: a KV pool of {lane_pool[0]} tokens ({lane_pool[1]} longest prompt"
                      f"{'s' if lane_pool[1] > 1 else ''}, what the emulated attention dies hold, up to "
                      f"{LANE_POOL_PROMPTS})", file=sys.stderr, flush=True)
        line = memory_refusal(args)  # before the factories, whose own check is the experts' share only
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        try:
            base = StageFactory(args.model, args.seed)
            for mode in modes:  # a bad profile, model or split fails here
                emulated(args, base, mode)
        except ValueError as e:
            parser.error(f"--emulate {args.emulate} --emulate-model {args.emulate_model}: {e}")
        if args.time_scale <= 0 or args.token_scale < 1:
            parser.error("--time-scale must be > 0 and --token-scale >= 1")
    if not args.emulate:
        extra = [f for f, on in (("--expert-dies", args.expert_dies != 1), ("--weights", args.weights),
                                 ("--ignore-memory", args.ignore_memory)) if on]
        if extra:
            verb = "needs" if len(extra) == 1 else "need"
            parser.error(f"{', '.join(extra)} {verb} --emulate (emulated devices only)")
    if args.lane_threshold != "auto" and not (args.lane_threshold.isdigit()):
        parser.error(f"--lane-threshold {args.lane_threshold}: give a number of tokens >= 0, or auto")
    if args.routing != "balanced" and not args.emulate:
        parser.error(f"--routing {args.routing}: needs --emulate (the served model's own router picks its experts; "
                     "the routing skews the emulated model's work)")
    if args.cp_threshold is not None:
        if args.cp_threshold < 0:
            parser.error(f"--cp-threshold {args.cp_threshold}: give a number of tokens >= 1, or 0 for off")
        if args.cp_threshold and not args.emulate:
            parser.error("--cp-threshold needs --emulate: the baseline's context parallelism is emulated (the owner "
                         "of a shared prompt computes it; the emulated devices hold their shares)")

    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:  # the plot is drawn after the run: say so before
        print("prefill.py: matplotlib is missing (ttft.png): pip install -e \".[examples]\"", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        factory = StageFactory(args.model, args.seed)
        mcfg = factory.config()
        info = model_info(mcfg)
        requests = make_requests(args, mcfg.vocab_size)
    except (TraceError, ValueError, OSError) as e:  # a bad trace line, an unknown preset, a missing file
        print(f"prefill.py: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}: {mcfg.num_hidden_layers} layers, {mcfg.n_routed_experts} experts (top "
          f"{mcfg.num_experts_per_tok}); {len(requests)} requests; computing reference outputs ...",
          file=sys.stderr, flush=True)
    if args.emulate:
        print(f"emulated accelerators: {args.emulate_model} on {args.emulate}, time scale {args.time_scale:g}, "
              f"{args.token_scale} emulated tokens per real token", file=sys.stderr, flush=True)
    refs, single_process_s = references(factory, requests)
    cfg = RuntimeConfig(num_attention_ranks=args.attention_ranks, num_expert_ranks=args.expert_ranks,
                        token_budget=args.token_budget, chunk_len=args.chunk_len,
                        max_prompt_len=args.max_prompt_len, expert_token_budget=args.expert_token_budget,
                        barrier_free=not args.no_barrier_free,
                        ping_pong=not args.no_ping_pong, load_aware=not args.no_load_aware,
                        expert_batching=not args.no_expert_batching, progress=True,
                        long_prompt_lane=not args.no_long_prompt_lane, token_balanced=not args.no_token_balanced,
                        lane_tokens=args.lane_tokens, sync_collectives=args.sync_collectives)
    if args.emulate:  # calibration requests take emulated (long) times: space them by the emulated prefill time
        single_process_s = max(single_process_s, _emulated_p90_s(args, factory, requests))
    cfgs = {m: mode_config(cfg, m, args) for m in ("async", "sync")}
    if args.emulate:  # the placer weighs work as the emulated device does (CostModel.placer_linear_weight)
        cfgs = {m: dataclasses.replace(c, placer_linear_weight=emulated(args, factory, m).placer_linear_weight())
                for m, c in cfgs.items()}
    slo_info = resolve_slo(args, {m: emulated(args, factory, m) for m in ("async", "sync")}, info, cfgs, requests,
                           single_process_s, modes)
    slo = slo_info["ttft_s"]
    print(describe_slo(slo_info), file=sys.stderr, flush=True)
    threshold = lane_threshold(args, factory, cfgs["async"], slo)
    wait = {"auto": LANE_WAIT_SLO * slo, "none": None}.get(args.lane_wait, args.lane_wait)
    cfgs["async"] = dataclasses.replace(cfgs["async"], lane_threshold=threshold, lane_wait_s=wait)
    if not args.no_long_prompt_lane and "async" in modes:
        print("long-prompt lane: " + ("prompts of 2+ chunks" if threshold is None else
                                      f"prompts longer than {threshold} tokens")
              + ("" if wait is None else f"; one that waits {wait:.3g} s for room runs on one attention rank"),
              file=sys.stderr, flush=True)
    mean_len = sum(int(r.token_ids.numel()) for r in requests) / len(requests)
    summary = {"config": vars(args), "slo": slo_info, "runs": [], "lane_threshold": threshold,
               "lane_tokens": {"tokens": lane_tokens(cfgs["async"]), "auto": lane_pool is not None},
               "lane_wait_s": wait}
    if args.emulate:
        summary["emulation"] = emulated(args, factory, "async").describe_emulation()
        summary["ignore_memory"] = args.ignore_memory
        summary["memory"] = {m: [d.describe() for d in v] if m in ("async", "sync") else v
                             for m, v in memory_table(args).items()}
    rows, checked, mismatches, details = [], 0, 0, []
    emu_runs: dict = {m: [] for m in modes}
    last_results: dict = {}  # mode -> its last RunResult (the default picture)

    def run_at(mode: str, rate: "float | None") -> tuple:
        """One run of ``mode`` at ``rate`` req/s (None: the trace as made): recorded; returns its SLO attainment
        and served fraction (served over offered tokens/s)."""
        nonlocal checked, mismatches, details
        if rate is None:
            load = requests
        else:
            load = at_rate(probe_requests(requests, rate) if auto_sweep else requests, rate)
        rate = args.rate if rate is None else rate
        mean_len = sum(int(r.token_ids.numel()) for r in load) / len(load)  # of this load's prompts
        with tempfile.TemporaryDirectory(prefix="asap-emu-") as stats_dir:
            result = run_mode(mode, emulated(args, factory, mode, stats_dir), info, load, cfgs[mode])
            emu = emulation_stats(stats_dir) if args.emulate else None
        s = summarize_run(result.records, slo).as_dict()
        c, b, d = check(result, refs)
        checked, mismatches, details = checked + c, mismatches + b, details + d
        entry = {"mode": mode, "rate_req_s": rate, "offered_tokens_per_s": rate * mean_len, "requests": len(load), **s}
        if result.lane:  # what the long-prompt lane's admission did in this run (serving.lane.LaneCounts)
            entry["lane"] = result.lane
        if emu is not None:
            entry["overrun_fraction"] = emu["overrun_fraction"]
            entry["emulation"] = {k: v for k, v in emu.items() if k != "overrun_fraction"}
            emu_runs[mode].append(emu)
            if emu["overrun_fraction"] > 0.05:
                print(f"  warning: {mode}: the held stages' real compute overran their modelled time by "
                      f"{emu['overrun_fraction']:.1%} of it: the dilation is too small for this host (raise "
                      "--time-scale)", file=sys.stderr, flush=True)
            late = emu["collectives"]
            busiest = max((r["held_s"] for r in emu["per_rank"]), default=0.0)
            late["late_share"] = late["late_s"] / busiest if busiest else 0.0
            if late["collectives"] and late["late_share"] > 0.05:
                print(f"  warning: {mode}: the host's transport ({args.sync_collectives}) was slower than the "
                      f"modelled collective in {late['late_fraction']:.1%} of {late['collectives']} collectives, "
                      f"{late['late_share']:.1%} of the busiest worker's time (median {late['median_transport_s']:.2e}"
                      f" s vs {late['median_modelled_s']:.2e} s modelled): the baseline is slowed by this host; "
                      "raise --time-scale or use --sync-collectives shm", file=sys.stderr, flush=True)
        summary["runs"].append(entry)
        last_results[mode] = result
        summary.setdefault(mode, {k: v for k, v in s.items()})  # the first load's numbers, per mode
        write_timeline(out / f"timeline_{mode}.json", result, cfgs[mode])
        fmt = (lambda v: "-" if v is None else f"{v:.3f}")
        rows.append([mode, f"{rate:g}", f"{rate * mean_len:.0f}", fmt(s["ttft_p50_s"]), fmt(s["ttft_p90_s"]),
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
    summary["correctness"] = {"checked": checked, "mismatches": mismatches, "details": details[:20]}
    if auto_sweep or len(rates) > 1:
        pts = {m: [r for r in summary["runs"] if r["mode"] == m] for m in modes}
        for mode in modes:  # a load counts only where the SLO holds AND served >= 0.9 of offered (sustained)
            summary[mode]["slo_compliant_throughput"] = slo_compliant_throughput(pts[mode])
            summary[mode]["at_slo_compliant_load"] = served_at_load(pts[mode],
                                                                    summary[mode]["slo_compliant_throughput"])
            summary[mode]["withheld"] = withheld_reason(pts[mode])
        if "async" in modes and "sync" in modes:
            summary["slo_compliant_throughput_ratio"], summary["ratio_withheld"] = throughput_ratio(
                summary["async"]["slo_compliant_throughput"], summary["sync"]["slo_compliant_throughput"],
                points=(pts["async"], pts["sync"]))
    if args.emulate:
        for mode in modes:  # by time (asap_comm.sim.emulate_stats.overrun_summary), and by calls
            calls = sum(e["calls"] for e in emu_runs[mode])
            over = sum(e["overruns"] for e in emu_runs[mode])
            modelled = sum(e["modelled_s"] for e in emu_runs[mode])
            summary[mode]["overrun_fraction"] = sum(e["overrun_s"] for e in emu_runs[mode]) / modelled if modelled \
                else 0.0
            summary[mode]["overrun_calls_fraction"] = over / calls if calls else 0.0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if auto_sweep or len(rates) > 1:  # TTFT p50/p90 against offered load, per mode
        plots.ttft_vs_load(out / "ttft.png", summary["runs"], slo, heading="ASAP (async) vs synchronous DP+EP",
                           title=f"model {args.model}, trace {Path(args.trace).name}")
    else:  # one load point per mode: the TTFT CDFs and per-rank compute / waiting / idle
        plots.ttft_cdf_and_ranks(out / "ttft.png", last_results, slo, cfgs)
    print()
    print(table(rows, emulated=bool(args.emulate)))
    print(f"\n{describe_slo(slo_info)}")
    print(f"correctness: {checked} outputs checked, {mismatches} mismatches")
    if auto_sweep or len(rates) > 1:
        sct = {m: summary[m].get("slo_compliant_throughput") for m in modes}
        for mode in modes:
            at = summary[mode].get("at_slo_compliant_load")
            print(f"SLO-compliant throughput ({mode}): {'-' if sct[mode] is None else sct[mode]} tokens/s" + (
                "" if at is None else f" (there: served {at['served_tokens_per_s']:.0f} tokens/s, "
                f"{at['served_fraction']:.0%} of offered, TTFT p99 {at['ttft_p99_s']:.2f} s)")
                + (f" ({summary[mode]['withheld']})" if summary[mode].get("withheld") else ""))
        if "slo_compliant_throughput_ratio" in summary:
            r = summary["slo_compliant_throughput_ratio"]
            print("ASAP / baseline: " + (f"- ({summary['ratio_withheld']})" if r is None else f"{r:.2f}x"))
    if args.emulate:
        print("overruns: " + ", ".join(f"{m} {summary[m]['overrun_fraction']:.2%}" for m in modes))
    print(f"artifacts in {out}/: summary.json, ttft.png, " + ", ".join(f"timeline_{m}.json" for m in modes))
    return 0 if mismatches == 0 else 1


def _emulated_p90_s(args, factory, requests) -> float:
    """Modelled (dilated) single-device prefill time of the p90 prompt: spaces the SLO calibration requests."""
    from asap_comm.sim.costs import CostModel

    cost = CostModel.load(args.emulate, args.emulate_model)
    n = int(p90_prompt_len(requests) * args.token_scale)
    shapes = cost.shapes
    per_layer = cost.attention_s([(n, 0)]) + cost.router_s(n) + cost.shared_experts_s(n)
    return (shapes.num_layers * per_layer + cost.head_s(1)) * args.time_scale


if __name__ == "__main__":
    sys.exit(main())
