"""Conformance checks every compressor must pass (docs/adding_a_compressor.md).

Each ``check_*`` takes ``make``, a function returning a new, identically configured
compressor (one per rank), and raises ``AssertionError`` (or the library's error)
when the compressor breaks a contract the exchanges and the Simulator rely on:

- :func:`check_payloads`: ``encode`` returns a payload of the compressor's
  ``payload_kind`` (or dense), ``decode`` of one rank's payload has the tensor's shape;
- :func:`check_rejects_bad_gradients`: integer, empty and NaN/Inf gradients fail
  with an ``hvd_compress:`` message naming the tensor;
- :func:`check_conserves_mass`: with error feedback, over any steps and on every
  rank, produced = sent + residual (``sum_t g_t = sum_t sent_t + r_T``);
- :func:`check_thread_ranks_equal_per_tensor_spec`: the real per-rank exchange
  (:class:`~hvd_compress.engine.exchange.BucketExchange` over thread ranks, the bucket engine)
  gives the averages of the per-tensor spec (:class:`tests.oracle.PerTensorRanks`: the
  compressor's own ``encode``/``decode``, tensor by tensor);
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
from hvd_compress.wire import DensePayload, SparsePayload, TernaryPayload
from tests.oracle import PerTensorRanks

Make = Callable[[], Any]

SHAPES = {"layer.weight": (8, 40), "layer.bias": (40,)}
PAYLOAD_TYPES = {"dense": DensePayload, "sparse": SparsePayload, "ternary": TernaryPayload}


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
def check_payloads(make: Make, framework: str = "numpy") -> None:
    """``encode`` gives a payload of ``payload_kind`` (or dense) whose ``decode`` has the tensor's shape."""
    compressor = make()
    assert compressor.config()["type"] == type(compressor).__name__
    expected = PAYLOAD_TYPES[compressor.payload_kind]
    for name, (grad,) in gradients(0, 1, framework).items():
        payload = compressor.encode(grad, name)
        assert isinstance(payload, (expected, DensePayload)), (name, payload)
        assert payload.nbytes > 0
        decoded = compressor.decode([payload], grad.shape, average=False)
        assert tuple(decoded.shape) == tuple(grad.shape)
        assert as_numpy(decoded).dtype == as_numpy(grad).dtype


def check_rejects_bad_gradients(make: Make) -> None:
    """Integer, empty and non-finite gradients fail with a message naming the tensor."""
    compressor = make()
    with pytest.raises(TypeError, match="hvd_compress: .*'ints'"):
        compressor.encode(np.arange(10), "ints")
    with pytest.raises(ValueError, match="hvd_compress: .*'empty'"):
        compressor.encode(np.zeros(0, np.float32), "empty")
    bad = np.ones(50, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="hvd_compress: .*'nan'"):
        compressor.encode(bad, "nan")


def check_conserves_mass(make: Make, ranks: int = 3, steps: int = 4) -> None:
    """Every rank: ``sum_t g_t = sum_t sent_t + r_T`` (float64, so up to rounding only)."""
    compressors = [make().bind(rank, ranks) for rank in range(ranks)]
    assert getattr(compressors[0], "error_feedback", False), "mass is conserved only with error feedback"
    produced = {name: [np.zeros(shape) for _ in range(ranks)] for name, shape in SHAPES.items()}
    sent = copy.deepcopy(produced)
    for step in range(steps):
        for name, per_rank in gradients(step, ranks, dtype=np.float64).items():
            for rank, (compressor, grad) in enumerate(zip(compressors, per_rank)):
                payload = compressor.encode(grad, name)
                produced[name][rank] += grad
                sent[name][rank] += compressor.decode([payload], grad.shape, average=False)
    for name in SHAPES:
        for rank, compressor in enumerate(compressors):
            residual = compressor.residual(name)
            kept = 0.0 if residual is None else residual
            np.testing.assert_allclose(sent[name][rank] + kept, produced[name][rank], rtol=1e-12, atol=1e-12)
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
    make: Make, ranks: int = 3, steps: int = 3, framework: str = "numpy", rtol: float = 1e-6
) -> None:
    """Thread ranks through :class:`BucketExchange` give the per-tensor spec's averages, on every rank.

    ``rtol``: 1e-6 is float32 rounding; a float16 wire (FP16) rounds the sum to float16
    as a real allreduce does, where the per-tensor ``decode`` sums in float32: ``rtol=1e-3``.
    ``framework="tensorflow-kernels"``: TensorFlow tensors on TensorFlow's kernels (:func:`tensorflow_kernels`).
    """
    thread_ranks_equal(PerTensorRanks, make, ranks, steps, framework, rtol)


def check_thread_ranks_equal_simulator(
    make: Make, ranks: int = 3, steps: int = 3, framework: str = "numpy", rtol: float = 1e-6
) -> None:
    """Thread ranks through :class:`BucketExchange` give the Simulator's averages (lockstep ranks of the
    same engine), on every rank; ``rtol`` and ``framework`` as :func:`check_thread_ranks_equal_per_tensor_spec`."""
    thread_ranks_equal(Simulator, make, ranks, steps, framework, rtol)


def thread_ranks_equal(spec: Callable[..., Any], make: Make, ranks: int, steps: int, framework: str,
                       rtol: float) -> None:
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
                    got[name], as_numpy(want[name]), rtol=rtol, atol=1e-7, err_msg=f"step {step} {name}"
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
