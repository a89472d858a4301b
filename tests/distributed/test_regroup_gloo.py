"""``regroup_states`` on real routes: 3 ranks' checkpoints resumed by 2 processes over gloo.

The Simulator trains 3 ranks for :data:`~tests.distributed.route_checkpoints.HALF` steps and saves
each rank's compressor state to its own file (``torch.save``). Each of 2 processes started by
``torch.multiprocessing`` loads the three files (``torch.load(weights_only=True)``), regroups them for
its rank (new rank 0 sums old ranks 0 and 2) and trains on to
:data:`~tests.distributed.route_checkpoints.STEPS` on the DDP comm hook and on the drop-in optimizer
over ``torch.distributed``: the parameters must equal the Simulator of 2 ranks resumed from the same
regrouped states (1e-6), and no rank may stop with ``ranks disagree``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


from hvd_compress import regroup_states  # noqa: E402
from tests.distributed import launch  # noqa: E402
from tests.distributed import route_checkpoints as moves  # noqa: E402

OLD, NEW = 3, 2
ROUTES = ["ddp", "dropin"]


def job(rank: int, folder: Path) -> None:
    """Each compressor's old files regrouped for this rank, then each route trained on from them."""
    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    params = torch.load(folder / "params.pt", weights_only=True)
    result = {}
    for name in moves.NAMES:
        old = [torch.load(folder / f"{name}.{i}.pt", weights_only=True) for i in range(OLD)]
        state = regroup_states(old, rank, NEW)
        for route in ROUTES:
            result[f"{route}/{name}"], _ = moves.train(route, name, rank, moves.HALF, moves.STEPS, comm,
                                                       params[name], state)
    torch.save(result, folder / f"rank{rank}.pt")


def _entry(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    with launch.gloo_group(rank, NEW, port):
        job(rank, Path(folder))


def spawn(folder: Path, timeout: float = 120.0) -> None:
    launch.spawn_gloo(_entry, NEW, str(folder), timeout=timeout)


@pytest.mark.timeout(180)
def test_three_ranks_checkpoints_resume_on_two_processes_as_the_simulator_does(tmp_path):
    params = {}
    for name in moves.NAMES:
        params[name], states = moves.simulate(name, OLD, 0, moves.HALF)
        for i, state in enumerate(states):
            torch.save(state, tmp_path / f"{name}.{i}.pt")
    torch.save(params, tmp_path / "params.pt")
    spawn(tmp_path)
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(NEW)]
    for name in moves.NAMES:
        old = [torch.load(tmp_path / f"{name}.{i}.pt", weights_only=True) for i in range(OLD)]
        regrouped = [regroup_states(old, rank, NEW) for rank in range(NEW)]
        expected, _ = moves.simulate(name, NEW, moves.HALF, moves.STEPS, params[name], regrouped)
        straight, _ = moves.simulate(name, NEW, moves.HALF, moves.STEPS, params[name])
        assert moves.difference(straight, expected) > 1e-4  # the regrouped residuals change the training
        for rank, result in enumerate(results):
            for route in ROUTES:
                assert moves.difference(result[f"{route}/{name}"], expected) < 1e-6, (rank, route, name)
