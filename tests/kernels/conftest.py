"""Fixtures of the kernel tests: ``K``, the kernel module under test, and ``numpy_draws``."""

import numpy as np
import pytest

from tests.kernels.frameworks import NAMES, framework


@pytest.fixture(scope="session", params=NAMES)
def K(request):
    """The kernel module under test (``frameworks.py``); a module narrows it with an indirect
    ``parametrize("K", ...)``. Session-scoped: pytest then runs every test of one framework
    before the next, in all modules (torch's and TF's thread pools do not take turns)."""
    return framework(request.param)


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

    def uniform_into(rng, out):  # the engine's draws (TernGrad's bucket codec), into ``out`` where it is mutable
        drawn = K.tensor(rng.random(out.shape[0], dtype=np.float32))
        return out.copy_(drawn) if hasattr(out, "copy_") else drawn

    monkeypatch.setattr(K.ops, "uniform_into", uniform_into)


@pytest.fixture(autouse=True)
def framework_kernels(request, monkeypatch):
    """Compressors called on the framework's tensors run its kernels: eager TensorFlow CPU tensors,
    which the library computes on as numpy arrays (``tf_ops.host_array``), stay TensorFlow tensors
    here, so these tests check the kernels a graph or a GPU runs."""
    if "K" in request.fixturenames:
        K = request.getfixturevalue("K")
        if K.name == "tf":
            monkeypatch.setattr(K.ops, "host_array", lambda a: a)
