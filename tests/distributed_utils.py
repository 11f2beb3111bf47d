"""One launch helper for the multi-process tests.

``run(fn, world_size, *args)`` runs ``fn(comm, *args)`` on fresh processes
through :func:`asap_comm.launch`, whose every join is bounded: a deadlock
fails the test after ``timeout`` seconds instead of hanging CI.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import asap_comm

DEFAULT_TIMEOUT = 90.0


@dataclass(frozen=True)
class RankInfo:
    """What a rank knows about itself, for tests that want it in one place."""

    rank: int
    world_size: int
    pid: int
    shm_prefix: str


def rank_info(comm) -> RankInfo:
    return RankInfo(comm.rank, comm.world_size, os.getpid(), comm._shm_prefix)


def shm_files(prefix: str) -> list[str]:
    """Names in /dev/shm that a communicator with ``prefix`` created and did not unlink."""
    return sorted(glob.glob(f"/dev/shm/{prefix}*"))


def run(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, comm_timeout: float = 20.0) -> list:
    return asap_comm.launch(fn, world_size, *args, timeout=timeout, comm_timeout=comm_timeout)
