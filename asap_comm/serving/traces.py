"""Request traces: synthetic arrivals and lengths, and the two public trace formats.

A trace is a ``list[Request]`` sorted by arrival, ``request_id`` numbering it
0..n-1 in that order, the first arrival at 0.0 s. Token ids are not part of
it: the runtime draws them later from ``prompt_len``.

Synthetic load::

    reqs = synthetic_trace(rate=4.0, num_requests=200, arrival="gamma", cv=3.0,
                           lengths=LogNormalLengths(median=256, sigma=1.0, min_len=16, max_len=2048), seed=0)

Public traces ship in ``asap_comm/data/traces/`` (``$ASAP_TRACES_DIR`` overrides); ``load_trace``
takes ``"mooncake"``, ``"azure"`` or any file, scaled to what a CPU host can serve::

    reqs = load_trace("mooncake", target_rate=2.0, length_scale=1 / 16,
                      max_prompt_len=2048, limit=300)
    log.info(summarize_trace(reqs).describe())

Formats read:

* **Mooncake JSONL** (kvcache-ai/Mooncake FAST'25 traces): one JSON object per
  line with ``timestamp`` (ms since the trace start), ``input_length``,
  ``output_length``; other keys (``hash_ids``) are ignored; blank lines are
  skipped.
* **Azure LLM inference CSV** (Azure/AzurePublicDataset 2023/2024): header
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` (any column order, extra columns
  ignored), ``TIMESTAMP`` a date-time such as ``2023-11-16 18:15:46.6805900``
  (7 fractional digits in the real file; any number is read exactly to the
  nanosecond; an optional ``T`` separator and ``Z``/``+hh:mm`` offset).

Lengths must be non-negative integers (a JSON float with an integral value such
as ``12.0`` is accepted); anything else raises :class:`TraceError` naming the
file, the line and the problem.

Randomness comes from :class:`random.Random` streams seeded from ``seed``
(one stream for arrivals, one for lengths, so changing the length
distribution leaves the arrival times alone): the same seed gives the same
trace on every platform and Python 3 version.
"""
from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, Sequence

from .metrics import percentile

__all__ = [
    "TraceError",
    "Request",
    "poisson_arrivals",
    "gamma_arrivals",
    "LengthDistribution",
    "FixedLengths",
    "UniformLengths",
    "LogNormalLengths",
    "EmpiricalLengths",
    "synthetic_trace",
    "load_mooncake",
    "load_azure",
    "load_trace", "PUBLIC_TRACES", "TRACES_ENV", "traces_dir", "trace_path", "resolve_trace", "scale_trace",
    "TraceSummary",
    "summarize_trace",
]


class TraceError(ValueError):
    """A trace file could not be read. ``path``, ``line`` (1-based, or None for
    the whole file) and ``reason`` are kept as attributes; the message is
    ``"<path>:<line>: <reason>"``."""

    def __init__(self, path: str | os.PathLike, line: int | None, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.line, self.reason))


@dataclass(frozen=True)
class Request:
    """One request of a trace: when it arrives and how long it is.

    ``arrival_s``: seconds since the first request of the trace (>= 0);
    ``prompt_len``: prompt tokens (>= 0; the runtime rejects empty prompts);
    ``output_len``: tokens the trace says were generated (prefill produces
    only the first; kept for the simulator and for reporting).
    """

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.arrival_s, (int, float)) and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"Request: arrival_s={self.arrival_s!r} must be finite and >= 0")
        for name in ("request_id", "prompt_len", "output_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Request: {name}={v!r} must be a non-negative int")


# --------------------------------------------------------------------------- arrivals

def _check_rate_count(fn: str, rate: float, num_requests: int | None, duration_s: float | None) -> None:
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"{fn}: rate={rate!r} must be a positive number of requests/s")
    if (num_requests is None) == (duration_s is None):
        raise ValueError(f"{fn}: give exactly one of num_requests and duration_s")
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int)
                                     or num_requests < 0):
        raise ValueError(f"{fn}: num_requests={num_requests!r} must be a non-negative int")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"{fn}: duration_s={duration_s!r} must be finite and >= 0")


