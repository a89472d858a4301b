"""The dense-switch probe, run by every route's multi-rank job: nothing may be lost when a tensor
that was sent sparse turns dense.

One parameter of :data:`SIZE` elements starts at 0; rank ``r``'s gradient at step ``s`` is row
``s`` of :func:`gradients` (``loss = sum(w * row)``). A sparsifier runs at ratio :data:`SPARSE`
(1%) for :data:`SWITCH_AT` steps, then at :data:`DENSE` (0.6: N ranks x k >= SIZE, so the tensor
is sent dense) up to :data:`STEPS`. Plain SGD then moves the weights by ``lr x`` the sum over
steps of the mean gradient exactly when the residual left over from the sparse steps goes out
with the first dense step. The probe reads no residual and no compressor state before the check
(:func:`relative_error`): observing must not change what is sent.
"""

from __future__ import annotations

import numpy as np

SIZE, STEPS, SWITCH_AT = 4096, 6, 4
SPARSE, DENSE = 0.01, 0.6
LR = 0.1


def gradients(rank: int) -> np.ndarray:
    """Rank ``rank``'s gradients, one float32 row per step."""
    return np.random.default_rng(2000 + rank).standard_normal((STEPS, SIZE)).astype(np.float32)


def ratio(step: int) -> float:
    """The sparsifier's ratio at ``step``."""
    return SPARSE if step < SWITCH_AT else DENSE


def relative_error(moved: np.ndarray, world: int) -> float:
    """``|moved - lr x sum of the mean gradients| / |lr x sum|`` (max norms), ``moved = w0 - w``;
    every rank can compute every rank's gradients, so no collective is needed."""
    expected = LR * np.mean([gradients(r).astype(np.float64).sum(axis=0) for r in range(world)], axis=0)
    return float(np.abs(np.asarray(moved, np.float64).reshape(-1) - expected).max() / np.abs(expected).max())
