"""Momentum correction on the fused bucket (:mod:`hvd_compress.engine.fused`; torch tensors, numpy
arrays and TensorFlow tensors) against the per-tensor compressors (:class:`tests.oracle.PerTensorRanks`).

Thread ranks run :class:`~hvd_compress.engine.exchange.BucketExchange` on a bucket
holding compressed tensors (sizes repeated), a tensor under ``dense_below`` and
one sent dense because ``N k >= d``; the results, residuals and velocities must be
the per-tensor spec's bit for bit, on numpy, on
torch the CPU's way and the accelerator's, and on TensorFlow's kernels (what a GPU runs). The dense tensors' averages differ only where a
half-precision wire rounds the sum (the per-tensor decode sums in float32). Also: a NaN step
leaves every residual and velocity as before (the other tensors step as the per-tensor spec's),
a change of density moves the velocities between the dense and compressed parts,
a checkpoint mid-training resumes exactly, ``Auto`` sending a bucket dense sends the
velocities, and a steady step reads nothing back to the host.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import Auto, GaussianK, RegTopK, TopK  # noqa: E402
from benchmarks.host_reads import count_host_reads  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.engine import fused  # noqa: E402
from hvd_compress.engine.exchange import BucketExchange  # noqa: E402
from hvd_compress.transport.threads import run_ranks  # noqa: E402
from hvd_compress.kernels import torch_ops  # noqa: E402
from tests.oracle import PerTensorRanks  # noqa: E402
from tests.comm.test_fused import way_of  # noqa: E402

RANKS = 3
#: "one" is under dense_below; "three": 3 ranks x k = 3 >= 3, sent dense; the rest compressed
SHAPES = {"a": (40, 50), "one": (1,), "c": (2000,), "three": (3,), "d": (40, 50), "f": (33, 61)}
DENSE = ("one", "three")
COMPRESSORS = {
    "topk": lambda: TopK(0.05, dense_below=2, momentum=0.9),
    "topk-no-feedback": lambda: TopK(0.05, dense_below=2, momentum=0.9, error_feedback=False),
    "gaussiank": lambda: GaussianK(0.05, dense_below=2, momentum=0.9),
    "regtopk": lambda: RegTopK(0.05, dense_below=2, momentum=0.9, seed=1),
}


#: the paths a bucket takes: torch tensors the CPU's way or the accelerator's, numpy arrays,
#: TensorFlow tensors on TensorFlow's kernels
PATHS = ["host", "accelerator", "numpy", "tensorflow"]
NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def in_form(g, way: str):
    """A torch gradient as the path ``way`` takes it: a numpy array, a TensorFlow tensor, or as it is."""
    if way == "numpy":
        return g.numpy().astype(NUMPY_DTYPES[g.dtype])
    if way == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        return tf.cast(tf.constant(g.float().numpy()), str(g.dtype).split(".")[1])
    return g


def as_torch(t):
    """A result or state (torch or TensorFlow tensor, numpy array) as a torch tensor of its dtype."""
    if type(t).__module__.startswith("tensorflow"):
        return torch.from_numpy(t.numpy().astype(np.float64)).to(getattr(torch, t.dtype.name))
    return torch.as_tensor(t).clone()


def gradients(rank: int, step: int, dtype, nan=None):
    generator = torch.Generator().manual_seed(100 * rank + step)
    grads = {name: (torch.round(torch.randn(shape, generator=generator) * 2) / 2).to(dtype)
             for name, shape in SHAPES.items()}  # few distinct magnitudes: ties at the k-th value
    for name in (nan or {}).get((rank, step), ()):
        grads[name].view(-1)[0] = float("nan")
    return grads


def state_of(compressor):
    return state_of_names(compressor, SHAPES)


def state_of_names(compressor, names):
    return {n: (compressor.residual(n), compressor.velocity(n)) for n in names}


def exchange_steps(comm, compressor, dtype, steps, nan=None, ratios=None, way="host", seen=None):
    """This rank's results and state after each step; ``ratios[step]`` sets the density before the step.
    ``way``: the gradients in that path's form (:func:`in_form`); ``seen(compressor)`` after each step's
    exchange, before its state is read."""
    out = []
    for step in range(steps):
        if ratios and step in ratios:
            compressor.ratio = ratios[step]
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in gradients(comm.rank, step, dtype, nan).items():
            exchange.add(name, in_form(g, way))
        exchange.launch()
        results = {n: as_torch(t) for n, t in exchange.finish(average=True).items()}
        if seen is not None:
            seen(compressor)
        out.append((results, {n: tuple(None if x is None else as_torch(x) for x in pair)
                              for n, pair in state_of(compressor).items()}))
    return out


def assert_state_equal(got, want, where, names=SHAPES):
    for name in names:
        for label, a, b in zip(("residual", "velocity"), got[name], want[name]):
            assert (a is None) == (b is None), f"{where} {name} {label}"
            if a is not None:
                assert torch.equal(torch.as_tensor(a).double(), torch.as_tensor(b).double()), f"{where} {name} {label}"


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kind", COMPRESSORS)
def test_fused_bucket_equals_simulator(kind, dtype, way):
    steps = 3
    if way == "numpy" and dtype not in NUMPY_DTYPES:
        pytest.skip("numpy has no bfloat16")
    with way_of(way):
        results = run_ranks(RANKS, lambda comm: exchange_steps(comm, COMPRESSORS[kind](), dtype, steps, way=way))
        sim, expected, states = PerTensorRanks(RANKS, COMPRESSORS[kind]()), [], []
        for step in range(steps):  # TensorFlow's tensors: the spec on TensorFlow's kernels too
            per_rank = [{n: in_form(g, way) for n, g in gradients(r, step, dtype).items()} for r in range(RANKS)]
            expected.append(sim.step({n: [g[n] for g in per_rank] for n in SHAPES}))
            states.append([{n: tuple(None if x is None else as_torch(x) for x in pair)
                            for n, pair in state_of(c).items()} for c in sim.compressors])
    half = dtype in (torch.float16, torch.bfloat16)
    for step in range(steps):
        for rank, (got, state) in enumerate(r[step] for r in results):
            for name in SHAPES:
                want = as_torch(expected[step][name])
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                # a half-precision wire rounds the dense sum before the division; the per-tensor spec does not
                tolerance = torch.finfo(dtype).eps * float(want.double().abs().max()) if half and name in DENSE else 0
                np.testing.assert_allclose(got[name].double().numpy(), want.double().numpy(), rtol=0, atol=tolerance,
                                           err_msg=f"{kind} {dtype} step {step} {name}")
            assert_state_equal(state, states[step][rank], f"{kind} {dtype} step {step} rank {rank}")


@pytest.mark.parametrize("way", PATHS)
@pytest.mark.parametrize("kind", ["topk", "regtopk"])
def test_nan_step_keeps_residuals_and_velocities_and_the_others_step(kind, way):
    """NaN on rank 1 at step 1 in a compressed tensor and in a dense one: those results are NaN on
    every rank; every rank's residual and velocity of them are as before the step; the bucket's
    other tensors give the per-tensor spec's results and state (of gradients without NaN) at every step."""
    nan = {(1, 1): ("a", "three")}
    with way_of(way):
        fused = run_ranks(RANKS, lambda comm: exchange_steps(comm, COMPRESSORS[kind](), torch.float32, 3, nan,
                                                             way=way))
    clean = [n for n in SHAPES if n not in nan[(1, 1)]]
    sim = PerTensorRanks(RANKS, COMPRESSORS[kind]())
    for step in range(3):
        expected = sim.step({n: [gradients(r, step, torch.float32)[n] for r in range(RANKS)] for n in clean})
        for rank, mine in enumerate(fused):
            for name in clean:
                assert torch.equal(mine[step][0][name], torch.as_tensor(expected[name])), (rank, step, name)
            want = state_of_names(sim.compressors[rank], clean)
            assert_state_equal({n: mine[step][1][n] for n in clean}, want, f"rank {rank} step {step}", clean)
    for rank, mine in enumerate(fused):
        for name in nan[(1, 1)]:
            assert torch.isnan(mine[1][0][name]).any(), f"'{name}' should be NaN on rank {rank}"
            for label, before, after in zip(("residual", "velocity"), mine[0][1][name], mine[1][1][name]):
                assert (before is None and after is None) or torch.equal(before, after), (rank, name, label)
    finite = [r[2][0][n] for r in fused for n in SHAPES]
    assert all(torch.isfinite(t).all() for t in finite), "the step after the NaN trains normally"


