"""Our compressors with ``horovod.tensorflow``: the communicator and the stock-Horovod hooks.

TensorFlow runs gradient exchange inside graphs: Horovod wraps its
allreduce in a ``tf.function`` even in eager mode, and Keras compiles the
train step. The compressors are Python classes that branch on what they see
(Gaussian-k's count, the header check, TernGrad's shared scale), so each
exchange runs eagerly as one ``tf.py_function`` op (:func:`eagerly`) whose
collectives are eager Horovod calls, those started together issued as one
(:class:`HorovodTensorFlowCommunicator`). Inside a ``tf.function`` these stateful
ops run in program order, so every rank issues its exchanges in the same
order; no collective waits on a tensor another rank has not reached.

Stock Horovod (``hvd.DistributedGradientTape(tape, compression=RegTopK(0.01), groups=1)``)
calls ``compress`` per gradient, then allreduces what it returned, then calls
``decompress``: gradient by gradient (each in its own ``tf.cond``) without
``groups=``; with ``groups=`` (and ``hvd.grouped_allreduce``) a group's
``compress`` calls all come first, then one grouped allreduce, then its
``decompress`` calls. ``compress`` records the gradient in the pending group of
the graph being built (eagerly: outside any graph) and hands Horovod a
one-element placeholder of ones; the group's first ``decompress`` runs one
exchange of all its gradients (:class:`~hvd_compress.engine.exchange.BucketExchange`
keyed by the first and last names and the count: header, sparse allgathers or
TernGrad's scale Max and packed code sum, as one :func:`eagerly` op in that
graph), and each ``decompress`` takes its gradient's average from it. So each
Horovod group is one exchange, and without ``groups=`` each gradient is a group
of its own. Horovod's reduction of the placeholder is the scaling it wants (1
for ``op=Average``, N for ``op=Sum``), so ``decompress`` returns the average
times that. Residuals are kept per tensor name, so a tensor's state follows it
into whichever group holds it. An error while compressing drops the graph's
pending group (no later exchange sends its tensors). Each exchange costs rounds of
Horovod's negotiation, so a step of one-gradient groups is slower than ``groups=1``
(one exchange per step); the hooks cannot regroup Horovod's gradients (each
average is due before Horovod shows the next gradient), so a traced step with two
such groups warns once per process, naming ``groups=1``.

A sparsifier's tensors under ``dense_below``, and None's gradients, go to
Horovod's own allreduce unchanged, FP16's cast to float16 (``tf.cast``: a value
beyond float16's range becomes Inf, as in the engine's dense part and Horovod's
own fp16 compression; ``decompress`` casts the sum back); ``compressor.stats``
counts them, and the placeholders, at every run of the graph (:func:`_counted`),
so that the statistics equal the bytes handed to the collectives. Tensors with ``N k >= d``
travel dense in their exchange, with their residual.

Collective names: the i-th gradient compressed while tracing one graph is
``hvd_compress.<i>``; gradients come in the model's variable order, the same
on every rank. ``hvd.allreduce(t, compression=...)`` called eagerly (outside any
``tf.function``) names ``t`` by that call's ``name=``, else ``call.<i>``, the
i-th tensor compressed since the compressor's last ``decompress`` (with a
warning, once), as stock ``horovod.torch`` names such calls: the same tensor
keeps its residual from call to call. The header makes every rank check that the others compressed a
tensor of the same name and size with the same configuration.

Every compressor, dense ones and small tensors included, checks once per
``(name, shape, dtype)`` that every rank compresses that tensor with the same
configuration (:func:`check_agreement`: one allgather of ``[config, layout]``,
run eagerly while the graph is traced, so no step pays for it). Without it a
rank running Top-k hands Horovod a one-element placeholder where a rank running
None hands it the gradient, and Horovod's own shape error (or a hang) comes
first; with it every rank raises ``ranks disagree`` naming every rank's compressor.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import numpy as np
import tensorflow as tf

from hvd_compress.transport.communicator import HorovodCommunicator
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.horovod.calls import allreduce_call
from hvd_compress.engine.rounds import check_header
from hvd_compress.wire import header_config, header_hash


class HorovodTensorFlowCommunicator(HorovodCommunicator):
    """``horovod.tensorflow`` collectives, called eagerly; those started together run as one.

    Every eager Horovod call blocks until each rank has made the matching call (eager calls match
    by their order, the same on every rank), so a bucket's header, dense sum and sparse allgathers,
    issued one after the other, cost a round of Horovod's negotiation each. Here ``*_async`` queues
    the collective and the first ``wait`` runs the queue in order, the allgathers as one
    ``grouped_allgather`` at the place of the first of them: every tensor viewed as bytes
    (``tf.bitcast`` to int8 and back), so each comes back bit for bit as its own allgather returns
    it. With two ranks the allreduces join that group too (:meth:`_joins`): each rank gathers both
    tensors and adds (or takes the maximum) itself, ``a + b`` and ``max(a, b)`` being the same bits
    in either order, and the bytes each rank sends are those of a ring allreduce (``d``). Every rank
    queues the same collectives in the same order, so the grouped calls match as the single ones did.
    Numpy arrays (an exchange computing on the host) are viewed as bytes, gathered and reduced by
    numpy, and come back as numpy arrays: a drop-in Top-k exchange then makes one TensorFlow op.
    """

    #: run the queue's allgathers (and two ranks' allreduces) as one grouped call; ``False``: each
    #: collective is its own Horovod call, in queue order (``python -m benchmarks tf-step --one-by-one``)
    grouped = True

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        super().__init__(hvd)
        self._queued: List[_Queued] = []

    def allreduce_async(self, tensor: Any, op: str, name: str) -> Any:
        return self._queue(_Queued(op, name, tensor))

    def allgather_async(self, tensor: Any, name: str, rows: Optional[Sequence[int]] = None) -> Any:
        return self._queue(_Queued(None, name, tensor))

    def wait(self, handle: Any) -> Any:
        if handle.tensor is not None:
            self._run_queued()
        return handle.result

    def _queue(self, queued: "_Queued") -> "_Queued":
        self._queued.append(queued)
        return queued

    def _joins(self, queued: "_Queued") -> bool:
        """Whether the collective runs in the batch's ``grouped_allgather``: allgathers, and with two
        ranks the allreduces (Max; Sum, but not of float16 or bfloat16, which Horovod may add in float32)."""
        if queued.op is None:
            return True
        half = queued.tensor.dtype.name in ("float16", "bfloat16")
        return self.size == 2 and (queued.op == self.MAX or not half)

    def _run_queued(self) -> None:
        batch, self._queued = self._queued, []
        grouped = [queued for queued in batch if self._joins(queued)] if self.grouped else []
        for queued in batch:
            if grouped and queued is grouped[0]:
                self._grouped(grouped)
            elif queued not in grouped:  # its own Horovod call
                self._grouped([queued])
        for queued in batch:
            queued.tensor = None

    def _grouped(self, grouped: List["_Queued"]) -> None:
        """Run ``grouped`` as one ``grouped_allgather`` (a lone one as itself)."""
        if len(grouped) == 1:
            (queued,) = grouped
            tensor = tf.convert_to_tensor(queued.tensor)
            result = (
                self.hvd.allgather(tensor, name=queued.name) if queued.op is None
                else self.hvd.allreduce(tensor, op=self._ops[queued.op], name=queued.name)
            )
            queued.result = _like(result, queued.tensor)
            return
        sent = [q.tensor if q.op is None else q.tensor[None] for q in grouped]  # allreduces: a row per rank
        gathered = self.hvd.grouped_allgather([_as_bytes(t) for t in sent], name=grouped[0].name)
        for queued, result in zip(grouped, gathered):
            result = _from_bytes(result, queued.tensor)
            queued.result = result if queued.op is None else _reduce_rows(result, queued.op == self.MAX)


def _like(result: Any, sent: Any) -> Any:
    """A collective's ``result`` as numpy when ``sent`` was (an exchange computing on the host)."""
    return result.numpy() if isinstance(sent, np.ndarray) else result


