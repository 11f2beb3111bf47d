"""Patience across hosts and a group that ends on its own (issue 35, item 1).

* A stopped PE on another host is outlived, as on one host: a mailbox send to it that timed out waiting for its
  answer is offered again without ever placing the message twice (the native engine keeps the unanswered
  request), and the HTTP service under torchrun on two simulated hosts lives through a 60 s SIGSTOP of a remote
  expert worker and of a remote attention worker under load (both in one run, stopped together), every answer right.
* A group that is gone ends its workers: a wait on any of several senders (``ExpertEnd.dispatch_recv``) fails once
  every sender died or left; an attention worker whose front end left without stopping it fails; a worker that
  gives up tells the front end why (the service fails with that reason, never "stopped cleanly"); after node 0
  and node 1's launcher are removed, node 1's workers exit 3 on their own within the liveness limit.

The single-host checks run everywhere; the ones on simulated hosts (``asap_comm.testing.netns``) need root and
are marked ``netns`` and ``slow`` like the other multi-host tests.
"""
import os
import signal
import time

import pytest
import torch

import asap_comm
from asap_comm.moe import AttentionEnd, ExpertEnd, MoEPlan
from asap_comm.testing.netns import Hosts, free_port, mark_ready, run_across_hosts, wait_ready
from asap_comm.testing.service import (calls, end_service, host_health, long_clients, serve_across_hosts,
                                       wait_host_health)
from distributed_utils import run


# --------------------------------------------------------------------------- one host: a wait on any sender
def _senders_leave(comm, plan, finish_first):
    if comm.rank < plan.num_attention_ranks:
        end = AttentionEnd(comm, plan)
        if comm.rank == 0 and finish_first:
            end.finish()  # PE 0 finishes; PE 1 leaves without finishing
        comm.barrier()
        return None
    ex = ExpertEnd(comm, plan)
    comm.barrier()
    t0 = time.monotonic()
    try:
        while ex.dispatch_recv(timeout=30) is not None:
            pass
        out = ("finished", time.monotonic() - t0)
    except asap_comm.PeerFailure as e:
        out = ("PeerFailure", time.monotonic() - t0, e.pe, e.reason, str(e))
    except asap_comm.TimeoutError as e:
        out = ("TimeoutError", time.monotonic() - t0, str(e))
    time.sleep(3)  # stay: the other expert PE's wait must not end because every other PE closed
    return out


@pytest.mark.parametrize("finish_first", [True, False], ids=["one finished", "none finished"])
def test_a_wait_on_any_sender_fails_once_every_sender_has_left(finish_first):
    """Two attention PEs, two expert PEs on one host: the attention PEs leave (close) without finishing (PE 0
    finishes first in one case). Each expert PE, waiting in dispatch_recv for any attention PE, gets PeerFailure
    within about a second, although the other expert PE lives on (before: it waited out its whole timeout)."""
    plan = MoEPlan(num_attention_ranks=2, num_expert_ranks=2, num_experts=4, hidden=8, top_k=2, max_tokens=4,
                   max_inflight=2)
    results = run(_senders_leave, 4, plan, finish_first, timeout=90)
    for pe in (2, 3):
        res = results[pe]
        assert res[0] == "PeerFailure", (pe, res)
        assert res[3] == "closed" and res[2] == (1 if finish_first else 0), res
        assert "every attention rank that had not finished" in res[4] and "PE 1 closed" in res[4], res
        assert res[1] < 10, f"PE {pe} noticed after {res[1]:.1f} s (hang guard; the check runs every 0.1 s)"


# --------------------------------------------------------------------------- one host: a group whose front end left
class _LeaveWithoutStopping:
    """A front-end role that waits for the workers, then leaves without sending them the stop message."""

    def __call__(self, comm, cfg, info, ch, num_targets, label, role_of):
        from asap_comm.serving.frontend import FrontEnd

        FrontEnd(comm, cfg, info, ch.box, num_targets, label).wait_ready(ch.stats, 60)
        return "left"


