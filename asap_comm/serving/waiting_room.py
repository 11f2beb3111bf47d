"""Fair admission for the HTTP service: a bounded first-come, first-served waiting room in front of the
admission bound.

The rule. A call (one ``/v1/completions`` request, all its prompts) whose
prompt tokens exceed the admission bound is refused at once (413: it could
never run without locking everyone else out). Any other call is admitted at
once if nobody is waiting and its tokens fit under the bound beside those
in flight. Otherwise it waits here, in arrival order, until every call ahead
of it has been admitted and its own tokens fit; it is refused (429 with
``Retry-After``) only when the waiting room itself is full, and answered 504
if its deadline passes while it waits. Admission is all-or-nothing per call,
as before.

Why no client starves. Nothing overtakes a waiting call: a call that
arrives while a hog's call at the bound runs waits behind that call and
behind the hog's calls that arrived *before* it, never behind one sent
after it. Its wait is therefore bounded by the work in flight and waiting
at its arrival (at most the bound plus the waiting room), whatever anyone
sends afterwards. A hog that sends back to back gets one call admitted per
turn of the queue, like everyone else. (First-come first-served is per
call, not per client: a client holding many calls in the room at once gets
a share per call. The room's bound caps what it can hold.)

Why strict order and no backfilling. Letting small calls pass a large call
that waits for room would use the bound better, but a stream of small calls
could then keep a large call waiting until its deadline. Strict order keeps
every wait bounded.

Memory. The room holds at most ``max_tokens`` prompt tokens (their int64
tensors: 8 bytes each) in at most ``max_calls`` calls, each also holding its
open connection.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Waiter", "WaitingRoom", "MAX_WAITING_CALLS"]

MAX_WAITING_CALLS = 1024  # calls waiting at once, whatever their size


@dataclass(eq=False)
class Waiter:
    """One waiting call: its prompt tokens, its deadline (the caller's clock), and whatever its owner admits
    (``call``) and resolves when it does (``future``)."""

    tokens: int
    deadline: float
    call: object = None
    future: object = None


class WaitingRoom:
    """The FIFO of :class:`Waiter`\\ s, bounded by ``max_tokens`` waiting tokens and ``max_calls`` entries.
    One thread owns it."""

    def __init__(self, max_tokens: int, max_calls: int = MAX_WAITING_CALLS) -> None:
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"WaitingRoom: max_tokens={max_tokens!r} must be an int >= 1")
        if not (isinstance(max_calls, int) and max_calls >= 1):
            raise ValueError(f"WaitingRoom: max_calls={max_calls!r} must be an int >= 1")
        self.max_tokens, self.max_calls = max_tokens, max_calls
        self._q: deque = deque()
        self.tokens = 0  # waiting prompt tokens

    def __len__(self) -> int:
        return len(self._q)

    def has_room(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` may wait here now."""
        return len(self._q) < self.max_calls and self.tokens + tokens <= self.max_tokens

    def add(self, w: Waiter) -> None:
        """Queue ``w`` last; ``ValueError`` if it has no room (check :meth:`has_room` first)."""
        if not self.has_room(w.tokens):
            raise ValueError(f"WaitingRoom.add: no room for a call of {w.tokens} tokens ({len(self._q)} calls, "
                             f"{self.tokens} of {self.max_tokens} tokens waiting)")
        self._q.append(w)
        self.tokens += w.tokens

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out (its client left, or its deadline passed); False if it is not here."""
        try:
            self._q.remove(w)
        except ValueError:
            return False
        self.tokens -= w.tokens
        return True

    def take_ready(self, free_tokens: int, now: float) -> tuple:
        """``(admit, expired)``: from the head, the calls whose deadline passed (``expired``) and, in order, those
        that fit into ``free_tokens`` one after the other (``admit``), stopping at the first that does not fit.
        Both leave the room."""
        admit, expired = [], []
        while self._q:
            w = self._q[0]
            if w.deadline <= now:
                expired.append(self._q.popleft())
            elif w.tokens <= free_tokens:
                admit.append(self._q.popleft())
                free_tokens -= w.tokens
            else:
                break
            self.tokens -= w.tokens
        return admit, expired

    def take_all(self) -> list:
        """Every waiting call, in order; the room is empty after."""
        out = list(self._q)
        self._q.clear()
        self.tokens = 0
        return out
