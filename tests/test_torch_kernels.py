"""The torch kernels against the numpy oracle (``compressors.reference``).

Every function of :mod:`hvd_compress.kernels.torch_ops` that shares a name with
the reference gets the same inputs and must give the same result:

* bit-exact (``np.array_equal``, same dtype): Top-k and RegTop-k selection, the
  RegTop-k scores and distortion, the error-feedback split, TernGrad's codes given
  the same uniforms, the ternary and 2-bit packings, the int32 sums, ``concat``,
  ``dense_sum`` and ``sparse_sum``. ``sparse_sum`` adds one rank at a time (a
  rank's indices are distinct), so its sums are in rank order like ``np.add.at``
  on CUDA too, where one ``index_add_`` of all ranks would add with atomics in no
  fixed order (:func:`test_sparse_sum_adds_in_rank_order` would catch another order);
* within a stated tolerance: the reductions (Gaussian-k's mean/std threshold,
  TernGrad's clipping bound), computed in the input dtype by torch and in float64
  by the reference;
* Gaussian-k: the same count rule, checked exactly by handing the reference the
  torch threshold; with its own threshold the selected set must be equal unless an
  |a_j| lies between the two thresholds (at some correction round), where rounding
  decides.

Then dtype/device preservation, the :class:`~hvd_compress.simulator.Simulator`
fed torch tensors vs numpy arrays, and checkpoints of compressors run on torch.

The comparisons and the Simulator checks run on CPU and on CUDA (see ``DEVICES``:
when a GPU is present, or required with ``HVD_COMPRESS_DEVICE=cuda``).
"""

from __future__ import annotations

import inspect
import os
import pickle
from typing import Any, List
from unittest import mock

import numpy as np
import pytest
from hypothesis import Phase, assume, example, given, note, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK  # noqa: E402
from hvd_compress.kernels import reference as R  # noqa: E402
from hvd_compress.wire import TernaryPayload  # noqa: E402
from hvd_compress.kernels import ops_for  # noqa: E402
from hvd_compress.kernels import torch_ops as T  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402

from tests.helpers import (  # noqa: E402
    ALL_COMPRESSORS,
    SPARSIFIERS,
    distortions,
    exact_k,
    float_arrays,
    index_sets,
    permille,
    ternary_codes,
    training_runs,
)

FLOATS = [np.float16, np.float32, np.float64]
FLOATS_32_64 = [np.float32, np.float64]

#: ``HVD_COMPRESS_DEVICE`` (``ci/gpu_tests.sh`` exports ``cuda``): ``cuda`` makes the CUDA cases
#: required (they fail, not skip, without a usable GPU), ``cpu`` leaves them out; unset, they run
#: whenever ``torch.cuda.is_available()``.
REQUESTED_DEVICE = os.environ.get("HVD_COMPRESS_DEVICE", "").strip().lower()
if REQUESTED_DEVICE not in ("", "cpu", "cuda"):
    raise ValueError(f"HVD_COMPRESS_DEVICE must be cpu or cuda, got {REQUESTED_DEVICE!r}")


def _cuda_case():
    if REQUESTED_DEVICE == "cuda":
        return "cuda"
    if REQUESTED_DEVICE == "cpu":
        return pytest.param("cuda", marks=pytest.mark.skip(reason="HVD_COMPRESS_DEVICE=cpu"))
    return pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
        ),
    )


DEVICES = ["cpu", _cuda_case()]

#: Magnitudes that repeat (ties), signed zeros included.


# --------------------------------------------------------------------------- #
# Conversions and comparisons
# --------------------------------------------------------------------------- #
def to_torch(a: np.ndarray, device: str = "cpu") -> "torch.Tensor":
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def to_numpy(t: "torch.Tensor") -> np.ndarray:
    return t.detach().cpu().numpy()


