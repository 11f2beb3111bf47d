"""The service's processes: the serving group on this host (``launch``), or one PE of a group across hosts
under torchrun; the signals, the listening check and the exit statuses (0: stopped cleanly, 2: bad arguments
or settings, 3: a worker failed, 130: a second signal)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time

from ...errors import CommError, LaunchError
from ..group import GroupSpec, group_main
from ..protocol import RuntimeConfig
from ..sync import check_config
from .app import HttpFront
from .frontdoor import remove_stale_segments
from .options import ServiceOptions

__all__ = ["service_main", "serve_on_this_host", "serve_one_pe", "StopFlag", "remove_stale"]


def service_main(comm, spec: GroupSpec):
    """One PE of a service group: signals are the parent's business (it turns SIGINT/SIGTERM into the stop
    event the front end watches; a terminal's Ctrl-C and a supervisor's SIGTERM to the whole process group
    reach every PE), then ``group_main``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return group_main(comm, spec)


class StopFlag:
    """The stop request the launcher's signal handler sets and the front-end PE polls (``set``/``is_set``, as an
    ``Event``): one byte of anonymous shared memory, so that a crash of the whole process tree leaves no named
    semaphore (``/dev/shm/sem.mp-*``, which an ``mp.Event`` is made of) behind. Picklable to a spawned child."""

    def __init__(self) -> None:
        self._flag = mp.get_context("spawn").RawValue("b", 0)
        self._clean = mp.get_context("spawn").RawValue("b", 0)  # the front end ended without a failure

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)

    def ended_cleanly(self) -> None:
        """The front end says it stopped without a failure (expert failover: a replaced PE's death, which
        ``launch`` reports at the end, was not the service's)."""
        self._clean.value = 1

    @property
    def clean(self) -> bool:
        return bool(self._clean.value)


def remove_stale(shm_dir: str = "/dev/shm") -> None:
    """At start-up: remove what a crashed service of this user left in ``shm_dir`` (``frontdoor.remove_stale_segments``:
    only files no live process holds), and say so."""
    removed = remove_stale_segments(shm_dir)
    if removed:
        names = ", ".join(os.path.basename(p) for p in removed[:8]) + (" ..." if len(removed) > 8 else "")
        print(f"asap serve: removed {len(removed)} stale shared-memory file(s) of this user that no live process "
              f"holds (left by a crash): {names}", file=sys.stderr, flush=True)


def serve_on_this_host(args, factory, info, cfg: RuntimeConfig, opts: ServiceOptions) -> int:
    """The whole service on this host: ``launch`` the workers and the front end (the group's last PE) until a
    signal or a failure. Returns the exit status."""
    if not _can_listen(opts):
        return 2
    stop = StopFlag()
    front = HttpFront(opts, stop)
    return _handling_signals(_stop_on_signals(stop), lambda: _launch_here(args, factory, info, cfg, opts, front))


def _launch_here(args, factory, info, cfg: RuntimeConfig, opts: ServiceOptions, front) -> int:
    from ...launch import launch
    store = None
    if args.mode == "async":
        spec = GroupSpec("async", cfg, info, factory, front)
    else:
        from ...rendezvous import loopback_store
        check_config(factory, cfg)
        # the workers' gloo group meets in a TCPStore on 127.0.0.1; the shm collectives (the service's default)
        # need none: nothing listens, nothing another local process could jam
        store = loopback_store(cfg.timeout_s) if cfg.sync_collectives == "gloo" else None
        spec = GroupSpec("sync", cfg, info, factory, front, None if store is None else store.port)
    world = spec.world_size
    print(f"asap serve: starting {world - 1} {args.mode} workers for {opts.model_name} ...", file=sys.stderr,
          flush=True)
    try:
        results = launch(service_main, world, spec, timeout=1e9, comm_timeout=args.comm_timeout_s,
                         leader=world - 1, leader_grace=5.0)
    except LaunchError as e:
        first = str(e).splitlines()[0]
        if e.remote_type == "OutOfSharedMemory":  # a setting of this machine, not a failure of the service
            print(f"asap serve: {first.split('raised OutOfSharedMemory: ', 1)[-1]}", file=sys.stderr)
            return 2
        A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
        if front.stop_event.clean and args.mode == "async" and A <= e.rank < A + E + cfg.spare_expert_ranks:
            print(f"asap serve: stopped cleanly; an expert PE a spare replaced had ended: {first}", file=sys.stderr)
            return 0
        if front.stop_event.clean and args.mode == "async" and cfg.attention_failover and e.rank < A:
            print(f"asap serve: stopped cleanly; an attention PE whose requests were re-admitted had ended: {first}",
                  file=sys.stderr)
            return 0
        print(f"asap serve: stopped: {first}", file=sys.stderr)
        return 3
    del store  # the gloo group's store lives until the group ended
    return _exit_status(results[-1][1])


