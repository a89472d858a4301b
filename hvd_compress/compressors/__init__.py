"""Compressors: the numpy specification (``reference``) and the algorithm classes.

``Compression`` mirrors Horovod's ``hvd.Compression``: ``Compression.none`` and
``Compression.fp16`` are ready to use; the sparse and ternary ones are factories,
e.g. ``Compression.topk(0.01)``.
"""

from hvd_compress.compressors.base import Compressor
from hvd_compress.compressors.gaussiank import GaussianK
from hvd_compress.compressors.none import FP16, NoneCompressor
from hvd_compress.compressors.regtopk import RegTopK
from hvd_compress.compressors.terngrad import TernGrad
from hvd_compress.compressors.topk import TopK


class Compression:
    """Namespace of compressors, like ``horovod.torch.Compression``."""

    none = NoneCompressor()
    fp16 = FP16()
    topk = TopK
    gaussiank = GaussianK
    regtopk = RegTopK
    terngrad = TernGrad

    #: Command-line and config names.
    names = ("none", "fp16", "topk", "gaussiank", "regtopk", "terngrad")

    @staticmethod
    def by_name(name: str, ratio: float = 0.01, **options) -> Compressor:
        """A new compressor from its name; ``ratio`` applies to the sparsifiers."""
        key = name.lower().replace("-", "").replace("_", "")
        if key in ("topk", "gaussiank", "regtopk"):
            return getattr(Compression, key)(ratio, **options)
        if key == "terngrad":
            return TernGrad(**options)
        if key == "none":
            return NoneCompressor(**options)
        if key == "fp16":
            return FP16(**options)
        raise ValueError(
            f"hvd_compress: unknown compression {name!r}; choose one of {', '.join(Compression.names)}"
        )


__all__ = [
    "Compressor",
    "TopK",
    "GaussianK",
    "RegTopK",
    "TernGrad",
    "NoneCompressor",
    "FP16",
    "Compression",
]