class _AdmitOneAndPump:
    """A front-end role that admits one request and pumps until a worker's failure reaches it."""

    def __call__(self, comm, cfg, info, ch, num_targets, label, role_of):
        from asap_comm.serving.frontend import FrontEnd

        fe = FrontEnd(comm, cfg, info, ch.box, num_targets, label)
        fe.wait_ready(ch.stats, 60)
        fe.admit(1, torch.arange(1, 9))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                fe.pump(0.01)
            except asap_comm.PeerFailure as e:
                return ("PeerFailure", e.pe, e.reason, str(e))
        return ("nothing", None, None, "")


class _GivesUpFactory:
    """The tiny model, whose attention side gives up (a synthetic TimeoutError) at its first step."""

    def __call__(self, role, experts):
        from serving_utils import TinyFactory

        model = TinyFactory()(role, experts)
        if role == "attention":
            def attention_stage(*a, **k):
                raise asap_comm.TimeoutError("send: synthetic: PE 3 did not answer")
            model.attention_stage = attention_stage
        return model


def _group_pe(comm, spec):
    """The PE's outcome, last the time it ended on the host's monotonic clock (one clock for every process of
    the host: ends compare across PEs, which their own durations do not, as the PEs start one after another)."""
    from asap_comm.serving.group import group_main

    try:
        role, payload = group_main(comm, spec)
        return ("returned", role, payload if role == "front" else None, time.monotonic())
    except asap_comm.PeerFailure as e:
        return ("PeerFailure", e.pe, e.reason, str(e), time.monotonic())
    except asap_comm.CommError as e:
        return (type(e).__name__, None, None, str(e), time.monotonic())


def _spec(front, factory=None):
    from asap_comm.serving.group import GroupSpec
    from asap_comm.serving.protocol import RuntimeConfig
    from serving_utils import INFO, TinyFactory

    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=64, max_prompt_len=64, timeout_s=60)
    return GroupSpec("async", cfg, INFO, factory or TinyFactory(), front)


def test_workers_end_when_their_front_end_leaves_without_stopping_them():
    """The front end leaves (closes) without the stop message: each attention worker fails (the front end
    closed before it stopped it), and then each expert worker (every attention rank left without finishing),
    though nobody died. Before: all four waited for a message that could not come, until killed."""
    started = time.monotonic()
    results = run(_group_pe, 5, _spec(_LeaveWithoutStopping()), timeout=120, comm_timeout=30)
    assert results[4][:3] == ("returned", "front", "left"), results[4]
    for pe in (0, 1):
        kind, lost, reason, msg, _ = results[pe]
        assert (kind, lost, reason) == ("PeerFailure", 4, "closed"), results[pe]
        assert "the front end (PE 4) closed before it stopped this worker" in msg, msg
    # the first expert PE to notice names the attention ranks; the other may notice first that every PE left
    first = min((2, 3), key=lambda pe: results[pe][-1])
    assert "every attention rank that had not finished" in results[first][3], results[first]
    for pe in (2, 3):
        assert results[pe][0] == "PeerFailure" and results[pe][2] == "closed", results[pe]
    assert max(r[-1] for r in results[:4]) - started < 60, results  # a hang guard: they end within seconds


def test_a_worker_that_gives_up_tells_the_front_end_why():
    """An attention worker gives up (here a synthetic TimeoutError in its model): before it leaves it tells the
    front end why, and the front end fails with that reason (the service answers 503 naming it and exits 3 with
    it logged). Before: the worker left, the front end went on as if nothing happened (and its requests there
    were never answered); the other workers then ended too (their front end and senders gone)."""
    results = run(_group_pe, 5, _spec(_AdmitOneAndPump(), _GivesUpFactory()), timeout=120, comm_timeout=30)
    kind, role, payload, _ = results[4]
    assert (kind, role) == ("returned", "front"), results[4]
    assert payload[:3] == ("PeerFailure", payload[1], "closed") and payload[1] in (0, 1), payload
    assert f"attention worker PE {payload[1]} gave up: send: synthetic: PE 3 did not answer" in payload[3], payload
    failed = payload[1]
    assert results[failed][0] == "TimeoutError" and "synthetic" in results[failed][3], results[failed]
    other = 1 - failed
    assert results[other][:3] == ("PeerFailure", 4, "closed"), results[other]
    for pe in (2, 3):
        assert results[pe][0] == "PeerFailure" and results[pe][2] == "closed", results[pe]


