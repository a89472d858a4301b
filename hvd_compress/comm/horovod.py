"""Our compressors inside stock Horovod (``hvd.DistributedOptimizer(opt, compression=...)``).

Horovod's optimizer calls ``compress(grad)``, allreduces what it returns, then
calls ``decompress(output, ctx)``. To put only the compressed payload on the
wire, ``compress`` starts its own asynchronous collectives and hands Horovod a
one-element placeholder of ones; ``decompress`` waits for them and rebuilds the
dense gradient:

- sparse (Top-k, Gaussian-k, RegTop-k) and TernGrad: the tensor is a bucket of
  one for :class:`~hvd_compress.comm.exchange.BucketExchange` (the fused torch
  path: header check on the first step only, allgather of indices and values of
  known size, or scale allreduce-Max and packed code sum, nothing read back to
  the host; Horovod fuses these small collectives of a step into few buffers);
- FP16 casts, None passes through; tensors under ``dense_below`` elements are
  returned to Horovod's own allreduce unchanged (unless a residual is left to
  flush after a switch to dense: then our exchange sends gradient + residual).

Horovod's reduction of the placeholder is the scaling it applies (1 for
``op=Average`` whatever ``gradient_predivide_factor``, N for ``op=Sum``), so the
decoded sum is divided by ``N / placeholder``; it is read on the host once per
tensor name, the first time.

Collective names: Horovod does not pass the parameter name to ``compress``.
The i-th tensor compressed since the last ``decompress`` is named
``hvd_compress.<i>`` (and its residual is kept under that name). Backward hooks
fire in the same order on every rank for the same model, so the names agree;
the header lets every rank check that the others compressed a tensor of the
same name and size with the same configuration, and raise a clear error
otherwise.
The drop-in :mod:`hvd_compress.torch` knows the real names.

TensorFlow tensors (``horovod.tensorflow``, ``horovod.tensorflow.keras``) go to
:mod:`hvd_compress.comm.horovod_tf`, which runs each exchange as one graph op.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from hvd_compress.comm.communicator import HorovodTorchCommunicator
from hvd_compress.comm.exchange import BucketExchange, open_exchange
from hvd_compress.compressors.base import Compressor


@dataclass
class _Calls:
    """Counts ``compress`` calls of the current step for deterministic collective names."""

    index: int = 0
    decompressing: bool = False
    #: Horovod's reduction of each tensor's placeholder of ones (1: op=Average, N: op=Sum)
    reductions: Dict[str, float] = field(default_factory=dict)

    def next_name(self) -> str:
        if self.decompressing:
            self.index, self.decompressing = 0, False
        self.index += 1
        return f"hvd_compress.{self.index - 1}"


@dataclass
class _Context:
    dtype: Any = None
    name: str = ""
    exchange: Optional[BucketExchange] = None


@functools.lru_cache(maxsize=None)
def _communicator() -> HorovodTorchCommunicator:
    return HorovodTorchCommunicator()


def _framework(tensor: Any) -> str:
    framework = type(tensor).__module__.split(".")[0]
    if framework not in ("torch", "tensorflow"):
        raise TypeError(
            f"hvd_compress: Horovod compression of {type(tensor).__name__} is not supported; "
            "pass torch tensors (horovod.torch) or TensorFlow tensors (horovod.tensorflow)"
        )
    return framework


def _calls(compressor: Any) -> _Calls:
    return compressor.__dict__.setdefault("_horovod_calls", _Calls())


def compress(compressor: Any, tensor: Any):
    """Horovod ``Compressor.compress``: start our collectives, return ``(placeholder, ctx)``."""
    if _framework(tensor) == "tensorflow":
        from hvd_compress.comm import horovod_tf

        return horovod_tf.compress(compressor, tensor)

    if compressor.payload_kind == "dense":  # None, FP16: Horovod's own allreduce moves it
        wire = compressor.dense_wire_dtype
        numel, itemsize = tensor.numel(), tensor.element_size()
        compressor.stats.add(numel * (2 if wire else itemsize), numel * itemsize, numel, numel)
        if wire is None:
            return tensor, _Context()
        import torch

        return tensor.to(getattr(torch, wire)), _Context(dtype=tensor.dtype)
    name = _calls(compressor).next_name()
    exchange = open_exchange(compressor, _communicator(), name)
    exchange.add(name, tensor)
    if exchange.only_dense:
        return tensor, _Context()
    exchange.launch()
    return tensor.new_ones(1), _Context(tensor.dtype, name, exchange)


def decompress(compressor: Any, output: Any, ctx: _Context):
    """Horovod ``Compressor.decompress``: wait for our collectives, return the dense gradient."""
    if _framework(output) == "tensorflow":
        from hvd_compress.comm import horovod_tf

        return horovod_tf.decompress(compressor, output, ctx)
    if ctx.exchange is None:
        return output if ctx.dtype is None else output.to(ctx.dtype)
    calls = _calls(compressor)
    calls.decompressing = True
    world = _communicator().size
    reduced = calls.reductions.get(ctx.name)
    if reduced is None:  # read once per tensor: Horovod applies the same op every step
        reduced = calls.reductions[ctx.name] = float(output.reshape(-1)[0])
    divisor = world / reduced  # N for op=Average, 1 for op=Sum
    if divisor == world:
        return ctx.exchange.finish(average=True)[ctx.name]
    return (ctx.exchange.finish(average=False)[ctx.name] / divisor).to(ctx.dtype)


# Every compressor's Horovod ``compress``/``decompress`` runs through this module.
Compressor.horovod_adapter = sys.modules[__name__]
