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
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
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


def _keras_optimizers():
    """Every tf.keras optimizer with a momentum of its own, as users make them: (optimizer, hyperparameter)."""
    optimizers = tf.keras.optimizers
    chosen = [(optimizers.SGD(0.1, momentum=0.9), "momentum"), (optimizers.RMSprop(0.01, momentum=0.5), "momentum")]
    for name in ("Adam", "AdamW", "Adamax", "Nadam", "Lion"):
        if hasattr(optimizers, name):
            chosen.append((getattr(optimizers, name)(0.001), "beta_1"))
    return chosen


@pytest.mark.parametrize("optimizer,hyperparameter", _keras_optimizers(), ids=lambda o: type(o).__name__)
def test_keras_optimizers_with_a_momentum_of_their_own_are_refused(optimizer, hyperparameter):
    """Adam's beta_1 is a momentum too: under a momentum-correcting compressor it would be applied twice."""
    import hvd_compress.keras as hvd_keras

    name = type(optimizer).__name__
    with pytest.raises(ValueError, match=rf"{name} config has {hyperparameter}=0\.\d+: momentum would be applied twice"
                       rf".*{'compressor momentum=0' if hyperparameter == 'beta_1' else 'plain SGD'}"):
        hvd_keras.DistributedOptimizer(optimizer, compression=TopK(0.01, momentum=0.9))
    assert hvd_keras.DistributedOptimizer(optimizer, compression=TopK(0.01)).compression.momentum == 0


def test_keras_optimizers_without_momentum_take_momentum_correction():
    import hvd_compress.keras as hvd_keras

    optimizers = tf.keras.optimizers
    for optimizer in (optimizers.SGD(0.1), optimizers.Adam(0.001, beta_1=0.0), optimizers.Adagrad(0.01),
                      optimizers.RMSprop(0.01)):
        wrapped = hvd_keras.DistributedOptimizer(optimizer, compression=RegTopK(0.01, momentum=0.9))
        assert wrapped.compression.momentum == 0.9


def test_a_loss_scale_optimizer_is_seen_through():
    import hvd_compress.keras as hvd_keras

    scaled = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.001))
    with pytest.raises(ValueError, match=r"Adam config has beta_1=0\.9"):
        hvd_keras.DistributedOptimizer(scaled, compression=TopK(0.01, momentum=0.9))


def test_the_error_shows_the_configured_ratio_under_a_density_warmup():
    """A warm-up made first sets the compressor to its start density; the error names the 0.01 written."""
    import hvd_compress.keras as hvd_keras
    from hvd_compress import DensityWarmup

    compressor = TopK(0.01, momentum=0.9)
    DensityWarmup(compressor, warmup_steps=4, start=0.25)
    assert compressor.ratio == 0.25
    with pytest.raises(ValueError, match=r"TopK\(ratio=0\.01, .*\(its density warm-up is at 0\.25 now\)") as raised:
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(0.001), compression=compressor)
    assert "ratio=0.25" not in str(raised.value)
