"""Small array helpers shared by the planning stages."""

from __future__ import annotations

import numpy as np

__all__ = ["gather_runs"]


def gather_runs(values: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenate values[starts[i] : starts[i] + sizes[i]] over i, without a Python loop."""
    total = int(sizes.sum())
    if total == 0:
        return values[:0]
    shift = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return values[np.arange(total, dtype=np.int64) + shift]
