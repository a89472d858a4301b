"""``hvd_compress.torch.DistributedOptimizer``: compressed, fused and overlapped gradient exchange.

Same signature as ``horovod.torch.DistributedOptimizer``. Parameters are split
once into buckets (reverse registration order, the order backward produces
gradients; one dtype and device per bucket; at most ``bucket_cap_mb`` of
gradients each), identical on every rank. A hook on each parameter counts its
gradient in; when a bucket is complete its tensors are encoded and its fused
collectives start (:class:`~hvd_compress.engine.exchange.BucketExchange`) while
backward goes on. ``synchronize()`` launches what is left, waits, and writes the
averaged gradients back: at the end of the backward that completed every bucket
(as DDP does, so that what reads ``p.grad`` after ``backward()``, such as
``torch.amp.GradScaler``'s ``unscale_``, sees the exchanged gradients and every
rank decides alike), else in ``step()``. Parameters that backward did not reach
(unused layers, branches not taken, on some ranks or all) send zeros, as with
Horovod; then ``step()`` synchronizes, and a gradient changed in place between
its backward and ``step()`` (``GradScaler.unscale_``, clipping) is refused, since
its exchange has already started. Buckets launch as soon as they are complete without
waiting for other ranks (TernGrad's codes, which need the shared scale, are
sent at ``synchronize()``); over transports that match collectives by order
they launch in bucket order (a bucket waits for the buckets before it).

The optimizer runs its compressor on a run state of its own,
``optimizer.compression_state`` (a
:class:`~hvd_compress.algorithms.state.CompressorState`: residuals keyed by
parameter name, random streams, fused plans, statistics), so one compressor can
serve several optimizers without mixing their residuals. The state is saved in
``optimizer.state_dict()`` under ``"hvd_compress"``, so a checkpoint resumes
exactly.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch

from hvd_compress.engine.exchange import BucketExchange, open_exchange
from hvd_compress.engine.nonfinite import raise_if_nonfinite
from hvd_compress.horovod.torch_buckets import cut
from hvd_compress.torch.ddp import densified
from hvd_compress.algorithms import Compressor, as_compressor
from hvd_compress.algorithms.base import NonFiniteGradientError
from hvd_compress.algorithms.checkpoint import check_names, writer
from hvd_compress.algorithms.validation import check_single_momentum, param_group_momenta


ROUTE = "hvd_compress.torch.DistributedOptimizer"


def _is_sum(op: Any) -> bool:
    if op is None or op == "average":
        return False
    if op == "sum":
        return True
    import horovod.torch as hvd

    if op == hvd.Sum:
        return True
    if op == hvd.Average:
        return False
    raise ValueError(f"hvd_compress: op must be hvd.Average or hvd.Sum, got {op!r}")


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        named_parameters,
        compression: Compressor,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        bucket_cap_mb: float,
        communicator: Any,
    ) -> None:
        super(self.__class__, self).__init__(params)
        if communicator is None:
            from hvd_compress.transport.communicator import HorovodTorchCommunicator

            communicator = HorovodTorchCommunicator()
        self._comm = communicator
        self._compression = compression
        self._average = not _is_sum(op)
        self._predivide = float(gradient_predivide_factor)
        if self._predivide != 1.0 and not self._average:
            raise ValueError("hvd_compress: gradient_predivide_factor needs op=hvd.Average")
        self._passes = int(backward_passes_per_step)
        all_params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is not None:
            named = [(n, p) for n, p in named_parameters if p.requires_grad]
            if {id(p) for _, p in named} != {id(p) for p in all_params}:
                raise ValueError(
                    "hvd_compress: named_parameters must name exactly the optimizer's trainable parameters"
                )
        else:
            named = [(f"param.{i}", p) for i, p in enumerate(all_params)]
        if len({n for n, _ in named}) != len(named):
            raise ValueError("hvd_compress: parameter names must be unique")
        self._names = {id(p): n for n, p in named}
        self._named_by_position = named_parameters is None
        #: the run state this optimizer runs its compressor on (the compressor's own when no other route holds it)
        self.compression_state = compression.state_for(self, ROUTE)
        self._params = dict(named)
        self._buckets = cut(list(reversed(named)), int(bucket_cap_mb * 2**20))  # backward's order
        self._bucket_of = {n: b for b, names in enumerate(self._buckets) for n in names}
        self._ready: List[set] = [set() for _ in self._buckets]
        self._in_flight: Dict[int, BucketExchange] = {}
        self._delay = {n: self._passes for n in self._params}
        # _synchronized_by_backward: the end of a backward synchronized (not synchronize()), step() takes it
        self._synchronized = self._synchronized_by_backward = self._end_queued = False
        self._nonfinite_error: Optional[Exception] = None  # strict mode's, at the end of a backward: step() raises it
        self._versions: Dict[str, tuple] = {}  # each counted-in gradient's (id, version) at its hook
        self._should_synchronize = True
        # Buckets go in bucket order when the transport matches collectives by order: a bucket
        # holding a gradient that backward did not produce on some rank (a branch not taken)
        # is complete at different times on different ranks. Otherwise they go as they are
        # complete and wait for no other rank there (launch(complete=False)).
        self._in_order = communicator.matches_by_order
        self._warned_sparse: set = set()
        hook = _weak_hook(self)
        for p in self._params.values():
            p.register_post_accumulate_grad_hook(hook)

    # ----------------------------------------------------------------- hooks
    def _hook(self, p: torch.Tensor) -> None:
        name = self._names[id(p)]
        if self._synchronized:
            raise AssertionError(
                "hvd_compress: gradients computed after synchronize() and before step() (the exchange "
                "of this step's gradients is done: after the backward that completed every bucket, or "
                "an explicit synchronize()); call step() (or zero_grad() for a step not taken) before "
                "the next backward, or accumulate with backward_passes_per_step="
            )
        if not self._end_queued:  # once per backward: synchronize at its end if every bucket is out
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(_weak_end_of_backward(self))
        self._delay[name] -= 1
        if self._delay[name] > 0:
            return
        self._versions[name] = (id(p.grad), p.grad._version) if p.grad is not None else None
        bucket = self._bucket_of[name]
        self._ready[bucket].add(name)
        if not self._in_order:
            if len(self._ready[bucket]) == len(self._buckets[bucket]):
                self._launch(bucket)
            return
        while (  # launch complete buckets in bucket order, the same on every rank
            len(self._in_flight) < len(self._buckets)
            and len(self._ready[len(self._in_flight)]) == len(self._buckets[len(self._in_flight)])
        ):
            self._launch(len(self._in_flight))

    def _launch(self, bucket: int) -> None:
        exchange = open_exchange(self._compression, self._comm, f"hvd_compress.bucket{bucket}", self.compression_state)
        for name in self._buckets[bucket]:
            p = self._params[name]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if grad.is_sparse:
                grad = densified(name, grad, self._warned_sparse,
                                 "it is exchanged dense (compressed like any other) and written back dense",
                                 stacklevel=3)
            exchange.add(name, grad if self._predivide == 1.0 else grad / self._predivide)
        exchange.launch(complete=self._in_order)
        self._in_flight[bucket] = exchange

    def _end_of_backward(self) -> None:
        """After a backward: synchronize when every bucket has been launched (every parameter's
        gradient counted in, the last of ``backward_passes_per_step`` passes), as DDP does at the end
        of backward; otherwise ``step()`` will (parameters this backward did not reach)."""
        self._end_queued = False
        if not self._synchronized and len(self._in_flight) == len(self._buckets):
            try:
                self._synchronize()
            except NonFiniteGradientError as error:  # strict mode raises it where it always has: in step()
                self._nonfinite_error = error
                return
            self._synchronized_by_backward = True

    def _raise_deferred(self) -> None:
        """Raise strict mode's error of the last backward's exchange (``nonfinite="raise"``), once."""
        error, self._nonfinite_error = self._nonfinite_error, None
        if error is not None:
            raise error

    def _changed_since_backward(self) -> List[str]:
        """The parameters whose gradient was replaced or changed in place after its hook counted it in."""
        changed = []
        for name, seen in self._versions.items():
            grad = self._params[name].grad
            if seen != ((id(grad), grad._version) if grad is not None else None):
                changed.append(name)
        return changed

    # ------------------------------------------------------------ public API
    def synchronize(self) -> None:
        """Finish every bucket's exchange and write the averaged gradients into ``p.grad``.

        After a backward that already did (every bucket complete: module docstring) it does
        nothing, so ``synchronize()``, ``unscale_``, ``with skip_synchronize(): step()`` (Horovod's
        recipe) works either way."""
        self._raise_deferred()
        if self._synchronized_by_backward:
            self._synchronized_by_backward = False  # explicit from here: step() needs skip_synchronize()
            return
        changed = self._changed_since_backward()
        if changed:
            self._versions = {}
            what = ", ".join(repr(n) for n in changed[:3]) + (" and others" if len(changed) > 3 else "")
            raise RuntimeError(_read_too_early(f"the gradient of {what} changed after backward()"))
        self._synchronize()

    def _synchronize(self) -> None:
        for bucket in range(len(self._buckets)):
            if bucket not in self._in_flight:
                self._launch(bucket)
        for exchange in self._in_flight.values():  # before any finish: ranks may differ in launch order
            exchange.complete()
        grads, results, exchanged = [], [], {}
        for bucket in range(len(self._buckets)):
            for name, result in self._in_flight.pop(bucket).finish(self._average).items():
                exchanged[name] = result
                p = self._params[name]
                if self._predivide != 1.0:
                    result = result * self._predivide
                if p.grad is None or p.grad.is_sparse:
                    p.grad = result.to(p.dtype)
                else:
                    grads.append(p.grad)
                    results.append(result)
        if grads:
            torch._foreach_copy_(grads, results)  # one launch for all parameters
        self._ready = [set() for _ in self._buckets]
        self._delay = {n: self._passes for n in self._params}
        self._versions = {}
        self._synchronized = True
        if self._compression.nonfinite == "raise":
            self._synchronized = False  # the step is not taken; the next backward starts afresh
            raise_if_nonfinite(exchanged)
            self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` without synchronizing: after an explicit ``synchronize()`` (e.g. to clip)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        self._raise_deferred()
        if _called_by_state_broadcast():  # zero gradients on every rank: a local step, as for Horovod's optimizer
            return super(self.__class__, self).step(closure)
        if self._should_synchronize and not self._synchronized_by_backward:
            if self._synchronized:
                raise AssertionError(
                    "hvd_compress: synchronize() was already called; use "
                    "`with optimizer.skip_synchronize(): optimizer.step()`"
                )
            if _called_by_grad_scaler():  # its unscale_ read (and changed) the gradients before their exchange
                self._versions = {}
                raise RuntimeError(_read_too_early("torch.amp.GradScaler.step() unscaled the gradients"))
            self.synchronize()
        self._synchronized = self._synchronized_by_backward = self._end_queued = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._in_flight or self._versions:
            raise AssertionError(
                "hvd_compress: zero_grad() while gradients are being exchanged (some parameters received "
                "no gradient in this backward, so the exchange did not finish at its end); call step() or "
                "synchronize() first. With torch.amp.GradScaler, synchronize before the scaler reads the "
                "gradients: scaler.scale(loss).backward(); optimizer.synchronize(); "
                "scaler.unscale_(optimizer); with optimizer.skip_synchronize(): scaler.step(optimizer); "
                "scaler.update()"
            )
        # A step skipped after synchronize() (GradScaler on an overflow, a user's own check)
        # never calls step(): zero_grad() starts the next iteration all the same.
        self._synchronized = self._synchronized_by_backward = self._end_queued = False
        self._nonfinite_error = None
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def _forget_step(self) -> None:
        """Drop what a step in progress left (exchanges in flight, gradients counted in, the flags): a
        step that a failed collective interrupted (Horovod Elastic's reset) is never finished."""
        self._in_flight = {}
        self._ready = [set() for _ in self._buckets]
        self._delay = {n: self._passes for n in self._params}
        self._versions = {}
        self._synchronized = self._synchronized_by_backward = self._end_queued = False
        self._nonfinite_error = None

    def state_dict(self):
        state = super(self.__class__, self).state_dict()
        self._compression.bind(self._comm.rank, self._comm.size)  # the writer's rank and world, step or not
        state["hvd_compress"] = self._compression.state_dict(self.compression_state)
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        compressor_state = state_dict.pop("hvd_compress", None)
        super(self.__class__, self).load_state_dict(state_dict)
        if compressor_state is not None:
            advice = " (without named_parameters= it names its parameters param.<i>)" if self._named_by_position else ""
            check_names(compressor_state.get("tensors") or {}, writer(compressor_state), self._params.__contains__,
                        f"this {self.compression_state.route}", advice)
            self._compression.load_state_dict(compressor_state, self.compression_state)


def _weak_hook(optimizer: _DistributedOptimizer) -> Any:
    """The parameters' hook, holding the optimizer weakly.

    A bound method would close a cycle (parameter -> hook -> optimizer -> parameter)
    through torch's C++ hook list, which the garbage collector does not see: no
    optimizer, its state or its residuals would ever be freed. Once the optimizer is
    gone the hook does nothing.
    """
    ref = weakref.ref(optimizer)

    def hook(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._hook(p)

    return hook


#: the module of ``torch.amp.GradScaler``, whose ``step`` calls ``optimizer.step()``
GRAD_SCALER_MODULE = "torch.amp.grad_scaler"
#: (module, function) of Horovod's optimizer-state broadcast
BROADCAST_OPTIMIZER_STATE = ("horovod.torch.functions", "broadcast_optimizer_state")


def _called_by_grad_scaler(depth: int = 4) -> bool:
    """Whether ``step()`` was called by ``torch.amp.GradScaler.step`` (its ``_maybe_opt_step``)."""
    return _called_from(GRAD_SCALER_MODULE, None, depth)


def _called_by_state_broadcast(depth: int = 4) -> bool:
    """Whether ``step()`` was called by ``horovod.torch.broadcast_optimizer_state`` (also Horovod
    Elastic's ``TorchState.sync()``), which fills an empty optimizer state by a step on zero gradients."""
    return _called_from(*BROADCAST_OPTIMIZER_STATE, depth)


def _called_from(module: str, function: Any, depth: int) -> bool:
    """Whether a frame of ``module``'s ``function`` (any of its functions: ``None``) is among the
    ``depth`` frames above the caller of this function's caller."""
    frame = sys._getframe(3)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == module and function in (None, frame.f_code.co_name):
            return True
        frame = frame.f_back
    return False


def _read_too_early(what: str) -> str:
    """The error for gradients read or changed (GradScaler's ``unscale_``, clipping) before their exchange
    finished: a backward that left parameters without a gradient does not finish it at its end."""
    return (
        f"hvd_compress: {what} before the exchange of this step's gradients finished: it started during "
        "backward, with the gradients as they were then. Some parameters received no gradient in this "
        "backward (an unused layer, a branch not taken), so the exchange could not finish at its end, as it "
        "does otherwise; finish it yourself before torch.amp.GradScaler (or clipping) reads the gradients:\n"
        "    scaler.scale(loss).backward()\n"
        "    optimizer.synchronize()\n"
        "    scaler.unscale_(optimizer)          # optional: clip here\n"
        "    with optimizer.skip_synchronize():\n"
        "        scaler.step(optimizer)\n"
        "    scaler.update()"
    )


def _weak_end_of_backward(optimizer: _DistributedOptimizer) -> Any:
    """:meth:`_DistributedOptimizer._end_of_backward` for autograd's ``queue_callback``, holding the
    optimizer weakly (as :func:`_weak_hook`)."""
    ref = weakref.ref(optimizer)

    def end_of_backward() -> None:
        live = ref()
        if live is not None:
            live._end_of_backward()

    return end_of_backward


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression: Optional[Compressor] = None,
    backward_passes_per_step: int = 1,
    op: Any = None,
    gradient_predivide_factor: float = 1.0,
    bucket_cap_mb: float = 25.0,
    communicator: Any = None,
    nonfinite: Optional[str] = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses the compressed average of all ranks' gradients.

    Arguments as ``horovod.torch.DistributedOptimizer``; in addition ``bucket_cap_mb``
    (gradient bytes per fused bucket), ``communicator`` (default: Horovod's;
    any :class:`~hvd_compress.transport.communicator.Communicator`) and ``nonfinite``
    (``"raise"``: :class:`~hvd_compress.engine.nonfinite.NonFiniteGradientError` on every
    rank at a step whose gradients hold NaN/Inf, one host read per step; default: the
    compressor's ``nonfinite``, ``"propagate"``: NaN/Inf reach every rank's gradient as
    in a dense allreduce). ``compression`` is one of our compressors (default: none).

    A sparsifier with momentum correction (``TopK(0.01, momentum=0.9)``, Deep Gradient
    Compression's) owns the momentum: ``optimizer`` must run without its own
    (``torch.optim.SGD(params, lr, momentum=0)``); a ``param_group`` with ``momentum > 0``
    raises ``ValueError`` here.
    """
    compression = as_compressor(compression)
    check_single_momentum(
        compression, param_group_momenta(optimizer.param_groups), "hvd_compress.torch.DistributedOptimizer"
    )
    if nonfinite is not None:
        compression.nonfinite = nonfinite  # in its configuration: ranks that disagree stop at once
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        bucket_cap_mb,
        communicator,
    )
