"""A sum-selected global top-k for N simulated ranks, after Ok-Topk (Li, Hoefler, "Near-Optimal Sparse
Allreduce for Distributed Deep Learning", PPoPP 2022), with fixed slots so that no size is read back.

A baseline of the studies (``python -m benchmarks convergence --compressors oktopk --traffic 0.04``),
not an hvd_compress compressor: it asks what selecting the largest *summed* entries buys over the
index rules hvd_compress ships (each rank's own top-k gathered; a set shared by every rank).

Per step, the model's gradients are one bucket: each rank's tensors flattened in the model's order
into ``d`` entries, padded with zeros to ``D = R w`` (``R`` ranks, ``w = ceil(d / R)``). Entry ``i``
belongs to region ``i mod R``, owned by rank ``i mod R`` (interleaved regions, so each holds a
share of every layer). On every rank ``r``:

- ``a_r = e_r + g_r``, or with momentum correction (DGC, ``momentum = m``) ``u_r = m u_r + g_r``,
  ``a_r = e_r + u_r``;
- **sparse reduce-scatter** (an all-to-all with ``s`` fixed slots per destination): for every
  region ``j``, rank ``r`` sends owner ``j`` its ``s`` entries of ``a_r`` in region ``j`` with the
  largest ``|a_r|``, as (int32 index, float32 value) pairs; owner ``j`` sums what it received per index;
- **global selection**: owner ``j`` keeps the ``s`` entries of its region with the largest ``|sum|``
  among those it received;
- **allgather** of every owner's ``s`` kept (index, sum) pairs: every rank applies ``sum / R`` at
  the ``R s`` kept entries, zero elsewhere;
- **error feedback**: ``e_r = a_r`` with the entries that rank ``r`` sent *and* its owner kept
  set to zero (an entry sent but not kept stays), and so ``u_r`` with momentum correction
  (momentum-factor masking). Nothing is lost: ``R average + sum_r e_r = sum_r a_r``.

Slots from the traffic budget ``t`` (a fraction of a dense fp32 ring allreduce's bytes per rank,
``2 (R-1)/R 4 d``): the all-to-all sends ``(R-1)/R`` of the ``8 R s`` bytes a rank hands it, the
ring allgather ``(R-1) 8 s``, so the traffic is ``16 (R-1) s`` bytes and ``2 R s / d`` of dense's;
``s = max(1, round(t d / (2 R)))``. The density warm-up ramps ``t`` itself
(:func:`hvd_compress.algorithms.schedule.warmup_density`, from ``warmup_start`` over
``warmup_steps`` steps), as ``DensityWarmup`` ramps a ``TopK(traffic=...)``.

What differs from the paper: the regions are interleaved and fixed instead of rebalanced, and each
rank sends exactly ``s`` entries per region and each owner keeps exactly ``s`` (the paper's
thresholds, re-estimated every few steps, send and keep a varying count), so every message has a
size known in advance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hvd_compress.algorithms.schedule import warmup_density

#: bytes of one (int32 index, float32 value) pair
PAIR_BYTES = 8


@dataclass(frozen=True)
class OkTopk:
    """The baseline's settings: the traffic budget, momentum correction and the warm-up of the budget."""

    #: ring traffic per rank as a fraction of a dense fp32 allreduce's (module docstring)
    traffic: float = 0.04
    #: momentum correction's ``m`` (0: none; the optimizer then keeps its own momentum)
    momentum: float = 0.0
    #: steps of the budget's warm-up ramp (0: none)
    warmup_steps: int = 0
    #: the budget at step 0 of the warm-up
    warmup_start: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.traffic <= 1 or not 0 <= self.momentum < 1 or self.warmup_steps < 0:
            raise ValueError(f"OkTopk needs 0 < traffic <= 1, 0 <= momentum < 1 and warmup_steps >= 0, got "
                             f"traffic {self.traffic}, momentum {self.momentum}, warmup_steps {self.warmup_steps}")

    def traffic_at(self, step: int) -> float:
        """The budget of (0-based) ``step``: the warm-up's ramp from ``max(warmup_start, traffic)``, then
        ``traffic``."""
        return warmup_density(step, self.warmup_steps, max(self.warmup_start, self.traffic), self.traffic)

    @staticmethod
    def slots(traffic: float, numel: int, n_ranks: int) -> int:
        """``s``, the pairs per region: ``round(t d / (2 R))``, at least 1 (a region holds ``ceil(d / R)``
        entries, at least ``s`` for ``t <= 1``)."""
        return max(1, round(traffic * numel / (2 * n_ranks)))


