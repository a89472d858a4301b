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
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hvd_compress.algorithms.base import Compressor, dense_sum
from hvd_compress.wire import DensePayload, TernaryPayload
from hvd_compress.wire import two_bit_bytes
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
    ) -> None:
        super().__init__(seed=seed)
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

    def encode_options(self, compressors: List["TernGrad"], grads: Dict[str, List[Any]]) -> Dict[str, Dict[str, Any]]:
        """Scalar sharing tensor by tensor: the allreduce-Max of every rank's vector of layer scales."""
        if not self.scalar_sharing:
            return {}
        local = [
            {name: c.local_scale(per_rank[rank], name) for name, per_rank in grads.items()}
            for rank, c in enumerate(compressors)
        ]
        names = [name for name, s in local[0].items() if s is not None]
        vectors = np.array([[scales[name] for name in names] for scales in local])
        return {name: {"scale": s} for name, s in zip(names, vectors.max(axis=0).tolist())}

    def bucket_codec(self, bucket: Any) -> Any:
        """:class:`~hvd_compress.algorithms.terngrad_bucket.TernaryBucketCodec`."""
        from hvd_compress.algorithms.terngrad_bucket import TernaryBucketCodec

        return TernaryBucketCodec(self, bucket)

    # ------------------------------------------------------------------ steps
    def _clipped(self, a: Any, ops: Any) -> Any:
        return a if self.clip is None else ops.terngrad_clip(a, self.clip)

    def _measured(self, flat: Any, name: str, shape: tuple, ops: Any) -> Tuple[Any, Any, Any, Any]:
        """``(flat g, a = g + r, clip(a), max|clip(a)|)`` of a gradient."""
        a = self._compensated(flat, name, shape, ops)
        clipped = self._clipped(a, ops)
        return flat, a, clipped, ops.terngrad_scale(clipped)

    def local_scale(self, tensor: Any, name: str) -> Optional[float]:
        """This rank's scale ``max|g|`` (after clipping); ``None`` for tensors sent dense.

        The ranks' scales are combined with an allreduce-Max and the result is
        passed to :meth:`encode` as ``scale``.
        """
        flat, shape, ops = self._validated(tensor, name)
        return None if flat.shape[0] < self.dense_below else self._measured(flat, name, shape, ops)[3]

    def encode(self, tensor: Any, name: str, scale: Optional[float] = None) -> Any:
        """Ternary payload of ``tensor``; ``scale`` is the shared ``S`` (``None``: local scale)."""
        return super().encode(tensor, name, scale=scale)

    def _encode(self, flat: Any, name: str, shape: tuple, ops: Any, scale: Optional[float] = None):
        if flat.shape[0] < self.dense_below:
            return DensePayload(values=flat, dtype=flat.dtype)
        return self._payload(*self._measured(flat, name, shape, ops), name, ops, scale)

    def _payload(self, flat: Any, a: Any, clipped: Any, local: Any, name: str, ops: Any,
                 scale: Optional[float]) -> TernaryPayload:
        shared = scale is not None
        if not shared:
            scale = local
        elif not scale >= local:
            raise ValueError(
                f"hvd_compress: shared TernGrad scale {scale!r} for '{name}' is below this "
                f"rank's max|g| = {local!r}; ranks disagree on the scale"
            )
        uniform = ops.uniform(self.generator(ops, flat), flat)
        codes = ops.terngrad_codes(clipped, scale, uniform)
        if self.error_feedback:
            self.memory.set(name, "residual", a - scale * ops.cast(codes, a.dtype))
        return TernaryPayload(
            codes=codes,
            scale=float(scale),
            world_size=self.size,
            shared_scale=shared,
            dtype=flat.dtype,
        )

    def _sum(self, payloads: List[Any], numel: int, ops: Any):
        if all(isinstance(p, DensePayload) for p in payloads):
            return dense_sum(payloads, numel, ops)
        if not all(isinstance(p, TernaryPayload) and p.codes.shape[0] == numel for p in payloads):
            raise ValueError(
                f"hvd_compress: TernGrad payloads disagree with a tensor of {numel} elements; "
                "ranks are configured differently"
            )
        dtype = payloads[0].dtype
        acc = ops.accumulation_dtype(dtype)
        if all(p.shared_scale for p in payloads):
            if any(p.world_size != len(payloads) for p in payloads):
                raise ValueError(
                    f"hvd_compress: TernGrad payloads were packed for "
                    f"{sorted({p.world_size for p in payloads})} ranks but {len(payloads)} "
                    "arrived; bind(rank, size) every compressor to the real world size"
                )
            scales = {p.scale for p in payloads}
            if len(scales) != 1:
                raise ValueError(
                    f"hvd_compress: ranks sent different shared TernGrad scales {sorted(scales)}"
                )
            fmt = payloads[0].wire_format
            wires = [self.wire_tensor(p, ops) for p in payloads]
            received = ops.sum_int32_wrapping(wires) if fmt == "allreduce" else ops.concat(wires)
            code_sum = self.code_sum(received, numel, len(payloads), fmt, ops)
            return ops.cast(code_sum, acc) * payloads[0].scale, dtype
        gathered = self.codes_of_ranks(
            ops.concat([ops.pack_two_bit(p.codes) for p in payloads]), numel, len(payloads), ops
        )
        scaled = [ops.cast(codes, acc) * p.scale for codes, p in zip(gathered, payloads)]
        return ops.dense_sum(scaled), dtype

    # ------------------------------------------------------------- wire format
    @staticmethod
    def wire_tensor(payload: TernaryPayload, ops: Any) -> Any:
        """What travels for ``payload``: packed int32 lanes (allreduce) or 2-bit codes (int8, allgather)."""
        if payload.wire_format == "allreduce":
            return ops.pack_ternary(payload.codes, payload.world_size)
        return ops.pack_two_bit(payload.codes)

    @staticmethod
    def codes_of_ranks(gathered: Any, numel: int, world_size: int, ops: Any) -> List[Any]:
        """Every rank's codes from the allgather of their 2-bit packed codes (rank order)."""
        chunk = two_bit_bytes(numel)
        return [ops.unpack_two_bit(gathered[r * chunk : (r + 1) * chunk], numel) for r in range(world_size)]

    @classmethod
    def code_sum(cls, received: Any, numel: int, world_size: int, wire_format: str, ops: Any) -> Any:
        """``sum over ranks of t`` from what the collective returned: summed lanes or gathered codes."""
        if wire_format == "allreduce":
            return ops.unpack_ternary_sum(received, numel, world_size)
        return ops.sum_codes(cls.codes_of_ranks(received, numel, world_size, ops))
