"""The expert-rank half of the MoE exchange: ``dispatch_recv``, ``output_buffer``, ``combine_send`` and the
node-aware reduction (``asap_comm.moe``)."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from ..errors import CommError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from .plan import _DESC_WORDS, _FIN, ExpertBatch, MoEPlan, _Buffers

__all__ = ["ExpertEnd"]

_SENDERS_EVERY_S = 0.1  # how often a waiting dispatch_recv checks that an attention rank may still send


class ExpertEnd:
    """The expert-rank half: ``dispatch_recv``, ``output_buffer`` and ``combine_send``.

    Construct on every expert PE while every attention PE constructs its
    ``AttentionEnd`` (collective allocation, once). Single-threaded.
    Iterating yields batches until every attention rank has called ``finish``.
    On a spare expert PE (``plan.spare_pes``) it serves no expert rank until
    :meth:`take_over`; it still takes descriptors and the ``finish`` ones.
    """

    def __init__(self, comm, plan: MoEPlan) -> None:
        if not plan.num_attention_ranks <= comm.rank < plan.world_size:
            raise ValueError(f"ExpertEnd: PE {comm.rank} is not an expert rank (expert ranks are "
                             f"{plan.num_attention_ranks}..{plan.world_size - 1})")
        self.comm, self.plan = comm, plan
        self._buf = _Buffers(comm, plan)
        self.experts = plan.local_experts(comm.rank)
        # the expert rank this PE serves (0..E-1; its returns count on word (slot, rank)); None: a spare not yet used
        self.expert_rank = comm.rank - plan.num_attention_ranks if comm.rank not in plan.spare_pes else None
        self._finished: set[int] = set()
        # attention failover: a dead attention PE counts as finished once another attention PE lives or finished,
        # and rows computed for it are dropped (nobody reads them); off: its death fails the wait (PeerFailure)
        self.lose_senders = False
        self.lost: set[int] = set()  # attention PEs counted as finished because they died
        # address of combine[0, 0] on each attention PE, where its transport addresses it directly (this host);
        # None for the others: their rows travel with put_signal
        views = [comm.transport(a).direct_view(self._buf.combine) for a in range(plan.num_attention_ranks)]
        self._combine_at = [None if v is None else v.data_ptr() for v in views]
        self._mine = torch.zeros(plan.num_experts, dtype=torch.bool)  # [N]: experts held here
        self._mine[self.experts] = True
        self._minus1 = torch.tensor(-1, dtype=torch.int32)
        # node-aware parts received and not yet combined: (a, slot) -> (gateway, host PEs, union rows n, combine
        # offset, contacted mask, rows of the union that are this rank's)
        self._host_parts: dict = {}
        self._group = next((pes for pes in self._buf.host_groups.values() if comm.rank in pes), None)
        self.node_aware_parts = 0  # node-aware parts received (each gathered from a gateway)
        self.node_aware_reductions = 0  # node-aware parts this rank reduced and returned

    def take_over(self, rank: int) -> list:
        """On a spare PE: serve expert rank ``rank`` (whose PE died) from now on; returns its experts' global ids
        (load them, then compute). Batches taken before are computed after it, with the same ids."""
        plan = self.plan
        if self.comm.rank not in plan.spare_pes:
            raise CommError(f"take_over: PE {self.comm.rank} is not a spare expert PE ({list(plan.spare_pes)})")
        if self.expert_rank is not None:
            raise CommError(f"take_over: PE {self.comm.rank} serves expert rank {self.expert_rank} already")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.num_expert_ranks:
            raise ValueError(f"take_over: rank={rank!r} is out of range [0, {plan.num_expert_ranks})")
        self.expert_rank = rank
        self.experts = plan.local_experts(plan.num_attention_ranks + rank)
        self._mine.zero_()
        self._mine[self.experts] = True
        return list(self.experts)

    @property
    def finished(self) -> bool:
        """True once every attention rank has called ``finish`` and its descriptor was received."""
        return len(self._finished | self.lost) == self.plan.num_attention_ranks

    def _batch(self, msg) -> "ExpertBatch | None":
        plan = self.plan
        a = msg.src
        slot, layer, n, off, gateway, mask = (msg.tensor.tolist() if msg.tensor.numel() == _DESC_WORDS
                                              else (None,) * _DESC_WORDS)
        msg.release()
        if slot == _FIN and 0 <= a < plan.num_attention_ranks:
            self._finished.add(a)
            return None
        ok = (slot is not None and 0 <= a < plan.num_attention_ranks and 0 <= slot < plan.max_inflight
              and 0 < n <= plan.max_tokens and 0 <= off and off + n <= plan.combine_rows and layer >= 0)
        group = self._group
        ok = ok and (gateway == -1 or (group is not None and gateway in group and (a, slot) not in self._host_parts
                                       and 0 < mask < (1 << len(group))))
        if not ok:
            raise CommError(f"dispatch_recv: corrupt descriptor from PE {a}: slot={slot} layer={layer} "
                            f"rows={n} offset={off} gateway={gateway} mask={mask}")
        buf = self._buf
        if gateway != -1:
            return self._host_batch(a, slot, layer, n, off, gateway, mask)
        return ExpertBatch(layer, buf.tokens[a, slot, :n], buf.expert_ids[a, slot, :n], buf.weights[a, slot, :n],
                           [(a, slot, off, n, 0)])

    def _union(self, a: int, slot: int, n: int, gateway: int) -> tuple:
        """(tokens, expert_ids, weights) of the ``n`` rows attention PE ``a`` put for this host in ``gateway``'s
        region (``slot``): views over shared memory (the gateway is on this host)."""
        buf, comm = self._buf, self.comm
        views = (buf.tokens[a, slot, :n], buf.expert_ids[a, slot, :n], buf.weights[a, slot, :n])
        return views if gateway == comm.rank else tuple(comm.remote(v, gateway) for v in views)

    def _rows_of(self, pe: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """Indices of the union rows (``expert_ids`` [n, k], this host's experts, -1 elsewhere) that have an
        expert on ``pe``."""
        owner = self.plan.rank_of_expert[expert_ids.clamp(min=0).to(torch.int64)] + self.plan.num_attention_ranks
        return ((owner == pe) & (expert_ids >= 0)).any(1).nonzero().flatten()

    def _host_batch(self, a: int, slot: int, layer: int, n: int, off: int, gateway: int, mask: int) -> ExpertBatch:
        """This rank's rows of a node-aware part: gathered from the gateway's region (shared memory)."""
        tokens, ids, weights = self._union(a, slot, n, gateway)
        rows = self._rows_of(self.comm.rank, ids)
        if rows.numel() == 0:
            raise CommError(f"dispatch_recv: descriptor from PE {a} (slot {slot}) names no row for this rank")
        self._host_parts[(a, slot)] = (gateway, n, off, mask, rows)
        self.node_aware_parts += 1
        mine = torch.where(self._mine[ids.clamp(min=0).to(torch.int64)] & (ids >= 0), ids, self._minus1)
        if rows.numel() == n:
            return ExpertBatch(layer, tokens, mine, weights, [(a, slot, off, n, 0)])
        return ExpertBatch(layer, tokens.index_select(0, rows), mine.index_select(0, rows),
                           weights.index_select(0, rows), [(a, slot, off, rows.numel(), 0)])

    def dispatch_recv(self, timeout=None) -> "ExpertBatch | None":
        """The next micro-batch from any attention rank, any layer (waits, bounded).

        Returns None once every attention rank has finished. Ordering:
        acquire: the rows are complete. Raises ``TimeoutError``, or
        ``PeerFailure`` if a PE died, or once every attention rank that has
        not finished has died or left (closed without ``finish``): a wait on
        any of several senders ends when none of them can send any more
        (checked about every 0.1 s), whatever the other PEs do.
        """
        t = total = self.comm._timeout("dispatch_recv", timeout)
        deadline = time.monotonic() + t
        while not self.finished:
            try:
                msg = self._buf.inbox.recv(min(t, _SENDERS_EVERY_S))
            except CommTimeoutError:
                msg = self._senders_gone()
                if msg is None:
                    t = deadline - time.monotonic()
                    if t <= 0:
                        raise CommTimeoutError(f"dispatch_recv: no micro-batch from attention ranks "
                                               f"{self._unfinished()} within {total:.3g} s") from None
                    continue
            b = self._batch(msg)
            if b is not None:
                return b
        return None

    def _unfinished(self) -> list:
        return [a for a in range(self.plan.num_attention_ranks) if a not in self._finished and a not in self.lost]

    def _senders_gone(self):
        """A message that arrived meanwhile, or None while an unfinished attention rank lives; ``PeerFailure`` once
        none does. The states are read before the inbox, so a rank's last messages (placed before it left) are
        seen first."""
        states = {a: self.comm.peer_state(a) for a in self._unfinished()}
        died = [a for a, s in states.items() if s == "died"]
        if self.lose_senders and died and (len(died) < len(states) or self._finished or self.lost):
            self.lost.update(died)  # another attention PE lives or finished: the dead ones count as finished
            states = {a: s for a, s in states.items() if s != "died"}
            if not states:
                return self._buf.inbox.poll()  # (None: finished)
        if any(s == "alive" for s in states.values()):
            return None
        msg = self._buf.inbox.poll()
        if msg is not None:
            return msg
        first = next(iter(states))
        reason = "died" if any(s == "died" for s in states.values()) else "closed"
        raise PeerFailure(f"dispatch_recv: every attention rank that had not finished ({sorted(states)}) has died or "
                          f"left without finishing ({', '.join(f'PE {a} {s}' for a, s in states.items())}): no "
                          "micro-batch can come", pe=first, reason=reason)

    def dispatch_recv_many(self, max_batches: "int | None" = None, timeout=None) -> list:
        """Wait (bounded) for one micro-batch, then take every other one already pending, up to ``max_batches``.

        For adaptive batching: merge the ones of the same layer with
        ``ExpertBatch.merge`` (or ``by_layer``). Empty once every attention
        rank has finished.
        """
        first = self.dispatch_recv(timeout)
        if first is None:
            return []
        out = [first]
        while max_batches is None or len(out) < max_batches:
            msg = self._buf.inbox.poll()
            if msg is None:
                break
            b = self._batch(msg)
            if b is not None:
                out.append(b)
        return out

    @staticmethod
    def by_layer(batches: list) -> list:
        """Merge a list of batches into one ``ExpertBatch`` per layer (layers in first-seen order)."""
        groups: dict[int, list] = {}
        for b in batches:
            groups.setdefault(b.layer, []).append(b)
        return [ExpertBatch.merge(g) for g in groups.values()]

    def __iter__(self) -> Iterator[ExpertBatch]:
        while True:
            b = self.dispatch_recv()
            if b is None:
                return
            yield b

    def output_buffer(self, batch: ExpertBatch) -> torch.Tensor:
        """Where to compute ``batch``'s output ``[n,H]`` so that ``combine_send`` need not copy it.

        For a batch from one micro-batch: a view of the origin attention
        rank's combine area at the rows reserved for this rank (``comm.remote``);
        write the result into it (``torch.mul(..., out=buf)``, ``apply_experts(...,
        out=buf)``) and pass it to ``combine_send``, which then only signals.
        For a merged batch: a new local tensor.
        """
        if len(batch.parts) != 1:
            return torch.empty(batch.num_rows, self.plan.hidden, dtype=self.plan.dtype)
        a, slot, off, n, _first = batch.parts[0]
        if (a, slot) in self._host_parts:  # node-aware: this rank's partial sums, read by the host's reducer
            return self._buf.red[a, slot, :n]
        if self._combine_at[a] is None:  # not addressable from here: computed here, then put
            return torch.empty(n, self.plan.hidden, dtype=self.plan.dtype)
        return self.comm.remote(self._buf.combine[slot, off:off + n], a)

    def combine_send(self, batch: ExpertBatch, out: torch.Tensor) -> None:
        """Return ``out [n,H]`` (each row's weighted sum over this rank's experts) to the origin rank(s).

        Rows go straight into each origin attention rank's combine area at
        the offset it assigned; then that slot's counter gets +1 (release:
        the rows are visible first). Never waits.
        """
        fn, plan = "combine_send", self.plan
        if not isinstance(batch, ExpertBatch):
            raise TypeError(f"{fn}: batch must be an ExpertBatch, got {type(batch).__name__}")
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{fn}: out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (batch.num_rows, plan.hidden):
            raise ValueError(f"{fn}: out must be [n={batch.num_rows}, hidden={plan.hidden}], got {tuple(out.shape)}")
        if out.dtype != plan.dtype:
            raise ValueError(f"{fn}: out dtype {out.dtype} != plan dtype {plan.dtype}")
        if out.device.type != "cpu":
            raise ValueError(f"{fn}: out is on {out.device}; the shm backend moves CPU tensors only")
        buf, comm = self._buf, self.comm
        if self.expert_rank is None:
            raise CommError(f"{fn}: PE {comm.rank} is a spare that serves no expert rank yet (take_over first)")
        row_bytes = plan.hidden * out.element_size()
        E, r = plan.num_expert_ranks, self.expert_rank
        for a, slot, off, n, first in batch.parts:
            if a in self.lost:  # attention failover: its PE died, its requests were re-admitted elsewhere
                self._host_parts.pop((a, slot), None)
                continue
            if (a, slot) in self._host_parts:
                self._combine_host(a, slot, out[first:first + n])
                continue
            if self._combine_at[a] is None:  # not addressable from here: rows and counter in one message
                comm.put_signal(buf.combine[slot, off:off + n], out[first:first + n], a, buf.done, slot * E + r, 1,
                                op="add")
                continue
            dst = self._combine_at[a] + (slot * plan.combine_rows + off) * row_bytes
            if len(batch.parts) != 1 or out.data_ptr() != dst or not out.is_contiguous():
                comm.remote(buf.combine[slot, off:off + n], a).copy_(out[first:first + n])
            # else: computed in place by output_buffer(): nothing to copy
            comm.signal_op(buf.done, slot * E + r, 1, "add", a)  # release: rows first

    def _combine_host(self, a: int, slot: int, out: torch.Tensor) -> None:
        """Node-aware combine of one part: leave ``out`` (this rank's rows) in ``red``, count it on the
        gateway; the rank whose count completes the part reduces the host's partials and returns them."""
        gateway, n, off, mask, rows = self._host_parts.pop((a, slot))
        buf, comm, S = self._buf, self.comm, self.plan.max_inflight
        mine = buf.red[a, slot, :rows.numel()]
        if out.data_ptr() != mine.data_ptr() or not out.is_contiguous():
            mine.copy_(out)
        done = comm.signal_op(buf.red_count, a * S + slot, 1, "add", gateway) + 1  # release: red first
        if done == bin(mask).count("1"):  # the last partial of this part: reduce (acquire: every red is seen)
            self._reduce(a, slot, gateway, n, off, mask, rows)

    def _reduce(self, a: int, slot: int, gateway: int, n: int, off: int, mask: int, own_rows) -> None:
        """Sum the contacted host ranks' partials of attention PE ``a``'s part (``slot``) in PE order and
        return them with one put_signal. ``own_rows``: this rank's rows of the union (known from dispatch)."""
        plan, buf, comm, S = self.plan, self._buf, self.comm, self.plan.max_inflight
        acc_dtype = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
        ids = self._union(a, slot, n, gateway)[1]
        y = torch.zeros(n, plan.hidden, dtype=acc_dtype)
        for i, pe in enumerate(self._group):
            if not mask >> i & 1:
                continue
            rows = own_rows if pe == comm.rank else self._rows_of(pe, ids)
            part = buf.red[a, slot, :rows.numel()]
            if pe != comm.rank:
                part = comm.remote(part, pe)
            y.index_add_(0, rows, part if acc_dtype == plan.dtype else part.to(acc_dtype))
        comm.signal_op(buf.red_count, a * S + slot, 0, "set", gateway)  # the next use of the slot counts anew
        self.node_aware_reductions += 1
        word = slot * plan.num_expert_ranks + gateway - plan.num_attention_ranks  # the host part's word
        comm.put_signal(buf.combine[slot, off:off + n], y if acc_dtype == plan.dtype else y.to(plan.dtype), a,
                        buf.done, word, 1, op="add")
