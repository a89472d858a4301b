"""The framework kernels against the numpy oracle (``kernels.reference``), once for every
kernel module: torch on CPU and on CUDA, TensorFlow eagerly and traced (``frameworks.py``).

Every function of the kernel module that shares a name with the reference gets the same
inputs and must give the same result:

* bit-exact (same dtype, every value and sign of zero): Top-k selection, the RegTop-k scores
  (up to float32) and the dense posterior, the error-feedback split, TernGrad's codes given the
  same uniforms, the ternary and 2-bit packings, the int32 sums, ``concat``, ``maximum``,
  ``dense_sum`` and the float64 -> float16 cast;
* within a stated tolerance (``K.reduction_rtol``): the reductions (Gaussian-k's mean/std
  threshold, TernGrad's clipping bound), computed by the framework in the input dtype or at
  least float32, by the reference in float64;
* Gaussian-k: the same count rule from the same first threshold, exactly.

Then dtype/device preservation, the dispatch, the :class:`~hvd_compress.simulator.Simulator` (the
engine) fed framework tensors against the same fed numpy arrays (averages, residuals, RegTop-k's
distortion, bytes), TernGrad's random stream and checkpoints. What only one framework has: ``test_torch_only.py``,
``test_tf_only.py``.
"""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import strategies as st

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK, kernels
from hvd_compress import wire
from hvd_compress.kernels import reference as R
from hvd_compress.simulator import Simulator
from tests.helpers import (
    SPARSIFIERS,
    distortions,
    exact_k,
    float_arrays,
    index_sets,
    permille,
    sampled_in_range_but_over_the_slots,
    ternary_codes,
)
from tests.kernels.frameworks import FLOATS, FLOATS_32_64
from tests.kernels.frameworks import given_per_framework as given


mus = st.sampled_from([4.0, 5.0, 0.7, 4.3, 37.5])
world_sizes = st.integers(1, 16)


# --------------------------------------------------------------------------- #
# 1. Kernels vs the reference
# --------------------------------------------------------------------------- #
def test_every_reference_function_has_a_twin(K):
    """The contract of the kernel interface: same public names (the constants and
    framework-free helpers are re-exported), the fused bucket path's (``BUCKET_FUNCTIONS``) included."""
    functions = [
        name
        for name, f in vars(R).items()
        if inspect.isfunction(f) and f.__module__ == R.__name__ and not name.startswith("_")
    ]
    assert sorted(n for n in functions if not callable(getattr(K.ops, n, None))) == []
    assert all(inspect.isfunction(getattr(R, n, None)) for n in R.BUCKET_FUNCTIONS)


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data())
def test_array_utilities_match_reference(K, dtype, data):
    a = data.draw(float_arrays(dtype, max_size=300), label="a")
    a[: data.draw(st.integers(0, 3))] = data.draw(st.sampled_from([np.inf, -np.inf, np.nan]))
    t = K.tensor(a)
    assert K.ops.itemsize(t) == R.itemsize(a)
    cut = data.draw(st.integers(0, a.shape[0]))
    sizes = [cut, a.shape[0] - cut]

    def utilities(ops, x, dtype_of):
        return {
            "zeros_like": ops.zeros_like(x),
            "full": ops.full(a.shape[0], 2.5, x),
            "full float16": ops.full(3, 0.1, x, ops.float16),
            **{f"cast to {d.__name__}": ops.cast(x, dtype_of(d)) for d in FLOATS},
            "as_int64": ops.as_int64([3, -1, 2**40], x),
            "as_float32": ops.as_float32([0.1, 1e30], x),
            "reshape": ops.reshape(x, (1, -1)),
            "split": ops.split(x, sizes),
        }

    K.check(lambda x: utilities(K.ops, x, K.dtype), [t], utilities(R, a, np.dtype))
    assert K.ops.to_list(K.ops.as_int64([1, 2], t)) == R.to_list(R.as_int64([1, 2], a)) == [1, 2]


def test_placed_writes_each_part_at_its_start(K):
    """``placed(out, [(start, values), ...])``: a DDP bucket's dense sums copied to their places (hand-computed)."""
    out, values = np.array([0.5, -1.25, 3.0, 7.5, 2.25, -0.75], np.float32), np.array([9.1, -8.3, 6.7], np.float32)
    want = np.array([0.5, 6.7, 3.0, 9.1, -8.3, -0.75], np.float32)
    np.testing.assert_array_equal(R.placed(out.copy(), [(3, values[:2]), (1, values[2:])]), want)
    K.check(lambda o, v: K.ops.placed(o, [(3, v[:2]), (1, v[2:])]), [K.tensor(out), K.tensor(values)], want)


