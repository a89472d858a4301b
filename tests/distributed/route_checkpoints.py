"""Compressor checkpoints moving between routes, run by the in-process tests and the multi-rank jobs.

A route trains :func:`tests.distributed.torch_horovod.make_model` for :data:`HALF` steps and saves
each rank's compressor state the way that route saves it; another route loads each rank's state
the way it loads it and trains to :data:`STEPS`. The result must equal the Simulator trained
straight through (Top-k and RegTop-k are deterministic, so the order in which a route hands its
tensors to the exchange does not matter; RegTop-k carries its posterior across, Top-k with
momentum correction its velocity). Routes (:func:`train`):

- ``dropin``: ``hvd_compress.torch.DistributedOptimizer`` (saves ``optimizer.state_dict()``, whose
  ``"hvd_compress"`` is the compressor state);
- ``mpi``: ``hvd_compress.mpi.DistributedOptimizer`` (the same, on any communicator);
- ``stock``: ``horovod.torch.DistributedOptimizer(compression=...)`` (``compression.state_dict()``);
- ``ddp``: DDP with :func:`hvd_compress.torch.ddp_hook` (``CompressionState.state_dict()``);
- ``Simulator``: every rank's state at once (``Simulator.state_dict()["ranks"]``, or a list of the
  ranks' states into ``Simulator.load_state_dict``); in a multi-rank job every rank runs it alone
  (each rank can compute every rank's gradients).

Every route is given the model's ``named_parameters``: then they all name tensors alike.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hvd_compress.simulator import Simulator
from tests.distributed import torch_horovod as workload

STEPS, HALF = 4, 2
NAMES = ["regtopk", "topk-momentum"]

Params = Dict[str, torch.Tensor]


def _model(params: Optional[Params]) -> torch.nn.Module:
    model = workload.make_model()
    if params is not None:
        model.load_state_dict(params)
    return model


def _params(model: torch.nn.Module) -> Params:
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def simulate(name: str, ranks: int, start: int, stop: int, params: Optional[Params] = None,
             states: Optional[List[Any]] = None) -> Tuple[Params, List[Any]]:
    """Steps ``start``..``stop`` on the Simulator from ``params`` and every rank's ``states``:
    (final parameters, every rank's state)."""
    model = _model(params)
    sim = Simulator(ranks, workload.compressor(name))
    if states is not None:
        sim.load_state_dict(states)
    workload.simulate_steps(model, sim, start, stop)
    return _params(model), sim.state_dict()["ranks"]


def train(route: str, name: str, rank: int, start: int, stop: int, comm: Any = None,
          params: Optional[Params] = None, state: Any = None, named: bool = True) -> Tuple[Params, Any]:
    """Steps ``start``..``stop`` of rank ``rank`` on ``route`` from ``params`` and this rank's
    compressor ``state``, loaded as that route loads it; (final parameters, the state it saves).
    ``comm``: the communicator of ``dropin`` and ``mpi``. ``named=False``: no ``named_parameters``."""
    model = _model(params)
    compression = workload.compressor(name)
    names = dict(model.named_parameters()) if named else None
    sgd = torch.optim.SGD(model.parameters(), lr=workload.LR)
    forward: Callable = model
    if route in ("dropin", "mpi"):
        if route == "dropin":
            import hvd_compress.torch as wrapper

            opt = wrapper.DistributedOptimizer(sgd, named_parameters=names and names.items(),
                                               compression=compression, communicator=comm)
        else:
            import hvd_compress.mpi as wrapper

            opt = wrapper.DistributedOptimizer(sgd, named_parameters=names and names.items(),
                                               compression=compression, comm=comm)
        if state is not None:
            opt.load_state_dict({**opt.state_dict(), "hvd_compress": state})
        save = lambda: opt.state_dict()["hvd_compress"]  # noqa: E731
    elif route == "stock":
        import horovod.torch as hvd

        opt = hvd.DistributedOptimizer(sgd, named_parameters=names and names.items(), compression=compression)
        if state is not None:
            compression.load_state_dict(state)
        save = compression.state_dict
    elif route == "ddp":
        from hvd_compress.torch import CompressionState, ddp_hook

        forward = torch.nn.parallel.DistributedDataParallel(model)
        hook = CompressionState(compression, named_parameters=names and names.items())
        if state is not None:
            hook.load_state_dict(state)
        forward.register_comm_hook(hook, ddp_hook)
        opt = sgd
        save = hook.state_dict
    else:
        raise ValueError(route)
    data = workload.batches(rank, stop)
    for step in range(start, stop):
        opt.zero_grad()
        workload.loss_fn(forward, *data[step]).backward()
        opt.step()
    return _params(model), save()


def initial() -> Params:
    """The model's initial parameters (threads pass them: ``make_model`` seeds torch's shared generator)."""
    return _params(workload.make_model())


def difference(got: Params, expected: Params) -> float:
    return max(float((got[n] - expected[n]).abs().max()) for n in expected)


def between(writer: str, reader: str, name: str, rank: int, ranks: int, comm: Any = None,
            gather: Optional[Callable[[Any], List[Any]]] = None) -> float:
    """``writer`` for :data:`HALF` steps, ``reader`` from its state to :data:`STEPS`: how far this
    rank's parameters are from the Simulator's straight run. ``gather(state)``: every rank's state
    in rank order (for a Simulator reader)."""
    if writer == "Simulator":
        params, states = simulate(name, ranks, 0, HALF)
        state = states[rank]
    else:
        params, state = train(writer, name, rank, 0, HALF, comm, initial())
    if reader == "Simulator":
        final, _ = simulate(name, ranks, HALF, STEPS, params, gather(state))
    else:
        final, _ = train(reader, name, rank, HALF, STEPS, comm, params, state)
    return difference(final, straight(name, ranks))


@functools.lru_cache(maxsize=None)
def straight(name: str, ranks: int) -> Params:
    """The Simulator's parameters after :data:`STEPS` steps without a break."""
    return simulate(name, ranks, 0, STEPS)[0]


def matrix(pairs: List[Tuple[str, str]], rank: int, ranks: int, comm: Any = None,
           gather: Optional[Callable[[Any], List[Any]]] = None) -> Dict[str, float]:
    """:func:`between` for every ``(writer, reader)`` and every compressor of :data:`NAMES`."""
    return {f"{w}->{r}/{name}": between(w, r, name, rank, ranks, comm, gather)
            for w, r in pairs for name in NAMES}


def refusal(load: Callable[[], Any]) -> str:
    """The message ``load()`` raised (``""``: it loaded)."""
    try:
        load()
    except ValueError as error:
        return str(error)
    return ""
