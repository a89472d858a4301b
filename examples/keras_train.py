"""Train a small CNN with compressed gradients on several ranks (Keras ``model.fit`` + Horovod).

    horovodrun -np 2 --gloo python examples/keras_train.py --compression regtopk --ratio 0.01
    horovodrun -np 2 --gloo python examples/keras_train.py --compression topk --ratio 0.001 --warmup-epochs 2

The data are scikit-learn's bundled 8x8 handwritten digits (as in
examples/pytorch_train.py; ``pip install scikit-learn``, no download): 1,437
images to train, 360 to test; each rank trains on its own shard. The optimizer is
``hvd_compress.keras.DistributedOptimizer`` (fused compressed exchange); the
callbacks broadcast rank 0's initial weights, average the metrics over ranks,
optionally warm the density up as Deep Gradient Compression does
(``--warmup-epochs``), and log the compression statistics. Rank 0 prints, per
epoch, the loss and accuracy (averaged over ranks), the test accuracy and the
bytes its compressor put on the wire against dense float32 gradients.

It runs with TensorFlow's ``tf.keras``: Keras 3 by default, Keras 2 (``tf_keras``)
with ``TF_USE_LEGACY_KERAS=1`` in the environment; the model is compiled with
``jit_compile=False`` (the compressed exchange cannot run under XLA).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hvd_compress.keras as hvd  # noqa: E402
from hvd_compress import Compression  # noqa: E402


def digits():
    """scikit-learn's 1,797 handwritten 8x8 digits, pixels scaled to [0, 1], shuffled with a fixed
    seed: ``(train_x, train_y, test_x, test_y)``, images ``N x 8 x 8 x 1`` (channels last)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = (data.images[order] / 16.0).astype(np.float32)[..., None]
    y = data.target[order].astype(np.int64)
    return x[:1437], y[:1437], x[1437:], y[1437:]


def build_model() -> tf.keras.Model:
    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            tf.keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )


class PrintEpoch(tf.keras.callbacks.Callback):
    """Rank 0's per-epoch line: loss, accuracy, test accuracy, bytes sent vs dense."""

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        mib = 2.0**20
        line = (
            f"epoch {epoch + 1}: loss {logs['loss']:.4f}  accuracy {logs['accuracy']:.3f}  "
            f"test accuracy {logs['val_accuracy']:.3f}  "
            f"sent {logs['compression_bytes'] / mib:.2f} MiB vs dense "
            f"{logs['compression_dense_bytes'] / mib:.2f} MiB "
            f"({logs['compression_savings']:.1f}x less, density {logs['compression_density']:.4f})"
        )
        if "compression_ratio" in logs:
            line += f"\n  density setting {logs['compression_ratio']:.4f}"
        if "compression_residual_norm" in logs:
            line += f"\n  residual norm {logs['compression_residual_norm']:.4f}"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-samples", type=int, help="train on the first N images only (default: all)")
    parser.add_argument(
        "--warmup-epochs", type=int, default=0, help="DGC density warm-up epochs (sparsifiers; 0: none)"
    )
    parser.add_argument("--warmup-start", type=float, default=0.25, help="density of the first epoch")
    args = parser.parse_args()

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    tf.keras.utils.set_random_seed(0)

    train_x, train_y, test_x, test_y = digits()
    train_x, train_y = train_x[: args.train_samples], train_y[: args.train_samples]
    shard = slice(hvd.rank(), len(train_y) - len(train_y) % hvd.size(), hvd.size())  # equal step counts
    train_x, train_y = train_x[shard], train_y[shard]

    compression = Compression.by_name(args.compression, args.ratio)
    optimizer = hvd.DistributedOptimizer(
        tf.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9), compression=compression
    )
    model = build_model()
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),  # before ours: they log this rank's own numbers
    ]
    if args.warmup_epochs:
        callbacks.append(
            hvd.callbacks.DensityWarmupCallback(
                optimizer, warmup_epochs=args.warmup_epochs, start=args.warmup_start
            )
        )
    callbacks.append(hvd.callbacks.CompressionStatsCallback(optimizer))
    if hvd.rank() == 0:
        callbacks.append(PrintEpoch())
        print(f"{hvd.size()} ranks, {hvd.KERAS} model.fit, compression {compression!r}", flush=True)

    model.fit(
        train_x,
        train_y,
        batch_size=args.batch_size,
        epochs=args.epochs,
        shuffle=True,
        validation_data=(test_x, test_y),
        callbacks=callbacks,
        verbose=0,
    )


if __name__ == "__main__":
    main()
