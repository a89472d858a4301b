"""What every algorithm of the spec shares: sizes, dtypes, the dense allreduce's sum."""

from __future__ import annotations

import math
from typing import Any, List

import numpy as np


def accumulation(dtype) -> np.dtype:
    """Residuals, velocities and sums live in at least float32."""
    return np.result_type(dtype, np.float32)


def k_of(numel: int, ratio: float) -> int:
    """``k = max(1, ceil(ratio d))``, the product shrunk by one part in 10^12 so that float rounding
    (``0.07 * 100 = 7.000000000000001``) does not add an entry."""
    return max(1, math.ceil(ratio * numel * (1.0 - 1e-12)))


def saturate(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` in ``dtype``, values beyond its finite range clipped to it."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    largest = finfo(dtype).max
    return np.clip(a, -largest, largest).astype(dtype)


def finfo(dtype) -> Any:
    """numpy's ``finfo``, or ml_dtypes' for the dtypes it adds to numpy (bfloat16)."""
    try:
        return np.finfo(dtype)
    except ValueError:
        import ml_dtypes

        return ml_dtypes.finfo(dtype)


def rank_order_sum(arrays: List[np.ndarray]) -> np.ndarray:
    """``((x_0 + x_1) + x_2) + ...`` in at least float32: how every rank sums, in rank order."""
    total = arrays[0].astype(accumulation(arrays[0].dtype))
    for array in arrays[1:]:
        total = total + array.astype(total.dtype)
    return total


def allreduce_sum(arrays: List[np.ndarray]) -> np.ndarray:
    """A dense allreduce-Sum: summed in rank order in at least float32, rounded once to the sent dtype."""
    return rank_order_sum(arrays).astype(arrays[0].dtype)
