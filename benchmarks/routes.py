"""The routes of a one-rank training step that ``python -m benchmarks trace`` compares.

Each route is a step function over a fresh model of a workload (same seed,
same synthetic batch): zero_grad, forward, backward, the gradient exchange and
the optimizer step (SGD, momentum 0.9). ``torch.distributed`` runs in this
process with a single rank (:func:`process_group`: ``nccl`` on CUDA, ``gloo``
on the CPU, ``MASTER_ADDR=127.0.0.1`` and a free port), so every collective
goes through its backend but nothing crosses a network. Routes:

* ``local``: no DDP, the plain optimizer (no exchange at all);
* ``ddp``: ``DistributedDataParallel`` with its allreduce;
* ``ddp+fp16``: torch's ``fp16_compress_hook``;
* ``ddp+handwritten-topk``: :func:`handwritten_topk_hook` below, a flat-bucket
  Top-k with error feedback in a few lines: the peer to beat;
* per compressor: ``ours-ddp-hook`` (:func:`hvd_compress.torch.ddp_hook`),
  ``ours-dropin`` (:class:`hvd_compress.torch.DistributedOptimizer`, over
  Horovod when ``horovod.torch`` imports and initialises, else over
  :class:`~hvd_compress.transport.torch_dist.TorchDistCommunicator`; ``dropin_comm``
  picks one) and ``ours-stock-horovod`` (``horovod.torch.DistributedOptimizer``
  with our compressor; skipped, with a note, without Horovod). Stock Horovod
  registers no gradient hooks at world size 1 (so nothing would be
  compressed); the route builds its optimizer with ``HOROVOD_ELASTIC=1``, which
  makes it register them, so the row runs the real path.

The repository's training-step timing benchmark (``python -m benchmarks
train-step``) times these routes and more.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

#: ``auto-regtopk``: ``Auto(RegTopK)``, each bucket the cheaper way after measuring (world size 1: dense).
AUTO_PREFIX = "auto-"
#: Untimed steps an ``auto-`` row needs: one untimed and three timed measurements, then the decision.
AUTO_STEADY_AFTER = 5
BASELINE = "ddp"
#: Routes without one of our compressors: (route, what it exchanges).
TORCH_ROUTES = (("local", "none"), ("ddp", "none"), ("ddp+fp16", "fp16"), ("ddp+handwritten-topk", "topk"))
#: Routes run once per compressor of ours.
OUR_ROUTES = ("ours-ddp-hook", "ours-dropin", "ours-stock-horovod")
ROUTES = tuple(r for r, _ in TORCH_ROUTES) + OUR_ROUTES
DROPIN_COMMS = ("auto", "torch", "horovod")
#: The MLP: input features, hidden widths, classes. Weights are >= 1024 elements (sent sparse),
#: biases below (sent dense), as in a real model.
MLP_SIZES = (512, 768, 768, 10)
MLP_BATCH = 32
LR = 1e-3


# ======================================================== the peer to beat
class HandwrittenTopKState:
    """State of :func:`handwritten_topk_hook`: the density and a residual per bucket index."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.residuals: Dict[int, Any] = {}


def handwritten_topk_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """Top-k with error feedback on DDP's flat bucket, allgather of (values, indices): a DDP comm hook.

    The best short hook a user would write: ``a = g + r``, one ``torch.topk(|a|, k)``,
    ``r = a`` with the sent entries zeroed (``index_fill_``: a scalar argument, where
    ``a[idx] = 0`` copies a host scalar to the device and waits), two fixed-size allgathers
    (``all_gather_into_tensor``, ``k`` known from the bucket's size) and the average decoded in
    the index allgather's future callback; nothing is read back to the host. On NCCL a
    collective's future is done once queued and ``wait()`` makes the callback's stream wait;
    on gloo the value allgather, queued first, is done or running on gloo's other thread.
    (After DDP rebuilds its buckets a residual may meet a reordered bucket; a hand-written hook
    typically ignores that, and so does this one, except for a size change.)
    """
    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13's name
    world, grad = dist.get_world_size(), bucket.buffer()
    residual = state.residuals.get(bucket.index())
    a = grad + residual if residual is not None and residual.shape == grad.shape else grad.clone()
    k = max(1, math.ceil(state.ratio * a.numel()))
    indices = torch.topk(a.abs(), k, sorted=False).indices
    values = a.index_select(0, indices)
    state.residuals[bucket.index()] = a.index_fill_(0, indices, 0)
    all_values, all_indices = values.new_empty(world * k), indices.new_empty(world * k)
    values_sent = gather(all_values, values, async_op=True).get_future()
    indices_sent = gather(all_indices, indices, async_op=True).get_future()

    def average(_: Any) -> Any:
        values_sent.wait()
        return torch.zeros_like(grad).scatter_add_(0, all_indices, all_values).div_(world)

    return indices_sent.then(average)


