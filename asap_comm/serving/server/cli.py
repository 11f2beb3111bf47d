"""The service's command line: ``python -m asap_comm.serving.server`` (the flags, and :func:`main`, which
checks them and the optional dependencies, builds the model factory, and hands over to ``.workers``)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..runtime_args import add_runtime_args, runtime_config_from_args
from .frontdoor import check_connection_limit
from .options import ServiceOptions
from .workers import remove_stale, serve_on_this_host, serve_one_pe

__all__ = ["build_parser", "service_options", "main"]

DESCRIPTION = "The online prefill service: ASAP (or the DP+EP baseline) behind an OpenAI-compatible HTTP API."


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m asap_comm.serving.server", description=DESCRIPTION,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="small", help="a model preset (tiny, small, ...) or a checkpoint directory")
    ap.add_argument("--plugin", default="deepseek", help="the model plugin (entry-point group asap_comm.models)")
    ap.add_argument("--mode", choices=["async", "sync"], default="async",
                    help="async: ASAP; sync: the DP+EP baseline on the same processes")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: a free port (printed)")
    ap.add_argument("--served-model-name", default=None, help="the model id of the API (default: --model's name)")
    ap.add_argument("--tokenizer", default=None, help="a local tokenizer directory; enables text prompts")
    ap.add_argument("--max-queued-tokens", type=int, default=65536,
                    help="admission bound: prompt tokens admitted and not finished; a call over it on its own gets "
                         "413, others wait their turn (first come, first served)")
    ap.add_argument("--max-waiting-tokens", type=int, default=None,
                    help="prompt tokens of the calls waiting for admission (429 past it); unset: twice "
                         "--max-queued-tokens")
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="the largest request body read (413 past it); unset: 1 MiB + 16 bytes per token of "
                         "--max-queued-tokens")
    ap.add_argument("--max-rank-calls", type=int, default=0,
                    help="requests an attention rank holds at once (the others wait in the front end, where the "
                         "clients' chunks take turns); 0 (default): no bound")
    ap.add_argument("--no-urgent-slot", action="store_true",
                    help="turn off the extra micro-batch slot per attention rank that lets a light client's call "
                         "(fewer calls in flight than an equal share) start at once beside a flooding client's "
                         "(its calls still go first, in micro-batches of their own); saves one dispatch slot of "
                         "memory per attention rank")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every path but /health and /metrics; unset: "
                         "the environment variable ASAP_API_KEY (preferred: a command line is visible to ps)")
    ap.add_argument("--request-timeout-s", type=float, default=60.0, help="per-request deadline (504 past it)")
    ap.add_argument("--header-timeout-s", type=float, default=10.0,
                    help="a connection must send a request's headers within this long of its first byte (408 and "
                         "closed otherwise: slowloris)")
    ap.add_argument("--idle-timeout-s", type=float, default=60.0,
                    help="a connection with no request in progress is closed after this long without one")
    ap.add_argument("--max-connections", type=int, default=None,
                    help="open connections at most; at the limit the oldest idle or slow-header one is closed, and "
                         "a new one gets 503 only when every open one is in a request; unset: the file limit "
                         "(RLIMIT_NOFILE) less 128; must be below it")
    ap.add_argument("--min-body-rate", type=int, default=16384,
                    help="bytes per second a request body must arrive at, averaged over every 5 s (408 otherwise)")
    ap.add_argument("--refused-hold-s", type=float, default=1.0,
                    help="a client whose call got 429 from the full waiting room while it held its share of it: "
                         "its next small calls wait unread in their connections, up to this long, until it no "
                         "longer holds its share (a flooding client's retries cost one call per hold, not one "
                         "per retry; at most half of --max-connections held at once); 0: answer them at once")
    ap.add_argument("--bad-call-delay-s", type=float, default=1.0,
                    help="a client that had 32 calls refused as its own error (a 4xx other than 429) within a "
                         "second: each of its calls waits this long before it is handled, while its refusals keep "
                         "coming (a client flooding bad calls costs one call per connection per delay); 0: no brake")
    ap.add_argument("--worker-stall-s", type=float, default=10.0,
                    help="/health answers 503 naming a worker whose heartbeat is older than this (not a failure)")
    ap.add_argument("--drain-timeout-s", type=float, default=30.0, help="on SIGTERM/Ctrl-C: in-flight grace")
    ap.add_argument("--failure-exit-s", type=float, default=10.0,
                    help="after a worker dies: answer 503 this long, then exit with status 3")
    ap.add_argument("--comm-timeout-s", type=float, default=30.0,
                    help="the communicator's default wait bound; the serving loops retry waits on a live peer "
                         "that is slow or stopped, so it does not limit how long a peer may stall")
    ap.add_argument("--seed", type=int, default=0, help="random weights of a preset model")
    add_runtime_args(ap)  # the runtime's flags, shared with every command line (asap_comm.serving.runtime_args)
    # The service's one preset (SERVICE_PRESETS): the baseline's collectives on asap_comm's authenticated one-sided
    # puts, not gloo's loopback TCPStore that another local process could jam; a dead worker is then named by the
    # survivors' waits. --sync-collectives gloo chooses torch.distributed.
    ap.set_defaults(**SERVICE_PRESETS)
    for a in ap._actions:
        if a.dest in SERVICE_PRESETS:
            a.help += f" (the service's default: {SERVICE_PRESETS[a.dest]})"
    return ap


# RuntimeConfig fields whose default the service changes (the only ones; tests/test_runtime_args.py holds it)
SERVICE_PRESETS = {"sync_collectives": "shm"}


def service_runtime_config(args):
    """The workers' ``RuntimeConfig`` from parsed arguments: the runtime's flags, and in the async mode the urgent
    slot on unless ``--no-urgent-slot`` (``RuntimeConfig.urgent_slot``: a light client's call starts at once
    beside a flooding client's)."""
    cfg = runtime_config_from_args(args)
    if args.mode == "async":
        cfg = dataclasses.replace(cfg, urgent_slot=not args.no_urgent_slot)
    return cfg


def service_options(args, environ) -> ServiceOptions:
    """The HTTP side's settings from parsed arguments; the API key from ``--api-key`` or else
    ``environ["ASAP_API_KEY"]``, stripped of surrounding whitespace (said on stderr). ``ValueError`` for an empty
    key (a typo must not switch authentication off)."""
    source = "--api-key" if args.api_key is not None else "ASAP_API_KEY"
    api_key = args.api_key if args.api_key is not None else environ.get("ASAP_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key / ASAP_API_KEY is empty: give a key, or unset it for no authentication")
    if api_key is not None and api_key != api_key.strip():  # a mounted secret often ends with a newline
        api_key = api_key.strip()
        print(f"asap serve: the API key from {source} had surrounding whitespace (a trailing newline?); it was "
              "stripped", file=sys.stderr, flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ServiceOptions(host=args.host, port=args.port, model_name=name, mode=args.mode,
                          max_queued_tokens=args.max_queued_tokens, request_timeout_s=args.request_timeout_s,
                          drain_timeout_s=args.drain_timeout_s, failure_exit_s=args.failure_exit_s,
                          tokenizer=args.tokenizer, max_body_bytes=args.max_body_bytes,
                          max_waiting_tokens=args.max_waiting_tokens, worker_stall_s=args.worker_stall_s,
                          header_timeout_s=args.header_timeout_s, idle_timeout_s=args.idle_timeout_s,
                          max_connections=args.max_connections, min_body_rate=args.min_body_rate, api_key=api_key,
                          max_rank_calls=args.max_rank_calls or None, refused_hold_s=args.refused_hold_s,
                          bad_call_delay_s=args.bad_call_delay_s)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    missing = [m for m in ("aiohttp", "prometheus_client") if _missing(m)]
    if missing:
        print(f"asap serve: missing {', '.join(missing)}: pip install -e \".[serve]\"", file=sys.stderr)
        return 2
    if args.tokenizer is not None and _missing("transformers"):
        print("asap serve: --tokenizer needs transformers: pip install transformers", file=sys.stderr)
        return 2
    from ..plugins import load_model_factory, model_info_of
    try:
        factory = load_model_factory(args.model, plugin=args.plugin, seed=args.seed)
        info = model_info_of(factory)
        cfg = service_runtime_config(args)
        opts = service_options(args, os.environ)
        check_connection_limit(opts.max_connections)
    except (ValueError, LookupError, OSError) as e:
        print(f"asap serve: {e}", file=sys.stderr)
        return 2
    remove_stale()  # what a crash of a whole service tree left in /dev/shm
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None:  # started by torchrun: one PE of a group across hosts
        return serve_one_pe(args, factory, info, cfg, opts)
    return serve_on_this_host(args, factory, info, cfg, opts)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
