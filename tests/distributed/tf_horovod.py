"""Trains a small Keras model a few steps with Horovod's TensorFlow API and each compressor.

Run by the tests under ``horovodrun --gloo``: one job runs every scenario given with
``--scenario LABEL=PATH:NAME,NAME[:OPTION...]``, one after the other (the start-up of a TF job and
AutoGraph's first conversion of the exchange cost more than the scenarios themselves). ``PATH``:
``tape`` (stock ``horovod.tensorflow.DistributedGradientTape(tape, compression=...)``),
``tape-dropin`` (``hvd_compress.tensorflow.DistributedGradientTape``), ``keras`` (stock
``horovod.tensorflow.keras.DistributedOptimizer`` in ``model.fit``) or ``keras-dropin``
(``hvd_compress.keras.DistributedOptimizer``). ``OPTION``: ``eager`` (tape paths: no
``tf.function``), ``rank1-nan`` (NaN data on rank 1), ``rank1-ratio=R`` or
``rank1-compression=NAME`` (rank 1 misconfigured: the scenario must raise on every rank).

Rank 0 writes the final weights (``LABEL/NAME/wI``) and the bytes each rank handed to our
collectives per step (``wire``: JSON, per label and name) to ``--out`` (an ``.npz``). A scenario
that raises ``ValueError`` or a TensorFlow ``OpError`` writes ``OUT.LABEL.error.RANK`` on each rank
that raised, then the ranks meet at a barrier and go on with the next scenario; :func:`simulate`
computes the same training in one process with the :class:`~hvd_compress.simulator.Simulator`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Dict, List

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_compress import Compression  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402

RATIO = 0.05
LR = 0.1
BATCH = 16


def make_model() -> tf.keras.Model:
    init = tf.keras.initializers.GlorotUniform
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(128, activation="relu", kernel_initializer=init(seed=1)),
            tf.keras.layers.Dense(10, kernel_initializer=init(seed=2)),
        ]
    )
    model.build((None, 64))
    return model


def data(rank: int, steps: int):
    """Rank ``rank``'s batches, a different stream per rank."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((steps * BATCH, 64)).astype(np.float32)
    y = rng.integers(0, 10, steps * BATCH).astype(np.int64)
    return x, y


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compressor(name: str):
    return Compression.by_name(name, RATIO)


def weights(model: tf.keras.Model) -> Dict[str, np.ndarray]:
    return {f"w{i}": v.numpy() for i, v in enumerate(model.trainable_variables)}


def simulate(name: str, ranks: int, steps: int) -> Dict[str, np.ndarray]:
    """The same training on the in-process simulator (TF tensors, so the same kernels and draws)."""
    model = make_model()
    sim = Simulator(ranks, compressor(name))
    sets = [data(r, steps) for r in range(ranks)]
    for step in range(steps):
        grads: Dict[str, List[tf.Tensor]] = {f"w{i}": [] for i in range(len(model.trainable_variables))}
        for x, y in sets:
            batch = slice(step * BATCH, (step + 1) * BATCH)
            with tf.GradientTape() as tape:
                loss = LOSS(y[batch], model(x[batch], training=True))
            for i, g in enumerate(tape.gradient(loss, model.trainable_variables)):
                grads[f"w{i}"].append(g)
        averaged = sim.step(grads)
        for i, v in enumerate(model.trainable_variables):
            v.assign_sub(LR * averaged[f"w{i}"])
    return weights(model)


class ByteCounter:
    """Sums the bytes our communicator hands to Horovod collectives."""

    def __init__(self) -> None:
        from hvd_compress.comm.horovod_tf import HorovodTensorFlowCommunicator as comm

        self.bytes = 0
        for attr in ("allreduce_async", "allgather_async"):
            setattr(comm, attr, self._counting(getattr(comm, attr)))

    def _counting(self, method):
        def wrapper(this, tensor, *args, **kwargs):
            self.bytes += tensor.shape.num_elements() * tensor.dtype.size  # static: AutoGraph may trace this
            return method(this, tensor, *args, **kwargs)

        return wrapper


