"""The ASAP primitive benchmarks, shared by ``run_all.py``, ``bench_moe.py`` (its core put bandwidth) and
``bench_net.py`` (the same loops between two hosts). Each ``*_pe`` function runs on every PE of a 2-PE group
(``asap_comm.launch``, or ``asap_comm.init`` on simulated hosts).

PE 0 times and checks; PE 1 answers. Every function returns a dict with
``samples_ns`` (PE 0: ns per iteration of each timed batch, or per transfer)
and ``bad`` (how many checks failed on that PE).
"""
from __future__ import annotations

import contextlib
import functools

import torch

import asap_comm
from _common import BatchPlan, digest, pattern, pinned, time_batches, time_each

PEER = (1, 0)  # PEER[rank]: the other PE of the pair


def words(t: torch.Tensor) -> memoryview:
    """A writable int64 memoryview over a contiguous int64 CPU tensor (fast element access from Python)."""
    return memoryview(t.numpy()).cast("B").cast("q")


# --------------------------------------------------------------------------- ping-pong
def _initiator(send, wait, tx: memoryview, rx: memoryview):
    """PE 0's batch: write the counter into the payload, send it, wait for the echo, check signal and payload."""

    def batch(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            tx[0] = i
            send(i)
            if wait(i) != i or rx[0] != i:
                bad += 1
        return bad

    return batch


def _responder(send, wait):
    """PE 1's batch: wait for the counter and echo back the observed value with the received payload."""

    def batch(first: int, n: int) -> int:
        for i in range(first, first + n):
            send(wait(i))
        return 0

    return batch


def _prepared_handles(comm, dst, src, sig):
    """(send, wait) through ``prepare_put_signal`` / ``prepare_signal_wait``."""
    return comm.prepare_put_signal(dst, src, PEER[comm.rank], sig, 0), comm.prepare_signal_wait(sig, 0, ">=")


def _generic_handles(comm, dst, src, sig):
    """(send, wait) through ``comm.put_signal`` / ``comm.signal_wait_until``."""
    return (functools.partial(comm.put_signal, dst, src, PEER[comm.rank], sig, 0),
            functools.partial(comm.signal_wait_until, sig, 0, ">="))


def _keyword_batch(comm, rx_t, sig):
    """The ping-pong batch through ``comm.put_signal(..., op="set")`` / ``comm.signal_wait_until(...,
    timeout=30)``: the generic calls as users write them, with keyword arguments and a bounded wait, written
    inline in the loop (the other paths call their handles directly, so no path pays for a wrapper frame that
    the others do not)."""
    put_signal, wait_until, peer = comm.put_signal, comm.signal_wait_until, PEER[comm.rank]
    if comm.rank == 0:
        tx_t = torch.zeros(1, dtype=torch.int64)
        tx, rx = words(tx_t), words(rx_t)

        def batch(first: int, n: int) -> int:
            bad = 0
            for i in range(first, first + n):
                tx[0] = i
                put_signal(rx_t, tx_t, peer, sig, 0, i, op="set")
                if wait_until(sig, 0, ">=", i, timeout=30) != i or rx[0] != i:
                    bad += 1
            return bad
    else:
        def batch(first: int, n: int) -> int:
            for i in range(first, first + n):
                put_signal(rx_t, rx_t, peer, sig, 0, wait_until(sig, 0, ">=", i, timeout=30), op="set")
            return 0
    return batch


def _torch_ops_handles(comm, dst, src, sig):
    """(send, wait) through ``torch.ops.asap_comm.put_signal`` / ``signal_wait_until`` (wait result as int)."""
    put_signal, wait_until = torch.ops.asap_comm.put_signal, torch.ops.asap_comm.signal_wait_until
    peer, cid = PEER[comm.rank], comm.id
    return (lambda v: put_signal(dst, src, peer, sig, 0, v, "set", cid),
            lambda v: int(wait_until(sig, 0, ">=", v, None, cid)))


def _handle_path(make_handles):
    """A ping-pong path whose two calls are the callables ``make_handles(comm, dst, src, sig)`` returns."""

    def make_batch(comm, rx_t, sig):
        if comm.rank == 0:
            tx_t = torch.zeros(1, dtype=torch.int64)
            send, wait = make_handles(comm, rx_t, tx_t, sig)
            return _initiator(send, wait, words(tx_t), words(rx_t))
        send, wait = make_handles(comm, rx_t, rx_t, sig)  # echo the received payload
        return _responder(send, wait)

    return make_batch


# path -> make_batch(comm, rx_t, sig): the batch function of this PE
PINGPONG_PATHS = {"prepared": _handle_path(_prepared_handles), "generic": _handle_path(_generic_handles),
                  "generic_kw": _keyword_batch, "torch_ops": _handle_path(_torch_ops_handles)}


def _pingpong(comm, plan: BatchPlan, make_batch) -> dict:
    """One 8-byte put_signal ping-pong: PE 0 sends counter ``i`` (payload and signal), PE 1 echoes both.

    PE 1 replies with its receive buffer as the source, so PE 0's check of the
    echoed payload and signal value covers both directions.
    """
    rx_t = comm.zeros((1,), torch.int64)  # payload lands here on each PE
    sig = comm.signals(1)
    batch = make_batch(comm, rx_t, sig)
    comm.barrier()
    samples, bad = time_batches(batch, plan)
    comm.barrier()
    return {"samples_ns": samples, "bad": bad}


def pingpong_pe(comm, plans: dict, pin: bool = True) -> dict:
    """Run the ping-pong through each API path in ``plans`` (a key of PINGPONG_PATHS -> BatchPlan).

    Returns the results by path. With ``pin``, each PE is pinned to its own
    CPU meanwhile (see ``_common.pinned``); without, the processes stay where
    the OS puts them, as a user would run them.
    """
    with pinned(comm.rank) if pin else contextlib.nullcontext():
        return {path: _pingpong(comm, plan, PINGPONG_PATHS[path]) for path, plan in plans.items()}


# --------------------------------------------------------------------------- put bandwidth
def put_bandwidth_pe(comm, nbytes: int, iters: int, warmup: int, thread_counts: tuple = (0,)) -> list:
    """PE 0 puts ``nbytes`` of float32 into PE 1's symmetric tensor; the baseline is a local ``copy_``.

    One pass per entry of ``thread_counts``: torch intra-op threads for both
    (0: torch's default); puts this large are done with torch's ``copy_``,
    so both use them. Returns one result per pass (see ``_put_vs_copy``).
    """
    dst = comm.zeros((nbytes // 4,), torch.float32)
    default = torch.get_num_threads()
    results = []
    for threads in thread_counts:
        torch.set_num_threads(threads or default)
        results.append(_put_vs_copy(comm, dst, iters, warmup))
    return results


def _put_vs_copy(comm, dst: torch.Tensor, iters: int, warmup: int) -> dict:
    """Time ``comm.put(dst, src, 1)`` against ``local.copy_(src)`` on PE 0, ``iters`` times each.

    Each iteration stamps the iteration number into element 0 (untimed),
    then times both, alternating their order so neither always finds the
    source cache-warm. Returns, on PE 0, ``samples_ns`` (put) and
    ``copy_samples_ns`` (ns per transfer); on every PE the blake2b ``digest``
    of what it holds after the last iteration (PE 0: the source, PE 1: the
    received tensor), ``bad`` (PE 0: the local copy differs from the source)
    and ``threads``.
    """
    result = {"samples_ns": [], "copy_samples_ns": [], "bad": 0, "threads": torch.get_num_threads()}
    if comm.rank == 0:
        src = pattern(dst.numel())
        local = torch.empty_like(src)

        def put():
            comm.put(dst, src, 1)

        def copy():
            local.copy_(src)

        for _ in range(warmup):
            put()
            copy()
        for k in range(iters):
            src[0] = float(k)
            first, second = (put, copy) if k % 2 == 0 else (copy, put)
            t_first, t_second = time_each(first), time_each(second)
            t_put, t_copy = (t_first, t_second) if k % 2 == 0 else (t_second, t_first)
            result["samples_ns"].append(t_put)
            result["copy_samples_ns"].append(t_copy)
        result["bad"] = int(not torch.equal(local, src))
        result["digest"] = digest(src.numpy())
    comm.barrier()  # release: every put is visible on PE 1 after this
    if comm.rank == 1:
        result["digest"] = digest(dst.numpy())
    comm.barrier()  # PE 1 has read dst before the next pass overwrites it
    return result


# --------------------------------------------------------------------------- mailbox round trip
class _WordViews:
    """Cached ``words()`` views of the tensors a mailbox hands out (it reuses one tensor object per slot)."""

    def __init__(self) -> None:
        self._cache: dict = {}

    def __call__(self, t: torch.Tensor) -> memoryview:
        entry = self._cache.get(id(t))
        if entry is None or entry[0] is not t:
            entry = self._cache[id(t)] = (t, words(t))
        return entry[1]


def _mailbox_initiator(box, tx: torch.Tensor, prepared: bool):
    """PE 0's batch: send counter ``i`` (tag and first/last payload word), receive the echo, check it.

    ``prepared``: send through ``box.prepare_send`` (a fixed staging buffer) instead of ``box.send``.
    """
    recv, tx_words, view = box.recv, words(tx), _WordViews()
    last = tx.numel() - 1
    if prepared:
        handle = box.prepare_send(1, tx)
        send = lambda i: handle(i)  # noqa: E731
    else:
        send = lambda i: box.send(1, tx, i)  # noqa: E731

    def batch(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            tx_words[0] = i
            tx_words[last] = i
            send(i)
            m = recv()
            w = view(m.tensor)
            if m.tag != i or m.src != 1 or w[0] != i or w[last] != i:
                bad += 1
            m.release()
        return bad

    return batch


def _mailbox_responder(box, numel: int, prepared: bool):
    """PE 1's batch: receive, check the tag, send the payload and tag back, release the slot.

    ``prepared``: echo the first/last words through a prepared staging buffer;
    otherwise send the received tensor itself (zero-copy view) back.
    """
    recv, view = box.recv, _WordViews()
    stage = torch.zeros(numel, dtype=torch.int64)
    stage_words, last, handle = words(stage), numel - 1, box.prepare_send(0, stage)

    def batch(first: int, n: int) -> int:
        bad = 0
        for i in range(first, first + n):
            m = recv()
            if m.tag != i:
                bad += 1
            if prepared:
                w = view(m.tensor)
                stage_words[0] = w[0]
                stage_words[last] = w[last]
                m.release()
                handle(i)
            else:
                box.send(0, m.tensor, m.tag)
                m.release()
        return bad

    return batch


def mailbox_pe(comm, plan: BatchPlan, nbytes: int, num_slots: int, prepared: bool = False, pin: bool = True) -> dict:
    """Mailbox round trips of ``nbytes``-byte int64 messages (PE 0 -> PE 1 -> PE 0), each PE on its own CPU
    (``pin``) or where the OS puts it."""
    with pinned(comm.rank) if pin else contextlib.nullcontext():
        return _mailbox_roundtrips(comm, plan, nbytes, num_slots, prepared)


def _mailbox_roundtrips(comm, plan: BatchPlan, nbytes: int, num_slots: int, prepared: bool) -> dict:
    box = comm.mailbox(nbytes, num_slots)
    if comm.rank == 0:
        batch = _mailbox_initiator(box, torch.zeros(nbytes // 8, dtype=torch.int64), prepared)
    else:
        batch = _mailbox_responder(box, nbytes // 8, prepared)
    comm.barrier()
    samples, bad = time_batches(batch, plan)
    comm.barrier()
    return {"samples_ns": samples, "bad": bad}


def launch(fn, *args, timeout: float) -> list:
    """``asap_comm.launch(fn, 2, *args)``: the per-PE results, bounded by ``timeout`` seconds."""
    return asap_comm.launch(fn, 2, *args, timeout=timeout)
