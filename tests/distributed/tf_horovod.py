"""Trains a small Keras model a few steps with Horovod's TensorFlow API and each compressor.

Run by the tests under ``horovodrun --gloo``: one job runs every scenario given with
``--scenario LABEL=PATH:NAME,NAME[:OPTION...]``, one after the other (the start-up of a TF job and
AutoGraph's first conversion of the exchange cost more than the scenarios themselves). ``PATH``:
``tape`` (stock ``horovod.tensorflow.DistributedGradientTape(tape, compression=...)``),
``tape-dropin`` (``hvd_compress.tensorflow.DistributedGradientTape``), ``keras`` (stock
``horovod.tensorflow.keras.DistributedOptimizer`` in ``model.fit``) or ``keras-dropin``
(``hvd_compress.keras.DistributedOptimizer``). ``OPTION``: ``eager`` (tape paths: no
``tf.function``), ``rank1-nan`` (NaN data on rank 1), ``rank1-ratio=R`` or
``rank1-compression=NAME`` (rank 1 misconfigured: the scenario must raise on every rank),
``switch`` (tape paths: the dense-switch probe, :func:`train_switch`, instead of the model),
``allreduce`` (path ``tape``, with ``eager``: a plain tape, each gradient averaged by
``hvd.allreduce(g, name=..., compression=...)``; with ``groups=1`` too, all of them by one
``hvd.grouped_allreduce(grads, name=..., compression=...)``), ``groups=G`` (stock paths: Horovod's
``groups=G``, the gradients allreduced in ``G`` groups).

Rank 0 writes the final weights (``LABEL/NAME/wI``), the bytes each rank handed to our
collectives per step and, in all, to every collective next to what ``compressor.stats`` counted,
and the stock route's exchanges (``wire``: JSON, per label and name) to ``--out`` (an ``.npz``). A scenario
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
from tests.distributed import switch_probe as probe  # noqa: E402

RATIO = 0.05
LR = 0.1
BATCH = 16


def make_model() -> tf.keras.Model:
    init = tf.keras.initializers.GlorotUniform
    model = tf.keras.Sequential(
        [
            tf.keras.layers.Dense(128, activation="relu", kernel_initializer=init(seed=1)),
            tf.keras.layers.Dense(128, activation="relu", kernel_initializer=init(seed=3)),
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
    """``topk``...; ``<sparsifier>-leader``, ``-aggregate``: with that shared index set (``indices=``);
    ``-reuse``: reused thresholds between exact selections every other step (``exact_every=2``)."""
    base, _, indices = name.partition("-")
    option = {"exact_every": 2} if indices == "reuse" else {"indices": indices} if indices else {}
    return Compression.by_name(base, RATIO, **option)


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
    """Sums the bytes our communicator hands to Horovod collectives (``bytes``) and, apart, those
    Horovod's own allreduce moves for the stock route (``horovod``: the gradients None, FP16 and
    small tensors hand it, the placeholders), counted each time they run (in a graph: by an op), and
    the stock route's exchanges (``exchanged``: each one's number of tensors, in order)."""

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        from hvd_compress.horovod import tensorflow_hooks as horovod_tf
        from hvd_compress.horovod.tensorflow_hooks import HorovodTensorFlowCommunicator as comm

        self.bytes = self.horovod = 0
        self.exchanged: List[int] = []
        horovod_tf.exchange = self._exchanges(horovod_tf.exchange)
        self.ours = False  # inside our communicator's call (which runs Horovod's allreduce itself)
        for attr in ("allreduce_async", "allgather_async"):
            setattr(comm, attr, self._counting(getattr(comm, attr)))
        comm.wait = self._ours(comm.wait)  # runs the collectives queued by the two above
        hvd._allreduce = self._counting_horovod(hvd._allreduce)
        hvd._grouped_allreduce = self._counting_horovod(hvd._grouped_allreduce)  # Horovod's groups= (a list)

    def _counting(self, method):
        ours = self._ours(method)

        def wrapper(this, tensor, *args, **kwargs):
            if isinstance(tensor, np.ndarray):  # an exchange computing on the host
                self.bytes += tensor.nbytes
            else:  # static: AutoGraph may trace this
                self.bytes += tensor.shape.num_elements() * tensor.dtype.size
            return ours(this, tensor, *args, **kwargs)

        return wrapper

    def _exchanges(self, function):
        def wrapper(compressor, comm, key, named, *args, **kwargs):
            self.exchanged.append(len(named))
            return function(compressor, comm, key, named, *args, **kwargs)

        return wrapper

    def _ours(self, method):
        def wrapper(this, *args, **kwargs):
            self.ours = True
            try:
                return method(this, *args, **kwargs)
            finally:
                self.ours = False

        return wrapper

    def _counting_horovod(self, function):
        def add(nbytes):
            self.horovod += nbytes
            return 0

        def wrapper(tensors, *args, **kwargs):
            result = function(tensors, *args, **kwargs)
            if self.ours:
                return result
            nbytes = sum(t.shape.num_elements() * t.dtype.size for t in tf.nest.flatten(tensors))
            if tf.executing_eagerly():
                add(nbytes)
                return result
            with tf.control_dependencies([tf.py_function(lambda: add(nbytes), [], tf.int32)]):
                return tf.nest.map_structure(tf.identity, result)

        return wrapper


def train_switch(compression, args: argparse.Namespace, hvd) -> float:
    """The dense-switch probe (:mod:`tests.distributed.switch_probe`) on a tape path: how far the
    weights are from ``w0 - lr x`` the sum of the mean gradients (relative; 0: nothing lost)."""
    w = tf.Variable(tf.zeros([probe.SIZE]))
    rows = probe.gradients(hvd.rank())
    if args.path == "tape-dropin":
        import hvd_compress.tensorflow as hvd_compress_tf

        wrap = hvd_compress_tf.DistributedGradientTape
    else:
        wrap = hvd.DistributedGradientTape

    @tf.function
    def step(row):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * row)
        (g,) = wrap(tape, compression=compression).gradient(loss, [w])
        w.assign_sub(probe.LR * g)

    for s, row in enumerate(rows):
        compression.ratio = probe.ratio(s)
        step(tf.constant(row))
    return probe.relative_error(-w.numpy(), hvd.size())


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

    grouping = {} if args.groups is None else {"groups": args.groups}

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = LOSS(yb, model(xb, training=True))
        if args.allreduce and args.groups:  # all by hand in one call, named: "grads.<i>" each
            grads = hvd.grouped_allreduce(tape.gradient(loss, model.trainable_variables), name="grads",
                                          compression=compression)
        elif args.allreduce:  # each gradient by hand, named: its residual carries from call to call
            grads = [hvd.allreduce(g, name=f"grad{i}", compression=compression)
                     for i, g in enumerate(tape.gradient(loss, model.trainable_variables))]
        else:
            grads = wrap(tape, compression=compression, **grouping).gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
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
    grouping = {} if args.groups is None else {"groups": args.groups}
    model = make_model()
    model.compile(optimizer=wrap(tf.keras.optimizers.SGD(LR), compression=compression, **grouping), loss=LOSS)
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
        rank1_ratio=None, rank1_compression=None, switch=False, allreduce=False, groups=None,
    )
    for option in options:
        key, _, value = option.partition("=")
        if key == "eager":
            run.eager = True
        elif key == "switch":
            if not path.startswith("tape"):
                raise argparse.ArgumentTypeError(f"switch needs a tape path, in scenario {text!r}")
            run.switch = True
        elif key == "allreduce":
            if path != "tape":
                raise argparse.ArgumentTypeError(f"allreduce needs the tape path, in scenario {text!r}")
            run.allreduce = True
        elif key == "groups":
            if path not in ("tape", "keras"):
                raise argparse.ArgumentTypeError(f"groups needs a stock path, in scenario {text!r}")
            run.groups = int(value)
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
    """Trains each of ``run.names``; (final weights by ``NAME/wI`` or the probe's ``NAME/switch_error``,
    and by name: ``[bytes per step through our communicator, [bytes handed to the collectives in all,
    bytes compressor.stats counted], the number of tensors of each exchange of the stock route]`` per rank)."""
    run.steps = steps
    arrays, wire = {}, {}
    for name in run.names:
        compression = compressor(run.rank1_compression if hvd.rank() == 1 and run.rank1_compression else name)
        if hvd.rank() == 1 and run.rank1_ratio is not None:
            compression.ratio = run.rank1_ratio
        counter.bytes = counter.horovod = 0
        counter.exchanged = []
        if run.switch:
            arrays[f"{name}/switch_error"] = np.float64(train_switch(compression, run, hvd))
        else:
            model = (train_keras if run.path.startswith("keras") else train_tape)(compression, run)
            for key, value in weights(model).items():
                arrays[f"{name}/{key}"] = value
        handed = [counter.bytes + counter.horovod, compression.stats.bytes_sent]
        wire[name] = [hvd.allgather_object(counter.bytes // steps), hvd.allgather_object(handed),
                      hvd.allgather_object(counter.exchanged)]
    return arrays, wire


def main() -> None:
    import horovod.tensorflow as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", type=parse_scenario, action="append", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    parser.add_argument("--collectives", help="first, tf_collectives.check writing COLLECTIVES.<rank>")
    args = parser.parse_args()
    hvd.init()
    if args.collectives:
        from tests.distributed import tf_collectives

        tf_collectives.check(args.collectives)
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
