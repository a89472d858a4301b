"""mpi4py transport: :class:`MPICommunicator`, no Horovod needed (``mpirun -np N python train.py``).

Buffer-based mpi4py calls only (no pickling on the hot path):

- ``allreduce_async``: ``Iallreduce`` into a new buffer of the input's shape
  and dtype. ``SUM`` and ``MAX``. Signed integers are summed as the unsigned
  type of the same width (``MPI_UINT32_T`` for int32): C defines unsigned
  overflow as arithmetic modulo 2^n, which is bit for bit two's-complement
  wrap-around, so int32 sums wrap exactly (TernGrad's packed lanes rely on it).
  ``MPI_SUM`` on ``MPI_INT32_T`` wraps the same way in practice (Open MPI and
  MPICH add with a plain C ``+``), but the standard leaves signed overflow
  undefined, so we do not depend on it. 16-bit floats (float16, bfloat16)
  are reduced in float32 and cast back, as the compressors sum them, and move
  as raw 16-bit words otherwise: MPI has no bfloat16, and float16's
  ``MPI_SHORT_FLOAT`` is an Open MPI 5 extension.
- ``allgather_async``: a blocking ``Allgather`` of every rank's
  ``[rows, elements per row, dtype]`` (which also checks that trailing shapes
  and dtypes agree, raising the same error on every rank), then
  ``Iallgatherv`` with the exact counts and displacements: no padding, and a
  rank may contribute zero rows.
- ``wait``: ``Wait`` on the request; returns a tensor of the input's kind
  (numpy array or torch tensor, same dtype and device).

Tensors: numpy arrays, and torch tensors through their numpy views (zero copy;
non-contiguous tensors are copied once). CUDA tensors are passed to MPI
directly when the library is CUDA-aware (:func:`cuda_aware`: mpi4py's
``MPI.Query_cuda_support()`` where it exists, else Open MPI's
``MPIX_Query_cuda_support()`` or MPICH's ``MPIX_GPU_query_support``; set
``HVD_COMPRESS_MPI_CUDA_AWARE=1`` or ``0`` to override). Otherwise they are
staged through host memory (a device-to-host copy before, host-to-device after
each collective) and a warning says so once.

Names are ignored. MPI matches collectives by call order on the communicator,
not by name: every rank must issue the same collectives in the same order.
:class:`~hvd_compress.engine.exchange.BucketExchange` does (per bucket, in
bucket order: header allgather, dense allreduce, indices allgather, values
allgather, scales allreduce/allgather, then the ternary code collectives in
``finish``), and the drop-in optimizer launches buckets in the same order on
every rank. Ranks that disagree about the layout are caught by the header
check, which :class:`~hvd_compress.engine.exchange.BucketExchange` waits for
before issuing anything else when ``matches_by_order`` is set, so ranks that
would issue different collectives (one rank has a dense part the others lack)
stop with an error instead of mismatching.

Progress: Open MPI has no progress thread by default, so a nonblocking
collective mostly advances inside ``wait`` (small ones complete eagerly);
launching early still lets all buckets' collectives proceed together.
Thread level: mpi4py initializes ``MPI_THREAD_MULTIPLE`` by default; the
optimizer's hooks may run in autograd's device threads, which needs at least
``MPI_THREAD_SERIALIZED`` (never two MPI calls at once: we do not make any).

Errors: an exception on one rank would leave it waiting in ``MPI_Finalize``
and the others in a collective, forever. The first :class:`MPICommunicator`
of a job of 2 or more ranks therefore installs :func:`install_abort_on_error`:
a ``sys.excepthook`` (chained to the previous one) that prints the uncaught
exception's traceback to stderr, every line prefixed ``[rank R]``, waits
:data:`ABORT_GRACE_S` (so ranks that fail alike, as on a configuration mismatch
the header check catches, print theirs too) and calls
``MPI.COMM_WORLD.Abort(1)``: every rank ends, as with Horovod or ``python -m
mpi4py``. Exceptions the script catches are not affected; nor are other
threads' (the MPI layer runs its collectives on the calling thread).
``HVD_COMPRESS_MPI_ABORT_ON_ERROR=0`` turns the hook off.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
import zlib
from types import TracebackType
from typing import Any, Dict, Optional, Sequence, Type

import numpy as np

from hvd_compress.transport.communicator import Communicator

_CUDA_AWARE: Optional[bool] = None
_WARNED_STAGING = False


# ----------------------------------------------------------------- CUDA-awareness
def _libmpi():
    """ctypes handle of the MPI library mpi4py loaded (found in this process's maps)."""
    import ctypes

    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                base = os.path.basename(path)
                if base.startswith(("libmpi.so", "libmpi_", "libmpich")) and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return ctypes.CDLL(None)


def cuda_aware() -> bool:
    """Whether the MPI library accepts CUDA device pointers (detected once per process)."""
    global _CUDA_AWARE
    if _CUDA_AWARE is not None:
        return _CUDA_AWARE
    override = os.environ.get("HVD_COMPRESS_MPI_CUDA_AWARE")
    if override in ("0", "1"):
        _CUDA_AWARE = override == "1"
        return _CUDA_AWARE
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)  # MPI-5 / newer mpi4py
    if query is not None:
        _CUDA_AWARE = bool(query())
        return _CUDA_AWARE
    _CUDA_AWARE = False
    try:
        import ctypes

        lib = _libmpi()
        ompi = getattr(lib, "MPIX_Query_cuda_support", None)
        if ompi is not None:  # Open MPI extension: 1 when built with and running on CUDA
            ompi.restype = ctypes.c_int
            _CUDA_AWARE = bool(ompi())
        else:
            mpich = getattr(lib, "MPIX_GPU_query_support", None)
            if mpich is not None:  # MPICH >= 4: MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA=0, &flag)
                flag = ctypes.c_int(0)
                if mpich(ctypes.c_int(0), ctypes.byref(flag)) == 0:
                    _CUDA_AWARE = bool(flag.value)
    except Exception:  # pragma: no cover - exotic builds: be safe, stage through host
        _CUDA_AWARE = False
    return _CUDA_AWARE


