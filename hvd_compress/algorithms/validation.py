"""Checks of the compressors' arguments, at construction and on assignment.

Each ``check_*`` returns the value in its canonical type, or raises
``TypeError`` (wrong type: ``error_feedback='no'``, ``dense_below=1.5``) or
``ValueError`` (out of range: ``dense_below=-1``, ``clip=-1``), naming the
argument. :func:`checked` makes a property that runs a check on every
assignment, so ``compressor.clip = -1`` fails as ``TernGrad(clip=-1)`` does
instead of silently changing what is sent.
"""

from __future__ import annotations

import math
import numbers
from statistics import StatisticsError
from typing import Any, Callable, Optional

import numpy as np

from hvd_compress.kernels import reference

#: Smallest Gaussian-k ratio: below it ``ratio / 2`` rounds to 0 and the tail
#: quantile ``Phi^-1(1 - ratio / 2)`` (:func:`reference.normal_tail_quantile`) is undefined.
GAUSSIANK_MIN_RATIO = 2 * math.ulp(0.0)  # 1e-323


def _got(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool (Python or numpy); ``TypeError`` otherwise (``'no'`` is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"hvd_compress: {name} must be True or False, got {_got(value)}")
    return bool(value)


def check_compile(value: Any, name: str) -> Optional[bool]:
    """``None`` or a bool (see :attr:`~hvd_compress.algorithms.base.Compressor.compile`)."""
    return None if value is None else check_bool(value, f"{name} (None: HVD_COMPRESS_COMPILE decides)")


def check_count(value: Any, name: str) -> int:
    """``value`` as a non-negative int; bools, floats and negatives are rejected."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"hvd_compress: {name} must be an int >= 0, got {_got(value)}")
    if value < 0:
        raise ValueError(f"hvd_compress: {name} must be an int >= 0, got {value!r}")
    return int(value)


def check_positive(value: Any, name: str, allow_none: bool = False) -> Optional[float]:
    """``value`` as a finite float > 0 (or ``None`` when ``allow_none``)."""
    if value is None and allow_none:
        return None
    expected = "a finite number > 0" + (" or None" if allow_none else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"hvd_compress: {name} must be {expected}, got {_got(value)}")
    number = float(value)
    if not 0.0 < number < math.inf:  # also rejects NaN
        raise ValueError(
            f"hvd_compress: {name} must be > 0 and finite{' (or None)' if allow_none else ''}, got {value!r}"
        )
    return number


def check_between(low: float, high: float, why: str) -> Callable[..., Optional[float]]:
    """A check of a finite number in ``[low, high]`` (``None`` too with ``allow_none``); ``why``
    ends the message of a value outside, saying what the range protects."""

    def check(value: Any, name: str, allow_none: bool = False) -> Optional[float]:
        number = check_positive(value, name, allow_none)
        if number is not None and not low <= number <= high:
            bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise ValueError(f"hvd_compress: {name} must be {bounds}, got {value!r}: {why}")
        return number

    return check


#: TernGrad's clipping factor ``c`` (bound ``c std(g)``): below 1 a bell-shaped gradient has more
#: than 31% of its entries clipped, and a bound that small sends signs only; the paper uses 2.5.
check_clip = check_between(
    1.0, math.inf, "below 1 it clips most of a bell-shaped gradient (more than 31% of its entries); "
    "TernGrad's paper uses 2.5, None turns clipping off",
)

#: RegTop-k's temperature ``mu``: it divides ``1 + D`` in float32, where a value outside the normal
#: range rounds to 0 or Inf and the scores become NaN (0 / 0) or 0 for every entry.
check_temperature = check_between(
    float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max),
    "the scores divide by mu in float32, where a smaller value rounds to 0 and a larger one to Inf",
)


def check_momentum(value: Any, name: str) -> float:
    """``value`` as a float in ``[0, 1)``: the decay of a sparsifier's velocity (DGC's momentum
    correction; 0 turns it off). At 1 or above the velocity never forgets and grows without bound."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"hvd_compress: {name} must be a number in [0, 1), got {_got(value)}")
    number = float(value)
    if not 0.0 <= number < 1.0:  # also rejects NaN
        raise ValueError(
            f"hvd_compress: {name} must be in [0, 1) (0 turns momentum correction off; DGC uses 0.9), "
            f"got {value!r}"
        )
    return number


def param_group_momenta(param_groups: Any) -> list:
    """``[("param_group i", momentum, hyperparameter)]`` of a torch optimizer's ``param_groups``: its
    ``momentum`` (SGD, RMSprop; 0 where a group has none), and ``betas[0]``, the first-moment decay of
    Adam, AdamW, NAdam, RAdam, Adamax (a momentum of their own)."""
    momenta = []
    for i, group in enumerate(param_groups):
        group = group if isinstance(group, dict) else {}
        momenta.append((f"param_group {i}", group.get("momentum", 0.0), "momentum"))
        betas = group.get("betas")
        if isinstance(betas, (list, tuple)) and betas:
            momenta.append((f"param_group {i}", betas[0], "betas[0]"))
    return momenta


