"""What Horovod's ``DistributedOptimizer`` takes as ``compression=``: the compressors with Horovod's interface.

Horovod calls ``compression.compress(tensor)`` before its allreduce and
``compression.decompress(tensor, ctx)`` after it (``horovod.torch.Compression.fp16``
is such an object). Both calls run the compressor's own collectives through
:mod:`hvd_compress.horovod.torch_hooks` (``horovod.tensorflow`` the same way, through
:mod:`hvd_compress.horovod.tensorflow_hooks`), a layer above the algorithms; so the public
compressors (``hvd_compress.TopK`` ...) are defined here, each the algorithm of
:mod:`hvd_compress.algorithms` plus :class:`HorovodInterface`::

    hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd_compress.TopK(0.01))

A compressor of your own (a :class:`~hvd_compress.algorithms.base.Compressor` subclass) gets
the interface by deriving from :class:`HorovodInterface` too (so does ``Auto``, the engine's
exchange policy around a compressor), or is wrapped:
``compression=HorovodCompression(MyCompressor(0.01))``. The names of
``Compression`` (``Compression.topk(0.01)``, ``Compression.fp16``) are registered here, with
the header numbers 1 to 6 they have always carried.
"""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress.algorithms import DenseFactory, as_compressor, gaussiank, none, registry, regtopk, terngrad, topk
from hvd_compress.engine import auto
from hvd_compress.horovod import torch_hooks as horovod


class HorovodInterface:
    """Horovod's ``Compressor`` interface for a compressor class (a mixin: ``class C(HorovodInterface, Algorithm)``)."""

    def compress(self, tensor: Any, name: Optional[str] = None):
        """Horovod ``Compressor.compress``: starts the compressor's collectives; returns a placeholder
        and a context. ``name`` identifies the tensor (the same on every rank); by default the
        parameter name the calling Horovod optimizer uses."""
        return horovod.compress(self, tensor, name)

    def decompress(self, tensor: Any, ctx: Any):
        """Horovod ``Compressor.decompress``: the dense averaged (or summed) gradient."""
        return horovod.decompress(self, tensor, ctx)


class HorovodCompression:
    """``compress``/``decompress`` of any compressor (a factory or class is called) for Horovod."""

    def __init__(self, compressor: Any) -> None:
        self.compressor = as_compressor(compressor, "HorovodCompression")

    def compress(self, tensor: Any, name: Optional[str] = None):
        """As :meth:`HorovodInterface.compress`, for the wrapped compressor."""
        return horovod.compress(self.compressor, tensor, name)

    def decompress(self, tensor: Any, ctx: Any):
        """As :meth:`HorovodInterface.decompress`, for the wrapped compressor."""
        return horovod.decompress(self.compressor, tensor, ctx)

    def __repr__(self) -> str:
        return f"HorovodCompression({self.compressor!r})"


class NoneCompressor(HorovodInterface, none.NoneCompressor):
    __doc__ = none.NoneCompressor.__doc__


class FP16(HorovodInterface, none.FP16):
    __doc__ = none.FP16.__doc__


class TopK(HorovodInterface, topk.TopK):
    __doc__ = topk.TopK.__doc__


class GaussianK(HorovodInterface, gaussiank.GaussianK):
    __doc__ = gaussiank.GaussianK.__doc__


class RegTopK(HorovodInterface, regtopk.RegTopK):
    __doc__ = regtopk.RegTopK.__doc__


class TernGrad(HorovodInterface, terngrad.TernGrad):
    __doc__ = terngrad.TernGrad.__doc__


class Auto(HorovodInterface, auto.Auto):
    __doc__ = auto.Auto.__doc__


registry.register("none", NoneCompressor, factory=DenseFactory("none", NoneCompressor), number=1)
registry.register("fp16", FP16, factory=DenseFactory("fp16", FP16), number=2)
registry.register("topk", TopK, number=3)
registry.register("gaussiank", GaussianK, number=4)
registry.register("regtopk", RegTopK, number=5)
registry.register("terngrad", TernGrad, number=6)
