"""A quick probe of this host against a fitted ``local`` profile (a few seconds), before the profile is trusted.

A matching host fingerprint (CPU model, cores, torch version: ``calibrate.host_fingerprint``) does not say the
host runs at the speed the profile was fitted at: a VM of the same kind may run twice as slow (a noisy
neighbour, a throttled or oversubscribed host). So ``validate`` (and ``calibrate``, which records the reference)
times a couple of the operators the profile was fitted on:

* ``swiglu``: one routed expert's SwiGLU (the model's hidden and expert widths, random float32 weights,
  single-threaded, as a rank runs it) at 16 and 256 rows;
* ``p2p``: an ``asap_comm.moe`` dispatch -> identity expert -> combine round trip of 1 and 256 rows between two
  spawned processes (the shared-memory put path the profile's p2p link was fitted on).

Each is compared with the profile's reference for the same call: the probe's own timing recorded at fit time
(``profile["probe"]``, written by ``calibrate``), else the profile's prediction (``CostModel.expert_s``,
``dispatch_s + combine_s``). :func:`probe_verdict` says whether the host agrees: every ratio measured /
reference within ``[1 / tolerance, tolerance]`` (default 1.3).
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["probe_host", "probe_verdict", "TOLERANCE"]

TOLERANCE = 1.3  # a host slower or faster than this factor against the profile's reference disagrees with it
_SWIGLU_ROWS = (16, 256)
_P2P_ROWS = (1, 256)


def median_time(fn, reps: int, warmup: int = 1) -> float:
    """The median wall time of ``reps`` calls of ``fn`` after ``warmup`` untimed ones (host.py times its
    operators with it too)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _swiglu(hidden: int, inter: int, reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(inter, hidden, generator=g) * 0.02, torch.randn(inter, hidden, generator=g) * 0.02
    w2 = torch.randn(hidden, inter, generator=g) * 0.02
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for n in _SWIGLU_ROWS:
                x = torch.randn(n, hidden, generator=g)

                def call(x=x):
                    h = torch.nn.functional.linear(x, w1)
                    return torch.nn.functional.linear(torch.nn.functional.silu(h) * torch.nn.functional.linear(x, w3),
                                                      w2)
                out[str(n)] = median_time(call, reps)
    finally:
        torch.set_num_threads(threads)
    return out


def _p2p_pe(comm, hidden: int, num_experts: int, top_k: int, rows, reps: int):
    """Two spawned PEs: PE 0 sends, PE 1 returns the rows (identity expert)."""
    from asap_comm.moe import AttentionEnd, ExpertEnd, MoEPlan, apply_experts

    torch.set_num_threads(1)
    plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=num_experts, hidden=hidden,
                   max_tokens=max(rows), top_k=top_k, max_inflight=2)
    if comm.rank == 1:
        ex = ExpertEnd(comm, plan)
        for b in ex:
            ex.combine_send(b, apply_experts(b, lambda e, x: x, out=ex.output_buffer(b)))
        return None
    att = AttentionEnd(comm, plan)
    g = torch.Generator().manual_seed(1)
    res = {}
    for n in rows:
        x = torch.randn(n, hidden, generator=g)
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)])
        w = torch.rand(n, top_k, generator=g)
        res[str(n)] = median_time(lambda: att.combine_recv(att.dispatch_send(x, ids, w, 0), timeout=30), reps)
    att.finish()
    return res


def probe_host(shapes, *, p2p: bool = True, reps: int = 7) -> dict:
    """Time this host's probe operators (seconds per call, by size): ``{"swiglu": {...}, "p2p": {...}}`` and the
    probe's own ``wall_s``. ``shapes``: the ``ModelShapes`` of the model the profile was fitted with."""
    t0 = time.perf_counter()
    out = {"swiglu": _swiglu(shapes.hidden, shapes.moe_inter, reps)}
    if p2p:
        import asap_comm

        res = asap_comm.launch(_p2p_pe, 2, shapes.hidden, shapes.num_experts, shapes.top_k, _P2P_ROWS, reps,
                               timeout=60, comm_timeout=30)
        out["p2p"] = res[0]
    out["wall_s"] = time.perf_counter() - t0
    return out


def _reference(profile, shapes) -> "tuple[dict, str]":
    """The reference timings of the probe's calls: the probe recorded at fit time, else the profile's predictions."""
    rec = profile.data.get("probe")
    if isinstance(rec, dict) and isinstance(rec.get("swiglu"), dict):
        return ({k: v for k, v in rec.items() if k in ("swiglu", "p2p")},
                "the probe recorded when the profile was fitted")
    from ..costmodel.costs import CostModel

    cm = CostModel(profile, shapes)
    return ({"swiglu": {str(n): cm.expert_s(n) for n in _SWIGLU_ROWS},
             "p2p": {str(n): cm.dispatch_s(n) + cm.combine_s(n) for n in _P2P_ROWS}},
            "the profile's predictions (it records no probe)")


def probe_verdict(measured: dict, profile, shapes, tolerance: float = TOLERANCE) -> dict:
    """Compare a :func:`probe_host` result with ``profile``'s reference: per call the ratio measured / reference;
    ``agrees`` when every ratio is within ``[1 / tolerance, tolerance]``; ``reason`` names the worst call."""
    if not tolerance > 1:
        raise ValueError(f"probe_verdict: tolerance={tolerance!r} must be > 1")
    ref, source = _reference(profile, shapes)
    ratios = {}
    for kind, sizes in measured.items():
        if not isinstance(sizes, dict) or kind not in ref:
            continue
        for n, t in sizes.items():
            r = ref[kind].get(n)
            if r and r > 0:
                ratios[f"{kind} {n}"] = t / r
    if not ratios:
        raise ValueError("probe_verdict: the probe and the profile have no call in common")
    worst = max(ratios, key=lambda k: max(ratios[k], 1 / ratios[k]))
    w = ratios[worst]
    agrees = 1 / tolerance <= w <= tolerance
    median = statistics.median(ratios.values())
    reason = None if agrees else (f"{worst}: this host took {w:.2f}x the reference time ({source}); median ratio "
                                  f"{median:.2f}x over {len(ratios)} calls, tolerance {tolerance:g}x")
    return {"agrees": agrees, "ratios": ratios, "median_ratio": median, "worst": worst, "tolerance": tolerance,
            "reference": source, "measured": measured, "reason": reason}
