"""Property-based tests (hypothesis) of the algorithms and the simulator."""

import io
import warnings
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.kernels import reference
from hvd_compress.simulator import Simulator
from tests.oracle import PerTensorRanks

from tests.helpers import (
    SPARSIFIERS,
    exact_k,
    permille,
    rank_uniforms,
    topk_oracle,
    training_runs,
    vectors,
)

#: Relative tolerance of the float64 conservation check: a few ulps per addition of
#: at most (steps x ranks) terms of magnitude <= 1e3, scaled by sum |g| per element.
CONSERVATION_RTOL = 1e-12


# (a) ------------------------------------------------------------------------ #
@given(kind=st.sampled_from(sorted(SPARSIFIERS)), grads=training_runs(), p=permille)
def test_error_feedback_conserves_the_gradient(kind, grads, p):
    """sum_{t,r} g = N * sum_t avg_t + sum_r residual_r, per element."""
    steps, n_ranks, numel = grads.shape
    sim = Simulator(n_ranks, SPARSIFIERS[kind](p / 1000))
    output_sum = np.zeros(numel)
    for step in grads:
        output_sum += sim.step({"w": list(step)})["w"]
    residual_sum = np.sum(sim.residuals("w"), axis=0)
    lhs = grads.sum(axis=(0, 1))
    rhs = n_ranks * output_sum + residual_sum
    tolerance = CONSERVATION_RTOL * (1.0 + np.abs(grads).sum(axis=(0, 1)))
    assert np.all(np.abs(lhs - rhs) <= tolerance), np.max(np.abs(lhs - rhs) - tolerance)


# (b) ------------------------------------------------------------------------ #
def one_rank(compressor, a):
    """What one rank sends of ``a`` on the engine (a 1-rank Simulator's average) and its residual."""
    sim = Simulator(1, compressor)
    sent = sim.step({"w": [a]})["w"]
    return sent, sim.residuals("w")[0], sim


@given(a=vectors(), p=permille)
def test_topk_sends_the_k_largest(a, p):
    k = exact_k(p, a.shape[0])
    sent, residual, sim = one_rank(TopK(p / 1000, dense_below=0), a)
    chosen = np.zeros(a.shape[0], bool)
    chosen[topk_oracle(a, k)] = True
    np.testing.assert_array_equal(sent, np.where(chosen, a, 0))
    np.testing.assert_array_equal(residual, np.where(chosen, 0, a))
    assert sim.values_sent_per_rank == [k]


# (c) ------------------------------------------------------------------------ #
@given(
    seed=st.integers(0, 2**32 - 1),
    numel=st.integers(2000, 5000),
    p=st.integers(10, 200),
    dtype=st.sampled_from([np.float32, np.float64]),
)
# k = 20: the first threshold passes 12 (< 2k/3), x0.5 passes 398, x1.5 passes 102 = 5k
@example(seed=617182, numel=2000, p=10, dtype=np.float64)
def test_gaussiank_count_is_near_k_on_normal_data(seed, numel, p, dtype):
    a = np.random.default_rng(seed).standard_normal(numel).astype(dtype)
    k = exact_k(p, numel)
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr), warnings.catch_warnings():
        warnings.simplefilter("error")
        sent, residual, _ = one_rank(GaussianK(p / 1000, dense_below=0), a)
    indices = np.flatnonzero(sent)  # normal data: no entry is exactly 0
    count = indices.shape[0]
    assert k / 2 <= count <= 2 * k, (count, k)
    assert stdout.getvalue() == "" and stderr.getvalue() == ""
    np.testing.assert_array_equal(sent + residual, a)
    # a threshold selection, cut to its first k when it overshoots: every sent magnitude exceeds
    # every kept one before the last sent index (after it, a cut set may have left larger ones)
    kept = np.delete(np.arange(numel), indices)
    before = kept[kept < indices.max()]
    assert before.shape[0] == 0 or np.abs(sent[indices]).min() > np.abs(a[before]).max()


# (d) ------------------------------------------------------------------------ #
@given(g=vectors(), clip=st.sampled_from([None, 2.5]), seed=st.integers(0, 100))
def test_terngrad_sends_ternary_codes_sign_consistent(g, clip, seed):
    """One rank sends S * t: t in {-1, 0, 1} with the sign of g, S = max|clip(g)| (its entry has p = 1)."""
    sent, _, _ = one_rank(TernGrad(clip=clip, dense_below=0, seed=seed), g)
    scale = np.abs(sent).max()
    if scale == 0:
        assert not g.any()
        return
    codes = sent / scale
    assert set(np.unique(codes)) <= {-1.0, 0.0, 1.0}
    nonzero = codes != 0
    np.testing.assert_array_equal(np.sign(codes[nonzero]), np.sign(g[nonzero]))
    largest = np.argmax(np.abs(g))  # clipping keeps the largest |g| the largest: always sent
    assert sent[largest] == np.sign(g[largest]) * scale
    if clip is None:
        assert scale == np.abs(g).max()
    else:
        assert scale <= np.abs(g).max()


