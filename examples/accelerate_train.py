"""Train the small CNN of ``pytorch_train.py`` with Hugging Face Accelerate, the DDP comm hook compressing gradients.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --compression regtopk
    torchrun --nproc-per-node 2 examples/accelerate_train.py --cpu                    # CPU processes, gloo
    torchrun --nproc-per-node 2 examples/accelerate_train.py --cpu --epochs 4 --resume checkpoints/epoch_1

(``accelerate launch --cpu`` starts one process, or several through MPI; ``torchrun``
starts CPU processes that Accelerate joins over gloo.)

``accelerator.prepare`` wraps the model in ``DistributedDataParallel`` (on GPUs, or on
CPU with gloo); the compressor goes on the wrapped model as a DDP comm hook::

    state = CompressionState(compression=RegTopK(0.01), named_parameters=net.named_parameters())
    model = accelerator.prepare(net)
    model.register_comm_hook(state, ddp_hook)

Checkpoints are Accelerate's own (``accelerator.save_state`` at the end of every
epoch to ``--checkpoint-dir/epoch_<n>``, ``accelerator.load_state`` for ``--resume``):
the hook state is registered with ``accelerator.register_for_checkpointing`` through
``every_rank_state.EveryRankState``, since Accelerate writes custom state from the main
process while residuals are per rank: it saves every rank's and gives each rank its own
back. The epoch counter is registered the same way, and the sampler is Accelerate's
seedable one (``use_seedable_sampler``), so a resumed run sees the batches an
uninterrupted one would.

The data are scikit-learn's 8x8 digits (``examples/pytorch_train.py``), sharded over
the ranks by the prepared data loader. Each rank prints a digest of its compressor state
when it is saved and restored; the main process prints per epoch the mean loss, test
accuracy and the bytes put on the wire against dense float32 gradients, and at the end a
digest of the parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from hvd_compress import Compression
from hvd_compress.torch import CompressionState, ddp_hook

if __package__:  # python -m examples.accelerate_train
    from examples.every_rank_state import EveryRankState, parameters_digest
    from examples.pytorch_train import Net, digits
else:  # accelerate launch / torchrun examples/accelerate_train.py: examples/ is sys.path[0]
    from every_rank_state import EveryRankState, parameters_digest
    from pytorch_train import Net, digits


class EpochCounter:
    """The number of finished epochs, saved and restored with Accelerate's state."""

    def __init__(self) -> None:
        self.done = 0

    def state_dict(self):
        return {"done": self.done}

    def load_state_dict(self, state) -> None:
        self.done = int(state["done"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--cpu", action="store_true", help="train on CPU even where there are GPUs")
    parser.add_argument("--batches-per-epoch", type=int, help="stop each epoch after this many batches")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", help="a folder written by accelerator.save_state to resume from")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=args.cpu, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    if accelerator.device.type == "cpu":
        torch.set_num_threads(1)
    set_seed(0)
    train_x, train_y, test_x, test_y = digits()
    net = Net()
    compression = Compression.by_name(args.compression, args.ratio)
    hook_state = CompressionState(compression=compression, named_parameters=net.named_parameters())
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    train_loader = DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True)
    model, optimizer, train_loader = accelerator.prepare(net, optimizer, train_loader)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise SystemExit(f"accelerate_train.py: {accelerator.num_processes} process(es): the model is not "
                         f"DistributedDataParallel, there is nothing to compress; start 2 or more processes")
    model.register_comm_hook(hook_state, ddp_hook)
    epochs = EpochCounter()
    accelerator.register_for_checkpointing(EveryRankState(hook_state), epochs)
    if args.resume:
        accelerator.load_state(args.resume)
    test_x, test_y = test_x.to(accelerator.device), test_y.to(accelerator.device)

    accelerator.print(f"{accelerator.num_processes} ranks, Accelerate ({accelerator.distributed_type}) "
                      f"with ddp_hook, compression {compression!r}")
    while epochs.done < args.epochs:
        hook_state.compression_state.stats.reset()
        train_loader.set_epoch(epochs.done)
        model.train()
        losses = []
        for step, (x, y) in enumerate(train_loader):
            if step == args.batches_per_epoch:
                break
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.detach())  # read once per epoch, not per step
        mean_loss = accelerator.reduce(torch.stack(losses).mean(), reduction="mean")
        model.eval()
        with torch.no_grad():
            accuracy = (model(test_x).argmax(1) == test_y).float().mean()
        epochs.done += 1
        stats = hook_state.compression_state.stats
        accelerator.print(
            f"epoch {epochs.done}: loss {mean_loss.item():.4f}  test accuracy {accuracy.item():.3f}  "
            f"sent {stats.bytes_sent / 2**20:.2f} MiB vs dense {stats.dense_bytes / 2**20:.2f} MiB "
            f"({stats.savings:.1f}x less, density {stats.density:.4f})",
            flush=True,
        )
        accelerator.save_state(os.path.join(args.checkpoint_dir, f"epoch_{epochs.done}"))
    accelerator.print(f"final parameters sha256 {parameters_digest(accelerator.unwrap_model(model))}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
