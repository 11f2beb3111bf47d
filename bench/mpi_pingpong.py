"""Open MPI one-sided ping-pong baseline (mpi4py), 8-byte payload, 2 ranks on one host.

Run by ``run_all.py`` as::

    mpirun --allow-run-as-root --oversubscribe -np 2 [--mca ...] python bench/mpi_pingpong.py \
        --warmup W --batches B --iters N

Each rank exposes an 8-byte window (``Win.Allocate``) and holds a passive-target
epoch to the peer for the whole run (``Lock_all``). Rank 0 writes counter ``i``
into its peer's window with ``Put`` + ``Flush``; rank 1 polls its own window
memory (``Win.Sync`` between polls, as the unified memory model asks) until
``i`` appears, then puts the value it saw back the same way. Rank 0 checks
that the echo is exactly ``i``. This mirrors the ASAP ping-pong in
``_asap_primitives.py`` (data and "signal" are the same 8-byte word here).

Prints one JSON line on rank 0's stdout: ``samples_ns`` (round-trip ns per
iteration, one entry per timed batch), ``bad`` (failed checks, both ranks),
``library`` (the MPI library version string).
"""
from __future__ import annotations

import argparse
import json

from mpi4py import MPI

from _common import BatchPlan, pinned, time_batches  # bench/ is the script's directory: first on its path


def _window_words(win) -> memoryview:
    """This rank's window memory as a memoryview of one uint64."""
    return memoryview(win.tomemory()).cast("B").cast("Q")


def _put_flush(win, tx, peer: int):
    """``send(value)``: Put ``value`` (8 bytes) into the peer's window and Flush (remote completion)."""
    put, flush = win.Put, win.Flush

    def send(value: int) -> None:
        tx[0] = value
        put(tx, peer)
        flush(peer)

    return send


def _poll(win, rx: memoryview):
    """``wait(value) -> seen``: spin on the local window until it holds >= ``value``."""
    sync = win.Sync

    def wait(value: int) -> int:
        while rx[0] < value:
            sync()
        return rx[0]

    return wait


def _batch(rank: int, send, wait):
    """Rank 0: send i, wait for the echo, count mismatches. Rank 1: echo what it sees."""

    def initiator(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            send(i)
            if wait(i) != i:
                bad += 1
        return bad

    def responder(first: int, n: int) -> int:
        for i in range(first, first + n):
            send(wait(i))
        return 0

    return initiator if rank == 0 else responder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, required=True, help="untimed round trips")
    ap.add_argument("--batches", type=int, required=True, help="timed batches")
    ap.add_argument("--iters", type=int, required=True, help="round trips per batch")
    args = ap.parse_args()
    plan = BatchPlan(args.warmup, args.batches, args.iters)

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise SystemExit("mpi_pingpong.py needs exactly 2 ranks")
    peer = 1 - rank
    win = MPI.Win.Allocate(8, disp_unit=8, comm=comm)
    rx = _window_words(win)
    rx[0] = 0
    tx = memoryview(bytearray(8)).cast("Q")
    comm.Barrier()
    win.Lock_all()
    with pinned(rank):
        samples, bad = time_batches(_batch(rank, _put_flush(win, tx, peer), _poll(win, rx)), plan)
    win.Unlock_all()
    bad = comm.reduce(bad, op=MPI.SUM, root=0)
    comm.Barrier()
    win.Free()
    if rank == 0:
        print(json.dumps({"samples_ns": samples, "bad": bad, "library": MPI.Get_library_version().strip()}))


if __name__ == "__main__":
    main()
