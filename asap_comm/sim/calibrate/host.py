"""``calibrate``: time the real operators and communication paths on this host and fit the ``local`` profile.

Compute: the model's own stage methods (loaded through the ``asap_comm.models``
plug-in, never imported directly), single-threaded as the runtime's workers run
them, over a grid of sizes; median of a few repetitions. Communication: the
runtime's real paths between spawned processes (``asap_comm.launch``): an
``asap_comm.moe`` dispatch -> ``apply_experts`` (identity expert) -> combine
round trip between one attention and one expert rank, and gloo
``all_to_all_single`` / ``all_reduce`` among 2 and 4 processes.

Fits (see ``costs.py`` for the functional form), each minimising the squared
*relative* error with non-negative coefficients:

* attention: ``per_item_s`` per chunk (the runtime calls ``attention_stage`` once
  per chunk) + ``gemm_flops / rate_gemm + core_flops / rate_core``, both scaled by
  ``(n + n_half) / n``; ``n_half`` picked on a grid; no bytes term.
* router, shared_experts, dense_mlp, expert: ``overhead + max(flops * (n+n_half)/n
  / rate, bytes / bw)``, ``n_half`` and the balance ``rate / bw`` on a grid.
  (For an expert, whose flops are proportional to its rows, ``n_half`` and the
  overhead are not separately identifiable; ties keep the smaller ``n_half``.)
* embed: ``overhead + bytes / bw``. head: ``per_item_s`` per sequence (one
  ``final_norm`` + ``lm_head_logits`` call per finished request, as the runtime).
* p2p (dispatch + combine round trip): ``2 * latency + rows * (dispatch_row_bytes +
  combine_row_bytes) / bw``; the round trip is split evenly, the mailbox
  ``message`` link takes the same figures.
* all_to_all: ``latency + latency_per_rank * (P - 1) + bytes / bw``; all_reduce:
  ``latency + latency_per_rank * (P - 1)``.

Writes ``out_dir/profile_local.json`` (the ``profiles/local.json`` schema) and
``out_dir/calibration.json`` (every raw timing, prediction and relative error).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

from ..costmodel.costs import CostModel
from ..costmodel.hardware import Profile
from ..costmodel.shapes import ModelShapes
from .probe import median_time

__all__ = ["calibrate", "main"]

_NHALF_GRID = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
_BALANCE_GRID = (0.0,) + tuple(2.0 ** k for k in range(-3, 9))  # flops per byte at which memory binds


# ------------------------------------------------------------------------------------------------ timing
def host_fingerprint() -> dict:
    """What a fitted profile depends on: the CPU model, the cores this process may use, and the torch version.

    (The host name is not part of it: a profile carries over between machines of one kind.)
    """
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count()
    import torch

    return {"cpu_model": cpu, "cores": cores, "torch": torch.__version__.split("+")[0]}


def foreign_profile_reason(profile_data: dict) -> "str | None":
    """Why a fitted (host-specific) profile does not describe this host, or None if it does or is not fitted.

    A profile without a recorded fingerprint counts as foreign: nothing says which host it fits.
    """
    fit = profile_data.get("fit")
    if not isinstance(fit, dict):
        return None  # an analytic (cluster) profile: not tied to a host
    here = host_fingerprint()
    there = fit.get("host_fingerprint")
    if not isinstance(there, dict):
        return f"it records no host fingerprint (fitted on {fit.get('host', 'an unknown host')!r}); this host is {here}"
    diff = [f"{k} {there.get(k)!r} there vs {here[k]!r} here" for k in here if there.get(k) != here[k]]
    return None if not diff else "it was fitted on another host: " + ", ".join(diff)


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)


def _time_compute(model, shapes: ModelShapes, grid: dict, reps: int, progress: bool) -> dict:
    """Raw timings per op: {op: [(size, seconds), ...]} with size as the cost model takes it."""
    H = shapes.hidden
    g = torch.Generator().manual_seed(0)
    moe_layer = shapes.first_k_dense_replace if shapes.num_moe_layers else None
    dense_layer = 0 if shapes.first_k_dense_replace > 0 else None
    att_layer = moe_layer if moe_layer is not None else 0
    out: dict = {}

    def rnd(n: int) -> torch.Tensor:
        return torch.randn(n, H, generator=g)

    t0 = time.perf_counter()
    pts = []
    for C in grid["cached"]:
        base = model.new_cache()
        if C:
            model.attention_stage(att_layer, rnd(C), base)
        lc = base.layers[att_layer]
        for T in grid["attention_tokens"]:
            x = rnd(T)

            def call(x=x, lc=lc):
                cache = model.new_cache()
                cache.layers[att_layer].c, cache.layers[att_layer].k_rope = lc.c, lc.k_rope  # a fresh prefix each time
                model.attention_stage(att_layer, x, cache)

            pts.append(((T, C), median_time(call, reps)))
    out["attention"] = pts
    _say(progress, f"attention: {len(pts)} (T, C) points in {time.perf_counter() - t0:.1f} s")

    def sweep(op: str, sizes, make: Callable[[int], Callable[[], object]]) -> None:
        t = time.perf_counter()
        out[op] = [(n, median_time(make(n), reps)) for n in sizes]
        _say(progress, f"{op}: {len(sizes)} sizes in {time.perf_counter() - t:.1f} s")

    if moe_layer is not None:
        sweep("router", grid["tokens"], lambda n: (lambda x=rnd(n): model.route(moe_layer, x)))
        if shapes.n_shared:
            sweep("shared_experts", grid["tokens"], lambda n: (lambda x=rnd(n): model.shared_experts(moe_layer, x)))
        sweep("expert", grid["rows"], lambda n: (lambda x=rnd(n): model.expert(moe_layer, 0, x)))
    if dense_layer is not None:
        sweep("dense_mlp", grid["tokens"], lambda n: (lambda x=rnd(n): model.dense_mlp(dense_layer, x)))
    sweep("embed", grid["tokens"],
          lambda n: (lambda ids=torch.randint(0, shapes.vocab, (n,), generator=g): model.embed(ids)))
    sweep("head", (1,), lambda n: (lambda x=rnd(1): model.lm_head_logits(model.final_norm(x))))
    return out


# ------------------------------------------------------------------------------------------------ comm (spawned)
def _comm_pe(comm, hidden: int, num_experts: int, top_k: int, row_counts, reps: int, port: int, a2a_rows,
             coll_reps: int):
    """Runs in each of 4 spawned PEs: MoE round trip on PEs 0 (attention) / 1 (expert); then gloo collectives."""
    import torch.distributed as dist

    from asap_comm.moe import AttentionEnd, ExpertEnd, MoEPlan, apply_experts, join_as_bystander

    torch.set_num_threads(1)
    from asap_comm.rendezvous import gloo_group

    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=60))
    gloo_group(store, comm.secret_token("calib-gloo"), comm.rank, comm.world_size, 60.0, loopback=True)
    result: dict = {}
    try:
        pair = dist.new_group([0, 1])
        plan = MoEPlan(num_attention_ranks=1, num_expert_ranks=1, num_experts=num_experts, hidden=hidden,
                       max_tokens=max(row_counts), top_k=top_k, max_inflight=2)
        if comm.rank == 0:
            att = AttentionEnd(comm, plan)
            g = torch.Generator().manual_seed(1)
            rt = []
            for n in row_counts:
                x = torch.randn(n, hidden, generator=g)
                ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)])
                w = torch.rand(n, top_k, generator=g)
                ts = []
                for i in range(reps + 2):
                    t = time.perf_counter()
                    att.combine_recv(att.dispatch_send(x, ids, w, 0), timeout=60)
                    if i >= 2:  # two warm-ups
                        ts.append(time.perf_counter() - t)
                rt.append((n, statistics.median(ts)))
            att.finish()
            result["p2p_round_trip"] = rt
        elif comm.rank == 1:
            ex = ExpertEnd(comm, plan)
            for b in ex:
                ex.combine_send(b, apply_experts(b, lambda e, x: x, out=ex.output_buffer(b)))
        else:
            join_as_bystander(comm, plan)
        dist.barrier()

        def coll(group, P: int) -> dict:
            res: dict = {"all_to_all": [], "all_reduce": None}
            for rows in a2a_rows:
                width = hidden * 4 + 8 * top_k  # a packed float32 row, as the sync baseline sends
                per = (rows // P) * width
                send = torch.zeros(per * P, dtype=torch.uint8)
                recv = torch.empty(per * P, dtype=torch.uint8)
                ts = []
                for i in range(coll_reps + 1):
                    dist.barrier(group=group)
                    t = time.perf_counter()
                    dist.all_to_all_single(recv, send, group=group)
                    if i:
                        ts.append(time.perf_counter() - t)
                res["all_to_all"].append((rows, statistics.median(ts)))
            flags = torch.zeros(2, dtype=torch.int64)
            ts = []
            for i in range(coll_reps + 1):
                dist.barrier(group=group)
                t = time.perf_counter()
                dist.all_reduce(flags, group=group)
                if i:
                    ts.append(time.perf_counter() - t)
            res["all_reduce"] = statistics.median(ts)
            return res

        all4 = coll(None, comm.world_size)
        if comm.rank in (0, 1):
            two = coll(pair, 2)
            if comm.rank == 0:
                result["collectives"] = {str(comm.world_size): all4, "2": two}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return result


def _time_comm(shapes: ModelShapes, quick: bool, progress: bool) -> dict:
    import asap_comm

    t = time.perf_counter()
    row_counts = (1, 64, 512) if quick else (1, 16, 64, 256, 1024)
    a2a_rows = (4, 256) if quick else (4, 64, 256, 1024)
    store = asap_comm.rendezvous.loopback_store(60.0)
    try:
        res = asap_comm.launch(_comm_pe, 4, shapes.hidden, shapes.num_experts, shapes.top_k, row_counts,
                               5 if quick else 40, store.port, a2a_rows, 3 if quick else 20,
                               timeout=120, comm_timeout=60)
    finally:
        del store
    _say(progress, f"communication (moe round trip, gloo all_to_all/all_reduce at 2 and 4 ranks) in "
                   f"{time.perf_counter() - t:.1f} s")
    return res[0]


# ------------------------------------------------------------------------------------------------ fitting
def _nnls(X: list, y: list) -> tuple[list, float]:
    """min sum((X c - y)/y)^2 subject to c >= 0 (exhaustive over active sets: a few columns only)."""
    k = len(X[0])
    A = torch.tensor([[v / yi for v in row] for row, yi in zip(X, y)], dtype=torch.float64)
    b = torch.ones(len(y), dtype=torch.float64)
    best, best_err = [0.0] * k, float(b.pow(2).sum())
    for mask in range(1, 1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = torch.linalg.lstsq(A[:, cols], b[:, None]).solution[:, 0]
        if (sol < 0).any() or not torch.isfinite(sol).all():
            continue
        c = [0.0] * k
        for j, v in zip(cols, sol.tolist()):
            c[j] = v
        err = float((A @ torch.tensor(c, dtype=torch.float64) - b).pow(2).sum())
        if err < best_err * (1 - 1e-9):
            best, best_err = c, err
    return best, best_err


def _rate(s: float):
    return 1.0 / s if s > 0 else None


def _fit_roofline(points: list) -> dict:
    """points: (n, flops, bytes, seconds) -> op entry overhead + max(flops*(n+nh)/n*s, bytes*rho*s)."""
    best = None
    for nh in _NHALF_GRID:
        for rho in _BALANCE_GRID:
            X = [[1.0, max(f * (n + nh) / n, rho * by)] for n, f, by, _t in points]
            c, err = _nnls(X, [p[3] for p in points])
            if best is None or err < best[0] * (1 - 1e-9):
                best = (err, nh, rho, c)
    _err, nh, rho, (o, s) = best
    return {"overhead_s": o, "flops_per_s": {"gemm": _rate(s)}, "bytes_per_s": _rate(rho * s) if rho else None,
            "n_half": nh}


def _fit_attention(points: list) -> dict:
    """points: (n, gemm, core, seconds), one chunk each -> per_item_s + (gemm*s_g + core*s_c)*(n+nh)/n."""
    best = None
    for nh in _NHALF_GRID:
        X = [[1.0, g * (n + nh) / n, c * (n + nh) / n] for n, g, c, _t in points]
        coef, err = _nnls(X, [p[3] for p in points])
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, nh, coef)
    _err, nh, (item, sg, sc) = best
    return {"overhead_s": 0.0, "per_item_s": item, "flops_per_s": {"gemm": _rate(sg), "core": _rate(sc)},
            "bytes_per_s": None, "n_half": nh}


def _host_memory() -> dict:
    """The local profile's ``memory`` block (``asap_comm.sim.costmodel.memory``): half of this host's RAM per rank, as the
    committed profile has it (small local runs always fit; a DeepSeek-V3 deployment on CPU ranks is refused)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        ram = 16.0
    return {"hbm_gb": max(1, round(ram / 2)), "usable_fraction": 1.0,
            "source": f"this host: {ram:.0f} GB of RAM shared by its processes; half of it is what one rank of a "
                      "small local run may take (written by asap_comm.sim.calibrate.host)"}