def _accumulate(gap, num_requests: int | None, duration_s: float | None) -> list[float]:
    """Arrival times 0, g1, g1+g2, ...: ``num_requests`` of them, or all < ``duration_s``."""
    out: list[float] = []
    t = 0.0
    while True:
        if num_requests is not None and len(out) >= num_requests:
            return out
        if duration_s is not None and t >= duration_s:
            return out
        out.append(t)
        t += gap()


def poisson_arrivals(rate: float, *, num_requests: int | None = None, duration_s: float | None = None,
                     seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at ``rate`` requests/s.

    The first arrival is at 0.0 and the gaps are exponential with mean
    ``1 / rate``. Give either ``num_requests`` or ``duration_s`` (arrivals in
    ``[0, duration_s)``).
    """
    _check_rate_count("poisson_arrivals", rate, num_requests, duration_s)
    rng = random.Random(f"asap-arrivals-{seed}")
    return _accumulate(lambda: rng.expovariate(rate), num_requests, duration_s)


def gamma_arrivals(rate: float, cv: float, *, num_requests: int | None = None, duration_s: float | None = None,
                   seed: int = 0) -> list[float]:
    """Arrival times (s) of a Gamma renewal process: bursty load at mean ``rate``.

    Gaps are Gamma-distributed with mean ``1 / rate`` and coefficient of
    variation ``cv`` (std / mean): shape ``1 / cv**2``, scale ``cv**2 / rate``.
    ``cv = 1`` is Poisson; ``cv > 1`` gives bursts of near-simultaneous
    arrivals separated by long gaps (``cv < 1`` is more regular than Poisson).
    The first arrival is at 0.0.
    """
    _check_rate_count("gamma_arrivals", rate, num_requests, duration_s)
    if not (isinstance(cv, (int, float)) and math.isfinite(cv) and cv > 0):
        raise ValueError(f"gamma_arrivals: cv={cv!r} must be a positive number")
    rng = random.Random(f"asap-arrivals-{seed}")
    shape, scale = 1.0 / cv ** 2, cv ** 2 / rate
    return _accumulate(lambda: rng.gammavariate(shape, scale), num_requests, duration_s)


# --------------------------------------------------------------------------- lengths

class LengthDistribution(Protocol):
    """Anything that draws ``n`` prompt lengths from a seeded ``random.Random``."""

    def sample(self, n: int, rng: random.Random) -> list[int]: ...


def _check_len(cls: str, name: str, v: int, minimum: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{cls}: {name}={v!r} must be an int >= {minimum}")


@dataclass(frozen=True)
class FixedLengths:
    """Every prompt has ``length`` tokens."""

    length: int

    def __post_init__(self) -> None:
        _check_len("FixedLengths", "length", self.length)

    def sample(self, n: int, rng: random.Random) -> list[int]:
        return [self.length] * n


@dataclass(frozen=True)
class UniformLengths:
    """Prompt lengths uniform on the integers ``lo..hi`` (both included)."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _check_len("UniformLengths", "lo", self.lo)
        _check_len("UniformLengths", "hi", self.hi, self.lo)

    def sample(self, n: int, rng: random.Random) -> list[int]:
        return [rng.randint(self.lo, self.hi) for _ in range(n)]


@dataclass(frozen=True)
class LogNormalLengths:
    """Log-normal prompt lengths: ``round(median * exp(sigma * N(0, 1)))`` clipped to
    ``[min_len, max_len]``. The skew of real chat traces (a long tail of long
    prompts) with a knob: p99/p50 is about ``exp(2.33 * sigma)`` before clipping."""

    median: float
    sigma: float
    min_len: int = 1
    max_len: int = 1 << 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.median) and self.median > 0):
            raise ValueError(f"LogNormalLengths: median={self.median!r} must be positive")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise ValueError(f"LogNormalLengths: sigma={self.sigma!r} must be finite and >= 0")
        _check_len("LogNormalLengths", "min_len", self.min_len)
        _check_len("LogNormalLengths", "max_len", self.max_len, self.min_len)

    def sample(self, n: int, rng: random.Random) -> list[int]:
        mu = math.log(self.median)
        return [min(self.max_len, max(self.min_len, round(rng.lognormvariate(mu, self.sigma)))) for _ in range(n)]


