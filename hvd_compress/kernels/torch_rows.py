"""Row selections of the fused torch path: Top-k and Gaussian-k of every tensor of a bucket at once.

The fused path (:mod:`hvd_compress.engine.fused`) lays a bucket's compressed tensors out in one
flat work buffer, those of equal size next to each other. A :class:`Rows` is that layout
(groups of equal-length rows) and selects for every row what :func:`reference.topk_indices` or
:func:`reference.gaussiank_from` (from its threshold) selects on that row alone, as work positions in a fixed
number of slots per row. On an accelerator nothing is read back to the host, and a bucket
costs a few kernels per group of equal-size tensors plus a fixed number for the whole bucket.

Top-k (``k`` slots a row)::

    per group:  torch.topk of the scores' bits, k per row         values (sorted), indices
                the entries equal to their row's k-th value, marked
    per bucket: one cumulative count over the marks and one binary search:
                the slots holding a tie get the row's lowest-indexed ties

Gaussian-k (``floor(4k/3)`` slots a row)::

    per group:  std_mean of the rows                               first thresholds
                |a| against the six thresholds the correction can meet, counted
                |a| above the threshold the correction chose, marked
    per bucket: the correction rule applied to the counts (a table of its outcomes)
                one cumulative count over the marks and one binary search:
                the marked entries in their row's slots, in index order

Reused thresholds (Top-k and RegTop-k with ``exact_every > 1``, between exact selections): Gaussian-k's
counting and marking passes from each row's kept threshold, toward ``[ceil(k/2), k]`` entries in
``k`` slots (:meth:`Rows.reused`).

Scores are non-negative with the sign bit clear (``|a|``, NaN included): read as integers of
their width their order is the floats' order, NaN above +Inf, so ``torch.topk`` of the bits is
exact for every float dtype and a tie is an equal bit pattern.

On the CPU, outside :func:`~hvd_compress.kernels.torch_ops.accelerator_path`, float32 and float64
rows take the host's way, the same selections in fewer passes (host reads cost nothing there)::

    Top-k:       per group one pass marks the scores above each row's limit, the j-th largest of a
                 strided sample (:func:`sampled_limit`), and finds each row's largest; per row the
                 k largest of its marked entries (a few k of them)
    thresholds:  per group one pass counts the six thresholds (Gaussian-k, reused thresholds), the
                 rule runs on the host, one pass marks the chosen threshold

each pass one of :mod:`~hvd_compress.kernels.torch_compiled` (compiled with ``torch.compile`` on the CPU).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hvd_compress.kernels import reference
from hvd_compress.kernels.reference_rows import each_row, row_order
from hvd_compress.kernels.reference_rows import limit_of_sample, sample_step
from hvd_compress.kernels import torch_compiled as compiled
from hvd_compress.kernels import torch_ops as ops

#: The integers of each float dtype's width: same bits, same order for non-negative floats.
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}

#: ``(start, rows, n, k, width)``: ``rows`` rows of ``n`` elements from work position ``start``,
#: each selecting ``k`` entries into ``width`` slots.
Group = Tuple[int, int, int, int, int]


def _outcomes() -> torch.Tensor:
    """The correction's choice for every classification of the candidate thresholds.

    Entry ``sum_i level_i 3^i`` (``level_i``: 0 below the rule's lower bound, 1 in range, 2 above
    its upper one for the threshold ``first * GAUSSIANK_FACTORS[i]``) is ``i + 6 cut``: the
    threshold :func:`reference.threshold_choice` ends on and whether it cuts that set, found by
    running it on counts that classify so (above the range falling as the threshold grows, as
    counts do). Gaussian-k and a reused threshold differ only in their bounds.
    """
    factors, low, high = reference.GAUSSIANK_FACTORS, 2, 4
    table = []
    for code in range(3 ** len(factors)):
        levels = [code // 3**i % 3 for i in range(len(factors))]

        def count(threshold: float, levels: List[int] = levels) -> int:
            i = factors.index(threshold)
            return (0, low, 2 * high + len(factors) - i)[levels[i]]

        chosen, cut = reference.threshold_choice(count, 1.0, low, high)
        table.append(factors.index(chosen) + len(factors) * cut)
    return torch.tensor(table, dtype=torch.int64)


_OUTCOMES = _outcomes()


def sampled_limit(rows: torch.Tensor, k: int, sample: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`~hvd_compress.kernels.reference_rows.sampled_limit` of a CPU ``(R, n)`` tensor: ``(R, 1)`` in its
    dtype (16-bit rows sampled in float32, which holds their values exactly); ``sample``: the rows' every
    :func:`~hvd_compress.kernels.reference_rows.sample_step`-th entry where already formed."""
    if sample is None:
        sample = rows[:, :: sample_step(rows.shape[1])]
    sample = sample if sample.dtype in ops.HOST_FLOATS else sample.float()
    return torch.from_numpy(limit_of_sample(sample.numpy(), k, rows.shape[1])).to(rows.dtype)


