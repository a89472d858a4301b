"""None and FP16 on stock ``horovod.torch`` count a step's bytes as the Simulator does, in every gradient
dtype: None counts the gradient's own bytes (bfloat16's 2 per entry, although Horovod 0.28.1 carries
bfloat16 as float32), FP16 float16's 2, so None's statistics equal a dense exchange's (savings 1.0x).
One rank, ``hvd.allreduce(t, name=..., compression=...)``'s calls of ``compress``/``decompress``: the
first step checks the layout through our exchange, the later ones hand Horovod the tensor itself."""

import pytest

torch = pytest.importorskip("torch")

from hvd_compress import Compression  # noqa: E402
from hvd_compress.horovod import torch_hooks  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402

NUMEL = 1000
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def stock_steps(compressor, grad, steps):
    """``(bytes_sent, dense_bytes)`` of the statistics after each step of one rank's stock calls."""
    counted = []
    for _ in range(steps):
        sent, ctx = compressor.compress(grad, name="w")
        result = compressor.decompress(sent.clone(), ctx)  # Horovod's allreduce of one rank: what it was handed
        assert result.dtype == grad.dtype and torch.equal(result, grad)
        counted.append((compressor.stats.bytes_sent, compressor.stats.dense_bytes))
    return counted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, wire_itemsize", [("none", None), ("fp16", 2)])
def test_stock_dense_steps_count_what_the_simulator_counts(name, wire_itemsize, dtype, monkeypatch):
    monkeypatch.setattr(torch_hooks, "_communicator", SingleProcessCommunicator)
    grad = ((torch.arange(NUMEL) % 64 - 32) / 8).to(DTYPES[dtype])  # exact in every dtype, and in float16
    itemsize = grad.element_size()
    compressor = Compression.by_name(name)
    counted = stock_steps(compressor, grad, 3)
    sim = Simulator(1, Compression.by_name(name))
    for _ in range(2):  # the first step also sends the layout check's header
        sim.step({"w": [grad]})
    per_step = [(b - a, d - c) for (a, c), (b, d) in zip(counted, counted[1:])]
    assert per_step == [(NUMEL * (wire_itemsize or itemsize), NUMEL * itemsize)] * 2
    assert per_step[0][0] == sim.bytes_sent_per_rank[0]
    if name == "none":
        sent, dense = counted[-1]
        assert sent - dense == 16 + torch_hooks.horovod_dtype(grad.dtype).itemsize  # header and placeholder
