"""``hvd_compress.torch.ddp_hook`` in real 2-process DDP runs (CPU, gloo, ``torch.multiprocessing``).

A small model (one DDP bucket) trains a few steps with every compressor; the
final parameters on both ranks must equal the in-process Simulator fed the same
per-rank gradients per parameter (1e-6; FP16 1e-3, as gloo sums float16 in
float16), named ``ddp.bucket0.<position>`` from DDP's construction-time layout
(model order), in that order whatever DDP's rebuilt bucket order (from step 2
in reverse; each run records and checks both). Also: NaN
gradients on one rank become non-finite gradients on every rank with nothing
lost, another ratio on one rank makes every rank raise, and a checkpoint
(pickle or state_dict) resumes bit for bit; two models whose hooks share one compressor
each equal the Simulator (each hook runs it on its own state); the dense-switch probe loses nothing and
``compressor.stats`` equals the bytes handed to the collectives; compressor state moves
to and from the drop-in optimizer and the Simulator; GradScaler with an overflow on one rank
skips exactly the steps DDP without a hook skips; ``nn.Embedding(sparse=True)``
and a zero-size parameter train (the sparse gradient densified and compressed,
mass conserved). One spawn runs it all (each start costs seconds).
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


from hvd_compress import Compression, NoneCompressor, RegTopK, TernGrad, TopK  # noqa: E402
from hvd_compress import wire  # noqa: E402
from hvd_compress.kernels import reference  # noqa: E402
from hvd_compress.engine.exchange import open_exchange  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402
from hvd_compress.torch import CompressionState, ddp_hook  # noqa: E402
from tests.distributed import launch  # noqa: E402
from tests.distributed import route_checkpoints as moves  # noqa: E402
from tests.distributed import switch_probe as probe  # noqa: E402
from tests.distributed.faults_torch import Odd  # noqa: E402  (a sparse embedding, a zero-size parameter)

RANKS, STEPS, RATIO, LR = 2, 4, 0.05, 0.1
BUCKET = "ddp.bucket0"
BUCKET_MB = 25  # the model (~38 KB) fits in one bucket
VARIANTS = ["topk", "gaussiank", "regtopk", "terngrad", "terngrad_allreduce", "fp16", "none", "topk_leader",
            "regtopk_aggregate", "topk_reuse"]
SHARED = ["regtopk", "terngrad"]  # two models on one compressor: residuals, posteriors, random streams
RESUMED = [(v, how) for v in ("regtopk", "terngrad") for how in ("pickle", "state_dict")]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    return torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)


def compressor(variant: str):
    """``<name>[_terngrad wire format | _<shared index rule> | _reuse]`` (``_reuse``: ``exact_every=2``)."""
    name, _, option = variant.partition("_")
    options = {"indices": option} if option in ("leader", "aggregate") else {"exact_every": 2} if option == "reuse" else {}
    return Compression.by_name(name, RATIO, **({} if name in ("none", "fp16") else {"seed": 0}), **options)


@contextlib.contextmanager
def wire_format(variant: str):
    """``terngrad_allreduce``: force the packed-lane allreduce (2 ranks would pick the 2-bit allgather)."""
    original = wire.ternary_wire_format
    if variant.endswith("_allreduce"):
        wire.ternary_wire_format = lambda numel, world: "allreduce"
    try:
        yield
    finally:
        wire.ternary_wire_format = original


# ----------------------------------------------------------------- in the ranks
class Wire:
    """Counts the collectives ddp.py calls (bytes handed in, and uneven all_to_all calls)."""

    ATTRS = ("all_gather", "all_reduce", "all_to_all_single")

    def __init__(self) -> None:
        self.bytes, self.alltoall = 0, 0
        self.originals = {attr: getattr(dist, attr) for attr in self.ATTRS}
        for attr in self.ATTRS:
            setattr(dist, attr, self._counting(attr, getattr(dist, attr)))

    def restore(self) -> None:
        for attr, function in self.originals.items():
            setattr(dist, attr, function)

    def _counting(self, attr, function):
        def wrapper(*args, **kwargs):
            tensor = args[0] if attr == "all_reduce" else args[1]
            if attr == "all_to_all_single":
                self.alltoall += 1
                tensor = tensor[: tensor.numel() // dist.get_world_size()]  # the repeats are per peer
            self.bytes += tensor.numel() * tensor.element_size()
            return function(*args, **kwargs)

        return wrapper


def train(rank, variant, steps, start=0, params=None, state=None, wire=None, layouts=None):
    model = make_model()
    if params is not None:
        model.load_state_dict(params)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
    state = state or CompressionState(compressor(variant), process_group=None)
    order = {id(p): i for i, p in enumerate(model.parameters())}

    def hook(state, bucket):
        if layouts is not None:
            layouts.append((bucket.index(), [order[id(p)] for p in bucket.parameters()]))
        return ddp_hook(state, bucket)

    ddp.register_comm_hook(state, ddp_hook if layouts is None else hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    per_step = []
    for step in range(start, start + steps):
        before = wire.bytes if wire else 0
        optimizer.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        per_step.append((wire.bytes if wire else 0) - before)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, state, per_step


def shared_training(rank: int, variant: str) -> list:
    """Two DDP models whose parameters share names (``ddp.bucket0.<position>``), their hooks on one
    compressor (a ``CompressionState`` each), stepped in turn on the same data: their parameters."""
    compression = compressor(variant)
    models = [torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=BUCKET_MB) for _ in range(2)]
    hooks = [CompressionState(compression) for _ in models]
    assert hooks[0].compression_state is not hooks[1].compression_state
    optimizers = []
    for model, hook in zip(models, hooks):
        model.register_comm_hook(hook, ddp_hook)
        optimizers.append(torch.optim.SGD(model.parameters(), lr=LR))
    for step in range(STEPS):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return [{k: v.detach().clone() for k, v in model.module.state_dict().items()} for model in models]


def replicas_agree(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    others = [torch.empty_like(flat) for _ in range(RANKS)]
    dist.all_gather(others, flat)
    return all(torch.equal(other, flat) for other in others)


class FlatBucket:
    """What ``handwritten_topk_hook`` uses of ``dist.GradBucket``."""

    def __init__(self, flat: torch.Tensor, index: int) -> None:
        self.flat, self.i = flat, index

    def buffer(self) -> torch.Tensor:
        return self.flat

    def index(self) -> int:
        return self.i


HANDWRITTEN_SIZES = (300, 77)  # two buckets: k = 15 and 4 at RATIO


def handwritten_gradient(rank: int, step: int, bucket: int) -> np.ndarray:
    return np.random.default_rng([rank, step, bucket]).standard_normal(HANDWRITTEN_SIZES[bucket]).astype(np.float32)


def handwritten_runs(rank: int) -> dict:
    """The benchmarks' hand-written Top-k hook (``benchmarks.routes``): called on two buckets
    for 3 steps (results and residuals), then in a DDP model of several buckets (replicas agree)."""
    from benchmarks import routes

    state, calls = routes.HandwrittenTopKState(RATIO), {}
    for step in range(3):
        for bucket in range(len(HANDWRITTEN_SIZES)):
            grad = torch.from_numpy(handwritten_gradient(rank, step, bucket))
            average = routes.handwritten_topk_hook(state, FlatBucket(grad, bucket)).wait()
            calls[step, bucket] = (average.clone(), state.residuals[bucket].clone())
    torch.manual_seed(0)  # 1.3M parameters: DDP's first bucket takes 1 MiB or more, the others 0.25 MB
    module = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 256))
    model = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.25)
    buckets = set()

    def hook(state, bucket):
        buckets.add(bucket.index())
        return routes.handwritten_topk_hook(state, bucket)

    model.register_comm_hook(routes.HandwrittenTopKState(RATIO), hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(3):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {"calls": calls, "ddp_agree": replicas_agree(model), "ddp_buckets": len(buckets)}


def scaled_training(rank: int, compression, inject: int = 2, steps: int = 5) -> dict:
    """torch.amp.GradScaler over DDP (``compression`` None: no hook) with an overflow on rank 1 at
    step ``inject``: which steps changed the weights, the scale after each, residuals finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if compression is not None:
        ddp.register_comm_hook(CompressionState(compression, named_parameters=model.named_parameters()), ddp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    stepped, scales = [], []
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(8, 16, generator=generator)
        if step == inject and rank == 1:
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        scaler.scale(ddp(x).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    residuals = [] if compression is None else [compression.residual(n) for n, _ in model.named_parameters()]
    assert replicas_agree(model), f"{compression!r}: replicas diverged"
    return {"stepped": stepped, "scales": scales,
            "residuals_finite": all(r is None or bool(torch.isfinite(r).all()) for r in residuals)}


def sparse_training(rank: int, compression, steps: int = 2) -> dict:
    """DDP (``compression`` None: no hook) of ``Odd``: how far the embedding moved, the
    gradient's layout, the warnings, and Top-k's conservation of mass over the steps: sum over
    ranks of the produced gradients == N * (what reached the weights) + sum of the residuals."""
    model = Odd()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if compression is not None:
        ddp.register_comm_hook(CompressionState(compression, named_parameters=model.named_parameters()), ddp_hook)
    initial = model.embedding.weight.detach().clone()
    produced = torch.zeros_like(initial)
    generator = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            ddp.zero_grad()
            tokens = torch.randint(0, 50, (6,), generator=generator)
            model(tokens).backward()  # the local gradient, as DDP's backward produces it
            produced += model.embedding.weight.grad.to_dense()
            ddp.zero_grad()
            before = model.embedding.weight.detach().clone()
            ddp(tokens).backward()
            layout = str(model.embedding.weight.grad.layout)
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
            assert model.empty.grad is not None and model.empty.grad.shape == (0, 3)
    assert replicas_agree(model), f"{compression!r}: replicas diverged"
    result = {"moved": float((model.embedding.weight - before).abs().max()), "layout": layout,
              "warnings": [str(w.message) for w in caught if "hvd_compress" in str(w.message)]}
    if isinstance(compression, TopK):
        reached = (initial - model.embedding.weight.detach()) / LR * RANKS
        kept = compression.residual("embedding.weight").clone()
        dist.all_reduce(produced)
        dist.all_reduce(kept)
        result["conservation"] = float((produced - reached - kept).abs().max())
    return result


class Probe(torch.nn.Module):
    """The dense-switch probe's one parameter (:mod:`tests.distributed.switch_probe`)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(probe.SIZE))

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        return (self.w * row).sum()


def switch_probe(rank: int) -> dict:
    """The dense-switch probe through the hook: its relative error (0: nothing lost), and the bytes
    handed to the collectives next to what ``compressor.stats`` counted."""
    model = Probe()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    compression = TopK(probe.SPARSE)
    ddp.register_comm_hook(CompressionState(compression), ddp_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=probe.LR)
    wire = Wire()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sends 'ddp.bucket0.0' dense"
        for step, row in enumerate(torch.from_numpy(probe.gradients(rank))):
            compression.ratio = probe.ratio(step)
            optimizer.zero_grad()
            ddp(row).backward()
            optimizer.step()
    wire.restore()
    return {"error": probe.relative_error(-model.w.detach().numpy(), RANKS),
            "handed": wire.bytes, "counted": compression.stats.bytes_sent}


def checkpoints_between_routes(rank: int) -> dict:
    """Compressor state saved by the hook and loaded by the drop-in optimizer (over torch.distributed)
    or the Simulator, and the other way round (``tests/distributed/route_checkpoints.py``): how far
    each run is from the Simulator's without a break; and the messages of what is refused (the
    hook's positional names without named_parameters=)."""
    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    def gather(state):
        states = [None] * RANKS
        dist.all_gather_object(states, state)
        return states

    comm = TorchDistCommunicator()
    pairs = [("ddp", "dropin"), ("dropin", "ddp"), ("ddp", "Simulator"), ("Simulator", "ddp")]
    differences = moves.matrix(pairs, rank, RANKS, comm, gather)
    initial = moves.initial()
    _, unnamed = moves.train("ddp", "regtopk", rank, 0, 1, params=initial, named=False)
    _, named = moves.train("dropin", "regtopk", rank, 0, 1, comm, initial)
    refused = {
        "ddp->dropin": moves.refusal(lambda: moves.train("dropin", "regtopk", rank, 1, 2, comm, initial, unnamed)),
        "dropin->ddp": moves.refusal(lambda: moves.train("ddp", "regtopk", rank, 1, 2, None, initial, named,
                                                         named=False)),
    }
    return {"differences": differences, "refused": refused}


def job(rank: int, out: Path) -> None:
    """Every training run, then the misconfigured one, which must raise on every rank."""
    wire = Wire()
    result = {}
    for variant in VARIANTS:
        layouts = []
        alltoall = wire.alltoall
        with wire_format(variant):
            params, state, per_step = train(rank, variant, STEPS, wire=wire, layouts=layouts)
        result[variant] = {
            "params": params,
            "layouts": layouts,
            "bytes": per_step,
            "counted": state.compressor.stats.bytes_sent,
            "alltoall": wire.alltoall - alltoall,
        }
    wire.restore()
    result["shared"] = {variant: shared_training(rank, variant) for variant in SHARED}
    result["switch"] = switch_probe(rank)
    result["handwritten"] = handwritten_runs(rank)
    result["checkpoints"] = checkpoints_between_routes(rank)
    for variant, how in RESUMED:
        params, state, _ = train(rank, variant, STEPS // 2)
        if how == "pickle":
            state = pickle.loads(pickle.dumps(state))
            assert state.process_group is None
        else:
            saved = io.BytesIO()
            torch.save(state.state_dict(), saved)
            state = CompressionState(compressor(variant))
            state.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
        params, _, _ = train(rank, variant, STEPS - STEPS // 2, start=STEPS // 2, params=params, state=state)
        result[f"resumed/{variant}/{how}"] = {"params": params}
    result["nan"] = {}
    for variant in ("topk", "regtopk", "terngrad", "fp16"):  # NaN on rank 1 at step 2: dense-like, nothing lost
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        state = CompressionState(compressor(variant))
        model.register_comm_hook(state, ddp_hook)
        record = {}
        for step in range(3):
            model.zero_grad()
            x, y = batch(rank, step)
            bad = step == 1 and rank == 1
            torch.nn.functional.cross_entropy(model(x * float("nan") if bad else x), y).backward()
            record[f"finite{step}"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
            record[f"residuals{step}"] = {
                n: state.compressor.residual(n).clone()
                for n in state.compressor.memory.names()
                if state.compressor.residual(n) is not None
            }
        result["nan"][variant] = record
    result["amp"] = {"dense": scaled_training(rank, None)}
    for make in (lambda: TopK(0.1, dense_below=0), lambda: RegTopK(0.1, dense_below=0),
                 lambda: TernGrad(dense_below=0, error_feedback=True)):
        compression = make()
        result["amp"][type(compression).__name__] = scaled_training(rank, compression)
    result["sparse"] = {}
    for make in (lambda: None, NoneCompressor, lambda: TopK(0.1, dense_below=0), lambda: TernGrad(dense_below=0)):
        compression = make()
        result["sparse"][type(compression).__name__] = sparse_training(rank, compression)
    torch.save(result, out / f"rank{rank}.pt")

    model = torch.nn.parallel.DistributedDataParallel(make_model())
    model.register_comm_hook(CompressionState(RegTopK(2 * RATIO if rank == 1 else RATIO)), ddp_hook)
    x, y = batch(rank, 0)
    start = time.monotonic()
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except ValueError as error:
        (out / f"error{rank}.txt").write_text(f"{time.monotonic() - start:.3f}\n{error}")
        dist.barrier()  # both ranks raised: let both report before the spawn ends them
        raise


def _entry(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    with launch.gloo_group(rank, RANKS, port):
        job(rank, Path(out))


def spawn(out: Path, timeout: float = 180.0) -> None:
    launch.spawn_gloo(_entry, RANKS, str(out), timeout=timeout)


# ---------------------------------------------------------------- in this process
def simulate(variant: str, steps: int = STEPS):
    """The Simulator fed each rank's gradients per parameter, named and ordered as the hook hands them
    to the exchange: ``ddp.bucket0.<position in model order>``, in model order (DDP's first layout)."""
    model = make_model()
    params = list(model.parameters())
    names = [f"{BUCKET}.{i}" for i in range(len(params))]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sim = Simulator(RANKS, compressor(variant))
    with wire_format(variant):
        for step in range(steps):
            grads = {}
            order = range(len(params))
            per_rank = []
            for rank in range(RANKS):
                model.zero_grad()
                x, y = batch(rank, step)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                per_rank.append([p.grad.clone() for p in params])
            grads = {names[i]: [per_rank[r][i] for r in range(RANKS)] for i in order}
            average = sim.step(grads)
            for name, p in zip(names, params):
                p.grad = average[name].clone()
            optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One 2-process run (each start costs seconds): ``(results per rank, error files, what the spawn raised)``."""
    out = tmp_path_factory.mktemp("ddp")
    try:
        spawn(out)
        raised = None
    except Exception as error:  # expected: the misconfigured run at the end
        raised = error
    errors = [out / f"error{r}.txt" for r in range(RANKS)]
    return out, errors, raised


@pytest.fixture(scope="module")
def trained(ranks):
    out, _, raised = ranks
    if not all((out / f"rank{r}.pt").exists() for r in range(RANKS)):
        pytest.fail(f"the DDP runs did not finish: {raised}")
    return [torch.load(out / f"rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_equal_simulator(trained, variant):
    model_order = list(range(len(list(make_model().parameters()))))
    for result in trained:  # DDP's layout: model order at step 1, then rebuilt in gradient-ready order
        assert result[variant]["layouts"] == [(0, model_order)] + [(0, model_order[::-1])] * (STEPS - 1)
    expected = simulate(variant)
    tolerance = 1e-3 if variant == "fp16" else 1e-6
    for rank, result in enumerate(trained):
        for key, value in expected.items():
            np.testing.assert_allclose(
                result[variant]["params"][key].numpy(),
                value.numpy(),
                rtol=0,
                atol=tolerance,
                err_msg=f"{variant} {key}: rank {rank} of the DDP run differs from the Simulator",
            )


def test_handwritten_topk_hook_averages_each_ranks_top_k_with_error_feedback(trained):
    """The benchmarks' peer on 2 gloo ranks: per bucket ``a_r = g_r + e_r``, each rank's ``k`` largest
    ``|a_r|`` sent, ``e_r = a_r`` with those zeroed, the result ``(sum_r a_r[S_r] at S_r) / 2`` (two float32
    terms: exact in either order); and in DDP over several buckets (their futures completed on gloo's two
    threads) both replicas stay equal."""
    residuals = [[np.zeros(n, np.float32) for n in HANDWRITTEN_SIZES] for _ in range(RANKS)]
    for step in range(3):
        for bucket, n in enumerate(HANDWRITTEN_SIZES):
            k = math.ceil(RATIO * n)
            total = np.zeros(n, np.float32)
            for rank in range(RANKS):
                a = handwritten_gradient(rank, step, bucket) + residuals[rank][bucket]
                chosen = np.argsort(-np.abs(a))[:k]
                total[chosen] += a[chosen]
                residuals[rank][bucket] = a.copy()
                residuals[rank][bucket][chosen] = 0
            for rank, result in enumerate(trained):
                average, residual = result["handwritten"]["calls"][step, bucket]
                where = f"rank {rank}, step {step}, bucket {bucket}"
                np.testing.assert_array_equal(average.numpy(), total / RANKS, err_msg=where)
                np.testing.assert_array_equal(residual.numpy(), residuals[rank][bucket], err_msg=where)
    for result in trained:
        assert result["handwritten"]["ddp_agree"] and result["handwritten"]["ddp_buckets"] > 1, result["handwritten"]


@pytest.mark.parametrize("variant", SHARED)
def test_two_models_on_one_compressor_each_equal_the_simulator(trained, variant):
    """Each hook runs the compressor on its own state: nothing of one model's run reaches the other's."""
    expected = simulate(variant)
    for rank, result in enumerate(trained):
        for model, params in enumerate(result["shared"][variant]):
            for key, value in expected.items():
                np.testing.assert_allclose(params[key].numpy(), value.numpy(), rtol=0, atol=1e-6,
                                           err_msg=f"{variant} {key}: model {model} on rank {rank}")


def test_sparse_payloads_travel_sparse(trained):
    """Fixed-size payloads: k values + k indices per compressed tensor (Gaussian-k: floor(4k/3)
    slots), one NaN flag and its position each (Gaussian-k: one more, the spare entry); the
    dense biases in one allreduce; the layout header only when the layout is new (step 1; DDP's
    rebuilt order from step 2 is not a new layout for the exchange)."""
    sizes = [p.numel() for p in make_model().parameters()]
    numel = sum(sizes)
    compressed = [n for n in sizes if n >= 1024]
    k = sum(reference.num_selected(n, RATIO) for n in compressed)
    header = 2 * 8  # [config hash, layout hash] as int64
    dense = 4 * (numel - sum(compressed))
    payload = dense + 4 * (k + len(compressed)) + 4 * (k + len(compressed))
    slots = sum(reference.gaussiank_slots(reference.num_selected(n, RATIO)) for n in compressed)
    padded = dense + 8 * (slots + len(compressed) + 1)
    for result in trained:
        assert result["topk"]["bytes"] == [header + payload] + [payload] * (STEPS - 1)
        assert result["regtopk"]["bytes"] == [header + payload] + [payload] * (STEPS - 1)
        assert result["none"]["bytes"] == [header + 4 * numel] + [4 * numel] * (STEPS - 1)
        # Gaussian-k: floor(4k/3) slots per tensor, whatever the counts, so no uneven allgather
        assert result["gaussiank"]["bytes"] == [header + padded] + [padded] * (STEPS - 1)
        assert result["gaussiank"]["alltoall"] == 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_statistics_count_every_byte_handed_to_the_collectives(trained, variant):
    """compressor.stats.bytes_sent == the bytes the hook handed to torch.distributed over the run
    (payloads, flags, the dense part and the first step's header)."""
    for rank, result in enumerate(trained):
        assert result[variant]["counted"] == sum(result[variant]["bytes"]), (rank, result[variant]["bytes"])


def test_a_tensor_that_turns_dense_sends_its_residual(trained):
    """The dense-switch probe (``tests/distributed/switch_probe.py``) through the hook: the weights
    moved by exactly lr x the sum of the mean gradients (float32 rounding), nothing read a residual
    before the check; the statistics equal the bytes handed over there too."""
    for rank, result in enumerate(trained):
        case = result["switch"]
        assert case["error"] < 1e-5, (rank, case)
        assert case["counted"] == case["handed"], (rank, case)


def test_checkpoints_move_between_the_hook_the_drop_in_and_the_simulator(trained):
    """Each rank's compressor state saved after 2 steps on one route and loaded on another resumes
    exactly (2 more steps equal the Simulator's 4 without a break); the hook's positional names are
    refused at load by the drop-in, and parameter names by a hook without named_parameters=, naming
    the route that wrote the state."""
    for rank, result in enumerate(trained):
        differences, refused = result["checkpoints"]["differences"], result["checkpoints"]["refused"]
        assert len(differences) == 8 and max(differences.values()) < 1e-6, (rank, differences)
        assert "written by hvd_compress.torch.ddp_hook and names its tensors 'ddp.bucket0." in refused["ddp->dropin"]
        assert "written by hvd_compress.torch.DistributedOptimizer" in refused["dropin->ddp"], refused
        assert ("none of which this ddp_hook's CompressionState exchanges (without named_parameters= it names "
                "parameters ddp.bucket<index>.<position>)") in refused["dropin->ddp"], refused


@pytest.mark.parametrize("variant", ["topk", "regtopk", "terngrad", "fp16"])
def test_nan_gradient_on_one_rank_is_nonfinite_on_every_rank_and_loses_nothing(trained, variant):
    """As DDP's dense allreduce: NaN on rank 1 at step 2 makes every gradient non-finite on both
    ranks; residuals keep their step-1 values and stay finite; step 3 trains normally."""
    for result in trained:
        record = result["nan"][variant]
        assert all(record["finite0"]) and all(record["finite2"]), record
        assert not any(record["finite1"]), record
        for name, residual in record["residuals1"].items():
            assert torch.equal(residual, record["residuals0"][name]), name
            assert bool(torch.isfinite(residual).all()), name


def test_grad_scaler_skips_exactly_the_steps_ddp_without_hook_skips(trained):
    """An overflow injected on rank 1 at step 3: Top-k, RegTop-k and TernGrad (error feedback)
    skip that step on every rank as plain DDP does, halve the scale as it does, train on
    afterwards, and keep every residual finite."""
    for rank, result in enumerate(trained):
        runs = result["amp"]
        assert runs["dense"]["stepped"] == [True, True, False, True, True], runs["dense"]
        for name in ("TopK", "RegTopK", "TernGrad"):
            run = runs[name]
            assert run["stepped"] == runs["dense"]["stepped"] and run["scales"] == runs["dense"]["scales"], (
                rank, name, run)
            assert run["residuals_finite"], (rank, name)


def test_sparse_embedding_and_zero_size_parameter_train_and_conserve_mass(trained):
    """nn.Embedding(sparse=True): DDP hands the hook a bucket whose buffer() is the sparse gradient;
    the hook compresses it dense (one warning, on the first step) and returns a sparse gradient, as
    DDP requires; the zero-size parameter passes; Top-k conserves the gradient's mass."""
    for rank, result in enumerate(trained):
        runs = result["sparse"]
        assert set(runs) == {"NoneType", "NoneCompressor", "TopK", "TernGrad"}
        for name, run in runs.items():
            assert run["moved"] > 0 and run["layout"] == "torch.sparse_coo", (rank, name, run)
            if name != "NoneType":
                assert len(run["warnings"]) == 1 and "'embedding.weight' has a sparse gradient" in run["warnings"][0]
        assert runs["TopK"]["conservation"] < 1e-5, runs["TopK"]


@pytest.mark.parametrize("variant, how", RESUMED)
def test_checkpoint_resumes_exactly(trained, variant, how):
    """2 steps, state through pickle or state_dict into a new DDP model, 2 more steps == 4 steps."""
    for result in trained:
        for key, value in result[variant]["params"].items():
            assert torch.equal(result[f"resumed/{variant}/{how}"]["params"][key], value), key


def test_mismatched_ratio_fails_every_rank(ranks):
    _, errors, raised = ranks
    assert raised is not None, "a rank with another ratio trained without error"
    assert "ranks disagree on 'ddp.bucket0'" in str(raised), str(raised)[-2000:]
    for rank, path in enumerate(errors):
        assert path.exists(), f"rank {rank} did not raise: {raised}"
        seconds, message = path.read_text().split("\n", 1)
        assert float(seconds) < 60
        assert "ranks disagree on 'ddp.bucket0'" in message, message
        assert "configuration" in message and f"RegTopK(ratio={2 * RATIO if rank else RATIO}" in message, message


def test_state_pickles_without_process_group_and_delegates_state_dict():
    state = CompressionState(RegTopK(0.1, dense_below=0), process_group=object())
    name = f"{BUCKET}.0"  # the hook's name of the first parameter of bucket 0 (no named_parameters=)
    exchange = open_exchange(state.compressor, SingleProcessCommunicator(), BUCKET, state.compression_state)
    exchange.add(name, torch.randn(100))  # one step of the hook's exchange, on the hook's run state
    exchange.launch()
    exchange.finish()
    assert torch.count_nonzero(state.compressor.residual(name)) == 90  # k = 10 of 100 sent
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None
    assert torch.equal(copy.compressor.residual(name), state.compressor.residual(name))
    assert state.state_dict().keys() == state.compressor.state_dict().keys()
    fresh = CompressionState(RegTopK(0.1, dense_below=0))
    fresh.load_state_dict(state.state_dict())
    assert torch.equal(fresh.compressor.residual(name), state.compressor.residual(name))
    with pytest.raises(ValueError, match="TopK"):
        CompressionState(Compression.topk(0.1)).load_state_dict(state.state_dict())
