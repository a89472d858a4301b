"""Drop-in replacement for ``horovod.torch`` with compressed, fused gradient exchange.

    import hvd_compress.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.regtopk(0.01))

Everything not defined here (``init``, ``rank``, ``size``, ``broadcast_parameters``,
``allreduce`` ...) is ``horovod.torch``'s own, looked up on first use, so the
module imports without Horovod (for :func:`ddp_hook`, which needs only
``torch.distributed``); ``elastic`` is ``horovod.torch.elastic``'s names plus
:func:`hvd_compress.torch.elastic.register` (the compression state in an elastic job).
"""

from __future__ import annotations

from typing import Any

from hvd_compress import Compression  # noqa: F401  (hvd.Compression.topk(0.01), like Horovod's)
from hvd_compress import DensityWarmup  # noqa: F401  (a schedule of the density, like torch's lr_scheduler)
from hvd_compress.torch.ddp import CompressionState, ddp_hook  # noqa: F401  (no Horovod needed)
from hvd_compress.torch.optimizer import DistributedOptimizer  # noqa: F401
from hvd_compress.torch import elastic  # noqa: F401  (horovod.torch.elastic's names, and register())


def __getattr__(name: str) -> Any:
    try:
        import horovod.torch as horovod_torch
    except ImportError as error:
        raise ImportError(
            f"hvd_compress.torch.{name} comes from horovod.torch, which is not installed "
            f"({error}); install Horovod (make setup does) or use hvd_compress.torch.ddp_hook"
        ) from error
    return getattr(horovod_torch, name)
