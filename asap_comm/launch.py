"""One-host launcher: run ``fn(comm, *args)`` in ``world_size`` new processes."""
from __future__ import annotations

import atexit
import glob
import multiprocessing as mp
import os
import pickle
import secrets
import shutil
import signal
import tempfile
import time
import traceback
from multiprocessing.connection import wait as mp_wait

from .errors import LaunchError, PeerFailure, TimeoutError

__all__ = ["launch"]

# Set for the children of launch(): the file where a child that re-ran an
# unguarded script (and so called launch() while being spawned) says so. One
# file per launching process for its whole life: a fork server keeps the
# environment it started with, so the path its children see must stay valid.
_GUARD_ENV = "ASAP_LAUNCH_GUARD_FILE"
_guard_path: "str | None" = None

# How a PE starts. "forkserver" (the default where the platform has it): a
# server process, started by the first launch() of a process, imports torch
# once (_PRELOAD) and forks each PE from there, so a PE starts in ~0.1 s instead
# of re-importing torch (about 1.3 s of CPU each, on every launch). "spawn": a
# fresh interpreter per PE. ASAP_START_METHOD chooses.
_START_ENV = "ASAP_START_METHOD"
_START_METHODS = ("forkserver", "spawn")
_PRELOAD = ["torch"]
_UNGUARDED = ("the script that calls asap_comm.launch has no `if __name__ == \"__main__\":` guard: each spawned "
              "process re-imports it and ran launch() again instead of its rank's work. Put the script's top-level "
              "code under `if __name__ == \"__main__\":`")


def _report_unguarded() -> None:
    """In a child being spawned: the main script called launch() at import time."""
    try:
        with open(os.environ[_GUARD_ENV], "a") as f:
            f.write("unguarded\n")
    except OSError:
        pass
    raise RuntimeError(f"asap_comm.launch: {_UNGUARDED}")


def _die_with_launcher(shm_prefix: str) -> None:
    """This PE exits as soon as its launcher is gone, after removing the group's shared-memory segments still named
    (a launcher killed by a signal runs no cleanup, and nothing else would remove them); its daemonic siblings do
    the same, so none lives on polling for work that never comes. A thread waits on the parent sentinel that
    multiprocessing gives each child it starts (spawned or forked by the fork server alike): the launcher holds
    its other end until it has stopped its PEs, so it reads end-of-file only when the launcher died. The thread
    runs whatever the PE's main thread is blocked in, and signals are left alone (a service's ranks ignore
    SIGTERM: their front end stops them)."""
    import threading

    from .bootstrap import unlink_quietly

    parent = mp.parent_process()
    if parent is None:  # not started by multiprocessing
        return

    def watch() -> None:
        while True:
            mp_wait([parent.sentinel])
            try:
                if os.read(parent.sentinel, 4096):
                    continue  # not end-of-file (nothing writes there after the start; read on)
            except OSError:
                pass
            _cleanup_segments(shm_prefix)
            if os.environ.get(_GUARD_ENV):  # the dead launcher's guard file: its exit handler did not run
                unlink_quietly(os.environ[_GUARD_ENV])
            os._exit(128 + signal.SIGHUP)  # as a hang-up: the other end is gone

    threading.Thread(target=watch, name="asap-launcher-watch", daemon=True).start()


class _Fd:
    """One of the launcher's file descriptors, handed to a PE as multiprocessing hands a pipe: the PE gets its
    own duplicate (``detach()``)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> int:
        return dup.detach()


def _std_fds() -> list:
    """The launcher's standard output and error as they are now (None for one that is closed)."""
    out: list = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
            out.append(_Fd(fd))
        except OSError:
            out.append(None)
    return out


