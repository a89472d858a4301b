"""``torch.amp.GradScaler`` with the drop-in optimizer, on 2 thread ranks, an Inf on rank 1 at one step.

Both recipes, PyTorch's plain one (``scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()``, as with DDP) and Horovod's (``synchronize()``, ``unscale_``,
``skip_synchronize()``), give the same parameters and scales, bit for bit: the backward
that completes every bucket ends with the exchange done, so the scaler reads the
exchanged gradients and every rank skips the step with the Inf. With ``NoneCompressor``
both equal DDP's arithmetic computed here densely (the average of the ranks' scaled
gradients, then the same scaler); tests/distributed/test_torch_dist.py compares with DDP
itself over gloo. A model with a parameter backward never reaches cannot finish the exchange at
the end of backward: the plain recipe then stops on every rank with an error naming
GradScaler and Horovod's recipe, which still trains.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd_torch  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

RANKS, STEPS, INF_STEP, SCALE = 2, 4, 1, 2.0**10


def data(rank: int):
    """Rank ``rank``'s batches; rank 1's at ``INF_STEP`` holds an Inf (a loss-scale overflow)."""
    batches = workload.batches(rank, STEPS)
    if rank == 1:
        x, y = batches[INF_STEP]
        x = x.clone()
        x[0, 0] = float("inf")
        batches[INF_STEP] = (x, y)
    return batches


def scaled_step(scaler, optimizer, recipe: str) -> None:
    """After ``scaler.scale(loss).backward()``: the rest of ``recipe``'s step."""
    if recipe == "horovod":
        optimizer.synchronize()
        scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
    else:
        scaler.step(optimizer)
    scaler.update()


def train(comm, model, name: str, recipe: str, extra=None):
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=workload.compressor(name),
        communicator=comm,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scales, stepped = [], []
    for x, y in data(comm.rank):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(workload.loss_fn(model, x, y)).backward()
        scaled_step(scaler, optimizer, recipe)
        scales.append(scaler.get_scale())
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    return {"params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
            "scales": scales, "stepped": stepped}


def dense_reference():
    """One replica stepped as every rank steps under DDP: the average ``(g_0 + g_1) / 2`` of the ranks'
    scaled gradients (NaN/Inf included), then the same scaler."""
    model = workload.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=workload.LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    per_rank = [data(r) for r in range(RANKS)]
    scales = []
    for step in range(STEPS):
        grads = []
        for rank in range(RANKS):
            model.zero_grad()
            scaler.scale(workload.loss_fn(model, *per_rank[rank][step])).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_param in zip(model.parameters(), *grads):
            p.grad = (per_param[0] + per_param[1]) / RANKS
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {n: p.detach().numpy() for n, p in model.named_parameters()}, scales


@pytest.mark.parametrize("name", ["none", "topk", "regtopk", "terngrad"])
def test_plain_and_horovod_recipes_skip_the_overflow_on_every_rank_alike(name):
    """Both recipes: the same parameters and scales on every rank, bit for bit; the step with the Inf
    skipped everywhere; NoneCompressor equal to DDP's arithmetic."""
    results = {}
    for recipe in ("plain", "horovod"):
        models = [workload.make_model() for _ in range(RANKS)]
        results[recipe] = run_ranks(RANKS, lambda comm: train(comm, models[comm.rank], name, recipe), timeout=60)
    expected, expected_scales = dense_reference() if name == "none" else (results["horovod"][0]["params"], None)
    for recipe, ranks in results.items():
        for rank, result in enumerate(ranks):
            where = f"{name} {recipe} rank {rank}"
            assert result["stepped"] == [step != INF_STEP for step in range(STEPS)], where
            assert result["scales"] == [SCALE, SCALE / 2, SCALE / 2, SCALE / 2], where
            assert expected_scales in (None, result["scales"]), where
            for param, value in expected.items():
                np.testing.assert_array_equal(result["params"][param], value, err_msg=f"{where} {param}")
            assert all(np.isfinite(value).all() for value in result["params"].values()), where


class WithUnused(torch.nn.Module):
    """The workload's model and a layer its forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.net = workload.make_model()
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


def test_plain_recipe_with_a_parameter_backward_never_reaches_names_gradscaler_on_every_rank():
    models = [WithUnused() for _ in range(RANKS)]
    errors = []

    def work(comm):
        try:
            train(comm, models[comm.rank], "topk", "plain")
        except (RuntimeError, AssertionError) as error:
            errors.append(str(error))
        return None

    run_ranks(RANKS, work, timeout=60)
    assert len(errors) == RANKS, errors
    for message in errors:
        assert "GradScaler" in message and "optimizer.synchronize()" in message, message
        assert "with optimizer.skip_synchronize():" in message, message
    models = [WithUnused() for _ in range(RANKS)]  # Horovod's recipe trains it, the overflow skipped everywhere
    for result in run_ranks(RANKS, lambda comm: train(comm, models[comm.rank], "topk", "horovod"), timeout=60):
        assert result["stepped"] == [step != INF_STEP for step in range(STEPS)]
        assert all(np.isfinite(value).all() for value in result["params"].values())
