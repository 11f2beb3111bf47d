"""The automatic TTFT SLO, one rule for every tool: ``SLO_MULTIPLIER`` (3) x the unloaded TTFT of the trace's
90th-percentile prompt.

Production SLOs are set as a multiple of unloaded latency; basing it on the
served system itself keeps it meaningful on any host or modelled cluster. What
"unloaded TTFT" is measured on is the caller's: the real processes, one
prompt at a time (``examples/prefill.py``), the service over HTTP
(``asap_comm.serving.client``), the simulator on the deployment being measured
(``asap_comm.sim.core.sweep.unloaded_slo``) or on one reference deployment for a
whole scaling curve (``asap_comm.sim.studies.search_space.slo_rule``). The rule itself,
which prompt and which multiple, is :func:`auto_slo`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["SLO_MULTIPLIER", "AutoSLO", "p90_prompt_len", "auto_slo"]

SLO_MULTIPLIER = 3.0  # the automatic SLO: this many times the unloaded TTFT of the p90 prompt


@dataclass(frozen=True)
class AutoSLO:
    """An automatic SLO and what it came from."""

    ttft_s: float  # the SLO: multiplier x unloaded_ttft_s
    unloaded_ttft_s: float  # the unloaded TTFT of the p90 prompt, as measured
    p90_prompt_tokens: int
    multiplier: float = SLO_MULTIPLIER


def p90_prompt_len(lengths: Iterable[int], max_prompt_len: "int | None" = None) -> int:
    """The 90th-percentile prompt length (the nearest rank at or above it) of ``lengths``, each clipped at
    ``max_prompt_len`` first (None: no clip). ``ValueError`` for no lengths."""
    lens = sorted(int(n) if max_prompt_len is None else min(int(n), max_prompt_len) for n in lengths)
    if not lens:
        raise ValueError("p90_prompt_len: no prompt lengths")
    return lens[min(len(lens) - 1, int(0.9 * len(lens)))]


def auto_slo(lengths: Iterable[int], unloaded_ttft_s: Callable[[int], float], *,
             max_prompt_len: "int | None" = None, multiplier: float = SLO_MULTIPLIER) -> AutoSLO:
    """THE automatic SLO: ``multiplier`` x ``unloaded_ttft_s(p90)``, where ``p90`` is :func:`p90_prompt_len` of
    ``lengths`` (clipped at ``max_prompt_len``) and ``unloaded_ttft_s(tokens)`` measures (or predicts) the TTFT
    of one prompt of that many tokens alone in the system, in seconds. ``ValueError`` if the measurement is not a
    positive finite number of seconds."""
    if not (isinstance(multiplier, (int, float)) and math.isfinite(multiplier) and multiplier > 0):
        raise ValueError(f"auto_slo: multiplier={multiplier!r} must be a positive number")
    p90 = p90_prompt_len(lengths, max_prompt_len)
    t = unloaded_ttft_s(p90)
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise ValueError(f"auto_slo: the unloaded TTFT of the {p90}-token p90 prompt is {t!r}; it must be positive "
                         "seconds")
    return AutoSLO(multiplier * t, t, p90, multiplier)
