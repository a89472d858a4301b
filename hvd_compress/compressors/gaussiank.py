"""Gaussian-k: Top-k approximated by a threshold from the moments of ``a``.

Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"
(2019); reference code hclhkbu/GaussianK-SGD. Assuming a bell-shaped ``a``::

    thr = |mean(a)| + std(a) * Phi^-1(1 - ratio / 2),   S = {j : |a_j| > thr}

then at most 3 evaluations correcting ``thr`` (x0.5 below 2k/3, x1.5 above 4k/3).
No sort: ``|S|`` is close to ``k`` but varies per rank and step, so the sparse
allgather is variable-size. The quantile is finite for ``ratio >= 1e-323``
(``ratio / 2`` must not round to 0); smaller ratios are rejected.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.compressors.base import check_ratio
from hvd_compress.compressors.sparse import Sparsifier
from hvd_compress.compressors.validation import check_gaussiank_ratio


class GaussianK(Sparsifier):
    """Gaussian-k threshold selection (see :func:`reference.gaussiank_select`)."""

    fused = False  # its per-rank counts vary: the per-tensor exchange (counts in the header)

    @Sparsifier.ratio.setter
    def ratio(self, value: float) -> None:
        self._ratio = check_gaussiank_ratio(check_ratio(value))

    def _select(self, a: Any, name: str, shape: tuple, ops: Any) -> Any:
        return ops.gaussiank_select(a, self.ratio)
