"""Waits that outlast a live but slow peer.

A serving group must survive a process that is stopped for a while (a
front end or a worker under SIGSTOP, a debugger, a host swapping): every
wait on the data path is bounded per attempt, and an attempt that times out
is retried for as long as the PEs that can end it are alive. A dead or
closed PE still ends the wait at once (``PeerFailure``); what a client sees
is bounded by its request deadline (the HTTP service answers 504), not by
these waits. A loop that idles on its inbox checks the PEs it depends on
itself (:class:`DeathWatch`).
"""
from __future__ import annotations

import time
from typing import Iterable, Sequence

from ..errors import PeerFailure
from ..errors import TimeoutError as CommTimeoutError

__all__ = ["ATTEMPT_S", "send_patiently", "wait_patiently", "DeathWatch"]

ATTEMPT_S = 5.0  # one attempt's bound: how often a patient wait re-checks that its peers live


def _gone(comm, pes: Iterable[int]) -> "tuple[int, str] | None":
    for pe in pes:
        if pe != comm.rank:
            state = comm.peer_state(pe)
            if state != "alive":
                return pe, state
    return None


def send_patiently(box, pe: int, tensor, tag: int = 0, attempt_s: float = ATTEMPT_S) -> None:
    """``box.send(pe, tensor, tag)`` that waits for room as long as ``pe`` lives (a send that times out placed
    nothing, so offering it again never duplicates it); ``PeerFailure`` once ``pe`` died or closed."""
    comm = box.comm
    while True:
        try:
            box.send(pe, tensor, tag, timeout=attempt_s)
            return
        except CommTimeoutError:
            gone = _gone(comm, (pe,))
            if gone is not None:
                raise PeerFailure(f"send: PE {pe} {gone[1]} while this PE waited for room in its inbox",
                                  pe=pe, reason=gone[1]) from None


def wait_patiently(comm, sig, idx: int, cmp: str, value: int, peers: Iterable[int],
                   attempt_s: float = ATTEMPT_S) -> int:
    """``comm.signal_wait_until(sig, idx, cmp, value)`` retried while every PE of ``peers`` (the ones that must
    act for it to hold) lives; returns the value seen."""
    peers = list(peers)
    while True:
        try:
            return comm.signal_wait_until(sig, idx, cmp, value, timeout=attempt_s)
        except CommTimeoutError:
            gone = _gone(comm, peers)
            if gone is not None:
                raise PeerFailure(f"signal_wait_until: waiting for sig[{idx}] {cmp} {value}: PE {gone[0]} "
                                  f"{gone[1]} while waited on", pe=gone[0], reason=gone[1]) from None


class DeathWatch:
    """Turns the death of a PE this one depends on into ``PeerFailure``, checked at most every ``every_s``.

    Mailbox receives and scoped waits fail only when *every* peer that could
    satisfy them is gone (``asap_comm``'s failure scope), so a serving loop
    that idles on its inbox checks the PEs it needs itself. PEs that closed
    finished their work and are not failures.
    """

    def __init__(self, comm, peers: Sequence[int], every_s: float = 0.01) -> None:
        self.comm, self.peers, self.every_s = comm, [p for p in peers if p != comm.rank], every_s
        self._next = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        for pe in self.peers:
            if self.comm.peer_state(pe) == "died":
                raise PeerFailure(f"PE {pe} died while PE {self.comm.rank} depended on it", pe=pe, reason="died")
