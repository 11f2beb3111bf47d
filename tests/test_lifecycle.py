"""Segments, bootstrap failures, zombies, packaging errors; launch scripts without a main guard, ranks that
outlive a killed launcher, a second init on an open address, collective calls made on only some PEs."""
import os
import re
import stat
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import asap_comm
from asap_comm import _C, CommError, PeerFailure
from asap_comm.testing.service import alive
from distributed_utils import run, shm_files

ROOT = Path(__file__).resolve().parents[1]


def test_segments_are_0600_exclusive_and_unlinked():
    name = "/asap-test-" + os.urandom(8).hex()
    m = _C.create_segment(name, 8192)
    try:
        st = os.stat("/dev/shm" + name)
        assert stat.S_IMODE(st.st_mode) == 0o600
        with pytest.raises(RuntimeError, match="File exists"):
            _C.create_segment(name, 8192)  # O_EXCL: never reuses a name
        with pytest.raises(RuntimeError, match="size"):
            _C.map_segment(name, 4096)  # a peer's segment must have the announced size
    finally:
        assert _C.unlink_segment(name)
    assert not os.path.exists("/dev/shm" + name)
    assert m.size == 8192


def test_init_timeout_when_a_peer_never_comes_leaves_nothing():
    prefix = "asap-t" + os.urandom(4).hex() + "-"
    t0 = time.monotonic()
    with pytest.raises(asap_comm.TimeoutError, match="init: waiting for PE 1's host"):
        asap_comm.init(0, 2, master_addr="127.0.0.1", master_port=0, timeout=1.0, shm_prefix=prefix)
    assert time.monotonic() - t0 < 120, "init ignored its 1-s bound"  # a hang guard, not a timing check
    assert shm_files(prefix) == []


def test_zombie_peer_turns_wait_into_peer_failure():
    """PE 1 exits without close() and is not reaped (a zombie): PE 0's wait fails fast."""
    store = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=20), wait_for_workers=False)
    prefix = "asap-z" + os.urandom(4).hex() + "-"
    code = textwrap.dedent(f"""
        import os, asap_comm
        comm = asap_comm.init(1, 2, master_addr="127.0.0.1", master_port={store.port}, timeout=20,
                              shm_prefix={prefix!r})
        sig = comm.signals(1)
        comm.signal_op(sig, 0, 1, "set", 0)
        comm.signal_wait_until(sig, 0, "==", 2)   # PE 0 says: go
        os._exit(0)                               # no close(): looks like a crash
    """)
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        comm = asap_comm.init(0, 2, store=store, timeout=20, shm_prefix=prefix)
        sig = comm.signals(1)
        comm.signal_wait_until(sig, 0, "==", 1)
        comm.signal_op(sig, 0, 2, "set", 1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until it is a zombie, without reaping it
            state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.01)
        assert state == "Z"
        # PeerFailure (not TimeoutError) means the liveness check fired, not the wait's 60-s bound
        with pytest.raises(PeerFailure, match="PE 1 died") as ei:
            comm.signal_wait_until(sig, 0, "==", 3, timeout=60)
        assert ei.value.pe == 1 and ei.value.reason == "died"
        assert not comm.peer_alive(1)
        comm.close()
    finally:
        child.wait(timeout=20)
    assert shm_files(prefix) == []


def _barrier_timeout(comm):
    go = comm.signals(1)
    if comm.rank == 1:  # late on purpose: joins only after PE 0's barrier has timed out
        comm.signal_wait_until(go, 0, "==", 1, timeout=60)
        comm.barrier(timeout=60)
        return None
    t0 = time.monotonic()
    msg = None
    try:
        comm.barrier(timeout=0.3)
    except asap_comm.TimeoutError as e:
        msg = str(e)
    took = time.monotonic() - t0
    comm.signal_op(go, 0, 1, "set", 1)
    comm.barrier(timeout=60)  # the late PE completes the round it was in; both go on
    return msg, took


def test_barrier_timeout():
    (msg, took), _ = run(_barrier_timeout, 2)
    assert msg is not None, "the barrier completed without PE 1"
    assert msg.startswith("barrier: waiting for barrier #") and "timed out" in msg
    assert took >= 0.3, f"the barrier gave up after {took:.3f} s, before its 0.3-s bound"


