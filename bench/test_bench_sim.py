"""The simulator's own speed as pytest-benchmark rows (``pytest bench/ --benchmark-only``): both modes at 384 dies
(ASAP 32 x TP8 + 128 expert dies, the baseline 48 x TP8 with CP above 4k; 16k chunks; the Mooncake trace at 8 req/s,
a load both sustain). Each round simulates the same run; ``extra_info`` holds its events, events/s and requests/s
(median over the rounds) and the event loop that ran (``core``): ASAP runs twice, on its native core
(``asap_comm/sim/core/native.py``; skipped in a build without it) and on the Python engine (``ASAP_SIM_NATIVE=0``),
the baseline on the Python engine. ``bench/bench_sim.py`` times the full 100k-request runs. A test fails only if
the run did not complete every request or the wrong loop ran."""
import statistics
import time

import pytest

pytest.importorskip("pytest_benchmark")

from bench_sim import deployments, repeated_trace  # noqa: E402  (pytest puts bench/ on the path: bench/conftest.py)

from asap_comm.sim.core import native  # noqa: E402
from asap_comm.sim.core.simulate import simulate  # noqa: E402
from asap_comm.sim.core.sweep import at_rate  # noqa: E402
from asap_comm.sim.costmodel.costs import CostModel  # noqa: E402
from asap_comm.sim.costmodel.shapes import ModelShapes  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

DIES, CHUNK, RATE = 384, 16384, 8.0


@pytest.mark.parametrize("mode,core", [("async", "native"), ("async", "python"), ("sync", "python")])
def test_bench_sim_384_dies(benchmark, request, monkeypatch, mode, core):
    if core == "native" and not native.available():
        pytest.skip("asap_comm._C built without the native sim core")
    monkeypatch.setenv("ASAP_SIM_NATIVE", "1" if core == "native" else "0")
    n = 500 if request.config.getoption("--bench-quick") else 2000
    cost, shapes = CostModel.load("ascend-910c-cm384", "deepseek-v3"), ModelShapes.preset("deepseek-v3")
    trace = at_rate(repeated_trace(n)[0], RATE)
    cfg, par, W = deployments(DIES, CHUNK)[mode]
    runs = []

    def one():
        t0 = time.perf_counter()
        res = simulate(mode, trace, cost, shapes, cfg, sync_ranks=W, par=par)
        runs.append((time.perf_counter() - t0, res.events, sum(r.ok for r in res.records)))
        assert res.core == core, f"{mode}: the {res.core} loop ran, not the {core} one"

    benchmark.group = f"simulator, {DIES} dies, {n} requests"
    benchmark.pedantic(one, rounds=3, iterations=1)
    wall = statistics.median(w for w, _, _ in runs)
    events = runs[0][1]
    benchmark.extra_info.update({"mode": mode, "core": core, "dies": DIES, "chunk": CHUNK, "requests": n,
                                 "events": events, "events_per_s": events / wall, "requests_per_s": n / wall,
                                 "wall_s_spread": [min(w for w, _, _ in runs), max(w for w, _, _ in runs)]})
    assert all(ok == n for _, _, ok in runs), f"{mode}: not every request completed: {[ok for *_, ok in runs]}"
