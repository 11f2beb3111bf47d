"""A /dev/shm too small for a group is a clear error, never SIGBUS: segments are allocated for real
(posix_fallocate) when the library hands out their bytes, so running out shows at the allocation, naming
/dev/shm, the bytes wanted and the bytes free; the HTTP service exits 2 with that line. Each test runs in a
private mount namespace whose /dev/shm is a small tmpfs (needs root, as the multi-host tests do)."""
import os
import shutil
import sys
import textwrap

import pytest

from asap_comm.testing.faults import in_small_shm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _why_not() -> "str | None":
    if sys.platform != "linux" or shutil.which("unshare") is None:
        return "needs Linux and unshare"
    if os.geteuid() != 0:
        return "mounting a private tmpfs needs root"
    return None


_why = _why_not()
if _why is not None:
    if os.environ.get("ASAP_REQUIRE_NETNS"):
        pytest.fail(f"shared-memory exhaustion tests cannot run ({_why}) and $ASAP_REQUIRE_NETNS is set",
                    pytrace=False)
    pytest.skip(_why, allow_module_level=True)


_GROUP = textwrap.dedent("""
    import os, sys, glob, torch, asap_comm

    def pe(comm, nbytes):
        small = comm.zeros(1024, torch.uint8)          # fits
        big = comm.zeros(nbytes, torch.uint8)          # does not: OutOfSharedMemory, not SIGBUS
        big.fill_(1)
        return "allocated"

    if __name__ == "__main__":
        try:
            print(asap_comm.launch(pe, 2, 8 << 20, timeout=120))
        except asap_comm.LaunchError as e:
            print("LAUNCH_ERROR", e.remote_type, str(e).splitlines()[0])
        print("LEFT", sorted(glob.glob("/dev/shm/asap-*")))
""")


def test_a_full_dev_shm_is_a_clear_error_not_sigbus(tmp_path):
    script = tmp_path / "group.py"
    script.write_text(_GROUP)
    r = in_small_shm("2m", [sys.executable, str(script)], timeout=180, cwd=REPO)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "LAUNCH_ERROR OutOfSharedMemory" in out, out
    assert "/dev/shm has" in out and "8388608 wanted" in out and "bytes free" in out, out
    assert "LEFT []" in out, out  # nothing left behind


@pytest.mark.slow
def test_the_server_exits_2_naming_dev_shm():
    r = in_small_shm("700k", [sys.executable, "-m", "asap_comm.serving.server", "--model", "tiny", "--port", "0"],
                     timeout=300, cwd=REPO)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "/dev/shm has" in ln]
    assert lines and "wanted" in lines[0] and lines[0].startswith("asap serve: "), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
