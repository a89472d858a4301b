"""The TensorFlow kernels against the numpy oracle (``compressors.reference``).

Every function of :mod:`hvd_compress.kernels.tf_ops` that shares a name with the
reference gets the same inputs and must give the same result, executed eagerly
and traced by ``tf.function`` (without autograph, so Python branching on a tensor
value fails the trace):

* bit-exact (same dtype, every value and sign of zero): Top-k and RegTop-k
  selection, the RegTop-k scores (up to float32) and distortion, the
  error-feedback split, TernGrad's codes given the same uniforms, the ternary and
  2-bit packings, the int32 sums, ``concat``, ``dense_sum``, ``sparse_sum`` and the
  float64 -> float16 cast;
* within a stated tolerance: the reductions (Gaussian-k's threshold, TernGrad's
  clipping bound), in at least float32 in TF and in float64 in the reference;
* Gaussian-k: the same count rule, checked exactly by handing the reference the TF
  threshold; with its own threshold the set must be equal unless an |a_j| lies
  between the two thresholds at some correction round.

Then the compressor classes fed TF tensors (eagerly) against the same classes fed
numpy arrays: payloads, residuals and decoded aggregates over several steps.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import assume, example, given, note, settings
from hypothesis import strategies as st

from tests.distributed.launch import require

require("tensorflow")

import tensorflow as tf  # noqa: E402

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK  # noqa: E402
from hvd_compress import kernels  # noqa: E402
from hvd_compress.kernels import reference as R  # noqa: E402
from hvd_compress.wire import DensePayload, SparsePayload, TernaryPayload  # noqa: E402
from hvd_compress.kernels import tf_ops as F  # noqa: E402

from tests.helpers import (  # noqa: E402
    distortions,
    exact_k,
    float_arrays,
    index_sets,
    permille,
    ternary_codes,
)

FLOATS = [np.float16, np.float32, np.float64]
FLOATS_32_64 = [np.float32, np.float64]

#: Every case is traced into a graph too (a trace costs tens of milliseconds): keep the
#: example counts modest, fewer per dtype where a test runs for three.
few = settings(max_examples=6)
some = settings(max_examples=15)

#: Magnitudes that repeat (ties), signed zeros included.


# --------------------------------------------------------------------------- #
# Conversions, comparisons, eager and graph
# --------------------------------------------------------------------------- #
def to_tf(a: np.ndarray) -> tf.Tensor:
    return tf.constant(np.array(a, copy=True))


def assert_same(got, want: np.ndarray, what: str = "") -> None:
    """TF result == reference result: dtype, every value and sign of zero (NaN == NaN)."""
    assert tf.is_tensor(got), (what, type(got))
    assert got.dtype == tf.as_dtype(want.dtype), (what, got.dtype, want.dtype)
    got = got.numpy()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    same = np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
    if want.dtype.kind == "f":  # -0.0 and 0.0 compare equal: their sign bits must too
        same = same and np.array_equal(np.signbit(got), np.signbit(want))
    assert same, (what, np.flatnonzero(got != want)[:10], got[got != want][:10], want[got != want][:10])


def eager_and_graph(fn, *args):
    """``fn(*args)`` executed eagerly, and traced by ``tf.function`` for the args' static shapes."""
    return {"eager": fn(*args), "graph": tf.function(fn, autograph=False)(*args)}


def check(fn, args, want, what: str = "") -> None:
    """Both runs of ``fn`` equal ``want``: an array, or a dict, tuple or list of them
    (one ``fn`` checking many kernels keeps it to one trace per example)."""
    for mode, got in eager_and_graph(fn, *args).items():
        assert_nest_same(got, want, f"{what} ({mode})")