def torch_dtype(dtype) -> "torch.dtype":
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def assert_same(got: "torch.Tensor", want: np.ndarray, what: str = "") -> None:
    """Torch result == reference result: dtype, every value and sign of zero (NaN == NaN)."""
    assert isinstance(got, torch.Tensor), (what, type(got))
    assert got.dtype == torch_dtype(want.dtype), (what, got.dtype, want.dtype)
    got = to_numpy(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    same = np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
    if want.dtype.kind == "f":  # -0.0 and 0.0 compare equal: their sign bits must too
        same = same and np.array_equal(np.signbit(got), np.signbit(want))
    assert same, (
        what,
        np.flatnonzero(got != want)[:10],
        got[got != want][:10],
        want[got != want][:10],
    )


# --------------------------------------------------------------------------- #
# Strategies (arrays of a few thousand entries are drawn from a seed: fast)
# --------------------------------------------------------------------------- #
mus = st.sampled_from([4.0, 5.0, 0.7, 4.3, 37.5])
world_sizes = st.integers(1, 16)


# --------------------------------------------------------------------------- #
# 1. Kernels vs the reference
# --------------------------------------------------------------------------- #
def test_every_reference_function_has_a_torch_twin():
    """The contract of the kernel interface: same public names (the constants and
    framework-free helpers are re-exported)."""
    functions = [
        name
        for name, f in vars(R).items()
        if inspect.isfunction(f) and f.__module__ == R.__name__ and not name.startswith("_")
    ]
    assert sorted(n for n in functions if not callable(getattr(T, n, None))) == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_array_utilities_match_reference(device, dtype, data):
    a = data.draw(float_arrays(dtype, max_size=300), label="a")
    a[: data.draw(st.integers(0, 3))] = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    t = to_torch(a, device)
    assert T.is_floating(t) is R.is_floating(a) is True
    assert T.is_floating(to_torch(a.astype(np.int32), device)) is R.is_floating(a.astype(np.int32)) is False
    assert T.count_nonfinite(t) == R.count_nonfinite(a)
    assert T.itemsize(t) == R.itemsize(a)
    assert_same(T.zeros_like(t), R.zeros_like(a), "zeros_like")
    assert_same(T.full(a.shape[0], 2.5, t), R.full(a.shape[0], 2.5, a), "full")
    for target in FLOATS:
        assert_same(T.cast(t, torch_dtype(target)), R.cast(a, target), f"cast to {target.__name__}")
    assert_same(T.as_int64([3, -1, 2**40], t), R.as_int64([3, -1, 2**40], a), "as_int64")
    assert_same(T.as_float32([0.1, 1e30], t), R.as_float32([0.1, 1e30], a), "as_float32")
    cut = data.draw(st.integers(0, a.shape[0]))
    sizes = [cut, a.shape[0] - cut]
    for got, want in zip(T.split(t, sizes), R.split(a, sizes), strict=True):
        assert_same(got, want, "split")


@pytest.mark.parametrize("dtype", FLOATS)
def test_torch_random_stream_is_per_rank_and_uniform(dtype):
    like = torch.zeros(5000, dtype=torch_dtype(dtype))
    draws = [T.uniform(T.generator(7, rank, like), like) for rank in (0, 0, 1)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert draws[0].dtype == like.dtype
    assert float(draws[0].min()) >= 0 and float(draws[0].max()) <= 1  # float16 may round up to 1
    assert abs(float(draws[0].double().mean()) - 0.5) < 5 * (1 / 12 / 5000) ** 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_topk_matches_reference_with_ties(device, dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    k = data.draw(st.integers(1, a.shape[0] + 2), label="k")  # k > numel clamps
    assert_same(T.topk_select(to_torch(a, device), k), R.topk_select(a, k), "topk_select")
    # signed scores: topk_indices ranks values, not magnitudes
    assert_same(T.topk_indices(to_torch(a, device), k), R.topk_indices(a, k), "topk_indices")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS_32_64)
@given(data=st.data(), p=permille)
def test_topk_all_equal_magnitudes_take_the_lowest_indices(device, dtype, data, p):
    numel = data.draw(st.integers(1, 3000))
    signs = np.random.default_rng(numel).choice([-1.0, 1.0], numel).astype(dtype)
    k = exact_k(p, numel)
    got = T.topk_select(to_torch(signs, device), k)
    assert_same(got, R.topk_select(signs, k))
    assert_same(got, np.arange(k, dtype=np.int32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), mu=mus)
def test_regtopk_scores_match_reference(device, dtype, data, mu):
    """Bit-exact up to float32 (tanh runs in float64 and is rounded back); float64 scores
    keep the two libraries' float64 tanh, which may differ in the last bit."""
    a = data.draw(float_arrays(dtype), label="a")
    d = data.draw(distortions(a.shape[0], dtype), label="D")
    got, want = T.regtopk_scores(to_torch(a, device), to_torch(d, device), mu), R.regtopk_scores(a, d, mu)
    if want.dtype == np.float64:
        np.testing.assert_allclose(to_numpy(got), want, rtol=4 * np.finfo(np.float64).eps, atol=0)
    else:
        assert_same(got, want, "scores")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), mu=mus)
