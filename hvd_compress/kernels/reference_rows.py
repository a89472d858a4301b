"""Row selections of the fused path on numpy: the reference's selection of every row of a bucket.

The numpy counterpart of :class:`hvd_compress.kernels.torch_rows.Rows` (same layout, same
results): a fused bucket (:mod:`hvd_compress.comm.fused`) lays its compressed tensors out
in one flat work buffer, those of equal size next to each other, and each row (tensor)
selects what :func:`reference.topk_indices` or :func:`reference.gaussiank_select` selects
on it alone, as work positions in a fixed number of slots per row. On the host nothing
is to be saved by batching the rows: a loop over them calls the reference itself, so the
selections are the per-tensor path's by construction.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence, Tuple

import numpy as np

from hvd_compress.kernels import reference


class Rows:
    """A flat work buffer's rows, grouped by length, and their selections.

    ``groups`` lists ``(start, rows, n, k, width)``: ``rows`` rows of ``n`` elements from work
    position ``start``, each selecting ``k`` entries into ``width`` slots (Top-k: ``k``;
    Gaussian-k: ``floor(4k/3)``), the groups' slots one after the other; unused slots hold
    the work position ``spare``. ``device``: the host's (numpy has no other).
    """

    def __init__(self, groups: Sequence[Tuple[int, int, int, int, int]], device: None = None,
                 spare: Optional[int] = None) -> None:
        self.groups = [tuple(int(x) for x in g) for g in groups]
        self.spare = spare
        widths = [width for _, count, _, _, width in self.groups for _ in range(count)]
        self.width = sum(widths)
        #: each slot's row
        self.slot_row = np.repeat(np.arange(len(widths), dtype=np.int64), widths)

    def _rows(self, flat: np.ndarray) -> Iterator[Tuple[int, np.ndarray, int, int]]:
        """Per row: its first work position, its entries of ``flat``, its ``k`` and its first slot."""
        slot = 0
        for start, count, n, k, width in self.groups:
            for i in range(count):
                first = start + i * n
                yield first, flat[first : first + n], k, slot
                slot += width

    def topk(self, scores: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest ``scores`` of every row, ties to the lower index: ``(positions, top)``,
        ``top`` each row's largest score (NaN or Inf exactly where the row holds NaN or Inf;
        such a row selects any ``k`` of its entries, NaN ranked as +Inf)."""
        positions = np.empty(self.width, dtype=np.int64)
        top = []
        for first, row, k, slot in self._rows(scores):
            top.append(np.max(row))
            key = np.where(np.isnan(row), np.inf, row) if np.isnan(top[-1]) else row
            positions[slot : slot + k] = reference.topk_indices(key, k) + first
        return positions, np.array(top, dtype=scores.dtype)

    def gaussiank(self, a: np.ndarray, magnitude: np.ndarray, ratio: float) -> Tuple[np.ndarray, np.ndarray]:
        """:func:`reference.gaussiank_select` of every row (``magnitude = |a|``): ``(positions, first)``:
        each row's selection in index order in its first slots, the others ``spare``, and each
        row's first threshold (float64; NaN or Inf where the row holds NaN or Inf)."""
        positions = np.full(self.width, self.spare, dtype=np.int64)
        first_thresholds = []
        for (first, row, k, slot), (_, size, _, _) in zip(self._rows(a), self._rows(magnitude)):
            first_thresholds.append(reference.gaussiank_threshold(row, ratio))
            chosen = reference.gaussiank_from(size, first_thresholds[-1], k)
            positions[slot : slot + chosen.shape[0]] = chosen + first
        return positions, np.array(first_thresholds, dtype=np.float64)
