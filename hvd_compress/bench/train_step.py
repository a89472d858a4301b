"""Full training-step time of every exchange route, one process (world size 1), CPU or GPU.

``torch.distributed`` is initialised in this process with a single rank
(``nccl`` on CUDA, ``gloo`` on the CPU; ``MASTER_ADDR=127.0.0.1`` and a free
port), so every collective runs through its backend but nothing crosses a
network: what is measured is the cost a route adds to a step on one device
(compression kernels, packing, host synchronisations, hooks), the part that
does not shrink with a faster link.

Each row builds the model afresh (same seed), feeds the same synthetic batch
and times whole training steps: zero_grad, forward, backward, the gradient
exchange and the optimizer step (SGD, momentum 0.9), with
``torch.cuda.synchronize()`` before and after each timed step on CUDA;
``warmup`` untimed steps first, then the median and minimum of ``steps``.
Rows:

* ``local``: no DDP, the plain optimizer (no exchange at all);
* ``ddp``: ``DistributedDataParallel`` with its allreduce, the baseline:
  ``ratio`` = median / ddp's median, ``overhead_ms`` = median - ddp's median;
* ``ddp+fp16``: torch's ``fp16_compress_hook``;
* ``ddp+powersgd``: torch's ``powerSGD_hook``, rank 4, from iteration
  ``POWERSGD_START`` on (that row warms up past it). On gloo (CPU) this row
  puts all gradients in one DDP bucket: the hook waits on collectives inside
  its future callbacks, which gloo runs on its two worker threads, so two
  buckets doing so at once deadlock (seen intermittently);
* ``ddp+handwritten-topk``: :func:`handwritten_topk_hook` below, a flat-bucket
  Top-k with error feedback in a few lines: the peer to beat;
* per compressor: ``ours-ddp-hook`` (:func:`hvd_compress.torch.ddp_hook`),
  ``ours-dropin`` (:class:`hvd_compress.torch.DistributedOptimizer`, over
  Horovod when ``horovod.torch`` imports and initialises, else over
  :class:`~hvd_compress.comm.torch_dist.TorchDistCommunicator`; ``dropin_comm``
  picks one) and ``ours-stock-horovod`` (``horovod.torch.DistributedOptimizer``
  with our compressor; skipped, with a note, without Horovod). Stock Horovod
  registers no gradient hooks at world size 1 (so nothing would be
  compressed); the row builds its optimizer with ``HOROVOD_ELASTIC=1``, which
  makes it register them, so the row times the real path.

``host_syncs_per_step`` is measured over one more steady-state step: on CUDA
the warnings of ``torch.cuda.set_sync_debug_mode("warn")``; on the CPU the
host reads of :func:`hvd_compress.bench.host_reads.count_host_reads` (``item``,
``tolist``, ``bool(t)`` ...: the places a GPU run would wait). Every row also
records that counter's reads by kind and their call sites.

``peak_mem_mib``: CUDA, ``torch.cuda.max_memory_allocated()`` over the row
(statistics reset first; model, optimizer state and activations); CPU, the
growth of the process's peak RSS over the row (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``, minus the RSS at the row's start; null where
that is not possible): a rough number, as the allocator reuses freed memory.

A row that fails records its error and the benchmark goes on. Outputs: the
JSON (``rows``, ``skipped``, ``settings``, ``machine``), a PNG of the ratios
and a table. Models: ``resnet50`` (torchvision, 3x224x224, 1000 classes),
``gpt2`` (transformers' GPT-2 small, sequence 512, LM loss) and ``mlp``
(:data:`MLP_SIZES`, no extra package).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import inspect
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from hvd_compress.bench import report
from hvd_compress.bench.host_reads import count_host_reads

MODELS = ("resnet50", "gpt2", "mlp")
#: ``auto-regtopk``: ``Auto(RegTopK)``, each bucket the cheaper way after measuring (world size 1: dense).
COMPRESSORS = ("none", "fp16", "topk", "gaussiank", "regtopk", "terngrad", "auto-regtopk")
AUTO_PREFIX = "auto-"
#: Untimed steps an ``auto-`` row needs: one untimed and three timed measurements, then the decision.
AUTO_STEADY_AFTER = 5
SPARSE = ("topk", "gaussiank", "regtopk")
BASELINE = "ddp"
#: Routes without one of our compressors: (route, what it exchanges).
TORCH_ROUTES = (
    ("local", "none"),
    ("ddp", "none"),
    ("ddp+fp16", "fp16"),
    ("ddp+powersgd", "powersgd-r4"),
    ("ddp+handwritten-topk", "topk"),
)
#: Routes run once per compressor of ours.
OUR_ROUTES = ("ours-ddp-hook", "ours-dropin", "ours-stock-horovod")
ROUTES = tuple(r for r, _ in TORCH_ROUTES) + OUR_ROUTES
DEFAULT_BATCH = {"resnet50": 64, "gpt2": 8, "mlp": 32}
#: The MLP: input features, hidden widths, classes. Weights are >= 1024 elements (sent sparse),
#: biases below (sent dense), as in a real model.
MLP_SIZES = (512, 768, 768, 10)
GPT2_SEQUENCE = 512
POWERSGD_RANK = 4
POWERSGD_START = 2
LR = 1e-3
#: What the CUDA sync-debug warnings say (``c10::cuda::warn_or_error_on_sync``).
SYNC_WARNING = "synchronizing CUDA operation"
DROPIN_COMMS = ("auto", "torch", "horovod")
GLOO_POWERSGD_NOTE = (
    "one DDP bucket: torch's PowerSGD hook waits inside its gloo future callbacks, and two buckets "
    "doing so at once take both gloo worker threads (deadlock)"
)


# ======================================================== the peer to beat
class HandwrittenTopKState:
    """State of :func:`handwritten_topk_hook`: the density and a residual per bucket index."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.residuals: Dict[int, Any] = {}