def test_regtopk_select_matches_reference(device, dtype, data, mu):
    a = data.draw(float_arrays(dtype), label="a")
    d = data.draw(distortions(a.shape[0], dtype), label="D")
    k = data.draw(st.integers(1, a.shape[0]), label="k")
    assert_same(
        T.regtopk_select(to_torch(a, device), to_torch(d, device), mu, k), R.regtopk_select(a, d, mu, k)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_regtopk_distortion_matches_reference(device, dtype, data):
    total = data.draw(float_arrays(dtype), label="total")
    numel = total.shape[0]
    indices = data.draw(index_sets(numel), label="indices")
    sent = data.draw(float_arrays(dtype, indices.shape[0], indices.shape[0]), label="sent")
    sent[: sent.shape[0] // 3] = 0  # s_j = 0 carries no information
    with np.errstate(over="ignore"):
        want = R.regtopk_distortion(total, indices, sent, numel)
    got = T.regtopk_distortion(
        to_torch(total, device), to_torch(indices, device), to_torch(sent, device), numel
    )
    assert_same(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_error_feedback_split_matches_reference(device, dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    indices = data.draw(index_sets(a.shape[0]), label="indices")
    values, residual = T.error_feedback_split(to_torch(a, device), to_torch(indices, device))
    want_values, want_residual = R.error_feedback_split(a, indices)
    assert_same(values, want_values, "values")
    assert_same(residual, want_residual, "residual")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), factor=st.sampled_from([1.0, 1.0, 1.37, 3.1e1, 1 + 2**-30]))
def test_terngrad_codes_match_reference_given_the_same_uniforms(device, dtype, data, factor):
    g = data.draw(float_arrays(dtype), label="g")
    scale = float(np.max(np.abs(g))) * factor  # S >= max|g|; S = 0 for a zero gradient
    uniform = np.random.default_rng(g.shape[0]).random(g.shape[0], dtype=np.float32).astype(dtype)
    assert_same(
        T.terngrad_codes(to_torch(g, device), scale, to_torch(uniform, device)),
        R.terngrad_codes(g, scale, uniform),
    )


@pytest.mark.parametrize("device", DEVICES)
@given(numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_pack_ternary_and_wrapping_sum_match_reference(device, numel, world_size, data):
    codes = [data.draw(ternary_codes(numel), label=f"codes[{r}]") for r in range(world_size)]
    lanes_ref = [R.pack_ternary(c, world_size) for c in codes]
    lanes = [T.pack_ternary(to_torch(c, device), world_size) for c in codes]
    for got, want in zip(lanes, lanes_ref):
        assert_same(got, want, "pack_ternary")
    total_ref = R.sum_int32_wrapping(lanes_ref)
    total = T.sum_int32_wrapping(lanes)
    assert_same(total, total_ref, "sum_int32_wrapping")
    unpacked = T.unpack_ternary_sum(total, numel, world_size)
    assert_same(unpacked, R.unpack_ternary_sum(total_ref, numel, world_size), "unpack_ternary_sum")
    assert_same(unpacked, R.sum_codes(codes), "unpack == sum of codes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", range(1, 17))
def test_packed_lanes_that_overflow_int32_when_summed(device, world_size):
    """All codes +1 puts 2N in every field: for N = 1 and 4..7 the lane (N = 1) or
    the lane sum (4..7) passes 2**31 and wraps to a negative int32."""
    numel = 3 * R.ternary_codes_per_lane(world_size) + 1
    codes = np.ones(numel, dtype=np.int8)
    lanes = [T.pack_ternary(to_torch(codes, device), world_size) for _ in range(world_size)]
    total = T.sum_int32_wrapping(lanes)
    unsigned = sum(to_numpy(l).astype(np.int64) & 0xFFFFFFFF for l in lanes)
    wraps = bool(np.any(unsigned >= 2**31))
    assert wraps == (world_size == 1 or 4 <= world_size <= 7)
    assert_same(total, R.sum_int32_wrapping([R.pack_ternary(codes, world_size)] * world_size))
    assert_same(T.unpack_ternary_sum(total, numel, world_size), np.full(numel, world_size, np.int32))


@pytest.mark.parametrize("device", DEVICES)
@given(world_size=world_sizes, numel=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
@example(world_size=16, numel=3, seed=0)
def test_sum_int32_wrapping_of_arbitrary_lanes(device, world_size, numel, seed):
    """Full-range int32 lanes: sums of up to 16 wrap around many times."""
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(world_size)
    ]
    arrays[0][0] = np.iinfo(np.int32).min
    arrays[-1][-1] = np.iinfo(np.int32).max
    want = R.sum_int32_wrapping(arrays)
    assert_same(T.sum_int32_wrapping([to_torch(a, device) for a in arrays]), want)
    exact = np.sum([a.astype(np.int64) for a in arrays], axis=0)
    assert np.array_equal((exact - want.astype(np.int64)) % 2**32, np.zeros(numel))  # the oracle wraps


@pytest.mark.parametrize("device", DEVICES)
@given(numel=st.integers(1, 3000), data=st.data())
def test_two_bit_packing_matches_reference(device, numel, data):
    codes = data.draw(ternary_codes(numel))
    packed = T.pack_two_bit(to_torch(codes, device))
    assert_same(packed, R.pack_two_bit(codes), "pack_two_bit")
    assert_same(T.unpack_two_bit(packed, numel), codes, "unpack_two_bit")
    assert_same(T.unpack_two_bit(packed, numel), R.unpack_two_bit(R.pack_two_bit(codes), numel))


@pytest.mark.parametrize("device", DEVICES)
@given(numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_sum_codes_and_concat_match_reference(device, numel, world_size, data):
    codes = [data.draw(ternary_codes(numel)) for _ in range(world_size)]
    assert_same(T.sum_codes([to_torch(c, device) for c in codes]), R.sum_codes(codes), "sum_codes")
    assert_same(T.concat([to_torch(c, device) for c in codes]), R.concat(codes), "concat int8")
    floats = [c.astype(np.float32) * 0.5 for c in codes]
    assert_same(T.concat([to_torch(f, device) for f in floats]), R.concat(floats), "concat float32")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), world_size=st.integers(1, 8))
def test_dense_sum_matches_reference(device, dtype, data, world_size):
    numel = data.draw(st.integers(1, 3000))
    values = [data.draw(float_arrays(dtype, numel, numel)) for _ in range(world_size)]
    assert_same(T.dense_sum([to_torch(v, device) for v in values]), R.dense_sum(values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), world_size=st.integers(1, 8))
def test_sparse_sum_matches_reference_bit_exactly(device, dtype, data, world_size):
    """Overlapping index sets of up to 8 ranks: float sums in rank order, bit-exact on CPU."""
    numel = data.draw(st.integers(1, 3000))
    indices = [data.draw(index_sets(numel)) for _ in range(world_size)]
    values = [
        data.draw(float_arrays(dtype, i.shape[0], i.shape[0])) if i.shape[0] else np.zeros(0, dtype)
        for i in indices
    ]
    got = T.sparse_sum([to_torch(i, device) for i in indices], [to_torch(v, device) for v in values], numel)
    assert_same(got, R.sparse_sum(indices, values, numel))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS_32_64)
def test_sparse_sum_adds_in_rank_order(device, dtype):
    """1e20 + 1 - 1e20 is 0 in rank order, 1 in any order that adds the 1 last."""
    indices = [np.array([0, 1], np.int32)] * 3
    values = [np.array(v, dtype) for v in ([1e20, 1.0], [1.0, 1e20], [-1e20, -1e20])]
    want = R.sparse_sum(indices, values, 2)
    assert want.tolist() == [0.0, 0.0]
    assert_same(
        T.sparse_sum([to_torch(i, device) for i in indices], [to_torch(v, device) for v in values], 2), want
    )


#: Relative tolerance of the reductions (mean, std): torch reduces in the input dtype
#: (accumulating in double, rounding the result to the dtype), the reference in float64.
REDUCTION_RTOL = {np.float16: 4 * 2.0**-10, np.float32: 8 * 2.0**-23, np.float64: 1e-12}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), p=permille)
def test_gaussiank_threshold_within_float_tolerance(device, dtype, data, p):
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    got, want = T.gaussiank_threshold(to_torch(a, device), ratio), R.gaussiank_threshold(a, ratio)
    assert isinstance(got, float)
    mag = float(np.max(np.abs(a.astype(np.float64))))
    scale = mag * (1 + R.normal_tail_quantile(ratio))  # bounds |mu| + sigma * q
    assert abs(got - want) <= REDUCTION_RTOL[dtype] * scale, (got, want, scale)


