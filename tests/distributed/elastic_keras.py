"""A Horovod Elastic Keras 2 job with compression state, run under ``horovodrun --min-np/--max-np``
with a discovery script that prints the hosts file ``--hosts-file`` (tests/distributed/test_elastic_horovodrun.py).

``model.fit`` with Horovod's ``CommitStateCallback`` (a commit every second batch) and
``hvd_compress.keras.DistributedOptimizer(SGD, TopK(0.05, indices="leader", dense_below=0))``,
state in ``hvd.elastic.KerasState``, ``hvd.elastic.register(state, optimizer)``. One host
(``localhost``) at the start; at step ``--change-at`` it rewrites the hosts file with ``127.0.0.1``
added (a process joins). Each process appends the events of tests/distributed/elastic_torch.py to
``<--events>/<pid>.jsonl``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts-file", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--change-at", type=int, default=5)
    args = parser.parse_args()

    import tensorflow as tf

    import hvd_compress.keras as hvd
    from hvd_compress import TopK
    from hvd_compress.horovod.elastic import held_residual
    from tests.distributed.elastic_events import event_log, log_commits, rewrite_hosts

    hvd.init()
    keras = tf.keras
    host, first_life = os.environ.get("HOROVOD_HOSTNAME", "?"), [True]
    log = event_log(args.events, hvd)

    generator = np.random.default_rng(7)
    inputs = generator.standard_normal((512, 32)).astype(np.float32)
    targets = inputs @ (generator.standard_normal((32, 8)).astype(np.float32) / 4)
    model = keras.Sequential([keras.layers.Dense(8, name="dense")])
    model.build((None, 32))
    compression = TopK(0.05, indices="leader", dense_below=0)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(0.2), compression=compression)
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)  # its variables made now: KerasState broadcasts them all
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    handler = hvd.elastic.register(state, optimizer)
    run = compression.state
    log_commits(handler, run, state, log)

    def rows(step: int) -> np.ndarray:
        return np.arange(16) + 16 * ((step * hvd.size() + hvd.rank()) % 32)

    class Batches(keras.utils.Sequence):
        """This rank's batches from step ``base`` on."""

        def __init__(self, base: int) -> None:
            super().__init__()
            self.base = base

        def __len__(self):
            return args.steps - self.base

        def __getitem__(self, index):
            at = rows(self.base + index)
            return inputs[at], targets[at]

    class Events(keras.callbacks.Callback):
        """The events, the step count in ``state.batch`` and the scenario, for a ``fit`` from step ``base``."""

        def __init__(self, base: int) -> None:
            super().__init__()
            self.base = base

        def on_train_begin(self, logs=None):
            log("enter", step=self.base, held=held_residual(run), exchanged=run.exchanged(), first_life=first_life[0])

        def on_train_batch_begin(self, batch, logs=None):
            if self.base + batch == args.change_at and first_life[0] and host == "localhost":
                rewrite_hosts(args.hosts_file, "localhost:1\n127.0.0.1:1\n", state)

        def on_train_batch_end(self, batch, logs=None):
            state.batch = self.base + batch + 1
            log("step", step=self.base + batch, exchanged=run.exchanged(), loss=float(logs["loss"]))

    @hvd.elastic.run
    def train(state) -> None:
        base = state.batch
        try:
            model.fit(Batches(base), epochs=1, verbose=0, shuffle=False,
                      callbacks=[Events(base), hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])
        except BaseException:
            first_life[0] = False
            raise

    train(state)
    weights = np.concatenate([w.reshape(-1) for w in model.get_weights()])
    log("end", step=args.steps, loss=float(np.mean((model.predict(inputs[:16], verbose=0) - targets[:16]) ** 2)),
        parameters=weights.tolist(), held=held_residual(run))


if __name__ == "__main__":
    main()
