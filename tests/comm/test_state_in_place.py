"""A fused bucket updates its state in place: residual, velocity, RegTop-k's posterior and reused thresholds
keep their buffers from step to step (a captured CUDA graph reads the addresses it captured, so state
reassigned to new buffers would replay stale), and what ``state_dict`` hands out is a copy that later
steps do not change.
"""

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import RegTopK, TopK  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.engine.exchange import BucketExchange  # noqa: E402
from hvd_compress.kernels import torch_ops  # noqa: E402

SHAPES = {"w": (40, 50), "v": (2000,), "u": (40, 50)}
COMPRESSORS = {
    "topk": lambda: TopK(0.05, dense_below=0),
    "regtopk": lambda: RegTopK(0.05, dense_below=0),
    "topk-momentum": lambda: TopK(0.05, dense_below=0, momentum=0.9),
    "topk-reuse": lambda: TopK(0.05, dense_below=0, exact_every=2),
}


def step(compressor, comm, generator):
    exchange = BucketExchange(compressor, comm, "bucket")
    for name, shape in SHAPES.items():
        exchange.add(name, torch.randn(shape, generator=generator))
    exchange.launch()
    exchange.finish(average=True)


def state_buffers(compressor):
    """Every state tensor of the compressor's one bucket, by name."""
    (bucket,) = compressor.state.buckets.values()
    found = {"residual": bucket.residual, "velocity": bucket.velocity,
             "thresholds": getattr(bucket.codec, "thresholds", None)}
    for i, t in enumerate(bucket.codec.posterior or ()):
        found[f"posterior{i}"] = t
    return {name: t for name, t in found.items() if t is not None}


@pytest.mark.parametrize("kind", list(COMPRESSORS))
def test_state_keeps_its_buffers_across_steps(kind):
    compressor, comm = COMPRESSORS[kind](), SingleProcessCommunicator()
    generator = torch.Generator().manual_seed(0)
    with torch_ops.accelerator_path():
        for _ in range(2):
            step(compressor, comm, generator)
        before = state_buffers(compressor)
        values = {name: t.clone() for name, t in before.items()}
        for _ in range(3):
            step(compressor, comm, generator)
        after = state_buffers(compressor)
    assert set(after) == set(before) and "residual" in after
    for name, t in after.items():
        assert t.data_ptr() == before[name].data_ptr(), f"{kind}: {name} moved to a new buffer"
    assert not torch.equal(after["residual"], values["residual"]), "the residual did not change"


@pytest.mark.parametrize("kind", ["topk-momentum", "topk-reuse"])
def test_a_saved_state_does_not_change_with_later_steps(kind):
    compressor, comm = COMPRESSORS[kind](), SingleProcessCommunicator()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        step(compressor, comm, generator)
    saved = compressor.state_dict()
    frozen = pickle.loads(pickle.dumps(saved))
    for _ in range(2):
        step(compressor, comm, generator)
    for name, entry in saved["tensors"].items():
        for key, value in entry.items():
            if key != "shape":
                np.testing.assert_array_equal(np.asarray(value), np.asarray(frozen["tensors"][name][key]),
                                              err_msg=f"{name} {key}")
