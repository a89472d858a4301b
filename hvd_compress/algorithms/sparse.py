"""Sparsifiers with error feedback: what Top-k, Gaussian-k and RegTop-k share.

Per tensor and step (docs/design.md, "Error feedback")::

    a = g + r;  S = select(a);  send a[S];  r = a with a[S] set to 0

so the sum over steps of ``g`` equals the sum of what was sent plus ``r``. ``r`` and
``a`` are kept in at least float32; a float16/bfloat16 gradient's values travel in
its own dtype, saturated, and ``r[S]`` keeps the rounding (and anything beyond range).
Tensors smaller than ``dense_below`` elements (biases, norms) are sent dense.

Momentum correction (``momentum=m > 0``; Lin et al., "Deep Gradient Compression",
ICLR 2018, arXiv:1712.01887, section 3.2): error feedback accumulates the velocity
of momentum SGD instead of the gradient, and a sent entry's momentum is spent::

    u = m u + g;  a = r + u;  S = select(a);  send a[S];  r = a with a[S] = 0;  u[S] = 0

``u`` is kept like ``r`` (at least float32, per tensor, in checkpoints as
``velocity``). Tensors sent dense (under ``dense_below``, or ``N k >= d``) send
``u`` (plus a residual left to flush) unmasked: the average of the ranks'
velocities is momentum SGD's velocity of the average gradient, so they train as
momentum SGD. The option owns the momentum: the optimizer must run without its
own (plain SGD; the torch optimizers raise ``ValueError`` otherwise). A step
whose exchanged tensor is non-finite leaves ``u`` (and ``r``) as before the step.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

from hvd_compress.kernels import reference
from hvd_compress.algorithms.base import Compressor, check_ratio
from hvd_compress.algorithms.state import CompressorState
from hvd_compress.algorithms.traffic import resolve as traffic_plan
from hvd_compress.algorithms.validation import (
    check_bool, check_count, check_exact_every, check_indices, check_momentum, checked,
)

#: Tensors below this many elements go dense by default.
DENSE_BELOW = 1024


class Sparsifier(Compressor):
    """Base of the sparse compressors; a subclass implements ``_select(a, name, shape, ops)`` (the indices ``S``
    of one tensor's ``a``, which :meth:`bucket_select` runs on each tensor of a bucket) or
    :meth:`bucket_select` itself (every tensor at once: Top-k, Gaussian-k, RegTop-k).

    Every parameter is checked when the compressor is made and when it is
    assigned later (``TypeError`` for a wrong type, ``ValueError`` out of range).
    """

    payload_kind = "sparse"
    fused = True

    seed = checked("seed", check_count, "Seed of the random streams, an int >= 0.")
    error_feedback = checked("error_feedback", check_bool, "Keep what was not sent in a residual (a bool).")
    dense_below = checked("dense_below", check_count, "Tensors below this many elements go dense (an int >= 0).")
    dense_when_cheaper = checked(
        "dense_when_cheaper", check_bool, "Send a tensor dense where N ranks x k >= its size (a bool)."
    )
    momentum = checked(
        "momentum", check_momentum,
        "DGC's momentum correction: decay m of the velocity u = m u + g that error feedback accumulates, "
        "in [0, 1) (0: off). The optimizer then runs without momentum.",
    )
    density_settings = ("ratio", "traffic")
    #: whether ``exact_every > 1`` applies (a selection of the ``k`` largest scores: Top-k, RegTop-k)
    reuses_thresholds = False
    #: whether :meth:`bucket_observe` reads the sums over ranks at the bucket's work positions (RegTop-k's
    #: posterior): then a decode keeps them there instead of summing straight into a route's layout
    observes_sums = False

    @property
    def indices(self) -> str:
        """How the ranks choose what they send: 'gather' (each rank its own k indices, allgathered: (N-1) 8k
        bytes received per rank), 'leader' or 'aggregate' (one index set shared by every rank, its values
        allreduced: 2 (N-1)/N 4k bytes, independent of N; algorithms.shared_bucket). With ``traffic=``
        it may be set to 'auto' (the default there): the mode is then picked at each ``bind`` for the
        number of ranks (:func:`~hvd_compress.algorithms.traffic.resolve`); reading it gives the mode picked."""
        return self._indices

    @indices.setter
    def indices(self, value: str) -> None:
        if not (value == "auto" and self._traffic is not None):
            value = check_indices(value, f"{type(self).__name__} indices")
        if value != "gather" and self._exact_every > 1:
            raise ValueError(
                f"hvd_compress: indices={value!r} shares one index set between the ranks, which exact_every="
                f"{self._exact_every} (each rank's own reused thresholds) does not use; choose one of them"
            )
        self._indices_rule = value
        self._resolve_traffic()

    @property
    def traffic(self) -> Optional[float]:
        """The budget per rank as a fraction of a dense float32 ring allreduce's bytes, in (0, 1], or
        ``None`` (the density ``ratio`` was given). Set, the index mode and ratio follow from it at every
        ``bind`` (:mod:`hvd_compress.algorithms.traffic`); density schedules then ramp the traffic."""
        return self._traffic

    @traffic.setter
    def traffic(self, value: float) -> None:
        self._traffic = check_ratio(value)
        self._resolve_traffic()

    def _resolve_traffic(self) -> None:
        """The index mode and ratio of the traffic budget on ``self.size`` ranks (with ``traffic=``), or the
        index mode as set."""
        if self._traffic is None:
            self._indices = self._indices_rule
            return
        self._indices, ratio = traffic_plan(self._traffic, self._indices_rule, self.size)
        self.ratio = ratio

    def bind(self, rank: int, size: int) -> "Sparsifier":
        """:meth:`Compressor.bind`; with ``traffic=``, the index mode and ratio for ``size`` ranks."""
        resized = size != self.size
        super().bind(rank, size)
        if resized and self._traffic is not None:
            self._resolve_traffic()
        return self

    def __init__(
        self,
        ratio: Optional[float] = None,
        error_feedback: bool = True,
        dense_below: int = DENSE_BELOW,
        dense_when_cheaper: bool = True,
        seed: int = 0,
        momentum: float = 0.0,
        indices: Optional[str] = None,
        exact_every: int = 1,
        traffic: Optional[float] = None,
        compile: Optional[bool] = None,
    ) -> None:
        super().__init__(seed=seed, compile=compile)
        if (ratio is None) == (traffic is None):
            raise TypeError(f"hvd_compress: {type(self).__name__} takes a density ratio or a traffic budget "
                            f"(traffic=, a fraction of a dense allreduce's bytes per rank), exactly one, got "
                            f"ratio={ratio!r}, traffic={traffic!r}")
        self._traffic = None if traffic is None else check_ratio(traffic)
        self.ratio = traffic if ratio is None else ratio
        self.error_feedback = error_feedback
        self.dense_below = dense_below
        self.dense_when_cheaper = dense_when_cheaper
        self.momentum = momentum
        self._exact_every = 1
        if indices is None:
            indices = "gather" if traffic is None else "auto"
        if traffic is not None and exact_every > 1 and indices != "gather":
            raise ValueError(f"hvd_compress: exact_every={exact_every} reuses each rank's own thresholds, so with "
                             f"traffic= pass indices='gather' (indices={indices!r} may share one index set)")
        self.indices = indices
        self.exact_every = exact_every
        self._warned_dense: set = set()

    @property
    def exact_every(self) -> int:
        """Steps between exact selections, an int >= 1 (1: every step). Above 1 (Top-k, RegTop-k, with
        ``indices='gather'``), the steps between select by each tensor's kept threshold in one counting
        and one marking pass (:func:`~hvd_compress.kernels.reference.reused_threshold_select`): at most
        ``k`` entries, in ``k`` slots (unused ones padded), no sort."""
        return self._exact_every

    @exact_every.setter
    def exact_every(self, value: int) -> None:
        value = check_exact_every(value, f"{type(self).__name__} exact_every")
        if value > 1 and not self.reuses_thresholds:
            raise ValueError(
                f"hvd_compress: {type(self).__name__} has no exact selection to space out (exact_every={value}): it "
                "selects by a threshold of its own every step; exact_every applies to TopK and RegTopK"
            )
        if value > 1 and self.shared:
            raise ValueError(
                f"hvd_compress: exact_every={value} reuses each rank's own thresholds, which an index set shared "
                f"by the ranks (indices={self.indices!r}) does not use; choose one of them"
            )
        self._exact_every = value

    @property
    def pads_slots(self) -> bool:
        """Whether a tensor's slots may go unused (then padded): with reused thresholds."""
        return self.exact_every > 1

    @property
    def ratio(self) -> float:
        """Fraction of entries sent, in (0, 1]; may change between steps (density schedules)."""
        return self._ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        self._ratio = check_ratio(value)

    def config(self) -> Dict[str, Any]:
        return {
            **super().config(),
            "ratio": self.ratio,
            "error_feedback": self.error_feedback,
            "dense_below": self.dense_below,
            "dense_when_cheaper": self.dense_when_cheaper,
            **({"momentum": self.momentum} if self.momentum else {}),
            **({"indices": self.indices} if self.shared else {}),
            **({"traffic": self.traffic} if self.traffic is not None else {}),
            **({"exact_every": self.exact_every} if self.exact_every > 1 else {}),
        }

    @property
    def shared(self) -> bool:
        """Whether every rank sends at one shared index set (``indices`` ``leader`` or ``aggregate``)."""
        return self.indices != "gather"

    def k(self, numel: int) -> int:
        """Entries sent for a tensor of ``numel`` elements."""
        return reference.num_selected(numel, self.ratio)

    def dense_is_cheaper(self, numel: int) -> bool:
        """Whether a dense ring allreduce (``2 (N-1)/N 4 numel`` bytes per rank) moves no more than the
        sparse payload: ``N k >= numel`` for the allgather of every rank's ``k`` (value, index) pairs
        (``(N-1) 8k``); with a shared index set, whose ``k`` values are allreduced too, ``2k >= numel``
        for the leader's (its ``k`` indices are allreduced as well), ``k >= numel`` for ``aggregate``."""
        if not self.dense_when_cheaper or self.size <= 1:
            return False
        sparse_words = {"gather": self.size, "leader": 2, "aggregate": 1}[self.indices] * self.k(numel)
        return sparse_words >= numel

    def fused_kind(self, numel: int) -> str:
        if numel == 0 or numel < self.dense_below or self.dense_is_cheaper(numel):
            return "dense"
        return "sparse"

    def slots(self, numel: int) -> int:
        """(value, index) slots a tensor of ``numel`` elements sends on the fused path: ``k``."""
        return self.k(numel)

    def bucket_codec(self, layout: Any) -> Any:
        """:class:`~hvd_compress.algorithms.sparse_bucket.SparseBucketCodec` (an allgather), or with a
        shared index set :class:`~hvd_compress.algorithms.shared_bucket.SharedIndexCodec` (an allreduce)."""
        if self.shared:
            from hvd_compress.algorithms.shared_bucket import SharedIndexCodec

            return SharedIndexCodec(self, layout, self.indices)
        from hvd_compress.algorithms.sparse_bucket import SparseBucketCodec

        return SparseBucketCodec(self, layout)

    def bucket_scores(self, a: Any, posterior: Any, ops: Any) -> Any:
        """``|a|``: Top-k's scores (a fused bucket's work buffer; non-negative, sign bit clear)."""
        return ops.magnitude(a)

    def bucket_observe(self, total: Any, sent: Any, bad: Any, slot_rows: Any, ops: Any) -> Any:
        """Hook: the sum over ranks of a fused bucket's compressed part, what this rank sent
        (``(positions, values)``), the per-tensor flags and each slot's tensor; returns the
        bucket's new posterior (RegTop-k) or ``None``."""
        return None

    def bucket_select(self, a: Any, scores: Any, rows: Any, ops: Any) -> Any:
        """A fused bucket's selection, ``(positions, probe)``: per row (tensor) of the work buffer ``a``
        what :meth:`_select` chooses on that row alone, ``k`` slots a row, as work positions (row
        start + index), the rows visited in the order the tensors were added (``Rows.each``: random
        draws come in that order on every route); and per row a value
        that is NaN or Inf exactly where the row holds NaN/Inf (its largest ``|a|``), so ``0 * probe``
        is its flag. Top-k, Gaussian-k and RegTop-k override it with one selection of every row at
        once (:class:`LargestScores`; :mod:`~hvd_compress.kernels.torch_rows`,
        :mod:`~hvd_compress.kernels.reference_rows`, :mod:`~hvd_compress.kernels.tf_rows`)."""
        chosen = {}
        for (name, shape), row, k, first in rows.each(a):
            indices = self._select(row, name, shape, ops)
            if indices.shape[0] != k:
                raise ValueError(
                    f"hvd_compress: {type(self).__name__}._select chose {indices.shape[0]} entries of '{name}', "
                    f"not k = {k}: a fused bucket sends k per tensor (a selection of another size overrides "
                    "slots and bucket_select)"
                )
            chosen[first] = ops.cast(indices, ops.int64) + first
        return ops.concat([chosen[first] for first in sorted(chosen)]), rows.largest(abs(a))

    def warn_dense(self, name: str, numel: int) -> None:
        """Warn once per tensor that ``name``, which held a residual, now travels dense where that is cheaper."""
        if name not in self._warned_dense and self.dense_is_cheaper(numel):
            self._warned_dense.add(name)
            warnings.warn(
                f"hvd_compress: {type(self).__name__} sends '{name}' dense: {self._dense_reason(numel)} a dense "
                "allreduce; its residual is sent with it",
                stacklevel=4,
            )

    def _dense_reason(self, numel: int) -> str:
        if self.shared:
            return (f"k = {self.k(numel)} of {numel} elements, where allreducing the shared index set's values"
                    f"{' and indices' if self.indices == 'leader' else ''} would move no fewer bytes than")
        return (f"{self.size} ranks x k = {self.k(numel)} >= {numel} elements, where allgathering sparse "
                "payloads would move more bytes than")

    def velocity(self, name: str, run: Optional[CompressorState] = None) -> Optional[Any]:
        """Momentum-correction velocity ``u`` of ``name`` in the tensor's shape (``None`` if it has none);
        ``run``: a route's state (default: the compressor's own)."""
        return (self.own_state if run is None else run).array(name, "velocity")

    def _select(self, a: Any, name: str, shape: tuple, ops: Any) -> Any:
        """Indices ``S`` to send of one tensor's error-compensated gradient ``a`` (``k(numel)`` of them, in the
        kernel module ``ops``'s index dtype)."""
        raise NotImplementedError


class LargestScores:
    """Mixin of a :class:`Sparsifier` whose ``S`` is the ``k`` largest scores (``bucket_scores``):
    a fused bucket selects every row at once, and with ``exact_every > 1`` by reused thresholds between."""

    reuses_thresholds = True

    def bucket_select(self, a: Any, scores: Any, rows: Any, ops: Any) -> Any:
        """Every row's ``k`` largest ``scores``, ties to the lower index (``Rows.topk``:
        :mod:`~hvd_compress.kernels.torch_rows`, :mod:`~hvd_compress.kernels.reference_rows`,
        :mod:`~hvd_compress.kernels.tf_rows`); the probe is each row's largest score, NaN or Inf
        exactly where the row holds NaN/Inf."""
        return rows.topk(scores)
