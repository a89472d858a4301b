"""Train the small CNN of ``pytorch_train.py`` with PyTorch Lightning, the DDP comm hook compressing gradients.

    python examples/lightning_train.py --devices 2 --compression regtopk --ratio 0.01
    python examples/lightning_train.py --devices 2 --epochs 4 --resume checkpoints/epoch=1.ckpt

The compressor enters as Lightning's own DDP option::

    state = CompressionState(compression=RegTopK(0.01), named_parameters=module.named_parameters())
    Trainer(strategy=DDPStrategy(ddp_comm_hook=ddp_hook, ddp_comm_state=state), ...)

and the callback :class:`CompressedGradients` adds what Lightning does not do by itself:

- Lightning 2.x registers ``ddp_comm_hook`` on CUDA devices only; on CPU (gloo) the
  callback registers it on the DDP-wrapped model at ``on_fit_start``;
- Lightning writes its checkpoint from rank 0, but residuals are per rank: the
  callback's ``state_dict`` (saved by Lightning in the checkpoint, under
  ``"callbacks"``) holds every rank's compressor state, and resuming
  (``--resume``, ``trainer.fit(ckpt_path=...)``) gives each rank its own back
  (``every_rank_state.py``).

Lightning starts the processes itself (``--devices``; under ``torchrun`` or SLURM it
uses theirs). The data are scikit-learn's 8x8 digits (``examples/pytorch_train.py``);
Lightning shards them over the ranks. A checkpoint is written at the end of every epoch
to ``--checkpoint-dir``; each rank prints a digest of its compressor state when it is
saved and restored, rank 0 prints per epoch the mean loss, test accuracy and the bytes
put on the wire against dense float32 gradients, and at the end a digest of the parameters.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from hvd_compress import Compression
from hvd_compress.torch import CompressionState, ddp_hook

if __package__:  # python -m examples.lightning_train
    from examples.every_rank_state import EveryRankState, parameters_digest
    from examples.pytorch_train import Net, digits
else:  # python examples/lightning_train.py: examples/ is sys.path[0]
    from every_rank_state import EveryRankState, parameters_digest
    from pytorch_train import Net, digits


class DigitsClassifier(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = Net()
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("accuracy", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class CompressedGradients(Callback):
    """Registers the DDP hook where Lightning does not (CPU), keeps every rank's compressor
    state in Lightning's checkpoints and reports the bytes sent per epoch."""

    def __init__(self, hook_state: CompressionState) -> None:
        self.hook_state = hook_state
        self.every_rank = EveryRankState(hook_state)

    def on_fit_start(self, trainer, pl_module) -> None:
        # the condition of Lightning's DDPStrategy._register_ddp_hooks, which registers on CUDA only
        if trainer.strategy.root_device.type != "cuda":
            trainer.strategy.model.register_comm_hook(self.hook_state, ddp_hook)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.hook_state.compression_state.stats.reset()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        stats = self.hook_state.compression_state.stats
        if trainer.is_global_zero:
            accuracy = f"{metrics['accuracy']:.3f}" if "accuracy" in metrics else "-"
            print(
                f"epoch {trainer.current_epoch + 1}: loss {metrics['loss']:.4f}  test accuracy {accuracy}  "
                f"sent {stats.bytes_sent / 2**20:.2f} MiB vs dense {stats.dense_bytes / 2**20:.2f} MiB "
                f"({stats.savings:.1f}x less, density {stats.density:.4f})",
                flush=True,
            )

    def state_dict(self):
        return self.every_rank.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.every_rank.load_state_dict(state_dict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compression", choices=Compression.names, default="regtopk")
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accelerator", default="auto", help="Lightning's: cpu, gpu, auto")
    parser.add_argument("--devices", type=int, default=2, help="processes (one per device)")
    parser.add_argument("--batches-per-epoch", type=int, help="Lightning's limit_train_batches (short runs)")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", help="a checkpoint of --checkpoint-dir to resume from")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    if not torch.cuda.is_available() or args.accelerator == "cpu":
        torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = digits()
    module = DigitsClassifier(args.lr)
    compression = Compression.by_name(args.compression, args.ratio)
    hook_state = CompressionState(compression=compression, named_parameters=module.named_parameters())
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=DDPStrategy(ddp_comm_hook=ddp_hook, ddp_comm_state=hook_state),
        max_epochs=args.epochs,
        limit_train_batches=args.batches_per_epoch,
        callbacks=[
            CompressedGradients(hook_state),
            ModelCheckpoint(dirpath=args.checkpoint_dir, filename="{epoch}", save_top_k=-1),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if trainer.is_global_zero:
        print(f"{trainer.world_size} ranks, Lightning DDPStrategy with ddp_hook, compression {compression!r}",
              flush=True)
    trainer.fit(
        module,
        DataLoader(TensorDataset(train_x, train_y), batch_size=args.batch_size, shuffle=True),
        DataLoader(TensorDataset(test_x, test_y), batch_size=120),
        ckpt_path=args.resume,
    )
    if trainer.is_global_zero:
        print(f"final parameters sha256 {parameters_digest(module)}", flush=True)


if __name__ == "__main__":
    main()
