"""Keras callbacks: Horovod's, plus compression statistics and a density warm-up.

``MetricAverageCallback``, ``LearningRateWarmupCallback`` and
``LearningRateScheduleCallback`` are ``horovod.tensorflow.keras.callbacks``'s
own, given a backend that has the ``constant``, ``get_value`` and
``set_value`` they call (Horovod 0.28 hands them ``keras.backend``, which
under TensorFlow >= 2.16 is Keras 3's and lacks them): ``tf.keras.backend``
under Keras 2, TensorFlow's operations under Keras 3.
``BroadcastGlobalVariablesCallback`` is Horovod's under Keras 2 (it
broadcasts after the first batch, once Keras 2 has made the optimizer's
slots); under Keras 3 it is ours and broadcasts the model's and the
optimizer's variables at ``on_train_begin``, before the first step (``fit``
has built both by then). This module adds

- :class:`CompressionStatsCallback`: per epoch, the bytes this rank put on the
  wire against dense gradients, the density achieved and the norm of the
  error-feedback residuals, written into ``logs`` (so ``History``,
  ``CSVLogger`` and ``TensorBoard`` record them);
- :class:`DensityWarmupCallback`: Deep Gradient Compression's warm-up, an
  exponentially decreasing density over the first epochs.

Both take the compressor, or the optimizer of
:func:`hvd_compress.keras.DistributedOptimizer` (which carries it as
``optimizer.compression``), or nothing (then ``model.optimizer``'s)::

    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=hvd.Compression.topk(0.001))
    model.fit(..., callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.DensityWarmupCallback(opt, warmup_epochs=4, start=0.25),
        hvd.callbacks.CompressionStatsCallback(opt),
        tf.keras.callbacks.CSVLogger("log.csv"),
    ])

Keras hands every callback the same ``logs`` dictionary in list order: put
these after ``MetricAverageCallback`` (which averages every entry over ranks)
to log this rank's own numbers, and before ``CSVLogger``/``TensorBoard``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf
from horovod.tensorflow.keras import callbacks as horovod_callbacks

from hvd_compress.algorithms.base import Compressor, check_ratio, is_compression
from hvd_compress.algorithms.schedule import (check_has_density, check_start, check_warmup_steps, reached_target,
                                               warmup_density)
from hvd_compress.keras.versions import KERAS3, broadcast_variables

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateWarmupCallback",
    "LearningRateScheduleCallback",
    "CompressionStatsCallback",
    "DensityWarmupCallback",
]


class _TensorFlowBackend:
    """What Horovod's callbacks call on a Keras backend, done with TensorFlow (for Keras 3)."""

    @staticmethod
    def constant(value: Any, name: Optional[str] = None) -> tf.Tensor:
        return tf.constant(value)

    @staticmethod
    def get_value(variable: Any) -> Any:
        return variable.numpy() if hasattr(variable, "numpy") else variable

    @staticmethod
    def set_value(variable: Any, value: Any) -> None:
        variable.assign(value)


class _HorovodBackend:
    """Gives a Horovod callback a backend with ``constant``/``get_value``/``set_value``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.backend = _TensorFlowBackend if KERAS3 else tf.keras.backend


class _Keras3Broadcast(tf.keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` before training.

    ``local_variables``: variables (or one) that stay as they are on each rank.
    """

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        local = [] if local_variables is None else local_variables
        self._local = {id(v) for v in (local if isinstance(local, (list, tuple)) else [local])}
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        variables = list(self.model.variables) + list(getattr(optimizer, "variables", []))
        with tf.device(self.device):
            broadcast_variables([v for v in variables if id(v) not in self._local], self.root_rank)
        self.broadcast_done = True


if KERAS3:
    BroadcastGlobalVariablesCallback = _Keras3Broadcast
else:
    BroadcastGlobalVariablesCallback = horovod_callbacks.BroadcastGlobalVariablesCallback


class MetricAverageCallback(_HorovodBackend, horovod_callbacks.MetricAverageCallback):
    __doc__ = horovod_callbacks.MetricAverageCallback.__doc__


class _MomentumCheck(_HorovodBackend):
    """Turns momentum correction off, with a warning, where the momentum is a Python number.

    Keras 3's optimizers and Keras 2's current ones (``tf.keras.optimizers.SGD``)
    keep ``momentum`` as a float read when the train step is traced, so it
    cannot be changed per step (Keras 2's ``tf.keras.optimizers.legacy`` ones
    keep a variable).
    """

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        momentum = getattr(self.model.optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, numbers.Real) and momentum:
            warnings.warn(
                f"hvd_compress: {type(self).__name__}: the optimizer's momentum is the number "
                f"{momentum!r}, fixed in the traced train step; momentum correction is off "
                "(use a Keras 2 tf.keras.optimizers.legacy optimizer for it, or pass "
                "momentum_correction=False)",
                stacklevel=2,
            )
        if isinstance(momentum, numbers.Real):  # a number (0 too) cannot be corrected
            self.momentum_correction = False
        super().on_train_begin(logs)


