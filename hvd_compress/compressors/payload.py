"""What a compressor puts on the wire for one tensor of one rank.

``nbytes`` is the number of bytes this rank hands to the collective for the
tensor: the quantity Horovod's timeline and our byte counters report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hvd_compress.compressors import reference


def array_nbytes(array: Any) -> int:
    """Bytes of a numpy array or framework tensor (torch, TF) without copying it."""
    if hasattr(array, "nbytes"):  # numpy
        return int(array.nbytes)
    if hasattr(array, "element_size"):  # torch
        return int(array.numel() * array.element_size())
    return int(np.prod(array.shape, dtype=np.int64)) * array.dtype.size  # tensorflow


@dataclass(frozen=True)
class DensePayload:
    """The whole tensor, possibly cast (``FP16``); ``dtype`` is the dtype to decode to."""

    values: Any
    dtype: Any

    @property
    def nbytes(self) -> int:
        return array_nbytes(self.values)


@dataclass(frozen=True)
class SparsePayload:
    """Selected entries of a flattened tensor of ``numel`` elements: ``values[i]`` at ``indices[i]``."""

    values: Any
    indices: Any
    numel: int

    @property
    def nbytes(self) -> int:
        return array_nbytes(self.values) + array_nbytes(self.indices)


@dataclass(frozen=True)
class TernaryPayload:
    """TernGrad codes ``t`` in {-1, 0, 1} (int8) and the scale ``S``; the tensor is ``S * t``.

    ``world_size`` and ``shared_scale`` fix the wire format: with a shared scale the
    codes of all ranks are summed by an integer allreduce of packed lanes (or
    allgathered as 2-bit codes when that moves fewer bytes); without one, each
    rank's 2-bit codes and scale are allgathered.
    """

    codes: Any
    scale: float
    world_size: int = 1
    shared_scale: bool = True
    dtype: Any = np.float32

    @property
    def wire_format(self) -> str:
        if not self.shared_scale:
            return "allgather"
        return reference.ternary_wire_format(self.codes.shape[0], self.world_size)

    @property
    def nbytes(self) -> int:
        numel = int(self.codes.shape[0])
        if self.wire_format == "allreduce":
            code_bytes = 4 * reference.ternary_lanes(numel, self.world_size)
        else:
            code_bytes = reference.two_bit_bytes(numel)
        return code_bytes + np.dtype(np.float32).itemsize  # + the scale
