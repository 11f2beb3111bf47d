"""A load-testing client of the prefill service: replays a trace over HTTP in real time.

    python -m asap_comm.serving.client --url http://127.0.0.1:8000 --trace synthetic --rate 4 \\
        --num-requests 100 --out runs/client
    python -m asap_comm.serving.client --url http://127.0.0.1:8000 --trace mooncake \\
        --rate 2 --num-requests 200 --sweep 1,2,4,8 --out runs/client-sweep

Each request is sent at its arrival time (asyncio + aiohttp; as many
concurrent requests as the trace makes), as ``POST /v1/completions`` with
token-id prompts (``--seed`` makes them reproducible: :func:`make_prompts`).
Traces: ``synthetic`` (Gamma arrivals, log-normal lengths), a Mooncake JSONL
or an Azure CSV file, with the runtime's scaling options
(``--rate`` = target request rate, ``--length-scale``, ``--max-prompt-len``).

A service started with an API key needs it here too (``--api-key``, or
``ASAP_API_KEY`` in the environment).

TTFT is measured at the client: from sending a request to receiving its
answer (for a prefill tier, the first token is the whole answer). Output
(``--out``): ``summary.json`` (the runtime's summary keys, measured here, plus
the ``vllm bench serve`` names where they overlap: ``request_throughput``,
``input_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``, ``p99_ttft_ms``,
...), ``requests.jsonl`` (one record per request, with the server's own
timings), ``ttft_cdf.png``; with ``--sweep``, ``sweep.json`` and the
SLO-compliant throughput (the highest rate whose SLO attainment is at least
0.9, with every lower rate also passing).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .metrics import (RequestRecord, percentile, served_fraction, slo_compliant_throughput, summarize_run,
                      withheld_reason)
from .slo import SLO_MULTIPLIER, auto_slo
from .traces import LogNormalLengths, TraceError, load_trace, scale_trace, synthetic_trace

__all__ = ["make_prompts", "replay", "summarize", "ServiceProcess", "main"]

SLO_PROBES = 5


class ServiceProcess:
    """``python -m asap_comm.serving.server ARGS`` in a subprocess (benchmarks, tests, scripts): :attr:`url`
    once it listens (pass ``--port 0`` for a free port). :meth:`stop` sends SIGTERM (or SIGKILL) and
    returns the exit status; :meth:`log` is its stderr so far."""

    def __init__(self, args: list, start_timeout_s: float = 240.0, cwd: "str | None" = None) -> None:
        import queue
        import subprocess
        import tempfile
        import threading

        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "asap_comm.serving.server", *args],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=cwd)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True).start()
        deadline = time.monotonic() + start_timeout_s
        self.url = None
        while self.url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop(force=True)
                raise TimeoutError(f"ServiceProcess: the server did not listen within {start_timeout_s} s; its "
                                   f"log:\n{self.log()}") from None
            if "listening on " in line:
                self.url = line.split("listening on ")[1].strip()
            elif self.proc.poll() is not None and lines.empty():
                raise RuntimeError(f"ServiceProcess: the server exited with {self.proc.returncode}:\n{self.log()}")

    def log(self) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()

    def stop(self, force: bool = False, timeout_s: float = 90.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if force else signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise TimeoutError(f"ServiceProcess: the server did not exit within {timeout_s} s of SIGTERM; its "
                               f"log:\n{self.log()}") from None


def make_trace(args) -> list:
    """The trace's requests (arrivals and lengths) at ``args.rate`` req/s."""
    if args.trace == "synthetic":
        return synthetic_trace(args.rate, num_requests=args.num_requests, arrival="gamma", cv=args.burstiness,
                               lengths=LogNormalLengths(args.median_len, 1.0, 4, args.max_prompt_len), seed=args.seed)
    return load_trace(args.trace, limit=args.num_requests, target_rate=args.rate, max_prompt_len=args.max_prompt_len,
                      length_scale=args.length_scale)