@pytest.mark.parametrize("seed", [0, 1])
def test_terngrad_is_unbiased(seed):
    """mean over n steps of S * t is within 5 standard errors of g, for every entry."""
    g = np.random.default_rng(100 + seed).standard_normal(200) * np.linspace(0.01, 3.0, 200)
    scale = np.abs(g).max()  # one rank, no clipping: S = max|g|
    draws = 2000
    sim = Simulator(1, TernGrad(clip=None, dense_below=0, seed=seed))
    total = np.zeros_like(g)
    for _ in range(draws):
        total += sim.step({"w": [g]})["w"]
    mean = total / draws
    p = np.abs(g) / scale
    standard_error = scale * np.sqrt(p * (1 - p) / draws)  # Bernoulli variance S^2 p (1 - p) / n
    excess = np.abs(mean - g) - 5 * standard_error
    assert np.all(excess <= 1e-12), f"worst entry exceeds 5 SE by {excess.max():.3g}"


# (e) ------------------------------------------------------------------------ #
@given(g=vectors(elements=st.floats(-65504, 65504, width=32), dtype=np.float32))
def test_fp16_round_trip_within_half_precision(g):
    out, _, _ = one_rank(FP16(), g)
    assert out.dtype == np.float32
    # round to nearest: relative error <= 2**-11 for normal halves, absolute <= 2**-25 below
    error = np.abs(out.astype(np.float64) - g.astype(np.float64))
    assert np.all(error <= np.abs(g.astype(np.float64)) * 2.0**-11 + 2.0**-25)


# (f) ------------------------------------------------------------------------ #
@given(
    a=st.one_of(vectors(), vectors(elements=st.floats(-1e3, 1e3, width=32), dtype=np.float32)),
    p=permille,
    mu=st.floats(0.1, 100.0),
)
def test_regtopk_first_step_is_topk(a, p, mu):
    top, top_residual, _ = one_rank(TopK(p / 1000, dense_below=0), a)
    reg, reg_residual, _ = one_rank(RegTopK(p / 1000, mu=mu, dense_below=0), a)
    np.testing.assert_array_equal(reg, top)
    np.testing.assert_array_equal(reg_residual, top_residual)
    assert reg.dtype == top.dtype == a.dtype


# (g) ------------------------------------------------------------------------ #
@given(n_ranks=st.integers(1, 16), numel=st.integers(1, 100), data=st.data())
def test_packed_ternary_sum_equals_sum_of_codes(n_ranks, numel, data):
    codes = data.draw(
        hnp.arrays(np.int8, (n_ranks, numel), elements=st.sampled_from([-1, 0, 1])), label="codes"
    )
    lanes = [reference.pack_ternary(c, n_ranks) for c in codes]
    # an int32 allreduce: exact sum modulo 2**32, read back as int32
    wrapped = (np.sum([l.astype(np.int64) for l in lanes], axis=0) & 0xFFFFFFFF).astype(np.uint32)
    total = reference.sum_int32_wrapping(lanes)
    np.testing.assert_array_equal(total.view(np.uint32), wrapped)
    np.testing.assert_array_equal(reference.unpack_ternary_sum(total, numel, n_ranks), codes.sum(axis=0))
    for c in codes:  # the 2-bit allgather format round-trips each rank's codes
        np.testing.assert_array_equal(reference.unpack_two_bit(reference.pack_two_bit(c), numel), c)
    # and TernGrad on the engine gives S * sum t / N whichever wire format it picks: g = 0.5 t has the
    # shared scale S = 0.5 (or 0 where every code is 0), so p = 1 where t != 0 and every code is drawn as t
    sim = Simulator(n_ranks, TernGrad(clip=None, dense_below=0))
    out = sim.step({"w": list(0.5 * codes.astype(np.float64))})["w"]
    np.testing.assert_allclose(out * n_ranks, 0.5 * codes.sum(axis=0), rtol=1e-15, atol=0)


