"""Hand-checked small cases for every algorithm.

Each expected value is worked out in the comment next to it; none is copied
from the library's output.
"""

import copy
import math

import numpy as np
import pytest

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.kernels import reference
from tests.helpers import reference_gaussiank
from hvd_compress import wire
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.simulator import Simulator
from hvd_compress.transport.threads import run_ranks

f64 = np.float64


def arr(*values, dtype=f64):
    return np.array(values, dtype=dtype)


# --------------------------------------------------------------------------- #
# k = max(1, ceil(ratio * d))
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "ratio, numel, k",
    [
        (0.5, 5, 3),  # ceil(2.5) = 3
        (1.0, 7, 7),  # everything
        (0.001, 10, 1),  # ceil(0.01) = 1, and at least 1 anyway
        (0.3, 6, 2),  # ceil(1.8) = 2
        (0.4, 100, 40),  # the linear-regression density: 40 of 100
        (0.07, 100, 7),  # 7% of 100 is 7 (0.07 * 100 is 7.000000000000001 in floating point)
        (0.14, 100, 14),  # same trap: 0.14 * 100 = 14.000000000000002
    ],
)
def test_topk_sends_ceil_ratio_times_numel(ratio, numel, k):
    g = np.arange(1.0, numel + 1.0)
    sim = Simulator(1, TopK(ratio, dense_below=0))
    sent = sim.step({"w": [g]})["w"]  # one rank: its average is what it sent
    assert sim.values_sent_per_rank == [k], f"ratio {ratio} of {numel} elements must send {k}"
    # the k largest of 1..numel are the last k
    np.testing.assert_array_equal(sent, np.where(np.arange(numel) >= numel - k, g, 0))
    np.testing.assert_array_equal(sim.residuals("w")[0], np.where(np.arange(numel) < numel - k, g, 0))


# --------------------------------------------------------------------------- #
# Top-k
# --------------------------------------------------------------------------- #
def test_topk_ties_go_to_lower_index_and_residual_over_two_steps():
    sim = Simulator(1, TopK(0.3, dense_below=0))  # d = 6 -> k = ceil(1.8) = 2
    # step 1: a = g1, |a| = [.25, 3, 2, 2, .5, 2]; largest is 3 (index 1), then a tie
    # at 2 among indices {2, 3, 5}: the lowest index, 2, wins.
    g1 = arr(0.25, -3, 2, -2, 0.5, 2)
    np.testing.assert_array_equal(sim.step({"w": [g1]})["w"], [0, -3, 2, 0, 0, 0])
    # residual: a with a[S] zeroed
    np.testing.assert_array_equal(sim.residuals("w")[0], [0.25, 0, 0, -2, 0.5, 2])

    # step 2: a = g2 + r = [1.25, 0, 0, -1, 0.5, 1]; largest 1.25 (index 0), then a
    # tie at 1 between indices 3 and 5: index 3 wins.
    g2 = arr(1, 0, 0, 1, 0, -1)
    np.testing.assert_array_equal(sim.step({"w": [g2]})["w"], [1.25, 0, 0, -1, 0, 0])
    np.testing.assert_array_equal(sim.residuals("w")[0], [0, 0, 0, 0, 0.5, 1])


def test_topk_selects_by_magnitude():
    # |a| = [1, 3, 5, 0], k = ceil(0.5 * 4) = 2: the entries 3 and 5 are sent, 1 stays behind
    sim = Simulator(1, TopK(0.5, dense_below=0))
    np.testing.assert_array_equal(sim.step({"w": [arr(1, 3, 5, 0)]})["w"], [0, 3, 5, 0])
    np.testing.assert_array_equal(sim.residuals("w")[0], [1, 0, 0, 0])


def test_topk_residual_keeps_shape_of_tensor():
    sim = Simulator(1, TopK(0.25, dense_below=0))  # d = 4 -> k = 1
    sent = sim.step({"m": [arr(1, -4, 2, 3).reshape(2, 2)]})["m"]  # sends -4 (flat index 1)
    np.testing.assert_array_equal(sent, [[0, -4], [0, 0]])
    np.testing.assert_array_equal(sim.residuals("m")[0], [[1, 0], [2, 3]])


