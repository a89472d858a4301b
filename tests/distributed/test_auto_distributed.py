"""``Auto`` on 2 processes: ranks whose own measurements point different ways make the same choice
(same decisions, same parameters on every rank) with the MPI layer (``mpirun``), stock
``horovod.torch`` and both TensorFlow routes (``horovodrun``); a pinned ``Auto`` trains exactly as
the Simulator."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.distributed import launch
from tests.distributed import torch_horovod as workload

MODULE = "tests.distributed.auto_torch"
STEPS = 8

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "route, kind, pinned",
    [("mpi", "mpirun", "regtopk"), ("stock", "horovodrun", "terngrad")],
)
def test_ranks_agree_and_pinned_equals_simulator(tmp_path, route, kind, pinned):
    if kind == "mpirun":
        launch.require_mpi()
    else:
        launch.require_horovod_torch()
    out = tmp_path / "auto"
    done = launch.run(kind, 2, MODULE, "--route", route, "--pinned", pinned, "--steps", str(STEPS),
                      "--out", str(out), timeout=200)
    assert done.returncode == 0, launch.output(done)
    ranks = [np.load(f"{out}.{rank}.npz") for rank in range(2)]
    decisions = [json.loads(str(r["decisions"])) for r in ranks]
    assert decisions[0] and decisions[0] == decisions[1], decisions
    assert {d["choice"] for d in decisions[0].values()} <= {"dense", "compressed"}
    for key in ranks[0].files:
        if key.startswith("measured/"):
            np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=f"{route}: ranks differ on {key}")
    expected = workload.simulate(pinned, 2, STEPS)
    for param, value in expected.items():
        for r in ranks:
            np.testing.assert_allclose(r[f"pinned/{param}"], value, rtol=0, atol=1e-6,
                                       err_msg=f"{route}: pinned Auto({pinned}) differs from the Simulator")


def test_tensorflow_routes_ranks_agree(tmp_path):
    """Stock ``horovod.tensorflow`` and the drop-in TF tape: same decisions and weights on both ranks."""
    launch.require("horovod.tensorflow")
    out = tmp_path / "auto_tf"
    done = launch.run("horovodrun", 2, "tests.distributed.auto_tf", "--out", str(out), timeout=200)
    assert done.returncode == 0, launch.output(done)
    ranks = [json.loads((tmp_path / f"auto_tf.{rank}.json").read_text()) for rank in range(2)]
    for route in ("stock", "dropin"):
        assert ranks[0][route]["decisions"], route
        assert ranks[0][route] == ranks[1][route], f"{route}: ranks differ"


def _ddp_rank(rank: int, port: int, out: str) -> None:
    with launch.gloo_group(rank, 2, port):
        _ddp_train(rank, out)


def _ddp_train(rank: int, out: str) -> None:
    import torch

    from hvd_compress import Auto, TopK
    from hvd_compress.torch import CompressionState, ddp_hook

    model = workload.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    auto = Auto(TopK(workload.RATIO), warmup=2, decide_every=3, log=False)
    ddp.register_comm_hook(CompressionState(auto, named_parameters=model.named_parameters()), ddp_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=workload.LR)
    for x, y in workload.batches(rank, STEPS):
        opt.zero_grad()
        workload.loss_fn(ddp, x, y).backward()
        opt.step()
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    np.savez(f"{out}.{rank}.npz", **params, decisions=json.dumps(auto.stats.decisions, sort_keys=True))


def test_ddp_hook_ranks_agree(tmp_path):
    """The DDP comm hook: measuring inside the hook, deciding, and the same decisions and weights on both ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ddp")
    mp.spawn(_ddp_rank, args=(port, out), nprocs=2, join=True)
    ranks = [np.load(f"{out}.{rank}.npz") for rank in range(2)]
    assert json.loads(str(ranks[0]["decisions"])) and str(ranks[0]["decisions"]) == str(ranks[1]["decisions"])
    for key in ranks[0].files:
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=f"DDP: ranks differ on {key}")
