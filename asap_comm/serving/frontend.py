"""The front end shared by the asynchronous runtime and the synchronous baseline.

It owns the request queue: replays arrivals in real time, rejects bad
requests, places requests on the ranks that run attention (``Placer``, with
``split_prompt`` for long prompts), sends their chunks through mailboxes and
collects each request's result (first token, final hidden state). Both
runtimes use it unchanged, so they differ only in how the workers run.
"""
from __future__ import annotations

import pickle
import sys
import time
from typing import Callable, Sequence

import torch

from ..errors import CommError, LaunchError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from ..launch import launch
from .metrics import RequestRecord
from .policies import Placer, split_prompt
from .protocol import HDR, STOP, encode_chunk

__all__ = ["STOP", "HDR", "request_mailbox", "run_front_end", "replay_report", "run_group", "validate"]



def validate(req, info, cfg) -> "str | None":
    """Why a request must be rejected, or None."""
    t = req.token_ids
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        return "prompt must be a 1-D tensor of token ids"
    if t.numel() == 0:
        return "empty prompt"
    if t.numel() > cfg.max_prompt_len:
        return f"prompt of {t.numel()} tokens is longer than max_prompt_len={cfg.max_prompt_len}"
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= info.vocab_size:
        return f"token id out of the vocabulary [0, {info.vocab_size}): min {lo}, max {hi}"
    return None


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


def finish_chunks(model, box, front: int, chunks, hs, caches: dict, batcher) -> None:
    """After a micro-batch's last layer: send each finished request's result (final-normed hidden of its
    last prompt token + its greedy first token) to the front end, drop its cache, free its chunks."""
    for c, h in zip(chunks, hs):
        if c.last:
            normed = model.final_norm(h[-1:])
            token = int(model.lm_head_logits(normed).argmax(-1)[0])
            box.send(front, torch.cat([normed[0].float(), torch.tensor([float(token)])]), c.request_id)
            del caches[c.request_id]
        batcher.done(c)


def request_mailbox(comm, cfg, info, num_targets: int):
    """Collective: requests (front end -> ranks) and results (ranks -> front end) share one mailbox."""
    slot = max(8 * (cfg.max_chunk_tokens + HDR), 4 * (info.hidden + 1), 256)
    return comm.mailbox(slot, 8 * (num_targets + 4))


