"""Fused passes of the torch kernels, compiled with ``torch.compile`` (inductor: C++/OpenMP on the CPU,
Triton on CUDA) where that is on, else run eagerly: the same functions, the same results.

Each pass is a plain torch function that reads the data once. The selection passes run over one
size group's ``(rows, n)`` view and write at most one byte per entry (marks in int8: inductor
vectorises int8 stores, not bool ones); the momentum update runs over a flat buffer and writes the
velocity into a buffer it is given:

* :func:`marks_and_largest`: ``m = [x > t_row]`` and each row's largest entry (NaN where the row
  holds NaN), for the sampled-threshold Top-k of :class:`~hvd_compress.kernels.torch_rows.Rows`;
* :func:`counts_above`: each row's count above each of its thresholds (Gaussian-k's correction,
  reused thresholds);
* :func:`marks_above`: ``m = [x > t_row]`` alone;
* :func:`magnitude_counts_above` and :func:`magnitude_marks_above`: the same of ``|x|``, from ``x`` (Gaussian-k
  counts and marks ``|a|`` without forming it);
* :func:`aged_marks`: the aggregate rule's scores ``rate (age + 1)`` marked above each row's limit, ``age + 1``
  written (the step's ages) and each row's largest ``|a|`` (its non-finite flag), without forming a score;
* :func:`moments`: each row's std and mean (Gaussian-k's first threshold);
* :func:`momentum_update`: momentum correction's velocity ``u = m u + g`` (one pass instead of two);
* :func:`largest_magnitudes`: each row's largest ``|x|`` (TernGrad's scales without clipping);
* :func:`ternary_scales`, :func:`keyed_ternary_codes` and :func:`ternary_codes`: TernGrad's per-row scales
  (extremes and the clipping bound's std in one pass) and its codes (in one pass instead of six), their
  uniforms made in the pass from each row's stream keys (:func:`counter_draws`,
  :mod:`~hvd_compress.kernels.counter_stream`) or read from drawn uniforms (an accelerator's generator);
* :func:`packed_fields` and :func:`scaled_rows`: TernGrad's codes packed into words, and the code sums times
  each row's scale (one pass each instead of three; unpacking compiles to slower code than torch's eager
  shifts, so it stays eager).

The results are integers, maxima and IEEE operations in the same order (inductor keeps
``-fno-unsafe-math-optimizations``, ``-ffp-contract=off``), so compiled and eager agree bit for bit;
the sums (Gaussian-k's moments, TernGrad's std) may round differently, within float rounding, as a
row-wise reduction does from one tensor's: a threshold between two neighbouring floats can move.

Where it runs compiled (:func:`enabled`): as a compressor's ``compile`` option says where it is set (``True``:
every device, ``False``: nowhere), else ``HVD_COMPRESS_COMPILE`` = ``1`` (every device), ``0``
(nowhere), or unset / ``auto``: on the CPU, where it is measured faster (``python -m benchmarks
select``), not on CUDA until a GPU run shows it faster there. Shapes are dynamic (one compile per
function, plus one for single-row groups: torch specialises sizes 0 and 1), so a new layout does
not compile again. Inductor's on-disk cache is shared by a job's processes and later runs: it is
``TORCHINDUCTOR_CACHE_DIR`` where set, else ``$HVD_COMPRESS_CACHE/inductor`` (default
``~/.cache/hvd_compress/inductor``). Where no compiler works (no C++ compiler, an unsupported
platform), the first failure warns once and every pass runs eagerly from then on.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

#: the switch: ``1`` compiled on every device, ``0`` never, unset or ``auto`` on the CPU only
COMPILE_ENV = "HVD_COMPRESS_COMPILE"
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
#: set once a compilation failed in this process: every pass is eager from then on
_broken = False


def enabled(device: torch.device, compile: Optional[bool] = None) -> bool:
    """Whether passes on ``device`` run compiled: ``compile`` where it is a bool (a compressor's option), else as
    ``HVD_COMPRESS_COMPILE`` says (module docstring); never once a compilation failed. ``ValueError`` for a
    value of ``HVD_COMPRESS_COMPILE`` that is none of the above."""
    if _broken or compile is not None:
        return bool(compile) and not _broken
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    if value not in ("", "auto"):
        raise ValueError(f"hvd_compress: {COMPILE_ENV}={value!r}: use 1, 0 or auto")
    return device.type == "cpu"


def cache_dir() -> Path:
    """Inductor's on-disk cache: ``TORCHINDUCTOR_CACHE_DIR``, else ``$HVD_COMPRESS_CACHE/inductor``."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    root = os.environ.get("HVD_COMPRESS_CACHE") or str(Path.home() / ".cache" / "hvd_compress")
    return Path(root) / "inductor"


class Pass:
    """A fused pass: ``fn`` compiled on first use where :func:`enabled`, else ``eager`` (default ``fn``):
    the same results in the passes eager torch takes well (one kernel per step, no broadcast temporaries)."""

    def __init__(self, fn: Callable[..., Any], eager: Optional[Callable[..., Any]] = None) -> None:
        self.fn, self.eager, self.compiled = fn, eager or fn, None
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__

    def __call__(self, *args: Any, compile: Optional[bool] = None) -> Any:
        """``compile``: the caller's choice (a compressor's option), else :func:`enabled` decides."""
        global _broken
        if not enabled(args[0].device, compile):
            return self.eager(*args)
        try:
            if self.compiled is None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir())
                self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            return self.compiled(*args)
        except Exception as error:  # noqa: BLE001  (any compiler failure: eager from now on)
            _broken = True
            warnings.warn(f"hvd_compress: torch.compile failed ({type(error).__name__}: {error}); the "
                          f"selection passes run eagerly in this process ({COMPILE_ENV}=0 skips compiling)",
                          RuntimeWarning, stacklevel=2)
            return self.eager(*args)


