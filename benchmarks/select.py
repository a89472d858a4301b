"""Exchange microbenchmark: each compressor's whole exchange of one gradient, eager and compiled, against a
copy of it and ``torch.topk``: ``python -m benchmarks select``.

For each size ``n`` (default 11.7M and 25.6M elements: a 1.9M-parameter model's six-fold, ResNet-50's
parameter count) and density (default 1% and 0.1%, ``k = ceil(ratio n)``), every row times one call
on a float32 gradient ``g`` (:func:`benchmarks.compress.gradient`, heavy tailed), median of ``repeats``
after a few untimed calls:

* ``copy``: ``out.copy_(g)`` into a kept buffer, reading and writing ``n`` floats: the floor of any pass;
* ``clone``: ``g.clone()``, a copy into a new buffer (the page faults of a fresh one included): what a
  step that allocates its output pays at least;
* ``torch.topk``: ``torch.topk(|g + r|, k)`` (unsorted, ``r`` a residual-sized draw), the plain
  error-feedback selection;
* a compressor's row (``none``, ``topk``, ``regtopk``, ``gaussiank``, ``terngrad``, ``topk-mc``:
  ``momentum=0.9``, ``topk-reuse``: ``exact_every=32``, ``topk-aggregate``: ``indices="aggregate"``),
  twice: ``eager`` and ``compiled``
  (``HVD_COMPRESS_COMPILE`` 0 and 1 around its calls: the fused passes of
  :mod:`hvd_compress.kernels.torch_compiled`): one whole exchange of a bucket holding the gradient, as
  the drop-in optimizer runs each of its buckets (:func:`~hvd_compress.engine.exchange.open_exchange`,
  ``add``, ``launch``, ``finish``) on a world of one
  (:class:`~hvd_compress.transport.communicator.SingleProcessCommunicator`, whose collectives hand back
  their input): the bucket's copy of the gradient, error feedback, the selection (or the codes), the
  message, the decode and the average. Each call is a step of its own: the residual (and a reused
  threshold, RegTop-k's posterior, the aggregate rule's rates) carry from step to step, as in training;
  ``first_step_ms`` is the row's first call (a compiled row's compilation, whatever the earlier rows
  left compiled, included).

``bucket="resnet50"`` (``--bucket``): each exchange's bucket holds ResNet-50's 161 parameter tensors instead,
views of one 25.6M-element gradient (the baselines time that gradient), the small ones dense by the
compressors' default: what a model's bucket costs beyond one tensor's (a copy per tensor into the bucket).

``vs_copy``, ``vs_clone`` and ``vs_topk`` are each row's time over the ``copy``, ``clone`` and
``torch.topk`` rows of the same size and density. Timing: CUDA events around each call on a GPU (the
host launches, the events time the device), ``time.perf_counter`` on the CPU. ``code_path="accelerator"``
runs the library's rows on the CPU through :func:`~hvd_compress.kernels.torch_ops.accelerator_path`
(the kernels a GPU runs; by default the CPU takes the routes' CPU way).

A row is one entry of :data:`ROWS`: a name, what it measures, and a function of a :class:`Case`
returning the call to time (set-up outside the call). Outputs: ``select.json`` and ``select.png``
(``name``: another stem; the PNG shows the time over the copy floor per row and case) and a table.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.compress import format_size, gradient
from benchmarks.shapes import resnet50_shapes
from benchmarks.output import publish
from benchmarks.report import machine, progress_bar, pyplot, ratio_bars, require, save_figure

#: six times the 1.9M-parameter CNN of the time-to-accuracy study, and ResNet-50's parameter count
DEFAULT_SIZES = (11_700_000, 25_600_000)
DEFAULT_RATIOS = (0.01, 0.001)
DEFAULT_REPEATS = 20
#: what a compressor row's bucket holds (:class:`Case`): its tensors' ``(name, shape)``, none for the one gradient
BUCKETS: Dict[str, Callable[[], List[Tuple[str, Tuple[int, ...]]]]] = {"one": list, "resnet50": resnet50_shapes}
WARMUP_CALLS = 3
CODE_PATHS = ("route", "accelerator")
#: The residual's scale relative to the gradient (a residual holds what earlier steps left).
RESIDUAL_SCALE = 0.3


def bucket_size(bucket: str, n: int) -> int:
    """Elements a compressor row's bucket holds: ``n`` for the one gradient, else its tensors' total."""
    shapes = BUCKETS[bucket]()
    return sum(math.prod(shape) for _, shape in shapes) if shapes else n


class Case:
    """One measurement's inputs: ``g`` and ``r`` (float32, ``n`` elements, on ``device``), ``k`` of
    ``ratio``; ``torch`` the module. ``tensors``: what a compressor row's bucket holds, ``(name, tensor)``:
    ``g`` itself (``bucket="one"``), or with ``bucket="resnet50"`` ResNet-50's 161 parameter tensors as
    views of ``g`` (``n`` is then their 25,557,032 elements)."""

    def __init__(self, torch: Any, device: str, n: int, ratio: float, seed: int, bucket: str = "one") -> None:
        from hvd_compress.kernels.reference import num_selected

        shapes, n = BUCKETS[bucket](), bucket_size(bucket, n)
        self.torch, self.device, self.n, self.ratio, self.bucket = torch, device, n, ratio, bucket
        self.k = num_selected(n, ratio)
        self.g = torch.from_numpy(gradient(n, seed)).to(device)
        self.r = torch.from_numpy(gradient(n, seed + 1)).mul_(RESIDUAL_SCALE).to(device)
        views, start = [], 0
        for name, shape in shapes:
            views.append((name, self.g[start : start + math.prod(shape)].view(shape)))
            start += math.prod(shape)
        self.tensors: List[Tuple[str, Any]] = views or [("g", self.g)]
        #: a compressor row's first call (ms), set by its set-up
        self.first_ms: Optional[float] = None


# ------------------------------------------------------------------ rows
def copy_floor(case: Case) -> Callable[[], Any]:
    out = case.torch.empty_like(case.g)
    return lambda: out.copy_(case.g)


def clone(case: Case) -> Callable[[], Any]:
    return lambda: case.g.clone()


def torch_topk(case: Case) -> Callable[[], Any]:
    torch = case.torch
    return lambda: torch.topk(torch.add(case.g, case.r).abs_(), case.k, sorted=False)


@contextlib.contextmanager
def compiling(on: bool) -> Any:
    """``HVD_COMPRESS_COMPILE`` set to 1 (``on``) or 0 for the block."""
    from hvd_compress.kernels.torch_compiled import COMPILE_ENV

    saved = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[COMPILE_ENV]
        else:
            os.environ[COMPILE_ENV] = saved


def engine(name: str, compiled: bool = False, **options: Any) -> Callable[[Case], Callable[[], Any]]:
    """A whole exchange of one bucket holding the gradient, compressor ``name`` with ``options``, eager or
    ``compiled`` (module docstring); the row's first call is timed into ``case.first_ms``."""
    def row(case: Case) -> Callable[[], Any]:
        from hvd_compress.transport.communicator import SingleProcessCommunicator
        from hvd_compress.engine.exchange import open_exchange
        from hvd_compress.algorithms import Compression
        from hvd_compress.algorithms.state import CompressorState

        # one gradient is compressed whatever its size; a model's bucket keeps the default (small tensors dense)
        every_tensor = {} if name == "none" or case.bucket != "one" else {"dense_below": 0}
        compressor = Compression.by_name(name, case.ratio, **every_tensor, **options)
        comm, run = SingleProcessCommunicator(), CompressorState()

        def step() -> Any:
            with compiling(compiled):
                exchange = open_exchange(compressor, comm, f"select.{name}", run)
                for tensor_name, tensor in case.tensors:
                    exchange.add(tensor_name, tensor)
                exchange.launch()
                return exchange.finish()

        started = time.perf_counter()
        step()
        case.first_ms = 1e3 * (time.perf_counter() - started)
        return step

    return row


