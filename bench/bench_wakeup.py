"""The shared-memory wake-up path: latency of a waiter that is woken, and the CPU an idle waiter burns.

Rows (two PEs on this host, ``asap_comm.launch``):

* ``mailbox_rt_unpinned`` / ``mailbox_rt_pinned``: the 64-byte mailbox round trip as a new user writes it
  (PE 0 ``box.send`` -> PE 1 ``box.recv`` -> ``box.send`` back -> ``release``; PE 0 ``recv``, ``release``),
  each round trip timed on its own; the processes left where the OS puts them, or pinned to their own CPUs.
* ``pingpong_generic_unpinned`` / ``pingpong_generic_pinned``: the 8-byte ``comm.put_signal`` /
  ``comm.signal_wait_until`` ping-pong, one way (half a round trip): how fast this VM is right now.
* ``mailbox_rt_think_<us>``: the round trip when PE 1 works ``<us>`` microseconds (a busy loop) before it
  answers, with PE 0's CPU seconds per round trip: a waiter whose messages arrive after its spin budget.
* ``idle_recv_cpu``: CPU time (``time.thread_time``) PE 0's thread uses in a ``box.recv`` that waits
  ``--idle-s`` seconds for a message that comes only then: an idle waiter must sleep, not spin.

Usage: ``python bench/bench_wakeup.py [--iters 20000] [--rounds 3] [--json out.json]``. Each round runs every
row once (rows interleaved, so slow phases of a noisy host hit all of them); samples are pooled over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import asap_comm
from _common import pinned


def _quantiles(xs: list) -> dict:
    xs = sorted(xs)
    n = len(xs)
    return {"median": xs[n // 2], "p10": xs[n // 10], "p90": xs[(9 * n) // 10], "mean": statistics.fmean(xs), "n": n}


def _maybe_pinned(rank: int, pin: bool):
    if pin:
        return pinned(rank)
    import contextlib

    return contextlib.nullcontext()


def _spin_us(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def mailbox_pe(comm, iters: int, warmup: int, pin: bool, think_us: float) -> dict:
    """PE 0: per-round-trip ns and the CPU ns of its thread over the timed loop."""
    box = comm.mailbox(64, 64)
    tx = torch.zeros(8, dtype=torch.int64)
    out = []
    with _maybe_pinned(comm.rank, pin):
        comm.barrier()
        if comm.rank == 0:
            bad = 0
            cpu0 = time.thread_time_ns()
            for i in range(warmup + iters):
                tx[0] = i
                t0 = time.perf_counter_ns()
                box.send(1, tx, i)
                m = box.recv()
                ok = m.tag == i
                m.release()
                t1 = time.perf_counter_ns()
                bad += not ok
                if i == warmup - 1:
                    cpu0 = time.thread_time_ns()
                if i >= warmup:
                    out.append(t1 - t0)
            cpu = time.thread_time_ns() - cpu0
        else:
            for _ in range(warmup + iters):
                m = box.recv()
                if think_us:
                    _spin_us(think_us)
                box.send(0, m.tensor, m.tag)
                m.release()
        comm.barrier()
    if comm.rank == 0:
        return {"samples_ns": out, "bad": bad, "cpu_ns": cpu}
    return {}


def pingpong_pe(comm, iters: int, warmup: int, pin: bool) -> dict:
    """PE 0: per-round-trip ns of the generic put_signal ping-pong."""
    rx = comm.zeros((1,), torch.int64)
    tx = torch.zeros(1, dtype=torch.int64)
    sig = comm.signals(1)
    peer = 1 - comm.rank
    out = []
    with _maybe_pinned(comm.rank, pin):
        comm.barrier()
        if comm.rank == 0:
            for i in range(1, warmup + iters + 1):
                tx[0] = i
                t0 = time.perf_counter_ns()
                comm.put_signal(rx, tx, peer, sig, 0, i)
                comm.signal_wait_until(sig, 0, ">=", i)
                t1 = time.perf_counter_ns()
                if i > warmup:
                    out.append(t1 - t0)
        else:
            for i in range(1, warmup + iters + 1):
                comm.signal_wait_until(sig, 0, ">=", i)
                comm.put_signal(rx, rx, peer, sig, 0, i)
        comm.barrier()
    return {"samples_ns": out} if comm.rank == 0 else {}


def idle_pe(comm, idle_s: float) -> dict:
    """PE 0 waits in recv while PE 1 sleeps ``idle_s``, then sends: PE 0's thread CPU and wall time in recv."""
    box = comm.mailbox(64, 4)
    comm.barrier()
    if comm.rank == 0:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        m = box.recv(timeout=idle_s + 30)
        c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
        m.release()
        res = {"cpu_ns": c1 - c0, "wall_ns": w1 - w0}
    else:
        time.sleep(idle_s)
        box.send(0, torch.zeros(8, dtype=torch.int64), 7)
        res = {}
    comm.barrier()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--think-us", type=float, nargs="*", default=[100.0])
    ap.add_argument("--rows", default="all", help="comma-separated row prefixes to run (default all)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    want = None if a.rows == "all" else a.rows.split(",")

    def on(name):
        return want is None or any(name.startswith(w) for w in want)

    pooled: dict = {}
    extra: dict = {}
    for r in range(a.rounds):
        for pin in (False, True):
            name = f"mailbox_rt_{'pinned' if pin else 'unpinned'}"
            if on(name):
                res = asap_comm.launch(mailbox_pe, 2, a.iters, a.warmup, pin, 0.0, timeout=600)[0]
                pooled.setdefault(name, []).extend(res["samples_ns"])
                extra.setdefault(name + "_median_by_round", []).append(_quantiles(res["samples_ns"])["median"] / 1e3)
            name = f"pingpong_generic_{'pinned' if pin else 'unpinned'}"
            if on(name):
                res = asap_comm.launch(pingpong_pe, 2, a.iters, a.warmup, pin, timeout=600)[0]
                pooled.setdefault(name, []).extend([s / 2 for s in res["samples_ns"]])
                extra.setdefault(name + "_median_by_round", []).append(
                    _quantiles(res["samples_ns"])["median"] / 2e3)
        for think in a.think_us:
            name = f"mailbox_rt_think_{think:g}"
            if on(name):
                n = max(200, a.iters // 10)
                res = asap_comm.launch(mailbox_pe, 2, n, n // 10, False, think, timeout=600)[0]
                pooled.setdefault(name, []).extend(res["samples_ns"])
                extra.setdefault(name + "_cpu_us_per_rt", []).append(res["cpu_ns"] / n / 1e3)
        if on("idle_recv_cpu"):
            res = asap_comm.launch(idle_pe, 2, a.idle_s, timeout=600)[0]
            extra.setdefault("idle_recv_cpu_ms", []).append(res["cpu_ns"] / 1e6)
            extra.setdefault("idle_recv_wall_ms", []).append(res["wall_ns"] / 1e6)
        print(f"[bench_wakeup] round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)

    rows = {}
    print(f"asap_comm={asap_comm.__file__} ASAP_SPIN_NS={os.environ.get('ASAP_SPIN_NS', 'default')} "
          f"cpus={os.cpu_count()}")
    print(f"{'row':32s} {'median':>9s} {'p10':>9s} {'p90':>9s} {'mean':>9s}  (us)")
    for name, xs in pooled.items():
        q = {k: (v / 1e3 if k != "n" else v) for k, v in _quantiles(xs).items()}
        rows[name] = q
        print(f"{name:32s} {q['median']:9.3f} {q['p10']:9.3f} {q['p90']:9.3f} {q['mean']:9.3f}  n={q['n']}")
    for k, v in extra.items():
        print(f"{k:32s} " + " ".join(f"{x:.3f}" for x in v))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "extra": extra}, f, indent=1)


if __name__ == "__main__":
    main()
