"""Fused exchange of one bucket of gradients over a :class:`Communicator`.

A bucket holds several tensors (same dtype and device). Their payloads share
a few collectives instead of a few per tensor:

- first, one allgather of a header ``[config hash, layout hash, count of every
  sparse tensor]``; ``finish`` checks it before waiting for anything else (and
  ``launch`` already, for communicators that match collectives by order), so
  ranks configured differently (compressor, ratio, tensor names, sizes or
  dense/sparse split) all fail with the same error instead of waiting for
  collectives the others never start;
- sparse payloads: one allgather of all indices, one of all values; every
  rank's segment of each tensor is cut out by the counts (no padding) and the
  compressor decodes each tensor (scatter-add; RegTop-k learns from it);
- TernGrad: one allreduce-Max of the vector of the bucket's scales, then the
  codes drawn with the shared scales travel as one int32 allreduce of packed
  lanes (and/or one allgather of 2-bit codes, per tensor's wire format);
- dense payloads (None, FP16, tensors under ``dense_below``): one allreduce-Sum
  of their concatenation.

Usage: ``add(name, grad)`` for each tensor, ``launch()`` once the bucket is
complete, ``finish(average)`` for ``{name: average or sum}``.

Torch buckets of one dtype and device whose compressor has a fused form take
:mod:`hvd_compress.comm.fused` instead: the header is exchanged once per layout,
sizes are known in advance, a step reads nothing back to the host and encodes
the whole bucket with a few kernels. The per-tensor path above serves numpy and
TensorFlow tensors.
Every collective of a bucket is started by ``launch`` (TernGrad waits there for
its shared scales, unless ``launch(complete=False)`` leaves that to
``complete()``), so ``finish`` only waits and decodes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

from hvd_compress.wire import (DensePayload, SparsePayload, TernaryPayload, different_algorithms, header_config,
                               header_hash)
from hvd_compress.kernels import ops_for
from hvd_compress.compressors.base import NonFiniteGradientError


def elements(tensor: Any) -> int:
    """Elements of a tensor of any framework."""
    return math.prod(int(n) for n in tensor.shape)


def open_exchange(compressor: Any, comm: Any, key: str) -> Any:
    """The exchange of bucket ``key``: the compressor's own where it chooses per bucket
    (``make_exchange``: :class:`~hvd_compress.comm.auto.Auto`), else a :class:`BucketExchange`."""
    make = getattr(compressor, "make_exchange", None)
    return make(comm, key) if make is not None else BucketExchange(compressor, comm, key)


class BucketExchange:
    """One bucket's payloads and the collectives that move them."""

    def __init__(self, compressor: Any, comm: Any, key: str) -> None:
        self.compressor, self.comm, self.key = compressor.bind(comm.rank, comm.size), comm, key
        self.average = True
        self.shapes: Dict[str, tuple] = {}
        self.added: List[Tuple[str, Any]] = []
        self.dense: List[Tuple[str, DensePayload]] = []
        self.sparse: List[Tuple[str, SparsePayload]] = []
        self.ternary: List[Tuple[str, Any, float]] = []
        self.handles: Dict[str, Any] = {}
        self.rows: Any = None  # every rank's header, once checked
        self.ops: Any = None
        self.fused: Any = None  # the step of a fused bucket, once launched
        self.resume: Any = None  # what launch left for complete()
        self.nonfinite: set = set()  # names whose gradient holds NaN/Inf on this rank (per-tensor path)
        self.kept_residuals: Dict[str, Any] = {}  # TernGrad without shared scales: residuals before encode
        self.kept_state: Dict[str, Any] = {}  # momentum correction: residual and velocity before encode

    def add(self, name: str, tensor: Any) -> None:
        """Add one gradient of the bucket (encoded by ``launch``)."""
        self.ops = self.ops or ops_for(tensor, name)
        self.shapes[name] = tuple(tensor.shape)
        self.added.append((name, tensor))

    def _encode(self) -> None:
        """Per-tensor path: encode every tensor (TernGrad: measure its scale; codes come after sharing)."""
        for name, tensor in self.added:
            if elements(tensor) == 0:  # nothing to compress: an empty dense part, as Horovod sends it
                flat = self.ops.reshape(tensor, (-1,))
                self.dense.append((name, DensePayload(values=flat, dtype=flat.dtype)))
                continue
            try:
                if self.compressor.payload_kind == "ternary":
                    scale = self.compressor.local_scale(tensor, name)
                    if scale is not None:
                        self.ternary.append((name, tensor, scale))
                        continue
                kept = self.compressor.step_state(name, elements(tensor))
                if kept is not None:
                    self.kept_state[name] = kept
                payload = self.compressor.encode(tensor, name)
            except NonFiniteGradientError:
                self._add_nonfinite(name, tensor)
                continue
            if isinstance(payload, SparsePayload):
                self.sparse.append((name, payload))
            else:
                self.dense.append((name, payload))

    def _add_nonfinite(self, name: str, tensor: Any) -> None:
        """A NaN/Inf gradient on this rank: nothing is encoded (its state stays as it was), and every
        rank's result becomes non-finite, as in a dense allreduce. Dense tensors carry the NaN/Inf
        through the sum; a sparse one sends no entries and the count -1 in the header; TernGrad
        sends the scale Inf (the shared Max is then Inf: ``0 * Inf = NaN`` everywhere)."""
        ops = self.ops
        flat = ops.reshape(tensor, (-1,))
        numel = flat.shape[0]
        self.nonfinite.add(name)
        kind = self.compressor.fused_kind(numel)
        if kind == "sparse":
            indices = ops.cast(ops.as_int64([], like=flat), ops.index_dtype(numel))
            self.sparse.append((name, SparsePayload(values=flat[:0], indices=indices, numel=numel)))
        elif kind == "ternary":
            self.ternary.append((name, tensor, float("inf")))
        else:
            wire = self.compressor.dense_wire_dtype
            values = flat if wire is None else ops.cast(flat, getattr(ops, wire))
            self.dense.append((name, DensePayload(values=values, dtype=flat.dtype)))

    # ------------------------------------------------------------------ launch
    def launch(self, complete: bool = True) -> None:
        """Encode the bucket and start its collectives (asynchronous).

        ``complete=False``: wait for no other rank (ranks may then launch their buckets
        in different orders); what needs another collective's result first (TernGrad's
        codes need the shared scale; the layout check) is done by :meth:`complete`,
        which ``finish`` calls. Call ``complete`` on every launched bucket before
        ``finish`` on any, when ranks may finish them in different orders.
        """
        tensors = [t for _, t in self.added]
        if self.ops.__name__.endswith("torch_ops"):
            from hvd_compress.comm import fused  # imports torch: only for torch tensors

            if fused.supported(self.compressor, tensors):
                names = [n for n, _ in self.added]
                bucket = fused.bucket_for(self.compressor, self.key, names, tensors, self.comm.size)
                self.fused = bucket.launch(tensors, self.comm, complete)
                return
        self._encode()
        ops, comm, key = self.ops, self.comm, self.key
        layout = [(n, self.shapes[n], "dense") for n, _ in self.dense]
        layout += [(n, self.shapes[n], "sparse") for n, _ in self.sparse]
        layout += [(n, self.shapes[n], "ternary") for n, _, _ in self.ternary]
        signature = header_hash(layout)
        counts = [-1 if n in self.nonfinite else p.values.shape[0] for n, p in self.sparse]
        config = header_config(type(self.compressor).__name__, self.compressor.config_hash())
        header = ops.as_int64([[config, signature, *counts]], like=self._any_tensor())
        self.handles["header"] = comm.allgather_async(header, f"{key}.header")
        self.compressor.stats.add(8 * (2 + len(counts)), 0, 0, 0)  # the header travels every step here
        if comm.matches_by_order:
            self._check_header()
        if self.dense:
            flat = ops.concat([ops.reshape(p.values, (-1,)) for _, p in self.dense])
            self.handles["dense"] = comm.allreduce_async(flat, comm.SUM, f"{key}.dense")
        if self.sparse:
            rows = None if self.rows is None else [sum(max(c, 0) for c in row[2:]) for row in self.rows]
            self.handles["indices"] = comm.allgather_async(
                ops.concat([p.indices for _, p in self.sparse]), f"{key}.indices", rows
            )
            self.handles["values"] = comm.allgather_async(
                ops.concat([p.values for _, p in self.sparse]), f"{key}.values", rows
            )
        if self.ternary:
            scales = ops.as_float32([s for _, _, s in self.ternary], like=self.ternary[0][1])
            if self.compressor.scalar_sharing:
                self.handles["scales"] = comm.allreduce_async(scales, comm.MAX, f"{key}.scales")
                self.resume = self._launch_ternary_codes
            else:
                self.handles["scales"] = comm.allgather_async(scales, f"{key}.scales")
                self._launch_two_bit_codes()
        if complete:
            self.complete()

    def complete(self) -> None:
        """Send what waited for another rank's data (see :meth:`launch`)."""
        if self.fused is not None:
            self.fused.complete(self.comm)
        elif self.resume is not None:
            resume, self.resume = self.resume, None
            resume()

    def _any_tensor(self) -> Any:
        if self.sparse:
            return self.sparse[0][1].values
        return self.ternary[0][1] if self.ternary else self.dense[0][1].values

    def in_flight(self) -> List[Any]:
        """Handles of the collectives ``launch`` started (``finish`` waits for them)."""
        handles = self.fused.handles if self.fused is not None else self.handles
        return list(handles.values())

    # ------------------------------------------------------------------ finish
    def finish(self, average: bool = True) -> Dict[str, Any]:
        """Wait for the collectives; every tensor's average (or sum over ranks), in its shape."""
        self.average = average
        if self.fused is not None:
            return self.fused.finish(self.comm, average)
        results: Dict[str, Any] = {}
        self.complete()
        if self.rows is None:
            self._check_header()
        if self.dense:
            results.update(self._finish_dense())
        if self.sparse:
            results.update(self._finish_sparse())
        if self.ternary:
            results.update(self._finish_ternary())
        return results

    def _result(self, name: str, total: Any, dtype: Any) -> Any:
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
            results[name] = self._result(name, part, p.dtype)
        return results

    def _check_header(self) -> None:
        self.rows = self.ops.to_list(self.comm.wait(self.handles["header"]))
        if any(row[:2] != self.rows[0][:2] for row in self.rows):
            self.comm.fail_together()
            raise ValueError(
                f"hvd_compress: ranks disagree on '{self.key}' (compressor or its configuration, "
                f"the names, shapes and order of the gradients, or compressor state loaded from another "
                f"rank): [config hash, layout hash] per rank = {[row[:2] for row in self.rows]}"
                f"{different_algorithms(row[0] for row in self.rows)}; "
                f"this rank runs {self.compressor!r}{self.compressor.state_note()}"
            )

    def _finish_sparse(self) -> Dict[str, Any]:
        ops = self.ops
        indices = self.comm.wait(self.handles["indices"])
        values = self.comm.wait(self.handles["values"])
        per_rank = [[max(c, 0) for c in row[2:]] for row in self.rows]
        flagged = [any(row[2 + j] < 0 for row in self.rows) for j in range(len(self.sparse))]
        totals = [sum(counts) for counts in per_rank]
        by_tensor: List[List[SparsePayload]] = [[] for _ in self.sparse]
        for counts, v, i in zip(per_rank, ops.split(values, totals), ops.split(indices, totals)):
            for j, (seg_v, seg_i) in enumerate(zip(ops.split(v, counts), ops.split(i, counts))):
                by_tensor[j].append(SparsePayload(seg_v, seg_i, self.sparse[j][1].numel))
        results = {}
        for (name, payload), payloads, bad in zip(self.sparse, by_tensor, flagged):
            if bad:
                results[name] = self._nonfinite_result(name, payload)
            else:
                results[name] = self.compressor.decode(payloads, self.shapes[name], average=self.average, name=name)
        return results

    def _nonfinite_result(self, name: str, sent: SparsePayload) -> Any:
        """NaN for a sparse tensor that was non-finite on some rank. A rank that encoded it takes
        back what it sent and the step's gradient, so its residual is as before the step."""
        ops, numel = self.ops, sent.numel
        residual = self.compressor.memory.peek(name, "residual")
        if name in self.kept_state:  # momentum correction: residual and velocity put back as they were
            self.compressor.restore_step_state(name, self.kept_state[name])
        elif name not in self.nonfinite and residual is not None:
            flat = ops.reshape(residual, (-1,))
            returned = ops.cast(ops.sparse_sum([sent.indices], [sent.values], numel), flat.dtype)
            gradient = ops.cast(ops.reshape(dict(self.added)[name], (-1,)), flat.dtype)
            self.compressor.memory.set(name, "residual", flat + returned - gradient)
        nan = ops.full(numel, float("nan"), sent.values, ops.accumulation_dtype(sent.values.dtype))
        return self._result(name, nan, sent.values.dtype)

    def _launch_ternary_codes(self) -> None:
        """Shared scales: wait for their Max, encode with them, start the code sum (or 2-bit gather)."""
        ops, comm, tern = self.ops, self.comm, self.compressor
        if self.rows is None:  # agree on the layout before waiting for the scales
            self._check_header()
        self.shared = ops.to_list(comm.wait(self.handles["scales"]))
        self.payloads = [
            tern.encode(t, name, scale=s) if s < float("inf") else tern.nonfinite_payload(ops.reshape(t, (-1,)), ops, True)
            for (name, t, _), s in zip(self.ternary, self.shared)
        ]
        for fmt, op in (("allreduce", comm.SUM), ("allgather", None)):
            wires = [tern.wire_tensor(p, ops) for p in self.payloads if p.wire_format == fmt]
            if not wires:
                continue
            flat = ops.concat(wires)
            if op is None:
                self.handles[fmt] = comm.allgather_async(flat, f"{self.key}.codes2bit")
            else:
                self.handles[fmt] = comm.allreduce_async(flat, op, f"{self.key}.lanes")

    def _launch_two_bit_codes(self) -> None:
        """Each rank's own scale: allgather of the 2-bit codes."""
        ops, tern = self.ops, self.compressor
        # residuals before the step, for tensors another rank finds non-finite (known after the gather)
        self.kept_residuals = {name: tern.memory.peek(name, "residual") for name, _, _ in self.ternary}
        self.payloads = [
            tern.nonfinite_payload(ops.reshape(t, (-1,)), ops, False) if name in self.nonfinite else tern.encode(t, name)
            for name, t, _ in self.ternary
        ]
        self.packed = [ops.pack_two_bit(p.codes) for p in self.payloads]
        self.handles["codes2bit"] = self.comm.allgather_async(ops.concat(self.packed), f"{self.key}.codes2bit")

    def _finish_ternary(self) -> Dict[str, Any]:
        ops, comm, tern = self.ops, self.comm, self.compressor
        if not tern.scalar_sharing:
            return self._finish_ternary_unshared(comm.wait(self.handles["scales"]))
        received = {fmt: comm.wait(self.handles[fmt]) for fmt in ("allreduce", "allgather") if fmt in self.handles}
        results, offsets = {}, {"allreduce": 0, "allgather": 0}
        for (name, tensor, _), payload, scale in zip(self.ternary, self.payloads, self.shared):
            fmt, numel = payload.wire_format, elements(tensor)
            size = tern.wire_tensor(payload, ops).shape[0]
            if fmt == "allreduce":
                wire = received[fmt][offsets[fmt] : offsets[fmt] + size]
            else:  # rank r's codes for this tensor sit in rank r's chunk of the gather
                chunk = received[fmt].shape[0] // comm.size
                wire = ops.concat(
                    [
                        received[fmt][r * chunk + offsets[fmt] : r * chunk + offsets[fmt] + size]
                        for r in range(comm.size)
                    ]
                )
            offsets[fmt] += size
            if scale == float("inf"):  # non-finite on some rank
                results[name] = self._nonfinite_ternary(name, tensor)
                continue
            code_sum = tern.code_sum(wire, numel, comm.size, fmt, ops)
            total = ops.cast(code_sum, ops.accumulation_dtype(tensor.dtype)) * scale
            results[name] = self._result(name, total, tensor.dtype)
        return results

    def _nonfinite_ternary(self, name: str, tensor: Any) -> Any:
        """NaN for a TernGrad tensor that was non-finite on some rank (written out: ``0 * Inf``
        would warn); a rank that encoded it takes its residual back to before the step."""
        kept = self.kept_residuals.get(name)
        if kept is not None:
            self.compressor.memory.set(name, "residual", kept)
        like = self.ops.reshape(tensor, (-1,))
        return self._result(name, self.ops.full(elements(tensor), float("nan"), like,
                                                self.ops.accumulation_dtype(like.dtype)), like.dtype)

    def _finish_ternary_unshared(self, scales: Any) -> Dict[str, Any]:
        """Each rank's own scale: allgather of 2-bit codes and scales, decoded per rank."""
        ops, comm, tern = self.ops, self.comm, self.compressor
        gathered = comm.wait(self.handles["codes2bit"])
        chunk = gathered.shape[0] // comm.size
        rank_scales = ops.to_list(ops.reshape(scales, (comm.size, -1)))
        results, offset = {}, 0
        for j, ((name, tensor, _), mine) in enumerate(zip(self.ternary, self.payloads)):
            size = self.packed[j].shape[0]
            numel = elements(tensor)
            ranks = [
                TernaryPayload(
                    codes=ops.unpack_two_bit(gathered[r * chunk + offset : r * chunk + offset + size], numel),
                    scale=rank_scales[r][j],
                    world_size=comm.size,
                    shared_scale=False,
                    dtype=mine.dtype,
                )
                for r in range(comm.size)
            ]
            offset += size
            if any(r[j] == float("inf") for r in rank_scales):  # non-finite on some rank
                results[name] = self._nonfinite_ternary(name, tensor)
                continue
            results[name] = tern.decode(ranks, self.shapes[name], average=self.average, name=name)
        return results
