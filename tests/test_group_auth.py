"""Who may join a group (asap_comm.rendezvous): an outsider who reaches the rendezvous store can neither redirect a
group nor stop it from forming; a value that fails the group secret's check is ignored (a wait that gets no authentic
value names the key and what it ignored), and nothing it names is mapped; launch() gives its PEs a store only this
user can reach, and stores rank 0 hosts listen on 127.0.0.1 only; without a secret, one host's PEs share one through a
0600 file that is gone once they joined. (A rogue that jams the store while groups form and run:
test_store_jam.py.)

Every spawned PE joins within a bounded time (each join has a timeout) so a hang fails the test."""
import glob
import os
import socket
from datetime import timedelta

import pytest
import torch

import asap_comm
from asap_comm.rendezvous import loopback_store, new_secret, private_file_store
from asap_comm.testing.faults import CTX, JOIN_S, plant_forged_value, plant_old_layout, run_pair


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


def test_outsider_writes_cannot_redirect_or_stop_a_group():
    """What used to take a group over (values planted under the keys it would read, a bumped join counter)
    now changes nothing: the group forms and its puts land in its own memory."""
    store = loopback_store(30.0)
    plant_old_layout(store.port)  # a planted heap chunk and control segment per PE, a bumped join counter
    secret = new_secret()
    prefix = "asap-au" + os.urandom(3).hex() + "-"
    got = run_pair(store.port, (secret, secret), prefix)
    assert got[0][:3] == ("ok", 0, [2.0] * 4) and got[1][:3] == ("ok", 1, [1.0] * 4), got
    assert glob.glob(f"/dev/shm/{prefix}*") == []


@pytest.mark.parametrize("forged", ["host/1", "ctrl/1", "too long"])
def test_a_value_that_fails_the_check_is_ignored_and_the_wait_names_the_key(forged):
    """Someone who sees the key names (list_keys) but not the secret writes under a real key a value that
    names a well-formed control segment: PE 0 ignores it (never maps the segment) and keeps waiting for the
    authentic value; when none comes, its bounded wait fails naming the key and what it ignored."""
    secret = new_secret()
    store = loopback_store(30.0)
    prefix = "asap-af" + os.urandom(3).hex() + "-"
    key, planted, victim_seg = plant_forged_value(store, secret, prefix, forged)
    try:
        with pytest.raises(asap_comm.TimeoutError, match=key) as err:
            asap_comm.init(0, 2, store=store, timeout=5.0, shm_prefix=prefix, group_secret=secret)
        text = str(err.value)
        assert "ignored" in text, text
        assert ("longer than" in text) if forged == "too long" else ("failed authentication" in text), text
        maps = open("/proc/self/maps").read()
        assert maps.count(planted.lstrip("/")) == 1  # only this test's own mapping: init never mapped it
    finally:
        del victim_seg
        asap_comm._native._C.unlink_segment(planted)
    assert [p for p in glob.glob(f"/dev/shm/{prefix}*")] == []


@pytest.mark.slow
def test_members_with_another_secret_never_meet():
    """Membership is the secret: two PEs with different secrets on one store cannot form a group."""
    store = loopback_store(30.0)
    prefix = "asap-as" + os.urandom(3).hex() + "-"
    got = run_pair(store.port, (new_secret(), new_secret()), prefix, timeout=3.0)
    assert {got[r][0] for r in (0, 1)} == {"err"}, got
    assert all(got[r][2] == "TimeoutError" for r in (0, 1)), got
    assert glob.glob(f"/dev/shm/{prefix}*") == []


@pytest.mark.slow
def test_one_host_without_a_secret_shares_one_through_a_private_file_that_is_then_removed():
    store = loopback_store(30.0)
    prefix = "asap-ad" + os.urandom(3).hex() + "-"
    got = run_pair(store.port, (None, None), prefix)
    assert got[0][:3] == ("ok", 0, [2.0] * 4) and got[1][:3] == ("ok", 1, [1.0] * 4), got
    assert got[0][3] == [] and got[1][3] == []  # rank 0 removed the file once both had joined
    assert glob.glob(f"/dev/shm/{prefix}*") == []


def test_env_secret_is_used_and_a_short_one_is_refused():
    store = loopback_store(30.0)
    prefix = "asap-ae" + os.urandom(3).hex() + "-"
    s = new_secret()
    got = run_pair(store.port, (None, None), prefix, env_secrets=(s, s))
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    with pytest.raises(ValueError, match="at least 16"):
        asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0, group_secret="short")


def _what_is_my_store(comm):
    return type(comm._store).__name__


def test_stores_of_one_host_groups_are_private_or_loopback_only(monkeypatch):
    # launch() gives its children a FileStore in a directory only this user can enter, removed at the end
    made = []

    def recording():
        path, directory = private_file_store()
        st = os.stat(directory)
        made.append((path, directory, st.st_uid, st.st_mode & 0o777))
        return path, directory

    monkeypatch.setattr(asap_comm.rendezvous, "private_file_store", recording)
    assert asap_comm.launch(_what_is_my_store, 2, timeout=JOIN_S) == ["FileStore", "FileStore"]
    [(path, directory, uid, mode)] = made
    assert uid == os.getuid() and mode == 0o700 and os.path.dirname(path) == directory, made
    assert not os.path.exists(directory)
    # the store rank 0 hosts in init(master_addr="127.0.0.1")
    with asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0) as comm:
        assert _listening_addresses(comm._store.port) == {_LOOPBACK4}
    store = loopback_store(5.0)
    assert _listening_addresses(store.port) == {_LOOPBACK4}


class _SlowFirstGet:
    """A store that answers its first ``get`` late (a PE on a loaded host), otherwise the real one."""

    def __init__(self, store, delay_s: float) -> None:
        self._store, self._delay = store, delay_s

    def get(self, key):
        if self._delay:
            import time
            time.sleep(self._delay)
            self._delay = 0.0
        return self._store.get(key)

    def __getattr__(self, name):
        return getattr(self._store, name)


def _refusing_pe(rank, port, secret, q):
    os.environ["ASAP_HOST_ID"] = f"host-{rank}"  # two "hosts": backend='shm' must refuse on both
    try:
        if rank == 0:  # hosts the store, and leaves as soon as it refuses
            asap_comm.init(0, 2, master_addr="127.0.0.1", master_port=port, timeout=20, backend="shm",
                           group_secret=secret)
        else:
            store = _SlowFirstGet(torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=20)),
                                  3.0)
            asap_comm.init(1, 2, store=store, timeout=20, backend="shm", group_secret=secret)
        q.put((rank, "joined"))
    except Exception as e:
        q.put((rank, type(e).__name__, str(e)))


@pytest.mark.slow
def test_a_refusal_reaches_every_pe_as_commerror_even_a_slow_one():
    """backend='shm' across two hosts: PE 1 reads the store late (a loaded host). Before, PE 0 (hosting the store)
    refused and exited first, and PE 1's read failed with 'Broken pipe' as a TimeoutError; now every PE reads
    every host before any refuses, and both get the documented CommError."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = CTX.Queue()
    secret = new_secret()
    procs = [CTX.Process(target=_refusing_pe, args=(r, port, secret, q)) for r in range(2)]
    procs[0].start()
    import time
    time.sleep(1.0)  # PE 0 hosts the store before PE 1 connects
    procs[1].start()
    try:
        got = dict((m[0], m[1:]) for m in (q.get(timeout=JOIN_S) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=JOIN_S)
            if p.is_alive():
                p.kill()
    for r in (0, 1):
        assert got[r][0] == "CommError" and "backend='shm' needs every PE on one host" in got[r][1], got