def make_prompts(trace: list, vocab_size: int, seed: int) -> list:
    """The token ids of each request (reproducible from ``seed``; the same rule as ``examples/prefill.py``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (r.prompt_len,), generator=g).tolist() for r in trace]


async def _post(session, url: str, body: dict, timeout_s: float) -> tuple:
    """``(status, json body or error text, client seconds)``."""
    import aiohttp

    t = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text()
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = {"error": {"message": text[:200]}}
            return resp.status, data, time.perf_counter() - t
    except asyncio.TimeoutError:
        return 0, {"error": {"message": f"no answer within {timeout_s} s (client timeout)"}}, time.perf_counter() - t
    except aiohttp.ClientError as e:
        return 0, {"error": {"message": f"{type(e).__name__}: {e}"}}, time.perf_counter() - t


def _auth(api_key: "str | None") -> dict:
    """The headers that carry the service's API key (``--api-key`` / ``ASAP_API_KEY`` of the server)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def replay(url: str, trace: list, prompts: list, *, model: "str | None" = None, timeout_s: float = 600.0,
                 progress: bool = True, label: str = "client", api_key: "str | None" = None) -> list:
    """Send each request at its arrival time; return one record dict per request (trace order). ``api_key``:
    sent as ``Authorization: Bearer``."""
    import aiohttp

    endpoint = url.rstrip("/") + "/v1/completions"
    out: list = [None] * len(trace)
    live = progress and sys.stderr.isatty()
    state = {"sent": 0, "done": 0, "failed": 0}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, headers=_auth(api_key)) as session:
        t0 = time.perf_counter()

        async def one(i: int, r) -> None:
            delay = r.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.perf_counter() - t0
            state["sent"] += 1
            body = {"prompt": prompts[i], "max_tokens": 1}
            if model is not None:
                body["model"] = model
            status, data, dur = await _post(session, endpoint, body, timeout_s)
            rec = {"index": i, "arrival_s": r.arrival_s, "sent_s": sent, "done_s": sent + dur, "prompt_len": r.prompt_len,
                   "status": status, "ttft_s": dur if status == 200 else None, "error": None}
            if status == 200:
                choice = data["choices"][0]
                rec.update(token=choice["token_ids"][0], server=choice.get("metrics"))
                state["done"] += 1
            else:
                rec["error"] = f"HTTP {status}: {data.get('error', {}).get('message', data)}" if status else \
                    data["error"]["message"]
                state["failed"] += 1
            out[i] = rec

        async def report() -> None:
            every = 0.5 if live else 5.0
            while True:
                await asyncio.sleep(every)
                line = (f"  [{label}] {time.perf_counter() - t0:6.1f} s  sent {state['sent']}/{len(trace)}  "
                        f"done {state['done']}  failed {state['failed']}  "
                        f"in flight {state['sent'] - state['done'] - state['failed']}")
                print("\r" + line + "  " if live else line, end="" if live else "\n", file=sys.stderr, flush=True)

        reporter = asyncio.create_task(report()) if progress else None
        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(trace)))
        finally:
            if reporter is not None:
                reporter.cancel()
        if live:
            print(file=sys.stderr)
    return out


def summarize(records: list, slo_s: float) -> dict:
    """The runtime's ``summary.json`` keys, measured at the client, plus ``vllm bench serve``'s names."""
    recs = [RequestRecord(i, r["sent_s"], r["prompt_len"], r["sent_s"], r["done_s"] if r["status"] == 200 else None,
                          None if r["status"] == 200 else r["error"]) for i, r in enumerate(records)]
    s = summarize_run(recs, slo_s).as_dict()
    ok = [r for r in records if r["status"] == 200]
    ttfts_ms = [1000 * r["ttft_s"] for r in ok]
    duration = (max(r["done_s"] for r in records) - min(r["sent_s"] for r in records)) if records else 0.0
    tokens = sum(r["prompt_len"] for r in ok)
    statuses: dict = {}
    for r in records:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    q = (lambda p: percentile(ttfts_ms, p) if ttfts_ms else None)
    s.update({
        "slo_ttft_s": slo_s,
        "completed": len(ok), "failed": len(records) - len(ok), "status_counts": statuses,
        "duration": duration, "total_input_tokens": tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": sum(1 for r in ok if r["ttft_s"] <= slo_s) / duration if duration > 0 else 0.0,
        "input_throughput": tokens / duration if duration > 0 else 0.0,
        "mean_ttft_ms": statistics.fmean(ttfts_ms) if ttfts_ms else None,
        "median_ttft_ms": statistics.median(ttfts_ms) if ttfts_ms else None,
        "std_ttft_ms": statistics.pstdev(ttfts_ms) if ttfts_ms else None,
        "p90_ttft_ms": q(90), "p99_ttft_ms": q(99),
        "max_send_lag_ms": 1000 * max((r["sent_s"] - r["arrival_s"] for r in records), default=0.0),
    })
    return s


