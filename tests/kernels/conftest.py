"""Fixtures of the kernel tests; ``K`` (the kernel module under test) is each test module's own."""

import numpy as np
import pytest


@pytest.fixture
def numpy_draws(K, monkeypatch):
    """The kernels drawing numpy's stream (``default_rng([seed, rank])``): TernGrad then sees
    the reference's uniforms, so the whole path is bit-exact."""
    monkeypatch.setattr(K.ops, "generator", lambda seed, rank, like: np.random.default_rng([seed, rank]))
    monkeypatch.setattr(
        K.ops,
        "uniform",
        lambda rng, like: K.ops.cast(K.tensor(rng.random(like.shape[0], dtype=np.float32)), like.dtype),
    )
