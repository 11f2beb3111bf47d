"""Fair admission per client for the HTTP service: the waiting room of ``..waiting_room``, with one queue per
client served in turn, and a share of the admission bound per active client.

A client is the caller's peer address (``app.client_of``). The rule, for a
call of ``t`` prompt tokens from client ``c`` (calls over the admission
bound got 413 before):

* **Share.** A client is *active* while it has tokens admitted or calls
  waiting, and for ``LINGER_S`` after its last call ended (so that a client
  that sends one call after another keeps its share between calls). Each
  active client may hold ``bound // active`` admitted tokens; a client with
  nothing admitted may always start one call that fits under the bound.
* **Turns.** Waiting calls queue per client, first come first served within
  a client; the clients take turns (round robin, one call per turn). A
  client over its share is skipped until its own calls finish; a call within
  its share that does not fit under the bound stops the turns until it does
  (nobody passes it: no starvation, as in ``waiting_room``).
* **Room.** The room holds ``max_tokens`` tokens in ``max_calls`` calls. A
  call that finds it full, from a client holding no more than its share of
  the room (``max_tokens`` / clients waiting), makes room: the newest
  waiting calls of the client holding the most get 429 until it fits. So
  one client that floods fills the room only while nobody else needs it.

A call is admitted at once exactly when it would be admitted at the head of
its turn: the engine adds it and runs the turns.

* **Held calls** (:class:`HeldCalls`, ``--refused-hold-s``). A client whose
  call got 429 from the full room, and that still holds its share of it,
  has its next calls held before their bodies are read (small ones: a held
  body waits in its connection), for up to ``refused_hold_s``. They leave
  one at a time, first held first, each as soon as the client no longer
  holds its share and the one before it reached the room. At most
  ``max_held`` calls are held at once, over all clients (the service: half
  of ``--max-connections``): a held call's connection is busy, which the
  connection limit cannot reclaim, so held calls never take more than half
  of it from the other clients' connections; past that, a call is answered
  at once. A client that
  keeps more calls open than its share then costs the front end one call
  per freed place, or per hold, instead of one per retry (docs/server.md
  has the measurement).
* **The brake on refused calls** (:class:`ErrorBrake`,
  ``--bad-call-delay-s``). Calls the service refuses as the caller's error
  (a 4xx other than 429: a bad body, a missing key, an unknown path) take
  no admission, so nothing above bounds how fast a client may send them, and
  each costs the front end a whole HTTP call. A client that had
  ``BRAKE_REFUSALS_PER_S`` refused in the last second has each of its calls
  wait ``bad_call_delay_s`` before it is handled, for as long as its
  refusals keep coming (a call refused after it waited holds the brake on);
  at most ``max_waiting`` calls wait at once over all clients (the service:
  half of ``--max-connections``), past that they are handled at once.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["FairWaiter", "FairRoom", "HeldCalls", "ErrorBrake", "LINGER_S", "BRAKE_REFUSALS_PER_S"]

LINGER_S = 1.0  # a client stays active this long after its last call ended
BRAKE_REFUSALS_PER_S = 32  # refused calls (4xx but 429) of one client within a second that brake it (ErrorBrake)


@dataclass(eq=False)
class FairWaiter:
    """One waiting call: its prompt tokens, deadline (the caller's clock), client, and what its owner admits
    (``call``) and resolves when it does (``future``)."""

    tokens: int
    deadline: float
    call: object = None
    future: object = None
    client: str = ""


class FairRoom:
    """Per-client FIFOs of :class:`FairWaiter`, bounded by ``max_tokens`` waiting tokens and ``max_calls`` calls
    in all, served in turn by :meth:`take_ready`. One thread owns it."""

    def __init__(self, max_tokens: int, max_calls: int) -> None:
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"FairRoom: max_tokens={max_tokens!r} must be an int >= 1")
        if not (isinstance(max_calls, int) and max_calls >= 1):
            raise ValueError(f"FairRoom: max_calls={max_calls!r} must be an int >= 1")
        self.max_tokens, self.max_calls = max_tokens, max_calls
        self.queues: dict = {}  # client -> deque of its waiters
        self.turn: deque = deque()  # clients with waiters, the next to be served first
        self.held: dict = {}  # client -> its waiting tokens
        self.tokens = 0
        self.calls = 0

    def __len__(self) -> int:
        return self.calls

    def clients(self) -> set:
        return set(self.queues)

    def has_room(self, tokens: int) -> bool:
        return self.calls < self.max_calls and self.tokens + tokens <= self.max_tokens

    def holds_share(self, client: str) -> bool:
        """Whether ``client`` holds its share of the room (``max_tokens`` or ``max_calls`` over the clients
        waiting, itself counted) or more: a call of it that finds the room full makes no room (:meth:`add`)."""
        n = len(self.queues) + (client not in self.queues)
        return (self.held.get(client, 0) >= self.max_tokens / n
                or len(self.queues.get(client, ())) >= self.max_calls / n)

    def add(self, w: FairWaiter) -> "list | None":
        """Queue ``w`` last among its client's calls, making room if the room is full and ``w``'s client holds no
        more than its share (see the module docstring). Returns the calls pushed out to make room (the caller
        answers them 429), or None if ``w`` found no room (it was not added)."""
        out: list = []
        if not self.has_room(w.tokens):
            n = len(self.queues) + (w.client not in self.queues)
            fair_tokens, fair_calls = self.max_tokens / n, self.max_calls / n
            mine = self.held.get(w.client, 0)
            if mine + w.tokens > fair_tokens or len(self.queues.get(w.client, ())) + 1 > fair_calls:
                return None
            while not self.has_room(w.tokens):
                others = [c for c in self.queues if c != w.client]
                if not others:
                    break
                top = max(others, key=lambda c: (self.held[c], len(self.queues[c])))
                if self.held[top] <= fair_tokens and len(self.queues[top]) <= fair_calls:
                    break
                victim = self.queues[top][-1]
                self.remove(victim)
                out.append(victim)
            if not self.has_room(w.tokens):  # nothing gained: put them back, as they were
                self._put_back(reversed(out))
                return None
        self._put_back((w,))
        return out

    def _put_back(self, ws) -> None:
        """Append each of ``ws`` to its client's queue (a new waiter, or one just taken out as its client's
        newest) and count it."""
        for w in ws:
            q = self.queues.get(w.client)
            if q is None:
                q = self.queues[w.client] = deque()
                self.turn.append(w.client)
            q.append(w)
            self.held[w.client] = self.held.get(w.client, 0) + w.tokens
            self.tokens += w.tokens
            self.calls += 1

    def remove(self, w: FairWaiter) -> bool:
        """Take ``w`` out (its client left, its deadline passed, or it made room); False if it is not here."""
        q = self.queues.get(w.client)
        if q is None:
            return False
        try:
            q.remove(w)
        except ValueError:
            return False
        self._taken(w)
        return True

    def _taken(self, w: FairWaiter) -> None:
        self.tokens -= w.tokens
        self.calls -= 1
        left = self.held[w.client] - w.tokens
        if self.queues[w.client]:
            self.held[w.client] = left
        else:
            del self.queues[w.client], self.held[w.client]
            self.turn.remove(w.client)

    def take_ready(self, free_tokens: int, admitted: dict, share: int, now: float) -> tuple:
        """``(admit, expired)``: the turns (module docstring) over ``free_tokens`` free admission tokens, with
        ``admitted`` (client -> its admitted tokens; not changed) and each client's ``share``. Both leave the
        room."""
        admit, expired = [], []
        mine = dict(admitted)
        skipped = 0
        while self.turn and skipped < len(self.turn):
            c = self.turn[0]
            w = self.queues[c][0]
            if w.deadline <= now:
                self.queues[c].popleft()
                self._taken(w)
                expired.append(w)
                continue
            held = mine.get(c, 0)
            if held and held + w.tokens > share:  # over its share: its own calls must finish first
                self.turn.rotate(-1)
                skipped += 1
                continue
            if w.tokens > free_tokens:
                break  # within its share but no room under the bound: nobody passes it
            self.queues[c].popleft()
            self._taken(w)
            admit.append(w)
            free_tokens -= w.tokens
            mine[c] = held + w.tokens
            if c in self.queues and self.turn and self.turn[0] == c:
                self.turn.rotate(-1)  # its turn is over
            skipped = 0
        return admit, expired

    def take_all(self) -> list:
        """Every waiting call; the room is empty after."""
        out = [w for q in self.queues.values() for w in q]
        self.queues.clear()
        self.turn.clear()
        self.held.clear()
        self.tokens = self.calls = 0
        return out


class HeldCalls:
    """The calls held before their bodies are read (module docstring, "Held calls"), over one :class:`FairRoom`
    (``room``). One asyncio loop owns it: :meth:`refused` when a call of a client got 429 from the full room
    (or was pushed out of it); ``hold = await held.hold(client)`` before a call's body is read (None: not held);
    :meth:`unhold` once that call reached the room (``room.add``, whatever it answered) or failed before;
    :meth:`release` whenever the room may have lost calls (its owner admitted or removed some). ``max_held``:
    the calls held at once at most, over all clients (more are not held)."""

    def __init__(self, room: FairRoom, hold_s: float, max_held: int) -> None:
        if not (isinstance(hold_s, (int, float)) and hold_s >= 0):
            raise ValueError(f"HeldCalls: hold_s={hold_s!r} must be a number of seconds >= 0 (0: never hold)")
        if not (isinstance(max_held, int) and not isinstance(max_held, bool) and max_held >= 0):
            raise ValueError(f"HeldCalls: max_held={max_held!r} must be an int >= 0 (0: never hold)")
        self.room, self.hold_s, self.max_held = room, float(hold_s), max_held
        self.refused_at: dict = {}  # client -> when a call of it last got 429 from the full room
        self.queues: dict = {}  # client -> futures of its held calls, first held first
        self.leaving: dict = {}  # client -> the future of its released call that has not reached the room yet
        self.count = 0  # calls held now

    def __len__(self) -> int:
        return self.count

    def refused(self, client: str) -> None:
        now = time.monotonic()
        if len(self.refused_at) > 1024:
            self.refused_at = {c: t for c, t in self.refused_at.items() if now - t <= self.hold_s}
        self.refused_at[client] = now

    async def hold(self, client: str) -> "asyncio.Future | None":
        """Wait while ``client`` was refused within the last ``hold_s`` and holds its share of the room, until
        this call's turn to leave comes or ``hold_s`` passed; None at once if it is not held. Else the call's
        hold, for :meth:`unhold`."""
        at = self.refused_at.get(client)
        if not self.hold_s or at is None or time.monotonic() - at > self.hold_s or not self.room.holds_share(client):
            return None
        if self.count >= self.max_held:
            return None
        q = self.queues.setdefault(client, deque())
        fut = asyncio.get_running_loop().create_future()
        q.append(fut)
        self.count += 1
        try:
            await asyncio.wait({fut}, timeout=self.hold_s)
        except asyncio.CancelledError:  # its caller left, perhaps just after its turn came: the next may leave
            self.unhold(client, fut)
            raise
        finally:
            self.count -= 1
            if not fut.done():  # its time is up (or its caller left): it goes on without its turn
                fut.cancel()
                q.remove(fut)
            if not q and self.queues.get(client) is q:
                del self.queues[client]
        return fut

    def unhold(self, client: str, hold) -> None:
        """The call of ``hold`` reached the room or failed: ``client``'s next held call may leave. Once per hold is
        enough; more calls do nothing."""
        if self.leaving.get(client) is hold:
            del self.leaving[client]
            self.release()

    def release_all(self) -> None:
        """Let every held call go on now (the service failed or stops: they get its answer at once)."""
        for q in self.queues.values():
            while q:
                q.popleft().set_result(None)

    def release(self) -> None:
        """Let the first held call of each client that no longer holds its share of the room leave, one per
        client at a time."""
        for client, q in self.queues.items():
            if q and client not in self.leaving and not self.room.holds_share(client):
                fut = self.leaving[client] = q.popleft()
                fut.set_result(None)


class ErrorBrake:
    """The brake on a client's refused calls (module docstring). One asyncio loop owns it: :meth:`refused` for
    each call answered with a 4xx other than 429; ``await brake.wait(client)`` before a call is handled (True if
    it waited). ``delay_s`` 0: never brake."""

    def __init__(self, delay_s: float, max_waiting: int, per_s: int = BRAKE_REFUSALS_PER_S) -> None:
        if not (isinstance(delay_s, (int, float)) and delay_s >= 0):
            raise ValueError(f"ErrorBrake: delay_s={delay_s!r} must be a number of seconds >= 0 (0: never brake)")
        for name, v, low in (("max_waiting", max_waiting, 0), ("per_s", per_s, 1)):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                raise ValueError(f"ErrorBrake: {name}={v!r} must be an int >= {low}")
        self.delay_s, self.max_waiting, self.per_s = float(delay_s), max_waiting, per_s
        self.windows: dict = {}  # client -> [start of its current 1-s window, refused calls in it]
        self.braked_until: dict = {}  # client -> until when its calls wait
        self.count = 0  # calls waiting now

    def __len__(self) -> int:
        return self.count

    def refused(self, client: str, braked: bool = False) -> None:
        """A call of ``client`` was refused as its own error; ``braked``: that call had waited (:meth:`wait`
        returned True), so the brake holds on for ``delay_s`` from now."""
        if not self.delay_s:
            return
        now = time.monotonic()
        if len(self.windows) > 1024:  # forget clients quiet for a while
            self.windows = {c: w for c, w in self.windows.items() if now - w[0] <= 1.0}
            self.braked_until = {c: t for c, t in self.braked_until.items() if t > now}
        w = self.windows.get(client)
        if w is None or now - w[0] > 1.0:
            w = self.windows[client] = [now, 0]
        w[1] += 1
        if braked or w[1] >= self.per_s:
            self.braked_until[client] = now + self.delay_s

    async def wait(self, client: str) -> bool:
        """Wait ``delay_s`` if ``client`` is braked now (and fewer than ``max_waiting`` calls wait)."""
        until = self.braked_until.get(client)
        if until is None or time.monotonic() >= until or self.count >= self.max_waiting:
            return False
        self.count += 1
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.count -= 1
        return True