def handwritten_topk_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
    """Top-k with error feedback on DDP's flat bucket, allgather of (values, indices): a DDP comm hook.

    (After DDP rebuilds its buckets a residual may meet a reordered bucket; a hand-written hook
    typically ignores that, and so does this one, except for a size change.)
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    grad = bucket.buffer()
    residual = state.residuals.get(bucket.index())
    a = grad + residual if residual is not None and residual.shape == grad.shape else grad.clone()
    k = max(1, math.ceil(state.ratio * a.numel()))
    indices = torch.topk(a.abs(), k, sorted=False).indices
    values = a[indices]
    a[indices] = 0
    state.residuals[bucket.index()] = a
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_indices = [torch.empty_like(indices) for _ in range(world)]
    futures = [
        dist.all_gather(all_values, values, async_op=True).get_future(),
        dist.all_gather(all_indices, indices, async_op=True).get_future(),
    ]

    def average(_: Any) -> Any:
        dense = torch.zeros_like(grad).scatter_add_(0, torch.cat(all_indices), torch.cat(all_values))
        return dense.div_(world)

    return torch.futures.collect_all(futures).then(average)


# ================================================================ workloads
def _optional(module: str) -> Any:
    """``module`` of the ``bench-gpu`` extra; ImportError naming the extra when missing or broken."""
    try:
        return report.require(module, "bench-gpu")
    except ImportError:
        raise
    except Exception as error:  # noqa: BLE001  (e.g. torchvision built for another torch: RuntimeError)
        raise ImportError(
            f"hvd_compress: {module} is installed but does not import ({type(error).__name__}: {error}); "
            f"it must match torch (pip install 'hvd_compress[bench-gpu]' next to your torch)"
        ) from error


class Workload:
    """A model factory and its loss on one fixed synthetic batch."""

    def __init__(self, model: str, device: Any, batch: int, seed: int) -> None:
        import torch

        self.name, self.device, self.batch, self.seed = model, device, batch, seed
        self.parameter_count: Optional[int] = None  # known after the first build()
        generator = torch.Generator().manual_seed(seed)
        if model == "resnet50":
            self._models = _optional("torchvision.models")
            self.inputs = torch.randn(batch, 3, 224, 224, generator=generator).to(device)
            self.labels = torch.randint(0, 1000, (batch,), generator=generator).to(device)
            self.description = f"torchvision resnet50, batch {batch} x 3x224x224, 1000 random labels"
        elif model == "gpt2":
            self._transformers = _optional("transformers")
            vocab = self._transformers.GPT2Config().vocab_size
            shape = (batch, GPT2_SEQUENCE)
            self.inputs = torch.randint(0, vocab, shape, generator=generator).to(device)
            self.description = (
                f"GPT-2 small (transformers), batch {batch} x {GPT2_SEQUENCE} random tokens, LM loss"
            )
        elif model == "mlp":
            self.inputs = torch.randn(batch, MLP_SIZES[0], generator=generator).to(device)
            self.labels = torch.randint(0, MLP_SIZES[-1], (batch,), generator=generator).to(device)
            sizes = "-".join(map(str, MLP_SIZES))
            self.description = f"MLP {sizes} (ReLU), batch {batch}, random labels"
        else:
            raise ValueError(f"hvd_compress: model must be one of {', '.join(MODELS)}, got {model!r}")

    def build(self) -> Any:
        """A fresh model on the device, in training mode, with the same initial weights every time."""
        import torch

        torch.manual_seed(self.seed)
        if self.name == "resnet50":
            model = self._models.resnet50()
        elif self.name == "gpt2":
            model = self._transformers.GPT2LMHeadModel(self._transformers.GPT2Config())
        else:
            layers: List[Any] = []
            for i, (n_in, n_out) in enumerate(zip(MLP_SIZES[:-1], MLP_SIZES[1:])):
                layers += [torch.nn.ReLU()] if i else []
                layers.append(torch.nn.Linear(n_in, n_out))
            model = torch.nn.Sequential(*layers)
        self.parameter_count = sum(p.numel() for p in model.parameters())
        return model.to(self.device).train()

    def loss(self, model: Any) -> Any:
        import torch

        if self.name == "gpt2":
            return model(input_ids=self.inputs, labels=self.inputs, use_cache=False).loss
        return torch.nn.functional.cross_entropy(model(self.inputs), self.labels)


# =================================================================== routes
class Environment:
    """What every row shares: the workload, the device, our options and Horovod (if it initialised)."""

    def __init__(self, workload: Workload, ratio: float, hvd: Any, dropin_comm: str) -> None:
        self.workload, self.ratio, self.hvd, self.dropin_comm = workload, ratio, hvd, dropin_comm

    @property
    def cuda(self) -> bool:
        return self.workload.device.type == "cuda"


def make_compressor(name: str, ratio: float) -> Any:
    from hvd_compress.compressors import Compression

    if name.startswith(AUTO_PREFIX):
        from hvd_compress import Auto

        return Auto(Compression.by_name(name[len(AUTO_PREFIX):], ratio), warmup=AUTO_STEADY_AFTER - 2, log=False)
    return Compression.by_name(name, ratio)


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _ddp(env: Environment, model: Any, one_bucket: bool = False) -> Any:
    """DDP with its default buckets, or (``one_bucket``) all gradients in one bucket."""
    from torch.nn.parallel import DistributedDataParallel

    device = env.workload.device
    options = {}
    if one_bucket:
        options["bucket_cap_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
    return DistributedDataParallel(model, device_ids=[device.index] if env.cuda else None, **options)


def _step_fn(env: Environment, model: Any, opt: Any) -> Callable[[], None]:
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
        return _step_fn(env, model, _sgd(model.parameters())), info
    if route == "ours-dropin":
        from hvd_compress.torch import DistributedOptimizer

        communicator = None  # Horovod's
        use_horovod = env.dropin_comm == "horovod" or (env.dropin_comm == "auto" and env.hvd is not None)
        if env.dropin_comm == "horovod" and env.hvd is None:
            raise RuntimeError("--dropin-comm horovod, but horovod.torch did not import or initialise")
        if not use_horovod:
            from hvd_compress.comm.torch_dist import TorchDistCommunicator

            communicator = TorchDistCommunicator()
        info["communicator"] = "horovod" if use_horovod else "torch.distributed"
        opt = DistributedOptimizer(
            _sgd(model.parameters()),
            named_parameters=model.named_parameters(),
            compression=make_compressor(compressor, env.ratio),
            communicator=communicator,
        )
        return _step_fn(env, model, opt), info
    if route == "ours-stock-horovod":
        hvd = env.hvd
        info["communicator"] = "horovod"
        with _environ(HOROVOD_ELASTIC="1"):  # at size 1 Horovod registers its hooks only when elastic
            opt = hvd.DistributedOptimizer(
                _sgd(model.parameters()),
                named_parameters=model.named_parameters(),
                compression=make_compressor(compressor, env.ratio),
            )
        return _step_fn(env, model, opt), info
    return _ddp_route(env, model, route, compressor, info)


def _ddp_route(
    env: Environment, model: Any, route: str, compressor: str, info: Dict[str, Any]
) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """:func:`build_route` for the routes through DDP (``ddp``, its torch hooks, ``ours-ddp-hook``): ``model``
    wrapped in DDP with the route's comm hook, and ``info`` completed."""
    # torch's PowerSGD hook waits on collectives inside its future callbacks; gloo runs those callbacks on
    # its 2 worker threads, so two buckets waiting at once deadlock: on gloo that row uses one bucket.
    one_bucket = route == "ddp+powersgd" and not env.cuda
    ddp = _ddp(env, model, one_bucket=one_bucket)
    info["communicator"] = "torch.distributed"
    if one_bucket:
        info["note"] = GLOO_POWERSGD_NOTE
    if route == "ddp+fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif route == "ddp+powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        info["min_warmup"] = POWERSGD_START + 1  # time PowerSGD itself, not its allreduce warm-up
    elif route == "ddp+handwritten-topk":
        ddp.register_comm_hook(HandwrittenTopKState(env.ratio), handwritten_topk_hook)
    elif route == "ours-ddp-hook":
        from hvd_compress.torch import CompressionState, ddp_hook

        state = CompressionState(make_compressor(compressor, env.ratio))
        if "named_parameters" in inspect.signature(CompressionState).parameters:  # names as ours-dropin's
            state = CompressionState(state.compressor, named_parameters=model.named_parameters())
        ddp.register_comm_hook(state, ddp_hook)
    elif route != BASELINE:
        raise ValueError(f"hvd_compress: unknown route {route!r}; choose from {', '.join(ROUTES)}")
    return _step_fn(env, ddp, _sgd(ddp.parameters())), info


