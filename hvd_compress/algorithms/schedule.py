"""Density schedules: Deep Gradient Compression's warm-up, for every route.

Lin et al., "Deep Gradient Compression" (ICLR 2018), section 3.4: in the first
epochs the density falls exponentially (25%, 6.25%, 1.5625%, 0.4%, ...) to the
target, so training adapts to sparse, delayed updates. With target density
``rho`` (the compressor's ``ratio`` when the schedule is made), start density
``s`` and ``W`` warm-up steps, step ``n`` (0-based) uses

    density(n) = s * (rho / s) ** (n / W)    for n < W
    density(n) = rho                          for n >= W

(:func:`warmup_density`, the one formula of :class:`DensityWarmup` and of
:class:`hvd_compress.keras.callbacks.DensityWarmupCallback`). A "step" is a call
of :meth:`DensityWarmup.step`: once per epoch as in DGC, or once per iteration
for a smoother ramp.

A schedule only sets ``compressor.ratio``. Every route reads the ratio on every
exchange (the fused plans are rebuilt when the configuration changes) and the
exchange header checks that all ranks agree on it, so a rank that steps its
schedule a different number of times stops with an error instead of decoding
garbage. Use it like ``torch.optim.lr_scheduler``::

    compressor = hvd_compress.TopK(0.001)
    opt = hvd.DistributedOptimizer(opt, named_parameters=..., compression=compressor)
    warmup = hvd_compress.DensityWarmup(compressor, warmup_steps=4, start=0.25)
    for epoch in range(epochs):
        train_one_epoch()
        warmup.step()
    torch.save({"model": ..., "warmup": warmup.state_dict()}, path)

It needs no framework: it takes a compressor (also ``Auto(...)``), anything
that carries one as ``.compression`` (Keras's ``DistributedOptimizer``) or
``.compressor`` (the DDP hook's ``CompressionState``), or a list of compressors
or anything with ``.compressors`` (the :class:`~hvd_compress.simulator.Simulator`'s
per-rank copies); all must have the same target density.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, List

from hvd_compress.algorithms.base import Compressor, check_ratio, is_compression

__all__ = ["DensityWarmup", "warmup_density", "check_warmup_steps", "check_has_density", "check_start"]


def ramped(compressor: Any) -> str:
    """What a density warm-up ramps on ``compressor``: its ``traffic`` budget where it has one, else its ``ratio``."""
    return "traffic" if getattr(compressor, "traffic", None) is not None else "ratio"


def ramping(compressor: Any) -> bool:
    """Whether a density warm-up ramps ``compressor`` now: its target (``target_ratio``, which
    :class:`DensityWarmup` sets) recorded and not reached."""
    target = getattr(compressor, "target_ratio", None)
    return target is not None and getattr(compressor, ramped(compressor)) != target


def warmup_density(step: int, warmup_steps: int, start: float, target: float) -> float:
    """``start * (target / start) ** (step / warmup_steps)`` before ``warmup_steps``, then ``target``.

    A geometric sequence from ``start`` (step 0) that would reach ``target`` at
    step ``warmup_steps``; negative steps count as 0. ``start = target ** (1 / (W + 1))``
    is DGC's released code (it multiplies by that factor every epoch); ``start = 1`` starts dense.
    """
    if step >= warmup_steps:
        return float(target)
    return float(start * (target / start) ** (max(step, 0) / warmup_steps))


def check_warmup_steps(value: Any, name: str = "warmup_steps") -> int:
    """``value`` as an int >= 0 (``TypeError`` for a non-number or a bool, ``ValueError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"hvd_compress: {name} must be an integer >= 0, got {value!r}")
    if not (float(value).is_integer() and value >= 0):
        raise ValueError(f"hvd_compress: {name} must be an integer >= 0, got {value!r}")
    return int(value)


def check_has_density(compressor: Any, who: str) -> Compressor:
    """``compressor`` if it is one of ours with a settable ``ratio``; ``TypeError`` naming it otherwise."""
    ratio = getattr(type(compressor), "ratio", None)
    if not is_compression(compressor) or not isinstance(ratio, property) or ratio.fset is None:
        raise TypeError(
            f"hvd_compress: {who} needs a compressor with a density (ratio), such as TopK, GaussianK, "
            f"RegTopK or Auto of one of them; {compressor!r} ({type(compressor).__name__}) has none"
        )
    return compressor


def check_start(start: Any, target: float, who: str) -> float:
    """``start`` as a density in ``[target, 1]`` (``TypeError``/``ValueError`` otherwise)."""
    start = check_ratio(start)
    if start < target:
        raise ValueError(
            f"hvd_compress: {who} start density {start!r} is below the target {target!r}; "
            "start must be in [target, 1]"
        )
    return start


