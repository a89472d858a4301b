"""TernGrad: stochastic ternary gradients with a scale shared by all ranks.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed
Deep Learning" (NeurIPS 2017). Per layer::

    g <- clip(g, -c * std(g), c * std(g))        (optional, c = 2.5)
    s = max|g|;   S = max over ranks of s        (scalar sharing: allreduce-Max)
    t_j = sign(g_j) * Bernoulli(|g_j| / S)       t in {-1, 0, 1},  E[S t] = g
    aggregate = S * sum over ranks of t   (/ N for the average)

On the wire the codes of all ranks are summed by an integer allreduce of int32
lanes packing ``floor(32 / b)`` codes of ``b = ceil(log2(2N + 1))`` bits, or
allgathered as 2-bit codes when that moves fewer bytes
(:func:`hvd_compress.wire.ternary_wire_format`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, Optional

from hvd_compress.algorithms.base import Compressor
from hvd_compress.algorithms.sparse import DENSE_BELOW
from hvd_compress.algorithms.validation import check_bool, check_clip, check_count, checked


class TernGrad(Compressor):
    """TernGrad with clipping factor ``clip`` (``None``: no clipping) and scalar sharing.

    Every parameter is checked when the compressor is made and when it is
    assigned later (``TypeError`` for a wrong type, ``ValueError`` out of range).
    """

    payload_kind = "ternary"
    fused = True

    seed = checked("seed", check_count, "Seed of the random streams, an int >= 0.")
    clip = checked(
        "clip", partial(check_clip, allow_none=True), "Clipping factor c, a number >= 1 or None."
    )
    scalar_sharing = checked("scalar_sharing", check_bool, "Share one scale per layer over ranks (a bool).")
    error_feedback = checked("error_feedback", check_bool, "Keep what was not sent in a residual (a bool).")
    dense_below = checked("dense_below", check_count, "Tensors below this many elements go dense (an int >= 0).")

    def __init__(
        self,
        clip: Optional[float] = 2.5,
        scalar_sharing: bool = True,
        error_feedback: bool = False,
        dense_below: int = DENSE_BELOW,
        seed: int = 0,
        compile: Optional[bool] = None,
    ) -> None:
        super().__init__(seed=seed, compile=compile)
        self.clip = clip
        self.scalar_sharing = scalar_sharing
        self.error_feedback = error_feedback
        self.dense_below = dense_below

    def config(self) -> Dict[str, Any]:
        return {
            **super().config(),
            "clip": self.clip,
            "scalar_sharing": self.scalar_sharing,
            "error_feedback": self.error_feedback,
            "dense_below": self.dense_below,
        }

    def fused_kind(self, numel: int) -> str:
        return "dense" if numel == 0 or numel < self.dense_below else "ternary"

    def bucket_codec(self, layout: Any) -> Any:
        """:class:`~hvd_compress.algorithms.terngrad_bucket.TernaryBucketCodec`."""
        from hvd_compress.algorithms.terngrad_bucket import TernaryBucketCodec

        return TernaryBucketCodec(self, layout)
