"""Barrier-free asynchronous MoE dispatch and combine between attention and expert ranks.

Legend: A = attention ranks (PEs 0..A-1), E = expert ranks (PEs A..A+E-1),
N = routed experts, T = tokens of one micro-batch, H = hidden, k = top-k,
S = ``max_inflight`` (handles outstanding per attention rank), n = rows one
expert rank receives from one micro-batch.

The four halves, each a one-sided operation on pre-sized symmetric buffers::

    attention PE                                  expert PE
    h = att.dispatch_send(x, ids, w, layer) ──>  b = ex.dispatch_recv()
        rows for expert rank r are written           (tokens, expert_ids, weights:
        straight into r's dispatch region            zero-copy views of its region)
        (a, slot), then a descriptor is sent     out = f(b)  # [n, H]
        to r's inbox                         <──  ex.combine_send(b, out)
    y = att.combine_recv(h)                          rows go straight into a's combine
        waits for slot's counters only,              area at the offset a assigned, then
        reduces the returned rows                    a's (slot, r) counter is bumped (release)

Why it cannot deadlock (docs/design.md, "A buffer layout that cannot deadlock"):

* a handle owns its slot ``(a, s)`` of every expert rank's dispatch region and
  of ``a``'s combine area from ``dispatch_send`` to ``combine_recv``, so
  writing rows never waits for anyone;
* every expert inbox has ``A * (S + 1)`` slots and an attention rank has at
  most ``S`` descriptors (plus one final ``finish``) outstanding in it, so a
  descriptor send never waits;
* the attention rank knows, at dispatch, how many rows each expert rank will
  return and gives each its own offset in the combine area, so
  ``combine_send`` writes without coordination and bumps a counter (one per
  slot and expert rank ``r``: who returned is known, which expert failover
  needs, docs/failover.md);
* ``combine_recv`` waits on its own slot's counters, nothing else.

So with at most S handles outstanding per attention rank, every
``dispatch_send`` and ``combine_send`` completes whether or not any attention
rank has called ``combine_recv`` yet. No collective or barrier is on the path
(the constructors are collective, once).

Each token travels once per destination expert rank (whatever number of its
k experts live there); expert ranks with no token in a micro-batch are not
contacted. Routing metadata (global expert ids, -1 for experts held by other
ranks, and weights) travels in the same region as the rows.

Across hosts (node-aware, as DeepEP does between nodes): toward a host that
holds two or more of the expert ranks, a token travels once per *host*, not
once per rank, and returns once. The attention rank puts the rows every
expert rank of that host needs into one of them, its gateway for that host
(spread over the attention ranks), completes the put (``quiet``), then sends
each contacted rank of the host a descriptor naming the gateway. Each rank
gathers its own rows from the gateway's region over shared memory, computes,
and leaves its partial sums in its own ``red`` region; it then adds 1 to the
(attention rank, slot) counter on the gateway. The rank whose add completes
the count sums the host's partials (same host: shared memory) and returns one
row per token with one ``put_signal``. Nobody waits for anybody: the last to
finish reduces. This halves the bytes on the link between the hosts for
every token that has experts on two ranks of a host.

Modules: ``plan`` (plan, placement, buffers, handle, batch, reference), ``attention`` (``AttentionEnd``),
``expert`` (``ExpertEnd``). Whether a peer's memory can be written in place is asked of its transport
(``comm.transport(pe).direct_view``), never decided here.
"""
from __future__ import annotations

from .attention import AttentionEnd
from .expert import ExpertEnd
from .plan import (DispatchHandle, ExpertBatch, InflightLimitError, MoEPlan, apply_experts, expert_placement,
                   join_as_bystander, reference_combine, reference_dispatch)

__all__ = ["MoEPlan", "expert_placement", "AttentionEnd", "ExpertEnd", "DispatchHandle", "ExpertBatch", "InflightLimitError",
           "join_as_bystander",
           "apply_experts", "reference_combine", "reference_dispatch"]

