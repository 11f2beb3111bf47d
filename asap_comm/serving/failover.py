"""Expert failover: a spare expert PE takes over the experts of an expert rank whose PE died (docs/failover.md).

A group with ``S = RuntimeConfig.spare_expert_ranks`` has ``S`` spare PEs after
its ``E`` expert PEs (``moe.MoEPlan.spare_pes``); a spare holds no experts
until it is needed. The front end decides, the workers follow; nothing else
coordinates, and nothing waits on a barrier:

* :class:`FrontFailover` (the front end) looks at the expert and spare PEs'
  states (``comm.peer_state``, at most every 10 ms). When the PE serving
  expert rank ``r`` died (or left before it was stopped), it gives ``r`` to
  the next spare: a :data:`TAKEOVER` message to the spare, then a
  :data:`ROUTE` message to every attention rank, ahead of their queued
  chunks. A spare that dies unused leaves the pool. With no spare left, every
  attention rank gets a :data:`ROUTE` naming no PE (``-1``) and the front end
  raises ``PeerFailure``: the group fails as it does without spares (503,
  exit status 3).
* The spare (``async_ranks.expert_main``) builds the rank's experts with the
  model factory (``ExpertEnd.take_over`` gives their ids) and serves them.
* An attention rank checks the route (:func:`check_route`, which fences a
  dead PE on another host: :func:`fence_dead`) and calls
  ``AttentionEnd.replace``: later dispatches go to the spare, and every
  micro-batch in flight whose part at the dead PE did not come back (each
  return is counted per expert rank) is sent again, same slot and rows.

Messages travel in the group's request mailbox (front end -> worker), tagged
:data:`TAKEOVER` (payload ``[rank, dead PE]``) and :data:`ROUTE` (``[rank,
new PE or -1, dead PE]``), int64.

Attention failover (``RuntimeConfig.attention_failover``) needs no spare and no
message: :class:`FrontAttention` (the front end) looks at the attention PEs'
states; when one died and another lives, the front end
(``FrontEnd._attention_check``) takes the results the dead PE sent before it
died, then re-admits every request it held on the surviving ranks under a new
wire id (:data:`READMIT_BASE` and up; a long-prompt lane through the dead PE is
cancelled on its other ranks and the request runs on one rank). The expert
ranks count a dead attention PE as finished (``ExpertEnd.lose_senders``) and
drop what they computed for it; no worker waits for it any more
(:func:`depended_on`).
"""
from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from ..errors import CommError, PeerFailure

__all__ = ["TAKEOVER", "ROUTE", "READMIT_BASE", "encode_takeover", "decode_takeover", "encode_route", "decode_route",
           "check_route", "fence_dead", "Replacement", "FrontFailover", "AttentionLoss", "FrontAttention",
           "depended_on"]

TAKEOVER = -4  # tag of the front end's "serve expert rank r" message to a spare (payload [r, dead PE])
ROUTE = -5  # tag of the front end's "expert rank r is on PE q now" message to attention ranks ([r, q or -1, dead])
READMIT_BASE = 1 << 60  # the wire ids of re-admitted requests start here (a client's request ids stay below)


def encode_takeover(rank: int, dead: int) -> torch.Tensor:
    return torch.tensor([rank, dead], dtype=torch.int64)


def decode_takeover(payload: torch.Tensor) -> tuple:
    """``(expert rank, dead PE)`` of a :data:`TAKEOVER` payload."""
    rank, dead = payload.tolist()
    return int(rank), int(dead)


def encode_route(rank: int, new: int, dead: int) -> torch.Tensor:
    return torch.tensor([rank, new, dead], dtype=torch.int64)


def decode_route(payload: torch.Tensor) -> tuple:
    """``(expert rank, new PE or -1, dead PE)`` of a :data:`ROUTE` payload."""
    rank, new, dead = payload.tolist()
    return int(rank), int(new), int(dead)


def depended_on(comm, cfg, role: str) -> list:
    """The PEs a worker of ``role`` ("attention" or "expert") fails with when they die: with spares, not the
    expert and spare PEs (their deaths are the failover's); with attention failover, not the attention PEs (the
    front end re-admits a dead one's requests); otherwise every PE."""
    A, E, S = cfg.num_attention_ranks, cfg.num_expert_ranks, cfg.spare_expert_ranks
    out = list(range(comm.world_size))
    if S:
        out = [pe for pe in out if not A <= pe < A + E + S]
    if getattr(cfg, "attention_failover", False):
        out = [pe for pe in out if pe >= A]
    return out