def test_import_without_extension_says_how_to_build(tmp_path):
    pkg = tmp_path / "asap_comm"
    pkg.mkdir()
    for f in (ROOT / "asap_comm").glob("*.py"):
        (pkg / f.name).write_text(f.read_text())
    r = subprocess.run([sys.executable, "-S", "-c", "import asap_comm"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode != 0
    assert "ImportError: asap_comm: the native extension asap_comm._C is not built" in r.stderr
    assert "pip install -e ." in r.stderr


def test_core_does_not_import_models():
    for f in (ROOT / "asap_comm").rglob("*.py"):
        text = f.read_text()
        assert "import models" not in text and "from models" not in text, f


def _leader_group(comm, note):
    if comm.rank == 1:
        os._exit(7)  # a worker dies
    if comm.rank == 0:  # the leader sees it, and goes on for a while (without leader=, it would be stopped)
        deadline = time.monotonic() + 20
        while comm.peer_state(1) != "died" and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.5)
        Path(note).write_text(comm.peer_state(1))
        return "leader"
    time.sleep(60)  # a worker that would outlive the leader: stopped after leader_grace
    Path(note + ".late").write_text("late")
    return "late"


@pytest.mark.slow
def test_launch_leader_outlives_a_dead_worker_and_stops_the_rest(tmp_path):
    from asap_comm import LaunchError
    note = tmp_path / "leader"
    with pytest.raises(LaunchError) as e:
        asap_comm.launch(_leader_group, 3, str(note), timeout=120, leader=0, leader_grace=1.0)
    assert e.value.rank == 1 and "exited with code 7" in str(e.value)
    assert note.read_text() == "died", "the leader was stopped with the dead worker"
    assert not Path(str(note) + ".late").exists(), "the sleeping worker was not stopped after the leader ended"
    with pytest.raises(ValueError, match="leader=3"):
        asap_comm.launch(_leader_group, 3, str(note), leader=3)


def _pe_facts(comm, name):
    print(f"PE {comm.rank} says {os.environ.get(name)}", file=sys.stderr, flush=True)
    print(f"PE {comm.rank} out", flush=True)
    return os.environ.get(name), os.getppid(), os.getcwd(), os.sched_getaffinity(0)


def test_launch_pes_get_the_launchers_environment_and_output_of_now(tmp_path, monkeypatch, capfd):
    """A fork server keeps the environment, the standard output and error and the CPU affinity it started with
    (the first launch's); each PE still gets the launcher's at its own launch: a variable set, changed or removed
    since is seen so, the working directory and the CPU affinity are the launcher's, and what a PE prints reaches
    the launcher's output as it is now (here pytest's capture of this test, set up after the server started in
    an earlier test)."""
    name = "ASAP_TEST_LAUNCH_ENV"
    monkeypatch.setenv(name, "first")
    assert asap_comm.launch(_pe_facts, 2, name, timeout=120)[0][0] == "first"  # the server may start here
    monkeypatch.setenv(name, "second")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        facts = asap_comm.launch(_pe_facts, 2, name, timeout=120)
    finally:
        os.sched_setaffinity(0, allowed)
    out, err = capfd.readouterr()
    assert sorted(re.findall(r"PE (\d) says (\w+)", err)) == [("0", "second"), ("1", "second")]  # lines may mix
    assert sorted(re.findall(r"PE (\d) out", out)) == ["0", "1"]
    assert [f[0] for f in facts] == ["second", "second"]
    assert {f[2] for f in facts} == {str(tmp_path)}
    assert [f[3] for f in facts] == [{min(allowed)}] * 2  # the launcher's CPU affinity of the time
    monkeypatch.delenv(name)
    assert [f[0] for f in asap_comm.launch(_pe_facts, 2, name, timeout=120)] == [None, None]


def test_launch_start_method_is_forkserver_or_spawn_as_asked(monkeypatch):
    """Where the platform has it, PEs are forked from the fork server (their parent is not the launcher);
    ``ASAP_START_METHOD=spawn`` starts each as a child of the launcher; any other value is refused before anything
    is created."""
    import multiprocessing as mp
    import tempfile

    def made() -> tuple:  # what a launch makes: its store's directory, its segments
        return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("asap-store-")}, shm_files("asap-")

    if "forkserver" in mp.get_all_start_methods():
        assert all(f[1] != os.getpid() for f in asap_comm.launch(_pe_facts, 2, "HOME", timeout=120))
    monkeypatch.setenv("ASAP_START_METHOD", "spawn")
    assert [f[1] for f in asap_comm.launch(_pe_facts, 2, "HOME", timeout=120)] == [os.getpid()] * 2
    monkeypatch.setenv("ASAP_START_METHOD", "fork")
    before = made()
    with pytest.raises(ValueError, match=r"launch: \$ASAP_START_METHOD='fork' is not one of \[.*'spawn'\]"):
        asap_comm.launch(_pe_facts, 2, "HOME", timeout=120)
    assert made() == before


