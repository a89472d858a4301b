"""``Auto`` on 2 processes (``mpirun`` with the MPI layer, ``horovodrun`` with stock Horovod): ranks whose measurements point different ways make the same choice (same decisions,
same parameters on every rank), and a pinned ``Auto`` trains exactly as the Simulator."""

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
