"""Patience across hosts and a group that ends on its own (issue 35, item 1).

* A stopped PE on another host is outlived, as on one host: a mailbox send to it that timed out waiting for its
  answer is offered again without ever placing the message twice (the native engine keeps the unanswered
  request), and the HTTP service under torchrun on two simulated hosts lives through a 60 s SIGSTOP of a remote
  expert worker and of a remote attention worker under load, every answer right.
* A group that is gone ends its workers: a wait on any of several senders (``ExpertEnd.dispatch_recv``) fails once
  every sender died or left; an attention worker whose front end left without stopping it fails; a worker that
  gives up tells the front end why (the service fails with that reason, never "stopped cleanly"); after node 0
  and node 1's launcher are removed, node 1's workers exit 3 on their own within the liveness limit.

The single-host checks run everywhere; the ones on simulated hosts need root (``tests/netns.py``) and are
marked ``slow`` like the other multi-host tests.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import asap_comm
from asap_comm.moe import AttentionEnd, ExpertEnd, MoEPlan
from distributed_utils import run

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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
    from asap_comm.serving.group import group_main

    t0 = time.monotonic()
    try:
        role, payload = group_main(comm, spec)
        return ("returned", role, payload if role == "front" else None, time.monotonic() - t0)
    except asap_comm.PeerFailure as e:
        return ("PeerFailure", e.pe, e.reason, str(e), time.monotonic() - t0)
    except asap_comm.CommError as e:
        return (type(e).__name__, None, None, str(e), time.monotonic() - t0)


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
    assert max(r[-1] for r in results[:4]) < 60, results  # a hang guard: they end within seconds


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
