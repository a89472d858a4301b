"""TernGrad (Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", NeurIPS 2017), one tensor at a time::

    a = g (+ r with error feedback);  b = c std(a) (clipping; none where it is 0 or a is constant)
    s = max|clip(a, -b, b)|;  S = max over ranks of s (scalar sharing; else each rank's own s)
    t_j = sign(a_j) [u_j < min(|a_j|, b) / S],  u_j uniform on [0, 1) from the rank's stream
    sum over ranks of S t  (shared: the integer sum of the codes times S);  r = a - S t

The draws ``u`` are float32, one per entry, in the order the tensors come, rounded to the
gradient's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from spec.common import accumulation


@dataclass
class TernGrad:
    clip: Optional[float] = 2.5
    scalar_sharing: bool = True
    error_feedback: bool = False
    dense_below: int = 1024

    def dense(self, numel: int, ranks: int) -> bool:
        return numel == 0 or numel < self.dense_below


def measure(option: TernGrad, g: np.ndarray, state: Dict[str, Any]) -> Dict[str, Any]:
    """``a``, the clipping bound (``None``: no clipping) and the local scale ``s`` (accumulation dtype)."""
    a = g.astype(accumulation(g.dtype)) + state.get("residual", 0) if option.error_feedback else g
    bound = None
    if option.clip is not None:
        exact = option.clip * float(np.std(a, dtype=np.float64))
        if exact != 0 and np.max(a) != np.min(a):
            bound = a.dtype.type(exact)
    largest = np.max(np.abs(a))
    local = largest if bound is None else min(largest, bound)
    return {"a": a, "bound": bound, "scale": np.asarray(local, a.dtype).astype(accumulation(g.dtype))}


def codes(option: TernGrad, measured: Dict[str, Any], scale: np.ndarray, uniform: np.ndarray,
          state: Dict[str, Any]) -> np.ndarray:
    """``t`` drawn with the scale ``S``; the residual ``r = a - S t`` with error feedback."""
    a = measured["a"]
    scale = np.asarray(scale).astype(a.dtype)
    ratio = np.abs(a) if measured["bound"] is None else np.minimum(np.abs(a), measured["bound"])
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (ratio / scale).astype(a.dtype)
    t = (np.sign(a).astype(np.int8) * (uniform < ratio)).astype(np.int8)
    if option.error_feedback:
        state["residual"] = a - t * scale
    return t


def step(option: TernGrad, grads: List[np.ndarray], states: List[Dict[str, Any]],
         draws: List[Callable[[int], np.ndarray]]) -> np.ndarray:
    """Every rank's step for one compressed tensor: the sum over ranks (accumulation dtype)."""
    measured = [measure(option, g, state) for g, state in zip(grads, states)]
    shared = max(m["scale"] for m in measured) if option.scalar_sharing else None
    total = None
    for m, state, draw, g in zip(measured, states, draws, grads):
        scale = shared if shared is not None else m["scale"]
        t = codes(option, m, scale, draw(g.shape[0]).astype(g.dtype), state)
        if shared is not None:
            total = t.astype(np.int32) if total is None else total + t
        else:
            part = t * scale
            total = part if total is None else total + part
    return (total * shared if shared is not None else total).astype(accumulation(grads[0].dtype))
