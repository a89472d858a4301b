"""Train the small CNN of ``pytorch_train.py`` under ``torchrun``: the drop-in optimizer over ``torch.distributed``.

    torchrun --nproc-per-node 2 examples/torchrun_train.py --compression regtopk --ratio 0.01
    torchrun --nproc-per-node 8 examples/torchrun_train.py --backend nccl     # one GPU per process

No Horovod: ``hvd_compress.torch.DistributedOptimizer`` exchanges the compressed
gradients over the default ``torch.distributed`` process group through
``communicator=TorchDistCommunicator()`` (gloo on CPU, NCCL on GPUs; ``--backend``
overrides). The data are scikit-learn's 8x8 digits (``examples/pytorch_train.py``),
each rank trains on its own shard. Rank 0 prints, per epoch, the mean loss over
ranks, test accuracy and the bytes the compressor put on the wire against dense
float32 gradients, in the format of ``pytorch_train.py``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hvd_compress import Compression
from hvd_compress.transport.torch_dist import TorchDistCommunicator
from hvd_compress.torch import DistributedOptimizer

if __package__:  # python -m examples.torchrun_train
    from examples.pytorch_train import Net, digits
else:  # torchrun examples/torchrun_train.py: examples/ is sys.path[0]
    from pytorch_train import Net, digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    args = parser.parse_args()

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend)  # rank, world size and rendezvous from torchrun's environment
    rank, size = dist.get_rank(), dist.get_world_size()

    train_x, train_y, test_x, test_y = (t.to(device) for t in digits())
    train_x, train_y = train_x[rank::size], train_y[rank::size]

    torch.manual_seed(0)
    model = Net().to(device)
    for tensor in model.state_dict().values():  # every rank starts from rank 0's parameters
        dist.broadcast(tensor, src=0)
    compression = Compression.by_name(args.compression, args.ratio)
    optimizer = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=compression,
        communicator=TorchDistCommunicator(),
    )

    if rank == 0:
        print(f"{size} ranks, torch.distributed ({backend}), compression {compression!r}", flush=True)
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
            losses.append(loss.detach())  # read once per epoch, not per step
        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
        stats = compression.stats
        if rank == 0:
            print(
                f"epoch {epoch + 1}: loss {mean_loss.item() / size:.4f}  test accuracy {accuracy:.3f}  "
                f"sent {stats.bytes_sent / 2**20:.2f} MiB vs dense {stats.dense_bytes / 2**20:.2f} MiB "
                f"({stats.savings:.1f}x less, density {stats.density:.4f})",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