def assert_nest_same(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), what
        for key in want:
            assert_nest_same(got[key], want[key], f"{what} {key}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_nest_same(g, w, f"{what}[{i}]")
    else:
        assert_same(got, want, what)


# --------------------------------------------------------------------------- #
# Strategies (arrays drawn from a seed: fast)
# --------------------------------------------------------------------------- #
mus = st.sampled_from([4.0, 5.0, 0.7, 4.3, 37.5])
world_sizes = st.integers(1, 16)


# --------------------------------------------------------------------------- #
# 1. Kernels vs the reference
# --------------------------------------------------------------------------- #
def test_every_reference_function_has_a_tf_twin():
    functions = [
        name
        for name, f in vars(R).items()
        if inspect.isfunction(f) and f.__module__ == R.__name__ and not name.startswith("_")
    ]
    assert sorted(n for n in functions if not callable(getattr(F, n, None))) == []


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data())
def test_array_utilities_match_reference(dtype, data):
    a = data.draw(float_arrays(dtype, max_size=300), label="a")
    a[: data.draw(st.integers(0, 3))] = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    t = to_tf(a)
    assert F.is_floating(t) is R.is_floating(a) is True
    ints = np.arange(3, dtype=np.int32)
    assert F.is_floating(to_tf(ints)) is R.is_floating(ints) is False
    assert F.itemsize(t) == R.itemsize(a)
    assert F.count_nonfinite(t) == R.count_nonfinite(a) and isinstance(F.count_nonfinite(t), int)
    assert int(tf.function(F.count_nonfinite, autograph=False)(t)) == R.count_nonfinite(a)
    cut = data.draw(st.integers(0, a.shape[0]))
    sizes = [cut, a.shape[0] - cut]

    def utilities(ops, x):
        return {
            "zeros_like": ops.zeros_like(x),
            "full": ops.full(a.shape[0], 2.5, x),
            "full float16": ops.full(3, 0.1, x, ops.float16),
            **{f"cast to {d.__name__}": ops.cast(x, d) for d in FLOATS},
            "as_int64": ops.as_int64([3, -1, 2**40], x),
            "as_float32": ops.as_float32([0.1, 1e30], x),
            "reshape": ops.reshape(x, (1, -1)),
            "split": ops.split(x, sizes),
        }

    check(lambda x: utilities(F, x), [t], utilities(R, a))
    assert F.to_list(F.as_int64([1, 2], t)) == R.to_list(R.as_int64([1, 2], a)) == [1, 2]


def test_fp16_cast_of_float64_rounds_once():
    """1.1967773426534207 lies just below the midpoint of two float16 neighbours; via
    float32 (``tf.cast``) it rounds onto the midpoint, then to the even neighbour, up."""
    x = np.array([1.1967773426534207, -1.1967773426534207, 7e4, 1e-40, -1e-40, 2.0**-25 * 1.5])
    want = R.cast(x, np.float16)
    assert float(want[0]) == 1.1962890625
    assert tf.cast(to_tf(x), tf.float16).numpy()[0] != want[0]  # what this guards against
    check(lambda t: F.cast(t, F.float16), [to_tf(x)], want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_tf_random_stream_is_per_rank_uniform_and_restorable(dtype):
    like = tf.zeros(5000, dtype=tf.as_dtype(dtype))
    draws = [F.uniform(F.generator(7, rank, like), like) for rank in (0, 0, 1)]
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])
    assert draws[0].dtype == like.dtype
    assert float(tf.reduce_min(draws[0])) >= 0 and float(tf.reduce_max(draws[0])) <= 1  # float16 may round up
    assert abs(float(tf.reduce_mean(tf.cast(draws[0], tf.float64))) - 0.5) < 5 * (1 / 12 / 5000) ** 0.5
    rng = F.generator(7, 0, like)
    state = F.generator_state(rng)
    assert isinstance(state, np.ndarray)
    first = F.uniform(rng, like)
    F.set_generator_state(rng, pickle.loads(pickle.dumps(state)))
    assert np.array_equal(F.uniform(rng, like), first)


def test_tf_random_stream_in_a_graph():
    """A stream created eagerly, or once on a function's first trace (as
    ``Compressor.generator`` caches it), draws inside ``tf.function`` and continues."""
    like = tf.zeros(100)
    eager = F.generator(3, 1, like)
    want = [F.uniform(eager, like) for _ in range(2)]
    cache = {}

    @tf.function(autograph=False)
    def draw(x):
        if "rng" not in cache:
            cache["rng"] = F.generator(3, 1, x)
        rng = cache["rng"]
        state = F.generator_state(rng)
        return F.uniform(rng, x), state

    for step in range(2):
        got, state = draw(like)
        assert np.array_equal(got, want[step]) and tf.is_tensor(state)
    graph_stream = tf.random.Generator.from_seed(0, alg="philox")
    tf.function(lambda: F.set_generator_state(graph_stream, F.generator_state(eager)), autograph=False)()
    assert np.array_equal(F.uniform(graph_stream, like), F.uniform(eager, like))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data())
