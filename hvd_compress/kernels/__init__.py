"""Framework kernels: the reference functions for each array type.

``ops_for(tensor)`` returns the module implementing
:mod:`hvd_compress.kernels.reference`'s functions for that tensor: the
reference itself for numpy arrays, :mod:`hvd_compress.kernels.torch_ops` for
torch tensors, :mod:`hvd_compress.kernels.tf_ops` for TensorFlow tensors and
variables. Compressor classes only ever call these functions, so one class
serves every framework. A framework's kernels are imported only when one of its
tensors arrives: importing hvd_compress imports neither torch nor TensorFlow.

``computed_form(tensor)`` is the array compressors and exchanges compute on: a
TensorFlow eager tensor on the CPU (float32, float64) becomes its numpy array and
runs the reference's kernels (one eager TensorFlow op costs about 50 µs of Python
and dispatch, numpy's a few µs, so an exchange of a few tensors went from about 65
eager ops to none); what an exchange hands back is a TensorFlow tensor again.
Tensors inside a graph, on a GPU, or of 16-bit types keep TensorFlow's kernels.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional, Sequence, Tuple

import numpy as np


def ops_for(tensor: Any, name: str = "") -> ModuleType:
    """The kernel module for ``tensor``'s framework; ``TypeError`` for unknown types."""
    if isinstance(tensor, np.ndarray):
        from hvd_compress.kernels import reference

        return reference
    framework = type(tensor).__module__.split(".")[0]
    if framework == "torch":
        from hvd_compress.kernels import torch_ops

        return torch_ops
    if framework == "tensorflow":
        from hvd_compress.kernels import tf_ops

        return tf_ops
    what = f"gradient '{name}'" if name else "a tensor"
    raise TypeError(
        f"hvd_compress: cannot compress {what} of type "
        f"{type(tensor).__module__}.{type(tensor).__name__}; "
        "pass a numpy array, a torch tensor or a TensorFlow tensor"
    )


def computed_form(tensor: Any) -> Any:
    """``tensor`` as compressors compute on it: an eager TensorFlow float32/float64 tensor on the
    CPU as its numpy array (see the module docstring), anything else as it is."""
    if type(tensor).__module__.split(".")[0] == "tensorflow":
        from hvd_compress.kernels import tf_ops

        return tf_ops.host_array(tensor)
    return tensor


def in_form_of(result: Any, original: Any) -> Any:
    """``result``, computed on ``computed_form(original)``, as a tensor of ``original``'s framework."""
    if computed_form(original) is original:
        return result
    return ops_for(original).from_host(result, original)


def bucket_rows(ops: ModuleType, groups: Sequence[Tuple[int, int, int, int, int]], like: Any,
                spare: Optional[int] = None, tensors: Optional[Sequence[Tuple[int, Any]]] = None,
                compile: Optional[bool] = None) -> Any:
    """The row selections of a fused bucket of ``ops``'s arrays (``like``: one of them): the ``Rows``
    of the module ``ops`` names (``BUCKET_ROWS``: :class:`~hvd_compress.kernels.torch_rows.Rows`,
    numpy's :class:`~hvd_compress.kernels.reference_rows.Rows`, :class:`~hvd_compress.kernels.tf_rows.Rows`);
    ``tensors``: each row's label in
    the order the tensors were added (:func:`~hvd_compress.kernels.reference_rows.row_order`); ``compile``: whether
    torch's passes run compiled (``None``: :func:`~hvd_compress.kernels.torch_compiled.enabled` decides)."""
    import importlib

    rows = importlib.import_module(ops.BUCKET_ROWS).Rows
    return rows(groups, getattr(like, "device", None), spare=spare, tensors=tensors, compile=compile)


def module(name: str) -> ModuleType:
    """A kernel module by its ``__name__`` (checkpoints record generators by module)."""
    import importlib

    if name not in (_REFERENCE, _TORCH, _TF):
        raise ValueError(f"hvd_compress: unknown kernel module {name!r}")
    return importlib.import_module(name)


_REFERENCE = "hvd_compress.kernels.reference"
_TORCH = "hvd_compress.kernels.torch_ops"
_TF = "hvd_compress.kernels.tf_ops"
