"""The baselines ``run_all.py`` measures in the same run as ASAP: Open MPI one-sided (mpi4py), multiprocessing.Pipe,
gloo.

Every entry point returns raw results (ns samples plus failed-check counts)
and is bounded in time: ``mpirun`` runs under a subprocess timeout, the
spawned process groups under ``_common.run_processes``' timeout.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import timedelta

from _common import BatchPlan, digest, pattern, pinned, run_processes, time_batches

HERE = os.path.dirname(os.path.abspath(__file__))


def _words(buf) -> memoryview:
    """An int64 memoryview over a writable buffer (bytearray, numpy array) of a multiple of 8 bytes."""
    return memoryview(buf).cast("B").cast("q")


# --------------------------------------------------------------------------- Open MPI one-sided
class Skipped(Exception):
    """A baseline that cannot run on this machine (the message says why)."""


def _ompi_major(mpirun: str) -> int:
    """Open MPI's major version from ``mpirun --version`` (raises Skipped for another MPI)."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"Open MPI\)?\s+(\d+)\.", out)
    if m is None:
        raise Skipped(f"{mpirun} is not Open MPI ({out.strip().splitlines()[:1]})")
    return int(m.group(1))


def mpi_command(mpirun: str, major: int, plan: BatchPlan) -> list:
    """The mpirun command line: 2 ranks, shared-memory transports only, out-of-band wire-up on loopback.

    The shared-memory BTL is ``vader`` before Open MPI 5 and ``sm`` from 5 on;
    single-copy (CMA) is turned off because containers often forbid
    ``process_vm_readv``. Ranks are not bound by mpirun; the script pins
    each rank to its own CPU like the ASAP benchmarks do.
    """
    shm_btl = "vader" if major < 5 else "sm"
    mca = {"btl": f"self,{shm_btl}", "pml": "ob1", "osc": "sm",
           f"btl_{shm_btl}_single_copy_mechanism": "none", "oob_tcp_if_include": "lo"}
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", "--bind-to", "none"]
    for key, value in mca.items():
        cmd += ["--mca", key, value]
    return cmd + [sys.executable, os.path.join(HERE, "mpi_pingpong.py"), "--warmup", str(plan.warmup),
                  "--batches", str(plan.batches), "--iters", str(plan.iters)]


