"""Expert failover across hosts (issue 35): a lost host's expert PEs replaced by spares on the other hosts.

* The fence: once a PE on another host is declared dead (``Communicator.fence_peer``, which the workers call when
  the front end's TAKEOVER or ROUTE names it; or this PE's own liveness line to it failed), nothing it sends is
  applied here, small or rendezvous-sized, put, signal or mailbox message: each is dropped and counted
  (``net_stats()["fenced"]``).
* The HTTP service under torchrun on three simulated hosts, expert PEs alone on the middle one, spares with the
  front end: under load the middle host's link goes down; the spares (on a third host) take over both expert ranks
  and every call is answered 200 with the right token.

Both need simulated hosts (``asap_comm.testing.netns``: root) and are marked ``netns`` and ``slow`` like the other
multi-host tests; on one host ``fence_peer`` does nothing (checked everywhere).
"""
import os
import subprocess
import time

import pytest
import torch

import asap_comm
from asap_comm.testing.netns import Hosts, free_port, run_across_hosts
from asap_comm.testing.service import (calls, end_service, host_health, long_clients, serve_across_hosts,
                                      wait_host_health)

from distributed_utils import run


def _fence_on_one_host(comm):
    try:
        comm.fence_peer(comm.rank)
        own = None
    except ValueError as e:
        own = str(e)
    out = comm.fence_peer(1 - comm.rank), comm.peer_state(1 - comm.rank), own, comm.net_stats()
    comm.barrier()  # the other PE is alive until both have looked
    return out


def test_fence_peer_on_one_host_does_nothing():
    """On one host there is nothing to fence (a dead process writes nothing): ``fence_peer`` returns False and the
    peer stays alive; naming this PE itself is a ValueError naming the call."""
    for fenced, state, own, stats in run(_fence_on_one_host, 2, timeout=60):
        assert (fenced, state, stats) == (False, "alive", {}), (fenced, state, stats)
        assert own is not None and own.startswith("fence_peer: pe=") and "is this PE" in own, own

