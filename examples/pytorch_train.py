"""Train a small CNN with compressed gradients on several ranks (PyTorch + Horovod or MPI).

    horovodrun -np 2 --gloo python examples/pytorch_train.py --compression regtopk --ratio 0.01
    mpirun -np 2 python examples/pytorch_train.py --compression terngrad --path dropin
    mpirun -np 4 python examples/pytorch_train.py --compression regtopk --path mpi
    horovodrun -np 2 --gloo python examples/pytorch_train.py --compression regtopk --decide measure

The data are scikit-learn's bundled 8x8 handwritten digits (``pip install
scikit-learn``; no download): 1,437 images to train, 360 to test (a fixed
shuffle); each rank trains on its own shard.
``--path stock`` hands our compressor to ``horovod.torch.DistributedOptimizer``;
``--path dropin`` uses ``hvd_compress.torch.DistributedOptimizer`` (fused buckets),
``--path mpi`` the same optimizer over mpi4py (``hvd_compress.mpi``, no Horovod).
Rank 0 prints, per epoch, the mean loss, the loss of the first and last tenth
of the batches (so a one-epoch run shows progress), test accuracy and the bytes
the compressor put on the wire against dense float32 gradients.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from hvd_compress import Auto, Compression


def digits():
    """scikit-learn's 1,797 handwritten 8x8 digits, pixels scaled to [0, 1], shuffled with a fixed
    seed: ``(train_x, train_y, test_x, test_y)`` as ``N x 1 x 8 x 8`` float32 and int64 tensors."""
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = torch.from_numpy((data.images[order] / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target[order].astype(np.int64))
    return x[:1437], y[:1437], x[1437:], y[1437:]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 8 * 8, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main(default_path: str = "stock") -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--path", choices=["stock", "dropin", "mpi"], default=default_path)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--decide",
        choices=["measure", "dense", "compressed"],
        help="wrap the compressor in Auto: measure each bucket both ways, or pin the choice",
    )
    args = parser.parse_args()

    if args.path == "mpi":
        import hvd_compress.mpi as hvd
    elif args.path == "dropin":
        import hvd_compress.torch as hvd
    else:
        import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    train_x, train_y, test_x, test_y = digits()
    shard = slice(hvd.rank(), None, hvd.size())
    train_x, train_y = train_x[shard], train_y[shard]

    model = Net()
    compression = Compression.by_name(args.compression, args.ratio)
    if args.decide:
        compression = Auto(compression, pin=None if args.decide == "measure" else args.decide)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, {args.path} path, compression {compression!r}")
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
        mean_loss, first, last = hvd.allreduce(
            torch.tensor(
                [sum(losses) / len(losses), sum(losses[:tenth]) / tenth, sum(losses[-tenth:]) / tenth]
            ),
            name="loss",
        ).tolist()
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
