"""Momentum correction and momentum-factor masking (Deep Gradient Compression, Lin et al. 2018, 3.2).

Per tensor and step, with ``momentum=m``::

    u = m u + g;  a = r + u;  S = select(a);  send a[S];  r = a with a[S] = 0;  u[S] = 0

and tensors sent dense send ``u`` unmasked. Checked here: a golden run worked by
hand; the compressors on numpy, torch and TensorFlow tensors equal a numpy
transcription of the formula; dense tensors train as momentum SGD of the
average gradient; the argument check; the refusal of an optimizer with its own
momentum (drop-in and stock Horovod's bucket plan); checkpoints (velocity
validated, a resume mid-training continues exactly); ``momentum=0`` is today's
compressor; the exchange keeps the velocity of a non-finite step.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.transport.threads import run_ranks
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.horovod.torch_buckets import Plan
from spec import sparse as spec_sparse
from hvd_compress.simulator import Simulator
from tests.oracle import PerTensorRanks
from tests import conformance

SPARSE = {"topk": TopK, "gaussiank": GaussianK, "regtopk": RegTopK}


# --------------------------------------------------------------------------- the formula
def test_golden_steps_by_hand():
    """Top-k, k = 1 of 4 entries, m = 1/2, one rank: every value below worked out by hand."""
    sim = Simulator(1, TopK(0.25, dense_below=0, momentum=0.5))
    steps = [
        # gradient,              sent (index, value), residual r,           velocity u (masked)
        ([1, -2, 0.5, 0.25], (1, -2.0), [1, 0, 0.5, 0.25], [1, 0, 0.5, 0.25]),
        ([1, 1, -1, 0], (0, 2.5), [0, 1, -0.25, 0.375], [0, 1, -0.75, 0.125]),
        ([0, 0, 0, 2], (3, 2.4375), [0, 1.5, -0.625, 0], [0, 0.5, -0.375, 0]),
    ]
    for g, (index, value), r, u in steps:
        sent = sim.step({"w": [np.array(g, np.float32)]})["w"]  # one rank: its average is what it sent
        np.testing.assert_array_equal(sent, np.where(np.arange(4) == index, value, 0))
        np.testing.assert_array_equal(sim.residuals("w")[0], r)
        np.testing.assert_array_equal(sim.velocities("w")[0], u)


def test_golden_dense_tensor_sends_its_velocity_unmasked():
    sim = Simulator(1, TopK(0.25, dense_below=8, momentum=0.5))  # 3 elements: dense
    for g, u in (([1, 2, 3], [1, 2, 3]), ([0, 0, 1], [0.5, 1, 2.5]), ([2, 0, 0], [2.25, 0.5, 1.25])):
        np.testing.assert_array_equal(sim.step({"b": [np.array(g, np.float32)]})["b"], u)
        np.testing.assert_array_equal(sim.velocities("b")[0], u)
        assert sim.residuals("b") == [None]


def spec_run(kind: str, grads, m: float, ratio: float, mu: float = 5.0):
    """The formula transcribed with the numpy spec's functions: one rank, error feedback, ``(sent, r, u)`` per
    step (RegTop-k: one rank's aggregate is its own sent vector)."""
    r = u = None
    posterior, out = None, []
    for g in grads:
        g = g.astype(np.float32)
        u = g.copy() if u is None else u * np.float32(m) + g
        a = u if r is None else r + u
        select = {"topk": spec_sparse.topk_select, "gaussiank": spec_sparse.gaussiank_select}.get(
            kind, spec_sparse.regtopk_select)
        S = select(a, ratio, posterior, mu)
        sent = np.zeros_like(a)
        sent[S] = a[S]
        r = a.copy()
        r[S] = 0
        u = u.copy()
        u[S] = 0
        if kind == "regtopk":
            state = {}
            spec_sparse.learn_posterior(sent, {"indices": S, "values": a[S]}, state)
            posterior = state["posterior"]
        out.append((sent, r, u))
    return out


as_numpy = conformance.as_numpy


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_compressor_equals_the_spec(kind, framework):
    """The compressor on numpy, torch or TensorFlow tensors equals the transcribed formula bit for bit."""
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(300).astype(np.float32) * (1 + 0.3 * t) for t in range(4)]
    expected = spec_run(kind, grads, 0.9, 0.05)
    sim = Simulator(1, SPARSE[kind](0.05, dense_below=0, momentum=0.9))
    for g, (sent, r, u) in zip(grads, expected):
        got = sim.step({"w": [_as(framework, g)]})["w"]
        np.testing.assert_array_equal(as_numpy(got), sent)
        np.testing.assert_array_equal(as_numpy(sim.compressors[0].residual("w")), r)
        np.testing.assert_array_equal(as_numpy(sim.velocities("w")[0]), u)