def _child(fn, rank, world_size, store_path, args, conn, shm_prefix, comm_timeout, secret, environ, std_fds,
           cpus):
    # Runs in a started PE (spawned, or forked by the fork server). The fork server keeps the environment, the
    # standard output and error and the CPU affinity it started with (the first launch's): the PE takes the
    # launcher's of now.
    os.environ.clear()
    os.environ.update(environ)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    for target, fd in zip((1, 2), std_fds):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)
    _die_with_launcher(shm_prefix)
    from datetime import timedelta

    from torch.distributed import FileStore

    from .comm import init

    try:
        store = FileStore(store_path, -1)  # in a directory only this user can enter (rendezvous.private_file_store)
        store.set_timeout(timedelta(seconds=comm_timeout))
        with init(rank, world_size, store=store, timeout=comm_timeout, shm_prefix=shm_prefix,
                  group_secret=secret) as comm:
            result = fn(comm, *args)
        # Plain pickle, by value: multiprocessing's pickler would share tensor
        # storage through file descriptors that die with this process.
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException as e:  # report everything, KeyboardInterrupt included
        try:
            conn.send_bytes(pickle.dumps(("err", type(e).__name__, str(e), traceback.format_exc(),
                                          isinstance(e, PeerFailure))))
        except Exception:
            pass
        conn.close()
        os._exit(1)
    conn.close()


def _cleanup_segments(prefix: str) -> list[str]:
    left = glob.glob(f"/dev/shm/{prefix}*")
    for path in left:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return left


