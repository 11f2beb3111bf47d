"""The HTTP service as the tests and the fault rows run it, and what they judge it by.

* on this host: :class:`Service` (``python -m asap_comm.serving.server --port 0 ARGS`` with an httpx client,
  /health and /metrics reads, the shared-memory files it added); :func:`file_limit` (a lowered RLIMIT_NOFILE that
  a started service inherits); :class:`Flood` (a client that keeps many calls in flight from 127.0.0.2);
  :func:`hostile_scenario` (/health latency while large bodies arrive);
* across simulated hosts (:mod:`asap_comm.testing.netns`): :func:`serve_across_hosts` (the service under torchrun),
  :func:`wait_host_health`, :func:`end_service`, :func:`host_leftovers`; calls from inside a host:
  :func:`http_in_host` (one after another), :func:`long_clients` / :func:`calls` (calls that may wait minutes);
* what is left: :func:`alive`, :func:`wait_dead`, :func:`descendants`, :func:`segment_prefixes`, :func:`shm_files`.

Every wait here is bounded.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import httpx

from asap_comm.serving.client import ServiceProcess


# ----------------------------------------------------------------------------- processes and segments
def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_dead(pids: list, timeout_s: float = 30.0) -> list:
    """Wait up to ``timeout_s`` for every pid to end; the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def listening_ports(pids: list) -> set:
    """The TCP ports on which any of ``pids`` holds a listening socket (from /proc: the processes' socket inodes
    against /proc/net/tcp and tcp6 in state LISTEN)."""
    inodes = set()
    for pid in pids:
        for fd in glob.glob(f"/proc/{pid}/fd/*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def descendants(pid: int) -> list:
    """``pid`` and every process below it (from /proc)."""
    children: dict = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def segment_prefixes(pids: list) -> set:
    """The ``asap-<hex>-`` prefixes of the /dev/shm segments these processes map (one per group)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        out.update(re.findall(r"/dev/shm/(asap-[0-9a-f]+-)", maps))
    return out


def shm_files() -> set:
    """asap_comm's segments and multiprocessing's named semaphores in /dev/shm."""
    return set(glob.glob("/dev/shm/asap-*")) | set(glob.glob("/dev/shm/sem.mp-*"))


@contextlib.contextmanager
def environ(values: dict):
    """This process's environment with ``values`` (None: removed) for the block (a process started in it inherits
    it); restored after."""
    def put(vals: dict) -> None:
        for k, v in vals.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    old = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(old)


@contextlib.contextmanager
def file_limit(nofile: int):
    """This process's soft RLIMIT_NOFILE at most ``nofile`` for the block (a process started in it inherits it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ----------------------------------------------------------------------------- the service on this host
class Service(ServiceProcess):
    """``python -m asap_comm.serving.server --port 0 ARGS`` in a subprocess (see ``ServiceProcess``), with
    :attr:`client` (httpx, ``http_timeout_s`` per call), /health and /metrics reads, and the files it added to
    /dev/shm. ``nofile``: start it with that file limit (:func:`file_limit`); ``env``: with these environment
    variables (:func:`environ`; e.g. ``{"ASAP_API_KEY": key}``)."""

    def __init__(self, args: list, start_timeout_s: float = 240.0, cwd: "str | None" = None,
                 http_timeout_s: float = 60.0, nofile: "int | None" = None, env: "dict | None" = None) -> None:
        self.segments_before = shm_files()
        with contextlib.ExitStack() as started_with:
            if nofile is not None:
                started_with.enter_context(file_limit(nofile))
            if env:
                started_with.enter_context(environ(env))
            super().__init__(["--port", "0", *args], start_timeout_s=start_timeout_s, cwd=cwd)
        self.client = httpx.Client(base_url=self.url, timeout=http_timeout_s)
        host, _, port = self.url.split("//")[1].partition(":")
        self.addr = (host, int(port.strip("/")))

    def running(self) -> bool:
        return self.proc.poll() is None

    def health(self) -> tuple:
        """``(status, body)`` of GET /health (status 0: no answer; the body then names the error)."""
        try:
            r = self.client.get("/health")
            return r.status_code, r.json()
        except (httpx.HTTPError, ValueError) as e:
            return 0, {"error": f"{type(e).__name__}: {e}"}

    def wait_health(self, pred, timeout_s: float) -> tuple:
        """Poll /health until ``pred(status, body)``, the service ends or ``timeout_s`` passes; the last answer
        (a bound, not a speed check)."""
        deadline = time.monotonic() + timeout_s
        while True:
            status, body = self.health()
            if pred(status, body) or time.monotonic() > deadline or not self.running():
                return status, body
            time.sleep(0.2)

    def metrics(self, name: "str | None" = None) -> dict:
        """``{(name, labels as a sorted tuple): value}`` of the samples of /metrics (those called ``name``)."""
        from prometheus_client.parser import text_string_to_metric_families

        r = self.client.get("/metrics")
        if r.status_code != 200:
            raise RuntimeError(f"Service.metrics: GET /metrics answered {r.status_code}: {r.text[:200]}")
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if name is None or s.name == name:
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def metric(self, name: str, **labels) -> float:
        return self.metrics(name).get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_metric(self, name: str, pred, timeout_s: float = 30.0, **labels) -> float:
        """Poll the metric until ``pred(value)`` or ``timeout_s``; the last value."""
        deadline = time.monotonic() + timeout_s
        while True:
            v = self.metric(name, **labels)
            if pred(v) or time.monotonic() > deadline:
                return v
            time.sleep(0.02)

    def new_segments(self) -> set:
        return shm_files() - self.segments_before

    def close(self, timeout_s: float = 60.0) -> "int | None":
        """Stop it if it runs (SIGTERM, bounded) and close the client; its exit status."""
        code = self.proc.poll()
        if code is None:
            try:
                code = self.stop(timeout_s=timeout_s)
            except TimeoutError:
                code = None
        self.client.close()
        return code


