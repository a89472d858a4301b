"""Stock ``horovod.torch``: the gradients Horovod compresses one at a time, exchanged in buckets.

Horovod's optimizer calls ``compress(grad)`` once per parameter and step, from
backward hooks and, for gradients backward did not produce, from
``synchronize()`` in set order: the order differs between ranks. A bucket's
members must not. So the buckets come from the calling optimizer, once
(:class:`Plan`): its parameters in reverse registration order (the order
backward produces gradients; a ``_requires_update`` parameter of each
``param_group``), named as Horovod names them (``_parameter_names``), cut into
buckets of one dtype and device and at most ``HVD_COMPRESS_BUCKET_CAP_MB``
(default 25, the drop-in's ``bucket_cap_mb``) of gradients each, the same on
every rank. A bucket's collectives are named after its first parameter
(``hvd_compress.<name>.*``).

A step of a plan (:class:`Step`):

- ``compress`` records the gradient and returns a one-element placeholder of
  ones for Horovod's allreduce (a slice of one buffer per step, dtype and device:
  one fill per step, not one per tensor);
- once every member of a bucket is recorded, the bucket is encoded and its
  collectives start (the fused bucket of the drop-in optimizer,
  :mod:`hvd_compress.engine.fused`; ``launch(complete=False)``: it waits for no
  other rank) while backward goes on;
- the first ``decompress`` of a recorded tensor launches the buckets still open
  with the members recorded (a parameter Horovod never compresses, a sparse
  gradient without ``sparse_as_dense``, leaves its bucket open), then completes
  every launched exchange (the layout check at a layout's first step, TernGrad's
  codes drawn with the shared scale): Horovod's ``synchronize`` compresses every
  gradient before it decompresses any, so every rank has launched every bucket
  by then;
- a bucket is finished at the first ``decompress`` of one of its members; each
  member's ``decompress`` returns its part.

Every tensor of a sparsifier travels through the bucket, those it sends dense
(under ``dense_below``, or ``N k >= d``) in the bucket's dense allreduce: a
tensor that turns dense sends its residual with its first dense gradient, and
the statistics count every byte (the bucket's payload, and here the placeholders).

A compressor with momentum correction (``TopK(0.01, momentum=0.9)``) owns the
momentum: the plan raises ``ValueError`` (on every rank, from the first backward)
when a ``param_group`` of the optimizer has ``momentum`` of its own.

Horovod's reduction of the placeholder is the scaling it applies: ``1`` for
``op=Average`` (whatever ``gradient_predivide_factor``), ``N`` for ``op=Sum``;
a bucket's result is the average, or the sum divided by ``N / reduction``. The
reduction is read on the host once per plan and world size, at the first
``decompress`` (Horovod applies one ``op`` to all of an optimizer's gradients).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Tuple

from hvd_compress.transport.communicator import horovod_dtype
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.algorithms.checkpoint import check_names
from hvd_compress.algorithms.validation import check_single_momentum, param_group_momenta

ROUTE = "horovod.torch.DistributedOptimizer"
CAP_ENV = "HVD_COMPRESS_BUCKET_CAP_MB"
DEFAULT_CAP_MB = 25.0


def cap_bytes() -> int:
    """Bucket size limit in bytes: ``HVD_COMPRESS_BUCKET_CAP_MB`` MiB (default 25)."""
    value = os.environ.get(CAP_ENV, "")
    try:
        mib = float(value) if value else DEFAULT_CAP_MB
    except ValueError:
        mib = float("nan")
    if not mib > 0:
        raise ValueError(f"hvd_compress: {CAP_ENV} must be a positive number of MiB, got {value!r}")
    return int(mib * 2**20)


def cut(named: List[Tuple[str, Any]], cap: int) -> List[List[str]]:
    """Buckets of ``named`` parameters in the given order: one dtype and device each, at most ``cap`` bytes
    each (a larger parameter alone)."""
    buckets: List[List[str]] = []
    size, kind = 0, None
    for name, p in named:
        p_kind, nbytes = (p.dtype, p.device), p.numel() * p.element_size()
        if not buckets or p_kind != kind or size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size, kind = size + nbytes, p_kind
    return buckets


class Plan:
    """The buckets of one Horovod optimizer's parameters, the same on every rank (module docstring)."""

    def __init__(self, optimizer: Any, compressor: Any = None) -> None:
        """``compressor``: the one Horovod was given; one with momentum correction refuses an optimizer
        with momentum of its own (:func:`~hvd_compress.algorithms.validation.check_single_momentum`)."""
        momenta = param_group_momenta(optimizer.param_groups)
        check_single_momentum(compressor, momenta, "horovod.torch.DistributedOptimizer")
        self.owner = weakref.ref(optimizer)
        names = optimizer._parameter_names
        required = getattr(optimizer, "_requires_update", None)
        params = [
            p for group in optimizer.param_groups for p in group["params"]
            if p in names and (p in required if required else p.requires_grad)
        ]
        self.buckets = cut([(names[p], p) for p in reversed(params)], cap_bytes())
        self.bucket_of = {n: b for b, members in enumerate(self.buckets) for n in members}
        if compressor is not None:
            compressor.state.route = ROUTE
            run = compressor.state
            check_names(run.memory.restored(), run.loaded_route, self.bucket_of.__contains__,
                        f"this {ROUTE}", " (without named_parameters= Horovod names parameters "
                        "allreduce.noname.<group>.<index>)")
        self.position = {n: i for i, n in enumerate(self.bucket_of)}
        self.keys = [f"hvd_compress.{members[0]}" for members in self.buckets]
        self.step: Optional[Step] = None
        #: (world size, Horovod's reduction of a placeholder of ones) when last read
        self.reduction: Optional[Tuple[int, float]] = None

    def __contains__(self, name: str) -> bool:
        return name in self.bucket_of

    # ------------------------------------------------------------ compress
    def record(self, compressor: Any, comm: Any, calls: Any, name: str, tensor: Any) -> Tuple[Any, "Planned"]:
        """``compress``: keep the gradient, launch its bucket if now complete; ``(placeholder, ctx)``."""
        if self.step is None or self.step.finishing:
            self.step = Step(len(self.buckets))
        step = self.step
        if name in step.seen:
            raise RuntimeError(
                f"hvd_compress: '{name}' was compressed twice in one step (before any decompress); "
                "Horovod's optimizer compresses each parameter once per step"
            )
        step.seen.add(name)
        bucket = self.bucket_of[name]
        step.open[bucket][name] = tensor
        if len(step.open[bucket]) == len(self.buckets[bucket]):
            self._launch(compressor, comm, calls, step, bucket)
        return self._placeholder(compressor, step, name, tensor), Planned(self, step, bucket, name, tensor)

    def _placeholder(self, compressor: Any, step: "Step", name: str, tensor: Any) -> Any:
        """One element of the step's buffer of ones for ``tensor``'s device, in its dtype or, where
        Horovod cannot carry that one, in the one it travels as
        (:func:`~hvd_compress.transport.communicator.horovod_dtype`); counted in stats."""
        key = (tensor.device, horovod_dtype(tensor.dtype))
        ones = step.placeholders.get(key)
        if ones is None:
            ones = step.placeholders[key] = tensor.new_ones(len(self.position), dtype=key[1])
        compressor.stats.add(ones.element_size(), 0, 0, 0)
        i = self.position[name]
        return ones[i : i + 1]

    def _launch(self, compressor: Any, comm: Any, calls: Any, step: "Step", bucket: int) -> None:
        """Encode bucket ``bucket`` with the members recorded (in plan order) and start its collectives."""
        recorded, step.open[bucket] = step.open[bucket], {}
        exchange = open_exchange(compressor, comm, self.keys[bucket])
        for name in self.buckets[bucket]:
            if name in recorded:
                exchange.add(name, recorded[name])
        exchange.launch(complete=False)  # ranks may complete buckets in different orders: wait for no one
        step.exchanges[bucket] = exchange
        calls.pending.append(exchange)

    # ---------------------------------------------------------- decompress
    def decompress(self, compressor: Any, comm: Any, calls: Any, output: Any, ctx: "Planned") -> Any:
        """``decompress``: finish the tensor's bucket (once per step) and return the tensor's result."""
        step = ctx.step
        if not step.finishing:  # the step's first decompress: every rank has compressed every gradient
            step.finishing = True
            for bucket, recorded in enumerate(step.open):
                if recorded:
                    self._launch(compressor, comm, calls, step, bucket)
        calls.complete_pending()
        world = comm.size
        if self.reduction is None or self.reduction[0] != world:  # read again if Horovod restarts resized
            self.reduction = (world, float(output.reshape(-1)[0]))
        divisor = world / self.reduction[1]  # N for op=Average, 1 for op=Sum
        results = step.results.get(ctx.bucket)
        if results is None:
            results = step.results[ctx.bucket] = step.exchanges.pop(ctx.bucket).finish(average=divisor == world)
            if compressor.dense_only:  # None, FP16: checked; Horovod's allreduce from now on
                compressor.state.drop_bucket(self.keys[ctx.bucket])
                calls.agreed = True
        result = results.pop(ctx.name)
        if divisor not in (world, 1.0):
            result = result / divisor
        return in_layout_of(result, ctx.grad)