# --------------------------------------------------------------------------- simulated hosts
def _stream_through_a_stop(comm, marker_dir, n):
    """PE 0 sends PE 1 (on the other host) ``n`` messages through a 4-slot inbox with a short timeout, offering
    each again after a TimeoutError (as the front end does) while PE 1 is stopped; PE 1 receives them all."""
    box = comm.mailbox(64, 4)
    comm.barrier()
    mark_ready(marker_dir, comm.rank)
    if comm.rank == 0:
        retries, i = 0, 0
        while i < n:
            try:
                box.send(1, torch.tensor([i, 7 * i]), tag=i, timeout=0.01)
                i += 1
            except asap_comm.TimeoutError:
                retries += 1
                time.sleep(0.01)
        got = None
    else:
        time.sleep(1.0)  # stopped within this
        got = []
        while len(got) < n + 5:  # more than were sent: a duplicate would show
            try:
                m = box.recv(timeout=2)  # the stream is over (after the last message and any duplicate)
            except asap_comm.TimeoutError:
                break
            with m:
                got.append((m.src, m.tag, m.tensor.tolist()))
        retries = None
    stats = comm.net_stats()
    comm.barrier(timeout=120)
    return {"got": got, "retries": retries, "stats": stats}


@pytest.mark.slow
@pytest.mark.netns
def test_a_send_offered_again_to_a_stopped_remote_pe_is_never_placed_twice(tmp_path):
    """PE 1 (another host) is stopped for 12 s (four times the 3 s peer timeout; past the old 10 s answer wait)
    while PE 0 streams to it with a 10 ms timeout and offers each message again after a TimeoutError: PE 1 gets
    every message exactly once, in order (before: the send waited 10 s for the stopped peer's answer, then the
    message offered again was placed a second time)."""
    out = str(tmp_path)

    def stop_pe1(hs, procs):
        pid1 = wait_ready(out, (0, 1), procs)[1]
        os.kill(pid1, signal.SIGSTOP)
        try:
            time.sleep(12)
        finally:
            os.kill(pid1, signal.SIGCONT)

    with Hosts(2) as hs:
        results = run_across_hosts(hs, [1, 1], _stream_through_a_stop, out, 12, timeout=180, during=stop_pe1,
                                   env={"ASAP_NET_PEER_TIMEOUT_S": "3"})
    got = results[1]["got"]
    assert got == [(0, i, [i, 7 * i]) for i in range(12)], got
    assert results[0]["retries"] > 0, results[0]  # the stop was met: sends timed out and were offered again
    s0 = results[0]["stats"]
    assert s0["mbox_unanswered"] >= 1 and s0["mbox_resumed"] >= 1 and s0["mbox_abandoned"] == 0, s0
    assert s0["disorder"] == 0 and results[1]["stats"]["disorder"] == 0


# --------------------------------------------------------------------------- the HTTP service across hosts
def _start_service(hs, port, extra=()):
    return serve_across_hosts(hs, port, ["--failure-exit-s", "2", "--comm-timeout-s", "10", "--worker-stall-s", "5",
                                         *extra])


def _prompts_and_answers():
    from models import preset, random_init

    model = random_init(preset("tiny"), seed=0)
    prompts = [[(7 * i + 3 * j) % 120 + 1 for j in range(5 + 11 * i)] for i in range(6)]
    return prompts, [int(model.prefill(torch.tensor(p)).logits[-1].argmax()) for p in prompts]


STOP_S = 60.0


