"""The size groups of a fused bucket's flat layout, as the kernels read them.

A fused bucket (:mod:`hvd_compress.engine.fused`) lays each part out grouped by size: every
group of equal-size tensors is one ``(rows, n)`` matrix of the part's flat buffer. The kernels
that work per row (TernGrad's scales and residual, the keep of a non-finite tensor's state, the
scaling of sums) take these groups, so the type lives with them.
"""

from __future__ import annotations

from typing import Any, List

#: an array of a kernel module (numpy array, torch or TensorFlow tensor)
Array = Any


class Group:
    """``rows`` tensors of ``n`` elements each, adjacent in their part's flat layout from ``start``
    (rows ``first`` onwards of that part's tensors)."""

    def __init__(self, start: int, first: int, members: List[int], n: int) -> None:
        self.start, self.members, self.rows, self.n = start, members, len(members), n
        self.stop = start + self.rows * n
        self.first, self.last = first, first + self.rows

    def view(self, flat: Array) -> Array:
        return flat[self.start : self.stop].reshape(self.rows, self.n)

    def column(self, per_row: Array) -> Array:
        """This group's part of a per-compressed-tensor vector, as a column (broadcasts over a row)."""
        return per_row[self.first : self.last, None]
