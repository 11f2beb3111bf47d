"""The asynchronous disaggregated prefill runtime (ASAP mode).

Processes (one ``asap_comm`` group, ``A + E + 1`` PEs):

* PEs ``0..A-1``, attention ranks: embedding, attention with each request's
  KV cache, router, dense layers, shared experts, final norm and head. Each
  runs up to two micro-batches at once (ping-pong): a micro-batch is a
  generator that yields its ``DispatchHandle`` at every MoE layer, and the
  rank resumes whichever micro-batch's experts have answered.
* PEs ``A..A+E-1``, expert ranks: the routed experts of every MoE layer,
  served to any attention rank as rows arrive, gathered per layer up to a
  token budget or a deadline (``ExpertBatcher``).
* PE ``A+E``, the front end: replays the request trace in real time, places
  each request (``Placer``, after splitting long prompts with
  ``split_prompt``) and collects results through mailboxes.

No collective call and no barrier is on the data path. The runtime is
model-agnostic: ``model_factory(role, experts)`` returns an object with the
stage methods of ``models.DeepseekV3`` (``embed``, ``attention_stage``,
``route``, ``dense_mlp``, ``shared_experts``, ``expert``, ``final_norm``,
``lm_head_logits``, ``new_cache``); ``ModelInfo`` carries its shapes.

Result of a request: its first generated token (greedy) and the final-normed
hidden state of its last prompt token. TTFT = arrival to the moment the front
end receives that result.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import CommError, LaunchError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from ..launch import launch
from ..moe import AttentionEnd, ExpertBatch, ExpertEnd, MoEPlan, apply_experts, join_as_bystander
from .metrics import RequestRecord
from .policies import Chunk, ExpertBatcher, MicroBatcher, Placer, split_prompt

__all__ = ["ModelInfo", "RuntimeConfig", "PromptRequest", "RunResult", "run_async"]

_STOP = -1  # tag of the front end's "no more requests" message
_HDR = 4  # chunk message header words: request id, chunk index, number of chunks, start


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs to know about a model: shapes and which layers are MoE."""

    num_layers: int
    moe_layers: tuple  # bool per layer
    hidden: int
    vocab_size: int
    num_experts: int
    top_k: int
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class RuntimeConfig:
    """Ranks, budgets and the four optimizations (each switchable for ablation)."""

    num_attention_ranks: int = 2
    num_expert_ranks: int = 2
    token_budget: int = 512  # tokens per attention micro-batch
    max_prompt_len: int = 8192
    chunk_len: "int | None" = 512  # split longer prompts into chunks (with load_aware)
    ping_pong: bool = True  # (2) two micro-batches in flight per attention rank
    load_aware: bool = True  # (3) least-outstanding-work placement + long-prompt splitting
    expert_batching: bool = True  # (4) gather rows per layer across attention ranks
    expert_token_budget: int = 1024
    expert_deadline_s: float = 0.002
    timeout_s: float = 600.0  # bound on the whole run
    progress: bool = False  # a live progress line on stderr from the front end

    def __post_init__(self) -> None:
        for name in ("num_attention_ranks", "num_expert_ranks", "token_budget", "max_prompt_len",
                     "expert_token_budget"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RuntimeConfig: {name}={v!r} must be an int >= 1")
        if self.chunk_len is not None and (not isinstance(self.chunk_len, int) or self.chunk_len < 1):
            raise ValueError(f"RuntimeConfig: chunk_len={self.chunk_len!r} must be None or an int >= 1")

    @property
    def effective_chunk_len(self) -> "int | None":
        return self.chunk_len if self.load_aware else None

    @property
    def max_chunk_tokens(self) -> int:
        c = self.effective_chunk_len
        return self.max_prompt_len if c is None else min(c, self.max_prompt_len)


@dataclass(frozen=True)
class PromptRequest:
    """A request: prompt token ids (1-D int64) arriving ``arrival_s`` after the run starts."""

    request_id: int
    arrival_s: float
    token_ids: torch.Tensor


@dataclass
class RunResult:
    """Per-request records, outputs ``{request_id: (first_token, hidden [H])}``, and the timeline."""

    records: list
    outputs: dict
    spans: list = field(default_factory=list)  # (pe, track, name, start_s from the first span, dur_s)
    mode: str = "async"


def _validate(req: PromptRequest, info: ModelInfo, cfg: RuntimeConfig) -> "str | None":
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


def _plan(cfg: RuntimeConfig, info: ModelInfo) -> MoEPlan:
    return MoEPlan(num_attention_ranks=cfg.num_attention_ranks, num_expert_ranks=cfg.num_expert_ranks,
                   num_experts=info.num_experts, hidden=info.hidden, dtype=info.dtype,
                   max_tokens=max(cfg.token_budget, cfg.max_chunk_tokens), top_k=info.top_k,
                   max_inflight=2 if cfg.ping_pong else 1)


def _mailbox(comm, cfg: RuntimeConfig, info: ModelInfo):
    """Requests (front end -> attention) and results (attention -> front end) share one mailbox."""
    slot = max(8 * (cfg.max_chunk_tokens + _HDR), 4 * (info.hidden + 1), 256)
    return comm.mailbox(slot, 8 * (cfg.num_attention_ranks + 4))


# ----------------------------------------------------------------------------- attention rank
class _AttentionRank:
    def __init__(self, comm, cfg: RuntimeConfig, info: ModelInfo, model, plan: MoEPlan) -> None:
        self.comm, self.cfg, self.info, self.model = comm, cfg, info, model
        self.att = AttentionEnd(comm, plan)
        self.box = _mailbox(comm, cfg, info)
        self.front = cfg.num_attention_ranks + cfg.num_expert_ranks
        self.batcher = MicroBatcher(cfg.token_budget)
        self.tokens: dict = {}  # (request, chunk index) -> token ids
        self.caches: dict = {}  # request -> KV cache
        self.spans: list = []  # (pe, track, name, start on the host's monotonic clock, duration)

    def _take(self, m) -> bool:
        """Handle one mailbox message; False on the stop message."""
        with m:
            if m.tag == _STOP:
                return False
            hdr = m.tensor[:_HDR].tolist()
            rid, index, n, start = hdr
            toks = m.tensor[_HDR:].clone()
        self.tokens[(rid, index)] = toks
        self.batcher.add(Chunk(rid, index, start, toks.numel(), n))
        return True

    def _microbatch(self, chunks: list):
        """One micro-batch through every layer; yields its DispatchHandle at each MoE layer."""
        model, info, att = self.model, self.info, self.att
        caches = [self.caches.setdefault(c.request_id, model.new_cache()) for c in chunks]
        lens = [c.length for c in chunks]
        hs = [model.embed(self.tokens.pop((c.request_id, c.index))) for c in chunks]
        t_start = time.monotonic()
        for layer in range(info.num_layers):
            outs = [model.attention_stage(layer, h, cache) for h, cache in zip(hs, caches)]
            mlp = torch.cat([o.mlp_input for o in outs]) if len(outs) > 1 else outs[0].mlp_input
            if info.moe_layers[layer]:
                routing = model.route(layer, mlp)
                handle = att.dispatch_send(mlp, routing.topk_ids, routing.topk_weights, layer)
                shared = model.shared_experts(layer, mlp)
                self.spans.append((self.comm.rank, 0, f"attn L{layer}", t_start, time.monotonic() - t_start))
                yield handle
                t_start = time.monotonic()
                y = att.combine_recv(handle) + shared
            else:
                y = model.dense_mlp(layer, mlp)
            ys = y.split(lens) if len(lens) > 1 else (y,)
            hs = [o.hidden + yi for o, yi in zip(outs, ys)]
        for c, h in zip(chunks, hs):
            if c.last:
                normed = model.final_norm(h[-1:])
                token = int(model.lm_head_logits(normed).argmax(-1)[0])
                out = torch.cat([normed[0].float(), torch.tensor([float(token)])])
                self.box.send(self.front, out, c.request_id)
                del self.caches[c.request_id]
            self.batcher.done(c)
        self.spans.append((self.comm.rank, 0, "attn tail", t_start, time.monotonic() - t_start))

    def run(self) -> list:
        running: list = []  # [generator, handle or None]
        stopped = False
        max_running = 2 if self.cfg.ping_pong else 1
        while True:
            while (m := self.box.poll()) is not None:
                stopped |= not self._take(m)
            while len(running) < max_running:
                batch = self.batcher.next_batch()
                if not batch:
                    break
                running.append([self._microbatch(batch), None])
            if stopped and not running and len(self.batcher) == 0:
                break
            progressed = False
            for entry in list(running):
                gen, handle = entry
                if handle is None or self.att.is_ready(handle):
                    try:
                        entry[1] = next(gen)
                    except StopIteration:
                        running.remove(entry)
                    progressed = True
            if progressed:
                continue
            if running:  # every micro-batch waits for its experts: wait on the oldest, briefly
                try:
                    self.comm.signal_wait_until(self.att._buf.done, running[0][1].slot, ">=", running[0][1].target,
                                                timeout=0.002)
                except CommTimeoutError:
                    pass
            else:
                try:
                    stopped |= not self._take(self.box.recv(timeout=0.05))
                except CommTimeoutError:
                    pass
        self.att.finish()
        return self.spans


def _attention_main(comm, cfg, info, model_factory, plan):
    torch.set_num_threads(1)
    rank = _AttentionRank(comm, cfg, info, model_factory("attention", []), plan)
    return rank.run()


# ----------------------------------------------------------------------------- expert rank
def _expert_main(comm, cfg, info, model_factory, plan):
    torch.set_num_threads(1)
    experts = plan.local_experts(comm.rank)
    model = model_factory("expert", experts)
    ex = ExpertEnd(comm, plan)
    _mailbox(comm, cfg, info)
    batcher = ExpertBatcher(cfg.expert_token_budget, cfg.expert_deadline_s, enabled=cfg.expert_batching)
    spans = []
    while True:
        now = time.monotonic()
        layer = batcher.ready(now)
        if layer is not None:
            batch = ExpertBatch.merge(batcher.take(layer))
            out = apply_experts(batch, lambda e, x: model.expert(layer, e, x), out=ex.output_buffer(batch))
            ex.combine_send(batch, out)
            spans.append((comm.rank, 0, f"experts L{layer} ({batch.num_rows} rows)", now, time.monotonic() - now))
            continue
        if ex.finished and batcher.held_rows == 0:
            break
        wait = batcher.wait_s(now)
        try:
            batches = ex.dispatch_recv_many(timeout=0.05 if wait is None else max(wait, 1e-4))
        except CommTimeoutError:
            batches = []
        now = time.monotonic()
        for b in batches:
            batcher.add(b.layer, b.num_rows, b, now)
    return spans


# ----------------------------------------------------------------------------- front end
def _front_main(comm, cfg, info, requests, plan, report_path, label="async"):
    torch.set_num_threads(1)
    join_as_bystander(comm, plan)
    box = _mailbox(comm, cfg, info)
    A = cfg.num_attention_ranks
    placer = Placer(A, load_aware=cfg.load_aware)
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, int(r.token_ids.numel())) for r in requests}
    outputs: dict = {}
    order = sorted(requests, key=lambda r: r.arrival_s)
    outstanding: set = set()
    t0 = time.monotonic()
    i = 0
    failure = None

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
    try:
        last_report = 0.0
        while i < len(order) or outstanding:
            now = time.monotonic() - t0
            if cfg.progress and now - last_report >= 0.5:
                last_report = now
                done = sum(1 for rec in records.values() if rec.done_s is not None)
                print(f"\r  [{label}] {now:6.1f} s  arrived {i}/{len(order)}  done {done}  in flight "
                      f"{len(outstanding)}  ", end="", file=sys.stderr, flush=True)
            while i < len(order) and order[i].arrival_s <= now:
                r = order[i]
                i += 1
                rec = records[r.request_id]
                error = _validate(r, info, cfg)
                if error is not None:
                    rec.start_s, rec.done_s, rec.error = now, now, f"rejected: {error}"
                    continue
                chunks = split_prompt(r.request_id, int(r.token_ids.numel()), cfg.effective_chunk_len)
                rank = placer.place(r.request_id, chunks)
                for c in chunks:
                    hdr = torch.tensor([c.request_id, c.index, c.num_chunks, c.start], dtype=torch.int64)
                    send(rank, torch.cat([hdr, r.token_ids[c.start:c.start + c.length].to(torch.int64)]),
                         r.request_id)
                rec.start_s = now
                outstanding.add(r.request_id)
            next_arrival = order[i].arrival_s - (time.monotonic() - t0) if i < len(order) else 0.05
            try:
                take(box.recv(timeout=max(1e-4, min(0.05, next_arrival))))
            except CommTimeoutError:
                continue
    except PeerFailure as e:
        role = "attention" if e.pe is not None and e.pe < A else "expert"
        failure = f"worker failure: {role} worker PE {e.pe} {e.reason} ({e})"
    except CommTimeoutError as e:
        failure = f"worker failure: {e}"
    now = time.monotonic() - t0
    for rid in outstanding:
        records[rid].done_s = None
        records[rid].error = failure or "not completed"
    for r in order[i:]:
        records[r.request_id].error = failure or "not admitted"
    if cfg.progress:
        print(f"\r  [{label}] {now:6.1f} s  {len(outputs)}/{len(order)} completed" + " " * 30, file=sys.stderr,
              flush=True)
    result = ([records[r.request_id] for r in requests], outputs)
    with open(report_path, "wb") as f:  # survives a LaunchError caused by a dead worker
        pickle.dump(result, f)
    if failure is None:
        for a in range(A):
            send(a, torch.zeros(1, dtype=torch.int64), _STOP)
    return result


