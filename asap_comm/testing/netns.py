"""Simulated hosts for multi-host tests: network namespaces joined by veth pairs.

``Hosts(n)`` builds ``n`` "hosts" on this machine, each with

* its own network namespace, whose only link is a veth pair on a private
  address (10.x.y.0/24, x and y random so concurrent runs do not collide)
  leading to a bridge in one more namespace (the "switch");
* its own mount namespace with a private ``/dev/shm`` (a fresh tmpfs), so
  shared memory cannot leak from one host to another;
* its own UTS namespace and hostname, so hosts are told apart by hostname as
  on a real cluster.

Nothing is routed anywhere else: the namespaces have no default route and
the bridge lives in a namespace of its own. Everything is deleted on exit,
including after a failure (the namespaces' deletion removes their links).

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and ``ip``/``unshare``;
:func:`unavailable` says why not when they are missing. CI runs as root, and
the tests turn a missing capability into a failure there (``$CI`` set); the
tests that build hosts carry the ``netns`` marker.
"""
from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

# Inside the new namespaces: a private /dev/shm, the host's name, and an /etc/hosts that resolves it (as a
# cluster's DNS would; gloo and c10d look their own hostname up).
_SETUP = ('mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && hostname "$ASAP_NETNS_HOSTNAME" '
          '&& printf "127.0.0.1 localhost\\n%s\\n" "$ASAP_NETNS_HOSTS" > /dev/shm/.asap-hosts '
          '&& mount --bind /dev/shm/.asap-hosts /etc/hosts && echo ready && exec sleep 86400')