def table(s: dict, title: str = "Serving Benchmark Result") -> str:
    """The end-of-run table, laid out like ``vllm bench serve``'s."""
    f = (lambda v, fmt: "-" if v is None else format(v, fmt))
    lines = [f"{' ' + title + ' ':=^50}",
             f"{'Successful requests:':<40}{s['completed']:<10}",
             f"{'Failed requests:':<40}{s['failed']:<10}",
             f"{'Benchmark duration (s):':<40}{s['duration']:<10.2f}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:<10.2f}",
             f"{'Request goodput (req/s):':<40}{s['request_goodput']:<10.2f}",
             f"{'Input token throughput (tok/s):':<40}{s['input_throughput']:<10.2f}",
             f"{' Time to First Token ':-^50}",
             f"{'Mean TTFT (ms):':<40}{f(s['mean_ttft_ms'], '.2f'):<10}",
             f"{'Median TTFT (ms):':<40}{f(s['median_ttft_ms'], '.2f'):<10}",
             f"{'P90 TTFT (ms):':<40}{f(s['p90_ttft_ms'], '.2f'):<10}",
             f"{'P99 TTFT (ms):':<40}{f(s['p99_ttft_ms'], '.2f'):<10}",
             f"{'SLO (TTFT <= ' + format(s['slo_ttft_s'], '.3g') + ' s) attainment:':<40}{s['slo_attainment']:<10.2f}",
             "=" * 50]
    return "\n".join(lines)


