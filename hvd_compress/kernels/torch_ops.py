"""PyTorch kernels: the functions of :mod:`hvd_compress.kernels.reference` on torch tensors.

Same names, same arguments, same results: bit-exact for Top-k, RegTop-k, the
error-feedback split and TernGrad's codes given the same draws; reductions
(mean, std) agree within float rounding. On CUDA the scatter-adds (``index_add_``,
float atomics) flush subnormal values (float32: below 1.2e-38) to zero, so a sum
that is subnormal in the reference may come back 0 there. Tensors stay on their
device. The selections of the fused path, which read nothing back on an
accelerator, are :mod:`hvd_compress.kernels.torch_rows`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from hvd_compress.wire import ternary_field_bits
from hvd_compress.kernels import torch_compiled as compiled
from hvd_compress.kernels.counter_stream import CounterStream
from hvd_compress.kernels.reference import (  # noqa: F401  (re-exported: framework-free)
    GAUSSIANK_FACTORS,
    GAUSSIANK_GROW,
    GAUSSIANK_HIGH,
    GAUSSIANK_LOW,
    GAUSSIANK_ROUNDS,
    GAUSSIANK_SHRINK,
    NO_DISTORTION,
    COUNT_SAMPLE,
    any_along,
    gaussiank_bounds,
    gaussiank_slots,
    joined,
    masked,
    normal_tail_quantile,
    num_selected,
    reuse_bounds,
    sample_stride,
    sum_along,
    threshold_choice,
)

#: the module of the fused path's row selections (:func:`hvd_compress.kernels.bucket_rows`)
BUCKET_ROWS = "hvd_compress.kernels.torch_rows"

_WORD = 1 << 32

_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_NUMPY_DTYPES = {
    **_NUMPY_FLOATS,
    torch.bool: np.bool_,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
}


float16, float32, float64, int16, int64 = torch.float16, torch.float32, torch.float64, torch.int16, torch.int64

#: CPU tensors take the host's shortcuts (numpy's selection and buffers, reused host buffers, host
#: reads, which cost nothing there) unless an :func:`accelerator_path` block is open: how many are, in any
#: thread (a count, so that blocks of several threads ending in any order leave the shortcuts on)
_accelerator_blocks = 0
_blocks_lock = threading.Lock()


def on_host(a: torch.Tensor) -> bool:
    """Whether ``a`` takes the CPU's shortcuts: on the CPU, outside :func:`accelerator_path`."""
    return not _accelerator_blocks and a.device.type == "cpu"


@contextlib.contextmanager
def accelerator_path() -> Iterator[None]:
    """CPU tensors take the branches an accelerator takes (same results), for the block's duration.

    What a trace of the block sees (``python -m benchmarks trace``) is then what a GPU
    would launch: the kernels and the bytes of the device code path, without a GPU.
    """
    global _accelerator_blocks
    with _blocks_lock:
        _accelerator_blocks += 1
    try:
        yield
    finally:
        with _blocks_lock:
            _accelerator_blocks -= 1


#: the float dtypes the host's selections and the compiled passes take (numpy's, for samples and limits)
HOST_FLOATS = (torch.float32, torch.float64)


def compiled_here(a: torch.Tensor, compile: Optional[bool] = None, floats: bool = True) -> bool:
    """Whether the fused passes of :mod:`~hvd_compress.kernels.torch_compiled` run on ``a`` compiled: where
    compiling is on for its device (``compile``, a compressor's option, else ``HVD_COMPRESS_COMPILE``), on the
    CPU outside :func:`accelerator_path` (whose trace shows what a GPU launches, by default uncompiled), and
    (``floats``) for the float dtypes the host's kernels take."""
    return ((on_host(a) or a.device.type != "cpu") and compiled.enabled(a.device, compile)
            and (a.dtype in HOST_FLOATS or not floats))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


# ------------------------------------------------------------------ utilities

def itemsize(a: torch.Tensor) -> int:
    return a.element_size()