@pytest.mark.parametrize("way", ["host", "numpy", "tensorflow"])
def test_density_change_moves_velocities_between_dense_and_compressed(way):
    """A warm-up's last steps: at 40% every tensor is sent dense (N k >= d), then 5%: the velocities move
    from the bucket's dense part to its compressed part (and back), as the per-tensor spec's state."""
    ratios = {0: 0.4, 2: 0.05, 3: 0.4, 4: 0.05}
    make = COMPRESSORS["topk"]
    with way_of(way):
        results = run_ranks(RANKS, lambda comm: exchange_steps(comm, make(), torch.float32, 6, ratios=ratios, way=way))
    assert_ramp_equals_spec(results, make, ratios, 6)


def assert_ramp_equals_spec(results, make, ratios, steps):
    """Every rank's results and state of each step (:func:`exchange_steps` with ``ratios``) equal the per-tensor
    spec's under the same densities, bit for bit."""
    sim = PerTensorRanks(RANKS, make())
    for step in range(steps):
        for c in sim.compressors:
            c.ratio = ratios.get(step, c.ratio)
        expected = sim.step({n: [gradients(r, step, torch.float32)[n] for r in range(RANKS)] for n in SHAPES})
        for rank, (got, state) in enumerate(r[step] for r in results):
            for name in SHAPES:
                assert torch.equal(got[name], expected[name]), (step, name)
            assert_state_equal(state, state_of(sim.compressors[rank]), f"step {step} rank {rank}")


