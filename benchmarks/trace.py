"""Count the kernels, bytes and device waits of a block of torch code: a ``TorchDispatchMode``.

    from benchmarks.trace import count_ops

    with count_ops() as counts:
        step()
    counts.ops, counts.bytes, counts.waits, counts.by_op

Every aten operator call that reaches the dispatcher while the block runs is
classified by one rule each (a GPU would launch the same operators, so the
counts stand for its kernels even when the block runs on the CPU):

* **not a kernel**: an operator whose outputs alias its inputs (``func.is_view``:
  ``view``, ``reshape`` as a view, ``t``, ``expand``, ``slice``, ``select``,
  ``split``, ``detach``, ``alias``, ``as_strided``, ``lift_fresh`` ...; in-place
  metadata changes tagged ``inplace_view``), an allocation
  (:data:`ALLOCATIONS`: ``empty*``, ``new_empty*``, ``resize_``) or a metadata
  change (:data:`METADATA`: ``_unsafe_view``, ``set_``, ``record_stream``). A
  no-op conversion (``x.to(x.dtype)``) never reaches the dispatcher.
* **kernel** (``ops``): every other aten operator, one launch per call (a
  ``_foreach_*`` call counts once). ``bytes`` adds, per kernel, every tensor
  argument and every tensor result, each ``numel * itemsize`` of the view
  (an in-place operator's tensor counts as read and as written).
* **device wait** (``waits``; also a kernel where it launches one): an
  operator that makes the host wait for the device on CUDA (:data:`SYNCING`:
  ``_local_scalar_dense`` behind ``item``/``bool``/``int``, ``nonzero``,
  ``masked_select``, ``unique*``, ``equal``), indexing with a bool mask
  (``index.Tensor``/``index_put_``, a ``nonzero`` inside),
  ``repeat_interleave`` without ``output_size``, and an upload of host data:
  ``lift_fresh`` of a tensor built from Python data during the block
  (``torch.tensor([...])``; on the CPU one of >= 1 dimension: a 0-dim one is a
  Python scalar, which a device kernel takes as an argument), a copy between
  the CPU and another device (seen only when the block runs on a device), and
  ``index_put_`` of a 0-dim CPU value (``a[idx] = 0``: the value is a Python
  scalar lifted to a CPU tensor, which ``_index_put_impl_`` copies to the
  device with a blocking ``to(device)``; counted where the value was lifted in
  the block, or where the target is on a device). ``index_fill_(0, idx, 0)``
  takes the scalar as an argument: no wait. ``tolist``/``numpy`` of a CPU
  tensor dispatch nothing; :func:`count_ops` adds them from
  :func:`~benchmarks.host_reads.count_host_reads` (``host_reads=True``).
* **collective**: an operator of the ``c10d`` namespace (``all_reduce``,
  ``all_gather`` ... of ``torch.distributed``), counted in ``collectives``
  and not in ``ops``/``bytes`` (the link's work); Horovod's collectives run
  in its C++ thread and are not seen. Other namespaces (``profiler``) are ignored.

The mode is thread-local; callbacks of ``torch.futures`` (``then``,
``add_done_callback``: DDP hooks' decode steps, run by the collective's
worker thread) are counted too, through a wrapper installed for the block's
duration. Collective backends' own copies (gloo's, in C++) are not seen.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ALLOCATIONS = frozenset(
    {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "resize_",
     "resize_as_"}
)
METADATA = frozenset({"_unsafe_view", "set_", "record_stream"})
SYNCING = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "equal"})
COLLECTIVE_NAMESPACE = "c10d"


def tensor_bytes(values: Any) -> int:
    """Sum of ``numel * itemsize`` over the tensors among ``values`` (nested lists, tuples, dicts)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(values) if isinstance(t, torch.Tensor))


