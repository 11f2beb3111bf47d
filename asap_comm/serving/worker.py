"""The worker side of serving, shared by the asynchronous runtime's attention ranks and the baseline's workers.

* :class:`ChunkTaker`: handles the front end's messages on the request
  mailbox (a chunk, :data:`~asap_comm.serving.protocol.CANCEL` or
  :data:`~asap_comm.serving.protocol.STOP`; :func:`worker_cancel`);
* :func:`layer_loop`: one micro-batch through every layer, a generator that
  yields at each MoE layer whatever its ``moe`` step yields (the asynchronous
  runtime yields its exchange handle and resumes the micro-batch once the
  experts answered; the baseline's collective exchange never yields, and
  :func:`run_to_end` drives it);
* :func:`finish_chunks`: after a micro-batch's last layer, each finished
  request's result to the front end.

The front end's side of the chunk protocol is ``frontend.py``; the messages
themselves are ``protocol.py``.
"""
from __future__ import annotations

import torch

from ..errors import CommError, PeerFailure
from .failover import ROUTE, decode_route
from .patience import send_patiently
from .protocol import CANCEL, STOP, chunk_urgent, decode_cancel, decode_chunk, encode_result

__all__ = ["ChunkTaker", "worker_cancel", "layer_loop", "run_to_end", "finish_chunks", "FAILED", "report_failure",
           "decode_failure"]

FAILED = -3  # tag of a worker's "I give up" message to the front end (payload: encode_failure's UTF-8 bytes)


def report_failure(box, front: int, role: str, error: BaseException, timeout: float = 1.0) -> None:
    """Best effort, bounded by ``timeout``: tell the front end (PE ``front``) why this worker gives up, so that
    the service fails with that reason (503, exit status 3, the reason logged) instead of learning only that
    the worker left. ``error``: what ended the worker (a ``PeerFailure`` names the PE it lost)."""
    pe = getattr(error, "pe", None) if isinstance(error, PeerFailure) else None
    reason = getattr(error, "reason", None) if pe is not None else None
    text = f"{-1 if pe is None else pe}|{reason or ''}|{role} PE {box.comm.rank} gave up: {error}"
    data = text.encode("utf-8", "replace")[: box.slot_bytes]
    try:
        box.send(front, torch.frombuffer(bytearray(data), dtype=torch.uint8), FAILED, timeout=timeout)
    except Exception:  # the front end is gone or does not answer: it learns from the worker's leaving
        pass


def decode_failure(src: int, payload: torch.Tensor) -> PeerFailure:
    """The front end's side of :func:`report_failure`: the ``PeerFailure`` to raise (naming the PE the worker
    lost, with its reason, or the worker itself as ``"closed"``), its message the worker's."""
    pe, reason, text = bytes(payload.tolist()).decode("utf-8", "replace").split("|", 2)
    lost = int(pe) if pe.lstrip("-").isdigit() and int(pe) >= 0 else None
    if lost is None or reason not in ("died", "closed"):
        return PeerFailure(text, pe=src, reason="closed")
    return PeerFailure(text, pe=lost, reason=reason)


def finish_chunks(model, box, front: int, chunks, hs, caches: dict, batcher, cancelled: "set | None" = None) -> None:
    """After a micro-batch's last layer: send each finished request's result (final-normed hidden of its
    last prompt token + its greedy first token) to the front end, drop its cache, free its chunks. A
    request in ``cancelled`` (the front end dropped it while this chunk ran) sends nothing and loses its
    cache whatever chunk this was."""
    for c, h in zip(chunks, hs):
        if cancelled and c.request_id in cancelled:
            cancelled.discard(c.request_id)
            caches.pop(c.request_id, None)
        elif c.last:
            normed = model.final_norm(h[-1:])
            token = int(model.lm_head_logits(normed).argmax(-1)[0])
            # a stopped front end is waited out (its inbox fills); only its death ends the wait
            send_patiently(box, front, encode_result(normed[0], token), c.request_id)
            del caches[c.request_id]
        batcher.done(c)


