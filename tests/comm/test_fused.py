"""The fused bucket (:mod:`hvd_compress.engine.fused`) against the per-tensor compressors.

Thread ranks run :class:`~hvd_compress.engine.exchange.BucketExchange` on buckets
of several tensors (sizes repeated, so tensors share a top-k call; small ones
dense) and must equal the per-tensor spec (:class:`tests.oracle.PerTensorRanks`, which
encodes tensor by tensor with the compressors' own ``encode``/``decode``), over several steps, for every fused compressor and
gradient dtype, on numpy arrays (``path="numpy"``: the selections of
:mod:`~hvd_compress.kernels.reference_rows`) and on torch tensors, the CPU's way and the
accelerator's (``accelerator_path``: the selections of :mod:`~hvd_compress.kernels.torch_rows`
without host reads), and on TensorFlow tensors with TensorFlow's kernels (``path="tensorflow"``:
what a GPU runs, :mod:`~hvd_compress.kernels.tf_rows`). Also: nothing
is lost (sent + residual == produced), a NaN on one rank makes that tensor
non-finite on every rank and leaves every residual as it was, and a steady-state
step reads no tensor back to the host.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK  # noqa: E402
from benchmarks.host_reads import count_host_reads  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.engine.exchange import BucketExchange  # noqa: E402
from hvd_compress.transport.threads import ThreadCommunicator, run_ranks  # noqa: E402
from hvd_compress.kernels import torch_ops  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from tests import conformance  # noqa: E402
from tests.oracle import PerTensorRanks  # noqa: E402

SHAPES = {"a": (40, 50), "b": (7,), "c": (2000,), "d": (40, 50), "e": (2000,), "f": (33, 61)}
COMPRESSORS = {
    "topk": lambda: TopK(0.05),
    "topk-no-feedback": lambda: TopK(0.05, error_feedback=False),
    "regtopk": lambda: RegTopK(0.05, seed=1),
    "gaussiank": lambda: GaussianK(0.05),
    "gaussiank-no-feedback": lambda: GaussianK(0.05, error_feedback=False),
    "gaussiank-leader": lambda: GaussianK(0.05, indices="leader"),
    "topk-aggregate": lambda: TopK(0.05, indices="aggregate"),
    "terngrad": lambda: TernGrad(seed=3),
    "terngrad-feedback-unclipped": lambda: TernGrad(clip=None, error_feedback=True, seed=3),
    "terngrad-unshared": lambda: TernGrad(scalar_sharing=False, seed=3),
    "fp16": FP16,
    "none": NoneCompressor,
}
#: index sets shared by the ranks have no per-tensor spec (a per-tensor encode refuses them): thread
#: ranks are compared with the Simulator's lockstep ranks (the same engine over another transport);
#: tests/comm/test_shared_indices.py checks their selections by hand
SHARED = ("gaussiank-leader", "topk-aggregate")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
#: the paths a bucket takes: torch tensors the CPU's way or the accelerator's, numpy arrays,
#: TensorFlow tensors on TensorFlow's kernels
PATHS = ["host", "accelerator", "numpy", "tensorflow"]
NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


@contextlib.contextmanager
def way_of(way: str):
    """The CPU's own way (numpy selections, host reads) or the accelerator's (for every rank thread);
    ``tensorflow``: TensorFlow's CPU tensors stay TensorFlow's (the kernels a GPU runs)."""
    if way == "tensorflow":
        with conformance.tensorflow_kernels():
            yield
        return
    with torch_ops.accelerator_path() if way == "accelerator" else contextlib.nullcontext():
        yield


def gradients(rank: int, step: int, dtype, ties: bool = False, numpy: bool = False, tensorflow: bool = False):
    """Torch tensors of ``dtype``, or with ``numpy`` (``tensorflow``) the same values as numpy arrays
    (TensorFlow tensors) of ``dtype``'s kind."""
    generator = torch.Generator().manual_seed(100 * rank + step)
    grads = {}
    for name, shape in SHAPES.items():
        g = torch.randn(shape, generator=generator)
        if ties:  # few distinct magnitudes: many ties at every k-th value
            g = torch.round(g * 2) / 2
        grads[name] = g.numpy().astype(NUMPY_DTYPES[dtype]) if numpy else g.to(dtype)
        if tensorflow:
            tf = pytest.importorskip("tensorflow")
            grads[name] = tf.cast(tf.constant(grads[name].float().numpy()), str(dtype).split(".")[1])
    return grads


