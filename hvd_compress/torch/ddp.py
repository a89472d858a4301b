"""Our compressors as a ``torch.distributed`` DDP communication hook (no Horovod needed).

    state = hvd_compress.torch.CompressionState(compressor=RegTopK(0.01), process_group=None)
    model.register_comm_hook(state, hvd_compress.torch.ddp_hook)

DDP hands the hook one bucket at a time: ``bucket.buffer()`` is the flat, not yet
averaged local gradient of the bucket's parameters. The bucket is one tensor for
the compressor, named ``ddp.bucket<index>`` (``bucket.index()`` is the same on
every rank); its error-feedback residual and RegTop-k state live in the compressor
under that name. Per bucket and step (the same steps as :mod:`hvd_compress.comm.horovod`
and the :class:`~hvd_compress.simulator.Simulator`, so the numbers are the same):

1. Header: one tiny ``all_gather`` of ``[numel, count, config crc32, bucket index,
   scale]`` per rank. Every rank checks that all agree on numel, configuration and
   bucket and raises the same ``ValueError`` otherwise (never a hang); a rank whose
   compressor rejects its gradient (NaN/Inf) says so in the header, so every rank
   raises. None/FP16 do this once per bucket (an FP16 failure later sends its Inf,
   and every rank raises on the non-finite sum); sparsifiers and TernGrad every
   step, as the header carries what they need (counts, scales).
2. Top-k, Gaussian-k, RegTop-k: ``encode`` -> (values, indices), packed as bytes
   into one buffer per rank. Equal counts (Top-k, RegTop-k): ``all_gather``.
   Unequal counts (Gaussian-k): ``all_to_all_single`` with split sizes, the
   buffer repeated once per peer as input. That is an allgatherv built on
   alltoallv: gloo has no uneven ``all_gather`` (it rejects unequal sizes) but
   does have alltoallv, NCCL and MPI have it too, and every rank moves exactly
   its own count to each peer: nothing is padded to the largest count (the
   repeated input costs local memory only). Then
   ``decode(payloads, (numel,), average=True, name=...)``, so RegTop-k learns
   from the aggregate.
3. TernGrad: the header carries every rank's ``local_scale``; the shared scale is
   their max (the all_gather of N scalars is the allreduce-Max, and also serves
   ``scalar_sharing=False``). ``encode(..., scale=S)``, then ``all_reduce`` SUM of
   the packed int32 lanes (``wire_tensor``) or ``all_gather`` of the 2-bit codes,
   per ``payload.wire_format``; ``code_sum`` * S / N.
4. Dense: None, and sparsifier/TernGrad buckets under ``dense_below``: ``all_reduce``
   then / N. FP16: ``all_reduce`` in float16, then cast back and / N.

The header exchange is synchronous (later steps need its result); the payload
collective is asynchronous and the hook returns its ``get_future()`` chained
(``then``) with the decode, a ``torch.futures.Future`` of the averaged flat
gradient in the bucket's dtype and device. The decode therefore runs on the
backend's completion thread while backward goes on.

Layout: DDP builds each bucket with its parameters in model order and, after the
first iteration, rebuilds the buckets in the order the gradients became ready
(usually reversed). The compressor always sees a bucket in the first layout this
state saw, DDP's construction-time one: the same on every rank and in every run,
so residuals and checkpoints keep fitting. After a rebuild that only reorders a
bucket the hook gathers the flat gradient into that layout and scatters the
result back (two copies of the bucket per step); a rebuild that moves parameters
between buckets resets those buckets' state, with a warning.
"""

import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from hvd_compress.compressors import FP16, NoneCompressor, TernGrad
from hvd_compress.compressors.payload import DensePayload, SparsePayload
from hvd_compress.kernels import torch_ops as ops

HEADER = ("numel", "count", "config", "bucket")
DENSE = -1  # the header's count for a bucket sent dense
FAILED = -2  # ... for a rank whose compressor rejected the gradient (NaN/Inf)


class CompressionState:
    """State of :func:`ddp_hook`: the compressor (residuals inside, keyed by bucket) and the group.

    Pickles itself without the process group (like ``PowerSGDState``; after
    unpickling the group is the default one, set ``process_group`` for another);
    :meth:`state_dict` / :meth:`load_state_dict` are the compressor's.
    """

    __slots__ = ("compressor", "process_group", "_checked", "_layouts")

    def __init__(self, compressor: Any, process_group: Optional[Any] = None) -> None:
        self.compressor = compressor
        self.process_group = process_group
        self._checked: set = set()  # dense buckets whose header agreed once
        self._layouts: Dict[str, tuple] = {}

    def __getstate__(self) -> Dict[str, Any]:
        return {"compressor": self.compressor}  # no process group; per-process bookkeeping is rebuilt

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["compressor"], process_group=None)

    def state_dict(self) -> Dict[str, Any]:
        return self.compressor.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.compressor.load_state_dict(state)


