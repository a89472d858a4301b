"""Trains a small model a few steps with stock ``horovod.torch`` and each compressor.

Run by the tests under ``horovodrun --gloo`` or ``mpirun``; rank 0 writes the
final parameters, the bytes each rank handed to Horovod collectives and the
bytes its compressor's statistics counted to ``--out`` (an ``.npz``). :func:`simulate` computes the same training in one
process with the :class:`~hvd_compress.simulator.Simulator`.
"""

from __future__ import annotations

import argparse
import time
import io
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from hvd_compress import Compression
from hvd_compress.simulator import Simulator

RATIO = 0.05
LR = 0.1


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return model.to(dtype)


def batches(rank: int, steps: int):
    """Rank ``rank``'s data: a different stream per rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(steps)
    ]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)


def compressor(name: str, seed: int = 0):
    """``topk``, ``fp16``...; ``<sparsifier>-momentum``: with momentum correction (the optimizer is plain SGD);
    ``<sparsifier>-leader``, ``-aggregate``: with that shared index set (``indices=``); ``-reuse``: with
    reused thresholds between exact selections every other step (``exact_every=2``); ``-traffic``: a traffic
    budget of 4 x RATIO instead of the density (its index rule and density resolved for the world size)."""
    if name.endswith("-traffic"):
        return Compression.by_name(name[: -len("-traffic")], None, seed=seed, traffic=4 * RATIO)
    if name.endswith("-momentum"):
        return Compression.by_name(name[: -len("-momentum")], RATIO, seed=seed, momentum=0.9)
    base, _, indices = name.partition("-")
    if indices == "reuse":
        return Compression.by_name(base, RATIO, seed=seed, exact_every=2)
    if indices:
        return Compression.by_name(base, RATIO, seed=seed, indices=indices)
    return Compression.by_name(name, RATIO, **({} if name in ("none", "fp16") else {"seed": seed}))


def simulate(
    name: str, ranks: int, steps: int, passes: int = 1, dtype: torch.dtype = torch.float32
) -> Dict[str, np.ndarray]:
    """The same training on the in-process simulator; gradients in backward-hook order.

    ``passes`` backward passes accumulate into each step's gradient (``backward_passes_per_step``).
    bfloat16: the update is ``torch.optim.SGD``'s own (``p.add_(g, alpha=-lr)``, one rounding), as in
    the runs, so that the parameters compare bit for bit.
    """
    model = make_model(dtype)
    sgd = torch.optim.SGD(model.parameters(), lr=LR) if dtype == torch.bfloat16 else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: several threads only contend (5-20x slower on a busy machine)
    try:
        simulate_steps(model, Simulator(ranks, compressor(name)), 0, steps, passes, optimizer=sgd)
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def simulate_steps(model: torch.nn.Module, sim: Simulator, start: int, stop: int, passes: int = 1,
                   after_step: Optional[Callable[[], Any]] = None, optimizer: Any = None) -> None:
    """Steps ``start``..``stop`` of the training on ``sim`` (every rank's data of :func:`batches`),
    SGD on ``model`` in place (``p -= LR * g``, or ``optimizer.step()``); ``after_step()`` after each
    (a density schedule's ``step``)."""
    data = [batches(r, stop * passes) for r in range(sim.n_ranks)]
    params = list(model.named_parameters())[::-1]  # Horovod's hooks fire last layer first
    for step in range(start, stop):
        grads: Dict[str, List[torch.Tensor]] = {n: [] for n, _ in params}
        for rank in range(sim.n_ranks):
            model.zero_grad()
            for micro in range(passes):
                loss_fn(model, *data[rank][step * passes + micro]).backward()
            for n, p in params:
                grads[n].append(p.grad.clone())
        averaged = sim.step(grads)
        if optimizer is not None:
            for n, p in params:
                p.grad = averaged[n]
            optimizer.step()
        else:
            with torch.no_grad():
                for n, p in params:
                    p -= LR * averaged[n]
        if after_step is not None:
            after_step()


class ByteCounter:
    """Wraps the Horovod collectives our code and Horovod's optimizer call, summing input bytes."""

    def __init__(self) -> None:
        import horovod.torch
        import horovod.torch.optimizer

        self.bytes = 0
        targets = [
            (horovod.torch, n) for n in ("allgather_async", "allreduce_async", "allreduce", "allgather")
        ]
        targets.append((horovod.torch.optimizer, "allreduce_async_"))
        for module, attr in targets:
            setattr(module, attr, self._counting(getattr(module, attr)))

    def _counting(self, function):
        def wrapper(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return function(tensor, *args, **kwargs)

        return wrapper


def make_optimizer(model: torch.nn.Module, compression, args: argparse.Namespace, path: str):
    """Stock ``horovod.torch`` or the drop-in ``hvd_compress.torch`` optimizer (``path``)."""
    import horovod.torch as hvd

    if path == "dropin":
        import hvd_compress.torch as hvd_compress_torch

        wrap = hvd_compress_torch.DistributedOptimizer
    else:
        wrap = hvd.DistributedOptimizer
    return wrap(
        torch.optim.SGD(model.parameters(), lr=LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Sum if args.op == "sum" else hvd.Average,
        backward_passes_per_step=args.passes,
        gradient_predivide_factor=args.predivide,
    )


def resumed(model: torch.nn.Module, optimizer, name: str, args: argparse.Namespace, path: str):
    """A fresh model and optimizer restored from a checkpoint of the current ones (torch.save round trip)."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh = make_model()
    fresh.load_state_dict(saved["model"])
    fresh_optimizer = make_optimizer(fresh, compressor(name), args, path)
    fresh_optimizer.load_state_dict(saved["optimizer"])
    return fresh, fresh_optimizer


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def train(name: str, steps: int, counter: ByteCounter, args: argparse.Namespace, path: str, resume_at: int = -1):
    """The final parameters and the bytes ``stats.bytes_sent`` counted (of the compressor last used);
    ``resume_at`` >= 0: checkpointed and restored into fresh objects (:func:`resumed`) before that step."""
    import horovod.torch as hvd

    model = make_model(torch.float16 if args.half else DTYPES[args.dtype])
    compression = compressor(name)
    if hvd.rank() == 1 and args.rank1_ratio is not None:
        compression.ratio = args.rank1_ratio
    compression.nonfinite = args.nonfinite
    optimizer = make_optimizer(model, compression, args, path)
    data = batches(hvd.rank(), steps * args.passes)
    counter.bytes = 0
    for step in range(steps):
        if step == resume_at:
            model, optimizer = resumed(model, optimizer, name, args, path)
        optimizer.zero_grad()
        for micro in range(args.passes):
            x, y = data[step * args.passes + micro]
            if hvd.rank() == 1 and args.rank1_nan:
                x = x * float("nan")
            loss = loss_fn(model, x, y)
            if args.op == "sum":
                loss = loss / hvd.size()  # Sum of per-rank means / N == the average
            loss.backward()
        if hvd.rank() == 1 and args.rank1_delay:
            time.sleep(args.rank1_delay)  # rank 0 reaches its checks (and would exit) first
        optimizer.step()
    params = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}
    return params, optimizer._compression.stats.bytes_sent


def main() -> None:
    import horovod.torch as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--compression", nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--op", choices=["average", "sum"], default="average")
    parser.add_argument("--out", required=True)
    parser.add_argument("--path", choices=["stock", "dropin"], nargs="+", default=["stock"],
                        help="the route; several: each trains every compressor, results keyed <path>-<name>")
    parser.add_argument("--passes", type=int, default=1, help="backward_passes_per_step")
    parser.add_argument("--half", action="store_true", help="float16 model and gradients")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's dtype")
    parser.add_argument("--predivide", type=float, default=1.0, help="gradient_predivide_factor")
    parser.add_argument("--resume-at", type=int, nargs="+", default=[-1],
                        help="checkpoint and restore before this step (-1: never); several: each trains every "
                             "compressor, results keyed resume<N>-<key>")
    parser.add_argument("--rank1-ratio", type=float, help="misconfigure rank 1 (error test)")
    parser.add_argument("--rank1-nan", action="store_true", help="NaN gradients on rank 1 (error test)")
    parser.add_argument("--rank1-delay", type=float, default=0.0, help="rank 1 sleeps before each step")
    parser.add_argument("--nonfinite", choices=["propagate", "raise"], default="propagate")
    args = parser.parse_args()
    hvd.init()
    counter = ByteCounter()
    arrays, wire, stats = {}, {}, {}
    runs = []
    for resume_at in args.resume_at:
        for path in args.path:
            for name in args.compression:
                key = name if len(args.path) == 1 else f"{path}-{name}"
                runs.append((resume_at, path, name, key if len(args.resume_at) == 1 else f"resume{resume_at}-{key}"))
    for resume_at, path, name, key in runs:
        try:
            trained, counted = train(name, args.steps, counter, args, path, resume_at)
        except (ValueError, FloatingPointError) as error:  # FloatingPointError: NonFiniteGradientError
            Path(f"{args.out}.error.{hvd.rank()}").write_text(str(error))
            if args.nonfinite == "raise":
                hvd.barrier()  # every rank raised: let all of them report before the launcher ends the job
            raise
        for param, value in trained.items():
            arrays[f"{key}/{param}"] = value
        wire[key] = hvd.allgather_object(counter.bytes // args.steps)
        stats[key] = hvd.allgather_object([counter.bytes, counted])  # totals over the steps
    if hvd.rank() == 0:
        np.savez(args.out, **arrays, wire=json.dumps(wire), stats=json.dumps(stats), size=hvd.size())


if __name__ == "__main__":
    main()
