import importlib.util
import os
from pathlib import Path

import pytest
import torch

import asap_comm

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def comm1():
    """A one-PE communicator in this process (no spawn): for argument and timeout checks."""
    c = asap_comm.init(0, 1, master_addr="127.0.0.1", master_port=0, timeout=5.0)
    yield c
    c.close()


@pytest.fixture
def bench_script():
    """``bench_script(name)``: the command ``bench/NAME.py`` loaded as a module from its path (the scripts are
    commands, not a package), for the tests of what a script builds; nothing is added to ``sys.path``."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="session")
def validate_calibrated_tiny(tmp_path_factory):
    """``python -m asap_comm.sim validate --model tiny --configs quick --num-requests 16 --calibrate``, run once for
    the session (about a minute on 2 cores): ``(completed process, its --out folder, the /dev/shm names that were
    there before it)``. Its quick calibration of this host (``calibrate(out, "tiny", quick=True)``, the same call
    as the API's) is what ``test_sim_costs`` checks, its validation what ``test_sim_runtime`` checks: one run,
    not two calibrations of the same host."""
    import glob
    import subprocess
    import sys
    import time

    out = tmp_path_factory.mktemp("validate-calibrated")
    before, t0 = set(glob.glob("/dev/shm/asap-*")), time.time()
    p = subprocess.run([sys.executable, "-m", "asap_comm.sim", "validate", "--out", str(out), "--model", "tiny",
                        "--configs", "quick", "--num-requests", "16", "--calibrate"], capture_output=True, text=True,
                       timeout=280)
    return p, out, before, t0


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test marked ``netns`` (it builds simulated hosts) is skipped, with the reason, where hosts cannot be built
    (no root, no ``ip``/``unshare``), and fails instead where ``$ASAP_REQUIRE_NETNS`` is set (CI runs as root, so
    a skip there would hide a failure); a build without the network backend fails it."""
    if item.get_closest_marker("netns") is None:
        return
    if not _NETNS:  # asked once per session
        from asap_comm.testing.netns import unavailable, why_no_hosts

        _NETNS["hosts"] = unavailable()
        _NETNS["net"] = why_no_hosts() if _NETNS["hosts"] is None else None
    why = _NETNS["hosts"]
    if why is not None:
        if os.environ.get("ASAP_REQUIRE_NETNS"):
            pytest.fail(f"simulated hosts cannot be built ({why}) and $ASAP_REQUIRE_NETNS is set", pytrace=False)
        pytest.skip(f"simulated hosts unavailable: {why}")
    if _NETNS["net"] is not None:
        pytest.fail(_NETNS["net"], pytrace=False)


_NETNS: dict = {}
