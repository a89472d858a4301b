"""Conformance checks every compressor must pass (docs/adding_a_compressor.md).

Each ``check_*`` takes ``make``, a function returning a new, identically configured
compressor (one per rank), and raises ``AssertionError`` (or the library's error)
when the compressor breaks a contract the exchanges and the Simulator rely on:

- :func:`check_results_keep_shape_and_dtype`: a step gives every tensor back in its shape
  and dtype and counts its bytes;
- :func:`check_rejects_bad_gradients`: an integer gradient fails with an ``hvd_compress:``
  message naming the tensor; a NaN/Inf on one rank makes that tensor non-finite on every rank;
- :func:`check_conserves_mass`: with error feedback, over any steps,
  produced = sent + residual (``sum_t g_t = sum_t sent_t + r_T``);
- :func:`check_thread_ranks_equal_per_tensor_spec`: the real per-rank exchange
  (:class:`~hvd_compress.engine.exchange.BucketExchange` over thread ranks, the bucket engine)
  gives the averages of the per-tensor spec (:class:`tests.oracle.PerTensorRanks`: the
  independent numpy spec of :mod:`spec`, tensor by tensor, or a spec the caller brings);
- :func:`check_thread_ranks_equal_simulator`: the same exchange gives the Simulator's averages
  (the engine over lockstep ranks: a transport check, for index sets shared by the ranks,
  which have no per-tensor spec);
- :func:`check_drop_in_optimizer_equals_simulator`: the drop-in
  ``hvd_compress.torch.DistributedOptimizer`` on thread ranks trains a small model
  to the parameters the Simulator gives;
- :func:`check_state_dict_round_trip`: a compressor restored from ``state_dict()``
  continues exactly (residuals, per-tensor state, random streams);
- :func:`check_ranks_disagreeing_fail_clearly`: ranks running different
  configurations stop with the header's error on every rank, no hang.

Gradients are small (a few hundred elements): ``make`` should compress them
(``dense_below=0`` for the sparsifiers).
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from typing import Any, Callable, Dict, List

import numpy as np
import pytest

from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.simulator import Simulator
from hvd_compress.transport.lockstep import LockstepGroup
from tests.oracle import PerTensorRanks

Make = Callable[[], Any]

SHAPES = {"layer.weight": (8, 40), "layer.bias": (40,)}


def gradients(step: int, ranks: int, framework: str = "numpy", dtype: Any = np.float32) -> Dict[str, List[Any]]:
    """``{name: [gradient of rank 0, ..., rank N-1]}`` for ``step``, deterministic, scale drifting with the step,
    as numpy arrays, torch or TensorFlow tensors (then that framework's kernels and random streams run; TensorFlow's
    float32 CPU tensors are computed as numpy arrays, :func:`hvd_compress.kernels.computed_form`)."""
    rng = np.random.default_rng(500 + step)
    grads = {
        name: [(rng.standard_normal(shape) * (1 + 0.2 * step)).astype(dtype) for _ in range(ranks)]
        for name, shape in SHAPES.items()
    }
    if framework == "torch":
        torch = pytest.importorskip("torch")
        grads = {name: [torch.from_numpy(g) for g in per_rank] for name, per_rank in grads.items()}
    elif framework == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        grads = {name: [tf.constant(g) for g in per_rank] for name, per_rank in grads.items()}
    return grads


@contextlib.contextmanager
def tensorflow_kernels():
    """TensorFlow's CPU float32/float64 tensors kept on TensorFlow's kernels (what a GPU runs), not
    computed as numpy arrays (:func:`hvd_compress.kernels.computed_form`), in every thread (skips
    without TensorFlow)."""
    pytest.importorskip("tensorflow")
    from hvd_compress.kernels import tf_ops

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tf_ops, "host_array", lambda a: a)
        yield


def as_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of a numpy array, torch tensor or TensorFlow tensor."""
    if hasattr(tensor, "detach"):
        return tensor.detach().numpy()
    return tensor.numpy() if hasattr(tensor, "numpy") else np.asarray(tensor)


