"""Framework kernels: the reference functions for each array type.

``ops_for(tensor)`` returns the module implementing
:mod:`hvd_compress.compressors.reference`'s functions for that tensor: the
reference itself for numpy arrays, :mod:`hvd_compress.kernels.torch_ops` for
torch tensors. Compressor classes only ever call these functions, so one class
serves every framework.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def ops_for(tensor: Any, name: str = "") -> ModuleType:
    """The kernel module for ``tensor``'s framework; ``TypeError`` for unknown types."""
    if isinstance(tensor, np.ndarray):
        from hvd_compress.compressors import reference

        return reference
    if type(tensor).__module__.split(".")[0] == "torch":
        from hvd_compress.kernels import torch_ops

        return torch_ops
    what = f"gradient '{name}'" if name else "a tensor"
    raise TypeError(
        f"hvd_compress: cannot compress {what} of type "
        f"{type(tensor).__module__}.{type(tensor).__name__}; pass a numpy array or a torch tensor"
    )


def module(name: str) -> ModuleType:
    """A kernel module by its ``__name__`` (checkpoints record generators by module)."""
    import importlib

    if name not in (_REFERENCE, _TORCH):
        raise ValueError(f"hvd_compress: unknown kernel module {name!r}")
    return importlib.import_module(name)


_REFERENCE = "hvd_compress.compressors.reference"
_TORCH = "hvd_compress.kernels.torch_ops"
