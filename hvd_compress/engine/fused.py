"""The fused bucket: the one exchange engine, a few kernels per bucket, no host reads in a step.

:class:`~hvd_compress.engine.exchange.BucketExchange` hands every bucket here, as one fused
bucket per dtype and device: arrays of one kernel module (numpy's
:mod:`hvd_compress.kernels.reference`, :mod:`~hvd_compress.kernels.torch_ops`,
:mod:`~hvd_compress.kernels.tf_ops`; ``ops.fusable``) and a compressor with a bucket codec
(``compressor.fused``: None, FP16, Top-k, Gaussian-k, RegTop-k, TernGrad, every
``Sparsifier``). The plan below is written once: every array operation goes through the
bucket's kernel module (``bucket.ops``, the functions ``reference.BUCKET_FUNCTIONS`` names,
each returning its result: numpy and torch write in place, TensorFlow's tensors are
immutable), so torch launches the kernels a GPU runs, numpy runs the same steps on the host
and TensorFlow on its own kernels; nothing here imports a framework.
What a step of a bucket needs to know in advance is known in advance: a
:class:`FusedBucket` is built once per layout (names, shapes, dtype, device,
compressor configuration, world size; a density change alone, a warm-up's step, makes
a new plan that takes the old one's state as it is) and holds

- the split of the bucket into a *dense* part (None, FP16, tensors under
  ``dense_below``, tensors where ``N k >= d``) and a *compressed* part, each
  laid out grouped by size so that each group of equal-size tensors is one
  ``(rows, n)`` matrix;
- the compressor's *codec* of the compressed part (``compressor.bucket_codec(layout)``:
  :class:`~hvd_compress.algorithms.sparse_bucket.SparseBucketCodec`,
  :class:`~hvd_compress.algorithms.terngrad_bucket.TernaryBucketCodec`): every size
  on the wire, what each round of collectives sends, how the sums decode. The codec sees
  the bucket's :class:`Layout` (no state) and, in a step, what the step carries
  (:class:`Launched`: ``accumulated(g)``, ``feedback``, ``momentum``, ``exchanges``, ``run``);
- the state: the compressed part's error-feedback residual as one flat buffer
  (in at least float32: a float16 gradient's residual cannot overflow; values
  travel in the gradient's dtype, saturated, the rest stays in the residual); under
  momentum correction the velocities of both parts, flat buffers like the residual. An
  algorithm's own state (RegTop-k's posterior, reused thresholds, a shared index set's
  rates) is its codec's.

Building it checks once that every rank agrees (an allgather of ``[config hash,
layout hash]``, read on the host); afterwards a step reads nothing back. Per step::

    dense part: one cat, one allreduce-Sum of it (``allreduce_donated_async``: the cat is
                                                  the step's own, no copy for the transport;
                                                  momentum correction: u = m u + g sent;
                                                  a tensor whose sum holds NaN/Inf keeps
                                                  its u from before the step: per size group
                                                  one flag pass and one where)
    compressed part: g = one cat (with error feedback, no momentum correction and a residual of the
                     gradients' dtype: a = g + r, each tensor added into its slice, one pass on the host);
                     the codec's rounds (:mod:`hvd_compress.algorithms.rounds`),
                     each started here, waited for by the next round or by ``finish``;
                     the decode: (total, per-tensor flag)
    result = total / N;  flagged tensors: residual (and velocity) as before the step,
                                                 one where per size group
    flat in another order (``finish(order=...)``, a DDP hook's bucket; :class:`Placement`):
                     the sparsifiers' decode sums in that order, the dense part's runs copied in;
                     other codecs: one cat of the sums in that order; then one division

Non-finite values behave as in the dense allreduce they replace: a codec sends a
flag per compressed tensor (0, or NaN/1 where the tensor holds NaN/Inf on this
rank), so a NaN/Inf on any rank makes that tensor non-finite on every rank
(``torch.cuda.amp.GradScaler`` then skips the step everywhere) and its state
keeps its values from before the step. Dense tensors carry NaN/Inf through the
sum themselves.

Results are those of the per-tensor spec (``spec/`` of the repository, tensor by tensor) bit
for bit, on numpy, torch and TensorFlow: same selection (ties to the lower index), same sums
in rank order, same draws (each tensor draws its own uniforms, in the order the
tensors were added); TernGrad's clipping bound on torch comes from a row-wise
std, which may round differently from one tensor's.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, List, Optional, Tuple

from hvd_compress import wire
from hvd_compress.kernels import module, ops_for
from hvd_compress.kernels.groups import Group
from hvd_compress.engine.rounds import Rounds, check_header

#: an array of the bucket's kernel module (numpy array, torch or TensorFlow tensor)
Array = Any


def float_errors_ignored(method: Any) -> Any:
    """A step's method without the kernel module's floating-point warnings (numpy's): the flags are
    ``0 * Inf`` by design, and sums may overflow as in the dense allreduce."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with getattr(self, "bucket", self).ops.float_errors_ignored():
            return method(self, *args, **kwargs)

    return run


def _offsets(groups: List[Group]) -> Dict[int, int]:
    """Each grouped tensor's first entry in its part's flat layout."""
    return {i: g.start + row * g.n for g in groups for row, i in enumerate(g.members)}


class Placement:
    """A flat output of a bucket's tensors in another order (``finish(order=...)``, a DDP hook's bucket),
    made once per order: each tensor's first entry there (``starts``), the size (``numel``), the dense
    part's runs ``(first entry there, first entry in the dense layout, length)`` (adjacent in both,
    merged) and the codec's :meth:`shift` of every position it sends, when its decode sums there
    (``shift``; ``None``: the sums are concatenated in that order: a codec that sums in its work layout
    only, or an ``order`` that is not every tensor once)."""

    def __init__(self, bucket: "FusedBucket", order: List[str]) -> None:
        index = {name: i for i, name in enumerate(bucket.names)}
        self.order = [index[name] for name in order]
        self.starts: Dict[int, int] = {}
        self.numel = 0
        for i in self.order:
            self.starts[i], self.numel = self.numel, self.numel + bucket.numels[i]
        every_tensor_once = sorted(self.order) == list(range(len(bucket.names)))
        codec = bucket.codec
        self.shift = (codec.shift(bucket.layout, self.starts, self.numel)
                      if every_tensor_once and getattr(codec, "placeable", False) else None)
        self.dense_runs = _runs([(self.starts[i], bucket.dense_offsets[i], bucket.numels[i]) for i in bucket.dense]
                                if self.shift is not None else [])


def _runs(pieces: List[Tuple[int, int, int]]) -> List[Tuple[int, int, int]]:
    """``(to, from, length)`` pieces sorted by ``to``, those adjacent in both layouts merged."""
    runs: List[Tuple[int, int, int]] = []
    for to, start, n in sorted(pieces):
        if runs and runs[-1][0] + runs[-1][2] == to and runs[-1][1] + runs[-1][2] == start:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
        else:
            runs.append((to, start, n))
    return runs


class PicklesOpsByName:
    """An object whose kernel module ``ops`` pickles as its name: a module does not pickle, and a
    route's state (which holds plans and layouts) may be pickled."""

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "ops": self.ops.__name__}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.ops = module(state["ops"])