def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer; on the CPU (host shortcuts on) one of :data:`HOST_BUFFERS`.

    A fresh buffer of the size of a gradient costs the kernel's page faults at its first writes
    (numpy asks for transparent huge pages, ``madvise``, whose compaction can stall; torch's CPU
    allocator faults 4 KiB at a time): more than a pass over the data. Reused buffers cost none.
    """
    if not _accelerator_blocks and device.type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(HOST_BUFFERS.take(numel, _NUMPY_DTYPES[dtype]))
    return torch.empty(numel, dtype=dtype, device=device)


class HostBuffers:
    """Host buffers of at least ``smallest`` bytes, reused once nothing else holds them.

    Each buffer is a numpy array kept here; a tensor made from it (``torch.from_numpy``) or a view of
    it holds a reference, so a buffer whose only reference is this pool's is free. At most ``per_size``
    are kept per byte size and ``budget`` bytes in all; beyond, buffers are plain ``np.empty``.
    A bucket's state lives in buffers of its size for good (its residual, velocity, the aggregate
    rule's rates and ages) beside a step's own (the bucket's copy, the sums, the average), so a size
    takes up to 16. Thread-safe (thread ranks share the process).
    """

    def __init__(self, smallest: int = 1 << 20, per_size: int = 16, budget: int = 1 << 30) -> None:
        self.smallest, self.per_size, self.budget = smallest, per_size, budget
        self.kept: dict = {}
        self.held = 0
        self.lock = threading.Lock()

    def take(self, numel: int, dtype: np.dtype) -> np.ndarray:
        nbytes = numel * np.dtype(dtype).itemsize
        if nbytes < self.smallest:
            return np.empty(numel, dtype=dtype)
        with self.lock:
            kept = self.kept.setdefault(nbytes, [])
            for buffer in kept:
                if sys.getrefcount(buffer) <= 3:  # the list, this loop, getrefcount's argument
                    return buffer.view(dtype)
            buffer = np.empty(nbytes, dtype=np.uint8)
            if len(kept) < self.per_size and self.held + nbytes <= self.budget:
                kept.append(buffer)
                self.held += nbytes
            return buffer.view(dtype)


#: the host buffers of :func:`_empty`
HOST_BUFFERS = HostBuffers()


def _flatnonzero(mask: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the true entries of a 1-D ``mask``; numpy's on CPU, faster there."""
    if on_host(mask):
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).flatten()


