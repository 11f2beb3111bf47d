"""Across hosts: asap_comm's network backend against raw UCX and gloo, on two simulated hosts.

Usage (as root: it builds network namespaces)::

    python bench/bench_net.py [--quick] [--out bench/results]
    python bench/bench_net.py --docs    # also: docs/results/bench/bench_net.json and its table in docs/benchmarks.md
    python bench/bench_net.py --render-docs [--check]   # no run (no root needed): that table from the committed json

Two "hosts" are network namespaces joined by a veth pair through a bridge, each with a private
``/dev/shm`` and its own hostname (``asap_comm.testing.netns``), so ``asap_comm.init()`` (backend "auto") puts the
network engine between them. Measured in the same run, round by round (``--rounds``, samples pooled):

* ``ucx_put_lat`` / ``ucx_am_lat``: ``ucx_perftest -t ucp_put_lat`` / ``ucp_am_lat`` (8 B, one-way latency,
  the tool's median of each run) between the hosts: raw UCX, the floor;
* ``ucx_put_bw``: ``ucx_perftest -t ucp_put_bw -s 16 MiB`` (GB/s);
* ``asap_pingpong_prepared`` / ``asap_pingpong_generic_kw``: the 8-byte put_signal + signal_wait_until
  ping-pong of ``_asap_primitives.py`` (prepared handles; generic calls with ``op=`` and ``timeout=``), one-way,
  each PE pinned to its own CPU; ``asap_pingpong_generic_kw_unpinned``: the same, not pinned;
* ``gloo_pingpong``: ``torch.distributed`` gloo send/recv of 8 bytes, one-way, between the same processes;
* ``asap_put_bw``: ``comm.put`` of 16 MiB float32 into the other host's symmetric tensor (GB/s);
* ``asap_mailbox_rt``: ``box.send``/``recv`` round trip of 64 B between the hosts;
* ``asap_moe_T128`` / ``gloo_moe_T128`` (and T=1024): ``bench_moe.py``'s dispatch + combine round trip
  (``_moe_workload.py``) with
  the attention ranks (PEs 0-1) on one host and the expert ranks (PEs 2-3) on the other (``asap_comm.moe`` as
  shipped: node-aware, once per expert host, for micro-batches with at least 1 MiB of rows for that host, so
  T=1024 here, and direct below that); the ``_direct`` rows run it again with every expert rank reached
  directly (``ASAP_MOE_NODE_AWARE=0``), each against its own gloo run;
* one host, ``backend="auto"`` against ``backend="shm"``: the generic ping-pong and the mailbox round trip
  (auto on one host builds no network engine: the rows show it costs nothing).

Targets (issue 11): ping-pong <= 1.5x raw UCX put latency and >= 3x lower than gloo; 16 MiB put >= 0.8x raw
UCX put bandwidth; MoE T=128 >= 3x gloo. Progress on stderr, the table on stdout, ``net.json`` /
``net.md`` under ``--out``. Exit status 1 if a data check failed, 2 if simulated hosts cannot be built.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

import asap_comm
import _moe_workload as moe
from _asap_primitives import mailbox_pe, pingpong_pe, put_bandwidth_pe
from _common import BatchPlan, git_commit, log, markdown_table, summarize, text_table
from _doc_tables import DocLine, add_arguments, check_flags, publish, render_main
from asap_comm.testing.netns import Hosts, run_across_hosts, unavailable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PP_PLAN = {"quick": BatchPlan(200, 10, 200), "full": BatchPlan(500, 30, 200)}
MB_PLAN = {"quick": BatchPlan(100, 10, 100), "full": BatchPlan(200, 20, 200)}
BW = {"quick": (8, 2), "full": (20, 3)}  # 16 MiB puts: timed iterations, warm-up
GLOO_ITERS = {"quick": 1000, "full": 3000}
ROUNDS = {"quick": 1, "full": 3}

# Targets (ratio: how many times better than the baseline; > 1: ASAP better)
PINGPONG_VS_UCX = (1 / 1.5, "≤ 1.5x UCX put")  # one-way ping-pong against raw UCX put latency
PINGPONG_VS_GLOO = (3.0, "≥ 3x lower than gloo")
PUT_VS_UCX = (0.8, "≥ 0.8x UCX put")  # 16 MiB put bandwidth against raw UCX put
MOE_T128_VS_GLOO = (3.0, "≥ 3x gloo")  # T=1024 is reported

# ---------------------------------------------------------------------------- the docs table
DOCS_NAME = "bench_net"
DOCS_COMMAND = "python bench/bench_net.py --docs"
DOCS_WHAT = "two network namespaces joined by veth, UCX over TCP; medians, every baseline measured in the same run"
GLOO_A2A = "gloo `all_to_all_single`"
DOC_LINES = (  # the rows of docs/benchmarks.md's table of this command, each against its baseline and target
    DocLine("put_signal + wait ping-pong, 8 B, one-way, generic calls with `op=` / `timeout=`",
            "asap_pingpong_generic_kw", "raw UCX put latency (`ucp_put_lat`)"),
    DocLine("same, processes not pinned", "asap_pingpong_generic_kw_unpinned", "raw UCX put latency"),
    DocLine("same, prepared handles", "asap_pingpong_prepared", "raw UCX put latency"),
    DocLine("same, generic calls, against gloo send/recv", "asap_pingpong_generic_kw_vs_gloo", "gloo"),
    DocLine("raw UCX active message, 8 B, one-way (what the engine sends)", "ucx_am_lat", target=False),
    DocLine("put, 16 MiB, to the other host", "asap_put_bw", "raw UCX put (`ucp_put_bw`)"),
    DocLine("mailbox round trip, 64 B, between hosts", "asap_mailbox_rt", target=False),
    DocLine("MoE dispatch + identity + combine, T=128, attention PEs on one host, expert PEs on the other",
            "asap_moe_T128_across_hosts", GLOO_A2A),
    DocLine("same, T=1024 (node-aware: once per expert host)", "asap_moe_T1024_across_hosts", GLOO_A2A),
    DocLine("same, every expert rank reached directly (`ASAP_MOE_NODE_AWARE=0`), T=128",
            "asap_moe_T128_across_hosts_direct", GLOO_A2A),
    DocLine("same, directly, T=1024", "asap_moe_T1024_across_hosts_direct", GLOO_A2A),
    DocLine("T=1024, node-aware against direct", "asap_moe_T1024_across_hosts", "direct",
            base_row="asap_moe_T1024_across_hosts_direct", target=False),
    DocLine("one host, `backend=\"auto\"`: generic ping-pong", "onehost_auto_pingpong_generic_kw",
            "`backend=\"shm\"`", target=False),
    DocLine("one host, `backend=\"auto\"`: mailbox round trip", "onehost_auto_mailbox_rt", "`backend=\"shm\"`",
            target=False),
)


# --------------------------------------------------------------------------- per PE (on the simulated hosts)
def _gloo_pingpong(comm, iters: int) -> dict:
    """8-byte gloo send/recv ping-pong between PE 0 and PE 1 (one-way ns per sample of 100 round trips)."""
    import torch.distributed as dist

    from asap_comm.rendezvous import gloo_group

    gloo_group(comm._store, comm.secret_token("bench-net-gloo"), comm.rank, 2, 60.0, loopback=comm.backend == "shm")
    try:
        buf = torch.zeros(1, dtype=torch.int64)
        samples, bad = [], 0
        for block in range(iters // 100 + 5):
            t0 = time.perf_counter_ns()
            for i in range(100):
                if comm.rank == 0:
                    buf[0] = i
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                    bad += int(buf[0]) != i
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
            if block >= 5:  # 5 warm-up blocks
                samples.append((time.perf_counter_ns() - t0) / 200)
        return {"samples_ns": samples, "bad": bad}
    finally:
        dist.destroy_process_group()


def net_pe(comm, mode: str) -> dict:
    """Every measurement between the two hosts' PEs (PE 0 on host 0, PE 1 on host 1)."""
    torch.set_num_threads(1)
    plan = PP_PLAN[mode]
    out = {"pingpong": pingpong_pe(comm, {"prepared": plan, "generic_kw": plan})}
    # the same generic calls with the processes left where the OS puts them (as a user runs them)
    out["pingpong"]["generic_kw_unpinned"] = pingpong_pe(comm, {"generic_kw": plan}, pin=False)["generic_kw"]
    iters, warmup = BW[mode]
    out["put_bw"] = put_bandwidth_pe(comm, 16 << 20, iters, warmup)[0]
    out["mailbox"] = mailbox_pe(comm, MB_PLAN[mode], 64, 4)
    out["gloo"] = _gloo_pingpong(comm, GLOO_ITERS[mode])
    out["net_stats"] = comm.net_stats()
    return out