def unavailable() -> "str | None":
    """Why simulated hosts cannot be built here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    name = f"asapchk{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def why_no_hosts() -> "str | None":
    """Why a group cannot span simulated hosts here (:func:`unavailable`; or asap_comm built without the network
    backend; or libucx missing), or None if it can."""
    why = unavailable()
    if why is not None:
        return why
    from asap_comm._native import _C

    if not getattr(_C, "NET_AVAILABLE", False):
        return "asap_comm was built without the network backend (UCX headers missing at build time)"
    try:
        import libucx  # noqa: F401
    except ImportError:
        return "the network backend needs libucx-cu12: pip install -e '.[net]' (the test extra includes it)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    index: int
    ns: str
    hostname: str
    addr: str
    link: str  # the host's end of its veth pair (inside ns)
    procs: list = field(default_factory=list)
    hosts_file: str = ""  # lines of /etc/hosts naming every simulated host

    holder: "subprocess.Popen | None" = None  # the process whose namespaces are this host

    def popen(self, argv: "list[str]", env: "dict | None" = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on this host (its network, mount and UTS namespaces: hostname, /dev/shm)."""
        cmd = ["nsenter", "-t", str(self.holder.pid), "-m", "-u", "-n", f"--wd={os.getcwd()}", "--", *argv]
        p = subprocess.Popen(cmd, env=env, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def _start_holder(self) -> None:
        e = dict(os.environ, ASAP_NETNS_HOSTNAME=self.hostname, ASAP_NETNS_HOSTS=self.hosts_file)
        self.holder = subprocess.Popen(["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts",
                                        "--propagation", "private", "sh", "-c", _SETUP], env=e,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.holder.kill()
            raise RuntimeError(f"simulated host {self.hostname}: setting up its namespaces failed: "
                               f"{self.holder.stderr.read().strip()}")

    def link_down(self) -> None:
        """Cut this host off the network (its processes keep running)."""
        _ip("-n", self.ns, "link", "set", "dev", self.link, "down")

    def kill_all(self) -> None:
        """SIGKILL every process running on this host (as if the host disappeared); the host stays.

        Found by network namespace (``ip netns pids``), so processes that left their launcher's
        process group (torchrun's workers do) go too; the host's holder process is spared."""
        for _ in range(3):
            r = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True)
            pids = [int(x) for x in r.stdout.split() if x.isdigit()]
            victims = [pid for pid in pids if self.holder is None or pid != self.holder.pid]
            if not victims:
                break
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Hosts:
    """A context manager: ``with Hosts(2) as hosts: hosts[0].popen([...])``."""

    def __init__(self, n: int = 2) -> None:
        if n < 1:
            raise ValueError(f"Hosts: n={n} must be >= 1")
        self.n = n
        tag = f"{os.getpid() % 100000}{random.randrange(1000):03d}"
        self._tag = tag
        self.subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.switch = f"asapsw{tag}"
        self.hosts: "list[Host]" = []
        self._made: "list[str]" = []

    def __enter__(self) -> "Hosts":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.n):
            ns = f"asaph{i}x{self._tag}"
            _ip("netns", "add", ns)
            self._made.append(ns)
            a, b = f"ah{i}x{self._tag}"[:15], f"as{i}x{self._tag}"[:15]
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", b, "master", "br0")
            _ip("-n", self.switch, "link", "set", b, "up")
            addr = f"{self.subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", a)
            _ip("-n", ns, "link", "set", a, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(Host(i, ns, f"asap-host{i}", addr, a))
        lines = "\n".join(f"{h.addr} {h.hostname}" for h in self.hosts)
        for h in self.hosts:
            h.hosts_file = lines
            h._start_holder()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        for h in self.hosts:
            h.kill_all()
            if h.holder is not None and h.holder.poll() is None:
                os.killpg(h.holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for h in self.hosts:
            for p in h.procs + ([h.holder] if h.holder is not None else []):
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __exit__(self, *exc) -> None:
        self.close()


def free_port() -> int:
    """A port that is free on every simulated host: they each have their own port space, so any
    high port works; choose at random from the ephemeral-free range."""
    return random.randrange(20000, 30000)


# ----------------------------------------------------------------------------- running a group across hosts
_WORKER = ["-m", "asap_comm.testing.worker"]  # one PE: joins, runs the function, pickles its result


def run_across_hosts(hosts: Hosts, layout: "list[int]", fn, *args, timeout: float = 120.0,
                     env: "dict | None" = None, expect_fail: "set[int] | None" = None, during=None,
                     launcher: str = "python") -> list:
    """Run ``fn(comm, *args)`` on ``sum(layout)`` PEs, ``layout[i]`` of them on host ``i`` (ranks in host order),
    each joining with ``asap_comm.init()`` from the torchrun-style environment; returns every PE's result.

    ``fn`` must be a module-level function; the PEs import its module (its directory goes on their
    ``PYTHONPATH``, so a test module's or a script's functions work). Every wait is bounded: a PE that does not end within
    ``timeout`` s fails the call. ``expect_fail``: ranks allowed to end without a result (their result is None).
    ``during(hosts, procs)``: called once every PE has started (to kill a host, cut a link, ...).
    ``launcher``: ``"python"`` starts each PE itself; ``"torchrun"`` starts one ``torchrun --nnodes N
    --nproc-per-node layout[i] --node-rank i`` per host (static rendezvous on host 0), as a user would.
    """
    import pickle
    import tempfile

    world = sum(layout)
    port = free_port()
    out = tempfile.mkdtemp(prefix="asap-multihost-")
    with open(os.path.join(out, "args.pkl"), "wb") as f:
        pickle.dump(args, f)
    procs = []
    mod = sys.modules[fn.__module__]
    name = fn.__module__
    if name == "__main__":  # a script's function: import the script by its file name
        name = os.path.splitext(os.path.basename(mod.__file__))[0]
    target = f"{name}:{fn.__qualname__}"
    base = dict(os.environ if env is None else {**os.environ, **env})
    where = os.path.dirname(os.path.abspath(mod.__file__))
    base["PYTHONPATH"] = os.pathsep.join(p for p in (where, base.get("PYTHONPATH", "")) if p)
    base["ASAP_TEST_DUMP_AFTER"] = str(max(1.0, timeout - 8))  # a hung PE prints its stacks before the kill
    base = with_secret(base)
    if launcher == "torchrun":
        procs = torchrun(hosts, layout, [*_WORKER, target, out], env=base, port=port)
    elif launcher == "python":
        rank = 0
        for h, n in enumerate(layout):
            for local in range(n):
                e = dict(base, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                         LOCAL_WORLD_SIZE=str(n), MASTER_ADDR=hosts[0].addr, MASTER_PORT=str(port))
                procs.append(hosts[h].popen([sys.executable, *_WORKER, target, out], env=e,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
                rank += 1
    else:
        raise ValueError(f"run_across_hosts: launcher={launcher!r} must be 'python' or 'torchrun'")
    try:
        if during is not None:
            try:
                during(hosts, procs)
            except AssertionError as e:
                for h in hosts.hosts:
                    h.kill_all()
                tails = [f"--- process {i}:\n" + (q.communicate(timeout=5)[0] or "")[-3000:]
                         for i, q in enumerate(procs)]
                raise AssertionError(f"{e}\n" + "\n".join(tails)) from None
        deadline = time.monotonic() + timeout
        logs = []
        for r, p in enumerate(procs):
            try:
                text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                tails = []
                for h in hosts.hosts:
                    h.kill_all()
                for i, q in enumerate(procs):
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                    try:
                        tails.append(f"--- process {i}:\n" + (q.communicate(timeout=5)[0] or "")[-3000:])
                    except Exception:
                        pass
                raise AssertionError(f"run_across_hosts: process {r} did not finish within {timeout} s "
                                     f"(layout {layout}, {fn.__qualname__})\n" + "\n".join(tails)) from None
            logs.append(text)
        if launcher == "torchrun":  # one log per host: give each PE its host's
            logs = [logs[_host_of(layout, r)] for r in range(world)]
            procs = [procs[_host_of(layout, r)] for r in range(world)]
        results = []
        for r in range(world):
            path = os.path.join(out, f"result-{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            elif expect_fail and r in expect_fail:
                results.append(None)
            else:
                raise AssertionError(f"run_across_hosts: PE {r} (host {hosts[_host_of(layout, r)].hostname}) failed "
                                     f"(exit {procs[r].returncode}):\n{logs[r][-4000:]}")
        return results
    finally:
        shutil.rmtree(out, ignore_errors=True)


def mark_ready(out_dir: str, rank: int) -> None:
    """On a PE of :func:`run_across_hosts`: say it is ready (``out_dir/ready-RANK`` holds its pid), for a ``during``
    that waits with :func:`wait_ready`."""
    tmp = os.path.join(out_dir, f".ready-{rank}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(out_dir, f"ready-{rank}"))


def wait_ready(out_dir: str, ranks, procs: list, timeout_s: float = 90.0) -> dict:
    """In a ``during``: wait until every PE of ``ranks`` called :func:`mark_ready`; ``{rank: pid}``. An
    ``AssertionError`` when one of ``procs`` ended first or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    paths = {r: os.path.join(out_dir, f"ready-{r}") for r in ranks}
    while not all(os.path.exists(p) for p in paths.values()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the PEs never started"
        time.sleep(0.05)
    out = {}
    for r, path in paths.items():
        with open(path) as f:
            out[r] = int(f.read())
    return out


def with_secret(env: "dict | None") -> dict:
    """``env`` (default: this process's) with a fresh ``ASAP_GROUP_SECRET`` unless it names one: a group across
    hosts needs one, as a user exports it on every host. ``{"ASAP_GROUP_SECRET": None}`` removes it."""
    env = dict(os.environ if env is None else env)
    if "ASAP_GROUP_SECRET" not in env:
        env["ASAP_GROUP_SECRET"] = secrets.token_hex(32)
    return {k: v for k, v in env.items() if v is not None}


def torchrun(hosts: Hosts, layout: "list[int]", argv: "list[str]", env: "dict | None" = None,
             port: "int | None" = None) -> "list[subprocess.Popen]":
    """Start ``torchrun --nnodes N --nproc-per-node layout[i] --node-rank i ... argv`` on every host ``i``
    (static rendezvous on host 0's address), all with one group secret (:func:`with_secret`); returns the
    torchrun processes (stdout+stderr piped, text)."""
    port = free_port() if port is None else port
    env = with_secret(env)
    return [hosts[h].popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(layout)}",
                            f"--nproc-per-node={n}", f"--node-rank={h}", f"--master-addr={hosts[0].addr}",
                            f"--master-port={port}", *argv],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for h, n in enumerate(layout)]


def _host_of(layout: "list[int]", rank: int) -> int:
    for h, n in enumerate(layout):
        if rank < n:
            return h
        rank -= n
    raise ValueError(rank)
