"""``Auto`` with ``horovod.tensorflow`` under ``horovodrun``: stock ``DistributedGradientTape``
(``compression=Auto(...)``, one exchange per gradient) and the drop-in ``hvd_compress.tensorflow`` tape
(one exchange per dtype), each training a linear layer inside a ``tf.function`` for a few steps while
measuring and deciding (and measuring again). Rank 1 inflates its compressed times 50x, rank 0 its dense
times. Every rank writes ``--out.<rank>.json``: per route, the decisions and the final weights.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import tensorflow as tf

from hvd_compress import Auto, TopK

INFLATE = 50.0


class SkewedAuto(Auto):
    def medians(self, state):
        dense, compressed = super().medians(state)
        return (dense * INFLATE, compressed) if self.rank == 0 else (dense, compressed * INFLATE)


def train(route: str, steps: int, hvd):
    w = tf.Variable(tf.random.stateless_normal([64, 32], seed=[1, 2]))
    b = tf.Variable(tf.zeros([32]))
    auto = SkewedAuto(TopK(0.05), warmup=2, indices=None, decide_every=4, log=False)
    rng = np.random.default_rng(hvd.rank())

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(tf.matmul(x, w) + b))
        if route == "stock":
            tape = hvd.DistributedGradientTape(tape, compression=auto)
        else:
            import hvd_compress.tensorflow as dropin

            tape = dropin.DistributedGradientTape(tape, compression=auto)
        grads = tape.gradient(loss, [w, b])
        w.assign_sub(1e-3 * grads[0])
        b.assign_sub(1e-3 * grads[1])

    for _ in range(steps):
        step(tf.constant(rng.normal(size=(8, 64)), tf.float32))
    return {"decisions": auto.stats.decisions, "w": w.numpy().tolist(), "b": b.numpy().tolist()}


def main() -> None:
    import horovod.tensorflow as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    result = {route: train(route, args.steps, hvd) for route in ("stock", "dropin")}
    with open(f"{args.out}.{hvd.rank()}.json", "w") as f:
        json.dump(result, f, sort_keys=True)


if __name__ == "__main__":
    main()
