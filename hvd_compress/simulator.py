"""N ranks in one process, no MPI: the routes' engine in lockstep, what multi-process runs must equal.

Every rank owns a deep copy of the compressor (its own residuals, RegTop-k
posterior and random stream, seeded from ``(seed, rank)``). One :meth:`Simulator.step`
runs the bucket engine every route runs (:class:`~hvd_compress.engine.exchange.BucketExchange`,
:mod:`~hvd_compress.engine.fused`) on every rank, the whole step as one bucket, over the
collectives of :mod:`~hvd_compress.transport.lockstep` (sums and gathers in rank order, no
threads): every rank launches the bucket, then every rank completes it (TernGrad's codes
after the shared scales' allreduce-Max), then every rank finishes it. So the averages,
residuals and bytes are a real route's (``bytes_sent_per_rank``: what each rank handed to
the collectives, the layout check's header at a layout's first step included; Gaussian-k
sends its ``floor(4k/3)`` slots per tensor as every route does).

Example::

    sim = Simulator(4, TopK(0.01), seed=0)
    avg = sim.step({"w": [g0, g1, g2, g3]})["w"]
    sim.bytes_sent, sim.residuals("w")
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hvd_compress.algorithms import Compressor, as_compressor
from hvd_compress.kernels import in_form_of
from hvd_compress.algorithms.base import as_tensor
from hvd_compress.algorithms.checkpoint import writer
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.transport.lockstep import LockstepGroup
from hvd_compress.wire import array_nbytes


class Simulator:
    """In-process simulation of ``n_ranks`` ranks training with ``compression``.

    ``seed`` replaces the compressor's own seed (``None`` keeps it); rank ``r``
    draws from the stream of ``(seed, r)``, as in a multi-process run.
    """

    def __init__(self, n_ranks: int, compression: Compressor, seed: Optional[int] = None) -> None:
        if isinstance(n_ranks, bool) or not isinstance(n_ranks, int) or n_ranks < 1:
            raise ValueError(f"hvd_compress: n_ranks must be a positive int, got {n_ranks!r}")
        compression = as_compressor(compression, "Simulator's compression")
        if not getattr(compression, "fused", False):
            raise TypeError(f"hvd_compress: {type(compression).__name__} brings no bucket codec, which the Simulator "
                            "runs as every route does (see docs/adding_a_compressor.md)")
        self.n_ranks = n_ranks
        self.compressors: List[Compressor] = []
        for rank in range(n_ranks):
            compressor = copy.deepcopy(compression)
            if seed is not None:
                compressor.seed = int(seed)
            compressor.state.route = "Simulator"
            self.compressors.append(compressor.bind(rank, n_ranks))
        #: what each rank handed to the collectives in the last step (bytes)
        self.bytes_sent_per_rank: List[int] = [0] * n_ranks
        #: values (entries) each rank sent in the last step
        self.values_sent_per_rank: List[int] = [0] * n_ranks
        #: what each rank handed to each collective in the last step: ``(name, "allreduce" or
        #: "allgather", bytes)``
        self.collectives_per_rank: List[List[Tuple[str, str, int]]] = [[] for _ in range(n_ranks)]
        self.dense_bytes = 0
        self.steps = 0

    @property
    def bytes_sent(self) -> int:
        """Wire bytes per rank in the last step (mean over ranks; Gaussian-k's vary)."""
        return int(round(sum(self.bytes_sent_per_rank) / self.n_ranks))

    def residuals(self, name: str) -> List[Optional[np.ndarray]]:
        """Each rank's error-feedback residual of ``name`` (the engine's buckets written out first)."""
        return [c.residual(name) for c in self.compressors]

    def velocities(self, name: str) -> List[Optional[np.ndarray]]:
        """Each rank's momentum-correction velocity of ``name`` (``None`` without ``momentum``)."""
        return [c.velocity(name) if hasattr(c, "velocity") else None for c in self.compressors]

    def step(self, grads: Mapping[str, Sequence[Any]]) -> Dict[str, np.ndarray]:
        """Aggregate one step: ``{name: [grad of rank 0, ..., rank N-1]}`` -> ``{name: average}``.

        Gradients may be numpy arrays, torch or TensorFlow tensors (then that framework's kernels run;
        eager TensorFlow CPU tensors run numpy's, as in the exchanges: :func:`~hvd_compress.kernels.computed_form`).
        """
        originals = {name: per_rank[0] for name, per_rank in grads.items()}
        grads = {name: self._rank_arrays(name, per_rank) for name, per_rank in grads.items()}
        before = [(c.stats.bytes_sent, c.stats.values_sent) for c in self.compressors]
        out = self._engine_step(grads, originals)
        self.bytes_sent_per_rank = [c.stats.bytes_sent - b for c, (b, _) in zip(self.compressors, before)]
        self.values_sent_per_rank = [c.stats.values_sent - v for c, (_, v) in zip(self.compressors, before)]
        self.dense_bytes = sum(array_nbytes(per_rank[0]) for per_rank in grads.values())
        self.steps += 1
        return out

    def _engine_step(self, grads: Dict[str, List[Any]], originals: Dict[str, Any]) -> Dict[str, Any]:
        """One step of the real engine on every rank in lockstep (:mod:`~hvd_compress.transport.lockstep`):
        the whole step is one bucket; every rank launches, then completes, then finishes it."""
        group = LockstepGroup(self.n_ranks)
        exchanges = []
        for rank, compressor in enumerate(self.compressors):
            exchange = open_exchange(compressor, group.rank(rank), "simulator")
            for name, per_rank in grads.items():
                exchange.add(name, per_rank[rank])
            exchange.launch(complete=False)
            exchanges.append(exchange)
        for exchange in exchanges:
            exchange.complete()
        results = [exchange.finish(average=True) for exchange in exchanges]
        self.collectives_per_rank = group.posted
        return {name: in_form_of(results[0][name], originals[name]) for name in grads}

    def _rank_arrays(self, name: str, per_rank: Sequence[Any]) -> List[Any]:
        if len(per_rank) != self.n_ranks:
            raise ValueError(
                f"hvd_compress: tensor '{name}' has {len(per_rank)} gradients for " f"{self.n_ranks} ranks"
            )
        arrays = [as_tensor(g) for g in per_rank]
        shapes = {tuple(a.shape) for a in arrays}
        if len(shapes) != 1:
            raise ValueError(f"hvd_compress: ranks disagree on the shape of '{name}': {shapes}")
        return arrays

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's compressor state (residuals, distortion, random stream)."""
        return {"ranks": [c.state_dict() for c in self.compressors], "steps": self.steps}

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`, or a list of every rank's compressor state in rank order (what
        the ranks of any route save: ``compressor.state_dict()``, ``CompressionState.state_dict()``,
        ``optimizer.state_dict()["hvd_compress"]``), to go on from a multi-process run (``steps``
        then counts from 0)."""
        if isinstance(state, (list, tuple)):
            state = {"ranks": list(state), "steps": 0}
        if not isinstance(state, dict) or "ranks" not in state:
            one = isinstance(state, dict) and "config" in state and "tensors" in state
            raise ValueError(
                "hvd_compress: a Simulator loads Simulator.state_dict() or a list of every rank's compressor "
                "state in rank order; this is "
                + (f"the state of one rank (written by {writer(state)}): pass [state of rank 0, ..., "
                   f"state of rank {self.n_ranks - 1}]" if one else f"a {type(state).__name__}")
            )
        if len(state["ranks"]) != self.n_ranks:
            raise ValueError(
                f"hvd_compress: state of {len(state['ranks'])} ranks cannot load into "
                f"a Simulator of {self.n_ranks}; regroup it for {self.n_ranks} ranks, keeping the sum of the "
                f"residuals: [hvd_compress.regroup_states(state, r, {self.n_ranks}) for r in range({self.n_ranks})]"
            )
        for compressor, rank_state in zip(self.compressors, state["ranks"]):
            compressor.load_state_dict(rank_state)
        for compressor in self.compressors:  # each rank's own state, in rank order
            note = compressor.state.note(compressor.rank)
            if note:
                raise ValueError(f"hvd_compress: the Simulator's states are not in rank order{note}")
        self.steps = int(state.get("steps", 0))
