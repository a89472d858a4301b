"""Compressors: the algorithm classes, the name table and ``Compression``.

The classes here are the algorithms (options, the per-tensor definition, the bucket codec);
the public ones, ``hvd_compress.TopK`` and the others, add Horovod's ``compress``/``decompress``
(:mod:`hvd_compress.horovod.interface`, a higher layer, which registers them under the
names of the table). The numpy specification is :mod:`hvd_compress.kernels.reference`.

``Compression`` mirrors Horovod's ``hvd.Compression``. Every entry is a factory
that makes a new compressor with its own state: ``Compression.topk(0.01)``,
``Compression.fp16()``. ``Compression.none`` and ``Compression.fp16`` also work
uncalled, as Horovod users write them (:class:`DenseFactory`).
"""

import warnings
from typing import Any, List, Tuple, Type

from hvd_compress.algorithms import registry
from hvd_compress.algorithms.base import Compressor, ExchangePolicy, is_compression
from hvd_compress.algorithms.gaussiank import GaussianK
from hvd_compress.algorithms.none import FP16, NoneCompressor
from hvd_compress.algorithms.regtopk import RegTopK
from hvd_compress.algorithms.schedule import DensityWarmup
from hvd_compress.algorithms.terngrad import TernGrad
from hvd_compress.algorithms.topk import TopK


class DenseFactory:
    """``Compression.none`` / ``Compression.fp16``: call it for a new compressor.

    Passed uncalled, as Horovod's own ``hvd.Compression.none`` is, it still works:
    our routes call it (:func:`as_compressor`), and stock Horovod's calls of
    ``compress``/``decompress`` go to one private compressor of the factory, made
    on first use (a dense compressor keeps no per-tensor state, and no one can
    reach its wire statistics, so nothing observable is shared between optimizers;
    making one per call would cost each gradient of each step an allocation).
    """

    def __init__(self, name: str, cls: Type[Compressor]) -> None:
        self.name, self.cls = name, cls
        self._protocol: Any = None

    def __call__(self, **options: Any) -> Compressor:
        return self.cls(**options)

    def _for_horovod(self) -> Compressor:
        if self._protocol is None:
            self._protocol = self.cls()
        return self._protocol

    def compress(self, tensor: Any):  # the registered class: one with Horovod's interface
        return self._for_horovod().compress(tensor)

    def decompress(self, tensor: Any, ctx: Any):
        return self._for_horovod().decompress(tensor, ctx)

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


def as_compressor(value: Any, route: str = "compression") -> Any:
    """What a route runs (a compressor or an exchange policy: Auto): ``None`` is none, a factory or class is called.

    Each call of a factory makes a new compressor, so optimizers never share state.
    """
    if value is None:
        return NoneCompressor()
    if is_compression(value):
        return value
    if isinstance(value, DenseFactory) or (isinstance(value, type) and issubclass(value, (Compressor, ExchangePolicy))):
        try:
            return value()
        except TypeError as error:
            raise TypeError(
                f"hvd_compress: {route}={value!r} needs arguments; pass an instance such as "
                f"{getattr(value, '__name__', value)}(0.01) ({error})"
            ) from None
    raise TypeError(
        f"hvd_compress: {route} must be an hvd_compress compressor such as "
        f"hvd_compress.TopK(0.01) or Compression.fp16, got {value!r}"
    )


def old_keyword(compression: Any, compressor: Any, where: str) -> Any:
    """``compression=``, the one public name for the compressor; ``compressor=`` still works, with a warning."""
    if compressor is None:
        return compression
    if compression is not None:
        raise TypeError(f"hvd_compress: {where} got both compression= and compressor=; pass compression= only")
    warnings.warn(
        f"hvd_compress: {where}(compressor=...) is now {where}(compression=...)", DeprecationWarning, stacklevel=3
    )
    return compressor


class _Names(type):
    """``Compression.<name>`` and ``Compression.names`` read the name table (:mod:`.registry`)."""

    @property
    def names(cls) -> Tuple[str, ...]:
        """Command-line and config names, every registered compressor's."""
        return registry.names()

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return registry.factory(name)

    def __dir__(cls) -> List[str]:
        return sorted(set(super().__dir__()) | set(registry.names()))


class Compression(metaclass=_Names):
    """Namespace of compressors, like ``horovod.torch.Compression``: ``Compression.topk(0.01)``,
    ``Compression.fp16``, one attribute per name of the table (``Compression.register`` adds one)."""

    @staticmethod
    def by_name(name: str, ratio: float = 0.01, **options) -> Compressor:
        """A new compressor from its name; ``ratio`` applies to the classes that take one (sparsifiers)."""
        return registry.build(name, ratio, **options)

    register = staticmethod(registry.register)
    unregister = staticmethod(registry.unregister)


__all__ = [
    "Compressor",
    "TopK",
    "GaussianK",
    "RegTopK",
    "TernGrad",
    "NoneCompressor",
    "FP16",
    "Compression",
    "DenseFactory",
    "as_compressor",
    "old_keyword",
    "DensityWarmup",
]
