"""Exception hierarchy of asap_comm.

Every error the library raises on purpose is a :class:`CommError` or a builtin
``ValueError``/``TypeError`` for bad arguments; messages start with the name of
the call that failed and carry the offending values.
"""
import builtins

__all__ = ["CommError", "TimeoutError", "PeerFailure", "LaunchError", "OutOfSharedMemory"]


class CommError(RuntimeError):
    """Base class of asap_comm's runtime errors."""


class TimeoutError(CommError, builtins.TimeoutError):  # noqa: A001 - the contract name
    """A bounded wait ran out. Also a builtin ``TimeoutError``."""


class PeerFailure(CommError):
    """A PE died, or closed, while this PE depended on it.

    Attributes: ``pe`` (the PE, or None if unknown) and ``reason``
    (``"died"`` or ``"closed"``).
    """

    def __init__(self, message: str, pe: "int | None" = None, reason: "str | None" = None) -> None:
        super().__init__(message)
        self.pe = pe
        self.reason = reason

    def __reduce__(self):  # keep pe/reason across pickling (launch reports)
        return (type(self), (str(self), self.pe, self.reason))


class OutOfSharedMemory(CommError):
    """Shared memory ran out: a segment could not be allocated for real (the library never leaves bytes that
    would raise SIGBUS when first touched). Attributes: ``path`` (the shared-memory file system, ``/dev/shm``),
    ``wanted`` (bytes this allocation needed) and ``free`` (bytes free there when it failed)."""

    def __init__(self, message: str, path: str = "/dev/shm", wanted: int = 0, free: int = 0) -> None:
        super().__init__(message)
        self.path, self.wanted, self.free = path, wanted, free

    def __reduce__(self):
        return (type(self), (str(self), self.path, self.wanted, self.free))


class LaunchError(CommError):
    """A rank started by :func:`asap_comm.launch` raised or died.

    Attributes: ``rank`` (the failing rank), ``exitcode`` (None if it raised),
    ``remote_traceback`` (the rank's formatted traceback, if it raised),
    ``remote_type`` (the name of the exception class it raised, if it raised).
    """

    def __init__(self, message: str, rank: int, exitcode: "int | None" = None,
                 remote_traceback: "str | None" = None, remote_type: "str | None" = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback
        self.remote_type = remote_type

    def __reduce__(self):
        return (type(self), (str(self), self.rank, self.exitcode, self.remote_traceback, self.remote_type))
