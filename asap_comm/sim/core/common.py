"""What both simulated modes share (``simulate.py`` has the modelling choices): the parallelism of attention
groups, the memoised cost model, and the front end (admission, placement, chunk delivery, results)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...serving.metrics import RequestRecord
from ...serving.policies import split_prompt
from ...serving.protocol import HDR, RuntimeConfig
from ...serving.traces import Request
from ..costmodel.hardware import RUNTIME_FACTORS
from ..costmodel.routing import routing_of
from .engine import Engine, Host

__all__ = ["Parallelism", "rows_per_rank_fraction", "SYNC_IDLE_POLL_S", "batch_skew"]

SYNC_IDLE_POLL_S = 0.001  # asap_comm.serving.sync_worker.IDLE_S: the idle baseline's heartbeat
_RESULT_BYTES_PER_HIDDEN = 4  # the result message carries the float32 final hidden state


@dataclass(frozen=True)
class Parallelism:
    """How attention groups are built (see the module docstring); the defaults are one device per rank.

    ``attention_tp``: devices per ASAP attention rank (tensor parallelism);
    ``sync_tp``: devices per baseline DP group; ``cp_threshold``: baseline prompts longer than this many tokens
    use context parallelism (None: never); ``sync_overlap``: the baseline hides its all_to_alls behind compute
    (two micro-batches per step, one's communication during the other's compute); ``serial_expert_transfers``:
    an ASAP expert rank sends nothing while it computes: it holds each batch's dispatch and combine transfers
    after computing it, as busy time (what the emulator does, ``EmulatedModel.hold_transfer``), instead of its
    links overlapping them with compute.
    """

    attention_tp: int = 1
    sync_tp: int = 1
    cp_threshold: "int | None" = None
    sync_overlap: bool = False
    serial_expert_transfers: bool = False

    def __post_init__(self) -> None:
        for name in ("sync_overlap", "serial_expert_transfers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Parallelism: {name}={getattr(self, name)!r} must be a bool")
        for name in ("attention_tp", "sync_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Parallelism: {name}={v!r} must be an int >= 1")
        c = self.cp_threshold
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"Parallelism: cp_threshold={c!r} must be None or an int >= 1")

    def describe(self) -> dict:
        out = {"attention_tp": self.attention_tp, "sync_tp": self.sync_tp, "cp_threshold": self.cp_threshold,
               "sync_overlap": self.sync_overlap}
        if self.serial_expert_transfers:  # only the emulator's replay sets it
            out["serial_expert_transfers"] = True
        return out


def rows_per_rank_fraction(num_experts: int, top_k: int, local_experts: int) -> float:
    """Chance that a token with ``top_k`` distinct experts out of ``num_experts`` has one of ``local_experts``."""
    if not 0 < top_k <= num_experts or not 0 <= local_experts <= num_experts:
        raise ValueError(f"rows_per_rank_fraction: top_k={top_k}, local_experts={local_experts} must be within "
                         f"num_experts={num_experts}")
    miss = math.comb(num_experts - local_experts, top_k) / math.comb(num_experts, top_k)
    return 1.0 - miss


def batch_skew(skew: float, tokens_by_request) -> float:
    """The slowest expert rank's work over the mean's for one batch, when one prompt's tokens alone give ``skew``
    (``CostModel.runtime``'s ``expert_skew``). A served router sends one prompt's tokens alike (they share its
    context) and different prompts' independently, so the batch's excess over the mean shrinks as its load spreads
    over more prompts: ``1 + (skew - 1) * sqrt(sum t**2) / sum t`` over the batch's tokens ``t`` per request
    (``tokens_by_request``: ``{request id: tokens}``, or ``(request id, tokens)`` pairs, summed per request),
    ``skew`` for one prompt, ``1 + (skew - 1) / sqrt(n)`` for ``n`` equal ones."""
    if skew == 1.0:
        return skew
    per: dict = {}
    for rid, t in (tokens_by_request.items() if isinstance(tokens_by_request, dict) else tokens_by_request):
        per[rid] = per.get(rid, 0) + t
    total = sum(per.values())
    if total <= 0:
        return skew
    return 1.0 + (skew - 1.0) * math.sqrt(sum(t * t for t in per.values())) / total


def _pairs(tokens: int, shapes, local_experts: int) -> list:
    """(token, expert) pairs per local expert for ``tokens`` tokens, balanced, summing to the expected total."""
    total = round(tokens * shapes.top_k * local_experts / shapes.num_experts)
    base, extra = divmod(total, local_experts)
    return [base + 1] * extra + [base] * (local_experts - extra)


def _validate(r: Request, cfg: RuntimeConfig) -> str | None:
    if r.prompt_len < 1:
        return "empty prompt"
    if r.prompt_len > cfg.max_prompt_len:
        return f"prompt of {r.prompt_len} tokens is longer than max_prompt_len={cfg.max_prompt_len}"
    return None


class _Memo:
    """The cost model with its one-integer-argument operations memoised (a run asks the same sizes again and
    again); ``attention_s`` and the rest pass through."""

    _CACHED = ("router_s", "shared_experts_s", "dense_mlp_s", "embed_s", "head_s", "dispatch_s", "combine_s",
               "message_s", "all_reduce_s")

    def __init__(self, cost) -> None:
        self._cost = cost
        for name in self._CACHED:
            fn, cache = getattr(cost, name), {}

            def cached(n, fn=fn, cache=cache):
                v = cache.get(n)
                if v is None:
                    v = cache[n] = fn(n)
                return v
            setattr(self, name, cached)
        self._experts: dict = {}
        self._a2a: dict = {}
        self._attn: dict = {}
        self._tp_ar: dict = {}
        self.runtime = {**RUNTIME_FACTORS, **(getattr(cost, "runtime", None) or {})}

    def __getattr__(self, name):
        return getattr(self._cost, name)

    def attention_s(self, chunks, tp: int = 1) -> float:
        if tp == 1:  # the plain call (cost models without tensor parallelism need not know ``tp``)
            return self._cost.attention_s(chunks)
        return self._cost.attention_s(chunks, tp=tp)

    def tp_all_reduce_s(self, tokens: int, tp: int) -> float:
        if tp == 1:
            return 0.0
        v = self._tp_ar.get((tokens, tp))
        if v is None:
            v = self._tp_ar[(tokens, tp)] = self._cost.tp_all_reduce_s(tokens, tp)
        return v

    def experts_s(self, pairs: list) -> float:
        # the cost depends on the multiset of row counts: one of values m and m + 1 (balanced lists, see _pairs)
        # is fixed by its bounds, length and sum; a skewed one (routing.py) by all its values
        hi, lo = max(pairs), min(pairs)
        key = (hi, lo, len(pairs), sum(pairs)) if hi - lo <= 1 else tuple(sorted(pairs))
        v = self._experts.get(key)
        if v is None:
            v = self._experts[key] = self._cost.experts_s(pairs)
        return v

    def all_to_all_s(self, rows: int, ranks: int, combine: bool = False) -> float:
        v = self._a2a.get((rows, ranks, combine))
        if v is None:
            v = self._a2a[(rows, ranks, combine)] = self._cost.all_to_all_s(rows, ranks, combine=combine)
        return v


class _Common:
    def __init__(self, cost, shapes, cfg: RuntimeConfig, requests, record_spans: bool,
                 par: Parallelism = Parallelism(), layers=None) -> None:
        cost = _Memo(cost)
        self.cost, self.shapes, self.cfg, self.par = cost, shapes, cfg, par
        self.engine = Engine()
        self.cpu = cost.cores is not None  # ranks share this host's CPU cores
        self.host = Host(self.engine, cost.cores)
        self.spans = [] if record_spans else None
        self.requests = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
        self.records = {r.request_id: RequestRecord(r.request_id, r.arrival_s, r.prompt_len) for r in requests}
        if len(self.records) != len(requests):
            raise ValueError("simulate: request ids must be unique")
        if layers is None:
            layers = [(bool(m), 1.0) for m in shapes.moe_layers]
        self.moe = [bool(m) for m, _w in layers]
        self.layer_weight = [float(w) for _m, w in layers]
        self.msg_result = cost.message_s(_RESULT_BYTES_PER_HIDDEN * (shapes.hidden + 1))
        self.routing = routing_of(cost)  # routing.py: balanced unless the cost model carries a skew
        self.load = None  # the skewed distribution's RankLoad on this mode's ranks (set by _skew)
        self.send_free = 0.0  # when the front end's sender is free again (_delivery_s)

    def _skew(self, ranks: int) -> None:
        """A skewed routing on ``ranks`` expert-holding ranks: the hottest rank's rows and pairs replace the
        balanced ones (``routing.py``: the slowest rank sets the pace of both modes)."""
        if not self.routing.balanced:
            self.load = self.routing.rank_load(self.shapes.num_experts, self.shapes.top_k, ranks)
            self.frac = self.load.row_frac[self.load.hot]

    def _expert_pairs(self, tokens: int) -> list:
        """(token, expert) pairs per local expert of the (hottest) rank for ``tokens`` tokens."""
        return _pairs(tokens, self.shapes, self.local) if self.load is None else self.load.pairs(tokens)

    def _placer_weight(self) -> "float | None":
        """The placer's linear weight: the config's, else derived from the cost model for this mode's attention
        groups of ``self.tp`` devices (``CostModel.placer_linear_weight``; None, the runtime's 512, for a cost
        model without it)."""
        if self.cfg.placer_linear_weight is not None:
            return self.cfg.placer_linear_weight
        derive = getattr(self.cost._cost, "placer_linear_weight", None)
        return None if derive is None else derive(self.tp)

    def _arrivals(self, arrive) -> None:
        for r in self.requests:
            self.engine.at(r.arrival_s, arrive, r)

    def _admit(self, r: Request):
        """Front end: validate, split, place. Returns (rank, chunks) or None if rejected."""
        rec = self.records[r.request_id]
        error = _validate(r, self.cfg)
        if error is not None:
            rec.start_s = rec.done_s = self.engine.now
            rec.error = f"rejected: {error}"
            return None
        chunks = split_prompt(r.request_id, r.prompt_len, self.cfg.effective_chunk_len)
        rank = self.placer.place(r.request_id, chunks)
        rec.start_s = self.engine.now
        return rank, chunks

    def arrive(self, r: Request) -> None:
        """Front end: admit the request and send its chunks to the chosen rank."""
        admitted = self._admit(r)
        if admitted is not None:
            rank, chunks = admitted
            self.engine.after(self._delivery_s(chunks), self._deliver, rank, chunks)

    def _deliver(self, rank: int, chunks: list) -> None:
        for c in chunks:
            self.batchers[rank].add(c)
        self._queued(rank)

    def _queued(self, rank: int) -> None:
        """New chunks are queued on ``rank``: the mode reacts (start micro-batches, or a step)."""
        raise NotImplementedError

    def _result(self, request_id: int) -> None:
        """The front end receives a request's result."""
        self.records[request_id].done_s = self.engine.now
        self.placer.complete(request_id)

    def _delivery_s(self, chunks) -> float:
        """Seconds from now until a request's ``chunks`` have reached their rank. The front end is one process
        that sends chunk after chunk in admission order (``FrontEnd._flush``), so a request's chunks leave once
        the chunks admitted before them have left: requests that arrive together reach their ranks in arrival
        order, whatever their sizes (a short prompt never overtakes a long one admitted before it)."""
        free = max(self.engine.now, self.send_free) + sum(self.cost.message_s(8 * (c.length + HDR)) for c in chunks)
        self.send_free = free
        return free - self.engine.now

    def _segments(self):
        """Per micro-batch: the layer runs between MoE layers: [(dense layers before, MoE layer)], each counted
        by its weight (the layers it stands for; 1 each unless ``layers=`` says otherwise); the MoE entry is 0.0
        for the run after the last MoE layer, which ends with the head."""
        segs, dense = [], 0.0
        for m, w in zip(self.moe, self.layer_weight):
            if m:
                segs.append((dense, w))
                dense = 0.0
            else:
                dense += w
        segs.append((dense, 0.0))  # the dense layers after the last MoE layer, then the head
        return segs

    def _finish_records(self) -> list:
        for rec in self.records.values():
            if rec.error is None and rec.done_s is None:
                rec.error = "not completed"
        return [self.records[r.request_id] for r in self.requests]
