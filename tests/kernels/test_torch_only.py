"""What only the torch kernels are tested for (the shared tests: ``test_kernels.py``).

* The Simulator fed torch tensors against the Simulator fed numpy arrays on small
  hypothesis-drawn runs (ties, zeros, subnormals): TensorFlow flushes subnormal floats to
  zero on CPU, so its kernels match numpy on normal numbers only (the shared tests draw those);
  CUDA's scatter-adds flush subnormal sums, so there runs with a subnormal result are left out.
* Larger and costlier runs through the Simulator: every compressor keeps torch tensors on
  their device and dtype, float16 gradients, gradients of thousands of entries over 4 steps, TernGrad's decode for up to 16 ranks and both wire formats, TernGrad bit-exact
  with numpy's draws, a Simulator checkpoint of every rank's stream (TensorFlow runs the
  same compressors against numpy through the Simulator in the shared tests).
* TernGrad's estimate on torch is unbiased: 4000 draws, through torch's own random stream.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import Phase, assume
from hypothesis import strategies as st

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.kernels import reference as R
from hvd_compress.simulator import Simulator
from tests.helpers import ALL_COMPRESSORS, permille, training_runs
from tests.kernels.frameworks import FLOATS_32_64
from tests.kernels.frameworks import given_per_framework as given
from tests.kernels.test_kernels import E2E, assert_simulators_agree, run_both
from tests.oracle import PerTensorRanks


pytestmark = pytest.mark.parametrize("K", ["torch-cpu", "torch-cuda"], indirect=True)


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("kind", sorted(E2E))
@given("all", grads=training_runs(max_steps=6), p=permille)
def test_simulator_on_torch_equals_simulator_on_numpy(K, kind, dtype, grads, p):
    """Small vectors with many ties and zeros, several steps of error feedback. On CUDA, whose
    scatter-adds flush a subnormal sum to 0 (``torch_ops``; RegTop-k then learns ``D = -1`` from
    it), runs whose reference results hold a subnormal value are not compared."""
    sim_k, sim_np, outputs = run_both(K, E2E[kind](p / 1000), grads.astype(dtype))
    if K.flushes_subnormals:
        assume(not any(np.any((out != 0) & (np.abs(out) < np.finfo(out.dtype).tiny)) for _, out in outputs))
    assert_simulators_agree(K, sim_k, sim_np, outputs)


@pytest.mark.parametrize("dtype", FLOATS_32_64)
def test_terngrad_torch_is_unbiased(K, dtype):
    """Mean of S * t over 4000 draws is within 5 standard errors of g, per entry
    (Var[S t_j] = S |g_j| - g_j^2; entries with zero variance must be exact): ten values, each
    400 times in one tensor, over 10 steps of one rank."""
    torch = K.torch
    values = np.array([0.0, 1e-3, -0.25, 0.5, -0.9, 1.0, -1.0, 0.3, 0.01, -0.6], dtype=dtype)
    g = K.tensor(np.tile(values, 400))
    sim = Simulator(1, TernGrad(clip=None, dense_below=0, seed=11))
    sent = [sim.step({"w": [g]})["w"].to(torch.float64) for _ in range(10)]
    mean = K.numpy(torch.stack(sent).reshape(-1, 400, 10).mean(dim=(0, 1)))
    gn = values.astype(np.float64)
    scale = float(np.max(np.abs(gn)))
    stderr = np.sqrt((scale * np.abs(gn) - gn**2) / 4000)
    assert np.all(np.abs(mean - gn) <= 5 * stderr), (mean, gn, stderr)
    assert not torch.equal(sent[0], sent[1])  # the stream moves


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("kind", sorted(E2E))
@given(
    "all",
    options=dict(phases=[Phase.explicit, Phase.reuse, Phase.generate]),  # seeded data: shrinking is moot
    seed=st.integers(0, 2**32 - 1),
    n_ranks=st.integers(1, 4),
    p=st.integers(1, 300),
    numel=st.sampled_from([(40, 50), (3000,), (1500,)]),
)
def test_simulator_on_torch_equals_numpy_on_large_tensors(K, kind, dtype, seed, n_ranks, p, numel):
    """Gradients of a few thousand entries whose scale drifts, 4 steps (RegTop-k's D in use)."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(numel))
    grads = np.stack([rng.standard_normal((n_ranks, size)) * (1 + step) for step in range(4)])
    sim_k, sim_np, outputs = run_both(K, E2E[kind](p / 1000), grads.astype(dtype), numel)
    assert_simulators_agree(K, sim_k, sim_np, outputs)
    if kind == "regtopk":
        assert any(np.any(d < R.NO_DISTORTION) for d in (c.distortion("w") for c in sim_np.compressors))


@pytest.mark.parametrize("scalar_sharing", [True, False])
@pytest.mark.parametrize("n_ranks,numel", [(1, 1000), (2, 999), (3, 1001), (4, 2000), (8, 1000), (16, 333)])
def test_terngrad_decode_is_scale_times_code_sum_over_n(K, n_ranks, numel, scalar_sharing):
    """Both wire formats (packed int32 allreduce, 2-bit allgather) and per-rank scales."""
    rng = np.random.default_rng(n_ranks * numel)
    grads = [K.tensor((rng.standard_normal(numel) * (r + 1)).astype(np.float32)) for r in range(n_ranks)]
    make = lambda: TernGrad(clip=None, dense_below=0, scalar_sharing=scalar_sharing, seed=2)  # noqa: E731
    out = Simulator(n_ranks, make()).step({"w": grads})["w"]
    assert out.dtype == K.dtype(np.float32)
    want = PerTensorRanks(n_ranks, make()).step({"w": grads})["w"]
    K.assert_same(out, K.numpy(want), "the spec on torch's draws")


def test_terngrad_equals_numpy_given_the_same_uniforms(K, numpy_draws):
    """With the kernels drawing numpy's stream, the whole TernGrad path (scalar sharing,
    error feedback, packing, decode) is bit-exact against numpy."""
    grads = np.random.default_rng(4).standard_normal((4, 5, 1200)).astype(np.float32)
    for compressor in (
        TernGrad(clip=None, dense_below=0),
        TernGrad(clip=None, dense_below=0, error_feedback=True),
        TernGrad(clip=None, dense_below=0, scalar_sharing=False, error_feedback=True),
    ):
        assert_simulators_agree(K, *run_both(K, compressor, grads))


N_RANKS = 3


def framework_grads(K, step: int):
    rng = np.random.default_rng(100 + step)
    return {
        "conv.weight": [
            K.tensor(rng.standard_normal((8, 25)).astype(np.float32) * np.float32(1 + 0.1 * step))
            for _ in range(N_RANKS)
        ],
        "fc.bias": [K.tensor(rng.standard_normal(7).astype(np.float32)) for _ in range(N_RANKS)],
    }


def test_terngrad_simulator_generators_are_in_the_checkpoint(K):
    """A Simulator's checkpoint holds every rank's stream; restored, step 3 is the same
    (the restore-and-continue round trip of every compressor: tests/compressors/test_state.py)."""

    def run(sim, steps):
        return [sim.step(framework_grads(K, step)) for step in steps]

    sim = Simulator(N_RANKS, TernGrad(dense_below=0), seed=5)
    run(sim, range(1, 3))
    state = pickle.loads(pickle.dumps(sim.state_dict()))
    generators = state["ranks"][0]["generators"]
    assert set(generators) == {K.ops.__name__}
    assert isinstance(generators[K.ops.__name__], K.generator_state_type)
    expected = run(sim, [3])

    restored = Simulator(N_RANKS, TernGrad(dense_below=0), seed=5)
    fresh = run(Simulator(N_RANKS, TernGrad(dense_below=0), seed=5), [3])
    restored.load_state_dict(state)
    for out_got, out_want in zip(run(restored, [3]), expected, strict=True):
        assert out_got.keys() == out_want.keys()
        for name in out_want:
            K.assert_same(out_got[name], K.numpy(out_want[name]), name)
    # guard: without the restored stream the same step differs
    assert not np.array_equal(K.numpy(fresh[0]["conv.weight"]), K.numpy(expected[0]["conv.weight"]))


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
@pytest.mark.parametrize("dtype", FLOATS_32_64)
def test_compressors_keep_torch_tensors_on_their_device(K, kind, dtype):
    sim = Simulator(3, ALL_COMPRESSORS[kind](), seed=1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grads = [K.tensor(rng.standard_normal((6, 50)).astype(dtype)) for _ in range(3)]
        out = sim.step({"w": grads})["w"]
        assert K.is_tensor(out)
        assert K.device_of(out) == K.device_of(grads[0])
        assert out.dtype == K.dtype(dtype) and out.shape == (6, 50)
        for residual in sim.residuals("w"):
            if residual is not None:
                assert K.device_of(residual) == K.device_of(grads[0]) and residual.dtype == K.dtype(dtype)
                assert residual.shape == (6, 50)


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
def test_simulator_on_torch_equals_numpy_for_float16(K, compressor):
    grads = np.random.default_rng(0).standard_normal((3, 4, 700)).astype(np.float16)
    assert_simulators_agree(K, *run_both(K, compressor, grads))


def test_host_counter_stream_draws_uniforms_independent_across_calls_and_ranks(K):
    """The host's counter stream: successive calls of one size (a tensor's steps) and two ranks' calls are
    uncorrelated entry by entry and fill 64 bins evenly (chi-square), and no call repeats another shifted."""
    like = K.tensor(np.zeros(200_000, dtype=np.float32))
    if not K.ops.on_host(like):
        pytest.skip("the counter stream is the host's")
    streams = [K.ops.generator(11, rank, like) for rank in (0, 1)]
    calls = [K.numpy(K.ops.uniform(streams[0], like)) for _ in range(3)] + [K.numpy(K.ops.uniform(streams[1], like))]
    n, sigma = like.shape[0], 1 / np.sqrt(like.shape[0])
    for u in calls:
        counts = np.bincount((u * 64).astype(np.int64), minlength=64)
        chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
        assert chi2 < 63 + 6 * np.sqrt(2 * 63)  # 63 degrees of freedom, 6 sigma
    for x, y in [(calls[0], calls[1]), (calls[1], calls[2]), (calls[0], calls[3])]:
        assert abs(np.corrcoef(x, y)[0, 1]) < 6 * sigma
        assert len(np.intersect1d(x[:1000], y)) < 30  # 2^24 values: about 12 coincide by chance
