"""The prefill job's command line and deployment: its flags, the ``--emulate`` presets, each mode's
``RuntimeConfig``, the emulated devices and their memory.

Everything here reads the parsed arguments of :func:`build_parser` (``args``),
what ``examples/prefill.py`` and the benchmarks that reuse its deployment
(``bench/bench_serving.py``, ``bench/afd_window.py``, ``bench/lane_policy_replay.py``)
build with :func:`parse_args`. The runtime's flags are
``asap_comm.serving.runtime_args.add_runtime_args``'s (one set of defaults,
``RuntimeConfig``'s); the job adds its load, SLO, emulation and deployment flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from ...serving.plugins import load_model_factory
from ...serving.protocol import RuntimeConfig
from ...serving.runtime_args import add_runtime_args, given_flags, runtime_config_from_args
from ..core.lane import LANE_SLO_FRACTION, LANE_WAIT_SLO
from ..costmodel.hardware import known_profiles
from .emulator import DEFAULT_TIME_SCALE

__all__ = ["DEFAULT_TIME_SCALE", "DEFAULT_TOKEN_SCALE", "EMULATE_DEFAULTS", "build_parser", "parse_args",
           "check_args", "apply_emulate_defaults", "sync_workers", "mode_config", "runtime_configs", "lane_wait_s",
           "emulated", "memory_table", "default_lane_tokens", "memory_refusal", "size_lane_pool", "lane_threshold",
           "emulated_p90_s"]

DEFAULT_TOKEN_SCALE = 128  # --emulate: emulated tokens per real token
# --emulate: the presets of the flags a user did not give. The deployment is afd-plugin's 32 dies (vLLM afd-plugin
# issue 170), memory-feasible for deepseek-v3 on ascend-910c-cm384 (asap_comm.sim.costmodel.memory): ASAP 2 attention groups
# x TP8 + 16 expert dies (4 expert processes of 4 dies each: the served model has 8 experts), the baseline 4 DP
# groups x TP8 with EP over all 32 dies; the Mooncake trace, 128-token chunks and micro-batches, prompts up to 512
# served tokens, the baseline's collectives on shared memory
EMULATE_DEFAULTS = {"model": "tiny", "attention_ranks": 2, "attention_tp": 8, "expert_ranks": 4, "expert_dies": 4,
                    "trace": "mooncake", "num_requests": 240, "max_prompt_len": 512, "token_budget": 128,
                    "chunk_len": 128, "sync_collectives": "shm", "sync_tp": 8, "cp_threshold": 64}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default in ``--help``; the description keeps its line breaks."""


def _factor_or_none(text: str):
    if text == "none":
        return None
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a multiple of the SLO >= 0, or none")
    return v