# ================================================================ workload
class MLPWorkload:
    """The MLP of :data:`MLP_SIZES` (ReLU) and its cross-entropy loss on one fixed synthetic batch; no extra
    package. A workload: ``name``, ``device``, ``batch``, ``description``, ``parameter_count`` (known after
    the first :meth:`build`), :meth:`build` and :meth:`loss`."""

    name = "mlp"

    def __init__(self, device: Any, batch: int, seed: int) -> None:
        import torch

        self.device, self.batch, self.seed = device, batch, seed
        self.parameter_count: Optional[int] = None
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(batch, MLP_SIZES[0], generator=generator).to(device)
        self.labels = torch.randint(0, MLP_SIZES[-1], (batch,), generator=generator).to(device)
        self.description = f"MLP {'-'.join(map(str, MLP_SIZES))} (ReLU), batch {batch}, random labels"

    def build(self) -> Any:
        """A fresh model on the device, in training mode, with the same initial weights every time."""
        import torch

        torch.manual_seed(self.seed)
        layers: List[Any] = []
        for i, (n_in, n_out) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
            layers += [torch.nn.ReLU()] if i else []
            layers.append(torch.nn.Linear(n_in, n_out))
        model = torch.nn.Sequential(*layers)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        return model.to(self.device).train()

    def loss(self, model: Any) -> Any:
        import torch

        return torch.nn.functional.cross_entropy(model(self.inputs), self.labels)


# =================================================================== routes
class Environment:
    """What every row shares: the workload, the device, our options and Horovod (if it initialised)."""

    def __init__(self, workload: Any, ratio: float, hvd: Any, dropin_comm: str) -> None:
        self.workload, self.ratio, self.hvd, self.dropin_comm = workload, ratio, hvd, dropin_comm
        #: the compressor of the last row built (:meth:`compressor`)
        self.last_compressor: Any = None

    def compressor(self, name: str) -> Any:
        """A new compressor ``name`` at the shared density (:func:`make_compressor`), kept as
        :attr:`last_compressor`."""
        self.last_compressor = make_compressor(name, self.ratio)
        return self.last_compressor

    @property
    def cuda(self) -> bool:
        return self.workload.device.type == "cuda"


#: ``exact_every`` of ``<sparsifier>-reuse``: no exact selection after the first step
REUSE_ALWAYS = 2**62


def make_compressor(name: str, ratio: float) -> Any:
    """Our compressor ``name`` at density ``ratio``; ``auto-<name>``: :class:`~hvd_compress.Auto` of it;
    ``<sparsifier>-leader``, ``<sparsifier>-aggregate``: with that shared index set; ``<sparsifier>-reuse<T>``:
    reused thresholds, exact every ``T`` steps (``-reuse`` alone: every step after the first reuses, what a
    step between exact selections costs)."""
    from hvd_compress.algorithms import Compression

    if name.startswith(AUTO_PREFIX):
        from hvd_compress import Auto

        return Auto(make_compressor(name[len(AUTO_PREFIX):], ratio), warmup=AUTO_STEADY_AFTER - 2, log=False)
    base, _, option = name.partition("-")
    if option.startswith("reuse"):
        return Compression.by_name(base, ratio, exact_every=int(option[len("reuse"):] or REUSE_ALWAYS))
    return Compression.by_name(base, ratio, **({"indices": option} if option else {}))


