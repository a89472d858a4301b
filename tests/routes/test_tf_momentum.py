"""Momentum correction with TensorFlow: the exchange inside ``tf.function`` keeps each tensor's velocity
across steps as the Simulator does, and Keras's ``DistributedOptimizer`` refuses an optimizer with
momentum of its own."""

from __future__ import annotations

import numpy as np
import pytest

from tests.distributed.launch import require

require("tensorflow")

import tensorflow as tf  # noqa: E402

from hvd_compress import RegTopK, TopK  # noqa: E402
from hvd_compress.comm.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from hvd_compress.tensorflow.gradients import GradientExchange  # noqa: E402


class Var:
    def __init__(self, name):
        self.name = name


def test_traced_exchange_keeps_the_velocity_as_the_simulator():
    """A weight (compressed) and a bias (dense) over 4 traced steps, one rank: bit for bit."""
    make = lambda: RegTopK(0.05, dense_below=100, momentum=0.9)  # noqa: E731
    compressor = make()
    exchange = GradientExchange(compressor, SingleProcessCommunicator())
    step = tf.function(lambda w, b: exchange([w, b], [Var("w"), Var("b")]))
    sim = Simulator(1, make())
    rng = np.random.default_rng(3)
    for _ in range(4):
        w, b = rng.standard_normal(500).astype(np.float32), rng.standard_normal(20).astype(np.float32)
        got = step(tf.constant(w), tf.constant(b))
        want = sim.step({"w": [w], "b": [b]})
        np.testing.assert_array_equal(got[0].numpy(), want["w"])
        np.testing.assert_array_equal(got[1].numpy(), want["b"])
        for name in ("w", "b"):
            np.testing.assert_array_equal(np.asarray(compressor.velocity(name)), sim.compressors[0].velocity(name))


def test_keras_optimizer_with_momentum_is_refused():
    import hvd_compress.keras as hvd_keras

    optimizer = tf.keras.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"SGD config has momentum=0\.9.*applied twice.*momentum=0 \(plain SGD"):
        hvd_keras.DistributedOptimizer(optimizer, compression=TopK(0.01, momentum=0.9))
