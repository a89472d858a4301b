"""The per-tensor spec of N ranks for a compressor, the yardstick the bucket engine is tested against.

:class:`PerTensorRanks` reads a compressor's configuration and steps the independent numpy
specification (:mod:`spec`, which shares no code with the package) tensor by tensor, rank by rank:
built-in algorithms by their rule in :mod:`spec`, a user's :class:`~hvd_compress.algorithms.sparse.Sparsifier`
by its own ``_select`` on each rank's copy (the rule is the user's definition; error feedback,
momentum and sums are the spec's). Gradients may be torch or TensorFlow tensors: the spec runs on
their values, TernGrad drawing from the stream that framework's kernels draw from, and the averages
come back in the gradients' form.

The engine (:mod:`hvd_compress.engine.fused`; the Simulator runs it) must give the same averages,
residuals and velocities, bit for bit on numpy.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.algorithms import as_compressor
from hvd_compress.algorithms.sparse import Sparsifier
from hvd_compress.kernels import computed_form, ops_for, reference
from spec import Ranks, sparse, terngrad
from spec.ranks import Dense, counter_draws, numpy_draws

RULES = {TopK: sparse.topk_select, GaussianK: sparse.gaussiank_select, RegTopK: sparse.regtopk_select}


def spec_option(compressor: Any, current: List[Any]) -> Any:
    """The spec's option for ``compressor`` (``current``: the tensor being stepped and a gradient of it, for
    a user's rule, which runs on that gradient's framework)."""
    if isinstance(compressor, TernGrad):
        return terngrad.TernGrad(compressor.clip, compressor.scalar_sharing, compressor.error_feedback,
                                 compressor.dense_below)
    if isinstance(compressor, (FP16, NoneCompressor)):
        return Dense(np.float16 if isinstance(compressor, FP16) else None)
    if not isinstance(compressor, Sparsifier):
        raise TypeError(f"the spec has no rule for {type(compressor).__name__}")
    rule = next((r for cls, r in RULES.items() if type(compressor) is cls), None)
    if rule is None:  # a user's selection, on this rank's copy, with the kernels of the gradients' framework
        def rule(a: np.ndarray, ratio: float, posterior: Any, mu: float) -> np.ndarray:
            name, like = current
            on = a if isinstance(like, np.ndarray) else in_form_of(a, like)
            return as_numpy(compressor._select(on, name, a.shape, ops_for(on) if on is not a else reference))

    return sparse.Sparse(rule, compressor.ratio, compressor.error_feedback, compressor.dense_below,
                         compressor.dense_when_cheaper, compressor.momentum, getattr(compressor, "mu", 5.0),
                         learns_posterior=isinstance(compressor, RegTopK))


def framework_draws(like: Any, seed: int, rank: int) -> Callable[[int], np.ndarray]:
    """Rank ``rank``'s uniforms as the kernels of ``like``'s framework draw them (seeded from ``(seed, rank)``)."""
    name = ops_for(computed_form(like)).__name__
    if name.endswith("torch_ops"):
        import torch

        from hvd_compress.kernels import torch_ops

        if torch_ops.on_host(like):  # a counter stream; an accelerator's torch.Generator elsewhere
            return counter_draws(seed, rank)
        state = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint32)
        stream = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        return lambda n: torch.rand(n, generator=stream, dtype=torch.float32).numpy()
    if name.endswith("tf_ops"):
        import tensorflow as tf

        key = np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64).view(np.int64)
        with tf.device("/cpu:0"):
            stream = tf.random.Generator.from_key_counter(int(key[0]), [0, 0], "philox")
        return lambda n: stream.uniform([n], dtype=tf.float32).numpy()
    return numpy_draws(seed, rank)


def as_numpy(tensor: Any) -> np.ndarray:
    """A tensor's values as a numpy array of its dtype (torch's bfloat16 as ml_dtypes')."""
    if str(getattr(tensor, "dtype", "")) == "torch.bfloat16":
        import ml_dtypes  # noqa: F401  (skips where it is missing: tests/kernels/frameworks.py)
        import torch

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)


def in_form_of(array: np.ndarray, like: Any) -> Any:
    """``array`` as a tensor of ``like``'s framework and device."""
    if isinstance(like, np.ndarray):
        return array
    if str(like.dtype) == "torch.bfloat16":
        import torch

        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(like.device)
    return ops_for(like).from_host(array, like)


class RankView:
    """One rank of :class:`PerTensorRanks`: its compressor's configuration (read and set through it) and
    the spec's state of that rank (``residual``, ``velocity`` in each tensor's shape)."""

    def __init__(self, oracle: "PerTensorRanks", compressor: Any) -> None:
        self.__dict__.update(oracle=oracle, compressor=compressor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compressor, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.compressor, name, value)

    def residual(self, name: str) -> Optional[np.ndarray]:
        return self.oracle.residuals(name)[self.compressor.rank]

    def velocity(self, name: str) -> Optional[np.ndarray]:
        return self.oracle.velocities(name)[self.compressor.rank]


class PerTensorRanks:
    """``n_ranks`` ranks of ``compression`` on the spec; ``seed`` replaces the compressor's own (``None``
    keeps it), as ``Simulator(n_ranks, compression, seed)`` does."""

    def __init__(self, n_ranks: int, compression: Any, seed: Optional[int] = None) -> None:
        compression = as_compressor(compression, "the oracle's compression")
        self.n_ranks, self.current = n_ranks, ["", None]
        self.compressors = []
        for rank in range(n_ranks):
            compressor = copy.deepcopy(compression)
            if seed is not None:
                compressor.seed = int(seed)
            self.compressors.append(RankView(self, compressor.bind(rank, n_ranks)))
        self.ranks: Optional[Ranks] = None
        self.shapes: Dict[str, tuple] = {}

    def step(self, grads: Mapping[str, Sequence[Any]]) -> Dict[str, Any]:
        """``{name: [grad of rank 0, ..., rank N-1]}`` -> ``{name: average}`` (in the gradients' form)."""
        options = [spec_option(c.compressor, self.current) for c in self.compressors]  # as configured now
        if self.ranks is None:
            like = next(iter(grads.values()))[0]
            self.ranks = Ranks(self.n_ranks, options, draws=[framework_draws(like, c.seed, c.rank) for c in self.compressors])
        self.ranks.options = options
        out = {}
        for name, per_rank in grads.items():
            assert len(per_rank) == self.n_ranks
            self.current[:] = [name, computed_form(per_rank[0])]  # eager TensorFlow CPU tensors: as numpy
            average = self.ranks.step({name: [as_numpy(g) for g in per_rank]})[name]
            self.shapes[name] = tuple(np.shape(average))
            out[name] = in_form_of(average, per_rank[0])
        return out

    def residuals(self, name: str) -> List[Any]:
        """Each rank's error-feedback residual of ``name`` in the tensor's shape (``None`` where it has none)."""
        return [self._shaped(self.ranks.residual(rank, name), name) for rank in range(self.n_ranks)]

    def velocities(self, name: str) -> List[Any]:
        """Each rank's momentum-correction velocity of ``name`` in the tensor's shape (``None`` without ``momentum``)."""
        return [self._shaped(self.ranks.velocity(rank, name), name) for rank in range(self.n_ranks)]

    def _shaped(self, array: Optional[np.ndarray], name: str) -> Optional[np.ndarray]:
        return None if array is None else array.reshape(self.shapes[name])
