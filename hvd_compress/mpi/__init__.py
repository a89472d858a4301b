"""Compressed data-parallel training over mpi4py, without Horovod.

    import hvd_compress.mpi as hvd
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.regtopk(0.01))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Run with ``mpirun -np N python train.py``. The optimizer is
:func:`hvd_compress.torch.optimizer.DistributedOptimizer` (fused buckets,
overlap with backward, residuals in ``state_dict``) on an
:class:`~hvd_compress.transport.mpi.MPICommunicator`. MPI initializes when this
module's functions first need it (mpi4py initializes on ``from mpi4py import MPI``).
From then on an uncaught exception on any rank prints its traceback (lines
prefixed ``[rank R]``) and aborts the whole job instead of hanging it
(:func:`~hvd_compress.transport.mpi.install_abort_on_error`;
``HVD_COMPRESS_MPI_ABORT_ON_ERROR=0`` turns this off).
"""

from __future__ import annotations

from typing import Any, Optional

from hvd_compress import Compression  # noqa: F401  (hvd.Compression.topk(0.01), like Horovod's)
from hvd_compress.transport.communicator import Communicator
from hvd_compress.transport.mpi import MPICommunicator, cuda_aware  # noqa: F401

Average = "average"
Sum = "sum"

_DEFAULT: Optional[MPICommunicator] = None


def communicator(comm: Any = None) -> Communicator:
    """An :class:`MPICommunicator` for ``comm`` (an mpi4py ``Comm``; default ``COMM_WORLD``, shared)."""
    global _DEFAULT
    if isinstance(comm, Communicator):
        return comm
    if comm is not None:
        return MPICommunicator(comm)
    if _DEFAULT is None:
        _DEFAULT = MPICommunicator()
    return _DEFAULT


def init(comm: Any = None) -> None:
    """Initialize MPI (idempotent; mpi4py already does on import). Here for Horovod-like scripts."""
    communicator(comm)


def rank() -> int:
    return communicator().rank


def size() -> int:
    return communicator().size


def DistributedOptimizer(
    optimizer: Any,
    named_parameters=None,
    compression=None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    bucket_cap_mb: float = 25.0,
    comm: Any = None,
    nonfinite: Optional[str] = None,
):
    """``hvd_compress.torch.DistributedOptimizer`` whose collectives go through mpi4py.

    ``op``: ``"average"`` (default, also ``None``) or ``"sum"``. ``comm``: an
    mpi4py communicator or any :class:`Communicator` (default ``COMM_WORLD``).
    ``nonfinite``: as the torch optimizer's (``"raise"``: strict mode).
    """
    from hvd_compress.torch.optimizer import DistributedOptimizer as _torch_optimizer  # torch only here

    if op not in (None, Average, Sum):
        raise ValueError(f"hvd_compress: op must be 'average' or 'sum', got {op!r}")
    wrapped = _torch_optimizer(
        optimizer,
        named_parameters=named_parameters,
        compression=compression,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        bucket_cap_mb=bucket_cap_mb,
        communicator=communicator(comm),
        nonfinite=nonfinite,
    )
    wrapped.compression_state.route = "hvd_compress.mpi.DistributedOptimizer"
    return wrapped


def broadcast_parameters(params: Any, root_rank: int = 0, comm: Any = None) -> None:
    """Overwrite every rank's tensors with ``root_rank``'s, in place (one buffer ``Bcast`` each).

    ``params``: a ``state_dict()`` or an iterable of ``(name, tensor)``, in the
    same order on every rank (a model's are; a dict is sorted by name, as
    Horovod does). Non-tensor entries are left alone.
    """
    import torch

    channel = communicator(comm)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for _, value in items:
        if isinstance(value, torch.Tensor):
            channel.broadcast_(value.data if value.requires_grad else value, root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, comm: Any = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (pickled; not for the hot path)."""
    return communicator(comm).comm.bcast(obj, root=root_rank)


def allreduce(tensor: Any, average: bool = True, name: Optional[str] = None, comm: Any = None) -> Any:
    """Average (or sum) of a tensor over ranks, like ``horovod.torch.allreduce`` (``name`` is ignored)."""
    channel = communicator(comm)
    total = channel.wait(channel.allreduce_async(tensor, channel.SUM, name or "allreduce"))
    return total / channel.size if average else total
