"""What the validation regimes (``validate.py``, ``emulated.py``, ``published.py``) share: the error target and
the traces."""
from __future__ import annotations

from ...serving.traces import TRACES_ENV, LogNormalLengths, load_trace, synthetic_trace
from ..studies.grids import mooncake_path

__all__ = ["TARGET", "validation_trace"]

TARGET = 0.15  # the simulator's target: |relative error| of each compared metric


def validation_trace(kind: str, n: int, max_len: int, seed: int, length_scale: float = 0.01) -> list:
    """``synthetic`` (Gamma-bursty, log-normal lengths) or the shared Mooncake trace, its lengths times
    ``length_scale`` (default: its 12k-token mean prompts scaled to CPU-sized ones), capped at ``max_len``."""
    if kind == "synthetic":
        return synthetic_trace(1.0, num_requests=n, arrival="gamma", cv=2.0,
                               lengths=LogNormalLengths(48, 1.0, 4, max_len), seed=seed)
    path = mooncake_path()
    if path is None:
        raise FileNotFoundError(f"validate: the Mooncake trace is not in ${TRACES_ENV}; unset it")
    return load_trace(path, limit=n, length_scale=length_scale, max_prompt_len=max_len)
