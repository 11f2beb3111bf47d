"""Who may join a group: the group secret, authenticated store values, loopback-only stores.

A group's rendezvous goes through a ``torch.distributed`` Store (a TCPStore),
which anyone who reaches its port may read and write. Nothing a PE reads
there is used on trust:

* **Keys an outsider cannot name.** Every key of a group lives under
  ``asap/<tag>/<generation>/``, where ``tag`` is derived from the group secret
  (HMAC-SHA256), so a process without the secret can neither predict a key
  (to plant a value before the group reads it) nor bump a counter the group
  relies on (the join counter and the rendezvous counters live there too).
* **Values an outsider cannot forge.** Every value carries an HMAC-SHA256 over
  the group's key prefix, the key and the value; a value that fails the check
  is never used: :meth:`GroupStore.get` raises ``CommError`` naming the key.
  The MAC binds the value to its key and generation, so a value cannot be
  moved to another key or replayed into a later group of the same store.
* **Bounded reads.** A value longer than ``MAX_VALUE_BYTES`` is refused before
  it is looked at (a store cannot refuse to *send* a long value, but only the
  group can write under its keys).

Where the secret comes from (:func:`resolve_secret`): the ``group_secret``
argument of ``init``, else ``$ASAP_GROUP_SECRET`` (which every host of a group
that spans hosts must set, to the same value), else, for a group on one host
(torchrun on one machine), a secret that rank 0 writes into a file that only
the same user can read (mode 0600, in ``/dev/shm`` under a random name): the
other PEs read it, rank 0 removes it once they have joined. ``asap_comm.launch``
(and every launcher of the project, which all go through it) generates a fresh
secret for its children. A group whose PEs span hosts without a shared secret
refuses to start, saying how to set one.

Stores that this package hosts for a group on one host listen on 127.0.0.1
only (:func:`loopback_store`): torch's TCPStore binds every interface unless
it is handed an already-bound socket, which is what this module does.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import socket
import stat
from datetime import timedelta
from typing import NamedTuple

from .errors import CommError
from .errors import TimeoutError as CommTimeoutError

__all__ = ["SECRET_ENV", "MAX_VALUE_BYTES", "new_secret", "Secret", "GroupStore", "resolve_secret", "loopback_store",
           "bound_store", "secret_token", "gloo_group"]

SECRET_ENV = "ASAP_GROUP_SECRET"
MAX_VALUE_BYTES = 64 * 1024  # the longest value a PE accepts from the store (a UCX address is ~200 bytes)
_MAC_BYTES = 32
_MIN_SECRET_CHARS = 16
_SET_HINT = ("set the same secret on every host, e.g. `export ASAP_GROUP_SECRET=$(python -c "
             "\"import secrets; print(secrets.token_hex(32))\")` before torchrun on each host")


def new_secret() -> str:
    """A fresh group secret: 256 random bits as 64 hex characters."""
    return secrets.token_hex(32)


def _check_secret(secret, where: str) -> bytes:
    if not isinstance(secret, str):
        raise TypeError(f"init: the group secret must be a str, got {type(secret).__name__} (from {where})")
    if len(secret) < _MIN_SECRET_CHARS:
        raise ValueError(f"init: the group secret from {where} has {len(secret)} characters; use at least "
                         f"{_MIN_SECRET_CHARS} random ones (e.g. 64 hex characters from secrets.token_hex(32))")
    return secret.encode()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def secret_token(secret: "str | bytes", label: str) -> str:
    """A string that only holders of ``secret`` can compute (32 hex characters), e.g. a private store prefix
    for a side channel such as the baseline's gloo rendezvous."""
    key = secret if isinstance(secret, bytes) else _check_secret(secret, "secret_token")
    return _mac(key, b"asap-token-v1", label.encode()).hex()[:32]


