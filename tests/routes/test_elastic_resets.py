"""The rules of a Horovod Elastic reset (``hvd_compress.torch.elastic.register``), in one process.

Processes are objects here (a model, a drop-in optimizer, a ``horovod.torch.elastic.TorchState`` with
the compression state registered), run as thread ranks; a reset is what Horovod does to each process:
the survivors ``on_reset()`` (after ``restore()`` when a collective failed), a joining process starts
fresh with rank 0's model (``sync()``), and the world is the survivors' and joiners' in rank order.
The gradient of ``w`` is the data row, the same for a process whatever its rank, so gradient mass is
counted exactly: what the ranks produced (committed steps) equals N x the step's average summed over
steps (from the weights' moves under plain SGD) plus every residual, the lost process's included.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import RegTopK, TopK  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from tests.distributed import launch  # noqa: E402

launch.require_horovod_torch()
from horovod.torch.elastic import TorchState  # noqa: E402

import hvd_compress.torch as hvd  # noqa: E402

SIZE, LR = 4096, 0.5
COMPRESSORS = {"topk-leader": lambda: TopK(0.01, indices="leader"), "regtopk-reuse": lambda: RegTopK(0.01, exact_every=2)}


class Probe(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SIZE))

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        return (self.w * row).sum()


def row(process: int, step: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng([process, step]).standard_normal(SIZE).astype(np.float32))


class Process:
    """One worker: its model, drop-in optimizer, elastic state, and the rows it produced."""

    def __init__(self, ident: int, compression, weights=None) -> None:
        self.ident, self.model = ident, Probe()
        if weights is not None:  # a joining process: rank 0's model (TorchState.sync)
            self.model.w.data.copy_(weights)
        self.opt = hvd.DistributedOptimizer(torch.optim.SGD(self.model.parameters(), lr=LR),
                                            named_parameters=self.model.named_parameters(), compression=compression,
                                            communicator=SingleProcessCommunicator())
        self.state = TorchState(model=self.model, optimizer=self.opt)
        hvd.elastic.register(self.state, self.opt)
        self.produced = torch.zeros(SIZE, dtype=torch.float64)

    def residual(self) -> torch.Tensor:
        r = self.opt._compression.residual("w", self.opt.compression_state)
        return torch.zeros(SIZE) if r is None else r.clone()


def phase(processes, steps, commit=True):
    """``steps`` steps of ``processes`` (rank = position): each steps and commits; returns the weights."""

    def work(comm):
        me = processes[comm.rank]
        me.opt._comm = comm  # Horovod's communicator reads the new rank and size after a reset
        for step in steps:
            data = row(me.ident, step)
            me.opt.zero_grad()
            me.model(data).backward()
            me.opt.step()
            if commit:
                me.produced += data.double()
                me.state.save()
        return me.model.w.detach().clone()

    weights = run_ranks(len(processes), work)
    for w in weights[1:]:
        assert torch.equal(w, weights[0]), "replicas differ"
    return weights[0]


def mass_left(processes, lost=()):
    """Every produced row, less every residual (the lost processes' committed ones included)."""
    produced = sum(p.produced for p in processes)
    return produced - sum(p.residual().double() for p in processes) - sum(r.double() for r in lost)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_an_added_process_starts_at_zero_and_nothing_is_duplicated(name):
    """2 -> 3: the survivors' residuals are the same after the reset, the new process's is zero; every
    rank agrees on the leader and on exact selections (no error), the replicas stay equal, and the gradient
    mass is conserved: 2 x the average of the first phase + 3 x the second's + the residuals = produced."""
    make = COMPRESSORS[name]
    first = [Process(0, make()), Process(1, make())]
    w0 = phase(first, range(4))  # 4 steps: without the reset rules the survivors' leader would be rank 1
    before = [p.residual() for p in first]
    for p in first:
        p.state.on_reset()
    assert all(torch.equal(p.residual(), r) for p, r in zip(first, before))
    joined = Process(2, make(), weights=w0)
    assert not joined.residual().any()
    everyone = first + [joined]
    w1 = phase(everyone, range(4, 7))
    sent = 2 * (0 - w0.double()) / LR + 3 * (w0.double() - w1.double()) / LR
    assert float((mass_left(everyone) - sent).abs().max()) < 1e-4


@pytest.mark.parametrize("name", COMPRESSORS)
def test_a_failure_rolls_residuals_back_and_renumbered_survivors_go_on(name):
    """3 -> 2, rank 0 lost in an uncommitted step: the survivors restore (model, optimizer and residuals
    equal to the last commit) and reset; renumbered 1 -> 0 and 2 -> 1 they train on without 'ranks
    disagree' (the optimizer's restored state names their old ranks), and the committed mass is conserved,
    the lost process's residual counted as lost."""
    make = COMPRESSORS[name]
    everyone = [Process(i, make()) for i in range(3)]
    w0 = phase(everyone, range(2))
    committed = [p.residual() for p in everyone]
    phase(everyone, [2], commit=False)  # the step a failure interrupts
    survivors = everyone[1:]
    for p in survivors:
        p.state.restore()
        p.state.on_reset()
    assert all(torch.equal(p.residual(), r) for p, r in zip(survivors, committed[1:]))
    assert torch.equal(survivors[0].model.w.detach(), w0)
    w1 = phase(survivors, range(3, 6))
    sent = 3 * (0 - w0.double()) / LR + 2 * (w0.double() - w1.double()) / LR
    left = mass_left(survivors, lost=[committed[0]]) + everyone[0].produced
    assert float((left - sent).abs().max()) < 1e-4


def test_a_compressor_in_the_state_as_an_ordinary_value_is_refused():
    """TorchState(compression=...) would broadcast rank 0's residuals: register() refuses it, and so does
    pickling by Horovod's broadcast_object (the receiver at once, the sender at its next exchange)."""
    import pickle

    model, compression = Probe(), TopK(0.01)
    state = TorchState(model=model, compression=compression)
    with pytest.raises(ValueError, match=r"hvd_compress.torch.elastic.register\(state, optimizer\)"):
        hvd.elastic.register(state, compression)
    namespace = {"__name__": "horovod.torch.functions", "pickle": pickle}
    exec("def broadcast_object(obj):\n    return pickle.dumps(obj)", namespace)
    payload = namespace["broadcast_object"](compression)
    with pytest.raises(ValueError, match="broadcasts from rank 0"):
        pickle.loads(payload)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                   compression=compression, communicator=SingleProcessCommunicator())
    with pytest.raises(ValueError, match="broadcasts from rank 0"):
        model(row(0, 0)).backward()  # the exchange launched in backward
        opt.step()
    assert pickle.loads(pickle.dumps(TopK(0.01))).ratio == 0.01  # pickling elsewhere is as before


def test_flush_needs_the_optimizer_and_goes_first():
    """register(..., flush=True) applies residuals with the optimizer, so the compression alone is refused;
    its handler saves before the model's, which then holds the applied residuals."""
    model, compression = Probe(), TopK(0.01)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                   compression=compression, communicator=SingleProcessCommunicator())
    state = TorchState(model=model, optimizer=opt)
    with pytest.raises(TypeError, match=r"flush=True\) applies residuals with the optimizer"):
        hvd.elastic.register(state, compression, flush=True)
    handler = hvd.elastic.register(state, opt, flush=True)
    assert next(iter(state._handlers.values())) is handler
