"""In-situ runtime factors of the ``local`` profile: the operators as the runtime really runs them.

Operator timings taken in a tight loop (``calibrate``) see warm caches and a
quiet machine. Inside the runtime the same operators run with cold weights
(every layer and expert in turn), beside other busy processes, and every MoE
layer adds process wake-ups and loop overhead. So ``calibrate`` also serves a
short calibration workload through the real runtime, both modes, **unloaded**
(requests far enough apart that they never queue), and fits:

* ``async_attention``, ``async_expert``, ``sync_compute``: total busy time of
  the real workers' timeline spans over the simulator's predicted busy time
  of the same requests (one multiplier per kind of work; for the baseline the
  prediction includes the core sharing of ranks polling in collectives);
* ``async_layer_overhead_s``: the median remaining gap between the real and
  the simulated TTFT, per MoE layer, after those multipliers (a latency:
  wake-ups, polling, Python between operators);
* the baseline's busy spans include the time its ranks lose to each other's
  polling, so ``sync_compute`` and ``sync_layer_overhead_s`` are instead fitted
  by least squares on the TTFTs: real TTFT = ``sync_compute`` x simulated
  compute time + simulated collective time + ``sync_layer_overhead_s`` x MoE
  layers, for each ``sync_poll_weight`` in 0, 0.25, ..., 1 (the core share a
  rank polling in a collective takes); the best fit wins. Pairs of requests
  that arrive together (two ranks computing at once) make it identifiable.

The validation traces are different (and loaded: queueing, batching, stalls),
so ``validate`` still tests what the simulator predicts beyond these numbers.
"""
from __future__ import annotations

import statistics
import sys

from ...serving.runtime import PromptRequest, RuntimeConfig, run_async
from ...serving.traces import Request
from ..core.simulate import simulate
from ..costmodel.costs import CostModel
from ..costmodel.hardware import RUNTIME_FACTORS, Profile
from ..costmodel.shapes import ModelShapes

__all__ = ["fit_runtime_factors"]

_COMPUTE = ("attn", "route+pack", "experts", "tail")  # run_sync's compute spans (the rest wait in collectives)


def _with(profile: Profile, shapes: ModelShapes, runtime: dict) -> CostModel:
    data = dict(profile.data)
    data["runtime"] = dict(runtime)
    return CostModel(Profile(data, profile.path), shapes)


