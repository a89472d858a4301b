"""A bfloat16 model started on stock ``horovod.torch`` as the README says (one process per rank, under
``horovodrun``): ``hvd.broadcast_parameters`` of the model's own state refuses bfloat16 (Horovod 0.28.1),
the same call on int16 views of its bfloat16 tensors makes every rank's model rank 0's, and
``hvd.broadcast_object`` carries the optimizer's bfloat16 state. Then a few steps with ``NoneCompressor``;
rank 0 writes to ``--out`` (JSON) each rank's digests, the errors, and the statistics' bytes."""

from __future__ import annotations

import argparse
import hashlib
import json

import torch

from hvd_compress import NoneCompressor


def digest(tensors) -> str:
    """sha256 of the tensors' raw bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def refused(call) -> str:
    """The message ``call()`` raises ("" when it returns)."""
    try:
        call()
    except (TypeError, ValueError) as error:
        return str(error)
    return ""


def main() -> None:
    import horovod.torch as hvd

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(hvd.rank())  # every rank starts elsewhere
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10))
    model = model.to(torch.bfloat16)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(8, 64).to(torch.bfloat16)).float().square().mean().backward()
    sgd.step()  # bfloat16 momentum buffers, a different one on every rank
    found = {"parameters_error": refused(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0)),
             "optimizer_error": refused(lambda: hvd.broadcast_optimizer_state(sgd, root_rank=0))}
    # the README's lines
    hvd.broadcast_parameters({name: t.view(torch.int16) if t.dtype == torch.bfloat16 else t
                              for name, t in model.state_dict().items()}, root_rank=0)
    sgd.load_state_dict(hvd.broadcast_object(sgd.state_dict(), root_rank=0))
    found["model"] = digest(model.state_dict().values())
    found["momentum"] = digest(sgd.state[p]["momentum_buffer"] for p in model.parameters())
    compression = NoneCompressor()
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    torch.manual_seed(100 + hvd.rank())
    for _ in range(args.steps):
        opt.zero_grad()
        model(torch.randn(8, 64).to(torch.bfloat16)).float().square().mean().backward()
        opt.step()
    found["trained"] = digest(model.parameters())  # BatchNorm's running statistics are each rank's own
    found["bytes_sent"], found["dense_bytes"] = compression.stats.bytes_sent, compression.stats.dense_bytes
    found["tensors"] = len(list(model.parameters()))
    found["numel"] = sum(p.numel() for p in model.parameters())
    found["dtypes"] = sorted({str(t.dtype) for t in model.state_dict().values()})
    every = hvd.allgather_object(found)
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)


if __name__ == "__main__":
    main()