def as_float64(t) -> np.ndarray:
    """A result or state (torch or TensorFlow tensor, numpy array) as a float64 numpy array."""
    return t.double().numpy() if isinstance(t, torch.Tensor) else np.asarray(t, dtype=np.float64)


def copied(t):
    if isinstance(t, torch.Tensor):
        return t.clone()
    return t.copy() if isinstance(t, np.ndarray) else t  # TensorFlow's tensors are immutable


def with_entry(g, index: int, value: float):
    """A copy of ``g`` (torch or TensorFlow tensor, numpy array) with its flat entry ``index`` set to ``value``."""
    if isinstance(g, (torch.Tensor, np.ndarray)):
        g = copied(g)
        g.reshape(-1)[index] = value
        return g
    tf = pytest.importorskip("tensorflow")
    flat = tf.tensor_scatter_nd_update(tf.reshape(g, [-1]), [[index]], tf.constant([value], g.dtype))
    return tf.reshape(flat, g.shape)


def exchange_steps(comm, make, dtype, steps, ties=False, nan=None, special=float("nan"), numpy=False,
                   tensorflow=False):
    compressor = make()
    out = []
    for step in range(steps):
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in gradients(comm.rank, step, dtype, ties, numpy, tensorflow).items():
            if nan == (comm.rank, step, name):
                g = with_entry(g, 3, special)
            exchange.add(name, g)
        exchange.launch()
        assert exchange.launched, "the bucket was not launched"
        out.append({n: copied(t) for n, t in exchange.finish(average=True).items()})
        out[-1]["residuals"] = {n: compressor.residual(n) for n in SHAPES}
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", COMPRESSORS)
def test_fused_bucket_equals_the_per_tensor_spec(kind, dtype, path):
    if kind.startswith("fp16") and dtype == torch.float64:
        pytest.skip("float64 -> float16 rounding is covered by the kernel tests")
    if path == "accelerator" and kind in ("fp16", "none"):
        pytest.skip("dense: no selection")
    if path == "numpy" and dtype not in NUMPY_DTYPES:
        pytest.skip("numpy has no bfloat16")
    ranks, steps, numpy, tensorflow = 3, 3, path == "numpy", path == "tensorflow"
    # FP16's gradients are random normals, most of which float16 cannot hold: the wire's rounding shows
    ties = not kind.startswith("fp16")
    with way_of(path):
        results = run_ranks(ranks, lambda comm: exchange_steps(comm, COMPRESSORS[kind], dtype, steps, ties,
                                                               numpy=numpy, tensorflow=tensorflow), timeout=60)
        spec = (Simulator if kind in SHARED else PerTensorRanks)(ranks, COMPRESSORS[kind]())
        expected, residuals = [], []
        for step in range(steps):
            per_rank = [gradients(r, step, dtype, ties, numpy, tensorflow) for r in range(ranks)]
            expected.append(spec.step({n: [g[n] for g in per_rank] for n in SHAPES}))
            residuals.append([{n: spec.compressors[r].residual(n) for n in SHAPES} for r in range(ranks)])
    # TernGrad's clipping bound c * std(g) comes from torch's row-wise std over each group of
    # equal-size tensors and from TensorFlow's std, which may round differently from the spec's float64
    # std; all else is bit for bit (numpy's rows take the spec's std: bit for bit too).
    clipped = kind in ("terngrad", "terngrad-unshared") and path in ("host", "accelerator", "tensorflow")
    tolerance = 64 * torch.finfo(dtype).eps if clipped else 0
    # in 16 bits a bound one ulp apart may flip a code where |g| meets it: a few entries of a tensor
    flips = 0.005 if clipped and dtype in (torch.float16, torch.bfloat16) else 0
    for step in range(steps):
        for rank, result in enumerate(results):
            for name in SHAPES:
                got, want = result[step][name], expected[step][name]
                assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape, name
                if flips:
                    close = np.isclose(as_float64(got), as_float64(want), rtol=0,
                                       atol=tolerance * float(np.abs(as_float64(want)).max()))
                    assert np.mean(~close) <= flips, f"{kind} {dtype} step {step} {name}: {np.sum(~close)} differ"
                    continue
                np.testing.assert_allclose(
                    as_float64(got),
                    as_float64(want),
                    rtol=0,
                    atol=tolerance * float(np.abs(as_float64(want)).max()),
                    err_msg=f"{kind} {dtype} step {step} {name}",
                )
                residual = residuals[step][rank][name]
                if residual is not None:
                    np.testing.assert_array_equal(as_float64(result[step]["residuals"][name]), as_float64(residual))


