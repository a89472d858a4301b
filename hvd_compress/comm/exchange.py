"""Exchange of one bucket of gradients over a :class:`Communicator`.

A bucket holds several tensors (same dtype and device). Their payloads share
a few collectives instead of a few per tensor:

- first, one allgather of a header ``[config hash, layout hash, codec's columns
  (a sparse tensor's count), flags]``, a flag bit per tensor of the bucket
  (:func:`flag_words`; set: its gradient holds NaN/Inf on this rank; a tensor the
  codec carries is then NaN on every rank and no rank's state moves: the codec asks
  ``flagged``); ``finish`` checks
  it before waiting for anything else (and ``launch`` already, for communicators
  that match collectives by order), so ranks configured differently (compressor,
  ratio, tensor names, sizes or dense/sparse split) all fail with the same error
  instead of waiting for collectives the others never start;
- dense payloads (None, FP16, tensors under ``dense_below``): one allreduce-Sum
  of their concatenation;
- the rest: the rounds of collectives of the compressor's per-tensor codec
  (``compressor.tensor_codec(exchange)``: :mod:`hvd_compress.compressors.tensor_codec`
  for dense and sparse payloads, TernGrad's own), started here; the codec encodes
  and decodes, this module knows no algorithm.

Usage: ``add(name, grad)`` for each tensor, ``launch()`` once the bucket is
complete, ``finish(average)`` for ``{name: average or sum}``.

Buckets of numpy arrays or torch tensors (one dtype and device) whose compressor
has a fused form take :mod:`hvd_compress.comm.fused` instead (``fused.supported``:
the kernel module's ``FUSES_BUCKETS`` and ``fusable``): the header is exchanged once
per layout, sizes are known in advance, a step reads nothing back to the host and
encodes the whole bucket with a few kernels; eager TensorFlow CPU float32/float64
tensors ride it as numpy arrays (:func:`~hvd_compress.kernels.computed_form`). The
per-tensor path above serves the other TensorFlow tensors (graphs, GPUs, 16-bit
types), custom compressors (``fused = False``), buckets that cannot fuse, and
``BucketExchange(..., fuse=False)``.
Every collective of a bucket is started by ``launch`` (a round that needs an
earlier one's result, TernGrad's codes drawn with the shared scales, is started
there too, unless ``launch(complete=False)`` leaves it to ``complete()``), so
``finish`` only waits and decodes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from hvd_compress.wire import DensePayload, header_config, header_hash
from hvd_compress.kernels import computed_form, ops_for
from hvd_compress.compressors.base import NonFiniteGradientError
from hvd_compress.comm import fused
from hvd_compress.comm.rounds import Rounds, check_header


def elements(tensor: Any) -> int:
    """Elements of a tensor of any framework."""
    return math.prod(int(n) for n in tensor.shape)


#: flags of non-finite tensors per header column (bits of an int64 that stays positive)
FLAG_BITS = 63


def flag_words(flags: List[bool]) -> List[int]:
    """``flags`` (one per tensor of the bucket, in order) packed ``FLAG_BITS`` to an int64 column:
    the header's width depends on the bucket's tensors only, not on which are flagged or dense."""
    return [sum(1 << bit for bit, flag in enumerate(flags[start : start + FLAG_BITS]) if flag)
            for start in range(0, len(flags), FLAG_BITS)]


def flagged_anywhere(rows: List[List[int]], count: int) -> List[bool]:
    """Per tensor of ``count``: whether some rank's header row (its last columns, :func:`flag_words`) flags it."""
    words = -(-count // FLAG_BITS)
    return [any(row[len(row) - words + j // FLAG_BITS] >> (j % FLAG_BITS) & 1 for row in rows) for j in range(count)]


def open_exchange(compressor: Any, comm: Any, key: str, state: Any = None) -> Any:
    """The exchange of bucket ``key`` on the run state ``state`` (a route's
    :class:`~hvd_compress.compressors.state.CompressorState`; default: ``compressor.state``, the
    compressor's own): the compressor's own exchange where it chooses per bucket
    (``make_exchange``: :class:`~hvd_compress.comm.auto.Auto`), else a :class:`BucketExchange`."""
    make = getattr(compressor, "make_exchange", None)
    return make(comm, key, state) if make is not None else BucketExchange(compressor, comm, key, state)


def in_run_state(method: Callable) -> Callable:
    """An exchange's method run with ``self.compressor``'s steps on the exchange's run state ``self.run``."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.compressor.running(self.run):
            return method(self, *args, **kwargs)

    return run


class BucketExchange:
    """One bucket's payloads and the collectives that move them, on the run state ``run`` (what the
    route hands :func:`open_exchange`); every step of the compressor it makes runs on that state.
    ``fuse=False``: the per-tensor path even where the fused one could run (tests compare the two)."""

    def __init__(self, compressor: Any, comm: Any, key: str, run: Any = None, fuse: bool = True) -> None:
        self.compressor, self.comm, self.key = compressor.bind(comm.rank, comm.size), comm, key
        self.run = compressor.state if run is None else run
        self.world, self.fuse = comm.size, fuse
        self.average = True
        self.shapes: Dict[str, tuple] = {}
        self.added: List[Tuple[str, Any]] = []
        self.dense: List[Tuple[str, DensePayload]] = []
        self.handles: Dict[str, Any] = {}
        self.rows: Any = None  # every rank's header, once checked
        self.ops: Any = None
        self.caller: Any = None  # (kernel module, a tensor) of the caller's tensors, when computed in another form
        self.fused: Any = None  # the step of a fused bucket, once launched
        self.codec: Any = None  # the compressor's per-tensor codec, once launched
        self.rounds = Rounds(comm, key, self.handles)  # the codec's rounds of collectives
        self.nonfinite: set = set()  # names whose gradient holds NaN/Inf on this rank (per-tensor path)
        self.flagged: set = set()  # the codec's names whose gradient holds NaN/Inf on some rank (the header's flags)
        self.kept_state: Dict[str, Any] = {}  # momentum correction: residual and velocity before encode

    def add(self, name: str, tensor: Any) -> None:
        """Add one gradient of the bucket (encoded by ``launch``), in the form it is computed on
        (:func:`~hvd_compress.kernels.computed_form`: eager TensorFlow CPU tensors as numpy)."""
        computed = computed_form(tensor)
        if computed is not tensor and self.caller is None:  # results go back as the caller's tensors
            self.caller = (ops_for(tensor), tensor)
        tensor = computed
        self.ops = self.ops or ops_for(tensor, name)
        self.shapes[name] = tuple(tensor.shape)
        self.added.append((name, tensor))

    def _encode(self) -> None:
        """Per-tensor path: the codec encodes every tensor; dense payloads come back for the dense sum.

        A NaN/Inf gradient on this rank is not encoded (its state stays as it was; the codec's
        ``add_nonfinite``) and every rank's result becomes non-finite, as in a dense allreduce:
        a dense one carries the NaN/Inf through the sum, one the codec carries is flagged in
        the header."""
        self.codec = self.compressor.tensor_codec(self)
        for name, tensor in self.added:
            if elements(tensor) == 0:  # nothing to compress: an empty dense part, as Horovod sends it
                flat = self.ops.reshape(tensor, (-1,))
                self.dense.append((name, DensePayload(values=flat, dtype=flat.dtype)))
                continue
            try:
                kept = self.compressor.step_state(name, elements(tensor))
                if kept is not None:
                    self.kept_state[name] = kept
                payload = self.codec.add(name, tensor)
            except NonFiniteGradientError:
                self.nonfinite.add(name)
                payload = self.codec.add_nonfinite(name, tensor)
            if payload is not None:
                self.dense.append((name, payload))

    # ------------------------------------------------------------------ launch
    @in_run_state
    def launch(self, complete: bool = True) -> None:
        """Encode the bucket and start its collectives (asynchronous).

        ``complete=False``: wait for no other rank (ranks may then launch their buckets
        in different orders); what needs another collective's result first (TernGrad's
        codes need the shared scale; the layout check) is done by :meth:`complete`,
        which ``finish`` calls. Call ``complete`` on every launched bucket before
        ``finish`` on any, when ranks may finish them in different orders.
        """
        tensors = [t for _, t in self.added]
        if self.fuse and fused.supported(self.compressor, tensors):
            names = [n for n, _ in self.added]
            bucket = fused.bucket_for(self.compressor, self.run, self.key, names, tensors, self.comm.size)
            self.fused = bucket.launch(tensors, self.comm, complete)
            return
        self._encode()
        ops, comm, key = self.ops, self.comm, self.key
        layout = [(n, self.shapes[n], "dense") for n, _ in self.dense] + self.codec.layout()
        config = header_config(type(self.compressor).__name__, self.compressor.config_hash())
        flags = flag_words([name in self.nonfinite for name, _ in self.added])
        columns = [config, header_hash(layout), *self.codec.header(), *flags]
        header = ops.as_int64([columns], like=self.added[0][1])
        self.handles["header"] = comm.allgather_async(header, f"{key}.header")
        self.run.stats.add(8 * len(columns), 0, 0, 0)  # the header travels every step here
        if comm.matches_by_order:
            self._check_header()
        if self.dense:
            flat = ops.concat([ops.reshape(p.values, (-1,)) for _, p in self.dense])
            self.handles["dense"] = comm.allreduce_async(flat, comm.SUM, f"{key}.dense")
        if self.codec.rounds:
            self.rounds.begin(self.codec.exchange(self.rows), self.codec.rounds)
        if complete:
            self.complete()

    @in_run_state
    def complete(self) -> None:
        """Send what waited for another rank's data (see :meth:`launch`); the layout is agreed on first."""
        if self.fused is not None:
            self.fused.complete(self.comm)
            return
        if self.rounds.left > 0 and self.rows is None:
            self._check_header()
        self.rounds.advance()

    def in_flight(self) -> List[Any]:
        """Handles of the collectives ``launch`` started (``finish`` waits for them)."""
        handles = self.fused.handles if self.fused is not None else self.handles
        return list(handles.values())

    # ------------------------------------------------------------------ finish
    @in_run_state
    def finish(self, average: bool = True, order: Optional[List[str]] = None) -> Any:
        """Wait for the collectives; every tensor's average (or sum over ranks), in its shape, as
        ``{name: result}``; with ``order`` (names), the results flat and concatenated in that order."""
        self.average = average
        if self.fused is not None:
            results = self.fused.finish(self.comm, average, order)
        else:
            results = self._finish()
            if order is not None:
                results = self.ops.concat([self.ops.reshape(results[name], (-1,)) for name in order])
        if self.caller is None:
            return results
        back, like = self.caller
        if order is not None:
            return back.from_host(results, like)
        return {name: back.from_host(result, like) for name, result in results.items()}

    def _finish(self) -> Dict[str, Any]:
        """:meth:`finish` on the per-tensor path."""
        results: Dict[str, Any] = {}
        self.complete()
        if self.rows is None:
            self._check_header()
        if self.dense:
            results.update(self._finish_dense())
        if self.rounds.begun:
            results.update(self.rounds.decode())
        self.rounds.release()
        return results

    def result(self, name: str, total: Any, dtype: Any) -> Any:
        """``total`` (a sum over ranks, flat) as tensor ``name``'s result: averaged unless
        ``finish(average=False)``, in ``dtype`` and the tensor's shape."""
        if self.average:
            total = self.ops.divide(total, self.comm.size)
        return self.ops.reshape(self.ops.cast(total, dtype), self.shapes[name])

    def _finish_dense(self) -> Dict[str, Any]:
        total = self.comm.wait(self.handles["dense"])
        sizes = [elements(p.values) for _, p in self.dense]
        acc = self.ops.accumulation_dtype(total.dtype)
        results = {}
        for (name, p), part in zip(self.dense, self.ops.split(total, sizes)):
            part = self.ops.cast(part, acc)
            if name in self.kept_state and self.ops.count_nonfinite(part):  # velocity as before the step
                self.compressor.restore_step_state(name, self.kept_state[name])
            results[name] = self.result(name, part, p.dtype)
        return results

    def _check_header(self) -> None:
        self.rows = self.ops.to_list(self.comm.wait(self.handles["header"]))
        check_header(self.comm, self.rows, self.key, self.compressor)
        anywhere = flagged_anywhere(self.rows, len(self.added))
        self.flagged = {name for (name, _), bad in zip(self.added, anywhere) if bad}
