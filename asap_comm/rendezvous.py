"""Who may join a group: the group secret, authenticated store values, stores an outsider cannot jam.

A group's rendezvous goes through a ``torch.distributed`` Store. A TCPStore
(torchrun's agent store, or the one rank 0 hosts for ``init(master_addr=...)``)
can be reached by any process that reaches its port, and lets it list every
key (``list_keys``), read, overwrite, bump (``add``) and delete any of them.
Nothing a group needs can be taken from it that way:

* **No shared counter, no guessable generation.** Rank 0 picks this group's
  generation at random (128 bits); every other PE asks for it under a fresh
  random nonce (``asap/<tag>/ask/<rank>``) and accepts only rank 0's answer to
  that nonce (``asap/<tag>/gen/<rank>/<nonce>``), so a stale answer (an earlier
  group with the same secret on the same store) or a replayed one is never
  taken. Every key of the group then lives under ``asap/<tag>/<generation>/``;
  ``tag`` is an HMAC of the group secret. An outsider that lists the keys sees
  random names; bumping one of them (the store refuses ``add`` on a value that
  is not an integer, closing the adder's own connection) or creating a new one
  changes nothing the group reads.
* **Values an outsider cannot forge, and a forgery is only noise.** Every value
  carries an HMAC-SHA256 (group secret) over its key prefix, key and value. A
  value that fails the check (or is longer than ``MAX_VALUE_BYTES``) is never
  used: the reader counts it (:attr:`GroupStore.forged`; the ``asap_comm.rendezvous``
  logger warns of the first and sums them up once the group has formed) and keeps waiting for the authentic
  one, within the same time bound as before (the communicator's ``timeout``).
* **Values an outsider cannot make disappear.** A PE's :class:`Keeper` (``keeper.py``, a
  thread, with its own connection where the store can ``clone``) puts each of
  this PE's values back every few milliseconds while a peer may still need it:
  for the whole of group formation (until every PE passed the group's first
  barrier), and for ``timeout`` seconds after a value published later (a heap
  chunk's name). So an overwrite or delete only delays a reader, and only
  while the outsider keeps at it (a store that anyone can write to cannot
  guarantee more: a writer that never stops can hold any key; it cannot make
  a PE use a value that is not its group's).
* **Rendezvous without counters.** Each PE publishes its own authenticated
  arrival key; rank 0 gathers them and publishes the release.

Where the secret comes from (:func:`resolve_secret`): the ``group_secret``
argument of ``init``, else ``$ASAP_GROUP_SECRET`` (which every host of a group
that spans hosts must set, to the same value), else, for a group on one host
(torchrun on one machine), a secret that rank 0 writes into a file that only
the same user can read (mode 0600, in ``/dev/shm`` under a random name). The
other PEs ask for it under a fresh nonce; rank 0 answers with the file's name
and an HMAC of the nonce under the file's secret, so a PE accepts a file only
if it is a private file of this user whose secret proves the answer came from
this group's rank 0 (a planted or stale record is ignored and counted, and a
PE keeps waiting). Rank 0 removes the file once every PE has joined.
``asap_comm.launch`` (and every launcher of the project, which all go through
it) generates a fresh secret for its children. A group whose PEs span hosts
without a shared secret refuses to start, saying how to set one.

Stores: ``asap_comm.launch`` gives its children a ``FileStore`` in a private
directory (mode 0700): only the same user (and root) can reach it at all.
Stores that rank 0 hosts for ``init(master_addr=..., master_port=...)``
listen on ``master_addr`` only (127.0.0.1 for a group on one host;
:func:`bound_store`): torch's TCPStore binds every interface unless it is
handed an already-bound socket, which is what this module does. torch 2.13's
c10d stores offer no Unix socket and no authentication of their clients, so a
TCPStore stays listable and writable by every local user; the points above are
what keep a group formed and working on one.
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
from .keeper import _NOLOCK, Keeper, _Reader

__all__ = ["SECRET_ENV", "MAX_VALUE_BYTES", "new_secret", "Secret", "GroupStore", "Keeper", "resolve_secret",
           "loopback_store", "bound_store", "private_file_store", "secret_token", "gloo_group"]

SECRET_ENV = "ASAP_GROUP_SECRET"
MAX_VALUE_BYTES = 64 * 1024  # the longest value a PE accepts from the store (a UCX address is ~200 bytes)
_MAC_BYTES = 32
_MIN_SECRET_CHARS = 16
_MAX_ANSWERS = 64  # nonces rank 0 answers per PE (a replayer of old asks cannot make it keep more)
_SET_HINT = ("set the same secret on every host, e.g. `export ASAP_GROUP_SECRET=$(python -c "
             "\"import secrets; print(secrets.token_hex(32))\")` before torchrun on each host")
_NONCE_RE = re.compile(r"^[0-9a-f]{32}$")


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

    ``join()`` agrees on this group's random generation with rank 0 (see the module docstring);
    ``set``/``get``/``rendezvous`` then work under that generation's prefix. ``formed()`` once the group has
    formed; ``close()`` when the PE leaves. ``forged``: values seen under this group's keys that failed the
    check (ignored).
    """

    def __init__(self, store, secret: bytes, rank: int, world_size: int, timeout_s: float,
                 keeper: "Keeper | None" = None) -> None:
        self._store, self._key, self.rank, self._world, self._timeout = store, secret, rank, world_size, timeout_s
        self._keeper = keeper if keeper is not None else Keeper(store)
        self._reader = _Reader(store, self._keeper, timeout_s)
        self._ns = "asap/" + _mac(secret, b"asap-namespace-v1").hex()[:32] + "/"
        self.prefix = ""
        self._formed = False

    @property
    def forged(self) -> int:
        return self._reader.forged

    # -- sealing
    def _seal(self, prefix: str, key: str, raw: bytes) -> bytes:
        return _mac(self._key, b"asap-value-v1", prefix.encode(), key.encode(), raw) + raw

    def _opener(self, prefix: str, key: str):
        def accept(raw: bytes):
            if len(raw) > MAX_VALUE_BYTES + _MAC_BYTES:
                return f"were longer than the {MAX_VALUE_BYTES} bytes a member publishes"
            mac, value = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
            if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, self._seal(prefix, key, value)[:_MAC_BYTES]):
                return "failed authentication with the group secret"
            return value
        return accept

    def _publish(self, prefix: str, key: str, raw: bytes) -> None:
        full, sealed = prefix + key, self._seal(prefix, key, raw)
        with self._keeper.lock if self._keeper.shared else _NOLOCK:
            self._store.set(full, sealed)
        self._keeper.keep(full, sealed, self._timeout if self._formed else None)

    def _read(self, prefix: str, key: str, what: str) -> bytes:
        return self._reader.read(prefix + key, self._opener(prefix, key), what)

    # -- the generation
    def join(self) -> str:
        """Agree on this group's generation (rank 0 picks it); returns it."""
        ns = self._ns
        if self.rank == 0:
            gen = secrets.token_hex(16)
            answered: "dict[int, set]" = {pe: set() for pe in range(1, self._world)}
            self._keeper.serve(lambda store: self._answer(store, gen, answered))
        else:
            nonce = secrets.token_hex(16)
            self._publish(ns, f"ask/{self.rank}", nonce.encode())
            raw = self._read(ns, f"gen/{self.rank}/{nonce}", "PE 0's answer (this group's generation)")
            gen = raw.decode("ascii", "replace")
            self._keeper.drop(f"{ns}ask/{self.rank}")
        self.prefix = f"{ns}{gen}/"
        return gen

    def _answer(self, store, gen: str, answered: "dict[int, set]") -> None:
        """Rank 0's keeper: answer every authentic question of a PE with the generation (bound to its nonce)."""
        ns = self._ns
        for pe, done in answered.items():
            key = f"ask/{pe}"
            if len(done) >= _MAX_ANSWERS or not store.check([ns + key]):
                continue
            raw = store.get(ns + key)
            nonce = self._opener(ns, key)(raw)
            if isinstance(nonce, str) or not _NONCE_RE.match(nonce.decode("ascii", "replace")):
                self._reader.count(ns + key, raw, nonce if isinstance(nonce, str) else "is malformed")
                continue
            nonce = nonce.decode()
            if nonce in done:
                continue
            done.add(nonce)
            akey = f"gen/{pe}/{nonce}"
            sealed = self._seal(ns, akey, gen.encode())
            store.set(ns + akey, sealed)
            self._keeper.keep(ns + akey, sealed)

    # -- values
    def set(self, key: str, value: "bytes | str") -> None:
        """Publish ``value`` under ``key`` with its MAC (and keep it there while a peer may need it)."""
        raw = value.encode() if isinstance(value, str) else bytes(value)
        if len(raw) > MAX_VALUE_BYTES:
            raise ValueError(f"init: store value {key!r} of {len(raw)} bytes is longer than {MAX_VALUE_BYTES}")
        self._publish(self.prefix, key, raw)

    def get(self, key: str, what: "str | None" = None) -> bytes:
        """The value a member published under ``key``: waits for one that passes the check (bounded by the
        timeout); values that fail it are ignored and counted (:attr:`forged`). Raises ``TimeoutError``
        naming the key (and what was ignored) when none came, ``CommError`` when the store is gone."""
        return self._read(self.prefix, key, what or "store key " + repr(key))

    def get_str(self, key: str, what: "str | None" = None) -> str:
        return self.get(key, what).decode("utf-8", "strict")

    def rendezvous(self, key: str) -> None:
        """Wait until every PE of the group has called ``rendezvous(key)``: each publishes its arrival, rank 0
        gathers them and publishes the release, which the others wait for. Rank 0 is the last to leave: if it
        hosts the store and exits right after (refusing the group), every other PE has been released."""
        if self._world == 1:
            return
        if self.rank == 0:
            for pe in range(1, self._world):
                self._read(self.prefix, f"{key}/{pe}", f"PE {pe} at rendezvous {key!r}")
            self._publish(self.prefix, f"{key}/0", b"1")
            return
        self._publish(self.prefix, f"{key}/{self.rank}", b"1")
        try:
            self._read(self.prefix, f"{key}/0", f"PE 0's release of rendezvous {key!r}")
        except CommTimeoutError as e:
            raise CommTimeoutError(f"init: rendezvous {key!r} did not complete within {self._timeout} s: {e}") \
                from None

    def arrive(self, key: str) -> None:
        """Every PE but rank 0 publishes its arrival at ``key`` and goes on; rank 0 waits for all of them."""
        if self.rank == 0:
            for pe in range(1, self._world):
                self._read(self.prefix, f"{key}/{pe}", f"PE {pe} at {key!r}")
        else:
            self._publish(self.prefix, f"{key}/{self.rank}", b"1")

    def formed(self) -> None:
        """The group has formed (every PE passed its first barrier): the formation's values are no longer
        needed; a value published from now on is kept for ``timeout`` seconds."""
        self._formed = True
        self._keeper.formed()

    def close(self) -> None:
        self._keeper.close()