# --------------------------------------------------------------------------
# launch: an unguarded script says so; ranks die with a launcher killed by a signal
# --------------------------------------------------------------------------
@pytest.mark.slow
def test_launch_without_main_guard_says_so(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        import asap_comm

        def work(comm):
            return comm.rank

        print(asap_comm.launch(work, 2, timeout=60))
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert p.returncode != 0
    assert 'no `if __name__ == "__main__":` guard' in p.stderr, p.stderr[-2000:]
    assert "LaunchError" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_die_with_a_launcher_killed_by_a_signal(tmp_path, method):
    """A launcher killed by SIGKILL (or an unhandled SIGTERM) runs no cleanup: its ranks, daemonic children, used to
    live on, polling forever. The ranks now exit as soon as it is gone (a thread of each waits on its parent
    sentinel), even a rank that ignores SIGTERM (as a service's workers do), after removing any of the group's
    shared-memory segments still named (a group's segments are unlinked once every peer has mapped them, so only a
    launcher killed while the group starts could leave one). With the fork server, the PEs' parent is the server,
    which lives on while they do: a parent-death signal would never come."""
    import glob
    import signal

    script = tmp_path / "launcher.py"
    pids = tmp_path / "pids"
    script.write_text(textwrap.dedent(f"""
        import os, signal, time
        import asap_comm

        def work(comm):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as asap_comm.serving.server's workers
            comm.empty((1024,))  # a heap segment in /dev/shm
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{comm._shm_prefix}} {{os.environ['ASAP_LAUNCH_GUARD_FILE']}}\\n")
            time.sleep(120)

        if __name__ == "__main__":
            asap_comm.launch(work, 2, timeout=300)
    """))
    log = open(tmp_path / "launcher.log", "w")
    p = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "ASAP_START_METHOD": method})
    try:
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and p.poll() is None
               and (not pids.exists() or len(pids.read_text().splitlines()) < 2)):  # a line per rank
            time.sleep(0.1)
        assert pids.exists(), (tmp_path / "launcher.log").read_text()[-3000:]
        lines = [x.split() for x in pids.read_text().splitlines()]
        ranks = [int(pid) for pid, _, _ in lines]
        (prefix,) = {pfx for _, pfx, _ in lines}
        (guard,) = {g for _, _, g in lines}
        assert len(ranks) == 2
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        log.close()

    deadline = time.monotonic() + 30  # hang guard only: the signal arrives at once
    while time.monotonic() < deadline and any(alive(r) for r in ranks):
        time.sleep(0.1)
    left = [r for r in ranks if alive(r)]
    for r in left:
        os.kill(r, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"
    segments = glob.glob(f"/dev/shm/{prefix}*")
    for path in segments:
        os.unlink(path)
    assert not segments, f"the killed launcher's group left {segments}"
    assert not os.path.exists(guard), "the killed launcher's guard file was left"


# --------------------------------------------------------------------------
# a second init on the same address, collective calls made on only some PEs
# --------------------------------------------------------------------------
def test_second_init_on_the_same_address_names_the_open_communicator():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=port, timeout=5) as c:
        with pytest.raises(CommError, match=rf"init: a communicator is already open on 127.0.0.1:{port} in this "
                                            rf"process \(id {c.id}, rank 0 of 1"):
            asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=port, timeout=5)
        assert not c.closed


def _mismatched(comm, kind):
    comm.zeros((4,))
    if kind == "different":
        if comm.rank == 0:
            comm.zeros((8,), torch.float64)
        else:
            comm.signals(2)
    else:  # only PE 0 makes the call
        if comm.rank == 0:
            comm.signals(3)
        else:
            time.sleep(3)
    return "returned"


@pytest.mark.slow
def test_collective_call_mismatch_names_the_calls():
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_mismatched, 2, "different")
    text = str(ei.value)
    assert "collective calls do not match" in text
    assert "zeros(shape=(8,), dtype=torch.float64)" in text and "signals(n=2)" in text
    with pytest.raises(asap_comm.LaunchError) as ei:
        run(_mismatched, 2, "missing", comm_timeout=1.0)
    text = str(ei.value)
    assert "signals: collective call #2, signals(n=3), did not complete" in text
    assert "PE 1 has made 1 collective calls (its last: zeros(shape=(4,), dtype=torch.float32))" in text