def _handling_signals(old: dict, body) -> int:
    """``body()``'s exit status; a second signal (``KeyboardInterrupt``, see ``_stop_on_signals``) ends it at once
    with 130. The handlers in ``old`` come back in every case."""
    try:
        return body()
    except KeyboardInterrupt:
        print("asap serve: stopped at once (second signal)", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _can_listen(opts: ServiceOptions) -> bool:
    """Whether the HTTP port can be bound (said at once, not from a group that took seconds to start)."""
    if opts.port:
        import socket
        try:
            with socket.socket(socket.AF_INET6 if ":" in opts.host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((opts.host, opts.port))
        except OSError as e:
            print(f"asap serve: cannot listen on {opts.host}:{opts.port}: {e.strerror or e}", file=sys.stderr)
            return False
    if opts.api_key is None and opts.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"asap serve: warning: listening on {opts.host} without an API key (--api-key or ASAP_API_KEY)",
              file=sys.stderr, flush=True)
    return True


def _stop_on_signals(stop) -> dict:
    """SIGINT/SIGTERM set ``stop`` (the front end drains, then stops the workers); a second one stops at once.
    Returns the previous handlers."""
    signals = [0]

    def on_signal(signum, frame):
        signals[0] += 1
        if signals[0] > 1:
            raise KeyboardInterrupt
        stop.set()

    return {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}


def _exit_status(summary: dict) -> int:
    if summary["failure"]:
        print(f"asap serve: exited after {summary['failure']}", file=sys.stderr)
        return 3
    print(f"asap serve: stopped cleanly after {summary['requests']} request(s)", file=sys.stderr)
    return 0


def serve_one_pe(args, factory, info, cfg: RuntimeConfig, opts: ServiceOptions) -> int:
    """One PE of a service whose workers span hosts, started by torchrun on every host (README, "The service
    across hosts"). torchrun's rank 0, on node 0, is the front end and the HTTP server (the group's last PE,
    as on one host); torchrun's rank r > 0 is PE r - 1. The group needs ``$ASAP_GROUP_SECRET``, the same on
    every host. Exit status as on one host (2: bad arguments or settings, 3: a worker failed); a worker's own
    status is 0 once the front end stopped it, 3 if the group failed under it."""
    W, r = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
    S = cfg.spare_expert_ranks if args.mode == "async" else 0
    if A + E + S + 1 != W:
        if r == 0:
            print(f"asap serve: torchrun started {W} processes, but --attention-ranks {A} + --expert-ranks {E} + "
                  f"--spare-expert-ranks {S} + the front end make {A + E + S + 1}", file=sys.stderr)
        return 2
    pe = W - 1 if r == 0 else r - 1
    is_front = pe == W - 1
    if is_front and not _can_listen(opts):
        return 2
    stop = threading.Event()
    if is_front:
        old = _stop_on_signals(stop)
    else:  # the front end stops the workers (a worker that died would fail the service)
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    return _handling_signals(old, lambda: _run_pe(pe, W, is_front, stop, args, factory, info, cfg, opts))


def _run_pe(pe: int, W: int, is_front: bool, stop, args, factory, info, cfg: RuntimeConfig,
            opts: ServiceOptions) -> int:
    from ...comm import init
    from ...errors import OutOfSharedMemory

    try:
        comm = init(pe, W, timeout=args.comm_timeout_s)
    except CommError as e:
        print(f"asap serve: PE {pe}: {e}", file=sys.stderr)
        return 2
    with comm:
        if is_front:
            where = ", ".join(f"PE {p}@{h}" for p, h in enumerate(comm.hosts))
            print(f"asap serve: {W - 1} {args.mode} workers for {opts.model_name} on "
                  f"{len(set(comm.hosts))} hosts ({where})", file=sys.stderr, flush=True)
        front = HttpFront(opts, stop)
        try:
            if args.mode == "sync":
                check_config(factory, cfg)
            role, payload = group_main(comm, GroupSpec(args.mode, cfg, info, factory, front,
                                                       comm._store if args.mode == "sync" else None))
        except OutOfSharedMemory as e:
            print(f"asap serve: PE {pe}: {e}", file=sys.stderr)
            return 2
        except CommError as e:  # PeerFailure, TimeoutError: the group failed under this worker
            print(f"asap serve: PE {pe}: stopped: {e}", file=sys.stderr, flush=True)
            if not is_front:  # leave after the front end: torchrun stops a node's processes once one fails,
                _outlive_front_end(comm, opts)  # which would cut short the front end's 503 answers
            return 3
    return _exit_status(payload) if role == "front" else 0


def _outlive_front_end(comm, opts: ServiceOptions) -> None:
    """A worker whose group failed waits (bounded) until the front end has answered 503 for its
    ``--failure-exit-s`` and left."""
    front = comm.world_size - 1
    deadline = time.monotonic() + opts.failure_exit_s + 15.0
    while time.monotonic() < deadline and comm.peer_state(front) == "alive":
        time.sleep(0.1)
