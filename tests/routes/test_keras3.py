"""``hvd_compress.keras`` under Keras 3 (TensorFlow backend) and Keras 2 (``tf_keras``).

2 ranks under ``horovodrun --gloo`` (tests/distributed/keras_fit.py), once per
Keras, the ranks' ``TF_USE_LEGACY_KERAS`` set to 0 or 1: ``model.fit`` with
RegTop-k at 1% and every callback, resumed from a checkpoint in the middle,
and a custom training loop; the weights must equal the Simulator's, the logged
losses its per-rank means, the logged bytes its ranks' (payloads, flags and layout checks). In-process tests
use Keras 3's optimizer class directly (this process's ``tf.keras`` is Keras 2).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.distributed import keras_fit as workload
from tests.distributed import launch

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # as the suite runs: tf.keras is Keras 2 here
launch.require("horovod.tensorflow")
launch.require("keras")

import tensorflow as tf  # noqa: E402

pytestmark = pytest.mark.timeout(420)


def keras_module(version: str):
    if version == "3":
        import keras
    else:
        import tf_keras as keras
    return keras


@pytest.mark.parametrize("version", ["3", "2"])
def test_fit_with_callbacks_and_resume_and_custom_loop_equal_simulator(version, tmp_path, monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "0" if version == "3" else "1")
    out = tmp_path / "result.npz"
    done = launch.run("horovodrun", 2, "tests.distributed.keras_fit", "--keras", version, "--out", str(out))
    assert done.returncode == 0, launch.output(done)
    result = np.load(out)
    meta = json.loads(str(result["meta"]))
    steps, lr = workload.STEPS, workload.LR

    # Horovod's warm-up from LR / size over epoch 0 (each batch), then LR; the density 25%, then 1%
    warmup = [lr / 2 * (1 + (b + 1) / steps) for b in range(steps)]
    assert meta["lrs"] == pytest.approx(warmup + [lr] * steps, rel=1e-6)
    assert meta["ratios"] == [workload.START] * steps + [workload.RATIO] * steps

    keras = keras_module(version)
    fit = workload.simulate(keras, meta["lrs"], meta["ratios"])
    loop = workload.simulate(keras, [lr] * steps, [workload.RATIO] * steps)
    for phase, expected in (("fit", fit), ("loop", loop)):
        for i, weight in enumerate(expected["weights"]):
            np.testing.assert_allclose(
                result[f"{phase}/w{i}"], weight, rtol=0, atol=1e-6, err_msg=f"{phase} w{i} differs"
            )

    # the Simulator runs the route's engine: beside the payloads, each step hands over a flag and its
    # position per sparse tensor, and each epoch (a new density: a new plan) its layout check once,
    # two int64 hashes; the route's statistics count the same bytes
    for rank, logs in enumerate(log["logs"] for log in meta["per_rank"]):
        assert [e["compression_ratio"] for e in logs] == [workload.START, workload.RATIO]
        assert logs[0]["lr"] == pytest.approx(lr)
        for epoch, entry in enumerate(logs):
            window = slice(epoch * steps, (epoch + 1) * steps)
            # MetricAverageCallback: the mean over ranks of each rank's mean batch loss
            assert entry["loss"] == pytest.approx(np.mean(fit["losses"][window]), rel=1e-5)
            # CompressionStatsCallback: the bytes this rank handed to the collectives, the Simulator's rank's
            assert entry["compression_bytes"] == sum(b[rank] for b in fit["bytes"][window])
            assert entry["compression_savings"] > (1 if epoch == 0 else 20)
            assert 0 < entry["compression_residual_norm"] < float("inf")
    if version == "3":
        assert "TF_USE_LEGACY_KERAS=1 for Keras 2" in meta["wrong_keras"]
        assert meta["per_rank"][0]["foreign_load"] == []
        (warning,) = meta["per_rank"][1]["foreign_load"]
        assert "rank 1 loaded the compression state saved by rank 0" in warning


# ---------------------------------------------------------------- in process, Keras 3 directly
@pytest.fixture(scope="module")
def keras3():
    import horovod.tensorflow as hvd

    hvd.init()
    return pytest.importorskip("hvd_compress.keras.keras3")


def distributed(keras3, compression, **options):
    import keras

    from hvd_compress.transport.communicator import SingleProcessCommunicator

    return keras3.DistributedOptimizer(
        keras.optimizers.SGD(0.1), compression, communicator=SingleProcessCommunicator(), **options
    )


def test_config_round_trip_keeps_compressor_and_op(keras3):
    import keras

    from hvd_compress import Auto, TernGrad, TopK

    auto = Auto(TopK(0.03, seed=5), warmup=2, decide_every=50, margin=0.1, indices="leader", log=False)
    for compression, op in ((TopK(0.02, dense_below=16, seed=7), "sum"), (TernGrad(clip=None), None), (auto, None)):
        opt = distributed(keras3, compression, op=op)
        again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
        assert isinstance(again, keras3.DistributedOptimizer)
        assert again.compression.config() == compression.config()
        assert again.compression.seed == compression.seed
        assert again.sums == (op == "sum")
        assert again.inner_optimizer.get_config() == opt.inner_optimizer.get_config()


def test_tf_train_checkpoint_restores_the_compression_state(keras3, tmp_path):
    import keras

    from hvd_compress import Compression

    model = workload.make_model(keras)
    x, y = workload.data(0)
    opt = distributed(keras3, Compression.regtopk(0.05))
    with tf.GradientTape() as tape:
        loss = workload.loss_fn(keras)(y, model(x))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    path = tf.train.Checkpoint(optimizer=opt).save(str(tmp_path / "ckpt"))

    fresh = distributed(keras3, Compression.regtopk(0.05))
    tf.train.Checkpoint(optimizer=fresh).restore(path)
    names = opt.compression.memory.names()
    assert names == ["0/kernel", "2/kernel"]  # index among the model's variables / name
    for name in names:
        np.testing.assert_array_equal(fresh.compression.residual(name), opt.compression.residual(name))
        np.testing.assert_array_equal(fresh.compression.distortion(name), opt.compression.distortion(name))


def test_bad_arguments_are_refused(keras3):
    import keras

    with pytest.raises(TypeError, match="compression must be an hvd_compress compressor"):
        distributed(keras3, "topk")
    with pytest.raises(TypeError, match="wraps a keras.optimizers.Optimizer"):
        keras3.DistributedOptimizer(object())
    with pytest.raises(ValueError, match="op must be hvd.Average or hvd.Sum"):
        distributed(keras3, None, op="max")
    opt = distributed(keras3, None)
    opt.build([keras.Variable(np.zeros(3, np.float32))])
    with pytest.raises(ValueError, match="Unknown variable"):
        opt.apply([tf.ones(3)], [keras.Variable(np.zeros(3, np.float32))])


def test_xla_is_refused_with_instructions(keras3):
    import keras

    model = workload.make_model(keras)
    model.compile(optimizer=distributed(keras3, None), loss="mse", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(np.zeros((4, workload.FEATURES)), np.zeros((4, workload.CLASSES)), verbose=0)


def test_keras3_optimizer_under_keras2_is_refused_with_instructions():
    import keras

    import hvd_compress.keras as hvd

    assert not hvd.KERAS3
    with pytest.raises(TypeError, match="a Keras 3 optimizer, but tf.keras is Keras 2.*TF_USE_LEGACY_KERAS"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))


def test_other_keras_backend_is_refused_with_instructions(keras3, monkeypatch):
    """What ``import hvd_compress.keras`` raises with KERAS_BACKEND=torch (a subprocess would import
    TensorFlow, Keras and torch: half a minute)."""
    import keras

    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(ImportError, match="needs Keras's TensorFlow backend, but KERAS_BACKEND is 'torch'"):
        keras3.check_backend()
