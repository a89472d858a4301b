"""Our compressors inside stock Horovod (``hvd.DistributedOptimizer(opt, compression=...)``).

Horovod's optimizer calls ``compress(grad)`` for each gradient, allreduces what
it returns, then calls ``decompress(output, ctx)``. To put only the compressed
payload on the wire, ``compress`` hands Horovod a one-element placeholder of
ones and our own asynchronous collectives move the gradient; ``decompress``
waits for them and returns the dense gradient.

Which gradient is it? Horovod's ``compress(tensor)`` is not told, and the
order of the calls is not the same on every rank: gradients that backward did
not produce (a branch not taken, a layer unused on one rank) are filled in with
zeros by ``synchronize()`` in set order, which differs between processes. So
each gradient is identified by its **parameter name**, the name Horovod itself
gives the parameter's allreduce (``named_parameters``, else
``allreduce.noname.<group>.<index>``): :func:`caller` finds the calling
``horovod.torch`` optimizer (``_allreduce_grad_async(self, p)`` or the grouped
form) on the call stack and checks that ``p.grad`` is the tensor handed over.
The residual is kept under that name.

Gradients of an optimizer found so are exchanged in **buckets** of its
parameters (:mod:`hvd_compress.horovod.torch_buckets`), cut as the drop-in
optimizer cuts them and the same on every rank: ``compress`` records the
gradient; a bucket whose gradients are all recorded is encoded and launched at
once, while backward goes on; the step's first ``decompress`` launches the rest.
A bucket is a :class:`~hvd_compress.engine.exchange.BucketExchange` (the
engine of :mod:`hvd_compress.engine.fused`: a header check at a
layout's first step, then an allgather of indices and of values of known size,
or TernGrad's scale allreduce-Max and packed code sum, and one dense
allreduce-Sum of the tensors sent dense, with a few kernels per bucket and
nothing read back to the host). Every tensor of a sparsifier or TernGrad goes
through it, those under ``dense_below`` (or with ``N k >= d``) in its dense
allreduce: Horovod sees only placeholders, a tensor that turns dense sends its
residual with its first dense gradient, and ``compressor.stats`` counts every
byte handed to the collectives (placeholders included).

None and FP16 (FP16 casts) hand Horovod the gradient itself, counted in the
statistics at every step, once a first step has passed through the buckets.
Otherwise a rank running Top-k would hand Horovod a one-element placeholder
where a rank running None or FP16 hands it the gradient, and Horovod's own
shape or dtype error would fire before ours; this way every rank exchanges the
headers of the same buckets, and every rank raises ``ranks disagree`` naming its
compressor. None and FP16 stop looking up names once one such check has
passed: every rank then runs the same compressor, and Horovod's own checks
cover the tensors.

``compress`` never waits for another rank: backward hooks and Horovod's
filling-in of missing gradients call it in an order that may differ between
ranks. Buckets launch with ``complete=False``; what must wait for another rank
(a layout's check, TernGrad's codes drawn with the shared scale) is done for
every exchange of the step at the step's first ``decompress``: Horovod's
``synchronize`` compresses every gradient before it decompresses any, so by
then every rank has started every collective waited for.

Horovod's reduction of the placeholder is the scaling it applies (1 for
``op=Average`` whatever ``gradient_predivide_factor``, N for ``op=Sum``), so the
decoded sum is divided by ``N / placeholder``; it is read on the host once (per
optimizer; per name for the tensors below).

``compress(tensor, name=...)`` names the tensor explicitly (your own calls), and
calls outside a Horovod optimizer (``hvd.allreduce(t, compression=...)``) have
no optimizer to bucket with: each such tensor is a bucket of its own, launched
in ``compress``. ``hvd.allreduce(t, name=..., compression=...)`` (and
``hvd.grouped_allreduce``) does not pass its name to ``compress``, so it is read
from that call on the stack (:func:`allreduce_call`). Without any name the
tensor is ``call.<i>``, the i-th tensor compressed since the last ``decompress``
(with a warning, once, for compressors that keep state under the name), as
Horovod itself names unnamed allreduces by call order: correct only when every
rank compresses the same tensors in the same order. Since such calls come in
the same order on every rank (``hvd.allreduce`` blocks until every rank made
it), their check is waited for in ``compress``, before Horovod's allreduce of
the placeholder: Horovod names an unnamed allreduce by the count of operations
the process issued, which differs between ranks whose compressors differ. None
and FP16 go through such a bucket the first time a (name, shape, dtype) is seen
in ``hvd.allreduce`` or with ``name=``, so ranks running different compressors
get ``ranks disagree`` on every rank there too (not Horovod's shape or dtype
mismatch), and hand Horovod the tensor afterwards; called by hand without a
name (no Horovod call to check with), they return the tensor.

Horovod 0.28.1 carries no bfloat16: bfloat16 gradients hand Horovod float32
placeholders (None: the gradient itself as float32, cast back in ``decompress``), and
our collectives go through :class:`~hvd_compress.transport.communicator.HorovodTorchCommunicator`,
which sums them in float32 and gathers them as raw 16-bit words. ``decompress`` returns
each result in its gradient's dtype and memory format (Horovod's optimizer sets
``p.grad`` to it, strides included: a ``channels_last`` gradient stays so).

TensorFlow tensors (``horovod.tensorflow``, ``horovod.tensorflow.keras``) go to
:mod:`hvd_compress.horovod.tensorflow_hooks`, which runs each exchange as one graph op.
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hvd_compress.transport.communicator import HorovodTorchCommunicator, horovod_carried, horovod_dtype
from hvd_compress.engine.exchange import BucketExchange, open_exchange
from hvd_compress.horovod.torch_buckets import Plan, Planned, in_layout_of
from hvd_compress.horovod.calls import allreduce_call


@dataclass
class _Calls:
    """A compressor's Horovod calls: the buckets of each optimizer, exchanges to complete, checks done."""

    index: int = 0
    decompressing: bool = False
    #: Horovod's reduction of each tensor's placeholder of ones (1: op=Average, N: op=Sum)
    reductions: Dict[str, float] = field(default_factory=dict)

    #: the fallback's warning was given
    warned: bool = False
    #: exchanges launched since the last ``decompress``, to complete at the next one (every path)
    pending: List[BucketExchange] = field(default_factory=list)
    #: (name, shape, dtype) of the tensors whose header every rank has exchanged (module docstring)
    checked: set = field(default_factory=set)
    #: a dense compressor (None, FP16) passed a header check: every rank runs the same one
    agreed: bool = False
    #: the buckets of each calling Horovod optimizer, by ``id``
    plans: Dict[int, Plan] = field(default_factory=dict)

    def plan_of(self, optimizer: Any, compressor: Any) -> Plan:
        """``optimizer``'s :class:`~hvd_compress.horovod.torch_buckets.Plan`, made at its first call."""
        plan = self.plans.get(id(optimizer))
        if plan is None or plan.owner() is not optimizer:
            plan = self.plans[id(optimizer)] = Plan(optimizer, compressor)
        return plan

    def complete_pending(self) -> None:
        """Complete every exchange this step launched (see the module docstring)."""
        pending, self.pending = self.pending, []
        for exchange in pending:
            exchange.complete()

    def next_name(self, warn: bool = True) -> str:
        """Fallback name: ``call.<i>`` for the i-th tensor since the last ``decompress``; ``warn``: say once
        that call order names it (a dense compressor keeps no state under the name: no warning)."""
        if self.decompressing:
            self.index, self.decompressing = 0, False
        self.index += 1
        if warn and not self.warned:
            self.warned = True
            warnings.warn(
                "hvd_compress: compress() was called outside horovod.torch's DistributedOptimizer and "
                "without name=...; gradients are identified by call order, which is only correct when "
                "every rank compresses the same gradients in the same order. Pass name= (the same on "
                "every rank), or use hvd_compress.torch.DistributedOptimizer",
                stacklevel=5,
            )
        return f"call.{self.index - 1}"


