"""Full training-step time of every exchange route, one process (world size 1), CPU or GPU:
``python -m benchmarks train-step``.

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
Rows: the routes of :mod:`benchmarks.routes` (``local``, ``ddp``, the
baseline: ``ratio`` = median / ddp's median, ``overhead_ms`` = median - ddp's
median; ``ddp+fp16``, ``ddp+handwritten-topk``, and ``ours-ddp-hook``,
``ours-dropin``, ``ours-stock-horovod`` per compressor), plus

* ``ddp+powersgd``: torch's ``powerSGD_hook``, rank 4, from iteration
  ``POWERSGD_START`` on (that row warms up past it). On gloo (CPU) this row
  puts all gradients in one DDP bucket: the hook waits on collectives inside
  its future callbacks, which gloo runs on its two worker threads, so two
  buckets doing so at once deadlock (seen intermittently).

``host_syncs_per_step`` is measured over one more steady-state step: on CUDA
the warnings of ``torch.cuda.set_sync_debug_mode("warn")``; on the CPU the
host reads of :func:`benchmarks.host_reads.count_host_reads` (``item``,
``tolist``, ``bool(t)`` ...: the places a GPU run would wait). Every row also
records that counter's reads by kind and their call sites.

``--profile`` (``profile=True``): one more steady step per row under
``torch.profiler`` (:mod:`benchmarks.step_profile`): ``profile`` holds its
``kernels`` (CUDA: device events; CPU: innermost aten operator calls that launch
a kernel) and ``device_ms`` (CUDA: the device events' time; CPU: the aten
operators' self time), ``profile_added`` the same minus the ``local`` row's.

``peak_mem_mib``: CUDA, ``torch.cuda.max_memory_allocated()`` over the row
(statistics reset first; model, optimizer state and activations); CPU, the
growth of the process's peak RSS over the row (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``, minus the RSS at the row's start; null where
that is not possible): a rough number, as the allocator reuses freed memory.

A row that fails records its error and the benchmark goes on. Outputs: the
JSON (``rows``, ``skipped``, ``settings``, ``machine``), a PNG of the ratios
and a table. Models: ``resnet50`` (torchvision, 3x224x224, 1000 classes),
``gpt2`` (transformers' GPT-2 small, sequence 512, LM loss) and ``mlp``
(:class:`benchmarks.routes.MLPWorkload`, no extra package).
"""

from __future__ import annotations

import datetime
import functools
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.step_profile import METHOD, profile_step
from benchmarks import report
from benchmarks import routes as step_routes
from benchmarks.host_reads import count_host_reads
from benchmarks.routes import (
    BASELINE,
    DROPIN_COMMS,  # noqa: F401  (re-exported: the CLI offers its choices)
    LR,
    OUR_ROUTES,
    Environment,
    process_group,
    rows_to_run,
    torch_device,
)

MODELS = ("resnet50", "gpt2", "mlp")
#: ``auto-regtopk``: ``Auto(RegTopK)``, each bucket the cheaper way after measuring (world size 1: dense).
COMPRESSORS = ("none", "fp16", "topk", "gaussiank", "regtopk", "terngrad", "auto-regtopk")
POWERSGD = "ddp+powersgd"
#: Routes without one of our compressors: (route, what it exchanges); PowerSGD before the hand-written hook.
TORCH_ROUTES = step_routes.TORCH_ROUTES[:3] + ((POWERSGD, "powersgd-r4"),) + step_routes.TORCH_ROUTES[3:]
ROUTES = tuple(r for r, _ in TORCH_ROUTES) + OUR_ROUTES
DEFAULT_BATCH = {"resnet50": 64, "gpt2": 8, "mlp": step_routes.MLP_BATCH}
GPT2_SEQUENCE = 512
POWERSGD_RANK = 4
POWERSGD_START = 2
#: What the CUDA sync-debug warnings say (``c10::cuda::warn_or_error_on_sync``).
SYNC_WARNING = "synchronizing CUDA operation"
GLOO_POWERSGD_NOTE = (
    "one DDP bucket: torch's PowerSGD hook waits inside its gloo future callbacks, and two buckets "
    "doing so at once take both gloo worker threads (deadlock)"
)


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