def _fit_scale_offset(xs: list, ys: list) -> tuple[float, float]:
    """Least squares ``y = k x + o`` with ``k, o >= 0``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else (my / mx if mx > 0 else 1.0)
    k = max(k, 0.0)
    o = my - k * mx
    if o < 0:  # through the origin
        o = 0.0
        sxy, sxx0 = sum(x * y for x, y in zip(xs, ys)), sum(x * x for x in xs)
        k = max(0.0, sxy / sxx0) if sxx0 > 0 else 1.0
    return k, o


def fit_runtime_factors(model: str, profile: Profile, shapes: ModelShapes, *, quick: bool = False,
                        progress: bool = True) -> dict:
    """Serve the calibration workload for real (async and sync) and fit the factors above."""
    import torch

    from ...serving.plugins import load_model_factory, model_info_of
    from ...serving.sync import run_sync

    factory = load_model_factory(model, seed=0)
    info = model_info_of(factory)
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=256, chunk_len=256,
                        max_prompt_len=512, placer_linear_weight=CostModel(profile, shapes).placer_linear_weight())
    # single requests, then pairs arriving together (two ranks computing at once in the baseline)
    lengths = [32, 160, 96, (64, 200)] if quick else [32, 160, 64, 256, 96, 128, 48, 200, (64, 200), (128, 256),
                                                      (32, 96)]
    gap = 0.45  # s between arrivals: well above one prefill, so nothing queues
    trace = []
    for i, n in enumerate(lengths):
        for m in (n if isinstance(n, tuple) else (n,)):
            trace.append(Request(len(trace), gap * i, m))
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, info.vocab_size, (r.prompt_len,), generator=g))
            for r in trace]
    A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
    n_moe = sum(1 for m in shapes.moe_layers if m)
    fit: dict = {}
    rt = dict(RUNTIME_FACTORS)
    for mode, run in (("async", run_async), ("sync", run_sync)):
        if progress:
            print(f"[calibrate] in-situ: {len(reqs)} unloaded requests through the real {mode} runtime",
                  file=sys.stderr, flush=True)
        real = run(factory, info, reqs, cfg)
        failed = [r for r in real.records if not r.ok]
        if failed:
            raise RuntimeError(f"fit_runtime_factors: the {mode} calibration run failed: {failed[0].error}")
        neutral = simulate(mode, trace, _with(profile, shapes, rt), shapes, cfg)
        if mode == "async":
            real_att = sum(d for pe, _, _, _, d in real.spans if pe < A)
            real_exp = sum(d for pe, _, _, _, d in real.spans if A <= pe < A + E)
            sim_att = sum(r["busy_s"] for r in neutral.ranks if r["role"] == "attention")
            sim_exp = sum(r["busy_s"] * r["stands_for"] for r in neutral.ranks if r["role"] == "expert")
            rt["async_attention"], rt["async_expert"] = real_att / sim_att, real_exp / sim_exp
            key = "async_layer_overhead_s"
            fit["async"] = {"real_attention_busy_s": real_att, "sim_attention_busy_s": sim_att,
                            "real_expert_busy_s": real_exp, "sim_expert_busy_s": sim_exp}
        else:
            # TTFT_i = k * compute_i + fixed_i + n_moe * overhead: compute_i and fixed_i from the simulator
            # (fixed = the simulated TTFT with no compute: collectives, messages, heartbeats), fitted by
            # least squares with both unknowns >= 0
            best = None
            for poll in (0.0, 0.25, 0.5, 0.75, 1.0):  # the polling share: the one that explains TTFTs best
                trial = {**rt, "sync_poll_weight": poll}
                neutral = simulate(mode, trace, _with(profile, shapes, trial), shapes, cfg)
                fixed = simulate(mode, trace, _with(profile, shapes, {**trial, "sync_compute": 0.0}), shapes, cfg)
                xs = [n.ttft_s - f.ttft_s for n, f in zip(neutral.records, fixed.records)]
                ys = [r.ttft_s - f.ttft_s for r, f in zip(real.records, fixed.records)]
                k, o = _fit_scale_offset(xs, ys)
                sse = sum((k * x + o - y) ** 2 for x, y in zip(xs, ys))
                if best is None or sse < best[0]:
                    best = (sse, poll, k, o)
            _, poll, k, o = best
            rt["sync_poll_weight"], rt["sync_compute"], rt["sync_layer_overhead_s"] = poll, k, o / n_moe
            real_c = sum(d for _, _, name, _, d in real.spans if name.split(" L")[0].split(" (")[0] in _COMPUTE)
            fit["sync"] = {"real_compute_busy_s": real_c, "sim_compute_busy_s": sum(r["busy_s"] for r in neutral.ranks),
                           "method": "TTFT regression"}
            final = simulate(mode, trace, _with(profile, shapes, rt), shapes, cfg)
            fit[mode].update(real_ttft_s=[r.ttft_s for r in real.records],
                             sim_ttft_s=[s.ttft_s for s in final.records])
            if progress:
                print(f"[calibrate] {mode}: sync_compute {k:.3g}, sync_layer_overhead_s {o / n_moe:.3g}, "
                      f"sync_poll_weight {poll:g}",
                      file=sys.stderr, flush=True)
            continue
        scaled = simulate(mode, trace, _with(profile, shapes, rt), shapes, cfg)
        gaps = [r.ttft_s - s.ttft_s for r, s in zip(real.records, scaled.records)]
        rt[key] = max(0.0, statistics.median(gaps) / n_moe)
        final = simulate(mode, trace, _with(profile, shapes, rt), shapes, cfg)
        fit[mode].update(real_ttft_s=[r.ttft_s for r in real.records],
                         sim_ttft_s=[s.ttft_s for s in final.records])
        if progress:
            print(f"[calibrate] {mode}: " + ", ".join(f"{k} {v:.3g}" for k, v in rt.items() if k.startswith(mode)),
                  file=sys.stderr, flush=True)
    return {**rt, "source": "fitted by asap_comm.sim.calibrate.insitu: real runtime spans and TTFTs of an unloaded "
                            f"calibration workload ({len(trace)} requests: {lengths} tokens, pairs arrive together; A=2, E=2)",
            "fit": fit}