@dataclass(frozen=True)
class EmpiricalLengths:
    """Prompt lengths taken from data: drawn with replacement (``resample=True``)
    or replayed in order, cycling (``resample=False``)."""

    values: tuple[int, ...]
    resample: bool = True

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("EmpiricalLengths: no values")
        for v in self.values:
            _check_len("EmpiricalLengths", "value", v)

    @classmethod
    def from_file(cls, path: str | os.PathLike, resample: bool = True) -> "EmpiricalLengths":
        """Read lengths from a trace (``.jsonl`` Mooncake, ``.csv`` Azure: their
        prompt lengths) or from a text file with one integer per line (blank
        lines and ``#`` comments skipped). Zero-length prompts of a trace are dropped."""
        path = Path(path)
        if path.suffix.lower() in (".jsonl", ".csv"):
            values = [r.prompt_len for r in load_trace(path) if r.prompt_len > 0]
            if not values:
                raise TraceError(path, None, "no non-empty prompts")
            return cls(tuple(values), resample)
        values = []
        for lineno, raw in enumerate(_read_lines(path), start=1):
            text = raw.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                v = int(text)
            except ValueError:
                raise TraceError(path, lineno, f"length {text!r} is not an integer") from None
            if v < 1:
                raise TraceError(path, lineno, f"length {v} must be >= 1")
            values.append(v)
        if not values:
            raise TraceError(path, None, "file holds no lengths")
        return cls(tuple(values), resample)

    def sample(self, n: int, rng: random.Random) -> list[int]:
        if self.resample:
            return [rng.choice(self.values) for _ in range(n)]
        return [self.values[i % len(self.values)] for i in range(n)]


def synthetic_trace(rate: float, *, num_requests: int | None = None, duration_s: float | None = None,
                    arrival: str = "poisson", cv: float = 1.0,
                    lengths: LengthDistribution = FixedLengths(128), output_len: int = 1,
                    seed: int = 0) -> list[Request]:
    """A synthetic trace: ``arrival`` ``"poisson"`` or ``"gamma"`` (with ``cv``) at
    ``rate`` requests/s, prompt lengths drawn from ``lengths``."""
    if arrival == "poisson":
        times = poisson_arrivals(rate, num_requests=num_requests, duration_s=duration_s, seed=seed)
    elif arrival == "gamma":
        times = gamma_arrivals(rate, cv, num_requests=num_requests, duration_s=duration_s, seed=seed)
    else:
        raise ValueError(f"synthetic_trace: arrival={arrival!r} must be 'poisson' or 'gamma'")
    lens = lengths.sample(len(times), random.Random(f"asap-lengths-{seed}"))
    return [Request(i, t, n, output_len) for i, (t, n) in enumerate(zip(times, lens))]


# --------------------------------------------------------------------------- file formats

def _read_lines(path: Path) -> list[str]:
    return _read_text(path).splitlines()


def _read_text(path: Path) -> str:
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return f.read()
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except UnicodeDecodeError as e:
        raise TraceError(path, None, f"not UTF-8 text ({e.reason} at byte {e.start})") from None