def check_route(comm, cfg, src: int, msg: tuple) -> tuple:
    """A :data:`ROUTE` message as an attention rank takes it: ``CommError`` unless it comes from the front end,
    names an expert rank, a spare PE (or -1) and a PE that is no longer alive. A dead PE on another host is
    fenced first (:func:`fence_dead`): this rank's own liveness line to it may not have failed yet, and nothing
    it sends may land from now on. Returns ``msg``."""
    A, E, S = cfg.num_attention_ranks, cfg.num_expert_ranks, cfg.spare_expert_ranks
    rank, new, dead = msg
    front = comm.world_size - 1
    ok = (src == front and 0 <= rank < E and (new == -1 or A + E <= new < A + E + S) and A <= dead < A + E + S
          and new != dead)
    if ok:
        fence_dead(comm, dead)
    if not ok or comm.peer_state(dead) == "alive":
        raise CommError(f"route: a bad failover message from PE {src}: expert rank {rank} to PE {new} "
                        f"(PE {dead} {comm.peer_state(dead) if A <= dead < A + E + S else 'out of range'})")
    return msg


def fence_dead(comm, pe: int) -> None:
    """The front end named PE ``pe`` dead (a :data:`TAKEOVER` or :data:`ROUTE` message, authenticated, from the
    one decider): if it is on another host, this PE's network engine counts it dead from now on and applies
    nothing more it sends (``Communicator.fence_peer``), so a host cut off and back on its link cannot write into
    a slot the spare owns. On this host a dead process writes nothing: ``fence_peer`` does nothing there."""
    if pe != comm.rank:
        comm.fence_peer(pe)


@dataclass
class Replacement:
    """One failover as the front end decided it (``/health``'s ``failover.replacements``)."""

    expert_rank: int
    dead_pe: int
    reason: str  # "died" or "closed" (left before it was stopped)
    new_pe: int  # -1: no spare was left
    after_s: float  # seconds from the group's start (the front end's FrontFailover) to the decision


class FrontFailover:
    """The front end's side of expert failover (module docstring).

    ``box``: the request mailbox; ``pending``: the front end's per-attention-rank queues of messages
    (``FrontEnd.pending``: ``(request id or None, payload, tag, queued at)``), where the :data:`ROUTE` messages go
    first. :meth:`check` looks and acts; :meth:`release` (the front end stops the workers) makes a PE that
    closes from then on no failure.
    """

    def __init__(self, comm, cfg, box, pending: list, every_s: float = 0.01) -> None:
        self.comm, self.box, self.pending, self.every_s = comm, box, pending, every_s
        A, E, S = cfg.num_attention_ranks, cfg.num_expert_ranks, cfg.spare_expert_ranks
        self.A, self.E = A, E
        self.pes = range(A, A + E + S)  # watched: the expert and spare PEs
        self.owner = [A + r for r in range(E)]  # expert rank -> the PE serving it
        self.spares = deque(range(A + E, A + E + S))  # spares not yet used, in order
        self.gone: dict = {}  # PE -> "died" | "closed": handled
        self.replacements: list = []
        self.released = False
        self.started = time.monotonic()
        self._next = 0.0

    @property
    def count(self) -> int:
        """Expert ranks given to a spare so far."""
        return sum(1 for e in self.replacements if e.new_pe >= 0)

    def release(self) -> None:
        self.released = True

    def serves(self, pe: int) -> "int | None":
        """The expert rank ``pe`` serves now, or None."""
        return self.owner.index(pe) if pe in self.owner else None

    def check(self, force: bool = False) -> None:
        """Look at the expert and spare PEs (at most every ``every_s`` unless ``force``); replace the dead.
        ``PeerFailure`` when an expert rank lost its PE and no spare is left."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + self.every_s
        for pe in self.pes:
            if pe in self.gone:
                continue
            state = self.comm.peer_state(pe)
            if state == "alive" or (state == "closed" and self.released):
                continue
            self.gone[pe] = state
            if pe in self.spares:
                self.spares.remove(pe)
                print(f"failover: spare expert PE {pe} {state} before it was needed; {len(self.spares)} spare(s) "
                      "left", file=sys.stderr, flush=True)
                continue
            r = self.serves(pe)
            if r is not None:
                self._replace(r, pe, state)

    def _replace(self, r: int, dead: int, state: str) -> None:
        while self.spares:
            new = self.spares.popleft()
            try:  # its inbox is empty: a live spare takes this at once
                self.box.send(new, encode_takeover(r, dead), TAKEOVER, timeout=5.0)
            except CommError as e:
                self.gone[new] = self.comm.peer_state(new)
                print(f"failover: spare expert PE {new} could not be told to take over ({e}); trying the next",
                      file=sys.stderr, flush=True)
                continue
            self.owner[r] = new
            now = time.monotonic()
            for a in range(self.A):  # ahead of the chunks queued for the rank
                self.pending[a].appendleft((None, encode_route(r, new, dead), ROUTE, now))
            self.replacements.append(Replacement(r, dead, state, new, round(now - self.started, 3)))
            print(f"failover: expert worker PE {dead} {state}; spare PE {new} takes over expert rank {r} "
                  f"({len(self.spares)} spare(s) left)", file=sys.stderr, flush=True)
            return
        self.replacements.append(Replacement(r, dead, state, -1, round(time.monotonic() - self.started, 3)))
        for a in range(self.A):  # best effort: the attention ranks leave instead of waiting for a route
            try:
                self.box.send(a, encode_route(r, -1, dead), ROUTE, timeout=0.5)
            except CommError:
                pass
        raise PeerFailure(f"PE {dead} {state} and no spare expert rank is left to take over expert rank {r}",
                          pe=dead, reason=state)

    def summary(self) -> dict:
        """``/health``'s ``failover`` object."""
        return {"spare_expert_ranks": len(self.pes) - self.E, "spares_left": list(self.spares),
                "failovers": self.count, "expert_rank_pes": list(self.owner),
                "replacements": [asdict(e) for e in self.replacements]}