class Layout(PicklesOpsByName):
    """What a codec sees of a fused bucket (``compressor.bucket_codec(layout)`` and every call of the codec):
    the kernel module ``ops`` and the arrays' form (``like``: an empty array of the bucket's ``dtype`` and
    device; ``acc``: the accumulation dtype), the world size, the tensors (``names``, ``shapes``,
    ``numels``) and the compressed part's layout (``groups`` of equal-size rows, ``compressed``: the
    tensors in work order, ``offsets``: each one's first work position, ``n_compressed`` entries).
    No state: what a step carries (error feedback, momentum, the run's step count) the codec gets from
    the step (:class:`Launched`)."""

    def __init__(self, bucket: "FusedBucket") -> None:
        b = bucket
        self.ops, self.like, self.dtype, self.acc, self.world = b.ops, b.like, b.dtype, b.acc, b.world
        self.names, self.shapes, self.numels = b.names, b.shapes, b.numels
        self.groups, self.compressed, self.offsets = b.groups, b.compressed, b.offsets
        self.n_compressed = b.n_compressed


class FusedBucket(PicklesOpsByName):
    """Plan and state of one bucket on the fused path (see the module docstring)."""

    def __init__(self, compressor: Any, run: Any, key: str, names: List[str], shapes: List[tuple], like: Array,
                 world: int) -> None:
        self.compressor, self.key, self.world = compressor, key, world
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        #: the kernel module of the bucket's arrays (``reference`` for numpy, ``torch_ops``, ``tf_ops``)
        self.ops = ops = ops_for(like)
        self.dtype, self.device = like.dtype, getattr(like, "device", None)
        self.acc = ops.accumulation_dtype(self.dtype)
        #: an empty array of the bucket's dtype and device: where new buffers go
        self.like = ops.zeros(0, self.dtype, like)
        self.config_hash = compressor.config_hash(run)
        #: the configuration but its density: a plan of another density with this one's keeps its state
        self.state_hash = compressor.config_hash(run, density=False)
        self.numels = [math.prod(s) for s in self.shapes]
        self.kinds = [compressor.fused_kind(n) for n in self.numels]
        self.groups = self._by_size([i for i, kind in enumerate(self.kinds) if kind != "dense"])
        self.compressed = [i for g in self.groups for i in g.members]  # work order
        self.n_compressed = self.groups[-1].stop if self.groups else 0
        self.offsets = _offsets(self.groups)  # tensor -> its first entry in the compressed part
        self.signature = wire.header_hash((self.names, self.shapes, self.kinds, str(self.dtype)))
        #: what the codec sees of the bucket, and the compressor's codec of the compressed part (what travels,
        #: how it decodes)
        self.layout = Layout(self)
        self.codec = compressor.bucket_codec(self.layout) if self.compressed else None
        #: spare work entries after the compressed part (Gaussian-k's unused slots point there; stay 0)
        self.padded = self.codec.spare if self.codec is not None else 0
        self.spare_zero = ops.zeros(self.padded, self.dtype, like)
        #: the dense part, laid out by size groups too (momentum correction flags its tensors per group)
        self.dense_groups = self._by_size([i for i, kind in enumerate(self.kinds) if kind == "dense"])
        self.dense = [i for g in self.dense_groups for i in g.members]
        self.n_dense = self.dense_groups[-1].stop if self.dense_groups else 0
        self.dense_offsets = _offsets(self.dense_groups)
        #: the average's divisor in the accumulation dtype, a true division (see ``torch_ops.divide``), made once
        self.divisor = ops.scalar(world, self.acc, like)
        #: momentum correction's decay (0: off)
        self.momentum = float(getattr(compressor, "momentum", 0.0) or 0.0)
        #: the compressor's ``compile`` option, for the kernels' fused passes (None: the environment decides)
        self.compile = getattr(compressor, "compile", None)
        self.step_stats = self._step_stats()
        # state
        self.residual: Optional[Array] = None
        self.velocity: Optional[Array] = None  # compressed part, the residual's layout
        self.dense_velocity: Optional[Array] = None  # dense part, in the order of self.dense
        self.flush_into_dense: Dict[int, Array] = {}
        self.checked = False
        #: steps this bucket's tensors have been exchanged (across plans; a shared index set's leader turn)
        self.exchanges = 0
        #: the flat outputs in other orders asked for so far (:class:`Placement`)
        self.placements: Dict[Tuple[str, ...], Placement] = {}

    def _by_size(self, indices: List[int]) -> List[Group]:
        """Tensors ``indices`` as groups of equal size, in the order each size first appears, adjacent."""
        by_size: Dict[int, List[int]] = {}
        for i in indices:
            by_size.setdefault(self.numels[i], []).append(i)
        groups: List[Group] = []
        for n, members in by_size.items():
            start, first = (groups[-1].stop, groups[-1].last) if groups else (0, 0)
            groups.append(Group(start, first, members, n))
        return groups

    def _step_stats(self) -> Tuple[int, int, int, int]:
        """What a step hands the collectives, for :class:`~hvd_compress.algorithms.base.WireStats`:
        ``(bytes sent, dense bytes, values sent, elements)``; the same every step of this plan."""
        def size(dtype: Any) -> int:
            return self.ops.itemsize(self.ops.empty(0, dtype, self.like))

        itemsize, wire_dtype = size(self.dtype), self.compressor.dense_wire_dtype
        sent = self.n_dense * (itemsize if wire_dtype is None else size(getattr(self.ops, wire_dtype)))
        values = self.n_dense
        if self.codec is not None:
            codec_bytes, codec_values = self.codec.wire(self.layout, itemsize)
            sent, values = sent + codec_bytes, values + codec_values
        numel = self.n_dense + self.n_compressed
        return sent, numel * itemsize, values, numel

    # ------------------------------------------------------------------ layout
    def matches(self, names: List[str], shapes: List[tuple], like: Array, world: int, run: Any) -> bool:
        return (
            names == self.names
            and shapes == self.shapes
            and like.dtype == self.dtype
            and getattr(like, "device", None) == self.device
            and world == self.world
            and self.compressor.config_hash(run) == self.config_hash
        )

    def start_check(self, comm: Any, run: Any) -> Any:
        """Start the allgather of ``[config hash, layout hash]`` (handle for :meth:`check`), counted in the
        statistics of the run state ``run``."""
        config = wire.header_config(type(self.compressor).__name__, self.config_hash)
        header = self.ops.as_int64([[config, self.signature]], like=self.like)
        run.stats.add(16, 0, 0, 0)  # two int64
        return comm.allgather_async(header, f"{self.key}.header", [1] * self.world)

    def check(self, comm: Any, run: Any, handle: Any = None) -> None:
        """Once per layout: every rank runs the same configuration on the same layout (one host read).

        Transports that match collectives by order wait for it before anything else is
        issued; name-matched ones (Horovod) wait in ``finish``, before decoding, so that
        ``launch`` never blocks (ranks may launch their buckets in different orders).
        """
        handle = self.start_check(comm, run) if handle is None else handle
        check_header(comm, self.ops.to_list(comm.wait(handle)), self.key, self.compressor, f" on {self._describe()}",
                     run.note(self.compressor.rank))
        self.checked = True

    def _describe(self) -> str:
        parts = [f"{n}{list(s)}:{k}" for n, s, k in zip(self.names, self.shapes, self.kinds)]
        shown = ", ".join(parts[:6]) + (f", ... ({len(parts)} tensors)" if len(parts) > 6 else "")
        return f"{self.dtype} [{shown}]"

    def placement(self, order: List[str]) -> Placement:
        """The :class:`Placement` of a flat output in ``order`` (made once per order)."""
        key = tuple(order)
        if key not in self.placements:
            self.placements[key] = Placement(self, order)
        return self.placements[key]

    # ------------------------------------------------------------------- state
    def take_over(self, previous: "FusedBucket") -> bool:
        """Take the state of ``previous``, this bucket's plan before a density change (a warm-up's step),
        where only the density changed: the same tensors in the same parts (``kinds``), the compressor's
        configuration the same but for its :attr:`density_settings`. The buffers move as they are, not
        through the per-name memory (no copies); the codec takes its own (``codec.take_over``). ``False``,
        nothing taken, otherwise (:meth:`adopt` then builds the state)."""
        same = (previous.names == self.names and previous.shapes == self.shapes and previous.kinds == self.kinds
                and previous.dtype == self.dtype and previous.device == self.device and previous.world == self.world
                and previous.padded == self.padded and previous.state_hash == self.state_hash)
        if not same:
            return False
        if self.codec is not None and not getattr(self.codec, "take_over", lambda _: False)(previous.codec):
            return False  # a codec that returns False has taken nothing
        self.residual, self.velocity = previous.residual, previous.velocity
        self.dense_velocity = previous.dense_velocity
        self.flush_into_dense = previous.flush_into_dense
        self.exchanges = max(self.exchanges, previous.exchanges)
        return True

    def adopt(self, memory: Any) -> None:
        """Take each tensor's state from the compressor's per-name memory (checkpoints, other layouts)."""
        comp, ops = self.compressor, self.ops
        feedback = getattr(comp, "error_feedback", False)
        for i in self.compressed:
            memory.track(self.names[i], self.shapes[i])
        if feedback and self.compressed:
            self.residual = self._gathered(memory, "residual", self.compressed, self.padded)
        if self.momentum and self.compressed:
            self.velocity = self._gathered(memory, "velocity", self.compressed, self.padded)
        if self.momentum and self.dense:
            self.dense_velocity = self._gathered(memory, "velocity", self.dense, False)
        for i in self.dense:
            name = self.names[i]
            r = memory.peek(name, "residual")
            if r is not None and math.prod(r.shape) == self.numels[i]:
                self.flush_into_dense[i] = ops.to_device(ops.cast(ops.reshape(r, (-1,)), self.acc), self.like)
                comp.warn_dense(name, self.numels[i])
            memory.discard(name, "residual")  # sent once (above); the velocity is the bucket's until flush();
            memory.discard(name, "velocity")  # a RegTop-k posterior stays for when the tensor is compressed again
        if hasattr(self.codec, "adopt"):  # the codec's own per-tensor state (RegTop-k's posterior...)
            self.codec.adopt(self.layout, memory)
        for i in self.compressed:
            memory.reset(self.names[i])  # the bucket's state is the truth until flush()

    def _gathered(self, memory: Any, key: str, members: List[int], spare: bool) -> Array:
        """The arrays ``key`` of tensors ``members`` as one flat buffer in the accumulation dtype (zeros
        where a tensor has none), and a 0 for the spare entry with ``spare``."""
        ops, parts = self.ops, []
        for i in members:
            value = memory.peek(self.names[i], key)
            known = value is not None and math.prod(value.shape) == self.numels[i]
            parts.append(ops.cast(ops.reshape(value, (-1,)), self.acc) if known
                         else ops.zeros(self.numels[i], self.acc, self.like))
        if spare:
            parts.append(ops.zeros(1, self.acc, self.like))
        return ops.to_device(ops.concat(parts), self.like)

    def flush(self, memory: Any) -> None:
        """Write each tensor's state back to the per-name memory (copies: the plan goes on updating its own
        buffers in place)."""
        ops = self.ops
        for i in self.compressed:
            name, shape, start, n = self.names[i], self.shapes[i], self.offsets[i], self.numels[i]
            memory.track(name, shape)
            if self.residual is not None:  # copies: the plan updates its state in place
                memory.set(name, "residual", ops.reshape(ops.clone(self.residual[start : start + n]), shape))
            if self.velocity is not None:
                memory.set(name, "velocity", ops.reshape(ops.clone(self.velocity[start : start + n]), shape))
        if hasattr(self.codec, "flush"):
            self.codec.flush(self.layout, memory)
        for i, r in self.flush_into_dense.items():
            memory.track(self.names[i], self.shapes[i])
            memory.set(self.names[i], "residual", ops.reshape(r, self.shapes[i]))
        if self.dense_velocity is not None:
            for i, start in self.dense_offsets.items():
                memory.track(self.names[i], self.shapes[i])
                velocity = ops.clone(self.dense_velocity[start : start + self.numels[i]])
                memory.set(self.names[i], "velocity", ops.reshape(velocity, self.shapes[i]))

    # ------------------------------------------------------------------ encode
    @float_errors_ignored
    def launch(self, tensors: List[Array], comm: Any, run: Any, complete: bool = True) -> "Launched":
        """Encode the bucket and start its collectives, on the run state ``run`` that holds the bucket (its
        statistics and random streams).

        ``complete=False``: return without waiting for any other rank; what needs a
        collective's result first (TernGrad's codes, drawn with the shared scale) is
        sent by ``Launched.complete()``.
        """
        out = Launched(self, comm, run)
        if not self.checked:
            if comm.matches_by_order:
                self.check(comm, run)
            else:
                out.header = self.start_check(comm, run)
        dense = self._dense_input(tensors) if not self.momentum else self._dense_velocity_input(tensors, out)
        if dense is not None:
            if dense is out.dense_velocity:  # the velocity is kept: a copy is reduced (on the host a kept buffer)
                dense = self.ops.concat([dense])
            out.handles["dense"] = comm.allreduce_donated_async(dense, comm.SUM, f"{self.key}.dense")
        if self.compressed:
            parts = [self.ops.reshape(tensors[i], (-1,)) for i in self.compressed] + [self.spare_zero]
            # a = g + r made as the parts are copied in (one pass), where the residual's dtype is the gradients'
            out.compensated = self.residual is not None and not self.momentum and self.dtype == self.acc
            g = self.ops.added_concat(parts, self.residual) if out.compensated else self.ops.concat(parts)
            out.rounds.begin(self.codec.exchange(self.layout, g, out), self.codec.rounds)
        run.stats.add(*self.step_stats)
        self.exchanges += 1
        if complete:
            out.complete(comm)
        return out

    def _dense_input(self, tensors: List[Array]) -> Optional[Array]:
        """The dense part in its flat layout, a fresh buffer of this step's (the allreduce may reduce it in place)."""
        if not self.dense:
            return None
        ops, parts = self.ops, []
        for i in self.dense:
            flat = ops.reshape(tensors[i], (-1,))
            if i in self.flush_into_dense:  # once, after a switch to dense (see flush)
                flat = ops.saturate(ops.add(flat, self.flush_into_dense.pop(i)), self.dtype)
            parts.append(flat)
        flat = ops.concat(parts) if len(parts) > 1 else ops.clone(parts[0])
        wire_dtype = self.compressor.dense_wire_dtype
        return flat if wire_dtype is None else ops.cast(flat, getattr(ops, wire_dtype))

    def _dense_velocity_input(self, tensors: List[Array], out: "Launched") -> Optional[Array]:
        """Momentum correction's dense part: ``u = m u + g``; send ``u`` (plus a flushed residual, once)."""
        if not self.dense:
            return None
        ops = self.ops
        g = ops.concat([ops.reshape(tensors[i], (-1,)) for i in self.dense])
        out.dense_velocity = sent = ops.momentum_update(self.dense_velocity, g, self.momentum, self.compile)
        for i in list(self.flush_into_dense):  # once, after a switch to dense (see flush): a new buffer,
            start, stop = self.dense_offsets[i], self.dense_offsets[i] + self.numels[i]  # the velocity stays
            sent = ops.concat([sent[:start], sent[start:stop] + self.flush_into_dense.pop(i), sent[stop:]])
        wire_dtype = self.compressor.dense_wire_dtype
        return ops.saturate(sent, self.dtype if wire_dtype is None else getattr(ops, wire_dtype))

    def keep_dense_velocity(self, total: Array, velocity: Array) -> None:
        """The dense part's new velocity, but a tensor whose sum holds NaN/Inf keeps its old one."""
        self.dense_velocity = self.ops.keep_finite_rows(self.dense_groups, total, self.dense_velocity, velocity,
                                                        self.compile)

    def compensated(self, g: Array) -> Array:
        """``a = g + r`` (``g`` is the bucket's own copy); in the residual's dtype, at least float32. (Where
        that is the gradients' dtype, ``launch`` adds the residual as it copies the gradients in.)"""
        if self.residual is None:
            return g
        if g.dtype != self.acc:
            return self.ops.add(g, self.residual)
        return self.ops.add_into(g, self.residual)