def test_topk_matches_reference_with_ties(dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    k = data.draw(st.integers(1, a.shape[0] + 2), label="k")  # k > numel clamps
    # signed scores: topk_indices ranks values, not magnitudes
    check(
        lambda t: (F.topk_select(t, k), F.topk_indices(t, k)),
        [to_tf(a)],
        (R.topk_select(a, k), R.topk_indices(a, k)),
    )


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@few
@given(data=st.data(), p=permille)
def test_topk_all_equal_magnitudes_take_the_lowest_indices(dtype, data, p):
    numel = data.draw(st.integers(1, 3000))
    signs = np.random.default_rng(numel).choice([-1.0, 1.0], numel).astype(dtype)
    k = exact_k(p, numel)
    want = R.topk_select(signs, k)
    assert np.array_equal(want, np.arange(k))
    check(lambda t: F.topk_select(t, k), [to_tf(signs)], want)


def test_kernels_take_variables():
    a = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    v = tf.Variable(a)
    assert kernels.ops_for(v) is F
    idx = R.topk_select(a, 20)
    assert_same(F.topk_select(v, 20), idx)
    values, residual = F.error_feedback_split(v, to_tf(idx), in_place=True)
    want_values, want_residual = R.error_feedback_split(a, idx)
    assert_same(values, want_values)
    assert_same(residual, want_residual)
    assert np.array_equal(v.numpy(), a)  # in_place is ignored: the variable is untouched
    assert F.count_nonfinite(v) == 0 and F.terngrad_scale(v) == R.terngrad_scale(a)
    check(lambda x: F.gaussiank_select(x, 0.05), [v], R.gaussiank_select(a, 0.05))
    payload = TopK(0.04, dense_below=0).encode(v, "v")
    assert_same(payload.indices, idx)
    assert_same(payload.values, want_values)


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), mu=mus)
def test_regtopk_scores_match_reference(dtype, data, mu):
    """Bit-exact up to float32 (tanh runs in float64 and is rounded back); float64 scores
    keep the two libraries' float64 tanh, which may differ in the last bits."""
    a = data.draw(float_arrays(dtype), label="a")
    d = data.draw(distortions(a.shape[0], dtype), label="D")
    want = R.regtopk_scores(a, d, mu)
    if want.dtype != np.float64:
        check(lambda x, y: F.regtopk_scores(x, y, mu), [to_tf(a), to_tf(d)], want)
        return
    for mode, got in eager_and_graph(lambda x, y: F.regtopk_scores(x, y, mu), to_tf(a), to_tf(d)).items():
        assert got.dtype == tf.float64, mode
        np.testing.assert_allclose(got.numpy(), want, rtol=4 * np.finfo(np.float64).eps, atol=0, err_msg=mode)


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), mu=mus)
def test_regtopk_select_matches_reference(dtype, data, mu):
    a = data.draw(float_arrays(dtype), label="a")
    d = data.draw(distortions(a.shape[0], dtype), label="D")
    k = data.draw(st.integers(1, a.shape[0]), label="k")
    check(lambda x, y: F.regtopk_select(x, y, mu, k), [to_tf(a), to_tf(d)], R.regtopk_select(a, d, mu, k))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), mu=mus)
def test_regtopk_select_sparse_matches_reference(dtype, data, mu):
    a = data.draw(float_arrays(dtype), label="a")
    idx = data.draw(index_sets(a.shape[0]), label="idx")
    values = data.draw(float_arrays(np.float32, idx.shape[0], idx.shape[0]), label="D at idx")
    k = data.draw(st.integers(1, a.shape[0]), label="k")
    check(
        lambda x, i, v: F.regtopk_select_sparse(x, i, v, mu, k),
        [to_tf(a), to_tf(idx), to_tf(values)],
        R.regtopk_select_sparse(a, idx, values, mu, k),
    )


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data())
def test_regtopk_posterior_and_distortion_match_reference(dtype, data):
    total = data.draw(float_arrays(dtype), label="total")
    numel = total.shape[0]
    indices = data.draw(index_sets(numel), label="indices")
    sent = data.draw(float_arrays(dtype, indices.shape[0], indices.shape[0]), label="sent")
    sent[: sent.shape[0] // 3] = 0  # s_j = 0 carries no information
    args = [to_tf(total), to_tf(indices), to_tf(sent)]
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        posterior = R.regtopk_posterior(total, indices, sent)
        distortion = R.regtopk_distortion(total, indices, sent, numel)

    def kernels_of(*x):
        idx, values = F.regtopk_posterior(*x)
        return idx, values, F.regtopk_distortion(*x, numel), F.regtopk_expand(idx, values, numel)

    check(kernels_of, args, (*posterior, distortion, distortion))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data())
