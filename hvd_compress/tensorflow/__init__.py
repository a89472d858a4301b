"""Drop-in replacement for ``horovod.tensorflow`` with compressed, fused gradient exchange.

    import hvd_compress.tensorflow as hvd
    hvd.init()
    with tf.GradientTape() as tape:
        loss = ...
    tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.regtopk(0.01))
    grads = tape.gradient(loss, model.trainable_variables)

The step's gradients travel in one fused exchange
(:class:`~hvd_compress.tensorflow.gradients.GradientExchange`): in eager mode
and inside ``tf.function``. Everything not defined here (``init``, ``rank``,
``size``, ``broadcast_variables``, ``allreduce`` ...) is ``horovod.tensorflow``'s
own. Compression state (residuals...) goes into checkpoints with
:class:`CompressionCheckpoint`. Our compressors also work as the
``compression=`` of stock ``horovod.tensorflow`` (one exchange per gradient).

Momentum correction (``Compression.topk(0.01, momentum=0.9)``, Deep Gradient
Compression's): the compressor keeps each tensor's velocity and hands back the
average of the ranks' velocities, so apply it with a plain ``SGD(learning_rate)``
(``momentum=0``). The tape cannot see the optimizer: one with momentum of its own
would apply momentum twice.
"""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress import Compression  # noqa: F401  (hvd.Compression.topk(0.01), like Horovod's)
from hvd_compress.algorithms import as_compressor
from hvd_compress.tensorflow.checkpoint import CompressionCheckpoint  # noqa: F401
from hvd_compress.tensorflow.gradients import GradientExchange


def exchange_for(
    compression: Any, op: Any, gradient_predivide_factor: float, communicator: Optional[Any]
) -> GradientExchange:
    """The :class:`GradientExchange` for Horovod-style arguments (``op`` Average or Sum)."""
    import horovod.tensorflow as hvd

    if gradient_predivide_factor != 1.0:
        raise ValueError(
            "hvd_compress: gradient_predivide_factor is not supported with compression "
            "(compressed payloads are summed exactly; scale the loss instead)"
        )
    if op not in (None, hvd.Average, hvd.Sum):
        raise ValueError(f"hvd_compress: op must be hvd.Average or hvd.Sum, got {op!r}")
    return GradientExchange(compression, communicator, average=op != hvd.Sum)


def DistributedGradientTape(
    gradtape: Any,
    compression: Any = None,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    communicator: Optional[Any] = None,
    **horovod_kwargs: Any,
) -> Any:
    """``horovod.tensorflow.DistributedGradientTape`` whose gradients travel compressed and fused.

    ``compression``: one of our compressors (default :class:`NoneCompressor`);
    ``communicator``: default Horovod's; other keyword arguments go to Horovod.
    """
    import horovod.tensorflow as hvd

    compression = as_compressor(compression)
    tape = hvd.DistributedGradientTape(gradtape, **horovod_kwargs)
    tape._allreduce_grads = exchange_for(compression, op, gradient_predivide_factor, communicator)
    return tape


def __getattr__(name: str) -> Any:
    try:
        import horovod.tensorflow as horovod_tensorflow
    except ImportError as error:
        raise ImportError(
            f"hvd_compress.tensorflow.{name} comes from horovod.tensorflow, which is not installed "
            f"({error}); install Horovod with TensorFlow support (make setup does)"
        ) from error
    return getattr(horovod_tensorflow, name)
