"""The fused bucket path for torch tensors: a few kernels per bucket, no host reads in a step.

:class:`~hvd_compress.comm.exchange.BucketExchange` hands a bucket here when its
tensors are torch tensors of one dtype and device and the compressor offers a
fused form (``compressor.fused``: None, FP16, Top-k, Gaussian-k, RegTop-k, TernGrad).
What a step of a bucket needs to know in advance is known in advance: a
:class:`FusedBucket` is built once per layout (names, shapes, dtype, device,
compressor configuration, world size) and holds

- the split of the bucket into a *dense* part (None, FP16, tensors under
  ``dense_below``, tensors where ``N k >= d``) and a *compressed* part, whose
  tensors are laid out grouped by size so that each group of equal-size tensors
  is one ``(rows, n)`` matrix;
- every size on the wire: ``k = ceil(ratio n)`` per tensor (Gaussian-k:
  ``floor(4k/3)`` slots, unused ones padded), so each rank sends exactly
  ``K = sum k`` values and indices and no count is exchanged;
- the state: the compressed part's error-feedback residual as one flat buffer
  (in at least float32: a float16 gradient's residual cannot overflow; values
  travel in the gradient's dtype, saturated, the rest stays in the residual),
  RegTop-k's posterior as fixed-size ``(indices, D)`` vectors; under momentum
  correction the velocities of both parts, flat buffers like the residual.

Building it checks once that every rank agrees (an allgather of ``[config hash,
layout hash]``, read on the host); afterwards a step reads nothing back:

sparse (Top-k, Gaussian-k, RegTop-k), per bucket::

    a = g + r                                   one cat, one add
    S, f = select(a, score(a))                  per size group one top-k and one tie scan
                                                (Gaussian-k: moments, one count of all its
                                                thresholds, one mark), then a fixed number
                                                of kernels for the bucket
                                                (:class:`~hvd_compress.kernels.torch_rows.Rows`)
    send a[S] ++ f, S ++ first entries          two allgathers (fixed size)
    r = a with a[S] set to 0
    total = 0;  total += every rank's a[S] at S and its f at each tensor's first entry
                                                one index_add per rank, in rank order
    result = total / N;  flagged tensors: r as before the step (one where per group)

with momentum correction (``momentum=m``, :mod:`hvd_compress.compressors.sparse`), a
velocity buffer of the compressed part's layout, and one of the dense part's::

    u = m u + g;  a = r + u                     one mul, one add each
    ... as above ...;  u[S] = 0                 one index_fill
    dense part: send u (+ a flushed residual); after the sum, a tensor whose sum holds
    NaN/Inf keeps its u from before the step    (one index_add of total * 0, one where)

TernGrad: per size group one ``aminmax`` (and ``std`` when clipping), so the
scales ``max|clip(g)| = min(max|g|, bound)`` and non-finite flags of all
tensors come at once; one allreduce-Max of ``scales ++ flags`` (waited for on
the device stream where the transport allows); codes for the whole part with
each tensor's own draws (per group only the division by its scales), one packed
int32 allreduce (or 2-bit allgather); the decode multiplies each group's code
sums by its scales, NaN for a flagged tensor.

Non-finite values behave as in the dense allreduce they replace: each rank
sends a flag ``f_j`` per compressed tensor with its values, 0, or NaN when
``a_j`` holds NaN/Inf (``0 *`` what the selection computes anyway: Top-k's
largest score, Gaussian-k's mean); every rank's flags are added at each
tensor's first entry, so a NaN/Inf on any rank makes that tensor non-finite
on every rank (``torch.cuda.amp.GradScaler`` then
skips the step everywhere), and the tensor's residual and RegTop-k posterior
keep their values from before the step. Dense tensors carry NaN/Inf through the
sum themselves.

Results are those of the per-tensor compressors (and the Simulator) bit for
bit: same selection (ties to the lower index), same sums in rank order, same
draws (each tensor draws its own uniforms, in the order the tensors were added).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hvd_compress import wire
from hvd_compress.kernels import torch_ops as ops
from hvd_compress.kernels.torch_rows import Rows

FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def supported(compressor: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the bucket can take the fused path (else the per-tensor path runs)."""
    if not getattr(compressor, "fused", False) or not tensors:
        return False
    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if first.dtype not in FUSED_DTYPES or any(
        t.dtype != first.dtype or t.device != first.device for t in tensors
    ):
        return False
    return True