def _start_context():
    """The multiprocessing context PEs start in: ``$ASAP_START_METHOD``, else ``forkserver`` where the platform
    has it (``spawn`` otherwise). ValueError names a value that is neither."""
    have = [m for m in _START_METHODS if m in mp.get_all_start_methods()]
    method = os.environ.get(_START_ENV) or have[0]
    if method not in have:
        raise ValueError(f"launch: ${_START_ENV}={method!r} is not one of {have}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first launch of this process
    return ctx


def _guard_file() -> str:
    """This process's guard file (see ``_GUARD_ENV``), emptied; removed when the process exits."""
    global _guard_path
    if _guard_path is not None and os.path.exists(_guard_path):
        open(_guard_path, "w").close()
        return _guard_path
    from .bootstrap import unlink_quietly

    fd, _guard_path = tempfile.mkstemp(prefix="asap-launch-")
    os.close(fd)
    atexit.register(unlink_quietly, _guard_path)
    return _guard_path


def _stop(procs, grace: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(grace)


def launch(fn, world_size: int, *args, timeout: float = 120.0, comm_timeout: float = 30.0,
           leader: "int | None" = None, leader_grace: float = 10.0) -> list:
    """Run ``fn(comm, *args)`` on ``world_size`` PEs of one host; return their results by rank.

    Each PE is a new process that imports the main script afresh, as multiprocessing's ``spawn`` does, so ``fn``
    and ``args`` must be picklable: define ``fn`` at module level in an importable module or a script file (not
    ``python -`` or a notebook cell), and guard the script's top level with ``if __name__ == "__main__":``. By
    default (``forkserver``, where the platform has it) the PEs are forked from a server process that the first
    ``launch()`` of a process starts and that has imported torch once, so later groups start in a fraction of a
    second; each PE still gets the launcher's current environment, working directory, ``sys.argv``, standard
    output and error, and CPU affinity (other process attributes, such as resource limits, are the server's: the
    first launch's). ``ASAP_START_METHOD=spawn`` starts a fresh interpreter per PE instead.

    Return values travel back pickled by value. The store is a ``FileStore`` in a fresh directory only this user
    can enter (no port: no other user can reach it), removed at the end, and a fresh group secret
    (``asap_comm.rendezvous``) reaches each child through its start arguments, never the environment. If any rank
    raises or dies, the others are stopped and :class:`asap_comm.LaunchError` is raised with that rank's traceback
    (the root cause is preferred over the ``PeerFailure`` it caused elsewhere). If the ranks are not done within
    ``timeout`` seconds they are killed and ``asap_comm.TimeoutError`` is raised. ``comm_timeout`` is each
    communicator's default wait bound. ``leader``: a rank that supervises the others (a service's front end): the
    failure of another rank does not stop the group (the leader sees it and decides), and once the leader has
    ended the others get ``leader_grace`` seconds to end before they are stopped; failures are raised at the end
    as usual. A rank stopped that way has no result (``None``). A PE whose launcher dies exits at once.
    Shared-memory segments of the run are removed whatever happens.
    """
    if os.environ.get(_GUARD_ENV) and getattr(mp.current_process(), "_inheriting", False):
        _report_unguarded()
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"launch: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"launch: world_size={world_size} must be >= 1")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    if not timeout > 0:
        raise ValueError(f"launch: timeout={timeout!r} must be > 0")
    if leader is not None and (isinstance(leader, bool) or not isinstance(leader, int)
                               or not 0 <= leader < world_size):
        raise ValueError(f"launch: leader={leader!r} must be None or a rank in [0, {world_size})")
    ctx = _start_context()
    from .rendezvous import new_secret, private_file_store

    store_path, store_dir = private_file_store()
    secret = new_secret()
    prefix = f"asap-{secrets.token_hex(6)}-"
    procs, conns = [], []
    guard_file = _guard_file()
    old_env = os.environ.get(_GUARD_ENV)
    os.environ[_GUARD_ENV] = guard_file  # inherited by the children
    try:
        for rank in range(world_size):
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"asap-pe{rank}",
                            args=(fn, rank, world_size, store_path, args, w, prefix, comm_timeout, secret,
                                  dict(os.environ), _std_fds(),
                                  os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None),
                            daemon=True)
            p.start()
            w.close()
            procs.append(p)
            conns.append(r)
        try:
            return _collect(procs, conns, timeout, leader, leader_grace)
        except LaunchError as e:
            if e.exitcode is not None and os.path.getsize(guard_file) > 0:
                raise LaunchError(f"launch: rank {e.rank} exited with code {e.exitcode} while starting: {_UNGUARDED}",
                                  rank=e.rank, exitcode=e.exitcode) from None
            raise
    finally:
        if old_env is None:
            os.environ.pop(_GUARD_ENV, None)
        else:
            os.environ[_GUARD_ENV] = old_env
        _stop(procs)
        for c in conns:
            c.close()
        _cleanup_segments(prefix)
        shutil.rmtree(store_dir, ignore_errors=True)


def _collect(procs, conns, timeout: float, leader: "int | None" = None, leader_grace: float = 10.0) -> list:
    n = len(procs)
    results: list = [None] * n
    done = [False] * n
    failures = []  # (priority, order, LaunchError)
    deadline = time.monotonic() + timeout
    grace_end = None
    while not all(done):
        now = time.monotonic()
        if grace_end is not None and now >= grace_end:
            break
        if now >= deadline:
            late = [r for r in range(n) if not done[r]]
            raise TimeoutError(f"launch: ranks {late} did not finish within {timeout} s; all ranks were killed")
        limit = min(deadline, grace_end or deadline) - now
        waitables = {}
        for r in range(n):
            if not done[r]:
                waitables[conns[r]] = r
                waitables[procs[r].sentinel] = r
        ready = mp_wait(list(waitables), timeout=min(limit, 0.5))
        for obj in ready:
            r = waitables[obj]
            if done[r]:
                continue
            msg = None
            if conns[r].poll():
                try:
                    msg = pickle.loads(conns[r].recv_bytes())
                except (EOFError, OSError):
                    msg = None
            elif obj is conns[r]:
                continue  # spurious
            if msg is None:
                procs[r].join(1.0)
                if procs[r].exitcode is None and obj is not procs[r].sentinel:
                    continue
                code = procs[r].exitcode
                how = f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 \
                    else f"exited with code {code}"
                failures.append((0, len(failures), LaunchError(
                    f"launch: rank {r} {how} without reporting a result", rank=r, exitcode=code)))
                done[r] = True
            elif msg[0] == "ok":
                results[r] = msg[1]
                done[r] = True
            else:
                _, name, text, tb, is_peer = msg
                prio = 2 if is_peer else 1
                failures.append((prio, len(failures), LaunchError(
                    f"launch: rank {r} raised {name}: {text}\n--- traceback of rank {r} ---\n{tb}",
                    rank=r, remote_traceback=tb, remote_type=name)))
                done[r] = True
            if leader is not None:
                if done[leader] and grace_end is None:
                    grace_end = time.monotonic() + leader_grace  # the leader has ended: the others follow
            elif failures and grace_end is None:
                grace_end = time.monotonic() + 0.5  # let the root cause arrive
    if failures:
        raise min(failures, key=lambda f: (f[0], f[1]))[2]
    return results
