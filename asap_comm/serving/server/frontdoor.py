"""The service's front door: what a connection may hold before it is a request, and what a crash leaves behind.

:class:`ConnectionGuard` wraps every connection's aiohttp protocol (one
asyncio loop owns it) and enforces, per connection:

* **header-read timeout** (``--header-timeout-s``, default 10 s): once a
  connection has sent the first byte of a request, the request's headers
  must be complete (``\\r\\n\\r\\n``) within this long; otherwise it gets
  ``408`` and is closed (a slowloris client holds nothing for long);
* **idle timeout** (``--idle-timeout-s``, default 60 s): a connection with no
  request in progress (just opened, or between keep-alive requests) is
  closed after this long without a new one;
* **connection limit** (``--max-connections``, default the file limit
  ``RLIMIT_NOFILE`` less 128, so that accepting never runs out of file
  descriptors): a connection accepted at the limit makes room by closing the
  oldest connection that is idle or still sending headers (a request in
  progress is never cut); if every open connection is in a request, the new
  one gets ``503`` and is closed at once.

The limit reached is logged at most once per ``LOG_INTERVAL_S`` (with the
count since the last line), and :class:`AcceptErrorFilter` does the same for
asyncio's "socket.accept() out of system resource" (logged with a traceback
per retry otherwise). The middleware (``app``) calls :meth:`ConnectionGuard.begin`
and :meth:`ConnectionGuard.end` around each request: in between, the request's
own bounds apply (the body's minimum rate, the request deadline).

:func:`remove_stale_segments` is what a crash of the whole process tree leaves
behind: ``/dev/shm/asap-*`` segments (a PE killed while setting one up) and
``/dev/shm/sem.mp-*`` (Python's named semaphores); at start-up, the service
removes those of its own user that no live process holds open or mapped and
that are older than ``STALE_AFTER_S``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
import time

__all__ = ["ConnectionGuard", "AcceptErrorFilter", "default_max_connections", "check_connection_limit",
           "remove_stale_segments", "FD_RESERVE", "LOG_INTERVAL_S", "STALE_AFTER_S"]

FD_RESERVE = 128  # file descriptors kept for everything but connections (the default limit is the file limit less this)
LOG_INTERVAL_S = 10.0  # at most one log line per interval for a repeated condition (the limit, accept errors)
STALE_AFTER_S = 60.0  # a segment younger than this may be one being set up: never stale
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


def default_max_connections() -> int:
    """``--max-connections`` when not given: the soft file limit (``RLIMIT_NOFILE``) less ``FD_RESERVE``, at least
    16 (an unlimited file limit: 65536)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - FD_RESERVE)


def check_connection_limit(max_connections: "int | None") -> None:
    """``ValueError`` unless ``max_connections`` (None: the default) is below the file limit by ``FD_RESERVE``:
    a limit past it would let accepting fail for want of file descriptors."""
    if max_connections is None:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections > soft - FD_RESERVE:
        raise ValueError(f"--max-connections {max_connections} is not below the file limit: RLIMIT_NOFILE is {soft}, "
                         f"and {FD_RESERVE} descriptors are kept for the process itself (at most "
                         f"{soft - FD_RESERVE}); lower it, or raise the limit (ulimit -n)")


class _Conn(asyncio.Protocol):
    """One connection: forwards everything to aiohttp's protocol (``inner``) and keeps the guard's state."""

    def __init__(self, guard: "ConnectionGuard", inner) -> None:
        self.guard, self.inner = guard, inner
        self.transport = None
        self.started = False  # inner.connection_made ran
        self.busy = False  # a request is in progress (its headers came)
        self.head_at = 0.0  # when the first byte of the request now being sent came (0: none yet)
        self.last = time.monotonic()  # the last time the connection went idle (or opened)
        self.tail = b""  # the last bytes seen while looking for the end of the headers

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.guard.opened(self):
            self.started = True
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            if not self.head_at:
                self.head_at = time.monotonic()
            seen = self.tail + data
            if any(end in seen for end in _HEAD_ENDS):
                self.busy, self.tail = True, b""  # the headers are complete: the request's own bounds apply now
            else:
                self.tail = seen[-3:]
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.started else None

    def pause_writing(self) -> None:
        if self.started:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.started:
            self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.guard.closed(self)
        if self.started:
            self.inner.connection_lost(exc)


