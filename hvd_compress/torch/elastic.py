"""Horovod Elastic (``hvd.elastic.run``, ``hvd.elastic.TorchState``) with compression state.

    import hvd_compress.torch as hvd
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    hvd.elastic.register(state, optimizer)      # stock horovod.torch: register(state, compression)

Everything else here (``run``, ``TorchState``, ``ElasticSampler``) is ``horovod.torch.elastic``'s own,
looked up on first use. :func:`register` keeps the contract of :mod:`hvd_compress.horovod.elastic`.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.algorithms.base import is_compression
from hvd_compress.horovod.elastic import CompressionStateHandler, attach, held_residual, refuse_ordinary_values  # noqa: F401


def __getattr__(name: str) -> Any:
    import horovod.torch.elastic as horovod_elastic

    return getattr(horovod_elastic, name)


def _route_of(holder: Any) -> tuple:
    """``(compression, run state, what drops the step in progress or None)`` of ``register``'s ``holder``."""
    run = getattr(holder, "compression_state", None)
    if run is not None and hasattr(holder, "_forget_step"):  # hvd_compress.torch / .mpi DistributedOptimizer
        return holder._compression, run, holder._forget_step
    if is_compression(holder):  # horovod.torch's optimizer runs the compressor on its own state
        return holder, holder.state, None
    inner = getattr(holder, "_compression", None)  # horovod.torch.DistributedOptimizer(compression=ours)
    if is_compression(inner):
        return inner, inner.state, None
    raise TypeError(f"hvd_compress: register() takes the DistributedOptimizer or the compression it runs, got "
                    f"{type(holder).__name__}")


def register(state: Any, holder: Any) -> CompressionStateHandler:
    """Keep the compression state of ``holder`` (a drop-in ``DistributedOptimizer``, or the compression
    given to ``horovod.torch.DistributedOptimizer``, or that optimizer) in the elastic ``state``
    (``hvd.elastic.TorchState``) by the contract of :mod:`hvd_compress.horovod.elastic`; call it on
    every process, after making ``state``. Returns the handler."""
    refuse_ordinary_values(state)
    return attach(state, CompressionStateHandler(*_route_of(holder)))
