"""Gaussian-k: Top-k approximated by a threshold from the moments of ``a``.

Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"
(2019); reference code hclhkbu/GaussianK-SGD. Assuming a bell-shaped ``a``::

    thr = |mean(a)| + std(a) * Phi^-1(1 - ratio / 2),   S = {j : |a_j| > thr}

then at most 3 evaluations correcting ``thr`` (x0.5 below 2k/3, x1.5 above 4k/3).
No sort: ``|S|`` is close to ``k`` but varies per rank and step, so the sparse
allgather is variable-size.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.compressors.sparse import Sparsifier


class GaussianK(Sparsifier):
    """Gaussian-k threshold selection (see :func:`reference.gaussiank_select`)."""

    def _select(self, a: Any, name: str, shape: tuple, ops: Any) -> Any:
        return ops.gaussiank_select(a, self.ratio)
