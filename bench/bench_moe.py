"""MoE round trip benchmark: dispatch -> identity expert -> combine, asap_comm.moe against gloo all-to-alls.

Usage::

    python bench/bench_moe.py [--quick] [--out bench/results]
    python bench/bench_moe.py --docs    # also: docs/results/bench/bench_moe.json and its table in docs/benchmarks.md
    python bench/bench_moe.py --render-docs [--check]   # no run: that table again from the committed json

Four processes on one host: PEs 0-1 are attention ranks, PEs 2-3 expert
ranks (A = 2, E = 2); N = 32 experts (16 per expert rank), top-k = 8
distinct experts per token drawn uniformly at random, H = 1024, float32,
T = 128 and T = 1024 tokens per micro-batch. The expert is the identity, so
every combined row must equal ``x[t] * sum_j topk_weights[t, j]``. The workload, the
per-PE program and the rows are ``bench/_moe_workload.py`` (``bench/bench_net.py`` runs
the same across two hosts).

Measured in the same processes, interleaved round by round:

* ``asap_moe_T*``: each attention rank loops ``dispatch_send`` ->
  ``combine_recv`` (one micro-batch in flight); expert ranks loop
  ``dispatch_recv`` -> identity -> ``combine_send`` until they have served
  every row they will be sent. One sample = one round trip.
* ``asap_moe_T*_2inflight``: the same with two handles in flight per attention
  rank (ping-pong); one sample = a batch's time / its round trips (throughput).
* ``gloo_moe_T*``: the synchronous DP+EP path on the same 4 processes:
  ``torch.distributed`` gloo on 127.0.0.1, dispatch = ``all_to_all_single``
  (each token sent once per destination expert rank, its expert ids and
  weights packed into the row), identity on the experts, combine = a second
  ``all_to_all_single`` back, ``index_add_`` on the attention rank. Every
  rank joins both collectives each iteration.
* ``asap_put_bw``: ``comm.put`` of 16 MiB float32 into a peer's symmetric
  tensor (the core bandwidth the MoE path is compared with).

Progress on stderr, the table on stdout, ``moe.json`` / ``moe.md`` under
``--out``. Exit status 1 if a data check failed or a benchmark errored.
See bench/README.md ("MoE round trip") for the method.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone

import torch

import asap_comm
from _common import fmt_cell, git_commit, log
from _doc_tables import DocLine, add_arguments, check_flags, publish, render_main
from _moe_workload import (FULL, NUM_ATTENTION, NUM_EXPERT_RANKS, NUM_EXPERTS, QUICK, SIZES, TOP_K, HIDDEN,
                           WAIT_TIMEOUT_S, WORLD, asap_moe_status, build_rows, mean_round_trip_bytes, moe_pe)

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------- the docs table
DOCS_NAME = "bench_moe"
DOCS_COMMAND = "python bench/bench_moe.py --docs"


def docs_what(meta: dict) -> str:
    """The setting of a run in words, for the line above its docs table."""
    threads = meta["torch_threads"]
    return (f"{NUM_ATTENTION} attention + {NUM_EXPERT_RANKS} expert PEs on one host, H={HIDDEN}, top-{TOP_K} of "
            f"{NUM_EXPERTS}, identity experts, {threads} torch thread{'s' if threads != 1 else ''} per process"
            f"{', pinned' if meta['pinned'] else ''}; medians, gloo measured in the same processes")


DOC_LINES = (  # the rows of docs/benchmarks.md's table of this command, each against its baseline and target
    DocLine("MoE dispatch + identity + combine, T=128", "asap_moe_T128", "gloo `all_to_all_single`"),
    DocLine("same, two micro-batches in flight (time per round trip)", "asap_moe_T128_2inflight",
            "gloo `all_to_all_single`"),
    DocLine("same, T=1024", "asap_moe_T1024", "gloo `all_to_all_single`", target=False),
    DocLine("same, T=1024, both attention ranks' bandwidth", "asap_moe_T1024", "one `comm.put` stream",
            base_row="asap_put_bw", key="gbps_aggregate", unit="GB/s"),
)


# ---------------------------------------------------------------------------- tables
COLUMNS = [  # (row key, header, format kind: _common.fmt_cell's, or "mib")
    ("name", "name", "text"),
    ("tokens", "T", "text"),
    ("inflight", "in flight", "text"),
    ("bytes", "bytes/rt", "mib"),
    ("unit", "unit", "text"),
    ("median", "median", "num"),
    ("p10", "p10", "num"),
    ("p90", "p90", "num"),
    ("gbps", "GB/s", "num"),
    ("baseline", "baseline", "text"),
    ("baseline_median", "base median", "num"),
    ("ratio", "ratio (>1: ASAP better)", "ratio"),
    ("vs_put_bw", "GB/s vs put", "ratio"),
    ("target", "target", "text"),
    ("target_met", "met", "text"),
    ("correct", "check", "text"),
]


def _cell(value, kind: str) -> str:
    if kind == "mib":
        return "-" if value is None else f"{value / (1 << 20):.2f} MiB"
    return fmt_cell(value, kind)


def _cells(rows: list) -> list:
    return [[_cell(r.get(key), kind) for key, _, kind in COLUMNS] for r in rows]


def text_table(rows: list) -> str:
    headers = [h for _, h, _ in COLUMNS]
    body = _cells(rows)
    widths = [max(len(c) for c in col) for col in zip(headers, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [headers, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list) -> str:
    headers = [h for _, h, _ in COLUMNS]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in _cells(rows)]
    return "\n".join(out)


def write_results(out_dir: str, rows: list, meta: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    notes = [f"{r['name']}: {r['note']}" for r in rows if r.get("note")]
    with open(os.path.join(out_dir, "moe.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "notes": notes}, f, indent=2)
        f.write("\n")
    meta_line = ", ".join(f"{k}={v}" for k, v in meta.items() if k != "config")
    md = ["# MoE round trip: asap_comm.moe vs gloo all-to-all", "", f"_{meta_line}_", "",
          f"A={NUM_ATTENTION} attention + E={NUM_EXPERT_RANKS} expert ranks, N={NUM_EXPERTS} experts, "
          f"top-{TOP_K}, H={HIDDEN}, float32, identity experts. `us` rows: time per round trip on an attention "
          "rank; `bytes/rt`: hidden rows sent to expert ranks + rows returned, per attention rank; `GB/s` = "
          "bytes/rt / median (per attention rank; both run at once). Ratios: >1 means ASAP is better.", "",
          markdown_table(rows)]
    if notes:
        md += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    with open(os.path.join(out_dir, "moe.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="MoE dispatch/combine round trip: asap_comm.moe vs gloo "
                                             "(see bench/README.md).")
    ap.add_argument("--quick", action="store_true", help="one round, fewer iterations (under ~45 s)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for moe.json / moe.md")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default 1: "
                                                           "4 processes share the host's CPUs)")
    ap.add_argument("--pin", action="store_true", help="pin PE i to CPU i mod 2 (default: the scheduler places them)")
    add_arguments(ap)
    args = ap.parse_args(argv)
    check_flags(ap, args)
    if args.render_docs:
        return render_main(args, DOCS_NAME, DOCS_COMMAND, DOC_LINES, docs_what)
    cfg = QUICK if args.quick else FULL
    t0 = time.monotonic()
    asap_note = asap_moe_status()
    if asap_note:
        log(asap_note)
    mean_bytes = mean_round_trip_bytes()
    results, error = None, ""
    attempts = [True, False] if not asap_note else [False]
    for with_asap in attempts:
        what = "ASAP + gloo" if with_asap else "gloo only"
        log(f"launching 4 PEs ({what}, {cfg.rounds} round(s), T={list(SIZES)}, threads={args.threads}, "
            f"pin={args.pin}) ...")
        try:
            results = asap_comm.launch(moe_pe, WORLD, cfg, args.threads, args.pin, with_asap,
                                       timeout=cfg.launch_timeout, comm_timeout=WAIT_TIMEOUT_S)
            log(f"{what}: done after {time.monotonic() - t0:.1f} s")
            break
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[-1]
            error = f"error: {type(e).__name__}: {first}"[:300]
            log(f"{what}: ERROR: {type(e).__name__}: {e}")
            if with_asap:
                asap_note = error
                log("retrying without ASAP so the baseline rows still get measured")
    rows = build_rows(results, asap_note, mean_bytes)
    if results is None:
        for r in rows:
            r["correct"], r["note"] = "FAIL", error
    meta = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "rounds": cfg.rounds,
        "seconds": round(time.monotonic() - t0, 1),
        "commit": git_commit(HERE),
        "asap_comm": asap_comm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch_threads": args.threads,
        "pinned": args.pin,
        "asap_spin_ns": os.environ.get("ASAP_SPIN_NS", "default"),
        "config": asdict(cfg),
    }
    write_results(args.out, rows, meta)
    print(text_table(rows))
    for r in rows:
        if r.get("note"):
            print(f"  note: {r['name']}: {r['note']}")
    log(f"finished in {meta['seconds']} s; wrote {args.out}/moe.json and moe.md")
    if args.docs:
        publish(DOCS_NAME, DOCS_COMMAND, DOC_LINES, docs_what, meta, rows)
    return 1 if any(r["correct"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