def exchanged(compressor, grads, average):
    """Every rank's result of one bucket exchange of ``{name: [grad of rank 0, ...]}`` on thread
    ranks (``average=False``: the sum over ranks, as the DDP hook asks for)."""
    size = len(next(iter(grads.values())))

    def work(comm):
        exchange = open_exchange(copy.deepcopy(compressor), comm, "bucket")
        for name, per_rank in grads.items():
            exchange.add(name, per_rank[comm.rank])
        exchange.launch()
        return exchange.finish(average=average)

    return run_ranks(size, work)


def test_sparse_exchange_average_and_sum():
    topk = TopK(0.3, dense_below=0)  # d = 6 -> k = 2
    # rank 0 sends {1: -3, 2: 2} (|0.5|, |0.25| stay), rank 1 sends {2: 4, 5: 1} (|0.5| stays)
    g0, g1 = arr(0.5, -3, 2, 0, 0, 0.25), arr(0, 0, 4, 0.5, 0, 1)
    # sum = [0, -3, 6, 0, 0, 1]; average over 2 ranks = [0, -1.5, 3, 0, 0, 0.5]
    np.testing.assert_array_equal(Simulator(2, topk).step({"w": [g0, g1]})["w"], [0, -1.5, 3, 0, 0, 0.5])
    shaped = {"w": [g0.reshape(2, 3), g1.reshape(2, 3)]}
    for result in exchanged(topk, shaped, average=False):
        np.testing.assert_array_equal(result["w"], [[0, -3, 6], [0, 0, 1]])


def test_sparse_bytes_per_step():
    # each rank sends k values and k indices, and one flag entry per compressed tensor in each
    # (the module docstring of hvd_compress.algorithms.sparse_bucket): d = 1000, ratio 0.01 -> k = 10
    g = np.linspace(-1, 1, 1000, dtype=np.float32)
    for dtype, value_bytes in ((np.float32, 4), (f64, 8)):
        sim = Simulator(1, TopK(0.01, dense_below=0))
        sim.step({"w": [g.astype(dtype)]})  # the first step also checks the layout with every rank
        sim.step({"w": [g.astype(dtype)]})
        # (10 + 1) * (value bytes + 4-byte int32 index): 88 for float32, 132 for float64
        assert sim.bytes_sent_per_rank == [11 * (value_bytes + 4)]
        assert sim.values_sent_per_rank == [10]


def test_small_tensors_go_dense_by_default():
    g = np.ones(1023, dtype=np.float32)  # below the default threshold of 1024 elements
    sim = Simulator(1, TopK(0.01))
    sim.step({"bias": [g]})
    assert sim.values_sent_per_rank == [1023]
    sim.step({"bias": [g]})  # after the first step's layout check: one allreduce of the whole tensor
    assert [(kind, nbytes) for _, kind, nbytes in sim.collectives_per_rank[0]] == [("allreduce", 1023 * 4)]
    sim = Simulator(1, TopK(0.01))
    sim.step({"w": [np.ones(1024, np.float32)]})
    assert sim.values_sent_per_rank == [11]  # ceil(10.24): sparse


# --------------------------------------------------------------------------- #
# Gaussian-k
# --------------------------------------------------------------------------- #
# Phi^-1(0.975) = 1.959963984540054 (the familiar 95% two-sided z value)
Z_975 = 1.959963984540054
# P(|Z| > 1) = 2 (1 - Phi(1)) = 0.31731050786291415, so Phi^-1(1 - ratio/2) = 1 for this ratio
RATIO_Z1 = 0.31731050786291415


