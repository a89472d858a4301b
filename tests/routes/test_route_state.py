"""Each route runs its compressor on a run state of its own (``optimizer.compression_state``), so one
compressor serves two optimizers at once without mixing their residuals, posteriors, velocities,
random streams or statistics: two models whose parameters share names, their optimizers on one
compressor and stepped in turn (the second's backward launched while the first's buckets are still
in flight), both end where the Simulator's straight run does. The DDP hook is checked the same way
in its multi-rank job (``tests/distributed/test_ddp_hook.py``)."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd  # noqa: E402
from hvd_compress import RegTopK, TernGrad, TopK  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.engine.exchange import open_exchange  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from tests.distributed import route_checkpoints as moves  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

RANKS = 2


def two_models_on_one_compressor(name: str, comm, initial) -> list:
    """This rank's parameters of two models (same names, start ``initial``) whose drop-in optimizers
    share one compressor, after :data:`moves.STEPS` steps taken in turn. The second model trains on
    the other rank's data: on 2 ranks the average (and the Simulator's run) is the same, but this
    rank's gradients, residuals and posteriors are the other rank's."""
    compression = workload.compressor(name)
    models = [workload.make_model() for _ in range(2)]
    for model in models:
        model.load_state_dict(initial)
    optimizers = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=workload.LR), compression=compression,
                                           named_parameters=m.named_parameters(), communicator=comm)
                  for m in models]
    assert optimizers[0].compression_state is not optimizers[1].compression_state
    # the second model takes the other rank's data: the same average, other gradients on this rank
    data = [workload.batches(rank, moves.STEPS) for rank in (comm.rank, RANKS - 1 - comm.rank)]
    for step in range(moves.STEPS):
        for model, optimizer, batches in zip(models, optimizers, data):  # both backwards before either step
            optimizer.zero_grad()
            workload.loss_fn(model, *batches[step]).backward()
        for optimizer in optimizers:
            optimizer.step()
    return [{n: p.detach().clone() for n, p in model.state_dict().items()} for model in models]


@pytest.mark.parametrize("name", moves.NAMES)
def test_two_optimizers_on_one_compressor_each_equal_the_simulator(name):
    straight, initial = moves.straight(name, RANKS), moves.initial()  # make_model seeds torch's shared generator
    for per_rank in run_ranks(RANKS, lambda comm: two_models_on_one_compressor(name, comm, initial)):
        for params in per_rank:
            assert moves.difference(params, straight) < 1e-6


def step(optimizer, model, x) -> None:
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()


def optimizer_on(compression, model):
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=compression,
                                    named_parameters=model.named_parameters(),
                                    communicator=SingleProcessCommunicator())


def test_the_first_route_runs_on_the_compressors_own_state_and_a_second_on_a_new_one():
    compression = RegTopK(0.05, dense_below=0)
    models = [torch.nn.Linear(40, 50) for _ in range(2)]
    first, second = (optimizer_on(compression, m) for m in models)
    assert first.compression_state is compression.state  # the old calls (compressor.residual, stats...) see it
    assert second.compression_state is not compression.state
    step(first, models[0], torch.randn(3, 40))
    step(second, models[1], 10 * torch.randn(3, 40))
    step(second, models[1], 10 * torch.randn(3, 40))
    saved_first, saved_second = first.state_dict()["hvd_compress"], second.state_dict()["hvd_compress"]
    assert saved_first["checksum"] != saved_second["checksum"]
    assert torch.equal(compression.residual("weight", second.compression_state),
                       second.compression_state.memory.peek("weight", "residual"))
    assert compression.state_dict(second.compression_state)["checksum"] == saved_second["checksum"]
    assert not torch.equal(compression.residual("weight"), second.compression_state.memory.peek("weight", "residual"))
    counts = [(s.numel, s.values_sent) for s in (first.compression_state.stats, second.compression_state.stats)]
    assert counts[1] == (2 * counts[0][0], 2 * counts[0][1]) and counts[0][1] > 0  # two steps against one
    assert compression.stats is first.compression_state.stats
    for call in (compression.state_dict, lambda: compression.load_state_dict(saved_first)):
        refusal = r"runs on 2 routes, each with a run state of its own.*optimizer\.(load_)?state_dict\(\)"
        with pytest.raises(RuntimeError, match=refusal):
            call()  # which route's state is meant is the route's to say

    first.load_state_dict(second.state_dict())  # a state moves between routes of one compressor
    assert first.state_dict()["hvd_compress"]["checksum"] == saved_second["checksum"]
    del second
    assert compression.state_dict()["checksum"] == saved_second["checksum"]  # one route left: the old call works
    del first
    assert optimizer_on(compression, models[0]).compression_state is compression.state  # free again


@pytest.mark.parametrize("make", [lambda: TopK(0.1, dense_below=0), lambda: TernGrad(dense_below=0)])
def test_a_ddp_hook_state_pickles_with_its_own_run_state(make):
    compression = make()
    hooks = [hvd.CompressionState(compression) for _ in range(2)]
    assert hooks[0].compression_state is compression.state and hooks[1].compression_state is not compression.state
    for hook, scale in zip(hooks, (1.0, 10.0)):
        exchange = open_exchange(compression, SingleProcessCommunicator(), "ddp.bucket0", hook.compression_state)
        exchange.add("ddp.bucket0.0", scale * torch.randn(100))
        exchange.launch()
        exchange.finish()
    copies = [pickle.loads(pickle.dumps(hook)) for hook in hooks]
    for hook, copy in zip(hooks, copies):
        assert copy.state_dict()["checksum"] == hook.state_dict()["checksum"]
    assert copies[0].compression_state is copies[0].compressor.state