class ModelWorkload:
    """torchvision's ResNet-50 or transformers' GPT-2 small and its loss on one fixed synthetic batch (the
    workload interface of :class:`benchmarks.routes.MLPWorkload`)."""

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
        else:
            self._transformers = _optional("transformers")
            vocab = self._transformers.GPT2Config().vocab_size
            shape = (batch, GPT2_SEQUENCE)
            self.inputs = torch.randint(0, vocab, shape, generator=generator).to(device)
            self.description = (
                f"GPT-2 small (transformers), batch {batch} x {GPT2_SEQUENCE} random tokens, LM loss"
            )

    def build(self) -> Any:
        """A fresh model on the device, in training mode, with the same initial weights every time."""
        import torch

        torch.manual_seed(self.seed)
        if self.name == "resnet50":
            model = self._models.resnet50()
        else:
            model = self._transformers.GPT2LMHeadModel(self._transformers.GPT2Config())
        self.parameter_count = sum(p.numel() for p in model.parameters())
        return model.to(self.device).train()

    def loss(self, model: Any) -> Any:
        import torch

        if self.name == "gpt2":
            return model(input_ids=self.inputs, labels=self.inputs, use_cache=False).loss
        return torch.nn.functional.cross_entropy(model(self.inputs), self.labels)


def workload(model: str, device: Any, batch: int, seed: int) -> Any:
    """The workload of ``model``: :class:`ModelWorkload`, or the library's MLP."""
    if model == "mlp":
        return step_routes.MLPWorkload(device, batch, seed)
    if model in MODELS:
        return ModelWorkload(model, device, batch, seed)
    raise ValueError(f"hvd_compress: model must be one of {', '.join(MODELS)}, got {model!r}")


# =================================================================== routes
def build_route(env: Environment, route: str, compressor: str) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """:func:`benchmarks.routes.build_route`, and ``ddp+powersgd``: the step function of a row and
    what to record about it (``communicator``, ``min_warmup``, ``note``)."""
    if route != POWERSGD:
        return step_routes.build_route(env, route, compressor)
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    # torch's PowerSGD hook waits on collectives inside its future callbacks; gloo runs those callbacks on
    # its 2 worker threads, so two buckets waiting at once deadlock: on gloo that row uses one bucket.
    one_bucket = not env.cuda
    ddp = step_routes.ddp(env, env.workload.build(), one_bucket=one_bucket)
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START
    )
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    # time PowerSGD itself, not its allreduce warm-up
    info = {"communicator": "torch.distributed", "min_warmup": POWERSGD_START + 1}
    if one_bucket:
        info["note"] = GLOO_POWERSGD_NOTE
    return step_routes.step_fn(env, ddp, step_routes.sgd(ddp.parameters())), info


# ============================================================== measuring
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


def measure(step: Callable[[], None], steps: int, warmup: int, cuda: bool, profile: bool = False) -> Dict[str, Any]:
    """Median and minimum of ``steps`` timed steps after ``warmup``; host syncs of one more step; with
    ``profile``, :func:`benchmarks.step_profile.profile_step` of one more."""
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
    measured = {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "host_syncs_per_step": syncs,
        "host_reads": reads,
    }
    if profile:
        measured["profile"] = profile_step(step, cuda)
    return measured


