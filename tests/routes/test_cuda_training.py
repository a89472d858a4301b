"""End-to-end training on one CUDA device: the drop-in optimizer on thread ranks, over NCCL and MPI.

- ``hvd_compress.torch.DistributedOptimizer`` on 3 thread ranks
  (:func:`~hvd_compress.transport.threads.run_ranks`), each training a CUDA copy of
  the small model of ``tests/distributed/torch_horovod.py`` with every compressor:
  all ranks end with the same parameters, bit for bit (the sparse sum adds in rank
  order, so replicas cannot drift apart), residuals stay on the GPU, and the
  parameters equal the Simulator fed the same CUDA gradients (1e-6, FP16 1e-4, as
  the CPU runs) and the CPU Simulator within what CUDA's float32 matrix products
  change (:data:`CPU_TOLERANCE`). The thread ranks compute gradients with
  ``torch.autograd.grad`` and exchange them in ``step()``: autograd runs the
  backward of CUDA tensors on one engine thread per device, so gradient hooks of
  several thread ranks that wait for each other in a collective would deadlock;
- the same optimizer over ``torch.distributed`` with the NCCL backend, world size 1
  (NCCL wants one GPU per rank), exchanging from the gradient hooks: equal to the
  Simulator of one rank on CUDA;
- the DDP hook over NCCL, world size 1: equal to the Simulator of one rank on CUDA;
- a steady step of the drop-in optimizer (world size 1, over NCCL and over the
  in-process :class:`~hvd_compress.transport.communicator.SingleProcessCommunicator`)
  captured whole in ``torch.cuda.graph`` (forward, backward with the exchange in its
  gradient hooks, ``step()``) and replayed: the parameters after each replay equal those
  after the same eager steps, with and without state across steps (the fused bucket
  updates residuals, velocities and posteriors in place: ``tests/comm/test_state_in_place.py``);
- ``hvd_compress.mpi.DistributedOptimizer`` under ``mpirun -np 2``, both ranks on
  the one GPU, CUDA tensors through MPI (staged through host memory unless the MPI
  library is CUDA-aware): equal to the Simulator of two ranks on CUDA (every
  compressor but FP16, see :data:`MPI_NAMES`). This module
  is the MPI worker too (``python -m tests.routes.test_cuda_training --mpi-worker OUT``).

Skipped without CUDA; with ``HVD_COMPRESS_DEVICE=cuda`` (``ci/gpu_tests.sh``) a
missing GPU fails instead, and ``HVD_COMPRESS_DEVICE=cpu`` skips them.
"""

from __future__ import annotations

import os
from typing import Dict

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd_torch  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

REQUESTED_DEVICE = os.environ.get("HVD_COMPRESS_DEVICE", "").strip().lower()
pytestmark = [
    pytest.mark.skipif(REQUESTED_DEVICE == "cpu", reason="HVD_COMPRESS_DEVICE=cpu"),
    pytest.mark.skipif(
        REQUESTED_DEVICE != "cuda" and not torch.cuda.is_available(),
        reason="no CUDA device: torch.cuda.is_available() is False",
    ),
]

NAMES = ["topk", "gaussiank", "regtopk", "terngrad", "fp16", "none"]
#: FP16's float16 allreduce needs an MPI float16 datatype, which Open MPI 4 lacks (``_mpi_type``
#: raises MPI_ERR_TYPE): left out of the MPI run, which is about CUDA tensors.
MPI_NAMES = [name for name in NAMES if name != "fp16"]
RANKS, STEPS = 3, 4
#: Parameters of the CUDA runs vs the CPU Simulator: float32 matrix products round differently.
CPU_TOLERANCE = 1e-5


def tolerance(name: str) -> float:
    return 1e-4 if name == "fp16" else 1e-6


def simulate(name: str, ranks: int, device: str) -> Dict[str, np.ndarray]:
    """``workload.simulate`` with the model and data on ``device``."""
    model = workload.make_model().to(device)
    sim = Simulator(ranks, workload.compressor(name))
    data = [[(x.to(device), y.to(device)) for x, y in workload.batches(r, STEPS)] for r in range(ranks)]
    params = list(model.named_parameters())[::-1]
    for step in range(STEPS):
        grads = {n: [] for n, _ in params}
        for rank in range(ranks):
            model.zero_grad()
            workload.loss_fn(model, *data[rank][step]).backward()
            for n, p in params:
                grads[n].append(p.grad.clone())
        averaged = sim.step(grads)
        with torch.no_grad():
            for n, p in params:
                assert averaged[n].device == p.device, n
                p -= workload.LR * averaged[n]
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}


