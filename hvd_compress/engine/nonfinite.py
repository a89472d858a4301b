"""Strict mode for non-finite gradients: ``nonfinite="raise"``.

By default (``"propagate"``) a NaN/Inf gradient on any rank makes that tensor's
exchanged result non-finite on every rank, as the dense allreduce it replaces
would, and ``GradScaler`` or the user's own check skips the step everywhere (the
flag travels with the data; nothing is read back to the host). In strict mode a
route that owns the step (the drop-in optimizers of :mod:`hvd_compress.torch`
and :mod:`hvd_compress.mpi`) also checks every exchanged result once per step:
``max |x|`` of every tensor in one multi-tensor kernel, then one host read of
whether all are finite. The results are the same on every rank, so every rank
raises the same :class:`NonFiniteGradientError` at the same step, naming the
tensors. The route raises after finishing its own bookkeeping, so the optimizer
stays usable: ``zero_grad()`` and the next step train normally. Residuals of
the non-finite tensors keep their values from before the step.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from hvd_compress.algorithms.base import NonFiniteGradientError


def raise_if_nonfinite(results: Mapping[str, Any]) -> None:
    """Raise :class:`NonFiniteGradientError` when any of the torch tensors ``results`` holds NaN/Inf.

    One host read when all are finite (a second one, to name the tensors, when not).
    """
    import torch

    named = [(name, tensor) for name, tensor in results.items() if tensor.numel()]
    if not named:
        return
    peaks = torch._foreach_norm([tensor for _, tensor in named], math.inf)
    device = named[0][1].device
    finite = torch.isfinite(torch.stack([peak.to(device, torch.float32) for peak in peaks]))
    if bool(finite.all()):
        return
    bad = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    shown = ", ".join(f"'{name}'" for name in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    raise NonFiniteGradientError(
        f"hvd_compress: the exchanged gradients of {shown} ({len(bad)} of {len(named)} tensors) hold NaN/Inf "
        f"(a NaN/Inf gradient on at least one rank; nonfinite='raise'). Every rank raises this at the same "
        f"step. The gradients were written back but the step was not taken: call zero_grad() and go on "
        f"(residuals keep their values from before the step), or lower the learning rate or loss scale"
    )
