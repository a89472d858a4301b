"""Keras 3 (TensorFlow backend): a ``DistributedOptimizer`` that wraps a Keras 3 optimizer.

``apply(grads, variables)`` (which ``apply_gradients`` and ``model.fit`` call)
first averages the gradients over ranks through the fused, compressed
exchange of the TensorFlow route
(:class:`~hvd_compress.tensorflow.gradients.GradientExchange`, one
``tf.py_function`` op inside a graph), then hands the average to the wrapped
optimizer. The wrapper delegates the learning rate, iterations, loss scaling
and its variables to the wrapped optimizer, like Keras's own
``LossScaleOptimizer``.

Serialization: ``get_config`` holds the wrapped optimizer's config and the
compressor's (type, parameters, seed); the class is registered as
``hvd_compress>DistributedOptimizer``, so ``keras.saving.load_model`` rebuilds
it once :mod:`hvd_compress.keras` is imported. ``model.save`` stores this
rank's compression state (residuals, RegTop-k posteriors, random streams)
with the optimizer, tagged with the rank; loading restores it on the same
rank and, on another rank, starts that rank's state afresh with a warning
(each rank's residuals are its own: for an exact resume every rank saves its
own file). ``tf.train.Checkpoint(optimizer=opt)`` includes the state too.

XLA cannot compile the exchange (``tf.py_function``): ``jit_compile=True`` is
an error; ``"auto"`` turns XLA on only with a GPU, so compile with
``jit_compile=False`` there.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, Optional

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import tracking
from tensorflow.python.ops import control_flow_util

from hvd_compress import algorithms
from hvd_compress.horovod import interface
from hvd_compress.transport.communicator import Communicator
from hvd_compress.tensorflow import exchange_for
from hvd_compress.tensorflow.checkpoint import CompressionCheckpoint, load_state_bytes, state_bytes

STATE_KEY = "hvd_compress_state"
RANK_KEY = "hvd_compress_rank"


def check_backend() -> None:
    """``ImportError`` unless Keras 3 runs on TensorFlow (``KERAS_BACKEND=tensorflow``)."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            f"hvd_compress: hvd_compress.keras needs Keras's TensorFlow backend, but KERAS_BACKEND is "
            f"{backend!r}; set KERAS_BACKEND=tensorflow (for PyTorch training use hvd_compress.torch)"
        )


check_backend()


def compressor_config(compressor: Any) -> Dict[str, Any]:
    """Type, parameters and seed: what :func:`compressor_from_config` rebuilds the compressor from
    (``Auto``: its options and its compressor's config)."""
    if isinstance(compressor, algorithms.ExchangePolicy):
        return {**compressor.config(), "compressor": compressor_config(compressor.inner)}
    return {**compressor.config(), "seed": compressor.seed}


def compressor_from_config(config: Dict[str, Any]) -> Any:
    """A new compressor of :func:`compressor_config`'s type and parameters (no state)."""
    options = dict(config)
    cls = getattr(interface, str(options.pop("type", "")), None)  # the public compressors
    if not (isinstance(cls, type) and issubclass(cls, (algorithms.Compressor, algorithms.ExchangePolicy))):
        raise ValueError(f"hvd_compress: unknown compressor in the optimizer config: {config!r}")
    if issubclass(cls, algorithms.ExchangePolicy):
        options["compressor"] = compressor_from_config(options["compressor"])
    return cls(**options)


def _refuse_xla() -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            "hvd_compress: DistributedOptimizer cannot run under XLA (its exchange is a "
            "tf.py_function); compile the model with jit_compile=False"
        )


@keras.saving.register_keras_serializable(package="hvd_compress")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps Keras 3 optimizer ``inner_optimizer``: gradients averaged over ranks, compressed.

    ``compression``: one of our compressors (default ``NoneCompressor``), kept
    as ``self.compression``; ``op``: ``hvd.Average`` (default) or ``hvd.Sum``
    (or ``"average"`` / ``"sum"``); ``communicator``: default Horovod's.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        compression: Optional[algorithms.Compressor] = None,
        op: Any = None,
        gradient_predivide_factor: float = 1.0,
        communicator: Optional[Communicator] = None,
        name: Optional[str] = None,
    ) -> None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "hvd_compress: DistributedOptimizer under Keras 3 wraps a keras.optimizers.Optimizer "
                f"(such as keras.optimizers.SGD(0.1)), got {type(inner_optimizer).__module__}."
                f"{type(inner_optimizer).__name__}"
            )
        compression = algorithms.as_compressor(compression)
        import horovod.tensorflow as hvd

        super().__init__(learning_rate=0.0, name=name or f"Distributed{type(inner_optimizer).__name__}")
        self.inner_optimizer = inner_optimizer
        self.compression = compression
        horovod_op = {"average": hvd.Average, "sum": hvd.Sum}.get(op, op) if isinstance(op, str) else op
        self._exchange = exchange_for(compression, horovod_op, gradient_predivide_factor, communicator)
        self.sums = not self._exchange.average
        self._compression_checkpoint = CompressionCheckpoint(compression)  # tf.train.Checkpoint

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` over ranks (compressed), then apply them with the wrapped optimizer."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "hvd_compress: DistributedOptimizer.apply without variables needs a built "
                    "optimizer; call optimizer.build(model.trainable_variables) first"
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        _refuse_xla()
        names = self.tensor_names(trainable_variables)
        averaged = self._exchange(list(grads), trainable_variables, names=names)
        self.inner_optimizer.apply(averaged, trainable_variables)

    def tensor_names(self, variables) -> list:
        """``"<index>/<name>"``, the index in the variables the optimizer was built with: stable
        across ``model.save`` / ``load_model`` (Keras 3 variable paths are not) and equal on all ranks."""
        return [f"{self._get_variable_index(v)}/{v.name}" for v in variables]

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise ValueError(
            "hvd_compress: DistributedOptimizer has no stateless_apply (the JAX-style API); use "
            "apply or apply_gradients with the TensorFlow backend"
        )

    # ------------------------------------------------------------ delegated
    @property
    def variables(self):
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    lr = learning_rate  # the name Horovod's learning-rate callbacks use

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def __getattr__(self, name: str) -> Any:
        """Public attributes of the wrapped optimizer (``momentum``, ``nesterov``...)."""
        inner = self.__dict__.get("inner_optimizer")
        if name.startswith("_") or inner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    # ------------------------------------------------------------ saving
    def save_own_variables(self, store) -> None:
        """This rank's compression state, tagged with the rank (the wrapped optimizer saves its own)."""
        store[STATE_KEY] = np.frombuffer(state_bytes(self.compression), dtype=np.uint8)
        store[RANK_KEY] = np.array([self._exchange.comm.rank], dtype=np.int64)

    def load_own_variables(self, store) -> None:
        """Restores the state saved by this rank; another rank's: a warning, and a fresh start."""
        if STATE_KEY not in store.keys():
            return
        saved_rank, rank = int(np.asarray(store[RANK_KEY])[0]), self._exchange.comm.rank
        if saved_rank != rank:
            warnings.warn(
                f"hvd_compress: rank {rank} loaded the compression state saved by rank {saved_rank}; "
                f"residuals are per rank, so rank {rank} starts its own afresh (save one file per "
                "rank to resume exactly)",
                stacklevel=2,
            )
            return
        load_state_bytes(self.compression, np.asarray(store[STATE_KEY]).tobytes())

    def get_config(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": compressor_config(self.compression),
            "op": "sum" if self.sums else "average",
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        compression = compressor_from_config(config.pop("compression"))
        return cls(inner, compression=compression, **config)
