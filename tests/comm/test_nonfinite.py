"""NaN/Inf in the exchange (numpy arrays, TensorFlow tensors as numpy and on TensorFlow's own
kernels): as in a dense allreduce.

A NaN gradient on rank 1 makes that tensor non-finite in every rank's result and
leaves the other tensors finite; no rank raises; that tensor's residual on every rank
is its value from before the step, bit for bit (the step's residual is not taken
where the tensor is flagged), and every residual stays finite; the next step trains
normally, with the same results on every rank. TernGrad without shared scales
included (every rank encodes before it learns that another's gradient was not
finite). No numpy warning on the way. Checked over thread ranks, which run the real
exchange.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from tests import conformance

# numpy's "invalid value encountered in multiply" (0 * Inf) on every NaN step was noise: none now
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

SHAPES = {"a": (40, 50), "b": (7,), "c": (3000,)}
COMPRESSORS = {
    "topk": lambda: TopK(0.05),
    "gaussiank": lambda: GaussianK(0.05),
    "regtopk": lambda: RegTopK(0.05),
    "terngrad": lambda: TernGrad(error_feedback=True, seed=3),
    "terngrad-unshared": lambda: TernGrad(scalar_sharing=False, seed=3),
    "terngrad-unshared-feedback": lambda: TernGrad(scalar_sharing=False, error_feedback=True, seed=3),
    "fp16": FP16,
    "none": NoneCompressor,
}


@pytest.fixture
def kernels_of(framework):
    """``tf-kernels``: TensorFlow's CPU tensors stay TensorFlow's (the kernels a GPU runs)."""
    with conformance.tensorflow_kernels() if framework == "tf-kernels" else contextlib.nullcontext():
        yield


def gradients(rank: int, step: int, framework: str):
    rng = np.random.default_rng(100 * rank + step)
    grads = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    if (rank, step) == (1, 1):
        grads["a"][3, 4] = np.nan
    if framework.startswith("tf"):
        tf = pytest.importorskip("tensorflow")
        return {name: tf.constant(g) for name, g in grads.items()}
    return grads


def steps(comm, make, framework, count=3):
    compressor, out = make(), []
    for step in range(count):
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in gradients(comm.rank, step, framework).items():
            exchange.add(name, g)
        exchange.launch()
        results = exchange.finish(average=True)
        out.append({name: np.asarray(t) for name, t in results.items()})
        out[-1]["residuals"] = {n: None if compressor.residual(n) is None else np.asarray(compressor.residual(n))
                                for n in SHAPES}
    return out


@pytest.mark.parametrize("framework", ["numpy", "tf", "tf-kernels"])
@pytest.mark.parametrize("kind", COMPRESSORS)
def test_nan_on_one_rank_is_nonfinite_on_every_rank_and_nothing_is_lost(kind, framework, kernels_of):
    results = run_ranks(2, lambda comm: steps(comm, COMPRESSORS[kind], framework), timeout=60)
    for rank, result in enumerate(results):
        assert not np.isfinite(result[1]["a"]).all(), f"rank {rank}: 'a' should be non-finite"
        for step in range(3):
            for name in SHAPES:
                if (step, name) != (1, "a"):
                    assert np.isfinite(result[step][name]).all(), (rank, step, name)
        before, after = result[0]["residuals"]["a"], result[1]["residuals"]["a"]
        if before is not None:
            np.testing.assert_array_equal(after, before, err_msg=f"rank {rank}")
        assert all(r is None or np.isfinite(r).all() for r in result[2]["residuals"].values())
    for step in range(3):  # the same results on every rank
        for name in SHAPES:
            np.testing.assert_array_equal(results[0][step][name], results[1][step][name])


@pytest.mark.parametrize("make", [lambda: TopK(0.1, dense_below=0), lambda: TernGrad(dense_below=0, seed=3)],
                         ids=["topk", "terngrad"])
def test_flags_of_a_large_bucket_name_the_right_tensor(make):
    """In a bucket of 130 tensors of one size, an Inf in the 64th, the 127th or the last on one rank
    makes that tensor's result hold NaN on every rank and no other tensor's."""
    names = [f"t{i:03d}" for i in range(130)]
    bad = {1: "t063", 2: "t126"}

    def run(comm):
        exchange = BucketExchange(make(), comm, "bucket")
        rng = np.random.default_rng(comm.rank)
        for name in names:
            g = rng.standard_normal(20).astype(np.float32)
            if bad.get(comm.rank) == name or (comm.rank == 0 and name == names[-1]):
                g[5] = np.inf
            exchange.add(name, g)
        exchange.launch()
        return exchange.finish(average=True)

    for result in run_ranks(3, run, timeout=60):
        nonfinite = {name for name, value in result.items() if not np.isfinite(value).all()}
        assert nonfinite == {"t063", "t126", names[-1]}
        assert all(np.isnan(result[name]).any() for name in nonfinite)