@pytest.mark.parametrize("kind, way", [(kind, "host") for kind in COMPRESSORS]
                         + [("regtopk", "numpy"), ("regtopk", "tensorflow")])
def test_a_density_change_alone_keeps_the_state_in_place(kind, way, monkeypatch):
    """A warm-up's steps change ``k`` and nothing else (every tensor stays in its part): each new plan takes
    the old one's state as it is, never through the per-name memory (the first plan adopts, no other), and
    every step still equals the per-tensor spec's (RegTop-k's posterior and the residuals decide what the
    next step selects)."""
    ratios, steps = {1: 0.08, 2: 0.03, 4: 0.06}, 6
    adopted, plans = [], []
    adopt = fused.FusedBucket.adopt
    monkeypatch.setattr(fused.FusedBucket, "adopt", lambda self, memory: adopted.append(1) or adopt(self, memory))

    def seen(compressor):
        plans.append(next(iter(compressor.own_state.buckets.values())).config_hash)

    with way_of(way):
        results = run_ranks(RANKS, lambda comm: exchange_steps(comm, COMPRESSORS[kind](), torch.float32, steps,
                                                               ratios=ratios, way=way, seen=seen))
    assert_ramp_equals_spec(results, COMPRESSORS[kind], ratios, steps)
    assert len(set(plans)) == 4, "each density is a plan of its own"
    assert len(adopted) == RANKS


def test_checkpoint_mid_training_resumes_exactly():
    comm = SingleProcessCommunicator()

    def run(compressor, steps, start=0):
        out = None
        for step in range(start, start + steps):
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, g in gradients(0, step, torch.float32).items():
                exchange.add(name, g)
            exchange.launch()
            out = exchange.finish()
        return out

    make = lambda: RegTopK(0.05, dense_below=2, momentum=0.9, dense_when_cheaper=False)  # noqa: E731
    straight = run(make(), 5)
    first = make()
    run(first, 2)
    state = first.state_dict()
    assert all(state["tensors"][n]["velocity"] is not None for n in SHAPES)
    resumed = make()
    resumed.load_state_dict(state)
    again = run(resumed, 3, start=2)
    for name in SHAPES:
        assert torch.equal(again[name], straight[name]), name


def test_auto_sending_a_bucket_dense_sends_the_velocities():
    """``Auto(..., pin="dense")``: each tensor's average is the velocity of momentum SGD fed the average
    gradient (fused torch and numpy buckets alike)."""
    m, steps = 0.9, 4

    def work(comm, numpy):
        auto = Auto(TopK(0.05, momentum=m), pin="dense", log=False)
        out = []
        for step in range(steps):
            exchange = auto.make_exchange(comm, "bucket")
            for name, g in gradients(comm.rank, step, torch.float32).items():
                exchange.add(name, g.numpy() if numpy else g)
            exchange.launch()
            out.append({n: torch.as_tensor(t) for n, t in exchange.finish(average=True).items()})
        own = sum(m ** (steps - 1 - t) * gradients(comm.rank, t, torch.float32)["a"].double() for t in range(steps))
        np.testing.assert_allclose(np.asarray(auto.velocity("a"), dtype=np.float64), own.numpy(), rtol=1e-5, atol=1e-5)
        return out

    velocity = {n: torch.zeros(shape, dtype=torch.float64) for n, shape in SHAPES.items()}
    expected = []
    for step in range(steps):
        for n in SHAPES:
            velocity[n] = m * velocity[n] + torch.stack([gradients(r, step, torch.float32)[n] for r in range(RANKS)]
                                                        ).double().mean(0)
        expected.append({n: v.clone() for n, v in velocity.items()})
    for numpy in (False, True):
        for result in run_ranks(RANKS, lambda comm: work(comm, numpy)):
            for step in range(steps):
                for n in SHAPES:
                    np.testing.assert_allclose(result[step][n].double().numpy(), expected[step][n].numpy(),
                                               rtol=1e-5, atol=1e-5, err_msg=f"numpy={numpy} step {step} {n}")


