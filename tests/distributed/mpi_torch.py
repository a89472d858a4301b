"""Workloads for :mod:`hvd_compress.transport.mpi` and :mod:`hvd_compress.mpi`, run under ``mpirun``.

``collectives --out PREFIX``: every rank checks MPICommunicator's collectives
against numpy (every rank can compute every rank's input: they are seeded by
rank) and writes ``PREFIX.<rank>`` with the number of checks that passed.
``collectives train ...`` does both in one job, in that order.

``probe``: the dense-switch probe (:mod:`tests.distributed.switch_probe`) with
the MPI optimizer; each rank writes ``PREFIX.switch.<rank>`` (JSON: its relative
error, the bytes handed to the collectives, the bytes ``compressor.stats`` counted).

``buckets --compression NAMES... --out FILE``: numpy buckets (:func:`bucket_gradients`) through
:class:`~hvd_compress.engine.exchange.BucketExchange` over the MPICommunicator, the fused path; each
rank writes ``FILE.buckets.<rank>.npz`` (``name/step/tensor``: the average).

``train --compression NAMES... --out FILE``: trains
:func:`tests.distributed.torch_horovod.make_model` like that workload, but with
``hvd_compress.mpi.DistributedOptimizer``; rank 0 writes the final parameters
(compare with :func:`tests.distributed.torch_horovod.simulate`), and each rank
``FILE.stats.<rank>`` (JSON: per name, the bytes handed to the collectives and
the bytes ``compressor.stats`` counted).

Error injection (``train``): ``--rank1-ratio R`` misconfigures rank 1 (every
rank raises "ranks disagree"; caught and reported per rank, or with
``--uncaught`` left to the library's abort hook); ``--rank1-fails nan|error
--fail-step S`` makes rank 1 alone fail at step ``S`` while the others wait
in the exchange: its loss becomes NaN (the compressor rejects the gradient in
backward) or the training loop raises.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict

import numpy as np
import torch

from tests.distributed import switch_probe as probe
from tests.distributed.torch_horovod import LR, batches, compressor, loss_fn, make_model


# --------------------------------------------------------------------- collectives
def _wrap_int32(total: np.ndarray) -> np.ndarray:
    return (((total.astype(np.int64) + 2**31) % 2**32) - 2**31).astype(np.int32)


def _input(rank: int, case: int, dtype: str, shape) -> np.ndarray:
    """Rank ``rank``'s input of ``case``: exactly representable, so any summation order is exact."""
    rng = np.random.default_rng(1000 * case + rank)
    if dtype == "int32-wrap":  # near the ends of the int32 range: sums wrap around
        big = rng.integers(2**31 - 1000, 2**31, size=shape)
        return np.where(rng.random(shape) < 0.5, big, -big).astype(np.int32)
    if dtype == "float16":  # small integers: every partial sum is exact in float16
        return rng.integers(-100, 100, size=shape).astype(dtype)
    if np.dtype(dtype).kind == "f":
        return (rng.integers(-1000, 1000, size=shape) / 8).astype(dtype)
    if np.dtype(dtype).kind == "b":
        return rng.random(shape) < 0.5
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, endpoint=True).astype(dtype)


class Checker:
    def __init__(self, comm) -> None:
        self.comm, self.count = comm, 0

    def equal(self, got, expected: np.ndarray, what: str, like) -> None:
        if isinstance(like, torch.Tensor):
            assert isinstance(got, torch.Tensor), (what, type(got))
            assert got.dtype == like.dtype and got.device == like.device, (what, got.dtype, like.dtype)
            got = got.view(torch.int16).numpy() if got.dtype == torch.bfloat16 else got.numpy()
        else:
            assert isinstance(got, np.ndarray) and got.dtype == like.dtype, (what, type(got), got.dtype)
        assert got.shape == expected.shape, (what, got.shape, expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=f"rank {self.comm.rank}: {what}")
        self.count += 1


def _as(kind: str, array: np.ndarray):
    return torch.from_numpy(array.copy()) if kind == "torch" else array


