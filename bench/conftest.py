"""pytest configuration of the benchmarks (``pytest bench/ --benchmark-only``); the suite's own report stays
``python bench/run_all.py``. The root's ``python -m pytest`` does not come here (pyproject's ``testpaths``)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # run_all and the shared _*.py modules are imported as top-level modules
    sys.path.insert(0, HERE)


def pytest_addoption(parser):
    parser.addoption("--bench-quick", action="store_true",
                     help="the iterations of run_all.py --quick (one round) instead of the full run's")
