"""Loads the native core, or explains how to build it."""
from . import errors

try:
    from . import _C  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - exercised by a packaging test
    raise ImportError(
        "asap_comm: the native extension asap_comm._C is not built or does not load "
        f"({e}). Build it from the project root with `pip install torch==2.13.0 && pip install -e .` "
        "(needs a C++20 compiler, CMake and pybind11; `pip install .` brings CMake and pybind11)."
    ) from e

_C._set_error_types(errors.CommError, errors.TimeoutError, errors.PeerFailure)

__all__ = ["_C"]