def _as(framework: str, g: np.ndarray):
    if framework == "numpy":
        return g
    if framework == "torch":
        return pytest.importorskip("torch").from_numpy(g.copy())
    return pytest.importorskip("tensorflow").constant(g)


@pytest.mark.parametrize("ranks_of", [Simulator, PerTensorRanks], ids=["engine", "per-tensor"])
def test_dense_tensors_train_as_momentum_sgd_of_the_average(ranks_of):
    """Dense tensors (under ``dense_below``, and ``N k >= d``): the average of what the ranks send
    is the velocity of momentum SGD fed the average gradient. The engine (the Simulator, every route)
    plans 'cheap' dense from the start, silently (it warns only when a tensor holding a residual turns
    dense)."""
    ranks, m = 3, 0.9
    sim = ranks_of(ranks, TopK(0.5, dense_below=10, momentum=m))
    rng = np.random.default_rng(1)
    velocity = {"small": np.zeros(6), "cheap": np.zeros(40)}  # 3 ranks x k = 20 >= 40: dense
    for step in range(5):
        grads = {n: [rng.standard_normal(v.size).astype(np.float32) for _ in range(ranks)] for n, v in velocity.items()}
        with _no_warning():
            out = sim.step(grads)
        for name, v in velocity.items():
            v *= m
            v += np.mean(grads[name], axis=0, dtype=np.float64)
            np.testing.assert_allclose(out[name], v, rtol=1e-5, atol=1e-6)


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_without_error_feedback_the_velocity_is_still_masked():
    sim = Simulator(1, TopK(0.25, dense_below=0, momentum=0.5, error_feedback=False))
    # step 1: u = g, sends -2 (index 1), u[1] = 0 -> [1, 0, 0.5, 0.25]
    np.testing.assert_array_equal(sim.step({"w": [np.array([1, -2, 0.5, 0.25], np.float32)]})["w"], [0, -2, 0, 0])
    # step 2: u = 0.5 [1, 0, 0.5, 0.25] + [1, 1, -1, 0] = [1.5, 1, -0.75, 0.125]: sends 1.5 (index 0)
    sent = sim.step({"w": [np.array([1, 1, -1, 0], np.float32)]})["w"]
    np.testing.assert_array_equal(sent, [1.5, 0, 0, 0])
    assert sim.residuals("w") == [None]
    np.testing.assert_array_equal(sim.velocities("w")[0], [0, 1, -0.75, 0.125])


# --------------------------------------------------------------------------- the argument
@pytest.mark.parametrize("kind", sorted(SPARSE))
@pytest.mark.parametrize("value, error", [(1.0, ValueError), (1.5, ValueError), (-0.1, ValueError),
                                          (float("nan"), ValueError), ("0.9", TypeError), (True, TypeError),
                                          (None, TypeError)])
