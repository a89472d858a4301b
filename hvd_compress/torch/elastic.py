"""Horovod Elastic (``hvd.elastic.run``, ``hvd.elastic.TorchState``) with compression state.

    import hvd_compress.torch as hvd
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    hvd.elastic.register(state, optimizer)      # stock horovod.torch: register(state, compression or optimizer)
    hvd.elastic.register(state, optimizer, flush=True)  # a commit applies the residuals first: none lost

Everything else here (``run``, ``TorchState``, ``ElasticSampler``) is ``horovod.torch.elastic``'s own,
looked up on first use. :func:`register` keeps the contract of :mod:`hvd_compress.horovod.elastic`.
"""

from __future__ import annotations

from typing import Any, Dict

from hvd_compress.algorithms.base import is_compression
from hvd_compress.horovod.elastic import (  # noqa: F401  (held_residual: the figure each commit logs)
    CompressionStateHandler, attach, held_residual, refuse_ordinary_values)


def __getattr__(name: str) -> Any:
    import horovod.torch.elastic as horovod_elastic

    return getattr(horovod_elastic, name)


def _route_of(holder: Any) -> tuple:
    """``(compression, run state, what drops the step in progress or None)`` of ``register``'s ``holder``."""
    run = getattr(holder, "compression_state", None)
    if run is not None and hasattr(holder, "_forget_step"):  # hvd_compress.torch / .mpi DistributedOptimizer
        return holder._compression, run, holder._forget_step
    if is_compression(holder):  # horovod.torch's optimizer runs the compressor on its own state
        return holder, holder.state, None
    inner = getattr(holder, "_compression", None)  # horovod.torch.DistributedOptimizer(compression=ours)
    if is_compression(inner):
        return inner, inner.state, None
    raise TypeError(f"hvd_compress: register() takes the DistributedOptimizer or the compression it runs, got "
                    f"{type(holder).__name__}")


def register(state: Any, holder: Any, flush: bool = False) -> CompressionStateHandler:
    """Keep the compression state of ``holder`` (a drop-in ``DistributedOptimizer``, or the compression
    given to ``horovod.torch.DistributedOptimizer``, or that optimizer) in the elastic ``state``
    (``hvd.elastic.TorchState``) by the contract of :mod:`hvd_compress.horovod.elastic`; call it on
    every process, after making ``state``. ``flush=True`` (``holder`` an optimizer): at each commit
    the residuals are applied and zeroed (:func:`flush_residuals`). Returns the handler."""
    refuse_ordinary_values(state)
    compression, run, forget_step = _route_of(holder)
    flush_now = None
    if flush:
        params = _named_parameters(holder)
        flush_now = lambda: flush_residuals(holder, run, params)  # noqa: E731
    return attach(state, CompressionStateHandler(compression, run, forget_step, flush_now))


def _named_parameters(optimizer: Any) -> Dict[str, Any]:
    """The parameters of a drop-in or ``horovod.torch`` optimizer by the names its compression uses."""
    named = getattr(optimizer, "_params", None)  # hvd_compress.torch.DistributedOptimizer
    if isinstance(named, dict):
        return dict(named)
    names = getattr(optimizer, "_parameter_names", None)  # horovod.torch.DistributedOptimizer
    if isinstance(names, dict) and not is_compression(optimizer):
        return {name: param for param, name in names.items()}
    raise TypeError("hvd_compress: register(state, ..., flush=True) applies residuals with the optimizer: pass "
                    "the DistributedOptimizer (drop-in or horovod.torch's), not the compression")


def flush_residuals(optimizer: Any, run: Any, params: Dict[str, Any]) -> None:
    """The residuals applied: ``R = mean over ranks of each rank's residuals`` (one allreduce of the
    model's size, zeros where a rank holds none, e.g. one that joined since), then one step of the
    wrapped optimizer (``optimizer``'s class's base) on ``p.grad = R``, then every residual zero
    (:func:`clear_residuals`). A collective: every rank commits together.
    The gradients in ``p.grad`` are put back after the step."""
    import horovod.torch as hvd
    import torch

    run.flush_buckets()
    names = sorted(params)
    parts = []
    for name in names:
        param, residual = params[name], run.memory.peek(name, "residual")
        parts.append(torch.zeros(param.numel(), dtype=param.dtype, device=param.device) if residual is None
                     else torch.as_tensor(residual).reshape(-1).to(param.dtype))
    average = hvd.allreduce(torch.cat(parts), op=hvd.Average, name="hvd_compress.elastic.flush")
    kept, offset = {}, 0
    for name in names:
        param = params[name]
        kept[name] = param.grad
        param.grad = average[offset:offset + param.numel()].view_as(param)
        offset += param.numel()
    super(optimizer.__class__, optimizer).step()
    for name in names:
        params[name].grad = kept[name]
    clear_residuals(run)


def clear_residuals(run: Any) -> None:
    """Every residual of ``run`` zero (after :func:`flush_residuals` applied them): the fused buckets'
    in place (their plans go on), the per-name memory's, and residuals a bucket would send once dense."""
    for bucket in run.buckets.values():
        if bucket.residual is not None:
            bucket.residual.zero_()
        bucket.flush_into_dense.clear()
    for name in run.memory.names():
        residual = run.memory.peek(name, "residual")
        if residual is not None:
            run.memory.set(name, "residual", residual * 0)