# --------------------------------------------------------------------------- compressor alone
def check_results_keep_shape_and_dtype(make: Make, framework: str = "numpy") -> None:
    """A step of one rank (the Simulator: the engine) gives every tensor back in its shape and dtype, and
    counts the bytes it handed to the collectives."""
    compressor = make()
    assert compressor.config()["type"] == type(compressor).__name__
    sim = Simulator(1, compressor)
    grads = gradients(0, 1, framework)
    out = sim.step(grads)
    for name, (grad,) in grads.items():
        assert tuple(out[name].shape) == tuple(grad.shape), name
        assert as_numpy(out[name]).dtype == as_numpy(grad).dtype, name
    assert sim.bytes_sent_per_rank[0] > 0


def check_rejects_bad_gradients(make: Make) -> None:
    """An integer gradient is refused naming the tensor; a NaN/Inf on one rank makes that tensor (and only
    that one) non-finite on every rank, as a dense allreduce would."""
    with pytest.raises(TypeError, match="hvd_compress: .*'ints'"):
        BucketExchange(make(), LockstepGroup(1).rank(0), "bucket").add("ints", np.arange(10))
    grads = gradients(0, 2)
    poisoned = next(iter(grads))
    grads[poisoned][1] = grads[poisoned][1].copy()
    grads[poisoned][1].reshape(-1)[3] = np.nan
    out = Simulator(2, make()).step(grads)
    for name in grads:
        assert np.isnan(out[name]).any() == (name == poisoned), name


def check_conserves_mass(make: Make, steps: int = 4) -> None:
    """With error feedback: ``sum_t g_t = sum_t sent_t + r_T`` (float64, up to rounding only), where what a
    rank sent is the sum over a world of one (the Simulator: the engine)."""
    assert getattr(make(), "error_feedback", False), "mass is conserved only with error feedback"
    sim = Simulator(1, make())
    produced = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    sent = copy.deepcopy(produced)
    for step in range(steps):
        grads = gradients(step, 1, dtype=np.float64)
        out = sim.step(grads)
        for name, (grad,) in grads.items():
            produced[name] += grad
            sent[name] += out[name]
    for name in SHAPES:
        residual = sim.residuals(name)[0]
        kept = 0.0 if residual is None else residual
        np.testing.assert_allclose(sent[name] + kept, produced[name], rtol=1e-12, atol=1e-12)
        assert np.any(kept != 0), f"{name}: nothing was kept back; is anything compressed?"


def check_state_dict_round_trip(make: Make, ranks: int = 3, framework: str = "numpy") -> None:
    """Steps 2 and 3 of a Simulator restored after step 1 equal those of the one that went on."""
    first = Simulator(ranks, make())
    first.step(gradients(0, ranks, framework))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    went_on = [first.step(gradients(step, ranks, framework)) for step in (1, 2)]
    restored = Simulator(ranks, make())
    restored.load_state_dict(state)
    again = [restored.step(gradients(step, ranks, framework)) for step in (1, 2)]
    for want, got in zip(went_on, again):
        for name in SHAPES:
            np.testing.assert_array_equal(as_numpy(got[name]), as_numpy(want[name]), err_msg=name)
    for name in SHAPES:
        for a, b in zip(first.residuals(name), restored.residuals(name)):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(as_numpy(a), as_numpy(b), err_msg=name)


# --------------------------------------------------------------------------- real exchange, thread ranks
def exchange_steps(comm: Any, compressor: Any, steps: int, framework: str) -> List[Dict[str, np.ndarray]]:
    """This rank's averages of ``steps`` steps through one bucket of the real exchange."""
    out = []
    for step in range(steps):
        exchange = BucketExchange(compressor, comm, "bucket0")
        for name, per_rank in gradients(step, comm.size, framework).items():
            exchange.add(name, per_rank[comm.rank])
        exchange.launch()
        out.append({name: as_numpy(value) for name, value in exchange.finish(average=True).items()})
    return out


def check_thread_ranks_equal_per_tensor_spec(
    make: Make, ranks: int = 3, steps: int = 3, framework: str = "numpy", rtol: float = 1e-6,
    spec: Callable[..., Any] = PerTensorRanks, atol: float = 1e-7,
) -> None:
    """Thread ranks through :class:`BucketExchange` give the per-tensor spec's averages, on every rank.

    ``rtol``: 1e-6 is float32 rounding (torch's and TensorFlow's kernels may round a std or a sum
    otherwise). ``framework="tensorflow-kernels"``: TensorFlow tensors on TensorFlow's kernels
    (:func:`tensorflow_kernels`). ``spec(ranks, compressor)``: the yardstick (a compressor of a kind the
    spec does not know brings its own, with ``step`` as :class:`~tests.oracle.PerTensorRanks` has it).
    ``atol``: for averages that cancel (a sum of ranks' terms far larger than itself).
    """
    thread_ranks_equal(spec, make, ranks, steps, framework, rtol, atol)


