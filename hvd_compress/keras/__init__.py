"""Drop-in replacement for ``horovod.tensorflow.keras`` with compressed, fused gradient exchange.

    import os; os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")   # before TensorFlow is imported
    import hvd_compress.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                   compression=hvd.Compression.regtopk(0.01))
    model.compile(optimizer=opt, loss=...)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvd.callbacks.CompressionStatsCallback(opt)])

Horovod's Keras integration works with Keras 2 only (the ``tf_keras`` package;
``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` that one). Under Keras 3 it
imports but never averages gradients, so this module refuses to load there.
Everything not defined here is ``horovod.tensorflow.keras``'s own.
"""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress import Compression  # noqa: F401
from hvd_compress.compressors import as_compressor


def check_keras() -> None:
    """``ImportError`` unless ``tf.keras`` is Keras 2 (tf_keras), the one Horovod supports."""
    import tensorflow as tf

    if tf.keras.__name__.startswith("tf_keras"):
        return
    version = str(getattr(tf.keras, "__version__", "unknown"))
    if not version.startswith("2."):
        raise ImportError(
            f"hvd_compress.keras needs Keras 2 but tf.keras is Keras {version}: Horovod's Keras "
            "integration silently skips the gradient allreduce under Keras 3. Install tf_keras "
            "(pip install tf_keras) and set TF_USE_LEGACY_KERAS=1 before importing TensorFlow, "
            "or use hvd_compress.tensorflow.DistributedGradientTape in a custom training loop"
        )


check_keras()

from hvd_compress.keras import callbacks  # noqa: E402,F401
from hvd_compress.tensorflow import exchange_for  # noqa: E402
from hvd_compress.tensorflow.checkpoint import CompressionCheckpoint  # noqa: E402


def DistributedOptimizer(
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

    compression = as_compressor(compression)
    distributed = hvd_keras.DistributedOptimizer(optimizer, **horovod_kwargs)
    distributed._allreduce_grads = exchange_for(compression, op, gradient_predivide_factor, communicator)
    distributed.compression = compression
    distributed._track_trackable(CompressionCheckpoint(compression), name="hvd_compress", overwrite=True)
    return distributed


def __getattr__(name: str) -> Any:
    import horovod.tensorflow.keras as horovod_keras

    return getattr(horovod_keras, name)