def test_gaussiank_threshold_formula_population_std():
    # a = [1, 3, 1, 3]: mean 2, population std 1 (sample std would be sqrt(4/3) = 1.1547)
    # thr = |2| + 1 * 1.95996 = 3.95996
    a = arr(1, 3, 1, 3)
    assert reference.gaussiank_threshold(a, 0.05) == pytest.approx(2 + Z_975, abs=1e-9)
    # negative mean: |mu| keeps the threshold positive -> same value
    assert reference.gaussiank_threshold(-a, 0.05) == pytest.approx(2 + Z_975, abs=1e-9)
    # thr = 2 + 1 * 1 = 3
    assert reference.gaussiank_threshold(a, RATIO_Z1) == pytest.approx(3.0, abs=1e-9)


def test_gaussiank_end_to_end_on_tiny_vector():
    # a = [1, 3, 1, 3], ratio 0.05 -> k = ceil(0.2) = 1; 2k/3 = 0.67, 4k/3 = 1.33
    # eval 1: thr = 3.96 -> none pass (0 < 0.67) -> thr = 1.98
    # eval 2: |a| > 1.98 -> {1, 3} (2 > 1.33) -> thr = 2.97
    # eval 3: |a| > 2.97 -> {1, 3} (still too many, and evaluations are exhausted)
    # -> the smallest set above 4k/3, {1, 3}, is cut to its first k = 1 index -> {1}
    sim = Simulator(1, GaussianK(0.05, dense_below=0))
    np.testing.assert_array_equal(sim.step({"w": [arr(1, 3, 1, 3)]})["w"], [0, 3, 0, 0])
    np.testing.assert_array_equal(sim.residuals("w")[0], [1, 0, 1, 3])


def _with_magnitudes(numel, groups):
    """A vector of ``numel`` entries, 0.1 by default, with ``{magnitude: count}`` placed first.

    Signs alternate so that the mean stays small; magnitudes are what the selection sees.
    """
    a = np.full(numel, 0.1)
    pos = 0
    for magnitude, count in groups:
        a[pos : pos + count] = magnitude
        pos += count
    a[1::2] *= -1
    return a


@pytest.fixture
def fixed_first_threshold(monkeypatch):
    """Pin the first threshold so the correction loop alone decides the selection."""

    def pin(value):
        monkeypatch.setattr(reference, "gaussiank_threshold", lambda a, ratio: value)

    return pin


# Below: d = 30, ratio 0.2 -> k = 6; the loop accepts counts in [2k/3, 4k/3] = [4, 8].
def test_gaussiank_halves_threshold_when_too_few(fixed_first_threshold):
    fixed_first_threshold(8.0)
    a = _with_magnitudes(30, [(9, 3), (4.5, 1), (3.9, 1)])
    # eval 1: thr 8 -> 3 entries (< 4) -> thr 8 * 0.5 = 4
    # eval 2: thr 4 -> the three 9s and 4.5 = 4 entries: in range, sent.
    # (a factor 0.6 would give thr 4.8 -> 3, then 2.88 -> 5 entries; 0.4 -> 3.2 -> 5 entries)
    np.testing.assert_array_equal(reference_gaussiank(a, 0.2), [0, 1, 2, 3])


def test_gaussiank_grows_threshold_when_too_many(fixed_first_threshold):
    fixed_first_threshold(1.0)
    a = _with_magnitudes(30, [(1.6, 5), (1.55, 2), (1.4, 10)])
    # eval 1: thr 1 -> 17 entries (> 8) -> thr 1 * 1.5 = 1.5
    # eval 2: thr 1.5 -> five 1.6s and two 1.55s = 7 entries: in range, sent.
    # (a factor 1.25 would give 1.25 -> 17, then 1.5625 -> 5 entries)
    np.testing.assert_array_equal(reference_gaussiank(a, 0.2), np.arange(7))