def _fit_affine(xs: list, ys: list) -> tuple[float, float]:
    (a, b), _ = _nnls([[1.0, x] for x in xs], ys)
    return a, b


# ------------------------------------------------------------------------------------------------ main entry
def calibrate(out_dir, model: str = "small", *, quick: bool = False, progress: bool = True,
              runtime: bool = True) -> Profile:
    """Time this host, fit the cost model, write ``profile_local.json`` and ``calibration.json`` to ``out_dir``."""
    from ...serving.plugins import load_model_factory

    t_start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    factory = load_model_factory(model, seed=0)
    shapes = ModelShapes.from_hf_config(factory.config().to_hf_dict(), name=model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _say(progress, f"model {model!r}: building; timing compute single-threaded ({'quick' if quick else 'full'})")
        with torch.inference_mode():
            m = factory.full()
            if quick:
                grid = {"attention_tokens": (16, 128, 512), "cached": (0, 512), "tokens": (1, 32, 256, 1024),
                        "rows": (1, 16, 256, 1024)}
                reps = 3
            else:
                grid = {"attention_tokens": (16, 64, 128, 256, 512, 1024), "cached": (0, 256, 1024),
                        "tokens": (1, 8, 32, 128, 512, 2048), "rows": (1, 4, 16, 64, 256, 1024)}
                reps = 11
            raw = _time_compute(m, shapes, grid, reps, progress)
            del m
    finally:
        torch.set_num_threads(threads)
    comm = _time_comm(shapes, quick, progress)

    # ---- fit compute ops (work from the cost model itself, with float32 bytes)
    stub = _stub_profile(shapes)
    cm0 = CostModel(stub, shapes)
    ops: dict = {}
    att_pts = []
    for (T, C), t in raw["attention"]:
        tokens, flops, nbytes = cm0.attention_work([(T, C)])
        att_pts.append((tokens, flops["gemm"], flops["core"], t))
    ops["attention"] = _fit_attention(att_pts)
    H = shapes.hidden
    work = {
        "router": lambda k: (2.0 * k * H * shapes.num_experts, shapes.num_experts * H * 4 + k * H * 4),
        "shared_experts": lambda k: (2.0 * k * cm0.shared_params, cm0.shared_params * 4 + 2.0 * k * H * 4),
        "dense_mlp": lambda k: (2.0 * k * cm0.dense_params, cm0.dense_params * 4 + 2.0 * k * H * 4),
        "expert": lambda k: (2.0 * k * cm0.expert_params, cm0.expert_params * 4 + 2.0 * k * H * 4),
    }
    for op, f in work.items():
        if op in raw:
            ops[op] = _fit_roofline([(k, *f(k), t) for k, t in raw[op]])
    if "dense_mlp" not in ops:  # no dense layer in this model: scale nothing, reuse the shared SwiGLU's fit
        ops["dense_mlp"] = dict(ops.get("shared_experts") or ops["expert"])
    if "shared_experts" not in ops:
        ops["shared_experts"] = dict(ops["expert"])
    o, s = _fit_affine([k * H * 8.0 for k, _ in raw["embed"]], [t for _, t in raw["embed"]])
    ops["embed"] = {"overhead_s": o, "flops_per_s": {}, "bytes_per_s": _rate(s), "n_half": 0}
    ops["head"] = {"overhead_s": 0.0, "per_item_s": raw["head"][0][1], "flops_per_s": {"gemm": None},
                   "bytes_per_s": None, "n_half": 0}
    ops["experts_batch"] = {"overhead_s": 0.0, "source": "the per-batch cost of apply_experts is in links.p2p "
                                                          "(measured through apply_experts)"}
    for op in ops:
        ops[op].setdefault("source", "fitted by asap_comm.sim.calibrate.host on this host")

    # ---- fit communication
    rt = comm["p2p_round_trip"]
    per_row_bytes = cm0.dispatch_row_bytes + cm0.combine_row_bytes
    o, s = _fit_affine([r * per_row_bytes for r, _ in rt], [t for _, t in rt])
    p2p = {"latency_s": o / 2, "bytes_per_s": _rate(s), "per_row_s": 0.0,
           "source": "fitted: asap_comm.moe dispatch_send -> apply_experts (identity) -> combine_send -> combine_recv "
                     "round trip, 1 attention + 1 expert rank, split evenly into dispatch and combine"}
    coll = comm["collectives"]
    X, y = [], []
    for P, res in coll.items():
        for rows, t in res["all_to_all"]:
            X.append([1.0, int(P) - 1.0, rows * cm0.dispatch_row_bytes])
            y.append(t)
    (lat, per_rank, sb), _ = _nnls(X, y)
    Ps = sorted(int(P) for P in coll)
    ar_lat, ar_rank = _fit_affine([P - 1.0 for P in Ps], [coll[str(P)]["all_reduce"] for P in Ps])
    links = {
        "p2p": p2p,
        "message": {"latency_s": p2p["latency_s"], "bytes_per_s": p2p["bytes_per_s"],
                    "source": "same shared-memory mailbox path as dispatch descriptors: the p2p fit"},
        "collective": {"latency_s": lat, "latency_per_rank_s": per_rank, "bytes_per_s": _rate(sb),
                       "ranks_per_node": None, "source": "fitted: gloo all_to_all_single of packed rows at 2 and 4 "
                                                         "processes"},
        "all_reduce": {"latency_s": ar_lat, "latency_per_rank_s": ar_rank,
                       "source": "fitted: gloo all_reduce of 2 int64 at 2 and 4 processes"},
    }
    data = {
        "name": "local",
        "description": f"fitted on {platform.node() or 'this host'} ({platform.processor() or platform.machine()}) "
                       f"by asap_comm.sim.calibrate.host with the {model!r} model, float32, one thread per rank",
        "rank": "one single-threaded process of this host (all ranks share its cores: processor sharing)",
        "cores": os.cpu_count(),
        "hardware": {},
        "memory": _host_memory(),
        "dtype": {"weight_bytes": 4, "activation_bytes": 4, "dispatch_bytes": 4, "combine_bytes": 4,
                  "source": "the reference model runs in float32 on CPU"},
        "ops": ops,
        "links": links,
    }
    path = out / "profile_local.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    profile = Profile(data, str(path))
    cm = CostModel(profile, shapes)

    # ---- predictions and errors per point
    points: dict = {}

    def add(op: str, size, t: float, pred: float) -> None:
        points.setdefault(op, []).append({"size": size, "seconds": t, "predicted": pred,
                                          "rel_error": (pred - t) / t if t > 0 else None})

    for (T, C), t in raw["attention"]:
        add("attention", [T, C], t, cm.attention_s([(T, C)]))
    pred = {"router": cm.router_s, "shared_experts": cm.shared_experts_s, "dense_mlp": cm.dense_mlp_s,
            "expert": cm.expert_s, "embed": cm.embed_s, "head": cm.head_s}
    for op, f in pred.items():
        for k, t in raw.get(op, []):
            add(op, k, t, f(k))
    for r, t in rt:
        add("p2p_round_trip", r, t, cm.dispatch_s(r) + cm.combine_s(r))
    for P, res in coll.items():
        for rows, t in res["all_to_all"]:
            add("all_to_all", [rows, int(P)], t, cm.all_to_all_s(rows, int(P)))
        add("all_reduce", int(P), res["all_reduce"], cm.all_reduce_s(int(P)))
    summary = {}
    for op, pts in points.items():
        errs = [abs(p["rel_error"]) for p in pts if p["rel_error"] is not None]
        summary[op] = {"points": len(pts), "median_abs_rel_error": statistics.median(errs) if errs else None,
                       "max_abs_rel_error": max(errs) if errs else None}
    all_errs = [abs(p["rel_error"]) for pts in points.values() for p in pts if p["rel_error"] is not None]
    elapsed = time.perf_counter() - t_start
    fit = {"model": model, "quick": quick, "seconds": elapsed, "host": platform.node(), "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "host_fingerprint": host_fingerprint(),
           "median_abs_rel_error": statistics.median(all_errs), "per_op": summary}
    data["fit"] = fit
    path.write_text(json.dumps(data, indent=2) + "\n")
    from .probe import probe_host  # the reference of validate's host probe, timed now beside the fit

    data["probe"] = probe_host(shapes)
    path.write_text(json.dumps(data, indent=2) + "\n")
    if runtime:  # the operators as the runtime runs them (asap_comm.sim.calibrate.insitu)
        from .insitu import fit_runtime_factors

        data["runtime"] = fit_runtime_factors(model, Profile(data, str(path)), shapes, quick=quick, progress=progress)
        path.write_text(json.dumps(data, indent=2) + "\n")
        fit["seconds"] = time.perf_counter() - t_start
    (out / "calibration.json").write_text(json.dumps(
        {"fit": fit, "grid": grid, "points": points, "coefficients": cm.describe()}, indent=2) + "\n")
    for op, s in summary.items():
        _say(progress, f"fit {op}: median |rel err| {s['median_abs_rel_error']:.1%}, max {s['max_abs_rel_error']:.1%}")
    _say(progress, f"done in {elapsed:.1f} s: {path}")
    return Profile(data, str(path))


def _stub_profile(shapes: ModelShapes) -> Profile:
    """A placeholder float32 profile: only to reach CostModel's work formulas during the fit."""
    op = {"overhead_s": 0.0, "flops_per_s": {"gemm": 1.0, "core": 1.0}, "bytes_per_s": 1.0}
    link = {"latency_s": 0.0, "latency_per_rank_s": 0.0, "bytes_per_s": 1.0}
    return Profile({"name": "stub", "dtype": {"weight_bytes": 4, "activation_bytes": 4, "dispatch_bytes": 4,
                                              "combine_bytes": 4},
                    "ops": {**{k: dict(op) for k in ("attention", "router", "shared_experts", "dense_mlp", "embed",
                                                     "head", "expert")}, "experts_batch": {"overhead_s": 0.0}},
                    "links": {"p2p": link, "message": link, "collective": link, "all_reduce": link}})


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m asap_comm.sim calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--model", default="small", help="model preset or checkpoint directory (default: small)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (~30 s)")
    ap.add_argument("--no-runtime", action="store_true",
                    help="skip the in-situ runtime factors (real runtime runs of a calibration workload)")
    a = ap.parse_args(argv)
    calibrate(a.out, a.model, quick=a.quick, runtime=not a.no_runtime)
    return 0


if __name__ == "__main__":
    sys.exit(main())
