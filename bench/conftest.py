"""pytest configuration of the benchmarks (``pytest bench/ --benchmark-only``); the suite's own report stays
``python bench/run_all.py``. The root's ``python -m pytest`` does not come here (pyproject's ``testpaths``)."""
# bench/ has no __init__.py: pytest (its default "prepend" import mode) puts this directory first on the path of the
# test modules here, so they import run_all and the shared _*.py modules as top-level modules without a path edit.


def pytest_addoption(parser):
    parser.addoption("--bench-quick", action="store_true",
                     help="the iterations of run_all.py --quick (one round) instead of the full run's")
