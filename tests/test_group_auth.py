"""Who may join a group (asap_comm.rendezvous): an outsider who reaches the rendezvous store can neither redirect a
group nor stop it from forming; a value that fails the group secret's check is refused naming its key, and nothing it
names is mapped; the stores a group on one host uses listen on 127.0.0.1 only; without a secret, one host's PEs share
one through a 0600 file that is gone once they joined.

Every spawned PE joins within a bounded time (each join has a timeout) so a hang fails the test."""
import glob
import multiprocessing as mp
import os
import socket
from datetime import timedelta

import pytest
import torch

import asap_comm
from asap_comm.rendezvous import GroupStore, loopback_store, new_secret

CTX = mp.get_context("spawn")
JOIN_S = 90


def _listening_addresses(port: int) -> "set[str]":
    """Local addresses (hex, as /proc/net/tcp writes them) of the sockets that LISTEN on ``port``."""
    out = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _, state = line.split()[1:4]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


_LOOPBACK4 = "0100007F"


def _pe(rank, port, secret, prefix, q, env_secret=None, timeout=20.0):
    """One PE in a spawned process: joins, exchanges a row with the other PE, reports what it saw."""
    if env_secret is not None:
        os.environ["ASAP_GROUP_SECRET"] = env_secret
    else:
        os.environ.pop("ASAP_GROUP_SECRET", None)
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=timeout))  # the test's
        with asap_comm.init(rank, 2, store=store, timeout=timeout, shm_prefix=prefix, group_secret=secret) as comm:
            x = comm.zeros(4, torch.float32)
            comm.put(x, torch.full((4,), float(rank + 1)), 1 - rank)
            comm.barrier()
            left = sorted(glob.glob(f"/dev/shm/{prefix}secret-*"))
            q.put(("ok", rank, x.tolist(), left))
    except Exception as e:
        q.put(("err", rank, type(e).__name__, str(e)))


