"""What only the torch kernels are tested for (the shared tests: ``test_kernels.py``).

* The Simulator fed torch tensors against the Simulator fed numpy arrays on small
  hypothesis-drawn runs (ties, zeros, subnormals): TensorFlow flushes subnormal floats to
  zero on CPU, so its kernels match numpy on normal numbers only (the shared tests draw those).
* TernGrad's estimate on torch is unbiased: 4000 draws, through torch's own random stream.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress import TernGrad
from tests.helpers import permille, training_runs
from tests.kernels.frameworks import FLOATS_32_64, framework
from tests.kernels.frameworks import given_per_framework as given
from tests.kernels.test_kernels import E2E, assert_simulators_agree, run_both


@pytest.fixture(params=["torch-cpu", "torch-cuda"])
def K(request):
    return framework(request.param)


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@pytest.mark.parametrize("kind", sorted(E2E))
@given("all", grads=training_runs(max_steps=6), p=permille)
def test_simulator_on_torch_equals_simulator_on_numpy(K, kind, dtype, grads, p):
    """Small vectors with many ties and zeros, several steps of error feedback."""
    assert_simulators_agree(K, *run_both(K, E2E[kind](p / 1000), grads.astype(dtype)))


@pytest.mark.parametrize("dtype", FLOATS_32_64)
def test_terngrad_torch_is_unbiased(dtype):
    """Mean of S * t over 4000 draws is within 5 standard errors of g, per entry
    (Var[S t_j] = S |g_j| - g_j^2; entries with zero variance must be exact)."""
    K = framework("torch-cpu")
    torch = K.torch
    draws = 4000
    g = torch.tensor([0.0, 1e-3, -0.25, 0.5, -0.9, 1.0, -1.0, 0.3, 0.01, -0.6], dtype=K.dtype(dtype))
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
