"""Fault injection: each fault of issue 20 against the real system, one row each.

Usage (as root: most rows build namespaces; ``sudo bash bench/setup.sh`` once installs nftables)::

    python bench/faults.py [--quick] [--only NAME[,NAME]] [--out bench/results/faults]

The service rows share one ``python -m asap_comm.serving.server --model tiny`` (async, 2 attention + 2 expert
ranks, admission bound 4096 tokens, deadline = the stall + 30 s, ``--worker-stall-s 5``), started once; the
row that kills a worker runs last and ends it. The harness is the tests' own, ``asap_comm.testing``: the
rows across hosts build two simulated hosts (``asap_comm.testing.netns``: network namespaces joined by veth,
private ``/dev/shm``, own hostname); the recipes (an outsider's store keys, the rogue UCX peer, CPU hogs, a
small ``/dev/shm``, ...) are ``asap_comm.testing.faults``; the service started and stopped, on one host or under
torchrun across hosts, and the calls, floods and hostile bodies sent to it are ``asap_comm.testing.service``.

Rows (``--only`` names):

=================  =====================================================================================
``rogue-store``    an outsider plants the old-layout keys and bumps ``asap/join`` before a group forms;
                   then a value with a wrong MAC under a real key (``ctrl/1``)
``rogue-peer``     a UCX peer outside the group, claiming PE 1, sends a put, a signal, a forged handshake
``stop-front-end`` the front end SIGSTOPped for 60 s (``--quick``: 35 s) under 200 clients
``stop-worker``    an expert worker SIGSTOPped for 60 s (35 s) under 200 clients
``kill-worker``    an expert worker SIGKILLed under load (``kill-worker-spare``: the same with one spare
                   expert rank, in its own service: the spare takes over; dip and recovery measured)
``kill-attention`` attention worker PE 0 SIGKILLed under load, in its own service with
                   ``--attention-failover``: its requests re-admitted on PE 1; dip and recovery measured
``cpu-hogs``       a busy loop at nice 0 on every core for 30 s (15 s) while serving
``link-down``      the service under torchrun on two hosts; node 1's link goes down under load
``host-lost-spare`` the service under torchrun on three hosts (front end + attention, experts, two spare
                   expert ranks); the experts' host loses its link under load (the spares take over)
``loss-5``,        5% / 20% of the packets one host sends dropped (nftables, in its namespace) while two
``loss-20``        PEs across the hosts stream mailbox messages and put_signal rows both ways
``small-shm``      the service started with a 700 kB ``/dev/shm`` (a tmpfs in a private mount namespace)
``hostile-bodies`` 100k-deep JSON, a 5,000-digit integer, token id 2**63, ``charset=bogus-xx``, and
                   ``/health`` latency while four clients send 50 MB bodies (against unloaded, same run)
``hog-client``     one client sends calls at the admission bound back to back beside three small clients
``no-secret``      the service under torchrun on two hosts without ``ASAP_GROUP_SECRET``
``slowloris``      1,134 connections trickling header bytes into a service with a file limit of 1,024
``stalled-uploads`` 8 uploads of 1 byte short of the body bound, stalled, beside small calls
``flood-client``   client A (127.0.0.2) keeps 64 calls in flight; client B (127.0.0.1) calls one at a time
=================  =====================================================================================

Columns: ``fault``; ``expected``; ``observed``; ``answered`` (the admitted requests and how they were
answered, e.g. "118/120 200, 2 504"; messages for the loss rows); ``wrong`` (answers that carried a wrong
token, or messages, rows or memory with wrong data: must be 0); ``pass`` (observed matches expected and wrong
is 0; "skipped: why" when this machine lacks what the row needs, which is not a pass). "Nothing lost": every
admitted request got the right token or an error status, and none went unanswered (every client call has a
timeout, every subprocess and wait a bound).

Progress on stderr; the table on stdout and as ``faults.md`` / ``faults.json`` under ``--out``. Exit status 0
when every row passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import aiohttp
import httpx
import torch
from _common import git_commit  # bench/_common.py, beside this script

import asap_comm
from asap_comm.rendezvous import loopback_store, new_secret
from asap_comm.serving.server.request import default_max_body_bytes
from asap_comm.testing import service as harness
from asap_comm.testing.faults import (cpu_hogs, cpu_seconds, in_small_shm, plant_forged_value, plant_old_layout,
                                      rogue_peer, run_pair, stream_in_order, victim)
from asap_comm.testing.netns import Hosts, run_across_hosts, torchrun, why_no_hosts
from asap_comm.testing.service import (Flood, alive, calls, descendants, end_service, host_health, host_leftovers,
                                       http_in_host, long_clients, segment_prefixes, serve_across_hosts,
                                       wait_host_health)
from asap_models import preset, random_init

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CFG = preset("tiny")
BOUND = 4096  # the shared service's admission bound (--max-queued-tokens): the hog client's call size
STALL_S = {"quick": 35.0, "full": 60.0}  # SIGSTOP of the front end / a worker
HOGS_S = {"quick": 15.0, "full": 30.0}  # CPU hogs
CLIENTS = {"quick": 100, "full": 200}  # concurrent clients under a stall
LOSS_MSGS = {"quick": {5: 300, 20: 100}, "full": {5: 1000, 20: 300}}  # mailbox messages each way per loss rate
WORKER_STALL_S = 5.0  # --worker-stall-s of the shared service
FAILURE_EXIT_S = 5.0  # --failure-exit-s
HOST_PORT = 18080  # the service's port inside a simulated host (each has its own port space)
DOOR_NOFILE = 1024  # the front-door rows' service: its file limit (RLIMIT_NOFILE)
HOSTILE_MB = 50  # each body of the hostile-bodies row's four senders
LOG_ERRORS = ("Traceback", "Error handling request", "Unhandled exception", "Exception in callback")

T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[faults {time.monotonic() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- rows
@dataclass
class Row:
    """One fault's outcome. ``passed`` is None while unjudged; ``skipped`` names what this machine lacks."""

    name: str
    fault: str
    expected: str
    observed: str = ""
    answered: str = "-"
    wrong: int = 0
    passed: "bool | None" = None
    skipped: "str | None" = None
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def verdict(self) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        return "PASS" if self.passed and self.wrong == 0 else "FAIL"


# ----------------------------------------------------------------------------- the reference and the load
class Reference:
    """The first token the service must answer: the tiny model's forward in this process (seed 0, as the
    service's ``--model tiny``)."""

    def __init__(self) -> None:
        self.model = random_init(CFG, seed=0)
        self._cache: dict = {}

    def token(self, ids: list) -> int:
        key = tuple(ids)
        if key not in self._cache:
            self._cache[key] = int(self.model.prefill(torch.tensor(ids, dtype=torch.int64)).logits[-1].argmax())
        return self._cache[key]

    def pool(self, num: int, lengths: tuple, seed: int, batch: int = 1) -> list:
        """``num`` calls of ``batch`` prompts (lengths drawn from ``lengths``), with the tokens each must get:
        ``[(prompt or list of prompts, [token, ...])]``."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(num):
            prompts = []
            for _ in range(batch):
                n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
                prompts.append(torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist())
            out.append((prompts[0] if batch == 1 else prompts, [self.token(p) for p in prompts]))
        return out


@dataclass
class Tally:
    """How the calls of a load were answered: ``statuses`` counts HTTP statuses as strings, plus ``"timeout"`` (no
    answer within the client's timeout: a hung call) and ``"closed"`` (the connection failed mid-call);
    ``wrong``: 200s with a wrong token; ``examples``: the first error message of each status."""

    statuses: Counter = field(default_factory=Counter)
    wrong: int = 0
    examples: dict = field(default_factory=dict)
    max_latency_s: float = 0.0
    sent: int = 0

    NOT_ADMITTED = ("429", "413", "refused")

    def add(self, status: str, message: "str | None", latency_s: float) -> None:
        self.statuses[status] += 1
        if message is not None and status not in self.examples:
            self.examples[status] = message[:300]
        if status == "200":
            self.max_latency_s = max(self.max_latency_s, latency_s)

    def merge(self, other: "Tally") -> "Tally":
        out = Tally(self.statuses + other.statuses, self.wrong + other.wrong, {**other.examples, **self.examples},
                    max(self.max_latency_s, other.max_latency_s), self.sent + other.sent)
        return out

    @property
    def admitted(self) -> int:
        return sum(n for s, n in self.statuses.items() if s not in self.NOT_ADMITTED)

    @property
    def right(self) -> int:
        return self.statuses["200"] - self.wrong

    @property
    def lost(self) -> int:
        """Admitted calls that got no answer at all."""
        return self.statuses["timeout"] + self.statuses["closed"]

    def only(self, *statuses: str) -> bool:
        """Every admitted call answered with one of ``statuses`` (and the 200s right)."""
        return all(s in statuses or s in self.NOT_ADMITTED for s in self.statuses)

    def answered(self) -> str:
        parts = [f"{self.right}/{self.admitted} 200"]
        if self.wrong:
            parts.append(f"{self.wrong} wrong token")
        parts += [f"{n} {s}" for s, n in sorted(self.statuses.items()) if s not in ("200", *self.NOT_ADMITTED)]
        refused = [f"{n} {s}" for s, n in sorted(self.statuses.items()) if s in self.NOT_ADMITTED]
        return ", ".join(parts) + (f" (not admitted: {', '.join(refused)})" if refused else "")


class Load:
    """``clients`` concurrent HTTP clients against ``url``, each posting calls from ``pool`` (see
    :meth:`Reference.pool`) one after another with ``pause_s`` between them, checking every answer, until
    :meth:`stop` (or ``calls_per_client`` calls each). Every call has a client timeout of ``timeout_s``. Runs on
    a thread of its own (its own asyncio loop)."""

    def __init__(self, url: str, pool: list, clients: int, pause_s: float, timeout_s: float,
                 calls_per_client: "int | None" = None) -> None:
        self.url, self.pool, self.clients, self.pause_s = url.rstrip("/"), pool, clients, pause_s
        self.timeout_s, self.calls_per_client = timeout_s, calls_per_client
        self.tally = Tally()
        self.in_flight = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def done(self) -> int:
        return sum(self.tally.statuses.values())

    def wait(self, timeout_s: float) -> bool:
        """Wait for every client to finish its calls (``calls_per_client``); whether they did."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def stop(self) -> Tally:
        """Stop sending; wait for the calls in flight (each bounded by the client timeout)."""
        self._stop.set()
        self._thread.join(self.timeout_s + 30)
        if self._thread.is_alive():  # cannot happen: every call is bounded; say so if it does
            self.tally.add("timeout", "the load's thread did not end", 0.0)
        return self.tally

    async def _main(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session, i: int) -> None:
        k = 0
        while not self._stop.is_set() and (self.calls_per_client is None or k < self.calls_per_client):
            prompt, want = self.pool[(i + k * self.clients) % len(self.pool)]
            k += 1
            self.tally.sent += 1
            self.in_flight += 1
            t = time.monotonic()
            try:
                async with session.post(self.url + "/v1/completions", json={"prompt": prompt}) as resp:
                    text = await resp.text()
                    status, message = str(resp.status), None
                    if resp.status == 200:
                        try:
                            got = [c["token_ids"][0] for c in json.loads(text)["choices"]]
                        except (ValueError, KeyError, IndexError, TypeError):
                            got = f"an answer without tokens: {text[:100]!r}"
                        if got != want:  # a 200 that does not carry the right tokens
                            self.tally.wrong += 1
                            message = f"wrong tokens {got}, expected {want}"
                    else:
                        message = error_message(text)
            except asyncio.TimeoutError:
                status, message = "timeout", f"no answer within {self.timeout_s:g} s"
            except aiohttp.ClientConnectorError as e:
                status, message = "refused", str(e)
            except aiohttp.ClientError as e:
                status, message = "closed", f"{type(e).__name__}: {e}"
            self.in_flight -= 1
            self.tally.add(status, message, time.monotonic() - t)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)


