"""N ranks stepped one after another in one thread: a Communicator for the Simulator's engine runs.

Each rank's collectives are posted and return at once; a collective's result is computed
when a rank first waits for it, from every rank's post (in rank order, as
:class:`~hvd_compress.transport.threads.ThreadCommunicator` computes it). Collectives match by
name and by how often each rank has used that name, as Horovod matches them. So the real
engine runs N ranks in lockstep without threads: every rank launches its bucket with
``complete=False`` (nothing waits), then every rank completes it (a round that needs an
earlier one's result waits for it: every rank has posted it), then every rank finishes::

    group = LockstepGroup(4)
    exchanges = [open_exchange(compressor[r], group.rank(r), "bucket") for r in range(4)]
    ...add, launch(complete=False) for each rank; complete() for each; finish() for each

Waiting for a collective some rank has not posted is an error naming it (in a lockstep run it
would otherwise never come). ``group.posted[rank]`` lists what each rank handed to the collectives,
``(name, "allreduce" or "allgather", bytes)`` in the order posted (ring traffic follows from it).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvd_compress.kernels import ops_for
from hvd_compress.transport.threads import GroupRank, concatenated, reduced


class LockstepGroup:
    """The posts of ``size`` lockstep ranks, by ``(name, use)``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.posts: Dict[Tuple[str, int], List[Any]] = {}
        self.results: Dict[Tuple[str, int], Any] = {}
        self.uses: List[Dict[str, int]] = [{} for _ in range(size)]
        #: per rank: ``(name, collective, bytes)`` of every tensor it posted, in order
        self.posted: List[List[Tuple[str, str, int]]] = [[] for _ in range(size)]

    def rank(self, rank: int) -> "LockstepCommunicator":
        return LockstepCommunicator(self, rank)

    def post(self, rank: int, name: str, tensor: Any, combine: Any, collective: str) -> Tuple[str, int]:
        self.posted[rank].append((name, collective, ops_for(tensor).itemsize(tensor) * math.prod(tuple(tensor.shape))))
        use = self.uses[rank].get(name, 0)
        self.uses[rank][name] = use + 1
        slots = self.posts.setdefault((name, use), [None] * self.size)
        slots[rank] = (tensor, combine)
        return name, use

    def result(self, key: Tuple[str, int]) -> Any:
        if key not in self.results:
            slots = self.posts.get(key, [None] * self.size)
            missing = [rank for rank, slot in enumerate(slots) if slot is None]
            if missing:
                raise RuntimeError(f"hvd_compress: collective '{key[0]}' waited for before ranks {missing} "
                                   "started it (a lockstep run: every rank must launch before any waits)")
            self.results[key] = slots[0][1]([tensor for tensor, _ in slots])
        result = self.results[key]
        return ops_for(result).clone(result)  # each rank its own, as each rank of a transport receives


class LockstepCommunicator(GroupRank):
    """Rank ``rank`` of a :class:`LockstepGroup`; name-matched, never blocks."""

    matches_by_order = False

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        return self.group.post(self._rank, name, tensor, lambda posts: reduced(op, posts), "allreduce")

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        return self.group.post(self._rank, name, tensor, lambda posts: concatenated(posts, name), "allgather")

    def wait(self, handle: Any) -> Any:
        return self.group.result(handle)
