"""Asynchronous SGD with gradient clipping over MPI (parameter server on rank 0).

Samuel Erickson, Mikael Johansson, "Clipping Makes Distributed and Federated
Asynchronous SGD Robust to Stragglers", arXiv:2606.13287, 2026
(<https://arxiv.org/abs/2606.13287>; sub-Weibull gradient noise): workers
compute gradients on a possibly stale model ``x_{t - tau_t}`` and the server
applies them as they arrive,

    x_{t+1} = x_t - eta * clip_lambda(g_t),   clip_lambda(v) = min(1, lambda / ||v||) * v,

where ``tau_t`` is the number of updates applied between the worker's read of
``x`` and the application of its gradient. With constant ``eta`` the convergence
of unclipped ASGD degrades with the maximum delay; clipping removes that
dependence from the oracle complexity and tolerates heavy-tailed noise (the
paper shows convergence in expectation and with high probability).
``lambda=None`` turns clipping off (plain ASGD).

Run with ``mpirun -np N python script.py`` (N >= 2) and call :func:`async_sgd`
on every rank:

    result = async_sgd(grad_fn, x0, steps=1000, lr=0.05, clip=1.0, loss_fn=loss)
    if result is not None:          # rank 0 only
        print(result.x, result.losses[-1], result.delays)

Roles and protocol (buffer-based point-to-point mpi4py calls, nothing pickled
on the hot path):

- rank 0 (server) holds ``x`` (a flat float32/float64 numpy vector). It sends
  every worker a control header ``[MODEL, version]`` and a copy of ``x``
  (``Isend``), then polls (``Test`` with short sleeps) the gradient headers it
  pre-posted with ``Irecv``, one per worker. A header is ``[GRAD, worker,
  version, iteration, format, n_values, numel, scale bits, values dtype,
  indices dtype]``; the payload follows on its own tags: dense values, or
  sparse values + int32 (int64 beyond 2^31 entries) indices, or ternary codes
  packed 2 bits each, four per byte (the scale rides in the header). The
  server rebuilds the dense gradient from it (numpy: a scatter, or the codes
  times the scale), clips it, applies it, records ``tau = t_now - version``,
  and sends the new ``x`` back to that worker only.
- ranks 1..N-1 (workers) receive ``x``, compute ``g = grad_fn(x, rng)`` with
  ``rng = np.random.default_rng([seed, worker])``, optionally compress it
  (:func:`compressed`: one step of the bucket engine every route runs, on a world
  of one rank, so selection, error feedback and the residuals are the engine's,
  kept on the worker in its compressor's run state; the step's sum over that
  one rank is exactly the vector this worker sends), sleep
  ``delay_schedule(worker, iteration)`` seconds (injected delay; the sleep
  is cut short by a stop message) and ``Isend`` it.
- Order: by arrival (``deterministic=False``), or (``deterministic=True``) a
  fixed order that makes a run reproducible bit for bit: the order of a
  *virtual clock* in which worker ``w``'s ``i``-th gradient is ready
  ``delay_schedule(w, i)`` after the server sent it ``x`` (ties: first sent,
  first served). Without a schedule every delay is 0 and this is plain
  round-robin over workers 1..N-1. The server waits for the worker whose turn
  it is; the others keep computing on their stale copies.
- Stop after ``steps`` updates: the server sends ``STOP`` to every worker and
  drains each worker's messages until its ``BYE`` (a gradient in flight is
  received and discarded), so every request is matched and completed before
  the function returns; MPI then finalizes normally at exit.
- A worker that dies or hangs: no gradient from it within ``timeout`` seconds
  after it was sent ``x``. MPI cannot recover from a lost rank, so the server
  prints a :class:`WorkerTimeoutError` naming the rank and calls
  ``comm.Abort(1)``: every rank ends (``abort_on_error=False`` raises
  instead; the other ranks are then the caller's problem). Any other error on
  any rank (a NaN gradient, an exception in ``grad_fn``) aborts the same way.
  Errors are printed with every line prefixed ``[rank R]``. Errors raised
  before the run starts (ranks that disagree on the configuration: every rank
  raises alike) and anywhere else in the script are handled by the hook of
  :func:`hvd_compress.transport.mpi.install_abort_on_error`, which ``async_sgd``
  installs: uncaught, they abort the job too.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from hvd_compress.transport.mpi import install_abort_on_error, report_error
from hvd_compress.algorithms import old_keyword

__all__ = ["async_sgd", "clip_lambda", "compressed", "received", "AsyncSGDResult", "WorkerTimeoutError",
           "worker_rng"]

# message tags
TAG_CTRL = 301  # server -> worker: [kind, version]
TAG_X = 302  # server -> worker: the model
TAG_HDR = 303  # worker -> server: gradient header / BYE
TAG_VALUES = 304  # worker -> server: dense or sparse values, ternary codes
TAG_INDICES = 305  # worker -> server: sparse indices

# control kinds
MODEL, STOP, GRAD, BYE = 1, 2, 3, 4
# payload formats
DENSE, SPARSE, TERNARY = 0, 1, 2
HDR_LEN = 10
POLL_S = 2e-4


class WorkerTimeoutError(RuntimeError):
    """A worker sent nothing within ``timeout`` seconds (it died or hangs)."""

    def __init__(self, rank: int, timeout: float, version: int) -> None:
        self.rank = rank
        super().__init__(
            f"hvd_compress.async_sgd: worker rank {rank} sent no gradient within {timeout:g} s "
            f"(server at update {version}); the rank died or hangs. MPI cannot continue "
            "without it: aborting the job."
        )


@dataclass
class AsyncSGDResult:
    """What the server (rank 0) returns.

    ``x``: final model. ``losses``: ``loss_fn(x)`` at start and every
    ``loss_every`` updates (and after the last), empty without ``loss_fn``;
    ``loss_steps`` the update counts they were taken at. ``delays[t]``: tau of
    update ``t``; ``workers[t]``: the worker whose gradient it was. ``counts``:
    updates per worker. ``elapsed``: wall seconds of the update loop.
    """

    x: np.ndarray
    losses: List[float] = field(default_factory=list)
    loss_steps: List[int] = field(default_factory=list)
    delays: List[int] = field(default_factory=list)
    workers: List[int] = field(default_factory=list)
    counts: Dict[int, int] = field(default_factory=dict)
    clipped: int = 0
    elapsed: float = 0.0

    def delay_stats(self) -> Dict[str, float]:
        """Mean, max and percentiles (50/90/99) of the recorded delays."""
        d = np.asarray(self.delays, dtype=np.float64)
        if d.size == 0:
            return {"mean": 0.0, "max": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        p50, p90, p99 = np.percentile(d, [50, 90, 99])
        return {
            "mean": float(d.mean()),
            "max": float(d.max()),
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
        }


# ------------------------------------------------------------------- the update rule
def _check_clip(lam: Any) -> Optional[float]:
    if lam is None:
        return None
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not (0 < float(lam) < math.inf):
        raise ValueError(f"hvd_compress: clip lambda must be a positive finite number or None, got {lam!r}")
    return float(lam)


def clip_lambda(v: Any, lam: Optional[float]) -> np.ndarray:
    """``min(1, lam / ||v||) * v`` (Euclidean norm); ``lam=None`` returns ``v`` unchanged.

    Vectors with ``||v|| <= lam`` (the zero vector included) are returned as is;
    longer ones are scaled to norm ``lam`` (up to rounding), keeping the dtype.
    """
    lam = _check_clip(lam)
    v = np.asarray(v)
    if lam is None:
        return v
    norm = float(np.linalg.norm(v.reshape(-1).astype(np.float64, copy=False)))
    if not norm > lam:  # also the zero vector
        return v
    return v * (lam / norm)


def worker_rng(seed: int, worker: int) -> np.random.Generator:
    """The random stream ``grad_fn`` gets on ``worker`` (for replays)."""
    return np.random.default_rng([int(seed), int(worker)])


# ------------------------------------------------------------------- helpers
def _wait(
    request: Any, deadline: Optional[float] = None, on_timeout: Optional[Callable[[], None]] = None
) -> None:
    """Complete ``request`` by polling (``Test`` + short sleeps: no busy spin on oversubscribed cores)."""
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            on_timeout()
        time.sleep(POLL_S)


def _abort(comm: Any, error: BaseException) -> None:
    report_error(comm.Get_rank(), error, "hvd_compress.async_sgd failed: aborting the MPI job")
    comm.Abort(1)


def compressed(compressor: Any, g: np.ndarray) -> Tuple[int, np.ndarray, Optional[np.ndarray], float]:
    """``(format, values, indices, scale)``: what a worker ships for its gradient ``g`` (flat numpy).

    One step of the bucket engine on a world of one rank
    (:func:`~hvd_compress.engine.exchange.open_exchange` over a
    :class:`~hvd_compress.transport.communicator.SingleProcessCommunicator`; its run state is the
    compressor's own) gives the vector ``v`` this worker sends (``finish(average=False)``: the sum over
    one rank); then, by how the compressor sends a tensor of this size
    (``compressor.fused_kind``): ``SPARSE`` its nonzero entries and their indices, ``TERNARY``
    ``t = sign(v)`` packed 2 bits per code with the scale ``S = max|v|`` (``v = S t``), ``DENSE`` all
    of ``v`` in the compressor's wire dtype (FP16: float16). A non-finite ``v`` goes ``DENSE``, for
    the server to reject.
    """
    from hvd_compress.engine.exchange import open_exchange
    from hvd_compress.kernels import reference
    from hvd_compress.transport.communicator import SingleProcessCommunicator

    exchange = open_exchange(compressor, SingleProcessCommunicator(), "async_sgd")
    exchange.add("x", g)
    exchange.launch()
    sent = np.ascontiguousarray(exchange.finish(average=False)["x"])
    kind = compressor.fused_kind(sent.size)
    if not np.isfinite(sent).all():
        return DENSE, sent, None, 0.0
    if kind == "sparse":
        indices = np.flatnonzero(sent).astype(np.int32 if sent.size < 2**31 else np.int64)
        return SPARSE, sent[indices], indices, 0.0
    if kind == "ternary":
        scale = float(np.max(np.abs(sent)))
        return TERNARY, reference.pack_two_bit(np.sign(sent).astype(np.int8)), None, scale
    wire_dtype = getattr(compressor, "dense_wire_dtype", None)
    return DENSE, sent if wire_dtype is None else sent.astype(wire_dtype), None, 0.0


def received(fmt: int, values: np.ndarray, indices: Optional[np.ndarray], scale: float, numel: int,
             dtype: Any) -> np.ndarray:
    """The dense gradient (``dtype``, ``numel`` entries) a worker shipped as :func:`compressed`'s output."""
    from hvd_compress.kernels import reference

    if fmt == DENSE:
        return values.astype(dtype, copy=False)
    if fmt == SPARSE:
        g = np.zeros(numel, dtype=dtype)
        g[indices] = values
        return g
    if fmt == TERNARY:
        return reference.unpack_two_bit(values, numel).astype(dtype) * np.dtype(dtype).type(scale)
    raise ValueError(f"hvd_compress: unknown gradient format {fmt}")


