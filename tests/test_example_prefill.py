"""The README's main job, on a tiny configuration: it runs both modes, checks every request
against the reference forward and writes the artifacts with the contract keys; the automatic
SLO sits above both modes' measured unloaded TTFT; ``--help`` describes every flag with its
default; progress written to a pipe has no carriage returns. Every subprocess is bounded."""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs the example end to end in subprocesses

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "prefill.py"
TINY = ["--model", "tiny", "--max-prompt-len", "64", "--median-len", "12", "--token-budget", "32", "--chunk-len", "16"]


def run_example(args: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The example with stdout and stderr on pipes, as raw bytes (text mode would turn "\\r" into "\\n")."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": path})


def tail(r: subprocess.CompletedProcess) -> str:
    return (r.stdout[-2000:] + r.stderr[-4000:]).decode(errors="replace")


def test_prefill_example_end_to_end(tmp_path):
    out = tmp_path / "run"
    r = run_example([*TINY, "--num-requests", "8", "--rate", "20", "--sweep", "10,40", "--out", str(out)],
                    tmp_path, timeout=240)
    assert r.returncode == 0, tail(r)
    summary = json.loads((out / "summary.json").read_text())
    for mode in ("async", "sync"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s", "slo_attainment",
                    "num_requests", "num_failed", "slo_compliant_throughput"):
            assert key in summary[mode], (mode, key)
        assert summary[mode]["num_requests"] == 8 and summary[mode]["num_failed"] == 0
        sct, at = summary[mode]["slo_compliant_throughput"], summary[mode]["at_slo_compliant_load"]
        assert (at is None) if sct is None else (at["offered_tokens_per_s"] == sct and at["runs"] == 1
                                                 and at["served_tokens_per_s"] > 0)
    assert summary["correctness"]["checked"] == 32 and summary["correctness"]["mismatches"] == 0
    assert len(summary["runs"]) == 4 and {run["mode"] for run in summary["runs"]} == {"async", "sync"}
    for run in summary["runs"]:  # the long-prompt lane's counts: ASAP's runs only (the baseline has no lane)
        assert ("lane" in run) == (run["mode"] == "async"), run
        if "lane" in run:
            lane = run["lane"]
            assert set(lane) == {"opened", "waited", "gave_up", "wait_s_mean", "wait_s_max"}, lane
            assert lane["gave_up"] <= lane["waited"] and lane["opened"] <= 8 and lane["wait_s_max"] >= 0

    # the automatic SLO: 3x the baseline's unloaded TTFT, measured on the served system, above both modes'
    slo = summary["slo"]
    assert slo["source"] == "auto" and slo["multiplier"] == 3.0
    unloaded = slo["unloaded_ttft_s"]
    assert set(unloaded) == {"async", "sync"} and all(0 < v < 5 for v in unloaded.values()), unloaded
    assert slo["ttft_s"] == pytest.approx(3.0 * unloaded["sync"])
    assert slo["ttft_s"] >= max(unloaded.values()), slo
    assert 1 <= slo["p90_prompt_tokens"] <= 64
    assert not {"slo_s", "unloaded_p90_prefill_s"} & set(summary["config"])  # stored once, under "slo"
    assert f"TTFT SLO {slo['ttft_s']:.3f} s".encode() in r.stdout

    # progress on a pipe: whole lines, never "\r"
    assert b"\r" not in r.stdout and b"\r" not in r.stderr
    assert re.search(rb"\[async\][^\n]*completed\n", r.stderr) and re.search(rb"\[sync\][^\n]*completed\n", r.stderr)

    timeline = json.loads((out / "timeline_async.json").read_text())
    assert any(e.get("ph") == "X" for e in timeline["traceEvents"])
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"mismatches" in r.stdout and b"async" in r.stdout and b"sync" in r.stdout


def test_prefill_example_slo_flag_overrides(tmp_path):
    out = tmp_path / "run"
    r = run_example([*TINY, "--num-requests", "4", "--rate", "20", "--modes", "async", "--slo", "0.5",
                     "--out", str(out)], tmp_path, timeout=120)
    assert r.returncode == 0, tail(r)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["slo"]["ttft_s"] == 0.5 and summary["slo"]["source"] == "flag"
    assert summary["slo"]["unloaded_ttft_s"] == {}  # not measured when the SLO is given
    assert b"unloaded TTFT" not in r.stderr and b"TTFT SLO 0.500 s (--slo)" in r.stdout
    assert "sync" not in summary and summary["async"]["num_requests"] == 4 and summary["async"]["num_failed"] == 0


