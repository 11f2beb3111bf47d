"""Prefill speed of the reference model (models/) beside transformers' DeepseekV3ForCausalLM.

One command, from the repository root:

    python bench/bench_models.py            # `small` preset, 2048 tokens, 5 repeats

Both run the same random weights (written once as a Hugging Face checkpoint and loaded by
each), float32, one request of --tokens tokens, no grad; the repeats alternate between the
two so that machine noise hits both alike. Reports median and spread of the wall time,
prefill tokens/s, the speed ratio (ours / transformers) and a PASS/FAIL check that the
logits agree (relative error < 1e-4).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from asap_models import load_checkpoint, preset, random_init, save_checkpoint


def _time(fn, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(ids)
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = preset(args.preset)
    if args.tokens > cfg.max_position_embeddings:
        ap.error(f"--tokens {args.tokens} > max_position_embeddings {cfg.max_position_embeddings}")
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(random_init(cfg, seed=0), tmp)
        ours = load_checkpoint(tmp)
        theirs = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))
    runs = {
        "models (ours)": lambda x: ours(x),
        "transformers": lambda x: theirs(x[None]).logits[0],
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    logits: dict[str, torch.Tensor] = {}
    for i in range(args.warmup + args.repeats):
        for name, fn in runs.items():
            dt, out = _time(fn, ids)
            if i >= args.warmup:
                times[name].append(dt)
            logits[name] = out
    a, b = logits.values()
    rel = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
    ok = rel < 1e-4

    print(f"prefill, preset={args.preset} ({cfg.num_parameters() / 1e6:.1f}M params), {args.tokens} tokens, "
          f"float32, {torch.get_num_threads()} threads, median of {args.repeats} (after {args.warmup} warm-up)")
    print(f"{'implementation':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'tokens/s':>9}")
    med = {}
    for name, ts in times.items():
        med[name] = statistics.median(ts)
        print(f"{name:<16} {med[name]:9.3f} {min(ts):7.3f} {max(ts):7.3f} {args.tokens / med[name]:9.0f}")
    ratio = med["transformers"] / med["models (ours)"]
    print(f"speed ratio (ours / transformers, tokens/s): {ratio:.2f}   logits rel err {rel:.1e}: "
          f"{'PASS' if ok else 'FAIL'}")
    if args.json:
        args.json.write_text(json.dumps({
            "preset": args.preset, "tokens": args.tokens, "threads": torch.get_num_threads(),
            "seconds": times, "tokens_per_s": {k: args.tokens / v for k, v in med.items()},
            "ratio": ratio, "logits_rel_err": rel, "pass": ok,
        }, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