def test_steady_state_step_reads_nothing_back():
    """The drop-in optimizer with momentum correction: after the first step, no host read on the
    accelerator's code path (see tests/comm/test_fused.py)."""
    from tests.distributed import torch_horovod as workload

    import hvd_compress.torch as hvd_torch

    model = workload.make_model()
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
        compression=TopK(0.05, momentum=0.9), communicator=SingleProcessCommunicator(),
    )
    data = workload.batches(0, 3)

    def step(x, y):
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        optimizer.step()

    step(*data[0])
    with count_host_reads() as reads, torch_ops.accelerator_path():
        for x, y in data[1:]:
            step(x, y)
    syncing = {k: n for k, n in reads.by_kind.items() if k not in ("numpy", "cpu")}
    assert not syncing, f"host reads in a steady-state step: {syncing} at {reads.sites.most_common(5)}"
    assert optimizer._compression.velocity("0.bias") is not None  # the dense bias has one too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", COMPRESSORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_cuda_steady_state_step_never_synchronizes_and_equals_the_cpu(kind, dtype):
    """On a GPU: ``torch.cuda.set_sync_debug_mode("error")`` around steady-state exchanges (the NaN
    step's flags and the dense velocities' kept values included); the state equals the CPU's way (but
    Gaussian-k's, whose moments the GPU may round differently)."""
    comm = SingleProcessCommunicator()
    on_gpu, on_cpu = COMPRESSORS[kind](), COMPRESSORS[kind]()
    nan = {(0, 2): ("a", "three")}

    # copied to each device before the check: a copy from pageable host memory synchronizes by itself
    steps = {device: [{name: g.to(device) for name, g in gradients(0, index, dtype, nan).items()}
                      for index in range(4)] for device in ("cuda", "cpu")}

    def step(compressor, index, device):
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in steps[device][index].items():
            exchange.add(name, g)
        exchange.launch()
        return exchange.finish()

    step(on_gpu, 0, "cuda")  # the layout check reads its header once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for index in range(1, 4):
            step(on_gpu, index, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    if kind.startswith("gaussiank"):
        return
    with torch_ops.accelerator_path():
        for index in range(4):
            step(on_cpu, index, "cpu")
    want = {n: tuple(None if x is None else x.cpu() for x in pair) for n, pair in state_of(on_cpu).items()}
    got = {n: tuple(None if x is None else x.cpu() for x in pair) for n, pair in state_of(on_gpu).items()}
    assert_state_equal(got, want, f"{kind} {dtype}")


@pytest.mark.parametrize("average", [True, False])
def test_world_of_one_nan_in_a_dense_tensor_keeps_its_velocity(average):
    """One rank (its collective hands back the buffer it was given): a NaN in one of two equal-size
    dense tensors makes that result NaN and keeps its velocity from before the step, while the other
    tensor of its size group steps, u = m u + g; numpy arrays give the same."""
    shapes = {"w": (30, 40), "b1": (7,), "b2": (7,)}  # b1, b2: one size group of the dense part

    def run(numpy):
        compressor, comm, out = TopK(0.05, dense_below=8, momentum=0.9), SingleProcessCommunicator(), []
        for step in range(3):
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, shape in shapes.items():
                g = torch.full(shape, float(step + 1)) + torch.arange(math.prod(shape)).view(shape) / 8
                if step == 1 and name == "b1":
                    g.view(-1)[3] = float("nan")
                exchange.add(name, g.numpy() if numpy else g)
            exchange.launch()
            results = {n: torch.as_tensor(t).clone() for n, t in exchange.finish(average=average).items()}
            out.append((results, {n: torch.as_tensor(compressor.velocity(n)).clone() for n in shapes}))
        return out

    fused = run(False)
    assert_runs_equal(run(True), fused, shapes)
    (_, before_u), (nan_step, nan_u) = fused[0], fused[1]
    assert torch.isnan(nan_step["b1"]).any() and torch.isfinite(nan_step["b2"]).all()
    assert torch.equal(nan_u["b1"], before_u["b1"]), "the NaN tensor keeps its velocity"
    assert not torch.equal(nan_u["b2"], before_u["b2"]), "its group's other tensor steps"
    assert torch.isfinite(fused[2][0]["b1"]).all(), "the step after trains normally"


def assert_runs_equal(runs, others, shapes):
    """Per step the same results (or both NaN somewhere) and velocities."""
    for step, ((got, got_u), (want, want_u)) in enumerate(zip(runs, others)):
        for name in shapes:
            assert torch.equal(got[name], want[name].float()) or (
                torch.isnan(got[name]).any() and torch.isnan(want[name]).any()), (step, name)
            assert torch.equal(got_u[name].double(), want_u[name].double()), (step, name)
