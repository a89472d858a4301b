"""Row selections of the fused path on TensorFlow: the TF kernels' selection of every row of a bucket.

The TensorFlow counterpart of :class:`hvd_compress.kernels.reference_rows.Rows` (same layout,
same results): a fused bucket (:mod:`hvd_compress.engine.fused`) lays its compressed tensors out
in one flat work buffer, those of equal size next to each other, and each row (tensor) selects
what :func:`tf_ops.topk_indices` or :func:`tf_ops.gaussiank_from` selects on it alone (which
is :func:`reference.topk_indices`, and :func:`reference.gaussiank_from` from the kernels' own
first threshold), as work positions in a fixed number of slots per row. Top-k runs one
``tf.math.top_k`` per size group (:func:`tf_ops.topk_positions`: each row's positions in order,
ties to the lower index, as one row alone); Gaussian-k runs each row's own threshold rule
(:func:`tf_ops.gaussiank_positions`: its selection in fixed slots). TensorFlow's tensors are
immutable, so the parts are joined by one ``tf.concat``. No size depends on the data and nothing
is read back to the host: the selections run eagerly (a GPU never waits for Python) or trace
into a graph.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from hvd_compress.kernels import reference_rows
from hvd_compress.kernels import tf_ops as ops


def _joined(parts: List[tf.Tensor], dtype: tf.DType, join=tf.concat) -> tf.Tensor:
    """``parts`` concatenated (or stacked), none: an empty ``dtype`` tensor."""
    return join(parts, axis=0) if parts else tf.zeros([0], dtype)


class Rows(reference_rows.Rows):
    """A flat work buffer's rows, grouped by length, and their selections (see
    :class:`reference_rows.Rows`): ``groups`` lists ``(start, rows, n, k, width)``; unused slots
    hold the work position ``spare``; ``device``: the work buffer's (a TF device string or None),
    where :attr:`slot_row` is made and the selections create their tensors."""

    def __init__(self, groups: Sequence[Tuple[int, int, int, int, int]], device: Optional[str] = None,
                 spare: Optional[int] = None, tensors: Optional[Sequence[Tuple[int, Any]]] = None,
                 compile: Optional[bool] = None) -> None:
        super().__init__(groups, spare=spare, tensors=tensors)
        self.device = device
        self.row_width = [width for _, count, _, _, width in self.groups for _ in range(count)]
        with ops.on_device(device):
            #: each slot's row
            self.slot_row = tf.constant(self.slot_row, tf.int64)

    def largest(self, flat: tf.Tensor) -> tf.Tensor:
        """Each row's largest entry (NaN where the row holds NaN), in work order."""
        with ops.on_device(self.device):
            rows = [row for _, row, _, _ in self._rows(flat)]
            top = [tf.where(tf.reduce_any(tf.math.is_nan(row)), tf.constant(np.nan, flat.dtype), tf.reduce_max(row))
                   for row in rows]
            return _joined(top, flat.dtype, tf.stack)

    def topk(self, scores: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """The ``k`` largest ``scores`` of every row, ties to the lower index: ``(positions, top)``,
        ``top`` each row's largest score (NaN or Inf exactly where the row holds NaN or Inf;
        such a row selects any ``k`` of its entries, NaN ranked as +Inf). Per size group one
        ``tf.math.top_k`` of its ``(rows, n)`` matrix, each row's positions sorted: what
        :func:`tf_ops.topk_indices` gives each row alone (``top_k`` ranks ties lower index first)."""
        with ops.on_device(self.device):
            nan = tf.math.is_nan(scores)
            key = tf.where(nan, tf.constant(np.inf, scores.dtype), scores)  # the identity without NaN
            parts, top = [], []
            for start, count, n, k, width in self.groups:
                block, holes = (tf.reshape(x[start : start + count * n], [count, n]) for x in (key, nan))
                top.append(tf.where(tf.reduce_any(holes, axis=1), tf.constant(np.nan, scores.dtype),
                                    tf.reduce_max(block, axis=1)))
                chosen = ops.topk_positions(block, min(k, n))
                chosen += tf.constant(start + n * np.arange(count, dtype=np.int64))[:, None]
                if width > chosen.shape[1]:
                    chosen = tf.concat([chosen, tf.fill([count, width - chosen.shape[1]], np.int64(self.spare))], 1)
                parts.append(tf.reshape(chosen, [-1]))
            return _joined(parts, tf.int64), _joined(top, scores.dtype)

    def gaussiank(self, a: tf.Tensor, ratio: float) -> Tuple[tf.Tensor, tf.Tensor]:
        """:func:`tf_ops.gaussiank_from` (from its own first threshold) of every row: ``(positions, first)``:
        each row's selection in index order in its first slots, the others ``spare``, and each
        row's first threshold (float64; NaN or Inf where the row holds NaN or Inf)."""
        with ops.on_device(self.device):
            parts, first_thresholds = [], []
            for (first, row, k, _), (_, size, _, _), width in zip(self._rows(a), self._rows(ops.magnitude(a)),
                                                                 self.row_width):
                first_thresholds.append(ops.gaussiank_first_threshold(row, ratio))
                parts.append(ops.gaussiank_positions(size, first_thresholds[-1], k, width, self.spare, first))
            return _joined(parts, tf.int64), _joined(first_thresholds, tf.float64, tf.stack)

    def reused(self, scores: tf.Tensor, kept: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """:func:`tf_ops.reused_positions` of every row from its ``kept`` threshold (float64, work order):
        ``(positions, the thresholds to keep, each row's largest score)``."""
        with ops.on_device(self.device):
            parts, chosen = [], []
            for row, (first, values, k, _) in enumerate(self._rows(scores)):
                positions, threshold = ops.reused_positions(values, kept[row], k, self.spare, first)
                parts.append(positions)
                chosen.append(threshold)
            return _joined(parts, tf.int64), _joined(chosen, tf.float64, tf.stack), self.largest(scores)

    def kth(self, scores: tf.Tensor, positions: tf.Tensor) -> tf.Tensor:
        """Each row's smallest score at its ``k`` positions (after :meth:`topk`: its k-th largest), float64:
        one ``reduce_min`` per size group."""
        with ops.on_device(self.device):
            chosen, parts, slot = tf.gather(scores, positions), [], 0
            for _, count, _, k, width in self.groups:
                block = tf.reshape(chosen[slot : slot + count * width], [count, width])[:, :k]
                parts.append(tf.cast(tf.reduce_min(block, axis=1), tf.float64))
                slot += count * width
            return _joined(parts, tf.float64)
