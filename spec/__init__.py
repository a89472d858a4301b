"""The per-tensor specification of every algorithm in plain numpy: the tests' independent yardstick.

Written from the algorithms' definitions (docs/design.md and the papers each module cites), tensor by
tensor and rank by rank, sharing no code with :mod:`hvd_compress`: the bucket engine every route runs
must give the same averages, residuals and velocities, bit for bit on numpy (on torch and TensorFlow
too where their kernels promise it). Not installed with the package.

- :mod:`spec.sparse`: Top-k, Gaussian-k and RegTop-k with error feedback and momentum correction;
- :mod:`spec.terngrad`: TernGrad with or without scalar sharing;
- :mod:`spec.ranks`: N ranks stepped tensor by tensor (:class:`~spec.ranks.Ranks`); dense tensors
  (None, FP16, tensors under ``dense_below``, ``N k >= d``) are summed as a dense allreduce sums them.
"""

from spec.ranks import Ranks

__all__ = ["Ranks"]
