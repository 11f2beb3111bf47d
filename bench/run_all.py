"""Run the ASAP benchmark suite and its baselines; print one table, write results.json and results.md.

Usage::

    bash bench/setup.sh                 # once: Open MPI + mpi4py for the MPI baseline
    python bench/run_all.py [--quick] [--out bench/results]
    python bench/run_all.py --docs      # also: docs/results/bench/run_all.json and its table in docs/benchmarks.md
    python bench/run_all.py --render-docs [--check]   # no run: that table again from the committed json

Progress goes to stderr, the table to stdout. Exit status 1 if any data
check failed or a benchmark errored (a target that is not met does not fail
the run; a baseline that cannot run here is skipped with a note).
See bench/README.md for what every row measures.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Callable

import torch

import asap_comm
import _asap_primitives as primitives
import _baselines as baselines
from _common import (GBPS, US, BatchPlan, Measurement, Target, git_commit, log, make_row, markdown_table, notes_of,
                     ns_to_gbps, ns_to_us, text_table)
from _doc_tables import DocLine, add_arguments, check_flags, publish, render_main

HERE = os.path.dirname(os.path.abspath(__file__))
PAYLOAD_BYTES = 8  # ping-pong payload
MAILBOX_BYTES = 64  # mailbox / Pipe message size
MAILBOX_SLOTS = 16
BW_BYTES = 16 << 20  # bandwidth transfer size
GROUP_TIMEOUT_S = 120.0  # bound on every process group (launch, mpirun, spawned baselines)


@dataclass(frozen=True)
class Config:
    """Iteration counts of one run; ``rounds`` repeats every benchmark, interleaved, and pools the samples."""

    rounds: int
    pingpong: BatchPlan  # ASAP prepared/generic and MPI ping-pong (round trips)
    torch_ops: BatchPlan  # torch.ops ping-pong (a slower path: fewer round trips)
    mailbox: BatchPlan
    pipe: BatchPlan
    gloo: BatchPlan  # gloo ping-pong, per size
    bw_iters: int  # timed transfers per bandwidth sample set
    bw_warmup: int


FULL = Config(rounds=3, pingpong=BatchPlan(20000, 100, 1000), torch_ops=BatchPlan(300, 30, 100),
              mailbox=BatchPlan(2000, 100, 300), pipe=BatchPlan(500, 50, 100), gloo=BatchPlan(200, 30, 100),
              bw_iters=30, bw_warmup=3)
QUICK = Config(rounds=1, pingpong=BatchPlan(10000, 60, 1000), torch_ops=BatchPlan(200, 20, 100),
               mailbox=BatchPlan(1000, 60, 200), pipe=BatchPlan(300, 30, 100), gloo=BatchPlan(100, 20, 100),
               bw_iters=20, bw_warmup=2)

# ---------------------------------------------------------------------------- what is measured
PP_PREPARED = Measurement("asap_pingpong_prepared", "put_signal+wait ping-pong, one-way, prepared handles",
                          US, PAYLOAD_BYTES)
PP_GENERIC = Measurement("asap_pingpong_generic", "same, comm.put_signal / comm.signal_wait_until", US,
                         PAYLOAD_BYTES)
PP_GENERIC_KW = Measurement("asap_pingpong_generic_kw", "same, generic calls with op= and timeout= keywords", US,
                            PAYLOAD_BYTES)
PP_PREPARED_FREE = Measurement("asap_pingpong_prepared_unpinned", "same as asap_pingpong_prepared, processes not "
                               "pinned (where the OS puts them)", US, PAYLOAD_BYTES)
PP_GENERIC_KW_FREE = Measurement("asap_pingpong_generic_kw_unpinned", "same as asap_pingpong_generic_kw, processes "
                                 "not pinned", US, PAYLOAD_BYTES)
PP_TORCH_OPS = Measurement("asap_pingpong_torch_ops", "same, torch.ops.asap_comm.put_signal / signal_wait_until",
                           US, PAYLOAD_BYTES)
MPI_PP = Measurement("mpi_put_flush_pingpong", "Open MPI (osc sm) Put+Flush ping-pong, one-way, mpi4py", US,
                     PAYLOAD_BYTES)
PUT_BW = Measurement("asap_put_bw", "comm.put into the peer's symmetric tensor (float32)", GBPS, BW_BYTES)
COPY_BW = Measurement("torch_copy_bw", "torch copy_ between two local tensors, same process", GBPS, BW_BYTES)
PUT_BW_1T = Measurement("asap_put_bw_1thread", "same as asap_put_bw, torch.set_num_threads(1)", GBPS, BW_BYTES)
COPY_BW_1T = Measurement("torch_copy_bw_1thread", "same as torch_copy_bw, torch.set_num_threads(1)", GBPS,
                         BW_BYTES)
BW_THREADS = (0, 1)  # torch intra-op threads of the two bandwidth passes (0: torch's default)
BW_SPECS = ((PUT_BW, COPY_BW), (PUT_BW_1T, COPY_BW_1T))  # (put, copy_) rows of each pass
MAILBOX_RT = Measurement("asap_mailbox_rt", "mailbox send->recv->reply->recv round trip, box.send", US, MAILBOX_BYTES)
MAILBOX_RT_PREP = Measurement("asap_mailbox_rt_prepared", "same, sends through box.prepare_send handles", US,
                              MAILBOX_BYTES)
MAILBOX_RT_FREE = Measurement("asap_mailbox_rt_unpinned", "same as asap_mailbox_rt, processes not pinned", US,
                              MAILBOX_BYTES)
PIPE_RT = Measurement("pipe_rt", "multiprocessing.Pipe send_bytes/recv_bytes round trip", US, MAILBOX_BYTES)
GLOO_PP8 = Measurement("gloo_pingpong_8", "gloo send/recv ping-pong, one-way (127.0.0.1)", US, PAYLOAD_BYTES)
GLOO_PP64 = Measurement("gloo_pingpong_64", "gloo send/recv ping-pong, one-way (127.0.0.1)", US, MAILBOX_BYTES)
GLOO_BW = Measurement("gloo_send_bw", "gloo send of float32 + 8-byte ack (127.0.0.1)", GBPS, BW_BYTES)

PINGPONG_TARGET = Target("≤ 0.5 µs and ≥ 2x vs MPI", max_median=0.5, min_ratio=2.0)
KEYWORD_TARGET = Target("≤ 0.5 µs and within 1.5x of prepared", max_median=0.5, min_ratio=1 / 1.5)
PUT_TARGET = Target("≥ 90% of copy_", min_ratio=0.9)
MAILBOX_TARGET = Target("≤ 3 µs and ≥ 10x vs Pipe", max_median=3.0, min_ratio=10.0)


def measured(spec: Measurement, samples: list, bad: int, note: str = "") -> Measurement:
    """``spec`` filled with its samples; correct iff no check failed."""
    note = "; ".join(n for n in (f"{bad} failed data checks" if bad else "", note) if n)
    return replace(spec, samples=samples, correct=bad == 0, note=note)


# ---------------------------------------------------------------------------- benchmark families
def run_asap_pingpong(cfg: Config) -> list:
    plans = {"prepared": cfg.pingpong, "generic": cfg.pingpong, "generic_kw": cfg.pingpong, "torch_ops": cfg.torch_ops}
    r0, r1 = primitives.launch(primitives.pingpong_pe, plans, timeout=GROUP_TIMEOUT_S)
    specs = {"prepared": PP_PREPARED, "generic": PP_GENERIC, "generic_kw": PP_GENERIC_KW, "torch_ops": PP_TORCH_OPS}
    out = [measured(spec, ns_to_us(r0[path]["samples_ns"], 2), r0[path]["bad"] + r1[path]["bad"])
           for path, spec in specs.items()]
    free = {"prepared": cfg.pingpong, "generic_kw": cfg.pingpong}  # as a user runs them: no pinning
    r0, r1 = primitives.launch(primitives.pingpong_pe, free, False, timeout=GROUP_TIMEOUT_S)
    specs = {"prepared": PP_PREPARED_FREE, "generic_kw": PP_GENERIC_KW_FREE}
    return out + [measured(spec, ns_to_us(r0[path]["samples_ns"], 2), r0[path]["bad"] + r1[path]["bad"])
                  for path, spec in specs.items()]


def run_mpi(cfg: Config) -> list:
    r = baselines.mpi_pingpong(cfg.pingpong, timeout=GROUP_TIMEOUT_S)
    return [measured(MPI_PP, ns_to_us(r["samples_ns"], 2), r["bad"], r["library"].split(",")[0])]


def run_put_bandwidth(cfg: Config) -> list:
    pe0_passes, pe1_passes = primitives.launch(primitives.put_bandwidth_pe, BW_BYTES, cfg.bw_iters,
                                               cfg.bw_warmup, BW_THREADS, timeout=GROUP_TIMEOUT_S)
    out = []
    for (put_spec, copy_spec), r0, r1 in zip(BW_SPECS, pe0_passes, pe1_passes):
        note = f"torch threads={r0['threads']}"
        delivered = r0["digest"] == r1["digest"]
        put_note = note if delivered else f"{note}; peer digest {r1['digest']} != sent {r0['digest']}"
        out += [measured(put_spec, ns_to_gbps(BW_BYTES, r0["samples_ns"]), int(not delivered), put_note),
                measured(copy_spec, ns_to_gbps(BW_BYTES, r0["copy_samples_ns"]), r0["bad"], note)]
    return out


def run_mailbox(cfg: Config) -> list:
    out = []
    for spec, prepared, pin in ((MAILBOX_RT, False, True), (MAILBOX_RT_PREP, True, True),
                                (MAILBOX_RT_FREE, False, False)):
        r0, r1 = primitives.launch(primitives.mailbox_pe, cfg.mailbox, MAILBOX_BYTES, MAILBOX_SLOTS, prepared, pin,
                                   timeout=GROUP_TIMEOUT_S)
        out.append(measured(spec, ns_to_us(r0["samples_ns"]), r0["bad"] + r1["bad"]))
    return out


def run_pipe(cfg: Config) -> list:
    r = baselines.pipe_roundtrip(cfg.pipe, MAILBOX_BYTES, timeout=GROUP_TIMEOUT_S)
    return [measured(PIPE_RT, ns_to_us(r["samples_ns"]), r["bad"])]


def run_gloo(cfg: Config) -> list:
    r = baselines.gloo_suite(cfg.gloo, (PAYLOAD_BYTES, MAILBOX_BYTES), BW_BYTES, cfg.bw_iters, cfg.bw_warmup,
                             timeout=GROUP_TIMEOUT_S)
    pp8, pp64, bw = r[f"pingpong_{PAYLOAD_BYTES}"], r[f"pingpong_{MAILBOX_BYTES}"], r["bandwidth"]
    return [measured(GLOO_PP8, ns_to_us(pp8["samples_ns"], 2), pp8["bad"]),
            measured(GLOO_PP64, ns_to_us(pp64["samples_ns"], 2), pp64["bad"]),
            measured(GLOO_BW, ns_to_gbps(BW_BYTES, bw["samples_ns"]), bw["bad"] + (not bw["same_digest"]))]


@dataclass(frozen=True)
class Family:
    """Benchmarks that run together in one process group; ``run`` returns the ``specs`` filled in."""

    title: str
    specs: tuple
    run: Callable[[Config], list]


FAMILIES = (  # each ASAP family is followed by its baseline, so the two see the same machine state
    Family("ASAP put_signal ping-pong (prepared, generic, keywords, torch.ops; pinned and not)",
           (PP_PREPARED, PP_GENERIC, PP_GENERIC_KW, PP_TORCH_OPS, PP_PREPARED_FREE, PP_GENERIC_KW_FREE),
           run_asap_pingpong),
    Family("Open MPI one-sided ping-pong (mpirun)", (MPI_PP,), run_mpi),
    Family("ASAP put bandwidth vs torch copy_", (PUT_BW, COPY_BW, PUT_BW_1T, COPY_BW_1T), run_put_bandwidth),
    Family("ASAP mailbox round trip", (MAILBOX_RT, MAILBOX_RT_PREP, MAILBOX_RT_FREE), run_mailbox),
    Family("multiprocessing.Pipe round trip", (PIPE_RT,), run_pipe),
    Family("gloo ping-pong and bandwidth", (GLOO_PP8, GLOO_PP64, GLOO_BW), run_gloo),
)


def run_family(family: Family, cfg: Config) -> list:
    """Run one family; on a skip or an error, its specs come back unmeasured with the reason as note."""
    t0 = time.monotonic()
    log(f"{family.title} ...")
    try:
        out = family.run(cfg)
    except baselines.Skipped as e:
        log(f"{family.title}: SKIPPED: {e}")
        return [replace(s, correct=None, note=f"skipped: {e}") for s in family.specs]
    except Exception as e:  # report, keep going with the other families
        log(f"{family.title}: ERROR: {type(e).__name__}: {e}")
        first_line = (str(e).splitlines() or [""])[0]
        return [replace(s, correct=False, note=f"error: {type(e).__name__}: {first_line}"[:200])
                for s in family.specs]
    log(f"{family.title}: done in {time.monotonic() - t0:.1f} s")
    return out


def merge(a: Measurement, b: Measurement) -> Measurement:
    """Pool two rounds of one benchmark: samples concatenated; FAIL if either failed, SKIP only if both skipped."""
    checks = {a.correct, b.correct}
    correct = False if False in checks else (None if checks == {None} else True)
    notes = [a.note] + ([b.note] if b.note != a.note else [])
    return replace(a, samples=(a.samples or []) + (b.samples or []) or None, correct=correct,
                   note="; ".join(n for n in notes if n))


def measure_all(cfg: Config) -> dict:
    """Every benchmark, ``cfg.rounds`` times over (interleaved); Measurements by name."""
    results: dict = {}
    for rnd in range(1, cfg.rounds + 1):
        log(f"round {rnd}/{cfg.rounds}")
        for family in FAMILIES:
            for m in run_family(family, cfg):
                results[m.name] = merge(results[m.name], m) if m.name in results else m
    return results


def build_rows(m: dict) -> list:
    """The result rows: ASAP rows against their baselines and targets, then the baselines themselves."""
    gloo8, gloo_bw = m[GLOO_PP8.name], m[GLOO_BW.name]
    mpi = m[MPI_PP.name]
    return [
        make_row(m[PP_PREPARED.name], mpi, PINGPONG_TARGET, gloo=gloo8),
        make_row(m[PP_GENERIC.name], mpi, PINGPONG_TARGET, gloo=gloo8),
        make_row(m[PP_GENERIC_KW.name], m[PP_PREPARED.name], KEYWORD_TARGET),
        make_row(m[PP_GENERIC_KW_FREE.name], m[PP_PREPARED_FREE.name], KEYWORD_TARGET),
        make_row(m[PP_TORCH_OPS.name], mpi, None, gloo=gloo8),
        make_row(m[PUT_BW.name], m[COPY_BW.name], PUT_TARGET, gloo=gloo_bw),
        make_row(m[PUT_BW_1T.name], m[COPY_BW_1T.name], PUT_TARGET, gloo=gloo_bw),
        make_row(m[MAILBOX_RT.name], m[PIPE_RT.name], MAILBOX_TARGET),
        make_row(m[MAILBOX_RT_PREP.name], m[PIPE_RT.name], MAILBOX_TARGET),
        make_row(m[MAILBOX_RT_FREE.name], m[PIPE_RT.name], MAILBOX_TARGET),
        *(make_row(m[spec.name]) for spec in (MPI_PP, PP_PREPARED_FREE, COPY_BW, COPY_BW_1T, PIPE_RT, GLOO_PP8, GLOO_PP64,
                                               GLOO_BW)),
    ]


# ---------------------------------------------------------------------------- the docs table
DOCS_NAME = "run_all"
DOCS_COMMAND = "python bench/run_all.py --docs"
DOCS_WHAT = "two processes on one host, medians, every baseline measured in the same run"
DOC_LINES = (  # the rows of docs/benchmarks.md's table of this command, each against its baseline and target
    DocLine("put_signal + wait ping-pong, 8 B, one-way, prepared handles", PP_PREPARED.name,
            "Open MPI Put+Flush"),
    DocLine("same, generic `comm.put_signal` / `signal_wait_until`", PP_GENERIC.name, "Open MPI Put+Flush"),
    DocLine("same, generic calls with `op=` / `timeout=` keywords", PP_GENERIC_KW.name, "prepared handles"),
    DocLine("same, keywords, processes not pinned", PP_GENERIC_KW_FREE.name, "prepared, not pinned"),
    DocLine("same, `torch.ops.asap_comm`", PP_TORCH_OPS.name, "gloo send/recv", base_row=GLOO_PP8.name,
            target=False),
    DocLine("put, 16 MiB, into a peer's tensor", PUT_BW.name, "local `copy_`"),
    DocLine("same, `torch.set_num_threads(1)`", PUT_BW_1T.name, "local `copy_`, 1 thread"),
    DocLine("mailbox round trip, 64 B, `box.send`", MAILBOX_RT.name, "`multiprocessing.Pipe`"),
    DocLine("same, `box.prepare_send`", MAILBOX_RT_PREP.name, "`multiprocessing.Pipe`"),
    DocLine("same, `box.send`, processes not pinned", MAILBOX_RT_FREE.name, "`multiprocessing.Pipe`"),
    DocLine("gloo send/recv, 8 B, one-way (a baseline)", GLOO_PP8.name, target=False),
)


# ---------------------------------------------------------------------------- output
def metadata(quick: bool, cfg: Config, seconds: float) -> dict:
    """Where and how the numbers were taken."""
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "rounds": cfg.rounds,
        "seconds": round(seconds, 1),
        "commit": git_commit(HERE),
        "asap_comm": asap_comm.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "asap_spin_ns": os.environ.get("ASAP_SPIN_NS", "default"),
        "torch_threads": torch.get_num_threads(),
    }


def write_results(out_dir: str, rows: list, meta: dict) -> None:
    """results.json (rows + metadata + notes) and results.md (the table) under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    notes = notes_of(rows)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "notes": notes}, f, indent=2)
        f.write("\n")
    meta_line = ", ".join(f"{k}={v}" for k, v in meta.items())
    md = ["# ASAP benchmark results", "", f"_{meta_line}_", "",
          "Units: `us` rows are latencies (lower is better), `GB/s` rows bandwidths (higher is better); "
          "ratios are expressed so that >1 means ASAP is better.", "", markdown_table(rows)]
    if notes:
        md += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Run the ASAP benchmark suite (see bench/README.md).")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and iterations (about a minute)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for results.json/.md")
    add_arguments(ap)
    args = ap.parse_args(argv)
    check_flags(ap, args)
    if args.render_docs:
        return render_main(args, DOCS_NAME, DOCS_COMMAND, DOC_LINES, DOCS_WHAT)
    cfg = QUICK if args.quick else FULL
    t0 = time.monotonic()
    rows = build_rows(measure_all(cfg))
    meta = metadata(args.quick, cfg, time.monotonic() - t0)
    write_results(args.out, rows, meta)
    print(text_table(rows))
    for note in notes_of(rows):
        print(f"  note: {note}")
    log(f"finished in {meta['seconds']} s; wrote {args.out}/results.json and results.md")
    if args.docs:
        publish(DOCS_NAME, DOCS_COMMAND, DOC_LINES, DOCS_WHAT, meta, rows)
    return 1 if any(r["correct"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
