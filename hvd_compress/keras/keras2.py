"""Keras 2 (``tf_keras``): Horovod's ``DistributedOptimizer`` with our fused, compressed exchange."""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress import Compression
from hvd_compress.tensorflow import exchange_for
from hvd_compress.tensorflow.checkpoint import CompressionCheckpoint


def distributed_optimizer(
    optimizer: Any,
    compression: Any = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    communicator: Optional[Any] = None,
    **horovod_kwargs: Any,
) -> Any:
    """``horovod.tensorflow.keras.DistributedOptimizer`` whose gradients travel compressed and fused.

    The compressor is ``optimizer.compression``; its state is a checkpoint
    dependency of the optimizer (``tf.train.Checkpoint(optimizer=opt)`` saves
    and restores residuals).
    """
    import horovod.tensorflow.keras as hvd_keras

    compression = Compression.none if compression is None else compression
    distributed = hvd_keras.DistributedOptimizer(optimizer, **horovod_kwargs)
    distributed._allreduce_grads = exchange_for(compression, op, gradient_predivide_factor, communicator)
    distributed.compression = compression
    distributed._track_trackable(CompressionCheckpoint(compression), name="hvd_compress", overwrite=True)
    return distributed