class Launched:
    """One step of a :class:`FusedBucket`: the collectives in flight and what ``finish`` needs."""

    def __init__(self, bucket: FusedBucket, comm: Any, run: Any) -> None:
        self.bucket, self.run = bucket, run  # the run state the step works on
        self.handles: Dict[str, Any] = {}
        self.rounds = Rounds(comm, bucket.key, self.handles)  # the codec's rounds of collectives
        self.residual: Optional[Array] = None
        self.velocity: Optional[Array] = None  # momentum correction: this step's, masked
        self.dense_velocity: Optional[Array] = None
        self.header: Any = None  # the layout check still to wait for (name-matched transports)
        self.placement: Optional[Placement] = None  # where the codec's decode sums, when not in the work layout
        #: what a codec reads of the step: the run's step count (before this step), whether error feedback
        #: keeps a residual (the codec hands the step's in ``residual``), momentum correction's decay
        self.exchanges, self.feedback, self.momentum = bucket.exchanges, bucket.residual is not None, bucket.momentum
        #: whether the compressed part handed to the codec already holds ``a = g + r`` (``launch``)
        self.compensated = False

    def accumulated(self, g: Array) -> Array:
        """What error feedback compresses: ``a = g + r`` (``g``: the step's own copy of the compressed part),
        or under momentum correction ``u = m u + g`` (this step's velocity, in :attr:`velocity`) and
        ``a = r + u``; in the residual's dtype, at least float32. ``g`` as ``launch`` hands it to the codec:
        where that already holds ``g + r`` (:attr:`compensated`), ``g`` itself."""
        b = self.bucket
        if b.momentum:
            self.velocity = u = b.ops.momentum_update(b.velocity, g, b.momentum, b.compile)
            return u if b.residual is None else b.ops.add(u, b.residual)
        return g if self.compensated else b.compensated(g)

    @float_errors_ignored
    def complete(self, comm: Any) -> None:
        """Check the layout if still pending, then start the rounds that waited for other ranks' data."""
        if self.header is not None:
            self.bucket.check(comm, self.run, self.header)
            self.header = None
        self.rounds.advance()

    # ------------------------------------------------------------------ finish
    @float_errors_ignored
    def finish(self, comm: Any, average: bool, order: Optional[List[str]] = None) -> Any:
        """Wait for the collectives; ``{name: average (or sum) over ranks}`` in each tensor's shape, or
        with ``order`` (names) those results flat, one after the other in that order (what a DDP hook
        returns): the codec's decode sums the compressed part there where it can (:meth:`_in_order`),
        then one division for the whole bucket."""
        b = self.bucket
        self.complete(comm)
        if order is not None:
            return self._in_order(comm, average, b.placement(order))
        parts = self._totals(comm)
        self.rounds.release()
        results: Dict[str, Array] = {}
        for total, starts in parts:
            flat = self._scaled(total, average)
            for i, start in starts.items():
                results[b.names[i]] = b.ops.reshape(flat[start : start + b.numels[i]], b.shapes[i])
        return results

    def _in_order(self, comm: Any, average: bool, placement: Placement) -> Array:
        """The sums flat in the placement's order, scaled: where the codec sums into that order
        (``placement.shift``), the dense part's runs are copied into its sums (one launch on torch), else
        both parts are concatenated in that order."""
        b = self.bucket
        if placement.shift is None or not b.compressed:
            parts = self._totals(comm)
            self.rounds.release()
            sums = {i: total[start : start + b.numels[i]] for total, starts in parts for i, start in starts.items()}
            return self._scaled(b.ops.concat([sums[i] for i in placement.order]), average)
        self.placement = placement
        parts = self._totals(comm)
        self.rounds.release()
        total = parts[-1][0]  # the compressed part's, in the placement's order
        if b.dense:
            dense = parts[0][0]
            total = b.ops.placed(total, [(to, dense[start : start + n]) for to, start, n in placement.dense_runs])
        return self._scaled(total[: placement.numel] if b.codec.spare else total, average)

    def _totals(self, comm: Any) -> List[Tuple[Array, Dict[int, int]]]:
        """The sums over ranks (accumulation dtype), each with its tensors' first entries: the dense part's,
        the compressed part's; the bucket takes the step's state."""
        b = self.bucket
        parts = []
        if b.dense:
            total = b.ops.cast(comm.wait(self.handles["dense"]), b.acc)
            if self.dense_velocity is not None:
                b.keep_dense_velocity(total, self.dense_velocity)
            parts.append((total, b.dense_offsets))
        if b.compressed:
            total, bad = self.rounds.decode()
            self._keep(bad)
            parts.append((total, b.offsets))
        return parts

    def _scaled(self, total: Array, average: bool) -> Array:
        b = self.bucket
        return b.ops.cast(b.ops.quotient(total, b.divisor) if average else total, b.dtype)

    def _keep(self, bad: Array) -> None:
        """The bucket takes the step's residual (and velocity); flagged tensors keep theirs from before the step."""
        b = self.bucket
        if self.residual is not None:
            b.residual = b.ops.keep_rows(b.groups, bad, b.residual, self.residual)
        if self.velocity is not None:
            b.velocity = b.ops.keep_rows(b.groups, bad, b.velocity, self.velocity)