def layer_loop(info, hs: list, attend, moe, dense, before=None):
    """The per-layer loop of one micro-batch, shared by both runtimes (a generator: it yields what ``moe``
    yields, and returns the sequences' final hidden states).

    ``hs``: the micro-batch's embedded sequences ``[len_i, H]`` (empty: the baseline's dummy batch, which
    still joins every MoE layer). Per layer: ``attend(layer, hs)`` -> one attention-stage output per sequence
    (``.hidden``, ``.mlp_input``; ``[]`` for a dummy batch); the MLP input of all sequences goes, concatenated,
    to ``moe(layer, mlp)`` (a generator returning routed + shared experts' output, or None for a dummy batch)
    on MoE layers and to ``dense(layer, mlp)`` on the others; its output is split back and added to each
    sequence's residual. ``before(layer)`` (optional, a generator; the long-prompt lane's wait for earlier
    chunks' KV, ``lane.py``) runs before each layer's attention and may yield too.
    """
    lens = [int(h.shape[0]) for h in hs]
    empty = torch.empty(0, info.hidden, dtype=info.dtype)
    for layer in range(info.num_layers):
        if before is not None:
            yield from before(layer)
        outs = attend(layer, hs)
        mlp = (torch.cat([o.mlp_input for o in outs]) if len(outs) > 1 else outs[0].mlp_input) if outs else empty
        if info.moe_layers[layer]:
            y = yield from moe(layer, mlp)
        elif outs:
            y = dense(layer, mlp)
        else:
            y = None
        if not outs:
            continue
        ys = y.split(lens) if len(lens) > 1 else (y,)
        hs = [o.hidden + yi for o, yi in zip(outs, ys)]
    return hs


def run_to_end(gen):
    """Drive a generator that never yields (the baseline's ``layer_loop``: its MoE exchange is synchronous) to
    its return value."""
    try:
        value = next(gen)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError(f"run_to_end: the generator yielded {value!r}")


def worker_cancel(rid: int, batcher, tokens: dict, caches: dict, cancelled: set) -> None:
    """A worker's side of a :data:`CANCEL` message: drop the request's queued chunks and, unless one of its
    chunks is running (then ``finish_chunks`` drops it after), its KV cache."""
    for c in batcher.cancel(rid):
        tokens.pop((rid, c.index), None)
    if batcher.running(rid):
        cancelled.add(rid)
    else:
        caches.pop(rid, None)


class ChunkTaker:
    """The worker side of the chunk protocol, shared by the async attention ranks and the baseline's workers:
    :meth:`_take` handles one request-mailbox message (a chunk, :data:`CANCEL`, :data:`STOP` or expert failover's
    ``failover.ROUTE``, given to :meth:`_route`). Needs ``batcher`` (a ``MicroBatcher``), ``tokens``, ``caches``
    and ``cancelled``; :meth:`_queue_chunk` decides where a chunk goes (by default the micro-batcher)."""

    def _take(self, m) -> bool:
        """Handle one mailbox message; False on the stop message."""
        with m:
            if m.tag == STOP:
                return False
            if m.tag == CANCEL:
                self._cancel(decode_cancel(m.tensor))
                return True
            if m.tag == ROUTE:
                self._route(m.src, decode_route(m.tensor))
                return True
            chunk, groups, toks = decode_chunk(m.tensor)
            urgent = chunk_urgent(m.tensor)
        self.tokens[(chunk.request_id, chunk.index)] = toks
        self._queue_chunk(chunk, groups, urgent)
        return True

    def _cancel(self, rid: int) -> None:
        worker_cancel(rid, self.batcher, self.tokens, self.caches, self.cancelled)

    def _queue_chunk(self, chunk, groups: int, urgent: bool = False) -> None:
        self.batcher.add(chunk, urgent=urgent)

    def _route(self, src: int, msg: tuple) -> None:
        """Expert failover's route message ``(expert rank, new PE or -1, dead PE)``: only the asynchronous
        runtime's attention ranks take one."""
        raise CommError(f"route: PE {src} sent a failover message to a worker that serves no expert exchange")