def test_momentum_must_be_a_number_in_0_1(kind, value, error):
    with pytest.raises(error, match=r"momentum must be a number in \[0, 1\)|momentum must be in \[0, 1\)"):
        SPARSE[kind](0.1, momentum=value)
    compressor = SPARSE[kind](0.1, momentum=0.5)
    with pytest.raises(error):
        compressor.momentum = value
    assert compressor.momentum == 0.5


@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_momentum_zero_is_todays_compressor(kind):
    """Same config, hash, repr and results as a compressor made without the argument."""
    plain, zero = SPARSE[kind](0.1, dense_below=0), SPARSE[kind](0.1, dense_below=0, momentum=np.float64(0))
    assert plain.config() == zero.config() and "momentum" not in zero.config()
    assert plain.config_hash() == zero.config_hash() and repr(plain) == repr(zero)
    a, b = Simulator(2, plain), Simulator(2, zero)
    for step in range(3):
        grads = conformance.gradients(step, 2)
        want, got = a.step(grads), b.step(grads)
        for name in grads:
            np.testing.assert_array_equal(got[name], want[name])
            np.testing.assert_array_equal(b.compressors[1].residual(name), a.compressors[1].residual(name))
            assert b.compressors[1].velocity(name) is None
    # the configurations differ only by momentum: ranks that disagree on it stop at the header check
    corrected = SPARSE[kind](0.1, dense_below=0, momentum=0.9)
    assert corrected.config()["momentum"] == 0.9 and corrected.config_hash() != plain.config_hash()
    assert "momentum=0.9" in repr(corrected)


# --------------------------------------------------------------------------- one momentum only
def test_drop_in_optimizer_refuses_an_optimizer_with_momentum():
    torch = pytest.importorskip("torch")
    import hvd_compress.torch as hvd_torch
    from hvd_compress.transport.communicator import SingleProcessCommunicator

    net = torch.nn.Linear(4, 2)
    groups = [{"params": [net.weight]}, {"params": [net.bias], "momentum": 0.9}]
    with pytest.raises(ValueError, match=r"momentum=0\.9.*param_group 1 has momentum=0\.9.*momentum=0 \(plain SGD"):
        hvd_torch.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1), named_parameters=net.named_parameters(),
                                       compression=TopK(0.1, momentum=0.9), communicator=SingleProcessCommunicator())
    for optimizer, compression in ((torch.optim.SGD(net.parameters(), lr=0.1), TopK(0.1, momentum=0.9)),
                                   (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), TopK(0.1))):
        hvd_torch.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                       compression=compression, communicator=SingleProcessCommunicator())


def test_stock_horovod_bucket_plan_refuses_an_optimizer_with_momentum():
    torch = pytest.importorskip("torch")
    from hvd_compress import Auto

    net = torch.nn.Linear(4, 2)

    class HorovodLike:  # what the plan reads of horovod.torch's optimizer
        def __init__(self, momentum: float) -> None:
            self.param_groups = [{"params": list(net.parameters()), "momentum": momentum}]
            self._parameter_names = {p: n for n, p in net.named_parameters()}

    with pytest.raises(ValueError, match=r"horovod\.torch\.DistributedOptimizer.*param_group 0 has momentum=0\.5"):
        Plan(HorovodLike(0.5), TopK(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="applied twice"):
        Plan(HorovodLike(0.5), Auto(RegTopK(0.1, momentum=0.9), log=False))
    assert Plan(HorovodLike(0.0), TopK(0.1, momentum=0.9)).buckets == [["bias", "weight"]]
    assert Plan(HorovodLike(0.5), TopK(0.1)).buckets == [["bias", "weight"]]


def test_double_momentum_error_shows_the_configured_ratio_under_a_warmup():
    """A density warm-up sets the ratio of its first step (0.25); the error shows the 0.01 written."""
    torch = pytest.importorskip("torch")
    from hvd_compress import DensityWarmup
    import hvd_compress.torch as hvd_torch
    from hvd_compress.transport.communicator import SingleProcessCommunicator

    net = torch.nn.Linear(4, 2)
    compression = TopK(0.01, momentum=0.9)
    DensityWarmup(compression, warmup_steps=4, start=0.25)
    assert compression.ratio == 0.25
    with pytest.raises(ValueError) as error:
        hvd_torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                       compression=compression, communicator=SingleProcessCommunicator())
    assert "TopK(ratio=0.01, " in str(error.value) and "ratio=0.25" not in str(error.value)
    assert "(its density warm-up is at 0.25 now)" in str(error.value)


