"""Keras callbacks of ``hvd_compress.keras``: compression statistics and the DGC density warm-up.

In-process fits use a world of one rank (``SingleProcessCommunicator``); the
example runs on 2 processes under ``horovodrun --gloo``.
"""

from __future__ import annotations

import csv
import math
import os
import re

import numpy as np
import pytest

from tests.distributed import launch

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # these fits use Keras 2; tests/routes/test_keras3.py runs Keras 3
try:
    import tensorflow as tf

    import hvd_compress.keras as hvd
except ImportError as error:
    if os.environ.get("HVD_COMPRESS_REQUIRE_HOROVOD") == "1":
        raise
    pytest.skip(f"hvd_compress.keras is not usable here: {error}", allow_module_level=True)

from hvd_compress import FP16, DensityWarmup, NoneCompressor, TernGrad, TopK  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.kernels.reference import num_selected  # noqa: E402
from hvd_compress.keras.callbacks import CompressionStatsCallback, DensityWarmupCallback  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SAMPLES, BATCH = 256, 32
STEPS = SAMPLES // BATCH
STATS = ["compression_bytes", "compression_dense_bytes", "compression_savings", "compression_density"]


@pytest.fixture(scope="module", autouse=True)
def _horovod():
    hvd.init()  # a world of one without horovodrun; the exchange uses SingleProcessCommunicator


def fit(compressor, callbacks, epochs, momentum=0.0):
    """Fit a 128-64-4 perceptron with ``compressor`` and ``callbacks(optimizer)``; (History, model)."""
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 128)).astype(np.float32)
    y = rng.integers(0, 4, SAMPLES)
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(64, activation="relu", input_shape=(128,)), tf.keras.layers.Dense(4)]
    )
    opt = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(0.05, momentum=momentum),
        compression=compressor,
        communicator=SingleProcessCommunicator(),
    )
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, verbose=0, callbacks=callbacks(opt))
    return history, model


def sizes(model):
    return [int(np.prod(v.shape)) for v in model.trainable_variables]


#: Bytes of the layout check of one fused exchange (per dtype), sent once when its plan is built:
#: the int64 config and layout hashes; it counts as sent (it is handed to an allgather). Each step
#: then sends, beside the values and indices, a flag and its position per sparse tensor (8 bytes).
LAYOUT_CHECK = 16


def test_stats_reach_history_and_csv_with_exact_bytes(tmp_path):
    """Top-k at 1%, every tensor sparse: k float32 values + k int32 indices per tensor and step, a flag
    and its position per tensor, and the exchange's layout check once (the first epoch)."""
    topk = TopK(0.01, dense_below=0)
    csv_path = tmp_path / "log.csv"
    history, model = fit(
        topk, lambda opt: [CompressionStatsCallback(opt), tf.keras.callbacks.CSVLogger(str(csv_path))], 2
    )
    logs = history.history
    sent = sum(num_selected(n, 0.01) for n in sizes(model))
    numel = sum(sizes(model))
    step = 8 * sent + 8 * len(sizes(model))
    for epoch in range(2):  # reset each epoch: both epochs count STEPS steps, the first the layout check
        sent_bytes = STEPS * step + (LAYOUT_CHECK if epoch == 0 else 0)
        assert logs["compression_bytes"][epoch] == sent_bytes
        assert logs["compression_dense_bytes"][epoch] == STEPS * 4 * numel
        assert logs["compression_savings"][epoch] == pytest.approx(STEPS * 4 * numel / sent_bytes)
        assert logs["compression_density"][epoch] == pytest.approx(sent / numel)
    assert logs["compression_savings"][0] > 40
    assert logs["compression_density"][0] == pytest.approx(0.01, rel=0.05)

    # the residual norm is that of the residuals left at the end of the last epoch
    names = list(topk.state_dict()["tensors"])  # the fused bucket's state written back per tensor
    expected = math.sqrt(sum(float(np.sum(np.square(topk.residual(n)))) for n in names))
    assert len(names) == 4
    assert 0 < logs["compression_residual_norm"][-1] == pytest.approx(expected, rel=1e-6)
    assert all(np.isfinite(logs["compression_residual_norm"]))

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert int(float(rows[1]["compression_bytes"])) == STEPS * step
    assert float(rows[1]["compression_residual_norm"]) > 0


