"""The emulation's host overhead: what the real runtime's processes spend outside the held stages, on this host.

An emulated run (``emulate.py``) holds every stage for its modelled time, but
the runtime's own work between stages (its loop, packing rows, puts and
signals, the baseline's shm collectives in Python, process wake-ups on a
shared 2-core host) is not held: it adds real wall time that no modelled
device has. ``simulate_emulated`` leaves it out, so it predicted unloaded
TTFTs 10-30% short and both modes' capacities 36-43% high on afd-plugin's
deployment (``validate --regime emulated``, issue 21).

:func:`fit_host_overhead` measures it the way ``calibrate`` fits its in-situ
factors: a short **unloaded** probe (requests far enough apart that they never
queue; other requests than the validation's, up to two chunks)
through the real runtime on the emulated devices, both modes, then one
number per mode, in wall seconds, chosen so the simulator's TTFTs of the same
requests match the real ones in the least-squares sense:

* ``async_job_s``: busy time of every ASAP attention-rank job (a layer segment
  up to its dispatch, or the tail): the attention process is single-threaded,
  so while it packs and puts one micro-batch the other waits;
* ``sync_layer_s``: time added to every MoE layer of the baseline's lock-step
  step (every rank pays it).

``simulate_emulated(..., host_overhead=)`` charges them (divided by the
dilation). Fitted unloaded and checked loaded: the validation's loads never
enter the fit.
"""
from __future__ import annotations

import sys
import time

__all__ = ["fit_host_overhead", "fit_one"]

# wall seconds per job / per MoE layer searched (a tiny served model on a 2-core host: a few ms to tens of ms)
_GRID_MAX_S = 0.1
_GRID_STEPS = 200


def fit_one(predict, real: list) -> "tuple[float, float]":
    """The overhead ``h`` in ``[0, 0.1]`` s minimizing ``sum((predict(h)[i] - real[i]) ** 2)``, and that sum's
    root mean square: a grid of 0.5-ms steps, then a golden-section refinement around the best point.
    ``predict(h)`` returns the simulated TTFTs in the order of ``real``."""
    def sse(h: float) -> float:
        return sum((p - r) ** 2 for p, r in zip(predict(h), real))

    step = _GRID_MAX_S / _GRID_STEPS
    grid = [i * step for i in range(_GRID_STEPS + 1)]
    errs = [sse(h) for h in grid]
    i = min(range(len(grid)), key=errs.__getitem__)
    lo, hi = max(0.0, grid[i] - step), min(_GRID_MAX_S, grid[i] + step)
    g = (5 ** 0.5 - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = sse(a), sse(b)
    for _ in range(20):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = sse(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = sse(b)
    best = min([(errs[i], grid[i]), (fa, a), (fb, b)])
    return best[1], (best[0] / max(1, len(real))) ** 0.5


def fit_host_overhead(factories: dict, cfgs: dict, info, *, lengths: list, progress: bool = True) -> dict:
    """Run the unloaded probe and fit the host overhead of each mode.

    ``factories``/``cfgs``: per mode (``"async"``, ``"sync"``), the run's ``EmulatedFactory`` and ``RuntimeConfig``
    (as the validation runs them); ``info``: the served model's ``ModelInfo``; ``lengths``: the probe's prompt
    lengths (real tokens; at most ``cfg.max_prompt_len``). Requests arrive one at a time, each after the longest
    simulated solo TTFT of the probe (either mode) times 1.5 plus 0.1 s, so none queues. Returns
    ``{"async_job_s", "sync_layer_s", "probe": {mode: {"gap_s", "lengths", "real_ttft_s", "sim_ttft_s" (with
    the overhead), "sim_ttft_none_s" (without), "rms_s"}}, "wall_s"}``.
    """
    import torch

    from ..serving.runtime import PromptRequest, run_async
    from ..serving.sync import run_sync
    from ..serving.traces import Request
    from .emulate import simulate_emulated

    if set(factories) != {"async", "sync"} or set(cfgs) != {"async", "sync"}:
        raise ValueError(f"fit_host_overhead: factories and cfgs need 'async' and 'sync', got {sorted(factories)} "
                         f"and {sorted(cfgs)}")
    if len(lengths) < 2 or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"fit_host_overhead: lengths={lengths!r} must be at least 2 ints >= 1")
    t0 = time.perf_counter()
    solo = max(simulate_emulated(factories[m], m, [Request(0, 0.0, max(lengths))], cfgs[m]).records[0].ttft_s
               for m in ("async", "sync"))
    gap = 1.5 * solo + 0.1
    trace = [Request(i, i * gap, n) for i, n in enumerate(lengths)]
    g = torch.Generator().manual_seed(12345)
    reqs = [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (r.prompt_len,), generator=g))
            for r in trace]
    key = {"async": "async_job_s", "sync": "sync_layer_s"}
    out: dict = {"probe": {}}
    for mode in ("async", "sync"):
        res = (run_async if mode == "async" else run_sync)(factories[mode], info, reqs, cfgs[mode])
        by_id = {r.request_id: r for r in res.records}
        bad = [i for i in range(len(trace)) if by_id.get(i) is None or by_id[i].ttft_s is None]
        if bad:
            raise RuntimeError(f"fit_host_overhead: the {mode} probe run failed requests {bad}")
        real = [by_id[i].ttft_s for i in range(len(trace))]

        def predict(h: float, mode=mode) -> list:
            sim = simulate_emulated(factories[mode], mode, trace, cfgs[mode], host_overhead={key[mode]: h})
            s = {r.request_id: r.ttft_s for r in sim.records}
            return [s[i] for i in range(len(trace))]

        h, rms = fit_one(predict, real)
        out[key[mode]] = h
        fitted, none = predict(h), predict(0.0)
        out["probe"][mode] = {"gap_s": gap, "lengths": list(lengths), "real_ttft_s": real,
                              "sim_ttft_s": fitted, "sim_ttft_none_s": none, "rms_s": rms}
        if progress:
            under = sum(real) / max(1e-9, sum(none)) - 1
            print(f"  [{time.perf_counter() - t0:5.0f} s] host overhead, {mode}: {len(trace)} unloaded requests, "
                  f"real TTFT {under:+.0%} over the simulator's without it; fitted {key[mode]} = {h * 1e3:.1f} ms "
                  f"(rms error {rms * 1e3:.0f} ms)", file=sys.stderr, flush=True)
    out["wall_s"] = time.perf_counter() - t0
    return out
