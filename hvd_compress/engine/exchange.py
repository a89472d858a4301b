"""Exchange of one bucket of gradients over a :class:`Communicator`: the front of the one engine.

A bucket holds several tensors. :class:`BucketExchange` collects them (``add``), hands them to
:mod:`hvd_compress.engine.fused` (``launch``: the plan of the bucket's layout, built once and
checked once with every rank; its dense part in one allreduce-Sum, its compressed part in the
rounds of the compressor's bucket codec; a few kernels per bucket and nothing read back to
the host in a step) and returns every tensor's average or sum over ranks (``finish``).

The engine runs on every framework through its kernel module (:func:`~hvd_compress.kernels.ops_for`):
numpy arrays (the MPI layer, thread ranks), torch tensors, TensorFlow's eager tensors (on a GPU,
or 16-bit: TensorFlow's kernels; eager CPU float32/float64 tensors as numpy arrays,
:func:`~hvd_compress.kernels.computed_form`, handed back as TensorFlow tensors). A bucket's
tensors of several dtypes or devices travel as one fused bucket per (dtype, device), in the
order each first appears. Every collective of a bucket is started by ``launch`` (a round that
needs an earlier one's result, TernGrad's codes drawn with the shared scales, is started there
too, unless ``launch(complete=False)`` leaves it to ``complete()``), so ``finish`` only waits
and decodes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hvd_compress.kernels import computed_form, ops_for
from hvd_compress.engine import fused
from hvd_compress.algorithms.state import refused_broadcast


def open_exchange(compressor: Any, comm: Any, key: str, state: Any = None) -> Any:
    """The exchange of bucket ``key`` on the run state ``state`` (a route's
    :class:`~hvd_compress.algorithms.state.CompressorState`; default: ``compressor.state``, the
    compressor's own) for a route's ``compression=``: an exchange policy's (``make_exchange``:
    :class:`~hvd_compress.engine.auto.Auto`'s, a :class:`BucketExchange` of a way it chooses), else this."""
    make = getattr(compressor, "make_exchange", None)
    return make(comm, key, state) if make is not None else BucketExchange(compressor, comm, key, state)


def unsupported(compressor: Any, name: str, tensor: Any) -> Optional[str]:
    """Why gradient ``name`` cannot be exchanged with ``compressor`` (``None``: it can)."""
    if not getattr(compressor, "fused", False):
        return (f"{type(compressor).__name__} brings no bucket codec (set `fused = True` and give it "
                "`bucket_codec`, or derive it from Sparsifier; see docs/adding_a_compressor.md)")
    if not ops_for(tensor, name).fusable([tensor]):
        return (f"gradient '{name}' ({type(tensor).__name__} of dtype {tensor.dtype}) cannot be exchanged: "
                "exchanges take floating point arrays and tensors (float16, bfloat16, float32 or float64; "
                "TensorFlow's eagerly)")
    return None


class BucketExchange:
    """One bucket's gradients and the collectives that move them, on the run state ``run`` (what the
    route hands :func:`open_exchange`): its fused buckets, their statistics and random streams."""

    def __init__(self, compressor: Any, comm: Any, key: str, run: Any = None) -> None:
        if getattr(compressor, "_refused_broadcast", False):  # sent by Horovod's broadcast_object (elastic)
            raise refused_broadcast(repr(compressor))
        self.compressor, self.comm, self.key = compressor.bind(comm.rank, comm.size), comm, key
        self.run = compressor.state if run is None else run
        self.added: List[Tuple[str, Any]] = []
        self.caller: Any = None  # (kernel module, a tensor) of the caller's tensors, when computed in another form
        self.converted: set = set()  # the names computed in another form (handed back converted)
        self.launched: List[Any] = []  # each fused bucket's step, once launched

    def add(self, name: str, tensor: Any) -> None:
        """Add one gradient of the bucket (encoded by ``launch``), in the form it is computed on
        (:func:`~hvd_compress.kernels.computed_form`: eager TensorFlow CPU tensors as numpy)."""
        computed = computed_form(tensor)
        if computed is not tensor:  # its result goes back as the caller's tensor
            self.converted.add(name)
            self.caller = self.caller or (ops_for(tensor), tensor)
        why = unsupported(self.compressor, name, computed)
        if why is not None:
            raise TypeError(f"hvd_compress: {why}")
        self.added.append((name, computed))

    def parts(self) -> List[Tuple[str, List[str], List[Any]]]:
        """The fused buckets of the added tensors: ``(key, names, tensors)`` per (dtype, device), in
        the order each first appears; the bucket's own key when there is one."""
        by_form: Dict[Any, Tuple[List[str], List[Any]]] = {}
        for name, tensor in self.added:
            names, tensors = by_form.setdefault((tensor.dtype, str(getattr(tensor, "device", ""))), ([], []))
            names.append(name)
            tensors.append(tensor)
        if len(by_form) == 1:
            return [(self.key, *next(iter(by_form.values())))]
        return [(f"{self.key}.{i}", names, tensors) for i, (names, tensors) in enumerate(by_form.values())]

    def launch(self, complete: bool = True) -> None:
        """Encode the bucket and start its collectives (asynchronous).

        ``complete=False``: wait for no other rank (ranks may then launch their buckets
        in different orders); what needs another collective's result first (TernGrad's
        codes need the shared scale; the layout check) is done by :meth:`complete`,
        which ``finish`` calls. Call ``complete`` on every launched bucket before
        ``finish`` on any, when ranks may finish them in different orders.
        """
        for key, names, tensors in self.parts():
            bucket = fused.bucket_for(self.compressor, self.run, key, names, tensors, self.comm.size)
            self.launched.append(bucket.launch(tensors, self.comm, self.run, complete))

    def complete(self) -> None:
        """Send what waited for another rank's data (see :meth:`launch`); the layout is agreed on first."""
        for step in self.launched:
            step.complete(self.comm)

    def in_flight(self) -> List[Any]:
        """Handles of the collectives ``launch`` started (``finish`` waits for them)."""
        return [handle for step in self.launched for handle in step.handles.values()]

    def finish(self, average: bool = True, order: Optional[List[str]] = None) -> Any:
        """Wait for the collectives; every tensor's average (or sum over ranks), in its shape, as
        ``{name: result}``; with ``order`` (names), the results flat and concatenated in that order."""
        if len(self.launched) == 1 and order is not None:  # one form: its flat result (a DDP hook's bucket)
            flat = self.launched[0].finish(self.comm, average, order)
            return flat if self.caller is None else self.caller[0].from_host(flat, self.caller[1])
        for step in self.launched:  # every rank starts every round before waiting for any
            step.complete(self.comm)
        results = {}
        for step in self.launched:
            results.update(step.finish(self.comm, average))
        if self.caller is not None:
            back, like = self.caller
            results = {name: back.from_host(result, like) if name in self.converted else result
                       for name, result in results.items()}
        if order is None:
            return results
        ops = ops_for(results[order[0]])
        return ops.concat([ops.reshape(results[name], (-1,)) for name in order])