def _engine_rows() -> Dict[str, Tuple[str, Callable[[Case], Callable[[], Any]]]]:
    kinds = {
        "none": ("NoneCompressor: the bucket's copy, the allreduce, the average", {}),
        "topk": ("Top-k: a = g + r, the exact selection, values, residual, decode", {}),
        "regtopk": ("RegTop-k: Top-k of the posterior's scores", {}),
        "gaussiank": ("Gaussian-k: moments, the counts of its thresholds, one marking pass", {}),
        "terngrad": ("TernGrad: scales, draws, codes, packing, decode", {}),
        "topk-mc": ("Top-k with momentum correction: u = m u + g, a = u + r, u[S] = 0", {"momentum": 0.9}),
        "topk-reuse": ("Top-k, exact_every=32: a step between exact ones", {"exact_every": 32}),
        "topk-aggregate": ("Top-k, indices='aggregate': the rate x age scores, an allreduce", {"indices": "aggregate"}),
    }
    rows = {}
    for key, (what, options) in kinds.items():
        name = key.split("-")[0]
        for mode in ("eager", "compiled"):
            rows[f"{key}/{mode}"] = (f"{what} ({mode})", engine(name, mode == "compiled", **options))
    return rows


#: ``name -> (what it measures, the function of a Case returning the call to time)``, in table order.
ROWS: Dict[str, Tuple[str, Callable[[Case], Callable[[], Any]]]] = {
    "copy": ("out.copy_(g): read and write n floats", copy_floor),
    "clone": ("g.clone(): a copy into a new buffer", clone),
    "torch.topk": ("torch.topk(|g + r|, k, sorted=False)", torch_topk),
    **_engine_rows(),
}
BASELINES = ("copy", "clone", "torch.topk")