def mpi_pingpong(plan: BatchPlan, timeout: float) -> dict:
    """Run bench/mpi_pingpong.py under mpirun; its JSON result (round-trip ns per batch, ``bad``, ``library``).

    Raises ``Skipped`` if mpirun or mpi4py is missing, ``RuntimeError`` if the run fails.
    """
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise Skipped("mpirun not found (run `bash bench/setup.sh`)")
    if importlib.util.find_spec("mpi4py") is None:
        raise Skipped(f"mpi4py is not installed for {sys.executable} (run `bash bench/setup.sh`)")
    cmd = mpi_command(mpirun, _ompi_major(mpirun), plan)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"mpirun did not finish within {timeout:.0f} s: {' '.join(cmd)}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"mpirun exited with {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- multiprocessing.Pipe
def _pipe_worker(rank: int, conn, plan: BatchPlan, nbytes: int) -> dict:
    """One side of the Pipe ping-pong: rank 0 sends ``nbytes`` carrying counter i and checks the echo."""
    send, recv = conn.send_bytes, conn.recv_bytes

    def initiator(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            msg = i.to_bytes(8, "little") * (nbytes // 8)
            send(msg)
            if recv() != msg:
                bad += 1
        return bad

    def responder(first: int, n: int) -> int:
        for _ in range(first, first + n):
            send(recv())
        return 0

    with pinned(rank):
        samples, bad = time_batches(initiator if rank == 0 else responder, plan)
    conn.close()
    return {"samples_ns": samples, "bad": bad}


def pipe_roundtrip(plan: BatchPlan, nbytes: int, timeout: float) -> dict:
    """Round trips of ``nbytes``-byte messages over a duplex ``multiprocessing.Pipe`` between two processes.

    Returns rank 0's ``samples_ns`` (round-trip ns per batch) and ``bad`` (both sides).
    """
    import multiprocessing as mp

    a, b = mp.get_context("spawn").Pipe(duplex=True)
    try:
        res = run_processes(_pipe_worker, [(0, a, plan, nbytes), (1, b, plan, nbytes)], timeout, "pipe ping-pong")
    finally:
        a.close()
        b.close()
    return {"samples_ns": res[0]["samples_ns"], "bad": res[0]["bad"] + res[1]["bad"]}


# --------------------------------------------------------------------------- gloo
def _gloo_pingpong(rank: int, plan: BatchPlan, nbytes: int) -> dict:
    """send/recv ping-pong of ``nbytes`` (int64 words); rank 0 writes counter i and checks the echo."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 8, dtype=torch.int64)
    words = _words(buf.numpy())
    peer = 1 - rank

    def initiator(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            words[0] = i
            dist.send(buf, peer)
            dist.recv(buf, peer)
            if words[0] != i:
                bad += 1
        return bad

    def responder(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            dist.recv(buf, peer)
            bad += words[0] != i
            dist.send(buf, peer)
        return bad

    with pinned(rank):
        samples, bad = time_batches(initiator if rank == 0 else responder, plan)
    return {"samples_ns": samples, "bad": bad}


def _gloo_bandwidth(rank: int, nbytes: int, iters: int, warmup: int) -> dict:
    """Rank 0 sends ``nbytes`` of float32 to rank 1, which acks each message with 8 bytes; ns per send+ack.

    Each message is stamped with its number in element 0 (checked by rank 1);
    after the last one both ranks report the digest of the full tensor.
    """
    import time

    import torch
    import torch.distributed as dist

    data = pattern(nbytes // 4) if rank == 0 else torch.zeros(nbytes // 4, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.int64)
    samples, bad = [], 0
    for k in range(-warmup, iters):
        if rank == 0:
            data[0] = float(k)
            t0 = time.perf_counter_ns()
            dist.send(data, 1)
            dist.recv(ack, 1)
            if k >= 0:
                samples.append(float(time.perf_counter_ns() - t0))
        else:
            dist.recv(data, 0)
            bad += float(data[0]) != float(k)
            dist.send(ack, 0)
    return {"samples_ns": samples, "bad": bad, "digest": digest(data.numpy())}


def _gloo_worker(rank: int, port: int, plan: BatchPlan, sizes: tuple, bw_bytes: int, bw_iters: int,
                 bw_warmup: int, timeout: float) -> dict:
    """One gloo rank: ping-pong for each size in ``sizes``, then the ``bw_bytes`` bandwidth test."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=timeout))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout))
    try:
        out = {f"pingpong_{n}": _gloo_pingpong(rank, plan, n) for n in sizes}
        out["bandwidth"] = _gloo_bandwidth(rank, bw_bytes, bw_iters, bw_warmup)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


def gloo_suite(plan: BatchPlan, sizes: tuple, bw_bytes: int, bw_iters: int, bw_warmup: int,
               timeout: float) -> dict:
    """torch.distributed "gloo" on 127.0.0.1 between two spawned processes.

    The rendezvous store is hosted here on a port the OS picks (bound to port
    0). Returns ``pingpong_<n>`` (round-trip ns per batch, ``bad``) for each
    size and ``bandwidth`` (ns per ``bw_bytes`` send + ack, ``bad``, and
    whether both ranks ended with the same bytes in ``same_digest``).
    """
    from asap_comm.rendezvous import loopback_store

    store = loopback_store(timeout, 2)
    args = (store.port, plan, sizes, bw_bytes, bw_iters, bw_warmup, timeout)
    r0, r1 = run_processes(_gloo_worker, [(0, *args), (1, *args)], timeout, "gloo")
    del store
    out = {key: {"samples_ns": r0[key]["samples_ns"], "bad": r0[key]["bad"] + r1[key]["bad"]} for key in r0}
    out["bandwidth"]["same_digest"] = r0["bandwidth"]["digest"] == r1["bandwidth"]["digest"]
    return out
