"""``hvd_compress.keras`` on 2 ranks under Keras 3 or Keras 2: ``fit`` with every callback, a
checkpoint round trip in the middle, and a custom training loop.

Run by tests/routes/test_keras3.py under ``horovodrun --gloo`` with ``--keras 3``
(``TF_USE_LEGACY_KERAS=0`` in the ranks' environment) or ``--keras 2``
(``TF_USE_LEGACY_KERAS=1``). Phases, RegTop-k at 1%:

1. ``fit`` epoch 0 with ``BroadcastGlobalVariablesCallback`` (Keras 3: rank 1
   starts from other weights, so the broadcast matters), ``MetricAverageCallback``,
   ``LearningRateWarmupCallback``, ``DensityWarmupCallback`` (25%, then 1%) and
   ``CompressionStatsCallback``; every rank saves its own checkpoint (Keras 3:
   ``model.save``; Keras 2: ``tf.train.Checkpoint``) and loads it into a new
   model and optimizer, which ``fit`` epoch 1;
2. a custom loop (Keras 3: ``apply_gradients`` in a ``tf.function``, then
   ``apply`` eagerly; Keras 2: ``minimize``, where Horovod averages).

Rank 0 writes to ``--out`` (``.npz``) the final weights of each phase, the
learning rate and density each step used, and every rank's logs;
:func:`simulate` computes the same training with the Simulator.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Any, Dict, List, Sequence

import numpy as np

BATCH, STEPS, FEATURES, CLASSES = 16, 4, 64, 10  # STEPS per epoch, per rank
LR, RATIO, START = 0.1, 0.01, 0.25


def make_model(keras: Any) -> Any:
    """Named layers: Keras 2 keys residuals by variable name, the same in the restored model."""
    init = keras.initializers.GlorotUniform
    model = keras.Sequential(
        [
            keras.layers.Dense(128, activation="relu", kernel_initializer=init(seed=1), name="hidden"),
            keras.layers.Dense(CLASSES, kernel_initializer=init(seed=2), name="logits"),
        ]
    )
    model.build((None, FEATURES))
    return model


def loss_fn(keras: Any) -> Any:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(rank: int):
    """Rank ``rank``'s STEPS batches (one epoch), a different stream per rank."""
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((STEPS * BATCH, FEATURES)).astype(np.float32)
    return x, rng.integers(0, CLASSES, STEPS * BATCH).astype(np.int64)


def compressor() -> Any:
    from hvd_compress import Compression

    return Compression.regtopk(RATIO)


def weights(model: Any) -> List[np.ndarray]:
    return [np.asarray(v.numpy()) for v in model.trainable_variables]


