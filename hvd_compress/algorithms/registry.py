"""The one table of compressor names: what ``Compression.<name>``, ``Compression.names``,
``Compression.by_name`` and the header's algorithm numbers read.

``register(name, cls)`` adds a compressor under a short name (lower case, no ``-``/``_``);
it gives the class a header number (:func:`hvd_compress.wire.register_algorithm`), so that
the cross-rank check names it in its ``ranks disagree`` error on every rank that registered
it. ``hvd_compress.algorithms`` registers the built-in compressors with the fixed numbers
1 to 6, which their headers have always carried.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Type

from hvd_compress import wire
from hvd_compress.algorithms.base import Compressor


@dataclass(frozen=True)
class Entry:
    """One registered compressor: its class, what ``Compression.<name>`` is, whether it takes a ratio."""

    cls: Type[Compressor]
    factory: Any
    takes_ratio: bool


_ENTRIES: Dict[str, Entry] = {}


def key(name: str) -> str:
    """The table's spelling of ``name``: ``"Reg-TopK"`` and ``"reg_topk"`` are ``"regtopk"``."""
    return name.lower().replace("-", "").replace("_", "")


def register(name: str, cls: Type[Compressor], *, factory: Any = None, number: Optional[int] = None) -> Type[Compressor]:
    """Add ``cls`` under ``name`` and return it.

    ``factory``: what ``Compression.<name>`` is (the class itself by default). ``number``: the
    header's algorithm number, for the built-ins; others leave it out and get one from their class
    name (:func:`hvd_compress.wire.register_algorithm`). ``by_name(name, ratio, **options)``
    passes ``ratio`` first when ``cls.__init__`` has a ``ratio`` parameter.
    """
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise TypeError(f"hvd_compress: register({name!r}, ...) needs a Compressor subclass, got {cls!r}")
    entry = Entry(cls, cls if factory is None else factory, "ratio" in inspect.signature(cls.__init__).parameters)
    if _ENTRIES.get(key(name), entry) != entry:
        raise ValueError(f"hvd_compress: the name {name!r} is taken by {_ENTRIES[key(name)].cls.__name__}")
    wire.register_algorithm(cls.__name__, number)
    _ENTRIES[key(name)] = entry
    return cls


def unregister(name: str) -> None:
    """Remove ``name`` from the table, and its class's header number."""
    entry = _ENTRIES.pop(key(name), None)
    if entry is not None and all(other.cls.__name__ != entry.cls.__name__ for other in _ENTRIES.values()):
        wire.unregister_algorithm(entry.cls.__name__)


def names() -> Tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(_ENTRIES)


def factory(name: str) -> Any:
    """What ``Compression.<name>`` is; ``AttributeError`` when nothing is registered under ``name``."""
    try:
        return _ENTRIES[key(name)].factory
    except KeyError:
        raise AttributeError(name) from None


def build(name: str, ratio: float, **options: Any) -> Compressor:
    """A new compressor from its registered name; ``ratio`` goes to the classes that take one."""
    entry = _ENTRIES.get(key(name))
    if entry is None:
        raise ValueError(f"hvd_compress: unknown compression {name!r}; choose one of {', '.join(names())}")
    make: Callable[..., Compressor] = entry.cls
    return make(ratio, **options) if entry.takes_ratio else make(**options)