@pytest.mark.slow
@pytest.mark.netns
def test_the_service_across_hosts_outlives_stopped_remote_workers():
    """``python -m asap_comm.serving.server`` under torchrun: the front end and attention PE 0 on node 0, attention
    PE 1 and expert PEs 2, 3 on node 1; --comm-timeout-s 10 (each attempt's bound). Under load from four clients,
    two workers on node 1 are stopped (SIGSTOP) together for 60 s, six times that bound: expert PE 2 (which node
    0's attention PE dispatches to) and attention PE 1 (which the front end sends chunks to); then continued.
    /health calls them stalled meanwhile (never died, no failure); every call gets 200 with the right token, calls
    finish after the stop, and the service then stops cleanly on SIGTERM. (Before: node 0's attention PE gave up
    on the expert after one attempt's bound, `send: waiting for a free slot in PE 2's inbox: timed out`, and the
    service died; a chunk offered again to the stopped attention PE was placed twice.) One run stops both, so the
    suite pays for one 60 s stop."""
    prompts, want = _prompts_and_answers()
    port = free_port()
    with Hosts(2) as hs:
        procs = _start_service(hs, port, ["--request-timeout-s", "300"])
        try:
            health = wait_host_health(hs[0], port, procs)
            pids = [health["workers"][pe]["pid"] for pe in (2, 1)]
            # four clients for 2 s before the stop, through it, and about 3 s after it (the calls held across the
            # stop end after it, then new ones)
            load = long_clients(hs[0], port, prompts, STOP_S + 5)
            time.sleep(2)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            t_stop = time.time()
            during = []
            try:
                while time.time() - t_stop < STOP_S:
                    time.sleep(5)
                    during.append(host_health(hs[0], port))
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            t_cont = time.time()
            lines = calls(load, STOP_S + 400)
            after = host_health(hs[0], port)
            logs = end_service(hs, procs)
        finally:
            for h in hs.hosts:
                h.kill_all()
    bad = [x for x in lines if x[0] != 200 or x[2] != want[x[1]]]
    assert lines and not bad, (bad[:5], logs[0][-3000:], logs[1][-3000:])
    offset = time.monotonic() - time.time()  # the clients' clock is CLOCK_MONOTONIC (shared by the namespaces)
    assert any(x[3] < t_stop + offset < x[4] for x in lines), "no call was in flight across the stop"
    assert sum(x[4] > t_cont + offset for x in lines) >= 4, "too few calls after the stop"
    stalled = [b for s, b in during if s == 503]
    assert stalled and all("stalled" in b.get("error", "") and "failure" not in b.get("error", "") for b in stalled), \
        during
    assert all(w["state"] == "alive" for s, b in during if isinstance(b, dict) and "workers" in b
               for w in b["workers"]), during
    assert after[0] == 200, after
    assert "stopped cleanly" in logs[0] and "worker failure" not in logs[0], logs[0][-3000:]
    assert "gave up" not in logs[0], logs[0][-3000:]
    # node 1's launcher: every worker ended with 0 (node 0's torchrun itself exits 1 on the SIGTERM it was sent)
    assert procs[1].returncode == 0, logs[1][-3000:]


@pytest.mark.slow
@pytest.mark.netns
def test_node_1_workers_exit_on_their_own_once_node_0_and_their_launcher_are_gone():
    """After a failure (expert PE 3 on node 1 killed under load), node 0 is cut off (its link down: no goodbye,
    no end of file; the liveness lines fail their keepalive within ASAP_NET_PEER_TIMEOUT_S = 3 s) and node 1's
    torchrun is killed (SIGKILL: nobody stops its workers; they ignore SIGTERM by design). Each remaining worker
    on node 1 logs why and exits (status 3) on its own within the liveness limit (plus slack for this host)."""
    prompts, _ = _prompts_and_answers()
    port = free_port()
    with Hosts(2) as hs:
        procs = _start_service(hs, port)
        try:
            health = wait_host_health(hs[0], port, procs)
            pids = {w["pe"]: w["pid"] for w in health["workers"]}
            load = long_clients(hs[0], port, prompts, 20)
            time.sleep(2.5)  # calls in flight through node 1's workers
            os.kill(pids[3], signal.SIGKILL)  # the failure
            procs[1].kill()  # node 1's launcher
            hs[0].link_down()  # node 0, gone
            t0 = time.monotonic()
            left = None
            while time.monotonic() - t0 < 60:
                alive = [pe for pe in (1, 2) if os.path.exists(f"/proc/{pids[pe]}")
                         and open(f"/proc/{pids[pe]}/stat").read().split(")")[-1].split()[0] != "Z"]
                if not alive:
                    left = time.monotonic() - t0
                    break
                time.sleep(0.1)
            log1 = procs[1].communicate(timeout=60)[0]  # the workers held the pipe: EOF once they are gone
            load.kill()
        finally:
            for h in hs.hosts:
                h.kill_all()
    assert left is not None, f"node 1's workers were still running 60 s later:\n{log1[-3000:]}"
    assert left < 3 + 20, f"node 1's workers took {left:.1f} s"  # the liveness limit, plus slack for a loaded host
    for pe in (1, 2):
        assert f"asap serve: PE {pe}: stopped:" in log1, log1[-3000:]