def check_collectives(comm) -> int:
    rank, size = comm.rank, comm.size
    check = Checker(comm)
    case = 0
    # allreduce SUM / MAX; several in flight at once, waited in reverse order
    started = []
    for kind in ("numpy", "torch"):
        for dtype, op in [
            ("float32", comm.SUM),
            ("float64", comm.SUM),
            ("int32", comm.SUM),
            ("int32-wrap", comm.SUM),
            ("int64", comm.SUM),
            ("float32", comm.MAX),
            ("float64", comm.MAX),
            ("int32", comm.MAX),
            ("int32-wrap", comm.MAX),
            ("int8", comm.MAX),
            ("float16", comm.SUM),
        ]:
            case += 1
            shape = (3, 5) if case % 2 else (7,)
            inputs = [_input(r, case, dtype, shape) for r in range(size)]
            stack = np.stack(inputs)
            if op == comm.MAX:
                expected = stack.max(axis=0)
            elif stack.dtype == np.int32:
                expected = _wrap_int32(stack.astype(np.int64).sum(axis=0))
            else:
                expected = stack.sum(axis=0).astype(stack.dtype)
            mine = _as(kind, inputs[rank])
            handle = comm.allreduce_async(mine, op, f"r{case}")
            started.append((handle, expected, f"{kind} {dtype} {op}", mine))
    for handle, expected, what, like in reversed(started):
        check.equal(comm.wait(handle), expected, "allreduce " + what, like)
    # int32 wrap-around, explicitly: every rank adds 2^31 - 1
    top = np.full(4, 2**31 - 1, dtype=np.int32)
    expected = _wrap_int32(np.full(4, (2**31 - 1) * size, dtype=np.int64))
    check.equal(comm.wait(comm.allreduce_async(top, comm.SUM, "wrap")), expected, "int32 wrap", top)
    # bfloat16 sums (reduced in float32 and cast back; the values are exact in bfloat16)
    half = torch.full((5,), float(rank + 1), dtype=torch.bfloat16)
    expected = torch.full((5,), float(size * (size + 1) // 2), dtype=torch.bfloat16).view(torch.int16).numpy()
    check.equal(comm.wait(comm.allreduce_async(half, comm.SUM, "bf16")), expected, "bfloat16 sum", half)
    # variable-size allgather: ranks with no rows, trailing dimensions, several dtypes
    patterns = [
        lambda r: [0, 3, 0, 5][r % 4],  # empty contributions
        lambda r: r + 1,  # all different
        lambda r: 2 if r == size - 1 else 0,  # only the last rank
        lambda r: 0,  # nobody
    ]
    started = []
    for kind in ("numpy", "torch"):
        for dtype in ("int8", "int32", "float32", "int64", "uint8", "float16", "bool"):
            for p, rows in enumerate(patterns):
                for trailing in ((), (3,)):
                    case += 1
                    inputs = [_input(r, case, dtype, (rows(r),) + trailing) for r in range(size)]
                    expected = np.concatenate(inputs)
                    mine = _as(kind, inputs[rank])
                    what = f"allgather {kind} {dtype} pattern {p} trailing {trailing}"
                    started.append((comm.allgather_async(mine, what), expected, what, mine))
    for handle, expected, what, like in reversed(started):
        check.equal(comm.wait(handle), expected, what, like)
    bf = torch.full((rank,), float(rank), dtype=torch.bfloat16)
    expected = torch.cat([torch.full((r,), float(r), dtype=torch.bfloat16) for r in range(size)])
    gathered = comm.wait(comm.allgather_async(bf, "bf16"))
    check.equal(gathered, expected.view(torch.int16).numpy(), "bfloat16 allgather", bf)
    # a non-contiguous torch input is gathered by value
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    expected = np.concatenate([(base + 100 * r)[:, ::2] for r in range(size)])
    check.equal(comm.wait(comm.allgather_async(wide[:, ::2], "strided")), expected, "strided allgather", wide)
    # ranks that disagree on the trailing shape all get the same error, and the communicator goes on working
    try:
        comm.allgather_async(np.zeros((1, 2 + (rank == size - 1)), np.float32), "bad")
    except ValueError as error:
        assert "ranks disagree" in str(error), error
        check.count += 1
    else:
        raise AssertionError("mismatched trailing shapes were not detected")
    # broadcast in place (numpy and torch, contiguous and not)
    vec = torch.full((4,), float(rank))
    comm.broadcast_(vec, root=size - 1)
    check.equal(vec, np.full(4, float(size - 1), np.float32), "broadcast torch", vec)
    mat = torch.full((4, 4), float(rank)).t()
    comm.broadcast_(mat, root=size - 1)
    check.equal(mat.contiguous(), np.full((4, 4), float(size - 1), np.float32), "broadcast strided", mat)
    arr = np.full(3, rank, dtype=np.int64)
    comm.broadcast_(arr, root=0)
    check.equal(arr, np.zeros(3, np.int64), "broadcast numpy", arr)
    return check.count


# --------------------------------------------------------------------- training
class ByteCounter:
    """Sums the bytes handed to :class:`~hvd_compress.transport.mpi.MPICommunicator`'s collectives."""

    def __init__(self) -> None:
        from hvd_compress.transport.mpi import MPICommunicator

        self.bytes = 0
        for attr in ("allreduce_async", "allgather_async"):
            setattr(MPICommunicator, attr, self._counting(getattr(MPICommunicator, attr)))

    def _counting(self, method):
        def wrapper(this, tensor, *args, **kwargs):
            self.bytes += int(np.prod(tensor.shape)) * (
                tensor.element_size() if isinstance(tensor, torch.Tensor) else tensor.itemsize
            )
            return method(this, tensor, *args, **kwargs)

        return wrapper


def switch_probe(counter: ByteCounter) -> dict:
    """The dense-switch probe (:mod:`tests.distributed.switch_probe`) with the MPI optimizer: its
    relative error (0: nothing lost), the bytes handed to the collectives and what the statistics counted."""
    import warnings

    import hvd_compress.mpi as hvd
    from hvd_compress import TopK

    w = torch.nn.Parameter(torch.zeros(probe.SIZE))
    compression = TopK(probe.SPARSE)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=probe.LR), named_parameters=[("w", w)],
                                         compression=compression)
    counter.bytes = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sends 'w' dense"
        for step, row in enumerate(torch.from_numpy(probe.gradients(hvd.rank()))):
            compression.ratio = probe.ratio(step)
            optimizer.zero_grad()
            (w * row).sum().backward()
            optimizer.step()
    return {"error": probe.relative_error(-w.detach().numpy(), hvd.size()), "handed": counter.bytes,
            "counted": compression.stats.bytes_sent}


