"""Compression state of TensorFlow training in ``tf.train.Checkpoint``: a restored run continues exactly."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.distributed.launch import require

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported
require("tensorflow")

import tensorflow as tf  # noqa: E402

from hvd_compress import Compression  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.tensorflow import CompressionCheckpoint  # noqa: E402
from hvd_compress.tensorflow.gradients import GradientExchange  # noqa: E402

NAMES = ["topk", "gaussiank", "regtopk", "terngrad"]


def gradients(step):
    rng = np.random.default_rng(step)
    return [tf.constant(rng.standard_normal(shape).astype(np.float32)) for shape in [(64, 40), (40,)]]


class Var:
    def __init__(self, name):
        self.name = name


VARIABLES = [Var("dense/kernel:0"), Var("dense/bias:0")]


def run_steps(exchange, steps):
    return [[g.numpy() for g in exchange(gradients(step), VARIABLES)] for step in steps]


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_restores_residuals_and_continues_exactly(name, tmp_path):
    options = {} if name == "terngrad" else {"ratio": 0.05}
    straight = GradientExchange(Compression.by_name(name, **options), SingleProcessCommunicator())
    expected = run_steps(straight, range(6))

    first = Compression.by_name(name, **options)
    run_steps(GradientExchange(first, SingleProcessCommunicator()), range(3))
    path = tf.train.Checkpoint(compression=CompressionCheckpoint(first)).save(str(tmp_path / "ckpt"))

    restored = Compression.by_name(name, **options)
    tf.train.Checkpoint(compression=CompressionCheckpoint(restored)).restore(path).assert_consumed()
    if name != "terngrad":
        np.testing.assert_array_equal(
            restored.residual("dense/kernel:0"), first.residual("dense/kernel:0")
        )
    resumed = run_steps(GradientExchange(restored, SingleProcessCommunicator()), range(3, 6))
    for got, want in zip(resumed, expected[3:]):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


def test_checkpoint_of_another_algorithm_is_an_error(tmp_path):
    topk = Compression.topk(0.05)
    run_steps(GradientExchange(topk, SingleProcessCommunicator()), range(1))
    path = tf.train.Checkpoint(compression=CompressionCheckpoint(topk)).save(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="TopK state"):
        tf.train.Checkpoint(compression=CompressionCheckpoint(Compression.regtopk(0.05))).restore(path)


def test_keras_optimizer_checkpoint_holds_the_compression_state(tmp_path):
    require("horovod.tensorflow.keras")
    import hvd_compress.keras as hvd

    hvd.init()
    compression = Compression.topk(0.05)
    opt = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), compression=compression, communicator=SingleProcessCommunicator()
    )
    model = tf.keras.Sequential([tf.keras.layers.Dense(40, input_shape=(64,))])
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.standard_normal((32, 64)), rng.standard_normal((32, 40)), batch_size=16, verbose=0)
    kernel = next(name for name in compression.state_dict()["tensors"] if "kernel" in name)
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))

    restored = Compression.topk(0.05)
    fresh = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.1), compression=restored, communicator=SingleProcessCommunicator()
    )
    tf.train.Checkpoint(optimizer=fresh).restore(path)
    np.testing.assert_array_equal(restored.residual(kernel), compression.residual(kernel))


def test_a_checkpoint_of_tensorflow_kernels_resumes_on_the_host(tmp_path, monkeypatch):
    """State written while the exchange ran TensorFlow's kernels (a GPU's, or this library before CPU
    tensors went to numpy: its TensorFlow random stream) loads into a CPU run, which continues with
    the saved residuals and keeps the TensorFlow stream in its next checkpoint beside numpy's."""
    from hvd_compress.kernels import tf_ops

    written = Compression.terngrad(error_feedback=True)
    with monkeypatch.context() as patch:
        patch.setattr(tf_ops, "host_array", lambda a: a)  # TensorFlow's kernels on CPU tensors
        run_steps(GradientExchange(written, SingleProcessCommunicator()), range(2))
        assert tf.is_tensor(written.residual("dense/kernel:0"))  # the state is TensorFlow's
        saved = written.state_dict()
    path = tf.train.Checkpoint(compression=CompressionCheckpoint(written)).save(str(tmp_path / "ckpt"))
    restored = Compression.terngrad(error_feedback=True)
    tf.train.Checkpoint(compression=CompressionCheckpoint(restored)).restore(path).assert_consumed()
    np.testing.assert_array_equal(restored.residual("dense/kernel:0"), written.residual("dense/kernel:0"))
    (got,) = run_steps(GradientExchange(restored, SingleProcessCommunicator()), [2])
    assert all(np.isfinite(g).all() for g in got)
    assert set(saved["generators"]) == {tf_ops.__name__}
    assert set(restored.state_dict()["generators"]) == {tf_ops.__name__, "hvd_compress.kernels.reference"}
