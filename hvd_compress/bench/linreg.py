"""Distributed linear regression of the RegTop-k paper (Bereyhi et al., section 2 of the supplement).

Reproduces the setup of AlBerey/RegTopK ``LinearRegression.py``/``SynthDataSet.py``:
``n_ranks`` clients with heterogeneous local models ``x_k = m_k 1 + z``
(``m_k ~ N(0, 5)``, ``z ~ N(0, I)``), data ``y = A_k x_k + e`` (``A_k`` standard
normal, ``e ~ N(0, 0.5)``), full-batch gradients of the mean squared error and
plain gradient descent on the average. The global optimum ``x*`` is the least
squares solution over all clients. Top-k with error feedback stalls at a fixed
distance from ``x*``; RegTop-k keeps approaching it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy as np

from hvd_compress.compressors import Compressor
from hvd_compress.simulator import Simulator


@dataclass
class LinearRegressionProblem:
    """Per-rank design matrices and targets, and the global optimum."""

    features: List[np.ndarray]
    targets: List[np.ndarray]
    optimum: np.ndarray
    start: np.ndarray

    @classmethod
    def generate(
        cls, n_ranks: int = 20, dim: int = 100, samples: int = 500, seed: int = 0
    ) -> "LinearRegressionProblem":
        rng = np.random.default_rng(seed)
        means = np.sqrt(5.0) * rng.standard_normal(n_ranks)
        features, targets = [], []
        for mean in means:
            local_model = mean + rng.standard_normal(dim)
            a = rng.standard_normal((samples, dim))
            features.append(a)
            targets.append(a @ local_model + np.sqrt(0.5) * rng.standard_normal(samples))
        gram = sum(a.T @ a for a in features)
        optimum = np.linalg.solve(gram, sum(a.T @ y for a, y in zip(features, targets)))
        bound = 1.0 / np.sqrt(dim)  # torch.nn.Linear's initialisation
        return cls(features, targets, optimum, rng.uniform(-bound, bound, dim))

    def gradients(self, x: np.ndarray) -> List[np.ndarray]:
        """Full-batch gradient of ``mean((A_k x - y_k)^2)`` on every rank."""
        return [2.0 / a.shape[0] * a.T @ (a @ x - y) for a, y in zip(self.features, self.targets)]

    def distance(self, x: np.ndarray) -> float:
        """Squared distance ``||x - x*||^2``."""
        return float(np.sum((x - self.optimum) ** 2))


def run(
    problem: LinearRegressionProblem,
    compression: Compressor,
    steps: int = 2500,
    lr: float = 0.01,
    revert: bool = False,
    callback: Optional[Callable[[int, float], None]] = None,
) -> List[float]:
    """Gradient descent on the simulator; returns ``||x_t - x*||^2`` after every step.

    ``revert`` adds the reference script's heuristic (``termination`` in
    ``DistLearnLinearReg.py``): a step that moves ``x`` by at least the allowed
    squared deviation is undone; after an accepted step the allowance becomes
    100x that step's squared length. It lives here, outside the compressor.
    """
    sim = Simulator(len(problem.features), compression)
    x = problem.start.copy()
    allowance = 1e5
    distances = []
    for step in range(steps):
        grads = problem.gradients(x)
        update = lr * sim.step({"x": grads})["x"]
        moved = float(np.sum(update**2))
        if not revert or moved < allowance:
            x = x - update
            allowance = 100.0 * moved if revert else allowance
        distances.append(problem.distance(x))
        if callback is not None:
            callback(step, distances[-1])
    return distances