def build_parser(description: str = "MoE prefill, ASAP against the synchronous DP+EP baseline, on one host.",
                 prog: "str | None" = None) -> argparse.ArgumentParser:
    """The job's flags: the runtime's (``add_runtime_args``), the load, the SLO, the sweep, emulation and the
    baseline's deployment."""
    p = argparse.ArgumentParser(prog=prog, description=description, formatter_class=_HelpFormatter)
    p.add_argument("--model", default="small", help="model preset (tiny, small) or a checkpoint directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the model weights, the trace and the prompts")
    p.add_argument("--modes", default="async,sync", help="comma-separated modes to run: async (ASAP), sync (baseline)")
    p.add_argument("--out", default="runs/prefill",
                   help="directory for summary.json, ttft.png and timeline_<mode>.json")
    load = p.add_argument_group("load")
    load.add_argument("--trace", default="synthetic",
                      help="the load: 'synthetic' (Gamma-bursty arrivals, log-normal prompt lengths), 'mooncake' or "
                           "'azure' (the public traces that ship with the package; $ASAP_TRACES_DIR overrides their "
                           "folder), or a Mooncake .jsonl / Azure .csv trace file")
    load.add_argument("--num-requests", type=int, default=24, help="requests in the load (at most, for a file)")
    load.add_argument("--rate", type=float, default=3.0,
                      help="offered load in requests/s (a file's arrivals are rescaled to it); --sweep overrides it")
    load.add_argument("--burstiness", type=float, default=2.0,
                      help="coefficient of variation of the synthetic inter-arrival times (1 = Poisson)")
    load.add_argument("--median-len", type=int, default=48, help="median synthetic prompt length, tokens")
    load.add_argument("--length-scale", type=float, default=1.0,
                      help="multiply a trace file's prompt lengths by this (to size a real trace for CPUs); prompts "
                           "longer than --max-prompt-len are clipped to it")
    slo = p.add_argument_group("SLO and load sweep")
    slo.add_argument("--slo", default="auto",
                     help="TTFT SLO in seconds, or 'auto': asap_comm.serving.slo.auto_slo on the baseline's (sync) "
                          "unloaded TTFT of the trace's p90 prompt, measured on the same ranks and configuration "
                          "before the runs")
    slo.add_argument("--sweep", default="",
                     help="comma-separated request rates (req/s): run each and report SLO-compliant throughput; or "
                          "'auto': search each mode's SLO-compliant throughput (doubling, then bisection) "
                          "(default: %(default)r, one run at --rate)")
    slo.add_argument("--lane-wait-slo", type=_factor_or_none, default=LANE_WAIT_SLO, metavar="MULTIPLE|none",
                     help="the lane's wait bound as a multiple of the TTFT SLO, made seconds once the SLO is known "
                          "(RuntimeConfig.lane_wait_s = MULTIPLE x SLO); --lane-wait-s, when given, replaces it; "
                          "none: without --lane-wait-s a prompt waits for a lane to close")
    emu = p.add_argument_group("emulated accelerators")
    emu.add_argument("--emulate", default=None, metavar="PROFILE",
                     help="hold every stage for its modelled time on this hardware profile "
                          f"({', '.join(known_profiles())}, or a profile .json)")
    emu.add_argument("--emulate-model", default="deepseek-v3",
                     help="with --emulate: the model whose work is costed (deepseek-v3, small, tiny, or a config.json)")
    emu.add_argument("--routing", default="balanced", metavar="balanced|zipf:S|histogram:PATH",
                     help="with --emulate: the emulated model's routing (asap_comm/sim/costmodel/routing.py); a hot expert "
                          "rank's emulated expert work and rows are scaled by its share")
    emu.add_argument("--time-scale", type=float, default=DEFAULT_TIME_SCALE,
                     help="with --emulate: wall seconds per modelled second (the dilation; raise it if overruns "
                          "exceed 5%%)")
    emu.add_argument("--token-scale", type=int, default=DEFAULT_TOKEN_SCALE,
                     help="with --emulate: emulated tokens per real token (prompt lengths of a trace file are divided "
                          "by it unless --length-scale is given)")
    emu.add_argument("--attention-tp", type=int, default=1,
                     help="with --emulate: devices per ASAP attention rank (a tensor-parallel group)")
    emu.add_argument("--expert-dies", type=int, default=1,
                     help="with --emulate: devices per ASAP expert process (its experts spread over them; default "
                          "with --emulate: 4)")
    emu.add_argument("--weights", choices=("bf16", "int8"), default=None,
                     help="with --emulate: weight dtype of the emulated devices, overriding the profile's (int8: W8A8)")
    emu.add_argument("--ignore-memory", action="store_true",
                     help="with --emulate: run a deployment whose emulated dies cannot hold the model (recorded)")
    base = p.add_argument_group("the baseline's deployment")
    base.add_argument("--sync-tp", type=int, default=1,
                      help="with --emulate: devices per baseline worker (a tensor-parallel DP group; its experts "
                           "spread over them)")
    base.add_argument("--sync-ranks", type=int, default=None,
                      help="baseline workers (DP groups) (default: A + E; with --emulate, ASAP's devices / --sync-tp)")
    base.add_argument("--cp-threshold", type=int, default=None, metavar="TOKENS",
                      help="with --emulate: the baseline's context parallelism: a prompt longer than TOKENS (served "
                           "tokens; x --token-scale emulated) is shared by ceil(prompt / TOKENS) DP groups, each "
                           "holding its share (default with --emulate: 64; 0: off)")
    add_runtime_args(p)
    return p


def parse_args(argv: list, parser: "argparse.ArgumentParser | None" = None) -> argparse.Namespace:
    """The job's arguments as the command line ``argv`` gives them: :func:`build_parser`'s, then the ``--emulate``
    presets for every flag not in ``argv`` (what ``examples/prefill.py`` runs; the benchmarks that reuse its
    deployment build theirs the same way)."""
    parser = build_parser() if parser is None else parser
    args = parser.parse_args(argv)
    apply_emulate_defaults(args, given_flags(parser, argv))
    return args


def apply_emulate_defaults(args, given: set) -> None:
    """``--emulate``: :data:`EMULATE_DEFAULTS` for every flag not given, and trace lengths divided by the token
    scale."""
    if args.emulate is None:
        return
    for k, v in EMULATE_DEFAULTS.items():
        if k not in given:
            setattr(args, k, v)
    if "length_scale" not in given:
        args.length_scale = 1.0 / args.token_scale