def local_pe(comm, mode: str) -> dict:
    """One host: the generic ping-pong and the mailbox round trip (for auto against shm)."""
    return {"pingpong": pingpong_pe(comm, {"generic_kw": PP_PLAN[mode]}),
            "mailbox": mailbox_pe(comm, MB_PLAN[mode], 64, 4), "backend": comm.backend}


# --------------------------------------------------------------------------- raw UCX
def _perftest_bin() -> str:
    import libucx

    return os.path.join(os.path.dirname(libucx.__file__), "bin", "ucx_perftest")


def ucx_perftest(hosts, test: str, size: int, iters: int) -> dict:
    """Run ``ucx_perftest -t test`` with the server on host 0 and the client on host 1; the client's Final line."""
    import libucx

    lib = os.path.join(os.path.dirname(libucx.__file__), "lib")
    env = dict(os.environ, LD_LIBRARY_PATH=lib, UCX_TLS="tcp", UCX_MODULES="^ib,cuda")
    port = str(13000 + (os.getpid() % 2000))
    args = ["-t", test, "-s", str(size), "-n", str(iters), "-p", port]
    server = hosts[0].popen([_perftest_bin(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    time.sleep(1.0)
    client = hosts[1].popen([_perftest_bin(), hosts[0].addr, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text = client.communicate(timeout=120)[0]
        server.communicate(timeout=30)
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
    final = [ln for ln in text.splitlines() if ln.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest {test}: no result:\n{text[-2000:]}")
    f = final[-1].split()
    # Final: iterations, latency p50, avg, overall (usec), bandwidth avg, overall (MB/s), msg rate avg, overall
    return {"lat_p50_us": float(f[2]), "lat_avg_us": float(f[3]), "bw_MBps": float(f[5])}


# --------------------------------------------------------------------------- rows
def _row(name: str, what: str, unit: str, samples: list, bad: int, note: str = "") -> dict:
    st = summarize(samples) if samples else None
    return {"name": name, "what": what, "unit": unit, "median": st.median if st else None,
            "p10": st.p10 if st else None, "p90": st.p90 if st else None, "samples": st.n if st else 0,
            "baseline": None, "ratio": None, "target": None, "target_met": None,
            "correct": "PASS" if bad == 0 and st else ("SKIP" if bad is None else "FAIL"), "note": note}


def _compare(row: dict, base: dict, target: "tuple | None", higher_is_better: bool) -> None:
    """ratio = how many times better the row is than base (>1: better); ``target``: (least ratio, its text)."""
    if row["median"] is None or base["median"] is None:
        return
    row["baseline"] = base["name"]
    row["baseline_median"] = base["median"]
    row["ratio"] = row["median"] / base["median"] if higher_is_better else base["median"] / row["median"]
    if target is not None:
        row["target_met"] = row["ratio"] >= target[0]
        row["target"] = target[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="asap_comm across hosts against raw UCX and gloo (see bench/README.md)")
    ap.add_argument("--quick", action="store_true", help="one round, fewer iterations")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for net.json / net.md")
    add_arguments(ap)
    args = ap.parse_args(argv)
    check_flags(ap, args)
    if args.render_docs:
        return render_main(args, DOCS_NAME, DOCS_COMMAND, DOC_LINES, DOCS_WHAT)
    mode = "quick" if args.quick else "full"
    why = unavailable()
    if why is not None:
        log(f"cannot build simulated hosts: {why}")
        return 2
    t0 = time.monotonic()
    ucx = {"put_lat": [], "am_lat": [], "put_bw": []}
    per = {"prepared": [], "generic_kw": [], "generic_kw_unpinned": [], "gloo": [], "put_bw": [], "mailbox": []}
    bad = {k: 0 for k in per}
    moe_results = moe_direct = None
    stats = []
    with Hosts(2) as hosts:
        for rnd in range(1, ROUNDS[mode] + 1):
            log(f"round {rnd}/{ROUNDS[mode]}: ucx_perftest put/am latency and 16 MiB put bandwidth")
            ucx["put_lat"].append(ucx_perftest(hosts, "ucp_put_lat", 8, 20000)["lat_p50_us"])
            ucx["am_lat"].append(ucx_perftest(hosts, "ucp_am_lat", 8, 20000)["lat_p50_us"])
            ucx["put_bw"].append(ucx_perftest(hosts, "ucp_put_bw", 16 << 20, 60)["bw_MBps"] / 1000.0)
            log(f"round {rnd}/{ROUNDS[mode]}: asap_comm ping-pong, put bandwidth, mailbox; gloo ping-pong")
            res = run_across_hosts(hosts, [1, 1], net_pe, mode, timeout=600)
            r0 = res[0]
            for path in ("prepared", "generic_kw", "generic_kw_unpinned"):
                per[path] += [s / 2 / 1000 for s in r0["pingpong"][path]["samples_ns"]]
                bad[path] += r0["pingpong"][path]["bad"]
            per["gloo"] += [s / 1000 for s in r0["gloo"]["samples_ns"]]
            bad["gloo"] += r0["gloo"]["bad"]
            per["put_bw"] += [(16 << 20) / s for s in r0["put_bw"]["samples_ns"]]  # bytes/ns = GB/s
            bad["put_bw"] += r0["put_bw"]["bad"] + int(r0["put_bw"].get("digest") != res[1]["put_bw"].get("digest"))
            per["mailbox"] += [s / 1000 for s in r0["mailbox"]["samples_ns"]]
            bad["mailbox"] += r0["mailbox"]["bad"]
            stats += [r["net_stats"] for r in res]
        log("asap_comm.moe across hosts (attention PEs on host 0, expert PEs on host 1) against gloo")
        cfg = moe.QUICK if args.quick else moe.FULL
        moe_results = run_across_hosts(hosts, [2, 2], moe.moe_pe, cfg, 1, False, True, timeout=900)
        log("the same with every expert rank reached directly (ASAP_MOE_NODE_AWARE=0)")
        moe_direct = run_across_hosts(hosts, [2, 2], moe.moe_pe, cfg, 1, False, True, timeout=900,
                                      env={"ASAP_MOE_NODE_AWARE": "0"})
    log("one host: backend='auto' against backend='shm'")
    local = {}
    for backend in ("shm", "auto", "shm", "auto"):
        os.environ["ASAP_BACKEND"] = backend
        try:
            got = asap_comm.launch(local_pe, 2, mode, timeout=300)
        finally:
            os.environ.pop("ASAP_BACKEND", None)
        assert got[0]["backend"] == "shm"  # auto on one host is the shm backend
        acc = local.setdefault(backend, {"pp": [], "mb": [], "bad": 0})
        acc["pp"] += [s / 2 / 1000 for s in got[0]["pingpong"]["generic_kw"]["samples_ns"]]
        acc["mb"] += [s / 1000 for s in got[0]["mailbox"]["samples_ns"]]
        acc["bad"] += got[0]["pingpong"]["generic_kw"]["bad"] + got[0]["mailbox"]["bad"]

    rows = {
        "ucx_put_lat": _row("ucx_put_lat", "raw UCX put latency, 8 B one-way (ucx_perftest p50)", "us",
                            ucx["put_lat"], 0),
        "ucx_am_lat": _row("ucx_am_lat", "raw UCX active message latency, 8 B one-way (ucx_perftest p50)", "us",
                           ucx["am_lat"], 0),
        "gloo_pingpong": _row("gloo_pingpong", "gloo send/recv 8 B, one-way", "us", per["gloo"], bad["gloo"]),
        "asap_pingpong_prepared": _row("asap_pingpong_prepared", "put_signal + wait ping-pong, prepared handles, "
                                       "one-way", "us", per["prepared"], bad["prepared"]),
        "asap_pingpong_generic_kw": _row("asap_pingpong_generic_kw", "put_signal(op=) + signal_wait_until("
                                         "timeout=) ping-pong, one-way", "us", per["generic_kw"], bad["generic_kw"]),
        "asap_pingpong_generic_kw_unpinned": _row("asap_pingpong_generic_kw_unpinned", "the same, processes not "
                                                  "pinned (where the OS puts them)", "us", per["generic_kw_unpinned"],
                                                  bad["generic_kw_unpinned"]),
        "ucx_put_bw": dict(_row("ucx_put_bw", "raw UCX put 16 MiB (ucx_perftest)", "GB/s", ucx["put_bw"], 0),
                           bytes=16 << 20),
        "asap_put_bw": dict(_row("asap_put_bw", "comm.put 16 MiB float32 to the other host", "GB/s",
                                 per["put_bw"], bad["put_bw"]), bytes=16 << 20),
        "asap_mailbox_rt": _row("asap_mailbox_rt", "box.send/recv 64 B round trip between hosts", "us",
                                per["mailbox"], bad["mailbox"]),
    }
    for name in ("asap_pingpong_prepared", "asap_pingpong_generic_kw", "asap_pingpong_generic_kw_unpinned"):
        r = dict(rows[name])
        _compare(r, rows["ucx_put_lat"], PINGPONG_VS_UCX, False)
        rows[name] = r
        g = dict(r, name=name + "_vs_gloo", what=r["what"] + " (against gloo)", target=None, target_met=None)
        _compare(g, rows["gloo_pingpong"], PINGPONG_VS_GLOO, False)
        rows[g["name"]] = g
    _compare(rows["asap_put_bw"], rows["ucx_put_bw"], PUT_VS_UCX, True)
    per_rank_bytes = moe.mean_round_trip_bytes()
    for results, suffix, how in ((moe_results, "", "node-aware from 1 MiB per host"),
                                 (moe_direct, "_direct", "every expert rank reached directly")):
        by = {r["name"]: r for r in moe.build_rows(results, "", per_rank_bytes)}
        for t in moe.SIZES:
            a, g = by.get(f"asap_moe_T{t}"), by.get(f"gloo_moe_T{t}")
            if a is None or g is None:
                continue
            ra = _row(f"asap_moe_T{t}_across_hosts{suffix}", f"asap_comm.moe dispatch+combine, T={t}, A on host 0, "
                      f"E on host 1 ({how})", "us", [], 0)
            ra.update({k: a[k] for k in ("median", "p10", "p90", "samples", "correct")})
            rg = _row(f"gloo_moe_T{t}_across_hosts{suffix}", f"gloo all_to_all_single dispatch+combine, T={t}"
                      + (" (same processes as the direct run)" if suffix else ""), "us", [], 0)
            rg.update({k: g[k] for k in ("median", "p10", "p90", "samples", "correct")})
            _compare(ra, rg, MOE_T128_VS_GLOO if t == 128 else None, False)
            rows[ra["name"]], rows[rg["name"]] = ra, rg
    for kind, key, what in (("pp", "pingpong_generic_kw", "generic ping-pong, one-way"),
                            ("mb", "mailbox_rt", "mailbox 64 B round trip")):
        s = _row(f"onehost_shm_{key}", f"one host, backend='shm': {what}", "us", local["shm"][kind],
                 local["shm"]["bad"])
        a = _row(f"onehost_auto_{key}", f"one host, backend='auto': {what}", "us", local["auto"][kind],
                 local["auto"]["bad"])
        _compare(a, s, None, False)
        rows[s["name"]], rows[a["name"]] = s, a
    rows = list(rows.values())
    disorder = sum(s.get("disorder", 0) for s in stats)
    meta = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "mode": mode,
            "commit": git_commit(ROOT), "host": platform.node(), "cpus": os.cpu_count(),
            "rounds": ROUNDS[mode], "seconds": round(time.monotonic() - t0, 1), "net_disorder": disorder,
            "transport": "UCX tcp over a veth pair between network namespaces"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "net.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "net.md"), "w") as f:
        f.write(f"# asap_comm across hosts ({mode}, {meta['date_utc']}, commit {meta['commit']})\n\n")
        f.write(markdown_table(rows) + "\n")
    print(text_table(rows))
    log(f"done in {meta['seconds']} s; wrote {args.out}/net.json and net.md")
    if args.docs:
        publish(DOCS_NAME, DOCS_COMMAND, DOC_LINES, DOCS_WHAT, meta, rows)
    failed = [r["name"] for r in rows if r["correct"] == "FAIL"] + (["net_disorder"] if disorder else [])
    if failed:
        log(f"data checks failed: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