def plot_cdf(path: Path, runs: dict, slo_s: float, title=()) -> None:
    """TTFT CDF per run label (``runs``: label -> client records); ``title``: lines saying what was run (the
    service, model, trace, load), fitted to the figure (``serving.plotting``)."""
    from .plotting import fit_title, plain_ticks, pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.4), layout="constrained")
    for label, records in runs.items():
        ttfts = sorted(r["ttft_s"] for r in records if r["status"] == 200)
        if ttfts:
            ax.step(ttfts, [(i + 1) / len(records) for i in range(len(ttfts))], where="post", label=label)
    ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s:.3g} s")
    ax.set_xlabel("TTFT at the client (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    plain_ticks(ax, "x")  # at least three plain labels, however narrow the TTFT range
    fit_title(fig, ["TTFT CDF over HTTP (failed requests never reach 1.0)", *title])
    save(fig, path)


async def _server_info(url: str, api_key: "str | None" = None) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(headers=_auth(api_key)) as session:
        async with session.get(url.rstrip("/") + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status == 401:
                raise ConnectionError("GET /v1/models answered 401: the service needs its API key (--api-key or "
                                      "ASAP_API_KEY)")
            if resp.status != 200:
                raise ConnectionError(f"GET /v1/models answered {resp.status}")
            return (await resp.json())["data"][0]


async def _unloaded_ttft(url: str, p90: int, vocab: int, model: str, api_key: "str | None" = None) -> float:
    """The median TTFT of ``p90``-token prompts sent one at a time (the first warms the connection and is not
    counted): what ``--slo auto`` multiplies (``serving.slo.auto_slo``)."""
    g = torch.Generator().manual_seed(12345)
    ttfts = []
    import aiohttp
    async with aiohttp.ClientSession(headers=_auth(api_key)) as session:
        for _ in range(SLO_PROBES):
            ids = torch.randint(0, vocab, (p90,), generator=g).tolist()
            status, data, dur = await _post(session, url.rstrip("/") + "/v1/completions",
                                            {"prompt": ids, "max_tokens": 1, "model": model}, 120.0)
            if status != 200:
                raise ConnectionError(f"--slo auto: a probe request failed: HTTP {status}: {data}")
            ttfts.append(dur)
    return statistics.median(ttfts[1:])  # the first warms the connection


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m asap_comm.serving.client", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--trace", default="synthetic",
                    help="synthetic, mooncake or azure (the public traces that ship with the package; "
                         "$ASAP_TRACES_DIR overrides their folder), or a Mooncake .jsonl / Azure .csv file")
    ap.add_argument("--rate", type=float, default=4.0, help="request rate (req/s) the trace is scaled to")
    ap.add_argument("--num-requests", type=int, default=100, help="requests (at most, for a file)")
    ap.add_argument("--burstiness", type=float, default=2.0, help="synthetic: CV of the Gamma inter-arrival times")
    ap.add_argument("--median-len", type=int, default=48, help="synthetic: median prompt length")
    ap.add_argument("--max-prompt-len", type=int, default=512, help="clip prompts to this many tokens")
    ap.add_argument("--length-scale", type=float, default=1.0, help="trace file: multiply prompt lengths")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace and the prompts' token ids")
    ap.add_argument("--slo", default="auto", help=f"TTFT SLO in seconds, or auto: {SLO_MULTIPLIER:g}x the unloaded "
                                                  "TTFT of a p90-length prompt, measured first")
    ap.add_argument("--sweep", default="", help="comma-separated request rates: replay the trace at each and "
                                                "report the SLO-compliant throughput")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="client-side bound on one request")
    ap.add_argument("--out", default="runs/client")
    ap.add_argument("--no-plot", action="store_true", help="skip the TTFT CDF plot (needs matplotlib)")
    ap.add_argument("--api-key", default=None, help="the service's API key (sent as Authorization: Bearer); unset: "
                                                    "the environment variable ASAP_API_KEY, if any")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import importlib.util
    if importlib.util.find_spec("aiohttp") is None:
        print("client: aiohttp is missing: pip install -e \".[serve]\"", file=sys.stderr)
        return 2
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        print("client: matplotlib is missing (the TTFT CDF plot): pip install matplotlib, or pass --no-plot",
              file=sys.stderr)
        return 2
    try:
        if not (args.rate > 0 and math.isfinite(args.rate)):
            raise ValueError(f"--rate {args.rate} must be a positive number")
        rates = [float(x) for x in args.sweep.split(",") if x.strip()] if args.sweep else []
        if any(not (r > 0) for r in rates):
            raise ValueError(f"--sweep {args.sweep!r}: rates must be positive")
        try:
            trace = make_trace(args)
        except (TraceError, OSError) as e:
            raise ValueError(f"--trace {args.trace}: {e}") from None
        slo_given = None if args.slo == "auto" else float(args.slo)
        if slo_given is not None and not slo_given > 0:
            raise ValueError(f"--slo {args.slo} must be positive or auto")
    except (ValueError, TraceError, OSError) as e:
        print(f"client: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get("ASAP_API_KEY")
    try:
        info = asyncio.run(_server_info(args.url, api_key))
    except Exception as e:  # connection refused, bad URL, not our server
        print(f"client: cannot reach the service at {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    vocab, model = info.get("vocab_size"), info["id"]
    if vocab is None:
        print(f"client: {args.url}/v1/models gives no vocab_size: is this an asap_comm service?", file=sys.stderr)
        return 1
    prompts = make_prompts(trace, vocab, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if slo_given is None:
        rule = auto_slo([r.prompt_len for r in trace],
                        lambda n: asyncio.run(_unloaded_ttft(args.url, n, vocab, model, api_key)))
        slo, unloaded = rule.ttft_s, rule.unloaded_ttft_s
        print(f"client: SLO {slo:.3f} s = {rule.multiplier:g} x the unloaded TTFT {unloaded:.3f} s of a "
              f"{rule.p90_prompt_tokens}-token (p90) prompt", file=sys.stderr)
    else:
        slo, unloaded = slo_given, None
    print(f"client: {len(trace)} requests, {sum(r.prompt_len for r in trace)} prompt tokens, to {args.url} "
          f"(model {model})", file=sys.stderr)
    runs: dict = {}
    summaries: dict = {}
    for rate in (rates or [None]):
        load = trace if rate is None else scale_trace(trace, target_rate=rate)
        label = f"{args.rate if rate is None else rate:g} req/s"
        records = asyncio.run(replay(args.url, load, prompts, model=model, timeout_s=args.timeout_s, label=label,
                                     api_key=api_key))
        s = summarize(records, slo)
        s["rate_req_s"] = args.rate if rate is None else rate
        runs[label], summaries[label] = records, s
        print(table(s, f"Serving Benchmark Result ({label})"))
    last = list(summaries.values())[-1]
    result = dict(last, url=args.url, model=model, trace=args.trace, unloaded_ttft_s=unloaded)
    with open(out / "requests.jsonl", "w") as f:
        for label, records in runs.items():
            for r in records:
                f.write(json.dumps(dict(r, run=label)) + "\n")
    if rates:
        # a rate counts only where the SLO holds AND it is sustained (served >= 0.9 of offered tokens/s over the
        # window from the first send to the last first token less one SLO: serving.metrics.served_fraction)
        points = [(s["rate_req_s"], s["slo_attainment"], served_fraction(s)) for s in summaries.values()]
        sct, why = slo_compliant_throughput(points), withheld_reason(points)
        sweep = {"slo_ttft_s": slo, "points": [{"rate_req_s": r, "slo_attainment": a, "served_fraction": f}
                                               for r, a, f in points],
                 "slo_compliant_throughput_req_s": sct, "withheld": why, "runs": summaries}
        (out / "sweep.json").write_text(json.dumps(sweep, indent=2))
        result["sweep"] = {"points": sweep["points"], "slo_compliant_throughput_req_s": sct, "withheld": why}
        print(f"SLO-compliant throughput: {f'- ({why})' if sct is None else f'{sct:g} req/s'} "
              f"(SLO {slo:.3g} s, attainment >= 0.9 and served >= 0.9 of offered)")
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    if not args.no_plot:
        plot_cdf(out / "ttft_cdf.png", runs, slo, title=[
            f"measured: the service at {args.url} (its deployment as started), model {model}; trace {args.trace}, "
            f"{len(trace)} requests per run; load: each run's request rate (req/s, the legend); SLO {slo:.3g} s"])
    print(f"client: wrote {out}/summary.json, requests.jsonl" + (", sweep.json" if rates else "")
          + ("" if args.no_plot else ", ttft_cdf.png"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
