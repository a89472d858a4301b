"""The drop-in ``hvd_compress.torch.DistributedOptimizer`` is freed once dropped (its parameters' hooks
hold it weakly), and a parameter that outlives it trains on without it."""

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd_torch  # noqa: E402
from hvd_compress import TopK  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402


def _trained(comm, model):
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=TopK(0.5),
        communicator=comm,
    )
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(3, 8)).sum().backward()
        optimizer.step()
    return weakref.ref(optimizer), weakref.ref(optimizer.state[model.weight]["momentum_buffer"])


def test_a_dropped_optimizer_and_its_state_are_freed():
    def work(comm):
        model = torch.nn.Linear(8, 4)
        refs = _trained(comm, model)
        return refs + (weakref.ref(model),)

    (optimizer, momentum, model), = run_ranks(1, work)
    gc.collect()
    assert optimizer() is None and momentum() is None and model() is None


def test_the_model_outlives_its_optimizer():
    model = torch.nn.Linear(8, 4)
    (optimizer, _), = run_ranks(1, lambda comm: _trained(comm, model))
    gc.collect()
    assert optimizer() is None
    model.zero_grad()
    model(torch.ones(3, 8)).sum().backward()  # the parameters' hooks do nothing now
    torch.testing.assert_close(model.bias.grad, torch.full((4,), 3.0))
