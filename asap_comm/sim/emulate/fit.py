"""The emulation's host overhead and served routing: what the real runtime's processes spend outside the held
stages on this host, and how unevenly the served model's router loads the expert ranks.

An emulated run (``emulator.py``) holds every stage for its modelled time, but
the runtime's own work between stages (its loop, packing rows, puts and
signals, the baseline's shm collectives in Python, process wake-ups on a
shared 2-core host) is not held: it adds real wall time that no modelled
device has. And each emulated expert rank holds for the rows it really
receives from the served model's router (a small random-weight model: on the
validation's probe the slowest of 4 expert processes gets about 1.6x the mean
rows of a batch), while the simulator's routing is balanced unless told.
``simulate_emulated`` leaves both out, so it predicted unloaded TTFTs 10-30%
short and both modes' capacities 36-43% high on afd-plugin's deployment
(``validate --regime emulated``, issue 21).

:func:`fit_host_overhead` measures them on a short **unloaded** probe
(requests far enough apart that they never queue; other requests than the
validation's, up to two chunks) through the real runtime on the emulated
devices, both modes:

* measured, not fitted: ``async_job_s``, the busy time of an ASAP
  attention-rank job outside its holds (the rank's timeline spans, which run
  from a wait's end to the dispatch, minus the seconds its stages held);
  ``expert_job_s``, the same per ASAP expert-rank batch; ``async_skew`` and
  ``sync_skew``, the served router's skew in each mode's probe: over every
  router call, the rows sent to the most loaded expert-holding rank over those
  sent to the mean rank (``EmulatedModel.route`` counts them, in the runtime's
  placement of the served experts on the mode's expert ranks or workers);
* fitted, one number per mode, so the simulator's TTFTs of the probe match the
  real ones in the least-squares sense with the measured values charged:
  ``async_layer_s``, latency added to each ASAP micro-batch's expert round trip
  (wake-ups and polling the spans do not see); ``sync_layer_s``, time added to
  every MoE layer of the baseline's lock-step step (every rank pays it: its shm
  collectives in Python, its loop).

Until 2026-12-03 the ASAP side was one fitted busy time per attention job
(13.7 ms): the measured busy time is about 1 ms, and the rest was the expert
round trip waiting for the hottest expert process. Charged as busy time it
held the attention rank under load, where the real run overlaps it: the
simulator put ASAP's loaded TTFTs up to 25% slow.

``simulate_emulated(..., host_overhead=, expert_skew=)`` charges them (the
overheads divided by the dilation; the skew on ASAP's expert batches and the
baseline's expert stage). Measured and fitted unloaded, checked
loaded: the validation's loads never enter the fit.
"""
from __future__ import annotations

import sys
import tempfile
import time

__all__ = ["fit_host_overhead", "fit_one", "busy_outside_holds", "routing_skew"]

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


def routing_skew(stats) -> float:
    """The served router's skew over a run: summed over every router call of the run's models (``read_stats``'
    ``route_rows_max`` / ``route_rows_mean``, recorded by ``EmulatedModel.route``), the rows sent to the most
    loaded expert-holding rank over those sent to the mean rank; 1.0 when nothing was routed."""
    mx = sum(s.get("route_rows_max", 0.0) for s in stats)
    mean = sum(s.get("route_rows_mean", 0.0) for s in stats)
    return mx / mean if mean > 0 else 1.0


def busy_outside_holds(spans, stats, role: str, prefix: str) -> "tuple[float, int]":
    """(mean seconds per span outside the stages' holds, spans) of one role's processes: the spans on track 0
    whose name starts with ``prefix`` (``"attn"``: an ASAP attention rank's jobs, ``"experts"``: an expert rank's
    batches) minus the seconds the role's models held (``read_stats``' ``held_s``), over the spans; 0 when
    negative (a hold outside the spans: the embedding's)."""
    jobs = [dur for _pe, track, name, _start, dur in spans if track == 0 and name.startswith(prefix)]
    held = sum(s["held_s"] for s in stats if role in s["role"].split("+"))
    if not jobs:
        return 0.0, 0
    return max(0.0, (sum(jobs) - held) / len(jobs)), len(jobs)