def is_kernel(func: Any) -> bool:
    """Whether an aten operator launches a kernel (module docstring: not a view, allocation or metadata)."""
    name = func._overloadpacket.__name__
    if func.is_view or torch.Tag.inplace_view in func.tags:
        return False
    return name not in ALLOCATIONS and name not in METADATA


def _bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _crosses_host(func: Any, args: Tuple, kwargs: Dict, out: Any) -> bool:
    """A copy between the CPU and another device (``copy_``: source and destination; ``_to_copy``)."""
    name = func._overloadpacket.__name__
    if name == "copy_":
        devices = {args[0].device.type, args[1].device.type}
    elif name == "_to_copy":
        devices = {args[0].device.type, out.device.type}
    else:
        return False
    return len(devices) == 2 and "cpu" in devices


def _uploaded(lifted: torch.Tensor) -> bool:
    """Whether a tensor built from Python data is an upload: it is on a device, or holds data (>= 1 dim).

    A 0-dim CPU tensor is a Python scalar lifted (``a[i] = 0``), which a device kernel takes
    as an argument, with no copy.
    """
    return lifted.device.type != "cpu" or lifted.dim() > 0


def _scalar_uploaded(target: Any, value: Any, lifted: Any) -> bool:
    """An ``index_put`` value that CUDA copies to the device with a host wait: a 0-dim CPU tensor,
    lifted from a Python scalar in the block (``lifted``: those seen) or written into a device tensor."""
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.device.type != "cpu":
        return False
    seen = lifted.get(id(value)) if lifted else None
    return (seen is not None and seen() is value) or (
        isinstance(target, torch.Tensor) and target.device.type != "cpu"
    )


def is_wait(func: Any, args: Tuple, kwargs: Dict, out: Any, lifted: Optional[Dict[int, Any]] = None) -> bool:
    """Whether the operator makes the host wait for the device on CUDA (module docstring); ``lifted``:
    the 0-dim tensors lifted from Python scalars so far in the block (``id -> weakref``)."""
    name = func._overloadpacket.__name__
    if name in SYNCING or name.startswith(("unique", "_unique")):
        return True
    if name.startswith("lift_fresh"):
        return _uploaded(args[0])
    if name in ("index_put_", "index_put", "_index_put_impl_"):
        value = args[2] if len(args) > 2 else kwargs.get("values")
        if _scalar_uploaded(args[0], value, lifted):
            return True
    if name in ("index", "index_put_", "index_put", "_index_put_impl_"):
        return _bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    return _crosses_host(func, args, kwargs, out)


class OpCounts:
    """What :func:`count_ops` yields: totals, and per operator ``by_op[name] = [calls, bytes]``."""

    def __init__(self) -> None:
        self.ops = 0
        self.bytes = 0
        self.waits = 0
        self.collectives = 0
        self.collective_bytes = 0
        self.by_op: Dict[str, List[int]] = {}
        self.waits_by_op: Counter = Counter()
        self.host_reads: Dict[str, int] = {}
        #: 0-dim tensors lifted from Python scalars in the block, ``id -> weakref`` (identity, not ``==``)
        self.lifted: Dict[int, Any] = {}
        self._lock = threading.Lock()

    def add(self, func: Any, args: Tuple, kwargs: Dict, out: Any) -> None:
        """Classify one operator call and add it."""
        if func.namespace == COLLECTIVE_NAMESPACE:
            moved = tensor_bytes((args, kwargs))
            with self._lock:
                self.collectives += 1
                self.collective_bytes += moved
            return
        if func.namespace != "aten":
            return
        name = str(func)[len("aten."):]
        wait = is_wait(func, args, kwargs, out, self.lifted)
        if name.startswith("lift_fresh") and isinstance(out, torch.Tensor) and out.dim() == 0:
            with self._lock:
                self.lifted[id(out)] = weakref.ref(out)
        kernel = is_kernel(func)
        moved = tensor_bytes((args, kwargs, out)) if kernel else 0
        with self._lock:
            if wait:
                self.waits += 1
                self.waits_by_op[name] += 1
            if kernel:
                self.ops += 1
                self.bytes += moved
                calls_bytes = self.by_op.setdefault(name, [0, 0])
                calls_bytes[0] += 1
                calls_bytes[1] += moved

    def add_host_reads(self, by_kind: Dict[str, int]) -> None:
        """Reads that dispatch no operator on a CPU tensor (``tolist``, ``numpy``) are waits too."""
        self.host_reads = dict(by_kind)
        for kind in ("tolist", "numpy"):
            if by_kind.get(kind):
                self.waits += by_kind[kind]
                self.waits_by_op[kind] += by_kind[kind]

    def as_dict(self) -> Dict[str, Any]:
        return {
            "ops": self.ops,
            "bytes": self.bytes,
            "device_waits": self.waits,
            "waits_by_op": dict(self.waits_by_op),
            "collectives": self.collectives,
            "collective_bytes": self.collective_bytes,
            "host_reads": self.host_reads,
        }


