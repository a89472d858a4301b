"""Ranks as threads of one process: a Communicator that runs the real per-rank code without MPI.

:class:`ThreadCommunicator` lets the real per-rank code (the fused exchange,
the drop-in optimizer) run N ranks in one process, each in its own thread,
without MPI or Horovod. Every collective is a rendezvous: each rank posts its
tensor, all wait at a barrier, and each computes the result from all posts in
rank order (sums in rank order, integer sums wrapping as an int32 allreduce
does). Collectives complete when called; ``wait`` just returns the result.
Ranks that issue different collectives meet the wrong partner and, as with
MPI, are caught by the exchange's header check; a rank that never arrives
breaks the barrier after ``timeout`` seconds on every rank.

    results = run_ranks(4, lambda comm: train(comm))   # one thread per rank

:class:`~hvd_compress.simulator.Simulator` is the lockstep counterpart
(:mod:`~hvd_compress.transport.lockstep`: the same engine, no threads, one call per step).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, List, Optional, Sequence

from hvd_compress.transport.communicator import Communicator
from hvd_compress.kernels import ops_for


class ThreadGroup:
    """Shared state of ``size`` thread ranks: one post slot per rank and a barrier."""

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        self.size = size
        self.slots: List[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=timeout)


class GroupRank(Communicator):
    """Rank ``rank`` of an in-process ``group`` of ranks (one with a ``size``)."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self._rank = group, rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.group.size


class ThreadCommunicator(GroupRank):
    """Rank ``rank`` of a :class:`ThreadGroup`."""

    matches_by_order = True

    def _collective(self, tensor: Any, combine: Callable[[List[Any]], Any]) -> Any:
        """``combine`` of every rank's ``tensor`` (rank order), computed before any rank moves on
        (and may change its tensor): post, barrier, combine, barrier."""
        self.group.slots[self._rank] = tensor
        self.group.barrier.wait()
        result = combine(list(self.group.slots))
        self.group.barrier.wait()
        return result

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        return self._collective(tensor, lambda posts: reduced(op, posts))

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        return self._collective(tensor, lambda posts: concatenated(posts, name))

    def wait(self, handle: Any) -> Any:
        return handle


def reduced(op: str, posts: List[Any]) -> Any:
    """The allreduce of the ranks' tensors ``posts`` in rank order: ``Communicator.MAX`` elementwise, else
    a sum (int32 wrapping as an int32 allreduce does; floats summed in at least float32, in rank order,
    back in the tensors' dtype)."""
    ops, first = ops_for(posts[0]), posts[0]
    if op == Communicator.MAX:
        return functools.reduce(ops.maximum, posts)
    if str(first.dtype).endswith("int32"):
        return ops.sum_int32_wrapping(posts)
    return ops.cast(ops.dense_sum(posts), first.dtype)


def concatenated(posts: List[Any], name: str) -> Any:
    """The ranks' tensors concatenated along dim 0; every rank raises the same error when their other
    dimensions differ (as ``MPICommunicator`` checks them)."""
    shapes = [tuple(p.shape[1:]) for p in posts]
    if len(set(shapes)) > 1:
        raise ValueError(f"hvd_compress: ranks disagree on the trailing shape of allgather '{name}' "
                         f"(per rank: {shapes})")
    return ops_for(posts[0]).concat(posts)


def run_ranks(size: int, work: Callable[[ThreadCommunicator], Any], timeout: float = 60.0) -> List[Any]:
    """Run ``work(comm)`` on ``size`` thread ranks; their results in rank order.

    The first exception of any rank is raised here (the others are released
    by the broken barrier). CUDA models: exchange gradients after backward
    (``torch.autograd.grad``, then the optimizer's ``step``), not from
    gradient hooks: autograd runs every thread's CUDA backward on one thread
    per device, so a rank whose hook waits at the barrier blocks the others
    (the barrier then times out).
    """
    group = ThreadGroup(size, timeout)
    results: List[Any] = [None] * size
    errors: List[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = work(ThreadCommunicator(group, rank))
        except BaseException as error:  # noqa: BLE001 - reported to the caller below
            errors.append(error)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    primary = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if primary or errors:
        raise (primary or errors)[0]
    return results