def _length(path: Path, lineno: int, key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(path, lineno, f"{key}={value!r} is not an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise TraceError(path, lineno, f"{key}={value!r} is not an integer")
        value = int(value)
    if value < 0:
        raise TraceError(path, lineno, f"{key}={value} is negative")
    return value


def _parse_mooncake(path: Path) -> list[tuple[float, int, int]]:
    """``(arrival_s since the trace's time origin, prompt_len, output_len)`` per line."""
    rows = []
    for lineno, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(path, lineno, f"bad JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceError(path, lineno, f"missing key {key!r} (keys: {sorted(obj)})")
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise TraceError(path, lineno, f"timestamp={ts!r} is not a finite number of milliseconds")
        rows.append((ts / 1000.0, _length(path, lineno, "input_length", obj["input_length"]),
                     _length(path, lineno, "output_length", obj["output_length"])))
    return rows


_AZURE_TS = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                       r"(Z|[+-]\d{2}:?\d{2})?")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_ns(path: Path, lineno: int, text: str) -> int:
    """An Azure ``TIMESTAMP`` as integer nanoseconds since the epoch (exact)."""
    m = _AZURE_TS.fullmatch(text.strip())
    if m is None:
        raise TraceError(path, lineno, f"TIMESTAMP {text!r} is not a date-time like '2023-11-16 18:15:46.6805900'")
    y, mo, d, h, mi, s, frac, tz = m.groups()
    try:
        when = _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), tzinfo=_dt.timezone.utc)
    except ValueError as e:
        raise TraceError(path, lineno, f"TIMESTAMP {text!r}: {e}") from None
    secs = int(when.timestamp())
    if tz and tz != "Z":
        sign = 1 if tz[0] == "+" else -1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    ns = int((frac or "0")[:9].ljust(9, "0"))
    return secs * 1_000_000_000 + ns


def _parse_azure(path: Path) -> list[tuple[float, int, int]]:
    text = _read_text(path)
    if not text.strip():
        raise TraceError(path, None, "empty file (expected a header TIMESTAMP,ContextTokens,GeneratedTokens)")
    reader = csv.reader(io.StringIO(text, newline=""))
    header = [h.strip() for h in next(reader)]
    missing = [c for c in _AZURE_COLUMNS if c not in header]
    if missing:
        raise TraceError(path, 1, f"CSV header {','.join(header)!r} lacks column(s) {', '.join(missing)} "
                                  f"(expected {','.join(_AZURE_COLUMNS)})")
    i_ts, i_in, i_out = (header.index(c) for c in _AZURE_COLUMNS)
    raw = []
    for row in reader:
        lineno = reader.line_num
        if not row or not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise TraceError(path, lineno, f"{len(row)} fields, header has {len(header)}")
        lens = []
        for i, key in ((i_in, "ContextTokens"), (i_out, "GeneratedTokens")):
            text = row[i].strip()
            try:
                value = int(text)
            except ValueError:
                raise TraceError(path, lineno, f"{key}={text!r} is not an integer") from None
            lens.append(_length(path, lineno, key, value))
        raw.append((_azure_ns(path, lineno, row[i_ts]), lens[0], lens[1]))
    if not raw:
        return []
    t0 = min(ns for ns, _, _ in raw)
    return [((ns - t0) / 1e9, n_in, n_out) for ns, n_in, n_out in raw]


def scale_trace(requests: Sequence[Request], *, speedup: float = 1.0, target_rate: float | None = None,
                length_scale: float = 1.0, max_prompt_len: int | None = None) -> list[Request]:
    """Rescale a trace in time and length, keeping its shape.

    Time: arrival times are divided by ``speedup``, or (``target_rate``, in
    requests/s) stretched so the mean rate ``(n - 1) / duration`` equals it;
    not both. Length: ``prompt_len`` becomes ``round(prompt_len * length_scale)``
    (at least 1 if it was at least 1) and is then capped at ``max_prompt_len``.
    ``output_len`` is kept as is. Order and ``request_id`` are kept.
    """
    if not (math.isfinite(speedup) and speedup > 0):
        raise ValueError(f"scale_trace: speedup={speedup!r} must be positive")
    if target_rate is not None:
        if speedup != 1.0:
            raise ValueError("scale_trace: give speedup or target_rate, not both")
        if not (math.isfinite(target_rate) and target_rate > 0):
            raise ValueError(f"scale_trace: target_rate={target_rate!r} must be positive")
    if not (math.isfinite(length_scale) and length_scale > 0):
        raise ValueError(f"scale_trace: length_scale={length_scale!r} must be positive")
    if max_prompt_len is not None:
        _check_len("scale_trace", "max_prompt_len", max_prompt_len)
    factor = 1.0 / speedup
    if target_rate is not None and len(requests) > 1:
        duration = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
        if duration <= 0:
            raise ValueError(f"scale_trace: all {len(requests)} requests arrive at once; "
                             "target_rate cannot stretch a zero-length trace")
        factor = (len(requests) - 1) / duration / target_rate
    out = []
    for r in requests:
        n = r.prompt_len
        if length_scale != 1.0 and n > 0:
            n = max(1, round(n * length_scale))
        if max_prompt_len is not None:
            n = min(n, max_prompt_len)
        out.append(Request(r.request_id, r.arrival_s * factor, n, r.output_len))
    return out