def bucket_for(compressor: Any, run: Any, key: str, names: List[str], tensors: List[Array],
               world: int) -> "FusedBucket":
    """The :class:`FusedBucket` of ``key`` for this layout, kept in the run state ``run.buckets`` (the
    route's :class:`~hvd_compress.algorithms.state.CompressorState`).

    Built when the layout or configuration is new. After a density change alone the new plan takes the
    old one's buffers (:meth:`FusedBucket.take_over`); otherwise the state of the tensors it holds moves
    over from other buckets through the run state's per-name memory.
    """
    shapes = [tuple(t.shape) for t in tensors]
    bucket = run.buckets.get(key)
    if bucket is not None and bucket.matches(names, shapes, tensors[0], world, run):
        return bucket
    fresh = FusedBucket(compressor, run, key, names, shapes, tensors[0], world)  # built for ``run``, not holding it
    fresh.exchanges = run.exchanges  # where the run stands (a checkpoint's count, once loaded)
    if bucket is not None and fresh.take_over(bucket):
        run.buckets[key] = fresh
        return fresh
    wanted = set(names)
    for other_key, other in list(run.buckets.items()):
        if other_key == key or wanted.intersection(other.names):
            other.flush(run.memory)
            fresh.exchanges = max(fresh.exchanges, other.exchanges)
            del run.buckets[other_key]
    run.adopt_loaded(fresh.ops, tensors[0])
    fresh.adopt(run.memory)
    run.buckets[key] = fresh
    return fresh
