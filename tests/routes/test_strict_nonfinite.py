"""Strict mode, ``nonfinite="raise"``, on the drop-in optimizer over thread ranks.

A NaN gradient of one parameter on rank 1 at step 1: every rank raises
:class:`~hvd_compress.NonFiniteGradientError` at that step naming that parameter
only, no rank takes the step, and every rank then trains on with the same optimizer
(same weights on every rank, all finite, residuals finite). Ranks that disagree on
the mode stop at the first step with ``ranks disagree``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hvd_compress.torch as hvd_torch  # noqa: E402
from hvd_compress import NonFiniteGradientError  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from tests.distributed import torch_horovod as workload  # noqa: E402

STEPS, BAD_STEP, BAD_PARAM = 4, 1, "0.weight"


def train(comm, model, name, modes=("raise", "raise")):
    compression = workload.compressor(name)
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=workload.LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=comm,
        nonfinite=modes[comm.rank],
    )
    params = dict(model.named_parameters())
    raised, before_after = [], None
    for step, (x, y) in enumerate(workload.batches(comm.rank, STEPS)):
        hook = None
        if (comm.rank, step) == (1, BAD_STEP):
            hook = params[BAD_PARAM].register_hook(lambda g: g * float("nan"))
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        before = {n: p.detach().clone() for n, p in params.items()}
        try:
            optimizer.step()
        except NonFiniteGradientError as error:
            raised.append((step, str(error)))
            before_after = all(torch.equal(before[n], p) for n, p in params.items())
        if hook is not None:
            hook.remove()
    residuals = [compression.residual(n) for n in params]
    return {
        "raised": raised,
        "untouched": before_after,
        "weights": {n: p.detach().numpy().copy() for n, p in params.items()},
        "residuals_finite": all(r is None or bool(torch.isfinite(r).all()) for r in residuals),
    }


def models(n):
    return [workload.make_model() for _ in range(n)]


@pytest.mark.parametrize("name", ["topk", "regtopk", "terngrad", "fp16"])
def test_nan_on_one_rank_raises_on_every_rank_at_that_step_and_training_goes_on(name):
    nets = models(2)
    results = run_ranks(2, lambda comm: train(comm, nets[comm.rank], name), timeout=60)
    for result in results:
        assert [step for step, _ in result["raised"]] == [BAD_STEP], result["raised"]
        message = result["raised"][0][1]
        assert f"'{BAD_PARAM}'" in message and "(1 of 4 tensors)" in message, message
        assert result["untouched"], "the step that raised must not change the weights"
        assert result["residuals_finite"]
        assert all(np.isfinite(w).all() for w in result["weights"].values())
    for param in results[0]["weights"]:
        np.testing.assert_array_equal(results[0]["weights"][param], results[1]["weights"][param], err_msg=param)


def test_ranks_that_disagree_on_the_mode_stop_at_the_first_step():
    nets = models(2)
    with pytest.raises(ValueError, match="ranks disagree"):
        run_ranks(2, lambda comm: train(comm, nets[comm.rank], "topk", modes=("raise", "propagate")), timeout=30)


def test_the_mode_is_validated():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        hvd_torch.DistributedOptimizer(
            torch.optim.SGD(workload.make_model().parameters(), lr=0.1), nonfinite="skip"
        )