def zeros_like(a: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(a)


def full(numel: int, value: float, like: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.full((numel,), value, dtype=like.dtype if dtype is None else dtype, device=like.device)


def cast(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if a.dtype == torch.float64 and dtype == torch.float16:
        return _float64_to_float16(a)
    return a.to(dtype)


def _float64_to_float16(a: torch.Tensor) -> torch.Tensor:
    """Round once, as numpy does (torch goes through float32 and can round twice).

    The float32 step rounds to odd (toward zero, lowest bit set when inexact),
    which keeps enough information for the float16 rounding to be exact.
    """
    single = a.to(torch.float32)
    back = single.to(torch.float64)
    inexact = back != a
    bits = single.view(torch.int32)
    bits = torch.where(inexact & (back.abs() > a.abs()), bits - 1, bits)
    return torch.where(inexact, bits | 1, bits).view(torch.float32).to(torch.float16)


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype of a torch float dtype (float16, float32, float64)."""
    return np.dtype(_NUMPY_FLOATS[dtype])


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded once to ``dtype`` (numpy's cast), so any later conversion of it is exact."""
    kind = _NUMPY_FLOATS.get(dtype)
    if kind is None:
        return value
    with np.errstate(over="ignore"):  # beyond the dtype's range: infinity, as numpy compares
        return float(kind(value))


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype on its device: divisions by it are true divisions."""
    return torch.full((), _rounded(value, like.dtype), dtype=like.dtype, device=like.device)


def as_int64(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=like.device)


def as_float32(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=like.device)


def from_host(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device)


def reshape(a: torch.Tensor, shape) -> torch.Tensor:
    return a.reshape(shape)


def divide(a: torch.Tensor, n: int) -> torch.Tensor:
    """``a / n`` as a true division (CUDA turns a division by a Python number into ``a * (1/n)``)."""
    return a / _scalar(n, a)


def to_list(a: torch.Tensor) -> list:
    return a.tolist()


def split(a: torch.Tensor, sizes) -> list:
    return list(torch.split(a, list(sizes)))


def generator(seed: int, rank: int, like: torch.Tensor):
    """The random stream of ``rank`` for ``like``, seeded from ``SeedSequence([seed, rank])``'s first 64 bits: on
    the host a :class:`~hvd_compress.kernels.counter_stream.CounterStream`, on an accelerator (and in
    :func:`accelerator_path`) its device's ``torch.Generator``."""
    state = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint32)
    seed64 = int(state[0]) << 32 | int(state[1])
    if on_host(like):
        return CounterStream(seed64)
    stream = torch.Generator(device=like.device)
    stream.manual_seed(seed64)
    return stream


def uniform(rng, like: torch.Tensor) -> torch.Tensor:
    """``len(like)`` draws uniform on [0, 1), drawn in float32, in ``like``'s dtype and device."""
    return uniform_into(rng, torch.empty(like.shape[0], dtype=torch.float32, device=like.device)).to(like.dtype)


def host_empty() -> torch.Tensor:
    """An empty CPU tensor: where checkpoints try a saved stream state (``generator(0, 0, like)``)."""
    return torch.empty(0)


def generator_state(rng):
    """A stream's state as a uint8 tensor (a counter stream's 16 bytes, a ``torch.Generator``'s own)."""
    if isinstance(rng, CounterStream):
        return torch.frombuffer(bytearray(rng.state()), dtype=torch.uint8)
    return rng.get_state()


def set_generator_state(rng, state) -> None:
    if isinstance(rng, CounterStream):
        rng.set_state(np.ascontiguousarray(state.cpu().numpy() if torch.is_tensor(state) else state).tobytes())
    else:
        rng.set_state(state)


def where(condition: torch.Tensor, a, b, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.where(condition, a, b) if out is None else torch.where(condition, a, b, out=out)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def dense_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = accumulation_dtype(values[0].dtype)
    total = values[0].to(dtype, copy=True)
    for v in values[1:]:
        total += v.to(dtype)
    return total


# -------------------------------------------------------------- error feedback
def error_feedback_split(
    a: torch.Tensor, indices: torch.Tensor, in_place: bool = False, wire_dtype: Optional[torch.dtype] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``index_select`` and ``index_fill_``: the gather and scatter of ``a[S]``, ``a[S] = 0`` without
    the generality (and the cost) of advanced indexing. A narrower ``wire_dtype``: the values
    saturate to it and ``a[S] - values`` stays in the residual (see the reference)."""
    idx = indices.long()
    values = a.index_select(0, idx)
    residual = a if in_place else _empty(a.shape[0], a.dtype, a.device).copy_(a)
    if wire_dtype is None or wire_dtype == a.dtype:
        return values, residual.index_fill_(0, idx, 0)
    sent = saturate(values, wire_dtype)
    return sent, residual.index_copy_(0, idx, values.sub_(sent.to(a.dtype)))


def momentum_update(velocity: torch.Tensor, g: torch.Tensor, momentum: float,
                    compile: Optional[bool] = None) -> torch.Tensor:
    """``u = m u + g``, a new tensor in the velocity's dtype (see the reference; on the host a kept buffer,
    :func:`_empty`): one compiled pass where passes compile (:func:`compiled_here`; ``compile``: the
    compressor's option)."""
    out = _empty(velocity.numel(), velocity.dtype, velocity.device).view(velocity.shape)
    compiled.momentum_update(velocity, g, momentum, out, compile=compiled_here(velocity, compile))
    return out


def momentum_mask(velocity: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``u[S] = 0`` in place; returns ``u``."""
    return velocity.index_fill_(0, indices.long(), 0)


def saturate(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a`` rounded to ``dtype``, values beyond its finite range clipped to it (NaN stays NaN)."""
    if a.dtype == dtype:
        return a
    largest = torch.finfo(dtype).max
    return a.clamp(-largest, largest).to(dtype)


# ----------------------------------------------------------------------- Top-k
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` largest scores, ascending indices, ties to the lower index (as the reference).

    With ``v`` the k-th largest score, the selection is every score above ``v`` and
    the lowest-indexed ones equal to ``v``; when exactly ``k`` scores are ``>= v`` (no
    tie is left out) that is their mask's indices, already ascending. On CPU, for
    float32 and float64, ``v`` comes from numpy's ``partition`` (a selection, several
    times faster there than ``torch.topk``); CUDA and other dtypes use ``torch.topk``.
    A NaN ``v`` selects nothing, as in the reference (compressors reject NaN first).
    """
    numel = scores.shape[0]
    k = min(k, numel)
    if on_host(scores) and scores.dtype in HOST_FLOATS:
        kth = float(np.partition(scores.detach().numpy(), numel - k)[numel - k])
    else:
        kth = torch.topk(scores, k, sorted=False).values.min()
    chosen = _flatnonzero(torch.ge(scores, kth, out=_empty(numel, torch.bool, scores.device)))
    if chosen.shape[0] > k:  # ties at the boundary: lowest indices win
        above = _flatnonzero(scores > kth)
        ties = _flatnonzero(scores == kth)[: k - above.shape[0]]
        chosen = torch.sort(torch.cat([above, ties])).values
    return chosen.to(index_dtype(numel))



# ------------------------------------------------------------------ Gaussian-k
def gaussiank_threshold(a: torch.Tensor, ratio: float) -> float:
    return float(gaussiank_thresholds(a[None], ratio).tolist()[0])


def gaussiank_thresholds(rows: torch.Tensor, ratio: float) -> torch.Tensor:
    """First Gaussian-k threshold of every row of a 2-D ``rows``, float64, on the device:
    ``|mean| + std * Phi^-1(1 - ratio / 2)``, the moments reduced in ``rows``' dtype (the
    reference's float64 moments agree within rounding)."""
    std, mean = torch.std_mean(rows, dim=1, correction=0)
    return mean.double().abs_().add_(std.double().mul_(normal_tail_quantile(ratio)))


def threshold_select(scores: torch.Tensor, threshold: float, k: int, bounds: Tuple[int, int],
                     width: int, stride: int) -> Tuple[torch.Tensor, float]:
    """:func:`reference.threshold_select` of one tensor's scores (counts read back: the CPU's row by
    row way and a per-tensor helper; an accelerator runs :class:`~hvd_compress.kernels.torch_rows.Rows`)."""
    sample = scores[::stride]

    def count(t: float) -> int:
        return stride * int(torch.count_nonzero(sample > _rounded(t, scores.dtype)))

    chosen, cut = threshold_choice(count, threshold, *bounds)
    selected = _flatnonzero(scores > _rounded(chosen, scores.dtype))[: k if cut else width]
    return selected.to(index_dtype(scores.shape[0])), chosen


def reused_threshold_select(scores: torch.Tensor, threshold: float, k: int) -> Tuple[torch.Tensor, float]:
    """:func:`reference.reused_threshold_select`: :func:`threshold_select` toward ``[ceil(k/2), k]`` in ``k`` slots."""
    return threshold_select(scores, threshold, k, reuse_bounds(k), k, sample_stride(k))


def gaussiank_from(magnitude: torch.Tensor, threshold: float, k: int) -> torch.Tensor:
    """:func:`reference.gaussiank_from` on ``|a|`` from a first ``threshold``: the indices selected, ascending
    (none where the threshold is NaN: ``a`` holds NaN or Inf, as in the reference)."""
    if threshold != threshold:
        return torch.empty(0, dtype=index_dtype(magnitude.shape[0]), device=magnitude.device)
    return threshold_select(magnitude, threshold, k, gaussiank_bounds(k), gaussiank_slots(k), 1)[0]


# -------------------------------------------------------------------- RegTop-k
def regtopk_scores(a: torch.Tensor, distortion: torch.Tensor, mu: float) -> torch.Tensor:
    d = distortion.to(accumulation_dtype(distortion.dtype))
    damping = torch.tanh(((1.0 + d) / _scalar(mu, d)).double()).to(d.dtype)
    return damping.abs() * a.abs()



def regtopk_expand(idx: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    distortion = full(numel, NO_DISTORTION, values)
    distortion[idx.long()] = values
    return distortion



# -------------------------------------------------------------------- TernGrad

def terngrad_codes(g: torch.Tensor, scale: float, uniform: torch.Tensor) -> torch.Tensor:
    """``sign(g) * [u < |g| / S]`` in int8: ``sign(g) = [g > 0] - [g < 0]`` (booleans are 0/1
    bytes, viewed as int8) times the keep mask, and ``|g| / S`` in one buffer, in place."""
    numel, device = g.shape[0], g.device
    if scale == 0:
        return torch.zeros(numel, dtype=torch.int8, device=device)
    ratio = torch.abs(g, out=_empty(numel, g.dtype, device)).div_(_scalar(scale, g))
    keep = torch.lt(uniform, ratio, out=_empty(numel, torch.bool, device))
    codes = torch.gt(g, 0, out=_empty(numel, torch.bool, device)).view(torch.int8)
    codes -= torch.lt(g, 0, out=_empty(numel, torch.bool, device)).view(torch.int8)
    return codes.mul_(keep)


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words to int32 modulo 2**32, two's complement."""
    return (torch.remainder(words + (_WORD >> 1), _WORD) - (_WORD >> 1)).to(torch.int32)


def _shifts(bits: int, per_word: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``bits * i`` for the ``per_word`` fields of a word, made once per dtype and device."""
    key = (bits, per_word, dtype, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = bits * torch.arange(per_word, dtype=dtype, device=device)
    return _SHIFTS[key]


_SHIFTS: dict = {}


def _pack_fields(codes: torch.Tensor, bits: int, per_word: int, word: torch.dtype,
                 compile: Optional[bool] = None) -> torch.Tensor:
    """Fields ``codes + 1`` (in {0, 1, 2}), ``per_word`` of ``bits`` bits to a ``word``:
    ``w = sum_i (t_i + 1) << bits i``.

    The shifted fields' bits are disjoint, so their sum is the reference's (no carry).
    torch shifts signed integers as unsigned, so a field reaching bit 31 of an int32
    word sets the sign bit, as the reference's cast to uint32 then view as int32; only
    the last field can, so the int32 sum of the shifted fields never overflows. Where passes run
    compiled (:func:`compiled_here`), the whole words in one pass
    (:func:`~hvd_compress.kernels.torch_compiled.packed_fields`), a last partial word as below.
    """
    numel = codes.shape[0]
    whole = numel // per_word
    if whole and compiled_here(codes, compile, floats=False):
        main = compiled.packed_fields(codes[: whole * per_word].view(whole, per_word), bits, per_word, word,
                                      compile=True)
        if whole * per_word == numel:
            return main
        return torch.cat([main, _pack_fields(codes[whole * per_word :], bits, per_word, word, False)])
    words = -(-numel // per_word)
    fields = _empty(words * per_word, word, codes.device)
    if words * per_word > numel:  # padding: fields 0
        fields[numel:].zero_()
    torch.add(codes, 1, out=fields[:numel])
    shifted = fields.view(words, per_word).bitwise_left_shift_(_shifts(bits, per_word, word, codes.device))
    return shifted.sum(dim=1, dtype=word)


def _unpack_fields(words: torch.Tensor, bits: int, per_word: int, numel: int) -> torch.Tensor:
    """Field ``i`` of every word, ``(w >> bits * i) & (2**bits - 1)``, in order, in the words' dtype.

    An arithmetic shift of a negative int32 word brings sign bits in above bit
    ``31 - bits * i``, which the mask (``bits * (i + 1) <= 32``) drops.
    """
    fields = _empty(words.shape[0] * per_word, words.dtype, words.device).view(-1, per_word)
    torch.bitwise_right_shift(words.unsqueeze(1), _shifts(bits, per_word, words.dtype, words.device), out=fields)
    return fields.bitwise_and_((1 << bits) - 1).view(-1)[:numel]


def pack_ternary(codes: torch.Tensor, world_size: int, compile: Optional[bool] = None) -> torch.Tensor:
    bits = ternary_field_bits(world_size)
    return _pack_fields(codes, bits, 32 // bits, torch.int32, compile)


def unpack_ternary_sum(lanes: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
    bits = ternary_field_bits(world_size)
    return _unpack_fields(lanes.to(torch.int32), bits, 32 // bits, numel).sub_(world_size)


def pack_two_bit(codes: torch.Tensor, compile: Optional[bool] = None) -> torch.Tensor:
    return _pack_fields(codes, 2, 4, torch.uint8, compile).view(torch.int8)


def unpack_two_bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Fields 0..2 as uint8 are the same bytes as int8: minus 1 in int8."""
    return _unpack_fields(packed.view(torch.uint8), 2, 4, numel).view(torch.int8).sub_(1)


def maximum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.maximum(a, b)


def concat(arrays: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.cat``; on the host a new 1-D buffer of one dtype comes from numpy (see :func:`_empty`)."""
    arrays = list(arrays)
    if out is None and on_host(arrays[0]) and all(a.dim() == 1 and a.dtype == arrays[0].dtype for a in arrays):
        out = _empty(sum(a.shape[0] for a in arrays), arrays[0].dtype, arrays[0].device)
    return torch.cat(arrays, out=out)



def added_concat(parts: Sequence[torch.Tensor], addend: torch.Tensor) -> torch.Tensor:
    """``concat(parts) + addend`` (``addend``: the parts' dtype and total length): on the host each part added
    into its slice of a kept buffer (see :func:`_empty`), one pass where a concatenation and an add take two
    (the same sums); elsewhere one ``cat`` and one add, two launches instead of one per part."""
    if not on_host(addend):
        return torch.cat(list(parts)).add_(addend)
    out, start = _empty(addend.shape[0], addend.dtype, addend.device), 0
    for part in parts:
        stop = start + part.shape[0]
        torch.add(part, addend[start:stop], out=out[start:stop])
        start = stop
    return out


def sum_int32_wrapping(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    return _wrap_int32(torch.stack([a.to(torch.int64) for a in arrays]).sum(dim=0))


# ----------------------------------------------------------------- aggregation

# ---------------------------------------------------------------- fused buckets
#: dtypes a fused bucket takes
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fusable(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return all(isinstance(t, torch.Tensor) and t.dtype == first.dtype and t.device == first.device
               for t in tensors) and first.dtype in FUSED_DTYPES


def float_errors_ignored():
    """torch never warns of floating-point errors."""
    return contextlib.nullcontext()


def empty(numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Uninitialised; on the host one of :data:`HOST_BUFFERS` (see :func:`_empty`)."""
    return _empty(numel, dtype, like.device)


def zeros(numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """Zeros; on the host in one of :data:`HOST_BUFFERS` (see :func:`_empty`)."""
    if on_host(like):
        return _empty(numel, dtype, like.device).zero_()
    return torch.zeros(numel, dtype=dtype, device=like.device)


def quotient(a: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``a / divisor`` (a 0-d tensor: a true division), a new buffer (on the host, see :func:`_empty`)."""
    return torch.div(a, divisor, out=_new_result(a, divisor))


def scalar(value: float, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A 0-d tensor on ``like``'s device: a division by it is a true division (see :func:`divide`)."""
    return torch.full((), float(value), dtype=dtype, device=like.device)


def clone(a: torch.Tensor) -> torch.Tensor:
    return a.clone()


def to_device(a: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return a.to(like.device)


def take(a: torch.Tensor, indices: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.index_select(a, 0, indices, out=out)


def zero_at(a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return a.index_fill_(0, indices, 0)


def put(a: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return a.index_copy_(0, indices, values)


def fill_zero(a: torch.Tensor) -> torch.Tensor:
    return a.zero_()


def index_add(total: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return total.index_add_(0, indices, values)


def magnitude(a: torch.Tensor) -> torch.Tensor:
    """``|a|``, a new buffer (on the host one of :data:`HOST_BUFFERS`, see :func:`_empty`)."""
    return torch.abs(a, out=_empty(a.shape[0], a.dtype, a.device)) if a.dim() == 1 and on_host(a) else a.abs()


def nonfinite_to_zero(a: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)


def isnan(a: torch.Tensor) -> torch.Tensor:
    return torch.isnan(a)


def multiply(a: torch.Tensor, b, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.mul(a, b, out=_new_result(a, b) if out is None else out)


def _new_result(a: torch.Tensor, b) -> Optional[torch.Tensor]:
    """A buffer for the elementwise result of ``a`` (1-D) and ``b`` (a tensor of ``a``'s shape, a 0-d tensor
    or a number) on the host (see :func:`_empty`), else ``None`` (torch allocates)."""
    if a.dim() != 1 or not on_host(a) or (isinstance(b, torch.Tensor) and b.dim() and b.shape != a.shape):
        return None
    return _empty(a.shape[0], torch.result_type(a, b), a.device)


def regtopk_sparse_scores(a: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, mu: float) -> torch.Tensor:
    """``|a|``, damped by ``|tanh((1 + D) / mu)|`` at ``idx`` (``|.|``: a NaN of ``0 * Inf`` keeps the
    sign bit clear, as the fused selections need)."""
    scores = magnitude(a).to(accumulation_dtype(torch.promote_types(a.dtype, values.dtype)))
    damped = regtopk_scores(a.index_select(0, idx), values, mu)
    return scores.index_copy_(0, idx, damped.abs_())


def draws_in_pass(rng, a: torch.Tensor, dtype: torch.dtype, compile: Optional[bool] = None) -> bool:
    """Whether TernGrad's codes pass makes its uniforms itself from each tensor's :func:`stream_keys`: for a
    counter stream where that pass runs compiled (:func:`compiled_here`; ``compile``: the compressor's option)
    and ``a`` is of the gradients' ``dtype``; else the uniforms are drawn first (:func:`uniform_into`)."""
    return isinstance(rng, CounterStream) and compiled_here(a, compile) and a.dtype == dtype


def stream_keys(rng: CounterStream, numels: Sequence[int], order: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """The keys of calls for ``numels[i]`` draws, taken for ``i = 0, 1, ...``, as an int32 ``(2, len(numels))``
    tensor (``k0`` and ``k1`` rows) whose columns follow ``order``."""
    keys = [rng.take(n) for n in numels]
    return torch.tensor([[keys[i][0] for i in order], [keys[i][1] for i in order]], dtype=torch.int32,
                        device=like.device)


def uniform_into(rng, out: torch.Tensor) -> torch.Tensor:
    """``len(out)`` float32 uniforms on [0, 1) written into ``out``: a counter stream's
    (:func:`_counter_uniforms_into`), or ``torch.rand``'s."""
    if isinstance(rng, CounterStream):
        return _counter_uniforms_into(out, *rng.take(out.shape[0]))
    return torch.rand(out.shape[0], generator=rng, dtype=torch.float32, device=out.device, out=out)


def _counter_uniforms_into(out: torch.Tensor, key0: int, key1: int) -> torch.Tensor:
    """The float32 uniforms of one call of a counter stream, its keys ``key0`` and ``key1``, written into the
    float32 ``out`` (its length: the call's draws): :func:`~hvd_compress.kernels.torch_compiled.counter_draws`
    and :func:`~hvd_compress.kernels.torch_compiled.uniforms` computed eagerly in place, in one int32 buffer
    and one temporary (each operation of theirs would make a new buffer)."""
    numel = out.shape[0]
    x = torch.arange(numel, dtype=torch.int32, out=_empty(numel, torch.int32, out.device))
    x.mul_(compiled.COUNTER_STEP).add_(key0)
    shifted = _empty(numel, torch.int32, out.device)
    for key in (None, key1):
        if key is not None:
            x.bitwise_xor_(key)
        for shift, mask, factor in ((16, 0xFFFF, compiled.MIX_1), (15, 0x1FFFF, compiled.MIX_2), (16, 0xFFFF, None)):
            x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=shifted).bitwise_and_(mask))
            if factor is not None:
                x.mul_(factor)
    return out.copy_(x.bitwise_and_(0xFFFFFF)).mul_(2.0**-24)  # below 2^24: exact in float32


def terngrad_bucket_scales(a: torch.Tensor, groups, clip: Optional[float], compile: Optional[bool] = None):
    """One ``aminmax`` (and ``std``) per group: ``clip(g) = clamp(g, -b, b)`` is monotone, so
    ``max|clip(g)| = min(max(-min g, max g), b)`` exactly; ``b = c std(g)``, +Inf where ``b = 0``
    or ``g`` is constant (no clipping). Where passes are compiled (:func:`compiled_here`), one
    :func:`~hvd_compress.kernels.torch_compiled.ternary_scales` per group (``compile``: the compressor's option)."""
    if compiled_here(a, compile):
        if clip is None:
            return torch.cat([compiled.largest_magnitudes(grp.view(a), compile=True) for grp in groups]), None
        scales = [compiled.ternary_scales(grp.view(a), float(clip), compile=True) for grp in groups]
        return torch.cat([s[0] for s in scales]), torch.cat([s[1] for s in scales])
    extremes = [torch.aminmax(grp.view(a), dim=1) for grp in groups]
    low, high = torch.cat([e[0] for e in extremes]), torch.cat([e[1] for e in extremes])
    local = torch.maximum(-low, high).abs()
    if clip is None:
        return local, None
    std = torch.cat([torch.std(grp.view(a), dim=1, correction=0) for grp in groups])
    bound = (std.double() * clip).to(a.dtype)
    bound = torch.where((bound == 0) | (low == high), torch.inf, bound)
    return torch.minimum(local, bound), bound


def terngrad_bucket_codes(a: torch.Tensor, groups, bound: Optional[torch.Tensor], scale: torch.Tensor,
                          uniform: torch.Tensor, compile: Optional[bool] = None) -> torch.Tensor:
    """``sign(g) [u < |clip(g)| / S]`` with each row's ``S``, ``u`` the uniforms ``uniform``, or those each row's
    keys make (``uniform`` int32: the :func:`stream_keys` of :func:`draws_in_pass`); ``|clip(g)| = min(|g|, b)``
    and ``clip`` keeps the sign, so ``clip(g)`` is never formed. ``clamp_(max=b)`` with a tensor bound is torch's
    ``minimum`` (NaN included), in place without an ``out`` argument. From keys, or where passes are compiled
    (:func:`compiled_here`; ``compile``: the compressor's option), one
    :func:`~hvd_compress.kernels.torch_compiled.keyed_ternary_codes` or
    :func:`~hvd_compress.kernels.torch_compiled.ternary_codes` per group."""
    compiling, keyed = compiled_here(a, compile), uniform.dtype == torch.int32  # keyed: draws_in_pass's keys
    if compiling or keyed:
        codes = _empty(a.shape[0], torch.int8, a.device)
        for grp in groups:
            limit = grp.column(bound) if bound is not None else torch.full((grp.rows, 1), torch.inf, dtype=a.dtype)
            if keyed:
                compiled.keyed_ternary_codes(grp.view(a), grp.column(uniform[0]), grp.column(uniform[1]), limit,
                                             grp.column(scale), grp.view(codes), compile=compiling)
            else:
                compiled.ternary_codes(grp.view(a), grp.view(uniform), limit, grp.column(scale), grp.view(codes),
                                       compile=True)
        return codes
    ratio = torch.abs(a)
    for grp in groups:
        view = grp.view(ratio)
        if bound is not None:
            view.clamp_(max=grp.column(bound))
        view.div_(grp.column(scale))
    keep = torch.lt(uniform, ratio).view(torch.int8)
    # sign(g) keep = keep - 2 (keep and g < 0): where keep is 1, |g| > 0 (a 0 never passes u < 0)
    return torch.sub(keep, torch.lt(a, 0).view(torch.int8).bitwise_and_(keep), alpha=2)


def terngrad_bucket_residual(a: torch.Tensor, groups, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    for grp in groups:
        grp.view(a).addcmul_(grp.view(codes), grp.column(scale), value=-1)
    return a


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b, out=_new_result(a, b))


def add_into(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.add_(b)


def copy_into(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return out.copy_(values)


def placed(out: torch.Tensor, parts) -> torch.Tensor:
    if parts:
        torch._foreach_copy_([out[start : start + values.shape[0]] for start, values in parts],
                             [values for _, values in parts])
    return out


def keep_rows(groups, bad: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` updated in place to ``new``, but each row flagged in ``bad`` left as it was; on the host, where
    no row is flagged (a read that costs nothing there), ``new`` itself (state moves only on the host: a
    captured CUDA graph reads the addresses it captured)."""
    if on_host(old) and not bad.numpy().any():  # a view of the flags: nothing copied or waited for
        return new
    for grp in groups:
        torch.where(grp.column(bad), grp.view(old), grp.view(new), out=grp.view(old))
    return old


def keep_finite_rows(groups, total: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
                     compile: Optional[bool] = None) -> torch.Tensor:
    """``new``, but each row where ``total`` holds NaN/Inf as in ``old`` (written into ``old``). On the host the
    whole part's largest ``|x|`` is read first (one pass, compiled where passes are): where it is finite the
    result is ``new`` itself, nothing copied; else each row's flag is its own largest ``|x|`` not finite."""
    if on_host(total):
        check = compiled_here(total, compile)
        whole = compiled.largest_magnitudes(total[: groups[-1].stop].view(1, -1), compile=check)
        if torch.isfinite(whole).numpy().all():  # a view of the flag: nothing copied or waited for
            return new
        bad = [~torch.isfinite(compiled.largest_magnitudes(grp.view(total), compile=check)) for grp in groups]
    else:  # per row, the sum of 0 * its elements: NaN where it holds NaN/Inf
        bad = [torch.isnan(torch.mul(grp.view(total), 0).sum(1)) for grp in groups]
    for grp, flags in zip(groups, bad):
        torch.where(flags[:, None], grp.view(old), grp.view(new), out=grp.view(old))
    return old


def scale_rows(groups, values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, numel: int,
               compile: Optional[bool] = None) -> torch.Tensor:
    """``values * S`` per row in ``dtype``; on the host into a kept buffer (a fresh one costs its page faults),
    converted first and multiplied in place: a product that promotes integer codes runs unvectorised there,
    ten times slower (the same floats: the integers convert exactly); where passes run compiled
    (:func:`compiled_here`), one :func:`~hvd_compress.kernels.torch_compiled.scaled_rows` per group."""
    total = empty(numel, dtype, values)
    host = on_host(values)
    fused = compiled_here(total, compile)
    for grp in groups:
        if fused:
            compiled.scaled_rows(grp.view(values), grp.column(scale), grp.view(total), compile=True)
        elif host:
            grp.view(total).copy_(grp.view(values)).mul_(grp.column(scale))
        else:
            torch.mul(grp.view(values), grp.column(scale), out=grp.view(total))
    return total
