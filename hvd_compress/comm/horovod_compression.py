"""What Horovod's ``DistributedOptimizer`` takes as ``compression=``: a compressor's Horovod interface.

Horovod calls ``compression.compress(tensor)`` before its allreduce and
``compression.decompress(tensor, ctx)`` after it (``horovod.torch.Compression.fp16``
is such an object). :class:`HorovodCompression` wraps one of our compressors so::

    hvd.DistributedOptimizer(opt, named_parameters=..., compression=HorovodCompression(TopK(0.01)))

and both calls run the compressor's own collectives through :mod:`hvd_compress.comm.horovod`
(``horovod.tensorflow`` the same way, through :mod:`hvd_compress.comm.horovod_tf`).

A compressor passed directly (``compression=TopK(0.01)``) works too:
``Compressor.compress``/``decompress`` look this module up by name
(:data:`hvd_compress.compressors.base.HOROVOD_INTERFACE`) once ``hvd_compress`` is imported,
and run the same wrapper; nothing is registered on the compressor class.
"""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress.compressors import as_compressor
from hvd_compress.comm import horovod


class HorovodCompression:
    """``compress``/``decompress`` of ``compressor`` for Horovod (see the module docstring)."""

    def __init__(self, compressor: Any) -> None:
        self.compressor = as_compressor(compressor, "HorovodCompression")

    def compress(self, tensor: Any, name: Optional[str] = None):
        """Horovod ``Compressor.compress``: starts the compressor's collectives; returns a placeholder
        and a context. ``name`` identifies the tensor (the same on every rank); by default the
        parameter name the calling Horovod optimizer uses."""
        return horovod.compress(self.compressor, tensor, name)

    def decompress(self, tensor: Any, ctx: Any):
        """Horovod ``Compressor.decompress``: the dense averaged (or summed) gradient."""
        return horovod.decompress(self.compressor, tensor, ctx)

    def __repr__(self) -> str:
        return f"HorovodCompression({self.compressor!r})"