def test_gaussiank_at_most_three_evaluations_last_set_sent(fixed_first_threshold):
    fixed_first_threshold(8.0)
    a = _with_magnitudes(30, [(9, 1), (3, 2), (1.5, 3)])
    # eval 1: thr 8 -> {9} = 1 -> thr 4
    # eval 2: thr 4 -> {9} = 1 -> thr 2
    # eval 3: thr 2 -> {9, 3, 3} = 3, still < 4, but no fourth evaluation: these 3 are sent
    # (a 4th evaluation at thr 1 would send 6 entries; stopping after 2 would send 1)
    np.testing.assert_array_equal(reference_gaussiank(a, 0.2), [0, 1, 2])


@pytest.mark.parametrize("count", [4, 8])  # exactly 2k/3 and exactly 4k/3 are accepted
def test_gaussiank_bounds_are_inclusive(fixed_first_threshold, count):
    fixed_first_threshold(1.0)
    a = _with_magnitudes(30, [(2, count), (0.5, 10)])
    np.testing.assert_array_equal(reference_gaussiank(a, 0.2), np.arange(count))


def test_gaussiank_threshold_is_strict(fixed_first_threshold):
    fixed_first_threshold(2.0)
    # 6 entries equal to the threshold (not > thr) and 5 above it: only the 5 pass (5 in [4, 8])
    a = _with_magnitudes(30, [(3, 5), (2, 6)])
    np.testing.assert_array_equal(reference_gaussiank(a, 0.2), np.arange(5))


def test_gaussiank_class_uses_the_loop(fixed_first_threshold):
    fixed_first_threshold(8.0)
    a = _with_magnitudes(30, [(9, 3), (4.5, 1), (3.9, 1)])
    sim = Simulator(1, GaussianK(0.2, dense_below=0))  # same as the halving case
    sent = sim.step({"w": [a]})["w"]
    np.testing.assert_array_equal(sent, np.where(np.arange(30) < 4, a, 0))
    np.testing.assert_array_equal(sim.residuals("w")[0], np.where(np.arange(30) < 4, 0, a))


# --------------------------------------------------------------------------- #
# RegTop-k
# --------------------------------------------------------------------------- #
def test_regtopk_score():
    a = arr(2, -3, 4, -1)
    distortion = arr(-1, 1e8, 3, 0)
    mu = 4.0
    # score = |tanh((1 + D) / mu)| * |a|
    # j=0: tanh(0) * 2 = 0;  j=1: tanh(~2.5e7) = 1 -> 3;  j=2: tanh(1) * 4;  j=3: tanh(0.25) * 1
    expected = [0.0, 3.0, math.tanh(1.0) * 4, math.tanh(0.25)]
    np.testing.assert_allclose(reference.regtopk_scores(a, distortion, mu), expected, rtol=1e-15)
    # D = -3: tanh(-0.5) is negative; the absolute value makes the score positive
    assert reference.regtopk_scores(arr(2), arr(-3), 4.0)[0] == pytest.approx(2 * math.tanh(0.5))


def test_regtopk_distortion_update():
    # d = 4, ratio 0.5 -> k = 2. Rank 0 sends 2 at 0 and 0 at 1 (the tie of zeros to the lower index);
    # rank 1 sends 3 at 0 and 4 at 3: T = [5, 0, 0, 4]. Rank 0: j=0: (5 - 2) / 2 = 1.5; j=1 sent a value
    # of exactly 0: no information -> 1e8; not sent: 1e8. Rank 1: j=0: (5 - 3) / 3; j=3: (4 - 4) / 4 = 0.
    sim = Simulator(2, RegTopK(0.5, dense_below=0, dense_when_cheaper=False))
    sim.step({"w": [arr(2, 0, 0, 0), arr(3, 0.25, -1, 4)]})
    np.testing.assert_array_equal(sim.compressors[0].distortion("w"), [1.5, 1e8, 1e8, 1e8])
    np.testing.assert_array_equal(sim.compressors[1].distortion("w"), [2 / 3, 1e8, 1e8, 0])


