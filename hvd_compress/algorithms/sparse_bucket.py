"""The sparsifiers' codec for a fused bucket (numpy, torch, TensorFlow): one round of two fixed-size allgathers.

Per bucket (the compressed part, laid out by size groups of ``(rows, n)`` matrices)::

    a = g + r                                   (momentum: u = m u + g;  a = r + u)
    S, f = select(a, score(a))                  per size group one top-k and one tie scan
                                                (Gaussian-k: moments, one count of all its
                                                thresholds, one mark), then a fixed number
                                                of kernels for the bucket
                                                (:func:`~hvd_compress.kernels.bucket_rows`: torch's
                                                :class:`~hvd_compress.kernels.torch_rows.Rows`, numpy's
                                                :class:`~hvd_compress.kernels.reference_rows.Rows`,
                                                :class:`~hvd_compress.kernels.tf_rows.Rows`)
    send a[S] ++ f, S ++ first entries          two allgathers of K + flags entries per rank
    r = a with a[S] set to 0                    (momentum: u[S] = 0)
    total = 0;  total += every rank's a[S] at S and its f at each tensor's first entry
                                                one index_add per rank, in rank order

``k = ceil(ratio n)`` per tensor (Gaussian-k: ``floor(4k/3)`` slots, unused ones sent as
index ``n_compressed``, a spare work entry that stays 0), so each rank sends exactly
``K = sum k`` values and indices and no count travels. The flag ``f_j`` of tensor ``j`` is
``0 *`` what the selection computes anyway (Top-k's largest score, Gaussian-k's mean): 0, or
NaN where ``a_j`` holds NaN/Inf; summed at the tensor's first entry it makes the tensor
non-finite on every rank, as a dense allreduce would.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional, Tuple

import numpy as np

from hvd_compress.kernels import bucket_rows
from hvd_compress.algorithms.checkpoint import host_array
from hvd_compress.algorithms.rounds import Send

#: an array of the bucket's kernel module (numpy array, torch or TensorFlow tensor)
Array = Any


class SparseBucketCodec:
    """Plan of a sparsifier's compressed part of one fused bucket (see the module docstring)."""

    rounds = 1

    def __init__(self, compressor: Any, layout: Any, slots: Any = None) -> None:
        """``slots(n)``: the slots of a row of ``n`` (default: the compressor's; a fixed ``k`` per row
        where the selection is a plain Top-k of other scores)."""
        self.compressor, ops = compressor, layout.ops
        groups = layout.groups
        own = slots is None
        k, slots = (compressor.k, compressor.slots) if own else (slots, slots)
        #: slots may go unused (Gaussian-k): one spare work entry after the compressed part
        self.spare = int(own and bool(getattr(compressor, "pads_slots", False)))
        self.k_total = sum(g.rows * slots(g.n) for g in groups)
        self.index_dtype = ops.index_dtype(layout.n_compressed + 1)
        #: the selections of the compressed part; unused slots point at the spare entry
        self.rows = bucket_rows(ops, [(g.start, g.rows, g.n, k(g.n), slots(g.n)) for g in groups],
                                layout.like, spare=layout.n_compressed, tensors=added_order(layout),
                                compile=compressor.compile)
        #: flags sent per step: one per compressed tensor, and a 0 for the spare entry, each added
        #: at the first work position of its tensor (the spare: its own)
        self.flag_count = sum(g.rows for g in groups) + self.spare
        firsts = [g.start + row * g.n for g in groups for row in range(g.rows)] + [layout.n_compressed] * self.spare
        self.flag_positions = ops.cast(ops.as_int64(firsts, layout.like), self.index_dtype)
        #: steps between exact selections (0: every step exact), and each row's kept threshold
        #: (float64, work order; ``None``: the next step selects exactly)
        self.reuse = compressor.exact_every if own and getattr(compressor, "exact_every", 1) > 1 else 0
        self.thresholds: Any = None
        #: each compressed tensor's k in this plan (a density change makes another plan)
        self.k_of = {i: k(layout.numels[i]) for i in layout.compressed}
        #: RegTop-k's posterior ``(work positions, D)`` from the last aggregate (``None``: D = 1e8 everywhere)
        self.posterior: Any = None
        #: each compressed tensor's slots (work order), and whether the decode may sum into another layout
        #: (:meth:`shift`): only where nothing reads the sums at work positions afterwards (RegTop-k does)
        self.widths = [slots(g.n) for g in groups for _ in range(g.rows)]
        self.placeable = not getattr(compressor, "observes_sums", False)

    def wire(self, layout: Any, itemsize: int) -> Tuple[int, int]:
        """``(bytes sent, values sent)`` of a step: ``K`` (value, index) slots and a flag with its position per tensor."""
        index_size = layout.ops.itemsize(layout.ops.empty(0, self.index_dtype, layout.like))
        return (self.k_total + self.flag_count) * (itemsize + index_size), self.k_total

    def exchange(self, layout: Any, g: Array, step: Any) -> Generator[List[Send], Dict[str, Any], Any]:
        """Encode ``g`` (the compressed part, and a 0 for the spare entry), one round, then the
        decode: ``(sum over ranks, per-tensor flag of a non-finite tensor)``."""
        message, positions, sent, kept = self._encode(layout, g, step)
        rows = [self.k_total + self.flag_count] * layout.world
        received = yield [Send("values", "gather", message, rows), Send("indices", "gather", positions, rows)]
        total, bad = self._decode(layout, received, sent, step.placement)
        if kept is not None:  # a non-finite tensor keeps its threshold (the first exact one: the new)
            self.thresholds = kept if self.thresholds is None else layout.ops.copy_into(
                self.thresholds, layout.ops.where(bad[: self.rows.count], self.thresholds, kept))
        return total, bad

    def _encode(self, layout: Any, g: Array, step: Any) -> Tuple[Array, Array, Any, Any]:
        comp, ops = self.compressor, layout.ops
        a = step.accumulated(g)
        scores = comp.bucket_scores(a, self.posterior, ops)
        idx, probe, kept = self._select(layout, a, scores, step)
        message, values = self.framed(layout, a, idx, probe, step)
        positions = ops.empty(self.k_total + self.flag_count, self.index_dtype, layout.like)
        return message, ops.concat([idx, self.flag_positions], out=positions), (idx, values), kept

    def _select(self, layout: Any, a: Array, scores: Array, step: Any) -> Tuple[Array, Array, Any]:
        """``(S, probe, thresholds to keep or None)``: the compressor's selection, or with reused thresholds
        (``exact_every = T > 1``) the exact one at every T-th step of the run (and when no threshold is
        kept) and each row's reused threshold between (:meth:`Rows.reused`; the probe: each row's largest
        score); the host knows which from the run's step count, so nothing is read back."""
        comp, ops = self.compressor, layout.ops
        if not self.reuse:
            return (*comp.bucket_select(a, scores, self.rows, ops), None)
        if self.thresholds is None or step.exchanges % self.reuse == 0:
            idx, probe = comp.bucket_select(a, scores, self.rows, ops)
            return idx, probe, self.rows.kth(scores, idx)
        idx, kept, probe = self.rows.reused(scores, self.thresholds)
        return idx, probe, kept

    def take_over(self, previous: Any) -> bool:
        """The state of ``previous``, this layout's codec before a density change: RegTop-k's posterior, and
        the kept thresholds where every tensor keeps its ``k`` (else the next step selects exactly), as
        :meth:`flush` then :meth:`adopt` would carry them. ``False`` for another kind of codec."""
        if type(previous) is not type(self):
            return False
        self.posterior = previous.posterior
        if self.reuse and previous.reuse and previous.k_of == self.k_of:
            self.thresholds = previous.thresholds
        return True

    def adopt(self, layout: Any, memory: Any) -> None:
        """Reused thresholds from each tensor's memory (``threshold``, kept for ``threshold_k`` slots: a
        checkpoint's, another plan's of the same ``k``); any missing or made for another ``k``: the next
        step selects exactly."""
        self.posterior = adopted_posterior(layout, memory)
        if not self.reuse:
            return
        parts = []
        for i in layout.compressed:
            threshold, k = memory.peek(layout.names[i], "threshold"), memory.peek(layout.names[i], "threshold_k")
            if threshold is None or k is None or int(np.asarray(host_array(k)).reshape(-1)[0]) != self.k_of[i]:
                return
            parts.append(layout.ops.cast(layout.ops.reshape(threshold, (-1,)), layout.ops.float64))
        self.thresholds = layout.ops.to_device(layout.ops.concat(parts), layout.like) if parts else None

    def flush(self, layout: Any, memory: Any) -> None:
        """Each tensor's posterior and kept threshold (copies) and its ``k`` into its memory."""
        flush_posterior(layout, self.posterior, memory)
        if not self.reuse or self.thresholds is None:
            return
        for row, i in enumerate(layout.compressed):
            memory.set(layout.names[i], "threshold", layout.ops.clone(self.thresholds[row : row + 1]))
            memory.set(layout.names[i], "threshold_k", int(self.k_of[i]))  # a plain int: torch.load(weights_only)

    def framed(self, layout: Any, a: Array, idx: Array, probe: Array, step: Any) -> Tuple[Array, Array]:
        """``(message, values)``: the message ``a[S] ++ flags ++ 0 for the spare entry`` (the flags ``0 *
        probe``: 0, or NaN where a tensor is non-finite) and its ``a[S]`` part (:func:`sent_part`)."""
        ops, count, flags = layout.ops, idx.shape[0], self.flag_count - self.spare
        message = ops.empty(count + self.flag_count, layout.dtype, layout.like)
        values = sent_part(layout, a, idx, message[:count], step)
        parts = [values, ops.multiply(probe, 0, out=message[count : count + flags])]
        if self.spare:
            parts.append(ops.fill_zero(message[count + flags :]))
        return ops.joined(message, parts), values

    def shift(self, layout: Any, starts: Dict[int, int], numel: int) -> Array:
        """What moves each sent position (``K`` slots, then the flags) from the work layout to a layout
        of ``numel`` entries where tensor ``i`` starts at ``starts[i]`` (its spare entry: ``numel``),
        made once per layout; :meth:`_decode` sums there when the step's ``placement`` holds it."""
        moves = [starts[i] - layout.offsets[i] for i in layout.compressed]
        per_slot = [move for move, width in zip(moves, self.widths) for _ in range(width)]
        spare = [numel - layout.n_compressed] * self.spare
        ops = layout.ops
        return ops.cast(ops.as_int64(per_slot + moves + spare, layout.like), ops.index_dtype(numel + 1))

    def _decode(self, layout: Any, received: Dict[str, Any], sent: Any,
                placement: Any = None) -> Tuple[Array, Array]:
        """``(sum over ranks, per-tensor flag)``: the sum in the work layout, or with ``placement`` (a
        layout of ``placement.numel`` entries, :meth:`shift` in ``placement.shift``) in that layout."""
        ops, width = layout.ops, self.k_total + self.flag_count
        values = ops.reshape(received["values"], (layout.world, width))
        indices = ops.reshape(received["indices"], (layout.world, width))
        size = layout.n_compressed
        if placement is not None:  # each position moved to its tensor's place there (spare slots: its spare)
            moved = ops.cast(indices, placement.shift.dtype) + placement.shift
            indices = moved if not self.spare else ops.where(indices == layout.n_compressed, placement.numel, moved)
            size = placement.numel
        total = ops.zeros(size + self.spare, layout.acc, layout.like)
        for rank in range(layout.world):  # rank order: the same sums on every rank and device; the flags
            total = ops.index_add(total, indices[rank], ops.cast(values[rank], layout.acc))  # (0 or NaN) at firsts
        flags = ops.cast(values[:, self.k_total :], layout.acc)
        bad = ops.isnan(ops.sum_along(flags, 0))  # NaN where any rank was non-finite
        posterior = self.compressor.bucket_observe(total, sent, bad, self.rows.slot_row, ops)
        if posterior is not None:
            self.posterior = kept_in_place(ops, self.posterior, posterior)
        return total, bad


