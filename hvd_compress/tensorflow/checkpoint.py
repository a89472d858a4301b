"""Compression state in ``tf.train.Checkpoint``: residuals, RegTop-k posteriors, random streams.

The state is created per gradient on first use, so a checkpoint may be
restored before it exists; :class:`CompressionCheckpoint` therefore saves the
compressor's whole :meth:`~hvd_compress.compressors.base.Compressor.state_dict`
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

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable import base as trackable


def _to_numpy(value: Any) -> Any:
    return value.numpy() if isinstance(value, (tf.Tensor, tf.Variable)) else value


def _to_tensor(value: Any) -> Any:
    return tf.convert_to_tensor(value) if isinstance(value, np.ndarray) and value.dtype != object else value


class CompressionCheckpoint(trackable.Trackable):
    """A ``tf.train.Checkpoint`` dependency holding ``compressor``'s state."""

    def __init__(self, compressor: Any) -> None:
        self.compressor = compressor

    def _serialize_to_tensors(self):
        state = tf.nest.map_structure(_to_numpy, self.compressor.state_dict())
        return {"state": tf.constant(pickle.dumps(state))}

    def _restore_from_tensors(self, restored_tensors):
        state = pickle.loads(restored_tensors["state"].numpy())
        tensors = tf.nest.map_structure(_to_tensor, state["tensors"])
        self.compressor.load_state_dict({**state, "tensors": tensors})
        return tf.no_op()