def _as_bytes(tensor: Any) -> Any:
    """``tensor``'s bytes as int8 (a numpy array's along its last axis, in one tensor)."""
    if isinstance(tensor, np.ndarray):
        return tf.convert_to_tensor(np.ascontiguousarray(tensor).view(np.int8))
    return tensor if tensor.dtype == tf.int8 else tf.bitcast(tensor, tf.int8)


def _from_bytes(tensor: Any, sent: Any) -> Any:
    """The gathered bytes ``tensor`` in ``sent``'s dtype (and numpy when ``sent`` was)."""
    if isinstance(sent, np.ndarray):
        return tensor.numpy().view(sent.dtype)
    return tensor if sent.dtype == tf.int8 else tf.bitcast(tensor, sent.dtype)


#: integer sums wrap, as Horovod's do: added as the unsigned type of the same width
_UNSIGNED = {tf.int8: tf.uint8, tf.int16: tf.uint16, tf.int32: tf.uint32, tf.int64: tf.uint64}


def _reduce_rows(rows: Any, maximum: bool) -> Any:
    """The two ranks' rows ``[2, ...]`` reduced: ``max`` or the sum (integers wrapping)."""
    if isinstance(rows, np.ndarray):  # numpy's integer sums of arrays wrap
        return np.maximum(rows[0], rows[1]) if maximum else rows[0] + rows[1]
    if maximum:
        return tf.maximum(rows[0], rows[1])
    unsigned = _UNSIGNED.get(rows.dtype)
    if unsigned is None:
        return rows[0] + rows[1]
    both = tf.bitcast(rows, unsigned)
    return tf.bitcast(both[0] + both[1], rows.dtype)


