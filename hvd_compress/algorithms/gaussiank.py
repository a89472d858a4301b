"""Gaussian-k: Top-k approximated by a threshold from the moments of ``a``.

Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"
(2019); reference code hclhkbu/GaussianK-SGD. Assuming a bell-shaped ``a``::

    thr = |mean(a)| + std(a) * Phi^-1(1 - ratio / 2),   S = {j : |a_j| > thr}

then at most 3 evaluations correcting ``thr`` (x0.5 below 2k/3, x1.5 above 4k/3),
round ``r`` at ``thr * f_r`` with ``f_r`` the product of the steps so far. No sort:
``|S|`` is close to ``k`` but varies per rank and step. When the last evaluation
is out of range and some evaluation selected more than ``4k/3`` entries, the
smallest such set is cut to its first ``k`` indices, as the reference code cuts
its last set (``indexes[0:k]``): every entry sent still lies above a threshold of
the correction, the rest stays in the residual, and no evaluation needs more than
a count. (Up to this release the cut kept the set's ``k`` largest entries, a top-k
of the row that an accelerator had to run for every tensor at every step.)

``|S|`` varies per tensor and step. The exchange's fused
bucket (every route, the Simulator) sends ``floor(4k/3)`` slots per tensor, the most
the correction can select, unused ones padded: no count travels and nothing is
read back, at up to a third more (value, index) bytes than Top-k (the wire
statistics count the slots). On an accelerator it counts the six thresholds a
tensor can meet (``thr x {1/4, 1/2, 3/4, 1, 3/2, 9/4}``) in one pass and applies
the rule to the counts (:meth:`hvd_compress.kernels.torch_rows.Rows.gaussiank`; numpy
runs the reference on each row, :class:`hvd_compress.kernels.reference_rows.Rows`, and TensorFlow
each row's rule in fixed slots, :class:`hvd_compress.kernels.tf_rows.Rows`):
a moments pass, a counting pass and a marking pass per size group, where Top-k runs
one ``torch.topk`` (several passes inside) and a tie scan. The quantile is finite
for ``ratio >= 1e-323`` (``ratio / 2`` must not round to 0); smaller ratios are
rejected.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.kernels import reference
from hvd_compress.algorithms.base import check_ratio
from hvd_compress.algorithms.sparse import Sparsifier
from hvd_compress.algorithms.validation import check_gaussiank_ratio


class GaussianK(Sparsifier):
    """Gaussian-k threshold selection (see :func:`reference.gaussiank_threshold` and :func:`reference.gaussiank_from`)."""

    pads_slots = True  # the fused path sends floor(4k/3) slots per tensor, unused ones padded

    @Sparsifier.ratio.setter
    def ratio(self, value: float) -> None:
        self._ratio = check_gaussiank_ratio(check_ratio(value))

    def slots(self, numel: int) -> int:
        return reference.gaussiank_slots(self.k(numel))

    def bucket_scores(self, a: Any, posterior: Any, ops: Any) -> Any:
        """None: the selection counts and marks ``|a|`` itself (on the host, from ``a``, no ``|a|`` formed)."""
        return None

    def bucket_select(self, a: Any, scores: Any, rows: Any, ops: Any) -> Any:
        """Every row's Gaussian-k selection in its ``floor(4k/3)`` slots
        (:meth:`~hvd_compress.kernels.torch_rows.Rows.gaussiank`); the probe is each row's mean
        (numpy, TensorFlow: its first threshold), not finite where the row holds NaN/Inf."""
        return rows.gaussiank(a, self.ratio)