class Step:
    """One step of a :class:`Plan`: gradients recorded, exchanges launched, results not yet taken."""

    def __init__(self, buckets: int) -> None:
        self.open: List[Dict[str, Any]] = [{} for _ in range(buckets)]  # until the bucket launches
        self.seen: set = set()
        self.exchanges: Dict[int, Any] = {}
        self.results: Dict[int, Dict[str, Any]] = {}
        self.placeholders: Dict[tuple, Any] = {}
        self.finishing = False


class Planned:
    """``decompress``'s context for a tensor recorded by a :class:`Plan` (``grad``: the tensor, whose
    dtype and memory format its result takes)."""

    __slots__ = ("plan", "step", "bucket", "name", "grad")

    def __init__(self, plan: Plan, step: Step, bucket: int, name: str, grad: Any) -> None:
        self.plan, self.step, self.bucket, self.name, self.grad = plan, step, bucket, name, grad


def in_layout_of(result: Any, grad: Any) -> Any:
    """``result`` in ``grad``'s dtype and memory format (Horovod's optimizer sets ``p.grad`` to what
    ``decompress`` returns, strides included: a ``channels_last`` gradient stays ``channels_last``).
    The exchange's results are contiguous; a gradient of other strides gets a copy in its own."""
    if result.stride() != grad.stride() and not grad.is_contiguous():
        import torch

        return torch.empty_like(grad).copy_(result)
    return result if result.dtype == grad.dtype else result.to(grad.dtype)