@dataclass(eq=False)
class _Queued:
    """A collective queued by :class:`HorovodTensorFlowCommunicator` (``op``: ``"sum"``, ``"max"``, None
    for an allgather), and its ``result`` once run (``tensor`` None then)."""

    op: Optional[str]
    name: str
    tensor: Any
    result: Any = None


def eagerly(
    fn: Callable[..., List[Any]], tensors: Sequence[Any], dtypes: Optional[Sequence] = None
) -> List[Any]:
    """``fn(*tensors)`` run eagerly; inside a graph as one ``tf.py_function`` op.

    ``fn`` returns one tensor per input, of the input's shape and dtype (or ``dtypes``).
    """
    tensors = list(tensors)
    if tf.executing_eagerly():
        return list(fn(*tensors))
    dtypes = [t.dtype for t in tensors] if dtypes is None else list(dtypes)
    outputs = tf.py_function(lambda *ts: list(fn(*ts)), tensors, Tout=dtypes)
    for output, tensor in zip(outputs, tensors):
        output.set_shape(tensor.shape)
    return list(outputs)


def exchange(compressor: Any, comm: Any, key: str, named: Sequence[tuple], average: bool = True) -> List[Any]:
    """Average (or sum) over ranks of each ``(name, tensor)``, in one fused exchange.

    Collectives an error left queued on :class:`HorovodTensorFlowCommunicator` still go out, as
    the eager calls they stand for would have, so that no later exchange issues them."""
    bucket = open_exchange(compressor, comm, key)
    try:
        for name, tensor in named:
            bucket.add(name, tensor)
        bucket.launch()
        results = bucket.finish(average=average)
    finally:
        if getattr(comm, "_queued", None):
            comm._run_queued()
    return [results[name] for name, _ in named]


@functools.lru_cache(maxsize=None)
def _communicator() -> HorovodTensorFlowCommunicator:
    return HorovodTensorFlowCommunicator()


@dataclass(eq=False)
class _Group:
    """The gradients compressed in one graph (eagerly: outside any) since its last exchange, one
    Horovod group's: ``named`` ``(name, tensor)`` in compression order; ``averages``, once
    :func:`_exchanged`, each one's average over ranks, in that order."""

    graph: Any
    named: List[tuple] = field(default_factory=list)
    averages: Optional[List[Any]] = None

    @property
    def key(self) -> str:
        """The exchange's key, the same on every rank: a lone tensor's name (Horovod without
        ``groups=``), else ``<first name>..<last name>.<count>``."""
        first, last = self.named[0][0], self.named[-1][0]
        return first if len(self.named) == 1 else f"{first}..{last}.{len(self.named)}"


@dataclass
class _Context:
    dtype: Any = None
    group: Optional[_Group] = None  # for compressors that exchange themselves: the tensor's group
    index: int = 0  # and its place in it


_names: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _outer_graph() -> Any:
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph


def _next_name() -> str:
    """``hvd_compress.<i>``: i counts the gradients compressed while tracing the outermost graph."""
    graph = _outer_graph()
    index = _names.get(graph, 0)
    _names[graph] = index + 1
    return f"hvd_compress.{index}"


@dataclass
class _Calls:
    """What this route keeps per compressor (its run state's route data)."""

    eager: int = 0  # tensors compressed eagerly without a name since the last ``decompress``
    checked: Set[tuple] = field(default_factory=set)  # (name, shape, dtype) the ranks agreed on
    #: per graph (None: eagerly), the group compressed there and not yet exchanged
    pending: Dict[Any, _Group] = field(default_factory=dict)


def _calls(compressor: Any) -> _Calls:
    return compressor.state.route_data("horovod.tensorflow", _Calls)


_warned_eager: List[bool] = []


def _name(compressor: Any, tensor: Any) -> str:
    """While a graph is traced: :func:`_next_name`. Eagerly: the ``name=`` of the
    ``hvd.allreduce`` call, else ``call.<i>`` by call order since the last ``decompress``."""
    if not tf.executing_eagerly():
        return _next_name()
    _, name = allreduce_call(compressor, tensor, "horovod.tensorflow")
    if name is not None:
        return name
    if not _warned_eager:
        _warned_eager.append(True)
        warnings.warn(
            "hvd_compress: hvd.allreduce(..., compression=...) was called eagerly without name=; tensors are "
            "identified by call order, which is only correct when every rank compresses the same tensors in "
            "the same order. Pass name= (the same on every rank)",
            stacklevel=6,  # the user's hvd.allreduce line
        )
    calls = _calls(compressor)
    calls.eager += 1
    return f"call.{calls.eager}"


#: per outermost graph and compressor: the bytes Horovod's own allreduce moves for it per run of the graph
_direct: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _counted(compressor: Any, tensor: Any, nbytes: int, numel: int) -> Any:
    """``tensor``, handed to Horovod's own allreduce (None, a tensor under ``dense_below``, a placeholder):
    its ``nbytes`` (``numel`` entries of the gradient, all sent) are added to ``compressor.stats`` each
    time it travels. Eagerly that is now; in a graph, one op per graph and compressor adds at each run
    what every such tensor of the graph moves (their sizes are static, summed while tracing)."""
    dense = numel * tensor.dtype.size
    if tf.executing_eagerly():
        compressor.stats.add(nbytes, dense, numel, numel)
        return tensor
    per_compressor = _direct.setdefault(_outer_graph(), {})
    totals = per_compressor.get(id(compressor))
    if totals is not None:
        totals[:] = [a + b for a, b in zip(totals, (nbytes, dense, numel, numel))]
        return tensor
    totals = per_compressor[id(compressor)] = [nbytes, dense, numel, numel]

    def count() -> Any:
        compressor.stats.add(*totals)
        return 0

    with tf.control_dependencies([tf.py_function(count, [], tf.int32)]):
        return tf.identity(tensor)


def check_agreement(compressor: Any, name: str, tensor: Any) -> None:
    """Once per ``(name, shape, dtype)``: every rank compresses it with the same configuration.

    Runs eagerly (``tf.init_scope``) while a graph is traced; every rank traces the
    same gradients in the same order, so the allgathers pair up. In a TF1 graph
    without eager execution there is nothing to run it with, and it is skipped.
    """
    seen = _calls(compressor).checked
    layout = (name, tuple(tensor.shape.as_list()), tensor.dtype.name)
    if layout in seen:
        return
    seen.add(layout)
    with tf.init_scope():
        if not tf.executing_eagerly():
            return
        comm = _communicator()
        compressor.bind(comm.rank, comm.size)
        config = header_config(type(compressor).__name__, compressor.config_hash())
        header = tf.constant([[config, header_hash(layout)]], tf.int64)
        rows = comm.wait(comm.allgather_async(header, f"{name}.agree")).numpy().tolist()
        compressor.stats.add(16, 0, 0, 0)
    check_header(comm, rows, name, compressor, f" on {layout[1]} {layout[2]}",
                 compressor.state.note(compressor.rank))


