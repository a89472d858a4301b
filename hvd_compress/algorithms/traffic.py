"""A traffic budget instead of a density: ``TopK(traffic=t)`` sends, at any number of ranks ``N``, about
``t`` times the bytes per rank of a dense float32 ring allreduce, and picks how.

Per-rank traffic of one compressed tensor of ``d`` elements, relative to a dense float32 ring allreduce
(``2 (N-1)/N 4d`` bytes per rank), at density ``k / d``:

- ``gather`` (each rank's own ``k`` (value, index) pairs, allgathered: ``(N-1) 8k`` bytes received):
  ``t = N k / d``, so ``k / d = t / N``;
- ``leader`` (the leader's ``k`` indices and every rank's values there, allreduced: ``2 (N-1)/N 8k``):
  ``t = 2 k / d``, so ``k / d = t / 2``;
- ``aggregate`` (``k`` values allreduced at indices every rank derives alike): ``t = k / d``; its first
  step of a plan (the start, an elastic reset) sends every entry once, so every rank learns every rate.

``indices="auto"`` (the default with ``traffic=``) picks ``aggregate`` from :data:`SHARED_FROM` ranks on
(one rank sends nothing, so its selection is its own): at equal traffic it trained better than each
rank's own selection at ``t / N`` in the fixed-global-batch Fashion-MNIST MLP studies (3 seeds, 936
steps, momentum correction and warm-up; docs/results/convergence_fashion-mnist_mlp_global256_traffic_n4
and _n16): at ``t = 0.04``, ``aggregate`` at 4% ended 0.02 (N = 4) and 0.15 points (N = 16) behind
dense, ``gather`` at ``0.04 / N`` 0.88 and 0.55 points behind. The resolution is a function of
``(t, rule, N)`` alone, so every rank resolves alike; it happens at ``bind`` (every route binds
before its first exchange, and again after an elastic reset or a resume at another ``N``).

The budget covers the compressed tensors: those under ``dense_below`` travel dense besides it, each a full
allreduce (a model's total is ``(dense entries + t x the others) / all entries``). The README's recommended
setting, ``TopK(traffic=0.03, dense_below=2000)``, sends the studies' classifier layers (128 x 10) dense too
and trained within 0.3 points of dense or above it on the MLP and the CNN from 4 to 64 ranks, at
0.045-0.046 of dense's traffic with the warm-up, where ``TopK(traffic=0.04)`` ended 1.12 points behind on
the CNN at 16 ranks (README, "When sparse stops paying").
"""

from __future__ import annotations

from typing import Tuple

#: ranks from which ``indices="auto"`` shares one index set (``aggregate``)
SHARED_FROM = 2
#: ``k / d`` per unit of traffic, by index mode and ranks
DENSITY_PER_TRAFFIC = {"gather": lambda size: 1.0 / size, "leader": lambda size: 0.5, "aggregate": lambda size: 1.0}


def resolve(traffic: float, rule: str, size: int) -> Tuple[str, float]:
    """``(indices, ratio)`` for a budget of ``traffic`` (a fraction of a dense float32 ring allreduce's
    bytes per rank) on ``size`` ranks: ``rule`` an index mode, or ``"auto"`` (module docstring). The
    ratio is at most 1; a world of one rank sends nothing, so it gets the budget as its density."""
    indices = rule if rule != "auto" else ("aggregate" if size >= SHARED_FROM else "gather")
    return indices, min(1.0, traffic * DENSITY_PER_TRAFFIC[indices](max(1, size)))