class InPlaceRanks(ThreadCommunicator):
    """Thread ranks whose transport reduces a donated buffer in place, as ``torch.distributed``'s does;
    records the buffers donated to it."""

    def __init__(self, ranks: ThreadCommunicator) -> None:
        super().__init__(ranks.group, ranks.rank)
        self.donated = []

    def allreduce_donated_async(self, tensor, op, name):
        self.donated.append(tensor)
        return tensor.copy_(self.allreduce_async(tensor, op, name))  # every rank has combined: safe to write


@pytest.mark.parametrize("shapes", [SHAPES, {"b": SHAPES["b"]}], ids=["bucket", "one-tensor"])
@pytest.mark.parametrize("kind", ["none", "fp16", "topk", "topk-momentum"])
def test_a_dense_part_reduced_in_place_changes_no_result_and_no_gradient(kind, shapes):
    """The dense part goes to ``allreduce_donated_async`` (momentum correction a copy of the velocity it
    keeps); reduced in place there, every result and residual is bit for bit the copying transport's
    (so the velocity of later steps is too), and no gradient the caller added changes."""
    make = (lambda: TopK(0.05, momentum=0.9)) if kind == "topk-momentum" else COMPRESSORS[kind]

    def work(comm, donated):
        compressor, out, dense_steps = make(), [], 0
        for step in range(3):
            grads = {n: g for n, g in gradients(comm.rank, step, torch.float32).items() if n in shapes}
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, g in grads.items():
                exchange.add(name, g)
            exchange.launch()
            dense_steps += bool(exchange.launched[0].bucket.dense)
            results = exchange.finish(average=True)
            out.append({n: (results[n].clone(), compressor.residual(n)) for n in grads})
            for name, g in gradients(comm.rank, step, torch.float32).items():
                assert name not in grads or torch.equal(grads[name], g), f"gradient {name} changed"
        return out, (len(comm.donated), dense_steps) if donated else None

    in_place = run_ranks(3, lambda comm: work(InPlaceRanks(comm), True))
    copied = run_ranks(3, lambda comm: work(comm, False))
    for (got, (donated, dense_steps)), (want, _) in zip(in_place, copied):
        assert dense_steps and donated == dense_steps
        for step_got, step_want in zip(got, want):
            for name, (result, residual) in step_got.items():
                assert torch.equal(result, step_want[name][0]), name
                assert residual is None or torch.equal(residual, step_want[name][1]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["none", "topk", "gaussiank", "regtopk", "terngrad"])
def test_flat_finish_is_the_results_concatenated(kind, dtype):
    """``finish(order=names)`` (a DDP hook's flat bucket: the sparsifiers' decode sums straight into that
    order, Gaussian-k's unused slots included; others concatenate) is ``finish()``'s results flattened and
    concatenated in that order, bit for bit: torch buckets the CPU's way and the accelerator's, numpy
    buckets; a NaN on one rank at step 1 (its flag moves with its tensor)."""
    order = ["e", "b", "a", "f", "d", "c"]

    def steps(comm, make, grads, flat, way):
        compressor, out = make(), []
        with way_of(way):
            for step in range(3):
                exchange = BucketExchange(compressor, comm, "bucket")
                for name, g in grads(comm.rank, step).items():
                    exchange.add(name, with_entry(g, 5, float("nan")) if (comm.rank, step, name) == (1, 1, "f") else g)
                exchange.launch()
                result = exchange.finish(average=True, order=order if flat else None)
                out.append(result if flat else np.concatenate([np.asarray(result[n]).reshape(-1) for n in order]))
        return out

    fused = lambda rank, step: gradients(rank, step, dtype)  # noqa: E731
    numpy = lambda rank, step: {n: g.float().numpy() for n, g in gradients(rank, step, dtype).items()}  # noqa: E731
    for grads, wire, way in ((fused, torch.Tensor, "host"), (fused, torch.Tensor, "accelerator"),
                             (numpy, np.ndarray, "numpy")):
        flats = run_ranks(3, lambda comm: steps(comm, COMPRESSORS[kind], grads, True, way))
        wants = run_ranks(3, lambda comm: steps(comm, COMPRESSORS[kind], grads, False, way))
        for flat, want in zip(flats, wants):
            for got, expected in zip(flat, want):
                assert isinstance(got, wire) and got.shape == expected.shape
                np.testing.assert_array_equal(np.asarray(got.float() if wire is torch.Tensor else got), expected)


