"""float16 gradients with error feedback: the residual accumulates in float32 and never overflows.

A float16 gradient of finite, moderate entries (600 every step) whose entries wait
their turn in a Top-k of k = 1 piles up ``a = g + r`` far beyond 65504, the largest
float16. The residual lives in float32, the values sent saturate at 65504 and the
rest stays in the residual, so every result is finite and nothing is lost:
``sum of gradients == sum of what was delivered + residual``, exactly (all the
numbers here are integers that float32 holds exactly), on every framework, in the
Simulator and through the exchange.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.transport.communicator import SingleProcessCommunicator
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.simulator import Simulator

#: k = 1 of 256: the entry sent at step 110 has waited 110 x 600 > 65504, and each one after it saturates
NUMEL, STEPS, ENTRY = 256, 150, 600.0
FLOAT16_MAX = 65504.0
COMPRESSORS = {
    "topk": lambda: TopK(1 / NUMEL, dense_below=0),
    "regtopk": lambda: RegTopK(1 / NUMEL, dense_below=0),
    "gaussiank": lambda: GaussianK(1 / NUMEL, dense_below=0),
}


def as_numpy(tensor) -> np.ndarray:
    return np.asarray(tensor.numpy() if hasattr(tensor, "numpy") else tensor, dtype=np.float64)


def gradient(framework: str):
    """The float16 gradient of every step in ``framework``."""
    if framework == "numpy":
        return np.full(NUMEL, ENTRY, np.float16)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        return torch.full((NUMEL,), ENTRY, dtype=torch.float16)
    tf = pytest.importorskip("tensorflow")
    return tf.fill([NUMEL], tf.constant(ENTRY, tf.float16))


def simulated(framework: str, make):
    """One rank of the Simulator (the engine in lockstep) in ``framework``."""
    sim = Simulator(1, make())
    delivered = [as_numpy(sim.step({"w": [gradient(framework)]})["w"]) for _ in range(STEPS)]
    return delivered, sim.compressors[0].residual("w")


def exchanged(framework: str, make):
    """One rank through the bucket exchange in ``framework``."""
    compressor, comm = make(), SingleProcessCommunicator()
    delivered = []
    for _ in range(STEPS):
        exchange = BucketExchange(compressor, comm, "bucket")
        exchange.add("w", gradient(framework))
        exchange.launch()
        delivered.append(as_numpy(exchange.finish(average=True)["w"]))
    return delivered, compressor.residual("w")


@pytest.mark.parametrize("kind", COMPRESSORS)
@pytest.mark.parametrize("route", ["simulator", "exchange"])
@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
def test_float16_residual_accumulates_in_float32_and_loses_nothing(kind, route, framework):
    make = COMPRESSORS[kind]
    delivered, residual = (simulated if route == "simulator" else exchanged)(framework, make)
    assert "float32" in str(residual.dtype), residual.dtype
    residual = as_numpy(residual)
    assert np.all(np.isfinite(delivered)) and np.all(np.isfinite(residual))
    assert residual.max() > FLOAT16_MAX, "the case did not pile up beyond the float16 range"
    assert max(d.max() for d in delivered) == FLOAT16_MAX, "no value saturated"
    np.testing.assert_array_equal(np.sum(delivered, axis=0) + residual, np.full(NUMEL, STEPS * ENTRY))


def test_float32_gradients_keep_float32_residuals_with_zeros_where_sent():
    """Where the gradient's dtype is the residual's, sent entries leave exactly 0 behind."""
    sim = Simulator(1, TopK(0.1, dense_below=0))  # k = ceil(0.1 * 20) = 2: the 19 and the 20
    g = np.arange(1, 21, dtype=np.float32)
    sent = sim.step({"w": [g]})["w"]
    residual = sim.residuals("w")[0]
    assert residual.dtype == np.float32 and sent.dtype == np.float32
    np.testing.assert_array_equal(sent, np.where(g > 18, g, 0))
    np.testing.assert_array_equal(residual, np.where(g > 18, 0, g))
