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
served baseline (``asap_comm.serving.slo.auto_slo``, the rule every tool uses): before the runs, each mode is started on the same ranks and
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
takes (``asap_comm.sim.emulate.emulator``): the work of ``--emulate-model`` (default
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
``memory``; ``asap_comm.sim.costmodel.memory``) unless ``--ignore-memory``.
``summary.json`` then carries ``overrun_fraction`` per mode, the memory table
(``memory``) and ``ignore_memory``.

    python examples/prefill.py --emulate ascend-910c-cm384 --emulate-model deepseek-v3 --sweep auto --out DIR

The runtime's flags and their defaults are every command line's
(``asap_comm.serving.runtime_args``); the lane's wait bound is ``--lane-wait-s``
seconds, or ``--lane-wait-slo`` times the SLO (default 2). This file is the
command line only: the job is ``asap_comm.sim.emulate`` (``deploy``: flags,
presets, deployment; ``job``: load, reference, SLO, runs, artifacts).
"""
from __future__ import annotations

import importlib.util
import sys

import torch

from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.traces import TraceError
from asap_comm.sim.costmodel.memory import LANE_POOL_PROMPTS
from asap_comm.sim.emulate.deploy import (build_parser, check_args, emulated, memory_refusal, parse_args,
                                          runtime_configs, size_lane_pool)
from asap_comm.sim.emulate.job import make_requests, print_report, run_job


def main(argv=None) -> int:
    doc = __doc__.split("\n")
    parser = build_parser("\n".join(doc[:4] + doc[5:]).strip())
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, parser)
    modes, rates, auto_sweep = check_args(parser, args)
    lane_pool = None  # --lane-tokens auto: (tokens, prompts) of the lanes' KV pool the emulated memory allows
    if args.emulate:
        lane_pool = size_lane_pool(args)
        if lane_pool is not None:
            print(f"long-prompt lane: a KV pool of {lane_pool[0]} tokens ({lane_pool[1]} longest prompt"
                  f"{'s' if lane_pool[1] > 1 else ''}, what the emulated attention dies hold, up to "
                  f"{LANE_POOL_PROMPTS})", file=sys.stderr, flush=True)
        line = memory_refusal(args)  # before the factories, whose own check is the experts' share only
        if line is not None:
            print(line, file=sys.stderr)
            return 2
        try:
            base = load_model_factory(args.model, seed=args.seed)
            for mode in modes:  # a bad profile, model or split fails here
                emulated(args, base, mode)
        except ValueError as e:
            parser.error(f"--emulate {args.emulate} --emulate-model {args.emulate_model}: {e}")
        if args.time_scale <= 0 or args.token_scale < 1:
            parser.error("--time-scale must be > 0 and --token-scale >= 1")
    if importlib.util.find_spec("matplotlib") is None:  # the plot is drawn after the run: say so before
        print("prefill.py: matplotlib is missing (ttft.png): pip install -e \".[examples]\"", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    try:
        factory = load_model_factory(args.model, seed=args.seed)
        info = model_info_of(factory)
        requests = make_requests(args, info.vocab_size)
        cfgs = runtime_configs(args, factory, progress=True)
    except (TraceError, ValueError, LookupError, OSError) as e:  # a bad trace line, an unknown preset, a missing file
        print(f"prefill.py: {e}", file=sys.stderr)
        return 2
    print(f"model {args.model}: {info.num_layers} layers, {info.num_experts} experts (top {info.top_k}); "
          f"{len(requests)} requests; computing reference outputs ...", file=sys.stderr, flush=True)
    if args.emulate:
        print(f"emulated accelerators: {args.emulate_model} on {args.emulate}, time scale {args.time_scale:g}, "
              f"{args.token_scale} emulated tokens per real token", file=sys.stderr, flush=True)
    summary, rows = run_job(args, modes, rates, auto_sweep, factory, info, requests, cfgs, lane_pool)
    print_report(summary, rows, modes, args.out, bool(args.emulate))
    return 0 if summary["correctness"]["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