class LearningRateScheduleCallback(_MomentumCheck, horovod_callbacks.LearningRateScheduleCallback):
    __doc__ = horovod_callbacks.LearningRateScheduleCallback.__doc__


class LearningRateWarmupCallback(_MomentumCheck, horovod_callbacks.LearningRateWarmupCallback):
    __doc__ = horovod_callbacks.LearningRateWarmupCallback.__doc__


def compressor_of(compressor_or_optimizer: Any, who: str) -> Compressor:
    """The compressor itself, or an optimizer's ``.compression``; ``TypeError`` otherwise."""
    if is_compression(compressor_or_optimizer):
        return compressor_or_optimizer
    compression = getattr(compressor_or_optimizer, "compression", None)
    if is_compression(compression):
        return compression
    raise TypeError(
        f"hvd_compress: {who} needs an hvd_compress compressor or an optimizer made by "
        f"hvd_compress.keras.DistributedOptimizer (which has .compression), got "
        f"{type(compressor_or_optimizer).__name__}"
        + (f" with compression {compression!r}" if compression is not None else "")
    )


def squared_norm(tensor: Any) -> float:
    """Sum of squares of a numpy, TensorFlow or torch tensor, accumulated in float64."""
    if hasattr(tensor, "detach"):  # torch, on any device
        return float(tensor.detach().double().square().sum())
    if hasattr(tensor, "numpy"):  # tf.Tensor, tf.Variable
        tensor = tensor.numpy()
    flat = np.asarray(tensor, dtype=np.float64).ravel()
    return float(flat @ flat)


def residual_norm(compressor: Compressor) -> float:
    """``sqrt(sum over tensors t of ||r_t||^2)``: the norm of all error-feedback residuals (those a
    fused bucket holds written back first)."""
    compressor.state.flush_buckets()
    total = 0.0
    for name in compressor.memory.names():
        residual = compressor.memory.peek(name, "residual")
        if residual is not None:
            total += squared_norm(residual)
    return math.sqrt(total)


def keeps_residuals(compressor: Compressor) -> bool:
    """Whether ``compressor`` runs error feedback (sparsifiers by default, TernGrad on request)."""
    return bool(getattr(compressor, "error_feedback", False))


class _CompressorCallback(tf.keras.callbacks.Callback):
    """Resolves the compressor: given, from an optimizer, or ``model.optimizer``'s at train begin."""

    def __init__(self, compressor_or_optimizer: Any = None) -> None:
        super().__init__()
        self._compressor: Optional[Compressor] = None
        if compressor_or_optimizer is not None:
            compressor = compressor_of(compressor_or_optimizer, type(self).__name__)
            self._check(compressor)
            self._compressor = compressor

    @property
    def compressor(self) -> Compressor:
        """The compressor; taken from ``model.optimizer`` on first use when none was given."""
        return self._resolve()

    def _resolve(self) -> Compressor:
        if self._compressor is None:
            optimizer = getattr(getattr(self, "model", None), "optimizer", None)
            if optimizer is None:
                raise ValueError(
                    f"hvd_compress: {type(self).__name__} was given no compressor and the model "
                    "has no optimizer yet; pass the compressor or the optimizer"
                )
            compressor = compressor_of(optimizer, f"{type(self).__name__} (model.optimizer)")
            self._check(compressor)
            self._compressor = compressor
        return self._compressor

    def _check(self, compressor: Compressor) -> None:
        """Hook: validate the compressor before it is used (raises)."""

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._resolve()  # now, so that errors come before the first step