def test_error_feedback_split_matches_reference(dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    indices = data.draw(index_sets(a.shape[0]), label="indices")
    check(F.error_feedback_split, [to_tf(a), to_tf(indices)], R.error_feedback_split(a, indices))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), factor=st.sampled_from([1.0, 1.0, 1.37, 3.1e1, 1 + 2**-30]))
def test_terngrad_codes_match_reference_given_the_same_uniforms(dtype, data, factor):
    """The scale as a Python float (eager callers) and as a tensor of ``g``'s dtype (graph)."""
    g = data.draw(float_arrays(dtype), label="g")
    scale = float(np.max(np.abs(g))) * factor  # S >= max|g|; S = 0 for a zero gradient
    uniform = np.random.default_rng(g.shape[0]).random(g.shape[0], dtype=np.float32).astype(dtype)
    check(
        lambda x, u: (F.terngrad_codes(x, scale, u), F.terngrad_codes(x, F.terngrad_scale(x), u)),
        [to_tf(g), to_tf(uniform)],
        (R.terngrad_codes(g, scale, uniform), R.terngrad_codes(g, R.terngrad_scale(g), uniform)),
    )


@some
@given(numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_pack_ternary_and_wrapping_sum_match_reference(numel, world_size, data):
    codes = [data.draw(ternary_codes(numel), label=f"codes[{r}]") for r in range(world_size)]
    lanes = [R.pack_ternary(c, world_size) for c in codes]
    total = R.sum_int32_wrapping(lanes)

    def kernels_of(cs):
        packed = [F.pack_ternary(c, world_size) for c in cs]
        summed = F.sum_int32_wrapping(packed)
        return packed, summed, F.unpack_ternary_sum(summed, numel, world_size)

    want = (lanes, total, R.unpack_ternary_sum(total, numel, world_size))
    assert np.array_equal(want[-1], R.sum_codes(codes))
    check(kernels_of, [[to_tf(c) for c in codes]], want)


@pytest.mark.parametrize("world_size", [1, 2, 4, 7, 8, 16])
def test_packed_lanes_that_overflow_int32_when_summed(world_size):
    """All codes +1 puts 2N in every field: for N = 1 and 4..7 the lane (N = 1) or
    the lane sum (4..7) passes 2**31 and wraps to a negative int32."""
    numel = 3 * R.ternary_codes_per_lane(world_size) + 1
    codes = np.ones(numel, dtype=np.int8)
    lanes = R.pack_ternary(codes, world_size)
    wraps = bool(np.any(lanes.view(np.uint32).astype(np.int64) * world_size >= 2**31))
    assert wraps == (world_size == 1 or 4 <= world_size <= 7)

    def kernels_of(c):
        summed = F.sum_int32_wrapping([F.pack_ternary(c, world_size)] * world_size)
        return summed, F.unpack_ternary_sum(summed, numel, world_size)

    want = (R.sum_int32_wrapping([lanes] * world_size), np.full(numel, world_size, np.int32))
    check(kernels_of, [to_tf(codes)], want)


@some
@given(world_size=world_sizes, numel=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
@example(world_size=16, numel=3, seed=0)
def test_sum_int32_wrapping_of_arbitrary_lanes(world_size, numel, seed):
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(world_size)
    ]
    arrays[0][0] = np.iinfo(np.int32).min
    arrays[-1][-1] = np.iinfo(np.int32).max
    check(F.sum_int32_wrapping, [[to_tf(a) for a in arrays]], R.sum_int32_wrapping(arrays))


@some
@given(numel=st.integers(1, 3000), data=st.data())
def test_two_bit_packing_matches_reference(numel, data):
    codes = data.draw(ternary_codes(numel))
    packed = R.pack_two_bit(codes)
    check(
        lambda c: (F.pack_two_bit(c), F.unpack_two_bit(F.pack_two_bit(c), numel)),
        [to_tf(codes)],
        (packed, codes),
    )


@some
@given(numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_sum_codes_concat_and_maximum_match_reference(numel, world_size, data):
    codes = [data.draw(ternary_codes(numel)) for _ in range(world_size)]
    floats = [c.astype(np.float32) * 0.5 for c in codes]

    def kernels_of(ops, cs, fs):
        return {
            "sum_codes": ops.sum_codes(cs),
            "concat int8": ops.concat(cs),
            "concat float32": ops.concat(fs),
            "maximum": ops.maximum(fs[0], fs[-1]),
        }

    tf_args = [[to_tf(c) for c in codes], [to_tf(f) for f in floats]]
    check(lambda cs, fs: kernels_of(F, cs, fs), tf_args, kernels_of(R, codes, floats))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), world_size=st.integers(1, 8))
