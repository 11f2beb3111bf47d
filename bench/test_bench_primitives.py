"""The microbenchmarks of ``bench/run_all.py`` as pytest-benchmark tests: ``pytest bench/ --benchmark-only``.

The measurements are run_all's own: one session runs ``run_all.measure_all`` (every family, the baselines
interleaved with ASAP, ``--bench-quick`` for run_all's ``--quick`` iterations) and ``run_all.build_rows``
compares each row with its baseline and target, exactly as the report does. Each test then hands one row's
samples to pytest-benchmark (one round per sample, in seconds per operation: a latency as measured, a bandwidth
sample as the time of one transfer) and records the row in ``benchmark.extra_info``: the median in the row's unit,
the baseline measured in the same run, its median, the ratio (>1: ASAP better), the target and whether it was
met, and the data check. A test fails only if the benchmark's data check failed or it errored; a target that is
not met does not fail it (as in run_all). ``python bench/run_all.py`` stays the report (table, results.json).
"""
import pytest

pytest.importorskip("pytest_benchmark")

import run_all  # noqa: E402  (pytest puts bench/ on the path: bench/conftest.py)
from _common import GBPS  # noqa: E402

# the whole suite runs in the first test's set-up (about 1.5 minutes on an idle 2-core machine, far more on a
# loaded one): past pyproject's 300-s test timeout
pytestmark = pytest.mark.timeout(3600)

FAMILY_OF = {spec.name: family.title for family in run_all.FAMILIES for spec in family.specs}
NAMES = list(FAMILY_OF)
EXTRA_KEYS = ("unit", "bytes", "median", "p10", "p90", "baseline", "baseline_median", "ratio", "vs_gloo", "target",
              "target_met", "correct", "note")


@pytest.fixture(scope="session")
def suite(request):
    """``(measurements by name, result rows by name)`` of one run_all measurement of every family."""
    cfg = run_all.QUICK if request.config.getoption("--bench-quick") else run_all.FULL
    measurements = run_all.measure_all(cfg)
    return measurements, {row["name"]: row for row in run_all.build_rows(measurements)}


class _Replay:
    """A clock for pytest-benchmark that replays measured times: round ``i`` lasts ``seconds[i]``."""

    __name__ = "replay of run_all's samples"

    def __init__(self, seconds: list) -> None:
        self._seconds, self._i, self._now, self._started = seconds, 0, 0.0, False

    def __call__(self) -> float:
        if self._started:  # the end of a round: it lasted the next sample
            self._now += self._seconds[self._i]
            self._i += 1
        self._started = not self._started
        return self._now


def _seconds_per_op(m) -> list:
    if m.unit == GBPS:  # GB/s of one transfer of m.nbytes
        return [m.nbytes / (s * 1e9) for s in m.samples]
    return [s * 1e-6 for s in m.samples]  # us per operation


@pytest.mark.parametrize("name", NAMES)
def test_bench(benchmark, suite, name):
    measurements, rows = suite
    m, row = measurements[name], rows[name]
    benchmark.extra_info.update({k: row[k] for k in EXTRA_KEYS})
    benchmark.group = FAMILY_OF[name]  # pytest-benchmark's table: one per family, as run_all runs them
    if row["correct"] == "SKIP":
        pytest.skip(row["note"] or "not measured")
    assert row["correct"] == "PASS", f"{name}: {row['note']}"
    seconds = _seconds_per_op(m)
    # pytest-benchmark times its rounds with the fixture's clock; hand it one that replays the samples run_all took
    benchmark._timer = _Replay(seconds)
    benchmark.pedantic(lambda: None, rounds=len(seconds), iterations=1)