def test_the_configured_traffic_budget_is_shown_under_a_warmup():
    """A traffic budget ramps like a density (``traffic`` follows the ramp): the error names the budget
    written, 0.04, not the ramp's 0.25."""
    from hvd_compress import DensityWarmup
    from hvd_compress.algorithms.validation import check_single_momentum

    compressor = TopK(traffic=0.04, momentum=0.9)
    DensityWarmup(compressor, warmup_steps=3, start=0.25)
    assert compressor.ratio == compressor.traffic == 0.25
    with pytest.raises(ValueError) as raised:
        check_single_momentum(compressor, [("param_group 0", 0.9)], "here")
    shown = str(raised.value)
    assert "ratio=0.04, " in shown and "traffic=0.04)" in shown and "=0.25," not in shown and "=0.25)" not in shown
    assert "(its density warm-up is at 0.25 now)" in shown


def test_adam_betas_count_as_a_momentum_and_the_error_shows_the_configured_ratio():
    """torch's Adam-family ``betas[0]`` is a momentum of its own; a warm-up made first has the compressor
    at its start density, and the error names the ratio the user wrote."""
    from hvd_compress import DensityWarmup
    from hvd_compress.algorithms.validation import check_single_momentum, param_group_momenta

    compressor = RegTopK(0.01, momentum=0.9)
    DensityWarmup(compressor, warmup_steps=3, start=0.25)
    groups = [{"momentum": 0.0}, {"betas": (0.9, 0.999), "lr": 1e-3}]
    assert param_group_momenta(groups) == [("param_group 0", 0.0, "momentum"), ("param_group 1", 0.0, "momentum"),
                                           ("param_group 1", 0.9, "betas[0]")]
    with pytest.raises(ValueError, match=r"RegTopK\(ratio=0\.01, .*\(its density warm-up is at 0\.25 now\).*"
                       r"param_group 1 has betas\[0\]=0\.9: momentum would be applied twice.*compressor "
                       r"momentum=0.*optimizer betas\[0\]=0") as raised:
        check_single_momentum(compressor, param_group_momenta(groups), "here")
    assert "ratio=0.25" not in str(raised.value)
    check_single_momentum(compressor, param_group_momenta([{"betas": (0.0, 0.999)}]), "here")
    check_single_momentum(RegTopK(0.01), param_group_momenta(groups), "here")


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_checkpoint_mid_training_resumes_exactly(kind, framework):
    """Residuals, velocities (dense ``layer.bias`` too) and posteriors: steps after a restore equal the run's."""
    make = lambda: SPARSE[kind](0.1, dense_below=100, momentum=0.9)  # noqa: E731
    conformance.check_state_dict_round_trip(make, framework=framework)
    sim = Simulator(2, make())
    sim.step(conformance.gradients(0, 2, framework))
    tensors = pickle.loads(pickle.dumps(sim.state_dict()))["ranks"][1]["tensors"]
    assert tensors["layer.bias"].get("residual") is None and tensors["layer.bias"]["velocity"] is not None
    assert tensors["layer.weight"]["residual"] is not None and tensors["layer.weight"]["velocity"] is not None


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t["w"].update(velocity=np.zeros(7, np.float32)), "velocity of 'w' has 7 elements"),
        (lambda t: t["w"].update(velocity=np.zeros(50, np.int32)), "velocity of 'w' has dtype int32"),
        (lambda t: t["w"]["velocity"].__setitem__(3, np.inf), "velocity of 'w' holds 1 NaN/Inf"),
    ],
)
def test_damaged_velocity_is_refused(damage, message):
    sim = Simulator(2, TopK(0.1, dense_below=0, momentum=0.9))
    rng = np.random.default_rng(0)
    sim.step({"w": [rng.standard_normal(50).astype(np.float32) for _ in range(2)]})
    state = sim.compressors[0].state_dict()
    state.pop("checksum")
    state["tensors"]["w"]["velocity"] = np.array(state["tensors"]["w"]["velocity"])
    damage(state["tensors"])
    with pytest.raises(ValueError, match=message):
        TopK(0.1, dense_below=0, momentum=0.9).load_state_dict(state)


