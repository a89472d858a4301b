"""PyTorch kernels: the functions of :mod:`hvd_compress.compressors.reference` on torch tensors.

Same names, same arguments, same results: bit-exact for Top-k, RegTop-k, the
error-feedback split and TernGrad's codes given the same draws; reductions
(mean, std) agree within float rounding. Tensors stay on their device; the only
host synchronisations are the scalars the algorithms branch on (Gaussian-k's
count, TernGrad's scale) and the sizes of ``nonzero``.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from hvd_compress.compressors.reference import (  # noqa: F401  (re-exported: framework-free)
    GAUSSIANK_HIGH,
    NO_DISTORTION,
    gaussiank_correct,
    normal_tail_quantile,
    num_selected,
    ternary_codes_per_lane,
    ternary_field_bits,
    ternary_lanes,
    ternary_wire_format,
    two_bit_bytes,
)

_WORD = 1 << 32

_NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


float16 = torch.float16


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


# ------------------------------------------------------------------ utilities
def is_floating(a: torch.Tensor) -> bool:
    return a.is_floating_point()


def itemsize(a: torch.Tensor) -> int:
    return a.element_size()


def count_nonfinite(a: torch.Tensor) -> int:
    if bool(torch.isfinite(a.sum())):
        return 0
    return int(a.numel() - torch.isfinite(a).sum().item())


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


def reshape(a: torch.Tensor, shape) -> torch.Tensor:
    return a.reshape(shape)


def divide(a: torch.Tensor, n: int) -> torch.Tensor:
    """``a / n`` as a true division (CUDA turns a division by a Python number into ``a * (1/n)``)."""
    return a / _scalar(n, a)


def to_list(a: torch.Tensor) -> list:
    return a.tolist()


def split(a: torch.Tensor, sizes) -> list:
    return list(torch.split(a, list(sizes)))


def generator(seed: int, rank: int, like: torch.Tensor) -> torch.Generator:
    """The random stream of ``rank`` on ``like``'s device, seeded from ``SeedSequence([seed, rank])``."""
    state = np.random.SeedSequence([seed, rank]).generate_state(2, dtype=np.uint32)
    stream = torch.Generator(device=like.device)
    stream.manual_seed(int(state[0]) << 32 | int(state[1]))
    return stream


