"""A store no outsider can jam (asap_comm.rendezvous): a rogue that reaches the rendezvous store (a TCPStore, as
torchrun's agent store or the one rank 0 hosts) lists every key, bumps it and overwrites it, round after round, while
groups form on it and while a formed group runs (and grows its heap, which reads the store again). Every group
forms, the running group lives, no answer is wrong, and the PEs count what they ignored.

The rogue works only on the store this test created (127.0.0.1, a free port), for a bounded number of rounds and a
bounded time. Every spawned PE reports within a bounded time (each join has a timeout) so a hang fails the test."""
import glob
import os
import threading
import time
from datetime import timedelta

import pytest
import torch

import asap_comm
from asap_comm.rendezvous import loopback_store, new_secret
from asap_comm.testing.faults import CTX, JOIN_S, collect, spawn

ROGUE_MAX_S = 60.0  # the rogue stops after this long ...
ROGUE_MAX_ROUNDS = 20000  # ... or this many rounds over every key, whichever comes first
BUMP_EVERY = 20  # rounds between bumps of a key (and when first seen): a refused bump costs a reconnect
MAX_PLANTS = 5000  # keys the rogue plants ahead of the group, at most
COMM_TIMEOUT_S = 20.0  # each PE's wait bound (init's timeout)


class Rogue:
    """From a thread: list every key of the store at 127.0.0.1:``port`` and overwrite each with a value of the
    shape a member writes (32 bytes where a MAC goes, then a name), round after round, until :meth:`stop` or the
    bounds above; plant values under the keys a group would write next (:meth:`_plant_next`); add 1 to each
    key when first seen and every ``BUMP_EVERY`` rounds (``add`` on a key that
    holds no integer makes the store close the adder's connection: the rogue reconnects and goes on)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.rounds = self.bumps = self.refused_bumps = self.overwrites = self.errors = 0
        self.keys_seen: "set[str]" = set()
        self.planted: "set[str]" = set()  # keys the rogue created before the group did
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-rogue", daemon=True)

    def _connect(self):
        return torch.distributed.TCPStore("127.0.0.1", self.port, None, False, timedelta(seconds=5))

    def _run(self) -> None:
        end = time.monotonic() + ROGUE_MAX_S
        writer, bumper = self._connect(), self._connect()  # the store drops a connection whose add it refuses
        while not self._stop.is_set() and self.rounds < ROGUE_MAX_ROUNDS and time.monotonic() < end:
            try:
                keys = writer.list_keys()
                for k in keys:
                    if k not in self.keys_seen or self.rounds % BUMP_EVERY == 0:
                        self.keys_seen.add(k)
                        try:
                            bumper.add(k, 1)
                            self.bumps += 1
                        except Exception:  # not an integer: refused, and this connection closed
                            self.refused_bumps += 1
                            bumper = self._connect()
                    writer.set(k, self._junk())
                    self.overwrites += 1
                    if k not in self.planted:
                        self._plant_next(writer, k, keys)
            except Exception:
                self.errors += 1
                writer = self._connect()
            self.rounds += 1
            time.sleep(0.0005)

    @staticmethod
    def _junk() -> bytes:
        return b"\0" * 32 + b"/asap-rogue-" + os.urandom(4).hex().encode()

    def _plant_next(self, writer, key: str, keys: list) -> None:
        """Guess the keys a group will write next (each number in ``key`` plus 1 or 2: the next PE, heap chunk,
        generation, ...) and plant a value under each that does not exist yet."""
        parts = key.split("/")
        for j, part in enumerate(parts):
            if not part.isdigit():
                continue
            for d in (1, 2):
                guess = "/".join(parts[:j] + [str(int(part) + d)] + parts[j + 1:])
                if guess not in self.planted and guess not in keys and len(self.planted) < MAX_PLANTS:
                    self.planted.add(guess)
                    writer.set(guess, self._junk())

    def __enter__(self) -> "Rogue":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _member(rank, world, port, secret, prefix, rounds, pause_s, started, q):
    """One PE of a group on the test's store (as under torchrun: a client of a TCPStore someone else hosts):
    joins, then ``rounds`` rounds of every PE putting ``100 * round + rank`` into slot ``rank`` of every PE's
    row, checked after each barrier; half-way it grows its heap (a collective that reads the store again; the
    last PE comes to it late, so the others read its key before it writes it)."""
    os.environ.pop("ASAP_GROUP_SECRET", None)
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=COMM_TIMEOUT_S))
        with asap_comm.init(rank, world, store=store, timeout=COMM_TIMEOUT_S, shm_prefix=prefix,
                            group_secret=secret, heap_chunk_bytes=1 << 20) as comm:
            if started is not None:
                started.put(rank)
            row = comm.zeros(world, torch.float64)
            wrong = 0
            grown = None
            for i in range(rounds):
                mine = torch.tensor([100.0 * i + rank], dtype=torch.float64)
                for pe in range(world):
                    comm.put(row[rank:rank + 1], mine, pe)
                comm.barrier()
                wrong += row.tolist() != [100.0 * i + p for p in range(world)]
                comm.barrier()
                if i == rounds // 2:
                    if rank == world - 1:
                        time.sleep(0.5)  # a PE that comes late to the collective (as a busy one does)
                    grown = comm.zeros(1 << 19, torch.float32)  # 2 MiB: a new heap chunk, named in the store
                    nxt = (rank + 1) % world
                    comm.put(grown[:4], torch.full((4,), float(rank)), nxt)
                    comm.barrier()
                    wrong += grown[:4].tolist() != [float((rank - 1) % world)] * 4
                time.sleep(pause_s)
            q.put(("ok", rank, wrong, comm._gs.forged))
    except Exception as e:
        q.put(("err", rank, type(e).__name__, str(e)))


def _start_group(port, world, secret, prefix, rounds, pause_s=0.0, started=None):
    return spawn(_member, [(r, world, port, secret, prefix, rounds, pause_s, started) for r in range(world)])


def _assert_all_right(got: dict, world: int) -> int:
    assert sorted(got) == list(range(world)), got
    for r in range(world):
        assert got[r][0] == "ok", got[r]
        assert got[r][2] == 0, f"PE {r}: {got[r][2]} wrong rows"
    return sum(got[r][3] for r in range(world))


@pytest.mark.slow
def test_groups_form_while_a_rogue_lists_bumps_and_overwrites_every_key():
    """Groups form one after another on one store while the rogue jams it: three with the same secret (so the
    generations must differ without a counter) and one with none (one host: rank 0 hands its file's secret to
    the others through the store). Every group forms and computes right."""
    store = loopback_store(60.0)
    secret = new_secret()
    prefixes = []
    forged = 0
    with Rogue(store.port) as rogue:
        for g, sec in enumerate([secret, secret, secret, None]):
            prefix = f"asap-jf{g}" + os.urandom(3).hex() + "-"
            prefixes.append(prefix)
            got = collect(*_start_group(store.port, 3, sec, prefix, rounds=20))
            forged += _assert_all_right(got, 3)
    assert rogue.rounds > 0 and rogue.overwrites > 0 and rogue.bumps + rogue.refused_bumps > 0, vars(rogue)
    assert any(k.startswith("asap/") for k in rogue.keys_seen), sorted(rogue.keys_seen)[:10]
    assert forged > 0, "the rogue's values never reached a PE: the test did not jam anything"
    for prefix in prefixes:
        assert glob.glob(f"/dev/shm/{prefix}*") == []


@pytest.mark.slow
def test_a_running_group_lives_while_a_rogue_jams_its_store():
    """A group forms, then the rogue jams the store while the group runs (and grows its heap, which reads the
    store): the group lives to the end and every row is right."""
    store = loopback_store(60.0)
    prefix = "asap-jr" + os.urandom(3).hex() + "-"
    started = CTX.Queue()
    q, procs = _start_group(store.port, 4, new_secret(), prefix, rounds=60, pause_s=0.05, started=started)
    try:
        for _ in procs:
            started.get(timeout=JOIN_S)  # the group has formed
    except Exception:
        collect(q, procs)
        raise
    with Rogue(store.port) as rogue:
        got = collect(q, procs)
    forged = _assert_all_right(got, 4)
    assert rogue.rounds > 0 and rogue.overwrites > 0 and rogue.planted, vars(rogue)
    assert forged > 0, "no PE read a planted value (the late PE's heap chunk key): the test jammed nothing"
    assert glob.glob(f"/dev/shm/{prefix}*") == []