class Group:
    """``rows`` compressed tensors of ``n`` elements each, adjacent in the work layout from ``start``
    (rows ``first`` onwards of the compressed tensors); a sparsifier selects ``k`` of each and sends
    ``slots`` (``k``; Gaussian-k: ``floor(4k/3)``)."""

    def __init__(self, start: int, first: int, members: List[int], n: int, k: int, slots: int) -> None:
        self.start, self.members, self.rows, self.n, self.k, self.slots = start, members, len(members), n, k, slots
        self.stop = start + self.rows * n
        self.first, self.last = first, first + self.rows

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start : self.stop].view(self.rows, self.n)

    def column(self, per_row: torch.Tensor) -> torch.Tensor:
        """This group's part of a per-compressed-tensor vector, as a column (broadcasts over a row)."""
        return per_row[self.first : self.last, None]


class FusedBucket:
    """Plan and state of one bucket on the fused path (see the module docstring)."""

    def __init__(self, compressor: Any, key: str, names: List[str], shapes: List[tuple], like: torch.Tensor,
                 world: int) -> None:
        self.compressor, self.key, self.world = compressor, key, world
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        self.dtype, self.device = like.dtype, like.device
        self.acc = ops.accumulation_dtype(self.dtype)
        self.config_hash = compressor.config_hash()
        self.numels = [math.prod(s) for s in self.shapes]
        self.kinds = [compressor.fused_kind(n) for n in self.numels]
        by_size: Dict[int, List[int]] = {}
        for i, kind in enumerate(self.kinds):
            if kind != "dense":
                by_size.setdefault(self.numels[i], []).append(i)
        self.groups: List[Group] = []
        start = 0
        sparse = compressor.payload_kind == "sparse"
        for n, members in by_size.items():
            k = compressor.k(n) if sparse else 0
            first = sum(g.rows for g in self.groups)
            self.groups.append(Group(start, first, members, n, k, compressor.slots(n) if sparse else 0))
            start += len(members) * n
        self.compressed = [i for g in self.groups for i in g.members]  # work order
        self.n_compressed = start
        #: slots may go unused (Gaussian-k): they send index ``n_compressed``, a spare work entry that stays 0
        self.padded = bool(sparse and getattr(compressor, "pads_slots", False))
        self.dense = [i for i, kind in enumerate(self.kinds) if kind == "dense"]
        self.n_dense = sum(self.numels[i] for i in self.dense)
        self.k_total = sum(g.rows * g.slots for g in self.groups)
        self.index_dtype = ops.index_dtype(self.n_compressed + 1)
        self.offsets: Dict[int, int] = {}
        for g in self.groups:
            for row, i in enumerate(g.members):
                self.offsets[i] = g.start + row * g.n
        #: the selections of the compressed part (sparse); unused slots point at the spare entry
        self.rows = Rows([(g.start, g.rows, g.n, g.k, g.slots) for g in self.groups], self.device,
                         spare=self.n_compressed) if sparse and self.groups else None
        #: each selected slot's compressed-tensor number (row in work order), for RegTop-k's posterior
        self.slot_rows = self.rows.slot_row if self.rows is not None else None
        #: flags sent per step: one per compressed tensor, and a 0 for the spare entry, each added
        #: at the first work position of its tensor (the spare: its own)
        self.flag_count = len(self.compressed) + self.padded
        self.flag_positions = torch.tensor([g.start + row * g.n for g in self.groups for row in range(g.rows)]
                                           + [self.n_compressed] * self.padded, dtype=self.index_dtype,
                                           device=self.device)
        self.spare_zero = torch.zeros(int(self.padded), dtype=self.dtype, device=self.device)
        #: the average's divisor, a 0-d tensor: a true division (see ``torch_ops.divide``), made once
        self.divisor = torch.full((), float(world), dtype=self.acc, device=self.device)
        #: momentum correction's decay (0: off); the dense part's tensors by element, to flag them
        self.momentum = float(getattr(compressor, "momentum", 0.0) or 0.0)
        self.dense_offsets: Dict[int, int] = {}
        for i in self.dense:
            self.dense_offsets[i] = sum(self.numels[j] for j in self.dense_offsets)
        self.dense_rows = torch.repeat_interleave(
            torch.arange(len(self.dense), device=self.device),
            torch.tensor([self.numels[i] for i in self.dense], dtype=torch.int64, device=self.device),
        ) if self.momentum and self.dense else None
        self.wire_format = self._ternary_wire_format()
        self.step_stats = self._step_stats()
        layout = (self.names, self.shapes, self.kinds, str(self.dtype))
        self.signature = wire.header_hash(layout)
        # state
        self.residual: Optional[torch.Tensor] = None
        self.velocity: Optional[torch.Tensor] = None  # compressed part, the residual's layout
        self.dense_velocity: Optional[torch.Tensor] = None  # dense part, in the order of self.dense
        self.posterior: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.flush_into_dense: Dict[int, torch.Tensor] = {}
        self.checked = False

    def _ternary_wire_format(self) -> str:
        """How TernGrad's codes travel: packed lanes summed (``allreduce``) or 2-bit codes gathered."""
        comp = self.compressor
        if comp.payload_kind != "ternary" or not comp.scalar_sharing:
            return "allgather"
        return wire.ternary_wire_format(self.n_compressed, self.world)

    def _step_stats(self) -> Tuple[int, int, int, int]:
        """What a step hands the collectives, for :class:`~hvd_compress.compressors.base.WireStats`:
        ``(bytes sent, dense bytes, values sent, elements)``; the same every step of this plan."""
        def size(dtype: torch.dtype) -> int:
            return torch.empty((), dtype=dtype).element_size()

        itemsize, comp, count = size(self.dtype), self.compressor, len(self.compressed)
        wire_dtype = comp.dense_wire_dtype
        sent = self.n_dense * (itemsize if wire_dtype is None else size(getattr(torch, wire_dtype)))
        values = self.n_dense
        if count and comp.payload_kind == "sparse":
            # k (value, index) slots per tensor, and per tensor its flag with the flag's position
            sent += (self.k_total + self.flag_count) * (itemsize + size(self.index_dtype))
            values += self.k_total
        elif count:
            codes = (4 * wire.ternary_lanes(self.n_compressed, self.world) if self.wire_format == "allreduce"
                     else wire.two_bit_bytes(self.n_compressed))
            sent += codes + 2 * count * size(self.acc)
            values += self.n_compressed
        numel = self.n_dense + self.n_compressed
        return sent, numel * itemsize, values, numel

    # ------------------------------------------------------------------ layout
    def matches(self, names: List[str], shapes: List[tuple], like: torch.Tensor, world: int) -> bool:
        return (
            names == self.names
            and shapes == self.shapes
            and like.dtype == self.dtype
            and like.device == self.device
            and world == self.world
            and self.compressor.config_hash() == self.config_hash
        )

    def start_check(self, comm: Any) -> Any:
        """Start the allgather of ``[config hash, layout hash]`` (handle for :meth:`check`)."""
        config = wire.header_config(type(self.compressor).__name__, self.config_hash)
        header = torch.tensor([[config, self.signature]], dtype=torch.int64, device=self.device)
        self.compressor.stats.add(header.numel() * header.element_size(), 0, 0, 0)
        return comm.allgather_async(header, f"{self.key}.header", [1] * self.world)

    def check(self, comm: Any, handle: Any = None) -> None:
        """Once per layout: every rank runs the same configuration on the same layout (one host read).

        Transports that match collectives by order wait for it before anything else is
        issued; name-matched ones (Horovod) wait in ``finish``, before decoding, so that
        ``launch`` never blocks (ranks may launch their buckets in different orders).
        """
        handle = self.start_check(comm) if handle is None else handle
        rows = ops.to_list(comm.wait(handle))
        if any(row != rows[0] for row in rows):
            comm.fail_together()
            raise ValueError(
                f"hvd_compress: ranks disagree on '{self.key}' (compressor or its configuration, the "
                f"names, shapes and order of the gradients, or compressor state loaded from another rank): "
                f"[config hash, layout hash] per rank = {rows}{wire.different_algorithms(r[0] for r in rows)}; "
                f"this rank runs {self.compressor!r} on {self._describe()}{self.compressor.state_note()}"
            )
        self.checked = True

    def _describe(self) -> str:
        parts = [f"{n}{list(s)}:{k}" for n, s, k in zip(self.names, self.shapes, self.kinds)]
        shown = ", ".join(parts[:6]) + (f", ... ({len(parts)} tensors)" if len(parts) > 6 else "")
        return f"{self.dtype} [{shown}]"

    # ------------------------------------------------------------------- state
    def adopt(self, memory: Any) -> None:
        """Take each tensor's state from the compressor's per-name memory (checkpoints, other layouts)."""
        comp = self.compressor
        feedback = getattr(comp, "error_feedback", False)
        post_idx, post_val = [], []
        for i in self.compressed:
            memory.track(self.names[i], self.shapes[i])
            idx = memory.peek(self.names[i], "posterior_indices")
            if idx is not None:
                post_idx.append(idx.to(torch.int64) + self.offsets[i])
                post_val.append(memory.peek(self.names[i], "posterior_values"))
        if feedback and self.compressed:
            self.residual = self._gathered(memory, "residual", self.compressed, self.padded)
        if self.momentum and self.compressed:
            self.velocity = self._gathered(memory, "velocity", self.compressed, self.padded)
        if post_idx:
            self.posterior = (torch.cat(post_idx).to(self.device), torch.cat(post_val).to(self.device))
        if self.momentum and self.dense:
            self.dense_velocity = self._gathered(memory, "velocity", self.dense, False)
        for i in self.dense:
            name = self.names[i]
            r = memory.peek(name, "residual")
            if r is not None and r.numel() == self.numels[i]:
                self.flush_into_dense[i] = r.reshape(-1).to(self.acc)
                comp.warn_dense(name, self.numels[i])
            memory.reset(name)
        for i in self.compressed:
            memory.reset(self.names[i])  # the bucket's state is the truth until flush()

    def _gathered(self, memory: Any, key: str, members: List[int], spare: bool) -> torch.Tensor:
        """The arrays ``key`` of tensors ``members`` as one flat buffer in the accumulation dtype (zeros
        where a tensor has none), and a 0 for the spare entry with ``spare``."""
        parts = []
        for i in members:
            value = memory.peek(self.names[i], key)
            parts.append(value.reshape(-1).to(self.acc) if value is not None and value.numel() == self.numels[i]
                         else torch.zeros(self.numels[i], dtype=self.acc, device=self.device))
        if spare:
            parts.append(torch.zeros(1, dtype=self.acc, device=self.device))
        return torch.cat(parts).to(self.device)

    def flush(self, memory: Any) -> None:
        """Write each tensor's state back to the per-name memory (views; no copy of the residual)."""
        for i in self.compressed:
            name, shape, start, n = self.names[i], self.shapes[i], self.offsets[i], self.numels[i]
            memory.track(name, shape)
            if self.residual is not None:
                memory.set(name, "residual", self.residual[start : start + n].view(shape))
            if self.velocity is not None:
                memory.set(name, "velocity", self.velocity[start : start + n].view(shape))
            if self.posterior is not None:
                idx, values = self.posterior
                mine = (idx >= start) & (idx < start + n) & (values != ops.NO_DISTORTION)
                memory.set(name, "posterior_indices", (idx[mine] - start).to(ops.index_dtype(n)))
                memory.set(name, "posterior_values", values[mine])
        for i, r in self.flush_into_dense.items():
            memory.track(self.names[i], self.shapes[i])
            memory.set(self.names[i], "residual", r.view(self.shapes[i]))
        if self.dense_velocity is not None:
            for i, start in self.dense_offsets.items():
                memory.track(self.names[i], self.shapes[i])
                velocity = self.dense_velocity[start : start + self.numels[i]]
                memory.set(self.names[i], "velocity", velocity.view(self.shapes[i]))

    # ------------------------------------------------------------------ encode
    def launch(self, tensors: List[torch.Tensor], comm: Any, complete: bool = True) -> "Launched":
        """Encode the bucket and start its collectives.

        ``complete=False``: return without waiting for any other rank; what needs a
        collective's result first (TernGrad's codes, drawn with the shared scale) is
        sent by ``Launched.complete()``.
        """
        out = Launched(self)
        if not self.checked:
            if comm.matches_by_order:
                self.check(comm)
            else:
                out.header = self.start_check(comm)
        dense = self._dense_input(tensors) if not self.momentum else self._dense_velocity_input(tensors, out)
        if dense is not None:
            out.handles["dense"] = comm.allreduce_async(dense, comm.SUM, f"{self.key}.dense")
        if self.compressed:
            g = torch.cat([tensors[i].reshape(-1) for i in self.compressed] + [self.spare_zero])
            if self.compressor.payload_kind == "sparse":
                self._launch_sparse(g, comm, out)
            else:
                self._launch_ternary(g, comm, out)
        self.compressor.stats.add(*self.step_stats)
        if complete:
            out.complete(comm)
        return out

    def _dense_input(self, tensors: List[torch.Tensor]) -> Optional[torch.Tensor]:
        if not self.dense:
            return None
        parts = []
        for i in self.dense:
            flat = tensors[i].reshape(-1)
            if i in self.flush_into_dense:  # once, after a switch to dense (see flush)
                flat = ops.saturate(flat + self.flush_into_dense.pop(i), self.dtype)
            parts.append(flat)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        wire_dtype = self.compressor.dense_wire_dtype
        return flat if wire_dtype is None else ops.cast(flat, getattr(torch, wire_dtype))

    def _dense_velocity_input(self, tensors: List[torch.Tensor], out: "Launched") -> Optional[torch.Tensor]:
        """Momentum correction's dense part: ``u = m u + g``; send ``u`` (plus a flushed residual, once)."""
        if not self.dense:
            return None
        g = torch.cat([tensors[i].reshape(-1) for i in self.dense])
        out.dense_velocity = u = ops.momentum_update(self.dense_velocity, g, self.momentum)
        sent = u.clone()  # the collective may write into its input
        for i in list(self.flush_into_dense):  # once, after a switch to dense (see flush)
            start = self.dense_offsets[i]
            sent[start : start + self.numels[i]].add_(self.flush_into_dense.pop(i))
        wire_dtype = self.compressor.dense_wire_dtype
        return ops.saturate(sent, self.dtype if wire_dtype is None else getattr(torch, wire_dtype))

    def keep_dense_velocity(self, total: torch.Tensor, velocity: torch.Tensor) -> None:
        """The dense part's new velocity, but a tensor whose sum holds NaN/Inf keeps its old one."""
        flags = torch.zeros(len(self.dense), dtype=total.dtype, device=self.device)
        flags.index_add_(0, self.dense_rows, total * 0)  # NaN where a tensor's sum holds NaN/Inf
        bad = torch.isnan(flags).index_select(0, self.dense_rows)
        self.dense_velocity = torch.where(bad, self.dense_velocity, velocity, out=velocity)

    def _compensated(self, g: torch.Tensor) -> torch.Tensor:
        """``a = g + r`` (``g`` is the bucket's own copy); in the residual's dtype, at least float32."""
        if self.residual is None:
            return g
        return g.add_(self.residual) if g.dtype == self.acc else torch.add(g, self.residual)

    def _launch_sparse(self, g: torch.Tensor, comm: Any, out: "Launched") -> None:
        comp = self.compressor
        if self.momentum:  # u = m u + g; a = r + u
            out.velocity = u = ops.momentum_update(self.velocity, g, self.momentum)
            a = u if self.residual is None else torch.add(u, self.residual)
        else:
            a = self._compensated(g)
        scores = comp.bucket_scores(a, self.posterior, ops)
        idx, probe = comp.bucket_select(a, scores, self.rows, ops)
        K, count = self.k_total, len(self.compressed)
        message = torch.empty(K + self.flag_count, dtype=self.dtype, device=self.device)
        if a.dtype != self.dtype and self.residual is not None:  # values saturate to the gradient's dtype,
            values, out.residual = ops.error_feedback_split(a, idx, in_place=True, wire_dtype=self.dtype)
            message[:K].copy_(values)  # the rest stays in the residual
        elif a.dtype != self.dtype:  # the velocity without error feedback: its values saturate, the rest goes
            values = ops.saturate(a.index_select(0, idx), self.dtype)
            message[:K].copy_(values)
        else:
            values = torch.index_select(a, 0, idx, out=message[:K])
            if self.residual is not None:
                out.residual = a.index_fill_(0, idx, 0)
        if self.momentum:
            ops.momentum_mask(out.velocity, idx)  # u[S] = 0 (the spare entry's slots: it stays 0)
        torch.mul(probe, 0, out=message[K : K + count])  # the flags: 0, or NaN for a non-finite tensor
        if self.padded:
            message[K + count :].zero_()
        out.sent = (idx, values)
        rows = [K + self.flag_count] * self.world
        out.handles["values"] = comm.allgather_async(message, f"{self.key}.values", rows)
        positions = torch.empty(self.k_total + self.flag_count, dtype=self.index_dtype, device=self.device)
        out.handles["indices"] = comm.allgather_async(
            torch.cat([idx, self.flag_positions], out=positions), f"{self.key}.indices", rows
        )

    def _launch_ternary(self, g: torch.Tensor, comm: Any, out: "Launched") -> None:
        comp = self.compressor
        a = self._compensated(g)
        local, bound = self._scales(a)
        uniform = torch.empty(self.n_compressed, dtype=torch.float32, device=self.device)
        generator = comp.generator(ops, a)
        for i in sorted(self.compressed):  # draws in the order the tensors were added
            start = self.offsets[i]
            torch.rand(self.numels[i], generator=generator, dtype=torch.float32, device=self.device,
                       out=uniform[start : start + self.numels[i]])
        uniform = uniform.to(self.dtype)
        sanitized = torch.nan_to_num(local, nan=0.0, posinf=0.0)
        bad = torch.ne(sanitized, local).to(self.acc)  # a scale (>= 0) is NaN or +Inf
        count = len(self.compressed)
        if comp.scalar_sharing:  # the codes need the Max over ranks: sent by Launched.complete
            handle = comm.allreduce_async(torch.cat([sanitized, bad]), comm.MAX, f"{self.key}.scales")

            def send_codes() -> None:
                shared = comm.wait(handle)
                out.bad = shared[count:] > 0
                self._send_codes(a, bound, uniform, shared[:count], comm, out)

            out.resume = send_codes
            return
        out.handles["scales"] = comm.allgather_async(
            torch.cat([sanitized, bad]), f"{self.key}.scales", [2 * count] * self.world
        )
        self._send_codes(a, bound, uniform, sanitized, comm, out)

    def _scales(self, a: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every compressed tensor's scale ``max|clip(g)|`` (in the accumulation dtype) and clipping
        bound (``a``'s dtype; ``None`` without clipping): one ``aminmax`` (and ``std``) per group.

        ``clip(g) = clamp(g, -b, b)`` is monotone, so ``max|clip(g)| = min(max(-min g, max g), b)``
        exactly; ``b = c std(g)``, or +Inf where ``b = 0`` or ``g`` is constant (no clipping).
        """
        comp = self.compressor
        extremes = [torch.aminmax(grp.view(a), dim=1) for grp in self.groups]
        low, high = torch.cat([e[0] for e in extremes]), torch.cat([e[1] for e in extremes])
        local = torch.maximum(-low, high).abs()
        if comp.clip is None:
            return local.to(self.acc), None
        std = torch.cat([torch.std(grp.view(a), dim=1, correction=0) for grp in self.groups])
        bound = (std.double() * comp.clip).to(a.dtype)
        bound = torch.where((bound == 0) | (low == high), torch.inf, bound)
        return torch.minimum(local, bound).to(self.acc), bound

    def _send_codes(self, a: torch.Tensor, bound: Optional[torch.Tensor], uniform: torch.Tensor,
                    scale: torch.Tensor, comm: Any, out: "Launched") -> None:
        """TernGrad codes drawn with ``scale`` (one per compressed tensor): residual, then the code collective."""
        scale_a = scale.to(a.dtype)
        codes = self._codes(a, bound, scale_a, uniform)
        if self.residual is not None:  # r = a - S t, per group in place
            for grp in self.groups:
                grp.view(a).addcmul_(grp.view(codes), grp.column(scale_a), value=-1)
            out.residual = a
        out.scale = scale
        if self.wire_format == "allreduce":
            lanes = ops.pack_ternary(codes, self.world)
            out.handles["codes"] = comm.allreduce_async(lanes, comm.SUM, f"{self.key}.lanes")
        else:
            packed = ops.pack_two_bit(codes)
            out.handles["codes"] = comm.allgather_async(packed, f"{self.key}.codes2bit", [packed.shape[0]] * self.world)

    def _codes(self, a: torch.Tensor, bound: Optional[torch.Tensor], scale: torch.Tensor,
               uniform: torch.Tensor) -> torch.Tensor:
        """TernGrad codes of every compressed tensor: ``sign(g) [u < |clip(g)| / S]`` with each tensor's ``S``;
        ``|clip(g)| = min(|g|, b)`` and ``clip`` keeps the sign, so ``clip(g)`` is never formed."""
        ratio = torch.abs(a)
        for grp in self.groups:
            rows = grp.view(ratio)
            if bound is not None:
                torch.minimum(rows, grp.column(bound), out=rows)
            rows.div_(grp.column(scale))
        keep = torch.lt(uniform, ratio).view(torch.int8)
        # sign(g) keep = keep - 2 (keep and g < 0): where keep is 1, |g| > 0 (a 0 never passes u < 0)
        return torch.sub(keep, torch.lt(a, 0).view(torch.int8).bitwise_and_(keep), alpha=2)


class Launched:
    """One step of a :class:`FusedBucket`: the collectives in flight and what ``finish`` needs."""

    def __init__(self, bucket: FusedBucket) -> None:
        self.bucket = bucket
        self.handles: Dict[str, Any] = {}
        self.residual: Optional[torch.Tensor] = None
        self.velocity: Optional[torch.Tensor] = None  # momentum correction: this step's, masked
        self.dense_velocity: Optional[torch.Tensor] = None
        self.sent: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.scale: Optional[torch.Tensor] = None
        self.bad: Optional[torch.Tensor] = None
        self.header: Any = None  # the layout check still to wait for (name-matched transports)
        self.resume: Any = None  # what launch left to do once another rank's data is in

    def complete(self, comm: Any) -> None:
        """Check the layout if still pending, then send what waited for other ranks (TernGrad's codes)."""
        if self.header is not None:
            self.bucket.check(comm, self.header)
            self.header = None
        if self.resume is not None:
            resume, self.resume = self.resume, None
            resume()

    # ------------------------------------------------------------------ finish
    def finish(self, comm: Any, average: bool) -> Dict[str, torch.Tensor]:
        """Wait for the collectives; ``{name: average (or sum) over ranks}`` in each tensor's shape."""
        b = self.bucket
        self.complete(comm)
        results: Dict[str, torch.Tensor] = {}
        if b.dense:
            total = comm.wait(self.handles["dense"]).to(b.acc)
            if self.dense_velocity is not None:
                b.keep_dense_velocity(total, self.dense_velocity)
            flat = self._scaled(total, average)
            start = 0
            for i in b.dense:
                results[b.names[i]] = flat[start : start + b.numels[i]].view(b.shapes[i])
                start += b.numels[i]
        if b.compressed:
            if b.compressor.payload_kind == "sparse":
                flat = self._finish_sparse(comm, average)
            else:
                flat = self._finish_ternary(comm, average)
            for i in b.compressed:
                start = b.offsets[i]
                results[b.names[i]] = flat[start : start + b.numels[i]].view(b.shapes[i])
        return results

    def _scaled(self, total: torch.Tensor, average: bool) -> torch.Tensor:
        b = self.bucket
        return ops.cast(torch.div(total, b.divisor) if average else total, b.dtype)

    def _finish_sparse(self, comm: Any, average: bool) -> torch.Tensor:
        b = self.bucket
        values = comm.wait(self.handles["values"]).view(b.world, b.k_total + b.flag_count)
        indices = comm.wait(self.handles["indices"]).view(b.world, b.k_total + b.flag_count)
        total = torch.zeros(b.n_compressed + b.padded, dtype=b.acc, device=b.device)
        for rank in range(b.world):  # rank order: the same sums on every rank and device; the flags
            total.index_add_(0, indices[rank], values[rank].to(b.acc))  # (0 or NaN) add at first entries
        bad = torch.isnan(values[:, b.k_total :].to(b.acc).sum(dim=0))  # NaN where any rank was non-finite
        b.compressor.bucket_observe(b, total, self.sent, bad, ops)
        self._keep(bad)
        return self._scaled(total, average)

    def _finish_ternary(self, comm: Any, average: bool) -> torch.Tensor:
        b = self.bucket
        count = len(b.compressed)
        received = comm.wait(self.handles["codes"])
        if b.compressor.scalar_sharing:
            if b.wire_format == "allreduce":
                code_sum = ops.unpack_ternary_sum(received, b.n_compressed, b.world)
            else:  # every rank's codes, summed in int8 (|sum| <= N) or int16
                chunk = wire.two_bit_bytes(b.n_compressed)
                code_sum = ops.unpack_two_bit(received[:chunk], b.n_compressed)
                if b.world > 127:
                    code_sum = code_sum.to(torch.int16)
                for r in range(1, b.world):
                    code_sum += ops.unpack_two_bit(received[r * chunk : (r + 1) * chunk], b.n_compressed)
            bad = self.bad
            total = self._scaled_rows(code_sum, torch.where(bad, torch.nan, self.scale.to(b.acc)))
        else:
            shared = comm.wait(self.handles["scales"]).view(b.world, 2 * count).to(b.acc)
            bad = (shared[:, count:] > 0).any(dim=0)
            chunk = wire.two_bit_bytes(b.n_compressed)
            total = None
            for r in range(b.world):  # rank order; a flagged tensor: NaN from the first rank's part on
                codes = ops.unpack_two_bit(received[r * chunk : (r + 1) * chunk], b.n_compressed)
                scale = torch.where(bad, torch.nan, shared[r, :count]) if r == 0 else shared[r, :count]
                part = self._scaled_rows(codes, scale)
                total = part if total is None else total.add_(part)
        self._keep(bad)
        return self._scaled(total, average)

    def _scaled_rows(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``codes * S`` per compressed tensor, in the accumulation dtype (integer codes convert exactly)."""
        b = self.bucket
        total = torch.empty(b.n_compressed, dtype=b.acc, device=b.device)
        for grp in b.groups:
            torch.mul(grp.view(codes), grp.column(scale), out=grp.view(total))
        return total

    def _keep(self, bad: torch.Tensor) -> None:
        """The bucket takes the step's residual (and velocity); flagged tensors keep theirs from before the step."""
        b = self.bucket
        if self.residual is not None:
            for grp in b.groups:
                torch.where(grp.column(bad), grp.view(b.residual), grp.view(self.residual),
                            out=grp.view(self.residual))
            b.residual = self.residual
        if self.velocity is not None:
            for grp in b.groups:
                torch.where(grp.column(bad), grp.view(b.velocity), grp.view(self.velocity),
                            out=grp.view(self.velocity))
            b.velocity = self.velocity


def bucket_for(compressor: Any, key: str, names: List[str], tensors: List[torch.Tensor], world: int) -> "FusedBucket":
    """The :class:`FusedBucket` of ``key`` for this layout, kept in ``compressor._buckets``.

    Built when the layout or configuration is new; state of the tensors it
    holds moves over from other buckets through the compressor's per-name memory.
    """
    shapes = [tuple(t.shape) for t in tensors]
    bucket = compressor._buckets.get(key)
    if bucket is not None and bucket.matches(names, shapes, tensors[0], world):
        return bucket
    fresh = FusedBucket(compressor, key, names, shapes, tensors[0], world)
    wanted = set(names)
    for other_key, other in list(compressor._buckets.items()):
        if other_key == key or wanted.intersection(other.names):
            other.flush(compressor.memory)
            del compressor._buckets[other_key]
    compressor.adopt_loaded_state(ops, tensors[0])
    fresh.adopt(compressor.memory)
    compressor._buckets[key] = fresh
    return fresh