@dataclass
class AttentionLoss:
    """One attention PE lost and survived (``/health``'s ``attention_failover.losses``)."""

    pe: int
    readmitted: int  # requests it held that were re-admitted on the surviving ranks
    survivors: list  # the attention ranks that serve from now on
    after_s: float  # seconds from the front end's start to the re-admission


class FrontAttention:
    """The front end's record of attention failover (``FrontEnd._attention_check`` acts on it): which attention PEs
    died and were survived, how many requests were re-admitted. :meth:`newly_gone` reads the live ranks' states
    (at most every ``every_s`` unless forced)."""

    def __init__(self, comm, num_ranks: int, every_s: float = 0.01) -> None:
        self.comm, self.A, self.every_s = comm, num_ranks, every_s
        self.dead: dict = {}  # PE -> "died": survived
        self.losses: list = []
        self.readmissions = 0
        self.released = False
        self.started = time.monotonic()
        self._next = 0.0

    @property
    def live(self) -> list:
        return [a for a in range(self.A) if a not in self.dead]

    @property
    def count(self) -> int:
        """Attention PEs lost and survived."""
        return len(self.losses)

    def release(self) -> None:
        """The front end stops the workers: an attention PE that closes from now on is no failure."""
        self.released = True

    def newly_gone(self, force: bool = False) -> list:
        """``[(PE, "died" | "closed")]`` of the live attention ranks that are gone (a closed one only before
        :meth:`release`)."""
        now = time.monotonic()
        if not force and now < self._next:
            return []
        self._next = now + self.every_s
        out = []
        for a in self.live:
            state = self.comm.peer_state(a)
            if state == "died" or (state == "closed" and not self.released):
                out.append((a, state))
        return out

    def record(self, pe: int, readmitted: int) -> None:
        self.dead[pe] = "died"
        self.readmissions += readmitted
        self.losses.append(AttentionLoss(pe, readmitted, self.live, round(time.monotonic() - self.started, 3)))
        print(f"failover: attention worker PE {pe} died; {readmitted} request(s) re-admitted on attention rank(s) "
              f"{self.live}", file=sys.stderr, flush=True)

    def summary(self) -> dict:
        """``/health``'s ``attention_failover`` object."""
        return {"failovers": self.count, "readmissions": self.readmissions, "live": self.live,
                "losses": [asdict(e) for e in self.losses]}