def fit_host_overhead(factories: dict, cfgs: dict, info, *, lengths: list, progress: bool = True) -> dict:
    """Run the unloaded probe, measure ASAP's overheads and the served routing's skew, and fit the rest.

    ``factories``/``cfgs``: per mode (``"async"``, ``"sync"``), the run's ``EmulatedFactory`` and ``RuntimeConfig``
    (as the validation runs them); ``info``: the served model's ``ModelInfo``; ``lengths``: the probe's prompt
    lengths (real tokens; at most ``cfg.max_prompt_len``). Requests arrive one at a time, each after the longest
    simulated solo TTFT of the probe (either mode) times 1.5 plus 0.1 s, so none queues. Returns
    ``{"async_job_s", "expert_job_s", "async_layer_s", "sync_layer_s", "async_skew", "sync_skew", "measured": {...},
    "probe": {mode: {"gap_s", "lengths", "real_ttft_s", "sim_ttft_s" (with the overheads), "sim_ttft_none_s"
    (with none, balanced routing), "rms_s"}}, "wall_s"}`` (the module docstring says which are measured and which
    fitted).
    """
    import torch

    from ...serving.runtime import PromptRequest, run_async
    from ...serving.sync import run_sync
    from ...serving.traces import Request
    from .emulator import simulate_emulated
    from .stats import read_stats

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
    out: dict = {"probe": {}}

    def run(mode: str):
        with tempfile.TemporaryDirectory(prefix="asap-fit-") as stats_dir:
            res = (run_async if mode == "async" else run_sync)(factories[mode].with_stats_dir(stats_dir), info, reqs,
                                                               cfgs[mode])
            stats = read_stats(stats_dir)
        by_id = {r.request_id: r for r in res.records}
        bad = [i for i in range(len(trace)) if by_id.get(i) is None or by_id[i].ttft_s is None]
        if bad:
            raise RuntimeError(f"fit_host_overhead: the {mode} probe run failed requests {bad}")
        return res, stats, [by_id[i].ttft_s for i in range(len(trace))]

    # ASAP: busy times and each mode's routing skew measured from its probe; one latency per mode fitted
    runs = {m: run(m) for m in ("async", "sync")}
    res, stats, _real = runs["async"]
    job, n_jobs = busy_outside_holds(res.spans, stats, "attention", "attn")
    ex_job, n_batches = busy_outside_holds(res.spans, stats, "expert", "experts")
    skew = {m: routing_skew(runs[m][1]) for m in runs}
    out["measured"] = {"async_job_s": job, "attention_jobs": n_jobs, "expert_job_s": ex_job,
                       "expert_batches": n_batches, "async_skew": skew["async"], "sync_skew": skew["sync"]}
    out.update(async_job_s=job, expert_job_s=ex_job, async_skew=skew["async"], sync_skew=skew["sync"])
    if progress:
        print(f"  [{time.perf_counter() - t0:5.0f} s] probe: ASAP busy {job * 1e3:.2f} ms per attention job "
              f"({n_jobs}), {ex_job * 1e3:.2f} ms per expert batch ({n_batches}); the served router sends the "
              f"hottest expert rank {skew['async']:.2f}x the mean rows (baseline: {skew['sync']:.2f}x)",
              file=sys.stderr, flush=True)
    for mode, key in (("async", "async_layer_s"), ("sync", "sync_layer_s")):
        real = runs[mode][2]
        fixed = {"async_job_s": job, "expert_job_s": ex_job} if mode == "async" else {}

        def predict(h: float, mode=mode, key=key, fixed=fixed) -> list:
            sim = simulate_emulated(factories[mode], mode, trace, cfgs[mode], host_overhead={**fixed, key: h},
                                    expert_skew=skew[mode])
            s = {r.request_id: r.ttft_s for r in sim.records}
            return [s[i] for i in range(len(trace))]

        h, rms = fit_one(predict, real)
        out[key] = h
        none_by = {r.request_id: r.ttft_s for r in simulate_emulated(factories[mode], mode, trace, cfgs[mode]).records}
        none = [none_by[i] for i in range(len(trace))]
        out["probe"][mode] = {"gap_s": gap, "lengths": list(lengths), "real_ttft_s": real,
                              "sim_ttft_s": predict(h), "sim_ttft_none_s": none, "rms_s": rms}
        if progress:
            under = sum(real) / max(1e-9, sum(none)) - 1
            print(f"  [{time.perf_counter() - t0:5.0f} s] host overhead, {mode}: {len(trace)} unloaded requests, "
                  f"real TTFT {under:+.0%} over the simulator's without it; fitted {key} = {h * 1e3:.1f} ms "
                  f"(rms error {rms * 1e3:.0f} ms)", file=sys.stderr, flush=True)
    out["wall_s"] = time.perf_counter() - t0
    return out
