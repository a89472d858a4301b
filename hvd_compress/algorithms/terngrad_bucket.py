"""TernGrad's codec for a fused layout, numpy, torch or TensorFlow (the algorithm:
:mod:`hvd_compress.algorithms.terngrad`).

The kernel module's ``terngrad_bucket_*`` functions work on every row (tensor) at once; torch's
run per size group one ``aminmax`` (and ``std`` when clipping), so the scales
``max|clip(g)| = min(max|g|, b)`` and non-finite flags of all tensors come at once;
with scalar sharing, round 1 is one allreduce-Max of ``scales ++ flags`` and round 2
the codes drawn with the shared scales (per group only the division by its scales) as
one packed int32 allreduce-Sum (or one 2-bit allgather,
:func:`hvd_compress.wire.ternary_wire_format`); without it, one round gathers every
rank's scales and 2-bit codes. The decode multiplies each group's code sums by its
scales, NaN for a flagged tensor. Each tensor draws its own uniforms, in the order the
tensors were added, so the results equal the per-tensor spec's (one tensor at a time) bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional, Tuple

from hvd_compress import wire
from hvd_compress.algorithms.rounds import Send

#: an array of the bucket's kernel module (numpy array, torch or TensorFlow tensor)
Array = Any


class TernaryBucketCodec:
    """Plan of TernGrad's compressed part of one fused bucket (see the module docstring)."""

    spare = 0

    def __init__(self, compressor: Any, layout: Any) -> None:
        self.compressor = compressor
        self.rounds = 2 if compressor.scalar_sharing else 1
        #: how the codes travel: packed lanes summed (``allreduce``) or 2-bit codes gathered
        self.wire_format = (wire.ternary_wire_format(layout.n_compressed, layout.world)
                            if compressor.scalar_sharing else "allgather")
        self.label = "lanes" if self.wire_format == "allreduce" else "codes2bit"

    def wire(self, layout: Any, itemsize: int) -> Tuple[int, int]:
        """``(bytes sent, values sent)`` of a step: the codes, and a scale and a flag per tensor."""
        codes = (4 * wire.ternary_lanes(layout.n_compressed, layout.world) if self.wire_format == "allreduce"
                 else wire.two_bit_bytes(layout.n_compressed))
        acc_size = layout.ops.itemsize(layout.ops.empty(0, layout.acc, layout.like))
        return codes + 2 * len(layout.compressed) * acc_size, layout.n_compressed

    def exchange(self, layout: Any, g: Array, step: Any) -> Generator[List[Send], Dict[str, Any], Any]:
        """Scales, codes, then the decode ``(sum over ranks, per-tensor flag of a non-finite tensor)``."""
        ops = layout.ops
        a = step.accumulated(g)
        local, bound = ops.terngrad_bucket_scales(a, layout.groups, self.compressor.clip, self.compressor.compile)
        local = ops.cast(local, layout.acc)  # max|clip(g)| of every compressed tensor
        uniform = self._uniform(layout, a, step.run)
        sanitized = ops.nonfinite_to_zero(local)
        flags = ops.cast(sanitized != local, layout.acc)  # a scale (>= 0) is NaN or +Inf
        count = len(layout.compressed)
        if self.compressor.scalar_sharing:  # the codes need the Max over ranks
            received = yield [Send("scales", "max", ops.concat([sanitized, flags]))]
            shared = received["scales"]
            bad = shared[count:] > 0
            scale = shared[:count]
            received = yield [self._codes_send(layout, a, bound, uniform, scale, step)]
            total = self._scaled_rows(layout, self._code_sum(layout, received[self.label]),
                                      ops.where(bad, float("nan"), ops.cast(scale, layout.acc)))
            return total, bad
        scales = Send("scales", "gather", ops.concat([sanitized, flags]), [2 * count] * layout.world)
        received = yield [scales, self._codes_send(layout, a, bound, uniform, sanitized, step)]
        return self._decode_own_scales(layout, received)

    def _uniform(self, layout: Any, a: Array, run: Any) -> Array:
        """Every compressed tensor's uniforms from this rank's stream in the run state ``run``, drawn in the
        order the tensors were added, in the gradients' dtype; or the stream keys from which the codes' pass
        makes those uniforms itself (``ops.draws_in_pass``: torch's counter stream, compiled on the host)."""
        ops, comp = layout.ops, self.compressor
        generator = run.generator(ops, comp.seed, comp.rank, a)
        order = sorted(layout.compressed)
        if ops.draws_in_pass(generator, a, layout.dtype, comp.compile):
            turn = {i: t for t, i in enumerate(order)}  # each tensor's turn to draw
            return ops.stream_keys(generator, [layout.numels[i] for i in order],
                                   [turn[i] for i in layout.compressed], layout.like)
        uniform = ops.empty(layout.n_compressed, ops.float32, layout.like)
        parts = {}
        for i in order:
            start = layout.offsets[i]
            parts[i] = ops.uniform_into(generator, uniform[start : start + layout.numels[i]])
        return ops.cast(ops.joined(uniform, [parts[i] for i in layout.compressed]), layout.dtype)

    def _codes_send(self, layout: Any, a: Array, bound: Optional[Array], uniform: Array, scale: Array,
                    step: Any) -> Send:
        """Codes drawn with ``scale`` (one per compressed tensor): the residual ``r = a - S t``, and their collective."""
        ops = layout.ops
        scale_a = ops.cast(scale, a.dtype)
        codes = ops.terngrad_bucket_codes(a, layout.groups, bound, scale_a, uniform, self.compressor.compile)
        if step.feedback:  # per group in place
            step.residual = ops.terngrad_bucket_residual(a, layout.groups, codes, scale_a)
        if self.wire_format == "allreduce":
            return Send(self.label, "sum", ops.pack_ternary(codes, layout.world, self.compressor.compile))
        packed = ops.pack_two_bit(codes, self.compressor.compile)
        return Send(self.label, "gather", packed, [packed.shape[0]] * layout.world)

    def _code_sum(self, layout: Any, received: Array) -> Array:
        """``sum over ranks of t``: summed lanes unpacked, or every rank's 2-bit codes summed in int8
        (``|sum| <= N``) or int16."""
        ops, n, world = layout.ops, layout.n_compressed, layout.world
        if self.wire_format == "allreduce":
            return ops.unpack_ternary_sum(received, n, world)
        chunk = wire.two_bit_bytes(n)
        code_sum = ops.unpack_two_bit(received[:chunk], n)
        if world > 127:
            code_sum = ops.cast(code_sum, ops.int16)
        for r in range(1, world):
            code_sum = ops.add_into(code_sum, ops.unpack_two_bit(received[r * chunk : (r + 1) * chunk], n))
        return code_sum

    def _decode_own_scales(self, layout: Any, received: Dict[str, Any]) -> Tuple[Array, Array]:
        """Each rank's codes times its own scales, summed in rank order; a flagged tensor: NaN
        from the first rank's part on."""
        ops, count, n = layout.ops, len(layout.compressed), layout.n_compressed
        shared = ops.cast(ops.reshape(received["scales"], (layout.world, 2 * count)), layout.acc)
        bad = ops.any_along(shared[:, count:] > 0, 0)
        chunk = wire.two_bit_bytes(n)
        total = None
        for r in range(layout.world):
            codes = ops.unpack_two_bit(received[self.label][r * chunk : (r + 1) * chunk], n)
            scale = ops.where(bad, float("nan"), shared[r, :count]) if r == 0 else shared[r, :count]
            part = self._scaled_rows(layout, codes, scale)
            total = part if total is None else ops.add_into(total, part)
        return total, bad

    def _scaled_rows(self, layout: Any, codes: Array, scale: Array) -> Array:
        """``codes * S`` per compressed tensor, in the accumulation dtype (integer codes convert exactly)."""
        return layout.ops.scale_rows(layout.groups, codes, scale, layout.acc, layout.n_compressed,
                                     self.compressor.compile)