def test_stats_from_model_optimizer_with_dense_small_tensors():
    """No argument: the callback takes ``model.optimizer.compression``; biases and the 256-element
    output layer (under dense_below=1024) travel dense, 4 bytes per element (with the flags and the
    layout check)."""
    topk = TopK(0.01)
    history, model = fit(topk, lambda opt: [CompressionStatsCallback()], 1)
    large = [n for n in sizes(model) if n >= 1024]
    small = [n for n in sizes(model) if n < 1024]
    sent = sum(num_selected(n, 0.01) for n in large)
    step = 8 * sent + 8 * len(large) + 4 * sum(small)
    assert history.history["compression_bytes"] == [STEPS * step + LAYOUT_CHECK]
    assert history.history["compression_density"][0] == pytest.approx((sent + sum(small)) / sum(sizes(model)))
    assert history.history["compression_savings"][0] > 1


def test_stats_without_residuals():
    """TernGrad (no error feedback): every entry sent as a 2-bit code, no residual norm logged."""
    history, _ = fit(TernGrad(), lambda opt: [CompressionStatsCallback(opt)], 1)
    logs = history.history
    assert set(STATS) <= set(logs)
    assert "compression_residual_norm" not in logs
    assert logs["compression_density"] == [1.0]
    assert logs["compression_savings"][0] > 5
    assert np.isfinite(logs["loss"][0])


def test_density_warmup_follows_the_schedule_and_restores_the_target():
    topk = TopK(0.01, dense_below=0)
    warmup = DensityWarmupCallback(topk, warmup_epochs=2, start=0.25)
    history, model = fit(topk, lambda opt: [warmup, CompressionStatsCallback(topk)], 3)
    ratios = history.history["compression_ratio"]
    assert ratios == pytest.approx([0.25, 0.25 * (0.01 / 0.25) ** 0.5, 0.01])  # 0.25, 0.05, 0.01
    assert topk.ratio == 0.01
    numel = sum(sizes(model))
    for ratio, density in zip(ratios, history.history["compression_density"]):  # the compressor used it
        assert density == pytest.approx(sum(num_selected(n, ratio) for n in sizes(model)) / numel)
    savings = history.history["compression_savings"]
    assert savings[0] < savings[1] < savings[2]


def test_density_warmup_matches_deep_gradient_compression():
    """Lin et al. 2018: 25%, 6.25%, 1.5625%, 0.39% over four epochs (target 0.25**5, about 0.1%);
    the DGC code's factor target ** (1 / (W + 1)) per epoch is start = target ** (1 / 5)."""
    paper = DensityWarmupCallback(TopK(0.25**5), warmup_epochs=4, start=0.25)
    assert [paper.density(e) for e in range(6)] == pytest.approx(
        [0.25, 0.0625, 0.015625, 0.00390625, 0.25**5, 0.25**5]
    )
    code = DensityWarmupCallback(TopK(0.001), warmup_epochs=4, start=0.001 ** (1 / 5))
    assert [code.density(e) for e in range(6)] == pytest.approx(
        [0.001 ** ((e + 1) / 5) for e in range(5)] + [0.001]
    )
    dense_start = DensityWarmupCallback(TopK(0.01), warmup_epochs=2, start=1.0)
    assert [dense_start.density(e) for e in range(3)] == pytest.approx([1.0, 0.1, 0.01])
    assert DensityWarmupCallback(TopK(0.01), warmup_epochs=0).density(0) == 0.01


def test_density_warmup_callback_and_schedule_share_the_formula():
    """Epoch e of the callback is step e of the framework-free DensityWarmup schedule."""
    callback = DensityWarmupCallback(TopK(0.001), warmup_epochs=3, start=0.5)
    schedule = DensityWarmup(TopK(0.001), warmup_steps=3, start=0.5)
    assert [callback.density(e) for e in range(5)] == [schedule.density_at(e) for e in range(5)]


@pytest.mark.parametrize("compressor", [TernGrad(), FP16(), NoneCompressor()], ids=repr)
def test_density_warmup_needs_a_ratio(compressor):
    with pytest.raises(TypeError, match=type(compressor).__name__):
        DensityWarmupCallback(compressor)