def error_message(text: str) -> str:
    """The ``error.message`` of an error answer's JSON body, or the body itself."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text


# ----------------------------------------------------------------------------- processes
def record(tally: "Tally", r, tokens: list, latency_s: float) -> bool:
    """Add one answer (an httpx response to a one-prompt call that must get ``tokens[0]``) to ``tally``; whether
    it was a right 200."""
    if r.status_code != 200:
        tally.add(str(r.status_code), error_message(r.text), latency_s)
        return False
    tally.add("200", None, latency_s)
    if r.json()["choices"][0]["token_ids"] != tokens[:1]:
        tally.wrong += 1
        return False
    return True


class Service(harness.Service):
    """A one-host service of the rows (``--model tiny``, admission bound ``BOUND``, ``--worker-stall-s``,
    ``--failure-exit-s`` as above, ``request_timeout_s``; ``extra`` args) with what the rows ask of it: the
    harness's ``Service`` (/health, /metrics, its client with a 30 s timeout)."""

    def __init__(self, request_timeout_s: float, extra: "list | None" = None, nofile: "int | None" = None) -> None:
        self.request_timeout_s = request_timeout_s
        args = ["--model", "tiny", "--max-queued-tokens", str(BOUND), "--request-timeout-s",
                str(request_timeout_s), "--worker-stall-s", str(WORKER_STALL_S), "--failure-exit-s",
                str(FAILURE_EXIT_S)] + list(extra or [])
        t = time.monotonic()
        super().__init__(args, start_timeout_s=300, cwd=ROOT, http_timeout_s=30, nofile=nofile)
        log(f"service up at {self.url} after {time.monotonic() - t:.0f} s ({' '.join(args)})")

    def pick(self, role: str) -> dict:
        """A worker row of /health whose role contains ``role``."""
        _, body = self.health()
        return next(w for w in body["workers"] if role in w["role"])

    def check(self, ref: Reference, n: int = 40, seed: int = 99) -> tuple:
        """One call after a fault: ``(right?, what happened)``."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()
        try:
            r = self.client.post("/v1/completions", json={"prompt": ids}, timeout=self.request_timeout_s + 30)
        except httpx.HTTPError as e:
            return False, f"{type(e).__name__}: {e}"
        if r.status_code != 200:
            return False, f"{r.status_code}: {r.text[:200]}"
        got = r.json()["choices"][0]["token_ids"][0]
        return got == ref.token(ids), f"200, token {got} (reference {ref.token(ids)})"


class Stopped:
    """SIGSTOP ``pid`` for the block; SIGCONT whatever happens."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __enter__(self) -> "Stopped":
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def sleep_with_progress(seconds: float, what: str, load: "Load | None" = None) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(10.0, left))
        extra = f"; {load.done()} answered, {load.in_flight} in flight" if load is not None else ""
        log(f"  {what}: {seconds - max(0.0, end - time.monotonic()):.0f}/{seconds:.0f} s{extra}")


def log_errors(text: str) -> list:
    return [w for w in LOG_ERRORS if w in text]


def short(text: str, width: int = 110) -> str:
    """``text``'s first line, cut at a word boundary near ``width`` characters (a table cell)."""
    line = (text.splitlines() or [""])[0]
    return line if len(line) <= width else line[:width].rsplit(" ", 1)[0] + " ..."


def excerpt(line: str, word: str, width: int = 110) -> str:
    """The start of ``line`` and the part around ``word`` (a long error message in a table cell)."""
    at = line.find(word)
    if len(line) <= 2 * width or at < 0:
        return line[:2 * width]
    return f"{line[:width]} ... {line[max(width, at - 10):at + width]}"


def tail(text: str, n: int = 3000) -> str:
    return text[-n:]


# ----------------------------------------------------------------------------- what this machine lacks
def nft_path() -> "str | None":
    """``nft`` on the PATH, or in /usr/sbin (which a user's PATH may lack)."""
    return shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")


def why_no_nft() -> "str | None":
    why = why_no_hosts()
    if why is None and nft_path() is None:
        return "`nft` is not installed (nftables: sudo bash bench/setup.sh)"
    return why


def why_no_private_shm() -> "str | None":
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "`unshare` is not installed (util-linux)"
    if os.geteuid() != 0:
        return "a private tmpfs on /dev/shm needs root"
    return None


