"""``torch.distributed`` transport: :class:`TorchDistCommunicator` (gloo, NCCL, MPI backends).

- ``allreduce_async``: ``all_reduce(..., async_op=True)`` on a copy (SUM, MAX);
  ``allreduce_donated_async``: on the given buffer itself (the caller's no longer).
- ``allgather_async``: with every rank's row count known (given by the caller
  from its header, or exchanged first with a one-element ``all_gather``):
  ``all_gather`` when all counts are equal, otherwise ``all_to_all_single``
  with exact split sizes (gloo refuses uneven ``all_gather``; an allgatherv
  built on alltoallv moves exactly each rank's rows, nothing is padded).

Like MPI, torch.distributed matches collectives by call order, so
``matches_by_order`` is set and names are ignored.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from hvd_compress.transport.communicator import Communicator


class TorchDistCommunicator(Communicator):
    """Collectives of an initialized ``torch.distributed`` process group (default: the world)."""

    matches_by_order = True

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("hvd_compress: call torch.distributed.init_process_group() first")
        self.group = group
        self._ops = {self.SUM: dist.ReduceOp.SUM, self.MAX: dist.ReduceOp.MAX}

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        return self.allreduce_donated_async(tensor.clone(), op, name)

    def allreduce_donated_async(self, tensor: Any, op: str, name: str) -> Any:
        """``all_reduce`` in place on ``tensor``, the caller's no longer (no copy)."""
        work = dist.all_reduce(tensor, op=self._ops[op], group=self.group, async_op=True)
        return work, lambda: tensor, tensor.is_cuda

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        if rows is None:
            mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
            everyone = [torch.empty_like(mine) for _ in range(self.size)]
            dist.all_gather(everyone, mine, group=self.group)
            rows = [int(r) for r in everyone]
        per_row = math.prod(tensor.shape[1:])
        if len(set(rows)) == 1:
            outputs = [torch.empty_like(tensor) for _ in rows]
            work = dist.all_gather(outputs, tensor.contiguous(), group=self.group, async_op=True)
            return work, lambda: torch.cat(outputs), tensor.is_cuda
        flat = tensor.contiguous().reshape(-1)
        gathered = flat.new_empty(sum(rows) * per_row)
        work = dist.all_to_all_single(
            gathered,
            flat.repeat(self.size),
            output_split_sizes=[r * per_row for r in rows],
            input_split_sizes=[flat.numel()] * self.size,
            group=self.group,
            async_op=True,
        )
        return work, lambda: gathered.reshape((sum(rows),) + tuple(tensor.shape[1:])), tensor.is_cuda

    def wait(self, handle: Any) -> Any:
        """The collective's result. A handle is ``(work, result, on GPU)``.

        On a GPU (NCCL) a work's future is done as soon as the collective is queued, and
        ``work.wait()`` makes the current stream wait for it (no host wait): the result is not
        read before. On the CPU (gloo) a done work needs no wait, and a DDP hook decodes inside
        its futures' callback, on gloo's thread, where waiting again would never return.
        """
        work, result, on_gpu = handle
        if on_gpu or not work.get_future().done():
            work.wait()
        return result()