# --------------------------------------------------------------------------- thread ranks
MOMENTUM = {
    "topk": lambda: TopK(0.1, dense_below=50, momentum=0.9),  # layer.bias (40) dense
    "gaussiank": lambda: GaussianK(0.1, dense_below=50, momentum=0.9),
    "regtopk": lambda: RegTopK(0.1, dense_below=50, momentum=0.9),
}


@pytest.mark.parametrize("framework", ["numpy", "tensorflow"])
@pytest.mark.parametrize("kind", sorted(MOMENTUM))
def test_thread_ranks_equal_the_per_tensor_spec(kind, framework):
    """The exchange over thread ranks (TensorFlow's CPU float32 tensors computed as numpy arrays); torch, and
    TensorFlow's kernels: tests/comm/test_fused_momentum.py."""
    if framework == "tensorflow":
        pytest.importorskip("tensorflow")
    conformance.check_thread_ranks_equal_per_tensor_spec(MOMENTUM[kind], framework=framework, rtol=0)


@pytest.mark.parametrize("kind", sorted(MOMENTUM))
def test_ranks_disagreeing_on_momentum_fail_clearly(kind):
    conformance.check_ranks_disagreeing_fail_clearly(
        MOMENTUM[kind], lambda: SPARSE[kind](0.1, dense_below=50, momentum=0.5)
    )


@pytest.mark.parametrize("kind", sorted(MOMENTUM))
def test_drop_in_optimizer_equals_simulator(kind):
    conformance.check_drop_in_optimizer_equals_simulator(lambda: SPARSE[kind](0.1, dense_below=30, momentum=0.9))


def test_nonfinite_step_keeps_velocity_and_residual():
    """NaN in rank 1's gradients of step 1 (a sparse and a dense tensor): that step's results are NaN on
    every rank, and every rank's residual and velocity are those from before the step, bit for bit."""
    ranks, names = 2, ("w", "b")

    def grads(rank: int, step: int):
        rng = np.random.default_rng(10 * rank + step)
        out = {"w": rng.standard_normal(200).astype(np.float32), "b": rng.standard_normal(20).astype(np.float32)}
        if (rank, step) == (1, 1):
            out["w"][5] = out["b"][2] = np.nan
        return out

    compressors = [TopK(0.05, dense_below=50, momentum=0.9) for _ in range(ranks)]

    def work(comm):
        c, seen = compressors[comm.rank], []
        for step in range(3):
            exchange = BucketExchange(c, comm, "bucket")
            for name, g in grads(comm.rank, step).items():
                exchange.add(name, g)
            exchange.launch()
            result = exchange.finish()
            seen.append((result, {n: (c.residual(n), c.velocity(n)) for n in names}))
        return seen

    for seen in run_ranks(ranks, work, timeout=30):
        assert all(np.isnan(seen[1][0][n]).any() for n in names)
        assert all(np.isfinite(seen[s][0][n]).all() for s in (0, 2) for n in names)
        for n in names:
            (r0, u0), (r1, u1) = seen[0][1][n], seen[1][1][n]
            np.testing.assert_array_equal(u1, u0, err_msg=n)
            assert (r0 is None and r1 is None) or np.array_equal(r0, r1), n