def ddp_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over the group, compressed on the wire.

    The annotations are the objects DDP's ``register_comm_hook`` checks for (so no
    ``from __future__ import annotations`` in this module).
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (state.compressor.rank, state.compressor.size) != (rank, world):
        state.compressor.bind(rank, world)  # once: bind() restarts the random streams
    name, flat, gather = f"ddp.bucket{bucket.index()}", bucket.buffer(), None
    if not isinstance(state.compressor, (NoneCompressor, FP16)):  # those are stateless: any layout
        gather = _canonical_order(state, name, bucket)
    future = _exchange(state, flat if gather is None else flat[gather], name, bucket.index(), group, world)
    if gather is None:
        return future
    return future.then(lambda f: torch.empty_like(f.value()).index_copy_(0, gather, f.value()))


def _exchange(state, buffer, name: str, index: int, group: Any, world: int) -> torch.futures.Future:
    """Steps 1-4 of the module docstring for one flat gradient."""
    compressor = state.compressor
    numel, dtype = buffer.numel(), buffer.dtype
    acc = ops.accumulation_dtype(dtype)

    def header(count: int, scale: float = 0.0, failure: Optional[Exception] = None) -> List[List[float]]:
        fields = [numel, count, state.compressor.config_hash(), index]
        return _exchange_header(state, group, world, name, fields, scale, buffer.device, failure)

    if isinstance(compressor, (NoneCompressor, FP16)):
        if name not in state._checked:
            header(DENSE)
            state._checked.add(name)
        if isinstance(compressor, NoneCompressor):
            return _all_reduce(buffer, group).then(lambda f: f.value()[0].div_(world))
        failure, wire = _attempt(lambda: compressor.encode(buffer, name).values)
        if failure is not None:
            wire = buffer.to(torch.float16)  # its Inf/NaN reach every rank's sum: all of them raise

        def fp16(f):
            total = f.value()[0]
            if failure is not None:
                raise failure
            if ops.count_nonfinite(total):
                raise ValueError(
                    f"hvd_compress: another rank's gradient of DDP bucket '{name}' has NaN/Inf or "
                    "exceeds the float16 range; FP16 compression failed there (see its error)"
                )
            return (total.to(acc) / world).to(dtype)

        return _all_reduce(wire, group).then(fp16)

    if isinstance(compressor, TernGrad):
        failure, local = _attempt(lambda: compressor.local_scale(buffer, name))
        count = FAILED if failure is not None else DENSE if local is None else numel
        rows = header(count, 0.0 if local is None else local, failure)
        if local is None:
            return _all_reduce(buffer, group).then(lambda f: f.value()[0].div_(world))
        scales = [row[4] for row in rows]
        if not compressor.scalar_sharing:
            payload = compressor.encode(buffer, name)
            codes = ops.pack_two_bit(payload.codes)

            def unshared(_):
                per_rank = compressor.codes_of_ranks(torch.cat(gathered), numel, world, ops)
                total = ops.dense_sum([ops.cast(c, acc) * s for c, s in zip(per_rank, scales)])
                return (total / world).to(dtype)

            gathered, fut = _all_gather(codes, world, group)
            return fut.then(unshared)
        scale = max(scales)
        payload = compressor.encode(buffer, name, scale=scale)
        wire, fmt = compressor.wire_tensor(payload, ops), payload.wire_format

        def shared(_):
            received = wire if fmt == "allreduce" else torch.cat(gathered)
            code_sum = compressor.code_sum(received, numel, world, fmt, ops)
            return (ops.cast(code_sum, acc) * scale / world).to(dtype)

        if fmt == "allreduce":
            return _all_reduce(wire, group).then(shared)
        gathered, fut = _all_gather(wire, world, group)
        return fut.then(shared)

    # Top-k, Gaussian-k, RegTop-k
    failure, payload = _attempt(lambda: compressor.encode(buffer, name))
    if failure is not None or isinstance(payload, DensePayload):
        header(FAILED if failure is not None else DENSE, failure=failure)
        return _all_reduce(buffer, group).then(lambda f: f.value()[0].div_(world))
    counts = [int(row[1]) for row in header(payload.values.shape[0])]
    values, indices = payload.values.contiguous(), payload.indices.contiguous()
    local = torch.cat([values.view(torch.uint8), indices.view(torch.uint8)])
    per_entry = values.element_size() + indices.element_size()

    def aggregate(_):
        received = torch.cat(gathered) if isinstance(gathered, list) else gathered
        payloads, start = [], 0
        for count in counts:
            cut = start + count * values.element_size()
            end = start + count * per_entry
            payloads.append(
                SparsePayload(
                    values=_view(received[start:cut], values.dtype),
                    indices=_view(received[cut:end], indices.dtype),
                    numel=numel,
                )
            )
            start = end
        return compressor.decode(payloads, (numel,), average=True, name=name).to(dtype)

    if len(set(counts)) == 1:
        gathered, fut = _all_gather(local, world, group)
    else:  # allgatherv as alltoallv: exact sizes, no padding
        gathered = local.new_empty(sum(counts) * per_entry)
        fut = dist.all_to_all_single(
            gathered,
            local.repeat(world),
            output_split_sizes=[c * per_entry for c in counts],
            input_split_sizes=[local.numel()] * world,
            group=group,
            async_op=True,
        ).get_future()
    return fut.then(aggregate)