def as_configured(compressor: Any) -> str:
    """``repr(compressor)`` with the ratio (or traffic budget) the user configured: under a density schedule
    (:class:`~hvd_compress.algorithms.schedule.DensityWarmup`, which records its target as
    ``compressor.target_ratio``) the ``ratio`` set now is the ramp's, not the one written, and so is a
    budget's ``traffic``."""
    text = repr(compressor)
    target, now = getattr(compressor, "target_ratio", None), getattr(compressor, "ratio", None)
    if target is None or now is None or target == now:
        return text
    text = text.replace(f"ratio={now!r}", f"ratio={target!r}", 1)
    if getattr(compressor, "traffic", None) == now:
        text = text.replace(f"traffic={now!r}", f"traffic={target!r}", 1)
    return text + f" (its density warm-up is at {now:g} now)"


def check_single_momentum(compressor: Any, momenta: Any, where: str) -> None:
    """``ValueError`` when both ``compressor`` (momentum correction) and the wrapped optimizer apply
    momentum: the update would decay twice (``m`` on the compressor's velocity, then the optimizer's
    own buffer on the average of the velocities). ``momenta``: ``(part of the optimizer, momentum)``
    or ``(part, momentum, hyperparameter name)`` triples (:func:`param_group_momenta`): SGD's
    ``momentum``, Adam's first-moment decay (``beta_1``, torch's ``betas[0]``)..."""
    own = float(getattr(compressor, "momentum", 0.0) or 0.0)
    if not own:
        return
    for part, theirs, *named in momenta:
        hyperparameter = named[0] if named else "momentum"
        if not (isinstance(theirs, numbers.Real) and theirs):
            continue
        if hyperparameter == "momentum":
            fix = ("Give the optimizer momentum=0 (plain SGD: the compressor owns the momentum), or the "
                   "compressor momentum=0")
        else:
            fix = (f"Give the compressor momentum=0 (the optimizer's {hyperparameter} is its momentum; error "
                   f"feedback still keeps what was not sent), or the optimizer {hyperparameter}=0")
        raise ValueError(
            f"hvd_compress: {where}: the compressor applies momentum itself ({as_configured(compressor)}: momentum="
            f"{own:g}, DGC's momentum correction) and the optimizer's {part} has {hyperparameter}={theirs!r}: "
            f"momentum would be applied twice. {fix}"
        )


#: What a NaN/Inf gradient does: ``"propagate"`` (that tensor's result is non-finite on every
#: rank, as in a dense allreduce) or ``"raise"`` (strict: every rank raises at that step).
NONFINITE = ("propagate", "raise")


def check_nonfinite(value: Any, name: str) -> str:
    """``value`` if it is one of :data:`NONFINITE`."""
    if value not in NONFINITE:
        raise ValueError(f"hvd_compress: {name} must be one of {NONFINITE}, got {_got(value)}")
    return value


def check_gaussiank_ratio(ratio: float) -> float:
    """A ratio (already in (0, 1]) for which Gaussian-k's threshold is finite: ``>= 1e-323``."""
    try:
        quantile = reference.normal_tail_quantile(ratio)
    except StatisticsError:
        quantile = math.nan
    if not math.isfinite(quantile):
        raise ValueError(
            f"hvd_compress: GaussianK ratio {ratio!r} is too small: the Gaussian tail quantile "
            f"Phi^-1(1 - ratio / 2) of its threshold is not finite (ratio / 2 rounds to 0); "
            f"the smallest ratio is {GAUSSIANK_MIN_RATIO!r}"
        )
    return ratio


#: how a sparsifier's ranks choose what they send (the ``indices=`` option): ``gather`` each its own ``S``,
#: allgathered; ``leader`` and ``aggregate`` one shared ``S``, allreduced
#: (:mod:`~hvd_compress.algorithms.shared_bucket`)
INDEX_MODES = ("gather", "leader", "aggregate")


def check_indices(value: Any, name: str) -> str:
    """``value`` if it names one of :data:`INDEX_MODES`; ``TypeError`` for a non-string, ``ValueError``
    for an unknown name."""
    if not isinstance(value, str):
        raise TypeError(f"hvd_compress: {name} must be one of {', '.join(map(repr, INDEX_MODES))}, got {_got(value)}")
    if value not in INDEX_MODES:
        raise ValueError(
            f"hvd_compress: {name} must be one of {', '.join(map(repr, INDEX_MODES))} ('gather': each rank "
            f"its own indices, allgathered; 'leader', 'aggregate': one index set shared by every rank, its "
            f"values allreduced), got {value!r}"
        )
    return value


def check_exact_every(value: Any, name: str) -> int:
    """``value`` as an int >= 1 (1: an exact selection every step); ``TypeError`` for a non-int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"hvd_compress: {name} must be an int >= 1 (steps between exact selections), got {_got(value)}")
    if value < 1:
        raise ValueError(f"hvd_compress: {name} must be an int >= 1 (1: an exact selection every step), got {value!r}")
    return int(value)


def checked(attribute: str, check: Callable[[Any, str], Any], doc: str) -> property:
    """A property stored in ``_<attribute>`` whose every assignment passes through ``check``.

    ``check(value, label)`` gets the label ``"<Class> <attribute>"`` for its messages.
    """
    slot = "_" + attribute

    def get(self) -> Any:
        return getattr(self, slot)

    def set(self, value: Any) -> None:
        setattr(self, slot, check(value, f"{type(self).__name__} {attribute}"))

    return property(get, set, doc=doc)
