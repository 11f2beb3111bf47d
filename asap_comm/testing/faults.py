"""Fault recipes shared by the tests and ``bench/faults.py``: each builds one fault the way an attacker or a bad
day would, and leaves the judging to its caller (a test asserts, the fault suite reports).

* the rendezvous store: :func:`plant_old_layout` (an outsider's keys before a group forms),
  :func:`plant_forged_value` (a value with a wrong MAC under a real key), :func:`run_pair` (two PEs that join a
  given store and exchange a row); :func:`spawn` / :func:`collect` (spawned PEs that each report one message);
* the network: :data:`ROGUE_PEER` / :func:`rogue_peer` / :func:`victim` (a UCX peer outside the group claiming
  PE 1), :func:`stream_in_order` (messages whose order and completeness the receiver checks, for lossy links);
* the host: :func:`cpu_hogs` (a busy loop at nice 0 on every core, or at a CPU share), :func:`cpu_seconds` (what a
  process used), :func:`in_small_shm` (a private, small
  ``/dev/shm``). HTTP calls from inside a simulated host: :mod:`asap_comm.testing.service`.

Every wait here is bounded. ``victim`` and ``stream_in_order`` run on PEs of
:func:`asap_comm.testing.netns.run_across_hosts`; ``_pe`` runs in a spawned process.
"""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import random
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch

import asap_comm

CTX = mp.get_context("spawn")
JOIN_S = 90  # the longest a spawned PE of run_pair may take to report


# ----------------------------------------------------------------------------- the rendezvous store
def plant_old_layout(port: int) -> None:
    """As an outsider who reaches the store on 127.0.0.1:``port``: plant the keys a group used to read before
    keys were derived from the group secret (a heap chunk and control segment per PE, a host name), bump the
    join counter, and guess a key under a made-up tag."""
    outsider = torch.distributed.TCPStore("127.0.0.1", port, None, False)
    for pe in range(2):
        outsider.set(f"asap/0/chunk/1/{pe}", "/asap-planted:67108864")
        outsider.set(f"asap/0/ctrl/{pe}", "/asap-planted")
        outsider.set(f"asap/0/host/{pe}", "elsewhere")
    outsider.add("asap/join", 1)
    outsider.set("asap/" + "0" * 32 + "/0/host/1", "a guess")


def plant_forged_value(store, secret: str, prefix: str, forged: str) -> tuple:
    """As an outsider who sees the group's key names (``list_keys`` shows them; here a ``GroupStore`` with the
    secret plays PE 1 up to the forgery) but not the secret: from a thread, PE 1 joins PE 0's group when PE 0
    starts (call ``init`` as PE 0 of 2 on ``store`` next), then PE 1 stops and a value that fails the check
    lands under a real key, naming a well-formed control segment. ``forged``: ``"host/1"`` (a wrong MAC on PE
    1's host name), ``"ctrl/1"`` (a wrong MAC on PE 1's control segment), ``"too long"`` (200 KiB under
    ``ctrl/1``). PE 0 ignores the value and its wait for the key runs out (``TimeoutError`` naming the key and
    what it ignored). Returns ``(key, planted segment name, segment)``: keep the segment referenced while PE 0
    joins, then unlink it (``_C.unlink_segment(name)``)."""
    import threading

    from asap_comm.rendezvous import GroupStore

    if forged not in ("host/1", "ctrl/1", "too long"):
        raise ValueError(f"plant_forged_value: forged={forged!r} must be 'host/1', 'ctrl/1' or 'too long'")
    planted = f"/{prefix}planted{os.urandom(4).hex()}"
    seg = asap_comm._native._C.create_segment(planted, asap_comm._native._C.CTRL_BYTES)
    asap_comm._native._C.ctrl_init(seg.addr, 1, os.getpid())  # a well-formed control block
    own = store.clone()  # PE 1's own connection (PE 0 uses ``store`` in the caller's thread)

    def pe1() -> None:
        member = GroupStore(own, secret.encode(), 1, 2, 10.0)
        try:
            member.join()  # waits for PE 0's answer
            if forged == "host/1":
                own.set(member.prefix + "host/1", b"\0" * 32 + socket.gethostname().encode())
                return
            member.set("host/1", socket.gethostname())
            member.rendezvous("hosts")
            if forged == "ctrl/1":
                own.set(member.prefix + "ctrl/1", b"\1" * 32 + planted.encode())
            else:
                own.set(member.prefix + "ctrl/1", b"x" * (200 * 1024))
            time.sleep(0.5)  # PE 0 has read what it needed from PE 1's keeper before it stops
        except Exception:
            pass
        finally:
            member.close()

    threading.Thread(target=pe1, name="plant-forged-pe1", daemon=True).start()
    return ("host/1" if forged == "host/1" else "ctrl/1"), planted, seg


