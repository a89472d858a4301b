"""``Auto`` on real processes: the model of :mod:`tests.distributed.torch_horovod`, two trainings.

- ``measured``: ``Auto(TopK)`` measures every bucket on the real transport; rank 0 inflates its dense
  times 50x and rank 1 its compressed times 50x, so each rank alone would choose differently;
- ``pinned``: ``Auto(<name>, pin="compressed")``, to compare with the Simulator.

``--route mpi`` (``hvd_compress.mpi.DistributedOptimizer`` under ``mpirun``), ``stock``
(``horovod.torch.DistributedOptimizer(compression=Auto(...))``) or ``dropin``
(``hvd_compress.torch.DistributedOptimizer`` over Horovod), both under ``horovodrun``.
Every rank writes ``--out.<rank>.npz``: final parameters of both trainings and the decisions.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from hvd_compress import Auto
from tests.distributed.torch_horovod import LR, batches, compressor, loss_fn, make_model

INFLATE = 50.0


class SkewedAuto(Auto):
    """Each rank's own measurement points the other way; the reduced one decides."""

    def medians(self, state):
        dense, compressed = super().medians(state)
        return (dense * INFLATE, compressed) if self.rank == 0 else (dense, compressed * INFLATE)


def optimizer_for(route: str, model: torch.nn.Module, compression):
    params = dict(named_parameters=model.named_parameters(), compression=compression)
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    if route == "mpi":
        import hvd_compress.mpi as hvd

        return hvd.DistributedOptimizer(sgd, **params), hvd.rank()
    import horovod.torch as hvd

    if route == "dropin":
        import hvd_compress.torch as dropin

        return dropin.DistributedOptimizer(sgd, **params), hvd.rank()
    return hvd.DistributedOptimizer(sgd, **params), hvd.rank()


def train(route: str, compression, steps: int):
    model = make_model()
    optimizer, rank = optimizer_for(route, model, compression)
    data = batches(rank, steps)
    for step in range(steps):
        optimizer.zero_grad()
        loss_fn(model, *data[step]).backward()
        optimizer.step()
    return rank, {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--route", choices=["mpi", "stock", "dropin"], required=True)
    parser.add_argument("--pinned", default="topk", help="compressor of the pinned training")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.route != "mpi":
        import horovod.torch as hvd

        hvd.init()
    measured = SkewedAuto(compressor("topk"), warmup=2, indices=None, decide_every=3, log=False)
    rank, trained = train(args.route, measured, args.steps)
    _, pinned = train(args.route, Auto(compressor(args.pinned), pin="compressed", log=False), args.steps)
    arrays = {f"measured/{n}": v for n, v in trained.items()}
    arrays.update({f"pinned/{n}": v for n, v in pinned.items()})
    np.savez(f"{args.out}.{rank}.npz", **arrays, decisions=json.dumps(measured.stats.decisions, sort_keys=True))


if __name__ == "__main__":
    main()