def test_prefill_example_help_lists_every_flag_with_default(tmp_path):
    r = run_example(["--help"], tmp_path, timeout=60)
    assert r.returncode == 0, tail(r)
    text = r.stdout.decode()
    assert "\r" not in text
    usage, _, options = text.partition("\noptions:\n")
    flags = re.findall(r"\[(--[a-z][a-z-]*)", usage)
    assert len(flags) >= 20 and "--slo" in flags and "--no-expert-batching" in flags, flags
    # one block per option: its first line starts with two spaces and a dash
    blocks = {}
    for block in re.split(r"\n(?=  -)", options):
        block = block.strip()
        blocks[re.match(r"(?:-\w, )?(--[a-z-]+)", block).group(1)] = block
    for flag in flags:
        assert flag in blocks, f"{flag} missing from --help"
        body = " ".join(blocks[flag].split())
        assert "(default: " in body, f"{flag} shows no default: {body}"
        described = re.sub(r"^--[a-z-]+( [A-Z_]+)?|\(default: [^)]*\)", "", body).strip()
        assert len(described) > 10, f"{flag} has no description: {body}"


@pytest.mark.parametrize("case", ["preset", "trace", "matplotlib"])
def test_prefill_example_user_errors_exit_2_with_one_line(tmp_path, case, capsys, monkeypatch):
    """A user's mistake prints one clear line and exits 2, before any run starts: no traceback. (The example's
    main() in this process, loaded from its path, with the argv a user would give: an exception would fail the
    test; no interpreter is started for a usage error.)"""
    import importlib.util

    if case == "preset":
        argv = ["--model", "nope", "--out", str(tmp_path / "o")]
        expected = "unknown name 'nope'"
    elif case == "trace":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\nnot json\n')
        argv = ["--trace", str(bad), "--out", str(tmp_path / "o")]
        expected = "bad.jsonl:2"
    else:  # matplotlib absent: said before the run, not after it
        monkeypatch.setitem(sys.modules, "matplotlib", None)
        argv = ["--out", str(tmp_path / "o")]
        expected = "matplotlib is missing"
    spec = importlib.util.spec_from_file_location("example_prefill", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    capsys.readouterr()
    try:
        rc = example.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err[-4000:]
    assert expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists(), "the run started"


def test_parse_args_fills_the_emulate_defaults_of_absent_flags_only(bench_script):
    """deploy.parse_args (what the example and bench/afd_window.py build their arguments with): with --emulate, every
    flag not given takes EMULATE_DEFAULTS, a given one keeps its value; afd_window's --cp-threshold reaches the
    baseline and a bad one exits 2."""
    afd_window = bench_script("afd_window")
    from asap_comm.serving.protocol import RuntimeConfig
    from asap_comm.sim.emulate import deploy

    a = deploy.parse_args(["--emulate", "ascend-910c-cm384", "--attention-tp", "4", "--cp-threshold", "0"])
    assert (a.attention_tp, a.cp_threshold, a.sync_tp, a.expert_dies) == (4, 0, 8, 4)
    assert a.model == "tiny" and a.length_scale == pytest.approx(1 / a.token_scale)
    plain = deploy.parse_args(["--attention-ranks", "3"])  # no --emulate: the parser's own defaults
    assert plain.attention_ranks == 3 and plain.emulate is None and plain.length_scale == 1.0
    ns = argparse.Namespace(seed=0, num_requests=16, time_scale=0.35, token_scale=128, no_long_prompt_lane=True,
                            cp_threshold=0)
    ea = afd_window.emulate_args(ns, "ascend-910c-cm384")
    assert ea.cp_threshold == 0 and ea.no_long_prompt_lane and ea.num_requests == 16 and ea.attention_ranks == 2
    base = RuntimeConfig(num_attention_ranks=2, num_expert_ranks=4, cp_threshold=None)
    assert deploy.mode_config(base, "sync", ea).cp_threshold is None  # 0: the baseline without CP
    assert deploy.mode_config(base, "sync", afd_window.emulate_args(
        argparse.Namespace(**{**vars(ns), "cp_threshold": None}), "ascend-910c-cm384")).cp_threshold == 64
    with pytest.raises(SystemExit) as e:
        afd_window.main(["--cp-threshold", "-1"])
    assert e.value.code == 2


def test_sweep_auto_halves_no_lower_than_its_floor_and_says_where_it_stopped():
    """--sweep auto on a mode that meets the SLO at no load: halving stops at the rate whose probe would span more
    than SWEEP_MAX_PROBE_S (before: 8 halvings, the last probes minutes each); the search reports that rate."""
    from asap_comm.sim.core.sweep import search_rate
    from asap_comm.sim.emulate import job

    floor = job.sweep_floor(240)
    assert floor == pytest.approx(job.SWEEP_MIN_REQUESTS / job.SWEEP_MAX_PROBE_S)
    assert job.sweep_floor(20) == pytest.approx(20 / job.SWEEP_MAX_PROBE_S)  # a shorter load: shorter probes
    ran = []
    lowest = job.sweep_auto(lambda r: ran.append(r) or (0.5, 1.0), 8.0, min_rate=floor)
    assert ran == [8.0 / 2 ** k for k in range(len(ran))] and min(ran) >= floor > min(ran) / 2
    assert lowest == min(ran) and len(ran) < 9  # the floor, not the 8 halvings, ended it
    # a mode that meets the SLO below the start: the floor does not stop it, and the search bisects as before
    ran.clear()
    assert job.sweep_auto(lambda r: ran.append(r) or ((0.95, 1.0) if r <= 1.0 else (0.5, 1.0)), 8.0,
                              min_rate=floor) is None
    assert 1.0 in ran and len(ran) == 4 + job.SWEEP_AUTO_BISECTIONS
    # without a floor: the 8 halvings of before
    assert len(search_rate(lambda r: (0.0, 1.0), 8.0)) == 9
    with pytest.raises(ValueError, match="min_rate"):
        search_rate(lambda r: (1.0, 1.0), 8.0, min_rate=-1)


def test_sweep_auto_counts_only_sustained_loads():
    """--sweep auto bisects on the combined criterion: a load that meets the SLO attainment but is served below 90%
    of offered (the longest requests queued without bound) fails, so the search stops below it; a runner that
    returns the attainment alone is refused."""
    from asap_comm.sim.core.sweep import search_rate
    from asap_comm.sim.emulate import job

    seen = search_rate(lambda r: (1.0, 1.0 if r <= 2.0 else 0.5), 1.0, bisections=3)
    passed = [r for r, (a, f) in seen.items() if a >= 0.9 and f >= 0.9]
    assert max(passed) == 2.0 and all(r > 2.0 for r in seen if r not in passed)
    # attainment 1.0 everywhere, served 9% of offered everywhere: no load passes
    assert job.sweep_auto(lambda r: (1.0, 0.09), 8.0, min_rate=1.0) == 1.0
    with pytest.raises(ValueError, match="served_fraction"):
        search_rate(lambda r: 1.0, 8.0)


def test_bench_serving_takes_the_examples_arguments_and_memory_check(tmp_path, bench_script):
    """bench/bench_serving.py builds its deployment with the example's own parser (before: a hand-built namespace
    that lacked flags the example added later, such as --routing, so --emulate failed with an AttributeError):
    the emulated defaults are the example's, every attribute the example's helpers read is there, and a deployment
    the emulated dies cannot hold exits 2 with one line naming memory."""
    bench_serving = bench_script("bench_serving")
    from asap_models import StageFactory

    from asap_comm.sim.emulate import deploy

    def bench_args(*argv):
        return bench_serving.build_parser().parse_args(list(argv))

    e = bench_serving.example_args(bench_args("--emulate", "ascend-910c-cm384", "--num-requests", "240",
                                              "--attention-tp", "4"))
    want = deploy.parse_args(["--emulate", "ascend-910c-cm384", "--num-requests", "240", "--attention-tp", "4",
                               "--time-scale", repr(deploy.DEFAULT_TIME_SCALE)])
    assert vars(e) == vars(want) and e.model == "tiny" and e.routing == "balanced"
    assert deploy.memory_refusal(e) is None
    for mode in ("async", "sync"):  # the call that raised AttributeError on the hand-built namespace
        assert deploy.emulated(e, StageFactory(e.model, 0), mode).describe_emulation()["profile"]
    plain = bench_serving.example_args(bench_args("--model", "tiny", "--attention-ranks", "3"))
    assert vars(plain) == vars(deploy.parse_args(["--num-requests", "40", "--slo", "auto", "--model", "tiny",
                                                   "--attention-ranks", "3"]))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--emulate", "ascend-910c-cm384",
                        "--attention-tp", "1", "--expert-ranks", "1", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "memory" in lines[0] and "bench_serving.py" in lines[0], r.stderr
    # a load the example refuses with one line (8 Mooncake requests share one timestamp: no rate to scale to)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--emulate", "ascend-910c-cm384",
                        "--num-requests", "8", "--rates", "1", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "arrive at once" in lines[0], r.stderr
