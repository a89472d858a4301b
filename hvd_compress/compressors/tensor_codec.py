"""The per-tensor codec: any framework, tensors of any sizes, payloads encoded one tensor at a time.

The per-tensor exchange (:class:`~hvd_compress.comm.exchange.BucketExchange`:
TensorFlow, custom compressors, numpy and torch buckets that cannot fuse) asks the compressor for a codec
(``compressor.tensor_codec(exchange)``) and hands it every gradient of the bucket.
:class:`TensorCodec` serves every compressor whose ``encode`` returns dense or sparse
payloads (:mod:`hvd_compress.wire`); TernGrad brings its own
(:class:`~hvd_compress.compressors.terngrad_tensors.TernaryTensorCodec`).

Dense payloads go back to the exchange, which sums them in one allreduce. Sparse ones
travel in one round (:mod:`hvd_compress.compressors.rounds`) of two allgathers, all
indices and all values of the bucket, each rank's count of each tensor in the bucket's
header; every rank's segment of each tensor is cut out by the counts (no padding) and
the compressor decodes each tensor (scatter-add in rank order; RegTop-k learns from it).

A tensor that holds NaN/Inf on a rank is not encoded there (its state stays as it was);
its result is non-finite on every rank, as in a dense allreduce. A dense one carries
the NaN/Inf through the sum; a sparse one sends no entries and the exchange flags it
in the header (``bucket.flagged``: flagged on some rank); its result is NaN and a rank
that encoded it takes back what it sent, so its residual is as before the step.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional, Tuple

from hvd_compress.wire import DensePayload, SparsePayload
from hvd_compress.compressors.rounds import Send


class TensorCodec:
    """Dense and sparse payloads of one exchange (see the module docstring); ``bucket`` is the
    exchange: its ``ops``, ``world``, ``shapes``, ``rows`` (every rank's header, once checked),
    ``nonfinite`` (this rank's NaN/Inf tensors), ``flagged`` (some rank's, once the header is
    checked), ``kept_state``, ``added`` and ``result(name, total, dtype)``."""

    kind = "sparse"  # the layout's name of the tensors this codec carries

    def __init__(self, compressor: Any, bucket: Any) -> None:
        self.compressor, self.bucket, self.ops = compressor, bucket, bucket.ops
        self.names: List[str] = []  # the tensors this codec carries, in order
        self.payloads: List[SparsePayload] = []

    @property
    def rounds(self) -> int:
        """Rounds of collectives of a step (0: every tensor went dense)."""
        return 1 if self.names else 0

    # ------------------------------------------------------------------ encode
    def add(self, name: str, tensor: Any) -> Optional[DensePayload]:
        """Encode one gradient: a dense payload goes back to the exchange, a sparse one stays here."""
        payload = self.compressor.encode(tensor, name)
        if not isinstance(payload, SparsePayload):
            return payload
        self.names.append(name)
        self.payloads.append(payload)
        return None

    def add_nonfinite(self, name: str, tensor: Any) -> Optional[DensePayload]:
        """A NaN/Inf gradient on this rank (module docstring): nothing encoded."""
        ops = self.ops
        flat = ops.reshape(tensor, (-1,))
        numel = flat.shape[0]
        if self.compressor.fused_kind(numel) == "dense":
            wire = self.compressor.dense_wire_dtype
            return DensePayload(values=flat if wire is None else ops.cast(flat, getattr(ops, wire)), dtype=flat.dtype)
        indices = ops.cast(ops.as_int64([], like=flat), ops.index_dtype(numel))
        self.names.append(name)
        self.payloads.append(SparsePayload(values=flat[:0], indices=indices, numel=numel))
        return None

    def layout(self) -> List[Tuple[str, tuple, str]]:
        """``(name, shape, kind)`` of each tensor this codec carries, for the layout hash."""
        return [(name, self.bucket.shapes[name], self.kind) for name in self.names]

    def header(self) -> List[int]:
        """The header's entries after ``[config hash, layout hash]``: each tensor's count."""
        return [int(p.values.shape[0]) for p in self.payloads]

    # ---------------------------------------------------------------- exchange
    def exchange(self, rows: Optional[List[List[int]]]) -> Generator[List[Send], Dict[str, Any], Dict[str, Any]]:
        """One round of two allgathers (each rank's rows from the header ``rows`` where checked
        already), then ``{name: result}``."""
        ops = self.ops
        counts = None if rows is None else [sum(row[2 : 2 + len(self.names)]) for row in rows]
        received = yield [Send("indices", "gather", ops.concat([p.indices for p in self.payloads]), counts),
                          Send("values", "gather", ops.concat([p.values for p in self.payloads]), counts)]
        return self._decode(received["indices"], received["values"])

    def _decode(self, indices: Any, values: Any) -> Dict[str, Any]:
        ops, bucket = self.ops, self.bucket
        per_rank = [row[2 : 2 + len(self.names)] for row in bucket.rows]
        totals = [sum(counts) for counts in per_rank]
        by_tensor: List[List[SparsePayload]] = [[] for _ in self.names]
        for counts, v, i in zip(per_rank, ops.split(values, totals), ops.split(indices, totals)):
            for j, (seg_v, seg_i) in enumerate(zip(ops.split(v, counts), ops.split(i, counts))):
                by_tensor[j].append(SparsePayload(seg_v, seg_i, self.payloads[j].numel))
        results = {}
        for name, payload, payloads in zip(self.names, self.payloads, by_tensor):
            if name in bucket.flagged:
                results[name] = self._nonfinite_result(name, payload)
            else:
                results[name] = self.compressor.decode(payloads, bucket.shapes[name], average=bucket.average,
                                                       name=name)
        return results

    def _nonfinite_result(self, name: str, sent: SparsePayload) -> Any:
        """NaN for a tensor that was non-finite on some rank. A rank that encoded it takes back
        what it sent and the step's gradient, so its residual is as before the step."""
        ops, bucket, memory = self.ops, self.bucket, self.compressor.memory
        residual = memory.peek(name, "residual")
        if name in bucket.kept_state:  # momentum correction: residual and velocity put back as they were
            self.compressor.restore_step_state(name, bucket.kept_state[name])
        elif name not in bucket.nonfinite and residual is not None:
            flat = ops.reshape(residual, (-1,))
            returned = ops.cast(ops.sparse_sum([sent.indices], [sent.values], sent.numel), flat.dtype)
            gradient = ops.cast(ops.reshape(dict(bucket.added)[name], (-1,)), flat.dtype)
            memory.set(name, "residual", flat + returned - gradient)
        return nan_result(bucket, name, sent.numel, sent.values)


def nan_result(bucket: Any, name: str, numel: int, like: Any) -> Any:
    """The exchange's result for a tensor non-finite on some rank: NaN, in ``like``'s dtype
    (written out: ``0 * Inf`` would warn)."""
    ops = bucket.ops
    return bucket.result(name, ops.full(numel, float("nan"), like, ops.accumulation_dtype(like.dtype)), like.dtype)

