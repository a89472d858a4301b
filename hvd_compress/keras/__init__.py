"""Drop-in replacement for ``horovod.tensorflow.keras`` with compressed, fused gradient exchange,
under Keras 3 (TensorFlow backend) and Keras 2 (``tf_keras``)::

    import hvd_compress.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                   compression=hvd.Compression.regtopk(0.01))
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                              hvd.callbacks.CompressionStatsCallback(opt)])

The Keras is TensorFlow's ``tf.keras``: Keras 3 unless ``TF_USE_LEGACY_KERAS=1``
was set before TensorFlow was imported, which makes it Keras 2 (the
``tf_keras`` package). The optimizer given must be of that Keras.

- Keras 3: :class:`hvd_compress.keras.keras3.DistributedOptimizer` wraps the
  optimizer (Horovod's own Keras integration imports there but never averages
  gradients); names not defined here are ``horovod.tensorflow``'s (``init``,
  ``rank``, ``size``, ``allreduce`` ...).
- Keras 2: Horovod's ``DistributedOptimizer`` whose ``_allreduce_grads`` is
  our exchange; its compression state is a checkpoint dependency of the
  optimizer (``tf.train.Checkpoint(optimizer=opt)`` saves the residuals); names
  not defined here are ``horovod.tensorflow.keras``'s.

:func:`broadcast_variables` takes Keras 3 variables too (custom training loops).
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from hvd_compress import Compression  # noqa: F401
from hvd_compress.algorithms import as_compressor
from hvd_compress.algorithms.validation import check_single_momentum
from hvd_compress.keras.versions import KERAS, KERAS3, broadcast_variables, uses_keras3  # noqa: F401

if KERAS3:
    from hvd_compress.keras import keras3  # noqa: E402  (ImportError unless the backend is TensorFlow)

from hvd_compress.keras import callbacks  # noqa: E402,F401
from hvd_compress.keras import elastic  # noqa: E402,F401  (horovod.tensorflow.keras.elastic's names, and register())
from hvd_compress.tensorflow import exchange_for  # noqa: E402
from hvd_compress.tensorflow.checkpoint import CompressionCheckpoint  # noqa: E402


def _is_keras3_optimizer(optimizer: Any) -> bool:
    keras = sys.modules.get("keras")  # imported already wherever a Keras 3 optimizer exists
    version = str(getattr(keras, "__version__", ""))
    return version.startswith("3") and isinstance(optimizer, keras.optimizers.Optimizer)


#: Hyperparameters of Keras optimizers that are a momentum of their own: SGD's and RMSprop's
#: ``momentum``; the first-moment decay ``beta_1`` of Adam, AdamW, Adamax, Nadam, Lamb and Lion
#: (``beta_2``, Adam's second-moment decay, scales the step rather than averaging it).
MOMENTUM_HYPERPARAMETERS = ("momentum", "beta_1")


def _momenta(optimizer: Any) -> list:
    """``[("Adam config", 0.9, "beta_1"), ...]``: each momentum hyperparameter
    (:data:`MOMENTUM_HYPERPARAMETERS`) of the optimizer's config, and of the optimizer a
    ``LossScaleOptimizer`` wraps; ``[]`` where the config cannot be read."""
    momenta, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        try:
            config = optimizer.get_config()
        except Exception:  # noqa: BLE001  (a custom optimizer's config is its own business)
            return momenta
        part = f"{type(optimizer).__name__} config"
        for key in MOMENTUM_HYPERPARAMETERS:
            if key in config:
                momenta.append((part, config[key], key))
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return momenta


def DistributedOptimizer(
    optimizer: Any,
    compression: Any = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    communicator: Optional[Any] = None,
    **horovod_kwargs: Any,
) -> Any:
    """``optimizer`` whose gradients are averaged over ranks, compressed and fused.

    ``compression``: one of our compressors (default none), then available as
    ``opt.compression``; ``op``: ``hvd.Average`` (default) or ``hvd.Sum``;
    ``communicator``: default Horovod's. Keras 2 passes other keyword
    arguments to Horovod's ``DistributedOptimizer``; Keras 3 accepts ``name``.

    A sparsifier with momentum correction (``TopK(0.01, momentum=0.9)``) owns the
    momentum: wrap a plain ``SGD(learning_rate)``; an optimizer with a momentum of its
    own (``momentum > 0``: SGD, RMSprop; ``beta_1 > 0``: Adam, AdamW, Adamax, Nadam,
    Lion...) raises ``ValueError``. Adam users keep Adam and give the compressor
    ``momentum=0`` (docs/keras.md).
    """
    if KERAS3 != _is_keras3_optimizer(optimizer):
        kind = "a Keras 3" if _is_keras3_optimizer(optimizer) else "not a Keras 3"
        raise TypeError(
            f"hvd_compress: DistributedOptimizer got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}, {kind} optimizer, but tf.keras is {KERAS}. Pass an "
            "optimizer of tf.keras, or choose the Keras before importing TensorFlow: "
            "TF_USE_LEGACY_KERAS=1 for Keras 2 (tf_keras), unset or 0 for Keras 3"
        )
    compression = as_compressor(compression)
    check_single_momentum(compression, _momenta(optimizer), "hvd_compress.keras.DistributedOptimizer")
    if not KERAS3:  # Horovod's optimizer; its compression state a checkpoint dependency
        import horovod.tensorflow.keras as horovod_keras

        distributed = horovod_keras.DistributedOptimizer(optimizer, **horovod_kwargs)
        distributed._allreduce_grads = exchange_for(compression, op, gradient_predivide_factor, communicator)
        distributed.compression = compression
        distributed._track_trackable(CompressionCheckpoint(compression), name="hvd_compress", overwrite=True)
        return distributed
    unsupported = sorted(set(horovod_kwargs) - {"name"})
    if unsupported:
        raise TypeError(
            f"hvd_compress: DistributedOptimizer under Keras 3 does not take {', '.join(unsupported)} "
            "(Horovod's Keras 2 options); set gradient_accumulation_steps, clipping... on the "
            "wrapped optimizer"
        )
    return keras3.DistributedOptimizer(
        optimizer, compression, op, gradient_predivide_factor, communicator, **horovod_kwargs
    )


def __getattr__(name: str) -> Any:
    if KERAS3:
        import horovod.tensorflow as horovod_module
    else:
        import horovod.tensorflow.keras as horovod_module

    return getattr(horovod_module, name)
