"""Retrying an operation toward a PE that lives but does not answer, bounded per attempt.

A PE on another host whose process is stopped (SIGSTOP, a debugger, a host
swapping) keeps its liveness line open (its kernel answers for it) but
answers no message: a put that needs its reply, a mailbox send (whose answer
says whether the message was placed) or a quiet then time out, attempt by
attempt. On one host the same operations never wait for the peer's CPU. So
that a stop is outlived the same way on every host, the library's own
multi-step operations that must not fail half-way (``moe.AttentionEnd``'s
dispatch) offer each step again for as long as the peer lives, each attempt
bounded by the communicator's timeout. Offering again is safe: a put
rewrites the same bytes, and a mailbox send offered again awaits the answer
to its first offer instead of sending a copy (``Mailbox.send``).
"""
from __future__ import annotations

from typing import Callable, Iterable, TypeVar

from .errors import PeerFailure
from .errors import TimeoutError as CommTimeoutError

__all__ = ["gone", "while_alive"]

T = TypeVar("T")


def gone(comm, pes: Iterable[int]) -> "tuple[int, str] | None":
    """``(pe, "died" | "closed")``: the first PE of ``pes`` (this one excluded) no longer alive, else None."""
    for pe in pes:
        if pe != comm.rank:
            state = comm.peer_state(pe)
            if state != "alive":
                return pe, state
    return None


def while_alive(comm, pes: Iterable[int], attempt: Callable[[], T], what: str) -> T:
    """``attempt()`` (one bounded try that raises ``asap_comm.TimeoutError`` when its bound ran out) offered
    again while every PE of ``pes`` lives; returns its result. ``PeerFailure`` naming ``what`` once one of them
    died or closed (a failure ``attempt`` raises itself passes through)."""
    pes = list(pes)
    while True:
        try:
            return attempt()
        except CommTimeoutError as e:
            lost = gone(comm, pes)
            if lost is not None:
                raise PeerFailure(f"{what}: PE {lost[0]} {lost[1]} while this PE waited for it ({e})",
                                  pe=lost[0], reason=lost[1]) from None