def test_fp16_cast_of_float64_rounds_once(K):
    """float64 -> float16 must round to nearest directly, as numpy does; a detour through
    float32 rounds twice: 1.1967773426534207 lies just below 1.19677734375, the midpoint
    of the float16 neighbours 1.1962890625 and 1.197265625, so it rounds down; float32
    rounds it onto the midpoint, which then goes to the even neighbour, up."""
    x = np.array([1.1967773426534207, -1.1967773426534207, 7e4, 1e-40, -1e-40, 2.0**-25 * 1.5])
    want = R.cast(x, np.float16)
    assert float(want[0]) == 1.1962890625
    assert K.numpy(K.native_cast(K.tensor(x), np.float16))[0] != want[0]  # what this guards against
    K.check(lambda t: K.ops.cast(t, K.ops.float16), [K.tensor(x)], want)


@pytest.mark.parametrize("dtype", FLOATS)
def test_random_stream_is_per_rank_uniform_and_restorable(K, dtype):
    like = K.tensor(np.zeros(5000, dtype=dtype))
    draws = [K.ops.uniform(K.ops.generator(7, rank, like), like) for rank in (0, 0, 1)]
    assert draws[0].dtype == like.dtype
    draws = [K.numpy(d) for d in draws]
    assert np.array_equal(draws[0], draws[1]) and not np.array_equal(draws[0], draws[2])
    assert float(draws[0].min()) >= 0 and float(draws[0].max()) <= 1  # float16 may round up to 1
    assert abs(float(draws[0].astype(np.float64).mean()) - 0.5) < 5 * (1 / 12 / 5000) ** 0.5
    rng = K.ops.generator(7, 0, like)
    state = K.ops.generator_state(rng)
    assert isinstance(state, K.generator_state_type)
    first = K.numpy(K.ops.uniform(rng, like))
    K.ops.set_generator_state(rng, pickle.loads(pickle.dumps(state)))
    assert np.array_equal(K.numpy(K.ops.uniform(rng, like)), first)


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data())
def test_topk_matches_reference_with_ties(K, dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    k = data.draw(st.integers(1, a.shape[0] + 2), label="k")  # k > numel clamps
    # signed scores: topk_indices ranks values, not magnitudes
    K.check(lambda t: (K.ops.topk_indices(t, k), K.ops.topk_indices(abs(t), k)), [K.tensor(a)],
            (R.topk_indices(a, k), R.topk_indices(np.abs(a), k)))


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@given("few", data=st.data(), p=permille)
def test_topk_all_equal_magnitudes_take_the_lowest_indices(K, dtype, data, p):
    numel = data.draw(st.integers(1, 3000))
    signs = np.random.default_rng(numel).choice([-1.0, 1.0], numel).astype(dtype)
    k = exact_k(p, numel)
    want = R.topk_indices(np.abs(signs), k)
    assert want.dtype == np.int32 and np.array_equal(want, np.arange(k))
    K.check(lambda t: K.ops.topk_indices(abs(t), k), [K.tensor(signs)], want)


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), mu=mus)
def test_regtopk_scores_match_reference(K, dtype, data, mu):
    """Bit-exact up to float32 (tanh runs in float64 and is rounded back); float64 scores
    keep the two libraries' float64 tanh, which may differ in the last bit."""
    a = data.draw(float_arrays(dtype), label="a")
    d = data.draw(distortions(a.shape[0], dtype), label="D")
    want = R.regtopk_scores(a, d, mu)
    scores = lambda x, y: K.ops.regtopk_scores(x, y, mu)  # noqa: E731
    if want.dtype != np.float64:
        K.check(scores, [K.tensor(a), K.tensor(d)], want)
        return
    for mode, got in K.run(scores, K.tensor(a), K.tensor(d)).items():
        assert got.dtype == K.dtype(np.float64), mode
        rtol = 4 * np.finfo(np.float64).eps
        np.testing.assert_allclose(K.numpy(got), want, rtol=rtol, atol=0, err_msg=mode)


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), mu=mus)
def test_regtopk_sparse_scores_match_reference(K, dtype, data, mu):
    """``|a|``, damped where the posterior informs ``D``: as :func:`test_regtopk_scores_match_reference`."""
    a = data.draw(float_arrays(dtype), label="a")
    idx = data.draw(index_sets(a.shape[0]), label="idx").astype(np.int64)  # work positions, as the engine's
    values = data.draw(float_arrays(np.float32, idx.shape[0], idx.shape[0]), label="D at idx")
    want = R.regtopk_sparse_scores(a, idx, values, mu)
    scores = lambda x, i, v: K.ops.regtopk_sparse_scores(x, i, v, mu)  # noqa: E731
    args = [K.tensor(a), K.tensor(idx), K.tensor(values)]
    if want.dtype != np.float64:
        K.check(scores, args, want)
        return
    for mode, got in K.run(scores, *args).items():
        np.testing.assert_allclose(K.numpy(got), want, rtol=4 * np.finfo(np.float64).eps, atol=0, err_msg=mode)


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data())
def test_regtopk_expand_matches_reference(K, dtype, data):
    """The dense ``D`` of a posterior: its values at its indices, ``1e8`` elsewhere."""
    numel = data.draw(st.integers(1, 3000), label="numel")
    idx = data.draw(index_sets(numel), label="idx")
    values = data.draw(float_arrays(np.float32, idx.shape[0], idx.shape[0]), label="D at idx").astype(
        np.result_type(dtype, np.float32))
    K.check(lambda i, v: K.ops.regtopk_expand(i, v, numel), [K.tensor(idx), K.tensor(values)],
            R.regtopk_expand(idx, values, numel))


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data())
def test_error_feedback_split_matches_reference(K, dtype, data):
    a = data.draw(float_arrays(dtype), label="a")
    indices = data.draw(index_sets(a.shape[0]), label="indices")
    K.check(K.ops.error_feedback_split, [K.tensor(a), K.tensor(indices)], R.error_feedback_split(a, indices))


