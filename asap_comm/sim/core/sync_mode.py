"""The synchronous DP+EP baseline (``"sync"``) simulated: lock-step steps of every DP group, three all-to-alls
per MoE layer, context parallelism (``simulate.py`` has the modelling choices)."""
from __future__ import annotations

import itertools

from ...serving.policies import MicroBatcher, Placer, split_prompt
from ...serving.traces import Request
from .common import SYNC_IDLE_POLL_S, Parallelism, _Common, _validate, batch_skew, rows_per_rank_fraction


# ----------------------------------------------------------------------------- synchronous DP+EP baseline
def _even_parts(n: int, parts: int) -> list:
    """``n`` tokens in ``parts`` near-equal shares (as ``split_prompt`` balances chunks)."""
    base, extra = divmod(n, parts)
    return [base + 1] * extra + [base] * (parts - extra)


_MEMO_MAX = 1 << 21  # entries of _SyncSim's two step memos together before they are cleared


class _CpRequest:
    """A request run with context parallelism: its chunks, the DP groups that share each of them, progress."""
    __slots__ = ("request_id", "chunks", "groups", "next", "busy")

    def __init__(self, request_id: int, chunks: list, groups: list) -> None:
        self.request_id, self.chunks, self.groups = request_id, chunks, groups
        self.next = 0  # index of the chunk to run next
        self.busy = False


