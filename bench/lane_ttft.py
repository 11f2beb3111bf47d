"""The long-prompt lane in the emulator: one long prompt alone, lane on against lane off (its TTFT ratio).

    python bench/lane_ttft.py [--prompt 499] [--attention-ranks 2] [--attention-tp 8] [--expert-ranks 4]

The runtime's flags are every command line's (``add_runtime_args``); this benchmark's presets for those not given:
4 expert ranks, 128-token chunks and micro-batches, prompts up to max(512, --prompt) tokens.

Emulated accelerators (``asap_comm.sim.emulate.emulator``): the served ``tiny`` model stands for ``--emulate-model`` on
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

from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.runtime import PromptRequest, run_async
from asap_comm.serving.runtime_args import add_runtime_args, given_flags, runtime_config_from_args
from asap_comm.sim.emulate.emulator import EmulatedFactory
from asap_comm.sim.emulate.stats import overrun_summary, read_stats

PRESETS = {"expert_ranks": 4, "chunk_len": 128, "token_budget": 128}  # for the runtime's flags not given


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=499, help="served tokens of the long prompt")
    p.add_argument("--attention-tp", type=int, default=8)
    p.add_argument("--profile", default="ascend-910c-cm384")
    p.add_argument("--emulate-model", default="deepseek-v3")
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--token-scale", type=int, default=128)
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    add_runtime_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    given = given_flags(p, argv)
    for k, v in {**PRESETS, "max_prompt_len": max(512, a.prompt)}.items():
        if k not in given:
            setattr(a, k, v)
    base = load_model_factory("tiny", seed=0)
    info = model_info_of(base)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(0, 0.0, torch.randint(0, info.vocab_size, (8,), generator=g)),
            PromptRequest(1, 2.0, torch.randint(0, info.vocab_size, (a.prompt,), generator=g))]
    out = {"command": " ".join(["python bench/lane_ttft.py"] + argv)}
    for lane in (False, True):
        try:
            cfg = runtime_config_from_args(a, long_prompt_lane=lane, timeout_s=600)
        except ValueError as e:
            p.error(str(e))
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