# ----------------------------------------------------------------------------- the suite
class Suite:
    """Runs the rows; holds what they share (the reference, the one-host service, two simulated hosts)."""

    def __init__(self, quick: bool) -> None:
        self.mode = "quick" if quick else "full"
        self.stall_s = STALL_S[self.mode]
        self.ref = Reference()
        self.small = self.ref.pool(64, (4, 24), seed=1)
        self._service: "Service | None" = None
        self._door: "Service | None" = None  # the front-door rows' own service (a lowered file limit)
        self._hosts: "Hosts | None" = None

    # shared resources --------------------------------------------------------
    def service(self) -> Service:
        if self._service is None or not self._service.running():
            if self._service is not None:
                log("the shared service has ended; starting a fresh one")
                self._service.close()
            log("starting the shared service ...")
            self._service = Service(self.stall_s + 30)
        return self._service

    def hosts(self) -> Hosts:
        if self._hosts is None:
            log("building two simulated hosts ...")
            self._hosts = Hosts(2).__enter__()
        return self._hosts

    def close(self) -> None:
        if self._service is not None:
            self._service.close()
        if self._door is not None:
            self._door.close()
        if self._hosts is not None:
            self._hosts.close()

    def load(self, clients: int, pause_s: float = 0.05, pool: "list | None" = None,
             calls_per_client: "int | None" = None) -> Load:
        svc = self.service()
        return Load(svc.url, pool or self.small, clients, pause_s, svc.request_timeout_s + 30, calls_per_client)

    # 1. rogue store writer ------------------------------------------------------
    def rogue_store(self, row: Row) -> None:
        store = loopback_store(30.0)
        plant_old_layout(store.port)
        secret, prefix = new_secret(), "asap-fa" + os.urandom(3).hex() + "-"
        log("  planted the old-layout keys and bumped asap/join; two PEs join the store ...")
        got = run_pair(store.port, (secret, secret), prefix)
        formed = got[0][:3] == ("ok", 0, [2.0] * 4) and got[1][:3] == ("ok", 1, [1.0] * 4)
        wrong = sum(1 for r in (0, 1) if got[r][0] == "ok" and got[r][2] != [float(2 - r)] * 4)

        log("  a value with a wrong MAC under the real key ctrl/1 ...")
        store2 = loopback_store(30.0)
        secret2, prefix2 = new_secret(), "asap-fb" + os.urandom(3).hex() + "-"
        key, planted, seg = plant_forged_value(store2, secret2, prefix2, "ctrl/1")
        try:
            try:
                comm = asap_comm.init(0, 2, store=store2, timeout=5.0, shm_prefix=prefix2, group_secret=secret2)
                comm.close()
                refused = "init succeeded (the forged value was accepted)"
            except asap_comm.CommError as e:
                refused = f"{type(e).__name__}: {e}"
            with open("/proc/self/maps") as f:
                mapped = f.read().count(planted.lstrip("/")) - 1  # this process's own mapping of it is one
        finally:
            del seg
            asap_comm._native._C.unlink_segment(planted)
        left = glob.glob(f"/dev/shm/{prefix}*") + glob.glob(f"/dev/shm/{prefix2}*")
        named = key in refused and "failed authentication" in refused
        row.observed = (f"group formed: {'yes' if formed else 'NO'} (PE 0 holds {got[0][2]}, PE 1 {got[1][2]}); "
                        f"forged {key}: {short(refused, 120)}; planted segment mapped by init "
                        f"{mapped} times; {len(left)} segments left")
        row.answered = f"{sum(1 for r in (0, 1) if got[r][0] == 'ok')}/2 PEs joined"
        row.wrong = wrong
        row.passed = formed and named and mapped == 0 and not left
        row.details = {"pair": {str(k): list(v) for k, v in got.items()}, "forged": refused, "left": left}

    # 2. rogue network peer ------------------------------------------------------
    def rogue_peer(self, row: Row) -> None:
        hs = self.hosts()
        out = tempfile.mkdtemp(prefix="asap-faults-")
        try:
            log("  two PEs across the hosts; the rogue peer runs on host 1 ...")
            results = run_across_hosts(hs, [1, 1], victim, out, timeout=150, during=rogue_peer(out))
            with open(os.path.join(out, "rogue-done")) as f:
                rogue_out = f.read().strip()
        finally:
            shutil.rmtree(out, ignore_errors=True)
        s0, s1 = results[0]["stats"], results[1]["stats"]
        untouched = results[0]["untouched"] and results[1]["untouched"]
        row.observed = (f"heaps untouched: {'yes' if untouched else 'NO'}; PE 0 counted {s0['unauthenticated']} "
                        f"unauthenticated messages (PE 1: {s1['unauthenticated']}); disorder {s0['disorder']}, "
                        f"bad messages {s0['bad_messages']}; the group went on to its last barrier")
        row.wrong = sum(1 for r in results if not r["untouched"])
        row.passed = (untouched and s0["unauthenticated"] >= 3 and s1["unauthenticated"] == 0
                      and s0["disorder"] == 0 and s0["bad_messages"] == 0)
        row.details = {"stats": [s0, s1], "rogue": rogue_out}

    # 3. front end stopped ---------------------------------------------------------
    def stop_front_end(self, row: Row) -> None:
        svc = self.service()
        front = svc.health()[1]["front_end_pid"]
        clients = CLIENTS[self.mode]
        with self.load(clients) as load:
            self._warm(load, clients)
            log(f"  SIGSTOP front end (pid {front}) for {self.stall_s:.0f} s, {load.in_flight} calls in flight ...")
            in_flight = load.in_flight
            with Stopped(front):
                sleep_with_progress(self.stall_s, "front end stopped")
            log("  SIGCONT; the load goes on 5 s ...")
            time.sleep(5)
            tally = load.stop()
        self._after_stall(row, svc, tally, f"front end stopped {self.stall_s:.0f} s with {in_flight} calls in "
                                           f"flight ({clients} clients)")

    def _warm(self, load: Load, clients: int) -> None:
        deadline = time.monotonic() + 30
        while load.done() < clients and time.monotonic() < deadline:
            time.sleep(0.2)
        log(f"  load running: {load.done()} answered, {load.in_flight} in flight")

    def _after_stall(self, row: Row, svc: Service, tally: Tally, what: str, extra: str = "",
                     extra_ok: bool = True) -> None:
        alive_now = svc.running()
        ok, after = svc.check(self.ref) if alive_now else (False, "the service had exited")
        row.observed = (f"{what}; {extra}service {'lives' if alive_now else 'ENDED'}; a call after: {after}; "
                        f"slowest 200: {tally.max_latency_s:.1f} s")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = alive_now and ok and tally.only("200", "504") and tally.lost == 0 and extra_ok
        row.details = {"statuses": dict(tally.statuses), "examples": tally.examples}
        new = svc.log()
        if not row.passed:
            row.details["log"] = tail(new)

    # 4. a worker stopped ----------------------------------------------------------
    def stop_worker(self, row: Row) -> None:
        svc = self.service()
        w = svc.pick("expert")
        clients = CLIENTS[self.mode]
        named = f"PE {w['pe']} (pid {w['pid']}) sent no heartbeat"
        seen: Counter = Counter()
        first_503 = None
        with self.load(clients) as load:
            self._warm(load, clients)
            log(f"  SIGSTOP expert worker PE {w['pe']} (pid {w['pid']}) for {self.stall_s:.0f} s ...")
            t0 = time.monotonic()
            with Stopped(w["pid"]):
                while (elapsed := time.monotonic() - t0) < self.stall_s:
                    status, body = svc.health()
                    says = status == 503 and named in body.get("error", "")
                    seen["503 naming it" if says else str(status)] += 1
                    if says and first_503 is None:
                        first_503 = (elapsed, body["error"])
                        log(f"  /health after {elapsed:.1f} s: 503 {body['error'][:150]}")
                    time.sleep(min(1.0, max(0.0, self.stall_s - elapsed)))
            log("  SIGCONT; waiting for /health 200 ...")
            status, body = svc.wait_health(lambda s, b: s == 200, 60)
            back = time.monotonic() - t0 - self.stall_s
            time.sleep(3)
            tally = load.stop()
        health_ok = first_503 is not None and status == 200
        extra = (f"/health while stopped: {', '.join(f'{n} {s}' for s, n in sorted(seen.items()))}"
                 f"{f' (first 503 after {first_503[0]:.1f} s)' if first_503 else ''}; after SIGCONT: {status}"
                 f"{f' in {back:.1f} s' if status == 200 else ''}; ")
        self._after_stall(row, svc, tally, f"expert PE {w['pe']} stopped {self.stall_s:.0f} s ({clients} "
                                           f"clients)", extra, health_ok)
        row.details["health"] = {"while_stopped": dict(seen), "first_503": first_503, "after": [status, body]}

    # 5. a worker killed -----------------------------------------------------------
    def kill_worker(self, row: Row) -> None:
        svc = self.service()
        w = svc.pick("expert")
        tree = descendants(svc.proc.pid)
        prefixes = segment_prefixes(tree)
        with self.load(50, pause_s=0.1) as load:
            self._warm(load, 50)
            log(f"  SIGKILL expert worker PE {w['pe']} (pid {w['pid']}); {len(tree)} processes, segments "
                f"{sorted(prefixes)}* ...")
            t0 = time.monotonic()
            os.kill(w["pid"], signal.SIGKILL)
            status, body = svc.wait_health(lambda s, b: s == 503, 30)
            log(f"  /health after {time.monotonic() - t0:.1f} s: {status} {body.get('error', '')[:150]}")
            time.sleep(0.5)
            tally = load.stop()  # within --failure-exit-s: every call in flight gets its answer before the exit
        try:
            code = svc.proc.wait(timeout=FAILURE_EXIT_S + 90)
        except subprocess.TimeoutExpired:
            code = None
        deadline = time.monotonic() + 30
        while (left := [p for p in tree if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        segments = [p for pre in prefixes for p in glob.glob(f"/dev/shm/{pre}*")]
        states = [x["state"] for x in body.get("workers", [])]
        reason = body.get("error", "")
        names_it = f"PE {w['pe']} died" in reason
        call_503 = tally.examples.get("503", "none")
        row.observed = (f"/health {status}: '{short(reason)}', workers {states}; a call's 503: '{short(call_503)}'; "
                        f"exit status {code}; processes left {left}; segments left {segments}")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (status == 503 and names_it and f"PE {w['pe']} died" in call_503 and code == 3 and not left
                      and not segments and bool(prefixes) and tally.only("200", "503") and tally.lost == 0)
        row.details = {"killed": w, "health": [status, body], "statuses": dict(tally.statuses),
                       "examples": tally.examples, "log": tail(svc.log())}

    # 5b. a worker killed, with a spare ----------------------------------------------
    def _kill_under_load(self, flags: list, role: str, metric: str) -> dict:
        """Its own service (``flags``): 50 clients; a worker whose role contains ``role`` SIGKILLed; right answers
        per second (windows of 1 s or just over, sampled every 0.25 s) 10 s before and 20 s after (15 s quick):
        the dip (the slowest window within 5 s of the kill against the median before), the time to recover (from
        the kill to the end of the first window, starting after it, back at 0.9 of before), and the time from the
        kill until ``metric`` counted the failover (polled every 50 ms)."""
        svc = Service(60, flags)
        after_s = 15.0 if self.mode == "quick" else 20.0
        try:
            w = svc.pick(role)
            series: list = []  # (time, right 200s so far)
            with Load(svc.url, self.small, 50, 0.05, 90) as load:
                self._warm(load, 50)

                def sample_until(end: float) -> None:
                    while time.monotonic() < end:
                        series.append((time.monotonic(), load.tally.statuses["200"] - load.tally.wrong))
                        time.sleep(0.25)

                sample_until(time.monotonic() + 10.0)
                t_kill = time.monotonic()
                log(f"  SIGKILL {w['role']} PE {w['pe']} (pid {w['pid']}) ({' '.join(flags)}), "
                    f"{load.in_flight} calls in flight ...")
                os.kill(w["pid"], signal.SIGKILL)
                seen = None
                while seen is None and time.monotonic() < t_kill + 30:
                    series.append((time.monotonic(), load.tally.statuses["200"] - load.tally.wrong))
                    if svc.metric(metric) >= 1:
                        seen = time.monotonic() - t_kill
                    time.sleep(0.05)
                sample_until(t_kill + after_s)
                tally = load.stop()
            status, body = svc.health()
            metrics = {name: svc.metric(name) for name in (metric, "asap_attention_readmissions_total")}
        finally:
            code = svc.close()
        rates = []  # (window start, end, right answers per second): the shortest window of >= 1 s ending at each sample
        for i, (t, n) in enumerate(series):
            u, m = next(((u, m) for u, m in reversed(series[:i]) if t - u >= 1.0), (None, None))
            if u is not None:
                rates.append((u, t, (n - m) / (t - u)))
        before = sorted(r for u, t, r in rates if t <= t_kill)
        base = before[len(before) // 2] if before else 0.0
        during = [(t, r) for u, t, r in rates if u >= t_kill]
        low_t, low = min(((t, r) for t, r in during if t <= t_kill + 5), key=lambda x: x[1], default=(t_kill, 0.0))
        back = next((t for t, r in during if r >= 0.9 * base), None)
        after = sorted(r for t, r in during if t >= t_kill + after_s / 2)
        dip = (f"right answers/s: {base:.0f} before (median of 1 s windows), {low:.0f} at the lowest within "
               f"5 s ({low / base if base else 0:.2f}x, window ending {low_t - t_kill:.1f} s after the kill), "
               f"{after[len(after) // 2] if after else 0:.0f} in the last {after_s / 2:.0f} s; back at 0.9x "
               f"{'%.1f s' % (back - t_kill) if back is not None else 'never'} after the kill; "
               f"a clean stop after: exit status {code}")
        return {"killed": w, "status": status, "body": body, "metrics": metrics, "seen": seen, "tally": tally,
                "code": code, "dip": dip,
                "details": {"killed": w, "health": [status, body], "statuses": dict(tally.statuses),
                            "examples": tally.examples, "rate_before": base, "rate_lowest": low,
                            "lowest_after_s": low_t - t_kill,
                            "recovered_after_s": None if back is None else back - t_kill,
                            "failover_counted_after_s": seen,
                            "series": [(round(t - t_kill, 3), n) for t, n in series]}}

    def kill_worker_spare(self, row: Row) -> None:
        """Its own service with one spare expert rank (docs/failover.md): an expert worker SIGKILLed under load
        (:meth:`_kill_under_load`)."""
        k = self._kill_under_load(["--spare-expert-ranks", "1"], "expert", "asap_expert_failovers_total")
        status, body, tally, seen = k["status"], k["body"], k["tally"], k["seen"]
        failovers = k["metrics"]["asap_expert_failovers_total"]
        repl = body.get("failover", {}).get("replacements", [])
        row.observed = (f"spare took over: {[(e['expert_rank'], e['dead_pe'], e['new_pe']) for e in repl]} "
                        f"(rank, dead PE, spare), counted on /metrics "
                        f"{'%.2f s' % seen if seen is not None else 'never'} after the kill; "
                        f"/health {status}, asap_expert_failovers_total {failovers:g}; {k['dip']}")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (tally.only("200") and tally.lost == 0 and status == 200 and failovers == 1 and len(repl) == 1
                      and k["code"] == 0)
        row.details = k["details"]

    # 5c. an attention worker killed, with attention failover ---------------------------
    def kill_attention(self, row: Row) -> None:
        """Its own service with ``--attention-failover`` (docs/failover.md): attention worker PE 0 SIGKILLed under
        load (:meth:`_kill_under_load`); its requests are re-admitted on the other attention rank."""
        k = self._kill_under_load(["--attention-failover"], "attention", "asap_attention_failovers_total")
        status, body, tally, seen = k["status"], k["body"], k["tally"], k["seen"]
        failovers = k["metrics"]["asap_attention_failovers_total"]
        readmitted = k["metrics"]["asap_attention_readmissions_total"]
        losses = body.get("attention_failover", {}).get("losses", [])
        row.observed = (f"attention PE lost: {[(e['pe'], e['readmitted'], e['survivors']) for e in losses]} (PE, "
                        f"requests re-admitted, ranks left), counted on /metrics "
                        f"{'%.2f s' % seen if seen is not None else 'never'} after the kill; /health {status}, "
                        f"asap_attention_failovers_total {failovers:g}, asap_attention_readmissions_total "
                        f"{readmitted:g}; {k['dip']}")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (tally.only("200") and tally.lost == 0 and status == 200 and failovers == 1
                      and len(losses) == 1 and k["code"] == 0)
        row.details = k["details"]

    # 6. CPU hogs ------------------------------------------------------------------
    def cpu_hogs(self, row: Row) -> None:
        svc = self.service()
        seconds = HOGS_S[self.mode]
        health: Counter = Counter()
        with self.load(50) as load:
            self._warm(load, 50)
            hogs = cpu_hogs(seconds)
            log(f"  {len(hogs)} CPU hogs at nice {os.nice(0)} for {seconds:.0f} s ...")
            try:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    status, body = svc.health()
                    health["503 stalled" if status == 503 and "stalled" in body.get("error", "")
                           else str(status)] += 1
                    time.sleep(1.0)
            finally:
                for h in hogs:  # (they end by themselves about now)
                    h.kill()
                    h.wait(timeout=30)
            tally = load.stop()
        states = [w["state"] for w in svc.health()[1].get("workers", [])]
        ok, after = svc.check(self.ref) if svc.running() else (False, "the service had exited")
        row.observed = (f"{len(hogs)} hogs x {seconds:.0f} s; workers {states}; /health while loaded: "
                        f"{', '.join(f'{n} {s}' for s, n in sorted(health.items()))}; a call after: {after}; "
                        f"slowest 200: {tally.max_latency_s:.1f} s")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (ok and states == ["alive"] * 4 and tally.only("200") and tally.lost == 0
                      and tally.admitted > 0)
        row.details = {"statuses": dict(tally.statuses), "examples": tally.examples, "health": dict(health)}

    # 7. link down across hosts ----------------------------------------------------
    def link_down(self, row: Row) -> None:
        prompts = [p for p, _ in self.ref.pool(6, (5, 60), seed=7)]
        want = [self.ref.token(p) for p in prompts]
        bodies = [{"prompt": p} for p in prompts]
        with Hosts(2) as hs:  # hosts of its own: the cut link stays cut
            procs = serve_across_hosts(hs, HOST_PORT, ["--failure-exit-s", str(FAILURE_EXIT_S), "--comm-timeout-s",
                                                       "10"])
            try:
                log("  the service under torchrun: front end + 1 attention rank on host 0, 1 attention + 2 "
                    "expert ranks on host 1 ...")
                if self._wait_host_health(row, hs, procs) is None:
                    return
                first = http_in_host(hs[0], "/v1/completions", HOST_PORT, bodies, repeat=len(bodies))
                loads = [http_in_host(hs[0], "/v1/completions", HOST_PORT, bodies[k:] + bodies[:k], repeat=400,
                                      pause=0.02, wait=False) for k in (0, 3)]
                time.sleep(1.5)
                log("  node 1's link goes down under load ...")
                t0 = time.monotonic()
                hs[1].link_down()
                dead, got = None, None
                while dead is None and time.monotonic() - t0 < 60 and procs[0].poll() is None:
                    got = http_in_host(hs[0], "/health", HOST_PORT)
                    if got and got[0][0] == 503 and isinstance(got[0][1], dict) and \
                            [w["state"] for w in got[0][1]["workers"]][1:] == ["died"] * 3:
                        dead = got[0][1]
                        log(f"  /health after {time.monotonic() - t0:.1f} s: 503 {dead.get('error', '')[:120]}")
                    time.sleep(0.2)
                outs = [p.communicate(timeout=180)[0] for p in loads]
                lines = [(k, i, json.loads(line)) for k, out in enumerate(outs)
                         for i, line in enumerate(x for x in out.splitlines() if x.startswith("["))]
                try:
                    code = procs[0].wait(timeout=60)
                    log0 = procs[0].communicate(timeout=30)[0] or ""
                except subprocess.TimeoutExpired:
                    code, log0 = None, "(node 0's torchrun still runs)"
                left, shm = host_leftovers(hs[0])
            finally:
                for h in hs.hosts:
                    h.kill_all()
        tally = Tally()
        for k, i, (status, body) in lines:
            j = (i + 3 * k) % len(prompts)  # the prompt of this line (each client starts at its own offset)
            if status == 200:
                ok = body["choices"][0]["token_ids"][0] == want[j]
                tally.wrong += not ok
                tally.add("200", None if ok else f"wrong token for prompt {j}", 0.0)
            elif status == 0:  # urllib's error text: refused (never admitted), no answer in 60 s, or a broken one
                text = str(body)
                tally.add("refused" if "refused" in text else "timeout" if "timed out" in text else "closed", text,
                          0.0)
            else:
                tally.add(str(status), (body or {}).get("error", {}).get("message", str(body)), 0.0)
        first_ok = [a[0] for a in first] == [200] * len(prompts) and \
            [a[1]["choices"][0]["token_ids"][0] for a in first] == want
        exits = _exit_codes(log0)
        reason = dead.get("error", "") if dead else ""
        said_503 = "died" in tally.examples.get("503", "")
        seen = f"503, workers {[w['state'] for w in dead['workers']]}" if dead else "never 503 with 3 died"
        logged = "exited after worker failure" in log0
        row.observed = (f"before: {len(first)} calls {'all right' if first_ok else 'NOT all right'}; /health: "
                        f"{seen} ('{short(reason)}'); a call's 503: '{short(tally.examples.get('503', 'none'))}'; "
                        f"node 0: 'exited after worker failure' {'logged' if logged else 'NOT logged'}, exit codes "
                        f"{exits} (torchrun {code}); left on node 0: {len(left)} processes, segments {shm}")
        first_wrong = sum(1 for (st, b), w in zip(first, want) if st == 200 and b["choices"][0]["token_ids"][0] != w)
        row.answered, row.wrong = tally.answered(), tally.wrong + first_wrong
        row.passed = (first_ok and dead is not None and "died" in reason and said_503 and logged and "3" in exits
                      and not left and not shm and tally.only("200", "503", "closed") and not tally.statuses["timeout"])
        row.details = {"statuses": dict(tally.statuses), "examples": tally.examples, "health": dead,
                       "log_node0": tail(log0)}

    # 7b. a remote worker stopped 60 s (service under torchrun) ------------------
    def stop_remote_worker(self, row: Row) -> None:
        """SIGSTOP of expert PE 2 on node 1 (node 0's attention PE dispatches to it across hosts) for 60 s (20 s
        quick) under load from four clients whose calls may wait 300 s; --comm-timeout-s 10 bounds each attempt."""
        stop_s = 20.0 if self.mode == "quick" else 60.0
        prompts = [p for p, _ in self.ref.pool(6, (5, 60), seed=7)]
        want = [self.ref.token(p) for p in prompts]
        with Hosts(2) as hs:
            procs = serve_across_hosts(hs, HOST_PORT, ["--failure-exit-s", str(FAILURE_EXIT_S), "--comm-timeout-s",
                                                       "10", "--worker-stall-s", "5", "--request-timeout-s", "300"])
            try:
                health = self._wait_host_health(row, hs, procs)
                if health is None:
                    return
                pid = health["workers"][2]["pid"]
                load = long_clients(hs[0], HOST_PORT, prompts, stop_s + 30)
                time.sleep(6)
                log(f"  expert PE 2 on node 1 stopped for {stop_s:.0f} s under load ...")
                os.kill(pid, signal.SIGSTOP)
                t_stop, states = time.monotonic(), Counter()
                try:
                    while time.monotonic() - t_stop < stop_s:
                        time.sleep(5)
                        status, body = host_health(hs[0], HOST_PORT)
                        err = body.get("error", "") if isinstance(body, dict) else ""
                        states["failure" if "failure" in err else "stalled" if "stalled" in err else str(status)] += 1
                finally:
                    os.kill(pid, signal.SIGCONT)
                t_cont = time.monotonic()
                lines = calls(load, stop_s + 400)
                after = host_health(hs[0], HOST_PORT)
                logs = end_service(hs, procs)
            finally:
                for h in hs.hosts:
                    h.kill_all()
        tally = Tally()
        for status, j, token, start, end in lines:
            if status == 200:
                ok = token == want[j]
                tally.wrong += not ok
                tally.add("200", None if ok else f"wrong token for prompt {j}", end - start)
            else:
                tally.add(str(status), str(token), end - start)
        across = sum(1 for x in lines if x[3] < t_stop < x[4])
        later = sum(1 for x in lines if x[4] > t_cont)
        clean = "stopped cleanly" in logs[0] and "worker failure" not in logs[0]
        row.observed = (f"stopped {stop_s:.0f} s; /health during: {dict(states)}; after: "
                        f"{after[0]}; {across} calls in flight across the stop, {later} ended after "
                        f"it; slowest 200: {tally.max_latency_s:.1f} s; then SIGTERM: "
                        f"{'stopped cleanly' if clean else 'NOT clean'}, node 1's torchrun {procs[1].returncode}")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (tally.only("200") and tally.admitted > 0 and tally.wrong == 0 and across > 0 and later > 0
                      and states["stalled"] > 0 and not states["failure"] and after[0] == 200
                      and clean and procs[1].returncode == 0)
        row.details = {"statuses": dict(tally.statuses), "examples": tally.examples, "log_node0": tail(logs[0]),
                       "log_node1": tail(logs[1])}

    # 7c. a host lost, its expert PEs replaced by spares on the other hosts -------------
    def host_lost_spare(self, row: Row) -> None:
        """The service under torchrun on three hosts with two spare expert ranks (docs/failover.md, "Across
        hosts"): the front end (PE 5, node 0's first process) and attention PE 0 on host 0, expert PEs 1, 2 on
        host 1, spare PEs 3, 4 on host 2. Under load from four clients in host 0, host 1's link goes down; the
        spares take over both expert ranks. Right answers per second before (the 6 s before the loss) and after
        (from the failover to the end of the load), the time from the loss to /health showing both replacements,
        and the slowest call."""
        load_s = 30.0 if self.mode == "quick" else 40.0
        prompts = [p for p, _ in self.ref.pool(6, (5, 60), seed=7)]
        want = [self.ref.token(p) for p in prompts]
        with Hosts(3) as hs:
            front = hs[0]  # the front end and its HTTP server
            procs = serve_across_hosts(hs, HOST_PORT, ["--attention-ranks", "1", "--expert-ranks", "2",
                                                       "--spare-expert-ranks", "2", "--failure-exit-s",
                                                       str(FAILURE_EXIT_S), "--comm-timeout-s", "10",
                                                       "--worker-stall-s", "5", "--request-timeout-s", "120"],
                                       layout=[2, 2, 2])
            logs = ["", "", ""]
            try:
                log("  the service under torchrun: front end + attention PE 0 on host 0, expert PEs 1, 2 on host 1, "
                    "spares 3, 4 on host 2 ...")
                try:
                    wait_host_health(front, HOST_PORT, procs, 300)
                except RuntimeError as e:
                    row.observed, row.details, row.passed = "the service did not start", {"logs": tail(str(e))}, False
                    return
                load = long_clients(front, HOST_PORT, prompts, load_s)
                time.sleep(10)
                log("  host 1's link goes down under load ...")
                hs[1].link_down()
                t_loss = time.monotonic()
                seen, body = None, {}
                while seen is None and time.monotonic() - t_loss < 60:
                    status, body = host_health(front, HOST_PORT)
                    if status == 200 and (body or {}).get("failover", {}).get("failovers") == 2:
                        seen = time.monotonic() - t_loss
                    else:
                        time.sleep(0.2)
                lines = calls(load, load_s + 200)
                after = host_health(front, HOST_PORT)
                metrics = front.popen([sys.executable, "-c", "import sys, urllib.request; sys.stdout.write("
                                       "urllib.request.urlopen(sys.argv[1], timeout=60).read().decode())",
                                       f"http://127.0.0.1:{HOST_PORT}/metrics"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True).communicate(timeout=90)[0]
                hs[1].kill_all()  # the lost host's processes
                procs[0].send_signal(signal.SIGTERM)  # the front end stops the workers that are left
                for i in (0, 2, 1):
                    try:
                        logs[i] = procs[i].communicate(timeout=120)[0] or ""
                    except subprocess.TimeoutExpired:
                        for h in hs.hosts:
                            h.kill_all()
                        logs[i] = procs[i].communicate(timeout=30)[0] or ""
            finally:
                for h in hs.hosts:
                    h.kill_all()
        tally = Tally()
        for status, j, token, start, end in lines:
            if status == 200:
                ok = token == want[j]
                tally.wrong += not ok
                tally.add("200", None if ok else f"wrong token for prompt {j}", end - start)
            else:
                tally.add(str(status), str(token), end - start)
        ok_ends = sorted(x[4] for x in lines if x[0] == 200)
        before = sum(1 for e in ok_ends if t_loss - 6 <= e < t_loss) / 6
        t_back = t_loss + (seen or 0.0)
        t_end = max(ok_ends) if ok_ends else t_back
        after_rate = sum(1 for e in ok_ends if e >= t_back) / max(1e-9, t_end - t_back)
        across = sum(1 for x in lines if x[3] < t_loss < x[4])
        repl = (body or {}).get("failover", {}).get("replacements", [])
        failovers = next((float(x.split()[-1]) for x in metrics.splitlines()
                          if x.startswith("asap_expert_failovers_total")), 0.0)
        clean = "stopped cleanly" in logs[0] and "worker failure" not in logs[0]
        row.observed = (f"spares took over: {[(e['expert_rank'], e['dead_pe'], e['new_pe']) for e in repl]} (rank, "
                        f"dead PE, spare), both on /health {'%.1f s' % seen if seen is not None else 'never'} after "
                        f"the link went down (ASAP_NET_PEER_TIMEOUT_S 3); asap_expert_failovers_total {failovers:g}; "
                        f"right answers/s {before:.0f} before, {after_rate:.0f} after the failover; {across} calls "
                        f"in flight across the loss, slowest 200 {tally.max_latency_s:.1f} s; /health after "
                        f"{after[0]}; then SIGTERM: {'stopped cleanly' if clean else 'NOT clean'}")
        row.answered, row.wrong = tally.answered(), tally.wrong
        row.passed = (tally.only("200") and tally.admitted > 0 and tally.wrong == 0 and seen is not None
                      and len(repl) == 2 and failovers == 2 and after[0] == 200 and across > 0 and clean)
        row.details = {"statuses": dict(tally.statuses), "examples": tally.examples, "health": body,
                       "failover_seen_after_s": seen, "rate_before": before, "rate_after": after_rate,
                       "log_node0": tail(logs[0]), "log_host1": tail(logs[1]), "log_host2": tail(logs[2])}

    @staticmethod
    def _wait_host_health(row: Row, hs, procs) -> "dict | None":
        """/health's body once the service across ``hs`` answers 200; None (the row failed, with the launchers'
        logs) when it does not start."""
        try:
            return wait_host_health(hs[0], HOST_PORT, procs, 300)
        except RuntimeError as e:
            row.observed = "the service did not start"
            row.details = {"logs": tail(str(e), 6000)}
            row.passed = False
            return None

    # 8. packet loss -----------------------------------------------------------------
    def loss(self, row: Row, percent: int) -> None:
        hs = self.hosts()
        ns, link = hs[1].ns, hs[1].link
        num = LOSS_MSGS[self.mode][percent]
        rows = num // 5
        nft = ["ip", "netns", "exec", ns, nft_path()]
        for cmd in (["add", "table", "inet", "asapdrop"],
                    ["add", "chain", "inet", "asapdrop", "out", "{ type filter hook output priority 0; }"],
                    ["add", "rule", "inet", "asapdrop", "out", "oifname", link, "numgen", "random", "mod", "100",
                     "<", str(percent), "counter", "drop"]):
            subprocess.run(nft + cmd, check=True, capture_output=True, text=True, timeout=30)
        try:
            log(f"  {percent}% of host 1's packets dropped; two PEs stream {num} messages + {rows} rows each "
                f"way ...")
            t = time.monotonic()
            results = run_across_hosts(hs, [1, 1], stream_in_order, num, rows, timeout=400)
            took = time.monotonic() - t
            listing = subprocess.run(nft + ["list", "table", "inet", "asapdrop"], capture_output=True, text=True,
                                     timeout=30).stdout
        finally:
            subprocess.run(nft + ["delete", "table", "inet", "asapdrop"], capture_output=True, timeout=30)
        m = re.search(r"counter packets (\d+)", listing)
        dropped = int(m.group(1)) if m else None
        problems = [p for r in results for p in r["problems"]]
        states = [r["states"] for r in results]
        disorder = [r["stats"]["disorder"] for r in results]
        msgs, got_rows = sum(r["messages"] for r in results), sum(r["rows"] for r in results)
        everyone = "every PE saw every PE alive" if all(s == ["alive", "alive"] for s in states) else \
            f"peer states {states}"
        row.observed = (f"{dropped} packets dropped; took {took:.0f} s; disorder {disorder}; {everyone}; "
                        f"problems: {problems[:3] or 'none'}")
        row.answered = f"{msgs}/{2 * num} messages, {got_rows}/{2 * rows} rows in order"
        row.wrong = len(problems)
        row.passed = (not problems and msgs == 2 * num and got_rows == 2 * rows and disorder == [0, 0]
                      and all(s == ["alive", "alive"] for s in states) and bool(dropped))
        row.details = {"stats": [r["stats"] for r in results], "dropped_packets": dropped, "seconds": took}

    # 9. small /dev/shm ----------------------------------------------------------------
    def small_shm(self, row: Row) -> None:
        log("  the service in a private mount namespace with a 700 kB /dev/shm ...")
        r = in_small_shm("700k", [sys.executable, "-m", "asap_comm.serving.server", "--model", "tiny", "--port",
                                  "0"], timeout=300, cwd=ROOT)
        lines = [ln for ln in r.stderr.splitlines() if "/dev/shm has" in ln]
        errors = log_errors(r.stderr)
        row.observed = (f"exit status {r.returncode}{' (SIGBUS)' if r.returncode in (-7, 135) else ''}; "
                        f"{lines[0] if lines else 'no line naming /dev/shm'}; traceback: "
                        f"{'yes' if errors else 'no'}")
        row.passed = (r.returncode == 2 and bool(lines) and "wanted" in lines[0] and "free" in lines[0]
                      and not errors)
        row.details = {"stderr": tail(r.stderr)}

    # 10. hostile bodies -----------------------------------------------------------------
    def hostile_bodies(self, row: Row) -> None:
        svc = self.service()
        mark = len(svc.log())
        cases = [("100k-deep JSON", b"[" * 100_000 + b"]" * 100_000, {}),
                 ("5,000-digit integer", b'{"prompt": [' + b"9" * 5000 + b"]}", {}),
                 ("token id 2**63", json.dumps({"prompt": [2 ** 63]}).encode(), {}),
                 ("charset=bogus-xx", b'{"prompt": [1, 2]}', {"Content-Type": "application/json; charset=bogus-xx"})]
        statuses = []
        for name, body, headers in cases:
            r = svc.client.post("/v1/completions", content=body, headers={"Content-Type": "application/json",
                                                                        **headers})
            statuses.append((name, r.status_code, r.text[:200]))
        log(f"  bodies: {', '.join(f'{n}: {s}' for n, s, _ in statuses)}; /health probes, unloaded ...")
        unloaded = harness.hostile_scenario(svc.url, None, False)
        log(f"  /health probes while four clients send {HOSTILE_MB} MB bodies ...")
        loaded = harness.hostile_scenario(svc.url, harness.ids_body(HOSTILE_MB * 1000 * 1000),
                                              False)
        errors = log_errors(svc.log()[mark:])
        answers = loaded["answers"]
        big_ok = all(k == "reset" or k.startswith("4") for k in answers) and any(k.startswith("4") for k in answers)
        ratio = loaded["p99_ms"] / unloaded["p99_ms"] if unloaded["p99_ms"] else float("inf")
        row.observed = (f"{', '.join(f'{n}: {s}' for n, s, _ in statuses)}; 50 MB bodies: "
                        f"{', '.join(f'{v} {k}' for k, v in sorted(answers.items()))}; traceback in the log: "
                        f"{'yes ' + str(errors) if errors else 'no'}; /health p50/p99 {loaded['p50_ms']:.1f}/"
                        f"{loaded['p99_ms']:.1f} ms under the bodies, {unloaded['p50_ms']:.1f}/"
                        f"{unloaded['p99_ms']:.1f} ms unloaded (p99 x{ratio:.1f})")
        big = sum(answers.values())
        row.answered = (f"{sum(1 for _, s, _ in statuses if 400 <= s < 500)}/{len(statuses)} 4xx; 50 MB bodies: "
                        f"{sum(v for k, v in answers.items() if k.startswith('4'))}/{big} 4xx")
        row.passed = (all(400 <= s < 500 for _, s, _ in statuses) and big_ok and not errors
                      and loaded["p99_ms"] <= 50.0)
        row.details = {"bodies": statuses, "unloaded": unloaded, "loaded": loaded}
        if errors:
            row.details["log"] = tail(svc.log()[mark:])

    # 11. a hog client -----------------------------------------------------------------------
    def hog_client(self, row: Row) -> None:
        svc = self.service()
        hog_pool = self.ref.pool(3, (BOUND // 2, BOUND // 2), seed=11, batch=2)  # calls of BOUND tokens
        small_pool = self.ref.pool(30, (10, 40), seed=12)
        calls = 10 if self.mode == "quick" else 20
        with self.load(1, pause_s=0.0, pool=hog_pool) as hog:
            deadline = time.monotonic() + 120
            while hog.done() == 0 and time.monotonic() < deadline:  # the hog is at work before the others come
                time.sleep(0.1)
            log(f"  a hog sends calls of {BOUND} tokens back to back ({hog.done()} answered); three small "
                f"clients send {calls} calls each ...")
            small = self.load(3, pause_s=0.1, pool=small_pool, calls_per_client=calls)
            with small:
                finished = small.wait(svc.request_timeout_s * calls + 60)
            hog_tally = hog.stop()
        st = small.tally
        row.observed = (f"small calls: {st.right}/{3 * calls} right 200s (slowest {st.max_latency_s:.1f} s)"
                        f"{'' if finished else ', NOT all finished'}; the hog: {hog_tally.answered()} "
                        f"(calls of {BOUND} tokens, slowest {hog_tally.max_latency_s:.1f} s)")
        both = st.merge(hog_tally)
        row.answered, row.wrong = both.answered(), both.wrong
        row.passed = (finished and st.right == 3 * calls and hog_tally.right >= 1 and hog_tally.only("200")
                      and both.lost == 0)
        row.details = {"small": dict(st.statuses), "hog": dict(hog_tally.statuses),
                       "examples": both.examples}

    # 13-15. the front door: slowloris at the file limit, stalled uploads, a flooding client ----------------
    def door(self) -> Service:
        """A service of its own for the front-door rows: started with a file limit (RLIMIT_NOFILE) of
        ``DOOR_NOFILE``, ``--header-timeout-s 2 --idle-timeout-s 3``, admission bound 1024 tokens."""
        if self._door is None or not self._door.running():
            self._door = Service(30.0, ["--max-queued-tokens", "1024", "--header-timeout-s", "2", "--idle-timeout-s",
                                        "3", "--chunk-len", "256", "--token-budget", "512"], nofile=DOOR_NOFILE)
        return self._door

    def slowloris(self, row: Row) -> None:
        import socket
        svc = self.door()
        mark = len(svc.log())
        host, port = svc.url.split("//")[1].split(":")
        n, seconds = DOOR_NOFILE + 110, 15.0 if self.mode == "quick" else 30.0
        socks = []
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            socks.append(s)
        log(f"  {n} slowloris connections (file limit {DOOR_NOFILE}) sending a header byte per second "
            f"for {seconds:.0f} s; /health and calls meanwhile ...")
        health, calls = Counter(), Tally()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for s in socks:
                try:
                    s.send(b"a")
                except OSError:
                    pass
            status, _ = svc.health()
            health[status] += 1
            ids, tokens = self.small[calls.admitted % len(self.small)]
            t = time.monotonic()
            try:
                record(calls, svc.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}), tokens,
                       time.monotonic() - t)
            except httpx.HTTPError as e:
                calls.add("timeout", str(e), time.monotonic() - t)
            time.sleep(1.0)
        open_ = 0
        for s in socks:
            try:
                s.setblocking(False)
                s.recv(1)  # b"" or an answer: closed by the service
            except BlockingIOError:
                open_ += 1
            except OSError:
                pass
            s.close()
        log_text = svc.log()[mark:]
        closed = {k[1][0][1]: v for k, v in svc.metrics("asap_connections_closed_total").items()}
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(health.items()))
        row.observed = (f"{n} slowloris connections: /health {shown}; "
                        f"calls {calls.answered()}; still open at the end {open_}; closed by the service "
                        f"{dict(closed)}; stderr {len(log_text)} bytes, 'out of system resource' "
                        f"{log_text.count('out of system resource')}x; traceback: "
                        f"{'yes' if log_errors(log_text) else 'no'}")
        row.answered, row.wrong = calls.answered(), calls.wrong
        row.passed = (set(health) == {200} and set(calls.statuses) == {"200"} and open_ == 0
                      and len(log_text) < 4000 and not log_errors(log_text))
        row.details = {"health": dict(health), "calls": dict(calls.statuses), "closed": closed}

    def stalled_uploads(self, row: Row) -> None:
        import socket
        svc = self.door()
        host, port = svc.url.split("//")[1].split(":")
        bound = default_max_body_bytes(1024)
        out: list = [None] * 8

        def upload(i: int) -> None:
            s = socket.create_connection((host, int(port)), timeout=60)
            try:
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {bound}\r\n\r\n".encode() + b'{"prompt": [' + b" " * (bound - 13))
            except OSError:
                pass
            try:
                head = s.recv(4096)
                out[i] = int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else "no answer"
            except OSError as e:
                out[i] = f"no answer: {e}"
            finally:
                s.close()

        threads = [threading.Thread(target=upload, args=(i,), daemon=True) for i in range(8)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(1.5)
        log(f"  8 uploads of {bound - 1} of {bound} bytes stalled; small calls meanwhile ...")
        calls = Tally()
        for ids, tokens in self.small[:20]:
            t = time.monotonic()
            record(calls, svc.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}), tokens,
                   time.monotonic() - t)
        for t in threads:
            t.join(timeout=60)
        ended = time.monotonic() - t0
        row.observed = (f"small calls while 8 uploads stall: {calls.answered()} (slowest {calls.max_latency_s:.2f} s); "
                        f"the uploads: {', '.join(f'{v} {k}' for k, v in sorted(Counter(map(str, out)).items()))} "
                        f"(all ended within {ended:.0f} s)")
        row.answered, row.wrong = calls.answered(), calls.wrong
        row.passed = set(calls.statuses) == {"200"} and set(out) <= {408, 429} and 408 in out
        row.details = {"calls": dict(calls.statuses), "uploads": out}

    def flood_client(self, row: Row) -> None:
        import statistics
        svc = self.door()
        b_pool = self.ref.pool(16, (256, 256), seed=21)
        b_client = httpx.Client(base_url=svc.url, timeout=60, transport=httpx.HTTPTransport(local_address="127.0.0.1"))

        def serial() -> tuple:
            tally, secs = Tally(), []
            for ids, tokens in b_pool:
                t = time.monotonic()
                r = b_client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1})
                dt = time.monotonic() - t
                if record(tally, r, tokens, dt):
                    secs.append(dt)
            return tally, secs

        alone_tally, alone = serial()
        seconds = 20.0 if self.mode == "quick" else 40.0
        log(f"  client A (127.0.0.2) keeps 64 calls of 64 tokens in flight for {seconds:.0f} s; B (127.0.0.1) "
            "sends 256-token calls one after another ...")
        with Flood(svc.url, 64, 64, seconds) as flood:
            t_a, cpu_a = time.monotonic(), cpu_seconds(flood.proc.pid)
            time.sleep(2.0)
            b_tally, flooded = serial()
            share = (cpu_seconds(flood.proc.pid) - cpu_a) / (time.monotonic() - t_a)  # A's client, in cores
        a = flood.counts
        # The control: the same serial calls beside a busy loop that takes what A's client process took of the
        # cores (no call of its own). On 2 shared cores the flood's client is a CPU load as much as a client;
        # B's latency against this control is what the service's fairness leaves to B.
        share = min(max(share, 0.05), 1.0)
        hogs = cpu_hogs(seconds, count=1, duty=share)
        try:
            time.sleep(1.0)
            h_tally, hogged = serial()
        finally:
            for h in hogs:
                h.kill()
                h.wait(timeout=30)
        p50a, p50f, p50h = (statistics.median(x or [0]) for x in (alone, flooded, hogged))
        row.observed = (f"B alone: {alone_tally.answered()}, p50 {p50a * 1e3:.0f} ms; B while A floods: "
                        f"{b_tally.answered()}, p50 {p50f * 1e3:.0f} ms ({p50f / p50a if p50a else 0:.1f}x alone); "
                        f"A: {', '.join(f'{v} {k}' for k, v in sorted(a.items()))}; control, B beside a busy loop "
                        f"of A's client's CPU ({share:.2f} core): p50 {p50h * 1e3:.0f} ms ({p50h / p50a if p50a else 0:.1f}x "
                        f"alone; flooded {p50f / p50h if p50h else 0:.1f}x the control)")
        both = alone_tally.merge(b_tally).merge(h_tally)
        row.answered, row.wrong = both.answered(), both.wrong
        row.passed = set(both.statuses) == {"200"} and a.get("200", 0) > 0
        row.details = {"b_alone_s": alone, "b_flooded_s": flooded, "b_control_s": hogged, "a": a,
                       "a_client_cores": share, "p50_ratio": p50f / p50a if p50a else None,
                       "p50_ratio_control": p50h / p50a if p50a else None,
                       "p50_ratio_vs_control": p50f / p50h if p50h else None}

    # 12. a group across hosts without a secret ------------------------------------------------
    def no_secret(self, row: Row) -> None:
        hs = self.hosts()
        log("  the service under torchrun on two hosts, ASAP_GROUP_SECRET unset ...")
        procs = torchrun(hs, [1, 2], ["-m", "asap_comm.serving.server", "--model", "tiny", "--port", str(HOST_PORT),
                                      "--attention-ranks", "1", "--expert-ranks", "1", "--comm-timeout-s", "5"],
                         env={**os.environ, "ASAP_GROUP_SECRET": None})
        outs, codes = [], []
        try:
            for p in procs:
                try:
                    outs.append(p.communicate(timeout=180)[0] or "")
                except subprocess.TimeoutExpired:
                    p.kill()
                    outs.append((p.communicate(timeout=30)[0] or "") + "\n(killed after 180 s)")
                codes.append(p.returncode)
        finally:
            for h in hs.hosts:
                h.kill_all()
        text = "\n".join(outs)
        how = [ln.strip() for ln in text.splitlines() if "export ASAP_GROUP_SECRET" in ln]
        listened = "listening on" in text
        row.observed = (f"torchrun exit statuses {codes}; {excerpt(how[0], 'export') if how else 'no line says how'}"
                        f"; served: {'YES' if listened else 'no'}")
        row.passed = bool(how) and all(c not in (0, None) for c in codes) and not listened
        row.details = {"logs": [tail(o) for o in outs]}