def _ambiguous(a: np.ndarray, thr_a: float, thr_b: float) -> np.ndarray:
    """|a_j| lying between the two thresholds at some correction round (0.5x / 1.5x steps)."""
    magnitude = np.abs(a.astype(np.float64))
    hits = np.zeros(a.shape[0], dtype=bool)
    for m in (1.0, 0.5, 1.5, 0.25, 0.75, 2.25):
        with np.errstate(over="ignore"):
            lo, hi = (float(a.dtype.type(min(thr_a, thr_b) * m)), float(a.dtype.type(max(thr_a, thr_b) * m)))
        hits |= (lo <= magnitude) & (magnitude <= hi)
    return np.flatnonzero(hits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), p=permille)
def test_gaussiank_select_follows_the_reference_count_rule(device, dtype, data, p):
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    got = T.gaussiank_select(to_torch(a, device), ratio)
    assert got.dtype == torch.int32
    thr_t, thr_r = T.gaussiank_threshold(to_torch(a, device), ratio), R.gaussiank_threshold(a, ratio)
    # the same rule: the reference started from the torch threshold selects the same set
    with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: thr_t):
        same_rule = R.gaussiank_select(a, ratio)
    assert_same(got, same_rule, "reference from the torch threshold")
    # its own threshold: equal sets unless some |a_j| sits between the two thresholds
    want = R.gaussiank_select(a, ratio)
    ambiguous = _ambiguous(a, thr_t, thr_r)
    note(f"thresholds torch {thr_t!r} reference {thr_r!r}; {ambiguous.shape[0]} entries between")
    if ambiguous.shape[0] == 0:
        assert_same(got, want, "reference")
        assert got.shape[0] == want.shape[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), c=st.sampled_from([2.5, 1.0, 0.1]))