def adopted_posterior(layout: Any, memory: Any) -> Optional[Tuple[Array, Array]]:
    """RegTop-k's posterior of the compressed tensors from their memory (``posterior_indices``, ``_values``)
    as fixed-size ``(work positions, D)`` vectors on the bucket's device; ``None`` when none has one."""
    ops, positions, values = layout.ops, [], []
    for i in layout.compressed:
        idx = memory.peek(layout.names[i], "posterior_indices")
        if idx is not None:
            positions.append(ops.cast(idx, ops.int64) + layout.offsets[i])
            values.append(memory.peek(layout.names[i], "posterior_values"))
    if not positions:
        return None
    return ops.to_device(ops.concat(positions), layout.like), ops.to_device(ops.concat(values), layout.like)


def flush_posterior(layout: Any, posterior: Optional[Tuple[Array, Array]], memory: Any) -> None:
    """Each compressed tensor's part of ``posterior`` (copies, the entries it informed) into its memory."""
    if posterior is None:
        return
    ops, (idx, values) = layout.ops, posterior
    for i in layout.compressed:
        start, n = layout.offsets[i], layout.numels[i]
        mine = (idx >= start) & (idx < start + n) & (values != ops.NO_DISTORTION)
        memory.set(layout.names[i], "posterior_indices", ops.cast(ops.masked(idx, mine) - start, ops.index_dtype(n)))
        memory.set(layout.names[i], "posterior_values", ops.masked(values, mine))