def _exit_codes(log0: str) -> list:
    """The exit codes torchrun's failure summary on node 0 names (``exitcode  : 3``)."""
    return re.findall(r"exitcode\s*:\s*(-?\d+)", log0)


# ----------------------------------------------------------------------------- the registry
# name: (table label, expected, what it needs, how it runs: fn(suite, row)). Listed in the order (the
# table's); RUN_ORDER below runs the cheap rows first and the shared service's rows together, the kill last.
FAULTS = {
    "rogue-store": ("rogue store writer",
                    "the group forms, its puts land in its own memory; a forged ctrl/1: CommError naming the key, "
                    "nothing mapped, nothing left", None, Suite.rogue_store),
    "rogue-peer": ("rogue network peer (claims PE 1)",
                   "nothing applied, each message counted unauthenticated (>= 3), the group goes on",
                   why_no_hosts, Suite.rogue_peer),
    "stop-front-end": ("front end SIGSTOP under load",
                       "the service lives, serves again after; every answer the right token or 504, none hung",
                       None, Suite.stop_front_end),
    "stop-worker": ("expert worker SIGSTOP under load",
                    "/health 503 naming it while stopped, 200 after; the service lives; every answer the right "
                    "token or 504, none hung", None, Suite.stop_worker),
    "kill-worker": ("expert worker SIGKILL under load",
                    "503 naming it (/health and calls), exit status 3, no process and no /dev/shm/asap-* segment "
                    "left; every answer right or 503", None, Suite.kill_worker),
    "kill-worker-spare": ("expert worker SIGKILL under load with a spare (--spare-expert-ranks 1)",
                          "the spare takes over: every call 200 with the right token, none failed; /health 200 "
                          "showing the replacement, asap_expert_failovers_total 1; a clean stop after (exit 0); "
                          "the throughput dip and the time to recover reported", None, Suite.kill_worker_spare),
    "kill-attention": ("attention worker SIGKILL under load with --attention-failover",
                       "its requests re-admitted on the other attention rank: every call 200 with the right token, "
                       "none failed; /health 200 showing the loss, asap_attention_failovers_total 1; a clean stop "
                       "after (exit 0); the throughput dip and the time to recover reported", None,
                       Suite.kill_attention),
    "cpu-hogs": ("CPU hogs at nice 0 on every core",
                 "no failure: every answer 200 with the right token, every worker alive", None,
                 Suite.cpu_hogs),
    "link-down": ("link down across hosts (service under torchrun)",
                  "node 1's workers died in /health, 503 with the reason, front end exits 3, nothing left on "
                  "node 0; every answer right or 503", why_no_hosts, Suite.link_down),
    "host-lost-spare": ("a host lost (link down) with spares on the other hosts (service under torchrun, 3 hosts)",
                        "the spares take over both expert ranks of the lost host: every call 200 with the right "
                        "token, none failed; /health 200 showing the replacements, asap_expert_failovers_total 2; a "
                        "clean stop after", why_no_hosts, Suite.host_lost_spare),
    "stop-remote-worker": ("a remote worker stopped 60 s (expert PE on node 1, service under torchrun)",
                           "/health 503 stalled meanwhile (never died, no failure), 200 after; every call 200 with "
                           "the right token, calls in flight across the stop answered; a clean stop after",
                           why_no_hosts, Suite.stop_remote_worker),
    **{f"loss-{pct}": (f"{pct}% packet loss (nftables) across hosts",
                       "every message and row delivered once, in order (disorder 0), nobody declared dead",
                       why_no_nft, functools.partial(Suite.loss, percent=pct)) for pct in (5, 20)},
    "small-shm": ("700 kB /dev/shm (private mount namespace)",
                  "the server exits 2 with a line naming /dev/shm, the bytes wanted and free; no SIGBUS, no "
                  "traceback", why_no_private_shm, Suite.small_shm),
    "hostile-bodies": ("hostile bodies",
                       "only 4xx, no 500, no traceback in the log; /health p99 <= 50 ms while four 50 MB bodies "
                       "arrive", None, Suite.hostile_bodies),
    "hog-client": ("a hog client at the admission bound",
                   "small calls keep being served (200, right) beside the hog", None, Suite.hog_client),
    "slowloris": ("slowloris past the file limit (1,134 header-trickling connections at RLIMIT_NOFILE 1,024)",
                  "/health and calls answered 200 (right) all along; every slow connection closed (header timeout, "
                  "or the oldest at --max-connections); stderr < 4 kB, no traceback", None,
                  Suite.slowloris),
    "stalled-uploads": ("8 uploads of 1 byte short of the body bound, stalled",
                        "small calls 200 (right) meanwhile; each upload refused (429, per-client cap) or cut "
                        "(408, under --min-body-rate)", None, Suite.stalled_uploads),
    "flood-client": ("a flooding client (64 calls in flight) beside a serial one",
                     "the serial client gets no 429: every call 200 with the right token (its p50 against alone "
                     "and against a busy loop of the flood client's CPU share reported)", None, Suite.flood_client),
    "no-secret": ("a group across hosts without ASAP_GROUP_SECRET",
                  "refuses to start, saying how to set it; nothing served", why_no_hosts,
                  Suite.no_secret),
}
RUN_ORDER = ["rogue-store", "small-shm", "no-secret", "rogue-peer", "loss-5", "loss-20", "link-down",
             "stop-remote-worker", "host-lost-spare",
             "hostile-bodies", "hog-client", "slowloris", "stalled-uploads", "flood-client", "cpu-hogs",
             "stop-front-end", "stop-worker", "kill-worker-spare", "kill-attention", "kill-worker"]