@given("few", data=st.data(), spread=st.sampled_from([1.0, 1e3, 1e6]))
def test_error_feedback_split_to_float16_saturates_and_keeps_the_rest(K, data, spread):
    """float32 ``a`` (a float16 gradient plus its float32 residual) sent as float16: the values
    saturate at 65504 and ``r[S] = a[S] - values``: exact below 65504, rounded once in float32 above."""
    a = data.draw(float_arrays(np.float32), label="a") * np.float32(spread)
    indices = data.draw(index_sets(a.shape[0]), label="indices")
    want = R.error_feedback_split(a, indices, wire_dtype=np.float16)
    assert want[0].dtype == np.float16 and np.all(np.isfinite(want[0]))
    np.testing.assert_allclose(want[0].astype(np.float32) + want[1][indices], a[indices], rtol=2**-23, atol=0)
    in_range = np.abs(a[indices]) <= 65504
    np.testing.assert_array_equal((want[0].astype(np.float32) + want[1][indices])[in_range], a[indices][in_range])
    K.check(
        lambda x, i: K.ops.error_feedback_split(x, i, wire_dtype=K.ops.float16),
        [K.tensor(a), K.tensor(indices)],
        want,
    )


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), momentum=st.sampled_from([0.9, 0.5, 0.99, 1e-3]))
def test_momentum_update_and_mask_match_reference(K, dtype, data, momentum):
    """Momentum correction: ``u = m u + g`` in the velocity's dtype (at least float32; one multiply,
    then one add), then ``u[S] = 0``."""
    g = data.draw(float_arrays(dtype), label="g")
    u = data.draw(float_arrays(R.accumulation_dtype(g.dtype), min_size=g.size, max_size=g.size), label="u")
    indices = data.draw(index_sets(g.size), label="indices")
    updated = R.momentum_update(u, g, momentum)
    want = (updated, R.momentum_mask(updated.copy(), indices))

    def kernels_of(v, x, i):
        return K.ops.momentum_update(v, x, momentum), K.ops.momentum_mask(K.ops.momentum_update(v, x, momentum), i)

    K.check(kernels_of, [K.tensor(u), K.tensor(g), K.tensor(indices)], want)


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("flagged", [(), (0, 2, 4)])
def test_keep_finite_rows_keeps_the_old_rows_where_the_total_is_not_finite(K, dtype, flagged):
    """Two groups (3 rows of 5, 2 rows of 4); rows of the total holding NaN, +Inf, -Inf keep the old rows,
    the others take the new; nothing flagged: the new rows. Torch's host and accelerator branches both."""
    from hvd_compress.kernels.groups import Group

    groups = [Group(0, 0, [0, 1, 2], 5), Group(15, 3, [3, 4], 4)]
    rows = [(0, 5), (5, 10), (10, 15), (15, 19), (19, 23)]
    rng = np.random.default_rng(len(flagged))
    total, old, new = (rng.standard_normal(23).astype(dtype) * 1.3 for _ in range(3))
    want = new.copy()
    for row, special in zip(flagged, (np.nan, np.inf, -np.inf)):
        start, stop = rows[row]
        total[start + 1] = special
        want[start:stop] = old[start:stop]
    with np.errstate(invalid="ignore"):  # 0 * Inf: the NaN that flags a row
        np.testing.assert_array_equal(R.keep_finite_rows(groups, total, old.copy(), new), want)

    def kept(t, o, n):
        return K.ops.keep_finite_rows(groups, t, o, n)

    K.check(kept, [K.tensor(total), K.tensor(old), K.tensor(new)], want)
    if K.name == "torch-cpu":
        with K.ops.accelerator_path():
            K.check(kept, [K.tensor(total), K.tensor(old), K.tensor(new)], want, "accelerator path")