def check_args(parser: argparse.ArgumentParser, args) -> tuple:
    """``(modes, rates, auto_sweep)``; every bad value or combination is ``parser.error`` (one line, exit 2)."""
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
    if args.lane_tokens == "auto" and not args.emulate:
        parser.error("--lane-tokens auto needs --emulate (the memory model of the emulated dies sizes the pool)")
    try:  # the runtime's own checks, naming the flag (lane_tokens auto: sized later)
        runtime_config_from_args(args, **({"lane_tokens": None} if args.lane_tokens == "auto" else {}))
    except ValueError as e:
        parser.error(str(e))
    if args.emulate and args.expert_dies < 1:
        parser.error(f"--expert-dies {args.expert_dies}: give a number of devices >= 1")
    if not args.emulate:
        extra = [f for f, on in (("--expert-dies", args.expert_dies != 1), ("--weights", args.weights),
                                 ("--ignore-memory", args.ignore_memory)) if on]
        if extra:
            parser.error(f"{', '.join(extra)} {'needs' if len(extra) == 1 else 'need'} --emulate (emulated devices "
                         "only)")
    if args.routing != "balanced" and not args.emulate:
        parser.error(f"--routing {args.routing}: needs --emulate (the served model's own router picks its experts; "
                     "the routing skews the emulated model's work)")
    if args.cp_threshold is not None:
        if args.cp_threshold < 0:
            parser.error(f"--cp-threshold {args.cp_threshold}: give a number of tokens >= 1, or 0 for off")
        if args.cp_threshold and not args.emulate:
            parser.error("--cp-threshold needs --emulate: the baseline's context parallelism is emulated (the owner "
                         "of a shared prompt computes it; the emulated devices hold their shares)")
    return modes, rates, auto_sweep


