"""The long-prompt lane in the emulator: one long prompt alone, lane on against lane off (its TTFT ratio).

    python bench/lane_ttft.py [--prompt 499] [--attention-ranks 2] [--attention-tp 8] [--expert-ranks 4]

Emulated accelerators (``asap_comm.sim.emulate``): the served ``tiny`` model stands for ``--emulate-model`` on
``--profile``, each real token for ``--token-scale`` emulated ones (499 x 128 = 63.9k tokens: the afd-plugin
study's solo prompt). A short warm-up request runs first; the long prompt arrives after it. Prints the modelled
TTFT (wall / time scale) of each run, their ratio and the overrun fraction of the held calls.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import torch

from asap_comm.serving.runtime import ModelInfo, PromptRequest, RuntimeConfig, run_async
from asap_comm.sim.emulate import EmulatedFactory, overrun_summary, read_stats
from models.factory import StageFactory  # this checkout's models (the lane's kv_rows hooks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=499, help="served tokens of the long prompt")
    p.add_argument("--attention-ranks", type=int, default=2)
    p.add_argument("--attention-tp", type=int, default=8)
    p.add_argument("--expert-ranks", type=int, default=4)
    p.add_argument("--chunk-len", type=int, default=128)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--emulate-model", default="deepseek-v3")
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--token-scale", type=int, default=128)
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    a = p.parse_args(argv)
    base = StageFactory("tiny", seed=0)
    c = base.config()
    info = ModelInfo(c.num_hidden_layers, tuple(c.is_moe_layer(i) for i in range(c.num_hidden_layers)), c.hidden_size,
                     c.vocab_size, c.n_routed_experts, c.num_experts_per_tok,
                     kv_row_width=c.kv_lora_rank + c.qk_rope_head_dim)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(0, 0.0, torch.randint(0, c.vocab_size, (8,), generator=g)),
            PromptRequest(1, 2.0, torch.randint(0, c.vocab_size, (a.prompt,), generator=g))]
    out = {"command": " ".join(["python bench/lane_ttft.py"] + (argv if argv is not None else sys.argv[1:]))}
    for lane in (False, True):
        cfg = RuntimeConfig(num_attention_ranks=a.attention_ranks, num_expert_ranks=a.expert_ranks,
                            token_budget=a.chunk_len, chunk_len=a.chunk_len, max_prompt_len=max(512, a.prompt),
                            long_prompt_lane=lane, timeout_s=600)
        with tempfile.TemporaryDirectory() as stats:
            f = EmulatedFactory(base, a.profile, a.emulate_model, time_scale=a.time_scale, token_scale=a.token_scale,
                                num_expert_ranks=a.expert_ranks, attention_tp=a.attention_tp, stats_dir=stats)
            res = run_async(f, info, reqs, cfg)
            over = overrun_summary(read_stats(stats))
        rec = {r.request_id: r for r in res.records}[1]
        if rec.error:
            raise SystemExit(f"lane={lane}: {rec.error}")
        lane_pes = sorted({sp[0] for sp in res.spans if sp[2].startswith("lane kv")})
        out["lane" if lane else "no_lane"] = {"ttft_modelled_s": rec.ttft_s / a.time_scale, "ttft_wall_s": rec.ttft_s,
                                             "lane_ranks_putting_kv": lane_pes,
                                             "overrun_fraction": over["overrun_fraction"]}
        print(f"lane={lane}: TTFT {rec.ttft_s / a.time_scale:.2f} s modelled ({rec.ttft_s:.2f} s wall); "
              f"ranks putting KV {lane_pes}; overrun fraction {over['overrun_fraction']:.3f}", flush=True)
    out["ttft_ratio_off_over_on"] = out["no_lane"]["ttft_modelled_s"] / out["lane"]["ttft_modelled_s"]
    print(f"TTFT lane off / lane on: {out['ttft_ratio_off_over_on']:.3f}x")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
