"""Your own MoE forward pass, with asap_comm's dispatch and combine between attention and expert PEs.

    python examples/moe_dispatch_combine.py

PEs 0-1 run a toy 2-layer MoE model (a tanh "attention", a softmax router, top-2 of 8 experts); the routed
experts run on PEs 2-3. Each attention PE cuts its tokens into micro-batches of at most ``max_tokens``, sends
them all (``dispatch_send`` never waits), then combines them, and checks the result against the same forward
computed locally. The rules (callback, global expert ids, weights, placement, termination): docs/moe.md.
"""
import sys

import torch

import asap_comm
from asap_comm.moe import AttentionEnd, ExpertEnd, MoEPlan, apply_experts

H, N, K, LAYERS = 16, 8, 2, 2
PLAN = MoEPlan(num_attention_ranks=2, num_expert_ranks=2, num_experts=N, hidden=H, top_k=K, max_tokens=16,
               max_inflight=3)


def weights():
    """The same weights on every PE (one seed)."""
    g = torch.Generator().manual_seed(0)
    attn = [torch.randn(H, H, generator=g) / H ** 0.5 for _ in range(LAYERS)]
    router = [torch.randn(H, N, generator=g) for _ in range(LAYERS)]
    experts = [[torch.randn(H, H, generator=g) / H ** 0.5 for _ in range(N)] for _ in range(LAYERS)]
    return attn, router, experts


def forward(x, attn, router, moe):
    """The model; ``moe(layer, h, topk_ids, topk_weights) -> [T, H]`` is the routed-expert sum."""
    for layer in range(LAYERS):
        x = x + torch.tanh(x @ attn[layer])
        w, ids = torch.softmax(x @ router[layer], -1).topk(K)
        x = x + moe(layer, x, ids, w)
    return x


def pe_main(comm):
    attn, router, experts = weights()
    if comm.rank >= PLAN.num_attention_ranks:  # an expert PE: serve any attention PE, any layer, until all finish
        ex = ExpertEnd(comm, PLAN)  # holds the global experts PLAN.local_experts(comm.rank)
        for b in ex:  # b.tokens [n, H], b.expert_ids [n, K] (global ids, -1: elsewhere), b.weights [n, K]
            out = apply_experts(b, lambda e, x: torch.relu(x @ experts[b.layer][e]), out=ex.output_buffer(b))
            ex.combine_send(b, out)
        return None
    att = AttentionEnd(comm, PLAN)  # collective with the ExpertEnds, once

    def remote(layer, h, ids, w):  # every micro-batch out first, then each one back
        handles = [att.dispatch_send(h[i:i + PLAN.max_tokens], ids[i:i + PLAN.max_tokens],
                                     w[i:i + PLAN.max_tokens], layer) for i in range(0, h.shape[0], PLAN.max_tokens)]
        return torch.cat([att.combine_recv(hd) for hd in handles])

    def local(layer, h, ids, w):  # the same sum on this process
        y = torch.zeros_like(h)
        for e in range(N):
            t, j = (ids == e).nonzero(as_tuple=True)
            y.index_add_(0, t, w[t, j, None] * torch.relu(h[t] @ experts[layer][e]))
        return y

    x = torch.randn(20 + 13 * comm.rank, H, generator=torch.Generator().manual_seed(1 + comm.rank))
    y = forward(x, attn, router, remote)
    att.finish()  # the expert PEs' `for b in ex` ends once every attention PE has finished
    return x.shape[0], float((y - forward(x, attn, router, local)).abs().max())


if __name__ == "__main__":
    results = asap_comm.launch(pe_main, PLAN.world_size, timeout=120)
    ok = True
    for pe, (tokens, err) in enumerate(results[:PLAN.num_attention_ranks]):
        ok &= err < 1e-4
        print(f"attention PE {pe}: {tokens} tokens, {LAYERS} MoE layers, max |remote - local| = {err:.2e}")
    print("OK: dispatch/combine matches the local forward" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)