def train_tape(compression, args: argparse.Namespace) -> tf.keras.Model:
    import horovod.tensorflow as hvd

    import hvd_compress.tensorflow as hvd_compress_tf

    model = make_model()
    x, y = data(hvd.rank(), args.steps)
    if hvd.rank() == 1 and args.rank1_nan:
        x = x * np.float32("nan")
    wrap = (
        hvd_compress_tf.DistributedGradientTape if args.path == "tape-dropin" else hvd.DistributedGradientTape
    )

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        tape = wrap(tape, compression=compression)
        for v, g in zip(model.trainable_variables, tape.gradient(loss, model.trainable_variables)):
            v.assign_sub(LR * g)

    step = step if args.eager else tf.function(step)
    for s in range(args.steps):
        step(x[s * BATCH : (s + 1) * BATCH], y[s * BATCH : (s + 1) * BATCH])
    return model


def train_keras(compression, args: argparse.Namespace) -> tf.keras.Model:
    import horovod.tensorflow.keras as hvd

    if args.path == "keras-dropin":
        import hvd_compress.keras as hvd_compress_keras

        wrap = hvd_compress_keras.DistributedOptimizer
    else:
        wrap = hvd.DistributedOptimizer
    model = make_model()
    model.compile(optimizer=wrap(tf.keras.optimizers.SGD(LR), compression=compression), loss=LOSS)
    x, y = data(hvd.rank(), args.steps)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


PATHS = ["tape", "tape-dropin", "keras", "keras-dropin"]


def parse_scenario(text: str) -> argparse.Namespace:
    """``LABEL=PATH:NAME,NAME[:OPTION...]`` (see the module docstring) as the options of one run."""
    label, _, spec = text.partition("=")
    path, names, *options = spec.split(":")
    if path not in PATHS or not label or not names:
        raise argparse.ArgumentTypeError(f"bad scenario {text!r}")
    run = argparse.Namespace(
        label=label, path=path, names=names.split(","), eager=False, rank1_nan=False,
        rank1_ratio=None, rank1_compression=None,
    )
    for option in options:
        key, _, value = option.partition("=")
        if key == "eager":
            run.eager = True
        elif key == "rank1-nan":
            run.rank1_nan = True
        elif key == "rank1-ratio":
            run.rank1_ratio = float(value)
        elif key == "rank1-compression":
            run.rank1_compression = value
        else:
            raise argparse.ArgumentTypeError(f"bad option {option!r} in scenario {text!r}")
    return run


def run_scenario(run: argparse.Namespace, steps: int, counter: ByteCounter, hvd):
    """Trains each of ``run.names``; (final weights by ``NAME/wI``, bytes per step by name)."""
    run.steps = steps
    arrays, wire = {}, {}
    for name in run.names:
        compression = compressor(run.rank1_compression if hvd.rank() == 1 and run.rank1_compression else name)
        if hvd.rank() == 1 and run.rank1_ratio is not None:
            compression.ratio = run.rank1_ratio
        counter.bytes = 0
        model = (train_keras if run.path.startswith("keras") else train_tape)(compression, run)
        for key, value in weights(model).items():
            arrays[f"{name}/{key}"] = value
        wire[name] = hvd.allgather_object(counter.bytes // steps)
    return arrays, wire


def main() -> None:
    import horovod.tensorflow as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", type=parse_scenario, action="append", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    counter = ByteCounter()
    arrays, wire = {}, {}
    for run in args.scenario:
        try:
            trained, wire[run.label] = run_scenario(run, args.steps, counter, hvd)
        except (ValueError, tf.errors.OpError) as error:
            Path(f"{args.out}.{run.label}.error.{hvd.rank()}").write_text(str(error))
            hvd.allgather_object(run.label, name=f"after_{run.label}")  # both ranks got here
            continue
        arrays.update({f"{run.label}/{key}": value for key, value in trained.items()})
    if hvd.rank() == 0:
        np.savez(args.out, **arrays, wire=json.dumps(wire), size=hvd.size())


if __name__ == "__main__":
    main()