def sync_workers(args) -> int:
    """The baseline's workers (DP groups): --sync-ranks, or as many groups of --sync-tp devices as ASAP has devices
    (A x attention_tp + E x expert_dies) when emulating, else A + E processes."""
    if args.sync_ranks is not None:
        return args.sync_ranks
    if not args.emulate:
        return args.attention_ranks + args.expert_ranks
    dies = args.attention_ranks * args.attention_tp + args.expert_ranks * getattr(args, "expert_dies", 1)
    return max(1, dies // args.sync_tp)


def mode_config(cfg: RuntimeConfig, mode: str, args) -> RuntimeConfig:
    """The RuntimeConfig of a mode (``cfg.for_mode``): the baseline's worker count is :func:`sync_workers`
    (run_sync runs A + E workers) and its context parallelism ``--cp-threshold`` (0: off)."""
    cfg = cfg.for_mode(mode)
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


def runtime_configs(args, factory, **overrides) -> dict:
    """``{mode: RuntimeConfig}`` of both modes from the runtime's flags (``runtime_config_from_args``, with
    ``overrides``), :func:`mode_config`, and with ``--emulate`` the placer weighing work as the emulated device
    does (``CostModel.placer_linear_weight``). The lane's threshold and wait bound are set once the SLO is known
    (:func:`lane_threshold`, :func:`lane_wait_s`)."""
    cfg = runtime_config_from_args(args, lane_tokens=args.lane_tokens if args.lane_tokens != "auto" else None,
                                   **overrides)
    cfgs = {m: mode_config(cfg, m, args) for m in ("async", "sync")}
    if args.emulate:
        cfgs = {m: dataclasses.replace(c, placer_linear_weight=emulated(args, factory, m).placer_linear_weight())
                for m, c in cfgs.items()}
    return cfgs


def lane_wait_s(args, slo: float) -> "float | None":
    """The lane's wait bound in seconds: ``--lane-wait-s``, else ``--lane-wait-slo`` x the SLO (None: none)."""
    if args.lane_wait_s is not None:
        return args.lane_wait_s
    return None if args.lane_wait_slo is None else args.lane_wait_slo * slo


def emulated(args, base, mode: str, stats_dir=None):
    """The model factory of one run: ``base`` itself, or with ``--emulate`` the emulated device around it."""
    if not args.emulate:
        return base
    from .emulator import EmulatedFactory

    common = dict(time_scale=args.time_scale, token_scale=args.token_scale, stats_dir=stats_dir,
                  weights=getattr(args, "weights", None), check_memory=not getattr(args, "ignore_memory", False),
                  routing=args.routing)
    if mode == "async":
        return EmulatedFactory(base, args.emulate, args.emulate_model, num_expert_ranks=args.expert_ranks,
                               attention_tp=args.attention_tp, expert_devices=getattr(args, "expert_dies", 1),
                               **common)
    return EmulatedFactory(base, args.emulate, args.emulate_model, num_expert_ranks=sync_workers(args),
                           attention_tp=args.sync_tp, expert_devices=args.sync_tp, **common)


def memory_table(args) -> dict:
    """The emulated deployment's per-die memory (asap_comm.sim.costmodel.memory), both modes, in emulated tokens."""
    from ..costmodel.hardware import Profile
    from ..costmodel.memory import deployment_memory, with_weights
    from ..costmodel.shapes import ModelShapes
    from .emulator import rows_per_real_row

    prof, shapes, S = with_weights(Profile.load(args.emulate), args.weights), ModelShapes.load(args.emulate_model), \
        args.token_scale
    kw = dict(token_budget=args.token_budget * S, chunk_len=None if args.no_load_aware else args.chunk_len * S,
              max_prompt_len=args.max_prompt_len * S)
    # an expert die computes one gathered batch at a time: the runtime's --expert-token-budget rows, in emulated rows
    # per die as simulate_emulated scales them (without --no-expert-batching; with it, one arrival at a time)
    E_dies = args.expert_ranks * args.expert_dies
    hf = load_model_factory(args.model, seed=args.seed).describe()["hf_config"]
    real = ModelShapes.from_hf_config(hf, name="served")
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
    (up to ``LANE_POOL_PROMPTS``) that the emulated attention dies hold
    (``asap_comm.sim.costmodel.memory.fitting_lane_tokens``), in served tokens; None without --emulate or with the lane off (then the runtime's default: one longest
    prompt)."""
    from ..costmodel.memory import fitting_lane_tokens

    if not args.emulate or args.no_long_prompt_lane or args.no_load_aware:
        return None
    return fitting_lane_tokens(lambda n: memory_table(argparse.Namespace(**{**vars(args), "lane_tokens": n}))["async"],
                               args.max_prompt_len)


def memory_refusal(args, prog: str = "prefill.py") -> "str | None":
    """--emulate: the one line refusing a deployment whose emulated dies cannot hold it (None: it fits, or
    --ignore-memory)."""
    from ..costmodel.memory import memory_problems, refusal

    try:
        table = memory_table(args)
    except ValueError as e:
        return f"{prog}: {e}"
    problems = [x for m in ("async", "sync") for x in memory_problems(table[m], table["profile"])]
    if not problems or args.ignore_memory:
        return None
    return refusal(prog, problems, "give more --expert-ranks / --expert-dies or larger TP groups"
                   + (", --weights int8" if table["weight_bytes"] > 1 else "") + " or --ignore-memory")


def size_lane_pool(args) -> "tuple | None":
    """``--lane-tokens auto`` with --emulate: sets ``args.lane_tokens`` to :func:`default_lane_tokens`' pool (None
    where the lane is off or the deployment is bad: the memory check names it) and returns ``(tokens, prompts)``."""
    if args.lane_tokens != "auto" or not args.emulate:
        return None
    args.lane_tokens = None
    try:
        pool = default_lane_tokens(args)
    except ValueError:
        pool = None  # a bad deployment: memory_refusal names it
    if pool is not None:
        args.lane_tokens = pool[0]
    return pool


def lane_threshold(args, factory, cfg: RuntimeConfig, slo: float) -> "int | None":
    """``--lane-threshold``: a number, or ``auto``: with ``--emulate``, the longest prompt (in chunk steps) whose
    TTFT alone on one attention group, as the simulator predicts it for this emulated deployment
    (``simulate_emulated``, lane off), stays within ``LANE_SLO_FRACTION`` of the SLO (the simulator's own lane
    predicate, ``asap_comm.sim.core.lane``); without ``--emulate`` None (the runtime's default: any prompt of 2+
    chunks)."""
    if args.lane_threshold != "auto":
        return int(args.lane_threshold)
    if not args.emulate or args.no_long_prompt_lane or cfg.chunk_len is None:
        return None
    from ...serving import Request
    from .emulator import simulate_emulated

    f, alone = emulated(args, factory, "async"), dataclasses.replace(cfg, long_prompt_lane=False)
    n = 2 * cfg.chunk_len
    while n <= cfg.max_prompt_len:
        ttft = simulate_emulated(f, "async", [Request(0, 0.0, n)], alone).records[0].ttft_s
        if ttft > LANE_SLO_FRACTION * slo:
            return n - cfg.chunk_len
        n += cfg.chunk_len
    return cfg.max_prompt_len


def emulated_p90_s(args, p90_tokens: int) -> float:
    """Modelled (dilated) single-device prefill time of a ``p90_tokens``-token served prompt: spaces the SLO
    calibration requests of an emulated run."""
    from ..costmodel.costs import CostModel

    cost = CostModel.load(args.emulate, args.emulate_model)
    n = int(p90_tokens * args.token_scale)
    per_layer = cost.attention_s([(n, 0)]) + cost.router_s(n) + cost.shared_experts_s(n)
    return (cost.shapes.num_layers * per_layer + cost.head_s(1)) * args.time_scale