def train(name: str, comm, model: torch.nn.Module, hooks: bool = True) -> Dict[str, np.ndarray]:
    """The drop-in optimizer on one rank; returns the parameters and where the residuals live.

    ``hooks``: gradients from ``backward()`` (exchanged from the gradient hooks), else from
    ``torch.autograd.grad`` (no hook fires; ``step()`` exchanges them all).
    """
    device = next(model.parameters()).device
    compression = workload.compressor(name)
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=comm,
    )
    for x, y in workload.batches(comm.rank, STEPS):
        optimizer.zero_grad()
        loss = workload.loss_fn(model, x.to(device), y.to(device))
        if hooks:
            loss.backward()
        else:
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(loss, params)):
                p.grad = g
        optimizer.step()
    return summary(model, compression)


def summary(model: torch.nn.Module, compression) -> Dict[str, np.ndarray]:
    result = {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
    residuals = [compression.residual(n) for n, _ in model.named_parameters()]
    result["residual devices"] = sorted({r.device.type for r in residuals if r is not None})
    return result


def residual_devices_of(name: str) -> list:
    return ["cuda"] if name in ("topk", "gaussiank", "regtopk") else []


def assert_close(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray], atol: float, what: str) -> None:
    for param, value in want.items():
        np.testing.assert_allclose(got[param], value, rtol=0, atol=atol, err_msg=f"{what}: {param}")


@pytest.mark.parametrize("name", NAMES)
def test_drop_in_optimizer_on_cuda_thread_ranks(name):
    models = [workload.make_model().to("cuda") for _ in range(RANKS)]  # one after the other: seeded
    results = run_ranks(RANKS, lambda comm: train(name, comm, models[comm.rank], hooks=False))
    residual_devices = [r.pop("residual devices") for r in results]
    for rank, result in enumerate(results[1:], start=1):
        for param, value in results[0].items():
            assert np.array_equal(result[param], value), f"rank {rank} differs from rank 0: {param}"
    assert residual_devices == [residual_devices_of(name)] * RANKS, residual_devices
    assert_close(results[0], simulate(name, RANKS, "cuda"), tolerance(name), f"{name} vs CUDA Simulator")
    if name != "terngrad":  # TernGrad draws from the device's generator: CUDA's stream is not CPU's
        assert_close(results[0], simulate(name, RANKS, "cpu"), CPU_TOLERANCE, f"{name} vs CPU Simulator")


