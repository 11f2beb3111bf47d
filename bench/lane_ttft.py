"""The long-prompt lane in the emulator: one long prompt alone, lane on against lane off (its TTFT ratio).

    python bench/lane_ttft.py [--prompt 499] [--attention-ranks 2] [--attention-tp 8] [--expert-ranks 4]
    python bench/lane_ttft.py --compare chunks [...]   # the lane's chunks of equal length against equal cost

``--compare chunks`` runs the lane twice instead, with ``--lane-chunks tokens`` and ``cost``
(``RuntimeConfig.lane_chunks``), and prints beside each emulated TTFT the simulator's prediction of the same run
(``simulate_emulated``: the same deployment, scaled tokens and dilated time) and their difference.
``--expert-dies D``: each expert rank stands for D emulated dies (as ``examples/prefill.py``).

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
from asap_comm.serving.traces import Request
from asap_comm.sim.emulate.emulator import EmulatedFactory, simulate_emulated
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
    p.add_argument("--compare", choices=("lane", "chunks"), default="lane",
                   help="lane: lane off against on; chunks: the lane's chunks of equal length against equal cost")
    p.add_argument("--expert-dies", type=int, default=1, help="emulated dies per expert rank")
    p.add_argument("--model", default="tiny", help="the served model (a preset or a checkpoint directory)")
    p.add_argument("--layers", type=int, default=None,
                   help="serve the tiny preset's shapes with this many layers instead (a random checkpoint written "
                        "to a temporary folder): the lane's wavefront runs per served layer, so more layers come "
                        "closer to the emulated model's 61")
    add_runtime_args(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    given = given_flags(p, argv)
    for k, v in {**PRESETS, "max_prompt_len": max(512, a.prompt)}.items():
        if k not in given:
            setattr(a, k, v)
    model = a.model
    if a.layers is not None:
        import dataclasses

        from asap_models import preset, random_init, save_checkpoint
        if a.layers < 2:
            p.error(f"--layers {a.layers}: give 2 or more (one dense layer, then MoE layers)")
        import atexit
        import shutil
        model = tempfile.mkdtemp(prefix="asap-lane-ttft-")
        atexit.register(shutil.rmtree, model, True)
        cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=a.layers,
                                  max_position_embeddings=max(2048, a.prompt))
        save_checkpoint(random_init(cfg, seed=0), model)
    base = load_model_factory(model, seed=0)
    info = model_info_of(base)
    g = torch.Generator().manual_seed(0)
    reqs = [PromptRequest(0, 0.0, torch.randint(0, info.vocab_size, (8,), generator=g)),
            PromptRequest(1, 2.0, torch.randint(0, info.vocab_size, (a.prompt,), generator=g))]
    out = {"command": " ".join(["python bench/lane_ttft.py"] + argv)}
    runs = ((("no_lane", {"long_prompt_lane": False}), ("lane", {"long_prompt_lane": True})) if a.compare == "lane"
            else (("equal_length", {"long_prompt_lane": True, "lane_chunks": "tokens"}),
                  ("equal_cost", {"long_prompt_lane": True, "lane_chunks": "cost"})))
    for key, fields in runs:
        with tempfile.TemporaryDirectory() as stats:
            f = EmulatedFactory(base, a.profile, a.emulate_model, time_scale=a.time_scale, token_scale=a.token_scale,
                                num_expert_ranks=a.expert_ranks, attention_tp=a.attention_tp,
                                expert_devices=a.expert_dies, stats_dir=stats)
            try:
                cfg = runtime_config_from_args(a, timeout_s=600, placer_linear_weight=f.placer_linear_weight(),
                                               **fields)
            except ValueError as e:
                p.error(str(e))
            res = run_async(f, info, reqs, cfg)
            over = overrun_summary(read_stats(stats))
            sim = None
            if a.compare == "chunks":  # the simulator's prediction of this very run
                trace = [Request(r.request_id, r.arrival_s * a.time_scale, int(r.token_ids.numel())) for r in reqs]
                sim = {r.request_id: r for r in simulate_emulated(f, "async", trace, cfg).records}[1].ttft_s
        rec = {r.request_id: r for r in res.records}[1]
        if rec.error:
            raise SystemExit(f"{key}: {rec.error}")
        lane_pes = sorted({sp[0] for sp in res.spans if sp[2].startswith("lane kv")})
        out[key] = {"ttft_modelled_s": rec.ttft_s / a.time_scale, "ttft_wall_s": rec.ttft_s,
                    "lane_ranks_putting_kv": lane_pes, "overrun_fraction": over["overrun_fraction"]}
        line = (f"{key}: TTFT {rec.ttft_s / a.time_scale:.2f} s modelled ({rec.ttft_s:.2f} s wall); ranks putting KV "
                f"{lane_pes}; overrun fraction {over['overrun_fraction']:.3f}")
        if sim is not None:
            out[key]["simulated_ttft_modelled_s"] = sim / a.time_scale
            line += f"; the simulator {sim / a.time_scale:.2f} s ({sim / rec.ttft_s - 1:+.1%})"
        print(line, flush=True)
    if a.compare == "lane":
        out["ttft_ratio_off_over_on"] = out["no_lane"]["ttft_modelled_s"] / out["lane"]["ttft_modelled_s"]
        print(f"TTFT lane off / lane on: {out['ttft_ratio_off_over_on']:.3f}x")
    else:
        out["ttft_ratio_length_over_cost"] = (out["equal_length"]["ttft_modelled_s"]
                                              / out["equal_cost"]["ttft_modelled_s"])
        print(f"TTFT equal-length chunks / equal-cost chunks: {out['ttft_ratio_length_over_cost']:.3f}x")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