# ----------------------------------------------------------------------------- where the secret comes from
_FILE_KEY = "asap/local-secret/"
_TOKEN_RE = re.compile(r"^[0-9a-f]{32}$")


class Secret(NamedTuple):
    """A group's secret as :func:`resolve_secret` found it."""

    key: bytes
    source: str  # "argument", "environment", "generated" (a group of one PE) or "file" (one host, rank 0's file)
    file: "str | None" = None  # rank 0 of a "file" group: the file to remove once every PE joined


def resolve_secret(store, rank: int, world_size: int, host_id: str, group_secret, shm_prefix: str,
                   keeper: "Keeper | None" = None, timeout_s: float = 30.0) -> Secret:
    """The group secret: see the module docstring for where it comes from, in this order."""
    if group_secret is not None:
        return Secret(_check_secret(group_secret, "the group_secret argument"), "argument")
    env = os.environ.get(SECRET_ENV)
    if env:
        return Secret(_check_secret(env, f"${SECRET_ENV}"), "environment")
    if world_size == 1:
        return Secret(new_secret().encode(), "generated")
    return _file_secret(store, rank, world_size, host_id, shm_prefix, keeper or Keeper(store), timeout_s)


def spans_hosts_without_secret(hosts: "list[str]") -> CommError:
    """The error of a group whose PEs turned out to span hosts while its secret came from a one-host file."""
    return CommError(f"init: this group spans {len(set(hosts))} hosts and no {SECRET_ENV} is set: a group across "
                     f"hosts needs a shared secret; {_SET_HINT}")