@pytest.fixture
def nccl_world_of_one(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("torch.distributed with NCCL is not available")
    dist.init_process_group(
        "nccl",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_drop_in_optimizer_over_nccl_world_size_1(nccl_world_of_one):
    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    comm = TorchDistCommunicator()
    assert (comm.rank, comm.size) == (0, 1)
    for name in NAMES:
        result = train(name, comm, workload.make_model().to("cuda"))
        assert result.pop("residual devices") == residual_devices_of(name), name
        assert_close(result, simulate(name, 1, "cuda"), tolerance(name), f"{name} over NCCL vs Simulator")


def test_ddp_hook_over_nccl_world_size_1(nccl_world_of_one):
    """The DDP hook decodes in the callback of NCCL's futures, which are done as soon as the
    collectives are queued: its results must still be those the collectives wrote."""
    from torch.nn.parallel import DistributedDataParallel

    for name in [name for name in NAMES if name != "terngrad"]:  # DDP orders a bucket's tensors its own
        module = workload.make_model().to("cuda")  # way, so TernGrad's draws go to other tensors
        model = DistributedDataParallel(module, device_ids=[0], bucket_cap_mb=1)
        compression = workload.compressor(name)
        state = hvd_torch.CompressionState(compression, named_parameters=module.named_parameters())
        model.register_comm_hook(state, hvd_torch.ddp_hook)
        sgd = torch.optim.SGD(model.parameters(), lr=workload.LR)
        for x, y in workload.batches(0, STEPS):
            sgd.zero_grad()
            workload.loss_fn(model, x.to("cuda"), y.to("cuda")).backward()
            sgd.step()
        got = {n: p.detach().cpu().numpy() for n, p in module.named_parameters()}
        assert_close(got, simulate(name, 1, "cuda"), tolerance(name), f"{name} DDP hook over NCCL vs Simulator")


# ------------------------------------------------------------------ CUDA graphs
GRAPH_WARMUP, GRAPH_REPLAYS = 3, 3
#: Compressors without state across steps, and with it (residuals, RegTop-k's posterior), kept in place.
GRAPH_COMPRESSORS = {
    "none": lambda: workload.compressor("none"),
    "fp16": lambda: workload.compressor("fp16"),
    "topk-no-feedback": lambda: hvd_torch.Compression.topk(workload.RATIO, error_feedback=False),
    "gaussiank-no-feedback": lambda: hvd_torch.Compression.gaussiank(workload.RATIO, error_feedback=False),
    **{name: lambda name=name: workload.compressor(name) for name in ("topk", "gaussiank", "regtopk")},
}
GRAPH_CASES = [pytest.param(name, make, id=name) for name, make in GRAPH_COMPRESSORS.items()]


@pytest.fixture(params=["single-process", "nccl"])
def graph_communicator(request, tmp_path, monkeypatch):
    """A world of one for the capture: in-process, or ``torch.distributed`` over NCCL, initialised as
    torch's CUDA-graph notes ask (no asynchronous NCCL error handling during capture)."""
    if request.param == "single-process":
        from hvd_compress.transport.communicator import SingleProcessCommunicator

        yield lambda: SingleProcessCommunicator()
        return
    dist = pytest.importorskip("torch.distributed")
    if not (dist.is_available() and dist.is_nccl_available()):
        pytest.skip("torch.distributed with NCCL is not available")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        from hvd_compress.transport.torch_dist import TorchDistCommunicator

        yield TorchDistCommunicator
    finally:
        dist.destroy_process_group()


def _graph_optimizer(model: torch.nn.Module, compression, comm):
    return hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=comm,
    )


def _snapshot(model: torch.nn.Module) -> Dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name, make", GRAPH_CASES)
def test_drop_in_step_captured_in_a_cuda_graph_replays_as_eager_steps(graph_communicator, name, make):
    """Whole-step capture as torch's CUDA-graph notes describe it: static input tensors, warm-up steps
    on a side stream (the first step checks the layout with a host read; plans and scratch buffers are
    made there), ``zero_grad(set_to_none=True)`` before capture so backward allocates the gradients
    from the graph's pool, then forward, backward (the exchange starts in the gradient hooks) and
    ``step()`` (SGD with momentum: its buffers are updated in place) captured; each replay after
    copying the next batch into the static inputs must equal an eager step on that batch."""
    data = workload.batches(0, GRAPH_WARMUP + GRAPH_REPLAYS)

    eager = workload.make_model().to("cuda")
    optimizer = _graph_optimizer(eager, make(), graph_communicator())
    expected = []
    for x, y in data:
        optimizer.zero_grad()
        workload.loss_fn(eager, x.to("cuda"), y.to("cuda")).backward()
        optimizer.step()
        expected.append(_snapshot(eager))

    model = workload.make_model().to("cuda")
    optimizer = _graph_optimizer(model, make(), graph_communicator())
    static_x, static_y = data[0][0].to("cuda"), data[0][1].to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in data[:GRAPH_WARMUP]:
            static_x.copy_(x)
            static_y.copy_(y)
            optimizer.zero_grad(set_to_none=True)
            workload.loss_fn(model, static_x, static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert_close(_snapshot(model), expected[GRAPH_WARMUP - 1], 0, f"{name}: eager warm-up steps")

    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        workload.loss_fn(model, static_x, static_y).backward()
        optimizer.step()
    for step, (x, y) in enumerate(data[GRAPH_WARMUP:], start=GRAPH_WARMUP):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(_snapshot(model), expected[step], 1e-6, f"{name}: replay of step {step}")


def test_mpi_optimizer_with_cuda_tensors_on_2_ranks(tmp_path):
    from tests.distributed import launch

    launch.require_mpi()
    out = tmp_path / "mpi.npz"
    done = launch.run("mpirun", 2, "tests.routes.test_cuda_training", "--mpi-worker", str(out), timeout=180)
    assert done.returncode == 0, launch.output(done)
    result = np.load(out)
    assert int(result["size"]) == 2
    for name in MPI_NAMES:
        for rank in range(2):
            devices = [str(d) for d in result[f"{name}/residual devices/{rank}"]]
            assert devices == residual_devices_of(name), (name, rank, devices)
        got = {p: result[f"{name}/{p}"] for p in workload.make_model().state_dict()}
        assert_close(got, simulate(name, 2, "cuda"), tolerance(name), f"{name} over MPI vs Simulator")


def mpi_worker(out: str) -> None:
    """Both ranks train on ``cuda``; rank 0 checks that the ranks agree and writes ``out``."""
    import hvd_compress.mpi as hvd

    comm = hvd.communicator()
    arrays = {"size": np.array(comm.size), "cuda_aware": np.array(hvd.cuda_aware())}
    for name in MPI_NAMES:
        model = workload.make_model().to("cuda")
        compression = workload.compressor(name)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=workload.LR),
            named_parameters=model.named_parameters(),
            compression=compression,
        )
        for x, y in workload.batches(comm.rank, STEPS):
            optimizer.zero_grad()
            workload.loss_fn(model, x.to("cuda"), y.to("cuda")).backward()
            optimizer.step()
        result = summary(model, compression)
        everyone = comm.comm.gather(result, root=0)
        if comm.rank == 0:
            params = {p: v for p, v in result.items() if p != "residual devices"}
            for rank, theirs in enumerate(everyone):
                arrays[f"{name}/residual devices/{rank}"] = np.array(theirs["residual devices"], dtype=str)
                for param, value in params.items():
                    if not np.array_equal(theirs[param], value):
                        raise AssertionError(f"{name}: rank {rank} differs from rank 0 in {param}")
            arrays.update({f"{name}/{param}": value for param, value in params.items()})
    if comm.rank == 0:
        np.savez(out, **arrays)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["--mpi-worker"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m tests.routes.test_cuda_training --mpi-worker OUT.npz")
    mpi_worker(sys.argv[2])
