"""Row selections of the fused path on numpy: the reference's selection of every row of a bucket.

The numpy counterpart of :class:`hvd_compress.kernels.torch_rows.Rows` (same layout, same
results): a fused bucket (:mod:`hvd_compress.engine.fused`) lays its compressed tensors out
in one flat work buffer, those of equal size next to each other, and each row (tensor)
selects what :func:`reference.topk_indices` or :func:`reference.gaussiank_from` (from
:func:`reference.gaussiank_threshold`) selects on it alone, as work positions in a fixed number
of slots per row. On the host nothing is to be saved by batching the rows: a loop over them
calls those functions on each row (Top-k by one marking pass, :func:`topk_by_marking`). A selection of another kind visits the rows one by one in
the order their tensors were added (:meth:`Rows.each`, :func:`each_row`), so that random draws
come in that order on every framework.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hvd_compress.kernels import ops_for, reference


#: entries a row's sample holds (about): :func:`sampled_limit`
TOPK_SAMPLE = 8192


def sample_step(n: int) -> int:
    """The stride of a row's sample for :func:`sampled_limit`: odd, about :data:`TOPK_SAMPLE` entries of ``n``."""
    return max(1, n // TOPK_SAMPLE) | 1


def sampled_limit(rows: np.ndarray, k: int) -> np.ndarray:
    """Each row's limit for a Top-k by marking (``(R, 1)``, ``rows``' dtype): :func:`limit_of_sample` of the
    row's every :func:`sample_step`-th entry."""
    n = rows.shape[1]
    return limit_of_sample(rows[:, :: sample_step(n)], k, n)


def limit_of_sample(sample: np.ndarray, k: int, n: int) -> np.ndarray:
    """The ``j``-th largest of each row of ``sample`` (``(R, m)``, every :func:`sample_step`-th entry of rows of
    ``n``), ``j = e + 3 sqrt(e) + 3`` with ``e = k m / n`` the sampled entries expected above the row's k-th
    largest: about ``k (1 + 3 / sqrt(e))`` entries lie above it (-Inf where ``j`` exceeds the sample: every
    entry)."""
    m = sample.shape[1]
    expected = k * m / n
    j = int(math.ceil(expected + 3 * math.sqrt(expected) + 3))
    if j > m:
        return np.full((sample.shape[0], 1), -np.inf, dtype=sample.dtype)
    return np.partition(sample, m - j, axis=1)[:, m - j : m - j + 1].copy()


def topk_by_marking(row: np.ndarray, k: int) -> np.ndarray:
    """:func:`reference.topk_indices` of one row (no NaN), in one marking pass: the ``k`` largest of the
    entries above :func:`sampled_limit` (every entry tied with the k-th largest lies above it, and the
    marked entries are in index order, so ties go to the lower index), or of the whole row where fewer
    than ``k`` lie above it."""
    marked = np.flatnonzero(row > sampled_limit(row[None], k)[0, 0])
    if marked.shape[0] >= k:
        return marked[reference.topk_indices(row[marked], k)]
    return reference.topk_indices(row, k)


class Rows:
    """A flat work buffer's rows, grouped by length, and their selections.

    ``groups`` lists ``(start, rows, n, k, width)``: ``rows`` rows of ``n`` elements from work
    position ``start``, each selecting ``k`` entries into ``width`` slots (Top-k: ``k``;
    Gaussian-k: ``floor(4k/3)``), the groups' slots one after the other; unused slots hold
    the work position ``spare``. ``device``: the host's (numpy has no other). ``tensors``
    (see :func:`row_order`): each row's label, in the order the tensors were added. ``compile``: numpy
    compiles nothing (torch's :class:`~hvd_compress.kernels.torch_rows.Rows` takes it).
    """

    def __init__(self, groups: Sequence[Tuple[int, int, int, int, int]], device: None = None,
                 spare: Optional[int] = None, tensors: Optional[Sequence[Tuple[int, Any]]] = None,
                 compile: Optional[bool] = None) -> None:
        self.groups = [tuple(int(x) for x in g) for g in groups]
        self.spare = spare
        widths = [width for _, count, _, _, width in self.groups for _ in range(count)]
        self.count, self.width = len(widths), sum(widths)
        #: each slot's row
        self.slot_row = np.repeat(np.arange(len(widths), dtype=np.int64), widths)
        #: the rows in the order :meth:`each` visits them
        self.order = row_order(self.groups, tensors)

    def each(self, flat: np.ndarray) -> Iterator[Tuple[Any, np.ndarray, int, int]]:
        """:func:`each_row` of ``flat`` (a work buffer)."""
        return each_row(flat, self.order)

    def largest(self, flat: np.ndarray) -> np.ndarray:
        """Each row's largest entry (NaN where the row holds NaN), in work order."""
        return np.array([np.max(row) for _, row, _, _ in self._rows(flat)], dtype=flat.dtype)

    def largest_magnitude(self, a: Any) -> Any:
        """Each row's largest ``|a|`` (NaN where the row holds NaN), in work order: :meth:`largest` of
        ``|a|``; arrays of the framework of the subclass (numpy here)."""
        return self.largest(ops_for(a).magnitude(a))

    def _rows(self, flat: np.ndarray) -> Iterator[Tuple[int, np.ndarray, int, int]]:
        """Per row in work order: its first work position, its entries of ``flat``, its ``k`` and its first slot."""
        for first, n, k, slot, _ in row_order(self.groups):
            yield first, flat[first : first + n], k, slot

    def topk(self, scores: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest ``scores`` of every row, ties to the lower index: ``(positions, top)``,
        ``top`` each row's largest score (NaN or Inf exactly where the row holds NaN or Inf;
        such a row selects any ``k`` of its entries, NaN ranked as +Inf)."""
        positions = np.empty(self.width, dtype=np.int64)
        top = []
        for first, row, k, slot in self._rows(scores):
            top.append(np.max(row))
            chosen = (reference.topk_indices(np.where(np.isnan(row), np.inf, row), k) if np.isnan(top[-1])
                      else topk_by_marking(row, k))
            positions[slot : slot + k] = chosen + first
        return positions, np.array(top, dtype=scores.dtype)

    def aged_topk(self, rate: Any, age: Any, a: Any, one: Any) -> Tuple[Any, Any, Tuple[Any, Any, Any]]:
        """The aggregate rule's selection: ``(positions, probe, (aged, rate[positions], aged[positions]))``,
        ``aged = age + one``, ``positions`` each row's ``k`` largest ``rate * aged`` (:meth:`topk`), ``probe`` each
        row's largest ``|a|`` (:meth:`largest`); arrays of the framework of the subclass (numpy here)."""
        ops = ops_for(a)
        aged = ops.add(age, one)
        positions = self.topk(ops.multiply(rate, aged))[0]
        return positions, self.largest_magnitude(a), (aged, ops.take(rate, positions), ops.take(aged, positions))

    def gaussiank(self, a: np.ndarray, ratio: float) -> Tuple[np.ndarray, np.ndarray]:
        """:func:`reference.gaussiank_from` (from :func:`reference.gaussiank_threshold`) of every row: ``(positions, first)``:
        each row's selection in index order in its first slots, the others ``spare``, and each
        row's first threshold (float64; NaN or Inf where the row holds NaN or Inf)."""
        positions = np.full(self.width, self.spare, dtype=np.int64)
        first_thresholds = []
        for (first, row, k, slot), (_, size, _, _) in zip(self._rows(a), self._rows(reference.magnitude(a))):
            first_thresholds.append(reference.gaussiank_threshold(row, ratio))
            chosen = reference.gaussiank_from(size, first_thresholds[-1], k)
            positions[slot : slot + chosen.shape[0]] = chosen + first
        return positions, np.array(first_thresholds, dtype=np.float64)

    def reused(self, scores: np.ndarray, kept: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`reference.reused_threshold_select` of every row from its ``kept`` threshold (float64, work
        order): ``(positions, the thresholds to keep, each row's largest score)``, each row's selection in
        index order in its first slots, the others ``spare``."""
        positions = np.full(self.width, self.spare, dtype=np.int64)
        chosen = np.empty(len(kept), dtype=np.float64)
        for row, (first, values, k, slot) in enumerate(self._rows(scores)):
            selected, chosen[row] = reference.reused_threshold_select(values, float(kept[row]), k)
            positions[slot : slot + selected.shape[0]] = selected + first
        return positions, chosen, self.largest(scores)

    def kth(self, scores: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Each row's smallest score at its ``k`` positions (after :meth:`topk`: its k-th largest), float64."""
        return np.array([np.min(scores[positions[slot : slot + k]]) for _, _, k, slot in self._rows(scores)],
                        dtype=np.float64)


#: a row as :func:`each_row` visits it: ``(first work position, n, k, first slot, label)``
Row = Tuple[int, int, int, int, Any]


def row_order(groups: Sequence[Tuple[int, int, int, int, int]],
              tensors: Optional[Sequence[Tuple[int, Any]]] = None) -> List[Row]:
    """The rows of ``groups`` (``(start, rows, n, k, width)``) in the order to visit them: ``tensors``
    lists ``(row, label)``, a row by its place in work order and any label of its tensor (the
    fused path: name and shape), in the order the tensors were added; default: work order, no labels."""
    rows: List[Tuple[int, int, int, int]] = []
    slot = 0
    for start, count, n, k, width in groups:
        for i in range(count):
            rows.append((start + i * n, n, k, slot))
            slot += width
    visit = tensors if tensors is not None else [(row, None) for row in range(len(rows))]
    return [rows[row] + (label,) for row, label in visit]


def each_row(flat: Any, order: Sequence[Row]) -> Iterator[Tuple[Any, Any, int, int]]:
    """Per row of ``order`` (:func:`row_order`): its label, its entries of ``flat`` (a view), its
    ``k``, and the work position of its first entry; numpy arrays and torch tensors alike."""
    for first, n, k, _, label in order:
        yield label, flat[first : first + n], k, first
