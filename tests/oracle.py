"""The per-tensor spec of N ranks, the yardstick the bucket engine is tested against.

:class:`PerTensorRanks` steps N copies of a compressor tensor by tensor, through the compressors'
own ``encode`` and ``decode`` (the algorithm's definition, one tensor at a time) and nothing of
:mod:`hvd_compress.engine`: per tensor, in the order given, every rank encodes its gradient, the
payloads are "allgathered" (the list in rank order) and every rank decodes the average
(sparse payloads: scatter-add; ternary: packed integer sum). TernGrad with scalar sharing learns
the shared scales first (``encode_options``: the allreduce-Max of every rank's per-layer scales).

The engine (:mod:`hvd_compress.engine.fused`; the Simulator runs it) must give the same averages
and residuals bit for bit; its bytes differ where its wire does (a flag per compressed tensor,
the layout check's header, Gaussian-k's ``floor(4k/3)`` slots), so ``bytes_sent_per_rank`` here
is the per-tensor payloads' ``nbytes``.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Sequence

from hvd_compress.algorithms import as_compressor
from hvd_compress.algorithms.base import as_tensor
from hvd_compress.kernels import in_form_of


class PerTensorRanks:
    """``n_ranks`` copies of ``compression``, rank ``r`` bound to ``(r, n_ranks)``; ``seed`` replaces
    the compressor's own (``None`` keeps it), as ``Simulator(n_ranks, compression, seed)`` does."""

    def __init__(self, n_ranks: int, compression: Any, seed: Optional[int] = None) -> None:
        compression = as_compressor(compression, "the oracle's compression")
        self.n_ranks = n_ranks
        self.compressors = []
        for rank in range(n_ranks):
            compressor = copy.deepcopy(compression)
            if seed is not None:
                compressor.seed = int(seed)
            self.compressors.append(compressor.bind(rank, n_ranks))
        self.bytes_sent_per_rank: List[int] = [0] * n_ranks

    def step(self, grads: Mapping[str, Sequence[Any]]) -> Dict[str, Any]:
        """``{name: [grad of rank 0, ..., rank N-1]}`` -> ``{name: average}`` (in the gradients' form)."""
        originals = {name: per_rank[0] for name, per_rank in grads.items()}
        grads = {name: [as_tensor(g) for g in per_rank] for name, per_rank in grads.items()}
        assert all(len(per_rank) == self.n_ranks for per_rank in grads.values())
        shared = self.compressors[0].encode_options(self.compressors, grads)
        sent = [0] * self.n_ranks
        out: Dict[str, Any] = {}
        for name, per_rank in grads.items():
            options = shared.get(name, {})
            payloads = [c.encode(g, name, **options) for c, g in zip(self.compressors, per_rank)]
            for rank, payload in enumerate(payloads):
                sent[rank] += payload.nbytes
            decoded = [c.decode(payloads, tuple(per_rank[0].shape), name=name) for c in self.compressors]
            out[name] = in_form_of(decoded[0], originals[name])
        self.bytes_sent_per_rank = sent
        return out

    def residuals(self, name: str) -> List[Any]:
        """Each rank's error-feedback residual of ``name``."""
        return [c.residual(name) for c in self.compressors]

    def velocities(self, name: str) -> List[Any]:
        """Each rank's momentum-correction velocity of ``name`` (``None`` without ``momentum``)."""
        return [c.velocity(name) if hasattr(c, "velocity") else None for c in self.compressors]