def _warn_staging() -> None:
    global _WARNED_STAGING
    if not _WARNED_STAGING:
        _WARNED_STAGING = True
        warnings.warn(
            "hvd_compress: the MPI library is not CUDA-aware (MPIX_Query_cuda_support() is 0 or "
            "missing); CUDA tensors are staged through host memory (a device-to-host copy before "
            "and a host-to-device copy after every collective). Use a CUDA-aware MPI build, or "
            "set HVD_COMPRESS_MPI_CUDA_AWARE=1 if detection is wrong.",
            RuntimeWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------- errors end the job
#: Seconds a failing rank waits between printing its error and aborting the job.
ABORT_GRACE_S = 1.0
_ABORT_HOOK_INSTALLED = False


def report_error(rank: int, error: BaseException, headline: str) -> None:
    """Write ``headline`` and ``error``'s traceback to stderr, each line prefixed ``[rank R]``."""
    trace = traceback.format_exception(type(error), error, error.__traceback__)
    lines = [headline] + "".join(trace).splitlines()
    sys.stdout.flush()
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in lines))
    sys.stderr.flush()


def install_abort_on_error() -> bool:
    """Make an uncaught exception on any rank end the whole MPI job; ``True`` if the hook is on.

    Installs (once per process) a ``sys.excepthook`` that runs the previous hook
    (unless it is Python's default, which would print the traceback again),
    prints the traceback with :func:`report_error`, sleeps :data:`ABORT_GRACE_S`
    and calls ``MPI.COMM_WORLD.Abort(1)``. Nothing is installed for a single
    process, or when ``HVD_COMPRESS_MPI_ABORT_ON_ERROR`` is ``0``.
    """
    global _ABORT_HOOK_INSTALLED
    if _ABORT_HOOK_INSTALLED:
        return True
    if os.environ.get("HVD_COMPRESS_MPI_ABORT_ON_ERROR", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        return False
    previous = sys.excepthook

    def abort_on_error(kind: Type[BaseException], error: BaseException, tb: Optional[TracebackType]) -> None:
        try:
            if previous is not sys.__excepthook__:
                previous(kind, error, tb)
            rank, size = world.Get_rank(), world.Get_size()
            report_error(
                rank,
                error.with_traceback(tb),
                f"hvd_compress: uncaught {kind.__name__} on rank {rank} of {size}: aborting the MPI job "
                "(MPI_COMM_WORLD.Abort(1); HVD_COMPRESS_MPI_ABORT_ON_ERROR=0 turns this off)",
            )
        finally:
            if MPI.Is_initialized() and not MPI.Is_finalized():
                time.sleep(ABORT_GRACE_S)  # ranks that raised the same error print it too
                world.Abort(1)

    sys.excepthook = abort_on_error
    _ABORT_HOOK_INSTALLED = True
    return True


# ----------------------------------------------------------------- datatypes
_MPI_TYPES: Dict[str, Any] = {}
_UNSIGNED = {"i1": "u1", "i2": "u2", "i4": "u4", "i8": "u8"}


def _mpi_type(dtype: np.dtype, op: str = "") -> Any:
    """The predefined MPI datatype of ``dtype``; signed integers as unsigned for SUM (defined wrap)."""
    from mpi4py import MPI

    dtype = np.dtype(dtype)
    code = dtype.str.lstrip("<>|=")
    if op == Communicator.SUM and code in _UNSIGNED:
        code = _UNSIGNED[code]
    if code not in _MPI_TYPES:
        try:
            datatype = MPI.Datatype.fromcode(np.dtype(code).char)
        except (ValueError, KeyError, TypeError) as error:
            raise TypeError(f"hvd_compress: no MPI datatype for {dtype} ({error})") from error
        try:
            usable = datatype != MPI.DATATYPE_NULL and datatype.Get_size() == np.dtype(code).itemsize
        except MPI.Exception as error:  # a name mpi4py knows but this MPI library lacks
            raise TypeError(
                f"hvd_compress: this MPI library has no datatype for {dtype} ({error})"
            ) from error
        if not usable:
            raise TypeError(f"hvd_compress: no MPI datatype of the size of {dtype}")
        _MPI_TYPES[code] = datatype
    return _MPI_TYPES[code]


class _Wire:
    """One tensor prepared for MPI: the buffer MPI reads, and how to make the result look like the input."""

    def __init__(self, tensor: Any, for_sum: bool = False) -> None:
        self.torch = None
        self.device = None
        self.staged = False
        self.dtype = getattr(tensor, "dtype", None)
        self.upcast = False
        if isinstance(tensor, np.ndarray) or np.isscalar(tensor):
            array = np.asarray(tensor)
            self.dtype = array.dtype
            if array.dtype == np.float16:
                array, self.upcast = (
                    (array.astype(np.float32), True) if for_sum else (array.view(np.int16), False)
                )
            self.buffer = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        elif type(tensor).__module__.split(".")[0] == "torch":
            import torch

            self.torch = torch
            t = tensor.detach()
            if t.dtype in (torch.bfloat16, torch.float16):  # reduce in float32, gather the raw bits
                if for_sum:
                    t, self.upcast = t.float(), True
                else:
                    t = t.view(torch.int16)
            self.device = t.device
            if t.is_cuda:
                if cuda_aware():
                    torch.cuda.current_stream(t.device).synchronize()  # MPI does not see CUDA streams
                    self.buffer = t.contiguous()
                    return
                _warn_staging()
                self.staged = True
                t = t.cpu()
            elif t.device.type != "cpu":
                raise TypeError(f"hvd_compress: MPICommunicator cannot move {t.device} tensors")
            self.buffer = t.contiguous().resolve_conj().resolve_neg().numpy()
        else:
            raise TypeError(
                f"hvd_compress: MPICommunicator moves numpy arrays and torch tensors, "
                f"got {type(tensor).__module__}.{type(tensor).__name__}"
            )

    @property
    def np_dtype(self) -> np.dtype:
        if isinstance(self.buffer, np.ndarray):
            return self.buffer.dtype
        return self.torch.empty(0, dtype=self.buffer.dtype).numpy().dtype

    def empty(self, shape: tuple) -> Any:
        """A receive buffer in the wire's memory (host numpy, or device tensor when CUDA-aware)."""
        if isinstance(self.buffer, np.ndarray):
            return np.empty(shape, dtype=self.buffer.dtype)
        return self.torch.empty(shape, dtype=self.buffer.dtype, device=self.buffer.device)

    def result(self, received: Any) -> Any:
        """``received`` as the caller's kind: same framework, dtype and device as the input."""
        if self.torch is None:
            if self.dtype != np.float16:
                return received
            return received.astype(np.float16) if self.upcast else received.view(np.float16)
        out = received if isinstance(received, self.torch.Tensor) else self.torch.from_numpy(received)
        if self.dtype in (self.torch.bfloat16, self.torch.float16):
            out = out.to(self.dtype) if self.upcast else out.view(self.dtype)
        if self.staged:
            out = out.to(self.device)
        return out


class _Handle:
    """A started collective: its request, the buffers it uses (kept alive), and the result."""

    __slots__ = ("request", "wire", "received", "done", "value")

    def __init__(self, request: Any, wire: _Wire, received: Any) -> None:
        self.request, self.wire, self.received = request, wire, received
        self.done, self.value = False, None


class MPICommunicator(Communicator):
    """:class:`Communicator` over an mpi4py communicator (default ``MPI.COMM_WORLD``).

    Collective names are ignored: MPI matches collectives by call order, so
    every rank must issue the same collectives in the same order (see the
    module docstring).
    """

    matches_by_order = True

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        install_abort_on_error()
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()
        self._ops = {self.SUM: MPI.SUM, self.MAX: MPI.MAX}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def cuda_aware(self) -> bool:
        return cuda_aware()

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self._rank}, size={self._size})"

    def allreduce_async(self, tensor: Any, op: str, name: str = "") -> _Handle:
        """Start an elementwise SUM or MAX over ranks into a new buffer; ``name`` is ignored."""
        if op not in self._ops:
            raise ValueError(f"hvd_compress: allreduce op must be 'sum' or 'max', got {op!r}")
        wire = _Wire(tensor, for_sum=True)
        if wire.np_dtype == np.bool_ or (wire.np_dtype.kind == "c" and op == self.MAX):
            raise TypeError(f"hvd_compress: allreduce-{op} of {wire.np_dtype} is not supported")
        datatype = _mpi_type(wire.np_dtype, op)
        received = wire.empty(tuple(wire.buffer.shape))
        request = self.comm.Iallreduce([wire.buffer, datatype], [received, datatype], self._ops[op])
        return _Handle(request, wire, received)

    def allgather_async(self, tensor: Any, name: str = "", rows: Optional[Sequence[int]] = None) -> _Handle:
        """Start the concatenation along dim 0 in rank order (sizes may differ; ``name`` is ignored).

        Without ``rows`` (every rank's row count, when the caller already agreed
        on them), the counts travel first in a blocking ``Allgather``, which also
        checks trailing shapes and dtypes: every rank must reach this call
        before any returns.
        """
        wire = _Wire(tensor)
        shape = tuple(wire.buffer.shape)
        if not shape:
            raise ValueError("hvd_compress: allgather needs a tensor with at least one dimension")
        per_row = int(np.prod(shape[1:], dtype=np.int64))
        if rows is None:
            rows = self._exchange_rows(shape, per_row, wire.np_dtype, name)
        elif rows[self._rank] != shape[0]:
            raise ValueError(
                f"hvd_compress: allgather '{name}': {shape[0]} rows, announced {rows[self._rank]}"
            )
        counts = [int(r) * per_row for r in rows]
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist()
        received = wire.empty((int(sum(rows)),) + shape[1:])
        datatype = _mpi_type(wire.np_dtype)
        send = [wire.buffer, counts[self._rank], datatype]
        request = self.comm.Iallgatherv(send, [received, counts, displacements, datatype])
        return _Handle(request, wire, received)

    def _exchange_rows(self, shape: tuple, per_row: int, dtype: np.dtype, name: str) -> list:
        dtype_id = zlib.crc32(dtype.str.encode()) & 0x7FFFFFFF
        mine = np.array([shape[0], per_row, dtype_id], dtype=np.int64)
        everyone = np.empty((self._size, 3), dtype=np.int64)
        self.comm.Allgather([mine, self.MPI.INT64_T], [everyone, self.MPI.INT64_T])
        if (everyone[:, 1:] != everyone[0, 1:]).any():
            raise ValueError(
                f"hvd_compress: allgather '{name}': ranks disagree on the trailing shape or dtype "
                f"([rows, elements per row, dtype id] per rank = {everyone.tolist()}); this rank "
                f"has shape {shape} and dtype {dtype}"
            )
        return everyone[:, 0].tolist()

    def wait(self, handle: _Handle) -> Any:
        """Complete ``handle``'s collective; the result in the input's framework, dtype and device."""
        if not isinstance(handle, _Handle):
            raise TypeError(f"hvd_compress: not a handle of this communicator: {handle!r}")
        if not handle.done:
            handle.request.Wait()
            handle.value = handle.wire.result(handle.received)
            handle.done, handle.request, handle.received = True, None, None
        return handle.value

    # ------------------------------------------------------------- not on the hot path
    def broadcast_(self, tensor: Any, root: int = 0) -> Any:
        """In-place ``Bcast`` of a numpy array or torch tensor from ``root``; returns it."""
        wire = _Wire(tensor)
        target = wire.buffer
        direct = isinstance(tensor, np.ndarray) and target is tensor and tensor.dtype != np.float16
        if wire.torch is not None and not wire.staged and not wire.upcast:
            # numpy view / device tensor shares storage with ``tensor`` unless a copy was needed
            direct = tensor.is_contiguous() and tensor.dtype not in (wire.torch.bfloat16, wire.torch.float16)
        self.comm.Bcast([target, _mpi_type(wire.np_dtype)], root=root)
        if not direct:
            result = wire.result(target)
            if isinstance(tensor, np.ndarray):
                tensor[...] = result
            else:
                with wire.torch.no_grad():
                    tensor.copy_(result.reshape(tensor.shape))
        return tensor

    def barrier(self) -> None:
        self.comm.Barrier()