def test_dense_sum_matches_reference(dtype, data, world_size):
    numel = data.draw(st.integers(1, 3000))
    values = [data.draw(float_arrays(dtype, numel, numel)) for _ in range(world_size)]
    check(F.dense_sum, [[to_tf(v) for v in values]], R.dense_sum(values))


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), world_size=st.integers(1, 8))
def test_sparse_sum_matches_reference_bit_exactly(dtype, data, world_size):
    """Overlapping index sets of up to 8 ranks: float sums in rank order."""
    numel = data.draw(st.integers(1, 3000))
    indices = [data.draw(index_sets(numel)) for _ in range(world_size)]
    values = [
        data.draw(float_arrays(dtype, i.shape[0], i.shape[0])) if i.shape[0] else np.zeros(0, dtype)
        for i in indices
    ]
    check(
        lambda i, v: F.sparse_sum(i, v, numel),
        [[to_tf(i) for i in indices], [to_tf(v) for v in values]],
        R.sparse_sum(indices, values, numel),
    )


@pytest.mark.parametrize("dtype", FLOATS_32_64)
def test_sparse_sum_adds_in_rank_order(dtype):
    """1e20 + 1 - 1e20 is 0 in rank order, 1 in any order that adds the 1 last."""
    indices = [np.array([0, 1], np.int32)] * 3
    values = [np.array(v, dtype) for v in ([1e20, 1.0], [1.0, 1e20], [-1e20, -1e20])]
    want = R.sparse_sum(indices, values, 2)
    assert want.tolist() == [0.0, 0.0]
    check(lambda i, v: F.sparse_sum(i, v, 2), [[to_tf(i) for i in indices], [to_tf(v) for v in values]], want)


#: Relative tolerance of the reductions (mean, std): TF reduces in float32 (float16
#: inputs too) or float64, the reference in float64.
REDUCTION_RTOL = {np.float16: 8 * 2.0**-23, np.float32: 8 * 2.0**-23, np.float64: 1e-12}


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), p=permille)
def test_gaussiank_threshold_within_float_tolerance(dtype, data, p):
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    runs = eager_and_graph(lambda t: F.gaussiank_threshold(t, ratio), to_tf(a))
    assert isinstance(runs["eager"], float) and runs["graph"].dtype == tf.float64
    want = R.gaussiank_threshold(a, ratio)
    scale = float(np.max(np.abs(a.astype(np.float64)))) * (1 + R.normal_tail_quantile(ratio))
    for got in runs.values():
        assert abs(float(got) - want) <= REDUCTION_RTOL[dtype] * scale, (got, want, scale)


def _ambiguous(a: np.ndarray, thr_a: float, thr_b: float) -> np.ndarray:
    """|a_j| lying between the two thresholds at some correction round (0.5x / 1.5x steps)."""
    magnitude = np.abs(a.astype(np.float64))
    hits = np.zeros(a.shape[0], dtype=bool)
    for m in (1.0, 0.5, 1.5, 0.25, 0.75, 2.25):
        with np.errstate(over="ignore"):
            lo, hi = (float(a.dtype.type(min(thr_a, thr_b) * m)), float(a.dtype.type(max(thr_a, thr_b) * m)))
        hits |= (lo <= magnitude) & (magnitude <= hi)
    return np.flatnonzero(hits)


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), p=permille)
def test_gaussiank_select_follows_the_reference_count_rule(dtype, data, p):
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    thr_tf, thr_ref = F.gaussiank_threshold(to_tf(a), ratio), R.gaussiank_threshold(a, ratio)
    # the same rule: the reference started from the TF threshold selects the same set
    with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: thr_tf):
        same_rule = R.gaussiank_select(a, ratio)
    check(lambda t: F.gaussiank_select(t, ratio), [to_tf(a)], same_rule, "reference from the TF threshold")
    # its own threshold: equal sets unless some |a_j| sits between the two thresholds
    ambiguous = _ambiguous(a, thr_tf, thr_ref)
    note(f"thresholds TF {thr_tf!r} reference {thr_ref!r}; {ambiguous.shape[0]} entries between")
    if ambiguous.shape[0] == 0:
        assert np.array_equal(same_rule, R.gaussiank_select(a, ratio))


