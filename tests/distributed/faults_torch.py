"""Fault cases for the PyTorch routes over Horovod, several per launch (``tests/distributed/test_faults.py``).

``python -m tests.distributed.faults_torch --out PREFIX CASE...`` under
``horovodrun --gloo`` or ``mpirun``: each case runs on every rank and each rank
writes ``PREFIX.<rank>.json``, ``{case: {"ok": metrics} or {"error": message}}``.
A case that fails on one rank fails on all (that is what the suite checks), so
the next case starts from a clean slate.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional

import torch

from hvd_compress import FP16, GaussianK, NoneCompressor, TernGrad, TopK
from tests.distributed import route_checkpoints as moves
from tests.distributed import switch_probe as probe

LR = 0.1
CASES: Dict[str, Callable[[], dict]] = {}


def case(fn: Callable[[], dict]) -> Callable[[], dict]:
    CASES[fn.__name__] = fn
    return fn


def hvd():
    import horovod.torch

    return horovod.torch


def data(steps: int, width: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(1000 * seed + hvd().rank())
    return [torch.randn(8, width, generator=generator) for _ in range(steps)]


class Branchy(torch.nn.Module):
    """``a`` and ``out`` are used everywhere, ``b`` on rank 0 only, ``c`` and ``d`` nowhere (different shapes)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Rank-dependent allocations: the parameters' ids, and so the order of Horovod's set of
        # gradients to fill in, differ between ranks (as they do between real processes)
        self._shift = [torch.empty(1) for _ in range(3 * hvd().rank())]
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.c, self.d = torch.nn.Linear(16, 40), torch.nn.Linear(16, 24)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if hvd().rank() == 0:
            h = h + torch.tanh(self.b(h))
        return self.out(h)


def optimizer(model: torch.nn.Module, compression, route: str, **options):
    import hvd_compress.torch as dropin

    wrap = dropin.DistributedOptimizer if route == "dropin" else hvd().DistributedOptimizer
    return wrap(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                compression=compression, **options)


def replicas_agree(model: torch.nn.Module) -> bool:
    """Every rank holds the same parameters (compared through an allgather of their bytes)."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return all(torch.equal(other, flat) for other in hvd().allgather_object(flat))


@contextlib.contextmanager
def bucket_cap(mib: Optional[str]) -> Iterator[None]:
    """Stock horovod.torch's bucket size (``HVD_COMPRESS_BUCKET_CAP_MB``) for optimizers built inside."""
    from hvd_compress.horovod.torch_buckets import CAP_ENV

    saved = os.environ.get(CAP_ENV)
    if mib is not None:
        os.environ[CAP_ENV] = mib
    try:
        yield
    finally:
        os.environ.pop(CAP_ENV, None)
        if saved is not None:
            os.environ[CAP_ENV] = saved


