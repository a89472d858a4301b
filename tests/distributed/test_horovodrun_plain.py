"""The README's launch line as typed: ``horovodrun -np 2 python ...``, with no ``--gloo``.

Horovod here is built with MPI, so plain ``horovodrun`` takes its MPI controller, which
execs ``mpirun``. With Open MPI 5 that needs ci/build_horovod.sh's patch of Horovod's
mpirun line (Open MPI 5 no longer parses ``-bind-to none -map-by slot``; before the patch
this failed at once with exit 66, "Executable: none"). The other multi-process tests start
``horovodrun --gloo`` or ``mpirun`` directly, so only this one exercises that path.

Two ranks train RegTop-k a few steps (tests/distributed/torch_horovod.py); the result must
equal the Simulator's, and both ranks must report that they ran under Horovod's MPI
controller (``mpirun --tag-output`` prefixes ``[1,<rank>]``; Gloo's would be ``[<rank>]``).
Run as ``python -m tests.distributed.test_horovodrun_plain ARGS`` (what the ranks do), this module says
which controller it got, then runs the workload with ARGS.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tests.distributed import launch
from tests.distributed import torch_horovod as workload

NAMES = ["regtopk"]
STEPS = 4

pytestmark = pytest.mark.timeout(300)


def test_plain_horovodrun_uses_mpi_and_equals_simulator(monkeypatch, tmp_path):
    launch.require_horovod_torch()
    gloo_launcher = launch.launcher

    def plain_horovodrun(kind, ranks):
        gloo_launcher(kind, ranks)  # skips (or fails) without horovodrun on PATH
        return [shutil.which("horovodrun"), "-np", str(ranks)]  # the installed script, as typed

    monkeypatch.setattr(launch, "launcher", plain_horovodrun)
    out = tmp_path / "result.npz"
    done = launch.run(
        "horovodrun", 2, __name__, "--compression", *NAMES, "--steps", str(STEPS), "--out", str(out)
    )
    assert done.returncode == 0, launch.output(done)
    for rank in (0, 1):
        assert f"[1,{rank}]<stdout>: rank {rank}: controller mpi" in done.stdout, launch.output(done)
    launch.assert_equals_simulator(np.load(out), NAMES, lambda name: workload.simulate(name, 2, STEPS))


if __name__ == "__main__":
    import horovod.torch as hvd

    hvd.init()  # the workload's own hvd.init() is then a no-op
    controller = "mpi" if hvd.mpi_enabled() and not hvd.gloo_enabled() else "gloo"
    print(f"rank {hvd.rank()}: controller {controller}", flush=True)
    workload.main()
