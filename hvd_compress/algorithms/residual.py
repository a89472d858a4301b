"""Error-feedback memory: per-tensor state of a compressor (residuals and friends).

Each tensor name owns a few named arrays (``residual``, ``velocity`` under
momentum correction, RegTop-k's posterior...). The state is part of training: it is saved with
:meth:`TensorMemory.state_dict` and restored with :meth:`load_state_dict`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict


class TensorMemory:
    """Named arrays per tensor name, with the tensor size they belong to."""

    def __init__(self) -> None:
        self._slots: Dict[str, Dict[str, Any]] = {}
        self._shapes: Dict[str, tuple] = {}
        self._restored: set = set()

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def names(self):
        return list(self._slots)

    def restored(self) -> list:
        """Names whose state was loaded from a checkpoint and that no step has used since."""
        return [name for name in self._slots if name in self._restored]

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def track(self, name: str, shape: tuple) -> None:
        """Note that tensor ``name`` has ``shape`` this step.

        A tensor whose shape changed gets fresh state (with a warning); state
        restored from a checkpoint that does not fit the tensor is an error.
        """
        shape = tuple(shape)
        known = self._shapes.get(name)
        if known is not None and known != shape:
            if name in self._restored:
                raise ValueError(
                    f"hvd_compress: state restored for tensor '{name}' has shape {known} "
                    f"but the gradient has shape {shape}; the checkpoint belongs to a different model"
                )
            warnings.warn(
                f"hvd_compress: tensor '{name}' changed shape ({known} -> {shape}); "
                "its compression state is reset",
                stacklevel=4,
            )
            self.reset(name)
        elif known is not None:
            self._restored.discard(name)  # the checkpoint fits: later shape changes are live ones
        self._slots.setdefault(name, {})
        self._shapes[name] = shape

    def get(self, name: str, key: str, shape: tuple, init: Callable[[], Any]) -> Any:
        """The array ``key`` of tensor ``name`` (of ``shape``), created by ``init()`` when absent."""
        self.track(name, shape)
        slots = self._slots[name]
        if key not in slots:
            slots[key] = init()
        return slots[key]

    def set(self, name: str, key: str, value: Any) -> None:
        self._slots.setdefault(name, {})[key] = value

    def discard(self, name: str, key: str) -> None:
        """Forget the array ``key`` of ``name`` (if any); its other arrays stay."""
        self._slots.get(name, {}).pop(key, None)

    def slots(self, name: str) -> Dict[str, Any]:
        """Every array of ``name`` by key (a copy of the mapping)."""
        return dict(self._slots.get(name, {}))

    def peek(self, name: str, key: str) -> Any:
        """The array ``key`` of ``name`` or ``None``, without creating it."""
        return self._slots.get(name, {}).get(key)

    def reset(self, name: str = None) -> None:
        """Forget one tensor's state, or all of it."""
        names = list(self._slots) if name is None else [name]
        for n in names:
            self._slots.pop(n, None)
            self._shapes.pop(n, None)
            self._restored.discard(n)

    def state_dict(self) -> Dict[str, Any]:
        return {name: {"shape": self._shapes[name], **dict(slots)} for name, slots in self._slots.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.reset()
        for name, entry in state.items():
            entry = dict(entry)
            self._shapes[name] = tuple(int(n) for n in entry.pop("shape"))
            self._slots[name] = entry
            self._restored.add(name)
