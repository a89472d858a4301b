"""Train a small CNN with compressed gradients on several ranks over plain MPI (mpi4py, no Horovod).

    mpirun -np 4 python examples/mpi_train.py --compression regtopk
    mpirun -np 2 python examples/mpi_train.py --compression terngrad --epochs 1

Same data and model as ``examples/pytorch_train.py`` (synthetic 8x8 "digits",
each rank trains on its own shard), with ``hvd_compress.mpi.DistributedOptimizer``.
Rank 0 prints, per epoch, the mean loss, the loss of the epoch's first and last
batches (so a one-epoch run shows progress), test accuracy, and the bytes the
compressor put on the wire against dense float32 gradients.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `examples` and `hvd_compress` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hvd_compress.mpi as hvd  # noqa: E402
from examples.pytorch_train import Net, synthetic_digits  # noqa: E402
from hvd_compress import Compression  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    train_x, train_y = synthetic_digits(8192, seed=0)
    test_x, test_y = synthetic_digits(2048, seed=1)
    shard = slice(hvd.rank(), None, hvd.size())
    train_x, train_y = train_x[shard], train_y[shard]

    model = Net()
    compression = Compression.by_name(args.compression, args.ratio)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks over MPI, compression {compression!r}", flush=True)
    for epoch in range(args.epochs):
        compression.stats.reset()
        model.train()
        losses = []
        for start in range(0, len(train_y) - args.batch_size + 1, args.batch_size):
            batch = slice(start, start + args.batch_size)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        tenth = max(1, len(losses) // 10)
        mean_loss = hvd.allreduce_scalar(sum(losses) / len(losses))
        first = hvd.allreduce_scalar(sum(losses[:tenth]) / tenth)
        last = hvd.allreduce_scalar(sum(losses[-tenth:]) / tenth)
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        stats = compression.stats
        if hvd.rank() == 0:
            print(
                f"epoch {epoch + 1}: loss {mean_loss:.4f}  test accuracy {accuracy:.3f}  "
                f"sent {stats.bytes_sent / 2**20:.2f} MiB vs dense {stats.dense_bytes / 2**20:.2f} MiB "
                f"({stats.savings:.1f}x less, density {stats.density:.4f})\n"
                f"  loss of the first {tenth} batches {first:.4f} -> last {tenth} batches {last:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
