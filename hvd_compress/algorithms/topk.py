"""Top-k sparsification with error feedback.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent" (2017);
analysis in Shi et al. (2019). Sends the ``k = ceil(ratio * d)`` entries of
largest magnitude of ``a = g + r``: ``S = argtop_k |a_j|``.
"""

from __future__ import annotations

from hvd_compress.algorithms.sparse import LargestScores, Sparsifier


class TopK(LargestScores, Sparsifier):
    """Exact Top-k: ``S`` = the ``k`` largest ``|a_j|`` (ties to the lower index)."""
