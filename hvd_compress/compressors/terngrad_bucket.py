"""TernGrad's codec for a fused torch bucket (the algorithm: :mod:`hvd_compress.compressors.terngrad`).

Per size group one ``aminmax`` (and ``std`` when clipping), so the scales
``max|clip(g)| = min(max|g|, b)`` and non-finite flags of all tensors come at once;
with scalar sharing, round 1 is one allreduce-Max of ``scales ++ flags`` and round 2
the codes drawn with the shared scales (per group only the division by its scales) as
one packed int32 allreduce-Sum (or one 2-bit allgather,
:func:`hvd_compress.wire.ternary_wire_format`); without it, one round gathers every
rank's scales and 2-bit codes. The decode multiplies each group's code sums by its
scales, NaN for a flagged tensor. Each tensor draws its own uniforms, in the order the
tensors were added, so the results equal the per-tensor compressor's bit for bit.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, List, Optional, Tuple

import torch

from hvd_compress import wire
from hvd_compress.kernels import torch_ops as ops
from hvd_compress.compressors.rounds import Send


class TernaryBucketCodec:
    """Plan of TernGrad's compressed part of one fused bucket (see the module docstring)."""

    spare = 0

    def __init__(self, compressor: Any, bucket: Any) -> None:
        self.compressor = compressor
        self.rounds = 2 if compressor.scalar_sharing else 1
        #: how the codes travel: packed lanes summed (``allreduce``) or 2-bit codes gathered
        self.wire_format = (wire.ternary_wire_format(bucket.n_compressed, bucket.world)
                            if compressor.scalar_sharing else "allgather")
        self.label = "lanes" if self.wire_format == "allreduce" else "codes2bit"

    def wire(self, bucket: Any, itemsize: int) -> Tuple[int, int]:
        """``(bytes sent, values sent)`` of a step: the codes, and a scale and a flag per tensor."""
        codes = (4 * wire.ternary_lanes(bucket.n_compressed, bucket.world) if self.wire_format == "allreduce"
                 else wire.two_bit_bytes(bucket.n_compressed))
        acc_size = torch.empty((), dtype=bucket.acc).element_size()
        return codes + 2 * len(bucket.compressed) * acc_size, bucket.n_compressed

    def exchange(self, bucket: Any, g: torch.Tensor, step: Any) -> Generator[List[Send], Dict[str, Any], Any]:
        """Scales, codes, then the decode ``(sum over ranks, per-tensor flag of a non-finite tensor)``."""
        a = bucket.compensated(g)
        local, bound = self._scales(bucket, a)
        uniform = self._uniform(bucket, a)
        sanitized = torch.nan_to_num(local, nan=0.0, posinf=0.0)
        flags = torch.ne(sanitized, local).to(bucket.acc)  # a scale (>= 0) is NaN or +Inf
        count = len(bucket.compressed)
        if self.compressor.scalar_sharing:  # the codes need the Max over ranks
            received = yield [Send("scales", "max", torch.cat([sanitized, flags]))]
            shared = received["scales"]
            bad = shared[count:] > 0
            scale = shared[:count]
            received = yield [self._codes_send(bucket, a, bound, uniform, scale, step)]
            total = self._scaled_rows(bucket, self._code_sum(bucket, received[self.label]),
                                      torch.where(bad, torch.nan, scale.to(bucket.acc)))
            return total, bad
        scales = Send("scales", "gather", torch.cat([sanitized, flags]), [2 * count] * bucket.world)
        received = yield [scales, self._codes_send(bucket, a, bound, uniform, sanitized, step)]
        return self._decode_own_scales(bucket, received)

    def _uniform(self, bucket: Any, a: torch.Tensor) -> torch.Tensor:
        """Every compressed tensor's uniforms from this rank's stream, drawn in the order the tensors were added."""
        uniform = torch.empty(bucket.n_compressed, dtype=torch.float32, device=bucket.device)
        generator = self.compressor.generator(ops, a)
        for i in sorted(bucket.compressed):
            start = bucket.offsets[i]
            torch.rand(bucket.numels[i], generator=generator, dtype=torch.float32, device=bucket.device,
                       out=uniform[start : start + bucket.numels[i]])
        return uniform.to(bucket.dtype)

    def _scales(self, bucket: Any, a: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every compressed tensor's scale ``max|clip(g)|`` (in the accumulation dtype) and clipping
        bound (``a``'s dtype; ``None`` without clipping): one ``aminmax`` (and ``std``) per group.

        ``clip(g) = clamp(g, -b, b)`` is monotone, so ``max|clip(g)| = min(max(-min g, max g), b)``
        exactly; ``b = c std(g)``, or +Inf where ``b = 0`` or ``g`` is constant (no clipping).
        """
        clip = self.compressor.clip
        extremes = [torch.aminmax(grp.view(a), dim=1) for grp in bucket.groups]
        low, high = torch.cat([e[0] for e in extremes]), torch.cat([e[1] for e in extremes])
        local = torch.maximum(-low, high).abs()
        if clip is None:
            return local.to(bucket.acc), None
        std = torch.cat([torch.std(grp.view(a), dim=1, correction=0) for grp in bucket.groups])
        bound = (std.double() * clip).to(a.dtype)
        bound = torch.where((bound == 0) | (low == high), torch.inf, bound)
        return torch.minimum(local, bound).to(bucket.acc), bound

    def _codes_send(self, bucket: Any, a: torch.Tensor, bound: Optional[torch.Tensor], uniform: torch.Tensor,
                    scale: torch.Tensor, step: Any) -> Send:
        """Codes drawn with ``scale`` (one per compressed tensor): the residual ``r = a - S t``, and their collective."""
        scale_a = scale.to(a.dtype)
        codes = self._codes(bucket, a, bound, scale_a, uniform)
        if bucket.residual is not None:  # per group in place
            for grp in bucket.groups:
                grp.view(a).addcmul_(grp.view(codes), grp.column(scale_a), value=-1)
            step.residual = a
        if self.wire_format == "allreduce":
            return Send(self.label, "sum", ops.pack_ternary(codes, bucket.world))
        packed = ops.pack_two_bit(codes)
        return Send(self.label, "gather", packed, [packed.shape[0]] * bucket.world)

    @staticmethod
    def _codes(bucket: Any, a: torch.Tensor, bound: Optional[torch.Tensor], scale: torch.Tensor,
               uniform: torch.Tensor) -> torch.Tensor:
        """Codes of every compressed tensor: ``sign(g) [u < |clip(g)| / S]`` with each tensor's ``S``;
        ``|clip(g)| = min(|g|, b)`` and ``clip`` keeps the sign, so ``clip(g)`` is never formed."""
        ratio = torch.abs(a)
        for grp in bucket.groups:
            rows = grp.view(ratio)
            if bound is not None:
                torch.minimum(rows, grp.column(bound), out=rows)
            rows.div_(grp.column(scale))
        keep = torch.lt(uniform, ratio).view(torch.int8)
        # sign(g) keep = keep - 2 (keep and g < 0): where keep is 1, |g| > 0 (a 0 never passes u < 0)
        return torch.sub(keep, torch.lt(a, 0).view(torch.int8).bitwise_and_(keep), alpha=2)

    def _code_sum(self, bucket: Any, received: torch.Tensor) -> torch.Tensor:
        """``sum over ranks of t``: summed lanes unpacked, or every rank's 2-bit codes summed in int8
        (``|sum| <= N``) or int16."""
        n, world = bucket.n_compressed, bucket.world
        if self.wire_format == "allreduce":
            return ops.unpack_ternary_sum(received, n, world)
        chunk = wire.two_bit_bytes(n)
        code_sum = ops.unpack_two_bit(received[:chunk], n)
        if world > 127:
            code_sum = code_sum.to(torch.int16)
        for r in range(1, world):
            code_sum += ops.unpack_two_bit(received[r * chunk : (r + 1) * chunk], n)
        return code_sum

    def _decode_own_scales(self, bucket: Any, received: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each rank's codes times its own scales, summed in rank order; a flagged tensor: NaN
        from the first rank's part on."""
        count, n = len(bucket.compressed), bucket.n_compressed
        shared = received["scales"].view(bucket.world, 2 * count).to(bucket.acc)
        bad = (shared[:, count:] > 0).any(dim=0)
        chunk = wire.two_bit_bytes(n)
        total = None
        for r in range(bucket.world):
            codes = ops.unpack_two_bit(received[self.label][r * chunk : (r + 1) * chunk], n)
            scale = torch.where(bad, torch.nan, shared[r, :count]) if r == 0 else shared[r, :count]
            part = self._scaled_rows(bucket, codes, scale)
            total = part if total is None else total.add_(part)
        return total, bad

    @staticmethod
    def _scaled_rows(bucket: Any, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``codes * S`` per compressed tensor, in the accumulation dtype (integer codes convert exactly)."""
        total = torch.empty(bucket.n_compressed, dtype=bucket.acc, device=bucket.device)
        for grp in bucket.groups:
            torch.mul(grp.view(codes), grp.column(scale), out=grp.view(total))
        return total
