"""Serve your own model with ASAP's runtime: a small MoE written here (not DeepseekV3), run by ``run_async``.

    python examples/custom_model.py [--requests 12]

The model: token embedding, then per layer a single-head causal attention with a KV cache and a residual,
then an MLP: a dense one in layer 0, in the others a softmax top-2 router over 8 experts (each a ReLU MLP) plus
one shared expert. ``ToyFactory`` builds each worker's share of it, as the contract in
``asap_comm.serving.model_api`` asks: ``factory("attention", [])`` everything but the routed experts,
``factory("expert", ids)`` just those routed experts (global ids). The runtime runs 2 attention ranks, 2 expert
ranks and a front end on this host, splits prompts into 16-token chunks, and each request's first token and
final hidden state are checked against ``ToyMoE.reference``, the whole forward on one process.
"""
import argparse
import sys
from dataclasses import dataclass

import torch

from asap_comm.serving import (AttentionStage, ExpertStage, ModelFactory, ModelInfo, PromptRequest, RuntimeConfig,
                               run_async)
from asap_comm.serving.plugins import model_info_of

VOCAB, H, LAYERS, N, K, FF = 64, 16, 3, 8, 2, 32


@dataclass
class AttentionOutput:
    hidden: torch.Tensor  # [len, H] the residual stream after attention
    mlp_input: torch.Tensor  # [len, H] its norm: what the MLP / experts read


@dataclass
class Routing:
    topk_ids: torch.Tensor  # [T, K] global expert ids
    topk_weights: torch.Tensor  # [T, K]


def norm(x):
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


def mlp(w, x):
    return torch.relu(x @ w[0]) @ w[1]


class ToyMoE:
    """The model (or one worker's share of it). Every weight is drawn from one seed in a fixed order, so each
    share holds the same values as the whole model."""

    def __init__(self, seed: int = 0, experts: "list | None" = None, attention_side: bool = True) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=g) / shape[0] ** 0.5

        self.embed_w = rand(VOCAB, H) * VOCAB ** 0.5
        self.qkvo = [[rand(H, H) for _ in range(4)] for _ in range(LAYERS)]
        self.dense = (rand(H, FF), rand(FF, H))
        self.router = [rand(H, N) for _ in range(LAYERS)]
        self.shared = [(rand(H, FF), rand(FF, H)) for _ in range(LAYERS)]
        routed = [[(rand(H, FF), rand(FF, H)) for _ in range(N)] for _ in range(LAYERS)]
        keep = range(N) if experts is None else experts
        self.routed = [{e: routed[layer][e] for e in keep} for layer in range(LAYERS)]
        self.head = rand(H, VOCAB)
        self.attention_side = attention_side

    # ------------------------------------------------------------------ the attention side (AttentionStage)
    def new_cache(self):
        return [[] for _ in range(LAYERS)]  # per layer: (K, V) of every chunk so far

    def embed(self, token_ids):
        return self.embed_w[token_ids]

    def attention_stage(self, layer, hidden, cache):
        q, k, v, o = self.qkvo[layer]
        x = norm(hidden)
        cache[layer].append((x @ k, x @ v))
        keys, values = (torch.cat(t) for t in zip(*cache[layer]))
        start = keys.shape[0] - hidden.shape[0]  # positions of these tokens: start .. start+len-1
        scores = (x @ q) @ keys.T / H ** 0.5
        future = torch.arange(keys.shape[0])[None, :] > torch.arange(start, keys.shape[0])[:, None]
        h = hidden + torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ values @ o
        return AttentionOutput(h, norm(h))

    def route(self, layer, mlp_input):
        w, ids = torch.softmax(mlp_input @ self.router[layer], -1).topk(K)
        return Routing(ids, w / w.sum(-1, keepdim=True))

    def shared_experts(self, layer, mlp_input):
        return mlp(self.shared[layer], mlp_input)

    def dense_mlp(self, layer, mlp_input):
        return mlp(self.dense, mlp_input)

    def final_norm(self, hidden):
        return norm(hidden)

    def lm_head_logits(self, normed):
        return normed @ self.head

    # ------------------------------------------------------------------ the expert side (ExpertStage)
    def expert(self, layer, expert, x):
        return mlp(self.routed[layer][expert], x)  # unweighted: the runtime applies the routing weights

    # ------------------------------------------------------------------ the whole forward on one process
    def reference(self, token_ids):
        """(first token, final-normed hidden of the last prompt token) without chunks, ranks or the runtime."""
        h, cache = self.embed(token_ids), self.new_cache()
        for layer in range(LAYERS):
            a = self.attention_stage(layer, h, cache)
            if layer == 0:
                y = self.dense_mlp(layer, a.mlp_input)
            else:
                r = self.route(layer, a.mlp_input)
                y = self.shared_experts(layer, a.mlp_input)
                for t in range(h.shape[0]):  # token by token, choice by choice
                    for j in range(K):
                        e = int(r.topk_ids[t, j])
                        y[t] += r.topk_weights[t, j] * self.expert(layer, e, a.mlp_input[t:t + 1])[0]
            h = a.hidden + y
        normed = self.final_norm(h[-1:])
        return int(self.lm_head_logits(normed).argmax(-1)[0]), normed[0]


class ToyFactory:
    """The factory ``run_async`` takes (picklable): each worker's share, and the shapes."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def __call__(self, role: str, experts: list):
        if role not in ("attention", "expert"):
            raise ValueError(f"ToyFactory: role must be 'attention' or 'expert', got {role!r}")
        return ToyMoE(self.seed, experts=None if role == "attention" else experts, attention_side=role == "attention")

    def describe(self) -> dict:
        return {"num_layers": LAYERS, "moe_layers": [layer > 0 for layer in range(LAYERS)], "hidden": H,
                "vocab_size": VOCAB, "num_experts": N, "top_k": K}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12, help="prompts to serve (default: %(default)s)")
    args = ap.parse_args(argv)
    factory = ToyFactory(seed=0)
    assert isinstance(factory, ModelFactory) and isinstance(factory("attention", []), AttentionStage)
    assert isinstance(factory("expert", [0]), ExpertStage)
    info: ModelInfo = model_info_of(factory)
    g = torch.Generator().manual_seed(1)
    requests = [PromptRequest(i, 0.02 * i, torch.randint(0, VOCAB, (int(torch.randint(1, 41, (1,), generator=g)),),
                                                         generator=g)) for i in range(args.requests)]
    cfg = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=2, token_budget=32, chunk_len=16, max_prompt_len=64,
                        timeout_s=120)
    result = run_async(factory, info, requests, cfg)
    ref, bad = ToyMoE(seed=0), 0
    for r in requests:
        if r.request_id not in result.outputs:
            print(f"request {r.request_id}: no result", file=sys.stderr)
            bad += 1
            continue
        token, hidden = result.outputs[r.request_id]
        want_token, want_hidden = ref.reference(r.token_ids)
        err = float((hidden - want_hidden).abs().max())
        if token != want_token or err > 1e-4:
            print(f"request {r.request_id}: token {token} (reference {want_token}), |hidden diff| {err:.2e}",
                  file=sys.stderr)
            bad += 1
    ttft = sorted(rec.ttft_s for rec in result.records if rec.ok)
    print(f"served {len(requests) - bad}/{len(requests)} requests through run_async (2 attention + 2 expert ranks), "
          f"each equal to the reference forward; median TTFT {ttft[len(ttft) // 2] * 1e3:.1f} ms" if ttft else "")
    print("OK" if bad == 0 else f"MISMATCH: {bad} requests")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