class _Counting(TorchDispatchMode):
    """Adds every operator call of its thread to a shared :class:`OpCounts`."""

    def __init__(self, counts: OpCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.counts.add(func, args, kwargs, out)
        return out


class _Threads:
    """Enters a counting mode on any thread that runs a wrapped callback (once per thread)."""

    def __init__(self, counts: OpCounts) -> None:
        self.counts = counts
        self.local = threading.local()

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if getattr(self.local, "active", False):
            yield
            return
        self.local.active = True
        try:
            with _Counting(self.counts):
                yield
        finally:
            self.local.active = False

    def wrap(self, callback: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self.counting():
                return callback(*args, **kwargs)

        return counted


@contextlib.contextmanager
def _future_callbacks(threads: _Threads) -> Iterator[None]:
    """``torch.futures`` callbacks registered during the block run under ``threads.counting()``."""
    future = torch._C.Future
    saved = {name: getattr(future, name) for name in ("then", "add_done_callback")}
    try:
        for name, original in saved.items():
            setattr(future, name, lambda self, callback, _o=original: _o(self, threads.wrap(callback)))
        yield
    finally:
        for name, original in saved.items():
            setattr(future, name, original)


@contextlib.contextmanager
def count_ops(host_reads: bool = True) -> Iterator[OpCounts]:
    """Count the block's operators (this thread and ``torch.futures`` callbacks); yields :class:`OpCounts`.

    ``host_reads``: also count ``tolist``/``numpy`` reads as waits (CPU blocks; on a device
    those reads are copies the dispatcher sees).
    """
    from benchmarks.host_reads import count_host_reads

    counts = OpCounts()
    threads = _Threads(counts)
    reads_context = count_host_reads() if host_reads else contextlib.nullcontext()
    with reads_context as reads, _future_callbacks(threads), threads.counting():
        yield counts
    if reads is not None:
        counts.add_host_reads(reads.by_kind)


def top(by_op: Dict[str, List[int]], key: int, n: int) -> List[Tuple[str, int, int]]:
    """The ``n`` operators with most calls (``key`` 0) or bytes (``key`` 1): ``(name, calls, bytes)``."""
    ranked = sorted(by_op.items(), key=lambda item: (-item[1][key], item[0]))
    return [(name, calls, moved) for name, (calls, moved) in ranked[:n] if (calls, moved)[key] > 0]


def difference(by_op: Dict[str, List[int]], base: Optional[Dict[str, List[int]]]) -> Dict[str, List[int]]:
    """``by_op`` minus ``base`` per operator (what a route adds to a plain step)."""
    base = base or {}
    names = set(by_op) | set(base)
    zero = [0, 0]
    return {
        n: [by_op.get(n, zero)[0] - base.get(n, zero)[0], by_op.get(n, zero)[1] - base.get(n, zero)[1]]
        for n in sorted(names)
    }


__all__ = ["count_ops", "OpCounts", "is_kernel", "is_wait", "tensor_bytes", "top", "difference"]
