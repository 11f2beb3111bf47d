"""The wait's wake-up path (kernels/sync.cpp wait_until): an idle waiter sleeps instead of spinning, PEs that
share one CPU still exchange messages and still see a peer die, and a PE that moves itself off a shared CPU
leaves its CPU affinity as it found it. No wall-clock asserts: the idle check bounds CPU time, generously."""
import os
import signal
import time

import pytest
import torch

import asap_comm
from asap_comm import PeerFailure
from distributed_utils import run

IDLE_S = 1.5


def _idle_recv(comm):
    box = comm.mailbox(64, 4)
    comm.barrier()
    if comm.rank == 1:
        time.sleep(IDLE_S)
        box.send(0, torch.arange(8, dtype=torch.int64), 5)
        comm.barrier()
        return None
    c0 = time.thread_time()
    m = box.recv(timeout=60)
    cpu = time.thread_time() - c0
    ok = m.tag == 5 and m.tensor.tolist() == list(range(8))
    m.release()
    comm.barrier()
    return cpu, ok


def test_idle_recv_sleeps_instead_of_spinning():
    """A recv that waits 1.5 s for its message uses a small fraction of that in CPU time (a spinning waiter
    would use about all of it on a quiet host)."""
    cpu, ok = run(_idle_recv, 2)[0]
    assert ok
    assert cpu < 0.4 * IDLE_S, f"an idle recv used {cpu:.3f} s of CPU in {IDLE_S} s"


def _round_trips(comm, n, same_cpu):
    before = os.sched_getaffinity(0)
    if same_cpu:
        os.sched_setaffinity(0, {min(before)})
    pinned = os.sched_getaffinity(0)
    box = comm.mailbox(64, 8)
    tx = torch.zeros(8, dtype=torch.int64)
    bad = 0
    comm.barrier()
    for i in range(n):
        if comm.rank == 0:
            tx[0], tx[7] = i, -i
            box.send(1, tx, i)
            m = box.recv(timeout=30)
            bad += m.tag != i or m.src != 1 or m.tensor[0].item() != i or m.tensor[7].item() != -i
            m.release()
        else:
            m = box.recv(timeout=30)
            box.send(0, m.tensor, m.tag)
            m.release()
    comm.barrier()
    after = os.sched_getaffinity(0)
    os.sched_setaffinity(0, before)
    return bad, pinned == after


@pytest.mark.parametrize("same_cpu", [True, False], ids=["one_cpu", "unpinned"])
def test_round_trips_shared_or_unpinned_keep_affinity(same_cpu):
    """Round trips between two PEs on one CPU (each waiter hands the CPU over) and unpinned (a PE that finds
    the other on its CPU may move itself): every message comes back intact, and each PE's CPU affinity is what
    it was (a move restores the allowed set at once)."""
    res = run(_round_trips, 2, 3000, same_cpu)
    assert res[0] == (0, True)
    assert res[1] == (0, True)


def _dies_on_shared_cpu(comm, report):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    box = comm.mailbox(64, 4)
    comm.barrier()
    if comm.rank == 1:
        for _ in range(200):  # round trips first, so that both PEs' run stamps show the shared CPU
            m = box.recv(timeout=30)
            box.send(0, m.tensor, m.tag)
            m.release()
        os.kill(os.getpid(), signal.SIGKILL)
    for i in range(200):
        box.send(1, torch.tensor([i]), i)
        box.recv(timeout=30).release()
    err = None
    try:
        box.recv(timeout=30)
    except PeerFailure as e:
        err = (e.pe, e.reason)
    with open(report, "w") as f:
        f.write(repr(err))
    return err


def test_peer_death_seen_by_a_waiter_on_its_cpu(tmp_path):
    """PE 1 dies while PE 0, on the same CPU, waits for its message: PeerFailure, not a timeout."""
    report = tmp_path / "err.txt"
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_dies_on_shared_cpu, 2, str(report), timeout=60)
    assert ei.value.rank == 1 and ei.value.exitcode == -signal.SIGKILL, str(ei.value)
    assert eval(report.read_text()) == (1, "died")
