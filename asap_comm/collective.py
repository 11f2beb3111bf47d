"""Collective-call records and the barrier, written once against the transport interface.

Records: every collective allocation publishes "call #k is <description>" in this PE's control block
(``CTRL_RECORDS``: two slots, k % 2: a PE can be at most one collective call ahead of any other, because
each ends with a barrier). After the barrier every PE checks that every peer made the same call #k; when
the call cannot complete, the error names the call and what each peer did.

Barrier: on one host, a central counter in PE 0's control block (the last PE to arrive releases the round);
across hosts, every PE completes its puts and announces itself to PE 0, which waits for all and releases
each PE's own generation word. Either way each PE then records the round as done in its own control block
(``CTRL_DONE``), so that a PE that completed a round and then closed does not fail a peer still in it.
"""
from __future__ import annotations

import torch

from ._native import _C
from .errors import CommError, PeerFailure, TimeoutError
from .transport.base import CTRL_ARRIVE, CTRL_DONE, CTRL_GEN, OPS

__all__ = ["Records", "Barrier", "collective"]

_SLOT = _C.CTRL_COLL_SLOT_BYTES
_SET, _ADD = OPS["set"], OPS["add"]


class Records:
    """This PE's collective-call records and its reading of every peer's (through ``transports``)."""

    def __init__(self, rank: int, world_size: int, transports: list) -> None:
        self.rank, self.world_size, self._transports = rank, world_size, transports
        self.n = 0  # collective calls this PE has made

    def read(self, pe: int, k: int) -> "tuple[int, str]":
        """(call number, description) in slot k % 2 of PE ``pe``'s records."""
        return _decode(self._transports[pe].read_records(), k)

    def last(self, pe: int) -> "tuple[int, str]":
        """The newest collective call PE ``pe`` published: (number, description); (0, '') if none."""
        records = self._transports[pe].read_records()  # one read of a remote peer's records
        return max(_decode(records, 0), _decode(records, 1))

    def progress(self, pe: int, verb: str) -> str:
        """'PE p <verb> n collective calls (its last: ...)', for error messages."""
        n, d = self.last(pe)
        return f"PE {pe} {verb} {n} collective calls" + (f" (its last: {d})" if d else "")

    def publish(self, desc: str) -> int:
        k = self.n = self.n + 1
        raw = desc.encode()[: _SLOT - 16]
        slot = self._transports[self.rank].read_records()[(k % 2) * _SLOT:][:_SLOT]
        slot[16: 16 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else slot[16:16]
        slot[:16].view(torch.int64).copy_(torch.tensor([k, len(raw)], dtype=torch.int64))
        _C.fence()  # published before this PE arrives at the call's barrier
        return k

    def mismatch(self, k: int, desc: str) -> "str | None":
        """After call #k's barrier: a description of every peer whose call #k differs, or None."""
        bad = []
        for pe in range(self.world_size):
            if pe == self.rank:
                continue
            n, d = self.read(pe, k)
            if n != k:
                bad.append(self.progress(pe, "had made"))
            elif d != desc:
                bad.append(f"PE {pe}'s call #{k} is {d}")
        return "; ".join(bad) or None


def _decode(records: torch.Tensor, k: int) -> "tuple[int, str]":
    slot = records[(k % 2) * _SLOT:][:_SLOT]
    head = slot[:16].view(torch.int64)
    n, length = int(head[0]), int(head[1])
    length = max(0, min(length, _SLOT - 16))
    return n, bytes(slot[16: 16 + length].tolist()).decode("utf-8", "replace")


def collective(comm, fn: str, desc: str, body):
    """Runs a collective allocation ``body`` then the closing barrier, naming the call on failure."""
    comm._check_open(fn)
    records = comm._records
    k = records.publish(desc)
    try:
        result = body()
        comm.barrier()
    except (TimeoutError, PeerFailure) as e:
        late = [records.progress(pe, "has made") for pe in range(comm.world_size)
                if pe != comm.rank and records.last(pe)[0] < k and comm.peer_alive(pe)]
        hint = ("; ".join(late) + "; " if late else "") + \
            "every PE must make the same collective calls (empty, zeros, signals, mailbox) in the same order"
        msg = f"{fn}: collective call #{k}, {desc}, did not complete: {hint} ({e})"
        if isinstance(e, PeerFailure):
            raise PeerFailure(msg, pe=e.pe, reason=e.reason) from None
        raise TimeoutError(msg) from None
    bad = records.mismatch(k, desc)
    if bad is not None:
        raise CommError(f"{fn}: collective calls do not match: this PE's call #{k} is {desc}, but {bad}; every PE "
                        "must make the same collective calls (empty, zeros, signals, mailbox) with the same "
                        "arguments in the same order")
    return result


class Barrier:
    """The group's barrier (see the module docstring); ``barrier(t)`` runs one round or retries a pending one.

    ``central``: every PE can wait on PE 0's control words directly (one host), so the last PE to arrive
    releases the round; otherwise PE 0 gathers the arrivals and releases each PE."""

    def __init__(self, rank: int, world_size: int, transports: list, completers: list, central: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self._to, self._own, self._completers = transports, transports[rank], completers
        self._central = central
        self.epoch = 0
        self.pending: "int | None" = None  # round this PE arrived at but timed out in
        self.released = 0  # PE 0, gathering: the last round it released

    def __call__(self, t: float) -> None:
        if self.world_size == 1:
            _C.fence()
            return
        if self._central:
            self._central_round(t)
        else:
            self._gathered_round(t)
        self.pending = None
        self._own.ctrl_op(CTRL_DONE, self.k, _SET, False, t)  # read by peers that outlive this PE

    def _central_round(self, t: float) -> None:
        pe0 = self._to[0]
        if self.pending is None:
            self.epoch += 1
            k = self.k = self.epoch
            if pe0.ctrl_op(CTRL_ARRIVE, 1, _ADD, True, t) == k * self.world_size - 1:
                pe0.ctrl_op(CTRL_GEN, k, _SET, False, t)  # last to arrive: release everyone
                return
        else:
            k = self.k = self.pending  # a retry after a timeout: already arrived
        self.pending = k
        pe0.ctrl_wait(CTRL_GEN, "barrier: waiting for barrier #", _C.DEP_BARRIER, t)(k, t)

    def _gathered_round(self, t: float) -> None:
        """Each message is applied after everything its sender issued before it, so whatever any PE wrote
        before the barrier is visible after."""
        if self.pending is None:
            self.epoch += 1
            k = self.k = self.epoch
            for c in self._completers:
                c.quiet(t)
            self._to[0].ctrl_op(CTRL_ARRIVE, 1, _ADD, False, t)
        else:
            k = self.k = self.pending
        self.pending = k
        own = self._own
        if self.rank != 0:
            own.ctrl_wait(CTRL_GEN, "barrier: waiting for barrier #", _C.DEP_BARRIER, t)(k, t)
        elif self.released < k:
            own.ctrl_wait(CTRL_ARRIVE, "barrier: waiting for every PE to arrive, count >= ", _C.DEP_ALL,
                          t)(k * self.world_size, t)
            for pe in range(1, self.world_size):
                self._to[pe].ctrl_op(CTRL_GEN, k, _SET, False, t)
            self.released = k
