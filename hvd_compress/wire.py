"""What travels on the wire: the formats' sizes, and the bucket header.

This module is the one place that defines the formats; it imports nothing of
the library, so kernels, codecs, exchanges and the Simulator all build on it.

A fused bucket's dense tensors travel as one allreduce-Sum of their concatenation;
a sparsifier's (value, index) slots as two allgathers. TernGrad's codes ``t`` in
{-1, 0, 1}, with a scale shared by all ranks, are summed by an int32 allreduce of
*lanes*: the codes ``t + 1`` of ``N`` ranks in fields of ``b = ceil(log2(2N + 1))``
bits, ``floor(32 / b)`` per int32, so a field's sum over ranks never carries into
the next; or, when that moves fewer bytes (:func:`ternary_wire_format`), the codes
travel as 2-bit fields (four per byte) in one allgather. Without a shared scale
every rank's 2-bit codes and scale are allgathered. The packing itself
(numpy specification) is ``pack_ternary``/``pack_two_bit`` in
:mod:`hvd_compress.kernels.reference`, with torch and TensorFlow kernels beside it.

The bucket header (:func:`header_hash`): ranks exchange ``[config hash, layout
hash]`` once per layout and refuse to go on when they differ, so ranks
configured differently fail with one clear error instead of waiting for
collectives the others never start.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, Optional

import numpy as np


def header_hash(value: Any) -> int:
    """31-bit fingerprint of ``repr(value)`` (a configuration or a layout), equal on ranks that agree."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


#: algorithm numbers a header can carry (:func:`header_config`): compressor class name -> number,
#: filled by :func:`register_algorithm` (``hvd_compress.algorithms.registry`` registers the built-in
#: compressors with fixed numbers, so headers and their errors never change between releases)
_ALGORITHM_NUMBERS: Dict[str, int] = {}

#: numbers below this one are kept for the built-in compressors; others get theirs from their name
FIRST_FREE_NUMBER = 64
_LARGEST_NUMBER = 2**31 - 1  # the number sits above bit 32 of an int64 column


def register_algorithm(algorithm: str, number: Optional[int] = None) -> int:
    """Give the compressor class ``algorithm`` its header number and return it.

    Without ``number`` it is ``FIRST_FREE_NUMBER + header_hash(algorithm) mod (2^31 - 1 -
    FIRST_FREE_NUMBER)``: the same on every rank whatever order ranks register in. Two names
    with one number, or one name with two, are an error.
    """
    if number is None:
        number = FIRST_FREE_NUMBER + header_hash(algorithm) % (_LARGEST_NUMBER - FIRST_FREE_NUMBER)
    if not 0 < number <= _LARGEST_NUMBER:
        raise ValueError(f"hvd_compress: algorithm number {number} of {algorithm} must be in 1..{_LARGEST_NUMBER}")
    owner = algorithm_name(number)
    if _ALGORITHM_NUMBERS.get(algorithm, number) != number or owner not in (None, algorithm):
        raise ValueError(
            f"hvd_compress: cannot number {algorithm} {number}: {owner or algorithm} already has "
            f"{number if owner else _ALGORITHM_NUMBERS[algorithm]}"
        )
    _ALGORITHM_NUMBERS[algorithm] = number
    return number


def unregister_algorithm(algorithm: str) -> None:
    """Forget ``algorithm``'s number (its headers then carry 0, "another compressor")."""
    _ALGORITHM_NUMBERS.pop(algorithm, None)


def algorithm_name(number: int) -> Optional[str]:
    """The class name registered with ``number``, ``None`` when none is."""
    return next((name for name, n in _ALGORITHM_NUMBERS.items() if n == number), None)


def header_config(algorithm: str, config_hash: int) -> int:
    """The header's configuration column: the 31-bit hash, and above bit 32 the algorithm's number
    (0: one not registered, :func:`register_algorithm`), so that every rank can name every rank's algorithm."""
    return config_hash | _ALGORITHM_NUMBERS.get(algorithm, 0) << 32


def different_algorithms(columns: Any) -> str:
    """``""``, or ``"; ranks run different compressors: rank 0 TopK, rank 1 FP16"`` from the
    configuration columns of every rank's header (:func:`header_config`)."""
    codes = [int(column) >> 32 for column in columns]
    if len(set(codes)) < 2:
        return ""
    names = [algorithm_name(c) or "another compressor" for c in codes]
    return "; ranks run different compressors: " + ", ".join(f"rank {r} {n}" for r, n in enumerate(names))


def ternary_field_bits(world_size: int) -> int:
    """Bits ``b = ceil(log2(2N + 1))`` of a field holding ``sum over N ranks of (t + 1)``."""
    return max(1, math.ceil(math.log2(2 * world_size + 1)))


def ternary_codes_per_lane(world_size: int) -> int:
    """``floor(32 / b)`` codes share one int32 lane of the integer allreduce."""
    return 32 // ternary_field_bits(world_size)


def ternary_lanes(numel: int, world_size: int) -> int:
    """int32 lanes holding ``numel`` packed codes for ``world_size`` ranks."""
    return -(-numel // ternary_codes_per_lane(world_size))


def two_bit_bytes(numel: int) -> int:
    """Bytes of ``numel`` codes packed 2 bits each (four per byte)."""
    return -(-numel // 4)


def ternary_wire_format(numel: int, world_size: int) -> str:
    """``"allreduce"`` (packed int32 sum) or ``"allgather"`` (2-bit codes), by bytes moved.

    A ring allreduce of ``P`` bytes moves ``2 (N-1)/N * P`` per rank, a ring
    allgather of ``Q`` bytes per rank moves ``(N-1) * Q``: allgather wins when
    ``N * Q < 2 * P``.
    """
    packed = 4 * ternary_lanes(numel, world_size)
    if world_size * two_bit_bytes(numel) < 2 * packed:
        return "allgather"
    return "allreduce"


def array_nbytes(array: Any) -> int:
    """Bytes of a numpy array or framework tensor (torch, TF) without copying it."""
    if hasattr(array, "nbytes"):  # numpy
        return int(array.nbytes)
    if hasattr(array, "element_size"):  # torch
        return int(array.numel() * array.element_size())
    return int(np.prod(array.shape, dtype=np.int64)) * array.dtype.size  # tensorflow
