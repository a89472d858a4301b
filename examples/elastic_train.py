"""Elastic training with compressed gradients: workers may come and go (Horovod Elastic, PyTorch).

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        python examples/elastic_train.py --compression topk --ratio 0.01

``discover_hosts.sh`` prints the hosts that may run workers now, one ``host:slots`` per line
(Horovod runs it every second). On one machine, two names of it (``localhost`` and ``127.0.0.1``)
act as two hosts; add ``--network-interface lo``. The CNN of examples/pytorch_train.py trains on
scikit-learn's digits: each epoch is a fixed number of global steps of ``--global-batch`` images,
``--global-batch / size`` per rank, so the schedule does not depend on how many workers there are.

The compression state is kept by ``hvd.elastic.register(state, optimizer)``: each process keeps
its own residuals (a new worker starts at zero, nothing is broadcast), they roll back with the
model after a failure, and what the ranks must agree on starts afresh at every reset.
``--flush`` makes each commit apply the residuals first, so a lost worker loses none.
``--path stock`` hands the compressor to ``horovod.torch.DistributedOptimizer`` instead of the
drop-in. Rank 0 prints a line at each commit (``epoch E step S size N loss L``) and, at the end,
the test accuracy and a digest of the parameters.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F

from hvd_compress import Compression

if __package__:  # python -m examples.elastic_train
    from examples.pytorch_train import Net, digits
else:  # python examples/elastic_train.py: examples/ is sys.path[0]
    from pytorch_train import Net, digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="topk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--path", choices=("dropin", "stock"), default="dropin")
    parser.add_argument("--flush", action="store_true", help="each commit applies the residuals first")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--global-batch", type=int, default=64, help="images per step over all ranks")
    parser.add_argument("--commit-every", type=int, default=4, help="steps between commits")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    if args.path == "stock":
        import horovod.torch as hvd
    else:
        import hvd_compress.torch as hvd
    from hvd_compress.torch.elastic import register

    hvd.init()
    torch.manual_seed(0)
    train_x, train_y, test_x, test_y = digits()
    model = Net()
    compression = Compression.by_name(args.compression, args.ratio)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, step=0)
    register(state, optimizer if args.path == "dropin" or args.flush else compression, flush=args.flush)

    def batch(epoch: int, step: int):
        """This rank's part of global step ``step`` of ``epoch``: the same images whatever the world size."""
        per_rank = args.global_batch // hvd.size()
        start = ((epoch * args.steps_per_epoch + step) * args.global_batch + hvd.rank() * per_rank) % len(train_y)
        rows = torch.arange(start, start + per_rank) % len(train_y)
        return train_x[rows], train_y[rows]

    @hvd.elastic.run
    def train(state) -> None:
        while state.epoch < args.epochs:
            while state.step < args.steps_per_epoch:
                x, y = batch(state.epoch, state.step)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.step += 1
                if state.step % args.commit_every == 0:
                    if hvd.rank() == 0:
                        print(f"epoch {state.epoch} step {state.step} size {hvd.size()} loss {loss.item():.4f}",
                              flush=True)
                    state.commit()
            state.epoch, state.step = state.epoch + 1, 0
            state.commit()

    train(state)
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes())
    print(f"[rank {hvd.rank()}] test accuracy {accuracy:.3f}  final parameters sha256 {digest.hexdigest()[:16]}",
          flush=True)


if __name__ == "__main__":
    main()
