"""The demo: a small classifier trained on several simulated ranks with each compressor.

A two-layer perceptron (64 -> 256 -> 10, numpy only) learns scikit-learn's
8x8 handwritten digits. Each rank takes its own shard of every
batch; gradients travel through :class:`~hvd_compress.simulator.Simulator` (the
routes' bucket engine), so the loss, accuracy and bytes a route hands to the
collectives of every compressor can be compared with dense SGD on the same data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np

from hvd_compress.bench import require
from hvd_compress.algorithms import Compressor
from hvd_compress.simulator import Simulator


@dataclass
class Dataset:
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @classmethod
    def digits(cls, seed: int = 0, test: int = 360) -> "Dataset":
        """scikit-learn's 1,797 handwritten 8x8 digits (bundled, no download) as 64 features scaled
        to [0, 1], shuffled by ``seed``; the last ``test`` images are the test set."""
        datasets = require("sklearn.datasets", "bench")
        data = datasets.load_digits()
        order = np.random.default_rng(seed).permutation(len(data.target))
        x = (data.data[order] / 16.0).astype(np.float32)
        y = data.target[order].astype(np.int64)
        return cls(x[:-test], y[:-test], x[-test:], y[-test:])


class MLP:
    """``softmax(W2 relu(W1 x + b1) + b2)`` with cross-entropy loss and hand-written backward."""

    def __init__(self, features: int = 64, hidden: int = 256, classes: int = 10, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.params = {
            "fc1.weight": (rng.standard_normal((hidden, features)) / np.sqrt(features)).astype(np.float32),
            "fc1.bias": np.zeros(hidden, np.float32),
            "fc2.weight": (rng.standard_normal((classes, hidden)) / np.sqrt(hidden)).astype(np.float32),
            "fc2.bias": np.zeros(classes, np.float32),
        }

    def logits(self, x: np.ndarray) -> np.ndarray:
        p = self.params
        hidden = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0)
        return hidden @ p["fc2.weight"].T + p["fc2.bias"]

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray):
        p = self.params
        hidden = np.maximum(x @ p["fc1.weight"].T + p["fc1.bias"], 0)
        logits = hidden @ p["fc2.weight"].T + p["fc2.bias"]
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        loss = float(-np.mean(np.log(probs[np.arange(len(y)), y] + 1e-12)))
        d_logits = probs
        d_logits[np.arange(len(y)), y] -= 1
        d_logits /= len(y)
        d_hidden = (d_logits @ p["fc2.weight"]) * (hidden > 0)
        grads = {
            "fc1.weight": d_hidden.T @ x,
            "fc1.bias": d_hidden.sum(axis=0),
            "fc2.weight": d_logits.T @ hidden,
            "fc2.bias": d_logits.sum(axis=0),
        }
        return loss, {k: v.astype(np.float32) for k, v in grads.items()}

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self.logits(x).argmax(axis=1) == y))


@dataclass
class DemoResult:
    compression: str
    losses: List[float]
    accuracy: float
    bytes_per_step: int
    dense_bytes_per_step: int

    @property
    def savings(self) -> float:
        return self.dense_bytes_per_step / self.bytes_per_step


def train(
    label: str,
    compression: Compressor,
    data: Dataset,
    ranks: int = 4,
    epochs: int = 3,
    batch_per_rank: int = 32,
    lr: float = 0.1,
    seed: int = 0,
    on_epoch: Optional[Callable[[int, float, float], None]] = None,
) -> DemoResult:
    """Synchronous data-parallel SGD on ``ranks`` simulated ranks; returns per-epoch losses."""
    model = MLP(features=data.train_x.shape[1], seed=seed)
    sim = Simulator(ranks, compression, seed=seed)
    order = np.random.default_rng(seed)
    global_batch = ranks * batch_per_rank
    losses, sent, dense = [], [], []
    for epoch in range(epochs):
        perm = order.permutation(len(data.train_y))
        epoch_loss = []
        for start in range(0, len(perm) - global_batch + 1, global_batch):
            shards = perm[start : start + global_batch].reshape(ranks, batch_per_rank)
            results = [model.loss_and_grads(data.train_x[s], data.train_y[s]) for s in shards]
            epoch_loss.append(np.mean([loss for loss, _ in results]))
            averaged = sim.step({name: [g[name] for _, g in results] for name in model.params})
            for name, grad in averaged.items():
                model.params[name] -= lr * grad
            sent.append(sim.bytes_sent)
            dense.append(sim.dense_bytes)
        losses.append(float(np.mean(epoch_loss)))
        if on_epoch is not None:
            on_epoch(epoch, losses[-1], model.accuracy(data.test_x, data.test_y))
    return DemoResult(
        compression=label,
        losses=losses,
        accuracy=model.accuracy(data.test_x, data.test_y),
        bytes_per_step=int(np.mean(sent)),
        dense_bytes_per_step=int(np.mean(dense)),
    )
