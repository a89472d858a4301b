"""The fused exchange over ``torch.distributed`` (gloo): :class:`TorchDistCommunicator`.

One 2-process spawn checks the collectives against the expected values (an allreduce
leaves its input as it is; a donated buffer is reduced in place) and
trains the drop-in optimizer with it; the parameters must equal the Simulator
on the same gradients (tolerance 1e-6, as the Horovod and MPI runs), and a bfloat16 model's
bit for bit (gloo carries bfloat16 as it is). In the same spawn,
PyTorch's plain AMP recipe (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``) with an Inf on rank 1 at one step: the drop-in optimizer
(``NoneCompressor``) and DDP with the same ``torch.amp.GradScaler`` end with the same
parameters and scales, bit for bit, the step with the Inf skipped on both ranks.
"""

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

from tests.distributed import launch  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

RANKS = 2
NAMES = ["topk", "gaussiank", "regtopk", "terngrad", "none", "regtopk-leader"]
#: bfloat16 over gloo: a sparse, a ternary and a dense exchange (every compressor: the Horovod runs)
BFLOAT16_NAMES = ["regtopk", "terngrad", "none"]

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def check_collectives(comm, rank):
    """Returns a list of failed checks (empty when all hold)."""
    failures = []
    mine = torch.arange(5.0) * (rank + 1)
    summed = comm.wait(comm.allreduce_async(mine, comm.SUM, "s"))
    if not torch.equal(summed, torch.arange(5.0) * 3) or not torch.equal(mine, torch.arange(5.0) * (rank + 1)):
        failures.append(f"sum {summed}, input after it {mine}")
    donated = torch.arange(5.0) * (rank + 1)
    summed = comm.wait(comm.allreduce_donated_async(donated, comm.SUM, "d"))
    if not torch.equal(summed, torch.arange(5.0) * 3) or summed.data_ptr() != donated.data_ptr():
        failures.append(f"donated sum {summed}: not reduced in place")
    top = comm.wait(comm.allreduce_async(torch.tensor([rank, -rank], dtype=torch.int32), comm.MAX, "m"))
    if top.tolist() != [1, 0]:
        failures.append(f"max {top}")
    wrap = comm.wait(comm.allreduce_async(torch.tensor([2**31 - 1], dtype=torch.int32), comm.SUM, "w"))
    if wrap.tolist() != [-2]:  # (2^31 - 1) * 2 wraps to -2 in int32
        failures.append(f"int32 wrap {wrap}")
    for rows in ([3, 3], [2, 5], [0, 4]):  # equal, unequal, an empty contribution
        mine = torch.full((rows[rank], 2), float(rank))
        for known in (None, rows):
            got = comm.wait(comm.allgather_async(mine, "g", known))
            want = torch.cat([torch.full((r, 2), float(i)) for i, r in enumerate(rows)])
            if not torch.equal(got, want):
                failures.append(f"allgather rows={rows} known={known}: {got.tolist()}")
    return failures


def job(rank, out):
    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    result = {"failures": check_collectives(comm, rank), "params": {}}
    for name in NAMES:
        result["params"][name] = dropin_training(rank, name, comm, torch.float32)
    result["bfloat16"] = {name: dropin_training(rank, name, comm, torch.bfloat16) for name in BFLOAT16_NAMES}
    result["amp"] = {route: plain_amp_recipe(rank, route, comm) for route in ("ddp", "dropin")}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


def dropin_training(rank, name, comm, dtype):
    """The drop-in optimizer on a model of ``dtype`` (gloo carries bfloat16 as it is): final parameters."""
    import hvd_compress.torch as hvd_torch

    model = workload.make_model(dtype)
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=workload.compressor(name),
        communicator=comm,
    )
    for x, y in workload.batches(rank, workload_steps()):
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        optimizer.step()
    return {n: p.detach().float().tolist() for n, p in model.named_parameters()}


AMP_INF_STEP = 1


def plain_amp_recipe(rank, route, comm):
    """PyTorch's AMP recipe on DDP or the drop-in optimizer (NoneCompressor); rank 1's batch at
    ``AMP_INF_STEP`` holds an Inf. The final parameters and the scale after each step."""
    import hvd_compress.torch as hvd_torch

    model = workload.make_model()
    if route == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(forward.parameters(), lr=workload.LR)
    else:
        forward = model
        optimizer = hvd_torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=workload.LR),
            named_parameters=model.named_parameters(),
            compression=workload.compressor("none"),
            communicator=comm,
        )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scales = []
    for step, (x, y) in enumerate(workload.batches(rank, workload_steps())):
        if (rank, step) == (1, AMP_INF_STEP):
            x = x.clone()
            x[0, 0] = float("inf")
        optimizer.zero_grad()
        scaler.scale(workload.loss_fn(forward, x, y)).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"params": {n: p.detach().tolist() for n, p in model.named_parameters()}, "scales": scales}


def workload_steps():
    return 4


def _entry(rank, port, out):
    torch.set_num_threads(1)
    with launch.gloo_group(rank, RANKS, port):
        job(rank, out)


@pytest.mark.timeout(180)
def test_drop_in_optimizer_over_gloo_equals_simulator(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(
        _entry, args=(port, str(tmp_path)), nprocs=RANKS, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 150
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks did not finish within 150 s (hang?)")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]
    for rank, result in enumerate(results):
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
    for rank, result in enumerate(results):
        ddp, dropin = result["amp"]["ddp"], result["amp"]["dropin"]
        assert ddp["scales"] == dropin["scales"] == [2.0**10, 2.0**9, 2.0**9, 2.0**9], (rank, ddp, dropin)
        for param, value in ddp["params"].items():
            assert np.all(np.isfinite(value)), (rank, param)
            np.testing.assert_array_equal(dropin["params"][param], value, err_msg=f"AMP rank {rank} {param}")
    for name in BFLOAT16_NAMES:  # bfloat16: the Simulator's training with torch.optim.SGD's update, bit for bit
        for param, value in workload.simulate(name, RANKS, workload_steps(), dtype=torch.bfloat16).items():
            for rank, result in enumerate(results):
                got = np.array(result["bfloat16"][name][param], dtype=np.float32)
                np.testing.assert_array_equal(got, value, err_msg=f"bfloat16 {name} rank {rank} {param}")
    for name in NAMES:
        expected = workload.simulate(name, RANKS, workload_steps())
        for param, value in expected.items():
            for result in results:
                np.testing.assert_allclose(
                    np.array(result["params"][name][param], dtype=np.float32),
                    value,
                    rtol=0,
                    atol=1e-6,
                    err_msg=f"{name} {param}",
                )