def sgd(params: Any) -> Any:
    """The optimizer of every row: SGD, momentum 0.9."""
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def ddp(env: Environment, model: Any, one_bucket: bool = False) -> Any:
    """DDP with its default buckets, or (``one_bucket``) all gradients in one bucket."""
    from torch.nn.parallel import DistributedDataParallel

    device = env.workload.device
    options = {}
    if one_bucket:
        options["bucket_cap_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
    return DistributedDataParallel(model, device_ids=[device.index] if env.cuda else None, **options)


def step_fn(env: Environment, model: Any, opt: Any) -> Callable[[], None]:
    """One training step: zero_grad, forward, backward, ``opt.step()``."""
    def step() -> None:
        opt.zero_grad()  # set_to_none=True, torch's default (Horovod's zero_grad takes no argument)
        env.workload.loss(model).backward()
        opt.step()

    return step


def build_route(env: Environment, route: str, compressor: str) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """The step function of a row and what to record about it (``communicator``, ``min_warmup``)."""
    model = env.workload.build()
    info: Dict[str, Any] = {"min_warmup": AUTO_STEADY_AFTER if compressor.startswith(AUTO_PREFIX) else 0}
    if route == "local":
        return step_fn(env, model, sgd(model.parameters())), info
    if route == "ours-dropin":
        from hvd_compress.torch import DistributedOptimizer

        communicator = None  # Horovod's
        use_horovod = env.dropin_comm == "horovod" or (env.dropin_comm == "auto" and env.hvd is not None)
        if env.dropin_comm == "horovod" and env.hvd is None:
            raise RuntimeError("--dropin-comm horovod, but horovod.torch did not import or initialise")
        if not use_horovod:
            from hvd_compress.transport.torch_dist import TorchDistCommunicator

            communicator = TorchDistCommunicator()
        info["communicator"] = "horovod" if use_horovod else "torch.distributed"
        opt = DistributedOptimizer(
            sgd(model.parameters()),
            named_parameters=model.named_parameters(),
            compression=env.compressor(compressor),
            communicator=communicator,
        )
        return step_fn(env, model, opt), info
    if route == "ours-stock-horovod":
        hvd = env.hvd
        info["communicator"] = "horovod"
        with environ(HOROVOD_ELASTIC="1"):  # at size 1 Horovod registers its hooks only when elastic
            opt = hvd.DistributedOptimizer(
                sgd(model.parameters()),
                named_parameters=model.named_parameters(),
                compression=env.compressor(compressor),
            )
        return step_fn(env, model, opt), info
    return _ddp_route(env, model, route, compressor, info)


def _ddp_route(
    env: Environment, model: Any, route: str, compressor: str, info: Dict[str, Any]
) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """:func:`build_route` for the routes through DDP (``ddp``, ``ddp+fp16``, the hand-written hook,
    ``ours-ddp-hook``): ``model`` wrapped in DDP with the route's comm hook, and ``info`` completed."""
    wrapped = ddp(env, model)
    info["communicator"] = "torch.distributed"
    if route == "ddp+fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif route == "ddp+handwritten-topk":
        wrapped.register_comm_hook(HandwrittenTopKState(env.ratio), handwritten_topk_hook)
    elif route == "ours-ddp-hook":
        from hvd_compress.torch import CompressionState, ddp_hook

        state = CompressionState(env.compressor(compressor))
        if "named_parameters" in inspect.signature(CompressionState).parameters:  # names as ours-dropin's
            state = CompressionState(state.compressor, named_parameters=model.named_parameters())
        wrapped.register_comm_hook(state, ddp_hook)
    elif route != BASELINE:
        raise ValueError(f"hvd_compress: unknown route {route!r}; choose from {', '.join(ROUTES)}")
    return step_fn(env, wrapped, sgd(wrapped.parameters())), info


# ================================================================== setup
@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set environment variables for the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_horovod() -> Tuple[Any, Optional[str]]:
    """``horovod.torch``, initialised, or (None, why not)."""
    try:
        import horovod.torch as hvd
    except Exception as error:  # noqa: BLE001  (a broken build raises more than ImportError)
        return None, f"horovod.torch does not import ({type(error).__name__}: {error})"
    try:
        hvd.init()
    except Exception as error:  # noqa: BLE001
        return None, f"hvd.init() failed ({type(error).__name__}: {error})"
    if hvd.size() != 1:
        return None, f"Horovod runs {hvd.size()} ranks; this benchmark runs at world size 1"
    return hvd, None


@contextlib.contextmanager
def process_group(cuda: bool) -> Iterator[str]:
    """A one-rank default process group (nccl on CUDA, gloo on the CPU); yields the backend."""
    import torch.distributed as dist

    from benchmarks.report import free_port

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                "hvd_compress: the one-rank step benchmarks run at world size 1, but a larger group exists"
            )
        yield dist.get_backend()
        return
    backend = "nccl" if cuda else "gloo"
    with environ(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())):
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def torch_device(device: str, dropin_comm: str) -> Any:
    """The device rows run on (``"cpu"`` or ``"cuda"``, the current one, made current), after checking
    ``dropin_comm`` and that CUDA is there when asked for."""
    import torch

    if dropin_comm not in DROPIN_COMMS:
        raise ValueError(f"hvd_compress: dropin_comm must be one of {', '.join(DROPIN_COMMS)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("hvd_compress: --device cuda asked for, but torch.cuda.is_available() is False")
    if device != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    return dev


def rows_to_run(planned: Sequence[Tuple[str, str]], routes: Sequence[str], dropin_comm: str):
    """``(hvd, note, todo, skipped)``: Horovod initialised when a route needs it (``None`` otherwise or
    when it cannot start, ``note`` saying why), the ``(route, compressor)`` rows to run, and the stock
    rows skipped without it."""
    hvd, horovod_note = None, None
    if "ours-stock-horovod" in routes or ("ours-dropin" in routes and dropin_comm != "torch"):
        hvd, horovod_note = init_horovod()
    todo, skipped = [], []
    for route, compressor in planned:
        if route == "ours-stock-horovod" and hvd is None:
            skipped.append({"route": route, "compressor": compressor, "note": f"skipped: {horovod_note}"})
        else:
            todo.append((route, compressor))
    return hvd, horovod_note, todo, skipped


# ================================================================= output
def save(
    results: Dict[str, Any],
    json_path: Optional[str],
    plot_path: Optional[str],
    plot: Callable[[Dict[str, Any], Path], None],
) -> None:
    """Write the JSON (``json_path``) and the PNG of ``plot(results, path)`` (``plot_path``), each when given;
    their folders are made."""
    import json

    for path in (json_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if plot_path:
        plot(results, Path(plot_path))


__all__ = [
    "build_route",
    "Environment",
    "handwritten_topk_hook",
    "HandwrittenTopKState",
    "MLPWorkload",
    "init_horovod",
    "process_group",
    "rows_to_run",
    "save",
    "torch_device",
    "ROUTES",
    "OUR_ROUTES",
    "TORCH_ROUTES",
]
