"""Horovod Elastic (``hvd.elastic.run``, ``hvd.elastic.TorchState``) with compression state.

    import hvd_compress.torch as hvd
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0, batch=0)
    hvd.elastic.register(state, optimizer)      # stock horovod.torch: register(state, compression)

Everything else here (``run``, ``TorchState``, ``ElasticSampler``) is ``horovod.torch.elastic``'s own,
looked up on first use. :func:`register` adds to ``state`` a handler of the route's compression state
(:class:`CompressionStateHandler`) and a reset callback, which keep this contract:

- per-process arrays (residuals, momentum-correction velocities, RegTop-k's posterior) follow the
  process, never a rank number, and are never broadcast; a process that joins starts at zero; a lost
  process's residual is lost with it (each rank's is logged at each commit on the logger
  ``hvd_compress.elastic`` at level INFO; one host read per commit, only where that level is on);
- ``state.commit()`` keeps this process's arrays and ``restore()`` (after ``HorovodInternalError``) puts
  them back with the model: the residuals roll back to the last commit;
- at a reset (a process added, removed or replaced, ranks renumbered) every surviving rank keeps its
  arrays and starts afresh what must be the same on every rank or was measured for the old world
  (:meth:`~hvd_compress.algorithms.state.CompressorState.reset_for_new_world`): the step count (a
  shared index set's leader is rank 0 again, reused thresholds select exactly first), kept thresholds,
  the ``aggregate`` rule's rates, the plans, ``Auto``'s measurements and decisions, the step in
  progress (its exchanges, stock Horovod's recorded gradients), the record of a checkpoint's rank; a
  joining process starts there too, so the ranks agree without a collective (reset callbacks run on
  the survivors alone, and ``sync()`` is skipped where workers were only removed);
- a compressor put into the state as an ordinary value (``TorchState(compression=...)``), which Horovod
  would broadcast from rank 0, stops every rank with an error naming :func:`register`.
"""

from __future__ import annotations

import logging
from typing import Any

from hvd_compress.algorithms.base import is_compression
from hvd_compress.algorithms.state import refused_broadcast

LOG = logging.getLogger("hvd_compress.elastic")


def __getattr__(name: str) -> Any:
    import horovod.torch.elastic as horovod_elastic

    return getattr(horovod_elastic, name)


class CompressionStateHandler:
    """A handler of ``hvd.elastic.TorchState`` (``save``, ``restore``, ``sync``, as Horovod's
    ``StateHandler``) for one route's run state ``run`` of ``compression``; ``optimizer``: the drop-in
    optimizer whose step in progress a reset drops (``None`` on the stock route)."""

    def __init__(self, compression: Any, run: Any, optimizer: Any = None) -> None:
        self.value, self.run, self.optimizer = compression, run, optimizer
        self.saved = run.snapshot()

    def save(self) -> None:
        """``state.commit()``: this process's arrays as they are now."""
        self.saved = self.run.snapshot()
        if LOG.isEnabledFor(logging.INFO):
            LOG.info("hvd_compress: this process holds residuals of L1 norm %.6g (lost if it is lost)",
                     held_residual(self.run))

    def restore(self) -> None:
        """``state.restore()`` (after ``HorovodInternalError``): back to the last commit."""
        self.run.roll_back(self.saved)

    def sync(self) -> None:
        """Per-process state is never broadcast (``state.sync()``): nothing to do."""

    def set_value(self, value: Any) -> None:
        raise TypeError("hvd_compress: the compression state's handler is not an attribute to assign")

    def reset(self) -> None:
        """The reset callback: the rules of a new world, and the step in progress dropped."""
        self.run.reset_for_new_world()
        if self.optimizer is not None:
            self.optimizer._forget_step()


def held_residual(run: Any) -> float:
    """The L1 norm of every residual ``run`` holds (one host read; at commits, for the log)."""
    run.flush_buckets()
    total = 0.0
    for name in run.memory.names():
        residual = run.memory.peek(name, "residual")
        if residual is not None:
            total += float(abs(residual).sum())
    return total


def _route_of(holder: Any) -> tuple:
    """``(compression, run state, drop-in optimizer or None)`` of ``register``'s ``holder``."""
    run = getattr(holder, "compression_state", None)
    if run is not None and hasattr(holder, "_forget_step"):  # hvd_compress.torch / .mpi DistributedOptimizer
        return holder._compression, run, holder
    if is_compression(holder):  # horovod.torch's optimizer runs the compressor on its own state
        return holder, holder.state, None
    inner = getattr(holder, "_compression", None)  # horovod.torch.DistributedOptimizer(compression=ours)
    if is_compression(inner):
        return inner, inner.state, None
    raise TypeError(f"hvd_compress: register() takes the DistributedOptimizer or the compression it runs, got "
                    f"{type(holder).__name__}")


def _refuse_ordinary_values(state: Any) -> None:
    """A compressor among ``state``'s ordinary values (broadcast from rank 0) is refused."""
    for name, value in getattr(state, "_saved_state", {}).items():
        if is_compression(value):
            raise refused_broadcast(f"{value!r} (TorchState(..., {name}=...))")


def register(state: Any, holder: Any) -> CompressionStateHandler:
    """Keep the compression state of ``holder`` (a drop-in ``DistributedOptimizer``, or the compression
    given to ``horovod.torch.DistributedOptimizer``, or that optimizer) in the elastic ``state``
    (``hvd.elastic.TorchState``) by the rules of the module docstring; call it on every process, after
    making ``state``. Returns the handler."""
    _refuse_ordinary_values(state)
    compression, run, optimizer = _route_of(holder)
    handler = CompressionStateHandler(compression, run, optimizer)
    state._handlers[f"hvd_compress.{len(state._handlers)}"] = handler
    state.register_reset_callbacks([handler.reset])
    return handler