@pytest.mark.parametrize("dtype", FLOATS)
def test_added_concat_is_the_concatenation_plus_the_addend(K, dtype):
    """``a = g + r`` made as a bucket's parts are copied in: parts of several sizes (an empty one and a
    one-entry spare among them), NaN and Inf carried, the sums of the concatenation's, bit for bit."""
    rng = np.random.default_rng(5)
    parts = [(rng.standard_normal(n) * 3.7).astype(dtype) for n in (7, 0, 1000, 1)]
    parts[2][[3, 9]] = [np.nan, np.inf]
    addend = (rng.standard_normal(1008) * 0.37).astype(dtype)
    addend[11] = -np.inf
    want = np.concatenate(parts) + addend

    def added(a, *ps):
        return K.ops.added_concat(list(ps), a)

    K.check(added, [K.tensor(addend)] + [K.tensor(p) for p in parts], want)
    if K.name == "torch-cpu":
        with K.ops.accelerator_path():
            K.check(added, [K.tensor(addend)] + [K.tensor(p) for p in parts], want, "accelerator path")


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), factor=st.sampled_from([1.0, 1.0, 1.37, 3.1e1, 1 + 2**-30]))
def test_terngrad_codes_match_reference_given_the_same_uniforms(K, dtype, data, factor):
    """The scale as a Python float."""
    g = data.draw(float_arrays(dtype), label="g")
    scale = float(np.max(np.abs(g))) * factor  # S >= max|g|; S = 0 for a zero gradient
    uniform = np.random.default_rng(g.shape[0]).random(g.shape[0], dtype=np.float32).astype(dtype)
    K.check(lambda x, u: K.ops.terngrad_codes(x, scale, u), [K.tensor(g), K.tensor(uniform)],
            R.terngrad_codes(g, scale, uniform))


@given("some", numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_pack_ternary_and_wrapping_sum_match_reference(K, numel, world_size, data):
    codes = [data.draw(ternary_codes(numel), label=f"codes[{r}]") for r in range(world_size)]
    lanes = [R.pack_ternary(c, world_size) for c in codes]
    total = R.sum_int32_wrapping(lanes)

    def kernels_of(cs):
        packed = [K.ops.pack_ternary(c, world_size) for c in cs]
        summed = K.ops.sum_int32_wrapping(packed)
        unpacked = K.ops.unpack_ternary_sum(summed, numel, world_size)
        return packed, summed, unpacked, unpacked

    # the unpacked lane sum is the reference's and the sum of the codes
    want = (lanes, total, R.unpack_ternary_sum(total, numel, world_size), np.sum(codes, axis=0, dtype=np.int32))
    K.check(kernels_of, [[K.tensor(c) for c in codes]], want)


@pytest.mark.parametrize("world_size", range(1, 17))
def test_packed_lanes_that_overflow_int32_when_summed(K, world_size):
    """All codes +1 puts 2N in every field: for N = 1 and 4..7 the lane (N = 1) or
    the lane sum (4..7) passes 2**31 and wraps to a negative int32."""
    numel = 3 * wire.ternary_codes_per_lane(world_size) + 1
    codes = np.ones(numel, dtype=np.int8)
    lanes = R.pack_ternary(codes, world_size)
    wraps = bool(np.any(lanes.view(np.uint32).astype(np.int64) * world_size >= 2**31))
    assert wraps == (world_size == 1 or 4 <= world_size <= 7)
    kernel_lanes = [K.ops.pack_ternary(K.tensor(codes), world_size) for _ in range(world_size)]
    unsigned = sum(K.numpy(lane).astype(np.int64) & 0xFFFFFFFF for lane in kernel_lanes)
    assert bool(np.any(unsigned >= 2**31)) == wraps

    def kernels_of(c):
        packed = K.ops.pack_ternary(c, world_size)
        summed = K.ops.sum_int32_wrapping([packed] * world_size)
        return packed, summed, K.ops.unpack_ternary_sum(summed, numel, world_size)

    want = (lanes, R.sum_int32_wrapping([lanes] * world_size), np.full(numel, world_size, np.int32))
    K.check(kernels_of, [K.tensor(codes)], want)


@given(
    "some",
    examples=[dict(world_size=16, numel=3, seed=0)],
    world_size=world_sizes,
    numel=st.integers(1, 3000),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum_int32_wrapping_of_arbitrary_lanes(K, world_size, numel, seed):
    """Full-range int32 lanes: sums of up to 16 wrap around many times."""
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(-(2**31), 2**31, numel, dtype=np.int64).astype(np.int32) for _ in range(world_size)
    ]
    arrays[0][0] = np.iinfo(np.int32).min
    arrays[-1][-1] = np.iinfo(np.int32).max
    want = R.sum_int32_wrapping(arrays)
    K.check(K.ops.sum_int32_wrapping, [[K.tensor(a) for a in arrays]], want)
    exact = np.sum([a.astype(np.int64) for a in arrays], axis=0)
    assert np.array_equal((exact - want.astype(np.int64)) % 2**32, np.zeros(numel))  # the oracle wraps


@given("some", numel=st.integers(1, 3000), data=st.data())
def test_two_bit_packing_matches_reference(K, numel, data):
    codes = data.draw(ternary_codes(numel))
    packed = R.pack_two_bit(codes)

    def kernels_of(c):
        unpacked = K.ops.unpack_two_bit(K.ops.pack_two_bit(c), numel)
        return K.ops.pack_two_bit(c), unpacked, unpacked

    K.check(kernels_of, [K.tensor(codes)], (packed, codes, R.unpack_two_bit(packed, numel)))


@given("some", numel=st.integers(1, 3000), world_size=world_sizes, data=st.data())
def test_concat_and_maximum_match_reference(K, numel, world_size, data):
    codes = [data.draw(ternary_codes(numel)) for _ in range(world_size)]
    floats = [c.astype(np.float32) * 0.5 for c in codes]

    def kernels_of(ops, cs, fs):
        return {
            "concat int8": ops.concat(cs),
            "concat float32": ops.concat(fs),
            "maximum": ops.maximum(fs[0], fs[-1]),
        }

    args = [[K.tensor(c) for c in codes], [K.tensor(f) for f in floats]]
    K.check(lambda cs, fs: kernels_of(K.ops, cs, fs), args, kernels_of(R, codes, floats))


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), world_size=st.integers(1, 8))
def test_dense_sum_matches_reference(K, dtype, data, world_size):
    numel = data.draw(st.integers(1, 3000))
    values = [data.draw(float_arrays(dtype, numel, numel)) for _ in range(world_size)]
    K.check(K.ops.dense_sum, [[K.tensor(v) for v in values]], R.dense_sum(values))


