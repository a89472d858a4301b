"""PowerSGD (Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019) for N simulated ranks, as torch's DDP hook computes it.

A baseline of the studies (``python -m benchmarks convergence --compressors powersgd``), not an
hvd_compress compressor: :class:`PowerSGDSimulator` reproduces
``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` with a
``PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=s, min_compression_rate=c,
use_error_feedback=True, warm_start=True, orthogonalization_epsilon=0, random_seed=seed)``, the
N ranks in lockstep, every collective a sum over ranks in rank order. Per step ``t`` and bucket:

- ``t < s``: a dense allreduce of the average, ``sum_r (g_r / N)`` (torch's ``allreduce_hook``);
- else, on every rank ``x_r = g_r + e_r`` (``e_r`` the rank's error, zero at step ``s``). Each
  tensor is viewed as a matrix ``M_r`` of ``n = shape[0]`` rows and ``m = numel / n`` columns,
  ``k = min(n, m, r)``. It is compressed when ``(n + m) k c < n m`` (torch's ``_should_compress``,
  so 1-D tensors never are), else it goes in the bucket's dense part, allreduced as
  ``sum_r x_r / N``. For each compressed matrix: ``Q`` (``m x k``) is drawn once, the same on every
  rank (``torch.manual_seed(RandomState(seed).randint(10**9))``, one ``randn(1, m, k)`` per matrix in
  bucket order) and orthogonalized, and then warm-started: the last step's ``Q``, orthogonalized
  again. ``P = sum_r M_r Q`` (allreduce), orthogonalized; ``Q = sum_r M_r^T P / N`` (allreduce);
  every rank gets ``M_hat = P Q^T``. The error is ``e_r = x_r - out`` over the whole bucket: for a
  compressed matrix ``M_r - M_hat``, for the dense part ``x_r - mean_r x_r`` (whose mean over ranks
  is zero, so it leaves the average unchanged up to rounding).

Orthogonalization (:func:`orthogonalize`) is the hook's own ``_orthogonalize``: Gram-Schmidt, column by column
``c_i <- c_i / |c_i|``, ``c_j <- c_j - (c_i . c_j) c_i`` for ``j > i``, when ``k <= 2``; a QR
factorization's Q when ``k > 2`` (the two differ at most in column signs, which ``P Q^T`` does
not see).

Buckets (``buckets``): lists of tensor names; by default one bucket holding every tensor in the
reverse of the model's order, DDP's rebuilt bucket for a model under its 1 MiB first-bucket cap
(the MLP's 0.94 MB; tests/studies/test_powersgd.py records DDP's layout and checks it).

Bytes per rank and step (:attr:`PowerSGDSimulator.collectives_per_rank`, allreduces of fp32, ring
traffic ``2 (N-1)/N`` of each): ``4 sum numel`` before step ``s``, after it
``4 (sum_dense numel + sum_compressed (n + m) k)`` (P, Q and the dense part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

#: Matrix approximation ranks of ``--powersgd-ranks`` by default.
DEFAULT_RANKS = (1, 2, 4)


@dataclass(frozen=True)
class PowerSGD:
    """The hook's settings: ``PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
    min_compression_rate=min_compression_rate, random_seed=random_seed)``, error feedback and warm start on."""

    rank: int = 1
    #: dense allreduce steps before the first compressed one (torch's default 1000 suits long runs)
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    random_seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1 or self.start_iter < 2:
            raise ValueError(f"PowerSGD needs rank >= 1 and start_iter >= 2 (torch's rule with error feedback "
                             f"or warm start), got rank {self.rank}, start_iter {self.start_iter}")

    def matrix(self, shape: Sequence[int]) -> Optional[Tuple[int, int, int]]:
        """``(n, m, k)`` of a tensor of ``shape`` that is compressed, ``None`` for one sent dense:
        ``n = shape[0]``, ``m = numel / n``, ``k = min(n, m, rank)``, compressed iff ``(n + m) k c < n m``."""
        if len(shape) == 0 or shape[0] == 0:
            return None
        n = int(shape[0])
        m = int(np.prod(shape)) // n
        k = min(n, m, self.rank)
        return (n, m, k) if (n + m) * k * self.min_compression_rate < n * m else None

    def describe(self) -> Dict[str, Any]:
        """The settings as torch's ``PowerSGDState`` arguments."""
        return {"matrix_approximation_rank": self.rank, "start_powerSGD_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate, "use_error_feedback": True,
                "warm_start": True, "orthogonalization_epsilon": 0, "random_seed": self.random_seed}