def _marks(rows: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``[rows > limit]`` as int8, eagerly: the comparison's bool bytes, viewed."""
    return torch.gt(rows, limit).view(torch.int8)


def _marks_and_largest(rows: torch.Tensor, limit: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _marks(rows, limit), rows.amax(dim=1)


def _counts_above(rows: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """:func:`counts_above`, eagerly: one comparison and count per threshold (no ``(R, n, m)`` temporary),
    counted by numpy on the CPU (torch's count of bool bytes takes several times longer)."""
    def count(above: torch.Tensor) -> torch.Tensor:
        if above.device.type == "cpu":
            return torch.from_numpy(np.count_nonzero(above.numpy(), axis=1).astype(np.int64))
        return above.sum(dim=1)

    return torch.stack([count(torch.gt(rows, limits[:, j : j + 1])) for j in range(limits.shape[1])], dim=1)


def marks_and_largest_source(rows: torch.Tensor, limit: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``([rows > limit]`` as int8, each row's largest entry): ``rows`` ``(R, n)``, ``limit`` ``(R, 1)``
    in ``rows``' dtype; the largest is NaN where a row holds NaN."""
    return marks_above_source(rows, limit), rows.amax(dim=1)


def marks_above_source(rows: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``[rows > limit]`` as int8 (a select of 1 and 0: inductor vectorises it, not a bool's bytes):
    ``rows`` ``(R, n)``, ``limit`` ``(R, 1)`` in ``rows``' dtype."""
    return torch.where(rows > limit, 1, 0).to(torch.int8)


def counts_above_source(rows: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """``c[i, j] = #{x in rows[i] : x > limits[i, j]}`` (int64): ``rows`` ``(R, n)``, ``limits`` ``(R, m)``
    in ``rows``' dtype. One count per threshold, unrolled: compiled, one loop reads the rows once into
    ``m`` counters (a broadcast ``(R, n, m)`` comparison compiles to ``m`` reads), counted in int32 where
    a row is shorter than 2^31 (int64 counters take twice as long)."""
    within = torch.int32 if rows.shape[1] < 2**31 else torch.int64
    counts = [(rows > limits[:, j : j + 1]).sum(dim=1, dtype=within) for j in range(limits.shape[1])]
    return torch.stack(counts, dim=1).to(torch.int64)


def aged_marks_source(a: torch.Tensor, rate: torch.Tensor, age: torch.Tensor, aged: torch.Tensor,
                      limit: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The aggregate rule's pass over ``(R, n)`` rows: ``aged = age + 1`` (written into ``aged``), then
    ``([rate aged > limit]`` as int8, each row's largest ``|a|``: ``max(-min a, max a)``, NaN where ``a`` holds
    NaN); ``limit`` ``(R, 1)``."""
    grown = age + 1
    aged.copy_(grown)
    return marks_above_source(rate * grown, limit), largest_magnitudes_source(a)


def _aged_marks(a: torch.Tensor, rate: torch.Tensor, age: torch.Tensor, aged: torch.Tensor,
                limit: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`aged_marks`, eagerly: the score in a temporary, compared in place."""
    torch.add(age, 1, out=aged)
    return _marks(torch.mul(rate, aged), limit), largest_magnitudes_source(a)


def largest_magnitudes_source(rows: torch.Tensor) -> torch.Tensor:
    """Each row's ``max |g| = max(-min g, max g)`` exactly (NaN where the row holds NaN), read once."""
    return torch.maximum(-rows.amin(dim=1), rows.amax(dim=1)).abs()


def momentum_update_source(velocity: torch.Tensor, g: torch.Tensor, momentum: float, out: torch.Tensor) -> None:
    """``out = m u + g`` in the velocity's dtype: ``m u`` rounded, then the sum (no fused multiply-add)."""
    out.copy_(velocity * momentum + g)


def _momentum_update(velocity: torch.Tensor, g: torch.Tensor, momentum: float, out: torch.Tensor) -> None:
    torch.mul(velocity, momentum, out=out).add_(g)


def magnitude_counts_above_source(rows: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """:func:`counts_above_source` of ``|rows|``, no ``|rows|`` formed."""
    return counts_above_source(rows.abs(), limits)


def magnitude_marks_above_source(rows: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """:func:`marks_above_source` of ``|rows|``, no ``|rows|`` formed."""
    return marks_above_source(rows.abs(), limit)


marks_and_largest = Pass(marks_and_largest_source, _marks_and_largest)
momentum_update = Pass(momentum_update_source, _momentum_update)
aged_marks = Pass(aged_marks_source, _aged_marks)
largest_magnitudes = Pass(largest_magnitudes_source)
marks_above = Pass(marks_above_source, _marks)
counts_above = Pass(counts_above_source, _counts_above)
magnitude_counts_above = Pass(magnitude_counts_above_source, lambda rows, limits: _counts_above(rows.abs(), limits))
magnitude_marks_above = Pass(magnitude_marks_above_source, lambda rows, limit: _marks(rows.abs(), limit))


@Pass
def ternary_scales(rows: torch.Tensor, clip: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """TernGrad's scales of each row (:func:`~hvd_compress.kernels.torch_ops.terngrad_bucket_scales`):
    ``(min(max|g|, b), b)``, ``b = c std(g)`` rounded once to the rows' dtype, +Inf where ``b = 0`` or the
    row is constant; ``max|g| = max(-min g, max g)`` exactly. ``clip`` <= 0: no bound (``b = +Inf``)."""
    low, high = rows.amin(dim=1), rows.amax(dim=1)
    local = torch.maximum(-low, high).abs()
    std = torch.std(rows, dim=1, correction=0)
    bound = (std.to(torch.float64) * clip).to(rows.dtype)
    bound = torch.where((bound <= 0) | (low == high), torch.inf, bound)
    return torch.minimum(local, bound), bound


#: :mod:`~hvd_compress.kernels.counter_stream`'s constants as int32 (mod 2^32): the index step and
#: ``lowbias32``'s two multipliers
COUNTER_STEP, MIX_1, MIX_2 = 0x9E3779B9 - (1 << 32), 0x7FEB352D, 0x846CA68B - (1 << 32)


def _mixed(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` of int32 words (multiplications wrap mod 2^32; each shift masked to be logical)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * MIX_1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * MIX_2
    return x ^ ((x >> 16) & 0xFFFF)


def counter_draws(key0: torch.Tensor, key1: torch.Tensor, n: int) -> torch.Tensor:
    """Draws ``0..n-1`` of each row's call of a counter stream, its keys ``key0`` and ``key1`` (int32, ``(R, 1)``):
    ``d_j = h(h(j * 0x9E3779B9 + k0) xor k1)`` (int32 ``(R, n)``; :mod:`~hvd_compress.kernels.counter_stream`)."""
    j = torch.arange(n, dtype=torch.int32, device=key0.device)
    return _mixed(_mixed(j * COUNTER_STEP + key0) ^ key1)


def uniforms(draws: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Raw 32-bit draws as uniforms on [0, 1) in ``dtype``: ``(d mod 2^24) 2^-24`` in float32 (exact), then
    rounded to ``dtype``."""
    return (torch.bitwise_and(draws, 0xFFFFFF).to(torch.float32) * 2.0**-24).to(dtype)


def _codes(rows: torch.Tensor, uniform: torch.Tensor, bound: torch.Tensor, scale: torch.Tensor,
           out: torch.Tensor) -> None:
    keep = uniform < torch.minimum(rows.abs(), bound) / scale
    out.copy_(torch.where(keep, torch.where(rows < 0, -1, 1), 0).to(torch.int8))


@Pass
def keyed_ternary_codes(rows: torch.Tensor, key0: torch.Tensor, key1: torch.Tensor, bound: torch.Tensor,
                        scale: torch.Tensor, out: torch.Tensor) -> None:
    """TernGrad's codes of each row (:func:`~hvd_compress.kernels.torch_ops.terngrad_bucket_codes`) written
    into ``out`` (int8, ``rows``' shape): ``sign(g) [u < min(|g|, b) / S]``, ``u`` the :func:`uniforms` in
    ``rows``' dtype of the :func:`counter_draws` of each row's keys; ``key0``, ``key1``, ``bound`` and ``scale``
    ``(R, 1)``."""
    _codes(rows, uniforms(counter_draws(key0, key1, rows.shape[1]), rows.dtype), bound, scale, out)


@Pass
def ternary_codes(rows: torch.Tensor, uniform: torch.Tensor, bound: torch.Tensor, scale: torch.Tensor,
                  out: torch.Tensor) -> None:
    """:func:`keyed_ternary_codes` from drawn uniforms ``uniform`` (``rows``' shape), rounded to ``rows``' dtype."""
    _codes(rows, uniform.to(rows.dtype), bound, scale, out)


@Pass
def packed_fields(codes: torch.Tensor, bits: int, per_word: int, word: torch.dtype) -> torch.Tensor:
    """Each row of ``codes`` (int8 ``(W, per_word)``, values in {-1, 0, 1}) as one ``word``:
    ``w = sum_i (t_i + 1) << bits i`` (the fields' bits are disjoint: the sum is their OR), the fields
    unrolled (a reduction over a row of dynamic length compiles to a slow loop)."""
    words = codes[:, 0].to(word) + 1
    for i in range(1, per_word):
        words = words + torch.bitwise_left_shift(codes[:, i].to(word) + 1, bits * i)
    return words


@Pass
def scaled_rows(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = values S`` per row (``scale`` ``(R, 1)``), the values converted to ``out``'s dtype first (integer
    codes convert exactly)."""
    out.copy_(values.to(out.dtype) * scale)


@Pass
def moments(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``(std, mean)`` (``torch.std_mean``, ``correction=0``) in one pass: Gaussian-k's moments."""
    return torch.std_mean(rows, dim=1, correction=0)