@dataclass
class _Context:
    #: the dtype of the result (``None``: that of Horovod's output)
    dtype: Any = None
    name: str = ""
    exchange: Optional[BucketExchange] = None
    #: None, FP16: the tensor's header check (Horovod's allreduce from the next step): drop its plan after
    check_only: bool = False
    #: the tensor our exchange moves, whose memory format its result takes
    grad: Any = None


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


def _owns(param: Any, tensor: Any) -> bool:
    """Whether ``tensor`` is ``param``'s gradient (or its dense form, ``sparse_as_dense``)."""
    grad = getattr(param, "grad", None)
    if grad is None:
        return False
    return grad is tensor or (grad.is_sparse and tuple(tensor.shape) == tuple(param.shape))


def caller(tensor: Any, depth: int = 8) -> Tuple[Any, Optional[str]]:
    """``(optimizer, name)``: the ``horovod.torch`` optimizer compressing ``tensor`` and its name for the
    parameter whose gradient ``tensor`` is, found on the call stack; ``(None, None)`` if none.

    ``horovod.torch``'s optimizer calls ``compress`` from
    ``_allreduce_grad_async(self, p)`` (or, with ``groups``, from a comprehension
    over ``p`` inside ``_grouped_allreduce_grad_async(self, ps)``) and names the
    allreduce ``self._parameter_names[p]``; the same name on every rank. Looked
    for within ``depth`` frames, from the one that called this function's caller.
    """
    frame = sys._getframe(2)
    param = None
    for _ in range(depth):
        if frame is None:
            break
        local = frame.f_locals
        if param is None and _owns(local.get("p"), tensor):
            param = local["p"]
        names = getattr(local.get("self"), "_parameter_names", None)
        if param is not None and isinstance(names, dict):
            return local["self"], names.get(param)
        frame = frame.f_back
    return None, None


def _calls(compressor: Any) -> _Calls:
    """What this route keeps for ``compressor`` (its run state's route data)."""
    return compressor.state.route_data("horovod.torch", _Calls)