def train_unused(route: str, steps: int = 4, compression=None, **options) -> Dict[str, torch.Tensor]:
    model = Branchy()
    compression = TopK(0.1, dense_below=0) if compression is None else compression
    opt = optimizer(model, compression, route, **options)
    for x in data(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert replicas_agree(model), "replicas diverged"
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@case
def unused_parameters() -> dict:
    """Stock horovod.torch (plain and grouped) with parameters unused everywhere and on one rank only:
    the same training as the drop-in optimizer, which names every gradient by its parameter."""
    initial = {n: p.detach().clone() for n, p in Branchy().named_parameters()}
    reference = train_unused("dropin")
    differences = {}
    for label, options, cap in (("stock", {}, None), ("stock_grouped", {"groups": 2}, None),
                                ("stock_small_buckets", {}, "0.002")):
        with bucket_cap(cap):  # 0.002 MiB: 4 buckets, complete in different orders on the two ranks
            trained = train_unused("stock", **options)
        differences[label] = max(float((trained[n] - reference[n]).abs().max()) for n in reference)
    unused_moved = {"topk": max(float((reference[n] - initial[n]).abs().max()) for n in initial if n[0] in "cd")}
    for route in ("stock", "dropin"):  # TernGrad waits for the shared scale while encoding
        trained = train_unused(route, compression=TernGrad(dense_below=0))
        unused_moved[f"terngrad_{route}"] = max(
            float((trained[n] - initial[n]).abs().max()) for n in initial if n[0] in "cd"
        )
    b_moved = float((reference["b.weight"] - initial["b.weight"]).abs().max())
    return {"difference": differences, "unused_moved": unused_moved, "b_moved": b_moved}


class Odd(torch.nn.Module):
    """A sparse-gradient embedding, a zero-size parameter and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 8, sparse=True)
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))
        self.out = torch.nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(tokens)).sum() + self.empty.sum()


@case
def sparse_and_empty_parameters() -> dict:
    """nn.Embedding(sparse=True) and a zero-size parameter train on the stock and drop-in routes;
    drop-in Top-k conserves gradient mass: sum over ranks of the produced gradients ==
    N * (what reached the weights) + sum over ranks of the residuals."""
    moved, conservation = {}, {}
    routes = [("stock", NoneCompressor), ("stock", lambda: TopK(0.1, dense_below=0)),
              ("dropin", NoneCompressor), ("dropin", lambda: GaussianK(0.1, dense_below=0)),
              ("dropin", lambda: TopK(0.1, dense_below=0))]
    for route, make in routes:
        model, compression = Odd(), make()
        opt = optimizer(model, compression, route)
        before = model.embedding.weight.detach().clone()
        tokens = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(hvd().rank()))
        opt.zero_grad()
        local = []  # this rank's gradient as backward produces it (the drop-in's exchange may finish in backward)
        hook = model.embedding.weight.register_hook(lambda grad: local.append(grad.to_dense().clone()))
        model(tokens).backward()
        hook.remove()
        produced = local[0]
        opt.step()
        assert replicas_agree(model), f"{route} {compression!r}: replicas diverged"
        label = f"{route}_{type(compression).__name__}"
        moved[label] = float((model.embedding.weight - before).abs().max())
        if route == "dropin" and isinstance(compression, TopK):
            reached = (before - model.embedding.weight.detach()) / LR * hvd().size()
            residual = compression.residual("embedding.weight")
            total = hvd().allreduce(produced, op=hvd().Sum)
            kept = hvd().allreduce(residual, op=hvd().Sum)
            conservation[label] = float((total - reached - kept).abs().max())
    return {"moved": moved, "conservation": conservation}


def scaled_training(route: str, compression, inject: int, steps: int = 5) -> dict:
    """GradScaler training with an overflow injected on rank 1 at step ``inject``: which steps
    changed the weights, the scale after each step, and whether every residual stayed finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = optimizer(model, compression, route)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    stepped, scales = [], []
    for step, x in enumerate(data(steps)):
        if step == inject and hvd().rank() == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        stepped.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        scales.append(scaler.get_scale())
    residuals = [compression.residual(n) for n, _ in model.named_parameters()]
    finite = all(r is None or bool(torch.isfinite(torch.as_tensor(r)).all()) for r in residuals)
    assert replicas_agree(model), f"{route}: replicas diverged"
    return {"stepped": stepped, "scales": scales, "residuals_finite": finite}


@case
def grad_scaler_overflow() -> dict:
    """An injected overflow on one rank: every route skips exactly the steps dense training skips
    (torch.amp.GradScaler), and residuals stay finite."""
    out = {}
    for route in ("stock", "dropin"):
        out[f"{route}_dense"] = scaled_training(route, NoneCompressor(), inject=2)
        for make in (lambda: TopK(0.1, dense_below=0), lambda: TernGrad(dense_below=0, error_feedback=True)):
            compression = make()
            out[f"{route}_{type(compression).__name__}"] = scaled_training(route, compression, inject=2)
    return out


@case
def every_tensor_dense() -> dict:
    """Stock route where every compressed tensor travels dense (small, or N k >= d): no state and
    no names pile up over the steps, no warning repeats, and every step's bytes are counted."""
    import warnings

    from hvd_compress.horovod.torch_hooks import _calls

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
    compression = TopK(0.5, dense_below=40)  # 512 weights: 2 * 256 >= 512; the rest below 40
    opt = optimizer(model, compression, "stock")
    counted = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in data(30, width=64):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            counted.append(compression.stats.bytes_sent)
    messages = [str(w.message) for w in caught if "hvd_compress" in str(w.message)]
    params = list(model.parameters())
    return {"names": compression.memory.names(), "buckets": len(compression.state.buckets),
            "index": _calls(compression).index, "warnings": len(messages), "distinct": len(set(messages)),
            "step_bytes": [b - a for a, b in zip([0] + counted, counted)], "density": compression.stats.density,
            "dense_bytes": sum(4 * p.numel() for p in params), "tensors": len(params)}


@case
def dense_switch_keeps_residual() -> dict:
    """The dense-switch probe (:mod:`tests.distributed.switch_probe`) on the stock and drop-in routes:
    how far the weights are from ``w0 - lr x`` the sum of the mean gradients (relative; 0 when the
    residual of the sparse steps goes out with the first dense one)."""
    import warnings

    import hvd_compress.torch as dropin

    out = {}
    for route, wrap in (("stock", hvd().DistributedOptimizer), ("dropin", dropin.DistributedOptimizer)):
        w = torch.nn.Parameter(torch.zeros(probe.SIZE))
        compression = TopK(probe.SPARSE)
        opt = wrap(torch.optim.SGD([w], lr=probe.LR), named_parameters=[(f"switch_{route}", w)],
                   compression=compression)
        for step, row in enumerate(torch.from_numpy(probe.gradients(hvd().rank()))):
            compression.ratio = probe.ratio(step)
            opt.zero_grad()
            (w * row).sum().backward()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "sends 'switch_...' dense"
                opt.step()
        out[route] = probe.relative_error(-w.detach().numpy(), hvd().size())
    return out


@case
def checkpoint_between_routes() -> dict:
    """Compressor state saved on stock horovod.torch and loaded on the drop-in or the Simulator, and
    the other way round (:mod:`tests.distributed.route_checkpoints`): how far each run is from the
    Simulator's run without a break; and the messages of what is refused (positional names)."""
    pairs = [("stock", "dropin"), ("dropin", "stock"), ("stock", "Simulator"), ("Simulator", "stock")]
    rank, size = hvd().rank(), hvd().size()
    differences = moves.matrix(pairs, rank, size, gather=hvd().allgather_object)
    initial = moves.initial()
    _, unnamed = moves.train("stock", "regtopk", rank, 0, 1, params=initial, named=False)
    _, named = moves.train("dropin", "regtopk", rank, 0, 1, params=initial)
    refused = {
        "stock->dropin": moves.refusal(lambda: moves.train("dropin", "regtopk", rank, 1, 2, None, initial, unnamed)),
        "dropin->stock": moves.refusal(
            lambda: moves.train("stock", "regtopk", rank, 1, 2, None, initial, named, named=False)),
    }
    return {"differences": differences, "refused": refused}


@case
def outside_an_optimizer() -> dict:
    """Compressors used outside a Horovod optimizer: ``hvd.allreduce(t, compression=...)`` (no name:
    identified by call order, a warning) and ``compress(t, name=...)`` by hand, each a bucket of its
    own: how far from Horovod's own average, whether both calls agree, and the bytes counted."""
    import warnings

    t = torch.randn(1000, generator=torch.Generator().manual_seed(hvd().rank()))
    exact = hvd().allreduce(t, name="outside.exact")
    out = {}
    for label, compression in (("topk_dense", TopK(0.5, dense_below=0)), ("fp16", FP16()),
                               ("topk", TopK(0.1, dense_below=0))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "compress() was called outside horovod.torch's ..."
            reduced = hvd().allreduce(t, compression=compression, name=f"outside.{label}")
            wire, ctx = compression.compress(t, name=f"outside.{label}.named")
            named = compression.decompress(hvd().allreduce(wire, name=f"outside.{label}.named"), ctx)
        out[label] = {"error": float((reduced - exact).abs().max()), "agree": bool(torch.equal(named, reduced)),
                      "bytes": compression.stats.bytes_sent}
    return out


@case
def rank0_checkpoint_on_every_rank() -> dict:
    """The usual ``if rank == 0: save`` and load-on-all pattern with the drop-in optimizer: every
    rank stops at the next step with the same error (residuals are per rank)."""
    model = Branchy()
    opt = optimizer(model, TopK(0.1, dense_below=0), "dropin")
    for step, x in enumerate(data(3)):
        if step == 2:
            buffer = io.BytesIO()
            if hvd().rank() == 0:
                torch.save(opt.state_dict(), buffer)
            saved = hvd().broadcast_object(buffer.getvalue(), root_rank=0)
            opt.load_state_dict(torch.load(io.BytesIO(saved), weights_only=False))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return {}


@case
def transposed_parameter() -> dict:
    """A parameter of the same size but transposed on rank 1: the same clear error on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 12 if hvd().rank() == 0 else 8, bias=False)
    if hvd().rank() == 1:
        model.weight = torch.nn.Parameter(torch.randn(12, 8).t().contiguous())  # (8, 12)
    opt = optimizer(model, TopK(0.1, dense_below=0), "stock")
    opt.zero_grad()
    x = torch.randn(4, 8 if hvd().rank() == 0 else 12)
    model(x).square().sum().backward()
    opt.step()
    return {}


MISMATCHED = {"terngrad": lambda: TernGrad(dense_below=0), "fp16": FP16, "none": NoneCompressor}


def mismatched_compressor(other: str) -> dict:
    """Rank 0 runs Top-k, rank 1 ``other`` (stock horovod.torch; a Top-k tensor is a one-element
    placeholder for Horovod's allreduce, a None or FP16 one the gradient): the same clear error on
    every rank, before Horovod compares the allreduces' shapes and dtypes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    # the collectives of a case that ends mid-step are left behind: names of its own keep the next clear
    named = [(f"mismatch_{other}.{n}", p) for n, p in model.named_parameters()]
    compression = TopK(0.1, dense_below=0) if hvd().rank() == 0 else MISMATCHED[other]()
    opt = hvd().DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=named,
                                     compression=compression)
    for x in data(2, width=64):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return {}


for _other in MISMATCHED:
    CASES[f"mismatched_compressor_{_other}"] = (lambda other: lambda: mismatched_compressor(other))(_other)


@case
def mismatched_outside_an_optimizer() -> dict:
    """``hvd.allreduce(t, compression=...)`` without a name, Top-k on rank 0 and FP16 on rank 1 (a
    one-element placeholder against the float16 tensor for Horovod's allreduce, whose name Horovod
    takes from the count of operations each process issued): the same clear error on every rank.
    It leaves collectives behind under call-order names: run it last."""
    t = torch.randn(1000, generator=torch.Generator().manual_seed(hvd().rank()))
    compression = TopK(0.1, dense_below=0) if hvd().rank() == 0 else FP16()
    hvd().allreduce(t, compression=compression)
    return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    hvd().init()
    results = {}
    for name in args.cases:
        start = time.monotonic()
        try:
            results[name] = {"ok": CASES[name]()}
        except Exception as error:  # noqa: BLE001 - recorded for the test to judge
            results[name] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - start
        Path(f"{args.out}.{hvd().rank()}.json").write_text(json.dumps(results))
        hvd().barrier()  # a rank that raised first waits for the others to reach their error


if __name__ == "__main__":
    main()
