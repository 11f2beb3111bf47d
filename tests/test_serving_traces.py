"""asap_comm.serving.traces: synthetic load, the Mooncake/Azure loaders, scaling, errors.

Cheapest tier: pure functions, small files written to tmp_path, and the real
public traces that ship with the package (asap_comm/data/traces). No spawn.
"""
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from asap_comm.serving import (EmpiricalLengths, FixedLengths, LogNormalLengths, Request, TraceError,
                               UniformLengths, gamma_arrivals, load_azure, load_mooncake, load_trace,
                               poisson_arrivals, scale_trace, summarize_trace, synthetic_trace)
from asap_comm.serving.traces import PUBLIC_TRACES, TRACES_ENV, resolve_trace, trace_path

MOONCAKE = trace_path("mooncake")  # the copies that ship with the package (asap_comm/data/traces/)
AZURE = trace_path("azure")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _mooncake_text(rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# --------------------------------------------------------------------------- Request

def test_request_validation():
    r = Request(0, 0.5, 10)
    assert r.output_len == 1
    for bad in (dict(arrival_s=-1.0), dict(arrival_s=math.nan), dict(prompt_len=-1), dict(prompt_len=2.5),
                dict(output_len=True)):
        kw = dict(request_id=0, arrival_s=0.0, prompt_len=1) | bad
        with pytest.raises(ValueError, match="Request:"):
            Request(**kw)


# --------------------------------------------------------------------------- arrivals

@pytest.mark.parametrize("rate", [0.5, 20.0])
def test_poisson_mean_gap_and_cv(rate):
    t = poisson_arrivals(rate, num_requests=4000, seed=1)
    assert len(t) == 4000 and t[0] == 0.0 and t == sorted(t)
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.06)  # std of the mean ~ 1.6% here
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, abs=0.08)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_mean_gap_and_cv(cv):
    rate = 3.0
    t = gamma_arrivals(rate, cv, num_requests=6000, seed=2)
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=0.15)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.2)  # the CV estimate is noisy at cv=4


def test_arrivals_by_duration_and_determinism():
    t = poisson_arrivals(10.0, duration_s=50.0, seed=3)
    assert t[0] == 0.0 and max(t) < 50.0
    assert 400 < len(t) < 600
    assert poisson_arrivals(10.0, duration_s=50.0, seed=3) == t
    assert poisson_arrivals(10.0, duration_s=50.0, seed=4) != t
    assert gamma_arrivals(2.0, 3.0, num_requests=50, seed=5) == gamma_arrivals(2.0, 3.0, num_requests=50, seed=5)
    assert poisson_arrivals(1.0, num_requests=0) == []
    assert poisson_arrivals(1.0, duration_s=0.0) == []


def test_arrivals_argument_errors():
    with pytest.raises(ValueError, match="exactly one of num_requests and duration_s"):
        poisson_arrivals(1.0)
    with pytest.raises(ValueError, match="exactly one"):
        poisson_arrivals(1.0, num_requests=3, duration_s=2.0)
    with pytest.raises(ValueError, match="rate=0"):
        poisson_arrivals(0, num_requests=3)
    with pytest.raises(ValueError, match="cv=-1"):
        gamma_arrivals(1.0, -1, num_requests=3)
    with pytest.raises(ValueError, match="arrival='uniform'"):
        synthetic_trace(1.0, num_requests=3, arrival="uniform")


# --------------------------------------------------------------------------- lengths

def test_length_distributions_bounds():
    rng = random.Random(0)
    assert FixedLengths(7).sample(3, rng) == [7, 7, 7]
    u = UniformLengths(5, 9).sample(2000, rng)
    assert min(u) == 5 and max(u) == 9  # both ends reached in 2000 draws
    ln = LogNormalLengths(median=200, sigma=1.0, min_len=32, max_len=1024).sample(4000, rng)
    assert min(ln) == 32 and max(ln) == 1024 and all(isinstance(x, int) for x in ln)
    assert statistics.median(ln) == pytest.approx(200, rel=0.1)
    e = EmpiricalLengths((3, 4, 5), resample=False).sample(7, rng)
    assert e == [3, 4, 5, 3, 4, 5, 3]
    assert set(EmpiricalLengths((3, 4, 5)).sample(200, rng)) == {3, 4, 5}
    for bad in (lambda: FixedLengths(0), lambda: UniformLengths(5, 4), lambda: LogNormalLengths(0, 1.0),
                lambda: LogNormalLengths(10, 1.0, min_len=10, max_len=5), lambda: EmpiricalLengths(())):
        with pytest.raises(ValueError):
            bad()