def test_density_warmup_from_model_optimizer_checks_at_train_begin():
    with pytest.raises(TypeError, match="TernGrad"):
        fit(TernGrad(), lambda opt: [DensityWarmupCallback()], 1)


@pytest.mark.parametrize(
    "options",
    [
        {"warmup_epochs": -1},
        {"warmup_epochs": 2.5},
        {"start": 0.0},
        {"start": 1.5},
        {"start": float("nan")},
        {"start": 0.001},  # below the target 0.01: nothing to warm up
    ],
    ids=str,
)
def test_density_warmup_rejects_bad_numbers(options):
    with pytest.raises(ValueError, match="hvd_compress"):
        DensityWarmupCallback(TopK(0.01), **options)


@pytest.mark.parametrize("callback", [CompressionStatsCallback, DensityWarmupCallback])
def test_callbacks_need_one_of_our_compressors(callback):
    import horovod.tensorflow.keras as horovod_keras

    for wrong in [object(), tf.keras.optimizers.SGD(0.1), horovod_keras.Compression.fp16]:
        with pytest.raises(TypeError, match="compressor"):
            callback(wrong)


def test_horovod_callbacks_work_with_keras_2():
    """Horovod's metric averaging and learning-rate warm-up run on tf.keras's backend; momentum
    correction, impossible with a momentum fixed at trace time, is turned off with a warning."""
    callbacks = lambda opt: [  # noqa: E731
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.05, warmup_epochs=1, verbose=0),
        CompressionStatsCallback(opt),
    ]
    with pytest.warns(UserWarning, match="momentum correction is off"):
        history, _ = fit(TopK(0.01), callbacks, 2, momentum=0.9)
    assert history.history["lr"] == pytest.approx([0.05, 0.05])
    assert all(np.isfinite(history.history["loss"]))
    assert history.history["compression_savings"][1] > 1


#: Seconds a 2-process Keras fit may take to end after its last epoch's line: Horovod's shutdown, the
#: interpreter's exit and the launcher's (a few seconds on a loaded 2-core machine, dense or sparse).
#: A rank that waits on a collective its peer never joins ends at Gloo's 30 s timeout, past this.
EXIT_SECONDS = 20


def test_example_trains_under_horovodrun_and_reports_bytes():
    """2 ranks, 2 short epochs: a density warm-up (25%, then 1%) that both ranks follow; Top-k's
    processes end within :data:`EXIT_SECONDS` of the last epoch's line (no lingering at exit)."""
    launch.require("horovod.tensorflow.keras")
    done, exit_seconds = launch.run_timing_exit(
        "horovodrun",
        2,
        "examples.keras_train",
        "--compression",
        "topk",
        "--ratio",
        "0.01",
        "--epochs",
        "2",
        "--warmup-epochs",
        "1",
        "--train-samples",  # 4 steps an epoch per rank: enough for the warm-up and the byte counts
        "256",
        after="epoch 2:",
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, launch.output(done)
    assert exit_seconds < EXIT_SECONDS, f"the ranks took {exit_seconds:.1f} s to exit after the last epoch"
    epochs = re.findall(
        r"epoch (\d): loss (\S+)  accuracy \S+  test accuracy \S+  sent ([\d.]+) MiB vs dense ([\d.]+) MiB "
        r"\(([\d.]+)x less, density ([\d.]+)\)\s+(?:\[0\]<stdout>:)?\s*density setting ([\d.]+)",
        output,
    )
    assert [e[0] for e in epochs] == ["1", "2"], launch.output(done)
    for _, loss, sent, dense, savings, _, _ in epochs:
        assert math.isfinite(float(loss)), f"loss {loss}"
        assert 0 < float(sent) < float(dense)
    assert [float(e[6]) for e in epochs] == [0.25, 0.01]
    assert float(epochs[1][4]) > 20, f"only {epochs[1][4]}x fewer bytes than dense at 1%"


def test_density_warmup_callback_has_auto_measure_again_at_the_target_epoch(monkeypatch):
    from hvd_compress import Auto

    auto = Auto(TopK(0.01), log=False)
    calls = []
    monkeypatch.setattr(auto, "remeasure", lambda: calls.append(auto.ratio))
    warmup = DensityWarmupCallback(auto, warmup_epochs=2, start=0.25)
    for epoch in range(4):
        warmup.on_epoch_begin(epoch)
    assert calls == [0.01]