class GroupStore:
    """A group's view of a rendezvous store: authenticated values under keys only its members can name.

    ``join()`` takes this PE's generation (the group's ``join`` counter, under the secret's namespace, so
    several groups may use one store one after another); ``set``/``get``/``rendezvous`` then work under
    that generation's prefix.
    """

    def __init__(self, store, secret: bytes, world_size: int, timeout_s: float) -> None:
        self._store, self._key, self._world, self._timeout = store, secret, world_size, timeout_s
        self._ns = "asap/" + _mac(secret, b"asap-namespace-v1").hex()[:32] + "/"
        self.prefix = ""

    def join(self) -> int:
        """Count this PE in; returns the generation it belongs to (``(count - 1) // world_size``)."""
        n = self._store.add(self._ns + "join", 1)
        gen = (n - 1) // self._world
        self.prefix = f"{self._ns}{gen}/"
        return gen

    def _mac_of(self, key: str, value: bytes) -> bytes:
        return _mac(self._key, b"asap-value-v1", self.prefix.encode(), key.encode(), value)

    def set(self, key: str, value: "bytes | str") -> None:
        """Publish ``value`` under ``key`` with its MAC."""
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if len(raw) > MAX_VALUE_BYTES:
            raise ValueError(f"init: store value {key!r} of {len(raw)} bytes is longer than {MAX_VALUE_BYTES}")
        self._store.set(self.prefix + key, self._mac_of(key, raw) + raw)

    def get(self, key: str, what: "str | None" = None) -> bytes:
        """The value a member published under ``key`` (waits for it, bounded by the store's timeout); raises
        ``CommError`` naming the key if the value is too long or fails authentication."""
        try:
            raw = self._store.get(self.prefix + key)
        except Exception as e:  # torch raises DistStoreError on timeout, DistNetworkError when the store is gone
            raise _store_error(e, what or "store key " + repr(key)) from None
        if len(raw) > MAX_VALUE_BYTES + _MAC_BYTES:
            raise CommError(f"init: store value {key!r} is {len(raw)} bytes, more than the {MAX_VALUE_BYTES} a "
                            "member publishes; refusing it (someone other than the group wrote it)")
        mac, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, self._mac_of(key, value)):
            raise CommError(f"init: store value {key!r} failed authentication with the group secret: it was not "
                            "written by a member of this group (a process without the secret, or a PE started "
                            f"with another {SECRET_ENV}); nothing it names was used")
        return value

    def get_str(self, key: str, what: "str | None" = None) -> str:
        return self.get(key, what).decode("utf-8", "strict")

    def rendezvous(self, key: str) -> None:
        """Wait until every PE of the group has called ``rendezvous(key)``."""
        n = self._store.add(self.prefix + key, 1)
        if n == self._world:  # the last to arrive: done, and nothing left to wait for (the PE hosting the store
            self.set(key + "/done", b"1")  # may leave as soon as it sees the key, so do not wait on it here)
            return
        try:  # (only a member can name the key: its existence is the signal)
            self._store.wait([self.prefix + key + "/done"], timedelta(seconds=self._timeout))
        except Exception as e:
            err = _store_error(e, f"rendezvous {key!r}")
            if isinstance(err, CommTimeoutError):
                err = CommTimeoutError(f"init: rendezvous {key!r} did not complete within {self._timeout} s "
                                       f"({n}/{self._world} PEs arrived when this PE did): {e}")
            raise err from None


def _store_error(e: Exception, what: str) -> CommError:
    """A store failure as the documented error: ``TimeoutError`` when the wait ran out, ``CommError`` when the
    store itself went away (its host, rank 0, exited: e.g. it refused the group first)."""
    import torch.distributed as dist

    if isinstance(e, dist.DistNetworkError):
        return CommError(f"init: lost the rendezvous store while waiting for {what} (the PE hosting it may have "
                         f"exited): {e}")
    return CommTimeoutError(f"init: waiting for {what} failed: {e}")


# ----------------------------------------------------------------------------- where the secret comes from
_FILE_KEY = "asap/local-secret/"
_TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")


class Secret(NamedTuple):
    """A group's secret as :func:`resolve_secret` found it."""

    key: bytes
    source: str  # "argument", "environment", "generated" (a group of one PE) or "file" (one host, rank 0's file)
    file: "str | None" = None  # rank 0 of a "file" group: the file to remove once every PE joined


def resolve_secret(store, rank: int, world_size: int, host_id: str, group_secret, shm_prefix: str) -> Secret:
    """The group secret: see the module docstring for where it comes from, in this order."""
    if group_secret is not None:
        return Secret(_check_secret(group_secret, "the group_secret argument"), "argument")
    env = os.environ.get(SECRET_ENV)
    if env:
        return Secret(_check_secret(env, f"${SECRET_ENV}"), "environment")
    if world_size == 1:
        return Secret(new_secret().encode(), "generated")
    return _file_secret(store, rank, world_size, host_id, shm_prefix)