def test_terngrad_clip_within_float_tolerance(device, dtype, data, c):
    g = data.draw(float_arrays(dtype), label="g")
    assume(np.unique(g).shape[0] > 1)  # constant tensors: see the next test
    got, want = T.terngrad_clip(to_torch(g, device), c), R.terngrad_clip(g, c)
    assert got.dtype == torch_dtype(dtype)
    got = to_numpy(got).astype(np.float64)
    bound = c * float(np.std(g, dtype=np.float64))
    # clipping is 1-Lipschitz in the bound: entries differ by at most the bounds' difference
    tol = REDUCTION_RTOL[dtype] * bound + float(np.finfo(dtype).eps) * bound
    assert np.all(np.abs(got - want.astype(np.float64)) <= tol), np.max(np.abs(got - want))
    inside = np.abs(g.astype(np.float64)) < bound * (1 - 2 * REDUCTION_RTOL[dtype])
    assert np.array_equal(got[inside], g[inside].astype(np.float64))  # unclipped entries are untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data())
def test_terngrad_scale_matches_reference(device, dtype, data):
    """``max(-min, max)`` is ``max|g|`` exactly; all-zero gradients (signed zeros too) give +0.0."""
    g = data.draw(float_arrays(dtype), label="g")
    got, want = T.terngrad_scale(to_torch(g, device)), R.terngrad_scale(g)
    assert got == want and np.signbit(got) == np.signbit(want), (got, want)
    zeros = np.where(np.arange(g.shape[0]) % 2 == 0, -0.0, 0.0).astype(dtype)
    assert not np.signbit(T.terngrad_scale(to_torch(zeros, device)))
    g[-1] = np.nan
    assert np.isnan(T.terngrad_scale(to_torch(g, device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["torch", "reference"])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [0.1, -3.0, 7.0])
def test_terngrad_clip_leaves_a_constant_tensor_unchanged(device, impl, dtype, value):
    """Documented by both: ``sigma = 0`` means no clipping (it would erase the tensor).

    A rounded mean (std of a constant computed as a tiny non-zero) breaks it."""
    g = np.full(1000, value, dtype=dtype)
    if impl == "torch":
        got = to_numpy(T.terngrad_clip(to_torch(g, device), 2.5))
    else:
        got = R.terngrad_clip(g, 2.5)
    assert np.array_equal(got, g), (got[:3], g[:3])


# --------------------------------------------------------------------------- #
# 2. Dtypes and devices
# --------------------------------------------------------------------------- #
def _kernel_calls(ops, a, dtype):
    """``{name: output}`` of every kernel on ``a`` (a tensor or array of ``dtype``)."""
    numel = a.shape[0]
    k = max(1, numel // 10)
    idx = ops.topk_select(a, k)
    values, residual = ops.error_feedback_split(a, idx)
    no_info = ops.full(numel, R.NO_DISTORTION, a) if dtype != np.float16 else ops.cast(a, a.dtype) * 0 + 1
    codes = ops.terngrad_codes(a, ops.terngrad_scale(a), ops.uniform(ops.generator(0, 0, a), a))
    lanes = ops.pack_ternary(codes, 3)
    two_bit = ops.pack_two_bit(codes)
    return {
        "topk_indices": ops.topk_indices(a, k),
        "topk_select": idx,
        "error_feedback_split.values": values,
        "error_feedback_split.residual": residual,
        "gaussiank_select": ops.gaussiank_select(a, 0.1),
        "regtopk_scores": ops.regtopk_scores(a, no_info, 5.0),
        "regtopk_select": ops.regtopk_select(a, no_info, 5.0, k),
        "regtopk_distortion": (
            ops.regtopk_distortion(ops.dense_sum([a, a]), idx, values, numel) if dtype != np.float16 else None
        ),
        "terngrad_clip": ops.terngrad_clip(a, 2.5),
        "terngrad_codes": codes,
        "uniform": ops.uniform(ops.generator(0, 0, a), a),
        "zeros_like": ops.zeros_like(a),
        "full": ops.full(numel, 2.0, a),
        "cast": ops.cast(a, ops.float16),
        "pack_ternary": lanes,
        "sum_int32_wrapping": ops.sum_int32_wrapping([lanes, lanes, lanes]),
        "unpack_ternary_sum": ops.unpack_ternary_sum(ops.sum_int32_wrapping([lanes] * 3), numel, 3),
        "pack_two_bit": two_bit,
        "unpack_two_bit": ops.unpack_two_bit(two_bit, numel),
        "sum_codes": ops.sum_codes([codes, codes]),
        "concat": ops.concat([a, a]),
        "dense_sum": ops.dense_sum([a, a]),
        "sparse_sum": ops.sparse_sum([idx, idx], [values, values], numel),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_kernel_outputs_keep_dtype_and_device(device, dtype):
    """Every output has the reference's dtype (input dtype for float results, int32
    indices and lanes, int8 codes, float32+ sums) and stays on the input's device."""
    a = np.random.default_rng(3).standard_normal(1500).astype(dtype)
    want = _kernel_calls(R, a, dtype)
    got = _kernel_calls(T, to_torch(a, device), dtype)
    for name, out in got.items():
        if out is None:
            continue
        assert out.device.type == device, name
        assert out.dtype == torch_dtype(want[name].dtype), (name, out.dtype, want[name].dtype)
    assert got["topk_select"].dtype == torch.int32 and got["gaussiank_select"].dtype == torch.int32
    assert T.generator(0, 0, to_torch(a, device)).device.type == device
    assert isinstance(T.gaussiank_threshold(to_torch(a, device), 0.1), float)
    assert isinstance(T.terngrad_scale(to_torch(a, device)), float)


def test_ops_for_dispatches_torch_tensors_to_torch_ops():
    assert ops_for(torch.zeros(3)) is T
    assert ops_for(np.zeros(3)) is R
    with pytest.raises(TypeError, match="list"):
        ops_for([1.0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compressors_keep_torch_tensors_on_their_device(device, kind, dtype):
    sim = Simulator(3, ALL_COMPRESSORS[kind](), seed=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(6, 50, generator=gen, dtype=dtype).to(device) for _ in range(3)]
        out = sim.step({"w": grads})["w"]
        assert isinstance(out, torch.Tensor)
        assert out.device.type == device and out.dtype == dtype and out.shape == (6, 50)
        for residual in sim.residuals("w"):
            if residual is not None:
                assert residual.device.type == device and residual.dtype == dtype
                assert residual.shape == (6, 50)


# --------------------------------------------------------------------------- #
# 3. Simulator: torch tensors vs numpy arrays
# --------------------------------------------------------------------------- #
def run_both(compressor, grads: np.ndarray, shape=None, device: str = "cpu"):
    """``grads[step][rank]`` through two simulators, one fed numpy, one torch tensors on ``device``."""
    steps, n_ranks = grads.shape[:2]
    shape = shape or grads.shape[2:]
    sim_np, sim_t = Simulator(n_ranks, compressor, seed=3), Simulator(n_ranks, compressor, seed=3)
    outputs = []
    for step in grads:
        out_np = sim_np.step({"w": [g.reshape(shape) for g in step]})["w"]
        out_t = sim_t.step({"w": [to_torch(g.reshape(shape), device) for g in step]})["w"]
        outputs.append((out_t, out_np))
    return sim_t, sim_np, outputs


def assert_simulators_agree(sim_t, sim_np, outputs):
    for step, (out_t, out_np) in enumerate(outputs):
        assert_same(out_t, out_np, f"output of step {step}")
    assert sim_t.bytes_sent_per_rank == sim_np.bytes_sent_per_rank
    for rank, (r_t, r_np) in enumerate(zip(sim_t.residuals("w"), sim_np.residuals("w"))):
        if r_np is None:
            assert r_t is None
        else:
            assert_same(r_t, r_np, f"residual of rank {rank}")
    for c_t, c_np in zip(sim_t.compressors, sim_np.compressors):
        if isinstance(c_np, RegTopK) and c_np.distortion("w") is not None:
            assert_same(c_t.distortion("w"), c_np.distortion("w"), "RegTop-k distortion")


E2E_DENSE = {"none": lambda p: NoneCompressor(), "fp16": lambda p: FP16()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("kind", sorted({**SPARSIFIERS, **E2E_DENSE}))
@given(grads=training_runs(max_steps=6), p=permille)
def test_simulator_on_torch_equals_simulator_on_numpy(device, kind, dtype, grads, p):
    """Small vectors with many ties and zeros, several steps of error feedback."""
    compressor = {**SPARSIFIERS, **E2E_DENSE}[kind](p / 1000)
    assert_simulators_agree(*run_both(compressor, grads.astype(dtype), device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("kind", sorted({**SPARSIFIERS, **E2E_DENSE}))
@given(
    seed=st.integers(0, 2**32 - 1),
    n_ranks=st.integers(1, 4),
    p=st.integers(1, 300),
    numel=st.sampled_from([(40, 50), (3000,), (1500,)]),
)
@settings(phases=[Phase.explicit, Phase.reuse, Phase.generate])  # seeded data: shrinking is moot
def test_simulator_on_torch_equals_numpy_on_large_tensors(device, kind, dtype, seed, n_ranks, p, numel):
    """Gradients of a few thousand entries whose scale drifts, 4 steps (RegTop-k's D in use)."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(numel))
    grads = np.stack([rng.standard_normal((n_ranks, size)) * (1 + step) for step in range(4)])
    compressor = {**SPARSIFIERS, **E2E_DENSE}[kind](p / 1000)
    sim_t, sim_np, outputs = run_both(compressor, grads.astype(dtype), numel, device)
    assert_simulators_agree(sim_t, sim_np, outputs)
    if kind == "regtopk":
        assert any(np.any(d < R.NO_DISTORTION) for d in (c.distortion("w") for c in sim_np.compressors))


@pytest.mark.parametrize(
    "compressor",
    [
        NoneCompressor(),
        FP16(),
        TopK(0.05, dense_below=0),
        GaussianK(0.05, dense_below=0),
        RegTopK(0.05, mu=4.0, dense_below=0),
    ],
    ids=repr,
)
@pytest.mark.parametrize("device", DEVICES)
def test_simulator_on_torch_equals_numpy_for_float16(device, compressor):
    grads = np.random.default_rng(0).standard_normal((3, 4, 700)).astype(np.float16)
    assert_simulators_agree(*run_both(compressor, grads, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "topk"])
def test_average_over_3_ranks_is_bit_exact(device, kind):
    """``Compressor.decode`` and ``BucketExchange`` divide by N as a true division on every device
    (CUDA would multiply by 1/N, off by an ulp for a third of float32 values)."""
    grads = np.random.default_rng(5).standard_normal((2, 3, 1000)).astype(np.float32)
    compressor = {**SPARSIFIERS, **E2E_DENSE}[kind](0.1)
    assert_simulators_agree(*run_both(compressor, grads, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_cast_of_float64_rounds_once(device):
    """float64 -> float16 must round to nearest directly, as numpy does; a detour through
    float32 rounds twice: 1.1967773426534207 lies just below 1.19677734375, the midpoint
    of the float16 neighbours 1.1962890625 and 1.197265625, so it rounds down; float32
    rounds it onto the midpoint, which then goes to the even neighbour, up."""
    x = np.array([1.1967773426534207])
    want = R.cast(x, np.float16)
    assert float(want[0]) == 1.1962890625
    assert_same(T.cast(to_torch(x, device), T.float16), want)


# ----------------------------------------------------------------- TernGrad
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@given(seed=st.integers(0, 2**32 - 1), numel=st.integers(1, 3000), clip=st.sampled_from([None, 2.5]))
def test_terngrad_torch_codes_are_ternary_and_sign_consistent(dtype, seed, numel, clip):
    g = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    g[::7] = 0
    payload = TernGrad(clip=clip, dense_below=0, seed=seed).encode(g, "w")
    codes = payload.codes
    assert isinstance(payload, TernaryPayload)
    assert codes.dtype == torch.int8 and codes.device == g.device and codes.shape == (numel,)
    assert set(torch.unique(codes).tolist()) <= {-1, 0, 1}
    assert bool(torch.all((codes == 0) | (torch.sign(g).to(torch.int8) == codes)))
    assert payload.scale == pytest.approx(float(T.terngrad_scale(T.terngrad_clip(g, clip) if clip else g)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_terngrad_torch_is_unbiased(dtype):
    """Mean of S * t over 4000 draws is within 5 standard errors of g, per entry
    (Var[S t_j] = S |g_j| - g_j^2; entries with zero variance must be exact)."""
    draws = 4000
    g = torch.tensor([0.0, 1e-3, -0.25, 0.5, -0.9, 1.0, -1.0, 0.3, 0.01, -0.6], dtype=dtype)
    compressor = TernGrad(clip=None, dense_below=0, seed=11)
    total = torch.zeros_like(g, dtype=torch.float64)
    for _ in range(draws):
        payload = compressor.encode(g, "w")
        total += payload.scale * payload.codes.to(torch.float64)
    mean = (total / draws).numpy()
    gn = g.numpy().astype(np.float64)
    scale = float(np.max(np.abs(gn)))
    stderr = np.sqrt((scale * np.abs(gn) - gn**2) / draws)
    assert np.all(np.abs(mean - gn) <= 5 * stderr), (mean, gn, stderr)
    # and the stream does move: two encodes differ
    assert not torch.equal(compressor.encode(g, "w").codes, compressor.encode(g, "w").codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scalar_sharing", [True, False])
@pytest.mark.parametrize("n_ranks,numel", [(1, 1000), (2, 999), (3, 1001), (4, 2000), (8, 1000), (16, 333)])
def test_terngrad_torch_decode_is_scale_times_code_sum_over_n(device, n_ranks, numel, scalar_sharing):
    """Both wire formats (packed int32 allreduce, 2-bit allgather) and per-rank scales."""
    gen = torch.Generator().manual_seed(n_ranks * numel)
    grads = [(torch.randn(numel, generator=gen) * (r + 1)).to(device) for r in range(n_ranks)]
    compressors = [
        TernGrad(dense_below=0, scalar_sharing=scalar_sharing, seed=2).bind(r, n_ranks)
        for r in range(n_ranks)
    ]
    shared = max(c.local_scale(g, "w") for c, g in zip(compressors, grads)) if scalar_sharing else None
    payloads = [c.encode(g, "w", scale=shared) for c, g in zip(compressors, grads)]
    out = compressors[0].decode(payloads, (numel,))
    assert out.dtype == torch.float32
    if scalar_sharing:
        code_sum = np.sum([to_numpy(p.codes).astype(np.int32) for p in payloads], axis=0)
        want = (code_sum.astype(np.float32) * np.float32(shared)) / np.float32(n_ranks)
    else:
        scaled = [to_numpy(p.codes).astype(np.float32) * np.float32(p.scale) for p in payloads]
        want = scaled[0]
        for term in scaled[1:]:  # rank order
            want = want + term
        want = want / np.float32(n_ranks)
    assert_same(out, want)  # the same float32 operations in the same order: exact
    sim = Simulator(n_ranks, TernGrad(dense_below=0, scalar_sharing=scalar_sharing, seed=2))
    assert_same(sim.step({"w": grads})["w"], want, "Simulator")


@pytest.mark.parametrize("device", DEVICES)
def test_terngrad_torch_equals_numpy_given_the_same_uniforms(device, monkeypatch):
    """With torch_ops drawing numpy's stream, the whole TernGrad path (scalar sharing,
    error feedback, packing, decode) is bit-exact against numpy."""

    def numpy_stream(seed, rank, like):
        return np.random.default_rng([seed, rank])

    def numpy_uniform(rng, like):
        return to_torch(rng.random(like.shape[0], dtype=np.float32), like.device).to(like.dtype)

    monkeypatch.setattr(T, "generator", numpy_stream)
    monkeypatch.setattr(T, "uniform", numpy_uniform)
    ranks = 5
    grads = np.random.default_rng(4).standard_normal((4, ranks, 1200)).astype(np.float32)
    for compressor in (
        TernGrad(clip=None, dense_below=0),
        TernGrad(clip=None, dense_below=0, error_feedback=True),
        TernGrad(clip=None, dense_below=0, scalar_sharing=False, error_feedback=True),
    ):
        assert_simulators_agree(*run_both(compressor, grads, device=device))


# --------------------------------------------------------------------------- #
# 4. Checkpoints of compressors run on torch
# --------------------------------------------------------------------------- #
N_RANKS = 3


def torch_grads(step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return {
        "conv.weight": [torch.randn(8, 25, generator=gen) * (1 + 0.1 * step) for _ in range(N_RANKS)],
        "fc.bias": [torch.randn(7, generator=gen) for _ in range(N_RANKS)],
    }


def run_torch(sim, steps) -> List[Any]:
    return [sim.step(torch_grads(step)) for step in steps]


def assert_same_runs(got, want):
    for out_got, out_want in zip(got, want, strict=True):
        assert out_got.keys() == out_want.keys()
        for name in out_want:
            assert out_got[name].dtype == out_want[name].dtype
            assert torch.equal(out_got[name], out_want[name]), name


# (the restore-and-continue round trip on torch is tests/test_state.py, framework="torch")


def test_terngrad_torch_generator_is_in_the_checkpoint():
    sim = Simulator(N_RANKS, TernGrad(dense_below=0), seed=5)
    run_torch(sim, range(1, 3))
    state = pickle.loads(pickle.dumps(sim.state_dict()))
    generators = state["ranks"][0]["generators"]
    assert set(generators) == {"hvd_compress.kernels.torch_ops"}
    assert isinstance(generators["hvd_compress.kernels.torch_ops"], torch.Tensor)
    expected = run_torch(sim, [3])

    restored = Simulator(N_RANKS, TernGrad(dense_below=0), seed=5)
    fresh = run_torch(Simulator(N_RANKS, TernGrad(dense_below=0), seed=5), [3])
    restored.load_state_dict(state)
    assert_same_runs(run_torch(restored, [3]), expected)
    # guard: without the restored stream the same step differs
    assert not torch.equal(fresh[0]["conv.weight"], expected[0]["conv.weight"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@given(data=st.data(), mu=mus)
def test_regtopk_select_sparse_matches_reference(device, dtype, data, mu):
    a = data.draw(float_arrays(dtype), label="a")
    numel = a.shape[0]
    idx = data.draw(index_sets(numel), label="idx")
    values = data.draw(float_arrays(np.float32, idx.shape[0], idx.shape[0]), label="D at idx")
    k = data.draw(st.integers(1, numel), label="k")
    assert_same(
        T.regtopk_select_sparse(to_torch(a, device), to_torch(idx, device), to_torch(values, device), mu, k),
        R.regtopk_select_sparse(a, idx, values, mu, k),
    )