class _SyncSim(_Common):
    def __init__(self, cost, shapes, cfg, requests, record_spans, num_ranks: int,
                 par: Parallelism = Parallelism(), layers=None) -> None:
        super().__init__(cost, shapes, cfg, requests, record_spans, par, layers)
        W = self.W = num_ranks  # DP groups
        self.tp = par.sync_tp  # devices per DP group
        self.D = W * self.tp  # devices; EP spans all of them
        self.placer = Placer(W, load_aware=cfg.load_aware, linear_weight=self._placer_weight())
        self.batchers = [MicroBatcher(cfg.token_budget) for _ in range(W)]
        self.local = -(-shapes.num_experts // self.D)
        self.frac = rows_per_rank_fraction(shapes.num_experts, shapes.top_k, self.local)
        self._skew(self.D)  # a skewed routing: the hottest device's experts and rows set the step
        self.busy = [0.0] * W
        self.stepping = False
        self.check_at = None  # a pending step check (heartbeat)
        self.segs = self._segments()
        self.seg_runs = self._seg_runs()
        self.steps = 0
        self.k, self.layer_overhead = self.cost.runtime["sync_compute"], self.cost.runtime["sync_layer_overhead_s"]
        self.skew = self.cost.runtime["expert_skew"]  # the step waits for the device whose experts work longest
        self.cp_threshold = par.cp_threshold if W > 1 else None
        self.cp: list = []  # unfinished context-parallel requests, in arrival order
        # memos of pure functions of a step's inputs (a run repeats the same batches again and again): a group's
        # attention stage (with its CP exchanges) by its chunks, and its per-segment compute by (tokens, attention,
        # heads); the same float operations in the same order as computing them afresh, so every time is identical
        self._attn_memo: dict = {}
        self._work_memo: dict = {}  # (each holds some 200k entries after 100k Mooncake requests at 2k chunks)
        self._used_runs = []  # the runs the step loop visits: up to and including the first without a MoE layer
        for run in self.seg_runs:
            self._used_runs.append(run)
            if not run[2]:
                break

    # ------------------------------------------------------------------ context parallelism
    def arrive(self, r: Request) -> None:
        if (self.cp_threshold is None or r.prompt_len <= self.cp_threshold
                or _validate(r, self.cfg) is not None):
            super().arrive(r)
            return
        # a long prompt: the g least loaded DP groups share it (the placer's load-aware rule for g groups)
        g = min(self.W, -(-r.prompt_len // self.cp_threshold))
        chunks = split_prompt(r.request_id, r.prompt_len, self.cfg.effective_chunk_len)
        groups = self.placer.place_group(r.request_id, chunks, g)
        self.records[r.request_id].start_s = self.engine.now
        self.engine.after(self._delivery_s(chunks), self._deliver_cp, _CpRequest(r.request_id, chunks, groups))

    def _deliver_cp(self, req: _CpRequest) -> None:
        self.cp.append(req)
        self._queued(req.groups[0])

    def _result_cp(self, req: _CpRequest) -> None:
        self.records[req.request_id].done_s = self.engine.now
        self.placer.complete(req.request_id)

    def _batches(self) -> tuple:
        """This step's micro-batch per group, and its CP shares [(request, chunk, tokens, part)] (module docstring)."""
        if not self.cp:
            return [b.next_batch() for b in self.batchers], None
        budget = self.cfg.token_budget
        cp_tokens = [0] * self.W
        shares: list = [[] for _ in range(self.W)]
        proposed = set()  # owners (a request's first group) that proposed a chunk this step: one each, its oldest
        for req in self.cp:
            if req.busy or req.groups[0] in proposed:
                continue
            proposed.add(req.groups[0])
            c = req.chunks[req.next]
            parts = _even_parts(c.length, len(req.groups))
            if all(cp_tokens[j] == 0 or cp_tokens[j] + n <= budget for j, n in zip(req.groups, parts)):
                req.busy = True
                for i, (j, n) in enumerate(zip(req.groups, parts)):
                    cp_tokens[j] += n
                    shares[j].append((req, c, n, i))
        batches = []
        whole = self.cfg.max_chunk_tokens
        for j, b in enumerate(self.batchers):
            left = budget - cp_tokens[j]
            if cp_tokens[j] == 0:
                batches.append(b.next_batch())
            elif left >= whole:  # a whole chunk still fits under the budget
                b.token_budget = left
                try:
                    batches.append(b.next_batch())
                finally:
                    b.token_budget = budget
            else:
                batches.append([])
        return batches, shares

    # ------------------------------------------------------------------ lock-step
    def _queued(self, rank: int) -> None:
        if not self.stepping and self.check_at is None:
            # the idle ranks notice at their next heartbeat: the others' 1 ms receive timeouts must expire
            delay = (1.0 - 1.0 / self.W) * SYNC_IDLE_POLL_S + self.cost.all_reduce_s(self.D)
            self.check_at = self.engine.after(delay, self._step)

    def _step(self) -> None:
        self.check_at = None
        batches, shares = self._batches()
        if not any(batches) and not (shares and any(shares)):
            self.stepping = False
            return
        self.stepping = True
        self.steps += 1
        cost, W, D, tp, cores = self.cost, self.W, self.D, self.tp, self.cost.cores
        memo = self._attn_memo
        tokens, attn, last = [0] * W, [0.0] * W, [0] * W
        for r, b in enumerate(batches):
            if b:
                tokens[r] = sum(c.length for c in b)
                last[r] = sum(1 for c in b if c.last)
                if not (shares and shares[r]):
                    key = tuple([(c.length, c.start) for c in b])
                    a = memo.get(key)
                    if a is None:
                        a = memo[key] = cost.attention_s(list(key), tp)
                    attn[r] = a
        if shares:
            for r, sh in enumerate(shares):
                if not sh:
                    continue
                if len(sh) == 1 and not batches[r]:  # the usual case: one CP share alone (as below, without sums)
                    req, c, n, i = sh[0]
                    tokens[r] = n
                    key = ((c.length, c.start, len(req.groups)),)
                    a = memo.get(key)
                    if a is None:
                        a = memo[key] = (cost.attention_s(list(key), tp)
                                         + sum([cost.cp_exchange_s(c.length, c.start, len(req.groups), tp)]))
                    attn[r] = a
                    last[r] = 1 if c.last and i == 0 else 0
                    continue
                chunks = [(c.length, c.start) for c in batches[r]]
                chunks += [(c.length, c.start, len(req.groups)) for req, c, _n, _i in sh]
                tokens[r] += sum(n for _req, _c, n, _i in sh)
                key = tuple(chunks)
                a = memo.get(key)
                if a is None:
                    a = memo[key] = (cost.attention_s(chunks, tp)
                                     + sum(cost.cp_exchange_s(c.length, c.start, len(req.groups), tp)
                                           for req, c, _n, _i in sh))
                attn[r] = a
                last[r] += sum(1 for _req, c, _n, i in sh if c.last and i == 0)  # one group computes the head
        if tp > 1:  # every layer: the group's reduce-scatter + all-gather
            attn = [a + cost.tp_all_reduce_s(T, tp) if T else a for a, T in zip(attn, tokens)]
        per_dev = [-(-T // tp) for T in tokens]  # tokens of one device after the reduce-scatter
        rows = [round(T * self.frac) for T in per_dev]  # rows one device sends to one peer
        # every token of every rank may choose this rank's experts: its share of the (token, expert) pairs
        # is sum(tokens) * top_k * local / N (see _pairs)
        k = self.k
        # a served router's skew, averaged over the step's prompts (its own chunks and its CP shares)
        skew = batch_skew(self.skew, itertools.chain(((c.request_id, c.length) for b in batches for c in b),
                                                     ((req.request_id, n) for sh in shares or () for req, _c, n, _i in sh)))
        total = sum(tokens)
        expert_work = k * skew * cost.experts_s(self._expert_pairs(total)) if total else 0.0
        # the busiest device: what it sends (its rows for each of its D - 1 peers) or receives (from D - 1 devices)
        a2a_rows = max(max(rows) * (D - 1), round(sum(rows) * tp * (D - 1) / D))
        if self.load is not None:  # skewed: a device sends to the ranks its tokens reach; the hottest receives most
            p = self.load.row_frac
            a2a_rows = round(max(max(per_dev) * (self.load.rows_per_token - min(p)),
                                 max(p) * tp * sum(per_dev) * (D - 1) / D))
        # counts, dispatch (dispatch rows), combine (combine rows)
        a2a = cost.all_to_all_s(0, D) + cost.all_to_all_s(a2a_rows, D) + cost.all_to_all_s(a2a_rows, D, True)
        t = cost.all_reduce_s(D)
        busy_before = list(self.busy) if self.spans is not None else None
        # On a shared CPU host the ranks that wait in a gloo collective stay runnable (they poll): a phase
        # where n ranks compute runs at min(1, cores / (n + poll * (W - n))), poll fitted in situ.
        poll = cost.runtime["sync_poll_weight"]
        live = [r for r in range(W) if tokens[r]]
        n_att = len(live)
        spin = 1.0 if cores is None else max(1.0, (n_att + poll * (W - n_att)) / cores)
        spin_ex = 1.0 if cores is None else max(1.0, W / cores)  # every rank computes its experts
        overlap, overhead = self.par.sync_overlap, self.layer_overhead
        # each live group's rank-local work per segment run (what it computes between two collectives)
        wmemo, works = self._work_memo, []
        for r in live:
            key = (tokens[r], attn[r], last[r])
            w = wmemo.get(key)
            if w is None:
                if len(wmemo) + len(memo) >= _MEMO_MAX:  # bounded: start afresh (the values recompute alike)
                    wmemo.clear()
                    memo.clear()
                w = wmemo[key] = self._group_work(*key)
            works.append(w)
        busy = self.busy
        pending = [0.0] * W  # rank-local work since the last collective
        for j, (i, dense, moe, prev_w, n) in enumerate(self._used_runs):
            # n identical segments in a row (the same layers, after the same kind of MoE layer): one is computed,
            # and counted n times (a MoE model's middle layers: one run instead of a loop over them)
            pending = [0.0] * W
            for r, w in zip(live, works):
                pending[r] = w[j]
            if not moe:
                break
            m = max(pending)
            seg = spin * m if cores is not None else max(0.0, m)
            ex = spin_ex * expert_work * moe
            if overlap:  # the all_to_alls hidden behind compute as far as it lasts
                step_s = max(seg + ex, moe * a2a) + overhead
            else:
                step_s = seg + moe * a2a + ex + overhead
            e = expert_work * moe
            if n == 1:
                t += step_s
                busy = [b + (q + e) for b, q in zip(busy, pending)]
            else:
                t += n * step_s
                busy = [b + n * (q + e) for b, q in zip(busy, pending)]
            pending = [0.0] * W
        tail = spin * max(pending)
        self.busy = [b + q for b, q in zip(busy, pending)]
        t += tail
        if self.spans is not None:  # each rank's own compute of the step (the rest of the step it waits)
            for r in range(W):
                label = "step" if batches[r] or (shares and shares[r]) else "dummy step (experts only)"
                self.spans.append((self._name(r), label, self.engine.now, self.busy[r] - busy_before[r]))
        self.engine.after(t, self._step_done, batches, shares)

    def _group_work(self, T: int, attn: float, last: int) -> tuple:
        """A group's rank-local work per segment run of ``_used_runs`` with ``T`` tokens, ``attn`` s of attention
        per layer and ``last`` heads (``k *`` the segment's embedding or shared experts, dense layers, router or
        head)."""
        cost, k = self.cost, self.k
        Td = -(-T // self.tp)
        out = []
        for i, dense, moe, prev_w, _n in self._used_runs:
            # the previous MoE layer's shared experts run after its combine
            w = (cost.embed_s(T) if i == 0 else prev_w * cost.shared_experts_s(Td))
            w += dense * (attn + cost.dense_mlp_s(Td))
            if moe:
                w += moe * (attn + cost.router_s(Td))
            else:
                w += cost.head_s(last) if last else 0.0
            out.append(0.0 + k * w)
        return tuple(out)

    def _seg_runs(self) -> list:
        """The segments (``_segments``) as runs of identical ones: ``[(index of the first, dense, moe, weight of
        the MoE layer before, count)]``; the first segment (it embeds) and the last (it ends with the head) alone."""
        runs: list = []
        for i, (dense, moe) in enumerate(self.segs):
            prev_w = self.segs[i - 1][1] if i else 0.0
            if runs and i > 1 and moe and runs[-1][1:4] == (dense, moe, prev_w):
                first, d, m, p, n = runs[-1]
                runs[-1] = (first, d, m, p, n + 1)
            else:
                runs.append((i, dense, moe, prev_w, 1))
        return runs

    def _name(self, r: int) -> str:
        return f"rank {r}" if self.tp == 1 else f"group {r} (TP {self.tp})"

    def _step_done(self, batches: list, shares) -> None:
        for r, b in enumerate(batches):
            for c in b:
                self.batchers[r].done(c)
                if c.last:
                    self.engine.after(self.msg_result, self._result, c.request_id)
        if shares:
            for sh in shares:
                for req, c, _n, i in sh:
                    if i:
                        continue  # once per request: its first group's share
                    req.busy = False
                    req.next += 1
                    if c.last:
                        self.cp.remove(req)
                        self.engine.after(self.msg_result, self._result_cp, req)
        # the loop comes straight back to the next step's all_reduce
        self._step()

    def run(self) -> tuple:
        self._arrivals(self.arrive)
        end = self.engine.run()

        class _Busy:  # the per-rank busy time in the Rank interface
            def __init__(self, busy_s: float, jobs: int) -> None:
                self.busy_s, self.jobs = busy_s, jobs

        role = "dp+ep" if self.tp == 1 else f"dp+ep (TP {self.tp})"
        ranks = [(self._name(r), role, _Busy(self.busy[r], self.steps), self.tp) for r in range(self.W)]
        return end, ranks