# ============================================================== measuring
@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
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


def _proc_status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakMemory:
    """Peak memory of one row: CUDA allocator peak, or growth of the peak RSS on the CPU (or None)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            return
        self.rss = _proc_status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
        except OSError:
            self.rss = None

    def mib(self) -> Optional[float]:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        peak = _proc_status_kib("VmHWM")
        return None if self.rss is None or peak is None else max(0, peak - self.rss) / 1024


def _count_syncs(step: Callable[[], None], cuda: bool) -> Tuple[Optional[int], Dict[str, Any]]:
    """Host synchronisations of one step (CUDA: sync-debug warnings; CPU: host reads) and the host reads."""
    import torch

    syncs = None
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    with count_host_reads() as reads:
        step()
    if cuda:
        torch.cuda.synchronize()
    return (syncs if cuda else reads.count), reads.as_dict()


def measure(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> Dict[str, Any]:
    """Median and minimum of ``steps`` timed steps after ``warmup``; host syncs of one more step."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    syncs, reads = _count_syncs(step, cuda)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "host_syncs_per_step": syncs,
        "host_reads": reads,
    }


def run_row(env: Environment, route: str, compressor: str, steps: int, warmup: int) -> Dict[str, Any]:
    """One row; a failure is the row's ``error``, never an exception."""
    row: Dict[str, Any] = {
        "route": route,
        "compressor": compressor,
        "median_ms": None,
        "min_ms": None,
        "ratio": None,
        "overhead_ms": None,
        "host_syncs_per_step": None,
        "peak_mem_mib": None,
        "error": None,
    }
    memory = PeakMemory(env.cuda)
    step = None
    try:
        memory.start()
        step, info = build_route(env, route, compressor)
        row["warmup"] = max(warmup, info.pop("min_warmup"))
        row.update(info)
        row.update(measure(step, steps, row["warmup"], env.cuda))
        row["peak_mem_mib"] = memory.mib()
    except Exception as error:  # noqa: BLE001  (a failing row must not stop the others)
        row["error"] = f"{type(error).__name__}: {error}"
    finally:
        step = None
        gc.collect()
        if env.cuda:
            import torch

            torch.cuda.empty_cache()
    return row