def compressors_of(thing: Any, who: str) -> List[Compressor]:
    """The compressors a schedule sets: ``thing`` itself, its ``.compression``/``.compressor``, a list
    of compressors or its ``.compressors``; each checked by :func:`check_has_density`."""
    if is_compression(thing):
        found: List[Any] = [thing]
    elif is_compression(getattr(thing, "compression", None)):
        found = [thing.compression]
    elif is_compression(getattr(thing, "compressor", None)):
        found = [thing.compressor]
    elif isinstance(getattr(thing, "compressors", None), (list, tuple)):
        found = list(thing.compressors)
    elif isinstance(thing, (list, tuple)):
        found = list(thing)
    else:
        found = [thing]  # check_has_density names what it got
    if not found:
        raise ValueError(f"hvd_compress: {who} was given no compressor")
    return [check_has_density(c, who) for c in found]


def reached_target(compressors: List[Any]) -> None:
    """The ramp has just reached the target density: a compressor that chooses by measuring
    (``Auto``'s ``remeasure``) measures again, so that it decides for the density that trains
    rather than for the ramp's denser steps (where the sparsifiers send most tensors dense)."""
    for compressor in compressors:
        remeasure = getattr(compressor, "remeasure", None)
        if callable(remeasure):
            remeasure()


class DensityWarmup:
    """DGC's density warm-up as a schedule: ``warmup_steps`` calls of :meth:`step` from ``start`` to the target.

    Made, it sets the density of step 0 (``start``; the target at once when
    ``warmup_steps == 0``), as ``torch.optim.lr_scheduler`` sets the first rate.
    Each :meth:`step` moves one step on and sets :func:`warmup_density` of it,
    which reaches the target (the compressor's ``ratio`` when the schedule was
    made) after ``warmup_steps`` calls and stays there. Compressors given a
    traffic budget (``TopK(traffic=0.05)``) have their ``traffic`` ramped instead,
    from ``start`` of a dense allreduce's bytes to the budget.

    ``state_dict()`` / ``load_state_dict()`` carry the position and the
    settings, so a resumed run continues the ramp where it stopped; loading sets
    the density of that step at once.

    ``TypeError`` for compressors without a density (TernGrad, FP16, None);
    ``ValueError`` for ``warmup_steps < 0``, ``start`` outside ``[target, 1]``,
    or compressors whose densities differ.
    """

    def __init__(self, compressor: Any, warmup_steps: int, start: float = 0.25) -> None:
        self.compressors = compressors_of(compressor, "DensityWarmup")
        #: what the schedule ramps: the traffic budget of compressors given one (``traffic=``), else the density
        self.setting = "traffic" if all(ramped(c) == "traffic" for c in self.compressors) else "ratio"
        targets = {float(getattr(c, self.setting)) for c in self.compressors}
        if len(targets) != 1:
            raise ValueError(f"hvd_compress: DensityWarmup's compressors disagree on the density: {sorted(targets)}")
        self.target = targets.pop()
        self.warmup_steps = check_warmup_steps(warmup_steps)
        self.start = check_start(start, self.target, "DensityWarmup")
        self.last_step = 0
        self._apply()

    def density_at(self, step: int) -> float:
        """The density of (0-based) ``step``."""
        return warmup_density(step, self.warmup_steps, self.start, self.target)

    @property
    def density(self) -> float:
        """The density set now (that of :attr:`last_step`)."""
        return self.density_at(self.last_step)

    @property
    def done(self) -> bool:
        """Whether the target has been reached."""
        return self.last_step >= self.warmup_steps

    def step(self) -> float:
        """Move one step on and set its density; returns it. The step that reaches the target has
        an ``Auto`` compressor measure again (:func:`reached_target`)."""
        self.last_step += 1
        density = self._apply()
        if self.last_step == self.warmup_steps:
            reached_target(self.compressors)
        return density

    def _apply(self) -> float:
        density = self.density
        for compressor in self.compressors:
            setattr(compressor, self.setting, density)
            compressor.target_ratio = self.target  # what messages show as configured (not the ramp's density)
        return density

    def state_dict(self) -> Dict[str, Any]:
        """``{"last_step", "warmup_steps", "start", "target"}``: plain numbers, for ``torch.save`` or JSON."""
        return {
            "last_step": self.last_step,
            "warmup_steps": self.warmup_steps,
            "start": self.start,
            "target": self.target,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: its settings replace these, and its step's density is set."""
        missing = {"last_step", "warmup_steps", "start", "target"} - set(state)
        if missing:
            raise KeyError(f"hvd_compress: DensityWarmup state lacks {sorted(missing)}")
        target = check_ratio(state["target"])
        start = check_start(state["start"], target, "DensityWarmup")
        warmup_steps = check_warmup_steps(state["warmup_steps"])
        self.last_step = check_warmup_steps(state["last_step"], "last_step")
        self.target, self.start, self.warmup_steps = target, start, warmup_steps
        self._apply()

    def __repr__(self) -> str:
        return (
            f"DensityWarmup(step {self.last_step}/{self.warmup_steps}, density {self.density:.6g}, "
            f"start {self.start:g}, target {self.target:g})"
        )