@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), p=permille)
def test_gaussiank_threshold_within_float_tolerance(K, dtype, data, p):
    """A Python float eagerly (a float64 scalar in a graph), within ``K.reduction_rtol``."""
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    runs = K.run(lambda t: K.ops.gaussiank_threshold(t, ratio), K.tensor(a))
    for mode, got in runs.items():
        assert isinstance(got, float) if mode == "eager" else got.dtype == K.dtype(np.float64), mode
    want = R.gaussiank_threshold(a, ratio)
    mag = float(np.max(np.abs(a.astype(np.float64))))
    scale = mag * (1 + R.normal_tail_quantile(ratio))  # bounds |mu| + sigma * q
    for got in runs.values():
        assert abs(float(got) - want) <= K.reduction_rtol[dtype] * scale, (got, want, scale)



@pytest.mark.parametrize("dtype", FLOATS)
@given("few", data=st.data(), p=permille)
def test_gaussiank_from_follows_the_reference_count_rule(K, dtype, data, p):
    """From the same first threshold, the same set (int32, ascending)."""
    a = data.draw(float_arrays(dtype), label="a")
    ratio = p / 1000
    k, threshold = R.num_selected(a.shape[0], ratio), R.gaussiank_threshold(a, ratio)
    want = R.gaussiank_from(np.abs(a), threshold, k)
    assert want.dtype == np.int32
    K.check(lambda t: K.ops.gaussiank_from(abs(t), threshold, k), [K.tensor(a)], want)


def test_gaussiank_cuts_an_overshooting_superset(K):
    """12 -> 398 -> 102 entries for k = 20 (reference docstring): the smallest superset
    (at threshold x 0.75) is cut to its first k indices; a graph takes the same branch."""
    a = np.random.default_rng(0).standard_normal(2000)
    k = R.num_selected(a.shape[0], 0.01)
    thr = 3.1  # ~4 entries above: 0.5x then 1.5x steps overshoot back and forth
    want = R.gaussiank_from(np.abs(a), thr, k)
    counts = [int(np.sum(np.abs(a) > thr * m)) for m in (1.0, 0.5, 0.75)]
    assert counts[0] < 2 * k / 3 and min(counts[1:]) > 4 * k / 3, counts  # the trim is taken
    np.testing.assert_array_equal(want, np.flatnonzero(np.abs(a) > thr * 0.75)[:k])
    K.check(lambda t: K.ops.gaussiank_from(abs(t), thr, k), [K.tensor(a)], want)


