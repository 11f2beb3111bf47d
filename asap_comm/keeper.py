"""Keeping a PE's store values in place and reading a peer's through forgeries (``asap_comm.rendezvous``).

:class:`Keeper`: a thread that puts this PE's values back while a peer may still need them (an outsider who
reaches a TCPStore can overwrite or delete any key); ``_Reader``: bounded waits for a value that passes a
check, counting and skipping what does not.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable

from .errors import CommError
from .errors import TimeoutError as CommTimeoutError

__all__ = ["Keeper"]

_REPUBLISH_S = 0.02  # a Keeper puts this PE's values back this often (group formation)
_REPUBLISH_LATE_S = 0.1  # ... and this often for a value published after the group formed
_WAIT_SLICE_S = 0.25  # a read waits for its key in slices this long (a lost store is noticed between them)
_log = logging.getLogger("asap_comm.rendezvous")


def _is_lost(e: Exception) -> bool:
    """True when ``e`` says the store itself is gone (its host exited), not that a wait ran out."""
    import torch.distributed as dist

    return isinstance(e, dist.DistNetworkError)


class Keeper:
    """Keeps this PE's store values in place while a peer may still need them (see the module docstring).

    ``keep(key, raw, for_s)``: put ``raw`` back under ``key`` until :meth:`formed` (``for_s`` None) or for
    ``for_s`` seconds; ``serve(fn)``: call ``fn(store)`` on every round until :meth:`formed` (rank 0 answering
    the other PEs' questions). The thread starts with the first value and sleeps while there is nothing to
    keep; :meth:`close` ends it. It uses a clone of the store (its own connection) where the store can be
    cloned, else the store itself under :attr:`lock`, which every reader of this PE takes too."""

    def __init__(self, store) -> None:
        self.lock = threading.Lock()  # around store calls, when the thread shares the caller's store object
        import torch.distributed as dist

        # a FileStore in a private directory (asap_comm.launch): no one else can write it, nothing to put back
        self.private = isinstance(store, dist.FileStore)
        try:
            own = store.clone()
            own.set_timeout(timedelta(seconds=1.0))  # a get of a key deleted under it fails fast, then retries
            self._store, self.shared = own, False
        except Exception:  # a store without clone (a user's wrapper): share it, one call at a time
            self._store, self.shared = store, True
        self._cv = threading.Condition()
        self._values: "dict[str, tuple]" = {}  # key -> (raw, until: monotonic deadline or None = until formed)
        self._serve: "list[Callable]" = []
        self._thread: "threading.Thread | None" = None
        self._stop = False
        self.republished = 0  # rounds of put-backs (for tests)

    def keep(self, key: str, raw: bytes, for_s: "float | None" = None) -> None:
        if self.private:
            return
        with self._cv:
            self._values[key] = (raw, None if for_s is None else time.monotonic() + for_s)
            self._wake()

    def drop(self, key: str) -> None:
        with self._cv:
            self._values.pop(key, None)

    def serve(self, fn: Callable) -> None:
        with self._cv:
            self._serve.append(fn)
            self._wake()

    def formed(self) -> None:
        """The group has formed: nothing of its formation is needed any more."""
        with self._cv:
            self._serve.clear()
            self._values = {k: v for k, v in self._values.items() if v[1] is not None}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._values.clear()
            self._serve.clear()
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(2.0)

    def _wake(self) -> None:  # with self._cv held
        if self._stop:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asap-store-keeper", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def _run(self) -> None:
        store = self._store
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    now = time.monotonic()
                    self._values = {k: v for k, v in self._values.items() if v[1] is None or v[1] > now}
                    if self._values or self._serve:
                        break
                    self._cv.wait()
                items = list(self._values.items())
                serve = list(self._serve)
                late = all(until is not None for _, (_, until) in items) and not serve
            try:
                with self.lock if self.shared else _NOLOCK:
                    for key, (raw, _) in items:
                        store.set(key, raw)
                    for fn in serve:
                        fn(store)
                self.republished += 1
            except Exception as e:
                if _is_lost(e):  # the store is gone: nothing left to keep there
                    return
                _log.debug("store keeper: %s", e)  # an outsider's delete raced a get: the next round retries
            with self._cv:
                if not self._stop:
                    self._cv.wait(_REPUBLISH_LATE_S if late else _REPUBLISH_S)


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NOLOCK = _NoLock()


class _Reader:
    """Bounded waits for values on ``store`` that pass ``accept``; what does not is counted and skipped."""

    def __init__(self, store, keeper: Keeper, timeout_s: float) -> None:
        self._store, self._keeper, self._timeout = store, keeper, timeout_s
        self.forged = 0  # values seen that failed the check (each distinct one once per key)
        self._last_bad: "dict[str, bytes]" = {}

    def count(self, key: str, raw: bytes, why: str) -> None:
        if self._last_bad.get(key) == raw:
            return
        self._last_bad[key] = raw
        self.forged += 1
        if self.forged == 1:  # the first: later ones are summed up once the group has formed
            _log.warning("asap_comm: ignored a value under store key %r that %s (written by a process without the "
                         "group secret); waiting for the authentic one", key, why)

    def read(self, key: str, accept: Callable, what: str, timeout_s: "float | None" = None):
        """``accept(raw)``: the value, or a string saying why ``raw`` is refused. Waits for ``key`` until a
        value is accepted, at most the timeout; raises ``TimeoutError`` naming the key and what was refused,
        or ``CommError`` when the store itself is gone."""
        t = self._timeout if timeout_s is None else timeout_s
        deadline = time.monotonic() + t
        pause, refused, why = 0.001, 0, None
        lock = self._keeper.lock if self._keeper.shared else _NOLOCK
        slice_s = 0.02 if self._keeper.shared else _WAIT_SLICE_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                msg = f"init: waiting for {what} failed: no authentic value under store key {key!r} within {t} s"
                if refused:
                    msg += (f" (ignored {refused} values under it that {why}: written by a process without the "
                            f"group secret, or a PE started with another ASAP_GROUP_SECRET)")
                raise CommTimeoutError(msg)
            try:
                with lock:
                    self._store.wait([key], timedelta(seconds=max(0.001, min(left, slice_s))))
                    raw = self._store.get(key)
            except Exception as e:
                if _is_lost(e):
                    raise CommError(f"init: lost the rendezvous store while waiting for {what} (the PE hosting "
                                    f"it may have exited): {e}") from None
                continue  # the slice ran out (or an outsider deleted the key between the wait and the get)
            got = accept(raw)
            if not isinstance(got, str):
                return got
            refused, why = refused + 1, got
            self.count(key, raw, got)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


