"""Horovod Elastic (``hvd.elastic.run`` with ``TorchState`` or ``KerasState``) with compression state.

:func:`attach` adds to a Horovod elastic state a handler of one route's compression state
(:class:`CompressionStateHandler`) and a reset callback, which keep this contract:

- per-process arrays (residuals, momentum-correction velocities, RegTop-k's posterior) follow the
  process, never a rank number, and are never broadcast; a process that joins starts at zero; a lost
  process's residual is lost with it (each rank's is logged at each commit on the logger
  ``hvd_compress.elastic`` at level INFO; one host read per commit, only where that level is on);
- ``state.commit()`` keeps this process's arrays and ``restore()`` (after ``HorovodInternalError``) puts
  them back with the model: the residuals roll back to the last commit;
- optionally (torch, ``register(..., flush=True)``) every commit first applies the residuals: all
  ranks' averaged by one dense allreduce, applied by one step of the optimizer, then zero; the model
  saved then holds all the gradient mass, and a lost process loses none;
- at a reset (a process added, removed or replaced, ranks renumbered) every surviving rank keeps its
  arrays and starts afresh what must be the same on every rank or was measured for the old world
  (:meth:`~hvd_compress.algorithms.state.CompressorState.reset_for_new_world`): the step count (a
  shared index set's leader is rank 0 again, reused thresholds select exactly first), kept thresholds,
  the ``aggregate`` rule's rates, the plans, ``Auto``'s measurements and decisions, the step in
  progress (its exchanges, stock Horovod's recorded gradients), the record of a checkpoint's rank; a
  joining process starts there too, so the ranks agree without a collective (reset callbacks run on
  the survivors alone, and ``sync()`` is skipped where workers were only removed);
- a compressor put into the state as an ordinary value (``TorchState(compression=...)``), which Horovod
  would broadcast from rank 0, stops every rank with an error naming ``register``.

The framework's ``register(state, optimizer or compression)`` (:mod:`hvd_compress.torch.elastic`,
:mod:`hvd_compress.keras.elastic`) finds the route's state and calls :func:`attach`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from hvd_compress.algorithms.base import is_compression
from hvd_compress.algorithms.state import refused_broadcast

LOG = logging.getLogger("hvd_compress.elastic")


class CompressionStateHandler:
    """A handler of a Horovod elastic state (``save``, ``restore``, ``sync``, as Horovod's
    ``StateHandler``) for one route's run state ``run`` of ``compression``; ``forget_step``: what drops
    the route's step in progress at a reset (the drop-in torch optimizer's), or ``None``."""

    def __init__(self, compression: Any, run: Any, forget_step: Optional[Callable[[], None]] = None,
                 flush: Optional[Callable[[], None]] = None) -> None:
        self.value, self.run, self.forget_step, self.flush = compression, run, forget_step, flush
        self.saved = run.snapshot()

    def save(self) -> None:
        """``state.commit()``: the residuals flushed into the model first (``flush``, a collective: every
        rank commits together), then this process's arrays as they are now."""
        if self.flush is not None:
            self.flush()
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
        if self.forget_step is not None:
            self.forget_step()


def held_residual(run: Any) -> float:
    """The L1 norm of every residual ``run`` holds (one host read; at commits, for the log)."""
    run.flush_buckets()
    total = 0.0
    for name in run.memory.names():
        residual = run.memory.peek(name, "residual")
        if residual is not None:
            total += float(abs(residual).sum())
    return total


def refuse_ordinary_values(state: Any) -> None:
    """A compressor among ``state``'s ordinary values (broadcast from rank 0) is refused."""
    for name, value in getattr(state, "_saved_state", {}).items():
        if is_compression(value):
            raise refused_broadcast(f"{value!r} ({type(state).__name__}(..., {name}=...))")


def attach(state: Any, handler: CompressionStateHandler) -> CompressionStateHandler:
    """Put ``handler`` into the elastic ``state``: first among ``TorchState``'s handlers; around the
    ``save``/``restore`` of a state without handlers (``KerasState``), saving before it; and its reset
    callback."""
    handlers = getattr(state, "_handlers", None)
    if isinstance(handlers, dict):  # first: a flush changes the model before its handler saves it
        others = list(handlers.items())
        handlers.clear()
        handlers[f"hvd_compress.{len(others)}"] = handler
        handlers.update(others)
    else:
        save, restore = state.save, state.restore

        def save_both() -> None:
            handler.save()
            save()

        def restore_both() -> None:
            restore()
            handler.restore()

        state.save, state.restore = save_both, restore_both
    state.register_reset_callbacks([handler.reset])
    return handler
