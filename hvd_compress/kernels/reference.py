"""The numpy kernels: the engine's operations on numpy arrays, the reference of the other kernel modules.

Each function is a stateless step on flat arrays (one tensor's row, or a fused bucket's
buffers); the engine and the codecs hold the state. Torch and TensorFlow kernels implement
the same functions and are tested against this module: bit-for-bit for Top-k, RegTop-k
and TernGrad given the same random draws, the same threshold rule for Gaussian-k. The
last section holds what the fused bucket path (``hvd_compress.engine.fused``) needs
beside them: buffers, indexed reads and writes, and TernGrad's steps of every row of a
bucket; numpy's row selections (:mod:`~hvd_compress.kernels.reference_rows`) run the
functions above row by row. The per-tensor definition of each algorithm, the tests'
yardstick, is the spec outside the package (``spec/`` of the repository).

Notation (docs/design.md): ``a`` is the error-compensated gradient
``g + r`` of one tensor on one rank, ``d`` its length, ``k = max(1, ceil(ratio * d))``.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Sequence, Tuple

import numpy as np

from hvd_compress.wire import ternary_field_bits

#: Wire dtype of ``FP16``; dtypes of the fused bucket path's buffers.
float16, float32, float64, int16, int64 = np.float16, np.float32, np.float64, np.int16, np.int64

#: RegTop-k's "no information" distortion (plain Top-k score), as in the reference code.
NO_DISTORTION = 1e8


def num_selected(numel: int, ratio: float) -> int:
    """``k = max(1, ceil(ratio * numel))``: entries a sparsifier sends.

    The product is shrunk by one part in 10^12 first, so that float rounding
    (``0.07 * 100 = 7.000000000000001``) does not add an entry.
    """
    return max(1, math.ceil(ratio * numel * (1.0 - 1e-12)))


def index_dtype(numel: int) -> np.dtype:
    """int32 indices, int64 only for tensors of 2**31 elements or more."""
    return np.dtype(np.int32) if numel < 2**31 else np.dtype(np.int64)


# --------------------------------------------------------------------------- #
# Array utilities (each kernel module provides the same)
# --------------------------------------------------------------------------- #

def itemsize(a: np.ndarray) -> int:
    return a.itemsize



def zeros_like(a: np.ndarray) -> np.ndarray:
    return np.zeros_like(a)


def full(numel: int, value: float, like: np.ndarray, dtype=None) -> np.ndarray:
    return np.full(numel, value, dtype=like.dtype if dtype is None else dtype)


def cast(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` in ``dtype``; values out of range become Inf silently (callers check)."""
    with np.errstate(over="ignore"):
        return a.astype(dtype, copy=False)


def as_int64(values, like: np.ndarray) -> np.ndarray:
    """A small int64 array (headers) next to ``like``."""
    return np.asarray(values, dtype=np.int64)


def as_float32(values, like: np.ndarray) -> np.ndarray:
    """A small float32 array (scales) next to ``like``."""
    return np.asarray(values, dtype=np.float32)