def test_regtopk_two_ranks_two_steps_in_simulator():
    # d = 4, ratio 0.5 -> k = 2, mu = 4; both steps use the same gradients.
    g0, g1 = arr(4, 3, 0, 1), arr(-4, 1, 2, 0)
    sim = Simulator(2, RegTopK(0.5, mu=4.0, dense_below=0, dense_when_cheaper=False))

    # step 1 (D = 1e8: plain Top-k): rank 0 sends {0: 4, 1: 3}, rank 1 sends {0: -4, 2: 2}
    # T = [0, 3, 2, 0]; average = [0, 1.5, 1, 0]
    out1 = sim.step({"w": [g0, g1]})["w"]
    np.testing.assert_array_equal(out1, [0, 1.5, 1, 0])
    # D rank 0: j=0: (0 - 4) / 4 = -1, j=1: (3 - 3) / 3 = 0;  rank 1: j=0: (0 + 4) / -4 = -1,
    # j=2: (2 - 2) / 2 = 0;  1e8 elsewhere. Residuals r0 = [0, 0, 0, 1], r1 = [0, 1, 0, 0].
    d0, d1 = (c.distortion("w") for c in sim.compressors)
    np.testing.assert_array_equal(d0, [-1, 0, 1e8, 1e8])
    np.testing.assert_array_equal(d1, [-1, 1e8, 0, 1e8])

    # step 2, rank 0: a = [4, 3, 0, 2]; scores: j0 tanh(0)*4 = 0, j1 tanh(1/4)*3 = 0.73,
    #   j2 0, j3 1*2 = 2 -> sends {1: 3, 3: 2} (Top-k would send {0, 1}); r0 = [4, 0, 0, 0]
    # rank 1: a = [-4, 2, 2, 0]; scores: j0 0, j1 1*2 = 2, j2 tanh(1/4)*2 = 0.49, j3 0
    #   -> sends {1: 2, 2: 2}; r1 = [-4, 0, 0, 0]
    # T = [0, 5, 2, 2]; average = [0, 2.5, 1, 1]
    out2 = sim.step({"w": [g0, g1]})["w"]
    np.testing.assert_array_equal(out2, [0, 2.5, 1, 1])
    r0, r1 = sim.residuals("w")
    np.testing.assert_array_equal(r0, [4, 0, 0, 0])
    np.testing.assert_array_equal(r1, [-4, 0, 0, 0])
    # D rank 0: j1 (5 - 3) / 3 = 2/3, j3 (2 - 2) / 2 = 0; rank 1: j1 (5 - 2) / 2 = 1.5, j2 0
    d0, d1 = (c.distortion("w") for c in sim.compressors)
    np.testing.assert_allclose(d0, [1e8, 2 / 3, 1e8, 0], rtol=1e-15)
    np.testing.assert_array_equal(d1, [1e8, 1.5, 0, 1e8])


def test_regtopk_zero_sent_value_gives_no_distortion():
    # g = [3, 0, 0, 0], k = 2: sends index 0 (3) and, by the tie rule, index 1 (value 0)
    sim = Simulator(1, RegTopK(0.5, dense_below=0))
    np.testing.assert_array_equal(sim.step({"w": [arr(3, 0, 0, 0)]})["w"], [3, 0, 0, 0])  # one rank: T
    # j=0: (3 - 3) / 3 = 0; j=1 sent exactly 0 -> 1e8; others not sent -> 1e8
    np.testing.assert_array_equal(sim.compressors[0].distortion("w"), [0, 1e8, 1e8, 1e8])


# --------------------------------------------------------------------------- #
# TernGrad
# --------------------------------------------------------------------------- #
def test_terngrad_codes_with_given_uniforms():
    g = arr(0.5, -0.25, 0, 1.0, -1.0)
    u = arr(0.4, 0.3, 0.9, 0.999, 0.0)
    # S = 1: p = |g| / S = [.5, .25, 0, 1, 1]; keep u < p = [T, F, F, T, T]; t = sign(g) * keep
    np.testing.assert_array_equal(reference.terngrad_codes(g, 1.0, u), [1, 0, 0, 1, -1])
    # S = 2: p = [.25, .125, 0, .5, .5]; keep = [F, F, F, F, T]
    np.testing.assert_array_equal(reference.terngrad_codes(g, 2.0, u), [0, 0, 0, 0, -1])
    # S = 0 (all-zero gradient): all-zero codes
    np.testing.assert_array_equal(reference.terngrad_codes(np.zeros(3), 0.0, arr(0, 0, 0)), [0, 0, 0])
    assert reference.terngrad_codes(g, 1.0, u).dtype == np.int8


