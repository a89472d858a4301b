"""Shared index sets: every rank sends its values at one common set ``S``, summed by an allreduce.

An allgather of every rank's own ``k`` pairs makes each rank receive ``(N-1) 8k`` bytes, which
grows with the ranks; when every rank sends the values at the same ``S``, a plain allreduce-Sum
adds them and a ring moves ``2 (N-1)/N 4k`` bytes per rank, which does not (Chen et al.,
"ScaleCom: Scalable Sparsified Gradient Compression for Communication-Efficient Distributed
Training", NeurIPS 2020, arXiv:2104.11125). Per bucket (the compressed part, in size groups of
``(rows, n)`` matrices, as :mod:`~hvd_compress.algorithms.sparse_bucket`)::

    a = g + r                                    (momentum: u = m u + g;  a = r + u)
    S, agreed by every rank, one of
      leader     the cyclic leader L = t mod N (t: the steps the run has exchanged, the same for
                 every bucket however the route cuts them; in checkpoints) selects S = select(a_L)
                 with the compressor's own rule (Top-k, Gaussian-k's threshold in its fixed
                 slots, RegTop-k's posterior scores); round 1: an int allreduce-Sum of S,
                 every other rank adding zeros (ScaleCom's cyclic local top-k)
      aggregate  no index traffic: S = per row the k largest  rate * age,  where every rank
                 holds the same rate_j = |sum over ranks at j| / the steps j had accumulated
                 when last sent, and age_j = steps since j was last sent, this one included
                 (rate * age: what j is expected to have accumulated); kept per tensor across
                 plans (a density change) and in checkpoints (``index_rate``, ``index_age``);
                 the first step sends the whole part, which is how every rank learns every rate
    send a[S] ++ f                               one allreduce-Sum of K values and the flags
    r = a with a[S] set to 0                     (momentum: u[S] = 0)
    total[S] = the sum; f at each tensor's first entry: NaN where any rank held NaN/Inf

``f`` is ``0 *`` each row's largest ``|a|`` (the leader's: its selection's largest score),
so a non-finite tensor on any rank is non-finite on every rank and keeps its state, as in the
allgather codec. Per rank and step a ring moves ``2 (N-1)/N (K + T) s`` bytes of values (``T``
tensors' flags, ``s`` the gradient's itemsize), plus ``2 (N-1)/N 4K`` of indices for the leader:
independent of ``N``. ``aggregate`` ranks every tensor of the plan by the same rule, whatever
the compressor's own scores (Top-k, Gaussian-k and RegTop-k choose alike), and ``k`` per row.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Generator, List, Tuple

import numpy as np

from hvd_compress.algorithms.rounds import Send
from hvd_compress.algorithms.sparse_bucket import (SparseBucketCodec, adopted_posterior, flush_posterior,
                                                   kept_in_place)

#: an array of the bucket's kernel module (numpy array, torch or TensorFlow tensor)
Array = Any

class SharedIndexCodec(SparseBucketCodec):
    """Plan and state of a shared-index compressed part (see the module docstring)."""

    def __init__(self, compressor: Any, layout: Any, rule: str) -> None:
        """``rule``: ``"leader"`` or ``"aggregate"`` (the sparsifier's checked ``indices``)."""
        super().__init__(compressor, layout, slots=None if rule == "leader" else compressor.k)
        self.rule = rule
        self.rounds = 2 if rule == "leader" else 1
        self.placeable = False  # its decode sums in the work layout (the rates read it there)
        #: the aggregate rule's state, the same on every rank (``None``: the next step sends all)
        self.rate: Any = None
        self.age: Any = None
        #: 1 as a 0-d array of the accumulation dtype, made once: each step's ``age + 1``
        self.one = layout.ops.scalar(1, layout.acc, layout.like)

    def take_over(self, previous: Any) -> bool:
        """The state of ``previous``, this layout's codec before a density change (:meth:`SparseBucketCodec.take_over`)
        and, of the same rule, the ``aggregate`` rule's rates and ages; ``False`` for another rule."""
        if type(previous) is not type(self) or previous.rule != self.rule:
            return False
        self.rate, self.age = previous.rate, previous.age
        return super().take_over(previous)

    def adopt(self, layout: Any, memory: Any) -> None:
        """The ``aggregate`` rule's rates and ages from each tensor's memory (``index_rate``, ``index_age``:
        another plan's, after a density change, or a checkpoint's); a tensor without them makes the next
        step send the whole part; RegTop-k's posterior as a single selection's."""
        self.posterior = adopted_posterior(layout, memory)
        if self.rule != "aggregate":
            return
        ops, parts = layout.ops, {"index_rate": [], "index_age": []}
        for i in layout.compressed:
            for key, arrays in parts.items():
                value = memory.peek(layout.names[i], key)
                if value is None or math.prod(value.shape) != layout.numels[i]:
                    return
                arrays.append(ops.cast(ops.reshape(value, (-1,)), layout.acc))
        self.rate, self.age = (ops.to_device(ops.concat(parts[key]), layout.like) for key in parts)

    def flush(self, layout: Any, memory: Any) -> None:
        """Each tensor's posterior, rates and ages into its memory (copies: the plan's change in place)."""
        flush_posterior(layout, self.posterior, memory)
        if self.rule != "aggregate" or self.rate is None:
            return
        for i in layout.compressed:
            start, n = layout.offsets[i], layout.numels[i]
            memory.set(layout.names[i], "index_rate", layout.ops.clone(self.rate[start : start + n]))
            memory.set(layout.names[i], "index_age", layout.ops.clone(self.age[start : start + n]))

    def wire(self, layout: Any, itemsize: int) -> Tuple[int, int]:
        """``(bytes sent, values sent)`` of a steady step: ``K`` values and the flags (the leader's
        ``K`` indices too); the ``aggregate`` rule's first step of a plan adds the rest of the part."""
        index_size = layout.ops.itemsize(layout.ops.empty(0, self.index_dtype, layout.like))
        indices = self.k_total * index_size if self.rule == "leader" else 0
        return (self.k_total + self.flag_count) * itemsize + indices, self.k_total

    def exchange(self, layout: Any, g: Array, step: Any) -> Generator[List[Send], Dict[str, Any], Any]:
        """The rounds of one step (the leader's indices, then the values), then the decode:
        ``(sum over ranks, per-tensor flag of a non-finite tensor)``."""
        a = step.accumulated(g)
        if self.rule == "leader":
            idx, probe = yield from self._leader_set(layout, a, step)
            aged = None
        else:
            idx, probe, aged = self._aggregate_set(layout, a, step.run)
        message, values = self.framed(layout, a, idx, probe, step)
        received = yield [Send("values", "sum", message)]
        return self._decoded(layout, received["values"], idx, values, aged)

    def _leader_set(self, layout: Any, a: Array,
                    step: Any) -> Generator[List[Send], Dict[str, Any], Tuple[Array, Array]]:
        """Round 1: the leader's selection, allreduced (every other rank adds zeros); ``(S, probe)``."""
        ops = layout.ops
        if self.compressor.rank == step.exchanges % layout.world:
            scores = self.compressor.bucket_scores(a, self.posterior, ops)
            idx, probe = self.compressor.bucket_select(a, scores, self.rows, ops)
            chosen = ops.cast(idx, self.index_dtype)
        else:
            probe, chosen = self.rows.largest_magnitude(a), ops.zeros(self.k_total, self.index_dtype, layout.like)
        received = yield [Send("leader", "sum", chosen)]
        return ops.cast(received["leader"], ops.int64), probe

    def _aggregate_set(self, layout: Any, a: Array, run: Any) -> Tuple[Array, Array, Any]:
        """``(S, probe, (age + 1, rate[S], (age + 1)[S]))``: per row the ``k`` largest ``rate * (age + 1)``; at the
        first step every position (and ``None``; counted in the statistics of the run state ``run``)."""
        ops = layout.ops
        if self.rate is None:
            unsent = layout.n_compressed - self.k_total  # beyond a steady step's statistics
            run.stats.add(unsent * ops.itemsize(ops.empty(0, layout.dtype, layout.like)), 0, unsent, 0)
            probe = self.rows.largest_magnitude(a)
            return ops.as_int64(np.arange(layout.n_compressed), layout.like), probe, None
        return self.rows.aged_topk(self.rate, self.age, a, self.one)

    def _decoded(self, layout: Any, summed: Array, idx: Array, values: Array, aged: Any) -> Tuple[Array, Array]:
        ops, count = layout.ops, idx.shape[0]
        summed = ops.cast(summed, layout.acc)
        total = ops.index_add(ops.zeros(layout.n_compressed + self.spare, layout.acc, layout.like), idx, summed[:count])
        flags = summed[count:]
        total = ops.index_add(total, self.flag_positions, flags)
        bad = ops.isnan(flags)
        if self.rule == "aggregate":
            self._learn(layout, total, idx, summed[:count], aged, bad)
            return total, bad
        posterior = self.compressor.bucket_observe(total, (idx, values), bad, self.rows.slot_row, ops)
        if posterior is not None:  # RegTop-k's, for this rank's turns as the leader
            self.posterior = kept_in_place(ops, self.posterior, posterior)
        return total, bad

    def _learn(self, layout: Any, total: Array, idx: Array, sums: Array, aged: Any, bad: Array) -> None:
        """``rate[S] = |total[S]| / age[S]`` and ``age[S] = 0``, every other entry one step older; a flagged
        tensor keeps its rates and its entries count the step. ``sums``: ``total[S]`` as received (the flags
        added at a tensor's first entry are 0 where its rates change); ``aged``: the step's ages, and the rates
        and ages at ``S`` (the selection's). Work of size K, two scatters: the plan's rates and ages change where
        they lie (:meth:`flush` hands out copies)."""
        ops = layout.ops
        if aged is None:  # the whole part was sent, each entry's one step (a non-finite tensor's rates: 0)
            self.rate = ops.nonfinite_to_zero(abs(total[: layout.n_compressed]))
            self.age = ops.zeros(layout.n_compressed, layout.acc, layout.like)
            return
        age, rate_at, waited = aged
        kept = ops.take(bad, self.rows.slot_row)  # per slot: its tensor's flag
        self.rate = ops.put(self.rate, idx, ops.where(kept, rate_at, abs(sums) / waited))
        self.age = ops.put(age, idx, ops.where(kept, waited, 0))
