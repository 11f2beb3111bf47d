"""The HTTP side's settings of the online service (the runtime's are a ``RuntimeConfig``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .request import default_max_body_bytes

__all__ = ["ServiceOptions"]


@dataclass(frozen=True)
class ServiceOptions:
    """The HTTP side's settings (the runtime's are a ``RuntimeConfig``). ``max_body_bytes`` and
    ``max_waiting_tokens`` of None take their defaults from ``max_queued_tokens`` (see :attr:`body_bound`,
    :attr:`waiting_bound`); ``api_key`` None: no authentication. The front door (``.frontdoor``): a connection
    must send a request's headers within ``header_timeout_s`` of its first byte, an idle one is closed after
    ``idle_timeout_s``, at most ``max_connections`` are open (None: the file limit less 128, see
    :func:`~.frontdoor.default_max_connections`), and a body must arrive at ``min_body_rate`` bytes/s or more
    (averaged over every ``request.BODY_RATE_WINDOW_S``; 408 otherwise). ``max_rank_calls``: the requests an
    attention rank holds at once (a chunk sent, no result yet; the others wait in the front end, where the
    clients' chunks take turns: ``frontend.FrontEnd``); None: no bound. ``refused_hold_s``: how long a call
    of a client refused a place in the full waiting room is held, unread, while its client still holds its
    share of the room (``fairness.HeldCalls``); 0: never held. ``bad_call_delay_s``: how long each call of a
    client waits while the brake on its refused calls holds (``fairness.ErrorBrake``); 0: no brake."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "small"
    mode: str = "async"
    max_queued_tokens: int = 65536
    request_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    failure_exit_s: float = 10.0
    tokenizer: "str | None" = None
    max_body_bytes: "int | None" = None
    max_waiting_tokens: "int | None" = None
    worker_stall_s: float = 10.0
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    max_connections: "int | None" = None
    min_body_rate: int = 16384
    max_rank_calls: "int | None" = None
    refused_hold_s: float = 1.0
    bad_call_delay_s: float = 1.0
    api_key: "str | None" = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.port, int) and 0 <= self.port < 65536):
            raise ValueError(f"ServiceOptions: port={self.port!r} must be in [0, 65536)")
        for name in ("max_queued_tokens", "max_body_bytes", "max_waiting_tokens", "max_connections", "min_body_rate",
                     "max_rank_calls"):
            v = getattr(self, name)
            required = name in ("max_queued_tokens", "min_body_rate")
            if (v is not None or required) and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be an int >= 1")
        for name in ("request_timeout_s", "drain_timeout_s", "failure_exit_s", "worker_stall_s", "header_timeout_s",
                     "idle_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be a positive number of seconds")
        for name, off in (("refused_hold_s", "never hold"), ("bad_call_delay_s", "no brake")):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"ServiceOptions: {name}={v!r} must be a number of seconds >= 0 (0: {off})")
        if self.mode not in ("async", "sync"):
            raise ValueError(f"ServiceOptions: mode={self.mode!r} must be 'async' or 'sync'")
        if self.api_key is not None and not (isinstance(self.api_key, str) and self.api_key.strip()):
            raise ValueError("ServiceOptions: api_key must be a non-empty string (or None: no authentication)")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise ValueError("ServiceOptions: api_key has surrounding whitespace (a trailing newline?); strip it "
                             "(service_options does, and says so)")

    @property
    def body_bound(self) -> int:
        """The largest request body read: ``max_body_bytes``, or ``default_max_body_bytes(max_queued_tokens)``."""
        return self.max_body_bytes if self.max_body_bytes is not None else default_max_body_bytes(
            self.max_queued_tokens)

    @property
    def waiting_bound(self) -> int:
        """Prompt tokens the waiting room holds: ``max_waiting_tokens``, or twice ``max_queued_tokens`` (room for
        a call at the bound and as much again of others)."""
        return self.max_waiting_tokens if self.max_waiting_tokens is not None else 2 * self.max_queued_tokens