class CompressionStatsCallback(_CompressorCallback):
    """Writes per-epoch compression statistics of this rank into the epoch's ``logs``.

    From the compressor's :class:`~hvd_compress.algorithms.base.WireStats`,
    reset at ``on_epoch_begin`` and read at ``on_epoch_end``:

    - ``compression_bytes``: payload bytes this rank handed to the collectives
      during the epoch (values and indices, ternary codes and scales, dense
      tensors; the few-byte consistency header is not counted);
    - ``compression_dense_bytes``: the bytes of the same gradients sent dense;
    - ``compression_savings``: ``compression_dense_bytes / compression_bytes``;
    - ``compression_density``: entries sent over entries compressed
      (``sum |S_t| / sum d_t``; 1 for dense and ternary payloads);
    - ``compression_residual_norm``: ``sqrt(sum_t ||r_t||^2)`` over the
      error-feedback residuals ``r_t`` of every tensor ``t`` at the end of the
      epoch (what has been computed but not yet sent); only for compressors
      with error feedback (Top-k, Gaussian-k, RegTop-k; TernGrad with
      ``error_feedback=True``), absent otherwise;
    - ``compression_dense_buckets``, ``compression_compressed_buckets``: with
      :class:`~hvd_compress.engine.auto.Auto`, the buckets it decided to send dense and compressed.

    ``compressor_or_optimizer``: the compressor, an optimizer of
    :func:`hvd_compress.keras.DistributedOptimizer`, or ``None`` for
    ``model.optimizer``'s.
    """

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.compressor.stats.reset()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is None:
            return
        logs.update(self.epoch_logs())

    def epoch_logs(self) -> Dict[str, Any]:
        """The entries ``on_epoch_end`` adds to ``logs``, from the statistics so far."""
        stats = self.compressor.stats
        entries: Dict[str, Any] = {
            "compression_bytes": int(stats.bytes_sent),
            "compression_dense_bytes": int(stats.dense_bytes),
            "compression_savings": float(stats.savings),
            "compression_density": float(stats.density),
        }
        if keeps_residuals(self.compressor):
            entries["compression_residual_norm"] = residual_norm(self.compressor)
        if hasattr(stats, "decisions"):  # Auto: buckets sent dense and compressed
            entries["compression_dense_buckets"] = int(stats.dense_buckets)
            entries["compression_compressed_buckets"] = int(stats.compressed_buckets)
        return entries


class DensityWarmupCallback(_CompressorCallback):
    """Deep Gradient Compression's warm-up: the density decays exponentially to the target.

    Lin et al., "Deep Gradient Compression: Reducing the Communication
    Bandwidth for Distributed Training" (ICLR 2018), section 3.4: in the first
    epochs the sparsity rises exponentially (75%, 93.75%, 98.4375%, 99.6%,
    then 99.9%), so training adapts to the sparse, delayed updates. With
    target density ``rho`` (the compressor's ``ratio`` when the callback is
    made), start density ``s`` and ``W = warmup_epochs``, epoch ``e``
    (0-based, as Keras counts; ``initial_epoch`` respected) uses

        density(e) = s * (rho / s) ** (e / W)    for e < W
        density(e) = rho                          for e >= W

    a geometric sequence from ``s`` that would reach ``rho`` at epoch ``W``
    (:func:`hvd_compress.algorithms.schedule.warmup_density`, the formula of
    the framework-free :class:`hvd_compress.DensityWarmup` schedule too).
    ``s = 0.25, W = 4, rho = 0.001`` gives 25%, 6.3%, 1.6%, 0.40%, then 0.1%
    (the paper's 25%, 6.25%, 1.5625%, 0.39% is this sequence for
    ``rho = 0.25 ** 5 = 0.098%``); DGC's released code, which multiplies by
    ``rho ** (1 / (W + 1))`` each epoch, is ``s = rho ** (1 / (W + 1))``.
    ``s = 1`` starts dense.

    The density is set as ``compressor.ratio`` at ``on_epoch_begin``, logged
    as ``compression_ratio`` at ``on_epoch_end``, and reset to the target at
    ``on_train_end``; at the epoch that reaches the target an ``Auto``
    compressor measures again (``remeasure``). It depends only on the epoch number, so every rank uses
    the same one (the exchange header checks that ranks agree). While
    ``N * k`` reaches a tensor's size, the sparsifiers send that tensor dense
    (``dense_when_cheaper``).

    ``TypeError`` for compressors without a density (TernGrad, FP16, None);
    ``ValueError`` for ``warmup_epochs < 0`` or ``start`` outside
    ``[target, 1]``.
    """

    def __init__(
        self, compressor_or_optimizer: Any = None, warmup_epochs: int = 4, start: float = 0.25
    ) -> None:
        self.warmup_epochs = check_warmup_steps(warmup_epochs, "warmup_epochs")
        self.start = check_ratio(start)
        self.target: Optional[float] = None
        self.ratio: Optional[float] = None  # the density of the current epoch
        super().__init__(compressor_or_optimizer)

    def _check(self, compressor: Compressor) -> None:
        check_has_density(compressor, "DensityWarmupCallback")
        target = float(compressor.ratio)
        check_start(self.start, target, f"DensityWarmupCallback (for {compressor!r})")
        self.target = target

    def density(self, epoch: int) -> float:
        """The density of (0-based) ``epoch``: :func:`~hvd_compress.algorithms.schedule.warmup_density`."""
        self._resolve()  # sets the target
        return warmup_density(epoch, self.warmup_epochs, self.start, self.target)

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self.ratio = self.density(epoch)
        self.compressor.ratio = self.ratio
        self.compressor.target_ratio = self.target  # what messages show as configured (not the ramp's density)
        if epoch == self.warmup_epochs > 0:  # the target is reached: Auto measures again
            reached_target([self.compressor])

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if logs is not None and self.ratio is not None:
            logs["compression_ratio"] = self.ratio

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.target is not None:
            self.compressor.ratio = self.target