def test_gaussiank_counts_every_entry_where_a_sample_would_mislead(K):
    """Gaussian-k counts exactly: 200 entries above 1 exceed ``floor(4k/3) = 170``, so the threshold
    grows 1.5x and the set above 1.5 (in range) is sent whole, though every 2nd entry alone would
    have put threshold 1 in range."""
    a = sampled_in_range_but_over_the_slots()
    k = R.num_selected(a.shape[0], 0.01)
    assert (k, R.sample_stride(k), R.gaussiank_bounds(k), R.gaussiank_slots(k)) == (128, 2, (86, 170), 170)
    assert 2 * int(np.sum(np.abs(a[::2]) > 1.0)) == 100 and int(np.sum(np.abs(a) > 1.0)) == 200
    want = R.gaussiank_from(np.abs(a), 1.0, k)
    np.testing.assert_array_equal(want, np.flatnonzero(np.abs(a) > 1.5))
    assert 86 <= want.shape[0] <= 170
    K.check(lambda t: K.ops.gaussiank_from(abs(t), 1.0, k), [K.tensor(a)], want)


def test_reused_threshold_trusts_its_sampled_count_and_keeps_its_first_k(K):
    """A reused threshold counts every 2nd entry: 100 is in ``[64, 128]``, so threshold 1 is kept, and its
    set of 200 keeps its first 128 indices, Top-k's slots."""
    a = sampled_in_range_but_over_the_slots()
    k = R.num_selected(a.shape[0], 0.01)
    indices, chosen = R.reused_threshold_select(np.abs(a), 1.0, k)
    np.testing.assert_array_equal(indices, np.flatnonzero(np.abs(a) > 1.0)[:128])
    assert chosen == 1.0
    K.check(lambda t: K.ops.reused_threshold_select(abs(t), 1.0, k)[0], [K.tensor(a)], indices)


