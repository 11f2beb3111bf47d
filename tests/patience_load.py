"""Load for the stall tests across hosts: clients that keep calls in flight for minutes (a call may wait out a
stopped worker), from inside a simulated host. Used by tests/test_multihost_patience.py and bench/faults.py."""
import json
import subprocess
import sys

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
    allowed 300 s; the process's stdout has one JSON line per call: ``[status, prompt index, first token or error,
    start, end]`` (CLOCK_MONOTONIC, shared with the caller; status 0: no answer)."""
    return host.popen([sys.executable, "-c", _CLIENTS, f"http://127.0.0.1:{port}/v1/completions", json.dumps(prompts),
                       str(seconds), str(threads)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def calls(proc: subprocess.Popen, timeout: float) -> list:
    """The calls ``proc`` (from :func:`long_clients`) made, once it ended."""
    return [json.loads(x) for x in proc.communicate(timeout=timeout)[0].splitlines() if x.startswith("[")]