def simulate(keras: Any, lrs: Sequence[float], ratios: Sequence[float], ranks: int = 2) -> Dict[str, Any]:
    """Training on the Simulator with per-step learning rates and densities, from rank 0's weights:
    final ``weights``, each rank's ``bytes`` per step and mean ``losses`` over ranks per step."""
    import tensorflow as tf

    from hvd_compress.simulator import Simulator

    model, loss = make_model(keras), loss_fn(keras)
    sim = Simulator(ranks, compressor())
    sets = [data(rank) for rank in range(ranks)]
    out: Dict[str, Any] = {"bytes": [], "losses": []}
    for step, (lr, ratio) in enumerate(zip(lrs, ratios)):
        grads: Dict[str, List[Any]] = {f"w{i}": [] for i in range(len(model.trainable_variables))}
        losses = []
        for x, y in sets:
            batch = slice(step % STEPS * BATCH, (step % STEPS + 1) * BATCH)
            with tf.GradientTape() as tape:
                value = loss(y[batch], model(x[batch], training=True))
            losses.append(float(value))
            for i, g in enumerate(tape.gradient(value, model.trainable_variables)):
                grads[f"w{i}"].append(g)
        for c in sim.compressors:
            c.ratio = ratio
        averaged = sim.step(grads)
        for i, v in enumerate(model.trainable_variables):
            v.assign_sub(np.float32(lr) * averaged[f"w{i}"])
        out["bytes"].append(list(sim.bytes_sent_per_rank))
        out["losses"].append(float(np.mean(losses)))
    out["weights"] = weights(model)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keras", choices=["2", "3"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if os.environ.get("TF_USE_LEGACY_KERAS") != ("0" if args.keras == "3" else "1"):
        raise SystemExit(f"--keras {args.keras} with TF_USE_LEGACY_KERAS={os.environ.get('TF_USE_LEGACY_KERAS')}")

    import tensorflow as tf

    import hvd_compress.keras as hvd

    assert hvd.KERAS3 == (args.keras == "3"), hvd.KERAS
    hvd.init()
    keras, rank = tf.keras, hvd.rank()
    x, y = data(rank)
    lrs, ratios, logs = [], [], []

    class Recorder(keras.callbacks.Callback):
        """The learning rate and density of each step; the logs of each epoch."""

        def on_train_batch_begin(self, batch, logs=None):
            lrs.append(float(tf.convert_to_tensor(self.model.optimizer.learning_rate)))
            ratios.append(float(self.model.optimizer.compression.ratio))

        def on_epoch_end(self, epoch, epoch_logs=None):
            logs.append({k: float(v) for k, v in (epoch_logs or {}).items()})

    def compiled(model):
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compressor())
        compile_options = {"jit_compile": False} if hvd.KERAS3 else {}
        model.compile(optimizer=opt, loss=loss_fn(keras), **compile_options)
        return model, opt

    def callbacks(opt, first):
        chosen = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        if first:
            chosen.append(hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=1))
        chosen += [
            hvd.callbacks.DensityWarmupCallback(opt, warmup_epochs=1, start=START),
            hvd.callbacks.CompressionStatsCallback(opt),
            Recorder(),
        ]
        return chosen

    model, opt = compiled(make_model(keras))
    if hvd.KERAS3 and rank == 1:
        for v in model.trainable_variables:  # the broadcast must replace these
            v.assign(v + 1.0)
    fit = dict(batch_size=BATCH, shuffle=False, verbose=0)
    model.fit(x, y, epochs=1, callbacks=callbacks(opt, True), **fit)

    result: Dict[str, Any] = {}
    path = f"{args.out}.rank{rank}"
    if hvd.KERAS3:
        model.save(f"{path}.keras")
        import horovod.tensorflow as horovod

        horovod.broadcast_object(None, root_rank=0, name="saved")  # every rank's file is written
        restored = keras.models.load_model(f"{path}.keras")
        opt = restored.optimizer
        with warnings.catch_warnings(record=True) as caught:  # rank 1 loading rank 0's file
            warnings.simplefilter("always")
            if rank == 1:
                keras.models.load_model(f"{args.out}.rank0.keras")
        result["foreign_load"] = [str(w.message) for w in caught if "hvd_compress" in str(w.message)]
        import tf_keras

        try:
            hvd.DistributedOptimizer(tf_keras.optimizers.SGD(LR))
        except TypeError as error:
            result["wrong_keras"] = str(error)
    else:
        saved = tf.train.Checkpoint(model=model, optimizer=opt).save(path)
        restored, opt = compiled(make_model(keras))
        tf.train.Checkpoint(model=restored, optimizer=opt).restore(saved)
    restored.fit(x, y, epochs=2, initial_epoch=1, callbacks=callbacks(opt, False), **fit)
    result["fit"] = weights(restored)

    model = make_model(keras)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), compression=compressor())
    hvd.broadcast_variables(model.variables, 0)
    loss = loss_fn(keras)

    def step(xb, yb, apply):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        if not hvd.KERAS3:
            return opt.minimize(value, model.trainable_variables, tape=tape)
        grads = tape.gradient(value, model.trainable_variables)
        if apply:
            return opt.apply(grads, model.trainable_variables)
        return opt.apply_gradients(zip(grads, model.trainable_variables))

    graph_step = tf.function(lambda xb, yb: step(xb, yb, False))
    for s in range(STEPS):
        batch = slice(s * BATCH, (s + 1) * BATCH)
        if s < STEPS // 2:
            graph_step(x[batch], y[batch])
        else:
            step(x[batch], y[batch], True)
    result["loop"] = weights(model)

    import horovod.tensorflow as horovod

    per_rank = horovod.allgather_object({"logs": logs, "foreign_load": result.get("foreign_load", [])})
    if rank == 0:
        arrays = {f"{phase}/w{i}": w for phase in ("fit", "loop") for i, w in enumerate(result[phase])}
        meta = dict(lrs=lrs, ratios=ratios, per_rank=per_rank, wrong_keras=result.get("wrong_keras"))
        np.savez(args.out, **arrays, meta=json.dumps(meta))


if __name__ == "__main__":
    main()
