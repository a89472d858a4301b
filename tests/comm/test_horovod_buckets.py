"""Stock horovod.torch's buckets (``hvd_compress.horovod.torch_buckets``) in one process: the plan is the
optimizer's parameters in reverse order, cut by dtype and bytes, and a step's results do not depend on
the order in which Horovod hands over the gradients. (Multi-process runs: tests/distributed.)"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import TopK  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.horovod.torch_hooks import _Calls  # noqa: E402
from hvd_compress.horovod.torch_buckets import CAP_ENV, Plan, cut  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402


class FakeHorovodOptimizer:
    """What a Plan reads of ``horovod.torch``'s optimizer."""

    def __init__(self, named):
        self.param_groups = [{"params": [p for _, p in named]}]
        self._parameter_names = {p: n for n, p in named}
        self._requires_update = {p for _, p in named if p.requires_grad}


def params(*shapes, dtype=torch.float32):
    torch.manual_seed(0)
    return [(f"p{i}", torch.nn.Parameter(torch.randn(*s, dtype=dtype))) for i, s in enumerate(shapes)]


def test_cut_reverses_nothing_and_splits_by_dtype_and_bytes():
    named = params((10,), (20,), (30,)) + [("h", torch.nn.Parameter(torch.zeros(5, dtype=torch.float16)))]
    assert cut(named, cap=10**6) == [["p0", "p1", "p2"], ["h"]]
    assert cut(named, cap=4 * 30) == [["p0", "p1"], ["p2"], ["h"]]  # 40 + 80 <= 120 < 120 + 120
    assert cut(named, cap=1) == [["p0"], ["p1"], ["p2"], ["h"]]  # a larger tensor goes alone


def test_plan_is_reverse_registration_order_without_frozen_parameters(monkeypatch):
    named = params((4, 4), (4,), (8, 4), (8,))
    named[1][1].requires_grad_(False)
    monkeypatch.setenv(CAP_ENV, str(200 / 2**20))  # 200 bytes
    plan = Plan(FakeHorovodOptimizer(named))
    assert plan.buckets == [["p3", "p2"], ["p0"]]  # 32 + 128 bytes, then 64
    assert plan.keys == ["hvd_compress.p3", "hvd_compress.p0"]
    assert "p1" not in plan
    monkeypatch.setenv(CAP_ENV, "zero")
    with pytest.raises(ValueError, match=CAP_ENV):
        Plan(FakeHorovodOptimizer(named))


def run_step(plan, compressor, calls, grads, order, skip=()):
    """Record ``grads`` in ``order`` (but ``skip``), then decompress in plan order: ``{name: result}``."""
    comm = SingleProcessCommunicator()
    contexts = {}
    for name in order:
        if name not in skip:
            placeholder, contexts[name] = plan.record(compressor, comm, calls, name, grads[name])
            assert placeholder.shape == (1,) and float(placeholder) == 1.0
    return {n: plan.decompress(compressor, comm, calls, torch.ones(1), contexts[n]).clone() for n in contexts}


def test_results_do_not_depend_on_the_order_gradients_arrive_and_equal_the_simulator():
    named = params((64,), (3,), (32, 4), (16, 8))
    steps = [{n: torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))
              for i, (n, p) in enumerate(named)} for s in range(3)]
    orders = [["p3", "p2", "p1", "p0"], ["p1", "p0", "p3", "p2"]]
    results = []
    for order in orders:
        compressor = TopK(0.25, dense_below=10)
        plan, calls = Plan(FakeHorovodOptimizer(named)), _Calls()
        results.append([run_step(plan, compressor, calls, grads, order) for grads in steps])
        # one bucket in plan order whatever the arrival order (its layout is checked across ranks)
        assert list(compressor.state.buckets) == ["hvd_compress.p3"]
        assert compressor.state.buckets["hvd_compress.p3"].names == ["p3", "p2", "p1", "p0"]
        assert compressor.state.buckets["hvd_compress.p3"].kinds == ["sparse", "sparse", "dense", "sparse"]
    sim = Simulator(1, TopK(0.25, dense_below=10))
    for step, grads in enumerate(steps):
        expected = sim.step({n: [g.numpy()] for n, g in grads.items()})
        for name, value in expected.items():
            np.testing.assert_array_equal(results[0][step][name].numpy(), results[1][step][name].numpy())
            np.testing.assert_allclose(results[0][step][name].numpy(), value, rtol=0, atol=1e-7)