def spawn(target, args: list) -> tuple:
    """One spawned process per tuple of ``args``, each running ``target(*args[i], q)``; ``(q, procs)`` for
    :func:`collect`. ``target`` puts one message on ``q`` whose second item is its rank."""
    q = CTX.Queue()
    procs = [CTX.Process(target=target, args=(*a, q)) for a in args]
    for p in procs:
        p.start()
    return q, procs


def collect(q, procs) -> dict:
    """``{rank: message}`` of the processes :func:`spawn` started, each wait bounded by :data:`JOIN_S` (a
    process that did not report fails with ``queue.Empty``); then every process is joined (killed past the
    bound)."""
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


def _pe(rank, port, secret, prefix, env_secret, timeout, q):
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


def run_pair(port, secrets_, prefix, env_secrets=(None, None), timeout=20.0) -> dict:
    """Two PEs (spawned processes) join the store on 127.0.0.1:``port`` with ``secrets_[r]`` (and
    ``$ASAP_GROUP_SECRET`` = ``env_secrets[r]``), each puts ``rank + 1`` into the other's row. Returns
    ``{rank: ("ok", rank, row it holds, secret files left) or ("err", rank, exception type, message)}``."""
    return collect(*spawn(_pe, [(r, port, secrets_[r], prefix, env_secrets[r], timeout) for r in range(2)]))


# ----------------------------------------------------------------------------- the network
ROGUE_PEER = r"""
import os, sys, time, torch
import asap_comm
from asap_comm._native import _C
from asap_comm.comm import load_net
addr = bytes.fromhex(open(sys.argv[1]).read())
tls, _ = load_net("a rogue peer")
g = _C.Group(1, 2)  # claims to be PE 1 of the victim's group
ctrl = _C.create_segment("/asap-rogue-" + os.urandom(8).hex(), _C.CTRL_BYTES)
_C.ctrl_init(ctrl.addr, 1, os.getpid())
g.set_peer(1, ctrl.addr, os.getpid())
eng = _C.NetEngine(g, ctrl.addr, 5.0, tls)
eng.connect(0, addr)
eng.authenticate(0)  # (its own side: it trusts the victim; the victim does not trust it)
junk = torch.full((16,), 666.0)
eng.put(0, 1, 0, junk, 0, 64)                 # into the victim's first heap chunk
eng.signal(0, 1, 64, 7, 0, False, 5.0)        # and a signal word after it
eng.handshake_send(0, True, b"\0" * 32)       # a forged answer to a challenge nobody sent it
for _ in range(50):
    eng.poll()
    time.sleep(0.01)
eng.shutdown()
print("rogue done", flush=True)
"""
"""A process outside the group that knows PE 0's network address (``argv[1]``: a file with it in hex, as a
sniffer of the store would learn it) connects claiming to be PE 1 and sends a put, a signal and a forged handshake
answer."""


def victim(comm, out_dir):
    """A PE of a two-PE group that a rogue peer visits: PE 0 publishes its address in ``out_dir/addr`` and waits for
    ``out_dir/rogue-done``. Returns whether the heap chunk the rogue wrote to stayed zero, and net_stats()."""
    x = comm.zeros(32, torch.float32)  # heap chunk 0 = region 1: bytes 0..127
    comm.barrier()
    if comm.rank == 0:
        with open(os.path.join(out_dir, "addr"), "w") as f:
            f.write(comm._net.address().hex())
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "rogue-done")) and time.monotonic() < deadline:
            time.sleep(0.05)
    comm.barrier(timeout=90)
    untouched = bool(torch.equal(x, torch.zeros(32)))
    comm.barrier()
    return {"untouched": untouched, "stats": comm.net_stats()}


