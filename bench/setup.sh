#!/usr/bin/env bash
# One-time set-up for the benchmark baselines and the fault suite (idempotent):
#   * Open MPI (mpirun + headers) from Debian's packages, for bench/mpi_pingpong.py
#   * mpi4py from PyPI, into the active Python environment
#   * nftables (nft) from Debian's packages, for bench/faults.py's packet-loss rows
# Run it as root (or with sudo available) from the repository root:
#   bash bench/setup.sh
# The ASAP rows and the gloo / multiprocessing baselines need nothing from here;
# without MPI, run_all.py just skips the Open MPI column; without nft, faults.py skips its packet-loss rows.
set -euo pipefail

PYTHON="${PYTHON:-python}"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        echo "setup.sh: need root (or sudo) to run: $*" >&2; return 1; fi
}

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" -eq 0 ]; then as_root apt-get update; APT_UPDATED=1; fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}

if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
    echo "setup.sh: Open MPI already installed ($(mpirun --version 2>/dev/null | head -n1))"
else
    echo "setup.sh: installing Open MPI from apt"
    apt_install openmpi-bin libopenmpi-dev
fi

# nft usually lives in /usr/sbin, which a non-root PATH may lack
if command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ]; then
    echo "setup.sh: nftables already installed ($(PATH="$PATH:/usr/sbin" nft --version 2>/dev/null))"
else
    echo "setup.sh: installing nftables from apt (bench/faults.py: packet loss between simulated hosts)"
    apt_install nftables
fi

if "$PYTHON" -c "import mpi4py" >/dev/null 2>&1; then
    echo "setup.sh: mpi4py already installed ($("$PYTHON" -c 'import mpi4py; print(mpi4py.__version__)'))"
else
    echo "setup.sh: installing mpi4py with pip into $("$PYTHON" -c "import sys; print(sys.prefix)") (it loads the system Open MPI at run time)"
    "$PYTHON" -m pip install mpi4py
fi

echo "setup.sh: done"