def test_terngrad_draws_from_its_rank_stream():
    # rank 1 of 4 with seed 3 draws u = default_rng([3, 1]).random(d, float32)
    g = np.linspace(-1, 1, 50)
    # rank 0 sets the shared scale S = max over ranks of max|g| = 2 with its entry 0 (p = 2 / 2 = 1:
    # always coded +1); ranks 2 and 3 send zeros (p = 0: codes 0)
    lead = np.zeros(50)
    lead[0] = 2.0
    u = np.random.default_rng([3, 1]).random(50, dtype=np.float32).astype(f64)
    codes = np.sign(g) * (u < np.abs(g) / 2.0)
    codes[0] += 1  # rank 0's code
    sim = Simulator(4, TernGrad(clip=None, dense_below=0), seed=3)
    out = sim.step({"w": [lead, g, np.zeros(50), np.zeros(50)]})["w"]
    np.testing.assert_array_equal(out, 2.0 * codes / 4)  # S * sum of codes / N


def test_terngrad_clipping_at_c_std():
    # g = nine zeros and one 10: mean 1, population variance (9 * 1 + 81) / 10 = 9, std 3
    # bound c * std = 2.5 * 3 = 7.5 -> clipped max |g| = 7.5
    g = arr(*([0] * 9 + [10]))
    # the clipped entry has p = 7.5 / 7.5 = 1: always coded +1 (-1 for -g); zeros always 0;
    # one rank sends S * codes; unclipped, S = 10
    for clip, grad, expected in ((2.5, g, 7.5), (2.5, -g, -7.5), (None, g, 10.0)):
        sent = Simulator(1, TernGrad(clip=clip, dense_below=0)).step({"w": [grad]})["w"]
        np.testing.assert_allclose(sent, [0] * 9 + [expected], rtol=1e-15)


@pytest.mark.parametrize(
    "world_size, bits, per_lane",
    [
        (1, 2, 16),  # ceil(log2(3)) = 2 bits, floor(32 / 2) = 16 codes per int32
        (2, 3, 10),  # ceil(log2(5)) = 3, floor(32 / 3) = 10
        (3, 3, 10),  # ceil(log2(7)) = 3
        (4, 4, 8),  # ceil(log2(9)) = 4, 8 per lane
        (7, 4, 8),  # ceil(log2(15)) = 4
        (8, 5, 6),  # ceil(log2(17)) = 5, floor(32 / 5) = 6
        (16, 6, 5),  # ceil(log2(33)) = 6, floor(32 / 6) = 5
    ],
)
def test_ternary_field_width(world_size, bits, per_lane):
    assert wire.ternary_field_bits(world_size) == bits
    assert wire.ternary_codes_per_lane(world_size) == per_lane


def test_pack_ternary_lane_values():
    codes = np.array([1, 0, -1], np.int8)  # fields t + 1 = [2, 1, 0]
    # N = 1: 2-bit fields: 2 + (1 << 2) + (0 << 4) = 6
    np.testing.assert_array_equal(reference.pack_ternary(codes, 1), [6])
    # N = 2: 3-bit fields: 2 + (1 << 3) = 10
    np.testing.assert_array_equal(reference.pack_ternary(codes, 2), [10])
    # two ranks [1, 0, -1] and [1, 1, 1]: lanes 10 and 2 + 2*8 + 2*64 = 146, sum 156 = 0b010_011_100
    # fields [4, 3, 2] - N = [2, 1, 0] = code sums [1 + 1, 0 + 1, -1 + 1]
    other = reference.pack_ternary(np.array([1, 1, 1], np.int8), 2)
    np.testing.assert_array_equal(other, [146])
    total = reference.sum_int32_wrapping([reference.pack_ternary(codes, 2), other])
    np.testing.assert_array_equal(total, [156])
    np.testing.assert_array_equal(reference.unpack_ternary_sum(total, 3, 2), [2, 1, 0])