def uniform(rng: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """``len(like)`` draws uniform on [0, 1), drawn in float32, in ``like``'s dtype and device."""
    draws = torch.rand(like.shape[0], generator=rng, dtype=torch.float32, device=like.device)
    return draws.to(like.dtype)


def generator_state(rng: torch.Generator):
    return rng.get_state()


def set_generator_state(rng: torch.Generator, state) -> None:
    rng.set_state(state)


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
    a: torch.Tensor, indices: torch.Tensor, in_place: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    idx = indices.long()
    values = a[idx]
    residual = a if in_place else a.clone()
    residual[idx] = 0
    return values, residual


# ----------------------------------------------------------------------- Top-k
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` largest scores, ascending indices, ties to the lower index (as the reference)."""
    numel = scores.shape[0]
    k = min(k, numel)
    values, indices = torch.topk(scores, k, sorted=False)
    kth = values.min()
    inside = torch.count_nonzero(values == kth)
    ties = torch.nonzero(scores == kth).flatten()
    if ties.shape[0] > int(inside):  # ties at the boundary: lowest indices win
        above = torch.nonzero(scores > kth).flatten()
        indices = torch.cat([above, ties[: k - above.shape[0]]])
    return torch.sort(indices).values.to(index_dtype(numel))


def topk_select(a: torch.Tensor, k: int) -> torch.Tensor:
    return topk_indices(a.abs(), k)


# ------------------------------------------------------------------ Gaussian-k
def gaussiank_threshold(a: torch.Tensor, ratio: float) -> float:
    std, mean = torch.std_mean(a, correction=0)
    mean, std = torch.stack([mean, std]).tolist()
    return abs(mean) + std * normal_tail_quantile(ratio)


def gaussiank_select(a: torch.Tensor, ratio: float) -> torch.Tensor:
    """One moments pass, then per correction round one comparison and one count; no sort of ``a``.

    On CUDA a round counts with ``nonzero`` (a count, one host synchronisation, then
    the indices), cheaper there than ``count_nonzero``, which converts the mask to
    int64 first; the indices of the threshold finally chosen are then already there.
    On CPU a round counts the mask and ``nonzero`` runs once, at the end. Only what
    the correction can still choose is kept (the last round's and the smallest set
    above ``4k/3``).
    """
    k = num_selected(a.shape[0], ratio)
    magnitude = a.abs()
    found = {}  # threshold -> (indices of |a_j| > threshold, or their mask; count)

    def count(threshold: float) -> int:
        mask = magnitude > _rounded(threshold, a.dtype)
        if mask.is_cuda:
            hits = torch.nonzero(mask).flatten()
            found[threshold] = (hits, hits.shape[0])
        else:
            found[threshold] = (mask, int(torch.count_nonzero(mask)))
        above = [t for t, (_, n) in found.items() if n > GAUSSIANK_HIGH * k]
        smallest = min(above, key=lambda t: found[t][1], default=None)
        for t in [t for t in found if t != threshold and t != smallest]:
            del found[t]
        return found[threshold][1]

    def select(threshold: float) -> torch.Tensor:
        if threshold not in found:
            count(threshold)
        hits = found[threshold][0]
        return torch.nonzero(hits).flatten() if hits.dtype == torch.bool else hits

    selected = gaussiank_correct(
        count,
        select,
        lambda superset: superset[topk_indices(magnitude[superset], k).long()],
        gaussiank_threshold(a, ratio),
        k,
    )
    return selected.to(index_dtype(a.shape[0]))


# -------------------------------------------------------------------- RegTop-k
def regtopk_scores(a: torch.Tensor, distortion: torch.Tensor, mu: float) -> torch.Tensor:
    d = distortion.to(accumulation_dtype(distortion.dtype))
    damping = torch.tanh(((1.0 + d) / _scalar(mu, d)).double()).to(d.dtype)
    return damping.abs() * a.abs()


def regtopk_select(a: torch.Tensor, distortion: torch.Tensor, mu: float, k: int) -> torch.Tensor:
    return topk_indices(regtopk_scores(a, distortion, mu), k)


def regtopk_posterior(total: torch.Tensor, indices: torch.Tensor, sent: torch.Tensor):
    dtype = accumulation_dtype(total.dtype)
    informative = sent != 0
    idx = indices[informative]
    own = sent[informative].to(dtype)
    return idx, (total[idx.long()].to(dtype) - own) / own


def regtopk_distortion(
    total: torch.Tensor, indices: torch.Tensor, sent: torch.Tensor, numel: int
) -> torch.Tensor:
    return regtopk_expand(*regtopk_posterior(total, indices, sent), numel)


def regtopk_expand(idx: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    distortion = full(numel, NO_DISTORTION, values)
    distortion[idx.long()] = values
    return distortion


def regtopk_select_sparse(
    a: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, mu: float, k: int
) -> torch.Tensor:
    scores = a.abs().to(accumulation_dtype(torch.promote_types(a.dtype, values.dtype)))
    idx = idx.long()
    scores[idx] = regtopk_scores(a[idx], values, mu)
    return topk_indices(scores, k)


# -------------------------------------------------------------------- TernGrad
def terngrad_clip(g: torch.Tensor, c: float) -> torch.Tensor:
    bound = c * float(torch.std(g, correction=0))
    low, high = torch.aminmax(g)
    if bound == 0 or low == high:  # a constant tensor: clipping would erase it
        return g
    bound = _rounded(bound, g.dtype)
    return g.clamp(-bound, bound)


def terngrad_scale(g: torch.Tensor) -> float:
    return float(g.abs().max())


def terngrad_codes(g: torch.Tensor, scale: float, uniform: torch.Tensor) -> torch.Tensor:
    if scale == 0:
        return torch.zeros(g.shape[0], dtype=torch.int8, device=g.device)
    keep = uniform < g.abs() / _scalar(scale, g)
    return (torch.sign(g).to(torch.int8) * keep).to(torch.int8)


def _wrap_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) (or any int64) to int32 modulo 2**32, two's complement."""
    return (torch.remainder(words + (_WORD >> 1), _WORD) - (_WORD >> 1)).to(torch.int32)


def _pack_fields(fields: torch.Tensor, bits: int, per_word: int) -> torch.Tensor:
    words = -(-fields.shape[0] // per_word)
    padded = torch.zeros(words * per_word, dtype=torch.int64, device=fields.device)
    padded[: fields.shape[0]] = fields
    shifts = bits * torch.arange(per_word, dtype=torch.int64, device=fields.device)
    return (padded.view(words, per_word) << shifts).sum(dim=1)


def _unpack_fields(words: torch.Tensor, bits: int, per_word: int, numel: int) -> torch.Tensor:
    shifts = bits * torch.arange(per_word, dtype=torch.int64, device=words.device)
    fields = (words.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten()[:numel]


def pack_ternary(codes: torch.Tensor, world_size: int) -> torch.Tensor:
    bits = ternary_field_bits(world_size)
    return _wrap_int32(_pack_fields(codes.to(torch.int64) + 1, bits, 32 // bits))


def unpack_ternary_sum(lanes: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
    bits = ternary_field_bits(world_size)
    words = lanes.to(torch.int64) & (_WORD - 1)
    return (_unpack_fields(words, bits, 32 // bits, numel) - world_size).to(torch.int32)


def pack_two_bit(codes: torch.Tensor) -> torch.Tensor:
    return _pack_fields(codes.to(torch.int64) + 1, 2, 4).to(torch.uint8).view(torch.int8)


def unpack_two_bit(packed: torch.Tensor, numel: int) -> torch.Tensor:
    words = packed.view(torch.uint8).to(torch.int64)
    return (_unpack_fields(words, 2, 4, numel) - 1).to(torch.int8)


def maximum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.maximum(a, b)


def concat(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(arrays))


def sum_codes(codes: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([c.to(torch.int32) for c in codes]).sum(dim=0, dtype=torch.int32)


def sum_int32_wrapping(arrays: Sequence[torch.Tensor]) -> torch.Tensor:
    return _wrap_int32(torch.stack([a.to(torch.int64) for a in arrays]).sum(dim=0))


# ----------------------------------------------------------------- aggregation
def sparse_sum(indices: Sequence[torch.Tensor], values: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """Scatter-add of every rank's values, one ``index_add_`` per rank, in rank order.

    A rank's indices are distinct, so each of its ``index_add_`` touches an entry at
    most once: the sums are in rank order on every device (one ``index_add_`` of all
    ranks would add with atomics in no fixed order on CUDA, and replicas could differ).
    """
    dtype = accumulation_dtype(values[0].dtype)
    total = torch.zeros(numel, dtype=dtype, device=values[0].device)
    for idx, v in zip(indices, values):
        total.index_add_(0, idx.long(), v.to(dtype))
    return total
