"""The emulation's host overhead: what the real runtime's processes spend outside the held stages, on this host.

An emulated run (``emulate.py``) holds every stage for its modelled time, but
the runtime's own work between stages (its loop, packing rows, puts and
signals, the baseline's shm collectives in Python, process wake-ups on a
shared 2-core host) is not held: it adds real wall time that no modelled
device has. ``simulate_emulated`` leaves it out, so it predicted unloaded
TTFTs 10-30% short and both modes' capacities 36-43% high on afd-plugin's
deployment (``validate --regime emulated``, issue 21).

:func:`fit_host_overhead` measures it the way ``calibrate`` fits its in-situ
factors, on a probe of other requests than the validation's (up to two
chunks each), through the real runtime on the emulated devices, both modes:

* an **unloaded** part: requests far enough apart that they never queue; it
  sees every overhead on the request's path;
* a **burst** part: requests that all arrive at once, so the attention ranks
  stay busy; it tells the overhead that occupies a rank (and delays the
  requests behind it) from the overhead that only delays its own micro-batch.

and fits, per mode, in wall seconds, the numbers that make the simulator's
TTFTs of the same requests match the real ones in the least-squares sense of
relative errors (each probe request counts alike, short or long):

* ASAP, two numbers: ``async_job_s``, **busy** time of every attention-rank job
  (a layer segment up to its dispatch, or the tail: the attention process is
  single-threaded, so while it packs and puts one micro-batch the other waits),
  and ``async_layer_s``, **latency** added to each MoE layer's round trip to
  the experts (the expert processes' own loop, unpacking and puts, the wake-up
  of the waiting rank), which the rank's other micro-batch overlaps;
* the baseline, one: ``sync_layer_s``, time added to every MoE layer of its
  lock-step step (every rank pays it, so busy and latency are one).

``simulate_emulated(..., host_overhead=)`` charges them (divided by the
dilation). The validation's loads never enter the fit: they are predictions.
Without the burst part, only the unloaded sum is identifiable and ASAP's is
charged as busy time (``async_layer_s`` 0), which over-predicted its loaded
tail by 43-49% (issue 21).
"""
from __future__ import annotations

import sys
import time

__all__ = ["fit_host_overhead", "fit_one", "fit_two"]

# wall seconds per job / per MoE layer searched (a tiny served model on a 2-core host: a few ms to tens of ms)
_GRID_MAX_S = 0.1
_GRID_STEPS = 200
_GRID2_STEPS = 40  # fit_two's coarse grid per axis (2.5-ms steps)


def _sse(predict, real: list, relative: bool):
    """The objective of a fit: ``h -> sum of squared (relative) errors of predict(h) against real``."""
    if relative:
        return lambda *h: sum(((p - r) / r) ** 2 for p, r in zip(predict(*h), real))
    return lambda *h: sum((p - r) ** 2 for p, r in zip(predict(*h), real))