def run_row(
    env: Environment, route: str, compressor: str, steps: int, warmup: int, profile: bool = False
) -> Dict[str, Any]:
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
        row.update(measure(step, steps, row["warmup"], env.cuda, profile))
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
    profile: bool = False,
) -> Dict[str, Any]:
    """Time every row, write the JSON and the PNG (when given), print the table; returns the results.

    ``profile``: each row also records ``profile`` (kernels and device milliseconds of one more steady
    step, :mod:`benchmarks.step_profile`) and ``profile_added`` (those minus the ``local`` row's)."""
    from hvd_compress.algorithms.base import check_ratio

    report.require_packages(torch=True, plots=plot_path is not None)
    import torch

    ratio = check_ratio(ratio)
    _check(model, device, steps, warmup, batch, routes, compressors)
    batch = int(batch) if batch is not None else DEFAULT_BATCH[model]
    dev = torch_device(device, dropin_comm)
    load = workload(model, dev, batch, seed)  # raises early when torchvision/transformers is missing
    hvd, horovod_note, todo, skipped = rows_to_run(plan(routes, compressors), routes, dropin_comm)

    started = time.perf_counter()
    env = Environment(load, ratio, hvd, dropin_comm)
    rows, backend = _time_rows(env, todo, steps, warmup, progress, profile)
    _ratios(rows)
    _profile_added(rows)

    machine = report.machine(torch, [device])
    results = {
        "benchmark": "train-step",
        "machine": machine,
        "settings": _settings(
            load, device, machine, backend, steps, warmup, ratio, compressors, routes, dropin_comm, hvd,
            horovod_note, profile,
        ),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "skipped": skipped,
    }
    step_routes.save(results, json_path, plot_path, write_plot)
    print_table(results, stdout)
    return results


def _time_rows(
    env: Environment, todo: Sequence[Tuple[str, str]], steps: int, warmup: int, progress: bool,
    profile: bool = False,
) -> Tuple[List[Dict[str, Any]], str]:
    """``(rows, backend)``: :func:`run_row` of every ``(route, compressor)`` in ``todo``, inside a one-rank
    :func:`process_group` on ``env``'s device, with a progress bar (``progress``)."""
    rows: List[Dict[str, Any]] = []
    bar = report.progress_bar(len(todo), "train-step", "row", progress)
    try:
        with process_group(env.cuda) as backend:
            for route, compressor in todo:
                row = run_row(env, route, compressor, steps, warmup, profile)
                rows.append(row)
                if row["error"]:
                    report.say(bar, f"train-step: {route} {compressor} failed: {row['error']}")
                    bar.set_postfix_str(f"{route} {compressor}: error")
                else:
                    bar.set_postfix_str(f"{route} {compressor}: {row['median_ms']:.2f} ms")
                bar.update()
    finally:
        bar.close()
    return rows, backend


def _settings(
    workload: Any,
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
    profile: bool = False,
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
        "profile": None if not profile else METHOD[device] + "; profile_added: minus the local row's",
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


def _profile_added(rows: List[Dict[str, Any]]) -> None:
    """``profile_added`` of every profiled row: its kernels and device ms minus the ``local`` row's."""
    local = next((r for r in rows if r["route"] == "local" and r.get("profile")), None)
    for row in rows:
        if local is not None and row.get("profile"):
            row["profile_added"] = {key: row["profile"][key] - local["profile"][key] for key in local["profile"]}


# ================================================================= output
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
    profiled = bool(s.get("profile"))
    device_ms = "GPU ms" if s["device"] == "cuda" else "op ms"
    say(
        f"  {'route':<22} {'compressor':<12} {'median ms':>10} {'ratio':>7} {'overhead ms':>12} {'syncs':>6}"
        + (f" {'kernels':>8} {device_ms:>8}" if profiled else "")
    )
    for r in results["rows"]:
        if r["error"]:
            say(f"  {r['route']:<22} {r['compressor']:<12} error: {r['error']}")
            continue
        profile = r.get("profile") or {}
        columns = f" {_fmt(profile.get('kernels'), 'd', 8)} {_fmt(profile.get('device_ms'), '.2f', 8)}"
        say(
            f"  {r['route']:<22} {r['compressor']:<12} {_fmt(r['median_ms'], '.2f', 10)} "
            f"{_fmt(r['ratio'], '.2f', 6)}x {_fmt(r['overhead_ms'], '+.2f', 12)} "
            f"{_fmt(r['host_syncs_per_step'], 'd', 6)}"
            + (columns if profiled else "")
        )
    for skipped in results["skipped"]:
        say(f"  {skipped['route']:<22} {skipped['compressor']:<12} {skipped['note']}")
    say(f"  ratio: median / {BASELINE}'s; syncs per step: {s['host_syncs']}")
    if profiled:
        say(f"  kernels, {device_ms}: {s['profile']}")


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


__all__ = ["run", "plan", "build_route", "workload", "ModelWorkload", "MODELS", "COMPRESSORS", "ROUTES"]
