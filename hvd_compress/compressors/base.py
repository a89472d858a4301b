"""The compressor interface shared by every algorithm.

A compressor turns one rank's gradient into a payload (``encode``) and a list of
all ranks' payloads into the dense aggregate (``decode``). Neither call
communicates: the communicators in :mod:`hvd_compress.comm` (and the
:class:`~hvd_compress.simulator.Simulator`) move the payloads.
"""
from __future__ import annotations

import numbers
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hvd_compress.compressors import reference
from hvd_compress.compressors.payload import DensePayload
from hvd_compress.compressors.residual import TensorMemory


def check_ratio(ratio: Any) -> float:
    """``ratio`` as a float in (0, 1]; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"hvd_compress: ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"hvd_compress: ratio must be in (0, 1], got {ratio!r}")
    return ratio


def as_array(tensor: Any, name: str) -> np.ndarray:
    """The numpy array behind ``tensor``; framework tensors go through their adapters."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if isinstance(tensor, (list, tuple, numbers.Number)):
        return np.asarray(tensor)
    raise TypeError(
        f"hvd_compress: gradient '{name}' is a {type(tensor).__module__}.{type(tensor).__name__}; "
        "the core compressors take numpy arrays"
    )


def check_gradient(array: np.ndarray, name: str, who: str) -> None:
    """Reject what no compressor can handle, naming the tensor."""
    if array.dtype.kind != "f":
        raise TypeError(
            f"hvd_compress: {who} cannot compress '{name}' of dtype {array.dtype}; "
            "gradients must be floating point"
        )
    if array.size == 0:
        raise ValueError(f"hvd_compress: {who} cannot compress '{name}': the tensor is empty")
    finite = np.isfinite(array)
    if not finite.all():
        bad = int(array.size - np.count_nonzero(finite))
        raise ValueError(
            f"hvd_compress: gradient '{name}' has {bad} NaN/Inf of {array.size} entries; "
            f"{who} cannot compress it (lower the learning rate or loss scale, or skip the step)"
        )


class Compressor:
    """Base class: validation, per-tensor memory, rank binding and checkpoints.

    Subclasses implement ``_encode(flat, name, shape)`` and, when their payload is
    not dense, ``_sum(payloads, numel)``.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)
        self.rank, self.size = 0, 1
        self.memory = TensorMemory()
        self._rng: Optional[np.random.Generator] = None

    # ------------------------------------------------------------------ setup
    def bind(self, rank: int, size: int) -> "Compressor":
        """Tell the compressor which rank of how many it runs on (random streams, wire format)."""
        if not 0 <= rank < size:
            raise ValueError(f"hvd_compress: rank {rank} is not in [0, {size})")
        self.rank, self.size = int(rank), int(size)
        self._rng = None
        return self

    @property
    def rng(self) -> np.random.Generator:
        """This rank's random stream: ``default_rng([seed, rank])``."""
        if self._rng is None:
            self._rng = np.random.default_rng([self.seed, self.rank])
        return self._rng

    def config(self) -> Dict[str, Any]:
        """Type and parameters; ranks must agree on it."""
        return {"type": type(self).__name__}

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "type")
        return f"{type(self).__name__}({params})"

    # ------------------------------------------------------------- interface
    def encode(self, tensor: Any, name: str, **options: Any) -> Any:
        """One rank's payload for ``tensor``; updates that tensor's residual."""
        flat, shape = self._validated(tensor, name)
        return self._encode(flat, name, shape, **options)

    def _validated(self, tensor: Any, name: str):
        """``(flat array, shape)`` of a gradient this compressor accepts."""
        array = as_array(tensor, name)
        check_gradient(array, name, type(self).__name__)
        return array.reshape(-1), array.shape

    def decode(
        self,
        payloads: Sequence[Any],
        shape: Sequence[int],
        average: bool = True,
        name: Optional[str] = None,
    ) -> np.ndarray:
        """Dense aggregate of all ranks' ``payloads`` (rank order), averaged or summed.

        With ``name``, compressors that learn from the aggregate (RegTop-k) record it
        for that tensor's next selection.
        """
        payloads = list(payloads)
        if not payloads:
            raise ValueError("hvd_compress: decode needs the payloads of at least one rank")
        shape = tuple(int(n) for n in shape)
        numel = int(np.prod(shape, dtype=np.int64))
        total, dtype = self._sum(payloads, numel)
        if name is not None:
            self._observe(name, total)
        if average:
            total = total / total.dtype.type(len(payloads))
        return total.astype(dtype, copy=False).reshape(shape)

    def residual(self, name: str) -> Optional[np.ndarray]:
        """Error-feedback residual of ``name`` in the tensor's shape (``None`` if it has none)."""
        residual = self.memory.peek(name, "residual")
        return None if residual is None else residual.reshape(self.memory.shape(name))

    def reset(self, name: Optional[str] = None) -> None:
        """Drop the state of one tensor, or of all."""
        self.memory.reset(name)

    def state_dict(self) -> Dict[str, Any]:
        """Residuals, per-tensor state and the random stream, for checkpoints."""
        state = {"config": self.config(), "tensors": self.memory.state_dict()}
        if self._rng is not None:
            state["rng"] = self._rng.bit_generator.state
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a checkpoint of another algorithm is an error."""
        saved = state.get("config", {}).get("type")
        if saved != type(self).__name__:
            raise ValueError(
                f"hvd_compress: checkpoint holds {saved} state; cannot load it into {self!r}"
            )
        self.memory.load_state_dict(state["tensors"])
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]

    # ------------------------------------------------------------ for subclasses
    def _encode(self, flat: np.ndarray, name: str, shape: tuple) -> Any:
        raise NotImplementedError

    def _sum(self, payloads: List[Any], numel: int):
        """Sum over ranks of dense payloads; returns ``(total, dtype to decode to)``."""
        return dense_sum(payloads, numel)

    def _observe(self, name: str, total: np.ndarray) -> None:
        """Hook for compressors that learn from the aggregate; default: nothing."""


def dense_sum(payloads: List[DensePayload], numel: int):
    """Sum of dense payloads in rank order, in at least float32."""
    dtype = payloads[0].dtype
    total = np.zeros(numel, dtype=reference.accumulation_dtype(payloads[0].values.dtype))
    for payload in payloads:
        if payload.values.size != numel:
            raise ValueError(
                f"hvd_compress: a rank sent {payload.values.size} elements, expected {numel}; "
                "ranks disagree on the tensor shape"
            )
        total += payload.values.reshape(-1)
    return total, dtype