def from_host(array: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A numpy ``array`` (same dtype) as this framework's tensor next to ``like`` (loaded state)."""
    return np.asarray(array)


def reshape(a: np.ndarray, shape) -> np.ndarray:
    return a.reshape(shape)


def divide(a: np.ndarray, n: int) -> np.ndarray:
    """``a / n`` (averages over ranks), each quotient rounded once in ``a``'s dtype."""
    return a / a.dtype.type(n)


def to_list(a: np.ndarray) -> list:
    """A small array (headers, scales) as Python numbers."""
    return a.tolist()


def split(a: np.ndarray, sizes) -> list:
    """Consecutive pieces of ``a`` of the given sizes (views)."""
    return np.split(a, np.cumsum(sizes)[:-1])


def generator(seed: int, rank: int, like: np.ndarray) -> np.random.Generator:
    """The random stream of ``rank``: ``default_rng([seed, rank])``."""
    return np.random.default_rng([seed, rank])



def uniform(rng: np.random.Generator, like: np.ndarray) -> np.ndarray:
    """``len(like)`` draws uniform on [0, 1), drawn in float32, in ``like``'s dtype."""
    return rng.random(like.shape[0], dtype=np.float32).astype(like.dtype, copy=False)


def host_empty() -> np.ndarray:
    """An empty array on the host: where checkpoints try a saved stream state (``generator(0, 0, like)``)."""
    return np.empty(0)


def generator_state(rng: np.random.Generator):
    return rng.bit_generator.state


def set_generator_state(rng: np.random.Generator, state) -> None:
    rng.bit_generator.state = state


# --------------------------------------------------------------------------- #
# Error feedback
# --------------------------------------------------------------------------- #
def error_feedback_split(
    a: np.ndarray, indices: np.ndarray, in_place: bool = False, wire_dtype=None
) -> Tuple[np.ndarray, np.ndarray]:
    """Send ``a[S]`` and keep the rest: returns ``(values, residual)``.

    ``residual`` is ``a`` with ``a[S]`` set to zero, so ``values`` scattered at ``S``
    plus ``residual`` equals ``a`` exactly (error feedback, Seide et al. 2014;
    Stich et al. 2018). ``in_place``: ``a`` is a buffer of the caller's and becomes
    the residual (no copy).

    ``wire_dtype`` narrower than ``a`` (a float16 or bfloat16 gradient whose ``a = g + r``
    accumulates in float32): ``values = saturate(a[S], wire_dtype)`` and the residual
    keeps what the wire cannot carry, ``r[S] = a[S] - values``, so the identity above
    still holds and no finite ``a`` ever sends Inf.
    """
    values = a[indices]
    residual = a if in_place else a.copy()
    if wire_dtype is None or np.dtype(wire_dtype) == a.dtype:
        residual[indices] = 0
        return values, residual
    sent = saturate(values, wire_dtype)
    residual[indices] = values - sent.astype(a.dtype)
    return sent, residual


def momentum_update(velocity: np.ndarray, g: np.ndarray, momentum: float, compile=None) -> np.ndarray:
    """``u = m u + g`` (a new array in the velocity's dtype, at least float32): the velocity of Deep
    Gradient Compression's momentum correction (Lin et al. 2018, section 3.2), which error feedback
    then accumulates instead of the gradient. ``m`` is rounded to that dtype first; one multiply,
    then one add (no fused multiply-add), as every kernel module computes it. ``compile``: torch's
    option (numpy compiles nothing)."""
    return velocity * velocity.dtype.type(momentum) + g.astype(velocity.dtype)


def momentum_mask(velocity: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``u[S] = 0`` in place (momentum factor masking: a sent entry's momentum is spent); returns ``u``."""
    velocity[indices] = 0
    return velocity


def saturate(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` rounded to ``dtype``, values beyond its finite range clipped to it (NaN stays NaN)."""
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    largest = np.finfo(dtype).max
    return np.clip(a, -largest, largest).astype(dtype)


# --------------------------------------------------------------------------- #
# Top-k
# --------------------------------------------------------------------------- #
def topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest ``scores``, ascending; ties go to the lower index.

    O(d): ``argpartition`` finds the k-th largest score ``v``; every index with a
    score above ``v`` is taken, then the lowest-indexed ones equal to ``v``.
    """
    numel = scores.shape[0]
    k = min(k, numel)
    kth = scores[np.argpartition(scores, numel - k)[numel - k]]
    above = np.flatnonzero(scores > kth)
    ties = np.flatnonzero(scores == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, ties])).astype(index_dtype(numel))



# --------------------------------------------------------------------------- #
# Gaussian-k
# --------------------------------------------------------------------------- #
#: Correction loop of hclhkbu/GaussianK-SGD ``compression.py`` (GaussianCompressor):
#: at most 3 evaluations; below 2k/3 selected halve the threshold, above 4k/3 grow it 1.5x.
GAUSSIANK_ROUNDS = 3
GAUSSIANK_LOW, GAUSSIANK_HIGH = 2.0 / 3.0, 4.0 / 3.0
GAUSSIANK_SHRINK, GAUSSIANK_GROW = 0.5, 1.5


def gaussiank_slots(k: int) -> int:
    """The most entries Gaussian-k selects (:func:`gaussiank_from`) for ``k``: ``floor(4k/3)``.

    A threshold in range selects at most ``4k/3``; the fallbacks select fewer than
    ``2k/3`` (the last threshold, when nothing overshot) or exactly ``k`` (the cut).
    The fused path sends this many slots per tensor, so no count is exchanged.
    """
    return math.floor(GAUSSIANK_HIGH * k)


def gaussiank_threshold(a: np.ndarray, ratio: float) -> float:
    """First Gaussian-k threshold: ``thr = |mu| + sigma * Phi^-1(1 - ratio / 2)``.

    Shi et al., "Understanding Top-k Sparsification in Distributed Deep Learning"
    (2019), section 5: if ``a`` is bell-shaped with mean ``mu`` and standard
    deviation ``sigma`` (population, ``ddof=0``), a fraction ``ratio`` of entries
    lies beyond the two-sided ``1 - ratio`` quantile. The reference code uses
    ``mu``; ``|mu|`` keeps the threshold positive when the mean is negative.
    """
    mu = float(np.mean(a, dtype=np.float64))
    sigma = float(np.std(a, dtype=np.float64))
    return abs(mu) + sigma * normal_tail_quantile(ratio)


def normal_tail_quantile(ratio: float) -> float:
    """``Phi^-1(1 - ratio / 2)``, computed as ``-Phi^-1(ratio / 2)`` so tiny ratios stay finite."""
    return -NormalDist().inv_cdf(ratio / 2.0)



def gaussiank_from(magnitude: np.ndarray, threshold: float, k: int) -> np.ndarray:
    """Gaussian-k's selection on ``|a|`` from a first ``threshold``: the indices selected, ascending
    (:func:`threshold_select` toward ``[ceil(2k/3), floor(4k/3)]``, every entry counted)."""
    return threshold_select(magnitude, threshold, k, gaussiank_bounds(k), gaussiank_slots(k), 1)[0]


#: Every threshold the correction can evaluate, as multiples of the first: ``0.5^i 1.5^j`` for the
#: paths of at most ``GAUSSIANK_ROUNDS - 1`` steps (exact in binary), ascending.
GAUSSIANK_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.5, 2.25)


def gaussiank_bounds(k: int) -> Tuple[int, int]:
    """The counts Gaussian-k accepts for ``k``: ``[ceil(2k/3), floor(4k/3)]`` (integers, so that a
    count is compared as the reference code compares it with ``2k/3`` and ``4k/3``)."""
    return math.ceil(GAUSSIANK_LOW * k), math.floor(GAUSSIANK_HIGH * k)


def threshold_choice(count: Callable, threshold: float, low: int, high: int) -> Tuple[float, bool]:
    """Gaussian-k's correction of a first ``threshold`` toward a count in ``[low, high]``:
    ``(the threshold chosen, whether its set is to be cut to its first entries)``.

    Up to ``GAUSSIANK_ROUNDS`` evaluations of ``count(thr)``; below ``low`` the
    threshold halves, above ``high`` it grows 1.5x; the first in range is chosen.
    When none is, the smallest set above ``high`` seen is chosen, to be cut, or,
    when none overshot, the last threshold evaluated. Round ``r`` evaluates
    ``threshold * f_r``, ``f_r`` the product of the steps taken so far (one of
    :data:`GAUSSIANK_FACTORS`, exact), rounded once: every threshold a row can meet
    is known from the first, so an accelerator counts all of them in one pass and
    applies this rule to the counts.
    """
    superset = None  # the lowest count above high seen, and its threshold
    factor, last = 1.0, threshold
    for _ in range(GAUSSIANK_ROUNDS):
        current = threshold * factor
        selected = count(current)
        if selected < low:
            last, factor = current, factor * GAUSSIANK_SHRINK
        elif selected > high:
            if superset is None or selected < superset[0]:
                superset = (selected, current)
            last, factor = current, factor * GAUSSIANK_GROW
        else:
            return current, False
    return (last, False) if superset is None else (superset[1], True)


#: Entries a reused threshold's counts expect above it in their sample (``k / stride``).
COUNT_SAMPLE = 64


def sample_stride(k: int) -> int:
    """Every how many entries a reused threshold's counts look (:func:`reused_threshold_select`):
    ``max(1, k // COUNT_SAMPLE)``, so about 64 sampled entries lie above a threshold in range;
    every entry (stride 1) below ``k = 128``."""
    return max(1, k // COUNT_SAMPLE)


def threshold_select(scores: np.ndarray, threshold: float, k: int, bounds: Tuple[int, int],
                     width: int, stride: int) -> Tuple[np.ndarray, float]:
    """One row's selection by a threshold corrected toward a count in ``bounds``: ``(indices
    ascending, the threshold chosen)``.

    ``S = {j : score_j > thr}`` in index order, cut to its first ``k`` where the correction
    cuts (:func:`threshold_choice`: up to three counts, x0.5 below ``low``, x1.5 above
    ``high``), else to its first ``width`` (the slots a fused bucket sends). A count is
    ``stride`` times the entries of ``scores[::stride]`` above ``thr``: an accelerator counts
    the six thresholds the correction can meet on ``n / stride`` entries, then one pass over
    the row marks the chosen set. With ``stride = 1`` the counts are exact and no set in range
    exceeds ``width >= high``; a sampled count may miss the true one (by about ``1/sqrt(64)``
    at :func:`sample_stride`), and ``width`` bounds what is sent.

    Gaussian-k corrects its first threshold toward ``[ceil(2k/3), floor(4k/3)]`` in
    ``floor(4k/3)`` slots, counting every entry; Top-k and RegTop-k between exact selections
    (``exact_every > 1``) correct the threshold they kept toward ``[ceil(k/2), k]`` in ``k``
    slots, counting every :func:`sample_stride`-th entry (:func:`reused_threshold_select`).
    (Gaussian-k with sampled counts, its counting pass reading ``1/s`` of a row, cost 0.75-1.3
    points of accuracy on the Fashion-MNIST CNN; docs/results.md.)
    """
    sample = scores[::stride]
    chosen, cut = threshold_choice(lambda t: stride * int(np.count_nonzero(sample > t)), threshold, *bounds)
    selected = np.flatnonzero(scores > chosen)[: k if cut else width]
    return selected.astype(index_dtype(scores.shape[0])), chosen


# --------------------------------------------------------------------------- #
# Reused thresholds (Top-k and RegTop-k with ``exact_every > 1``)
# --------------------------------------------------------------------------- #
def reuse_bounds(k: int) -> Tuple[int, int]:
    """The counts a reused threshold accepts for ``k`` slots: ``[ceil(k/2), k]`` (Gaussian-k's
    ``[2k'/3, 4k'/3]`` for a target of ``k' = 3k/4``): what it sends fits Top-k's ``k`` slots."""
    return (k + 1) // 2, k


def reused_threshold_select(scores: np.ndarray, threshold: float, k: int) -> Tuple[np.ndarray, float]:
    """One row's selection by a kept ``threshold`` into ``k`` slots: ``(indices ascending, the
    threshold to keep)``: :func:`threshold_select` toward ``[ceil(k/2), k]`` in ``k`` slots.

    The threshold chosen is kept for the next step, so it follows the scores as they
    drift; an exact selection (every ``exact_every`` steps) sets it again to the ``k``-th
    largest score. Ok-Topk (Li & Hoefler, "Near-Optimal Sparse Allreduce for Distributed
    Deep Learning", PPoPP 2022, arXiv:2201.07598) likewise selects by a threshold it
    recomputes exactly only every few steps. (Marking once against the kept threshold and
    moving it only for the next step, without the in-step correction, cost 1.3 points of
    accuracy on the Fashion-MNIST MLP: while the threshold catches up, the cut keeps the
    lowest indices; docs/results.md.)
    """
    return threshold_select(scores, threshold, k, reuse_bounds(k), k, sample_stride(k))


# --------------------------------------------------------------------------- #
# RegTop-k
# --------------------------------------------------------------------------- #
def regtopk_scores(a: np.ndarray, distortion: np.ndarray, mu: float) -> np.ndarray:
    """RegTop-k score ``|tanh((1 + D_j) / mu)| * |a_j|``.

    Bereyhi et al., "Regularized Top-k: A Bayesian framework for gradient
    sparsification" (2025), the MAP sparsification mask; companion code
    AlBerey/RegTopK ``DistLearnLinearReg.py`` (function ``RegTopK``). ``D`` is the
    posterior distortion from the last aggregation (``D_j = (T_j - s_j) / s_j`` where this
    rank sent ``s_j != 0``, ``T`` the sum over ranks; :func:`regtopk_expand` makes it dense),
    ``mu`` the temperature. With ``D = 1e8`` the score is ``|a_j|`` (Top-k).
    ``D`` is kept in at least float32; ``tanh`` is evaluated in float64 and
    rounded back, so every framework's kernel gets the same scores.
    """
    d = distortion.astype(accumulation_dtype(distortion.dtype), copy=False)
    damping = np.tanh(((1.0 + d) / mu).astype(np.float64)).astype(d.dtype)
    return np.abs(damping) * np.abs(a)



def regtopk_expand(idx: np.ndarray, values: np.ndarray, numel: int) -> np.ndarray:
    """Dense ``D`` from its informative part: ``values`` at ``idx``, ``1e8`` elsewhere."""
    distortion = np.full(numel, NO_DISTORTION, dtype=values.dtype)
    distortion[idx] = values
    return distortion



def regtopk_sparse_scores(a: np.ndarray, idx: np.ndarray, values: np.ndarray, mu: float) -> np.ndarray:
    """RegTop-k's scores with ``D`` given by its informative part ``(idx, values)`` (``|a|`` elsewhere),
    in at least float32."""
    scores = np.abs(a).astype(accumulation_dtype(np.result_type(a.dtype, values.dtype)), copy=False)
    scores[idx] = regtopk_scores(a[idx], values, mu)
    return scores


# --------------------------------------------------------------------------- #
# TernGrad
# --------------------------------------------------------------------------- #

def terngrad_codes(g: np.ndarray, scale: float, uniform: np.ndarray) -> np.ndarray:
    """Ternary codes ``t_j = sign(g_j) * b_j``, ``b_j ~ Bernoulli(|g_j| / S)``.

    ``b_j = [u_j < |g_j| / S]`` with ``u_j`` uniform on [0, 1) (``uniform``, the
    same draws for every implementation), so ``E[S * t] = g`` when ``S >= max|g|``
    (Wen et al. 2017, eq. 3). ``S = 0`` (an all-zero gradient) gives all-zero codes.
    """
    if scale == 0:
        return np.zeros(g.shape[0], dtype=np.int8)
    keep = uniform < np.abs(g) / g.dtype.type(scale)
    return (np.sign(g).astype(np.int8) * keep).astype(np.int8)


def _pack_fields(fields: np.ndarray, bits: int, per_word: int, word: type) -> np.ndarray:
    """Pack small unsigned ``fields`` into words (unsigned ``word``) of ``per_word`` fields of ``bits``
    bits, field ``i`` of a word at bit ``i * bits``; computed in ``word`` itself (the fields do not overlap)."""
    words = -(-fields.shape[0] // per_word)
    padded = np.zeros(words * per_word, dtype=word)
    padded[: fields.shape[0]] = fields
    grid = padded.reshape(words, per_word)
    packed = grid[:, 0].copy()
    for i in range(1, per_word):  # a column at a time: a few passes over words, not over fields
        packed |= grid[:, i] << word(bits * i)
    return packed


def _unpack_fields(words: np.ndarray, bits: int, per_word: int, numel: int) -> np.ndarray:
    """Inverse of :func:`_pack_fields`: the first ``numel`` fields of unsigned ``words``, in their dtype."""
    word = words.dtype.type
    grid = np.empty((words.shape[0], per_word), dtype=words.dtype)
    for i in range(per_word):
        np.bitwise_and(words >> word(bits * i), word((1 << bits) - 1), out=grid[:, i])
    return grid.reshape(-1)[:numel]


def pack_ternary(codes: np.ndarray, world_size: int, compile=None) -> np.ndarray:
    """Pack ``t + 1`` into int32 lanes of ``floor(32/b)`` fields of ``b`` bits.

    Summing the lanes of N ranks with an int32 allreduce sums every field without
    carry into its neighbour (each field sum is at most ``2N < 2**b``); int32
    addition wraps modulo ``2**32``, which the unsigned view undoes exactly.
    """
    bits = ternary_field_bits(world_size)
    fields = (codes.astype(np.int64) + 1).astype(np.uint32)
    return _pack_fields(fields, bits, 32 // bits, np.uint32).view(np.int32)


def unpack_ternary_sum(lanes: np.ndarray, numel: int, world_size: int) -> np.ndarray:
    """Inverse of :func:`pack_ternary` on the sum of ``world_size`` ranks' lanes: ``sum t``."""
    bits = ternary_field_bits(world_size)
    fields = _unpack_fields(lanes.view(np.uint32), bits, 32 // bits, numel)
    return fields.astype(np.int32) - np.int32(world_size)


def pack_two_bit(codes: np.ndarray, compile=None) -> np.ndarray:
    """``t + 1`` packed four to a byte (int8, the allgather wire format)."""
    fields = (codes + np.int8(1)).view(np.uint8)  # {-1, 0, 1} + 1: 0, 1, 2
    return _pack_fields(fields, 2, 4, np.uint8).view(np.int8)


def unpack_two_bit(packed: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of :func:`pack_two_bit`: codes in {-1, 0, 1} (int8)."""
    return _unpack_fields(packed.view(np.uint8), 2, 4, numel).view(np.int8) - np.int8(1)


def maximum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise maximum (an allreduce-Max of two ranks)."""
    return np.maximum(a, b)


def concat(arrays: Sequence[np.ndarray], out=None) -> np.ndarray:
    """Rank-ordered concatenation, as an allgather returns it (into ``out``)."""
    return np.concatenate(arrays, out=out)



def added_concat(parts: Sequence[np.ndarray], addend: np.ndarray) -> np.ndarray:
    """``concat(parts) + addend`` (``addend``: the parts' dtype and total length), each part added into its
    slice of one new buffer: one pass, no concatenated copy first."""
    out, start = np.empty(addend.shape[0], dtype=addend.dtype), 0
    for part in parts:
        stop = start + part.shape[0]
        np.add(part, addend[start:stop], out=out[start:stop])
        start = stop
    return out


def sum_int32_wrapping(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise int32 sum with two's-complement wrap-around, as an int32 allreduce does."""
    total = np.zeros_like(arrays[0], dtype=np.uint32)
    for array in arrays:
        total += array.view(np.uint32)
    return total.view(np.int32)


# --------------------------------------------------------------------------- #
# Aggregation
# --------------------------------------------------------------------------- #
def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """Sums run in at least float32 (float16 payloads are added in float32)."""
    return np.result_type(dtype, np.float32)


def dense_sum(values: Sequence[np.ndarray]) -> np.ndarray:
    """Sum of the ranks' dense tensors in rank order, in at least float32."""
    dtype = accumulation_dtype(values[0].dtype)
    total = values[0].astype(dtype)
    for v in values[1:]:
        total = total + v.astype(dtype, copy=False)
    return total



# --------------------------------------------------------------------------- #
# Fused buckets (hvd_compress.engine.fused): buffers, and every tensor's step at once
# --------------------------------------------------------------------------- #
#: the module of the fused path's row selections (:func:`hvd_compress.kernels.bucket_rows`)
BUCKET_ROWS = "hvd_compress.kernels.reference_rows"
#: The functions the fused bucket path calls besides the ones above (every kernel module has them).
#: Every one returns its result, which the fused path always uses: numpy and torch write in place
#: (into ``out=``, a slice, or the first argument), TensorFlow's tensors are immutable and its
#: functions return new ones (``joined`` then concatenates the parts written "into" a buffer).
BUCKET_FUNCTIONS = (
    "fusable", "float_errors_ignored", "empty", "zeros", "scalar", "clone", "to_device", "added_concat", "take",
    "zero_at", "put", "fill_zero", "index_add", "isnan", "magnitude", "quotient", "nonfinite_to_zero", "multiply",
    "where", "gaussiank_from", "regtopk_sparse_scores", "draws_in_pass", "uniform_into", "terngrad_bucket_scales",
    "terngrad_bucket_codes",
    "terngrad_bucket_residual", "add", "add_into", "copy_into", "joined", "sum_along", "any_along", "masked",
    "keep_rows", "keep_finite_rows", "scale_rows", "placed",
)


def fusable(tensors: Sequence[np.ndarray]) -> bool:
    """Whether ``tensors`` can share a fused bucket: arrays of one float dtype."""
    first = tensors[0]
    return all(isinstance(t, np.ndarray) and t.dtype == first.dtype for t in tensors) and first.dtype in (
        np.float16, np.float32, np.float64)


def float_errors_ignored():
    """A context without numpy's floating-point warnings: a fused step makes its NaN flags as
    ``0 * Inf`` and lets sums overflow, as the dense allreduce it replaces does."""
    return np.errstate(all="ignore")


def empty(numel: int, dtype, like: np.ndarray) -> np.ndarray:
    return np.empty(numel, dtype=dtype)


def zeros(numel: int, dtype, like: np.ndarray) -> np.ndarray:
    return np.zeros(numel, dtype=dtype)


def scalar(value: float, dtype, like: np.ndarray):
    """``value`` as a number of ``dtype`` (divisions by it round once in that dtype)."""
    return np.dtype(dtype).type(value)


def clone(a: np.ndarray) -> np.ndarray:
    return a.copy()


def to_device(a: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``a`` where ``like`` lives (the host)."""
    return a


def take(a: np.ndarray, indices: np.ndarray, out=None) -> np.ndarray:
    """``a[indices]`` (into ``out``)."""
    return np.take(a, indices, out=out)


def zero_at(a: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``a[indices] = 0`` in place; returns ``a``."""
    a[indices] = 0
    return a


def put(a: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``a[indices] = values`` in place (distinct ``indices``); returns ``a``."""
    a[indices] = values
    return a


def fill_zero(a: np.ndarray) -> np.ndarray:
    a[...] = 0
    return a


def index_add(total: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``total[indices] += values`` in place, in order (a repeated index adds each time)."""
    np.add.at(total, indices, values)
    return total


def quotient(a: np.ndarray, divisor) -> np.ndarray:
    """``a / divisor`` (a 0-d array or scalar of ``a``'s dtype), a new array."""
    return a / divisor


def magnitude(a: np.ndarray) -> np.ndarray:
    """``|a|``, a new array."""
    return np.abs(a)


def nonfinite_to_zero(a: np.ndarray) -> np.ndarray:
    """``a`` with NaN and +-Inf replaced by 0."""
    return np.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)


def isnan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a)


def multiply(a: np.ndarray, b, out=None) -> np.ndarray:
    return np.multiply(a, b, out=out)


def where(condition: np.ndarray, a, b, out=None) -> np.ndarray:
    """``a`` where ``condition``, else ``b`` (into ``out``, which may be ``b``)."""
    if out is None:
        return np.where(condition, a, b)
    if out is not b:
        out[...] = b
    np.copyto(out, a, where=condition)
    return out


def draws_in_pass(rng, a: np.ndarray, dtype, compile=None) -> bool:
    """Whether TernGrad's codes pass makes its uniforms itself from stream keys: never here, the uniforms
    are drawn first (:func:`uniform_into`; torch's counter stream makes them in its compiled pass;
    ``compile``: torch's option)."""
    return False


def uniform_into(rng: np.random.Generator, out: np.ndarray) -> np.ndarray:
    """:func:`uniform`'s float32 draws, written into the float32 ``out``."""
    return rng.random(out.shape[0], dtype=np.float32, out=out)


def terngrad_bucket_scales(a: np.ndarray, groups, clip, compile=None):
    """Per row of ``groups`` (views of ``a``): ``(max|clip(a)|, clipping bound or None)`` in ``a``'s
    dtype, the clipping bound ``c std`` (TernGrad's, Wen et al. 2017, section 3.3), +Inf where the row is
    left as it is (``std = 0`` or a constant row: clipping would erase it). ``compile``: torch's option
    (numpy compiles nothing)."""
    rows_of = [row for grp in groups for row in grp.view(a)]
    largest = np.array([np.max(np.abs(row)) for row in rows_of], dtype=a.dtype)
    if clip is None:
        return largest, None
    exact = np.array([clip * float(np.std(row, dtype=np.float64)) for row in rows_of])
    constant = np.array([np.max(row) == np.min(row) for row in rows_of], dtype=bool)
    bound = cast(exact, a.dtype)
    bound[(exact == 0) | constant] = np.inf
    return np.minimum(largest, bound), bound


def terngrad_bucket_codes(a: np.ndarray, groups, bound, scale: np.ndarray, uniform: np.ndarray,
                          compile=None) -> np.ndarray:
    """:func:`terngrad_codes` of every row, each with its ``scale`` (and clipping ``bound``); ``compile``: torch's
    option (numpy compiles nothing)."""
    ratio = np.abs(a)  # S = 0: |a| = 0 / 0 is NaN, no code
    for grp in groups:
        view = grp.view(ratio)
        if bound is not None:
            np.minimum(view, grp.column(bound), out=view)
        view /= grp.column(scale)
    return (np.sign(a).astype(np.int8) * (uniform < ratio)).astype(np.int8)


def terngrad_bucket_residual(a: np.ndarray, groups, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``r = a - S t`` per row, in place in ``a``."""
    for grp in groups:
        view = grp.view(a)
        view -= grp.view(codes) * grp.column(scale)
    return a


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a + b`` in the type both promote to."""
    return a + b


def add_into(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a += b`` in place (``b`` of ``a``'s dtype); returns ``a``."""
    a += b
    return a


def copy_into(out: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[...] = values`` (cast to ``out``'s dtype); returns ``out``."""
    out[...] = values
    return out


def joined(buffer: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
    """``buffer``, whose consecutive slices ``parts`` were written into (``out=``, :func:`copy_into`;
    numpy's and torch's arrays alike)."""
    return buffer


def placed(out: np.ndarray, parts: Sequence[Tuple[int, np.ndarray]]) -> np.ndarray:
    """``out`` with each ``(start, values)`` of ``parts`` written from ``start`` on (in place: numpy's and
    torch's arrays; torch's in one launch)."""
    for start, values in parts:
        out[start : start + values.shape[0]] = values
    return out


def sum_along(a: np.ndarray, axis: int) -> np.ndarray:
    """The sums along ``axis`` (numpy's and torch's arrays alike)."""
    return a.sum(axis)


def any_along(a: np.ndarray, axis: int) -> np.ndarray:
    """Whether any is set along ``axis`` (numpy's and torch's arrays alike)."""
    return a.any(axis)


def masked(a: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The entries of ``a`` where ``mask`` (numpy's and torch's arrays alike)."""
    return a[mask]


def keep_rows(groups, bad: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``old`` updated in place to ``new``, but each row of ``groups`` flagged in ``bad`` (one flag per row)
    left as it was: state keeps its buffer across steps (what a captured CUDA graph reads)."""
    for grp in groups:
        np.copyto(grp.view(old), grp.view(new), where=~grp.column(bad))
    return old


def keep_finite_rows(groups, total: np.ndarray, old: np.ndarray, new: np.ndarray, compile=None) -> np.ndarray:
    """``old`` updated in place to ``new``, but each row of ``groups`` where ``total`` holds NaN/Inf left
    (``compile``: torch's option; numpy compiles nothing)."""
    for grp in groups:  # per row, the sum of 0 * its elements: NaN where it holds NaN/Inf
        bad = isnan(multiply(grp.view(total), 0).sum(1))[:, None]
        np.copyto(grp.view(old), grp.view(new), where=~bad)
    return old


def scale_rows(groups, values: np.ndarray, scale: np.ndarray, dtype, numel: int, compile=None) -> np.ndarray:
    """``values`` times each row's ``scale``, in ``dtype``: ``numel`` entries, the rows of ``groups``
    (``compile``: torch's option)."""
    total = np.empty(numel, dtype=dtype)
    for grp in groups:
        multiply(grp.view(values), grp.column(scale), out=grp.view(total))
    return total