def test_pack_ternary_lane_count():
    # N = 1: 16 codes per lane -> 16 codes fill 1 lane, 17 need 2
    assert reference.pack_ternary(np.zeros(16, np.int8), 1).shape == (1,)
    assert reference.pack_ternary(np.zeros(17, np.int8), 1).shape == (2,)
    # N = 16: 5 per lane -> 11 codes need 3 lanes
    assert reference.pack_ternary(np.zeros(11, np.int8), 16).shape == (3,)
    assert reference.pack_ternary(np.zeros(11, np.int8), 16).dtype == np.int32


def test_pack_ternary_uses_all_32_bits_and_wraps():
    # N = 1, 16 codes of +1: every 2-bit field holds 2 -> 0b1010...10 = 0xAAAAAAAA,
    # which as int32 is 0xAAAAAAAA - 2**32 = -1431655766
    np.testing.assert_array_equal(reference.pack_ternary(np.ones(16, np.int8), 1), [-1431655766])
    # N = 4, 8 codes of +1 per rank: lane 0x22222222 each; 4 ranks sum to 0x88888888,
    # beyond int32: wraps to 0x88888888 - 2**32 = -2004318072; fields 8 - N = 4 each
    lanes = [reference.pack_ternary(np.ones(8, np.int8), 4) for _ in range(4)]
    np.testing.assert_array_equal(lanes[0], [0x22222222])
    total = reference.sum_int32_wrapping(lanes)
    np.testing.assert_array_equal(total, [-2004318072])
    np.testing.assert_array_equal(reference.unpack_ternary_sum(total, 8, 4), [4] * 8)


@pytest.mark.parametrize("world_size", [1, 2, 4, 16])
@pytest.mark.parametrize("code", [-1, 0, 1])
def test_pack_ternary_extremes(world_size, code):
    # all ranks send the same code: every field sums to N * (code + 1), the sum is N * code
    numel = 37  # not a multiple of any codes-per-lane: exercises the padded last lane
    lanes = [reference.pack_ternary(np.full(numel, code, np.int8), world_size) for _ in range(world_size)]
    total = reference.sum_int32_wrapping(lanes)
    np.testing.assert_array_equal(
        reference.unpack_ternary_sum(total, numel, world_size), [world_size * code] * numel
    )


def test_two_bit_packing():
    codes = np.array([1, 0, -1, 1, -1], np.int8)
    # fields t + 1 = [2, 1, 0, 2 | 0]; byte 0 = 2 + (1 << 2) + (0 << 4) + (2 << 6) = 134,
    # as int8 134 - 256 = -122; byte 1 = 0
    packed = reference.pack_two_bit(codes)
    np.testing.assert_array_equal(packed, [-122, 0])
    assert packed.dtype == np.int8
    np.testing.assert_array_equal(reference.unpack_two_bit(packed, 5), codes)
    assert wire.two_bit_bytes(5) == 2


@pytest.mark.parametrize(
    "numel, world_size, fmt",
    [
        # N * 2-bit bytes < 2 * packed bytes -> allgather
        (64, 1, "allgather"),  # 1 * 16 < 2 * (4 lanes * 4 B = 16) = 32
        (60, 2, "allgather"),  # 2 * 15 = 30 < 2 * (6 lanes * 4 B) = 48
        (60, 3, "allgather"),  # 3 * 15 = 45 < 48
        (64, 4, "allreduce"),  # 4 * 16 = 64, not < 2 * (8 lanes * 4 B) = 64
        (64, 16, "allreduce"),  # 16 * 16 = 256 >= 2 * (13 lanes * 4 B) = 104
    ],
)
def test_ternary_wire_format(numel, world_size, fmt):
    assert wire.ternary_wire_format(numel, world_size) == fmt