def _file_proof(secret: bytes, nonce: str, record: str) -> str:
    return _mac(secret, b"asap-file-v1", nonce.encode(), record.encode()).hex()


def _file_secret(store, rank: int, world_size: int, host_id: str, shm_prefix: str, keeper: Keeper,
                 timeout_s: float) -> Secret:
    """One host, no secret given: rank 0 writes a fresh secret into a 0600 file and answers each PE's nonce
    with the file's name and a proof made with the file's secret (see the module docstring).

    The record is not secret (it says which file, not what is in it). A PE accepts the file only if it is a
    regular file of this user with no access for anyone else and its secret proves the answer, so a planted
    or stale value can at worst delay ``init`` (the PE ignores it, counts it and keeps waiting), never make a
    PE use a secret that someone else knows or fail while the real answer is on its way."""
    if rank == 0:
        token = secrets.token_hex(16)
        path = f"/dev/shm/{shm_prefix}secret-{token}"
        secret = new_secret().encode()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secret)
        finally:
            os.close(fd)
        record = f"{host_id}\n{shm_prefix}\n{token}"
        answered: "dict[int, set]" = {pe: set() for pe in range(1, world_size)}

        def answer(st) -> None:
            for pe, done in answered.items():
                key = f"{_FILE_KEY}ask/{pe}"
                if len(done) >= _MAX_ANSWERS or not st.check([key]):
                    continue
                nonce = st.get(key)[:64].decode("ascii", "replace")
                if not _NONCE_RE.match(nonce) or nonce in done:
                    continue
                done.add(nonce)
                akey, raw = f"{_FILE_KEY}ans/{pe}/{nonce}", f"{record}\n{_file_proof(secret, nonce, record)}".encode()
                st.set(akey, raw)
                keeper.keep(akey, raw)

        keeper.serve(answer)
        return Secret(secret, "file", path)
    nonce = secrets.token_hex(16)
    ask = f"{_FILE_KEY}ask/{rank}"
    with keeper.lock if keeper.shared else _NOLOCK:
        store.set(ask, nonce)
    keeper.keep(ask, nonce.encode())
    elsewhere: "list[str]" = []  # hosts named by answers this PE could not check (rank 0 elsewhere, or forged)

    def accept(raw: bytes):
        parts = raw[:1024].decode("utf-8", "replace").split("\n")
        if len(parts) != 4 or not _TOKEN_RE.match(parts[2]) or "/" in parts[1] or len(parts[1]) > 64 \
                or not re.match(r"^[0-9a-f]{64}$", parts[3]):
            return "is malformed"
        if parts[0] != host_id:
            elsewhere.append(parts[0])
        path = f"/dev/shm/{parts[1]}secret-{parts[2]}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            return f"names a secret file that cannot be read ({e})"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return (f"names a file that is not a private file of this user (mode {oct(st.st_mode & 0o777)}, "
                        f"uid {st.st_uid})")
            secret = os.read(fd, 256)
        finally:
            os.close(fd)
        if not hmac.compare_digest(parts[3], _file_proof(secret, nonce, "\n".join(parts[:3]))):
            return "failed the proof of rank 0's secret file"
        if parts[0] != host_id:  # authentic: rank 0 says it is on another host (simulated hosts sharing /dev/shm)
            raise CommError(f"init: this group spans hosts (rank 0 on {parts[0]!r}, this PE on {host_id!r}) and no "
                            f"{SECRET_ENV} is set: a group across hosts needs a shared secret; {_SET_HINT}")
        return secret

    reader = _Reader(store, keeper, timeout_s)
    try:
        secret = reader.read(f"{_FILE_KEY}ans/{rank}/{nonce}", accept, "rank 0's group secret")
    except CommError as e:  # the wait ran out, or rank 0 (hosting the store) gave up first and left
        if elsewhere:
            raise CommError(f"init: this group spans hosts (rank 0 on {elsewhere[-1]!r}, this PE on {host_id!r}) "
                            f"and no {SECRET_ENV} is set: a group across hosts needs a shared secret; "
                            f"{_SET_HINT}") from None
        if not isinstance(e, CommTimeoutError):
            raise
        raise CommTimeoutError(f"{e}; no {SECRET_ENV} is set, so this PE waited for rank 0 of this host to hand "
                               f"it one; {_SET_HINT} to avoid the hand-over") from None
    finally:
        keeper.drop(ask)
    return Secret(_check_secret(secret.decode("ascii", "replace"), "rank 0's secret file"), "file")


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


def private_file_store(world_size: int = -1) -> "tuple":
    """``(path, directory)``: the file of a ``torch.distributed.FileStore`` in a fresh directory that only this
    user can enter (mode 0700, under ``$TMPDIR``): a store for PEs of one host that no other user can reach.
    Each PE opens it with ``FileStore(path, world_size)``; remove ``directory`` when the group is done."""
    import tempfile

    directory = tempfile.mkdtemp(prefix="asap-store-")  # mode 0700
    return os.path.join(directory, "store"), directory


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