# (h) ------------------------------------------------------------------------ #
def _oracle_average(kind, grads, p):
    """The average a correct simulator step returns, computed directly with numpy."""
    n_ranks, numel = grads.shape
    if kind == "none":
        sent = list(grads)
    elif kind == "fp16":
        sent = [g.astype(np.float16).astype(np.float64) for g in grads]
    elif kind == "topk":
        k = exact_k(p, numel)
        sent = []
        for g in grads:
            idx = topk_oracle(g, k)
            s = np.zeros(numel)
            s[idx] = g[idx]
            sent.append(s)
    elif kind == "terngrad":
        scale = np.abs(grads).max()  # allreduce-Max of the ranks' max|g|
        sent = []
        for rank, g in enumerate(grads):
            u = rank_uniforms(0, rank, numel).astype(np.float64)
            t = np.sign(g) * (u < np.abs(g) / scale) if scale > 0 else np.zeros(numel)
            sent.append(scale * t)
    total = np.zeros(numel)
    for s in sent:
        total += s
    return total / n_ranks


SIMULATED = {
    "none": lambda p: NoneCompressor(),
    "fp16": lambda p: FP16(),
    "topk": lambda p: TopK(p / 1000, dense_below=0, dense_when_cheaper=False),
    "terngrad": lambda p: TernGrad(clip=None, dense_below=0),
}


def _float16_wire_average(grads):
    """FP16 on the engine: the float16 wire summed in float32 in rank order, rounded back to float16 (as
    an allreduce of float16 tensors returns it), then divided by N."""
    total = np.zeros(grads.shape[1], np.float32)
    for g in grads:
        total += g.astype(np.float16).astype(np.float32)
    return total.astype(np.float16).astype(np.float64) / grads.shape[0]


@pytest.mark.parametrize("ranks_of", [Simulator, PerTensorRanks], ids=["engine", "per-tensor"])
@pytest.mark.parametrize("kind", sorted(SIMULATED))
@given(grads=training_runs(max_ranks=6, max_steps=1, max_numel=60), p=permille)
def test_simulator_step_equals_numpy_average(kind, ranks_of, grads, p):
    """The Simulator (the engine) and the per-tensor spec against numpy; FP16's allreduce rounds the sum of
    the float16 values to float16 (both)."""
    grads = grads[0]
    n_ranks, numel = grads.shape
    if kind == "fp16":
        grads = grads.astype(np.float32)
    out = ranks_of(n_ranks, SIMULATED[kind](p)).step({"w": list(grads)})["w"]
    assert out.shape == (numel,) and out.dtype == grads.dtype
    if kind == "fp16":
        expected = _float16_wire_average(grads)
    else:
        expected = _oracle_average(kind, grads, p)
    np.testing.assert_allclose(out, expected, rtol=1e-6 if kind == "fp16" else 1e-12, atol=1e-12)


@given(kind=st.sampled_from(sorted(SPARSIFIERS)), a=vectors(), p=permille)
def test_sent_plus_residual_is_exactly_a(kind, a, p):
    """One step of error feedback splits a = g + 0 into what is sent and what is kept, bitwise."""
    sent, residual, _ = one_rank(SPARSIFIERS[kind](p / 1000), a)
    np.testing.assert_array_equal(sent + residual, a)
    assert np.all(residual[sent != 0] == 0)


# (i) ------------------------------------------------------------------------ #
@given(
    a=vectors(min_size=2, dtype=np.float32, elements=st.floats(-100, 100, width=32)),
    data=st.data(),
    mu=st.sampled_from([0.5, 4.0, 5.0]),
)
def test_regtopk_sparse_posterior_selects_as_the_dense_distortion(a, data, mu):
    """What the engine scores (D kept as its informative part) ranks as the dense D's scores."""
    numel = a.shape[0]
    sent_idx = np.array(
        sorted(data.draw(st.sets(st.integers(0, numel - 1), min_size=1), label="sent")), np.int32
    )
    sent = data.draw(hnp.arrays(np.float32, sent_idx.shape[0], elements=st.floats(-10, 10, width=32)))
    total = data.draw(hnp.arrays(np.float32, numel, elements=st.floats(-50, 50, width=32)))
    k = data.draw(st.integers(1, numel), label="k")
    informative = sent != 0
    idx = sent_idx[informative].astype(np.int64)
    values = (total[idx] - sent[informative]) / sent[informative]  # D = (T - s) / s where s != 0
    dense = reference.regtopk_expand(idx, values, numel)
    np.testing.assert_array_equal(
        reference.topk_indices(reference.regtopk_sparse_scores(a, idx, values, mu), k),
        reference.topk_indices(reference.regtopk_scores(a, dense, mu), k),
    )