def test_a_complete_bucket_launches_at_once_and_the_rest_at_the_first_decompress(monkeypatch):
    named = params((64,), (64,), (64,))
    monkeypatch.setenv(CAP_ENV, str(512 / 2**20))  # [p2, p1], [p0]
    plan, compressor, calls = Plan(FakeHorovodOptimizer(named)), TopK(0.25, dense_below=0), _Calls()
    comm = SingleProcessCommunicator()
    grads = {n: torch.randn(64) for n, _ in named}
    _, ctx = plan.record(compressor, comm, calls, "p1", grads["p1"])
    plan.record(compressor, comm, calls, "p0", grads["p0"])
    assert set(plan.step.exchanges) == {1}  # [p0] is complete, [p2, p1] waits for p2
    with pytest.raises(RuntimeError, match="compressed twice"):
        plan.record(compressor, comm, calls, "p0", grads["p0"])
    result = plan.decompress(compressor, comm, calls, torch.ones(1), ctx)  # p2 never came
    assert set(plan.step.results) == {0} and result.shape == (64,)
    assert compressor.state.buckets["hvd_compress.p2"].names == ["p1"]


def test_checkpoint_mid_training_resumes_exactly_and_saving_changes_nothing():
    """``compressor.state_dict()`` after step 1, loaded into a fresh compressor and optimizer plan: steps 2
    and 3 equal an uninterrupted run's, and the run that saved equals one that never looked."""
    named = params((64,), (3,), (32, 4))
    steps = [{n: torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * s + i))
              for i, (n, p) in enumerate(named)} for s in range(3)]
    order = [n for n, _ in named]

    def train(save_after=None):
        compressor, plan, calls = TopK(0.1, dense_below=10), Plan(FakeHorovodOptimizer(named)), _Calls()
        results, saved = [], None
        for step, grads in enumerate(steps):
            results.append(run_step(plan, compressor, calls, grads, order))
            if step == save_after:
                saved = compressor.state_dict()
        return results, saved

    straight, _ = train()
    observed, saved = train(save_after=0)
    resumed = TopK(0.1, dense_below=10)
    resumed.load_state_dict(saved)
    plan, calls = Plan(FakeHorovodOptimizer(named)), _Calls()
    continued = [run_step(plan, resumed, calls, grads, order) for grads in steps[1:]]
    for step in range(3):
        for name in order:
            torch.testing.assert_close(observed[step][name], straight[step][name], rtol=0, atol=0)
            if step:
                torch.testing.assert_close(continued[step - 1][name], straight[step][name], rtol=0, atol=0)


class NoBfloat16Horovod:
    """``horovod.torch`` of one rank as 0.28.1 behaves: its collectives refuse bfloat16 tensors."""

    Sum, Max = "sum", "max"

    def __init__(self):
        self.dtypes = []

    def rank(self):
        return 0

    def size(self):
        return 1

    def _take(self, tensor):
        if tensor.dtype == torch.bfloat16:
            raise TypeError("Unsupported data type torch.BFloat16Tensor")  # what Horovod raises
        self.dtypes.append(tensor.dtype)
        return tensor.clone()

    allreduce_async = allgather_async = lambda self, tensor, **kwargs: self._take(tensor)

    def synchronize(self, handle):
        return handle