def _pe_main(comm, cfg, info, model_factory, requests, report_path):
    plan = _plan(cfg, info)
    A, E = cfg.num_attention_ranks, cfg.num_expert_ranks
    if comm.rank < A:
        return ("attention", _attention_main(comm, cfg, info, model_factory, plan))
    if comm.rank < A + E:
        return ("expert", _expert_main(comm, cfg, info, model_factory, plan))
    return ("front", _front_main(comm, cfg, info, requests, plan, report_path))


def run_async(model_factory: Callable[[str, list], Any], info: ModelInfo, requests: Sequence[PromptRequest],
              cfg: RuntimeConfig = RuntimeConfig()) -> RunResult:
    """Run ``requests`` through the asynchronous disaggregated runtime; return per-request results.

    ``model_factory(role, experts)`` (picklable; ``role`` is ``"attention"``
    or ``"expert"``) builds each worker's model. Runs ``A + E + 1``
    processes on this host. If a worker dies, the requests it held fail with
    an error and the run still returns (nothing hangs; ``timeout_s`` bounds it).
    """
    world = cfg.num_attention_ranks + cfg.num_expert_ranks + 1
    fd, report = tempfile.mkstemp(prefix="asap-run-", suffix=".pkl")
    os.close(fd)
    try:
        try:
            results = launch(_pe_main, world, cfg, info, model_factory, list(requests), report,
                             timeout=cfg.timeout_s)
        except (LaunchError, CommError) as e:
            if os.path.getsize(report) == 0:
                raise
            with open(report, "rb") as f:
                records, outputs = pickle.load(f)
            for rec in records:
                if rec.error is None and rec.done_s is None:
                    rec.error = f"run aborted: {str(e).splitlines()[0]}"
            return RunResult(records, outputs, [], "async")
        spans = [s for role, payload in results if role != "front" for s in payload]
        origin = min((s[3] for s in spans), default=0.0)  # CLOCK_MONOTONIC is shared by the host's processes
        spans = [(pe, track, name, start - origin, dur) for pe, track, name, start, dur in spans]
        records, outputs = results[-1][1]
        return RunResult(records, outputs, spans, "async")
    finally:
        os.unlink(report)