_FLOOD = r"""
import asyncio, json, sys, time
import aiohttp
url, key, calls, tokens, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
counts = {}
async def one(session, stop):
    # ids every preset's vocabulary holds; with tokens < 0, -tokens ids no vocabulary holds (each call a 400)
    body = {"prompt": [1 + i % 127 for i in range(tokens)] if tokens > 0 else [10 ** 9] * -tokens, "max_tokens": 1}
    while time.monotonic() < stop:
        try:
            async with session.post(url + "/v1/completions", json=body,
                                    headers={"Authorization": "Bearer " + key} if key else None) as r:
                await r.read()
                counts[str(r.status)] = counts.get(str(r.status), 0) + 1
                if r.status == 429:
                    await asyncio.sleep(0.05)
        except aiohttp.ClientError:
            counts["error"] = counts.get("error", 0) + 1
async def main():
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, local_addr=("127.0.0.2", 0))) as s:
        print("flooding", flush=True)
        await asyncio.gather(*(one(s, stop) for _ in range(calls)))
    print(json.dumps(counts), flush=True)
asyncio.run(main())
"""


class Flood:
    """Client A, from 127.0.0.2 (a client of its own to the service's fairness): ``calls`` calls of ``tokens``
    tokens kept in flight for ``seconds`` (a 429 waits 50 ms), in a subprocess; ``tokens`` < 0: calls of
    ``-tokens`` ids past every vocabulary (each answered 400: a flood of bad calls). ``with Flood(...) as f:`` the
    block starts once it floods; after the block (it waits for the flood's end, bounded), :attr:`counts` is
    ``{status as a string or "error": calls}``."""

    def __init__(self, url: str, calls: int, tokens: int, seconds: float, api_key: str = "") -> None:
        self.seconds = seconds
        self.counts: dict = {}
        self.proc = subprocess.Popen([sys.executable, "-c", _FLOOD, url, api_key, str(calls), str(tokens),
                                      str(seconds)], stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> "Flood":
        if self.proc.stdout.readline().strip() != "flooding":
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise RuntimeError(f"Flood: the flooding client did not start (exit {self.proc.returncode})")
        return self

    def __exit__(self, *exc) -> None:
        try:
            out, _ = self.proc.communicate(timeout=self.seconds + 60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=30)
        lines = (out or "").strip().splitlines()
        self.counts = json.loads(lines[-1]) if lines else {}


# ----------------------------------------------------------------------------- hostile bodies
def ids_body(num_bytes: int) -> bytes:
    """A ``{"prompt": [...]}`` body of about ``num_bytes`` bytes of token ids (``"123, "``)."""
    return b'{"prompt": [' + b"123, " * (num_bytes // 5) + b'1]}'


def _address(url: str) -> tuple:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


def _probe_health(url: str, seconds: float, every_s: float) -> list:
    """``GET /health`` on one keep-alive connection every ``every_s`` for ``seconds``: latencies (s)."""
    import http.client

    conn = http.client.HTTPConnection(*_address(url), timeout=60)
    out = []
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            t = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            out.append(time.perf_counter() - t)
            if r.status != 200:
                raise RuntimeError(f"hostile_scenario: /health answered {r.status} while probed")
            time.sleep(every_s)
    finally:
        conn.close()
    return out


def _send_bodies(url: str, body: bytes, chunked: bool, stop, tally: dict) -> None:
    """Send ``body`` as a /v1/completions request again and again until ``stop``; count the answers' statuses
    (``"reset"``: the connection closed before an answer could be read) and the bytes sent."""
    import socket

    piece = 1 << 20
    while not stop.is_set():
        head = b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        head += b"Transfer-Encoding: chunked\r\n\r\n" if chunked else b"Content-Length: %d\r\n\r\n" % len(body)
        status = "reset"
        try:
            with socket.create_connection(_address(url), timeout=60) as s:
                s.sendall(head)
                for i in range(0, len(body), piece):
                    part = body[i:i + piece]
                    s.sendall(b"%x\r\n" % len(part) + part + b"\r\n" if chunked else part)
                    tally["bytes"] = tally.get("bytes", 0) + len(part)
                if chunked:
                    s.sendall(b"0\r\n\r\n")
                answer = s.recv(64)
                if answer.startswith(b"HTTP/1.1 "):
                    status = answer[9:12].decode()
        except OSError:
            pass
        tally[status] = tally.get(status, 0) + 1


def hostile_scenario(url: str, body: "bytes | None", chunked: bool, senders: int = 4, seconds: float = 4.0,
                     every_s: float = 0.005) -> dict:
    """/health latency on one keep-alive connection (a probe every ``every_s`` for ``seconds``) while
    ``senders`` threads send ``body`` again and again (Content-Length, or ``chunked``; ``None``: unloaded).
    ``{"probes", "p50_ms", "p99_ms", "max_ms", "mb_sent", "answers": {status or "reset": count}}``."""
    import threading

    stop = threading.Event()
    tallies = [{} for _ in range(senders)]
    threads = [threading.Thread(target=_send_bodies, args=(url, body, chunked, stop, t), daemon=True)
               for t in tallies] if body is not None else []
    for t in threads:
        t.start()
    try:
        lat = _probe_health(url, seconds, every_s)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    total: dict = {}
    for t in tallies:
        for k, v in t.items():
            total[k] = total.get(k, 0) + v
    lat.sort()
    pick = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))])
    return {"probes": len(lat), "p50_ms": pick(0.5) * 1e3, "p99_ms": pick(0.99) * 1e3, "max_ms": lat[-1] * 1e3,
            "mb_sent": total.pop("bytes", 0) / 1e6, "answers": total}