def rogue_peer(out_dir: str, host: int = 1):
    """A ``during`` for ``run_across_hosts(..., victim, out_dir)``: once PE 0 published its address, run
    :data:`ROGUE_PEER` on simulated host ``host``; its output goes to ``out_dir/rogue-done``."""
    def during(hs, procs):
        deadline = time.monotonic() + 90
        while not os.path.exists(os.path.join(out_dir, "addr")):
            assert time.monotonic() < deadline, "PE 0 never published its address"
            assert all(p.poll() is None for p in procs), "a PE ended early"
            time.sleep(0.05)
        p = hs[host].popen([sys.executable, "-c", ROGUE_PEER, os.path.join(out_dir, "addr")], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
        text = p.communicate(timeout=60)[0]
        with open(os.path.join(out_dir, "rogue-done"), "w") as f:
            f.write(text)
        assert p.returncode == 0 and "rogue done" in text, text
    return during


def stream_in_order(comm, num_messages: int, num_rows: int) -> dict:
    """Two PEs (one per host): each in turn streams to the other ``num_messages`` mailbox messages through a
    4-slot inbox (back-pressure; tag = sequence number, payload = the sender's rank and the number), then
    ``num_rows`` rows with ``put_signal`` (signal = rows sent). The receiver checks every message arrives once,
    in order, with its payload, and that each row is complete when its signal is seen. Returns
    ``{"problems", "messages", "rows", "states", "stats"}`` (what this PE received, peers' states, net_stats())."""
    r, peer = comm.rank, 1 - comm.rank
    box = comm.mailbox(256, 4)
    rows = comm.zeros((num_rows, 64), torch.int32)
    sig = comm.signals(1)
    problems, got_msgs, got_rows = [], 0, 0
    rng = random.Random(r)
    comm.barrier()
    for sender in (0, 1):
        if r == sender:
            for i in range(num_messages):
                box.send(peer, torch.full((i % 32 + 1,), float(r * 1_000_000 + i)), tag=i, timeout=120)
            for i in range(num_rows):
                comm.put_signal(rows[i], torch.full((64,), i * 10 + r, dtype=torch.int32), peer, sig, 0, i + 1,
                                op="set")
        else:
            for want in range(num_messages):
                msg = box.recv(timeout=120)
                src, tag, data = msg.src, msg.tag, msg.tensor.clone()
                msg.release()
                if (src, tag) != (peer, want) or not torch.equal(
                        data, torch.full((want % 32 + 1,), float(peer * 1_000_000 + want))):
                    problems.append(f"message {want}: got #{tag} from PE {src}")
                    break
                got_msgs += 1
                if rng.random() < 0.01:
                    time.sleep(0.002)  # let the inbox fill: back-pressure under loss
            seen = 0
            while seen < num_rows:
                v = comm.signal_wait_until(sig, 0, ">", seen, timeout=120)
                for i in range(seen, v):
                    if not torch.equal(rows[i], torch.full((64,), i * 10 + peer, dtype=torch.int32)):
                        problems.append(f"row {i} incomplete when signal {v} was seen")
                        break
                got_rows += v - seen
                seen = v
            if box.poll() is not None:
                problems.append("a message arrived twice")
        comm.barrier(timeout=120)
    states = [comm.peer_state(pe) for pe in range(comm.world_size)]
    comm.quiet()
    return {"problems": problems, "messages": got_msgs, "rows": got_rows, "states": states,
            "stats": comm.net_stats()}


# ----------------------------------------------------------------------------- the host
def cpu_hogs(seconds: float, count: "int | None" = None, duty: float = 1.0) -> "list[subprocess.Popen]":
    """``count`` (default: one per core) busy loops at nice 0 that end by themselves after ``seconds``; the
    caller waits for (or kills) them. With ``duty`` < 1 each loop is busy that fraction of every 10 ms and sleeps
    the rest (a hog of a given CPU share)."""
    if not 0.0 < duty <= 1.0:
        raise ValueError(f"cpu_hogs: duty={duty!r} must be in (0, 1]")
    code = (f"import time\nt = time.monotonic() + {seconds}\nbusy, idle = {duty} * 0.01, {1.0 - duty} * 0.01\n"
            "while time.monotonic() < t:\n"
            "    u = time.monotonic() + busy\n"
            "    while time.monotonic() < u: pass\n"
            "    if idle > 0: time.sleep(idle)\n")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count or os.cpu_count() or 2)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def in_small_shm(size: str, argv: "list[str]", timeout: float, cwd: "str | None" = None) -> subprocess.CompletedProcess:
    """Run ``argv`` with a private ``/dev/shm`` of ``size`` (a tmpfs in a mount namespace of its own; needs root
    and ``unshare``)."""
    script = f'mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec "$@"'
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)