def _finish(path: Path, rows: list[tuple[float, int, int]], *, speedup: float, target_rate: float | None,
            length_scale: float, max_prompt_len: int | None, start_s: float, skip: int,
            limit: int | None) -> list[Request]:
    if not rows:
        raise TraceError(path, None, "no requests in file")
    if not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"load_trace: start_s={start_s!r} must be finite and >= 0")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"load_trace: skip={skip!r} must be a non-negative int")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_trace: limit={limit!r} must be a positive int")
    rows = sorted(rows, key=lambda r: r[0])  # stable: equal timestamps keep file order
    t0 = rows[0][0]
    rows = [r for r in rows if r[0] - t0 >= start_s][skip:]
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise TraceError(path, None, f"no requests left after start_s={start_s}, skip={skip}")
    t1 = rows[0][0]
    reqs = [Request(i, max(0.0, t - t1), n_in, n_out) for i, (t, n_in, n_out) in enumerate(rows)]
    return scale_trace(reqs, speedup=speedup, target_rate=target_rate, length_scale=length_scale,
                       max_prompt_len=max_prompt_len)


def load_mooncake(path: str | os.PathLike, *, speedup: float = 1.0, target_rate: float | None = None,
                  length_scale: float = 1.0, max_prompt_len: int | None = None, start_s: float = 0.0,
                  skip: int = 0, limit: int | None = None) -> list[Request]:
    """Read a Mooncake JSONL trace. See :func:`load_trace` for the options."""
    path = Path(path)
    return _finish(path, _parse_mooncake(path), speedup=speedup, target_rate=target_rate,
                   length_scale=length_scale, max_prompt_len=max_prompt_len, start_s=start_s, skip=skip, limit=limit)


def load_azure(path: str | os.PathLike, *, speedup: float = 1.0, target_rate: float | None = None,
               length_scale: float = 1.0, max_prompt_len: int | None = None, start_s: float = 0.0,
               skip: int = 0, limit: int | None = None) -> list[Request]:
    """Read an Azure LLM inference CSV trace. See :func:`load_trace` for the options."""
    path = Path(path)
    return _finish(path, _parse_azure(path), speedup=speedup, target_rate=target_rate,
                   length_scale=length_scale, max_prompt_len=max_prompt_len, start_s=start_s, skip=skip, limit=limit)


PUBLIC_TRACES, TRACES_ENV = {"mooncake": "mooncake_conversation.jsonl", "azure": "azure_llm_2023_conv.csv"}, "ASAP_TRACES_DIR"

