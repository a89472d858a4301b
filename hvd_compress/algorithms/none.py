"""Dense baselines: no compression, and float16 casting (Horovod's ``Compression.fp16``)."""

from __future__ import annotations

from typing import Any

from hvd_compress.algorithms.base import Compressor
from hvd_compress.wire import DensePayload


class NoneCompressor(Compressor):
    """Sends the gradient as it is (the dense allreduce baseline)."""

    fused = True

    def _encode(self, flat: Any, name: str, shape: tuple, ops: Any) -> Any:
        return DensePayload(values=flat, dtype=flat.dtype)


class FP16(Compressor):
    """Casts to float16 for the wire and back after the sum (2 bytes per entry).

    Values that float16 cannot hold (they would round to Inf, beyond about 65520) are
    an error of ``encode`` rather than a silent Inf; the exchanges (and the Simulator) let them
    reach the sum as Inf on every rank, as a float16 allreduce does, so that loss scaling
    sees them.
    """

    fused = True
    dense_wire_dtype = "float16"

    def _encode(self, flat: Any, name: str, shape: tuple, ops: Any) -> Any:
        values = ops.cast(flat, ops.float16)
        if ops.count_nonfinite(values):
            raise ValueError(
                f"hvd_compress: gradient '{name}' exceeds the float16 range (|g| > 65504); "
                "FP16 compression would turn it into Inf"
            )
        return DensePayload(values=values, dtype=flat.dtype)
