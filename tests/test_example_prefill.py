"""The README's main job, on a tiny configuration: it runs both modes, checks every request
against the reference forward and writes the artifacts with the contract keys."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_prefill_example_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "examples" / "prefill.py"), "--model", "tiny", "--num-requests", "8",
           "--rate", "20", "--max-prompt-len", "64", "--median-len", "12", "--token-budget", "32",
           "--chunk-len", "16", "--sweep", "10,40", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    for mode in ("async", "sync"):
        for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_tokens_per_s", "slo_attainment",
                    "num_requests", "num_failed", "slo_compliant_throughput"):
            assert key in summary[mode], (mode, key)
        assert summary[mode]["num_requests"] == 8 and summary[mode]["num_failed"] == 0
    assert summary["correctness"]["checked"] == 32 and summary["correctness"]["mismatches"] == 0
    timeline = json.loads((out / "timeline_async.json").read_text())
    assert any(e.get("ph") == "X" for e in timeline["traceEvents"])
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mismatches" in r.stdout and "async" in r.stdout and "sync" in r.stdout