def test_empirical_lengths_from_files(tmp_path):
    txt = _write(tmp_path / "lens.txt", "# prompt lengths\n12\n\n40  # long one\n7\n")
    assert EmpiricalLengths.from_file(txt, resample=False).values == (12, 40, 7)
    bad = _write(tmp_path / "bad.txt", "12\nabc\n")
    with pytest.raises(TraceError, match=r"bad\.txt:2: length 'abc' is not an integer"):
        EmpiricalLengths.from_file(bad)
    mc = _write(tmp_path / "t.jsonl", _mooncake_text([{"timestamp": 5, "input_length": 9, "output_length": 1},
                                                      {"timestamp": 0, "input_length": 4, "output_length": 1}]))
    assert EmpiricalLengths.from_file(mc, resample=False).values == (4, 9)  # arrival order


def test_synthetic_trace_deterministic_and_independent_streams():
    kw = dict(num_requests=100, arrival="gamma", cv=2.0, seed=11)
    a = synthetic_trace(5.0, lengths=LogNormalLengths(64, 0.8, 8, 512), **kw)
    b = synthetic_trace(5.0, lengths=LogNormalLengths(64, 0.8, 8, 512), **kw)
    c = synthetic_trace(5.0, lengths=UniformLengths(1, 10), **kw)
    assert a == b
    assert [r.request_id for r in a] == list(range(100))
    assert [r.arrival_s for r in a] == [r.arrival_s for r in c]  # lengths do not perturb arrivals
    assert all(8 <= r.prompt_len <= 512 for r in a)


# --------------------------------------------------------------------------- Mooncake

def test_mooncake_load_sort_and_renumber(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 30, "output_length": 5, "hash_ids": [0, 1]},
            {"timestamp": 250, "input_length": 20, "output_length": 4},
            {"timestamp": 250, "input_length": 21, "output_length": 6},
            {"timestamp": 3250.5, "input_length": 40.0, "output_length": 0}]
    path = _write(tmp_path / "m.jsonl", _mooncake_text(rows) + "\n")  # trailing blank line is fine
    reqs = load_mooncake(path)
    assert reqs == [Request(0, 0.0, 20, 4), Request(1, 0.0, 21, 6), Request(2, 0.75, 30, 5),
                    Request(3, 3.0005, 40, 0)]
    assert load_trace(path) == reqs


def test_mooncake_scaling_and_selection(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 100 * (i + 1), "output_length": 1} for i in range(10)]
    path = _write(tmp_path / "m.jsonl", _mooncake_text(rows))
    fast = load_mooncake(path, speedup=4.0)
    assert [r.arrival_s for r in fast] == [i / 4 for i in range(10)]
    at = load_mooncake(path, target_rate=3.0)
    assert summarize_trace(at).mean_rate_per_s == pytest.approx(3.0)
    short = load_mooncake(path, length_scale=0.25, max_prompt_len=150)
    assert [r.prompt_len for r in short] == [25, 50, 75, 100, 125, 150, 150, 150, 150, 150]
    assert [r.prompt_len for r in load_mooncake(path, length_scale=1e-6)] == [1] * 10  # never below 1
    win = load_mooncake(path, start_s=2.5, limit=3)
    assert [(r.request_id, r.arrival_s, r.prompt_len) for r in win] == [(0, 0.0, 400), (1, 1.0, 500),
                                                                         (2, 2.0, 600)]
    assert [r.prompt_len for r in load_mooncake(path, skip=8)] == [900, 1000]
    win_rate = load_mooncake(path, start_s=2.0, limit=5, target_rate=2.0)  # rate of the window
    assert win_rate[-1].arrival_s == pytest.approx(2.0)
    with pytest.raises(ValueError, match="not both"):
        load_mooncake(path, speedup=2.0, target_rate=1.0)
    with pytest.raises(TraceError, match="no requests left"):
        load_mooncake(path, start_s=100.0)
    with pytest.raises(ValueError, match="limit=0"):
        load_mooncake(path, limit=0)


@pytest.mark.parametrize("line, reason", [
    ('{"timestamp": 5, "input_length": 3', "bad JSON"),
    ('[1, 2, 3]', "expected a JSON object, got list"),
    ('{"timestamp": 5, "output_length": 3}', "missing key 'input_length'"),
    ('{"timestamp": 5, "input_length": -3, "output_length": 3}', "input_length=-3 is negative"),
    ('{"timestamp": 5, "input_length": 2.5, "output_length": 3}', "input_length=2.5 is not an integer"),
    ('{"timestamp": 5, "input_length": "12", "output_length": 3}', "input_length='12' is not an integer"),
    ('{"timestamp": 5, "input_length": 12, "output_length": true}', "output_length=True is not an integer"),
    ('{"timestamp": "noon", "input_length": 12, "output_length": 3}', "timestamp='noon' is not a finite number"),
])
def test_mooncake_malformed_line_named(tmp_path, line, reason):
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
    path = _write(tmp_path / "bad.jsonl", good + "\n" + good + line + "\n" + good)
    with pytest.raises(TraceError, match=r"bad\.jsonl:4: ") as ei:
        load_mooncake(path)
    assert reason in str(ei.value)
    assert ei.value.line == 4 and ei.value.path == str(path) and isinstance(ei.value, ValueError)


