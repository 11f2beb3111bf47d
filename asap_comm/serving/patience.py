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
from ..patience import gone as _gone

__all__ = ["ATTEMPT_S", "send_patiently", "wait_patiently", "DeathWatch"]

ATTEMPT_S = 5.0  # one attempt's bound: how often a patient wait re-checks that its peers live


def send_patiently(box, pe: int, tensor, tag: int = 0, attempt_s: float = ATTEMPT_S) -> None:
    """``box.send(pe, tensor, tag)`` that waits for room as long as ``pe`` lives; ``PeerFailure`` once ``pe`` died or
    closed. Offering it again never duplicates it: on one host a send that timed out placed nothing, and toward
    a stopped PE on another host (no answer yet) the same message offered again awaits the first offer's
    answer (``Mailbox.send``)."""
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
    finished their work and are not failures, except those of ``must_stay``
    (the front end's workers until it stops them): their leaving is one
    until :meth:`release`.
    """

    def __init__(self, comm, peers: Sequence[int], every_s: float = 0.01, must_stay: Iterable[int] = ()) -> None:
        self.comm, self.peers, self.every_s = comm, [p for p in peers if p != comm.rank], every_s
        self.must_stay = {p for p in must_stay if p != comm.rank}
        self._next = 0.0

    def release(self) -> None:
        """From now on the PEs of ``must_stay`` may leave (they were told to)."""
        self.must_stay = set()

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        for pe in self.peers:
            state = self.comm.peer_state(pe)
            if state == "died":
                raise PeerFailure(f"PE {pe} died while PE {self.comm.rank} depended on it", pe=pe, reason="died")
            if state == "closed" and pe in self.must_stay:
                raise PeerFailure(f"PE {pe} left (closed) before PE {self.comm.rank} stopped it: it gave up",
                                  pe=pe, reason="closed")
