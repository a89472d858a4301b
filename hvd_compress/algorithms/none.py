"""Dense baselines: no compression, and float16 casting (Horovod's ``Compression.fp16``)."""

from __future__ import annotations

from hvd_compress.algorithms.base import Compressor


class NoneCompressor(Compressor):
    """Sends the gradient as it is (the dense allreduce baseline)."""

    fused = True


class FP16(Compressor):
    """Casts to float16 for the wire and back after the sum (2 bytes per entry).

    Values that float16 cannot hold (they round to Inf, beyond about 65520) reach the sum as
    Inf on every rank, as in a float16 allreduce, so that loss scaling sees them.
    """

    fused = True
    dense_wire_dtype = "float16"
