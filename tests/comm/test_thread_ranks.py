"""Thread ranks (hvd_compress.transport.threads): the real per-rank exchange code, N ranks in one process."""

import numpy as np
import pytest

from hvd_compress.transport.threads import run_ranks


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_collectives_against_numpy(framework):
    as_tensor = np.asarray
    if framework == "torch":
        torch = pytest.importorskip("torch")
        as_tensor = torch.from_numpy

    def work(comm):
        r = comm.rank
        out = {
            "sum": comm.wait(comm.allreduce_async(as_tensor(np.arange(4.0) * (r + 1)), comm.SUM, "s")),
            "max": comm.wait(comm.allreduce_async(as_tensor(np.array([r, -r], np.int32)), comm.MAX, "m")),
            "wrap": comm.wait(
                comm.allreduce_async(as_tensor(np.array([2**31 - 1], np.int32)), comm.SUM, "w")
            ),
            "gather": comm.wait(comm.allgather_async(as_tensor(np.full(r, float(r))), "g")),  # rank 0: empty
        }
        return {k: np.asarray(v) for k, v in out.items()}

    for result in run_ranks(3, work):
        np.testing.assert_array_equal(result["sum"], np.arange(4.0) * 6)
        np.testing.assert_array_equal(result["max"], [2, 0])
        np.testing.assert_array_equal(result["wrap"], [2**31 - 3])  # 3 * (2^31 - 1) mod 2^32, signed
        np.testing.assert_array_equal(result["gather"], [1.0, 2.0, 2.0])


def _train(name, comm, model, steps=4, ratio=None, nan_rank=None):
    import torch

    import hvd_compress.torch as hvd_torch
    from tests.distributed import torch_horovod as workload

    compression = workload.compressor(name)
    if ratio is not None and comm.rank == 1:
        compression.ratio = ratio
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=comm,
    )
    for x, y in workload.batches(comm.rank, steps):
        if comm.rank == nan_rank:
            x = x * float("nan")
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        optimizer.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _models(n):
    """Built here, one after the other: make_model seeds torch's global generator, which threads share."""
    from tests.distributed import torch_horovod as workload

    return [workload.make_model() for _ in range(n)]


@pytest.mark.parametrize("name", ["topk", "gaussiank", "regtopk", "terngrad", "fp16"])
def test_drop_in_optimizer_on_thread_ranks_equals_simulator(name):
    pytest.importorskip("torch")
    from tests.distributed import torch_horovod as workload

    models = _models(3)
    results = run_ranks(3, lambda comm: _train(name, comm, models[comm.rank]))
    expected = workload.simulate(name, 3, 4)
    tolerance = 1e-4 if name == "fp16" else 1e-6
    for result in results:
        for param, value in expected.items():
            np.testing.assert_allclose(
                result[param], value, rtol=0, atol=tolerance, err_msg=f"{name} {param}"
            )


def test_mismatched_ranks_fail_every_rank_clearly_and_nan_reaches_every_rank():
    pytest.importorskip("torch")
    models = _models(2)
    with pytest.raises(ValueError, match="ranks disagree"):
        run_ranks(2, lambda comm: _train("topk", comm, models[comm.rank], steps=1, ratio=0.2), timeout=20)
    models = _models(2)  # fresh: the failed run's optimizers left their hooks on the old ones
    results = run_ranks(2, lambda comm: _train("topk", comm, models[comm.rank], steps=1, nan_rank=1), timeout=20)
    for result in results:  # as a dense allreduce: the NaN of rank 1 reaches every rank's update
        assert all(not np.isfinite(value).all() for value in result.values()), result