def _wait_file(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def _touch(path: str) -> None:
    with open(path, "w"):
        pass


def _writes_after_the_verdict(comm, out):
    """PE 1 (host 1) writes into PE 0 (host 0); PE 0 declares PE 1 dead; PE 1, which is not told and lives on,
    writes again: a put_signal, a put and a mailbox message (a signal_op would wait for its answer, which does not
    come, for the whole timeout)."""
    small = comm.zeros(16, torch.int64)
    sig = comm.signals(3)
    box = comm.mailbox(64, 4)
    comm.barrier()
    if comm.rank == 1:
        comm.put_signal(small, torch.full((16,), 1, dtype=torch.int64), 0, sig, 0, 1, op="set")
        _wait_file(os.path.join(out, "fenced"))
        comm.put_signal(small, torch.full((16,), 2, dtype=torch.int64), 0, sig, 0, 2, op="set")
        comm.put(small[8:], torch.full((8,), 3, dtype=torch.int64), 0)
        try:
            box.send(0, torch.tensor([7, 7]), tag=3, timeout=2.0)
            sent = "placed"
        except asap_comm.CommError as e:  # no answer comes
            sent = type(e).__name__
        _touch(os.path.join(out, "sent"))
        return {"send": sent, "state": comm.peer_state(0)}
    comm.signal_wait_until(sig, 0, ">=", 1, timeout=60)
    before = comm.net_stats()["fenced"]
    fenced = comm.fence_peer(1)
    state = comm.peer_state(1)
    _touch(os.path.join(out, "fenced"))
    _wait_file(os.path.join(out, "sent"))
    deadline = time.monotonic() + 30  # the three were sent before "sent" appeared; they arrive, and are dropped
    while comm.net_stats()["fenced"] - before < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        comm.signal_wait_until(sig, 0, ">=", 2, timeout=5)
        wait = "returned"
    except asap_comm.PeerFailure as e:
        wait = f"PeerFailure {e.pe} {e.reason}"
    stats = comm.net_stats()
    return {"fenced_call": fenced, "state": state, "small": small.tolist(), "sigs": sig.tolist(),
            "mail": box.poll() is not None, "wait": wait, "again": comm.fence_peer(1),
            "fenced": stats["fenced"] - before, "last_error": stats["last_error"], "disorder": stats["disorder"]}


@pytest.mark.slow
@pytest.mark.netns
def test_nothing_a_pe_declared_dead_sends_is_applied(tmp_path):
    """PE 0 declares PE 1 (another host, alive and connected) dead with ``fence_peer``, as a worker does when the
    front end's TAKEOVER or ROUTE names it; PE 1 is not told and writes again: a put_signal, a put and a mailbox
    message. Each is dropped and counted (``net_stats()["fenced"]``): PE 0's memory, signal words and
    inbox hold what PE 1 wrote before the verdict; PE 1 counts as died here and a wait on its signal fails with
    PeerFailure at once; PE 1's mailbox send gets no answer (TimeoutError)."""
    out = str(tmp_path)
    with Hosts(2) as hs:
        r, w = run_across_hosts(hs, [1, 1], _writes_after_the_verdict, out, timeout=120)
    assert r["fenced_call"] is True and r["state"] == "died", r
    assert r["small"] == [1] * 16 and r["sigs"] == [1, 0, 0] and not r["mail"], r
    # at least the three writes; the mailbox send, unanswered, may be offered again within its 2 s and count again
    assert r["fenced"] >= 3 and "fenced" in r["last_error"] and r["disorder"] == 0, r
    assert r["wait"] == "PeerFailure 1 died", r
    assert r["again"] is False, r  # dead already: nothing more to do
    assert w == {"send": "TimeoutError", "state": "alive"}, w


# --------------------------------------------------------------------------- the HTTP service across hosts
# PEs: attention 0..A-1, expert A..A+E-1, spares A+E.., the front end last. Under torchrun the server makes node 0's
# first process the front end (and the HTTP server) and numbers the others on from PE 0 in host order, so with
# LAYOUT host 0 holds the front end (PE 5) and attention PE 0; host 1 (the host lost) expert PEs 1, 2; host 2 the
# spare PEs 3, 4.
LAYOUT = [2, 2, 2]
ARGS = ["--attention-ranks", "1", "--expert-ranks", "2", "--spare-expert-ranks", "2", "--failure-exit-s", "2",
        "--comm-timeout-s", "10", "--worker-stall-s", "5", "--request-timeout-s", "120"]
LOAD_S = 12.0  # 4 s before the loss, 8 s after it: the failover (about 3 s) and calls on the spares


def _prompts_and_answers():
    from models import preset, random_init

    model = random_init(preset("tiny"), seed=0)
    prompts = [[(7 * i + 3 * j) % 120 + 1 for j in range(5 + 11 * i)] for i in range(6)]
    return prompts, [int(model.prefill(torch.tensor(p)).logits[-1].argmax()) for p in prompts]


def _metric(text: str, name: str) -> "float | None":
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _metrics_text(host, port: int) -> str:
    p = host.popen(["python", "-c", "import sys, urllib.request; "
                    "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=60).read().decode())",
                    f"http://127.0.0.1:{port}/metrics"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.communicate(timeout=90)[0]


@pytest.mark.slow
@pytest.mark.netns
def test_a_lost_hosts_expert_pes_are_replaced_by_spares_on_the_other_hosts():
    """``python -m asap_comm.serving.server --spare-expert-ranks 2`` under torchrun on three simulated hosts (LAYOUT),
    ASAP_NET_PEER_TIMEOUT_S = 3. Under load from four clients, host 1 (both expert PEs) is cut off (link down: no
    goodbye, no end of file; the liveness lines fail their keepalive). The front end declares both dead, the spares
    on host 2 take over expert ranks 0 and 1, the attention PE routes to them (and fences the lost PEs):
    every call is answered 200 with the right token, calls end after the loss, /health (200) shows the two
    replacements, /metrics counts them, and a SIGTERM to node 0's launcher (the HTTP server) stops the rest cleanly."""
    prompts, want = _prompts_and_answers()
    port = free_port()
    with Hosts(3) as hs:
        front = hs[0]  # the HTTP server and the front end
        procs = serve_across_hosts(hs, port, ARGS, layout=LAYOUT)
        logs = ["", "", ""]
        try:
            health = wait_host_health(front, port, procs, timeout_s=240)
            assert [w["pe"] for w in health["workers"]][:5] == [0, 1, 2, 3, 4], health["workers"]
            load = long_clients(front, port, prompts, LOAD_S)
            time.sleep(4)  # load flows through the experts on host 1
            hs[1].link_down()
            t_loss = time.monotonic()
            after = None
            while time.monotonic() - t_loss < 60:  # the liveness limit (3 s) and the failover, with slack
                status, body = host_health(front, port)
                if status == 200 and body.get("failover", {}).get("failovers") == 2:
                    after = (status, body)
                    break
                time.sleep(0.5)
            lines = calls(load, LOAD_S + 200)
            final = host_health(front, port)
            metrics = _metrics_text(front, port)
            hs[1].kill_all()  # the lost host's processes (cut off, they end on their own; no need to wait)
            logs = end_service(hs, procs)  # the front end stops the workers that are left
        finally:
            for h in hs.hosts:
                h.kill_all()
    tail = "\n".join(f"--- host {i}:\n{log[-2500:]}" for i, log in enumerate(logs))
    assert after is not None, f"/health never showed two failovers within 60 s of the loss\n{tail}"
    fo = after[1]["failover"]
    assert sorted(fo["expert_rank_pes"]) == [3, 4] and fo["spares_left"] == [], fo
    assert sorted(e["dead_pe"] for e in fo["replacements"]) == [1, 2], fo
    assert all(e["reason"] == "died" for e in fo["replacements"]), fo
    bad = [x for x in lines if x[0] != 200 or x[2] != want[x[1]]]
    assert lines and not bad, (len(lines), bad[:5], tail)
    # the clients' clock is CLOCK_MONOTONIC, shared by the namespaces
    assert sum(x[4] > t_loss + 5 for x in lines) >= 4, "too few calls after the loss"
    assert final[0] == 200, final
    assert (_metric(metrics, "asap_expert_failovers_total") or 0) >= 2, metrics[-2000:]
    assert "PE 0@asap-host0, PE 1@asap-host1, PE 2@asap-host1, PE 3@asap-host2, PE 4@asap-host2, PE 5@asap-host0" \
        in logs[0], tail  # the layout the test means
    assert "stopped cleanly" in logs[0] and "worker failure" not in logs[0], tail
    assert "failover: expert worker PE 1 died" in logs[0] and "failover: expert worker PE 2 died" in logs[0], tail