def _golden(f, lo: float, hi: float, rounds: int = 20) -> "tuple[float, float]":
    """(f's smallest value, its argument) found by golden-section search on ``[lo, hi]``."""
    g = (5 ** 0.5 - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(rounds):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = f(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = f(b)
    return min((fa, a), (fb, b))


def fit_one(predict, real: list, *, relative: bool = False) -> "tuple[float, float]":
    """The overhead ``h`` in ``[0, 0.1]`` s minimizing ``sum((predict(h)[i] - real[i]) ** 2)`` (each error divided
    by ``real[i]`` when ``relative``), and that sum's root mean square: a grid of 0.5-ms steps, then a
    golden-section refinement around the best point. ``predict(h)`` returns the simulated TTFTs in the order of
    ``real``."""
    sse = _sse(predict, real, relative)
    step = _GRID_MAX_S / _GRID_STEPS
    grid = [i * step for i in range(_GRID_STEPS + 1)]
    errs = [sse(h) for h in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    best = min([(errs[i], grid[i]), _golden(sse, max(0.0, grid[i] - step), min(_GRID_MAX_S, grid[i] + step))])
    return best[1], (best[0] / max(1, len(real))) ** 0.5


def fit_two(predict, real: list, *, relative: bool = False) -> "tuple[tuple[float, float], float]":
    """The overheads ``(h1, h2)``, each in ``[0, 0.1]`` s, minimizing the squared errors of ``predict(h1, h2)``
    against ``real`` (relative when ``relative``), and that sum's root mean square: a grid of 2.5-ms steps on
    both axes, then a pattern search from the best point (the eight axis and diagonal moves, the step halved
    down to 10 us when none improves: the two overheads trade off along a diagonal valley)."""
    sse = _sse(predict, real, relative)
    step = _GRID_MAX_S / _GRID2_STEPS
    grid = [i * step for i in range(_GRID2_STEPS + 1)]
    err, x, y = min((sse(x, y), x, y) for x in grid for y in grid)
    moves = [(1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (-1, -1), (1, -1), (-1, 1)]
    while step > 1e-5:
        best = min((sse(a, b), a, b) for a, b in ((min(_GRID_MAX_S, max(0.0, x + dx * step)),
                                                   min(_GRID_MAX_S, max(0.0, y + dy * step))) for dx, dy in moves))
        if best[0] < err:
            err, x, y = best
        else:
            step /= 2
    return (x, y), (err / max(1, len(real))) ** 0.5


KEYS = {"async": ("async_job_s", "async_layer_s"), "sync": ("sync_layer_s",)}


def fit_host_overhead(factories: dict, cfgs: dict, info, *, lengths: list, burst_lengths: "list | None" = None,
                      progress: bool = True) -> dict:
    """Run the probe and fit the host overhead of each mode (see the module docstring).

    ``factories``/``cfgs``: per mode (``"async"``, ``"sync"``), the run's ``EmulatedFactory`` and ``RuntimeConfig``
    (as the validation runs them); ``info``: the served model's ``ModelInfo``; ``lengths``: the unloaded part's
    prompt lengths (real tokens; at most ``cfg.max_prompt_len``): requests one at a time, each after the longest
    simulated solo TTFT of the probe (either mode) times 1.5 plus 0.1 s, so none queues; ``burst_lengths``: the
    burst part's, all arriving at once (None or empty: no burst part; then ASAP's overhead is all busy time,
    ``async_layer_s`` 0). Returns ``{"async_job_s", "async_layer_s", "sync_layer_s", "probe": {mode: {"gap_s",
    "lengths", "burst_lengths", "real_ttft_s", "sim_ttft_s" (with the overhead), "sim_ttft_none_s" (without),
    "rms_s", "rel_rms"}}, "wall_s"}``: the TTFT lists hold the unloaded part, then the burst part; ``rms_s`` is their
    error's root mean square in seconds, ``rel_rms`` that of the relative errors (the fit's objective).
    """
    import torch

    from ..serving.runtime import PromptRequest, run_async
    from ..serving.sync import run_sync
    from ..serving.traces import Request
    from .emulate import simulate_emulated

    if set(factories) != {"async", "sync"} or set(cfgs) != {"async", "sync"}:
        raise ValueError(f"fit_host_overhead: factories and cfgs need 'async' and 'sync', got {sorted(factories)} "
                         f"and {sorted(cfgs)}")
    burst_lengths = list(burst_lengths or [])
    for name, ls, least in (("lengths", lengths, 2), ("burst_lengths", burst_lengths, 0)):
        if len(ls) < least or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ls):
            raise ValueError(f"fit_host_overhead: {name}={ls!r} must be {'at least 2 ' if least else ''}ints >= 1")
    if len(burst_lengths) == 1:
        raise ValueError(f"fit_host_overhead: burst_lengths={burst_lengths!r}: a burst needs at least 2 requests")
    t0 = time.perf_counter()
    solo = max(simulate_emulated(factories[m], m, [Request(0, 0.0, max(lengths))], cfgs[m]).records[0].ttft_s
               for m in ("async", "sync"))
    gap = 1.5 * solo + 0.1
    parts = [[Request(i, i * gap, n) for i, n in enumerate(lengths)]]
    if burst_lengths:
        parts.append([Request(i, 0.0, n) for i, n in enumerate(burst_lengths)])
    g = torch.Generator().manual_seed(12345)
    reqs = [[PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (r.prompt_len,),
                                                                     generator=g)) for r in part] for part in parts]
    out: dict = {"probe": {}}
    for mode in ("async", "sync"):
        real = []
        for part, rq in zip(parts, reqs):
            res = (run_async if mode == "async" else run_sync)(factories[mode], info, rq, cfgs[mode])
            by_id = {r.request_id: r for r in res.records}
            bad = [r.request_id for r in part if by_id.get(r.request_id) is None
                   or by_id[r.request_id].ttft_s is None]
            if bad:
                raise RuntimeError(f"fit_host_overhead: the {mode} probe run failed requests {bad}")
            real += [by_id[r.request_id].ttft_s for r in part]
        keys = KEYS[mode] if burst_lengths else KEYS[mode][:1]

        def predict(*h, mode=mode, keys=keys) -> list:
            ho = dict(zip(keys, h))
            out_ = []
            for part in parts:
                s = {r.request_id: r.ttft_s for r in simulate_emulated(factories[mode], mode, part, cfgs[mode],
                                                                       host_overhead=ho).records}
                out_ += [s[r.request_id] for r in part]
            return out_

        if len(keys) == 2:
            h, rel = fit_two(predict, real, relative=True)
        else:
            h1, rel = fit_one(predict, real, relative=True)
            h = (h1,)
        for k in KEYS[mode]:
            out[k] = dict(zip(keys, h)).get(k, 0.0)
        fitted, none = predict(*h), predict(*(0.0 for _ in keys))
        rms = (sum((p - r) ** 2 for p, r in zip(fitted, real)) / len(real)) ** 0.5
        out["probe"][mode] = {"gap_s": gap, "lengths": list(lengths), "burst_lengths": burst_lengths,
                              "real_ttft_s": real, "sim_ttft_s": fitted, "sim_ttft_none_s": none, "rms_s": rms,
                              "rel_rms": rel}
        if progress:
            under = sum(real) / max(1e-9, sum(none)) - 1
            fit = ", ".join(f"{k} = {v * 1e3:.1f} ms" for k, v in zip(keys, h))
            print(f"  [{time.perf_counter() - t0:5.0f} s] host overhead, {mode}: {len(lengths)} unloaded + "
                  f"{len(burst_lengths)} burst requests, real TTFT {under:+.0%} over the simulator's without it; "
                  f"fitted {fit} (rms error {rel:.1%})", file=sys.stderr, flush=True)
    out["wall_s"] = time.perf_counter() - t0
    return out
