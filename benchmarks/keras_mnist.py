"""Horovod's ``tensorflow2_keras_mnist.py`` with ``hvd_compress.keras``, on Fashion-MNIST: the Keras
and Adam recipe of docs/keras.md, measured.

    horovodrun -np 2 --gloo python -m benchmarks.keras_mnist --compression none
    horovodrun -np 2 --gloo python -m benchmarks.keras_mnist --compression regtopk --ratio 0.01
    horovodrun -np 2 --gloo python -m benchmarks.keras_mnist --compression regtopk --ratio 0.01 --recipe

The model, optimizer and callbacks are those of Horovod v0.28.1's
``examples/tensorflow2/tensorflow2_keras_mnist.py``: two convolutions, max
pooling, dropout, a 9216-128 dense layer (1.18 M of the model's 1.2 M weights)
and a softmax; ``Adam(0.001 * size)``; ``BroadcastGlobalVariablesCallback(0)``,
``MetricAverageCallback()`` and ``LearningRateWarmupCallback(initial_lr=0.001 *
size, warmup_epochs=3)``; batches of 128 shuffled from a buffer of 10,000, every
rank drawing from the whole training set. The example downloads MNIST; here the
images are Fashion-MNIST's (Debian's ``dataset-fashion-mnist``,
ci/install_fashion_mnist.sh), pixels divided by 255 as the example does. Its
``DistributedOptimizer`` is ``hvd_compress.keras``'s with ``--compression``.

``--recipe`` adds what docs/keras.md tells Adam users to add to a sparsifier:
``dense_below`` (``--dense-below``, default 100,000 entries: every tensor but the
big dense layer goes dense) and a density warm-up that starts dense
(``DensityWarmupCallback(opt, warmup_epochs=2, start=1.0)``: epochs at 100%,
10%, then the target 1%). The compressor keeps ``momentum=0``: Adam's
``beta_1`` is the momentum.

Rank 0 prints one JSON line: the arguments and, per epoch, the training loss and
accuracy (averaged over ranks, as the example's logs), the density of each epoch
under a warm-up, and the test accuracy of the final model on the 10,000 test images.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from benchmarks.datasets import FASHION_MNIST_FILES, fashion_mnist_folder, find_idx, read_idx  # noqa: E402

#: docs/keras.md's recipe: tensors below this many entries go dense (all but the 9216x128 kernel)
RECIPE_DENSE_BELOW = 100_000


def fashion_mnist(folder=None):
    """``(train_x, train_y, test_x, test_y)``: images ``N x 28 x 28 x 1`` in [0, 1], labels int64."""
    where = fashion_mnist_folder(folder)
    arrays = {}
    for key, stem in FASHION_MNIST_FILES.items():
        path = find_idx(where, stem)
        if path is None:
            raise FileNotFoundError(f"Fashion-MNIST's {stem} is not in {where}: run ci/install_fashion_mnist.sh")
        arrays[key] = read_idx(path)
    scale = lambda x: (x[..., None] / 255.0).astype(np.float32)  # noqa: E731
    return (scale(arrays["train_x"]), arrays["train_y"].astype(np.int64),
            scale(arrays["test_x"]), arrays["test_y"].astype(np.int64))


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compression", choices=["none", "topk", "regtopk", "gaussiank"], default="none")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--recipe", action="store_true", help="docs/keras.md's additions (dense_below, warm-up)")
    parser.add_argument("--dense-below", type=int, default=None,
                        help="default: the library's, or 100,000 with --recipe")
    parser.add_argument("--density-warmup-epochs", type=int, default=None, help="default 0, or 2 with --recipe")
    parser.add_argument("--start", type=float, default=None,
                        help="warm-up start density; default 0.25, 1.0 with --recipe")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=100, help="over all ranks (the example: 500)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="rank 0 saves checkpoint-{epoch}.h5 there each epoch, as the example does")
    args = parser.parse_args(argv)
    if args.dense_below is None and args.recipe:
        args.dense_below = RECIPE_DENSE_BELOW
    if args.density_warmup_epochs is None:
        args.density_warmup_epochs = 2 if args.recipe else 0
    if args.start is None:
        args.start = 1.0 if args.recipe else 0.25
    return args


def main(argv=None) -> None:
    args = arguments(argv)
    import tensorflow as tf

    import hvd_compress.keras as hvd
    from hvd_compress import Compression

    hvd.init()
    tf.keras.utils.set_random_seed(args.seed + hvd.rank())  # the broadcast gives every rank rank 0's weights
    train_x, train_y, test_x, test_y = fashion_mnist(args.data_dir)
    dataset = tf.data.Dataset.from_tensor_slices((train_x, train_y)).repeat().shuffle(10000, seed=args.seed
                                                                                       + hvd.rank()).batch(128)
    model = tf.keras.Sequential([
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(32, [3, 3], activation="relu"),
        tf.keras.layers.Conv2D(64, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.001 * hvd.size()
    options = {} if args.dense_below is None else {"dense_below": args.dense_below}
    compression = None if args.compression == "none" else Compression.by_name(args.compression, args.ratio, **options)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(scaled_lr), compression=compression)
    compile_options = {"jit_compile": False} if hvd.KERAS3 else {}
    model.compile(loss=tf.keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"],
                  **compile_options)
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=0),
    ]
    if compression is not None and args.density_warmup_epochs:
        callbacks.append(hvd.callbacks.DensityWarmupCallback(opt, args.density_warmup_epochs, start=args.start))
    if args.checkpoint_dir and hvd.rank() == 0:
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoint_dir, "checkpoint-{epoch}.h5")))
    began = time.perf_counter()
    history = model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(), callbacks=callbacks,
                        epochs=args.epochs, verbose=0)
    seconds = time.perf_counter() - began
    _, test_accuracy = model.evaluate(test_x, test_y, batch_size=1000, verbose=0)
    if hvd.rank() == 0:
        result = {
            "args": vars(args), "ranks": hvd.size(), "seconds": round(seconds, 1),
            "loss": [round(float(v), 4) for v in history.history["loss"]],
            "accuracy": [round(float(v), 4) for v in history.history["accuracy"]],
            "test_accuracy": round(float(test_accuracy), 4),
            "density": [round(float(v), 6) for v in history.history.get("compression_ratio", [])],
        }
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
