"""Horovod Elastic under Keras 2 (``hvd.elastic.run``, ``hvd.elastic.KerasState`` of
``horovod.tensorflow.keras``) with compression state.

    import hvd_compress.keras as hvd
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    hvd.elastic.register(state, optimizer)      # stock horovod.tensorflow.keras: register(state, compression)

Everything else here (``run``, ``KerasState``, ``CommitStateCallback``, ``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``) is ``horovod.tensorflow.keras.elastic``'s own, looked up on first use
(Horovod 0.28.1's ``KerasState`` reads a Keras 2 optimizer's ``variables()``; under Keras 3 it fails).
:func:`register` keeps the contract of :mod:`hvd_compress.horovod.elastic`: ``KerasState`` keeps no
handlers, so the compression state's are called after its own ``save``/``restore``. The TensorFlow
routes run each exchange eagerly with the world size of the moment, so ``fit``'s compiled step serves
the new world unchanged.
"""

from __future__ import annotations

from typing import Any

from hvd_compress.algorithms.base import is_compression
from hvd_compress.horovod.elastic import CompressionStateHandler, attach, refuse_ordinary_values


def __getattr__(name: str) -> Any:
    import horovod.tensorflow.keras.elastic as horovod_elastic

    return getattr(horovod_elastic, name)


def register(state: Any, holder: Any) -> CompressionStateHandler:
    """Keep the compression state of ``holder`` (an ``hvd_compress.keras.DistributedOptimizer``, or the
    compression given to ``horovod.tensorflow.keras.DistributedOptimizer``) in the elastic ``state``
    (``hvd.elastic.KerasState``); call it on every process, after making ``state``. Returns the handler."""
    refuse_ordinary_values(state)
    compression = holder if is_compression(holder) else getattr(holder, "compression", None)
    if not is_compression(compression):
        raise TypeError(f"hvd_compress: register() takes hvd_compress.keras.DistributedOptimizer or the "
                        f"compression given to horovod.tensorflow.keras.DistributedOptimizer, got "
                        f"{type(holder).__name__}")
    return attach(state, CompressionStateHandler(compression, compression.state))
