"""``Auto(compressor)``: measure each bucket's exchange both ways on the real link, send it the cheaper way.

Compression pays only where the bytes it saves cost more than its encoder,
decoder and extra collectives (Agarwal et al., "On the Utility of Gradient
Compression in Distributed Training Systems", MLSys 2022): on a fast link a
dense allreduce is often faster. ``Auto`` decides per bucket, measured:

1. *measure* (the first ``warmup + 1`` exchanges of a bucket; the first is not
   timed, it builds plans): the bucket travels compressed (so the maths is the
   inner compressor's), and the step times

   - ``compressed_ms`` = encode + collectives (launch, then waiting for every
     handle) + decode (``finish``);
   - ``dense_ms`` = one extra allreduce-Sum of the bucket's concatenated
     gradients over the same communicator (its result is discarded; one per
     dtype and device of a bucket that mixes them, as its dense exchange sends).

   A sparsifier has a second way to send sparse: its index mode switched between
   each rank's own indices, allgathered (``indices="gather"``), and one index set
   shared by every rank, allreduced (``"leader"``, ``"aggregate"``;
   :mod:`~hvd_compress.algorithms.shared_bucket`). ``Auto(..., indices=...)`` names a
   mode to try besides the compressor's own (``"auto"``: ``"leader"`` for a gathering
   compressor, ``"gather"`` for a sharing one; default ``None``: none, since at the same
   ratio the modes do not train alike): the next ``warmup + 1`` exchanges travel that
   way, timed alike (``alternative_ms``).

   Clocks: CUDA events on CUDA tensors, ``time.perf_counter`` otherwise; the
   events are read only when deciding. Steady steps record nothing.
2. *decide* (the next exchange of the bucket): each rank's median of its
   samples, reduced across ranks by an allreduce-Max of ``[dense, compressed,
   alternative]`` (one host read), so every rank holds the same numbers and makes the
   same choice::

       the faster sparse way  if  its ms < (1 - margin) * dense_ms,  else dense

   (ties go dense: dense is exact; between the sparse ways, to the compressor's own).
   The choices are ``"dense"``, ``"compressed"`` (the compressor as configured) and
   ``"indices=<mode>"`` (the other index mode). Rank 0 prints one line when a bucket's
   choice is made or changes.
3. *steady*: the bucket travels the chosen way; after ``decide_every`` more
   exchanges it is measured again (``0``: the choice is kept).

Switching keeps every gradient: a bucket that goes dense travels through
:class:`DenseView`, whose plans send each tensor's error-feedback residual
with its first dense gradient (the fused plan's dense-kind flush,
:meth:`~hvd_compress.engine.fused.FusedBucket.adopt`), so ``sum of what was sent + residual == sum of
gradients`` holds across the switch. Under momentum correction (a sparsifier's
``momentum``) a dense bucket sends each tensor's velocity ``u = m u + g``, and the
velocity carries over both ways. RegTop-k's posterior waits in the run state's
memory while the bucket is dense and informs the first selection back (as
after a density change; ``tests/comm/test_dense_switch.py``); TernGrad's random
stream is not advanced while dense. A bucket that goes back to compressed
starts with a zero residual.

Pinning: ``pin="dense"`` or ``"compressed"`` (or the environment variable
``HVD_COMPRESS_AUTO_PIN``) skips measuring; ``HVD_COMPRESS_AUTO_DECIDE_EVERY``
overrides ``decide_every``; :meth:`Auto.remeasure` measures every bucket again
(call it on every rank at the same step). Decisions and measurements are in
:meth:`Auto.state_dict` and in ``stats.decisions``.
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.algorithms.base import Compressor, ExchangePolicy, fingerprint
from hvd_compress.algorithms.schedule import ramping
from hvd_compress.algorithms.state import WireStats
from hvd_compress.algorithms.validation import check_count
from hvd_compress.kernels import ops_for

DENSE, COMPRESSED = "dense", "compressed"
#: the index mode ``Auto`` tries besides a sparsifier's own, by default
DEFAULT_ALTERNATIVE = {"gather": "leader", "leader": "gather", "aggregate": "gather"}
PIN_ENV, DECIDE_EVERY_ENV = "HVD_COMPRESS_AUTO_PIN", "HVD_COMPRESS_AUTO_DECIDE_EVERY"


def decide(dense_ms: float, compressed_ms: float, margin: float = 0.0) -> str:
    """``"compressed"`` if it is faster than dense by more than ``margin`` (a fraction), else ``"dense"``."""
    return COMPRESSED if compressed_ms < (1.0 - margin) * dense_ms else DENSE


# --------------------------------------------------------------------- clocks
class WallClock:
    """The default clock: a CUDA event recorded on the current stream for CUDA tensors (read, with one
    synchronisation, only when deciding), ``time.perf_counter()`` otherwise. Each mark follows the
    waits for the collectives it closes."""

    def mark(self, like: Any) -> Any:
        if getattr(like, "is_cuda", False):
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        if hasattr(stop, "elapsed_time"):
            stop.synchronize()  # only when deciding
            return float(start.elapsed_time(stop))
        return (stop - start) * 1e3


@dataclass
class BucketChoice:
    """One bucket's measurements and choice (what checkpoints carry)."""

    choice: Optional[str] = None
    dense_ms: Optional[float] = None  # reduced over ranks (max of the ranks' medians)
    compressed_ms: Optional[float] = None
    exchanges: int = 0  # exchanges of this bucket so far
    decided_at: int = 0
    measured: int = 0  # exchanges of the current measurement (the first is not timed)
    remeasure: bool = False  # measure again from the next exchange
    samples: List[Tuple[Any, ...]] = field(default_factory=list)
    alternative_ms: Optional[float] = None  # the other index mode's, where one is tried

    def decision(self) -> Dict[str, Any]:
        """The last decision: choice, the reduced timings and the exchange it was made at."""
        return {"choice": self.choice, "dense_ms": self.dense_ms, "compressed_ms": self.compressed_ms,
                "alternative_ms": self.alternative_ms, "decided_at": self.decided_at}

    def public(self) -> Dict[str, Any]:
        return {**self.decision(), "exchanges": self.exchanges, "remeasure": self.remeasure}


class AutoStats(WireStats):
    """:class:`WireStats` plus ``decisions``: ``{bucket: {"choice", "dense_ms", "compressed_ms", ...}}``
    (kept across ``reset()``)."""

    def __init__(self, stats: WireStats) -> None:
        super().__init__(stats.bytes_sent, stats.dense_bytes, stats.values_sent, stats.numel)
        self.decisions: Dict[str, Dict[str, Any]] = {}

    @property
    def dense_buckets(self) -> int:
        return sum(d["choice"] == DENSE for d in self.decisions.values())

    @property
    def compressed_buckets(self) -> int:
        """Buckets sent sparse (the compressor as configured, or its other index mode)."""
        return sum(d["choice"] not in (None, DENSE) for d in self.decisions.values())


# ---------------------------------------------------------------- dense view
def _on_both_ways(name: str, doc: str) -> property:
    """A setting of :class:`Auto` read from its inner compressor (``None`` where it has none) and set on both
    of its ways (the inner compressor and the other index mode's)."""
    def get(auto: "Auto") -> Any:
        return getattr(auto.inner, name, None)

    def put(auto: "Auto", value: Any) -> None:
        for way in (auto.inner, auto.alternative):
            if way is not None:
                setattr(way, name, value)

    return property(get, put, doc=doc)


class DenseView:
    """The inner compressor's tensors sent dense, as the compressor of a dense bucket's exchange, on its rank and run
    state: memory (residuals flushed into the dense sum), statistics, fused plans (a switch rebuilds the plan)."""

    fused, dense_wire_dtype = True, None

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner

    state = property(lambda self: self.inner.state)
    rank = property(lambda self: self.inner.rank)
    #: the inner compressor's momentum correction: its tensors sent dense send their velocity
    momentum = property(lambda self: getattr(self.inner, "momentum", 0.0))
    #: the inner compressor's ``compile`` option (its momentum update and checks run as it asks)
    compile = property(lambda self: getattr(self.inner, "compile", None))
    fused_kind = staticmethod(lambda numel: DENSE)  # every tensor
    warn_dense = staticmethod(lambda name, numel: None)  # nothing to warn of: the view sends every tensor dense

    def bind(self, rank: int, size: int) -> "DenseView":
        self.inner.bind(rank, size)
        return self

    def config_hash(self, run: Any, density: bool = True) -> int:
        """The inner compressor's configuration (:meth:`~hvd_compress.algorithms.base.Compressor.config_repr`,
        without the machine's ``compile``), its density settings left out while a warm-up ramps them
        (:func:`~hvd_compress.algorithms.schedule.ramping`) and with ``density=False``: a dense bucket sends
        the same whatever they are, so its plan is not rebuilt at every step of the ramp."""
        config = self.inner.config()
        if ramping(self.inner) or not density:
            config = {key: value for key, value in config.items() if key not in self.inner.density_settings}
        return fingerprint({"type": "Dense", "of": self.inner.config_repr(config)}, run, self.rank)

    def __repr__(self) -> str:
        return f"DenseView(of={repr(self.inner)!r})"


# ------------------------------------------------------------------ measuring
class WaitOnce:
    """A communicator whose ``wait`` remembers results: a measurement waits for every handle right
    after ``launch`` (to time the collectives) and ``finish`` then finds them done."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.results: Dict[int, Tuple[Any, Any]] = {}

    def __getattr__(self, name: str) -> Any:  # rank, size, the collectives: the communicator's
        return getattr(self.comm, name)

    def wait(self, handle: Any) -> Any:
        key = id(handle)
        if key not in self.results:
            self.results[key] = (handle, self.comm.wait(handle))  # handle kept: its id stays unique
        return self.results[key][1]


class AutoExchange:
    """One bucket's exchange for :class:`Auto` (``add``/``launch``/``in_flight``/``finish``, as
    :class:`~hvd_compress.engine.exchange.BucketExchange`). The bucket's way is settled at ``launch``,
    after its tensors are added."""

    def __init__(self, auto: "Auto", comm: Any, key: str, run: Any) -> None:
        self.auto, self.key = auto, key
        self.run = run  # the route's CompressorState: the inner compressor's, its choices and statistics
        self.state = auto.choices_in(run).setdefault(key, BucketChoice())
        self.mode = auto.mode(self.state)
        self.comm = WaitOnce(comm) if self.mode == "measure" else comm
        self.added: List[Tuple[str, Any]] = []
        self.marks: List[Any] = []
        self.exchange: Optional[BucketExchange] = None

    def add(self, name: str, tensor: Any) -> None:
        self.added.append((name, tensor))

    def _resolved(self) -> BucketExchange:
        if self.exchange is None:
            if self.mode == "decide":
                self.mode = self.auto.settle(self.key, self.added, self.comm, self.run)
            way = self.auto.way_measured(self.state) if self.mode == "measure" else self.mode
            compressor, suffix = self.auto.way(way)
            self.exchange = BucketExchange(compressor, self.comm, self.key + suffix, self.run)
            for name, tensor in self.added:
                self.exchange.add(name, tensor)
        return self.exchange

    def launch(self, complete: bool = True) -> None:
        """As :meth:`BucketExchange.launch`; a measuring exchange always waits for its collectives
        (so, like deciding, it needs every rank to reach the bucket in the same order)."""
        exchange, state = self._resolved(), self.state
        state.exchanges += 1
        if self.mode != "measure":
            exchange.launch(complete)
            return
        way = self.auto.way_measured(state)
        state.measured, state.remeasure = state.measured + 1, False
        timed = state.measured not in (1, self.auto.warmup + 2)  # the first exchange of each way builds plans
        clock, comm, like = self.auto.clock, self.comm, self.added[0][1]
        mark = (lambda: clock.mark(like)) if timed else (lambda: None)
        start = mark()
        exchange.launch()
        for handle in exchange.in_flight():
            comm.wait(handle)
        launched = mark()
        for key, _, tensors in exchange.parts():  # one allreduce per dtype and device, as a dense bucket sends
            ops = ops_for(tensors[0])
            flat = ops.concat([ops.reshape(t, (-1,)) for t in tensors])  # in the exchange's form
            comm.wait(comm.allreduce_async(flat, comm.SUM, f"{key}.auto.dense"))
            stats = self.auto.stats_in(self.run)
            stats.add(flat.shape[0] * ops.itemsize(flat), 0, 0, 0)  # the measurement's allreduce travels too
        self.marks = [start, launched, launched, mark(), way] if timed else []

    def complete(self) -> None:
        self._resolved().complete()

    def in_flight(self) -> List[Any]:
        return self._resolved().in_flight()

    def finish(self, average: bool = True, order: Optional[List[str]] = None) -> Any:
        exchange = self._resolved()
        if not self.marks:
            results = exchange.finish(average, order)
        else:
            clock, like = self.auto.clock, self.added[0][1]
            before = clock.mark(like)
            results = exchange.finish(average, order)
            start, launched, dense_start, dense_stop, way = self.marks
            self.state.samples.append((start, launched, before, clock.mark(like), dense_start, dense_stop, way))
        if isinstance(self.comm, WaitOnce):
            self.comm.results.clear()  # the handles it kept hold the transport's connections
        return results


class Auto(ExchangePolicy):
    """Per bucket, the cheaper of ``compressor`` and a dense allreduce, measured (see the module docstring): an
    exchange policy (:class:`~hvd_compress.algorithms.base.ExchangePolicy`) holding the compressor, ``inner``.

    ``warmup``: timed exchanges per measurement (after one untimed); ``decide_every``: exchanges
    between measurements (0: decide once); ``margin``: how much faster compressed must be (0.05 =
    5%); ``pin``: ``"dense"`` or ``"compressed"`` to skip measuring; ``log``: print a line on rank 0
    per decision change (``True``), call ``log(line)``, or ``False``; ``clock``: an object with
    ``mark(like)`` and ``elapsed_ms(start, stop)`` (default: CUDA events or ``perf_counter``);
    ``indices``: the index mode of a sparsifier tried besides its own (``"auto"``, ``"gather"``,
    ``"leader"``, ``"aggregate"``; ``None``, the default: only dense and the compressor; the modes
    train differently at the same ratio, so trying another is the user's call).
    """

    def __init__(self, compressor: Compressor, warmup: int = 3, decide_every: int = 0, margin: float = 0.0,
                 pin: Optional[str] = None, log: Any = True, clock: Any = None, indices: Optional[str] = None
                 ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"hvd_compress: Auto(compressor) needs an hvd_compress compressor such as "
                            f"RegTopK(0.01), got {compressor!r}")
        self.inner = compressor
        self.dense = DenseView(compressor)
        self.warmup = max(1, check_count(warmup, "Auto warmup"))
        env_every = os.environ.get(DECIDE_EVERY_ENV)
        self.decide_every = check_count(int(env_every) if env_every else decide_every, "Auto decide_every")
        if not 0.0 <= float(margin) < 1.0:
            raise ValueError(f"hvd_compress: Auto margin must be in [0, 1), got {margin!r}")
        self.margin = float(margin)
        pin = os.environ.get(PIN_ENV) or pin
        if pin not in (None, DENSE, COMPRESSED):
            raise ValueError(f"hvd_compress: Auto pin (or {PIN_ENV}) must be 'dense' or 'compressed', got {pin!r}")
        self.pin = pin
        self.log = log
        self.clock = clock or WallClock()
        #: the sparsifier with its other index mode (``None``: nothing else is tried), sharing its state
        self.alternative = alternative_of(compressor, indices)
        self.stats_in(compressor.own_state)

    def choices_in(self, run: Any) -> Dict[str, BucketChoice]:
        """Every bucket's measurements and choice in the run state ``run`` (a route's, or the inner
        compressor's own)."""
        return run.route_data("auto.choices", dict)

    def stats_in(self, run: Any) -> AutoStats:
        """The statistics of the run state ``run``, with the decisions (an :class:`AutoStats`)."""
        if not isinstance(run.stats, AutoStats):
            run.stats = AutoStats(run.stats)
        return run.stats

    #: :meth:`choices_in` and :meth:`stats_in` of the inner compressor's own state
    choices = property(lambda self: self.choices_in(self.inner.own_state))
    stats = property(lambda self: self.stats_in(self.inner.own_state))

    # what a route calls on its compression= (ExchangePolicy) that the inner compressor answers
    state = property(lambda self: self.inner.state)
    memory = property(lambda self: self.inner.memory)
    rank = property(lambda self: self.inner.rank)
    seed = property(lambda self: self.inner.seed, lambda self, value: self._seed(value))
    nonfinite = property(lambda self: self.inner.nonfinite, lambda self, value: setattr(self.inner, "nonfinite", value))
    fused = property(lambda self: self.inner.fused)
    dense_only = property(lambda self: self.inner.dense_only)
    dense_wire_dtype = property(lambda self: self.inner.dense_wire_dtype)
    dense_below = property(lambda self: getattr(self.inner, "dense_below", 0))
    error_feedback = property(lambda self: getattr(self.inner, "error_feedback", False))
    momentum = property(lambda self: getattr(self.inner, "momentum", 0.0))

    def _seed(self, value: int) -> None:
        """Seed the inner compressor and its copy in the other index mode (the Simulator's ``seed``)."""
        for way in (self.inner, self.alternative):
            if way is not None:
                way.seed = value

    def bind(self, rank: int, size: int) -> "Auto":
        """Bind the inner compressor and its copy in the other index mode (with ``traffic=``, each resolves
        its ratio for ``size`` ranks)."""
        for way in (self.inner, self.alternative):
            if way is not None:
                way.bind(rank, size)
        return self

    def state_for(self, holder: Any, route: str, state: Any = None) -> Any:
        return self.inner.state_for(holder, route, state)

    def config_hash(self, run: Any = None) -> int:
        """A compressor's ``config_hash`` of :meth:`config`, on the inner compressor's state (default: its own)."""
        return fingerprint(self.config(), self.inner.own_state if run is None else run, self.rank)

    @property
    def ratio(self) -> float:
        """The inner compressor's density (density schedules set it here)."""
        return self.inner.ratio

    @ratio.setter
    def ratio(self, value: float) -> None:
        self.inner.ratio = value
        if self.alternative is not None:
            self.alternative.ratio = value

    target_ratio = _on_both_ways("target_ratio", "The density a warm-up ramps the inner compressor to (``None`` "
                                                 "where none has), kept on the inner one.")
    traffic = _on_both_ways("traffic", "The inner compressor's traffic budget, ``None`` without one (density "
                                       "schedules then set it here).")

    def config(self) -> Dict[str, Any]:
        return {"type": "Auto", "compressor": self.inner.config_repr(), "warmup": self.warmup,
                "decide_every": self.decide_every, "margin": self.margin, "pin": self.pin,
                **({"indices": self.alternative.indices} if self.alternative is not None else {})}

    def way(self, choice: str) -> Tuple[Any, str]:
        """The compressor a bucket travels with for ``choice`` and the suffix of its plan's key."""
        if choice == DENSE:
            return self.dense, ".dense"
        if choice == COMPRESSED or self.alternative is None:
            return self.inner, ""
        return self.alternative, ".indices"

    @property
    def alternative_choice(self) -> Optional[str]:
        """The choice that sends with the other index mode (``"indices=leader"``...), ``None`` without one."""
        return None if self.alternative is None else f"indices={self.alternative.indices}"

    def way_measured(self, state: BucketChoice) -> str:
        """How a measuring exchange travels: the compressor's own way for the first ``warmup + 1``
        exchanges of a measurement, then its other index mode's."""
        if self.alternative is None or state.measured < self.warmup + 1:
            return COMPRESSED
        return self.alternative_choice

    # inspection: the inner compressor's state
    def residual(self, name: str, run: Any = None):
        return self.inner.residual(name, run)

    def velocity(self, name: str, run: Any = None):
        """The inner sparsifier's momentum-correction velocity of ``name`` (``None`` without)."""
        return self.inner.velocity(name, run) if hasattr(self.inner, "velocity") else None

    def reset(self, name: Optional[str] = None, run: Any = None) -> None:
        self.inner.reset(name, run)

    def make_exchange(self, comm: Any, key: str, state: Any = None) -> AutoExchange:
        """The exchange of bucket ``key`` on the run state ``state`` (default: :attr:`state`; called by
        :func:`~hvd_compress.engine.exchange.open_exchange`)."""
        self.bind(comm.rank, comm.size)
        return AutoExchange(self, comm, key, self.state if state is None else state)

    # ------------------------------------------------------------------ deciding
    def mode(self, state: BucketChoice) -> str:
        """How the bucket's next exchange runs: ``dense``, ``compressed``, ``measure`` or ``decide``."""
        if self.pin is not None:
            return self.pin
        if state.choice is not None and state.measured == 0:
            due = self.decide_every and state.exchanges - state.decided_at >= self.decide_every
            if not (due or state.remeasure):
                return state.choice
            state.samples = []
        ways = 1 if self.alternative is None else 2
        return "decide" if len(state.samples) >= ways * self.warmup else "measure"

    def medians(self, state: BucketChoice) -> Tuple[float, ...]:
        """This rank's median ``(dense_ms, compressed_ms[, alternative_ms])`` over the bucket's samples (reads
        the clocks)."""
        elapsed = self.clock.elapsed_ms
        dense = statistics.median(elapsed(s[4], s[5]) for s in state.samples)
        ways = [COMPRESSED] + ([] if self.alternative is None else [self.alternative_choice])
        sparse = [statistics.median(elapsed(s[0], s[1]) + elapsed(s[2], s[3]) for s in state.samples if s[6] == way)
                  for way in ways]
        return (dense, *sparse)

    def settle(self, key: str, added: List[Tuple[str, Any]], comm: Any, run: Any = None,
               mine: Optional[Tuple[float, ...]] = None) -> str:
        """Reduce this rank's ``[dense_ms, compressed_ms(, alternative_ms)]`` (default: :meth:`medians`) across
        ranks (max), record the bucket's choice in the run state ``run`` (default: the inner compressor's
        own) and return it; the same on every rank."""
        run = self.inner.own_state if run is None else run
        state = self.choices_in(run).setdefault(key, BucketChoice())
        like = added[0][1]
        ops = ops_for(like)
        local = ops.as_float32(list(mine or self.medians(state)), like=like)
        dense, compressed, *alternative = ops.to_list(comm.wait(comm.allreduce_async(local, comm.MAX, f"{key}.auto")))
        stats = self.stats_in(run)
        stats.add(4 * (2 + len(alternative)), 0, 0, 0)  # the float32 timings
        choice = decide(dense, compressed, self.margin)
        if alternative and alternative[0] < compressed:
            other = decide(dense, alternative[0], self.margin)
            choice = other if other == DENSE else self.alternative_choice
        previous = state.choice
        state.choice, state.dense_ms, state.compressed_ms = choice, float(dense), float(compressed)
        state.alternative_ms = float(alternative[0]) if alternative else None
        state.decided_at, state.measured, state.samples = state.exchanges, 0, []
        stats.decisions[key] = state.decision()
        if choice != previous and comm.rank == 0 and self.log:
            other = f", indices={self.alternative.indices} {alternative[0]:.2f} ms" if alternative else ""
            line = (f"hvd_compress: Auto: {key}: dense {dense:.2f} ms, {self.inner!r} {compressed:.2f} ms{other} "
                    f"-> {choice}")
            self.log(line) if callable(self.log) else print(line, file=sys.stderr, flush=True)
        return choice

    def remeasure(self, run: Any = None) -> None:
        """Measure every bucket again from its next exchange (call on every rank at the same step); ``run``:
        a route's state (default: the inner compressor's own)."""
        for state in self.choices_in(self.inner.own_state if run is None else run).values():
            state.remeasure, state.measured, state.samples = True, 0, []

    # --------------------------------------------------------------- checkpoints
    def state_dict(self, run: Any = None) -> Dict[str, Any]:
        """The inner compressor's state plus every bucket's choice and measurements (of ``run``, a route's
        state; default: the inner compressor's own)."""
        inner = self.inner.state_dict(run)
        choices = self.choices_in(self.inner.own_state if run is None else run)
        return {"config": self.config(), "inner": inner,
                "decisions": {key: state.public() for key, state in choices.items()}}

    def load_state_dict(self, state: Dict[str, Any], run: Any = None) -> None:
        saved = state.get("config", {}).get("type")
        if saved != "Auto":
            raise ValueError(f"hvd_compress: checkpoint holds {saved} state; cannot load it into {self!r}")
        self.inner.load_state_dict(state["inner"], run)
        run = self.inner.own_state if run is None else run
        choices, stats = self.choices_in(run), self.stats_in(run)
        choices.clear()
        for key, entry in state.get("decisions", {}).items():
            choices[key] = BucketChoice(**entry)
            if entry.get("choice") is not None:
                stats.decisions[key] = choices[key].decision()

    def __repr__(self) -> str:
        return f"Auto({self.inner!r}, warmup={self.warmup}, decide_every={self.decide_every})"


def alternative_of(compressor: Compressor, indices: Optional[str]) -> Optional[Compressor]:
    """``compressor`` with the index mode ``indices`` (``"auto"``: :data:`DEFAULT_ALTERNATIVE` of its own),
    sharing its run state (a shallow copy), or ``None`` when ``indices`` is ``None``, is the compressor's own
    mode, or the compressor has no index modes (not a sparsifier)."""
    own = getattr(compressor, "indices", None)
    if indices is None or own is None:
        return None
    other = copy.copy(compressor)
    other.indices = DEFAULT_ALTERNATIVE[own] if indices == "auto" else indices  # checked: an unknown mode fails
    return None if other.indices == own else other