def plan(routes: Sequence[str], compressors: Sequence[str]) -> List[Tuple[str, str]]:
    """(route, compressor) of every row, in table order; the ``ddp`` baseline always."""
    rows = [(r, c) for r, c in TORCH_ROUTES if r in routes or r == BASELINE]
    rows += [(r, c) for r in OUR_ROUTES if r in routes for c in compressors]
    return rows


# ================================================================== setup
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

    from hvd_compress.bench import free_port

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(
                "hvd_compress: bench train-step and trace run at world size 1, but a larger group exists"
            )
        yield dist.get_backend()
        return
    backend = "nccl" if cuda else "gloo"
    with _environ(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())):
        dist.init_process_group(backend, init_method="env://", rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _check(model: str, device: str, steps: int, warmup: int, batch: Optional[int], routes, compressors):
    if model not in MODELS:
        raise ValueError(f"hvd_compress: model must be one of {', '.join(MODELS)}, got {model!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"hvd_compress: device must be cpu or cuda, got {device!r}")
    if int(steps) < 1 or int(warmup) < 0:
        raise ValueError(f"hvd_compress: steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    if batch is not None and int(batch) < 1:
        raise ValueError(f"hvd_compress: batch must be >= 1, got {batch}")
    for name in routes:
        if name not in ROUTES:
            raise ValueError(f"hvd_compress: unknown route {name!r}; choose from {', '.join(ROUTES)}")
    for name in compressors:
        if name not in COMPRESSORS:
            raise ValueError(
                f"hvd_compress: unknown compressor {name!r}; choose from {', '.join(COMPRESSORS)}"
            )


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


# ==================================================================== run
def run(
    model: str = "mlp",
    device: str = "cpu",
    steps: int = 25,
    warmup: int = 8,
    batch: Optional[int] = None,
    compressors: Sequence[str] = COMPRESSORS,
    ratio: float = 0.01,
    routes: Sequence[str] = ROUTES,
    dropin_comm: str = "auto",
    seed: int = 0,
    json_path: Optional[str] = None,
    plot_path: Optional[str] = None,
    progress: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Time every row, write the JSON and the PNG (when given), print the table; returns the results."""
    from hvd_compress.compressors.base import check_ratio

    report.require_packages(torch=True, plots=plot_path is not None)
    import torch

    ratio = check_ratio(ratio)
    _check(model, device, steps, warmup, batch, routes, compressors)
    batch = int(batch) if batch is not None else DEFAULT_BATCH[model]
    dev = torch_device(device, dropin_comm)
    workload = Workload(model, dev, batch, seed)  # raises early when torchvision/transformers is missing
    hvd, horovod_note, todo, skipped = rows_to_run(plan(routes, compressors), routes, dropin_comm)

    started = time.perf_counter()
    rows, backend = _time_rows(Environment(workload, ratio, hvd, dropin_comm), todo, steps, warmup, progress)
    _ratios(rows)

    machine = report.machine(torch, [device])
    results = {
        "benchmark": "train-step",
        "machine": machine,
        "settings": _settings(
            workload, device, machine, backend, steps, warmup, ratio, compressors, routes, dropin_comm, hvd,
            horovod_note,
        ),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "skipped": skipped,
    }
    save(results, json_path, plot_path)
    print_table(results, stdout)
    return results


def _time_rows(
    env: Environment, todo: Sequence[Tuple[str, str]], steps: int, warmup: int, progress: bool
) -> Tuple[List[Dict[str, Any]], str]:
    """``(rows, backend)``: :func:`run_row` of every ``(route, compressor)`` in ``todo``, inside a one-rank
    :func:`process_group` on ``env``'s device, with a progress bar (``progress``)."""
    rows: List[Dict[str, Any]] = []
    bar = report.progress_bar(len(todo), "bench train-step", "row", progress)
    try:
        with process_group(env.cuda) as backend:
            for route, compressor in todo:
                row = run_row(env, route, compressor, steps, warmup)
                rows.append(row)
                if row["error"]:
                    report.say(bar, f"bench train-step: {route} {compressor} failed: {row['error']}")
                    bar.set_postfix_str(f"{route} {compressor}: error")
                else:
                    bar.set_postfix_str(f"{route} {compressor}: {row['median_ms']:.2f} ms")
                bar.update()
    finally:
        bar.close()
    return rows, backend


def _settings(
    workload: Workload,
    device: str,
    machine: Dict[str, Any],
    backend: str,
    steps: int,
    warmup: int,
    ratio: float,
    compressors: Sequence[str],
    routes: Sequence[str],
    dropin_comm: str,
    hvd: Any,
    horovod_note: Optional[str],
) -> Dict[str, Any]:
    """The results' ``settings``: what ran (model, device, options, Horovod) and how it was measured."""
    import torch

    cuda = device == "cuda"
    return {
        "model": workload.name,
        "model_description": workload.description,
        "parameters": workload.parameter_count,
        "batch": workload.batch,
        "device": device,
        "device_name": machine["devices"][device],
        "torch_version": torch.__version__,
        "world_size": 1,
        "backend": backend,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "steps": steps,
        "warmup": warmup,
        "ratio": ratio,
        "compressors": list(compressors),
        "routes": [r for r in ROUTES if r in routes or r == BASELINE],
        "dropin_comm": dropin_comm,
        "horovod": None if hvd is None else getattr(sys.modules.get("horovod"), "__version__", "?"),
        "horovod_note": horovod_note,
        "optimizer": f"SGD lr {LR:g} momentum 0.9",
        "powersgd": {"matrix_approximation_rank": POWERSGD_RANK, "start_powerSGD_iter": POWERSGD_START},
        "statistic": "median and min of the timed full steps (time.perf_counter"
        + ("; torch.cuda.synchronize() before and after each)" if cuda else ")"),
        "ratio_column": f"median_ms / the {BASELINE} row's median_ms (same run)",
        "host_syncs": (
            "torch.cuda.set_sync_debug_mode('warn') warnings over one steady-state step"
            if cuda
            else "host reads (count_host_reads: item, tolist, bool, int, float, index, numpy, "
            "cpu of device tensors) over one steady-state step"
        ),
        "peak_mem": (
            "torch.cuda.max_memory_allocated() over the row, after reset_peak_memory_stats()"
            if cuda
            else "growth of the process peak RSS over the row (VmHWM reset via /proc/self/clear_refs "
            "minus VmRSS at the row's start); null where unavailable"
        ),
    }


def _ratios(rows: List[Dict[str, Any]]) -> None:
    """Fill ``ratio`` and ``overhead_ms`` against the ``ddp`` row (left None if it failed)."""
    base = next((r for r in rows if r["route"] == BASELINE and r["median_ms"]), None)
    if base is None:
        return
    for row in rows:
        if row["median_ms"] is not None:
            row["ratio"] = row["median_ms"] / base["median_ms"]
            row["overhead_ms"] = row["median_ms"] - base["median_ms"]


# ================================================================= output
def save(
    results: Dict[str, Any],
    json_path: Optional[str],
    plot_path: Optional[str],
    plot: Optional[Callable] = None,
) -> None:
    """Write the JSON and, with ``plot(results, path)`` (default :func:`write_plot`), the PNG."""
    import json

    for path in (json_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    if plot_path:
        (plot or write_plot)(results, Path(plot_path))


def _fmt(value: Optional[float], spec: str, width: int) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(
        f"\nTraining step, {s['model_description']}; {s['device_name']} ({s['backend']}, world size 1), "
        f"torch {s['torch_version']}; median of {s['steps']} steps after {s['warmup']}; "
        f"ratio {s['ratio']:g} for the sparsifiers"
    )
    say(f"  {'route':<22} {'compressor':<12} {'median ms':>10} {'ratio':>7} {'overhead ms':>12} {'syncs':>6}")
    for r in results["rows"]:
        if r["error"]:
            say(f"  {r['route']:<22} {r['compressor']:<12} error: {r['error']}")
            continue
        say(
            f"  {r['route']:<22} {r['compressor']:<12} {_fmt(r['median_ms'], '.2f', 10)} "
            f"{_fmt(r['ratio'], '.2f', 6)}x {_fmt(r['overhead_ms'], '+.2f', 12)} "
            f"{_fmt(r['host_syncs_per_step'], 'd', 6)}"
        )
    for skipped in results["skipped"]:
        say(f"  {skipped['route']:<22} {skipped['compressor']:<12} {skipped['note']}")
    say(f"  ratio: median / {BASELINE}'s; syncs per step: {s['host_syncs']}")


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Ratio to ``ddp`` on a log scale: torch's routes on the left, ours per compressor on the right."""
    plt = report.pyplot()
    rows = [r for r in results["rows"] if r["ratio"] is not None]
    torch_rows = [r for r in rows if r["route"] not in OUR_ROUTES]
    ours = [r for r in rows if r["route"] in OUR_ROUTES]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2]}, sharey=True)
    if torch_rows:
        ratios = [("torch", [r["ratio"] for r in torch_rows])]
        report.ratio_bars(axes[0], [r["route"] for r in torch_rows], ratios)
        axes[0].tick_params(axis="x", labelrotation=30)
    axes[0].set_title("torch routes")
    names = list(dict.fromkeys(r["compressor"] for r in ours))
    routes = list(dict.fromkeys(r["route"] for r in ours))
    if ours:
        by_key = {(r["route"], r["compressor"]): r["ratio"] for r in ours}
        groups = [(route, [by_key.get((route, n), float("nan")) for n in names]) for route in routes]
        report.ratio_bars(axes[1], names, groups)
        axes[1].legend(fontsize="small")
    axes[1].set_title("ours, per compressor")
    for ax in axes:
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel(f"step time / {BASELINE} step time")
    s = results["settings"]
    fig.suptitle(f"Training step vs DDP allreduce: {s['model']} batch {s['batch']} on {s['device_name']}")
    report.save_figure(fig, path)


__all__ = [
    "run",
    "handwritten_topk_hook",
    "HandwrittenTopKState",
    "Workload",
    "plan",
    "build_route",
    "Environment",
    "init_horovod",
    "process_group",
    "MODELS",
    "COMPRESSORS",
    "ROUTES",
]
