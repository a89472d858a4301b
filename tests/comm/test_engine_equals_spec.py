"""The engine (the Simulator: every route's bucket engine in lockstep) against the independent numpy spec
(:mod:`spec`, through :class:`tests.oracle.PerTensorRanks`): averages, residuals and velocities bit for
bit, for every built-in algorithm and option that changes the arithmetic, in float16, float32 and
float64, on one rank and on three (where ``N k`` decides what goes dense)."""

import warnings

import numpy as np
import pytest

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.simulator import Simulator
from tests.oracle import PerTensorRanks

COMPRESSORS = {
    "topk": lambda: TopK(0.05, dense_below=100),
    "topk-momentum": lambda: TopK(0.05, dense_below=100, momentum=0.9),
    "topk-no-feedback": lambda: TopK(0.05, dense_below=100, error_feedback=False),
    "topk-cheap-dense": lambda: TopK(0.4, dense_below=100),  # 3 ranks x k >= d: dense
    "gaussiank": lambda: GaussianK(0.05, dense_below=100),
    "gaussiank-large-k": lambda: GaussianK(0.1, dense_below=100),  # v: k = 200
    "regtopk": lambda: RegTopK(0.05, mu=3.0, dense_below=100),
    "regtopk-momentum": lambda: RegTopK(0.05, dense_below=100, momentum=0.5, error_feedback=False),
    "terngrad": lambda: TernGrad(dense_below=100, seed=4),
    "terngrad-feedback-own-scales": lambda: TernGrad(None, scalar_sharing=False, error_feedback=True,
                                                     dense_below=100),
    "fp16": FP16,
    "none": NoneCompressor,
}


def gradients(step, ranks, dtype):
    rng = np.random.default_rng([7, step])
    shapes = {"w": (30, 40), "b": (40,), "v": (2000,)}
    return {n: [(rng.standard_normal(s) * (1 + 0.3 * step)).astype(dtype) for _ in range(ranks)]
            for n, s in shapes.items()}


def flat(array):
    return None if array is None else np.asarray(array).reshape(-1)


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64], ids=lambda d: d.__name__)
@pytest.mark.parametrize("kind", COMPRESSORS)
def test_engine_equals_the_spec_bit_for_bit(kind, dtype, ranks):
    engine, spec = Simulator(ranks, COMPRESSORS[kind]()), PerTensorRanks(ranks, COMPRESSORS[kind]())
    for step in range(3):
        grads = gradients(step, ranks, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 'sends dense' where N k >= d
            got, want = engine.step(grads), spec.step(grads)
        for name in grads:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step} {name}")
            for label, mine, theirs in (("residual", engine.residuals(name), spec.residuals(name)),
                                        ("velocity", engine.velocities(name), spec.velocities(name))):
                for rank, (a, b) in enumerate(zip(mine, theirs)):
                    assert (a is None) == (b is None), f"step {step} {name} rank {rank} {label}"
                    np.testing.assert_array_equal(flat(a), flat(b), err_msg=f"step {step} {name} rank {rank} {label}")