def _run_pair(port, secrets_, prefix, env_secrets=(None, None), timeout=20.0):
    q = CTX.Queue()
    procs = [CTX.Process(target=_pe, args=(r, port, secrets_[r], prefix, q, env_secrets[r], timeout))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in procs:
            msg = q.get(timeout=JOIN_S)
            got[msg[1]] = msg
        return got
    finally:
        for p in procs:
            p.join(timeout=JOIN_S)
            if p.is_alive():
                p.kill()
                p.join(5)


def test_outsider_writes_cannot_redirect_or_stop_a_group():
    """What used to take a group over (values planted under the keys it would read, a bumped join counter)
    now changes nothing: the group forms and its puts land in its own memory."""
    store = loopback_store(30.0)
    outsider = torch.distributed.TCPStore("127.0.0.1", store.port, None, False)
    for pe in range(2):  # the old layout: a planted heap chunk and control segment per PE
        outsider.set(f"asap/0/chunk/1/{pe}", "/asap-planted:67108864")
        outsider.set(f"asap/0/ctrl/{pe}", "/asap-planted")
        outsider.set(f"asap/0/host/{pe}", "elsewhere")
    outsider.add("asap/join", 1)
    outsider.set("asap/" + "0" * 32 + "/0/host/1", "a guess")
    secret = new_secret()
    prefix = "asap-au" + os.urandom(3).hex() + "-"
    got = _run_pair(store.port, (secret, secret), prefix)
    assert got[0][:3] == ("ok", 0, [2.0] * 4) and got[1][:3] == ("ok", 1, [1.0] * 4), got
    assert glob.glob(f"/dev/shm/{prefix}*") == []


@pytest.mark.parametrize("forged", ["host/1", "ctrl/1", "too long"])
def test_a_value_that_fails_the_check_is_refused_naming_the_key(forged):
    """Someone who learned the key names (by watching the store's traffic) but not the secret: its value is
    refused with CommError naming the key, and the segment it names is never mapped."""
    secret = new_secret()
    store = loopback_store(30.0)
    prefix = "asap-af" + os.urandom(3).hex() + "-"
    member = GroupStore(store, secret.encode(), 2, 5.0)  # PE 1's legitimate writes (it joins first)
    member.join()
    planted = f"/{prefix}planted{os.urandom(4).hex()}"
    victim_seg = asap_comm._native._C.create_segment(planted, asap_comm._native._C.CTRL_BYTES)
    try:
        asap_comm._native._C.ctrl_init(victim_seg.addr, 1, os.getpid())  # a well-formed control block
        raw = store  # the attacker writes straight into the store, with a MAC it had to guess
        if forged == "host/1":
            raw.set(member.prefix + "host/1", b"\0" * 32 + socket.gethostname().encode())
            key = "host/1"
        elif forged == "ctrl/1":
            member.set("host/1", socket.gethostname())
            store.add(member.prefix + "hosts", 1)  # PE 1 read every host (the rendezvous after that exchange)
            raw.set(member.prefix + "ctrl/1", b"\1" * 32 + planted.encode())
            key = "ctrl/1"
        else:
            member.set("host/1", socket.gethostname())
            store.add(member.prefix + "hosts", 1)
            raw.set(member.prefix + "ctrl/1", b"x" * (200 * 1024))
            key = "ctrl/1"
        with pytest.raises(asap_comm.CommError, match=key.replace("/", "/")) as err:
            asap_comm.init(0, 2, store=store, timeout=5.0, shm_prefix=prefix, group_secret=secret)
        text = str(err.value)
        assert ("more than" in text) if forged == "too long" else ("failed authentication" in text), text
        maps = open("/proc/self/maps").read()
        assert maps.count(planted.lstrip("/")) == 1  # only this test's own mapping: init never mapped it
    finally:
        del victim_seg
        asap_comm._native._C.unlink_segment(planted)
    assert [p for p in glob.glob(f"/dev/shm/{prefix}*")] == []


def test_members_with_another_secret_never_meet():
    """Membership is the secret: two PEs with different secrets on one store cannot form a group."""
    store = loopback_store(30.0)
    prefix = "asap-as" + os.urandom(3).hex() + "-"
    got = _run_pair(store.port, (new_secret(), new_secret()), prefix, timeout=3.0)
    assert {got[r][0] for r in (0, 1)} == {"err"}, got
    assert all(got[r][2] == "TimeoutError" for r in (0, 1)), got
    assert glob.glob(f"/dev/shm/{prefix}*") == []


def test_one_host_without_a_secret_shares_one_through_a_private_file_that_is_then_removed():
    store = loopback_store(30.0)
    prefix = "asap-ad" + os.urandom(3).hex() + "-"
    got = _run_pair(store.port, (None, None), prefix)
    assert got[0][:3] == ("ok", 0, [2.0] * 4) and got[1][:3] == ("ok", 1, [1.0] * 4), got
    assert got[0][3] == [] and got[1][3] == []  # rank 0 removed the file once both had joined
    assert glob.glob(f"/dev/shm/{prefix}*") == []


def test_env_secret_is_used_and_a_short_one_is_refused():
    store = loopback_store(30.0)
    prefix = "asap-ae" + os.urandom(3).hex() + "-"
    s = new_secret()
    got = _run_pair(store.port, (None, None), prefix, env_secrets=(s, s))
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    with pytest.raises(ValueError, match="at least 16"):
        asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0, group_secret="short")


def _where_is_my_store(comm):
    return comm._store.port, _listening_addresses(comm._store.port)


def test_stores_of_one_host_groups_listen_on_loopback_only():
    # the store launch() hosts for its children
    [(port, addrs)] = asap_comm.launch(_where_is_my_store, 1, timeout=JOIN_S)
    assert addrs == {_LOOPBACK4}, (port, addrs)
    # the store rank 0 hosts in init(master_addr="127.0.0.1")
    with asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0) as comm:
        assert _listening_addresses(comm._store.port) == {_LOOPBACK4}
    store = loopback_store(5.0)
    assert _listening_addresses(store.port) == {_LOOPBACK4}
