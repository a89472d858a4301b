"""hvd_compress: gradient compression for Horovod, MPI and NCCL.

Compressors (each usable as ``compression=`` in Horovod's ``DistributedOptimizer``)::

    from hvd_compress import TopK, GaussianK, RegTopK, TernGrad, NoneCompressor, FP16, Compression

They are the algorithms of :mod:`hvd_compress.algorithms` with Horovod's ``compress``/``decompress``
(:class:`HorovodInterface`, :mod:`hvd_compress.horovod.interface`);
``HorovodCompression(compressor)`` gives any other compressor that interface.

``DensityWarmup(compressor, warmup_steps, start)`` is Deep Gradient Compression's
density warm-up as a schedule (``.step()``, ``state_dict()``), for every route
(:mod:`hvd_compress.algorithms.schedule`).

``Auto(compressor)`` measures, per bucket, the compressed exchange against a dense
allreduce on the real link and sends each bucket the cheaper way
(:mod:`hvd_compress.engine.auto`).

``regroup_states(old_states, rank, world)`` regroups every rank's checkpoint for a world of another
size, keeping the sum over ranks of the residuals (:mod:`hvd_compress.algorithms.regroup`).

Every compressor is its options plus a bucket codec, which the one bucket engine
(:mod:`hvd_compress.engine`) runs on every route. The numpy kernels of
:mod:`hvd_compress.kernels.reference` are what every framework's kernels are
tested against; :class:`hvd_compress.simulator.Simulator` runs N ranks in one
process on the routes' bucket engine.
"""

from hvd_compress.algorithms import Compression, DensityWarmup
from hvd_compress.algorithms.regroup import regroup_states
from hvd_compress.horovod.interface import (
    FP16,
    Auto,
    GaussianK,
    HorovodCompression,
    HorovodInterface,
    NoneCompressor,
    RegTopK,
    TernGrad,
    TopK,
)
from hvd_compress.engine.nonfinite import NonFiniteGradientError

__version__ = "0.1.0"

__all__ = [
    "Auto",
    "TopK",
    "GaussianK",
    "RegTopK",
    "TernGrad",
    "NoneCompressor",
    "FP16",
    "Compression",
    "HorovodCompression",
    "HorovodInterface",
    "DensityWarmup",
    "NonFiniteGradientError",
    "regroup_states",
    "__version__",
]