# --------------------------------------------------------------------- helpers
def _exchange_header(state, group, world: int, name: str, fields: List[int], scale: float, device, failure):
    """All-gather ``fields + [scale]`` (int64; the float64 scale by its bits).

    Raises on every rank when the ranks disagree or one could not compress (``failure``,
    re-raised there): raising before the exchange would leave the others waiting.
    """
    bits = torch.tensor([float(scale)], dtype=torch.float64).view(torch.int64)
    row = torch.tensor(fields + [int(bits)], dtype=torch.int64, device=device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    table = [r[:4].tolist() + [float(r[4:].view(torch.float64))] for r in torch.stack(rows).cpu()]
    failed = [i for i, r in enumerate(table) if r[1] == FAILED]
    if failure is not None:
        raise failure
    if failed:
        raise ValueError(
            f"hvd_compress: rank(s) {failed} could not compress DDP bucket '{name}' (see their "
            "error, e.g. NaN/Inf gradients); every rank stops instead of waiting"
        )
    first = table[0]
    agree = lambda r: r[0] == first[0] and r[2:4] == first[2:4] and (r[1] == DENSE) == (first[1] == DENSE)
    if not all(agree(r) for r in table):
        described = "; ".join(f"rank {i}: {dict(zip(HEADER, r[:4]))}" for i, r in enumerate(table))
        raise ValueError(
            f"hvd_compress: ranks disagree on DDP bucket '{name}' (bucket size, compressor "
            f"configuration or bucket order); this rank runs {state.compressor!r}: {described}"
        )
    return table


def _attempt(work):
    """``(None, result)``, or ``(error, None)`` when ``work`` rejects the gradient (reported after the header)."""
    try:
        return None, work()
    except (ValueError, TypeError) as error:
        return error, None


def _all_gather(tensor: torch.Tensor, world: int, group: Any):
    outputs = [torch.empty_like(tensor) for _ in range(world)]
    return outputs, dist.all_gather(outputs, tensor, group=group, async_op=True).get_future()


def _all_reduce(tensor: torch.Tensor, group: Any) -> torch.futures.Future:
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()


def _view(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes as ``dtype`` (copied when the slice is not aligned for it)."""
    size = torch.empty((), dtype=dtype).element_size()
    return (raw if raw.storage_offset() % size == 0 else raw.clone()).view(dtype)


def _canonical_order(state: CompressionState, name: str, bucket: Any) -> Optional[torch.Tensor]:
    """``None``, or the gather indices putting the bucket back in its first layout after a rebuild."""
    params = bucket.parameters()
    layout = tuple(id(p) for p in params)
    first, cached = state._layouts.setdefault(name, (layout, None))
    if layout == first:
        return None
    if cached is not None and cached[0] == layout:
        return cached[1]
    if sorted(layout) != sorted(first):
        warnings.warn(
            f"hvd_compress: DDP bucket '{name}' now holds other parameters (DDP rebuilt its "
            "buckets); its compression state (residual) is reset",
            stacklevel=3,
        )
        state.compressor.reset(name)
        state._layouts[name] = (layout, None)
        return None
    starts, offset = {}, 0
    for p in params:
        starts[id(p)] = (offset, p.numel())
        offset += p.numel()
    device = bucket.buffer().device
    gather = torch.cat([torch.arange(s, s + n, device=device) for s, n in (starts[i] for i in first)])
    state._layouts[name] = (first, (layout, gather))
    return gather