def kept_in_place(ops: Any, old: Any, new: Tuple[Array, ...]) -> Tuple[Array, ...]:
    """State arrays ``new`` written into the buffers ``old`` holds where their shapes agree (what a captured
    CUDA graph reads stays where it was), else ``new`` itself."""
    if old is None or [o.shape for o in old] != [n.shape for n in new]:
        return new
    return tuple(ops.copy_into(o, n) for o, n in zip(old, new))


def added_order(layout: Any) -> List[Tuple[int, Tuple[str, tuple]]]:
    """The compressed tensors in the order they were added, each as ``(its row in work order, (name, shape))``
    (:func:`~hvd_compress.kernels.reference_rows.row_order`)."""
    rows = {i: row for row, i in enumerate(layout.compressed)}
    return [(rows[i], (layout.names[i], layout.shapes[i])) for i in sorted(layout.compressed)]



def sent_part(layout: Any, a: Array, idx: Array, out: Array, step: Any) -> Array:
    """``a[S]`` in the gradient's dtype, into ``out``; the step's residual is ``a`` with ``a[S]`` set to 0
    (what the gradient's dtype cannot carry stays in it) and under momentum correction ``u[S] = 0``."""
    ops = layout.ops
    if a.dtype != layout.dtype and step.feedback:  # values saturate to the gradient's dtype,
        values, step.residual = ops.error_feedback_split(a, idx, in_place=True, wire_dtype=layout.dtype)
        values = ops.copy_into(out, values)  # the rest stays in the residual
    elif a.dtype != layout.dtype:  # the velocity without error feedback: its values saturate, the rest goes
        values = ops.copy_into(out, ops.saturate(ops.take(a, idx), layout.dtype))
    else:
        values = ops.take(a, idx, out=out)
        if step.feedback:
            step.residual = ops.zero_at(a, idx)
    if step.momentum:  # u[S] = 0 (the spare entry's slots: it stays 0)
        step.velocity = ops.momentum_mask(step.velocity, idx)
    return values