def spans_hosts_without_secret(hosts: "list[str]") -> CommError:
    """The error of a group whose PEs turned out to span hosts while its secret came from a one-host file."""
    return CommError(f"init: this group spans {len(set(hosts))} hosts and no {SECRET_ENV} is set: a group across "
                     f"hosts needs a shared secret; {_SET_HINT}")


def _file_secret(store, rank: int, world_size: int, host_id: str, shm_prefix: str) -> Secret:
    """One host, no secret given: rank 0 writes a fresh secret into a 0600 file; the others read it.

    The store value naming the file is not secret (it says which file, not what is in it), and a PE accepts
    the file only if it is a regular file of this user with no access for anyone else, so a planted value
    can at worst make ``init`` fail, never make a PE use a secret that someone else knows."""
    gen = (store.add(_FILE_KEY + "join", 1) - 1) // world_size  # several groups may use one store in turn
    key = f"{_FILE_KEY}{gen}"
    if rank == 0:
        token = secrets.token_hex(16)
        path = f"/dev/shm/{shm_prefix}secret-{token}"
        secret = new_secret()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secret.encode())
        finally:
            os.close(fd)
        store.set(key, f"{host_id}\n{shm_prefix}\n{token}")
        return Secret(secret.encode(), "file", path)
    try:
        raw = store.get(key)
    except Exception as e:
        raise CommTimeoutError(f"init: waiting for rank 0's group secret failed: {e}") from None
    parts = raw[:512].decode("utf-8", "replace").split("\n")
    if len(parts) != 3 or not _TOKEN_RE.match(parts[2]) or "/" in parts[1]:
        raise CommError(f"init: no {SECRET_ENV} is set and the store's record of rank 0's secret file is "
                        f"malformed; {_SET_HINT}")
    if parts[0] != host_id:
        raise CommError(f"init: this group spans hosts (rank 0 on {parts[0]!r}, this PE on {host_id!r}) and no "
                        f"{SECRET_ENV} is set: a group across hosts needs a shared secret; {_SET_HINT}")
    path = f"/dev/shm/{parts[1]}secret-{parts[2]}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CommError(f"init: no {SECRET_ENV} is set and rank 0's secret file {path} cannot be read ({e}); "
                        f"{_SET_HINT}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise CommError(f"init: rank 0's secret file {path} is not a private file of this user (mode "
                            f"{oct(st.st_mode & 0o777)}, uid {st.st_uid}); refusing it")
        secret = os.read(fd, 256)
    finally:
        os.close(fd)
    return Secret(_check_secret(secret.decode("ascii", "replace"), path), "file")


# ----------------------------------------------------------------------------- stores that listen where asked
def bound_store(addr: str, port: int, world_size: "int | None", timeout_s: float):
    """Host a ``TCPStore`` listening on ``addr`` only (not on every interface, as TCPStore does by itself):
    the socket is bound here and handed to the store. ``port`` 0 picks a free port (``store.port``)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    infos = socket.getaddrinfo(addr, port, family, socket.SOCK_STREAM)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the descriptor from here (it closes it when it goes)
    try:
        return TCPStore(addr, bound_port, world_size, True, timedelta(seconds=timeout_s),
                        wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def loopback_store(timeout_s: float = 30.0, world_size: "int | None" = None):
    """Host a ``TCPStore`` on a free port of 127.0.0.1 only (``store.port``): for groups on one host."""
    return bound_store("127.0.0.1", 0, world_size, timeout_s)


def gloo_group(store, prefix: str, rank: int, world_size: int, timeout_s: float, loopback: bool) -> None:
    """``torch.distributed.init_process_group("gloo")`` through ``store`` under key prefix ``prefix`` (pass one
    an outsider cannot name, e.g. ``comm.secret_token(...)``). ``loopback``: every rank is on this host, so
    gloo's own connections listen on 127.0.0.1 only (by default gloo binds the address its hostname resolves
    to); otherwise gloo picks the host's interface as usual."""
    import torch.distributed as dist

    opts = None
    if loopback:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), pg_options=opts)


def host_summary(hosts: "list[str]") -> str:
    """``'h0': PEs [0, 1], 'h1': PEs [2, 3]``: which PEs run on which host, for error messages."""
    by: "dict[str, list[int]]" = {}
    for pe, h in enumerate(hosts):
        by.setdefault(h, []).append(pe)
    return ", ".join(f"{h!r}: PEs {pes}" for h, pes in by.items())
