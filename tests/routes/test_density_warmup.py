"""``DensityWarmup`` on the drop-in torch optimizer: thread ranks follow the schedule as the Simulator does,
and ranks whose schedules disagree stop with an error on every rank."""

from typing import Dict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd_torch  # noqa: E402
from hvd_compress import DensityWarmup  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:hvd_compress. TopK sends .* dense:UserWarning")

RANKS, STEPS = 3, 4
WARMUP = {"warmup_steps": 2, "start": 0.5}  # densities 0.5 (dense: 3 k >= n), 0.158, then the target 0.05


def train(comm, model, extra_steps: int = 0) -> Dict[str, np.ndarray]:
    compression = workload.compressor("topk")
    warmup = DensityWarmup(compression, **WARMUP)
    for _ in range(extra_steps):
        warmup.step()
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=comm,
    )
    for x, y in workload.batches(comm.rank, STEPS):
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        optimizer.step()
        warmup.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def simulate() -> Dict[str, np.ndarray]:
    """:func:`tests.distributed.torch_horovod.simulate` with the schedule stepped after every step."""
    model = workload.make_model()
    sim = Simulator(RANKS, workload.compressor("topk"))
    warmup = DensityWarmup(sim, **WARMUP)
    workload.simulate_steps(model, sim, 0, STEPS, after_step=warmup.step)
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def models(n: int):
    return [workload.make_model() for _ in range(n)]  # one after the other: make_model seeds torch globally


def test_thread_ranks_follow_the_warmup_like_the_simulator():
    built = models(RANKS)
    results = run_ranks(RANKS, lambda comm: train(comm, built[comm.rank]))
    expected = simulate()
    fresh = models(RANKS)
    constant = run_ranks(RANKS, lambda comm: train(comm, fresh[comm.rank], extra_steps=WARMUP["warmup_steps"]))
    for result in results:
        for name, value in expected.items():
            np.testing.assert_allclose(result[name], value, rtol=0, atol=1e-6, err_msg=name)
    # the warm-up changed the training: without it (the target from the start) the weights differ
    assert not np.allclose(constant[0]["0.weight"], expected["0.weight"], atol=1e-4)


def test_ranks_whose_schedules_disagree_stop_with_an_error():
    built = models(2)
    with pytest.raises(ValueError, match="ranks disagree"):
        run_ranks(2, lambda comm: train(comm, built[comm.rank], extra_steps=comm.rank), timeout=20)
