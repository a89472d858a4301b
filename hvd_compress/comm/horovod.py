"""Our compressors inside stock Horovod (``hvd.DistributedOptimizer(opt, compression=...)``).

Horovod's optimizer calls ``compress(grad)``, allreduces what it returns, then
calls ``decompress(output, ctx)``. To put only the compressed payload on the
wire, ``compress`` starts its own asynchronous collectives and hands Horovod a
one-element placeholder of ones; ``decompress`` waits for them and rebuilds the
dense gradient:

- sparse (Top-k, Gaussian-k, RegTop-k) and TernGrad: the tensor is a bucket of
  one for :class:`~hvd_compress.comm.exchange.BucketExchange` (header check,
  allgather of indices and values, or scale allreduce-Max and packed code sum;
  Horovod fuses these small collectives of a step into few buffers);
- FP16 casts, None passes through; tensors under ``dense_below`` elements are
  returned to Horovod's own allreduce unchanged.

Horovod's reduction of the placeholder is the scaling it applies (1 for
``op=Average`` whatever ``gradient_predivide_factor``, N for ``op=Sum``), so the
decoded sum is divided by ``N / placeholder``.

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
from dataclasses import dataclass
from typing import Any, Optional

from hvd_compress.comm.communicator import HorovodTorchCommunicator
from hvd_compress.comm.exchange import BucketExchange


@dataclass
class _Calls:
    """Counts ``compress`` calls of the current step for deterministic collective names."""

    index: int = 0
    decompressing: bool = False

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
    from hvd_compress.compressors import FP16, NoneCompressor

    if _framework(tensor) == "tensorflow":
        from hvd_compress.comm import horovod_tf

        return horovod_tf.compress(compressor, tensor)

    if isinstance(compressor, NoneCompressor):
        compressor.encode(tensor, "gradient passed to Horovod")  # validates, counts bytes
        return tensor, _Context()
    if isinstance(compressor, FP16):
        payload = compressor.encode(tensor, "gradient passed to Horovod")
        return payload.values.reshape(tensor.shape), _Context(dtype=tensor.dtype)
    name = _calls(compressor).next_name()
    exchange = BucketExchange(compressor, _communicator(), name)
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
    _calls(compressor).decompressing = True
    world = _communicator().size
    divisor = world / float(output.reshape(-1)[0])  # N for op=Average, 1 for op=Sum
    if divisor == world:
        return ctx.exchange.finish(average=True)[ctx.name]
    return (ctx.exchange.finish(average=False)[ctx.name] / divisor).to(ctx.dtype)