def test_flat_finish_of_some_tensors_is_theirs_concatenated():
    """An ``order`` naming some of the bucket's tensors (not a permutation of all) gives those results
    flat, in that order (the sums concatenated rather than decoded in place)."""
    order = ["c", "a"]

    def steps(comm, flat):
        compressor, out = TopK(0.05), []
        with torch_ops.accelerator_path():
            for step in range(2):
                exchange = BucketExchange(compressor, comm, "bucket")
                for name, g in gradients(comm.rank, step, torch.float32).items():
                    exchange.add(name, g)
                exchange.launch()
                result = exchange.finish(average=True, order=order if flat else None)
                out.append(result if flat else torch.cat([result[n].reshape(-1) for n in order]))
        return out

    for got, want in zip(run_ranks(2, lambda comm: steps(comm, True)), run_ranks(2, lambda comm: steps(comm, False))):
        for g, w in zip(got, want):
            assert g.shape == (2000 + 40 * 50,) and torch.equal(g, w)


@pytest.mark.parametrize("numpy", [False, True], ids=["torch", "numpy"])
def test_sent_plus_residual_equals_produced(numpy):
    """One rank, Top-k with error feedback: sum of results + residual == sum of gradients."""
    results = exchange_steps(SingleProcessCommunicator(), lambda: TopK(0.01), torch.float64, 6, numpy=numpy)
    for name in SHAPES:
        produced = sum(as_float64(gradients(0, step, torch.float64)[name]) for step in range(6))
        delivered = sum(as_float64(results[step][name]) for step in range(6))
        residual = results[-1]["residuals"][name]
        total = delivered + (0 if residual is None else as_float64(residual))
        np.testing.assert_allclose(total, produced, rtol=0, atol=1e-12)


@pytest.mark.parametrize("special, dtype", [(float("nan"), torch.float32), (float("-inf"), torch.float16)],
                         ids=["nan-float32", "inf-float16"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["topk", "gaussiank", "regtopk", "terngrad-feedback-unclipped", "fp16"])
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_nan_on_one_rank_is_nonfinite_everywhere_and_loses_nothing(kind, path, special, dtype):
    """Also -Inf in a float16 gradient, whose values travel saturated (finite): the flag still goes.
    No numpy warning on the way."""
    ranks = 2

    with way_of(path):
        results = run_ranks(ranks, lambda comm: exchange_steps(comm, COMPRESSORS[kind], dtype, 3, nan=(1, 1, "a"),
                                                               special=special, numpy=path == "numpy",
                                                               tensorflow=path == "tensorflow"))
    for result in results:
        assert not np.isfinite(as_float64(result[1]["a"])).all(), "tensor 'a' should be non-finite on every rank"
        assert all(np.isfinite(as_float64(result[s][n])).all() for s in range(3) for n in SHAPES if (s, n) != (1, "a"))
        before, after = result[0]["residuals"]["a"], result[1]["residuals"]["a"]
        if before is not None:
            np.testing.assert_array_equal(as_float64(before), as_float64(after),
                                          "the residual of the NaN step must be kept")
        for name in SHAPES:
            residual = result[2]["residuals"][name]
            assert residual is None or np.isfinite(as_float64(residual)).all(), name


@pytest.mark.parametrize("numpy", [False, True], ids=["torch", "numpy"])
def test_checkpoint_of_a_fused_bucket_resumes_exactly(numpy):
    comm = SingleProcessCommunicator()

    def run(compressor, steps, start=0):
        out = None
        for step in range(start, start + steps):
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, g in gradients(0, step, torch.float32, numpy=numpy).items():
                exchange.add(name, g)
            exchange.launch()
            out = exchange.finish()
        return out

    straight = run(RegTopK(0.05), 4)
    first = RegTopK(0.05)
    run(first, 2)
    resumed = RegTopK(0.05)
    resumed.load_state_dict(first.state_dict())
    again = run(resumed, 2, start=2)
    for name in SHAPES:
        np.testing.assert_array_equal(as_float64(again[name]), as_float64(straight[name]), name)


@pytest.mark.parametrize("kind", ["topk", "gaussiank", "regtopk", "terngrad", "fp16", "none"])
def test_steady_state_step_reads_nothing_back(kind):
    """The CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``: after the first step (the
    layout check), a step calls no item/tolist/bool/int/float/index on any tensor."""
    from tests.distributed import torch_horovod as workload

    import hvd_compress.torch as hvd_torch

    model = workload.make_model()
    optimizer = hvd_torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=COMPRESSORS[kind](),
        communicator=SingleProcessCommunicator(),
    )
    data = workload.batches(0, 3)

    def step(x, y):
        optimizer.zero_grad()
        workload.loss_fn(model, x, y).backward()
        optimizer.step()

    step(*data[0])
    # the CPU's way reads back by design (cheaper there); the accelerator's way is what counts here
    with count_host_reads() as reads, torch_ops.accelerator_path():
        for x, y in data[1:]:
            step(x, y)
    syncing = {k: n for k, n in reads.by_kind.items() if k not in ("numpy", "cpu")}
    assert not syncing, f"{kind}: host reads in a steady-state step: {syncing} at {reads.sites.most_common(5)}"


