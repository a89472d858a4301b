"""Our compressors as a ``torch.distributed`` DDP communication hook (no Horovod needed).

    state = hvd_compress.torch.CompressionState(compression=RegTopK(0.01), process_group=None,
                                                named_parameters=model.named_parameters())
    model.register_comm_hook(state, hvd_compress.torch.ddp_hook)

DDP hands the hook one bucket at a time; ``bucket.gradients()`` are the
bucket's parameters' local gradients, views of its flat buffer. The hook runs
them through the same :class:`~hvd_compress.engine.exchange.BucketExchange` as
the drop-in optimizer and the stock Horovod route (the fused torch path: one
header check per layout, then sizes known in advance, a few kernels per bucket,
nothing read back to the host), over a
:class:`~hvd_compress.transport.torch_dist.TorchDistCommunicator` of the process
group, and returns a ``torch.futures.Future`` of the bucket's averaged flat
gradient: all the bucket's collectives are asynchronous, and the decode runs
when they have completed (``collect_all(...).then``) while backward goes on.

Each parameter is a tensor of its own for the compressor (per-tensor ``k``,
small tensors dense, a residual per parameter), named by ``named_parameters``
when given, else ``ddp.bucket<index>.<position>`` from the first layout DDP
builds (the same on every rank). The exchange sees a bucket's parameters in
that first order: DDP reordering a bucket after the first iteration changes
nothing for the compressor; moving parameters between buckets costs a new plan
and one more header check, and the residuals, keyed by name, move with them.

Sparse gradients (``nn.Embedding(sparse=True)``): DDP gives such a parameter a
bucket of its own whose ``buffer()`` is the sparse gradient (``gradients()`` is
empty) and copies the hook's result into it, so the result must be sparse too.
The hook densifies the gradient, compresses it like any other (with a warning
once per parameter, as the drop-in optimizer does) and returns the average as a
sparse tensor holding every row. Zero-size parameters are an empty dense part.

Momentum correction (``RegTopK(0.01, momentum=0.9)``, Deep Gradient Compression's):
the hook returns the average of the ranks' velocities ``u = m u + g``, so the
optimizer stepping DDP's parameters must run without momentum of its own
(``torch.optim.SGD(params, lr)``). The hook never sees the optimizer and cannot
check this: with ``SGD(..., momentum=0.9)`` momentum would be applied twice.
"""

import re
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from hvd_compress.engine.exchange import open_exchange
from hvd_compress.transport.torch_dist import TorchDistCommunicator
from hvd_compress.algorithms import as_compressor, old_keyword
from hvd_compress.algorithms.checkpoint import check_names, writer

ROUTE = "hvd_compress.torch.ddp_hook"