def traces_dir() -> Path:
    """``$ASAP_TRACES_DIR`` if set, else the package's copy (``asap_comm/data/traces/``)."""
    env = os.environ.get(TRACES_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / "data" / "traces"


def trace_path(name: str) -> Path:
    """A public trace's file (``"mooncake"``, ``"azure"``, or a file name in :func:`traces_dir`); TraceError if absent."""
    fname = PUBLIC_TRACES.get(name, name)
    path = traces_dir() / fname
    if not path.is_file():
        where = f"${TRACES_ENV}={os.environ[TRACES_ENV]}" if os.environ.get(TRACES_ENV) else "the package's data"
        raise TraceError(path, None, f"public trace {name!r} not found in {where} (unset {TRACES_ENV}, or pass a file)")
    return path


def resolve_trace(spec: str | os.PathLike) -> Path:
    """A ``--trace`` value as a file: a public trace's name or an existing path; TraceError naming it otherwise."""
    if isinstance(spec, str) and spec in PUBLIC_TRACES:
        return trace_path(spec)
    path = Path(spec)
    if not path.is_file():
        raise TraceError(path, None, f"no such trace file (a .jsonl/.csv file, or one of {sorted(PUBLIC_TRACES)})")
    return path


def load_trace(path: str | os.PathLike, format: str | None = None, **options) -> list[Request]:
    """Read a trace file: ``format`` ``"mooncake"`` or ``"azure"``, or None to go
    by the suffix (``.jsonl`` / ``.csv``). ``path`` may also be a public trace's
    name, ``"mooncake"`` or ``"azure"`` (:func:`resolve_trace`).

    Options, applied in this order: select by time (``start_s``: skip requests
    that arrive less than that many seconds, in the file's own time, after the
    first), then by count (``skip`` the first requests, keep at most
    ``limit``); re-zero so the first kept request arrives at 0.0; renumber
    0..n-1 in arrival order (equal timestamps keep file order); then
    :func:`scale_trace` (``speedup`` or ``target_rate`` over the kept
    requests, ``length_scale``, ``max_prompt_len``). The whole file is
    validated whatever the selection. Raises :class:`TraceError` on a
    malformed or empty file.
    """
    path = resolve_trace(path) if isinstance(path, str) and path in PUBLIC_TRACES else Path(path)
    if format is None:
        format = {".jsonl": "mooncake", ".csv": "azure"}.get(path.suffix.lower())
        if format is None:
            raise ValueError(f"load_trace: cannot tell the format of {str(path)!r} from its suffix; "
                             "pass format='mooncake' or 'azure'")
    if format == "mooncake":
        return load_mooncake(path, **options)
    if format == "azure":
        return load_azure(path, **options)
    raise ValueError(f"load_trace: format={format!r} must be 'mooncake' or 'azure'")


# --------------------------------------------------------------------------- summary

@dataclass(frozen=True)
class TraceSummary:
    """Shape of a trace, for logs. ``mean_rate_per_s`` is ``(n - 1) / duration``
    (0.0 if undefined); ``interarrival_cv`` the coefficient of variation of the
    gaps (1 for Poisson, > 1 bursty; 0.0 with fewer than two gaps or zero mean);
    ``prompt_skew`` is p99 / p50 of the prompt lengths."""

    num_requests: int
    duration_s: float
    mean_rate_per_s: float
    interarrival_cv: float
    prompt_len_mean: float
    prompt_len_p50: float
    prompt_len_p90: float
    prompt_len_p99: float
    prompt_len_max: int
    prompt_skew: float
    total_prompt_tokens: int

    def describe(self) -> str:
        return (f"{self.num_requests} requests over {self.duration_s:.1f} s ({self.mean_rate_per_s:.2f} req/s, "
                f"inter-arrival CV {self.interarrival_cv:.2f}); prompt tokens mean {self.prompt_len_mean:.0f}, "
                f"p50 {self.prompt_len_p50:.0f}, p90 {self.prompt_len_p90:.0f}, p99 {self.prompt_len_p99:.0f}, "
                f"max {self.prompt_len_max}, p99/p50 {self.prompt_skew:.2f}")


def summarize_trace(requests: Iterable[Request]) -> TraceSummary:
    reqs = sorted(requests, key=lambda r: r.arrival_s)
    if not reqs:
        raise ValueError("summarize_trace: no requests")
    times = [r.arrival_s for r in reqs]
    lens = [r.prompt_len for r in reqs]
    duration = times[-1] - times[0]
    gaps = [b - a for a, b in zip(times, times[1:])]
    cv = 0.0
    if len(gaps) >= 2:
        mean = sum(gaps) / len(gaps)
        if mean > 0:
            cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    p50, p90, p99 = (percentile(lens, q) for q in (50, 90, 99))
    return TraceSummary(
        num_requests=len(reqs),
        duration_s=duration,
        mean_rate_per_s=(len(reqs) - 1) / duration if duration > 0 else 0.0,
        interarrival_cv=cv,
        prompt_len_mean=sum(lens) / len(lens),
        prompt_len_p50=p50, prompt_len_p90=p90, prompt_len_p99=p99,
        prompt_len_max=max(lens),
        prompt_skew=p99 / p50 if p50 > 0 else math.inf,
        total_prompt_tokens=sum(lens),
    )
