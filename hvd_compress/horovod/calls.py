"""Horovod's own collective calls on the stack: the name a user gave ``hvd.allreduce``.

``hvd.allreduce(tensor, name=..., compression=c)`` and ``hvd.grouped_allreduce`` (in
``horovod.torch`` and ``horovod.tensorflow``) call ``c.compress(tensor)`` without the
name; :func:`allreduce_call` finds that call in the caller's frames and reads it, so
that a compressor keeps a tensor's state under the name the user chose.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

#: Horovod's functions that take ``compression=`` and call ``compress(tensor)`` themselves
ALLREDUCES = ("allreduce", "grouped_allreduce")


def allreduce_call(compressor: Any, tensor: Any, module: str, depth: int = 8) -> Tuple[bool, Optional[str]]:
    """``(found, name)``: whether ``hvd.allreduce(tensor, compression=compressor)`` (or
    ``hvd.grouped_allreduce``) of Horovod's ``module`` (``horovod.torch.mpi_ops``,
    ``horovod.tensorflow``) is among the ``depth`` frames above the caller, and the ``name=`` it
    was given (grouped: ``<name>.<position of tensor>``), ``None`` without one (Horovod then
    names it by call order too)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        local = frame.f_locals
        if (frame.f_code.co_name in ALLREDUCES and frame.f_globals.get("__name__") == module
                and local.get("compression") is compressor):
            name = local.get("name")
            if name is not None and "tensors" in local:  # grouped: the position of this tensor in the group
                position = next((i for i, t in enumerate(local["tensors"]) if t is tensor), None)
                name = None if position is None else f"{name}.{position}"
            return True, None if name is None else str(name)
        frame = frame.f_back
    return False, None