@pytest.mark.parametrize("kind", [k for k in COMPRESSORS if k != "fp16"] + ["fp16"])
def test_tensorflow_steady_state_step_reads_nothing_back(kind):
    """TensorFlow's kernels (a GPU's path): after the first step (the layout check), an exchange of
    float32 and float16 buckets reads no tensor value back to the host, TensorFlow's own ops included."""
    tf = pytest.importorskip("tensorflow")
    grads = {f"{name}.{dtype}": tf.cast(tf.constant(g.numpy()), dtype)
             for dtype in ("float32", "float16") for name, g in gradients(0, 0, torch.float32).items()}
    compressor, comm = COMPRESSORS[kind](), SingleProcessCommunicator()

    def step():
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in grads.items():
            exchange.add(name, g)
        exchange.launch()
        return exchange.finish(average=True)

    with way_of("tensorflow"):
        step()
        with count_host_reads("tensorflow") as reads:
            step()
    assert reads.count == 0, f"{kind}: host reads in a steady-state step: {reads.as_dict()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["topk", "gaussiank", "regtopk", "terngrad", "fp16", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_cuda_steady_state_step_never_synchronizes(kind, dtype):
    """On a GPU: ``torch.cuda.set_sync_debug_mode("error")`` around steady-state exchanges."""
    comm = SingleProcessCommunicator()
    compressor = COMPRESSORS[kind]()

    # copied to the GPU before the check: a copy from pageable host memory synchronizes by itself
    steps = [{name: g.cuda() for name, g in gradients(0, index, dtype).items()} for index in range(4)]

    def step(index):
        exchange = BucketExchange(compressor, comm, "bucket")
        for name, g in steps[index].items():
            exchange.add(name, g)
        exchange.launch()
        return exchange.finish()

    step(0)  # the layout check reads its header once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for index in range(1, 4):
            step(index)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("framework", ["numpy", "tensorflow"])
def test_a_bucket_of_several_dtypes_is_a_fused_bucket_per_dtype(framework):
    """float32, float16 and float64 gradients in one bucket: each dtype its own fused bucket, the results
    the per-tensor spec's, each in its gradient's dtype and framework (TensorFlow: float32 and float64 computed
    as numpy arrays, float16 on TensorFlow's kernels, all handed back as TensorFlow tensors)."""
    dtypes = {"a": np.float32, "b": np.float16, "c": np.float64, "d": np.float32}

    def grads(rank, step):
        rng = np.random.default_rng(10 * rank + step)
        out = {n: rng.standard_normal(300).astype(dtype) for n, dtype in dtypes.items()}
        if framework == "tensorflow":
            tf = pytest.importorskip("tensorflow")
            out = {n: tf.constant(g) for n, g in out.items()}
        return out

    def steps(comm):
        compressor, out = TopK(0.05, dense_below=0), []
        for step in range(2):
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, g in grads(comm.rank, step).items():
                exchange.add(name, g)
            exchange.launch()
            assert len(exchange.launched) == 3
            out.append(exchange.finish(average=True))
        return out

    results = run_ranks(2, steps, timeout=60)
    spec = PerTensorRanks(2, TopK(0.05, dense_below=0))
    for step in range(2):
        expected = spec.step({n: [grads(r, step)[n] for r in range(2)] for n in dtypes})
        for result in results:
            for name, dtype in dtypes.items():
                got = result[step][name]
                assert type(got) is type(expected[name]) and np.dtype(got.dtype.name if framework == "tensorflow"
                                                                      else got.dtype) == dtype, name
                np.testing.assert_array_equal(np.asarray(got), np.asarray(expected[name]), err_msg=f"{step} {name}")


def test_accelerator_blocks_of_several_threads_end_in_any_order():
    """Rank threads open and close ``accelerator_path`` blocks in any order: the CPU's way is off while one
    is open and on again once all have closed."""
    a = torch.zeros(3)
    first, second = torch_ops.accelerator_path(), torch_ops.accelerator_path()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not torch_ops.on_host(a)
    second.__exit__(None, None, None)
    assert torch_ops.on_host(a)
