"""Count the reads of tensor values into the host made while a block of code runs.

    from benchmarks.host_reads import count_host_reads

    with count_host_reads() as reads:
        loss.backward(); opt.step()
    reads.count, reads.by_kind, reads.sites.most_common(3)

For its duration, :func:`count_host_reads` replaces ``torch.Tensor.item``,
``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__`` and
``numpy`` (and ``cpu``, counted only for a tensor on another device than the
CPU) by wrappers that count each call, from any thread and any code (library
code included), then call the original; on exit the originals are back.
``count_host_reads("tensorflow")`` does the same for TensorFlow's eager tensors
(``numpy``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``; ``np.asarray`` of one
reads through the buffer protocol, unseen). On a
GPU each of these reads waits for the device (a host synchronisation); on the
CPU they are where a GPU run would wait, so the count is the CPU stand-in for
``torch.cuda.set_sync_debug_mode("warn")``.

What it does not see: reads made inside C++ (an operator that syncs
internally, e.g. ``nonzero`` or ``torch.topk`` with a tensor ``k``), and
``__bool__``/``__int__``/... reached through ``Tensor.__dict__`` lookups that
bypass the type (none in torch's Python code). A patched method that calls
another one (``__format__`` -> ``item``) counts once: only the outermost call
of a thread counts.

``by_kind`` counts per method name; ``sites`` per ``file:line`` of the first
calling frame outside torch (and outside this module), to say where the reads
come from.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import Counter
from typing import Any, Callable, Dict, Iterator

#: Methods replaced for the duration; ``cpu`` counts only for tensors not on the CPU.
METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")
#: TensorFlow's eager tensors' methods that read their values
TF_METHODS = ("numpy", "__bool__", "__int__", "__float__", "__index__")
_MISSING = object()


class HostReads:
    """What :func:`count_host_reads` yields: ``count``, ``by_kind`` (Counter) and ``sites`` (Counter)."""

    def __init__(self) -> None:
        self.count = 0
        self.by_kind: Counter = Counter()
        self.sites: Counter = Counter()
        self._lock = threading.Lock()
        self._depth = threading.local()

    def _add(self, kind: str, site: str) -> None:
        with self._lock:
            self.count += 1
            self.by_kind[kind] += 1
            self.sites[site] += 1

    def as_dict(self, sites: int = 5) -> Dict[str, Any]:
        """JSON-ready: the count, counts per kind and the ``sites`` most frequent call sites."""
        return {
            "count": self.count,
            "by_kind": dict(self.by_kind),
            "sites": dict(self.sites.most_common(sites)),
        }

    def __repr__(self) -> str:
        return f"HostReads(count={self.count}, by_kind={dict(self.by_kind)})"


def _patched(framework: str) -> tuple:
    """``(tensor class, its methods to count, the framework's folder)``."""
    if framework == "tensorflow":
        import tensorflow as tf
        from tensorflow.python.framework.ops import EagerTensor

        return EagerTensor, TF_METHODS, os.path.dirname(os.path.abspath(tf.__file__)) + os.sep
    import torch

    return torch.Tensor, METHODS, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _caller_site(skip: tuple) -> str:
    """``file:line`` of the first frame whose file is not under one of the ``skip`` prefixes."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and filename != __file__:
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<torch>"


def _wrap(original: Callable, kind: str, reads: HostReads, skip: tuple) -> Callable:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(reads._depth, "value", 0)
        if depth == 0 and (kind != "cpu" or self.device.type != "cpu"):
            reads._add(kind, _caller_site(skip))
        reads._depth.value = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            reads._depth.value = depth

    counted.__name__ = getattr(original, "__name__", kind)
    counted.__doc__ = getattr(original, "__doc__", None)
    counted.__wrapped__ = original
    return counted


@contextlib.contextmanager
def count_host_reads(framework: str = "torch") -> Iterator[HostReads]:
    """Count host reads of ``framework``'s tensor values (any thread) while the block runs; yields
    :class:`HostReads`."""
    tensor, methods, folder = _patched(framework)
    reads = HostReads()
    saved = {name: tensor.__dict__.get(name, _MISSING) for name in methods}
    try:
        for name in methods:
            setattr(tensor, name, _wrap(getattr(tensor, name), name, reads, (folder,)))
        yield reads
    finally:
        for name, original in saved.items():
            if original is _MISSING:
                if name in tensor.__dict__:
                    delattr(tensor, name)
            else:
                setattr(tensor, name, original)


__all__ = ["count_host_reads", "HostReads", "METHODS", "TF_METHODS"]