# ---------------------------------------------------------------- timing
def timer(torch: Any, device: str) -> Callable[[Callable[[], Any]], float]:
    """Milliseconds of one call: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if device == "cuda":
        def cuda_ms(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return cuda_ms

    def cpu_ms(fn: Callable[[], Any]) -> float:
        started = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - started)

    return cpu_ms


def median_ms(fn: Callable[[], Any], repeats: int, ms: Callable[[Callable[[], Any]], float],
              sync: Callable[[], None]) -> float:
    for _ in range(WARMUP_CALLS):
        fn()
    sync()
    return statistics.median(ms(fn) for _ in range(repeats))


# ------------------------------------------------------------------- run
def _check(device: str, sizes: Sequence[int], ratios: Sequence[float], repeats: int, rows: Sequence[str],
           code_path: str, torch: Any) -> None:
    from hvd_compress.algorithms.base import check_ratio

    if device not in ("cpu", "cuda"):
        raise ValueError(f"hvd_compress: device must be cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("hvd_compress: --device cuda asked for, but torch.cuda.is_available() is False")
    if not sizes or min(sizes) < 1:
        raise ValueError(f"hvd_compress: sizes must be positive, got {list(sizes)}")
    if not ratios:
        raise ValueError("hvd_compress: give at least one density")
    for ratio in ratios:
        check_ratio(ratio)
    if int(repeats) < 1:
        raise ValueError(f"hvd_compress: repeats must be at least 1, got {repeats}")
    for name in rows:
        if name not in ROWS:
            raise ValueError(f"hvd_compress: unknown row {name!r}; choose from {', '.join(ROWS)}")
    if code_path not in CODE_PATHS:
        raise ValueError(f"hvd_compress: code_path must be one of {', '.join(CODE_PATHS)}, got {code_path!r}")


def run(
    device: Optional[str] = None,
    sizes: Sequence[int] = DEFAULT_SIZES,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    repeats: int = DEFAULT_REPEATS,
    rows: Sequence[str] = tuple(ROWS),
    code_path: str = "route",
    seed: int = 0,
    out: Optional[str] = "results",
    name: str = "select",
    bucket: str = "one",
    plot: bool = True,
    progress: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Time every row at every (size, density), write ``<name>.json`` and ``<name>.png`` to ``out``,
    print the table; returns the results. ``device`` None: CUDA when available, else the CPU. ``bucket``:
    what a compressor row's bucket holds (:data:`BUCKETS`; ``resnet50``: ResNet-50's tensors, ``sizes``
    left aside)."""
    torch = require("torch", "torch")
    if plot and out:
        require("matplotlib", "bench")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(dict.fromkeys([*BASELINES, *rows]))  # the baselines always: the ratios need them
    if bucket not in BUCKETS:
        raise ValueError(f"hvd_compress: bucket must be one of {', '.join(BUCKETS)}, got {bucket!r}")
    sizes = sorted({bucket_size(bucket, n) for n in sizes})
    _check(device, sizes, ratios, repeats, names, code_path, torch)
    ms = timer(torch, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    path = contextlib.nullcontext
    if code_path == "accelerator":
        from hvd_compress.kernels.torch_ops import accelerator_path as path

    cases = [(int(n), float(ratio)) for n in sorted(set(sizes)) for ratio in ratios]
    bar = progress_bar(len(cases) * len(names), "bench select", "meas", progress)
    measured: List[Dict[str, Any]] = []
    started = time.perf_counter()
    try:
        with torch.no_grad(), path():
            for n, ratio in cases:
                case = Case(torch, device, n, ratio, seed, bucket)
                for row in names:
                    bar.set_postfix_str(f"{format_size(n)} {ratio:g} {row}")
                    case.first_ms = None
                    call = ROWS[row][1](case)
                    measured.append({"size": n, "ratio": ratio, "k": case.k, "row": row,
                                     "ms": median_ms(call, int(repeats), ms, sync), "first_step_ms": case.first_ms})
                    call = None
                    bar.update()
                case = None
                if device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        bar.close()
    _ratios(measured)
    results = {
        "benchmark": "select",
        "machine": machine(torch, [device]),
        "settings": {
            "device": device,
            "sizes": sorted(set(int(n) for n in sizes)),
            "ratios": list(ratios),
            "repeats": int(repeats),
            "warmup_calls": WARMUP_CALLS,
            "code_path": code_path,
            "bucket": bucket if bucket == "one" else f"{bucket}: its {len(BUCKETS[bucket]())} parameter tensors, "
            "small ones dense (the compressors' default dense_below)",
            "timing": "CUDA events around each call" if device == "cuda" else "time.perf_counter around each call",
            "statistic": "median ms of one call",
            "gradient": "float32, benchmarks.compress.gradient (normal, 1e-3 heavy tail); "
            f"residual {RESIDUAL_SCALE:g} x another draw",
            "rows": {row: ROWS[row][0] for row in names},
        },
        "wall_seconds": time.perf_counter() - started,
        "rows": measured,
    }
    return publish(results, out, name, write_plot if plot else None, print_table, stdout)


def _ratios(rows: List[Dict[str, Any]]) -> None:
    """Each row's ``vs_copy``, ``vs_clone`` and ``vs_topk``: its time over the baselines' of the same size
    and density."""
    base = {(r["size"], r["ratio"], r["row"]): r["ms"] for r in rows if r["row"] in BASELINES}
    for r in rows:
        for field, baseline in (("vs_copy", "copy"), ("vs_clone", "clone"), ("vs_topk", "torch.topk")):
            reference = base.get((r["size"], r["ratio"], baseline))
            r[field] = r["ms"] / reference if reference else None


# ---------------------------------------------------------------- output
def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s, m = results["settings"], results["machine"]
    say(
        f"\nSelection of one float32 gradient, {m['devices'][s['device']]} ({s['device']}, torch "
        f"{m['torch_version']}, {s['code_path']} code path); median of {s['repeats']} ({s['timing']})"
    )
    say(f"  {'size':>7} {'density':>8} {'k':>9} {'row':<26} {'ms':>9} {'/copy':>8} {'/clone':>7} {'/topk':>7}"
        f" {'first ms':>9}")
    for r in results["rows"]:
        first = "" if r.get("first_step_ms") is None else f"{r['first_step_ms']:9.0f}"
        say(
            f"  {format_size(r['size']):>7} {r['ratio']:>8g} {r['k']:>9} {r['row']:<26} {r['ms']:>9.3f} "
            f"{r['vs_copy']:>7.1f}x {r['vs_clone']:>6.2f}x {r['vs_topk']:>6.2f}x {first}"
        )
    for name, what in s["rows"].items():
        say(f"  {name}: {what}")


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Time over the copy floor (log scale): a cluster of bars per row, one bar per (size, density)."""
    plt = pyplot()
    rows = results["rows"]
    names = list(dict.fromkeys(r["row"] for r in rows))
    cases = list(dict.fromkeys((r["size"], r["ratio"]) for r in rows))
    by_key = {(r["row"], r["size"], r["ratio"]): r["vs_copy"] for r in rows}
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * len(names), 4.2))
    groups = [(f"{format_size(n)}, {ratio:g}", [by_key.get((name, n, ratio), float("nan")) for name in names])
              for n, ratio in cases]
    ratio_bars(ax, names, groups)
    ax.legend(title="elements, density", fontsize="small")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.set_ylabel("time / copy of n floats")
    s = results["settings"]
    fig.suptitle(f"Selection vs the copy floor on {results['machine']['devices'][s['device']]} ({s['device']})")
    save_figure(fig, path)


__all__ = ["run", "ROWS", "Case", "engine", "DEFAULT_SIZES", "DEFAULT_RATIOS"]
