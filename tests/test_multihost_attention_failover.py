"""Attention failover across hosts (issue 35): the host of an attention PE is lost under load; the front end
re-admits that PE's requests on the attention PE left (a prefill is recomputed from its prompt), and no call fails.

Needs simulated hosts (``asap_comm.testing.netns``: root); marked ``netns`` and ``slow`` like the other multi-host
tests. The helpers are the expert failover test's (``tests/test_multihost_failover.py``).
"""
import time

import pytest

from asap_comm.testing.netns import Hosts, free_port
from asap_comm.testing.service import (calls, end_service, host_health, long_clients, serve_across_hosts,
                                       wait_host_health)

from test_multihost_failover import _metric, _metrics_text, _prompts_and_answers

# PEs: attention 0, 1; expert 2, 3; the front end 4 (node 0's first process). Host 0: the front end and attention
# PE 0; host 1 (the host lost): attention PE 1 alone; host 2: expert PEs 2, 3.
LAYOUT = [2, 1, 2]
ARGS = ["--attention-ranks", "2", "--expert-ranks", "2", "--attention-failover", "--failure-exit-s", "2",
        "--comm-timeout-s", "10", "--worker-stall-s", "5", "--request-timeout-s", "120"]
LOAD_S = 12.0  # 4 s before the loss, 8 s after it


@pytest.mark.slow
@pytest.mark.netns
def test_a_lost_hosts_attention_pe_is_survived_by_the_attention_pe_left():
    """``--attention-failover`` under torchrun on three simulated hosts, ASAP_NET_PEER_TIMEOUT_S = 3. Under load
    from four clients, host 1 (attention PE 1 alone) is cut off (link down: no goodbye). The front end declares
    PE 1 dead and re-admits its requests on attention PE 0; the expert PEs (host 2) stop waiting for PE 1: every
    call is answered 200 with the right token, calls end after the loss, /health says 200, /metrics counts the
    re-admissions, and a SIGTERM to node 0's launcher stops the rest cleanly.

    Regression: across hosts the front end's chunk send to PE 1 could learn of the death (its liveness line)
    before the front end's check of the attention PEs did; the send's PeerFailure failed the whole service (503
    for every call in flight, exit 3)."""
    prompts, want = _prompts_and_answers()
    port = free_port()
    with Hosts(3) as hs:
        front = hs[0]
        procs = serve_across_hosts(hs, port, ARGS, layout=LAYOUT)
        logs = ["", "", ""]
        try:
            health = wait_host_health(front, port, procs, timeout_s=240)
            assert [w["pe"] for w in health["workers"]][:4] == [0, 1, 2, 3], health["workers"]
            load = long_clients(front, port, prompts, LOAD_S)
            time.sleep(4)  # load flows through both attention PEs
            hs[1].link_down()
            t_loss = time.monotonic()
            lines = calls(load, LOAD_S + 200)
            final = host_health(front, port)
            metrics = _metrics_text(front, port)
            hs[1].kill_all()  # the lost host's processes (cut off, they end on their own)
            logs = end_service(hs, procs)
        finally:
            for h in hs.hosts:
                h.kill_all()
    tail = "\n".join(f"--- host {i}:\n{log[-2500:]}" for i, log in enumerate(logs))
    bad = [x for x in lines if x[0] != 200 or x[2] != want[x[1]]]
    assert lines and not bad, (len(lines), bad[:5], tail)
    assert sum(x[4] > t_loss + 5 for x in lines) >= 4, "too few calls after the loss"
    assert final[0] == 200, (final, tail)
    assert "PE 0@asap-host0, PE 1@asap-host1, PE 2@asap-host2, PE 3@asap-host2, PE 4@asap-host0" in logs[0], tail
    assert "stopped cleanly" in logs[0] and "worker failure" not in logs[0], tail
    assert "failover: attention worker PE 1 died" in logs[0], tail
    assert (_metric(metrics, "asap_attention_readmissions_total") or 0) >= 1, metrics[-2000:]