assert sorted(RUN_ORDER) == sorted(FAULTS)

COLUMNS = ("fault", "expected", "observed", "answered", "wrong", "pass")


def cells(row: Row) -> list:
    return [row.fault, row.expected, row.observed or "-", row.answered, str(row.wrong), row.verdict()]


def markdown(rows: list) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells(r)) + " |" for r in rows]
    return "\n".join(out)


def run(names: list, quick: bool) -> list:
    needs = {name: FAULTS[name][2]() if FAULTS[name][2] is not None else None for name in names}
    for why in sorted({w for w in needs.values() if w is not None}):
        skipped = ", ".join(n for n, w in needs.items() if w == why)
        log(f"this machine lacks what some rows need: {why}; skipping {skipped}")
    suite = Suite(quick)
    rows = {}
    try:
        for name in [n for n in RUN_ORDER if n in names]:
            label, expected, _, fn = FAULTS[name]
            row = Row(name, label, expected)
            rows[name] = row
            why = needs[name]
            if why is not None:
                row.skipped = why
                log(f"{name}: skipped: {why}")
                continue
            log(f"{name}: {label} ...")
            t = time.monotonic()
            try:
                fn(suite, row)
            except Exception as e:  # a row that could not finish fails, with what happened
                row.passed = False
                note = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                row.observed = f"{row.observed}; {note}" if row.observed else note
                row.details["error"] = traceback.format_exc()
                svc = suite._service
                if svc is not None:
                    row.details.setdefault("log", tail(svc.log()))
            row.seconds = time.monotonic() - t
            log(f"{name}: {row.verdict()} ({row.seconds:.0f} s): {row.observed}")
            if row.verdict() == "FAIL":
                for key in ("error", "log", "log_node0", "logs", "stderr"):
                    if key in row.details:
                        text = row.details[key]
                        text = text if isinstance(text, str) else json.dumps(text, indent=1)[-6000:]
                        print(f"--- {name}: {key}\n{text}", file=sys.stderr, flush=True)
    finally:
        suite.close()
    return [rows[n] for n in FAULTS if n in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter stalls, hogs and loads (a smoke run)")
    ap.add_argument("--only", default=None, help=f"comma-separated rows: {', '.join(FAULTS)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "faults"))
    args = ap.parse_args(argv)
    names = list(FAULTS) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        ap.error(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # clean up as on Ctrl-C
    torch.set_num_threads(1)  # the reference forward: torch's threads spin against the service on a small host
    started = datetime.now(timezone.utc)
    t = time.monotonic()
    rows = run(names, args.quick)
    wall = time.monotonic() - t
    table = markdown(rows)
    passed = sum(r.verdict() == "PASS" for r in rows)
    meta = {"date_utc": started.isoformat(timespec="seconds"), "mode": "quick" if args.quick else "full",
            "wall_s": round(wall, 1), "commit": git_commit(ROOT), "cpus": os.cpu_count(), "python":
            platform.python_version(), "torch": torch.__version__, "passed": passed, "rows": len(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "faults.md"), "w") as f:
        f.write(f"_{', '.join(f'{k}={v}' for k, v in meta.items())}_\n\n{table}\n")
    with open(os.path.join(args.out, "faults.json"), "w") as f:
        json.dump({"meta": meta, "rows": [{**asdict(r), "pass": r.verdict()} for r in rows]}, f, indent=1,
                  default=str)
    print(table)
    log(f"{passed}/{len(rows)} rows passed in {wall:.0f} s; {args.out}/faults.md, faults.json")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
