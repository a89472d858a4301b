"""What a compressor learns while it runs, kept apart from its configuration.

A compressor's configuration (``ratio``, ``seed``, options: :meth:`Compressor.config`) says
what it sends; a :class:`CompressorState` holds everything a run accumulates: per-tensor
arrays (residuals, velocities, posteriors, in
:class:`~hvd_compress.algorithms.residual.TensorMemory`), the random streams, the fused
buckets' plans and the state they hold, the statistics of what was sent (:class:`WireStats`,
read as ``compressor.stats``), and what a route keeps per compressor
(:meth:`route_data`: stock Horovod's plans and calls for torch, the layouts checked and
eager call counts for TensorFlow, ``Auto``'s choices). It follows PyTorch's ``PowerSGDState``
(torch.distributed's ``powerSGD_hook``) and GRACE's ``Memory`` (Xu et al., "GRACE: A
Compressed Communication Framework for Distributed Machine Learning", ICDCS 2021): the
exchanges read and write state only through this object. ``Compressor.state_dict()`` saves
the memory and the random streams (the checkpoint format); bucket plans and route data are
rebuilt.

The route owns the state: the drop-in and MPI optimizers and the DDP hook each hold one
(:func:`state_for_route`: the compressor's own, ``compressor.own_state``, while no other live
route holds it, else a new one) and hand it to the exchanges explicitly
(:func:`~hvd_compress.engine.exchange.open_exchange`), whose steps work on it (``step.run``);
checkpoints and inspection take it as an argument (``compressor.state_dict(run)``). Calls
without one use the compressor's own (stock Horovod's ``compression=`` route, the Simulator).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from hvd_compress import kernels
from hvd_compress.algorithms.checkpoint import host_array
from hvd_compress.algorithms.residual import TensorMemory


@dataclass
class WireStats:
    """What the steps handed to the collectives since the last ``reset()``: bytes vs the dense gradients."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    values_sent: int = 0
    numel: int = 0

    @property
    def density(self) -> float:
        """Fraction of gradient entries sent (1 for dense and ternary payloads)."""
        return self.values_sent / self.numel if self.numel else 0.0

    @property
    def savings(self) -> float:
        """Dense bytes over bytes sent."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else 0.0

    def add(self, bytes_sent: int, dense_bytes: int, values_sent: int, numel: int) -> None:
        """Count a whole bucket at once (the fused path)."""
        self.bytes_sent += bytes_sent
        self.dense_bytes += dense_bytes
        self.values_sent += values_sent
        self.numel += numel

    def reset(self) -> None:
        self.bytes_sent = self.dense_bytes = self.values_sent = self.numel = 0


class CompressorState:
    """One compressor's run state (module docstring)."""

    generator_rank: Optional[int] = None  # also for states pickled before it was kept

    def __init__(self) -> None:
        #: per-tensor arrays by name (residual, velocity, posterior, ...)
        self.memory = TensorMemory()
        #: bucket key -> fused bucket (``hvd_compress.engine.fused.FusedBucket``): its plan and the
        #: bucket-shaped state it holds until :meth:`flush_buckets`
        self.buckets: Dict[str, Any] = {}
        #: kernel module name -> the random stream of rank ``generator_rank``; streams loaded before
        #: their framework ran
        self.generators: Dict[str, Any] = {}
        self.saved_generators: Dict[str, Any] = {}
        #: (rank, world) that saved the loaded state, ``None`` when it is this rank's own or none was loaded
        self.origin: Optional[Tuple[int, int]] = None
        #: the route that wrote the state last loaded; the route that runs on it (recorded in checkpoints)
        self.loaded_route = ""
        self.route: Optional[str] = None
        #: loaded arrays may be another framework's (moved on the first gradient)
        self.loaded_elsewhere = False
        #: what the steps handed the collectives (bytes sent against the dense gradients')
        self.stats = WireStats()
        self._route_data: Dict[str, Any] = {}
        #: steps exchanged before the buckets now held (a checkpoint's ``exchanges``)
        self.exchanges = 0

    def exchanged(self) -> int:
        """Steps this run has exchanged: the most any bucket has (a shared index set's leader turn)."""
        return max([self.exchanges] + [bucket.exchanges for bucket in self.buckets.values()])

    def route_data(self, key: str, make: Callable[[], Any]) -> Any:
        """What the route ``key`` keeps for this compressor (made by ``make()`` on first use)."""
        if key not in self._route_data:
            self._route_data[key] = make()
        return self._route_data[key]

    def generator(self, ops: Any, seed: int, rank: int, like: Any) -> Any:
        """Rank ``rank``'s random stream for ``like``'s framework, seeded from ``(seed, rank)``; a stream
        loaded from a checkpoint continues where it was saved."""
        if self.generator_rank != rank:
            self.generators, self.generator_rank = {}, rank
        if ops.__name__ not in self.generators:
            stream = ops.generator(seed, rank, like)
            if ops.__name__ in self.saved_generators:
                ops.set_generator_state(stream, self.saved_generators.pop(ops.__name__))
            self.generators[ops.__name__] = stream
        return self.generators[ops.__name__]

    def adopt_loaded(self, ops: Any, like: Any) -> None:
        """Move loaded arrays written by another framework (a numpy residual for torch gradients...)
        into ``ops``'s, next to ``like``: once after each load, not in a step. Counts (a reused
        threshold's ``threshold_k``) are plain ints and stay."""
        if not self.loaded_elsewhere:
            return
        self.loaded_elsewhere = False
        for name in self.memory.names():
            for key, value in list(self.memory.slots(name).items()):
                if value is not None and not isinstance(value, int) and kernels.ops_for(value, name) is not ops:
                    self.memory.set(name, key, ops.from_host(host_array(value), like))

    def note(self, rank: int) -> str:
        """``""``, or why the state rank ``rank`` runs on is not its own (for the cross-rank check's error)."""
        if self.origin is None or self.origin[0] == rank:
            return ""
        origin, world = self.origin
        return (  # this rank's number in it: ranks that all hold one other rank's state differ too
            f"; rank {rank}'s state was loaded from rank {origin}'s checkpoint (of {world} ranks): residuals are "
            f"per rank, so save compressor state on every rank and load each rank's own, or call "
            f"reset() after loading to start error feedback afresh"
        )

    def array(self, name: str, key: str) -> Any:
        """Tensor ``name``'s ``key`` array (``"residual"``, ``"velocity"``...) in the tensor's shape, the
        fused buckets written out first; ``None`` when it has none."""
        self.flush_buckets()
        value = self.memory.peek(name, key)
        return None if value is None else kernels.ops_for(value).reshape(value, self.memory.shape(name))

    def flush_buckets(self) -> None:
        """Write the fused buckets' state into the per-name memory (checkpoints, inspection)."""
        for bucket in self.buckets.values():
            bucket.flush(self.memory)

    def snapshot(self) -> Dict[str, Any]:
        """What a rollback restores (:meth:`roll_back`): the fused buckets written out, then every
        tensor's arrays as they are now (the references; the buckets go on in buffers of their own) and
        the step count."""
        self.flush_buckets()
        tensors = {name: (self.memory.shape(name), self.memory.slots(name)) for name in self.memory.names()}
        return {"tensors": tensors, "exchanges": self.exchanged()}

    def roll_back(self, snapshot: Dict[str, Any]) -> None:
        """This process's state as :meth:`snapshot` took it (copies of its arrays): the plans dropped,
        the per-tensor arrays and the step count put back."""
        self.buckets = {}
        self.memory.reset()
        for name, (shape, slots) in snapshot["tensors"].items():
            self.memory.track(name, shape)
            for key, value in slots.items():
                self.memory.set(name, key, value if value is None or isinstance(value, int)
                                else kernels.ops_for(value).clone(value))
        self.exchanges = snapshot["exchanges"]

    def reset_for_new_world(self) -> None:
        """The rules of a reset of the world (Horovod Elastic: a process added, removed or replaced, ranks
        renumbered). Per-process arrays stay with the process (residuals, velocities, RegTop-k's
        posterior), whatever its new rank; what every rank must hold alike, or what was measured for the
        old world, starts afresh on every rank, as it does in a process that joins: the plans (written
        out first), the step count (a shared index set's leader turn: rank 0 leads; reused thresholds:
        an exact selection first), kept thresholds, the ``aggregate`` rule's rates and ages, what routes
        keep (stock Horovod's step in progress, ``Auto``'s measurements and decisions), and the record
        of which rank's checkpoint the state came from."""
        self.flush_buckets()
        self.buckets, self._route_data, self.exchanges, self.origin = {}, {}, 0, None
        for name in self.memory.names():
            for key in WORLD_BOUND:
                self.memory.discard(name, key)

    def drop_bucket(self, key: str) -> None:
        """Forget the fused bucket of ``key`` (its plan; a route whose layout changed rebuilds it)."""
        self.buckets.pop(key, None)

    def drop_buckets(self, name: Optional[str] = None) -> None:
        """Forget every fused bucket, or those holding tensor ``name``."""
        for key, bucket in list(self.buckets.items()):
            if name is None or name in bucket.names:
                del self.buckets[key]


def state_for_route(compressor: Any, holder: Any, route: str, state: Optional[CompressorState] = None
                    ) -> CompressorState:
    """The :class:`CompressorState` a new route (the object ``holder``) runs ``compressor`` on, recording
    ``route`` in it: ``state`` when given, else the compressor's own while no other live route holds
    it (so a compressor serving one route reads, saves and loads that route's state as before), else
    a new one."""
    own = compressor.own_state
    taken = getattr(compressor, "_own_state_holder", None)
    if state is None:
        state = own if taken is None or taken() in (None, holder) else CompressorState()
    if state is own:
        compressor._own_state_holder = weakref.ref(holder)
    else:
        compressor.__dict__.setdefault("_other_route_states", weakref.WeakSet()).add(state)
    state.route = route
    return state


#: per-tensor state measured with, or agreed on by, the ranks of one world (:meth:`CompressorState.reset_for_new_world`)
WORLD_BOUND = ("threshold", "threshold_k", "index_rate", "index_age")

#: Horovod's ``broadcast_object`` (module, function): what sends an elastic state's ordinary values from rank 0
HOROVOD_BROADCASTS = (("horovod.torch.functions", "broadcast_object"),
                      ("horovod.tensorflow.functions", "broadcast_object"))


def pickled_by_horovod_broadcast(depth: int = 40) -> bool:
    """Whether the object being pickled is pickled by Horovod's ``broadcast_object`` (found on the call
    stack): an ordinary value of ``hvd.elastic.TorchState`` / ``KerasState``, sent from rank 0 to every rank."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) in HOROVOD_BROADCASTS:
            return True
        frame = frame.f_back
    return False


def refused_broadcast(what: str) -> ValueError:
    """The error of a compressor handed to Horovod's elastic state as an ordinary value, on every rank."""
    return ValueError(
        f"hvd_compress: {what} was put into Horovod's elastic state as an ordinary value, which Horovod "
        f"broadcasts from rank 0: every rank would take rank 0's residuals (gradient mass applied twice) and "
        f"nothing would roll back after a failure. Keep it out of TorchState(...) / KerasState(...), pass the "
        f"optimizer as optimizer=, and call hvd_compress.torch.elastic.register(state, optimizer) (stock "
        f"horovod.torch: register(state, compression); Keras: hvd_compress.keras.elastic.register(state, "
        f"optimizer)) on every process"
    )


#: what a compressor keeps of the routes that run it: weak references, not pickled
ROUTE_REFERENCES = ("_own_state_holder", "_other_route_states")


def check_one_state(compressor: Any, call: str, run: Optional[CompressorState]) -> CompressorState:
    """The state ``compressor.<call>(run)`` works on: ``run``, else the compressor's own, refused while
    live routes run the compressor on states of their own besides it (which one is meant is the
    route's to say)."""
    if run is not None:
        return run
    others = len(getattr(compressor, "_other_route_states", ()))
    if others:
        holder = getattr(compressor, "_own_state_holder", None)
        routes = others + (holder is not None and holder() is not None)
        raise RuntimeError(
            f"hvd_compress: {compressor!r} runs on {routes} route{'s' * (routes != 1)}, each with a run state of "
            f"its own; "
            f"call {call}() on the route whose state you mean: optimizer.{call}() (its 'hvd_compress' "
            f"entry), the DDP hook's CompressionState.{call}(), or compressor.{call}(run=route.compression_state)"
        )
    return compressor.own_state
