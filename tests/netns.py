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
the tests turn a missing capability into a failure there (``$CI`` set).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

_WRAP = ('mount -t tmpfs -o size=4g,mode=1777 tmpfs /dev/shm && hostname "$ASAP_NETNS_HOSTNAME" '
         '&& exec "$@"')


def unavailable() -> "str | None":
    """Why simulated hosts cannot be built here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    for tool in ("ip", "unshare"):
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

    def popen(self, argv: "list[str]", env: "dict | None" = None, **kw) -> subprocess.Popen:
        """Start ``argv`` on this host (its namespaces, hostname and /dev/shm)."""
        e = dict(os.environ if env is None else env)
        e["ASAP_NETNS_HOSTNAME"] = self.hostname
        cmd = ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--propagation", "private",
               "sh", "-c", _WRAP, "sh", *argv]
        p = subprocess.Popen(cmd, env=e, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def link_down(self) -> None:
        """Cut this host off the network (its processes keep running)."""
        _ip("-n", self.ns, "link", "set", "dev", self.link, "down")

    def kill_all(self) -> None:
        """SIGKILL every process this host started (as if the host disappeared)."""
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

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        for h in self.hosts:
            h.kill_all()
        deadline = time.monotonic() + 10
        for h in self.hosts:
            for p in h.procs:
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