def check_thread_ranks_equal_simulator(
    make: Make, ranks: int = 3, steps: int = 3, framework: str = "numpy", rtol: float = 1e-6
) -> None:
    """Thread ranks through :class:`BucketExchange` give the Simulator's averages (lockstep ranks of the
    same engine), on every rank; ``rtol`` and ``framework`` as :func:`check_thread_ranks_equal_per_tensor_spec`."""
    thread_ranks_equal(Simulator, make, ranks, steps, framework, rtol, 1e-7)


def thread_ranks_equal(spec: Callable[..., Any], make: Make, ranks: int, steps: int, framework: str,
                       rtol: float, atol: float) -> None:
    """Thread ranks of ``make()`` against ``spec(ranks, make())`` stepped on the same gradients."""
    compressors = [make() for _ in range(ranks)]
    kernels = framework == "tensorflow-kernels"
    framework = "tensorflow" if kernels else framework
    with tensorflow_kernels() if kernels else contextlib.nullcontext():
        results = run_ranks(ranks, lambda comm: exchange_steps(comm, compressors[comm.rank], steps, framework),
                            timeout=30)
        expected_ranks = spec(ranks, make())
        expected = [expected_ranks.step(gradients(step, ranks, framework)) for step in range(steps)]
    for rank_result in results:
        for step, (got, want) in enumerate(zip(rank_result, expected)):
            for name in SHAPES:
                np.testing.assert_allclose(
                    got[name], as_numpy(want[name]), rtol=rtol, atol=atol, err_msg=f"step {step} {name}"
                )


def check_ranks_disagreeing_fail_clearly(make: Make, make_other: Make) -> None:
    """Rank 1 runs ``make_other()``: every rank stops with the header's error (thread ranks, no hang)."""
    compressors = [make(), make_other()]
    with pytest.raises(ValueError, match="hvd_compress: ranks disagree"):
        run_ranks(2, lambda comm: exchange_steps(comm, compressors[comm.rank], 1, "numpy"), timeout=20)


def check_drop_in_optimizer_equals_simulator(make: Make, ranks: int = 2, steps: int = 3) -> None:
    """``hvd_compress.torch.DistributedOptimizer`` on thread ranks trains as the Simulator does."""
    torch = pytest.importorskip("torch")
    import hvd_compress.torch as hvd_torch

    def model() -> Any:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))

    def batch(rank: int, step: int):
        generator = torch.Generator().manual_seed(100 * rank + step)
        return torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)

    def loss(net: Any, rank: int, step: int) -> Any:
        x, y = batch(rank, step)
        return torch.nn.functional.mse_loss(net(x), y)

    models = [model() for _ in range(ranks)]  # built here: model() seeds torch's global generator

    def train(comm: Any) -> Dict[str, np.ndarray]:
        net = models[comm.rank]
        optimizer = hvd_torch.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            named_parameters=net.named_parameters(),
            compression=make(),
            communicator=comm,
        )
        for step in range(steps):
            optimizer.zero_grad()
            loss(net, comm.rank, step).backward()
            optimizer.step()
        return {n: p.detach().numpy().copy() for n, p in net.named_parameters()}

    results = run_ranks(ranks, train, timeout=30)

    net, sim = model(), Simulator(ranks, make())
    params = list(net.named_parameters())[::-1]  # the optimizer's hooks fire last layer first
    for step in range(steps):
        grads: Dict[str, List[Any]] = {n: [] for n, _ in params}
        for rank in range(ranks):
            net.zero_grad()
            loss(net, rank, step).backward()
            for n, p in params:
                grads[n].append(p.grad.clone())
        averaged = sim.step(grads)
        with torch.no_grad():
            for n, p in params:
                p -= 0.1 * averaged[n]
    for result in results:
        for n, p in net.named_parameters():
            np.testing.assert_allclose(result[n], p.detach().numpy(), rtol=0, atol=1e-6, err_msg=n)