def test_gaussiank_trims_an_overshooting_superset():
    """12 -> 398 -> 102 entries for k = 20 (reference docstring): the smallest superset
    is cut to its k largest; the graph takes the same branch."""
    a = np.random.default_rng(0).standard_normal(2000)
    ratio = 0.01
    k = R.num_selected(a.shape[0], ratio)
    thr = 3.1  # ~4 entries above: 0.5x then 1.5x steps overshoot back and forth
    with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: thr):
        want = R.gaussiank_select(a, ratio)
    counts = [int(np.sum(np.abs(a) > thr * m)) for m in (1.0, 0.5, 0.75)]
    assert counts[0] < 2 * k / 3 and min(counts[1:]) > 4 * k / 3, counts  # the trim is taken
    assert want.shape[0] == k
    with mock.patch.object(F, "_threshold", lambda _a, _r: tf.constant(thr, tf.float64)):
        check(lambda t: F.gaussiank_select(t, ratio), [to_tf(a)], want)


@pytest.mark.parametrize("dtype", FLOATS)
@few
@given(data=st.data(), c=st.sampled_from([2.5, 1.0, 0.1]))
def test_terngrad_clip_within_float_tolerance(dtype, data, c):
    g = data.draw(float_arrays(dtype), label="g")
    assume(np.unique(g).shape[0] > 1)  # constant tensors: see the next test
    want = R.terngrad_clip(g, c).astype(np.float64)
    bound = c * float(np.std(g, dtype=np.float64))
    tol = REDUCTION_RTOL[dtype] * bound + float(np.finfo(dtype).eps) * bound
    inside = np.abs(g.astype(np.float64)) < bound * (
        1 - 2 * REDUCTION_RTOL[dtype] - float(np.finfo(dtype).eps)
    )
    for mode, got in eager_and_graph(lambda t: F.terngrad_clip(t, c), to_tf(g)).items():
        assert got.dtype == tf.as_dtype(dtype), mode
        got = got.numpy().astype(np.float64)
        assert np.all(np.abs(got - want) <= tol), (mode, np.max(np.abs(got - want)))
        assert np.array_equal(got[inside], g[inside].astype(np.float64)), mode  # unclipped entries untouched


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value", [0.1, -3.0, 7.0])
def test_terngrad_clip_leaves_a_constant_tensor_unchanged(dtype, value):
    g = np.full(1000, value, dtype=dtype)
    check(lambda t: F.terngrad_clip(t, 2.5), [to_tf(g)], g)
    assert F.terngrad_scale(to_tf(g)) == R.terngrad_scale(g) == abs(float(g[0]))


