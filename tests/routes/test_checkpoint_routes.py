"""Compressor checkpoints between routes, in one process: the drop-in optimizer and the MPI
optimizer (on thread ranks) and the Simulator, in every direction, resume exactly as if the run had
not moved; what cannot move is refused at load, naming the route that wrote it. The stock
``horovod.torch`` route and the DDP hook are checked the same way in their multi-rank jobs
(``tests/distributed/test_faults.py``, ``tests/distributed/test_ddp_hook.py``); the helpers are
``tests/distributed/route_checkpoints.py``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import TopK  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from tests.distributed import route_checkpoints as moves  # noqa: E402

RANKS = 2
ROUTES = ["dropin", "mpi", "Simulator"]
PAIRS = [(w, r) for w in ROUTES for r in ROUTES if w != r]


def written(writer, name, initial):
    """``writer`` for the first half: (parameters of rank 0, every rank's state)."""
    if writer == "Simulator":
        return moves.simulate(name, RANKS, 0, moves.HALF)
    results = run_ranks(RANKS, lambda comm: moves.train(writer, name, comm.rank, 0, moves.HALF, comm, initial))
    return results[0][0], [state for _, state in results]


@pytest.mark.parametrize("name", moves.NAMES)
@pytest.mark.parametrize("writer, reader", PAIRS, ids=[f"{w}->{r}" for w, r in PAIRS])
def test_state_moves_between_routes_and_training_goes_on_exactly(writer, reader, name):
    initial = moves.initial()
    params, states = written(writer, name, initial)
    assert all(state["route"] == {"dropin": "hvd_compress.torch.DistributedOptimizer",
                                  "mpi": "hvd_compress.mpi.DistributedOptimizer"}.get(writer, writer)
               for state in states)
    if reader == "Simulator":
        finals = [moves.simulate(name, RANKS, moves.HALF, moves.STEPS, params, states)[0]]
    else:
        finals = [final for final, _ in run_ranks(RANKS, lambda comm: moves.train(
            reader, name, comm.rank, moves.HALF, moves.STEPS, comm, params, states[comm.rank]))]
    straight, _ = moves.simulate(name, RANKS, 0, moves.STEPS)
    for final in finals:
        assert moves.difference(final, straight) < 1e-6


def test_what_cannot_move_is_refused_naming_its_writer():
    """Positional names (no named_parameters=) mean nothing to another route; a whole Simulator or
    optimizer checkpoint is not a compressor's state; a Simulator loads every rank's state."""
    initial = moves.initial()
    _, positional = run_ranks(RANKS, lambda comm: moves.train(
        "dropin", "regtopk", comm.rank, 0, 1, comm, initial, named=False))[0]
    assert sorted(positional["tensors"]) == ["param.0", "param.2"]  # the weights (the biases go dense)
    message = moves.refusal(lambda: run_ranks(RANKS, lambda comm: moves.train(
        "mpi", "regtopk", comm.rank, 0, 1, comm, initial, positional)))
    assert "written by hvd_compress.torch.DistributedOptimizer and names its tensors 'param." in message
    assert "none of which this hvd_compress.mpi.DistributedOptimizer exchanges" in message
    assert "named_parameters=" in message

    sim = Simulator(RANKS, TopK(0.05))
    sim.step({"w": [torch.randn(2000) for _ in range(RANKS)]})
    whole = sim.state_dict()
    assert "this is a Simulator's state of 2 ranks" in moves.refusal(lambda: TopK(0.05).load_state_dict(whole))
    assert "the state of one rank (written by Simulator)" in moves.refusal(
        lambda: Simulator(RANKS, TopK(0.05)).load_state_dict(whole["ranks"][0]))
    Simulator(RANKS, TopK(0.05)).load_state_dict(whole["ranks"])  # a list of every rank's state loads

    model = torch.nn.Linear(40, 50)
    import hvd_compress.torch as hvd

    from hvd_compress.transport.communicator import SingleProcessCommunicator

    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=TopK(0.05),
                                   named_parameters=model.named_parameters(), communicator=SingleProcessCommunicator())
    model(torch.randn(3, 40)).sum().backward()
    opt.step()
    message = moves.refusal(lambda: TopK(0.05).load_state_dict(opt.state_dict()))
    assert "this is an optimizer's state_dict() (hvd_compress.torch.DistributedOptimizer)" in message
    assert "state['hvd_compress']" in message


def saved_and_loaded(state):
    """``state`` through ``torch.save`` and torch's default ``torch.load`` (``weights_only=True``)."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()))


@pytest.mark.parametrize("route", ["dropin", "mpi"])
def test_a_checkpoint_saved_after_a_load_and_before_a_step_names_its_writer(route):
    """Each rank loads its state into a new optimizer and saves it again before any step: the new
    checkpoint records that rank and the world of 2 (not rank 0 of 1), so resuming from it on
    every rank trains on to the Simulator's straight run (no 'loaded from rank 0's checkpoint')."""
    initial, name = moves.initial(), "regtopk"

    def work(comm):
        params, state = moves.train(route, name, comm.rank, 0, moves.HALF, comm, initial)
        _, again = moves.train(route, name, comm.rank, moves.HALF, moves.HALF, comm, params, state)  # no step
        final, _ = moves.train(route, name, comm.rank, moves.HALF, moves.STEPS, comm, params, again)
        return (again["rank"], again["world"]), final

    results = run_ranks(RANKS, work)
    assert [origin for origin, _ in results] == [(0, RANKS), (1, RANKS)]
    for _, final in results:
        assert moves.difference(final, moves.straight(name, RANKS)) < 1e-6


@pytest.mark.parametrize("name", ["topk-reuse", "regtopk-reuse"])
def test_reused_threshold_checkpoints_load_with_torchs_default_load_and_resume_exactly(name):
    """Reused thresholds (``exact_every=2``) keep ``threshold_k`` as a plain int: the drop-in's
    ``optimizer.state_dict()`` goes through ``torch.save`` and the default ``torch.load``
    (``weights_only=True``), and the run resumed from it equals the straight one. A checkpoint that holds
    it as a one-element numpy array (as written before) still loads, and is saved again as an int."""
    initial = moves.initial()

    def work(comm):
        params, state = moves.train("dropin", name, comm.rank, 0, moves.HALF, comm, initial)
        loaded = saved_and_loaded(state)
        old = {**state, "tensors": {n: {**e, "threshold_k": np.array([e["threshold_k"]], np.int64)} if "threshold_k" in e
                                    else e for n, e in state["tensors"].items()}}
        old.pop("checksum")
        _, again = moves.train("dropin", name, comm.rank, moves.HALF, moves.HALF, comm, params, old)
        final, _ = moves.train("dropin", name, comm.rank, moves.HALF, moves.STEPS, comm, params, loaded)
        return state, saved_and_loaded(again), final

    for state, again, final in run_ranks(RANKS, work):
        counts = [entry["threshold_k"] for entry in state["tensors"].values() if "threshold_k" in entry]
        assert counts and all(type(k) is int and k >= 1 for k in counts), counts
        assert [entry["threshold_k"] for entry in again["tensors"].values() if "threshold_k" in entry] == counts
        assert moves.difference(final, moves.straight(name, RANKS)) < 1e-6
