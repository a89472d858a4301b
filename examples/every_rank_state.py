"""Every rank's compressor state in a trainer's checkpoint (for ``lightning_train.py`` and ``accelerate_train.py``).

Error-feedback residuals are per rank (what each rank's compressor did not send
yet), but PyTorch Lightning and Hugging Face Accelerate write a checkpoint from
one process: a hook state saved as it is would carry rank 0's residuals only,
and loading rank 0's state on every rank stops the run at the first exchange
(``Compressor.load_state_dict``). :class:`EveryRankState` wraps the DDP hook's
:class:`~hvd_compress.torch.CompressionState` so that its ``state_dict()``
gathers every rank's state (``torch.distributed.all_gather_object``; every rank
calls it, as both trainers do when they save) and ``load_state_dict()`` loads
this rank's own. Resumed on more ranks, the new ranks start from zero residuals;
on fewer, the residuals of ranks no longer present are dropped.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist


def on_cpu(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every tensor moved to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: on_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(item) for item in value)
    return value


def parameters_digest(module: torch.nn.Module) -> str:
    """SHA-256 (12 hex digits) of a module's parameters and buffers: equal for runs that end alike."""
    sha = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:12]


def digest(compressor_state: Dict[str, Any]) -> str:
    """SHA-256 (12 hex digits) of a compressor state's per-tensor arrays (residuals, RegTop-k's
    posteriors...): equal before a save and after the resume when they are restored bit for bit."""
    sha = hashlib.sha256()
    for name in sorted(compressor_state["tensors"]):
        for key, value in sorted(compressor_state["tensors"][name].items()):
            array = np.ascontiguousarray(value.cpu().numpy() if isinstance(value, torch.Tensor) else value)
            sha.update(f"{name}/{key}/{array.dtype}/{array.shape}".encode())
            sha.update(array.tobytes())
    return sha.hexdigest()[:12]


class EveryRankState:
    """``state_dict``/``load_state_dict`` of a DDP hook's ``CompressionState`` holding every rank's state.

    ``state_dict()`` is a collective (call it on every rank) and each rank holds every
    rank's state while it is written (``world`` times one rank's residuals)."""

    def __init__(self, hook_state: Any, group: Any = None, verbose: bool = True) -> None:
        self.hook_state = hook_state
        self.group = group
        self.verbose = verbose

    def state_dict(self) -> Dict[str, Any]:
        mine = on_cpu(self.hook_state.state_dict())
        ranks = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(ranks, mine, group=self.group)
        self._report("saved", mine)
        return {"ranks": ranks}

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        rank = dist.get_rank(self.group)
        if rank >= len(saved["ranks"]):
            if self.verbose:
                print(f"[rank {rank}] no compressor state saved for this rank: residuals start from zero")
            return
        self.hook_state.load_state_dict(saved["ranks"][rank])
        self._report("restored", self.hook_state.state_dict())

    def _report(self, what: str, state: Dict[str, Any]) -> None:
        if self.verbose:
            print(f"[rank {dist.get_rank(self.group)}] compressor state {what}: {len(state['tensors'])} tensors, "
                  f"sha256 {digest(state)}", flush=True)