def codes_collectives(sim):
    """``(kind, bytes)`` of each collective of the last step that carried TernGrad's codes."""
    return [(kind, nbytes) for name, kind, nbytes in sim.collectives_per_rank[0]
            if name.endswith(("lanes", "codes2bit"))]


def test_ternary_codes_bytes_and_format():
    g = [np.linspace(-1, 1, 64) * (r + 1) for r in range(4)]
    # N = 4 shared scale: allreduce of ceil(64 / 8) = 8 int32 lanes = 32 bytes
    shared = Simulator(4, TernGrad(dense_below=0))
    shared.step({"w": g})
    assert codes_collectives(shared) == [("allreduce", 32)]
    # without a shared scale every rank's 2-bit codes are gathered: 64 / 4 = 16 bytes
    own = Simulator(4, TernGrad(dense_below=0, scalar_sharing=False))
    own.step({"w": g})
    assert codes_collectives(own) == [("allgather", 16)]


def test_terngrad_shared_and_own_scales():
    # entries equal to the scale in magnitude (p = 1) or 0 (p = 0) give codes that no draw changes
    g0, g1 = arr(2, 0, -2, 2), arr(2, 2, -2, 0)  # shared S = 2: codes [1, 0, -1, 1] and [1, 1, -1, 0]
    shared = TernGrad(clip=None, dense_below=0)
    # S * sum t = 2 * [2, 1, -2, 1] = [4, 2, -4, 2]; average over 2 ranks = [2, 1, -2, 1]
    np.testing.assert_array_equal(Simulator(2, shared).step({"w": [g0, g1]})["w"], [2, 1, -2, 1])
    for result in exchanged(shared, {"w": [g0, g1]}, average=False):
        np.testing.assert_array_equal(result["w"], [4, 2, -4, 2])
    # own scales 1 and 3: [1, 0, -1, 1] + 3 * [1, 1, -1, 0] = [4, 3, -4, 1]; / 2 = [2, 1.5, -2, .5]
    own = TernGrad(clip=None, dense_below=0, scalar_sharing=False)
    out = Simulator(2, own).step({"w": [arr(1, 0, -1, 1), arr(3, 3, -3, 0)]})["w"]
    np.testing.assert_array_equal(out, [2, 1.5, -2, 0.5])


# --------------------------------------------------------------------------- #
# FP16 and None
# --------------------------------------------------------------------------- #
def test_fp16_exchange():
    g0 = arr(1, 2.5, 0.1, dtype=np.float32)
    g1 = arr(3, -0.5, 0.1, dtype=np.float32)
    sim = Simulator(2, FP16())
    sim.step({"w": [g0, g1]})
    out = sim.step({"w": [g0, g1]})["w"]  # the second step: no layout check
    assert sim.bytes_sent_per_rank == [3 * 2, 3 * 2]
    # float16(0.1): 0.1 = 1.6 * 2**-4, mantissa round(0.6 * 1024) = 614 -> (1024 + 614) / 1024 / 16
    fp16_tenth = (1024 + 614) / 1024 / 16  # = 0.0999755859375
    assert out.dtype == np.float32  # back in the gradient's dtype
    np.testing.assert_array_equal(out, np.array([2, 1, fp16_tenth], np.float32))


def test_none_exchange():
    g0, g1 = arr(1, -2, 0.5), arr(3, 4, 0.25)
    sim = Simulator(2, NoneCompressor())
    sim.step({"w": [g0, g1]})
    out = sim.step({"w": [g0, g1]})["w"]
    assert sim.bytes_sent_per_rank == [3 * 8, 3 * 8]
    np.testing.assert_array_equal(out, [2, 1, 0.375])
    assert out.dtype == f64
    for result in exchanged(NoneCompressor(), {"w": [g0, g1]}, average=False):
        np.testing.assert_array_equal(result["w"], [4, 2, 0.75])
