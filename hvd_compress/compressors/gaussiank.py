"""Gaussian-k: Top-k approximated by a threshold from the moments of ``a``.

Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"
(2019); reference code hclhkbu/GaussianK-SGD. Assuming a bell-shaped ``a``::

    thr = |mean(a)| + std(a) * Phi^-1(1 - ratio / 2),   S = {j : |a_j| > thr}

then at most 3 evaluations correcting ``thr`` (x0.5 below 2k/3, x1.5 above 4k/3).
No sort: ``|S|`` is close to ``k`` but varies per rank and step. The per-tensor
exchange (numpy, TensorFlow) sends it variable-size, its count in the header. The
fused torch path sends ``floor(4k/3)`` slots per tensor, the most the correction
can select, unused ones padded: no count travels and nothing is read back, at up
to a third more (value, index) bytes than Top-k's ``k`` (the wire statistics count
the slots). On an accelerator that path also computes each row's ``k`` largest
every step, for rows whose correction ends trimmed, so on GPUs Gaussian-k costs
Top-k's selection plus its counting passes: choose Top-k there. The quantile is
finite for ``ratio >= 1e-323`` (``ratio / 2`` must not round to 0); smaller
ratios are rejected.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.kernels import reference
from hvd_compress.compressors.base import check_ratio
from hvd_compress.compressors.sparse import Sparsifier
from hvd_compress.compressors.validation import check_gaussiank_ratio


class GaussianK(Sparsifier):
    """Gaussian-k threshold selection (see :func:`reference.gaussiank_select`)."""

    pads_slots = True  # the fused path sends floor(4k/3) slots per tensor, unused ones padded

    @Sparsifier.ratio.setter
    def ratio(self, value: float) -> None:
        self._ratio = check_gaussiank_ratio(check_ratio(value))

    def _select(self, a: Any, name: str, shape: tuple, ops: Any) -> Any:
        return ops.gaussiank_select(a, self.ratio)

    def slots(self, numel: int) -> int:
        return reference.gaussiank_slots(self.k(numel))

    def bucket_select(self, a: Any, scores: Any, rows: Any, ops: Any) -> Any:
        """Every row's Gaussian-k selection in its ``floor(4k/3)`` slots
        (:meth:`~hvd_compress.kernels.torch_rows.Rows.gaussiank`); the probe is each row's mean,
        not finite where the row holds NaN/Inf."""
        return rows.gaussiank(a, scores, self.ratio)
