"""RegTop-k: Top-k regularized by the posterior of the last aggregation.

Bereyhi et al., "Regularized Top-k: A Bayesian framework for gradient
sparsification" (2025); companion code AlBerey/RegTopK ``DistLearnLinearReg.py``.
Error accumulation in Top-k scales the learning rate of entries that sat long
in the residual; RegTop-k damps entries whose last contribution the other
ranks cancelled. Per tensor and step::

    a = g + r
    score_j = |tanh((1 + D_j) / mu)| * |a_j|,   S = the k largest scores
    send a[S];  r = a with a[S] set to 0
    after aggregation (T = sum over ranks of the sent vectors):
    D_j = (T_j - s_j) / s_j where this rank sent s_j != 0, else 1e8

``D`` starts at 1e8, so step 1 is exactly Top-k.
"""

from __future__ import annotations

import math

from typing import Any, Dict, Optional

from hvd_compress import kernels
from hvd_compress.algorithms.sparse import DENSE_BELOW, LargestScores, Sparsifier
from hvd_compress.algorithms.state import CompressorState
from hvd_compress.algorithms.validation import check_temperature, checked


class RegTopK(LargestScores, Sparsifier):
    """RegTop-k with temperature ``mu`` (default 5; the reference's linear regression uses 4)."""

    mu = checked("mu", check_temperature, "Temperature of the scores, a number in float32's normal range.")
    observes_sums = True

    def __init__(
        self,
        ratio: Optional[float] = None,
        mu: float = 5.0,
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
        super().__init__(
            ratio,
            traffic=traffic,
            compile=compile,
            error_feedback=error_feedback,
            dense_below=dense_below,
            dense_when_cheaper=dense_when_cheaper,
            seed=seed,
            momentum=momentum,
            indices=indices,
            exact_every=exact_every,
        )
        self.mu = mu

    def config(self) -> Dict[str, Any]:
        return {**super().config(), "mu": self.mu}

    def distortion(self, name: str, run: Optional[CompressorState] = None):
        """Posterior distortion ``D`` of ``name`` used by its next selection (``None`` before any); ``run``:
        a route's state (default: the compressor's own)."""
        run = self.own_state if run is None else run
        run.flush_buckets()
        idx = run.memory.peek(name, "posterior_indices")
        if idx is None:
            return None
        values = run.memory.peek(name, "posterior_values")
        numel = math.prod(run.memory.shape(name))
        return kernels.ops_for(values).regtopk_expand(idx, values, numel)

    def bucket_scores(self, a: Any, posterior: Any, ops: Any) -> Any:
        """``|a|``, damped by ``|tanh((1 + D) / mu)|`` where the last aggregate informed ``D``."""
        if posterior is None:  # D = 1e8 everywhere: plain Top-k
            return abs(a)
        idx, distortion = posterior
        return ops.regtopk_sparse_scores(a, idx, distortion, self.mu)

    def bucket_observe(self, total: Any, sent: Any, bad: Any, slot_rows: Any, ops: Any) -> Any:
        """The posterior ``(indices, D)``: ``D = (T - s) / s`` at the sent slots (``s != 0``), else 1e8;
        tensors flagged non-finite: 1e8."""
        idx, values = sent
        own = ops.cast(values, total.dtype)
        informative = (own != 0) & ~ops.take(bad, slot_rows)
        distortion = (ops.take(total, idx) - own) / own
        return idx, ops.where(informative, distortion, ops.NO_DISTORTION)
