"""Sparsifiers send dense when N * k >= numel (a sparse allgather would move more bytes)."""

import warnings

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.wire import DensePayload, SparsePayload
from hvd_compress.simulator import Simulator

KINDS = [TopK, GaussianK, RegTopK]


def grads(n_ranks, numel, seed):
    rng = np.random.default_rng(seed)
    return {"w": [rng.standard_normal(numel) for _ in range(n_ranks)]}


@pytest.mark.parametrize("kind", KINDS)
def test_crowded_tensor_goes_dense_with_one_warning(kind):
    # 16 ranks x k = ceil(0.1 * 1100) = 110 -> 1760 >= 1100 elements
    sim = Simulator(16, kind(0.1))
    step = grads(16, 1100, 0)
    with pytest.warns(UserWarning, match="sends 'w' dense: 16 ranks x k = 110 >= 1100"):
        out = sim.step(step)["w"]
    np.testing.assert_allclose(out, np.mean(step["w"], axis=0), rtol=1e-12)
    assert sim.bytes_sent == 8 * 1100
    assert all(np.all(r == 0) for r in sim.residuals("w"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per tensor
        sim.step(grads(16, 1100, 1))


@pytest.mark.parametrize("kind", KINDS)
def test_switching_to_dense_flushes_the_residual(kind):
    """Sparse at ratio 0.01 (4 x 20 < 2000), then dense at 0.5: what was kept is sent then."""
    compressor = kind(0.01)
    sim = Simulator(4, compressor)
    first, second = grads(4, 2000, 0), grads(4, 2000, 1)
    sparse_out = sim.step(first)["w"]
    kept = [r.copy() for r in sim.residuals("w")]
    assert any(np.any(r != 0) for r in kept)
    for c in sim.compressors:
        c.ratio = 0.5
    with pytest.warns(UserWarning, match="dense"):
        dense_out = sim.step(second)["w"]
    expected = np.mean([g + r for g, r in zip(second["w"], kept)], axis=0)
    np.testing.assert_allclose(dense_out, expected, rtol=1e-12, atol=1e-15)
    total_in = np.sum(first["w"], axis=0) + np.sum(second["w"], axis=0)
    np.testing.assert_allclose(4 * (sparse_out + dense_out), total_in, rtol=1e-10, atol=1e-12)


def test_switch_can_be_turned_off_and_needs_several_ranks():
    assert isinstance(TopK(0.9, dense_below=0).encode(np.ones(10), "w"), SparsePayload)  # one rank
    off = TopK(0.1, dense_when_cheaper=False).bind(0, 16)
    assert isinstance(off.encode(np.ones(1100), "w"), SparsePayload)
    on = TopK(0.1).bind(0, 16)
    with pytest.warns(UserWarning):
        assert isinstance(on.encode(np.ones(1100), "w"), DensePayload)