# ----------------------------------------------------------------------------- calls from inside a simulated host
_HTTP = r"""
import json, sys, time, urllib.request, urllib.error
url, method, body, repeat, pause = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
for i in range(repeat):
    data = None if method == "GET" else json.dumps(body if not isinstance(body, list) else body[i % len(body)]).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out = (r.status, json.loads(r.read() or b"null"))
    except urllib.error.HTTPError as e:
        out = (e.code, json.loads(e.read() or b"null"))
    except Exception as e:
        out = (0, str(e))
    print(json.dumps(out), flush=True)
    time.sleep(pause)
"""


def http_in_host(host, path: str, port: int, body=None, repeat: int = 1, pause: float = 0.0, wait: bool = True):
    """Requests from inside simulated ``host`` (its loopback), one after another, each with a 60 s timeout:
    ``[(status, json body)]`` (status 0: no answer, the body is the error text), or the running process (its
    stdout: one such JSON pair a line) when ``wait`` is false. ``body``: a list of bodies is sent in turn."""
    p = host.popen([sys.executable, "-c", _HTTP, f"http://127.0.0.1:{port}{path}", "GET" if body is None else "POST",
                    json.dumps(body), str(repeat), str(pause)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)
    if not wait:
        return p
    out = p.communicate(timeout=120)[0]
    return [tuple(json.loads(line)) for line in out.splitlines() if line.startswith("[")]


def host_health(host, port: int) -> tuple:
    """``(status, body)`` of /health from inside ``host`` (``(0, None)``: no answer line)."""
    got = http_in_host(host, "/health", port)
    return got[0] if got else (0, None)


_CLIENTS = r"""
import json, sys, threading, time, urllib.request, urllib.error
url, prompts, seconds, threads = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
end = time.monotonic() + seconds
lock = threading.Lock()
def client(k):
    i = k
    while time.monotonic() < end:
        p = i % len(prompts)
        data = json.dumps({"prompt": prompts[p]}).encode()
        req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                out = [r.status, p, json.loads(r.read())["choices"][0]["token_ids"][0]]
        except urllib.error.HTTPError as e:
            out = [e.code, p, e.read().decode()[:300]]
        except Exception as e:
            out = [0, p, str(e)[:300]]
        with lock:
            print(json.dumps(out + [round(t0, 3), round(time.monotonic(), 3)]), flush=True)
        i += threads
threads_ = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
for t in threads_: t.start()
for t in threads_: t.join()
"""


def long_clients(host, port: int, prompts: list, seconds: float, threads: int = 4) -> subprocess.Popen:
    """``threads`` clients in ``host`` calling /v1/completions with ``prompts`` in turn for ``seconds``, each call
    allowed 300 s (a call may wait out a stopped worker); the process's stdout has one JSON line per call:
    ``[status, prompt index, first token or error, start, end]`` (CLOCK_MONOTONIC, shared with the caller;
    status 0: no answer)."""
    return host.popen([sys.executable, "-c", _CLIENTS, f"http://127.0.0.1:{port}/v1/completions", json.dumps(prompts),
                       str(seconds), str(threads)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def calls(proc: subprocess.Popen, timeout: float) -> list:
    """The calls ``proc`` (from :func:`long_clients`) made, once it ended."""
    return [json.loads(x) for x in proc.communicate(timeout=timeout)[0].splitlines() if x.startswith("[")]


# ----------------------------------------------------------------------------- the service across simulated hosts
def serve_across_hosts(hosts, port: int, args: list, layout: "list[int]" = (2, 3), peer_timeout_s: float = 3.0,
                       env: "dict | None" = None) -> "list[subprocess.Popen]":
    """``python -m asap_comm.serving.server --model tiny --port PORT --attention-ranks 2 --expert-ranks 2 ARGS``
    under torchrun, ``layout[i]`` processes on host ``i`` (the default: the front end and attention PE 0 on node
    0; attention PE 1 and expert PEs 2, 3 on node 1), ``ASAP_NET_PEER_TIMEOUT_S`` = ``peer_timeout_s``; ``env``
    adds to (or, with None values, removes from) this process's environment. Returns the torchrun processes."""
    from asap_comm.testing.netns import torchrun

    return torchrun(hosts, list(layout), ["-m", "asap_comm.serving.server", "--model", "tiny", "--port", str(port),
                                          "--attention-ranks", "2", "--expert-ranks", "2", *args],
                    env={**os.environ, "ASAP_NET_PEER_TIMEOUT_S": str(peer_timeout_s), **(env or {})})


def wait_host_health(host, port: int, procs: list, timeout_s: float = 300.0) -> dict:
    """Poll /health from inside ``host`` until 200; its body. ``RuntimeError`` with the launchers' logs when
    one of ``procs`` ends first or ``timeout_s`` passes (a hang guard for the start-up, not a speed check)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = host_health(host, port)
        if status == 200:
            return body
        ended = [p for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            logs = "\n".join(f"--- launcher {i} (exit {p.returncode}):\n" + (p.communicate(timeout=10)[0] or "")[-3000:]
                             for i, p in enumerate(procs) if p.poll() is not None)
            raise RuntimeError(f"the service on {host.hostname} did not answer /health 200 "
                               f"{'before a launcher ended' if ended else f'within {timeout_s:g} s'}\n{logs}")
        time.sleep(1.0)


def end_service(hosts, procs: list) -> list:
    """SIGTERM to node 0's launcher (the front end drains and stops every worker); the logs of every node's
    launcher (each wait bounded; past it, every host's processes are killed)."""
    procs[0].send_signal(signal.SIGTERM)
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0] or "")
        except subprocess.TimeoutExpired:
            for h in hosts.hosts:
                h.kill_all()
            logs.append(p.communicate(timeout=30)[0] or "")
    return logs


def host_leftovers(host, timeout_s: float = 30.0) -> tuple:
    """``(pids, asap segments)`` left on a simulated host: processes other than its holder (waited for up to
    ``timeout_s``) and the ``asap-*`` files of its /dev/shm."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = subprocess.run(["ip", "netns", "pids", host.ns], capture_output=True, text=True,
                              timeout=30).stdout.split()
        left = [int(p) for p in pids if int(p) != host.holder.pid]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    ls = host.popen(["sh", "-c", "ls -a /dev/shm"], stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0]
    return left, [f for f in ls.split() if f.startswith("asap-")]
