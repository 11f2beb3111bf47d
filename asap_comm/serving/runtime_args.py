"""The runtime's command-line flags, declared once: every command line that builds a ``RuntimeConfig`` uses them.

    parser = argparse.ArgumentParser()
    add_runtime_args(parser)                       # --attention-ranks ... --sync-collectives
    args = parser.parse_args()
    cfg = runtime_config_from_args(args, progress=True)

One flag per :class:`~asap_comm.serving.protocol.RuntimeConfig` field, named
after it (``token_budget`` -> ``--token-budget``; a switch that is on by
default -> ``--no-<name>``), with the field's default: the service
(``python -m asap_comm.serving.server``), ``examples/prefill.py``,
``examples/prefill_multihost.py``, ``python -m asap_comm.sim run`` and the
benchmarks share them, so a default is written in one place (the dataclass).
A command with presets for its own setting (``sim run`` on a cluster profile,
``examples/prefill.py --emulate``) applies them to the flags not given
(:func:`given_flags`) and says so in its help.

Two values take ``auto``, resolved by the commands that can: ``--lane-threshold
auto`` (the runtime: any prompt of 2+ chunks; the simulator and ``--emulate``:
a prompt predicted to need over half the SLO alone) and ``--lane-tokens auto``
(a command with a memory model sizes the lane's pool; elsewhere it is refused).
Times are seconds and say so: ``--expert-deadline-s``, ``--lane-wait-s``.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import fields

from .protocol import RuntimeConfig

__all__ = ["add_runtime_args", "runtime_config_from_args", "given_flags", "FLAGS"]

_DEFAULTS = {f.name: f.default for f in fields(RuntimeConfig)}

# field -> its flag (the switches that are on by default: --no-<name>)
FLAGS = {
    "num_attention_ranks": "--attention-ranks", "num_expert_ranks": "--expert-ranks",
    "token_budget": "--token-budget", "max_prompt_len": "--max-prompt-len", "chunk_len": "--chunk-len",
    "load_aware": "--no-load-aware",
    "barrier_free": "--no-barrier-free", "ping_pong": "--no-ping-pong", "token_balanced": "--no-token-balanced",
    "expert_batching": "--no-expert-batching", "expert_token_budget": "--expert-token-budget",
    "expert_deadline_s": "--expert-deadline-s",
    "long_prompt_lane": "--no-long-prompt-lane", "lane_threshold": "--lane-threshold", "lane_groups": "--lane-groups",
    "lane_tokens": "--lane-tokens", "lane_wait_s": "--lane-wait-s", "lane_chunks": "--lane-chunks",
    "spare_expert_ranks": "--spare-expert-ranks", "attention_failover": "--attention-failover",
    "sync_collectives": "--sync-collectives",
}


def _tokens_or_auto(text: str):
    """``auto``, or a whole number of tokens (its range is RuntimeConfig's to check)."""
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of tokens, or auto") from None


def add_runtime_args(parser: argparse.ArgumentParser, *, simulated: bool = False) -> None:
    """Add the runtime's flags to ``parser``, in three groups (both modes, ASAP only, the baseline only), each
    with its ``RuntimeConfig`` default. ``simulated=True`` (the simulator) leaves out the three that only real
    processes have: ``--spare-expert-ranks``, ``--attention-failover`` and ``--sync-collectives`` (the simulator
    models the collectives)."""
    d = _DEFAULTS
    shared = parser.add_argument_group("runtime (both modes)")
    shared.add_argument("--attention-ranks", type=int, default=d["num_attention_ranks"],
                        help="A: ASAP's attention ranks (the baseline runs A + E DP+EP workers unless told otherwise)")
    shared.add_argument("--expert-ranks", type=int, default=d["num_expert_ranks"], help="E: ASAP's expert ranks")
    shared.add_argument("--token-budget", type=int, default=d["token_budget"],
                        help="tokens per attention micro-batch (the baseline: per step of a worker)")
    shared.add_argument("--max-prompt-len", type=int, default=d["max_prompt_len"],
                        help="the longest prompt served, tokens")
    shared.add_argument("--chunk-len", type=int, default=d["chunk_len"],
                        help="split longer prompts into chunks of at most this many tokens (with load-aware "
                             "placement)")
    shared.add_argument("--no-load-aware", action="store_true",
                        help="ablation: turn off optimization (3), load-aware placement (least outstanding work) "
                             "and long-prompt splitting")
    asap = parser.add_argument_group("runtime (ASAP only)")
    for opt, what in (("barrier-free", "(1), the barrier-free pipeline (off: a barrier across the attention ranks "
                                       "at every MoE layer)"),
                      ("ping-pong", "(2), ping-pong (two micro-batches in flight per attention rank)"),
                      ("expert-batching", "(4), expert-side batching (rows of a layer across attention ranks)")):
        asap.add_argument(f"--no-{opt}", action="store_true", help=f"ablation: turn off optimization {what}")
    asap.add_argument("--no-token-balanced", action="store_true",
                      help="ablation: fill an attention rank's first ping-pong micro-batch up to the budget instead "
                           "of balancing the two micro-batches' tokens")
    asap.add_argument("--expert-token-budget", type=int, default=d["expert_token_budget"],
                      help="rows an expert rank gathers for one layer before it computes (optimization 4)")
    asap.add_argument("--expert-deadline-s", type=float, default=d["expert_deadline_s"],
                      help="seconds an expert rank waits for more rows of a layer after the first")
    asap.add_argument("--no-long-prompt-lane", action="store_true",
                      help="ablation: turn off the long-prompt lane (a prompt of several chunks pipelined over the "
                           "attention ranks, each layer's KV put to the later chunks' ranks)")
    asap.add_argument("--lane-threshold", type=_tokens_or_auto, default="auto", metavar="TOKENS|auto",
                      help="the lane takes prompts longer than this many tokens; auto: any prompt of 2+ chunks on "
                           "real processes, one predicted to need over half the SLO alone where a cost model "
                           "predicts it (sim run, examples/prefill.py --emulate)")
    asap.add_argument("--lane-groups", type=int, default=d["lane_groups"], metavar="G",
                      help="attention ranks a lane prompt spreads over (0: all)")
    asap.add_argument("--lane-tokens", type=_tokens_or_auto, default=None, metavar="TOKENS|auto",
                      help="the prompt tokens the lanes in flight hold together (every attention rank's pool of "
                           "received KV rows; a prompt that wants the lane waits for room); unset: "
                           "--max-prompt-len, one longest prompt; auto, where a memory model sizes it (sim run, "
                           "examples/prefill.py --emulate): the most longest prompts, up to 4, the dies hold")
    asap.add_argument("--lane-wait-s", type=float, default=d["lane_wait_s"], metavar="SECONDS",
                      help="a prompt that has waited this many seconds for room in the lane runs on one attention "
                           "rank instead; unset: it waits for a lane to close")
    asap.add_argument("--lane-chunks", choices=("tokens", "cost"), default=d["lane_chunks"],
                      help="how a lane prompt is split: tokens, chunks of near-equal length (--chunk-len); cost, "
                           "two chunks per lane rank of near-equal attention cost (later ones shorter, none longer "
                           "than --chunk-len), on up to twice as many ranks")
    if not simulated:
        asap.add_argument("--spare-expert-ranks", type=int, default=d["spare_expert_ranks"],
                          help="expert failover: spare expert processes, holding no experts until one takes over "
                               "the experts of an expert rank that died")
        asap.add_argument("--attention-failover", action="store_true",
                          help="attention failover: when an attention process dies and another lives, re-admit "
                               "its requests on the surviving attention ranks instead of failing the group")
    if not simulated:
        sync = parser.add_argument_group("runtime (the baseline only)")
        sync.add_argument("--sync-collectives", choices=("gloo", "shm"), default=d["sync_collectives"],
                          help="the baseline's all-to-alls: gloo (torch.distributed), or shm (asap_comm shared "
                               "memory, what NCCL/HCCL are to devices)")


def runtime_config_from_args(args: argparse.Namespace, **overrides) -> RuntimeConfig:
    """The ``RuntimeConfig`` of ``args`` (parsed with :func:`add_runtime_args`'s flags), with ``overrides``
    (field=value) applied last. ``--lane-threshold auto`` is None (the runtime's rule) unless overridden;
    ``--lane-tokens auto`` must be resolved by the caller (an override), else ``ValueError``. A bad value raises
    ``ValueError`` naming the flag and the value (give it to ``parser.error``)."""
    values = {}
    for name, flag in FLAGS.items():
        dest = flag[2:].replace("-", "_")  # --no-ping-pong -> no_ping_pong (True: the switch off)
        if not hasattr(args, dest):
            continue  # a flag this command left out (simulated=True)
        v = getattr(args, dest)
        values[name] = (not v) if flag.startswith("--no-") else v
    if values.get("lane_threshold") == "auto":
        values["lane_threshold"] = None
    if values.get("lane_tokens") == "auto" and "lane_tokens" not in overrides:
        raise ValueError("--lane-tokens auto: this command has no memory model to size the lane's pool; give a "
                         "number of tokens")
    values.update(overrides)
    try:
        return RuntimeConfig(**values)
    except ValueError as e:
        raise ValueError(_flag_message(str(e), set(overrides))) from None


def _flag_message(msg: str, overridden: set) -> str:
    """``RuntimeConfig: token_budget=0 must be ...`` -> ``--token-budget 0: must be ...`` (a field the command
    set itself keeps its field name)."""
    m = re.match(r"RuntimeConfig: (\w+)=(\S+) (.*)", msg)
    if m is None or m.group(1) not in FLAGS or m.group(1) in overridden:
        return msg
    return f"{FLAGS[m.group(1)]} {m.group(2)}: {m.group(3)}"


def given_flags(parser: argparse.ArgumentParser, argv: list) -> set:
    """The destinations of the options present on the command line ``argv`` (``--flag value`` or
    ``--flag=value``): what a command's presets must leave alone."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {a.dest for a in parser._actions if any(o in words for o in a.option_strings)}