def test_empty_and_missing_files(tmp_path):
    for name, loader in (("e.jsonl", load_mooncake), ("e.csv", load_azure)):
        path = _write(tmp_path / name, "\n  \n")
        with pytest.raises(TraceError, match=rf"{name}: (no requests in file|empty file)"):
            loader(path)
    header_only = _write(tmp_path / "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceError, match=r"h\.csv: no requests in file"):
        load_azure(header_only)
    with pytest.raises(TraceError, match="no such file"):
        load_mooncake(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_trace(tmp_path / "x.txt")


# --------------------------------------------------------------------------- Azure

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def test_azure_load_real_timestamp_format(tmp_path):
    path = _write(tmp_path / "a.csv", AZURE_HEADER +
                  "2023-11-16 18:15:46.6805900,374,44\r\n"
                  "2023-11-16 18:15:50.9951690,396,109\r\n"
                  "2023-11-16 18:15:46.6805901,879,55\r\n"   # 100 ns after the first, out of order
                  "2023-11-16 18:16:00,91,16\r\n")           # no fraction
    reqs = load_azure(path)
    assert [r.prompt_len for r in reqs] == [374, 879, 396, 91]
    assert [r.output_len for r in reqs] == [44, 55, 109, 16]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(1e-7, abs=1e-12)  # 7 fractional digits read exactly
    assert reqs[2].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert reqs[3].arrival_s == pytest.approx(13.31941, abs=1e-9)
    assert load_trace(path, speedup=2.0)[3].arrival_s == pytest.approx(13.31941 / 2)


def test_azure_column_order_extra_columns_and_timezones(tmp_path):
    path = _write(tmp_path / "a.csv", "GeneratedTokens,Extra,ContextTokens,TIMESTAMP\n"
                                      "5,x,10,2024-05-10T00:00:01.5Z\n"
                                      "6,y,11,2024-05-10T02:00:00+02:00\n")
    reqs = load_azure(path)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in reqs] == [(0.0, 11, 6), (1.5, 10, 5)]


@pytest.mark.parametrize("body, line, reason", [
    ("2023-11-16 18:15:46.68,374\n", 3, "2 fields, header has 3"),
    ("2023-11-16 18:15:46.68,abc,44\n", 3, "ContextTokens='abc' is not an integer"),
    ("2023-11-16 18:15:46.68,12,-4\n", 3, "GeneratedTokens=-4 is negative"),
    ("2023-11-16 18:15:46.68,1.5,4\n", 3, "ContextTokens='1.5' is not an integer"),
    ("16/11/2023 18:15,12,4\n", 3, "TIMESTAMP '16/11/2023 18:15' is not a date-time"),
    ("2023-13-16 18:15:46,12,4\n", 3, "month must be in 1..12"),
])
def test_azure_malformed_line_named(tmp_path, body, line, reason):
    path = _write(tmp_path / "bad.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n" + body)
    with pytest.raises(TraceError, match=rf"bad\.csv:{line}: ") as ei:
        load_azure(path)
    assert reason in str(ei.value)


def test_azure_wrong_header(tmp_path):
    path = _write(tmp_path / "h.csv", "timestamp,input_length,output_length\n2023-11-16 18:15:46,1,1\n")
    with pytest.raises(TraceError, match=r"h\.csv:1: CSV header .* lacks column\(s\) TIMESTAMP, ContextTokens, "
                                         r"GeneratedTokens"):
        load_azure(path)


# --------------------------------------------------------------------------- scaling, summary

def test_scale_trace_keeps_shape():
    reqs = synthetic_trace(2.0, num_requests=50, lengths=UniformLengths(100, 200), seed=0)
    s = scale_trace(reqs, target_rate=8.0, length_scale=0.5)
    assert summarize_trace(s).mean_rate_per_s == pytest.approx(8.0)
    ratio = [b.arrival_s / a.arrival_s for a, b in zip(reqs[1:], s[1:])]
    assert max(ratio) == pytest.approx(min(ratio))  # one common factor
    assert [b.prompt_len for b in s] == [max(1, round(a.prompt_len * 0.5)) for a in reqs]
    assert scale_trace([Request(0, 0.0, 5)], target_rate=3.0) == [Request(0, 0.0, 5)]  # one request: nothing to stretch
    with pytest.raises(ValueError, match="arrive at once"):
        scale_trace([Request(0, 0.0, 5), Request(1, 0.0, 5)], target_rate=3.0)
    with pytest.raises(ValueError, match="max_prompt_len=0"):
        scale_trace(reqs, max_prompt_len=0)


def test_summarize_trace_hand_computed():
    reqs = [Request(i, t, n) for i, (t, n) in enumerate([(0.0, 10), (1.0, 20), (3.0, 30), (4.0, 40)])]
    s = summarize_trace(reqs)
    assert (s.num_requests, s.duration_s, s.mean_rate_per_s) == (4, 4.0, 0.75)
    gaps_cv = statistics.pstdev([1.0, 2.0, 1.0]) / (4 / 3)
    assert s.interarrival_cv == pytest.approx(gaps_cv)
    assert (s.prompt_len_p50, s.prompt_len_max, s.total_prompt_tokens) == (25.0, 40, 100)
    assert s.prompt_len_p99 == pytest.approx(39.7)
    assert s.prompt_skew == pytest.approx(39.7 / 25)
    assert "4 requests over 4.0 s" in s.describe()
    with pytest.raises(ValueError, match="no requests"):
        summarize_trace([])


# --------------------------------------------------------------------------- the real public traces

def _require(path: Path) -> Path:
    assert path.is_file(), f"the public trace {path} must ship with the package"
    return path


def test_real_mooncake_trace():
    reqs = load_mooncake(_require(MOONCAKE))
    s = summarize_trace(reqs)
    assert s.num_requests == 12031  # README: 12,031 requests, one hour, mean input 12,035
    assert s.duration_s == pytest.approx(3536.999)
    assert s.prompt_len_mean == pytest.approx(12035, abs=1)
    assert s.interarrival_cv > 1.5 and s.prompt_skew > 5  # bursty and skewed: why it is the default shape
    scaled = load_mooncake(MOONCAKE, target_rate=2.0, length_scale=1 / 16, max_prompt_len=2048, limit=300)
    t = summarize_trace(scaled)
    assert t.num_requests == 300 and t.mean_rate_per_s == pytest.approx(2.0)
    assert 1 <= min(r.prompt_len for r in scaled) and t.prompt_len_max <= 2048


def test_real_azure_trace():
    reqs = load_azure(_require(AZURE))
    s = summarize_trace(reqs)
    assert s.num_requests == 19366
    assert 3000 < s.duration_s < 3700  # one hour of 2023-11-16
    assert reqs[0].arrival_s == 0.0 and all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert min(r.prompt_len for r in reqs) >= 1
    window = load_azure(AZURE, start_s=600.0, limit=100, speedup=10.0)
    assert len(window) == 100 and window[0].arrival_s == 0.0


# --------------------------------------------------------------------------- layering

def test_serving_imports_no_models_and_core_does_not_import_serving():
    code = ("import sys, asap_comm; assert 'asap_comm.serving' not in sys.modules; "
            "import asap_comm.serving; "
            "bad = [m for m in sys.modules if m == 'models' or m.startswith(('models.', 'asap_models'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- where the public traces are found

def test_the_public_traces_ship_with_the_package_and_load_by_name():
    for name, fname in PUBLIC_TRACES.items():
        path = trace_path(name)
        assert path.name == fname and path.is_file()
        assert resolve_trace(name) == path
    head = load_trace("mooncake", limit=5)
    assert [r.request_id for r in head] == list(range(5))
    assert head == load_trace(trace_path("mooncake"), limit=5)
    assert len(load_trace("azure", limit=3)) == 3


def test_the_traces_folder_can_be_overridden_and_a_missing_trace_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    with pytest.raises(TraceError, match=r"public trace 'mooncake' not found in \$ASAP_TRACES_DIR"):
        trace_path("mooncake")
    (tmp_path / "mooncake_conversation.jsonl").write_text(_mooncake_text(
        [{"timestamp": 0, "input_length": 7, "output_length": 1}, {"timestamp": 5, "input_length": 9,
                                                                  "output_length": 1}]))
    assert [r.prompt_len for r in load_trace("mooncake")] == [7, 9]
    with pytest.raises(TraceError, match="no such trace file"):
        resolve_trace(str(tmp_path / "nope.jsonl"))


def test_no_project_file_names_the_folder_beside_the_repository():
    repo = Path(__file__).resolve().parents[1]
    needle = "../" + "shared"
    offenders = []
    for path in repo.rglob("*"):
        if any(part in {".git", ".venv", "venv", "build", "runs", "__pycache__"} or part.endswith(".egg-info")
               for part in path.relative_to(repo).parts):
            continue
        if path.is_file() and path.suffix in {".py", ".md", ".toml", ".cfg", ".sh", ".txt", ".yml", ".yaml", ".json", ""}:
            try:
                if needle in path.read_text(errors="ignore"):
                    offenders.append(str(path.relative_to(repo)))
            except OSError:
                pass
    assert not offenders, f"files that read the folder beside the repository: {offenders}"