def run_front_end(comm, cfg, info, requests, report_path: str, box, num_targets: int,
                  label: str, role_of: Callable[[int], str]) -> tuple:
    """The front end of both runtimes: replay arrivals, reject bad requests, place, collect results.

    Places each request (its chunks) on one of PEs ``0..num_targets-1``
    (``Placer``; long prompts split by ``split_prompt``), sends the chunks
    through ``box`` and takes results from its own inbox. Never blocks on a
    full inbox while results wait (see ``send``). Appends every event to
    ``report_path`` so the records survive a worker's death (``replay_report``).
    Returns ``(records in request order, {request_id: (first token, hidden)})``.
    """
    W = num_targets
    placer = Placer(W, load_aware=cfg.load_aware)
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests}
    outputs: dict = {}
    order = sorted(requests, key=lambda r: r.arrival_s)
    outstanding: set = set()
    t0 = time.monotonic()
    i = 0
    failure = None
    report = open(report_path, "ab")

    def log(event: tuple) -> None:
        """Append an event to the report, which survives a LaunchError caused by a dead worker."""
        pickle.dump(event, report)
        report.flush()

    def take(m) -> None:
        """Record one result message."""
        with m:
            rid = m.tag
            hidden = m.tensor[:-1].clone()
            token = int(m.tensor[-1])
        records[rid].done_s = time.monotonic() - t0
        outputs[rid] = (token, hidden)
        outstanding.discard(rid)
        placer.complete(rid)
        log(("done", rid, records[rid].done_s, token, hidden))

    def send(rank: int, payload: torch.Tensor, tag: int) -> None:
        """Send without ever blocking the results: while rank's inbox is full, take results."""
        deadline = time.monotonic() + cfg.timeout_s
        while True:
            try:
                return box.send(rank, payload, tag, timeout=0.005)
            except CommTimeoutError:
                if time.monotonic() > deadline:
                    raise
                m = box.poll()
                if m is not None:
                    take(m)
    progress = cfg.progress
    # On a terminal one live line rewrites itself ("\r"); into a pipe or a file, whole lines, less often.
    live = progress and sys.stderr.isatty()
    every_s = 0.5 if live else 5.0
    watch = DeathWatch(comm, range(comm.world_size))
    try:
        last_report = 0.0
        while i < len(order) or outstanding:
            now = time.monotonic() - t0
            if progress and now - last_report >= every_s:
                last_report = now
                done = sum(1 for rec in records.values() if rec.done_s is not None)
                line = f"  [{label}] {now:6.1f} s  arrived {i}/{len(order)}  done {done}  in flight {len(outstanding)}"
                print("\r" + line + "  " if live else line, end="" if live else "\n", file=sys.stderr, flush=True)
            while i < len(order) and order[i].arrival_s <= now:
                r = order[i]
                i += 1
                rec = records[r.request_id]
                error = validate(r, info, cfg)
                if error is not None:
                    rec.start_s, rec.done_s, rec.error = now, now, f"rejected: {error}"
                    log(("rejected", r.request_id, now, rec.error))
                    continue
                n = int(r.token_ids.numel())
                chunks = split_prompt(r.request_id, n, cfg.effective_chunk_len)
                cp = cfg.cp_threshold if label == "sync" else None
                if cp is not None and n > cp and W > 1:  # context parallelism: the least-loaded groups share it
                    groups = placer.place_group(r.request_id, chunks, min(W, -(-n // cp)))
                    rank, mask = groups[0], sum(1 << j for j in groups)
                else:
                    rank, mask = placer.place(r.request_id, chunks), 0
                for c in chunks:
                    send(rank, encode_chunk(c, r.token_ids[c.start:c.start + c.length], mask), r.request_id)
                rec.start_s = now
                outstanding.add(r.request_id)
                log(("start", r.request_id, now))
            next_arrival = order[i].arrival_s - (time.monotonic() - t0) if i < len(order) else 0.05
            try:
                take(box.recv(timeout=max(1e-4, min(0.05, next_arrival))))
            except CommTimeoutError:
                watch.check()
                continue
    except PeerFailure as e:
        failure = f"worker failure: {role_of(e.pe)} PE {e.pe} {e.reason} ({e})"
    except CommTimeoutError as e:
        failure = f"worker failure: {e}"
    if progress:
        line = f"  [{label}] {time.monotonic() - t0:6.1f} s  {len(outputs)}/{len(order)} completed"
        print("\r" + line + " " * 30 if live else line, file=sys.stderr, flush=True)
    for rid in outstanding:
        records[rid].done_s = None
        records[rid].error = failure or "not completed"
    for r in order[i:]:
        records[r.request_id].error = failure or "not admitted"
    result = ([records[r.request_id] for r in requests], outputs)
    log(("final", result))
    report.close()
    if failure is None:
        for w in range(W):
            send(w, torch.zeros(1, dtype=torch.int64), STOP)
    return result


def replay_report(path: str, requests: Sequence) -> tuple:
    """``(records, outputs)`` from the front end's event log, however far it got."""
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests}
    outputs: dict = {}
    with open(path, "rb") as f:
        while True:
            try:
                event = pickle.load(f)
            except Exception:  # the end (EOFError), or a torn last event
                break
            kind, payload = event[0], event[1:]
            if kind == "final":
                return payload[0]
            rec = records[payload[0]]
            if kind == "start":
                rec.start_s = payload[1]
            elif kind == "rejected":
                rec.start_s = rec.done_s = payload[1]
                rec.error = payload[2]
            elif kind == "done":
                rec.done_s = payload[1]
                outputs[payload[0]] = (payload[2], payload[3])
    return [records[r.request_id] for r in requests], outputs


def run_group(pe_main, world: int, args: tuple, requests: Sequence, report_path: str, timeout_s: float,
              result_type, mode: str):
    """Launch ``pe_main(comm, *args)`` on ``world`` PEs (the front end last) and build the run's result.

    Spans of the workers are re-based on the first one (CLOCK_MONOTONIC is
    shared by the host's processes). If a PE dies, the front end's event log
    gives the records anyway and requests left unfinished get the error.
    """
    try:
        results = launch(pe_main, world, *args, timeout=timeout_s)
    except (LaunchError, CommError) as e:
        records, outputs = replay_report(report_path, requests)
        for rec in records:
            if rec.error is None and rec.done_s is None:
                rec.error = f"run aborted: {str(e).splitlines()[0]}"
        return result_type(records, outputs, [], mode)
    spans = [s for role, payload in results if role != "front" for s in payload]
    origin = min((s[3] for s in spans), default=0.0)
    spans = [(pe, track, name, start - origin, dur) for pe, track, name, start, dur in spans]
    records, outputs = results[-1][1]
    return result_type(records, outputs, spans, mode)