# --------------------------------------------------------------------------- #
# 2. Dtypes, devices, dispatch
# --------------------------------------------------------------------------- #
def _kernel_calls(ops, a, uniform):
    """``{name: output}`` of every kernel on ``a`` (a tensor or array) and draws ``uniform``."""
    numel = a.shape[0]
    k = max(1, numel // 10)
    idx = ops.topk_indices(abs(a), k)
    values, residual = ops.error_feedback_split(a, idx)
    no_info = ops.full(numel, R.NO_DISTORTION, a, ops.accumulation_dtype(a.dtype))
    codes = ops.terngrad_codes(a, 4.0, uniform)
    lanes = ops.pack_ternary(codes, 3)
    two_bit = ops.pack_two_bit(codes)
    return {
        "topk_indices": ops.topk_indices(a, k),
        "topk_indices of |a|": idx,
        "error_feedback_split.values": values,
        "error_feedback_split.residual": residual,
        "gaussiank_from": ops.gaussiank_from(abs(a), 1.0, k),
        "regtopk_scores": ops.regtopk_scores(a, no_info, 5.0),
        "terngrad_codes": codes,
        "terngrad_codes of zero draws": ops.terngrad_codes(a, 4.0, ops.zeros_like(a)),
        "zeros_like": ops.zeros_like(a),
        "full": ops.full(numel, 2.0, a),
        "cast": ops.cast(a, ops.float16),
        "pack_ternary": lanes,
        "sum_int32_wrapping": ops.sum_int32_wrapping([lanes, lanes, lanes]),
        "unpack_ternary_sum": ops.unpack_ternary_sum(ops.sum_int32_wrapping([lanes] * 3), numel, 3),
        "pack_two_bit": two_bit,
        "unpack_two_bit": ops.unpack_two_bit(two_bit, numel),
        "concat": ops.concat([a, a]),
        "dense_sum": ops.dense_sum([a, a]),
    }


@pytest.mark.parametrize("dtype", FLOATS)
def test_kernel_outputs_keep_dtype_and_device(K, dtype):
    """Every output has the reference's dtype (input dtype for float results, int32
    indices and lanes, int8 codes, float32+ sums) and stays on the input's device; in a graph too."""
    a = np.random.default_rng(3).standard_normal(1500).astype(dtype)
    want = _kernel_calls(R, a, R.uniform(R.generator(0, 0, a), a))
    t = K.tensor(a)
    stream = K.ops.generator(0, 0, t)  # eagerly: a graph may create a variable on its first trace only
    draws = K.ops.uniform(stream, t)
    assert K.device_of(stream) == K.device_of(draws) == K.device_of(t) and draws.dtype == t.dtype
    for mode, got in K.run(lambda x, u: _kernel_calls(K.ops, x, u), t, draws).items():
        assert got.keys() == want.keys()
        for name, out in got.items():
            assert out.dtype == K.dtype(want[name].dtype), (mode, name, out.dtype, want[name].dtype)
            assert K.device_of(out) == K.device_of(t), (mode, name, K.device_of(out))
        assert got["topk_indices"].dtype == got["gaussiank_from"].dtype == K.dtype(np.int32), mode
    assert isinstance(K.ops.gaussiank_threshold(t, 0.1), float)
    assert K.ops.index_dtype(2**31 - 1) == K.dtype(np.int32) and K.ops.index_dtype(2**31) == K.dtype(np.int64)


def test_ops_for_dispatches_tensors_to_their_kernels(K):
    assert kernels.ops_for(K.tensor(np.zeros(3))) is K.ops
    assert kernels.ops_for(np.zeros(3)) is R
    assert kernels.module(K.ops.__name__) is K.ops
    with pytest.raises(TypeError, match="list; pass a numpy array, a torch tensor or a TensorFlow tensor"):
        kernels.ops_for([1.0])


def test_importing_hvd_compress_does_not_import_the_framework(K):
    code = f"import sys, hvd_compress, hvd_compress.kernels; print({K.package!r} in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


# --------------------------------------------------------------------------- #
# 3. Compressors fed framework tensors vs numpy arrays (the engine, the Simulator)
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


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_compressors_on_framework_equal_compressors_on_numpy(K, kind, dtype):
    """Three ranks, four steps whose gradient scale drifts (RegTop-k's D in use, residuals
    carried): averages, residuals, distortions and bytes are bit-identical. TernGrad runs
    unclipped here (the clipping bound is a reduction, equal within rounding only), and
    TernGrad draws from each framework's own stream, so only its draw-free case (the dense
    bias) and its bytes compare; so is Gaussian-k's threshold where a framework reduces
    float16 in float16 (torch), which leaves that case out."""
    if kind == "gaussiank" and dtype == np.float16 and K.reduction_rtol[np.float16] > 2.0**-20:
        pytest.skip(f"{K} reduces float16 in float16: Gaussian-k's threshold equals within rounding only")
    rng = np.random.default_rng(5)
    sim_k, sim_np = Simulator(3, FACTORIES[kind]()), Simulator(3, FACTORIES[kind]())
    drawn = kind.startswith("terngrad")
    for step in range(4):
        grads = {name: [(rng.standard_normal(shape) * (1 + step)).astype(dtype) for _ in range(3)]
                 for name, shape in SHAPES.items()}
        got = sim_k.step({name: [K.tensor(g) for g in per_rank] for name, per_rank in grads.items()})
        want = sim_np.step(grads)
        assert sim_k.bytes_sent_per_rank == sim_np.bytes_sent_per_rank
        for name in SHAPES if not drawn else ["b"]:
            K.assert_same(got[name], want[name], f"step {step} {name}")
            for rank, (r_k, r_np) in enumerate(zip(sim_k.residuals(name), sim_np.residuals(name))):
                assert (r_k is None) == (r_np is None), (step, name, rank)
                if r_np is not None:
                    K.assert_same(r_k, r_np, f"step {step} {name} rank {rank} residual")
    for c_k, c_np in zip(sim_k.compressors, sim_np.compressors):
        if isinstance(c_np, RegTopK) and c_np.distortion("w") is not None:
            assert np.any(c_np.distortion("w") < R.NO_DISTORTION)
            K.assert_same(c_k.distortion("w"), c_np.distortion("w"), "RegTop-k distortion")


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_compressors_reject_integer_and_propagate_nonfinite_tensors(K, kind):
    """An integer gradient is refused by the exchange; NaN/Inf on one rank makes that tensor non-finite on
    every rank, as a dense allreduce would, and leaves the others finite."""
    with pytest.raises(TypeError, match="floating point"):
        Simulator(1, FACTORIES[kind]()).step({"w": [K.tensor(np.ones((30, 50), np.int32))]})
    bad = np.ones((30, 50), np.float32)
    bad[3, 4], bad[0, 0] = np.nan, np.inf
    good = np.random.default_rng(1).standard_normal((30, 50)).astype(np.float32)
    out = Simulator(2, FACTORIES[kind]()).step({"w": [K.tensor(bad), K.tensor(good)],
                                                "v": [K.tensor(good), K.tensor(good)]})
    assert not np.all(np.isfinite(K.numpy(out["w"]))) and np.all(np.isfinite(K.numpy(out["v"])))


# --------------------------------------------------------------------------- #
# 4. Simulator: framework tensors vs numpy arrays
# --------------------------------------------------------------------------- #
def run_both(K, compressor, grads: np.ndarray, shape=None):
    """``grads[step][rank]`` through two simulators, one fed numpy, one ``K``'s tensors."""
    steps, n_ranks = grads.shape[:2]
    shape = shape or grads.shape[2:]
    sim_np, sim_k = Simulator(n_ranks, compressor, seed=3), Simulator(n_ranks, compressor, seed=3)
    outputs = []
    for step in grads:
        out_np = sim_np.step({"w": [g.reshape(shape) for g in step]})["w"]
        out_k = sim_k.step({"w": [K.tensor(g.reshape(shape)) for g in step]})["w"]
        outputs.append((out_k, out_np))
    return sim_k, sim_np, outputs


def assert_simulators_agree(K, sim_k, sim_np, outputs):
    for step, (out_k, out_np) in enumerate(outputs):
        K.assert_same(out_k, out_np, f"output of step {step}")
    assert sim_k.bytes_sent_per_rank == sim_np.bytes_sent_per_rank
    for rank, (r_k, r_np) in enumerate(zip(sim_k.residuals("w"), sim_np.residuals("w"))):
        if r_np is None:
            assert r_k is None
        else:
            K.assert_same(r_k, r_np, f"residual of rank {rank}")
    for c_k, c_np in zip(sim_k.compressors, sim_np.compressors):
        if isinstance(c_np, RegTopK) and c_np.distortion("w") is not None:
            K.assert_same(c_k.distortion("w"), c_np.distortion("w"), "RegTop-k distortion")


E2E_DENSE = {"none": lambda p: NoneCompressor(), "fp16": lambda p: FP16()}
E2E = {**SPARSIFIERS, **E2E_DENSE}


@pytest.mark.parametrize("kind", ["none", "topk"])
def test_average_over_3_ranks_is_bit_exact(K, kind):
    """``Compressor.decode`` and ``BucketExchange`` divide by N as a true division on every device
    (CUDA would multiply by 1/N, off by an ulp for a third of float32 values; so would a graph
    whose constant folding turns a division by a constant into a multiplication)."""
    grads = np.random.default_rng(5).standard_normal((2, 3, 1000)).astype(np.float32)
    assert_simulators_agree(K, *run_both(K, E2E[kind](0.1), grads))


# --------------------------------------------------------------------------- #
# 5. TernGrad on framework tensors: codes, decode, random stream, checkpoints
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", FLOATS_32_64)
@given("few", seed=st.integers(0, 2**32 - 1), numel=st.integers(1, 3000), clip=st.sampled_from([None, 2.5]))
def test_terngrad_codes_are_ternary_and_sign_consistent(K, dtype, seed, numel, clip):
    """What one rank sends is ``S t``: ``t`` in {-1, 0, 1} with ``g``'s sign, ``S = max|clip(g)|`` (the largest
    entry always codes 1), on ``g``'s device."""
    g_np = np.random.default_rng(seed).standard_normal(numel).astype(dtype)
    g_np[::7] = 0
    g = K.tensor(g_np)
    out = Simulator(1, TernGrad(clip=clip, dense_below=0, seed=seed)).step({"w": [g]})["w"]
    assert K.device_of(out) == K.device_of(g) and tuple(out.shape) == (numel,)
    sent = K.numpy(out).astype(np.float64)
    scale = np.max(np.abs(sent))
    codes = sent / scale if scale > 0 else sent
    assert set(np.unique(codes).tolist()) <= {-1.0, 0.0, 1.0}
    assert np.all((codes == 0) | (np.sign(g_np) == codes))
    bound = np.inf if clip is None or np.all(g_np == g_np[0]) else clip * np.std(g_np.astype(np.float64))
    assert scale == pytest.approx(min(np.max(np.abs(g_np.astype(np.float64))), bound), rel=1e-5)


def test_terngrad_stream_is_in_the_checkpoint(K):
    """TernGrad draws from the kernels' generator; its state goes into state_dict (a numpy
    array on TF, a tensor on torch) and a restored rank continues the stream exactly."""
    g = K.tensor(np.random.default_rng(0).standard_normal(2000).astype(np.float32))
    sim = Simulator(1, TernGrad(dense_below=0, seed=5))
    first = K.numpy(sim.step({"w": [g]})["w"])
    assert np.all((first == 0) | (np.sign(first) == np.sign(K.numpy(g))))
    state = pickle.loads(pickle.dumps(sim.compressors[0].state_dict()))
    assert set(state["generators"]) == {K.ops.__name__}
    assert isinstance(state["generators"][K.ops.__name__], K.generator_state_type)
    expected = K.numpy(sim.step({"w": [g]})["w"])
    restored = Simulator(1, TernGrad(dense_below=0, seed=5))
    restored.load_state_dict([state])
    K.assert_same(restored.step({"w": [g]})["w"], expected)
    assert not np.array_equal(K.numpy(Simulator(1, TernGrad(dense_below=0, seed=5)).step({"w": [g]})["w"]), expected)
