"""Compression state in ``tf.train.Checkpoint``: residuals, RegTop-k posteriors, random streams.

The state is created per gradient on first use, so a checkpoint may be
restored before it exists; :class:`CompressionCheckpoint` therefore saves the
compressor's whole :meth:`~hvd_compress.algorithms.base.Compressor.state_dict`
as one serialized tensor and restores it at once with ``load_state_dict``::

    ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                               compression=CompressionCheckpoint(compressor))

(The Keras ``DistributedOptimizer`` of :mod:`hvd_compress.keras` tracks one
itself, so ``tf.train.Checkpoint(optimizer=opt)`` already includes it.)
Like ``torch.load``, restoring unpickles: load only checkpoints you trust.
"""

from __future__ import annotations

import pickle
from typing import Any

import tensorflow as tf
from tensorflow.python.trackable import base as trackable


def _to_numpy(value: Any) -> Any:
    return value.numpy() if isinstance(value, (tf.Tensor, tf.Variable)) else value


def state_bytes(compressor: Any) -> bytes:
    """``compressor.state_dict()`` pickled, its TensorFlow tensors as numpy arrays."""
    return pickle.dumps(tf.nest.map_structure(_to_numpy, compressor.state_dict()))


def load_state_bytes(compressor: Any, data: bytes) -> None:
    """Restore what :func:`state_bytes` saved into ``compressor`` (unpickles: trusted data only); the
    numpy arrays move to a GPU's TensorFlow tensors on the first gradient there."""
    compressor.load_state_dict(pickle.loads(data))


class CompressionCheckpoint(trackable.Trackable):
    """A ``tf.train.Checkpoint`` dependency holding ``compression``'s state."""

    def __init__(self, compression: Any) -> None:
        self.compressor = compression

    def _serialize_to_tensors(self):
        return {"state": tf.constant(state_bytes(self.compressor))}

    def _restore_from_tensors(self, restored_tensors):
        load_state_bytes(self.compressor, restored_tensors["state"].numpy())
        return tf.no_op()