def horovod_of_one_rank():
    from hvd_compress.transport.communicator import HorovodCommunicator, HorovodTorchCommunicator

    comm = HorovodTorchCommunicator.__new__(HorovodTorchCommunicator)
    HorovodCommunicator.__init__(comm, NoBfloat16Horovod())
    return comm


def test_horovod_communicator_sums_bfloat16_in_float32_and_gathers_its_raw_bits():
    comm = horovod_of_one_rank()
    values = torch.randn(7).to(torch.bfloat16)
    summed = comm.wait(comm.allreduce_async(values, comm.SUM, "s"))
    gathered = comm.wait(comm.allgather_async(values, "g"))
    assert comm.hvd.dtypes == [torch.float32, torch.int16]
    for result in (summed, gathered):
        assert result.dtype == torch.bfloat16 and torch.equal(result.view(torch.int16), values.view(torch.int16))
    assert comm.wait(comm.allreduce_async(torch.ones(2), comm.MAX, "m")).dtype == torch.float32  # as it was


@pytest.mark.parametrize("compression", ["none", "topk", "terngrad"])
def test_bfloat16_gradients_reach_horovod_only_as_dtypes_it_carries(compression):
    """Stock steps of bfloat16 gradients: placeholders and our exchange's collectives, and for None,
    from its second step, Horovod's own allreduce of the gradient (``_direct``). Nothing bfloat16
    reaches Horovod; the results are bfloat16 and equal the Simulator's bit for bit."""
    from hvd_compress import Compression
    from hvd_compress.horovod import torch_hooks as horovod

    def make():
        return Compression.by_name(compression, 0.25, **({} if compression == "none" else {"dense_below": 10}))

    named = params((64,), (3,), (32, 4), dtype=torch.bfloat16)
    comm = horovod_of_one_rank()
    compressor, sim = make(), Simulator(1, make())
    plan, calls = Plan(FakeHorovodOptimizer(named), compressor), horovod._calls(compressor)
    for step in range(2):
        grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(torch.bfloat16)
                 for i, (n, p) in enumerate(named)}
        expected = sim.step({n: [grads[n]] for n in reversed(grads)})  # plan order: each tensor's draws in turn
        results = {}
        if calls.agreed:  # None once checked: Horovod's allreduce moves (and here returns) what _direct hands it
            for name, grad in grads.items():
                sent, ctx = horovod._direct(compressor, grad)
                results[name] = horovod.decompress(compressor, comm.hvd._take(sent), ctx)
        else:
            contexts = {name: plan.record(compressor, comm, calls, name, grad) for name, grad in grads.items()}
            for name, (placeholder, ctx) in contexts.items():
                results[name] = plan.decompress(compressor, comm, calls, comm.hvd._take(placeholder), ctx)
        for name, result in results.items():
            assert result.dtype == torch.bfloat16, (step, name)
            assert torch.equal(result.view(torch.int16), expected[name].view(torch.int16)), (step, name)
    assert calls.agreed == (compression == "none")
    assert torch.bfloat16 not in comm.hvd.dtypes and comm.hvd.dtypes


def test_a_channels_last_gradient_comes_back_channels_last():
    """Horovod's optimizer sets ``p.grad`` to ``decompress``'s result, strides included: a
    ``channels_last`` gradient gets its result in its own memory format, the values of a contiguous one."""
    conv = [("conv", torch.nn.Parameter(torch.randn(8, 4, 3, 3)))]
    grad = torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    comm, results = SingleProcessCommunicator(), {}
    for layout, g in (("channels_last", grad), ("contiguous", grad.contiguous())):
        plan, compressor, calls = Plan(FakeHorovodOptimizer(conv)), TopK(0.25, dense_below=0), _Calls()
        _, ctx = plan.record(compressor, comm, calls, "conv", g)
        results[layout] = plan.decompress(compressor, comm, calls, torch.ones(1), ctx)
    assert results["channels_last"].stride() == grad.stride() != results["contiguous"].stride()
    assert torch.equal(results["channels_last"], results["contiguous"])