def _direct(compressor: Any, tensor: Any):
    """None, FP16: the tensor (FP16: cast; a dtype Horovod cannot carry: as the one it carries,
    :func:`~hvd_compress.transport.communicator.horovod_carried`) for Horovod's own allreduce, counted in
    the statistics in the dtype the compressor sends (FP16: float16; None: the gradient's, so a bfloat16
    gradient that Horovod carries as float32 counts bfloat16's bytes, as the engine's dense sums do)."""
    wire = compressor.dense_wire_dtype
    if wire is None:
        sent, back = horovod_carried(tensor)
        itemsize = tensor.element_size()
    else:
        import torch

        sent, back = tensor.to(getattr(torch, wire)), True
        itemsize = sent.element_size()
    numel = tensor.numel()
    compressor.stats.add(numel * itemsize, numel * tensor.element_size(), numel, numel)
    return sent, _Context(dtype=None if back is None else tensor.dtype)


def compress(compressor: Any, tensor: Any, name: Optional[str] = None):
    """Horovod ``Compressor.compress``: record or send the gradient, return ``(placeholder, ctx)``.

    ``name``: the tensor's name, the same on every rank (then it is a bucket of
    its own); by default its parameter's name in the calling Horovod optimizer
    (:func:`caller`), and it joins that optimizer's buckets
    (:mod:`hvd_compress.horovod.torch_buckets`).
    """
    if _framework(tensor) == "tensorflow":
        from hvd_compress.horovod import tensorflow_hooks as horovod_tf

        return horovod_tf.compress(compressor, tensor)

    calls = _calls(compressor)
    dense = compressor.dense_only  # None, FP16: Horovod's own allreduce, once checked
    if dense and calls.agreed:
        return _direct(compressor, tensor)
    if name is None:
        optimizer, name = caller(tensor)
        if optimizer is not None and name is not None:
            plan = calls.plan_of(optimizer, compressor)
            if name in plan:
                return plan.record(compressor, _communicator(), calls, name, tensor)
    # hvd.allreduce(t, compression=...) blocks until every rank has made the same call, and calls
    # named by order come in the same order on every rank: the check may be waited for right here
    in_order, horovod = name is None, False
    if name is None:  # hvd.allreduce(t, name=..., compression=...): Horovod's name, else call order
        horovod, name = allreduce_call(compressor, tensor, "horovod.torch.mpi_ops")
    if dense and (name is None and not horovod or (name, tuple(tensor.shape), tensor.dtype) in calls.checked):
        return _direct(compressor, tensor)  # checked, or called by hand without a name: nothing to check with
    if name is None:
        name = calls.next_name(warn=not dense)
    seen = (name, tuple(tensor.shape), tensor.dtype)
    if compressor.state.route is None:
        compressor.state.route = "horovod.torch"
    exchange = open_exchange(compressor, _communicator(), f"hvd_compress.{name}")
    exchange.add(name, tensor)
    if dense:
        calls.checked.add(seen)
    # with name=..., ranks may compress in different orders: wait for no one here. In order, the check
    # comes before Horovod's allreduce of the placeholder, whose name (Horovod counts every handle a
    # process issued when it names an allreduce by order) would differ where ranks' compressors do
    exchange.launch(complete=in_order)
    calls.pending.append(exchange)
    placeholder = tensor.new_ones(1, dtype=horovod_dtype(tensor.dtype))
    compressor.stats.add(placeholder.element_size(), 0, 0, 0)
    return placeholder, _Context(tensor.dtype, name, exchange, check_only=dense, grad=tensor)


def decompress(compressor: Any, output: Any, ctx: Any):
    """Horovod ``Compressor.decompress``: wait for our collectives, return the dense gradient."""
    if _framework(output) == "tensorflow":
        from hvd_compress.horovod import tensorflow_hooks as horovod_tf

        return horovod_tf.decompress(compressor, output, ctx)
    calls = _calls(compressor)
    calls.decompressing = True  # the next compress starts a new step (fallback names restart at 0)
    if isinstance(ctx, Planned):
        return ctx.plan.decompress(compressor, _communicator(), calls, output, ctx)
    calls.complete_pending()
    if ctx is None:  # Horovod's own sparse allreduce (sparse gradients without sparse_as_dense)
        return output
    if ctx.exchange is None:
        return output if ctx.dtype is None else output.to(ctx.dtype)
    world = _communicator().size
    reduced = calls.reductions.get(ctx.name)
    if reduced is None:  # read once per tensor: Horovod applies the same op every step
        reduced = calls.reductions[ctx.name] = float(output.reshape(-1)[0])
    divisor = world / reduced  # N for op=Average, 1 for op=Sum
    if divisor == world:
        result = ctx.exchange.finish(average=True)[ctx.name]
    else:
        result = ctx.exchange.finish(average=False)[ctx.name] / divisor
    result = in_layout_of(result, ctx.grad)
    if ctx.check_only:  # None, FP16: checked; Horovod's allreduce moves the tensor from now on
        compressor.state.drop_bucket(f"hvd_compress.{ctx.name}")
        calls.agreed = True
    return result