def orthogonalize(matrices: Any) -> Any:
    """The columns of each ``n x k`` matrix of a ``(b, n, k)`` batch orthonormalized in place by the hook's own
    ``_orthogonalize`` (epsilon 0: Gram-Schmidt for ``k <= 2``, else a QR factorization); returns them."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    _orthogonalize(matrices)
    return matrices


class PowerSGDSimulator:
    """``n_ranks`` ranks running torch's PowerSGD hook (module docstring) in one process.

    The interface :func:`benchmarks.cnn.train` uses of :class:`~hvd_compress.simulator.Simulator`:
    :meth:`step` (``{name: [grad of rank 0, ...]}`` -> ``{name: average}``, torch tensors),
    ``bytes_sent_per_rank``, ``collectives_per_rank`` (``(name, "allreduce", bytes)``), and
    :meth:`layer_table` in place of the compressor's.
    """

    def __init__(self, n_ranks: int, config: PowerSGD, buckets: Optional[Sequence[Sequence[str]]] = None) -> None:
        self.n_ranks, self.config = n_ranks, config
        self.buckets = None if buckets is None else [list(b) for b in buckets]
        self.rng = np.random.RandomState(config.random_seed)
        self.errors: Dict[str, Any] = {}  # name -> (N, *shape), every rank's error
        self.qs: Dict[str, Any] = {}  # name -> (1, m, k), the warm-started Q
        self.steps = 0
        self.bytes_sent_per_rank: List[int] = [0] * n_ranks
        self.collectives_per_rank: List[List[Tuple[str, str, int]]] = [[] for _ in range(n_ranks)]
        self.compressors = [config]  # what cnn.train reads a momentum from (none: the optimizer keeps it)

    @property
    def compressing(self) -> bool:
        """Whether the next step compresses (``steps >= start_iter``)."""
        return self.steps >= self.config.start_iter

    def step(self, grads: Mapping[str, Sequence[Any]]) -> Dict[str, Any]:
        import torch

        stacked = {name: torch.stack([torch.as_tensor(g) for g in per_rank]) for name, per_rank in grads.items()}
        if len(next(iter(stacked.values()))) != self.n_ranks:
            raise ValueError(f"PowerSGDSimulator: every tensor needs {self.n_ranks} gradients")
        if self.buckets is None:
            self.buckets = [list(reversed(list(stacked)))]
        posted: List[Tuple[str, str, int]] = []
        out: Dict[str, Any] = {}
        for index, bucket in enumerate(self.buckets):
            if self.compressing:
                out.update(self._compress(index, {name: stacked[name] for name in bucket}, posted))
            else:  # allreduce_hook: divide, then sum
                for name in bucket:
                    out[name] = (stacked[name] / self.n_ranks).sum(0)
                posted.append((f"powersgd.bucket{index}.dense", "allreduce",
                               sum(stacked[n][0].numel() * stacked[n].element_size() for n in bucket)))
        self.collectives_per_rank = [list(posted) for _ in range(self.n_ranks)]
        self.bytes_sent_per_rank = [sum(nbytes for _, _, nbytes in posted)] * self.n_ranks
        self.steps += 1
        return out

    def _compress(self, index: int, x: Dict[str, Any], posted: List[Tuple[str, str, int]]) -> Dict[str, Any]:
        """One compressed step of one bucket: ``x`` is ``{name: (N, *shape)}`` in bucket order."""
        import torch

        n_ranks, out = self.n_ranks, {}
        for name in x:
            x[name] = x[name] + self.errors[name] if name in self.errors else x[name]
        plans = {name: self.config.matrix(tuple(x[name].shape[1:])) for name in x}
        matrices = [name for name in x if plans[name] is not None]
        dense = [name for name in x if plans[name] is None]
        for name in dense:  # the uncompressed tensors: sum, then divide
            out[name] = x[name].sum(0) / n_ranks
        if any(name not in self.qs for name in matrices):  # the first compressed step: Q drawn, the same everywhere
            generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for name in matrices:
                _, m, k = plans[name]
                self.qs[name] = orthogonalize(torch.randn(1, m, k, generator=generator, dtype=x[name].dtype))
        else:
            for name in matrices:
                orthogonalize(self.qs[name])
        ps = {}
        for name in matrices:  # P = sum_r M_r Q
            n, m, k = plans[name]
            ps[name] = orthogonalize(torch.matmul(x[name].reshape(n_ranks, n, m), self.qs[name]).sum(0, keepdim=True))
        for name in matrices:  # Q = sum_r M_r^T P / N; M_hat = P Q^T
            n, m, k = plans[name]
            self.qs[name] = torch.matmul(x[name].reshape(n_ranks, n, m).transpose(1, 2), ps[name]).sum(
                0, keepdim=True) / n_ranks
            out[name] = torch.bmm(ps[name], self.qs[name].transpose(1, 2)).reshape(x[name].shape[1:])
        for name in x:
            self.errors[name] = x[name] - out[name]
        size = next(iter(x.values())).element_size()
        entries = {"dense": sum(x[name][0].numel() for name in dense),
                   "p": sum(plans[name][0] * plans[name][2] for name in matrices),
                   "q": sum(plans[name][1] * plans[name][2] for name in matrices)}
        posted += [(f"powersgd.bucket{index}.{part}", "allreduce", size * count) for part, count in entries.items()]
        return out

    def layer_table(self, shapes: Mapping[str, Tuple[int, ...]]) -> List[Dict[str, Any]]:
        """How the last step (before any, the first) sent each tensor (``values``: its entries on the wire,
        ``(n + m) k`` for a low-rank one), in :func:`benchmarks.cnn.layer_table`'s form (``k``: the rank)."""
        compressing = max(self.steps - 1, 0) >= self.config.start_iter
        rows = []
        for name, shape in shapes.items():
            numel = int(np.prod(shape))
            plan = self.config.matrix(shape)
            row = {"name": name, "numel": numel, "k": None, "sent": "dense", "reason": None, "values": numel}
            if not compressing:
                row["reason"] = f"before start_powerSGD_iter={self.config.start_iter}"
            elif plan is None:
                rule = f"(n + m) k {self.config.min_compression_rate:g} >= n m"
                row["reason"] = ("1-D: " if len(shape) < 2 else "") + rule
            else:
                n, m, k = plan
                row.update(k=k, sent="low-rank", values=(n + m) * k)
            rows.append(row)
        return rows


def traffic_vs_dense(config: PowerSGD, shapes: Mapping[str, Sequence[int]], steps: int) -> float:
    """PowerSGD's ring traffic per rank over ``steps`` steps against dense fp32 allreduces' (both ring
    allreduces, so the ratio of entries): ``(s D + (T - s) C) / (T D)`` with ``s = min(start_iter, T)``,
    ``D = sum numel``, ``C = sum_dense numel + sum_compressed (n + m) k``."""
    total = sum(int(np.prod(s)) for s in shapes.values())
    compressed = 0
    for shape in shapes.values():
        plan = config.matrix(tuple(shape))
        compressed += int(np.prod(shape)) if plan is None else (plan[0] + plan[1]) * plan[2]
    dense_steps = min(config.start_iter, steps)
    return (dense_steps * total + (steps - dense_steps) * compressed) / (steps * total)