def _graph() -> Any:
    """The graph being built (None eagerly): a group's tensors and its exchange op belong to it."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


#: per outermost graph: the groups of one tensor exchanged in it (:func:`_note_lone_group`)
_lone_groups: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_warned_groups: List[bool] = []


def _note_lone_group(group: _Group) -> None:
    """Warn once per process when a traced step exchanges a second group of one tensor: Horovod
    without ``groups=`` hands us its gradients one by one, each then its own exchange (a round of
    Horovod's negotiation per gradient), where ``groups=1`` makes the step's gradients one exchange.
    The hook cannot regroup them: each gradient's average is due before Horovod shows the next."""
    if group.graph is None or len(group.named) != 1 or _warned_groups:
        return
    outer = _outer_graph()
    _lone_groups[outer] = _lone_groups.get(outer, 0) + 1
    if _lone_groups[outer] < 2:
        return
    _warned_groups.append(True)
    warnings.warn(
        "hvd_compress: horovod.tensorflow hands this compressor one gradient per group (DistributedGradientTape "
        "or DistributedOptimizer without groups=), so each gradient is an exchange of its own. Pass groups=1 "
        "(hvd.DistributedGradientTape(tape, compression=..., groups=1), hvd.DistributedOptimizer(opt, "
        "compression=..., groups=1)) to exchange a step's gradients as one, which is faster; or use the "
        "drop-in hvd_compress.tensorflow / hvd_compress.keras, which always do",
        stacklevel=2,
    )


def _exchanged(compressor: Any, group: _Group) -> List[Any]:
    """``group``'s averages: at the first call, one exchange of all its tensors, as one :func:`eagerly` op."""
    if group.averages is None:
        pending = _calls(compressor).pending
        if pending.get(group.graph) is group:  # later compressions open the next group
            del pending[group.graph]
        _note_lone_group(group)
        names, tensors = zip(*group.named)
        key = group.key
        run = lambda *ts: exchange(compressor, _communicator(), key, list(zip(names, ts)))  # noqa: E731
        group.averages, group.named = eagerly(run, tensors), []
    return group.averages


# do_not_convert: Horovod calls these while Keras or the user's tf.function traces a step, and
# AutoGraph converting this package (Python branches on static shapes and configuration only)
# took seconds of the first step
@tf.autograph.experimental.do_not_convert
def compress(compressor: Any, tensor: Any):
    """Horovod ``Compressor.compress`` for TF tensors: ``(tensor for Horovod's allreduce, ctx)``;
    a tensor we exchange joins its graph's pending group (exchanged by :func:`decompress`)."""
    pending = _calls(compressor).pending
    try:
        name = _name(compressor, tensor)
        compressor.state.route = "horovod.tensorflow"
        check_agreement(compressor, name, tensor)
    except BaseException:  # the group goes with the step: no later step exchanges its tensors
        pending.pop(_graph(), None)
        raise
    numel = tensor.shape.num_elements()
    if compressor.dense_only and compressor.dense_wire_dtype is None:  # None
        return _counted(compressor, tensor, numel * tensor.dtype.size, numel), _Context()
    if compressor.dense_only:  # FP16: cast to its wire dtype, as the engine's dense part (no saturation)
        wire_dtype = tf.as_dtype(compressor.dense_wire_dtype)
        counted = _counted(compressor, tensor, numel * wire_dtype.size, numel)
        return tf.cast(counted, wire_dtype), _Context(dtype=tensor.dtype)
    if numel < getattr(compressor, "dense_below", 0):
        return _counted(compressor, tensor, numel * tensor.dtype.size, numel), _Context()
    group = pending.setdefault(_graph(), _Group(_graph()))
    group.named.append((name, tensor))
    placeholder = _counted(compressor, tf.ones([1], dtype=tensor.dtype), tensor.dtype.size, 0)
    return placeholder, _Context(tensor.dtype, group, len(group.named) - 1)


@tf.autograph.experimental.do_not_convert
def decompress(compressor: Any, output: Any, ctx: _Context):
    """Horovod ``Compressor.decompress``: the dense average (``op=Average``) or sum (``op=Sum``)."""
    _calls(compressor).eager = 0
    if ctx.group is None:
        return output if ctx.dtype is None else tf.cast(output, ctx.dtype)
    average = _exchanged(compressor, ctx.group)[ctx.index]
    scaling = tf.reshape(output, [-1])[0]  # 1 for op=Average, N for op=Sum
    return average * tf.cast(scaling, average.dtype)
