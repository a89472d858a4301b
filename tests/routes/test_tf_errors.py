"""Bad input with TensorFlow gets a clear error, eagerly and inside ``tf.function``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launch import require

require("tensorflow")

import tensorflow as tf  # noqa: E402

from hvd_compress import Compression  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.tensorflow.gradients import GradientExchange  # noqa: E402


class Var:
    def __init__(self, name):
        self.name = name


def exchange(grads, compressor=None):
    compressor = compressor or Compression.topk(0.05)
    return GradientExchange(compressor, SingleProcessCommunicator())(
        grads, [Var(f"v{i}") for i in range(len(grads))]
    )


@pytest.mark.parametrize("compressor", ["topk", "terngrad", "fp16"])
def test_nan_gradient_reaches_the_result_as_in_a_dense_allreduce(compressor):
    """Eagerly and in a graph: the NaN/Inf tensor comes back non-finite, the others finite, no error."""
    make = {"topk": lambda: Compression.topk(0.05), "terngrad": Compression.terngrad, "fp16": Compression.fp16}
    grad = np.ones(2048, dtype=np.float32)
    grad[7] = np.nan
    clean = np.arange(2048, dtype=np.float32)
    eager = exchange([tf.constant(grad), tf.constant(clean)], make[compressor]())
    traced = tf.function(lambda g, c: exchange([g, c], make[compressor]()))(tf.constant(grad), tf.constant(clean))
    for bad, good in (eager, traced):
        assert not np.isfinite(bad.numpy()).all()
        assert np.isfinite(good.numpy()).all()


def test_integer_gradient_is_a_type_error():
    with pytest.raises(TypeError, match="floating point"):
        exchange([tf.range(2048)])


def test_none_gradients_pass_through():
    grad = tf.constant(np.arange(2048, dtype=np.float32))
    out = exchange([None, grad])
    assert out[0] is None
    assert out[1].shape == grad.shape


def test_predivide_and_unknown_op_are_refused():
    require("horovod.tensorflow")
    import horovod.tensorflow as hvd

    from hvd_compress.tensorflow import exchange_for

    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        exchange_for(Compression.topk(0.01), hvd.Average, 2.0, None)
    with pytest.raises(ValueError, match="op must be"):
        exchange_for(Compression.topk(0.01), hvd.Adasum, 1.0, None)