def train(name: str, steps: int, args: argparse.Namespace, counter: ByteCounter) -> Dict[str, np.ndarray]:
    """The final parameters; ``args.counted[name]``: ``[bytes handed to the collectives, bytes
    compressor.stats counted]``."""
    import hvd_compress.mpi as hvd

    model = make_model()
    compression = compressor(name)
    if hvd.rank() == 1 and args.rank1_ratio is not None:
        compression.ratio = args.rank1_ratio
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        named_parameters=model.named_parameters(),
        compression=compression,
        op=args.op,
    )
    data = batches(hvd.rank(), steps)
    counter.bytes = 0
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(model, *data[step])
        if args.op == "sum":
            loss = loss / hvd.size()
        if hvd.rank() == 1 and args.rank1_fails and step == args.fail_step:
            if args.rank1_fails == "error":
                raise RuntimeError(f"injected failure on rank 1 at step {step}")
            loss = loss * float("nan")
        loss.backward()
        optimizer.step()
    args.counted[name] = [counter.bytes, compression.stats.bytes_sent]
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ numpy buckets
BUCKET_SHAPES = {"w": (40, 50), "b": (7,), "v": (2000,), "u": (40, 50), "s": (300,)}


def bucket_gradients(rank: int, step: int) -> Dict[str, np.ndarray]:
    """A numpy bucket's float32 gradients, seeded by ``(rank, step)``, few distinct magnitudes (ties)."""
    rng = np.random.default_rng([rank, step])
    return {n: (np.round(rng.standard_normal(s) * 2) / 2).astype(np.float32) for n, s in BUCKET_SHAPES.items()}


def numpy_buckets(comm, names, steps: int) -> Dict[str, np.ndarray]:
    """``{name/step/tensor: average}`` of numpy buckets exchanged over ``comm`` (the fused path)."""
    from hvd_compress.engine.exchange import BucketExchange

    out = {}
    for name in names:
        compression = compressor(name)
        for step in range(steps):
            exchange = BucketExchange(compression, comm, f"numpy.{name}")
            for tensor, g in bucket_gradients(comm.rank, step).items():
                exchange.add(tensor, g)
            exchange.launch()
            out.update({f"{name}/{step}/{t}": np.asarray(v) for t, v in exchange.finish().items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="+", choices=["collectives", "train", "probe", "buckets"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compression", nargs="+", default=[])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--op", choices=["average", "sum"], default="average")
    parser.add_argument("--rank1-ratio", type=float, help="misconfigure rank 1 (error test)")
    parser.add_argument("--uncaught", action="store_true", help="do not catch --rank1-ratio's error")
    parser.add_argument("--rank1-fails", choices=["nan", "error"], help="rank 1 alone fails (error test)")
    parser.add_argument("--fail-step", type=int, default=1)
    args = parser.parse_args()

    import hvd_compress.mpi as hvd

    comm = hvd.communicator()
    if "collectives" in args.mode:
        count = check_collectives(comm)
        Path(f"{args.out}.{comm.rank}").write_text(str(count))
    if "buckets" in args.mode:
        np.savez(f"{args.out}.buckets.{comm.rank}.npz", **numpy_buckets(comm, args.compression, args.steps))
    counter = ByteCounter()
    if "probe" in args.mode:
        Path(f"{args.out}.switch.{comm.rank}").write_text(json.dumps(switch_probe(counter)))
    if "train" not in args.mode:
        return
    arrays = {}
    args.counted = {}
    for name in args.compression:
        try:
            trained = train(name, args.steps, args, counter)
        except ValueError as error:
            if args.rank1_ratio is None or args.uncaught:
                raise
            Path(f"{args.out}.error.{comm.rank}").write_text(str(error))
            print(f"rank {comm.rank}: {error}", file=sys.stderr, flush=True)
            comm.barrier()  # every rank raised: let all of them report before the launcher ends the job
            sys.exit(1)
        for param, value in trained.items():
            arrays[f"{name}/{param}"] = value
    Path(f"{args.out}.stats.{comm.rank}").write_text(json.dumps(args.counted))
    if comm.rank == 0:
        np.savez(args.out, **arrays, size=comm.size)


if __name__ == "__main__":
    main()