class CompressionState:
    """State of :func:`ddp_hook`: the compressor, the run state it runs on (``compression_state``, a
    :class:`~hvd_compress.algorithms.state.CompressorState`: residuals keyed by parameter, random
    streams, fused plans, statistics; the compressor's own when no other route holds it, so one
    compressor can serve several models) and the group.

    Pickles itself without the process group (like ``PowerSGDState``; after
    unpickling the group is the default one, set ``process_group`` for another);
    :meth:`state_dict` / :meth:`load_state_dict` are the compressor's, on ``compression_state``.
    """

    __slots__ = ("compressor", "compression_state", "process_group", "_names", "_order", "_comm",
                 "_warned_sparse", "_named", "__weakref__")

    def __init__(
        self,
        compression: Any = None,
        process_group: Optional[Any] = None,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
        *,
        compressor: Any = None,
        compression_state: Any = None,
    ) -> None:
        compression = old_keyword(compression, compressor, "CompressionState")
        self.compressor = as_compressor(compression, "CompressionState's compression")
        self.process_group = process_group
        named = [] if named_parameters is None else list(named_parameters)
        self._names: Dict[int, str] = {id(p): n for n, p in named}
        self._order: Dict[int, int] = {id(p): i for i, (_, p) in enumerate(named)}
        self._comm: Optional[TorchDistCommunicator] = None
        self._warned_sparse: set = set()
        self._named = set(self._names.values())  # empty: parameters named by bucket and position
        self.compression_state = self.compressor.state_for(self, ROUTE, compression_state)

    def __getstate__(self) -> Dict[str, Any]:
        # no process group; per-process bookkeeping is rebuilt
        return {"compressor": self.compressor, "compression_state": self.compression_state}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["compressor"], process_group=None, compression_state=state.get("compression_state"))

    def state_dict(self) -> Dict[str, Any]:
        """The compressor's state (:meth:`~hvd_compress.algorithms.base.Compressor.state_dict`), recording
        this process's rank and world in the group (when the group is up), whether or not a step ran."""
        if dist.is_initialized():
            comm = self.communicator()
            self.compressor.bind(comm.rank, comm.size)
        return self.compressor.state_dict(self.compression_state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The compressor's, refusing state whose tensors this hook names none of (written by a route
        that names parameters otherwise: :func:`~hvd_compress.algorithms.checkpoint.check_names`)."""
        if isinstance(state, dict) and isinstance(state.get("tensors"), dict):
            if self._named:
                known, advice = self._named.__contains__, ""
            else:
                known = lambda name: re.fullmatch(r"ddp\.bucket\d+\.\d+", name) is not None  # noqa: E731
                advice = " (without named_parameters= it names parameters ddp.bucket<index>.<position>)"
            check_names(state["tensors"], writer(state), known, "this ddp_hook's CompressionState", advice)
        self.compressor.load_state_dict(state, self.compression_state)

    def communicator(self) -> TorchDistCommunicator:
        if self._comm is None or self._comm.group is not self.process_group:
            self._comm = TorchDistCommunicator(self.process_group)
        return self._comm

    def names(self, bucket: Any) -> List[Tuple[int, str]]:
        """``(position in the bucket, name)`` of its parameters, in the order they were first named.

        Unnamed parameters are named by their first bucket and position. The exchange
        sees a bucket's parameters in that first order whatever order DDP's rebuilt
        buckets use, so a rebuild changes neither the plan nor TernGrad's draws.
        """
        named = []
        for position, p in enumerate(bucket.parameters()):
            if id(p) not in self._names:
                self._names[id(p)] = f"ddp.bucket{bucket.index()}.{position}"
            if id(p) not in self._order:
                self._order[id(p)] = len(self._order)
            named.append((self._order[id(p)], position, self._names[id(p)]))
        return [(position, name) for _, position, name in sorted(named)]

    def densified(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return densified(name, grad, self._warned_sparse,
                         "ddp_hook exchanges it dense (compressed like any other) and returns it as a sparse tensor of "
                         "every row", stacklevel=4)


def densified(name: str, grad: torch.Tensor, warned: set, outcome: str, stacklevel: int) -> torch.Tensor:
    """A sparse gradient (``nn.Embedding(sparse=True)``) as a dense one, with a warning once per name in
    ``warned`` saying what the route does with it (``outcome``; ``stacklevel``: the frame it names)."""
    if name not in warned:
        warned.add(name)
        warnings.warn(f"hvd_compress: parameter '{name}' has a sparse gradient; {outcome}. Use sparse=False to "
                      "silence this", stacklevel=stacklevel)
    return grad.to_dense()


def _every_row(dense: torch.Tensor) -> torch.Tensor:
    """``dense`` as a sparse COO tensor of all its rows (what DDP copies into a sparse gradient)."""
    rows = torch.arange(dense.shape[0], device=dense.device).unsqueeze(0)
    return torch.sparse_coo_tensor(rows, dense, dense.shape, check_invariants=False, is_coalesced=True)


def ddp_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradient averaged over the group, compressed on the wire.

    The annotations are the objects DDP's ``register_comm_hook`` checks for (so no
    ``from __future__ import annotations`` in this module).
    """
    comm = state.communicator()
    named = state.names(bucket)
    gradients = bucket.gradients()
    sparse = bucket.buffer().is_sparse  # a bucket of its own, gradients() empty (module docstring)
    if sparse:
        gradients = [state.densified(named[0][1], bucket.buffer())]
    exchange = open_exchange(state.compressor, comm, f"ddp.bucket{bucket.index()}", state.compression_state)
    for position, name in named:
        exchange.add(name, gradients[position])
    exchange.launch()
    futures = [handle[0].get_future() for handle in exchange.in_flight()]
    in_bucket_order = [name for _, name in sorted(named)]

    def decode(_: Any) -> torch.Tensor:
        if sparse:
            return _every_row(exchange.finish(average=True)[named[0][1]])
        return exchange.finish(average=True, order=in_bucket_order)  # DDP's flat bucket

    return torch.futures.collect_all(futures).then(decode)