def _uploaded(device: torch.device, arrays: Sequence[Any]) -> List[torch.Tensor]:
    """``arrays`` (host integers) as int64 tensors on ``device``: slices of one buffer, copied there at once."""
    host = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    flat = torch.from_numpy(np.concatenate(host)).to(device)
    ends = np.cumsum([0] + [len(a) for a in host])
    return [flat[start:stop] for start, stop in zip(ends[:-1], ends[1:])]


class Rows:
    """A flat work buffer's rows, grouped by length, and the selections of all rows at once.

    ``groups`` lists ``(start, rows, n, k, width)``: ``rows`` rows of ``n`` elements from work
    position ``start`` (row ``i`` at ``start + i n``), each selecting ``k`` entries into ``width``
    slots (Top-k: ``k``; Gaussian-k: ``floor(4k/3)``); the groups' slots follow each other in
    order. ``spare`` is the work position unused slots hold (Gaussian-k). ``tensors``
    (:func:`~hvd_compress.kernels.reference_rows.row_order`): each row's label, in the order the
    tensors were added (:meth:`each`). ``compile``: whether the passes of the CPU's way run compiled (``None``:
    as :func:`~hvd_compress.kernels.torch_compiled.enabled` says). Built once per layout: the index tensors the selections
    need are made here, on ``device``, and the selections reuse one scratch buffer of marks.
    """

    def __init__(self, groups: Sequence[Group], device, spare: Optional[int] = None,
                 tensors: Optional[Sequence[Tuple[int, Any]]] = None, compile: Optional[bool] = None) -> None:
        self.groups = [tuple(int(x) for x in g) for g in groups]
        self.device, self.spare = torch.device(device), spare
        #: whether the passes run compiled (``None``: :func:`~hvd_compress.kernels.torch_compiled.enabled`)
        self.compile = compile
        #: the rows in the order :meth:`each` visits them
        self.order = row_order(self.groups, tensors)
        self.row_ranges: List[Tuple[int, int]] = []
        self.slot_ranges: List[Tuple[int, int]] = []
        row_start: List[int] = []
        row_k: List[int] = []
        row_width: List[int] = []
        edge_start: List[int] = []
        for start, count, n, k, width in self.groups:
            rows, slots = len(row_start), sum(row_width)
            edge_start += [rows + len(self.row_ranges) + i for i in range(count)]
            self.row_ranges.append((rows, rows + count))
            self.slot_ranges.append((slots, slots + count * width))
            row_start += [start + i * n for i in range(count)]
            row_k += [k] * count
            row_width += [width] * count
        self.count, self.width = len(row_start), sum(row_width)
        self.end = max((start + count * n for start, count, n, _, _ in self.groups), default=0)
        #: dtype of the cumulative counts of marks (one mark per work position)
        self.scan = torch.int32 if 1 + self.end < 2**31 else torch.int64
        slot_row = np.repeat(np.arange(self.count), row_width)
        first_slot = np.cumsum([0] + row_width)[:-1]
        last_slot = first_slot + np.asarray(row_width, dtype=np.int64) - 1
        starts = np.asarray(row_start, dtype=np.int64)

        edge_start = np.asarray(edge_start, dtype=np.int64)
        uploaded = _uploaded(self.device, [  # one upload for the layout's index tensors
            slot_row, starts[slot_row], np.arange(self.width) - first_slot[slot_row],
            np.concatenate([last_slot, first_slot, last_slot[slot_row]]),
            last_slot[slot_row] - np.arange(self.width) + 1,
            row_k, np.concatenate([edge_start, edge_start + 1]), edge_start[slot_row]])
        self.slot_row, self.slot_start = uploaded[0], uploaded[1]
        #: a slot's place in its row, from 0
        self.slot_rank = uploaded[2].to(self.scan)
        #: each row's last slot, its first, and each slot's row's last (Top-k's sorted slots: each
        #: row's k-th value, its largest, and the k-th value of each slot's row)
        self._ends = uploaded[3]
        #: how far before its row's last slot a slot is, plus 1
        self._from_end = uploaded[4].to(self.scan)
        self.k = uploaded[5]
        self._marks: Dict[int, torch.Tensor] = {}
        self._tables: Dict[Any, Tuple[torch.Tensor, ...]] = {}
        #: where each row starts and then where each ends in :meth:`_edges` (a group's row starts, then its
        #: end), and each slot's row's start
        self._row_edges, self._edge_of_slot = uploaded[6], uploaded[7]

    def marks(self, size: int) -> torch.Tensor:
        """A bool scratch buffer of ``size`` whose first entry stays False (a count of 0 before the rows)."""
        buffer = self._marks.get(size)
        if buffer is None:
            buffer = self._marks[size] = torch.zeros(size, dtype=torch.bool, device=self.device)
        return buffer

    def _views(self, flat: torch.Tensor):
        """Per group: its start, its ``(rows, n)`` view of ``flat`` (a work buffer), ``k``, ``width``
        and its ranges of rows and of slots."""
        for (start, count, n, k, width), rows, slots in zip(self.groups, self.row_ranges, self.slot_ranges):
            yield start, flat[start : start + count * n].view(count, n), k, width, rows, slots

    def each(self, flat: torch.Tensor) -> Iterator[Tuple[Any, torch.Tensor, int, int]]:
        """Every row of ``flat`` (a work buffer) alone, in the order the tensors were added
        (:func:`~hvd_compress.kernels.reference_rows.each_row`): a selection of another kind row by row."""
        return each_row(flat, self.order)

    def largest(self, flat: torch.Tensor) -> torch.Tensor:
        """Each row's largest entry (NaN where the row holds NaN), in work order: one ``amax`` per group."""
        return torch.cat([view.amax(dim=1) for _, view, *_ in self._views(flat)])

    def largest_magnitude(self, a: torch.Tensor) -> torch.Tensor:
        """Each row's largest ``|a|`` (NaN where the row holds NaN), in work order; where the passes run
        compiled, one pass per group that forms no ``|a|``
        (:func:`~hvd_compress.kernels.torch_compiled.largest_magnitudes`: ``max(-min a, max a)``, exactly)."""
        if not ops.compiled_here(a, self.compile):
            return self.largest(ops.magnitude(a))
        return torch.cat([compiled.largest_magnitudes(view, compile=self.compile) for _, view, *_ in self._views(a)])

    # ------------------------------------------------------------------- Top-k
    def topk(self, scores: torch.Tensor, host: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest ``scores`` of every row, ties to the lower index: ``(positions, top)``.

        ``positions``: int64 work positions, each row's ``k`` in its slots (not in index
        order); ``top``: each row's largest score (NaN above +Inf: a row holds NaN or Inf
        exactly when ``top`` does). ``host``: the CPU's way (default: on the CPU, outside
        ``accelerator_path``), :meth:`_topk_host`.
        """
        if ops.on_host(scores) and scores.dtype in ops.HOST_FLOATS if host is None else host:
            positions, top = self._topk_host(scores.cpu())  # (another device: the host's way, for tests)
            return positions.to(scores.device), top.to(scores.device)
        bits = scores.view(_BITS[scores.dtype])
        values = torch.empty(self.width, dtype=bits.dtype, device=scores.device)
        local = torch.empty(self.width, dtype=torch.int64, device=scores.device)
        for _, view, k, width, _, (lo, hi) in self._views(bits):
            assert width == k, "Top-k fills every slot of a row"
            torch.topk(view, k, dim=1, out=(values[lo:hi].view(-1, k), local[lo:hi].view(-1, k)))
        ends = values.index_select(0, self._ends)
        kth, top = ends[: self.count], ends[self.count : 2 * self.count]
        tie = torch.eq(values, ends[2 * self.count :])
        return self._lowest_ties(bits, kth, tie, local), top.view(scores.dtype)

    def _lowest_ties(self, bits: torch.Tensor, kth: torch.Tensor, tie: torch.Tensor,
                     local: torch.Tensor) -> torch.Tensor:
        """``torch.topk`` keeps any of the entries tied at a row's k-th value; the spec keeps the
        lowest-indexed. Its values are sorted, so a row's tie slots are its last ``m``: the slot
        ``e`` before the last gets the row's tie number ``e + 1`` in index order, found by a
        binary search of ``c[row start] + e + 1`` in ``c = cumsum(marks)``, ``marks`` the entries
        equal to their row's k-th value (after a leading 0).
        """
        marks = self.marks(1 + self.end)
        for start, view, _, _, (r0, r1), _ in self._views(bits):
            torch.eq(view, kth[r0:r1, None], out=marks[1 + start : 1 + start + view.numel()].view_as(view))
        counted = torch.cumsum(marks, 0, dtype=self.scan)
        at_slot_rows = self._edges(counted).index_select(0, self._edge_of_slot)
        found = torch.searchsorted(counted[1:], at_slot_rows.add_(self._from_end))
        return torch.where(tie, found, local.add_(self.slot_start))

    def _edges(self, counted: torch.Tensor) -> torch.Tensor:
        """``counted`` at each group's row starts and its end: strided views (one per group) gathered
        into one small vector, which :attr:`_row_edges` and :attr:`_edge_of_slot` index."""
        return torch.cat([counted[start : start + count * n + 1 : n] for (start, count, n, _, _) in self.groups])

    def _topk_host(self, scores: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The CPU's Top-k: per group one pass marks the scores above each row's :func:`sampled_limit` and
        finds each row's largest (:func:`~hvd_compress.kernels.torch_compiled.marks_and_largest`), then each
        row's ``k`` largest among its marked few (:meth:`_marked_topk`)."""
        parts, top = [], []
        for start, view, k, _, _, _ in self._views(scores):
            marks, largest = compiled.marks_and_largest(view, sampled_limit(view, k), compile=self.compile)
            top.append(largest)
            nan = torch.isnan(largest).numpy()

            def alone(i: int, view: torch.Tensor = view, k: int = k, nan: np.ndarray = nan) -> Optional[torch.Tensor]:
                """A row holding NaN, which the reference never ranks: the accelerator's way ranks it above +Inf."""
                return Rows([(0, 1, view.shape[1], k, k)], view.device).topk(view[i], host=False)[0] if nan[i] else None

            parts += self._marked_topk(marks, k, start, lambda i, at, view=view: view[i].index_select(0, at),
                                       lambda i, view=view: view[i], alone)
        return torch.cat(parts), torch.cat(top)

    def aged_topk(self, rate: torch.Tensor, age: torch.Tensor, a: torch.Tensor,
                  one: torch.Tensor) -> Tuple[Any, ...]:
        """The aggregate rule's selection: ``(positions, probe, (aged, rate[positions], aged[positions]))``,
        ``aged = age + one``, ``positions`` each row's ``k`` largest ``rate * aged`` (:meth:`topk`'s), ``probe`` each
        row's largest ``|a|``. On the host one pass per group
        (:func:`~hvd_compress.kernels.torch_compiled.aged_marks`) writes ``aged`` and marks the scores above the
        limit of their strided sample, no score formed: the same selection, and the rates and ages at the
        positions come from the marked entries' (gathered once, to score them)."""
        if not (ops.on_host(a) and a.dtype in ops.HOST_FLOATS and rate.dtype in ops.HOST_FLOATS):
            aged = ops.add(age, one)
            positions = self.topk(ops.multiply(rate, aged))[0]
            return positions, self.largest_magnitude(a), (aged, ops.take(rate, positions), ops.take(aged, positions))
        aged = ops.empty(age.shape[0], age.dtype, age)
        parts, probe, rates_at, aged_at = [], [], [], []
        views = zip(self._views(a), *(self._views(x) for x in (rate, age, aged)))
        for (start, view, k, _, _, _), (_, rates, *_), (_, ages, *_), (_, grown, *_) in views:
            step, n = sample_step(view.shape[1]), view.shape[1]
            sample = rates[:, ::step] * (ages[:, ::step] + one)
            marks, largest = compiled.aged_marks(view, rates, ages, grown, sampled_limit(rates, k, sample),
                                                  compile=self.compile)
            probe.append(largest)
            for i, mine in self._marked_rows(marks):
                if mine.shape[0] < k:  # the sample's limit was too high (or few scores above 0): the whole row
                    mine = torch.arange(n)
                row_rates, row_aged = rates[i].index_select(0, mine), grown[i].index_select(0, mine)
                best = ops.topk_indices(row_rates * row_aged, k).long()
                parts.append(mine.index_select(0, best) + (start + i * n))
                rates_at.append(row_rates.index_select(0, best))
                aged_at.append(row_aged.index_select(0, best))
        return torch.cat(parts), torch.cat(probe), (aged, torch.cat(rates_at), torch.cat(aged_at))

    def _marked_rows(self, marks: torch.Tensor) -> Iterator[Tuple[int, torch.Tensor]]:
        """Per row ``i`` of a group's ``marks`` (int8 ``(R, n)``): ``(i, its marked positions)``, int64, in index
        order."""
        n = marks.shape[1]
        marked = np.flatnonzero(marks.view(torch.bool).numpy())
        edges = np.searchsorted(marked, np.arange(marks.shape[0] + 1) * n)
        for i in range(marks.shape[0]):
            yield i, torch.from_numpy(marked[edges[i] : edges[i + 1]] - i * n)

    def _marked_topk(self, marks: torch.Tensor, k: int, start: int, scores_at: Any, row_scores: Any,
                     alone: Any = None) -> List[torch.Tensor]:
        """Per row ``i`` of a group's ``marks`` (int8 ``(R, n)``, the scores above the row's sampled limit): the
        work positions of its ``k`` largest scores, ties to the lower index (the marks are in index order),
        among the marked entries where at least ``k`` are (``scores_at(i, positions)``; every entry tied with
        the k-th largest lies above the limit), else of the whole row (``row_scores(i)``: the sample's limit
        was too high, or fewer than ``k`` entries lie above 0); ``alone(i)``, where given and not ``None``,
        selects row ``i`` itself."""
        n, chosen = marks.shape[1], []
        for i, mine in self._marked_rows(marks):
            rows = alone(i) if alone is not None else None
            if rows is None:
                rows = (mine.index_select(0, ops.topk_indices(scores_at(i, mine), k).long()) if mine.shape[0] >= k
                        else ops.topk_indices(row_scores(i), k))
            chosen.append(rows.long() + (start + i * n))
        return chosen

    # -------------------------------------------------------------- Gaussian-k
    def thresholds(self, a: torch.Tensor, ratio: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """First Gaussian-k threshold of every row and its mean, float64: ``|mean| + std *
        Phi^-1(1 - ratio / 2)``, the moments reduced in ``a``'s dtype (as
        :func:`torch_ops.gaussiank_thresholds`; compiled, :func:`~hvd_compress.kernels.torch_compiled.moments`,
        within float rounding of it)."""
        std_mean = compiled.moments if ops.compiled_here(a, self.compile) else functools.partial(torch.std_mean, dim=1,
                                                                                                  correction=0)
        moments = [std_mean(view) for _, view, *_ in self._views(a)]
        both = torch.empty(2 * self.count, dtype=torch.float64, device=a.device)
        std, mean = torch.cat([m[0] for m in moments] + [m[1] for m in moments], out=both).view(2, -1)
        return mean.abs().add_(std.mul(reference.normal_tail_quantile(ratio))), mean

    def gaussiank(self, a: torch.Tensor, ratio: float, host: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """:func:`reference.gaussiank_from` (from :func:`reference.gaussiank_threshold`) of every row: ``(positions, mean)``.

        ``positions``: int64 work positions, each row's selection in index order in its
        first slots, the other slots ``spare``; ``mean``: each row's mean (float64, NaN or
        Inf for a row holding NaN or Inf). All six thresholds a row can meet are
        counted in one pass per group, the rule is applied to the counts, and one pass
        marks what the chosen threshold selects (cut to ``k`` where the rule cuts). On the
        host (``host``, default on the CPU outside ``accelerator_path``) the host applies the rule
        to the same counts (:meth:`_threshold_host`), whose passes, where they compile, read ``a`` and
        form no ``|a|``; elsewhere ``|a|`` is formed once.
        """
        first, mean = self.thresholds(a, ratio)
        if (ops.on_host(a) if host is None else host) and a.dtype in ops.HOST_FLOATS:
            host_a = a.cpu()  # (another device: the host's way, for tests)
            of_a = ops.compiled_here(host_a, self.compile)
            magnitude = host_a if of_a else ops.magnitude(host_a)
            positions = self._threshold_host(magnitude, first.cpu(), reference.gaussiank_bounds, of_a=of_a)[0]
            return positions.to(a.device), mean
        return self._by_threshold(ops.magnitude(a), first, reference.gaussiank_bounds)[0], mean

    def _by_threshold(self, magnitude: torch.Tensor, first: torch.Tensor, bounds_of: Any,
                      keep: bool = False, stride_of: Any = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every row's ``{j : magnitude_j > thr}`` in its slots, in index order, ``thr`` its ``first`` threshold
        (float64) corrected toward a count in ``bounds_of(k)`` (:func:`reference.threshold_choice`):
        ``(positions, thr if keep else None)``. All six thresholds a row can meet are counted in one pass
        per group (with ``stride_of``: on every ``s = stride_of(k)``-th entry, against the bounds over
        ``s``: ``s c < low`` is ``c < ceil(low / s)``, ``s c > high`` is ``c > floor(high / s)``), the rule is
        applied to the counts (a table of its outcomes), and one pass marks what the chosen threshold
        selects (cut to ``k`` where the rule cuts)."""
        factors, outcomes, pow3, bounds, next_rank, counts = self._threshold_tables(bounds_of, stride_of)
        nodes = len(reference.GAUSSIANK_FACTORS)
        # every threshold twice (the outcome table's codes i + 6 cut index both), in magnitude's dtype
        if magnitude.dtype in ops.HOST_FLOATS:  # rounded once, on the write
            limits = torch.mul(first[:, None], factors, out=magnitude.new_empty((self.count, 2 * nodes)))
        else:
            limits = ops.cast(first[:, None] * factors, magnitude.dtype)
        for _, view, k, _, (r0, r1), _ in self._views(magnitude):  # counts[:, 6:] hold k (the cut's room)
            stride = stride_of(k) if stride_of else 1
            torch.sum(torch.gt(view[:, ::stride, None], limits[r0:r1, None, :nodes]), dim=1, out=counts[r0:r1, :nodes])
        levels = torch.searchsorted(bounds, counts, right=True)  # 0 below the bounds, 1 in range, 2 above
        outcome = outcomes.index_select(0, levels.mul_(pow3).sum(dim=1))[:, None]  # pow3: 0 on k's columns
        limit = limits.gather(1, outcome)
        room = counts.gather(1, outcome).view(-1) if stride_of is None else None  # sampled: count the marks
        chosen = first * factors.index_select(0, outcome.view(-1)) if keep else None
        return self._marked(magnitude, limit, room, next_rank), chosen

    def _marked(self, magnitude: torch.Tensor, limit: torch.Tensor, room: Optional[torch.Tensor],
                next_rank: torch.Tensor) -> torch.Tensor:
        """Per row the first ``room`` entries above its ``limit`` (a column), in index order in its slots,
        the other slots ``spare``: one marking pass per group, one cumulative count, one binary search.
        ``room=None``: every marked entry up to ``k`` (each row's marks: the count at its end minus at its
        start, read from :meth:`_edges`)."""
        counted = self._counted(magnitude, limit)
        edges = self._edges(counted)
        if room is None:
            ends = edges.index_select(0, self._row_edges)
            room = torch.minimum(ends[self.count :] - ends[: self.count], self.k)
        found = torch.searchsorted(counted[1:], edges.index_select(0, self._edge_of_slot).add_(next_rank))
        return torch.where(self.slot_rank < room.index_select(0, self.slot_row), found, self.spare)

    def _counted(self, magnitude: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """``cumsum`` of the marks ``magnitude > limit`` (each row's own), after a leading 0."""
        marks = self.marks(1 + self.end)
        for start, view, _, _, (r0, r1), _ in self._views(magnitude):
            torch.gt(view, limit[r0:r1], out=marks[1 + start : 1 + start + view.numel()].view_as(view))
        return torch.cumsum(marks, 0, dtype=self.scan)

    def _threshold_tables(self, bounds_of: Any, stride_of: Any = None) -> Tuple[torch.Tensor, ...]:
        """Built once per rule: the factors (twice), the outcome table, powers of 3 (then zeros), each row's
        integer bounds ``[low, high + 1]`` (``bounds_of(k)``; counted on every ``s``-th entry:
        ``[ceil(low / s), floor(high / s) + 1]``), each slot's rank + 1, and the counts' buffer: six counts
        per row, then ``k`` six times (the room of a cut set)."""
        tables = self._tables.get((bounds_of, stride_of))
        if tables is None:
            nodes = len(reference.GAUSSIANK_FACTORS)
            bounds = [[-(-low // s), high // s + 1] for start, count, n, k, width in self.groups for _ in range(count)
                      for (low, high), s in [(bounds_of(k), stride_of(k) if stride_of else 1)]]
            counts = torch.empty((self.count, 2 * nodes), dtype=torch.int64, device=self.device)
            counts[:, nodes:] = self.k[:, None]
            tables = self._tables[(bounds_of, stride_of)] = (
                torch.tensor(reference.GAUSSIANK_FACTORS * 2, dtype=torch.float64, device=self.device),
                _OUTCOMES.to(self.device),
                torch.cat([3 ** torch.arange(nodes), torch.zeros(nodes, dtype=torch.int64)]).to(self.device),
                torch.tensor(bounds, dtype=torch.int64, device=self.device).view(-1, 2),
                self.slot_rank + 1,
                counts,
            )
        return tables

    # ---------------------------------------------------------- reused thresholds
    def reused(self, scores: torch.Tensor, kept: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`reference.reused_threshold_select` of every row from its ``kept`` threshold (float64,
        work order): ``(positions, the thresholds to keep, each row's largest score)``, each row's selection
        in index order in its first slots, the others ``spare``: a counting pass over every
        ``sample_stride(k)``-th entry and a marking pass per size group, no top-k (on the host:
        :meth:`_threshold_host`, whose marking pass finds the largest too)."""
        if ops.on_host(scores) and scores.dtype in ops.HOST_FLOATS:
            return self._threshold_host(scores, kept, reference.reuse_bounds, reference.sample_stride, largest=True)
        positions, chosen = self._by_threshold(scores, kept, reference.reuse_bounds, keep=True,
                                               stride_of=reference.sample_stride)
        return positions, chosen, self.largest(scores)

    def kth(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each row's smallest score at its ``k`` positions (after :meth:`topk`: its k-th largest), float64."""
        chosen = scores.index_select(0, positions)
        parts = [chosen[lo:hi].view(-1, k).amin(dim=1) for (_, _, _, k, _), (lo, hi) in zip(self.groups, self.slot_ranges)]
        return torch.cat(parts).to(torch.float64)

    def _threshold_host(self, magnitude: torch.Tensor, first: torch.Tensor, bounds_of: Any,
                        stride_of: Any = None, largest: bool = False, of_a: bool = False) -> Tuple[torch.Tensor, ...]:
        """The CPU's :meth:`_by_threshold` (same results): per group one pass counts every row's six
        candidate thresholds (:func:`~hvd_compress.kernels.torch_compiled.counts_above`, on every
        ``stride_of(k)``-th entry), the host applies :func:`reference.threshold_choice` to the counts, one
        pass marks each row's chosen threshold (:func:`~hvd_compress.kernels.torch_compiled.marks_above`);
        a row whose first threshold is not finite runs :func:`torch_ops.threshold_select` alone.
        ``(positions, the thresholds chosen, float64)``, and with ``largest`` each row's largest ``magnitude``
        (found by the marking pass: :func:`~hvd_compress.kernels.torch_compiled.marks_and_largest`). ``of_a``
        (Gaussian-k's, without ``largest``): ``magnitude`` is ``a`` itself, counted and marked by its ``|a|`` (the
        ``magnitude_`` passes)."""
        out = torch.full((self.width,), self.spare, dtype=torch.int64)
        chosen = first.numpy().copy()
        tops = []
        for start, view, k, width, (r0, r1), (lo, _) in self._views(magnitude):
            stride, bounds, n = stride_of(k) if stride_of else 1, bounds_of(k), view.shape[1]
            limits = _limits(chosen[r0:r1, None] * np.asarray(reference.GAUSSIANK_FACTORS), view.dtype)
            count = compiled.magnitude_counts_above if of_a else compiled.counts_above
            counts = count(view[:, ::stride] if stride > 1 else view, limits, compile=self.compile)
            counts = counts.numpy() * stride
            take, limit = np.full(r1 - r0, width), np.full(r1 - r0, np.inf)
            for i in range(r1 - r0):
                first_i = float(chosen[r0 + i])
                if math.isfinite(first_i):
                    at = {first_i * f: c for f, c in zip(reference.GAUSSIANK_FACTORS, counts[i])}
                    chosen[r0 + i], cut = reference.threshold_choice(at.__getitem__, first_i, *bounds)
                    take[i], limit[i] = k if cut else width, chosen[r0 + i]
            limit_of = _limits(limit[:, None], view.dtype)
            if largest:
                marks, top = compiled.marks_and_largest(view, limit_of, compile=self.compile)
                tops.append(top)
            else:
                mark = compiled.magnitude_marks_above if of_a else compiled.marks_above
                marks = mark(view, limit_of, compile=self.compile)
            marks = marks.view(torch.bool).numpy()
            marked = np.flatnonzero(marks)
            edges = np.searchsorted(marked, np.arange(r1 - r0 + 1) * n)
            for i in range(r1 - r0):
                if math.isfinite(float(first[r0 + i])):
                    mine = torch.from_numpy(marked[edges[i] : min(edges[i] + take[i], edges[i + 1])] - i * n)
                else:  # NaN or Inf (a row holding NaN/Inf): the row alone, as the kernels select it
                    mine, chosen[r0 + i] = ops.threshold_select(view[i].abs() if of_a else view[i],
                                                                float(first[r0 + i]), k, bounds, width, stride)
                out[lo + i * width : lo + i * width + mine.shape[0]] = mine.long() + (start + i * n)
        return (out, torch.from_numpy(chosen)) + ((torch.cat(tops),) if largest else ())


def _limits(thresholds: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float64 thresholds rounded once to ``dtype`` (numpy's cast, as the kernels compare; beyond the dtype's
    range: infinity)."""
    with np.errstate(over="ignore"):
        return torch.from_numpy(thresholds.astype(ops.numpy_dtype(dtype)))
