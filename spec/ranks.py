"""N ranks stepped tensor by tensor: every rank's step, the sums in rank order, every rank's average.

A tensor sent dense (every tensor of None and FP16; a sparsifier's under ``dense_below`` or where
``N k >= d``; TernGrad's under ``dense_below``) is summed as a dense allreduce sums it: what each rank
sends (the gradient, plus once a residual left from when it was compressed; under momentum
correction the velocity ``u = m u + g``; FP16: rounded to float16) summed in rank order in at least
float32 and rounded once to the dtype sent. Every average is the sum (accumulation dtype) divided
by N, rounded to the gradient's dtype.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from spec import sparse, terngrad
from spec.common import accumulation, allreduce_sum, saturate


class Dense:
    """No compression (``wire=None``) or a cast for the wire (FP16: ``wire=np.float16``)."""

    def __init__(self, wire: Optional[Any] = None) -> None:
        self.wire = wire

    def dense(self, numel: int, ranks: int) -> bool:
        return True


Option = Union[Dense, sparse.Sparse, terngrad.TernGrad]


def numpy_draws(seed: int, rank: int) -> Callable[[int], np.ndarray]:
    """Rank ``rank``'s stream: ``default_rng([seed, rank])``, float32 draws on [0, 1)."""
    stream = np.random.default_rng([seed, rank])
    return lambda n: stream.random(n, dtype=np.float32)


def counter_draws(seed: int, rank: int) -> Callable[[int], np.ndarray]:
    """Rank ``rank``'s counter stream (torch's on the host): its 64-bit seed ``s`` is
    ``SeedSequence([seed, rank])``'s first two 32-bit words; a call for ``n`` draws at position ``p`` keys
    ``(k0, k1)`` = the low and high words of ``splitmix64(s + p)``, then ``d_j = h(h(j 0x9E3779B9 + k0) ^ k1)``
    mod 2^32 with ``h`` = lowbias32, and ``u_j = (d_j mod 2^24) 2^-24`` in float32."""
    words = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint32)
    stream = {"seed": int(words[0]) << 32 | int(words[1]), "position": 0}
    mask = (1 << 64) - 1

    def lowbias32(x: np.ndarray) -> np.ndarray:
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        return x ^ (x >> np.uint32(16))

    def draw(n: int) -> np.ndarray:
        z = (stream["seed"] + stream["position"] + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        stream["position"] += n
        with np.errstate(over="ignore"):
            j = np.arange(n, dtype=np.uint32) * np.uint32(0x9E3779B9) + np.uint32(z & 0xFFFFFFFF)
            d = lowbias32(lowbias32(j) ^ np.uint32(z >> 32))
        return (d & np.uint32(0xFFFFFF)).astype(np.float32) * np.float32(2.0**-24)

    return draw


class Ranks:
    """``n_ranks`` ranks running ``option`` (or a list of each rank's: a rule of a user's that draws from
    each rank's own stream); ``draws[r](n)``: rank ``r``'s next ``n`` uniforms (default:
    :func:`numpy_draws` of ``seed``)."""

    def __init__(self, n_ranks: int, option: Union[Option, Sequence[Option]], seed: int = 0,
                 draws: Optional[Sequence[Callable[[int], np.ndarray]]] = None) -> None:
        #: each rank's option (may change between steps: a density schedule)
        self.options = list(option) if isinstance(option, (list, tuple)) else [option] * n_ranks
        self.n_ranks = n_ranks
        self.draws = list(draws) if draws is not None else [numpy_draws(seed, r) for r in range(n_ranks)]
        #: per rank, per tensor: ``residual``, ``velocity``, ``posterior`` (flat, accumulation dtype)
        self.states: List[Dict[str, Dict[str, Any]]] = [{} for _ in range(n_ranks)]

    @property
    def option(self) -> Option:
        return self.options[0]

    def step(self, grads: Mapping[str, Sequence[np.ndarray]]) -> Dict[str, np.ndarray]:
        """``{name: [gradient of rank 0, ..., rank N-1]}`` -> ``{name: average}``, in the tensors' order."""
        out = {}
        for name, per_rank in grads.items():
            flats = [np.asarray(g).reshape(-1) for g in per_rank]
            states = [state.setdefault(name, {}) for state in self.states]
            if self.option.dense(flats[0].shape[0], self.n_ranks):
                total = self._dense(flats, states)
            elif isinstance(self.option, terngrad.TernGrad):
                total = terngrad.step(self.option, flats, states, self.draws)
            else:
                total = self._sparse(flats, states)
            average = total.astype(accumulation(flats[0].dtype)) / accumulation(flats[0].dtype).type(self.n_ranks)
            out[name] = average.astype(flats[0].dtype).reshape(np.shape(per_rank[0]))
        return out

    def _dense(self, flats: List[np.ndarray], states: List[Dict[str, Any]]) -> np.ndarray:
        wire = getattr(self.option, "wire", None)
        sent = []
        for g, state in zip(flats, states):
            residual = state.pop("residual", None)  # left from when the tensor was compressed: sent once
            if getattr(self.option, "momentum", 0.0):
                u = sparse.velocity_step(self.option, g, state)
                sent.append(saturate(u if residual is None else u + residual, g.dtype if wire is None else wire))
                continue
            x = g if residual is None else saturate(g + residual, g.dtype)
            sent.append(x if wire is None else x.astype(wire))
        return allreduce_sum(sent)

    def _sparse(self, flats: List[np.ndarray], states: List[Dict[str, Any]]) -> np.ndarray:
        parts = [sparse.sparse_send(option, g, state) for option, g, state in zip(self.options, flats, states)]
        total = sparse.sparse_sum(parts, flats[0].shape[0], flats[0].dtype)
        if self.option.learns_posterior:
            for part, state in zip(parts, states):
                sparse.learn_posterior(total, part, state)
        return total

    def residual(self, rank: int, name: str) -> Optional[np.ndarray]:
        return self.states[rank].get(name, {}).get("residual")

    def velocity(self, rank: int, name: str) -> Optional[np.ndarray]:
        return self.states[rank].get(name, {}).get("velocity")