def _dtype_code(dtype: Any) -> int:
    return ord(np.dtype(dtype).char)


def _compressor_for(compressor: Any, worker: int) -> Any:
    if compressor is None:
        return None
    from hvd_compress.algorithms.base import Compressor

    if isinstance(compressor, Compressor):
        return compressor
    if callable(compressor):
        made = compressor(worker)
        if not isinstance(made, Compressor):
            raise TypeError(f"hvd_compress: compressor factory returned {made!r}, not a Compressor")
        return made
    raise TypeError(
        f"hvd_compress: compressor must be a Compressor or a factory worker -> Compressor, got {compressor!r}"
    )


# ------------------------------------------------------------------- entry point
def async_sgd(
    grad_fn: Callable[[np.ndarray, np.random.Generator], Any],
    x0: Optional[np.ndarray],
    steps: int,
    lr: float,
    clip: Optional[float] = None,
    *,
    comm: Any = None,
    loss_fn: Optional[Callable[[np.ndarray], float]] = None,
    loss_every: int = 1,
    compression: Union[None, Any, Callable[[int], Any]] = None,
    delay_schedule: Optional[Callable[[int, int], float]] = None,
    deterministic: bool = False,
    timeout: float = 60.0,
    seed: int = 0,
    abort_on_error: bool = True,
    compressor: Any = None,
) -> Optional[AsyncSGDResult]:
    """Asynchronous SGD with optional clipping; call on every rank. Returns the result on rank 0, ``None`` elsewhere.

    ``x0``: the initial model, a flat float32/float64 vector (rank 0's is used;
    workers may pass ``None``). ``steps``: server updates. ``lr``: eta.
    ``clip``: lambda (``None``: no clipping). ``grad_fn(x, rng) -> g`` runs on
    the workers (``rng``: :func:`worker_rng`). ``loss_fn(x)`` runs on the
    server every ``loss_every`` updates. ``compression``: a compressor (every
    worker uses its own copy: same seed) or a factory ``worker -> Compressor``
    (``worker`` 0 is the server's, which only checks that every rank has the same configuration;
    workers compress with :func:`compressed`, the server rebuilds with :func:`received`). ``delay_schedule(worker,
    iteration) -> seconds``: injected sleep before a worker sends its
    ``iteration``-th gradient (0-based). ``deterministic``: virtual-clock order
    (round-robin without a schedule) instead of arrival order. ``timeout``:
    seconds without a gradient from a worker before it is declared dead (must
    exceed its compute time plus injected delay). ``compressor``: the old name of
    ``compression`` (deprecated).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else getattr(comm, "comm", comm)
    install_abort_on_error()
    rank, size = comm.Get_rank(), comm.Get_size()
    clip = _check_arguments(size, steps, lr, clip, timeout)
    x0, mine = _rank_configuration(comm, x0, deterministic, steps, abort_on_error)
    compressor = old_keyword(compression, compressor, "async_sgd")
    local = _compressor_for(compressor, rank)
    mine[2] = 0 if local is None else local.config_hash()
    numel, dtype = _agreed_model(comm, mine)

    try:
        if rank == 0:
            server = _Server(
                comm, x0, steps, float(lr), clip, loss_fn, loss_every, local, delay_schedule, deterministic,
                float(timeout),
            )
            return server.run()
        _worker(comm, rank, numel, dtype, grad_fn, local, delay_schedule, seed)
        return None
    except BaseException as error:
        if abort_on_error and not isinstance(error, KeyboardInterrupt):
            _abort(comm, error)
        raise


def _check_arguments(size: int, steps: Any, lr: Any, clip: Any, timeout: Any) -> Optional[float]:
    """Raise on a bad world ``size`` or argument (the same on every rank, so every rank raises alike); returns
    ``clip`` as a float (or None)."""
    if size < 2:
        raise ValueError(
            "hvd_compress: async_sgd needs at least 2 ranks (a server and a worker); run under mpirun -np N"
        )
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"hvd_compress: steps must be a positive integer, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (0 < float(lr) < math.inf):
        raise ValueError(f"hvd_compress: lr must be a positive finite number, got {lr!r}")
    clip = _check_clip(clip)
    if not (timeout > 0):
        raise ValueError(f"hvd_compress: timeout must be positive, got {timeout!r}")
    return clip


def _rank_configuration(
    comm: Any, x0: Any, deterministic: bool, steps: int, abort_on_error: bool
) -> Tuple[Any, np.ndarray]:
    """``(x0, mine)``: ``x0`` as a numpy array (checked: a non-empty flat float32/float64 vector, else a
    TypeError, after aborting the job when ``abort_on_error``) and this rank's configuration
    ``[numel, dtype code, compressor hash, deterministic, steps]`` (numel and dtype -1 without ``x0``; the
    hash 0, for the caller to fill in)."""
    mine = np.array([-1, -1, 0, int(bool(deterministic)), int(steps)], dtype=np.int64)
    if x0 is not None:
        x0 = np.asarray(x0)
        if x0.dtype not in (np.float32, np.float64) or x0.ndim != 1 or x0.size == 0:
            error = TypeError(
                f"hvd_compress: async_sgd needs x0 as a non-empty flat float32/float64 vector, "
                f"got shape {x0.shape} dtype {x0.dtype}"
            )
            if abort_on_error:
                _abort(comm, error)
            raise error
        mine[0], mine[1] = x0.size, _dtype_code(x0.dtype)
    return x0, mine


def _agreed_model(comm: Any, mine: np.ndarray) -> Tuple[int, np.dtype]:
    """``(numel, dtype)`` of rank 0's ``x0``, after one cheap collective (``Allgather`` of every rank's
    :func:`_rank_configuration`) that checks rank 0 has ``x0`` and every rank agrees with it."""
    size = comm.Get_size()
    everyone = np.empty((size, mine.size), dtype=np.int64)
    comm.Allgather(mine, everyone)
    if everyone[0, 0] < 0:
        raise ValueError("hvd_compress: async_sgd needs x0 on rank 0 (the server)")
    disagree = [
        r
        for r in range(size)
        if (everyone[r, 2:] != everyone[0, 2:]).any()
        or (everyone[r, 0] >= 0 and (everyone[r, :2] != everyone[0, :2]).any())
    ]
    if disagree:
        raise ValueError(
            f"hvd_compress: async_sgd ranks {disagree} disagree with rank 0 on x0's size/dtype, the "
            f"compressor, deterministic or steps ([numel, dtype, compressor hash, deterministic, steps] "
            f"per rank = {everyone.tolist()})"
        )
    return int(everyone[0, 0]), np.dtype(chr(int(everyone[0, 1])))


# ------------------------------------------------------------------- worker
def _worker(comm, rank, numel, dtype, grad_fn, compressor, delay_schedule, seed) -> None:
    rng = worker_rng(seed, rank)
    ctrl = np.zeros(2, dtype=np.int64)
    ctrl_req = comm.Irecv(ctrl, source=0, tag=TAG_CTRL)
    iteration = 0
    while True:
        _wait(ctrl_req)
        if ctrl[0] == STOP:
            break
        if ctrl[0] != MODEL:
            raise RuntimeError(f"hvd_compress: worker {rank} got control message {ctrl.tolist()}")
        version = int(ctrl[1])
        x = np.empty(numel, dtype=dtype)
        _wait(comm.Irecv(x, source=0, tag=TAG_X))
        ctrl_req = comm.Irecv(ctrl, source=0, tag=TAG_CTRL)  # the next model or STOP

        g = np.asarray(grad_fn(x, rng))
        if g.size != numel:
            raise ValueError(
                f"hvd_compress: grad_fn returned {g.size} elements on worker {rank}, x has {numel}"
            )
        g = np.ascontiguousarray(g.reshape(-1), dtype=dtype)
        if compressor is None:
            fmt, values, indices, scale = DENSE, g, None, 0.0
        else:
            fmt, values, indices, scale = compressed(compressor, g)

        if delay_schedule is not None:  # injected delay, cut short by STOP
            until = time.monotonic() + float(delay_schedule(rank, iteration))
            while time.monotonic() < until and not ctrl_req.Test():
                time.sleep(min(POLL_S * 5, max(0.0, until - time.monotonic())))
            if ctrl_req.Test():
                if ctrl[0] == STOP:
                    break
                raise RuntimeError(
                    f"hvd_compress: worker {rank} got {ctrl.tolist()} before sending its gradient"
                )

        _send_gradient(comm, rank, version, iteration, numel, fmt, values, indices, scale)
        iteration += 1
    bye = np.zeros(HDR_LEN, dtype=np.int64)
    bye[0], bye[1], bye[3] = BYE, rank, iteration
    _wait(comm.Isend(bye, dest=0, tag=TAG_HDR))


def _send_gradient(comm, rank, version, iteration, numel, fmt, values, indices, scale) -> None:
    """Send rank 0 one gradient: its ``GRAD`` header (layout in the module docstring), then the payload's
    ``values`` (and ``indices``) on their own tags; returns once every send completed."""
    header = np.array(
        [
            GRAD,
            rank,
            version,
            iteration,
            fmt,
            values.size,
            numel,
            np.float64(scale).view(np.int64),
            _dtype_code(values.dtype),
            0 if indices is None else _dtype_code(indices.dtype),
        ],
        dtype=np.int64,
    )
    sends = [comm.Isend(header, dest=0, tag=TAG_HDR), comm.Isend(values, dest=0, tag=TAG_VALUES)]
    if indices is not None:
        sends.append(comm.Isend(indices, dest=0, tag=TAG_INDICES))
    for request in sends:
        _wait(request)


# ------------------------------------------------------------------- server
class _Server:
    def __init__(
        self,
        comm,
        x0,
        steps,
        lr,
        clip,
        loss_fn,
        loss_every,
        compressor,
        delay_schedule,
        deterministic,
        timeout,
    ) -> None:
        self.comm, self.steps, self.lr, self.clip = comm, steps, lr, clip
        self.loss_fn, self.loss_every = loss_fn, max(1, int(loss_every))
        self.compressor, self.schedule = compressor, delay_schedule
        self.deterministic, self.timeout = deterministic, timeout
        self.x = np.array(x0, copy=True)
        self.workers = list(range(1, comm.Get_size()))
        self.version = 0
        self.headers = {w: np.zeros(HDR_LEN, dtype=np.int64) for w in self.workers}
        self.header_reqs: Dict[int, Any] = {}
        self.arrived: Dict[int, Optional[int]] = {w: None for w in self.workers}  # arrival sequence
        self.arrivals = 0
        self.sent_at: Dict[int, float] = {}
        self.sends: Dict[int, List[Any]] = {w: [] for w in self.workers}
        self._keep: Dict[int, tuple] = {}  # buffers of the sends in flight, alive until completed
        # virtual clock (deterministic order)
        self.vfinish: Dict[int, float] = {}
        self.vseq: Dict[int, int] = {}
        self.vcount = 0
        self.iteration = {w: 0 for w in self.workers}

    # -- messages
    def _post_header(self, w: int) -> None:
        self.header_reqs[w] = self.comm.Irecv(self.headers[w], source=w, tag=TAG_HDR)
        self.arrived[w] = None

    def _send_ctrl(self, w: int, kind: int) -> None:
        for request in self.sends[w]:  # the previous message to w was received before w answered
            _wait(request)
        ctrl = np.array([kind, self.version], dtype=np.int64)
        self.sends[w] = [self.comm.Isend(ctrl, dest=w, tag=TAG_CTRL)]
        if kind == MODEL:
            snapshot = self.x.copy()
            self.sends[w].append(self.comm.Isend(snapshot, dest=w, tag=TAG_X))
            self._keep[w] = (ctrl, snapshot)
            self.sent_at[w] = time.monotonic()
            delay = 0.0 if self.schedule is None else float(self.schedule(w, self.iteration[w]))
            self.vfinish[w] = self.vnow + delay
            self.vseq[w] = self.vcount
            self.vcount += 1
        else:
            self._keep[w] = (ctrl,)

    def _timed_out(self, w: int) -> None:
        raise WorkerTimeoutError(w, self.timeout, self.version)

    def _poll(self) -> bool:
        """Test every header not yet arrived; check deadlines. True if something arrived."""
        got = False
        now = time.monotonic()
        for w in self.workers:
            if self.arrived[w] is None and w in self.header_reqs:
                if self.header_reqs[w].Test():
                    self.arrived[w] = self.arrivals
                    self.arrivals += 1
                    got = True
                elif now - self.sent_at[w] > self.timeout:
                    self._timed_out(w)
        return got

    def _next(self) -> int:
        """The worker whose gradient is applied next (waits for it)."""
        if self.deterministic:
            w = min(self.workers, key=lambda v: (self.vfinish[v], self.vseq[v]))
            while self.arrived[w] is None:
                if not self._poll():
                    time.sleep(POLL_S)
            return w
        while True:
            ready = [v for v in self.workers if self.arrived[v] is not None]
            if ready:
                return min(ready, key=lambda v: self.arrived[v])
            if not self._poll():
                time.sleep(POLL_S)

    def _receive_payload(self, w: int, header: np.ndarray):
        fmt, n_values, numel = int(header[4]), int(header[5]), int(header[6])
        values = np.empty(n_values, dtype=np.dtype(chr(int(header[8]))))
        deadline = time.monotonic() + self.timeout
        _wait(self.comm.Irecv(values, source=w, tag=TAG_VALUES), deadline, lambda: self._timed_out(w))
        indices = None
        if fmt == SPARSE:
            indices = np.empty(n_values, dtype=np.dtype(chr(int(header[9]))))
            _wait(self.comm.Irecv(indices, source=w, tag=TAG_INDICES), deadline, lambda: self._timed_out(w))
        return fmt, values, indices, numel

    def _rebuilt(self, w: int, header: np.ndarray, fmt, values, indices, numel) -> np.ndarray:
        if numel != self.x.size:
            raise ValueError(
                f"hvd_compress: worker {w} sent a gradient of {numel} elements, x has {self.x.size}"
            )
        if self.compressor is None:
            if fmt != DENSE:
                raise ValueError(
                    f"hvd_compress: worker {w} sent a compressed gradient, the server has no compressor"
                )
            return values
        scale = float(np.int64(header[7]).view(np.float64))
        return received(fmt, values, indices, scale, numel, self.x.dtype)

    # -- the loop
    def run(self) -> AsyncSGDResult:
        result = AsyncSGDResult(x=self.x, counts={w: 0 for w in self.workers})
        if self.loss_fn is not None:
            result.losses.append(float(self.loss_fn(self.x)))
            result.loss_steps.append(0)
        start = time.monotonic()
        self.vnow = 0.0
        for w in self.workers:
            self._post_header(w)
            self._send_ctrl(w, MODEL)
        while self.version < self.steps:
            w = self._next()
            header = self.headers[w].copy()
            if header[0] != GRAD or header[1] != w:
                raise RuntimeError(f"hvd_compress: unexpected message from worker {w}: {header.tolist()}")
            payload = self._receive_payload(w, header)
            self._post_header(w)
            g = self._rebuilt(w, header, *payload)
            if not np.isfinite(g).all():
                raise FloatingPointError(
                    f"hvd_compress: the gradient of worker {w} (its iteration {int(header[3])}, computed on "
                    f"version {int(header[2])}) has {int((~np.isfinite(g)).sum())} NaN/Inf of {g.size} entries"
                )
            tau = self.version - int(header[2])
            step = clip_lambda(g, self.clip)
            result.clipped += int(step is not g)
            self.x = self.x - self.lr * step
            self.version += 1
            if self.deterministic:
                self.vnow = self.vfinish[w]
            self.iteration[w] += 1
            result.delays.append(tau)
            result.workers.append(w)
            result.counts[w] += 1
            if self.loss_fn is not None and (
                self.version % self.loss_every == 0 or self.version == self.steps
            ):
                result.losses.append(float(self.loss_fn(self.x)))
                result.loss_steps.append(self.version)
            if self.version < self.steps:
                self._send_ctrl(w, MODEL)
        result.elapsed = time.monotonic() - start
        result.x = self.x
        self._shutdown()
        return result

    def _shutdown(self) -> None:
        for w in self.workers:
            self._send_ctrl(w, STOP)
        for w in self.workers:  # drain until BYE: a gradient in flight is received and dropped
            deadline = time.monotonic() + self.timeout
            while True:
                _wait(self.header_reqs[w], deadline, lambda: self._timed_out(w))
                header = self.headers[w]
                if header[0] == BYE:
                    break
                if header[0] != GRAD:
                    raise RuntimeError(f"hvd_compress: unexpected message from worker {w}: {header.tolist()}")
                self._receive_payload(w, header.copy())
                self._post_header(w)
            del self.header_reqs[w]
        for w in self.workers:
            for request in self.sends[w]:
                _wait(request)
        self._keep = {}
