"""The collectives every transport provides: Horovod, mpi4py, torch.distributed, the simulator.

A :class:`Communicator` moves framework tensors. ``*_async`` calls return a
handle; :meth:`Communicator.wait` returns the result. Names identify a
collective across ranks (Horovod matches by name; others by call order) and
must be the same on every rank.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


class Communicator:
    """Interface: ``rank``, ``size``, sum/max allreduce and variable-size allgather."""

    SUM = "sum"
    MAX = "max"
    #: Collectives are matched by call order (MPI), not by name (Horovod): ranks must
    #: agree on a bucket's layout before issuing its payload collectives.
    matches_by_order = False

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def size(self) -> int:
        raise NotImplementedError

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        """Elementwise ``op`` (``SUM`` or ``MAX``) over ranks; integer tensors sum exactly.

        The input is left as it is: the result is a new tensor (or, in a world of one rank, may be
        the input itself), so a caller can send a buffer it keeps (momentum correction's velocity)."""
        raise NotImplementedError

    def allreduce_donated_async(self, tensor: Any, op: str, name: str) -> Any:
        """:meth:`allreduce_async` of a buffer the caller gives away (a fresh one it never reads again):
        a transport that copies its input to leave it as it is may reduce ``tensor`` itself instead
        (its result may be ``tensor``). The default sends it like any other input."""
        return self.allreduce_async(tensor, op, name)

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        """Concatenation along dim 0 of every rank's tensor, rank order; sizes may differ.

        ``rows``: every rank's dim-0 size, when the caller already knows them
        (a transport that must exchange sizes first can skip that).
        """
        raise NotImplementedError

    def wait(self, handle: Any) -> Any:
        raise NotImplementedError

    def fail_together(self) -> None:
        """Called by every rank that found the ranks disagree, just before it raises: returns once
        the others have found it too (or after a while), so that no rank's exit ends the job
        before the others can raise the same error. A no-op where errors cannot race."""


class SingleProcessCommunicator(Communicator):
    """A world of one rank: every collective returns its input (tests, single-GPU runs)."""

    rank = 0
    size = 1

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        return tensor

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        return tensor

    def wait(self, handle: Any) -> Any:
        return handle


class HorovodCommunicator(Communicator):
    """Rank, size and reduction ops of a Horovod framework module (``horovod.torch``, ``horovod.tensorflow``)."""

    def __init__(self, hvd: Any) -> None:
        self.hvd = hvd
        self._ops = {self.SUM: hvd.Sum, self.MAX: hvd.Max}

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def size(self) -> int:
        return self.hvd.size()


class Converted:
    """A Horovod handle whose result goes back to the caller's dtype (``back(result)``)."""

    __slots__ = ("handle", "back")

    def __init__(self, handle: Any, back: Any) -> None:
        self.handle, self.back = handle, back


def horovod_dtype(dtype: Any) -> Any:
    """The dtype ``horovod.torch``'s allreduce carries a tensor of ``dtype`` as: ``dtype`` itself, or
    float32 for bfloat16 (Horovod 0.28.1 has no ``horovod_torch_allreduce_async_torch_BFloat16Tensor``)."""
    import torch

    return torch.float32 if dtype == torch.bfloat16 else dtype


def horovod_carried(tensor: Any) -> Any:
    """``(tensor as Horovod's allreduce carries it, how a result goes back)`` (``back`` is ``None`` when
    it travels as it is, :func:`horovod_dtype`). A bfloat16 tensor is summed (or its maximum taken) in
    float32 and rounded back once: over 2 ranks exactly bfloat16's own sum (float32 has more than twice
    bfloat16's 8 significant bits, so the double rounding is innocuous), over more the float32 sum
    rounded once."""
    dtype = horovod_dtype(tensor.dtype)
    if dtype == tensor.dtype:
        return tensor, None
    original = tensor.dtype
    return tensor.to(dtype), lambda result: result.to(original)


def horovod_gathered(tensor: Any) -> Any:
    """:func:`horovod_carried` for an allgather: a bfloat16 tensor travels as its raw 16 bits (int16),
    exactly, and is viewed back."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16), lambda result: result.view(torch.bfloat16)
    return tensor, None


class HorovodTorchCommunicator(HorovodCommunicator):
    """``horovod.torch`` collectives (Gloo, MPI or NCCL, as Horovod was started); dtypes Horovod cannot
    carry travel as one it can (:func:`horovod_carried`, :func:`horovod_gathered`)."""

    def __init__(self) -> None:
        import horovod.torch as hvd

        super().__init__(hvd)

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        carried, back = horovod_carried(tensor)
        handle = self.hvd.allreduce_async(carried, op=self._ops[op], name=name)
        return handle if back is None else Converted(handle, back)

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        carried, back = horovod_gathered(tensor)
        handle = self.hvd.allgather_async(carried, name=name)
        return handle if back is None else Converted(handle, back)

    def wait(self, handle: Any) -> Any:
        if isinstance(handle, Converted):
            return handle.back(self.hvd.synchronize(handle.handle))
        return self.hvd.synchronize(handle)

    #: seconds a rank that found the ranks disagree waits for the others to find it too
    FAIL_TOGETHER_SECONDS = 30.0

    def fail_together(self) -> None:
        """One allreduce named ``hvd_compress.disagree``, joined by every rank that found the ranks
        disagree (they all read the same headers). When one process ends with an error, the
        launcher (``horovodrun``, ``mpirun``) ends the others, which may not have read the headers
        yet (a rank still in backward, or waiting for Horovod's allreduce); waiting here keeps every
        rank alive until each has found the mismatch and raises it. Polled, with
        :attr:`FAIL_TOGETHER_SECONDS` at most."""
        import time

        import torch

        handle = self.hvd.allreduce_async(torch.zeros(1), op=self.hvd.Sum, name="hvd_compress.disagree")
        deadline = time.monotonic() + self.FAIL_TOGETHER_SECONDS
        while not self.hvd.poll(handle) and time.monotonic() < deadline:
            time.sleep(0.01)
