"""Record an expert-selection histogram from the reference model's own router (``asap_comm.sim.costmodel.routing``'s
``histogram:PATH`` reads it).

Prompts: the Mooncake conversation trace's prompt lengths (first ``--prompts`` requests, divided by
``--length-scale``, clipped to ``--max-len``), each filled with text-like token ids: drawn from a Zipf law over
the vocabulary (rank ``r`` with weight ``1 / r**1.0``, natural text's token frequencies), the ranks shuffled
over the ids with the seed. Every prompt is prefilled through the model's stages (``layer_forward``, the
forward the serving runtime reproduces) and every MoE layer's ``route`` output, the router the runtime calls
(group-limited top-k with its bias), is counted per expert.

    python bench/record_routing.py --model small --seed 0 --prompts 64 \
        --out asap_comm/sim/routing_data/small-seed0-mooncake.json

Honest limits: the preset models have seeded random weights, so this is the routing of a random-weight router
on text-like ids, not DeepSeek-V3's trained router (whose auxiliary-loss-free balancing keeps its load far
flatter over a large batch); it measures what *this* runtime's router does, and gives the simulator a measured
curve to use. Imports ``models`` (asap_comm never does).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from asap_comm.serving.traces import load_trace
from asap_comm.sim.calibrate.target import mooncake_path
from asap_comm.sim.costmodel.routing import HISTOGRAM_FORMAT
from asap_models.factory import StageFactory


def text_like_ids(n: int, vocab: int, rng: random.Random, order: list) -> list:
    """``n`` token ids from a Zipf(1.0) law over the vocabulary (``order[r]``: the id of frequency rank r)."""
    weights = [1.0 / (r + 1) for r in range(vocab)]
    return [order[i] for i in rng.choices(range(vocab), weights=weights, k=n)]


def record(model: str, seed: int, prompts: int, length_scale: float, max_len: int) -> dict:
    factory = StageFactory(model, seed)
    cfg = factory.config()
    full = factory.full().eval()
    path = mooncake_path()
    if path is None:
        raise SystemExit("record_routing.py: the Mooncake trace (asap_comm/data/traces/mooncake_conversation.jsonl) is "
                         "not found")
    lens = [max(1, min(max_len, round(r.prompt_len / length_scale))) for r in load_trace(path)[:prompts]]
    counts = {layer: [0] * cfg.n_routed_experts for layer in range(cfg.num_hidden_layers) if cfg.is_moe_layer(layer)}
    route = full.route

    def counting_route(layer, mlp_input):
        r = route(layer, mlp_input)
        for e, c in zip(*torch.unique(r.topk_ids, return_counts=True)):
            counts[layer][int(e)] += int(c)
        return r

    full.route = counting_route
    rng = random.Random(seed)
    order = list(range(cfg.vocab_size))
    rng.shuffle(order)
    t0 = time.perf_counter()
    with torch.no_grad():
        for n in lens:
            full.prefill(torch.tensor(text_like_ids(n, cfg.vocab_size, rng, order), dtype=torch.int64))
    tokens = sum(lens)
    return {"format": HISTOGRAM_FORMAT, "model": f"{model} preset, seeded random weights (seed {seed})",
            "num_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok, "tokens": tokens, "seed": seed,
            "prompts": {"count": len(lens), "lengths": f"Mooncake conversation trace, first {len(lens)} requests' "
                        f"prompt lengths / {length_scale:g}, clipped to {max_len}",
                        "tokens": "text-like ids: Zipf(1.0) over the vocabulary, ranks shuffled with the seed"},
            "recorded_with": "bench/record_routing.py: DeepseekV3.route (the runtime's router) of every MoE layer "
                             "during layer-by-layer prefill", "record_wall_s": round(time.perf_counter() - t0, 1),
            "note": "a random-weight router on text-like ids, not DeepSeek-V3's trained router",
            "layers": {str(k): v for k, v in counts.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="a preset of models/ (tiny, small)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--length-scale", type=float, default=16.0, help="Mooncake prompt lengths are divided by this")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.prompts < 1 or args.length_scale <= 0 or args.max_len < 1:
        p.error("--prompts and --max-len must be >= 1 and --length-scale > 0")
    data = record(args.model, args.seed, args.prompts, args.length_scale, args.max_len)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    loads = [sorted(c, reverse=True) for c in data["layers"].values()]
    mean = data["tokens"] * data["top_k"] / data["num_experts"]
    print(f"{data['tokens']} tokens, {len(loads)} MoE layers; hottest expert / mean per layer: "
          + ", ".join(f"{c[0] / mean:.2f}" for c in loads) + f"  -> {out} ({data['record_wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
