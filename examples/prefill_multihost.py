"""MoE prefill across hosts: one PE per process, launched by torchrun on every host.

    # on host 0 (attention ranks) and host 1 (expert ranks and the front end), the same command but --node-rank,
    # with the same group secret on every host (python -c "import secrets; print(secrets.token_hex(32))"):
    export ASAP_GROUP_SECRET=...
    torchrun --nnodes 2 --nproc-per-node 3 --node-rank 0 --master-addr HOST0 --master-port 29500 \\
        examples/prefill_multihost.py --mode async --out runs/multihost

Every process joins the group with ``asap_comm.init()`` (torchrun's RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; hosts told apart by hostname or ``$ASAP_HOST_ID``). Shared memory connects the PEs of one host,
the network engine (``pip install -e ".[net]"``) the hosts. The group is the one ``run_async`` /
``run_sync`` builds on one host: in async mode PEs ``0..A-1`` are attention ranks, ``A..A+E-1`` expert
ranks and the last PE the front end (A defaults to the number of PEs on rank 0's host, so attention and
experts sit on different hosts); in sync mode the first ``W - 1`` PEs are DP+EP workers (gloo through the
same TCPStore). The front end replays a synthetic skewed trace, checks every request's first token and
hidden state against the single-process reference forward, and writes to ``--out``:

* ``summary_<mode>.json``: TTFT statistics, checked/mismatched requests, which host each PE was on;
* ``timeline_<mode>.json``: the Chrome trace (Perfetto), one row per PE, named with its host.

Exit status: 0 when every request was served and matched the reference, 1 otherwise, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

import asap_comm
from asap_comm.serving import ChromeTrace, summarize_run
from asap_comm.serving.frontend import Replay
from asap_comm.serving.group import GroupSpec, group_main
from asap_comm.serving.plugins import load_model_factory, model_info_of
from asap_comm.serving.runtime import PromptRequest, RunResult
from asap_comm.serving.runtime_args import add_runtime_args, given_flags, runtime_config_from_args
from asap_comm.serving.traces import LogNormalLengths, synthetic_trace
from asap_comm.sim.emulate.job import check  # the single-host job's reference check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["async", "sync"], default="async",
                   help="async: ASAP (attention and expert ranks); sync: the DP+EP baseline")
    p.add_argument("--model", default="tiny", help="model preset of asap_models (default tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--rate", type=float, default=8.0, help="arrivals per second")
    p.add_argument("--median-len", type=int, default=24)
    p.add_argument("--slo", type=float, default=2.0, help="TTFT SLO in seconds for the summary")
    p.add_argument("--timeout", type=float, default=120.0, help="bound of the whole run, seconds")
    p.add_argument("--out", default="runs/multihost", help="directory of the outputs (on the front end's host)")
    # the runtime's flags, every command line's (--attention-ranks: by default the PEs on rank 0's host here; the
    # expert ranks are the PEs left but the spares and the front end)
    add_runtime_args(p)
    return p


def make_requests(args, vocab: int) -> list:
    trace = synthetic_trace(args.rate, num_requests=args.num_requests, arrival="gamma", cv=2.0,
                            lengths=LogNormalLengths(args.median_len, 1.0, 4, args.max_prompt_len), seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    return [PromptRequest(r.request_id, r.arrival_s, torch.randint(0, vocab, (r.prompt_len,), generator=g))
            for r in trace]


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    given = given_flags(parser, argv)
    args.attention_ranks = args.attention_ranks if "attention_ranks" in given else None
    args.expert_ranks = args.expert_ranks if "expert_ranks" in given else None
    comm = asap_comm.init(timeout=args.timeout)
    try:
        return run(comm, args)
    finally:
        comm.close()


def run(comm, args) -> int:
    W, rank = comm.world_size, comm.rank
    first_host = [pe for pe in range(W) if comm.hosts[pe] == comm.hosts[0]]
    # The split of the group: async, A attention + E expert ranks + the front end; sync, the same A + E PEs
    # as DP+EP workers (run_sync's split) + the front end.
    A = args.attention_ranks if args.attention_ranks is not None else len(first_host)
    S = args.spare_expert_ranks if args.mode == "async" else 0
    E = W - A - S - 1
    if A < 1 or E < 1 or args.expert_ranks not in (None, E):
        if rank == 0:
            print(f"prefill_multihost.py: {W} PEs cannot hold {A} attention ranks, "
                  + ("at least one" if args.expert_ranks is None else f"{args.expert_ranks}")
                  + f" expert rank(s), {S} spare(s) and the front end", file=sys.stderr)
        return 2
    factory = load_model_factory(args.model, seed=args.seed)
    info = model_info_of(factory)
    requests = make_requests(args, info.vocab_size)
    try:
        cfg = runtime_config_from_args(args, num_attention_ranks=A, num_expert_ranks=E, timeout_s=args.timeout,
                                       progress=rank == W - 1).for_mode(args.mode)
    except ValueError as e:
        if rank == 0:
            print(f"prefill_multihost.py: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if rank == W - 1:
        out.mkdir(parents=True, exist_ok=True)
        where = ", ".join(f"PE {pe}@{h}" for pe, h in enumerate(comm.hosts))
        print(f"{args.mode}: {W} PEs on {len(set(comm.hosts))} hosts ({where})", file=sys.stderr, flush=True)
    fd, report = tempfile.mkstemp(prefix="asap-multihost-", suffix=".pkl")
    os.close(fd)
    store = comm._store  # the group's TCPStore (torchrun's): every host reaches it
    comm.barrier()
    t_sync = time.monotonic()  # every PE passes this point together: the timeline's common origin
    try:
        gloo = torch.distributed.PrefixStore(f"asap-multihost-{args.mode}", store) if args.mode == "sync" else None
        role, payload = group_main(comm, GroupSpec(args.mode, cfg, info, factory, Replay(requests, report), gloo))
    finally:
        os.unlink(report)
    key = f"asap-multihost/{args.mode}/spans/"
    if role != "front":
        store.set(key + str(rank), pickle.dumps((comm.hosts[rank], role, t_sync, payload)))
        return 0
    records, outputs, lane = payload
    spans, roles = [], {}
    for pe in range(W - 1):
        try:
            store.wait([key + str(pe)], timedelta(seconds=30))
            host, prole, t0, pspans = pickle.loads(store.get(key + str(pe)))
        except Exception as e:  # a worker that died has no spans to give
            print(f"no spans from PE {pe}: {e}", file=sys.stderr)
            continue
        roles[pe] = (host, prole)
        spans += [(p, track, name, start - t0, dur) for p, track, name, start, dur in pspans]
    result = RunResult(records, outputs, spans, args.mode, lane)
    refs = {}
    model = factory.full()
    for r in requests:
        with torch.no_grad():
            o = model.prefill(r.token_ids)
        refs[r.request_id] = (int(o.logits[-1].argmax()), o.final_hidden[-1])
    checked, bad, details = check(result, refs)
    failed = [r for r in records if not r.ok]
    summary = summarize_run(records, args.slo)
    trace = ChromeTrace()
    for pe, (host, prole) in sorted(roles.items()):
        trace.name_process(pe, f"{args.mode} {prole} PE {pe} @ {host}")
    for pe, track, name, start, dur in spans:
        trace.complete(name, pe, track, start, dur)
    trace.write(out / f"timeline_{args.mode}.json")
    doc = {"mode": args.mode, "world_size": W, "hosts": comm.hosts, "attention_ranks": A, "expert_ranks": E,
           "requests": len(requests), "checked": checked, "mismatches": bad, "failed": len(failed),
           "errors": [r.error for r in failed][:5], "ttft_p50_s": summary.ttft_p50_s,
           "ttft_p90_s": summary.ttft_p90_s, "ttft_p99_s": summary.ttft_p99_s, "slo_s": args.slo,
           "slo_attainment": summary.slo_attainment}
    (out / f"summary_{args.mode}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{args.mode}: {checked}/{len(requests)} requests checked against the reference, {bad} mismatches, "
          f"{len(failed)} failed; TTFT p50 {(summary.ttft_p50_s or 0) * 1e3:.0f} ms "
          f"p90 {(summary.ttft_p90_s or 0) * 1e3:.0f} ms "
          f"(hosts: {', '.join(sorted(set(comm.hosts)))}); wrote {out}/summary_{args.mode}.json and "
          f"timeline_{args.mode}.json", file=sys.stderr, flush=True)
    for d in details[:5]:
        print("  " + d, file=sys.stderr)
    return 0 if bad == 0 and not failed and checked == len(requests) else 1


if __name__ == "__main__":
    sys.exit(main())