class OkTopkSimulator:
    """``n_ranks`` ranks running the sum-selected global top-k (module docstring) in one process.

    The interface :func:`benchmarks.cnn.train` uses of :class:`~hvd_compress.simulator.Simulator`:
    :meth:`step` (``{name: [grad of rank 0, ...]}`` -> ``{name: average}``, torch tensors),
    ``bytes_sent_per_rank``, ``collectives_per_rank`` (``(name, "alltoall" or "allgather", bytes)``),
    ``compressors`` (whose ``momentum`` the study records) and :meth:`layer_table`.
    """

    def __init__(self, n_ranks: int, config: OkTopk) -> None:
        if n_ranks < 2:
            raise ValueError(f"OkTopkSimulator needs at least 2 ranks, got {n_ranks}")
        self.n_ranks, self.config = n_ranks, config
        self.errors: Optional[Any] = None  # (R, D): every rank's residual e_r
        self.velocities: Optional[Any] = None  # (R, D): u_r, with momentum correction
        self.steps = 0
        self.last_slots: Optional[int] = None
        self.bytes_sent_per_rank: List[int] = [0] * n_ranks
        self.collectives_per_rank: List[List[Tuple[str, str, int]]] = [[] for _ in range(n_ranks)]
        self.compressors = [config]

    def step(self, grads: Mapping[str, Sequence[Any]]) -> Dict[str, Any]:
        import torch

        names = list(grads)
        shapes = [tuple(torch.as_tensor(grads[name][0]).shape) for name in names]
        g = torch.cat([torch.stack([torch.as_tensor(x).reshape(-1) for x in grads[name]]) for name in names], 1)
        ranks, d = g.shape
        if ranks != self.n_ranks:
            raise ValueError(f"OkTopkSimulator: every tensor needs {self.n_ranks} gradients, got {ranks}")
        width = -(-d // ranks)
        g = torch.nn.functional.pad(g, (0, ranks * width - d))
        if self.errors is None:
            self.errors = torch.zeros_like(g)
            self.velocities = torch.zeros_like(g) if self.config.momentum else None
        if self.velocities is not None:
            self.velocities.mul_(self.config.momentum).add_(g)
            g = self.velocities
        s = self.config.slots(self.config.traffic_at(self.steps), d, ranks)
        a = self.errors + g
        average, cleared = self.exchange(a, s)
        self.errors = torch.where(cleared, 0.0, a)
        if self.velocities is not None:
            self.velocities = torch.where(cleared, 0.0, self.velocities)
        out, start = {}, 0
        for name, shape in zip(names, shapes):
            size = int(np.prod(shape))
            out[name] = average[start:start + size].reshape(shape)
            start += size
        posted = [("oktopk.reduce_scatter", "alltoall", PAIR_BYTES * ranks * s),
                  ("oktopk.allgather", "allgather", PAIR_BYTES * s)]
        self.collectives_per_rank = [list(posted) for _ in range(ranks)]
        self.bytes_sent_per_rank = [sum(nbytes for _, _, nbytes in posted)] * ranks
        self.last_slots, self.steps = s, self.steps + 1
        return out

    @staticmethod
    def exchange(a: Any, s: int) -> Tuple[Any, Any]:
        """One exchange of ``a`` (``(R, D)``, every rank's accumulated entries, ``R`` dividing ``D``) with
        ``s`` slots per region: the average over ranks (``(D,)``, zero outside the kept entries) and the
        entries each rank's residual clears (``(R, D)`` bools: sent by that rank and kept by their owner)."""
        import torch

        ranks, padded = a.shape
        width = padded // ranks
        regions = a.reshape(ranks, width, ranks).transpose(1, 2)  # [rank, owner, position]: entry position R + owner
        sent_at = regions.abs().topk(s, dim=2).indices
        sent = torch.zeros(regions.shape, dtype=torch.bool).scatter_(2, sent_at, True)
        sums = torch.where(sent, regions, 0.0).sum(0)  # [owner, position]
        score = torch.where(sent.any(0), sums.abs(), -1.0)
        kept = torch.zeros(sums.shape, dtype=torch.bool).scatter_(1, score.topk(s, dim=1).indices, True)
        average = (torch.where(kept, sums, 0.0) / ranks).transpose(0, 1).reshape(padded)
        cleared = (sent & kept).transpose(1, 2).reshape(ranks, padded)
        return average, cleared

    def layer_table(self, shapes: Mapping[str, Tuple[int, ...]]) -> List[Dict[str, Any]]:
        """How the last step (before any, the first) sent each tensor, in :func:`benchmarks.cnn.layer_table`'s
        form: every tensor ``sparse`` in the one bucket, ``values`` its share ``numel R s / d`` of the kept
        entries."""
        d = sum(int(np.prod(shape)) for shape in shapes.values())
        s = self.last_slots or self.config.slots(self.config.traffic_at(0), d, self.n_ranks)
        return [{"name": name, "numel": int(np.prod(shape)), "k": None, "sent": "sparse",
                 "reason": f"one bucket of {d:,} entries, {self.n_ranks} x {s} kept",
                 "values": int(np.prod(shape)) * self.n_ranks * s / d} for name, shape in shapes.items()]


def traffic_vs_dense(slots: int, numel: int, n_ranks: int) -> float:
    """Ring traffic per rank against a dense fp32 allreduce's: ``2 R s / d`` (module docstring)."""
    return 2.0 * n_ranks * slots / numel
