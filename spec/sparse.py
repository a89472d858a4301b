"""Top-k, Gaussian-k and RegTop-k with error feedback and momentum correction, one tensor at a time.

One rank, one tensor, one step (error feedback: Seide et al. 2014, Stich et al. 2018; momentum
correction: Lin et al., "Deep Gradient Compression", ICLR 2018, section 3.2)::

    u = m u + g  (momentum m > 0; else u = g)       a = u + r  (r: the residual, with error feedback)
    S = select(a);  send a[S] in the gradient's dtype (saturated)
    r = a with r[S] = a[S] - what was sent;         u[S] = 0

Sums over ranks run in rank order in at least float32; RegTop-k then keeps, per rank, its
posterior distortion ``D_j = (T_j - s_j) / s_j`` at the entries ``j`` it sent as ``s_j != 0``
(``T``: the sum over ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, Callable, Dict

import numpy as np

from spec.common import accumulation, k_of, saturate


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores``, ascending; among equal scores the lower index wins."""
    return np.sort(np.argsort(-scores, kind="stable")[:k])


def topk_select(a: np.ndarray, ratio: float, posterior: Any = None, mu: float = 0.0) -> np.ndarray:
    """Top-k (Aji & Heafield 2017): the ``k`` largest ``|a_j|``."""
    return top_k(np.abs(a), k_of(a.shape[0], ratio))


def regtopk_select(a: np.ndarray, ratio: float, posterior: Any, mu: float) -> np.ndarray:
    """RegTop-k (Bereyhi et al. 2025): the ``k`` largest ``|tanh((1 + D_j) / mu)| |a_j|``, ``D = 1e8`` (so
    the factor is exactly 1) where no posterior informs it; ``tanh`` evaluated in float64."""
    scores = np.abs(a).astype(accumulation(a.dtype))
    if posterior is not None:
        idx, distortion = posterior
        damping = np.tanh(((1.0 + distortion) / mu).astype(np.float64)).astype(distortion.dtype)
        scores[idx] = np.abs(damping) * np.abs(a[idx])
    return top_k(scores, k_of(a.shape[0], ratio))


def gaussiank_select(a: np.ndarray, ratio: float, posterior: Any = None, mu: float = 0.0) -> np.ndarray:
    """Gaussian-k (Shi et al. 2019; hclhkbu/GaussianK-SGD): ``S = {j : |a_j| > thr}``,
    ``thr = |mean a| + std(a) Phi^-1(1 - ratio / 2)``, then up to three counts: below ``ceil(2k/3)``
    the threshold halves, above ``floor(4k/3)`` it grows 1.5x, the first in range wins; else the
    smallest set above range seen, cut to its first ``k`` indices, or the last threshold counted."""
    k = k_of(a.shape[0], ratio)
    low, high = math.ceil(2.0 / 3.0 * k), math.floor(4.0 / 3.0 * k)
    magnitude = np.abs(a)
    first = abs(float(np.mean(a, dtype=np.float64))) - float(np.std(a, dtype=np.float64)) * NormalDist().inv_cdf(
        ratio / 2.0)
    factor, last, over = 1.0, first, None
    for _ in range(3):
        threshold = first * factor
        count = int(np.count_nonzero(magnitude > threshold))
        if low <= count <= high:
            return np.flatnonzero(magnitude > threshold)
        if count > high and (over is None or count < over[0]):
            over = (count, threshold)
        last, factor = threshold, factor * (0.5 if count < low else 1.5)
    if over is None:
        return np.flatnonzero(magnitude > last)
    return np.flatnonzero(magnitude > over[1])[:k]


SELECTIONS: Dict[str, Callable] = {"TopK": topk_select, "RegTopK": regtopk_select, "GaussianK": gaussiank_select}


@dataclass
class Sparse:
    """A sparsifier's options; ``select(a, ratio, posterior, mu)`` its rule (a user's rule takes the same)."""

    select: Callable
    ratio: float
    error_feedback: bool = True
    dense_below: int = 1024
    dense_when_cheaper: bool = True
    momentum: float = 0.0
    mu: float = 5.0
    learns_posterior: bool = False

    def dense(self, numel: int, ranks: int) -> bool:
        """Sent dense: empty, under ``dense_below``, or where ``N k >= d`` (a dense allreduce moves less)."""
        cheaper = self.dense_when_cheaper and ranks > 1 and ranks * k_of(numel, self.ratio) >= numel
        return numel == 0 or numel < self.dense_below or cheaper


def sparse_send(option: Sparse, g: np.ndarray, state: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """One rank's step for one compressed tensor: ``{"indices", "values"}``; ``state`` (the rank's
    ``residual``, ``velocity``, ``posterior`` of the tensor) is updated."""
    a = velocity_step(option, g, state) if option.momentum else g  # u, kept; u[S] = 0 below
    if option.error_feedback:
        a = a + state.get("residual", np.zeros(g.shape[0], accumulation(g.dtype)))
    indices = np.asarray(option.select(a, option.ratio, state.get("posterior"), option.mu))
    values = saturate(a[indices], g.dtype)
    if option.error_feedback:
        residual = a.copy()
        residual[indices] = a[indices] - values.astype(a.dtype)
        state["residual"] = residual
    if option.momentum:
        state["velocity"][indices] = 0
    return {"indices": indices, "values": values}


def sparse_sum(sent: list, numel: int, dtype) -> np.ndarray:
    """The sum over ranks of every rank's ``values`` scattered at its ``indices``, in rank order."""
    total = np.zeros(numel, accumulation(dtype))
    for part in sent:
        np.add.at(total, part["indices"], part["values"].astype(total.dtype))
    return total


def learn_posterior(total: np.ndarray, part: Dict[str, np.ndarray], state: Dict[str, Any]) -> None:
    """RegTop-k: ``D_j = (T_j - s_j) / s_j`` where this rank sent ``s_j != 0``."""
    own = part["values"].astype(total.dtype)
    informative = own != 0
    state["posterior"] = (part["indices"][informative], (total[part["indices"]][informative] - own[informative])
                          / own[informative])


def velocity_step(option: Sparse, g: np.ndarray, state: Dict[str, Any]) -> np.ndarray:
    """Momentum correction: ``u = m u + g``, kept in ``state`` (a tensor sent dense sends it whole; a compressed
    one compresses ``r + u`` and then spends the sent entries, ``u[S] = 0``)."""
    acc = accumulation(g.dtype)
    u = state.get("velocity", np.zeros(g.shape[0], acc)) * acc.type(option.momentum) + g.astype(acc)
    state["velocity"] = u
    return u
