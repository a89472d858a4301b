"""Our compressors inside stock Horovod (``hvd.DistributedOptimizer(opt, compression=...)``).

Horovod's optimizer calls ``compress(grad)``, allreduces what it returns, then
calls ``decompress(output, ctx)``. To put only the compressed payload on the
wire, ``compress`` starts its own asynchronous collectives and hands Horovod a
one-element placeholder of ones; ``decompress`` waits for them and rebuilds the
dense gradient:

- sparse (Top-k, Gaussian-k, RegTop-k): allgather of a header
  ``[numel, count, config hash, call index]``, of the int32 indices and of the
  values (variable size per rank, never padded); scatter-add of all ranks';
- TernGrad: allreduce-Max of the layer's scale (Horovod fuses these small
  allreduces of a step into one buffer), then ``decompress`` draws the codes
  with the shared scale and sums them with an int32 allreduce of packed lanes
  (or an allgather of 2-bit codes when that moves fewer bytes);
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
same size with the same configuration and raise a clear error otherwise.
The drop-in :mod:`hvd_compress.torch` knows the real names.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, List

from hvd_compress.compressors.payload import DensePayload, SparsePayload

HEADER = ("numel", "count", "config", "index")


@dataclass
class _Calls:
    """Counts ``compress`` calls of the current step for deterministic collective names."""

    index: int = 0
    decompressing: bool = False
    config_hash: int = 0
    bound: tuple = field(default=(None, None))


def _calls(compressor: Any, hvd: Any) -> _Calls:
    calls = compressor.__dict__.get("_horovod_calls")
    if calls is None:
        calls = compressor.__dict__["_horovod_calls"] = _Calls()
        config = repr(sorted(compressor.config().items())).encode()
        calls.config_hash = zlib.crc32(config) & 0x7FFFFFFF
    if calls.bound != (hvd.rank(), hvd.size()):
        compressor.bind(hvd.rank(), hvd.size())
        calls.bound = (hvd.rank(), hvd.size())
    return calls


def _horovod_for(tensor: Any) -> Any:
    if type(tensor).__module__.split(".")[0] == "torch":
        import horovod.torch as hvd

        return hvd
    raise TypeError(
        f"hvd_compress: Horovod compression of {type(tensor).__name__} is not supported; "
        "pass torch tensors (horovod.torch)"
    )


def _next_name(calls: _Calls) -> str:
    if calls.decompressing:
        calls.index, calls.decompressing = 0, False
    name = f"hvd_compress.{calls.index}"
    calls.index += 1
    return name


@dataclass
class _Context:
    kind: str
    name: str = ""
    shape: tuple = ()
    dtype: Any = None
    handles: List[Any] = field(default_factory=list)
    tensor: Any = None


def compress(compressor: Any, tensor: Any):
    """Horovod ``Compressor.compress``: start our collectives, return ``(placeholder, ctx)``."""
    from hvd_compress.compressors import FP16, NoneCompressor, TernGrad

    if isinstance(compressor, NoneCompressor):
        return tensor, _Context("dense")
    if isinstance(compressor, FP16):
        payload = compressor.encode(tensor, "gradient passed to Horovod")
        return payload.values.reshape(tensor.shape), _Context("fp16", dtype=tensor.dtype)
    hvd = _horovod_for(tensor)
    import torch

    calls = _calls(compressor, hvd)
    name = _next_name(calls)
    ctx = _Context("sparse", name=name, shape=tuple(tensor.shape), dtype=tensor.dtype)
    if isinstance(compressor, TernGrad):
        scale = compressor.local_scale(tensor, name)
        if scale is None:
            return tensor, _Context("dense")
        ctx.kind, ctx.tensor = "ternary", tensor.detach().clone()
        local = tensor.new_tensor([scale], dtype=torch.float32)
        if compressor.scalar_sharing:
            ctx.handles = [hvd.allreduce_async(local, op=hvd.Max, name=f"{name}.scale")]
        else:
            ctx.handles = [hvd.allgather_async(local, name=f"{name}.scale")]
        return tensor.new_ones(1), ctx
    payload = compressor.encode(tensor, name)
    if isinstance(payload, DensePayload):
        return tensor, _Context("dense")
    header = tensor.new_tensor(
        [[payload.numel, payload.values.shape[0], calls.config_hash, calls.index - 1]],
        dtype=torch.int64,
    )
    ctx.handles = [
        hvd.allgather_async(header, name=f"{name}.header"),
        hvd.allgather_async(payload.indices, name=f"{name}.indices"),
        hvd.allgather_async(payload.values, name=f"{name}.values"),
    ]
    return tensor.new_ones(1), ctx


def decompress(compressor: Any, output: Any, ctx: _Context):
    """Horovod ``Compressor.decompress``: wait for our collectives, return the dense gradient."""
    if ctx.kind == "dense":
        return output
    if ctx.kind == "fp16":
        return output.to(ctx.dtype)
    hvd = _horovod_for(output)
    calls = _calls(compressor, hvd)
    calls.decompressing = True
    world = hvd.size()
    divisor = world / float(output.reshape(-1)[0])  # N for op=Average, 1 for op=Sum
    if ctx.kind == "ternary":
        total = _ternary_sum(compressor, hvd, ctx, world)
    else:
        total = _sparse_sum(compressor, hvd, ctx, world, calls.config_hash)
    return (total / divisor).to(ctx.dtype).reshape(ctx.shape)


def _sparse_sum(compressor: Any, hvd: Any, ctx: _Context, world: int, config_hash: int):
    headers, indices, values = (hvd.synchronize(h) for h in ctx.handles)
    rows = headers.tolist()
    numel = rows[0][0]
    if any(row[0] != numel or row[2] != config_hash or row[3] != rows[0][3] for row in rows):
        described = "; ".join(f"rank {r}: {dict(zip(HEADER, row))}" for r, row in enumerate(rows))
        raise ValueError(
            f"hvd_compress: ranks disagree on collective '{ctx.name}' (tensor size, compressor "
            f"configuration or order of gradients): {described}"
        )
    counts = [row[1] for row in rows]
    payloads = [
        SparsePayload(values=v, indices=i, numel=numel)
        for v, i in zip(values.split(counts), indices.split(counts))
    ]
    return compressor.decode(payloads, (numel,), average=False, name=ctx.name)


def _ternary_sum(compressor: Any, hvd: Any, ctx: _Context, world: int):
    from hvd_compress.kernels import ops_for

    ops = ops_for(ctx.tensor)
    scales = hvd.synchronize(ctx.handles[0])
    numel = ctx.tensor.numel()
    acc = ops.accumulation_dtype(ctx.dtype)
    if not compressor.scalar_sharing:
        payload = compressor.encode(ctx.tensor, ctx.name)
        gathered = hvd.allgather(ops.pack_two_bit(payload.codes), name=f"{ctx.name}.codes")
        codes = compressor.codes_of_ranks(gathered, numel, world, ops)
        return ops.dense_sum([ops.cast(c, acc) * s for c, s in zip(codes, scales.tolist())])
    scale = float(scales.reshape(-1)[0])
    payload = compressor.encode(ctx.tensor, ctx.name, scale=scale)
    wire = compressor.wire_tensor(payload, ops)
    if payload.wire_format == "allreduce":
        received = hvd.allreduce(wire, op=hvd.Sum, name=f"{ctx.name}.codes")
    else:
        received = hvd.allgather(wire, name=f"{ctx.name}.codes")
    code_sum = compressor.code_sum(received, numel, world, payload.wire_format, ops)
    return ops.cast(code_sum, acc) * scale
