"""The attention-rank half of the MoE exchange: ``dispatch_send`` and ``combine_recv`` (``asap_comm.moe``)."""
from __future__ import annotations

import os
import time

import torch

from ..errors import CommError, PeerFailure
from ..errors import TimeoutError as CommTimeoutError
from ..patience import while_alive
from .plan import _DESC_WORDS, _FIN, DispatchHandle, InflightLimitError, MoEPlan, _Buffers, _check_int

__all__ = ["AttentionEnd"]


class AttentionEnd:
    """The attention-rank half: ``dispatch_send`` and ``combine_recv``.

    Construct on every attention PE while every expert PE constructs its
    ``ExpertEnd`` (collective allocation, once). Single-threaded.
    """

    def __init__(self, comm, plan: MoEPlan) -> None:
        if not 0 <= comm.rank < plan.num_attention_ranks:
            raise ValueError(f"AttentionEnd: PE {comm.rank} is not an attention rank "
                             f"(attention ranks are 0..{plan.num_attention_ranks - 1})")
        self.comm, self.plan = comm, plan
        self._buf = _Buffers(comm, plan)
        a, A, S = comm.rank, plan.num_attention_ranks, plan.max_inflight
        # Views of every expert PE's dispatch region (a, s) where its transport addresses it directly (this
        # host), writable in place; None for the others, whose rows are staged here and put (the path every
        # transport has).
        self._direct: dict = {}
        for pe in range(A, plan.world_size):
            to = comm.transport(pe)
            for s in range(S):
                views = tuple(to.direct_view(t[a, s]) for t in (self._buf.tokens, self._buf.expert_ids,
                                                                 self._buf.weights))
                self._direct[(pe, s)] = None if views[0] is None else views
        # what dispatch_send reaches, ascending by first PE: an expert rank index, or a host's expert PEs
        # (node-aware; only toward the hosts whose memory is not addressable from here)
        grouped = {pe: pes for pes in self._buf.host_groups.values() for pe in pes if self._direct[(pe, 0)] is None}
        self._targets: list = []
        for r in range(plan.num_expert_ranks):
            pe = A + r
            if pe not in grouped:  # (no groups with spares: a replaced rank is always reached directly)
                self._targets.append(r)
            elif grouped[pe][0] == pe:
                self._targets.append(tuple(grouped[pe]))
        # Below this many bytes of rows per host, the quiet and the host-side reduction cost more than the
        # bytes they save (bench/bench_net.py: T=128 x 4 KiB rows is faster direct, T=1024 node-aware).
        self.node_aware_bytes = int(os.environ.get("ASAP_MOE_NODE_AWARE_BYTES", 1 << 20))
        self._stage = None
        if any(v is None for v in self._direct.values()):
            self._stage = (torch.empty(plan.max_tokens, plan.hidden, dtype=plan.dtype),
                           torch.empty(plan.max_tokens, plan.top_k, dtype=torch.int32),
                           torch.empty(plan.max_tokens, plan.top_k, dtype=torch.float32))
        self._minus1 = torch.tensor(-1, dtype=torch.int32)
        self._desc = torch.zeros(_DESC_WORDS, dtype=torch.int64)  # staging for descriptors
        self._desc_words = memoryview(self._desc.numpy()).cast("B").cast("q")
        self._send_desc = {pe: self._buf.inbox.prepare_send(pe, self._desc) for pe in range(A, plan.world_size)}
        self._free = list(range(S - 1, -1, -1))  # free slots, pop() takes the lowest
        self._outstanding: dict[int, DispatchHandle] = {}
        E = plan.num_expert_ranks
        self._counted = [0] * (S * E)  # per word (slot, r): returns expected so far (the words are cumulative)
        self._owner = [A + r for r in range(E)]  # the PE serving expert rank r (a spare once r's PE died)
        self._keep = plan.num_spare_ranks > 0  # keep each handle's inputs until combine_recv, to send a part again
        # a wait for a part fails only with the PEs that can return it (not with any PE's death): with spares, and
        # where the caller survives other PEs' deaths (attention failover sets it)
        self.scoped_waits = self._keep
        self.resent = 0  # parts sent again to a replacement (replace)
        self.lost: set = set()  # with spares: expert PEs found dead by wait_ready, not yet replaced
        self._finished = False

    @property
    def num_inflight(self) -> int:
        return len(self._outstanding)

    def _check(self, x, topk_ids, topk_weights, layer) -> int:
        fn, plan = "dispatch_send", self.plan
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cpu":
                raise ValueError(f"{fn}: {name} is on {t.device}; the shm backend moves CPU tensors only")
        _check_int(fn, "layer", layer, 0)
        if x.dim() != 2 or x.shape[1] != plan.hidden:
            raise ValueError(f"{fn}: x must be [T, hidden={plan.hidden}], got {tuple(x.shape)}")
        if x.dtype != plan.dtype:
            raise ValueError(f"{fn}: x dtype {x.dtype} != plan dtype {plan.dtype}")
        T = x.shape[0]
        if T > plan.max_tokens:
            raise ValueError(f"{fn}: {T} tokens > max_tokens={plan.max_tokens}")
        for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if tuple(t.shape) != (T, plan.top_k):
                raise ValueError(f"{fn}: {name} must be [T={T}, top_k={plan.top_k}], got {tuple(t.shape)}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
            raise ValueError(f"{fn}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"{fn}: topk_weights must be a floating tensor, got {topk_weights.dtype}")
        if T:
            lo, hi = (int(v) for v in torch.aminmax(topk_ids))
            if lo < 0 or hi >= plan.num_experts:
                raise ValueError(f"{fn}: expert ids must be in [0, {plan.num_experts}), got min {lo} max {hi}")
        if self._finished:
            raise CommError(f"{fn}: finish() was called on this AttentionEnd")
        if not self._free:
            raise InflightLimitError(f"{fn}: {len(self._outstanding)} handles already in flight "
                                     f"(max_inflight={plan.max_inflight}); combine_recv one first")
        return T

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      layer: int) -> DispatchHandle:
        """Send micro-batch ``x [T,H]`` with routing ``topk_ids [T,k]``, ``topk_weights [T,k]``; returns at once.

        Never waits for the experts: the handle owns a slot (an error if
        ``max_inflight`` are outstanding). Toward an expert PE on another host
        whose process lives but does not run (stopped), each put and
        descriptor is offered again, attempt by attempt, for as long as it
        lives (``asap_comm.patience``); ``PeerFailure`` once it died. Each
        token is written once into each expert rank that holds any of its
        experts, with the ids (-1 for experts elsewhere) and
        weights; then that rank gets a descriptor (release: it sees the rows).
        Toward another host with two or more expert ranks, once per host (the
        module docstring's node-aware path). With spare expert PEs
        (``plan.num_spare_ranks``) the handle keeps ``x``, ``topk_ids`` and
        ``topk_weights`` (references: do not modify them before
        ``combine_recv``) so that :meth:`replace` can send a part again.
        """
        T = self._check(x, topk_ids, topk_weights, layer)
        plan = self.plan
        slot = self._free.pop()
        h = DispatchHandle(slot, layer, T, 0)
        if T:
            ids32 = topk_ids.to(torch.int32)
            weights = topk_weights.to(torch.float32)
            rank_of = plan.rank_of_expert[topk_ids]  # [T, k] expert-rank index of each choice
            if self._keep:
                h.source = (x, ids32, weights, rank_of)
            off = 0
            for target in self._targets:
                if isinstance(target, tuple):  # the expert PEs of another host: node-aware when large enough
                    n = self._dispatch_host(target, h, x, ids32, weights, rank_of, off)
                    if n is not None:
                        off += n
                        continue
                    ranks = [pe - plan.num_attention_ranks for pe in target]
                else:
                    ranks = [target]
                for r in ranks:
                    off += self._dispatch_rank(r, h, x, ids32, weights, rank_of, off)
        for i, (r, _) in enumerate(h.waits):
            word = slot * plan.num_expert_ranks + r
            self._counted[word] += 1
            h.waits[i] = (r, self._counted[word])
        h.target = len(h.parts)
        self._outstanding[slot] = h
        return h

    def _dispatch_rank(self, r: int, h: DispatchHandle, x, ids32, weights, rank_of, off: int) -> int:
        """Dispatch ``h``'s rows for expert rank ``r`` to it directly; returns the combine rows reserved."""
        on_r = rank_of == r  # [T, k]
        rows = on_r.any(1).nonzero().flatten()  # [n] tokens with an expert on r
        n = rows.numel()
        if n == 0:
            return 0  # not contacted
        pe = self._owner[r]
        self._send_part(pe, h, x, ids32, weights, on_r, rows, off)
        h.parts.append((pe, rows, off, n))
        h.pes.append(pe)
        h.waits.append((r, 0))
        return n

    def _send_part(self, pe: int, h: DispatchHandle, x, ids32, weights, on_r, rows, off: int) -> None:
        """``h``'s ``rows`` (their choices on the rank: ``on_r`` [T, k]) into PE ``pe``'s region, then its
        descriptor. With spares, toward a PE that died meanwhile it gives up quietly: the part is sent again to
        the replacement (:meth:`replace`)."""
        n, slot = rows.numel(), h.slot
        views = self._direct[(pe, slot)]
        tok, eid, w = views if views is not None else self._stage
        try:
            # rows, routing ids (-1: expert elsewhere) and weights straight into the peer's region
            self._fill(tok, eid, w, x, ids32, weights, on_r, rows, h.num_tokens)
            if views is None:  # another host: put the staged rows (applied before the descriptor below)
                self._put_staged(pe, slot, n)
            self._send_descriptor(pe, slot, h.layer, n, off, -1, 0)  # release: rows before it
        except PeerFailure as e:
            if not self._keep or e.pe != pe:
                raise

    def _fill(self, tok, eid, w, x, ids32, weights, on, rows, T) -> None:
        """Rows ``rows`` of the micro-batch, their routing ids (-1 where ``on`` is False) and weights, into
        ``tok``/``eid``/``w``."""
        n = rows.numel()
        if n == T:  # every token: plain copies, rows are 0..T-1
            tok[:n].copy_(x)
            torch.where(on, ids32, self._minus1, out=eid[:n])
            w[:n].copy_(weights)
        else:
            torch.index_select(x, 0, rows, out=tok[:n])
            torch.index_select(torch.where(on, ids32, self._minus1), 0, rows, out=eid[:n])
            torch.index_select(weights, 0, rows, out=w[:n])

    def _put_staged(self, pe: int, slot: int, n: int) -> None:
        """The staged rows, ids and weights into PE ``pe``'s region (this rank, ``slot``) on another host."""
        a, comm, buf = self.comm.rank, self.comm, self._buf
        tok, eid, w = self._stage
        for dst, src in ((buf.tokens[a, slot, :n], tok[:n]), (buf.expert_ids[a, slot, :n], eid[:n]),
                         (buf.weights[a, slot, :n], w[:n])):
            try:
                comm.put(dst, src, pe)
            except CommTimeoutError:  # a stopped peer (its process lives): offered again while it lives
                while_alive(comm, (pe,), lambda: comm.put(dst, src, pe), "dispatch_send: put")

    def _send_descriptor(self, pe: int, slot: int, layer: int, n: int, off: int, gateway: int, mask: int) -> None:
        words = self._desc_words
        words[0], words[1], words[2], words[3], words[4], words[5] = slot, layer, n, off, gateway, mask
        try:
            self._send_desc[pe]()
        except CommTimeoutError:  # a stopped peer on another host: offering the same message again never
            while_alive(self.comm, (pe,), self._send_desc[pe], "dispatch_send: descriptor")  # duplicates it

    def _dispatch_host(self, pes: tuple, h: DispatchHandle, x, ids32, weights, rank_of, off: int) -> "int | None":
        """Node-aware dispatch of ``h``'s micro-batch to the expert PEs ``pes`` of one other host (module
        docstring); returns the combine rows it reserved at ``off``, or None (nothing sent) when the host's
        rows are fewer than ``node_aware_bytes``: those go to each rank directly."""
        plan, A, slot = self.plan, self.plan.num_attention_ranks, h.slot
        ranks = torch.tensor([pe - A for pe in pes])
        on = torch.isin(rank_of, ranks)  # [T, k] choices held on that host
        rows = on.any(1).nonzero().flatten()
        n = rows.numel()
        if n == 0:
            return 0
        if n * plan.hidden * x.element_size() < self.node_aware_bytes:
            return None
        contacted = [pe for pe in pes if bool((rank_of[rows] == pe - A).any())]
        gateway = pes[self.comm.rank % len(pes)]
        tok, eid, w = self._stage
        self._fill(tok, eid, w, x, ids32, weights, on, rows, h.num_tokens)
        self._put_staged(gateway, slot, n)
        if contacted != [gateway]:  # the rows are in the gateway's memory before any other rank hears of them
            try:
                self.comm.quiet()
            except CommTimeoutError:
                while_alive(self.comm, (gateway,), self.comm.quiet, "dispatch_send: quiet")
        mask = sum(1 << i for i, pe in enumerate(pes) if pe in contacted)
        for pe in contacted:
            self._send_descriptor(pe, slot, h.layer, n, off, gateway, mask)
        h.parts.append((gateway, rows, off, n))  # one reduced row per token comes back
        h.pes.extend(contacted)
        h.waits.append((gateway - A, 0))  # the reducer returns on the gateway's word
        return n

    def is_ready(self, handle: DispatchHandle) -> bool:
        """True once every expert rank ``handle`` contacted has returned its rows (never waits)."""
        fetch, done, base = self.comm.signal_fetch, self._buf.done, handle.slot * self.plan.num_expert_ranks
        for r, target in handle.waits:
            if fetch(done, base + r) < target:
                return False
        return True

    def wait_ready(self, handle: DispatchHandle, timeout: float) -> bool:
        """Wait at most ``timeout`` s until :meth:`is_ready` (``handle`` stays outstanding: read it with
        :meth:`combine_recv`). Returns whether it is ready; raises ``PeerFailure`` if a PE died. With spare
        expert PEs only the death of a PE it waits on counts, and then it returns False at once and adds the
        PE to :attr:`lost` (its replacement, once :meth:`replace` names it, answers instead)."""
        try:
            self._wait_words(handle, timeout)
        except CommTimeoutError:
            return False
        except PeerFailure as e:
            if not self._keep or e.pe not in self._owner:
                raise
            self.lost.add(e.pe)
            return False
        return True

    def _wait_words(self, handle: DispatchHandle, timeout) -> None:
        """Wait (each word bounded by what is left of ``timeout``) until every part of ``handle`` is back."""
        comm, done, base = self.comm, self._buf.done, handle.slot * self.plan.num_expert_ranks
        t = comm._timeout("wait_ready", timeout)
        deadline = None
        for r, target in handle.waits:
            if comm.signal_fetch(done, base + r) >= target:
                continue
            if deadline is None:
                deadline = time.monotonic() + t
            else:
                t = max(1e-6, deadline - time.monotonic())
            if self.scoped_waits:  # only the PEs that can return it: another's death is the failover's business
                comm.signal_wait_until(done, base + r, ">=", target, timeout=t, peers=self._waited_on(r))
            else:
                comm.signal_wait_until(done, base + r, ">=", target, timeout=t)

    def _waited_on(self, r: int) -> list:
        """The PEs that can return expert rank ``r``'s part: its owner, or the host's expert PEs (node-aware)."""
        group = next((pes for pes in self._buf.host_groups.values() if self.plan.num_attention_ranks + r in pes),
                     None)
        return list(group) if group is not None and self._owner[r] in group else [self._owner[r]]

    def replace(self, r: int, pe: int) -> int:
        """Expert rank ``r``'s PE died and spare PE ``pe`` took over its experts (``ExpertEnd.take_over``): route
        ``r`` to ``pe`` from now on, and send ``pe`` each outstanding micro-batch's part for ``r`` that did not
        come back (its word names who returned it; a dead PE returns nothing more). Same slot, rows and combine
        offset, so the handle completes as if nothing happened. Returns the parts sent again. Call it only once
        the old owner is dead (the front end's failover says so)."""
        plan = self.plan
        if not self._keep:
            raise CommError("replace: this plan has no spare expert PEs (num_spare_ranks=0)")
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < plan.num_expert_ranks:
            raise ValueError(f"replace: expert rank r={r!r} is out of range [0, {plan.num_expert_ranks})")
        if pe not in plan.spare_pes:
            raise ValueError(f"replace: pe={pe!r} is not a spare expert PE ({list(plan.spare_pes)})")
        self.lost.discard(self._owner[r])
        self._owner[r] = pe
        sent = 0
        done, E = self._buf.done, plan.num_expert_ranks
        for h in sorted(self._outstanding.values(), key=lambda h: h.slot):
            for i, (wr, target) in enumerate(h.waits):
                if wr != r or self.comm.signal_fetch(done, h.slot * E + r) >= target:
                    continue
                _pe, rows, off, n = h.parts[i]
                x, ids32, weights, rank_of = h.source
                self._send_part(pe, h, x, ids32, weights, rank_of == r, rows, off)
                h.parts[i] = (pe, rows, off, n)
                h.pes = sorted((set(h.pes) - {_pe}) | {pe})
                sent += 1
        self.resent += sent
        return sent

    def combine_recv(self, handle: DispatchHandle, timeout=None) -> torch.Tensor:
        """Wait for ``handle``'s micro-batch only; return its routed-expert output ``[T,H]``.

        ``y[t] = sum_j topk_weights[t,j] * expert_{topk_ids[t,j]}(x[t])``: the
        partial sums each contacted expert rank returned, reduced (in float32
        for lower-precision dtypes). Frees the handle's slot. Raises
        ``TimeoutError`` after ``timeout`` s, ``PeerFailure`` if a PE died.
        """
        if not isinstance(handle, DispatchHandle) or self._outstanding.get(handle.slot) is not handle:
            raise ValueError(f"combine_recv: unknown handle {handle!r} (already combined, or from another "
                             "AttentionEnd)")
        plan, buf, s = self.plan, self._buf, handle.slot
        self._wait_words(handle, timeout)
        acc_dtype = torch.float32 if plan.dtype in (torch.float16, torch.bfloat16) else plan.dtype
        area, T = buf.combine[s], handle.num_tokens
        # Parts that cover every token are added whole (rows are 0..T-1); the rest by index.
        full = [area[off:off + n] for _pe, _rows, off, n in handle.parts if n == T]
        if len(full) >= 2:
            first = full[0] if acc_dtype == plan.dtype else full[0].to(acc_dtype)
            y = torch.add(first, full[1])  # one pass: reads both parts, writes y
            for part in full[2:]:
                y += part
        elif full:
            y = full[0].to(acc_dtype, copy=True)
        else:
            y = torch.zeros(T, plan.hidden, dtype=acc_dtype)
        for _pe, rows, off, n in handle.parts:
            if n != T:
                y.index_add_(0, rows, area[off:off + n].to(acc_dtype))
        del self._outstanding[s]
        self._free.append(s)
        return y if acc_dtype == plan.dtype else y.to(plan.dtype)

    def finish(self) -> None:
        """Tell every expert rank that this attention rank sends no more micro-batches.

        An ``ExpertEnd`` returns None from ``dispatch_recv`` (and ends
        iteration) once every attention rank has finished and it has served
        everything before.
        """
        if self._finished:
            return
        self._finished = True
        for pe in self._send_desc:
            if self._keep and self.comm.peer_state(pe) != "alive":  # a dead (replaced) or gone spare PE
                continue
            try:
                self._send_descriptor(pe, _FIN, 0, 0, 0, -1, 0)
            except PeerFailure:
                if not self._keep:
                    raise