class ConnectionGuard:
    """The per-connection bounds of one listening server (see the module docstring). ``factory`` is aiohttp's
    protocol factory (``runner.server``); pass :meth:`protocol` to ``loop.create_server``. ``count(reason)`` is
    called for each connection the guard closes (``header_timeout``, ``idle``, ``evicted``, ``refused``)."""

    def __init__(self, factory, header_timeout_s: float, idle_timeout_s: float, max_connections: int,
                 count=lambda reason: None) -> None:
        self.factory, self.count = factory, count
        self.header_timeout_s, self.idle_timeout_s, self.max_connections = (header_timeout_s, idle_timeout_s,
                                                                            max_connections)
        self.conns: dict = {}  # transport -> _Conn, in the order they opened
        self._sweeper: "asyncio.Task | None" = None
        self._limit_log = _Every(LOG_INTERVAL_S)

    def protocol(self) -> _Conn:
        return _Conn(self, self.factory())

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def __len__(self) -> int:
        return len(self.conns)

    # ------------------------------------------------------------------ a connection's life
    def opened(self, c: _Conn) -> bool:
        """A new connection: True to serve it; False when it was refused (503, closed)."""
        if len(self.conns) >= self.max_connections:
            victim = self._oldest_not_busy()
            if victim is None:
                self._at_limit("every open connection is in a request: refusing new ones (503)")
                self.count("refused")
                _answer_and_close(c.transport, 503, "Service Unavailable", "too many connections are open; retry "
                                  "later", retry_after=1)
                return False
            self._at_limit("closing the oldest idle or slow-header connections to make room")
            self.count("evicted")
            self.conns.pop(victim.transport, None)
            victim.transport.abort()
        self.conns[c.transport] = c
        return True

    def closed(self, c: _Conn) -> None:
        if self.conns.get(c.transport) is c:
            del self.conns[c.transport]

    def begin(self, transport) -> None:
        """A request's handler starts on ``transport`` (the middleware)."""
        c = self.conns.get(transport)
        if c is not None:
            c.busy, c.tail = True, b""

    def end(self, transport) -> None:
        """A request's handler returned on ``transport``: the connection is idle until its next request."""
        c = self.conns.get(transport)
        if c is not None:
            c.busy, c.head_at, c.tail, c.last = False, 0.0, b"", time.monotonic()

    # ------------------------------------------------------------------ the bounds
    def _oldest_not_busy(self) -> "_Conn | None":
        best = None
        for c in self.conns.values():
            if not c.busy and (best is None or (c.head_at or c.last) < (best.head_at or best.last)):
                best = c
        return best

    def _at_limit(self, what: str) -> None:
        n = self._limit_log.tick()
        if n:
            print(f"asap serve: {len(self.conns)} connections open, the limit (--max-connections "
                  f"{self.max_connections}): {what} ({n} time(s) in the last {LOG_INTERVAL_S:g} s or since the "
                  f"last report)", file=sys.stderr, flush=True)

    async def _sweep(self) -> None:
        period = min(1.0, max(0.05, min(self.header_timeout_s, self.idle_timeout_s) / 4))
        while True:
            await asyncio.sleep(period)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        """Close every connection past its header-read or idle timeout."""
        late = []
        for c in self.conns.values():
            if c.busy:
                continue
            if c.head_at and now - c.head_at > self.header_timeout_s:
                late.append((c, "header_timeout"))
            elif not c.head_at and now - c.last > self.idle_timeout_s:
                late.append((c, "idle"))
        for c, reason in late:
            self.conns.pop(c.transport, None)
            self.count(reason)
            if reason == "header_timeout":
                _answer_and_close(c.transport, 408, "Request Timeout", "the request's headers did not arrive within "
                                  f"{self.header_timeout_s:g} s (--header-timeout-s)")
            else:
                c.transport.close()


def _answer_and_close(transport, status: int, reason: str, message: str, retry_after: "int | None" = None) -> None:
    """A whole HTTP/1.1 answer with a JSON error body written straight to ``transport``, which is then closed."""
    import json

    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n" + (f"Retry-After: {retry_after}\r\n" if retry_after else "") + "\r\n")
    try:
        transport.write(head.encode() + body)
        transport.close()
    except Exception:  # the peer is gone already
        transport.abort()


class _Every:
    """A log line at most once per ``interval_s``: :meth:`tick` returns the events to report now (0: not yet)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s, self.last, self.pending = interval_s, -float("inf"), 0

    def tick(self) -> int:
        self.pending += 1
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return 0
        n, self.pending, self.last = self.pending, 0, now
        return n


class AcceptErrorFilter(logging.Filter):
    """For the ``asyncio`` logger: its "socket.accept() out of system resource" (one record with a traceback per
    retry, every second, while the process has no file descriptor free) at most once per ``interval_s``, as one
    line with the error and the count, without the traceback. Other records pass untouched."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.every = _Every(interval_s)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if not msg.startswith("socket.accept() out of system resource"):
            return True
        n = self.every.tick()
        if not n:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        record.msg = (f"socket.accept() out of system resource: {exc or 'no file descriptor free'} ({n} time(s) since "
                      f"the last report; at most one line per {self.every.interval_s:g} s); lower --max-connections "
                      "or raise the file limit")
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


def install_accept_error_filter() -> None:
    """Put one :class:`AcceptErrorFilter` on the ``asyncio`` logger (idempotent)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorFilter) for f in logger.filters):
        logger.addFilter(AcceptErrorFilter())


# ----------------------------------------------------------------------------- what a crash leaves
def _held_paths(prefix: str) -> set:
    """Every path under ``prefix`` that a process this user can inspect holds open (``/proc/*/fd``) or mapped
    (``/proc/*/maps``)."""
    held = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith(prefix):
                    held.add(target.removesuffix(" (deleted)"))
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        held.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or another user's
            continue
    return held


def remove_stale_segments(shm_dir: str = "/dev/shm", stale_after_s: float = STALE_AFTER_S) -> list:
    """Remove the ``asap-*`` segments and ``sem.mp-*`` named semaphores in ``shm_dir`` that a crashed process
    tree of this user left: owned by this user, older than ``stale_after_s``, and neither open nor mapped by any
    live process (their owner is dead: nobody can use them again). Returns the paths removed."""
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(("asap-", "sem.mp-"))]
    except OSError:
        return []
    uid, now = os.getuid(), time.time()
    candidates = []
    for n in names:
        path = os.path.join(shm_dir, n)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime > stale_after_s:
            candidates.append(path)
    if not candidates:
        return []
    held = _held_paths(shm_dir.rstrip("/") + "/")
    removed = []
    for path in candidates:
        if path in held:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed
