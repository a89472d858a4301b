"""The compressor interface shared by every algorithm: configuration, a bucket codec, run state.

A compressor is its options (checked, in :meth:`Compressor.config`, agreed on by the ranks) and
the codec of a fused bucket's compressed part (:meth:`Compressor.bucket_codec`), which the one
engine (:mod:`hvd_compress.engine`) runs on every route and in the
:class:`~hvd_compress.simulator.Simulator`. What a run accumulates lives in a
:class:`~hvd_compress.algorithms.state.CompressorState`. The per-tensor definition of each
algorithm, the yardstick the engine is tested against, is the numpy spec outside the package
(``spec/`` of the repository).
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Optional, Tuple

import numpy as np

from hvd_compress import kernels
from hvd_compress.wire import header_hash
from hvd_compress.algorithms.checkpoint import check_state, plain_counts, state_checksum, writer
from hvd_compress.algorithms.residual import TensorMemory
from hvd_compress.algorithms.state import (ROUTE_REFERENCES, CompressorState, WireStats, check_one_state,
                                           pickled_by_horovod_broadcast, refused_broadcast, state_for_route)
from hvd_compress.algorithms.validation import check_compile, check_count, check_nonfinite, checked


def check_ratio(ratio: Any) -> float:
    """``ratio`` as a float in (0, 1]; ``TypeError``/``ValueError`` otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"hvd_compress: ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"hvd_compress: ratio must be in (0, 1], got {ratio!r}")
    return ratio


def as_tensor(tensor: Any) -> Any:
    """Numpy arrays and framework tensors pass; anything else (lists, scalars) becomes a numpy array, and
    eager TensorFlow tensors on the CPU too (:func:`hvd_compress.kernels.computed_form`)."""
    if not (hasattr(tensor, "shape") and hasattr(tensor, "dtype")):
        return np.asarray(tensor)
    return kernels.computed_form(tensor)


def fingerprint(config: Dict[str, Any], run: CompressorState, rank: int) -> int:
    """:meth:`Compressor.config_hash`: a 31-bit hash of ``config`` and of ``run.note(rank)``."""
    return header_hash((sorted(config.items()), run.note(rank)))


class NonFiniteGradientError(ValueError, FloatingPointError):
    """A gradient (or, with ``nonfinite="raise"``, an exchanged gradient) holds NaN/Inf."""


class Compressor:
    """Base class: validation, per-tensor memory, rank binding and checkpoints.

    Subclasses bring a bucket codec (:meth:`bucket_codec`; a :class:`~hvd_compress.algorithms.sparse.Sparsifier`
    needs only its selection, ``_select``).

    Capabilities the exchanges dispatch on (never on the class):
    ``payload_kind`` (``"dense"``, ``"sparse"`` or ``"ternary"``), ``fused`` (it has a bucket
    codec, :meth:`bucket_codec`: the exchanges can run it), ``dense_wire_dtype`` (the
    dtype dense payloads travel in, ``None`` for the gradient's) and
    :meth:`fused_kind` (how a tensor of ``numel`` elements travels).

    Configuration (``seed``, a subclass's ``ratio`` and options: :meth:`config`) lives on the
    object; what a run accumulates (per-tensor memory, random streams, fused buckets, statistics,
    route data) lives in a :class:`~hvd_compress.algorithms.state.CompressorState`: the one a
    route hands its exchanges and passes as ``run`` to :meth:`state_dict` and the other calls
    that read state, else the compressor's own (:attr:`own_state`, also ``self.state``;
    ``self.memory`` its memory).
    """

    payload_kind = "dense"
    fused = False
    dense_wire_dtype: Optional[str] = None
    #: the keys of :meth:`config` a density schedule changes step by step (:class:`~hvd_compress.DensityWarmup`);
    #: a fused bucket whose configuration changes in these alone keeps its state where it is
    density_settings: Tuple[str, ...] = ()
    nonfinite = checked(
        "nonfinite", check_nonfinite,
        "What a NaN/Inf gradient does: 'propagate' (default: non-finite result on every rank, as a dense "
        "allreduce) or 'raise' (the routes that own the step raise NonFiniteGradientError on every rank).",
    )
    _nonfinite = "propagate"
    compile = checked(
        "compile", check_compile,
        "Whether the selection passes run compiled with torch.compile (kernels.torch_compiled): None (default: "
        "as HVD_COMPRESS_COMPILE says, the CPU only unless it is set), True (on every device) or False "
        "(eagerly, the same results). Read when a bucket's layout is first seen; a setting of this machine, not "
        "part of config() (the ranks need not agree on it).",
    )
    _compile = None

    def __init__(self, seed: int = 0, compile: Optional[bool] = None) -> None:
        self.seed = check_count(seed, f"{type(self).__name__} seed")
        self.compile = compile
        self.rank, self.size = 0, 1
        self.own_state = CompressorState()  # what a run accumulates, apart from the configuration

    @property
    def state(self) -> CompressorState:
        """The compressor's own run state, :attr:`own_state` (stock Horovod's, the Simulator's; a route
        with a state of its own passes that one explicitly)."""
        return self.own_state

    @state.setter
    def state(self, state: CompressorState) -> None:
        self.own_state = state

    def state_for(self, holder: Any, route: str, state: Optional[CompressorState] = None) -> CompressorState:
        """The state the new route ``holder`` runs this compressor on
        (:func:`~hvd_compress.algorithms.state.state_for_route`)."""
        return state_for_route(self, holder, route, state)

    def __getstate__(self) -> Dict[str, Any]:
        if pickled_by_horovod_broadcast():  # an elastic state's ordinary value: refused on every rank
            self._refused_broadcast = True  # this rank (the sender) raises at its next exchange
            return {"refused_broadcast": repr(self)}
        return {k: v for k, v in self.__dict__.items() if k not in ROUTE_REFERENCES}  # weak references

    def __setstate__(self, saved: Dict[str, Any]) -> None:
        if "refused_broadcast" in saved:  # the ranks that receive it
            raise refused_broadcast(saved["refused_broadcast"])
        saved = dict(saved)
        if "state" in saved:  # pickled when the state was an attribute, with its statistics and route beside it
            state = saved["own_state"] = saved.pop("state")
            state.stats = saved.pop("stats", state.stats)
            state.route = saved.pop("_route", None)
        self.__dict__.update(saved)

    @property
    def memory(self) -> TensorMemory:
        """Per-tensor arrays by name (``state.memory``): residuals, velocities, posteriors."""
        return self.state.memory

    @property
    def stats(self) -> WireStats:
        """What the compressor's steps sent (``state.stats``; read-only here: ``stats.reset()`` clears it)."""
        return self.state.stats

    # ------------------------------------------------------------------ setup
    def bind(self, rank: int, size: int) -> "Compressor":
        """Tell the compressor which rank of how many it runs on (random streams, wire format)."""
        if not 0 <= rank < size:
            raise ValueError(f"hvd_compress: rank {rank} is not in [0, {size})")
        self.rank, self.size = int(rank), int(size)
        return self

    def generator(self, ops: Any, like: Any) -> Any:
        """This rank's random stream for ``like``'s framework in the compressor's own state, seeded from
        ``(seed, rank)`` (:meth:`~hvd_compress.algorithms.state.CompressorState.generator`)."""
        return self.own_state.generator(ops, self.seed, self.rank, like)

    def config(self) -> Dict[str, Any]:
        """Type and parameters; ranks must agree on it."""
        return {"type": type(self).__name__, **({"nonfinite": "raise"} if self.nonfinite == "raise" else {})}

    def config_hash(self, run: Optional[CompressorState] = None, density: bool = True) -> int:
        """A 31-bit fingerprint of :meth:`config`: equal on ranks configured alike.

        A rank holding state that another rank saved (rank 0's checkpoint loaded on
        every rank) hashes differently, so the cross-rank check stops every rank.
        ``run``: the state the steps run on (default: the compressor's own). ``density=False``:
        without :attr:`density_settings` (equal before and after a warm-up's step).
        """
        config = self.config()
        if not density:
            config = {key: value for key, value in config.items() if key not in self.density_settings}
        return fingerprint(config, self.own_state if run is None else run, self.rank)

    def config_repr(self, config: Optional[Dict[str, Any]] = None) -> str:
        """``Type(key=value, ...)`` of :meth:`config` (or of ``config``): what ranks agree on, without this
        machine's settings (``compile``)."""
        params = ", ".join(f"{k}={v!r}" for k, v in (config or self.config()).items() if k != "type")
        return f"{type(self).__name__}({params})"

    def __repr__(self) -> str:
        return self.config_repr({**self.config(), **({} if self.compile is None else {"compile": self.compile})})

    # ------------------------------------------------------------- interface

    @property
    def dense_only(self) -> bool:
        """Every tensor travels as a dense payload (None, FP16): once the ranks' header agrees, a
        transport may sum the gradients with its own allreduce."""
        return self.payload_kind == "dense"

    # ------------------------------------------------------------- fused buckets
    def fused_kind(self, numel: int) -> str:
        """How a tensor of ``numel`` elements travels: ``"dense"``, or this compressor's payload kind."""
        return "dense"

    def bucket_codec(self, layout: Any) -> Any:
        """The codec of a fused bucket's compressed part, made once per ``layout`` (what the codec sees of the
        bucket: its kernel module ``layout.ops``, its tensors, the compressed part's size groups; no state);
        its steps are rounds of collectives (:mod:`hvd_compress.algorithms.rounds`). Compressors that send
        every tensor dense have none."""
        raise NotImplementedError(f"{type(self).__name__} sends every tensor dense")

    def warn_dense(self, name: str, numel: int) -> None:
        """Hook: ``name`` now travels dense though the algorithm would compress it."""

    def residual(self, name: str, run: Optional[CompressorState] = None) -> Optional[np.ndarray]:
        """Error-feedback residual of ``name`` in the tensor's shape (``None`` if it has none); ``run``: a
        route's state (default: the compressor's own)."""
        return (self.own_state if run is None else run).array(name, "residual")

    def reset(self, name: Optional[str] = None, run: Optional[CompressorState] = None) -> None:
        """Drop the state of one tensor, or of all (in ``run``, default the compressor's own)."""
        run = self.own_state if run is None else run
        run.drop_buckets(name)
        run.memory.reset(name)
        if name is None:
            run.origin = None

    def state_dict(self, run: Optional[CompressorState] = None) -> Dict[str, Any]:
        """Residuals, per-tensor state and the random stream, for checkpoints (of ``run``, a route's
        state; default: the compressor's own)."""
        run = check_one_state(self, "state_dict", run)
        run.flush_buckets()
        state = {"config": self.config(), "tensors": run.memory.state_dict(), "rank": self.rank,
                 "world": self.size, "route": run.route}
        if getattr(self, "shared", False) or getattr(self, "exact_every", 1) > 1:  # the leader's turn of a
            state["exchanges"] = run.exchanged()  # shared index set, the schedule of exact selections
        state["generators"] = {
            **run.saved_generators,
            **{module: kernels.module(module).generator_state(stream) for module, stream in run.generators.items()},
        }
        state["checksum"] = state_checksum(state)
        return state

    def load_state_dict(self, state: Dict[str, Any], run: Optional[CompressorState] = None) -> None:
        """Restore :meth:`state_dict` into ``run`` (a route's state; default: the compressor's own) after
        checking it completely (:func:`~hvd_compress.algorithms.checkpoint.check_state`).

        The state is this rank's: loading another rank's (rank 0's checkpoint on every
        rank) stops every rank at the first exchange with an error saying so. Resumed
        on another number of ranks, each rank keeps the residuals it saved (ranks that
        saved none start from zero; residuals of ranks no longer present are not applied),
        unless every rank's checkpoint is regrouped for the new world first
        (:func:`~hvd_compress.algorithms.regroup.regroup_states`: their sum kept).
        """
        run = check_one_state(self, "load_state_dict", run)
        check_state(state, self)
        run.buckets = {}
        run.memory.load_state_dict(plain_counts(state["tensors"]))
        run.loaded_elsewhere = bool(state["tensors"])
        run.generators = {}
        run.saved_generators = dict(state.get("generators", {}))
        run.loaded_route = writer(state)
        run.exchanges = check_count(state.get("exchanges", 0), "checkpoint's exchanges")
        holds_state = bool(state["tensors"]) or bool(state.get("generators"))
        run.origin = (int(state["rank"]), int(state["world"])) if "rank" in state and holds_state else None


class ExchangePolicy:
    """A ``compression=`` that is not a compressor: it holds one and picks, per bucket, how that compressor's
    exchange runs (:class:`~hvd_compress.engine.auto.Auto`). What routes, the Simulator, schedules, callbacks and
    checkpoints call on a ``compression=`` (a :class:`Compressor` has it all, the optional part where it has it):

    - ``config()``, ``repr``, ``config_hash()``, ``seed``, ``rank``, ``bind(rank, size)``, ``nonfinite`` (set too);
    - ``fused``, ``dense_only``, ``dense_wire_dtype``; ``state_for(holder, route, state)``, ``state``, ``memory``,
      ``stats``; ``residual(name, run)``, ``reset(name, run)``, ``state_dict(run)``, ``load_state_dict(state, run)``;
    - optional: ``ratio`` (schedules set it, and ``target_ratio``), ``dense_below``, ``error_feedback``,
      ``momentum``, ``velocity(name, run)``, ``remeasure(run)`` (schedules call it), ``make_exchange(comm, key,
      state)`` (:func:`~hvd_compress.engine.exchange.open_exchange`: the bucket's exchange)."""


def is_compression(value: Any) -> bool:
    """Whether a route runs ``value`` as ``compression=``: a :class:`Compressor` or an :class:`ExchangePolicy`."""
    return isinstance(value, (Compressor, ExchangePolicy))