# --------------------------------------------------------------------------- #
# 2. Dtypes, devices, dispatch
# --------------------------------------------------------------------------- #
def _kernel_calls(ops, a, dtype):
    """``{name: output}`` of every kernel on ``a`` (a tensor or array of ``dtype``)."""
    numel = a.shape[0]
    k = max(1, numel // 10)
    idx = ops.topk_select(a, k)
    values, residual = ops.error_feedback_split(a, idx)
    no_info = ops.full(numel, R.NO_DISTORTION, a, ops.accumulation_dtype(a.dtype))
    codes = ops.terngrad_codes(a, ops.terngrad_scale(a), ops.cast(ops.zeros_like(a), a.dtype))
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
        "regtopk_distortion": ops.regtopk_distortion(ops.dense_sum([a, a]), idx, values, numel),
        "terngrad_clip": ops.terngrad_clip(a, 2.5),
        "terngrad_codes": codes,
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


@pytest.mark.parametrize("dtype", FLOATS)
def test_kernel_outputs_keep_dtype_and_device(dtype):
    """Every output has the reference's dtype (input dtype for float results, int32 indices
    and lanes, int8 codes, float32+ sums) and sits on the input's device; in a graph too."""
    a = np.random.default_rng(3).standard_normal(1500).astype(dtype)
    want = _kernel_calls(R, a, dtype)
    t = to_tf(a)
    for mode, got in eager_and_graph(lambda x: _kernel_calls(F, x, dtype), t).items():
        assert got.keys() == want.keys()
        for name, out in got.items():
            assert out.dtype == tf.as_dtype(want[name].dtype), (mode, name, out.dtype, want[name].dtype)
            assert out.device == t.device, (mode, name, out.device)
    assert isinstance(F.gaussiank_threshold(t, 0.1), float) and isinstance(F.terngrad_scale(t), float)
    assert F.generator(0, 0, t).state.device == t.device
    assert F.index_dtype(2**31 - 1) == tf.int32 and F.index_dtype(2**31) == tf.int64


def test_ops_for_dispatches_tf_tensors_and_variables_to_tf_ops():
    assert kernels.ops_for(tf.zeros(3)) is F
    assert kernels.ops_for(tf.Variable(tf.zeros(3))) is F
    assert kernels.ops_for(np.zeros(3)) is R
    assert kernels.module(F.__name__) is F
    with pytest.raises(TypeError, match="TensorFlow tensor"):
        kernels.ops_for([1.0])


def test_importing_hvd_compress_does_not_import_tensorflow():
    code = "import sys, hvd_compress, hvd_compress.kernels; print('tensorflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# --------------------------------------------------------------------------- #
# 3. Compressors fed TF tensors vs numpy arrays (eager)
# --------------------------------------------------------------------------- #
FACTORIES = {
    "topk": lambda: TopK(0.05, dense_below=100, dense_when_cheaper=False),
    "gaussiank": lambda: GaussianK(0.05, dense_below=100, dense_when_cheaper=False),
    "regtopk": lambda: RegTopK(0.05, mu=4.0, dense_below=100, dense_when_cheaper=False),
    "regtopk_no_ef": lambda: RegTopK(0.05, error_feedback=False, dense_below=100, dense_when_cheaper=False),
    "terngrad": lambda: TernGrad(clip=None, dense_below=100),
    "terngrad_ef": lambda: TernGrad(clip=None, dense_below=100, error_feedback=True),
    "terngrad_ef_noshare": lambda: TernGrad(
        clip=None, dense_below=100, error_feedback=True, scalar_sharing=False
    ),
    "none": lambda: NoneCompressor(),
    "fp16": lambda: FP16(),
}

SHAPES = {"w": (30, 50), "b": (7,)}


@pytest.fixture
def numpy_draws(monkeypatch):
    """tf_ops drawing numpy's stream (``default_rng([seed, rank])``): TernGrad then sees the
    reference's uniforms, so the whole path is bit-exact."""
    monkeypatch.setattr(F, "generator", lambda seed, rank, like: np.random.default_rng([seed, rank]))
    monkeypatch.setattr(
        F, "uniform", lambda rng, like: tf.cast(rng.random(like.shape[0], dtype=np.float32), like.dtype)
    )


def run_ranks(make, grads, convert):
    """``grads[step][name][rank]`` through one compressor per rank, as the Simulator does:
    shared TernGrad scales, encode, every rank decodes (and learns) from all payloads."""
    n_ranks = len(grads[0]["w"])
    compressors = [make().bind(rank, n_ranks) for rank in range(n_ranks)]
    steps = []
    for step in grads:
        record = {}
        for name, per_rank in step.items():
            tensors = [convert(g) for g in per_rank]
            scale = None
            if isinstance(compressors[0], TernGrad) and compressors[0].scalar_sharing:
                local = [c.local_scale(t, name) for c, t in zip(compressors, tensors)]
                scale = None if local[0] is None else max(local)
            options = {} if scale is None else {"scale": scale}
            payloads = [c.encode(t, name, **options) for c, t in zip(compressors, tensors)]
            decoded = [c.decode(payloads, per_rank[0].shape, name=name) for c in compressors]
            record[name] = (payloads, decoded, [c.residual(name) for c in compressors])
        steps.append(record)
    return compressors, steps


def assert_payloads_equal(got, want, what):
    assert type(got) is type(want), what
    if isinstance(want, TernaryPayload):
        assert_same(got.codes, want.codes, f"{what} codes")
        assert (got.scale, got.world_size, got.shared_scale) == (
            want.scale,
            want.world_size,
            want.shared_scale,
        )
    else:
        assert_same(got.values, want.values, f"{what} values")
    if isinstance(want, SparsePayload):
        assert_same(got.indices, want.indices, f"{what} indices")
        assert got.numel == want.numel, what
    if isinstance(want, (DensePayload, TernaryPayload)):
        assert tf.as_dtype(got.dtype) == tf.as_dtype(want.dtype), what
    assert got.nbytes == want.nbytes, what


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_compressors_on_tf_equal_compressors_on_numpy(kind, dtype, numpy_draws):
    """Three ranks, four steps whose gradient scale drifts (RegTop-k's D in use, residuals
    carried): payloads, decoded averages and residuals are bit-identical. TernGrad runs
    unclipped here: the clipping bound is a reduction, equal within rounding only
    (:func:`test_terngrad_clip_within_float_tolerance`)."""
    rng = np.random.default_rng(5)
    grads = [
        {
            name: [(rng.standard_normal(shape) * (1 + step)).astype(dtype) for _ in range(3)]
            for name, shape in SHAPES.items()
        }
        for step in range(4)
    ]
    compressors_tf, run_tf = run_ranks(FACTORIES[kind], grads, to_tf)
    compressors_np, run_np = run_ranks(FACTORIES[kind], grads, lambda g: g)
    for step, (got, want) in enumerate(zip(run_tf, run_np)):
        for name in SHAPES:
            for rank in range(3):
                what = f"step {step} {name} rank {rank}"
                assert_payloads_equal(got[name][0][rank], want[name][0][rank], what)
                assert_same(got[name][1][rank], want[name][1][rank], f"{what} decoded")
                if want[name][2][rank] is None:
                    assert got[name][2][rank] is None, what
                else:
                    assert_same(got[name][2][rank], want[name][2][rank], f"{what} residual")
    for c_tf, c_np in zip(compressors_tf, compressors_np):
        assert c_tf.stats == c_np.stats
        if isinstance(c_np, RegTopK) and c_np.distortion("w") is not None:
            assert np.any(c_np.distortion("w") < R.NO_DISTORTION)
            assert_same(c_tf.distortion("w"), c_np.distortion("w"), "RegTop-k distortion")


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_compressors_reject_integer_and_nonfinite_tf_tensors(kind):
    compressor = FACTORIES[kind]()
    with pytest.raises(TypeError, match="floating point"):
        compressor.encode(tf.ones((30, 50), tf.int32), "w")
    bad = np.ones((30, 50), np.float32)
    bad[3, 4], bad[0, 0] = np.nan, np.inf
    with pytest.raises(ValueError, match="has 2 NaN/Inf of 1500"):
        compressor.encode(to_tf(bad), "w")
    if kind == "fp16":
        with pytest.raises(ValueError, match="float16 range"):
            compressor.encode(to_tf(np.full(5, 7e4, np.float32)), "w")


def test_terngrad_tf_stream_is_in_the_checkpoint():
    """TernGrad on TF draws from tf_ops' generator; its state goes into state_dict (numpy)
    and a restored compressor continues the stream exactly."""
    g = to_tf(np.random.default_rng(0).standard_normal(2000).astype(np.float32))
    compressor = TernGrad(dense_below=0, seed=5)
    first = compressor.encode(g, "w")
    assert set(np.unique(first.codes.numpy())) <= {-1, 0, 1} and first.codes.dtype == tf.int8
    assert np.all((first.codes.numpy() == 0) | (first.codes.numpy() == np.sign(g.numpy())))
    state = pickle.loads(pickle.dumps(compressor.state_dict()))
    assert set(state["generators"]) == {F.__name__}
    assert isinstance(state["generators"][F.__name__], np.ndarray)
    expected = compressor.encode(g, "w").codes
    restored = TernGrad(dense_below=0, seed=5)
    restored.load_state_dict(state)
    assert_same(restored.encode(g, "w").codes, expected.numpy())
    assert not np.array_equal(TernGrad(dense_below=0, seed=5).encode(g, "w").codes, expected)
