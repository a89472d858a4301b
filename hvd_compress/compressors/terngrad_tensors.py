"""TernGrad's per-tensor codec (the algorithm: :mod:`hvd_compress.compressors.terngrad`).

With scalar sharing, two rounds: an allreduce-Max of the bucket's scales ``max|clip(g)|``
(one per tensor), then the codes drawn with the shared scales, as one allreduce-Sum of
packed int32 lanes and/or one allgather of 2-bit codes (each tensor's wire format,
:func:`hvd_compress.wire.ternary_wire_format`); the scale is read on the host between
the rounds. Without it, one round gathers every rank's scales and 2-bit codes, decoded
per rank. A tensor with NaN/Inf on a rank is flagged in the exchange's header (its scale
0): no rank encodes it with a shared scale, its result is NaN everywhere, and a rank that
encoded it with its own scale takes its residual back.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional

from hvd_compress.wire import DensePayload, TernaryPayload
from hvd_compress.compressors.rounds import Send
from hvd_compress.compressors.tensor_codec import TensorCodec, nan_result

#: the wire formats of the codes: (format, operation, collective name)
CODE_WIRES = (("allreduce", "sum", "lanes"), ("allgather", "gather", "codes2bit"))


class TernaryTensorCodec(TensorCodec):
    """TernGrad's tensors of one exchange (see the module docstring)."""

    kind = "ternary"

    def __init__(self, compressor: Any, bucket: Any) -> None:
        super().__init__(compressor, bucket)
        self.tensors: List[Any] = []
        self.scales: List[float] = []  # this rank's, 0 for a non-finite tensor
        self.measured: Dict[str, Any] = {}  # what encoding a tensor needs besides the scale

    @property
    def rounds(self) -> int:
        return 0 if not self.names else 2 if self.compressor.scalar_sharing else 1

    def add(self, name: str, tensor: Any) -> Optional[DensePayload]:
        """Measure the tensor's scale; codes come after the scales are shared. Small tensors go dense."""
        measured = self.compressor.measure(tensor, name)
        if measured is None:
            return self.compressor.encode(tensor, name)
        self.measured[name] = measured
        self._carry(name, tensor, measured[3])
        return None

    def add_nonfinite(self, name: str, tensor: Any) -> Optional[DensePayload]:
        if self.compressor.fused_kind(int(self.ops.reshape(tensor, (-1,)).shape[0])) == "dense":
            return super().add_nonfinite(name, tensor)
        self._carry(name, tensor, 0.0)
        return None

    def _carry(self, name: str, tensor: Any, scale: float) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.scales.append(scale)

    def header(self) -> List[int]:
        return []

    def exchange(self, rows: Optional[List[List[int]]]) -> Generator[List[Send], Dict[str, Any], Dict[str, Any]]:
        ops, tern = self.ops, self.compressor
        scales = ops.as_float32(self.scales, like=self.tensors[0])
        if tern.scalar_sharing:
            received = yield [Send("scales", "max", scales)]
            shared = ops.to_list(received["scales"])
            payloads = [  # the header is checked: flagged tensors are known
                tern.nonfinite_payload(ops.reshape(t, (-1,)), ops, True) if name in self.bucket.flagged
                else tern.encode_measured(self.measured[name], name, scale=s)
                for name, t, s in zip(self.names, self.tensors, shared)
            ]
            wires = [tern.wire_tensor(p, ops) for p in payloads]
            sends = []
            for fmt, op, label in CODE_WIRES:
                chosen = [wire for p, wire in zip(payloads, wires) if p.wire_format == fmt]
                if chosen:
                    sends.append(Send(label, op, ops.concat(chosen)))
            received = yield sends
            return self._decode_shared(received, payloads, shared, [wire.shape[0] for wire in wires])
        # residuals before the step, for tensors another rank finds non-finite (known after the gather)
        kept = {name: tern.memory.peek(name, "residual") for name in self.names}
        payloads = [
            tern.nonfinite_payload(ops.reshape(t, (-1,)), ops, False) if name in self.bucket.nonfinite
            else tern.encode_measured(self.measured[name], name)
            for name, t in zip(self.names, self.tensors)
        ]
        packed = [ops.pack_two_bit(p.codes) for p in payloads]
        received = yield [Send("scales", "gather", scales), Send("codes2bit", "gather", ops.concat(packed))]
        return self._decode_own_scales(received, payloads, packed, kept)

    def _decode_shared(self, received: Dict[str, Any], payloads: List[TernaryPayload],
                       shared: List[float], sizes: List[int]) -> Dict[str, Any]:
        """Every tensor's ``S * sum over ranks of t``: its part (``sizes``: its wire's length) of the
        summed lanes, or its codes in every rank's chunk of the 2-bit gather."""
        ops, tern, bucket = self.ops, self.compressor, self.bucket
        world = bucket.world
        results, offsets = {}, {"allreduce": 0, "allgather": 0}
        for name, tensor, payload, scale, size in zip(self.names, self.tensors, payloads, shared, sizes):
            fmt, label = payload.wire_format, "lanes" if payload.wire_format == "allreduce" else "codes2bit"
            start = offsets[fmt]
            if fmt == "allreduce":
                wire = received[label][start : start + size]
            else:  # rank r's codes for this tensor sit in rank r's chunk of the gather
                chunk = received[label].shape[0] // world
                wire = ops.concat([received[label][r * chunk + start : r * chunk + start + size] for r in range(world)])
            offsets[fmt] += size
            numel = int(payload.codes.shape[0])
            if name in bucket.flagged:  # non-finite on some rank
                results[name] = nan_result(bucket, name, numel, ops.reshape(tensor, (-1,)))
                continue
            code_sum = tern.code_sum(wire, numel, world, fmt, ops)
            total = ops.cast(code_sum, ops.accumulation_dtype(tensor.dtype)) * scale
            results[name] = bucket.result(name, total, tensor.dtype)
        return results

    def _decode_own_scales(self, received: Dict[str, Any], payloads: List[TernaryPayload], packed: List[Any],
                           kept: Dict[str, Any]) -> Dict[str, Any]:
        """Each rank's own scale: every rank's codes decoded with its scale, summed by the compressor."""
        ops, tern, bucket = self.ops, self.compressor, self.bucket
        world, gathered = bucket.world, received["codes2bit"]
        chunk = gathered.shape[0] // world
        rank_scales = ops.to_list(ops.reshape(received["scales"], (world, -1)))
        results, offset = {}, 0
        for j, (name, tensor, mine) in enumerate(zip(self.names, self.tensors, payloads)):
            size, numel = packed[j].shape[0], int(mine.codes.shape[0])
            ranks = [
                TernaryPayload(codes=ops.unpack_two_bit(gathered[r * chunk + offset : r * chunk + offset + size], numel),
                               scale=rank_scales[r][j], world_size=world, shared_scale=False, dtype=mine.dtype)
                for r in range(world)
            ]
            offset += size
            if name in bucket.flagged:  # non-finite on some rank: the residual as before
                if kept.get(name) is not None:
                    tern.memory.set(name, "residual", kept[name])
                results[name] = nan_result(bucket, name, numel, ops.reshape(tensor, (-1,)))
                continue
            results[name] = tern.decode(ranks, bucket.shapes[name], average=bucket.average, name=name)
        return results
