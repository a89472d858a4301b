"""Selection microbenchmark: the sparsifiers' selection of one gradient against the memory floor and
``torch.topk``: ``python -m benchmarks select``.

For each size ``n`` (default 25.6M and 124M elements: ResNet-50's and GPT-2 small's parameter
counts) and density (default 1% and 0.1%, ``k = ceil(ratio n)``), every row times one call
on a float32 gradient ``g`` and a residual ``r`` (:func:`benchmarks.compress.gradient`, heavy
tailed; ``r`` a smaller draw of the same law), median of ``repeats`` after a few untimed calls:

* ``copy``: ``out.copy_(g)``, reading and writing ``n`` floats: the floor of any pass;
* ``torch.topk``: ``torch.topk(|g + r|, k)`` (unsorted), the plain error-feedback selection;
* ``topk``: the library's Top-k as the routes run it: the launch of one bucket holding the
  gradient, as the drop-in optimizer launches each of its buckets
  (:func:`~hvd_compress.engine.exchange.open_exchange`, ``add``, ``launch``: the fused
  bucket's :meth:`~hvd_compress.engine.fused.FusedBucket.launch`) on a world of one
  (:class:`~hvd_compress.transport.communicator.SingleProcessCommunicator`, whose collectives
  hand back their input): the bucket's copy of the gradient, ``a = g + r``, the scores, the
  exact selection (:class:`~hvd_compress.kernels.torch_rows.Rows`: ``torch.topk`` of the
  scores' bits, ties to the lower index), the values, the residual, the message. The
  residual is the one a first, untimed step left; timed launches are never finished, so
  every call starts from the same state;
* ``gaussiank``: the same for Gaussian-k (moments, the counts of its thresholds, one marking
  pass, compaction into ``floor(4k/3)`` slots);
* ``topk-reuse``: the same for Top-k at a step between exact selections (``exact_every > 1``): one
  marking pass against the kept threshold, the cumulative count (each row's count, the next
  threshold), compaction into ``k`` slots, and each row's largest score (the non-finite flag); a
  run with ``exact_every=T`` pays ``topk`` once in ``T`` steps and this row in the others.

``vs_copy`` and ``vs_topk`` are each row's time over the ``copy`` and ``torch.topk`` rows of the
same size and density. Timing: CUDA events around each call on a GPU (the host launches,
the events time the device), ``time.perf_counter`` on the CPU. ``code_path="accelerator"``
runs the library's rows on the CPU through
:func:`~hvd_compress.kernels.torch_ops.accelerator_path` (the kernels a GPU runs; by default
the CPU takes the routes' CPU way, numpy's selection).

A row is one entry of :data:`ROWS`: a name, what it measures, and a function of a
:class:`Case` returning the call to time (set-up outside the call). Outputs: ``select.json`` and
``select.png`` (``name``: another stem; the PNG shows the time over the copy floor per row and
case) and a table.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks.compress import format_size, gradient
from benchmarks.output import publish
from benchmarks.report import machine, progress_bar, pyplot, ratio_bars, require, save_figure

#: ResNet-50's and GPT-2 small's parameter counts, rounded as the issue states them.
DEFAULT_SIZES = (25_600_000, 124_000_000)
DEFAULT_RATIOS = (0.01, 0.001)
DEFAULT_REPEATS = 20
WARMUP_CALLS = 3
CODE_PATHS = ("route", "accelerator")
#: The residual's scale relative to the gradient (a residual holds what earlier steps left).
RESIDUAL_SCALE = 0.3
#: ``exact_every`` of the ``topk-reuse`` row: after the first (finished, exact) step every timed launch
#: selects by the kept threshold; a run with ``exact_every=T`` pays the ``topk`` row once in T steps.
REUSE_FOREVER = 2**62


class Case:
    """One measurement's inputs: ``g`` and ``r`` (float32, ``n`` elements, on ``device``), ``k`` of
    ``ratio``; ``torch`` the module."""

    def __init__(self, torch: Any, device: str, n: int, ratio: float, seed: int) -> None:
        from hvd_compress.kernels.reference import num_selected

        self.torch, self.device, self.n, self.ratio = torch, device, n, ratio
        self.k = num_selected(n, ratio)
        self.g = torch.from_numpy(gradient(n, seed)).to(device)
        self.r = torch.from_numpy(gradient(n, seed + 1)).mul_(RESIDUAL_SCALE).to(device)


# ------------------------------------------------------------------ rows
def copy_floor(case: Case) -> Callable[[], Any]:
    out = case.torch.empty_like(case.g)
    return lambda: out.copy_(case.g)


def torch_topk(case: Case) -> Callable[[], Any]:
    torch = case.torch
    return lambda: torch.topk(torch.add(case.g, case.r).abs_(), case.k, sorted=False)


def engine(name: str, **options: Any) -> Callable[[Case], Callable[[], Any]]:
    """The drop-in's exchange of one bucket holding the gradient, compressor ``name`` with ``options``
    (module docstring)."""
    def row(case: Case) -> Callable[[], Any]:
        from hvd_compress.transport.communicator import SingleProcessCommunicator
        from hvd_compress.engine.exchange import open_exchange
        from hvd_compress.algorithms import Compression
        from hvd_compress.algorithms.state import CompressorState

        compressor = Compression.by_name(name, case.ratio, dense_below=0, **options)
        comm, run = SingleProcessCommunicator(), CompressorState()

        def launch(g: Any) -> Any:
            exchange = open_exchange(compressor, comm, f"select.{name}", run)
            exchange.add("g", g)
            exchange.launch()
            return exchange

        launch(case.r).finish()  # a first step: the bucket is planned and keeps r's residual
        return lambda: launch(case.g)  # never finished: every call starts from that residual

    return row


#: ``name -> (what it measures, the function of a Case returning the call to time)``, in table order.
ROWS: Dict[str, Tuple[str, Callable[[Case], Callable[[], Any]]]] = {
    "copy": ("out.copy_(g): read and write n floats", copy_floor),
    "torch.topk": ("torch.topk(|g + r|, k, sorted=False)", torch_topk),
    "topk": ("launch of a one-tensor bucket, Top-k: copy, a = g + r, exact selection, values, residual",
             engine("topk")),
    "gaussiank": ("launch of a one-tensor bucket, Gaussian-k: copy, a = g + r, moments, counts, marks, "
                  "values, residual", engine("gaussiank")),
    "topk-reuse": ("launch of a one-tensor bucket, Top-k between exact selections (exact_every > 1): copy, "
                   "a = g + r, one mark against the kept threshold, the cumulative count, values, residual",
                   engine("topk", exact_every=REUSE_FOREVER)),
}
BASELINES = ("copy", "torch.topk")


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
    times = []
    for _ in range(repeats):
        gc.collect()  # an unfinished launch's buffers (a step's finish frees them at once)
        times.append(ms(fn))
    return statistics.median(times)


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
    plot: bool = True,
    progress: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Time every row at every (size, density), write ``<name>.json`` and ``<name>.png`` to ``out``,
    print the table; returns the results. ``device`` None: CUDA when available, else the CPU."""
    torch = require("torch", "torch")
    if plot and out:
        require("matplotlib", "bench")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = list(dict.fromkeys([*BASELINES, *rows]))  # the baselines always: the ratios need them
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
                case = Case(torch, device, n, ratio, seed)
                for row in names:
                    bar.set_postfix_str(f"{format_size(n)} {ratio:g} {row}")
                    measured.append({"size": n, "ratio": ratio, "k": case.k, "row": row,
                                     "ms": median_ms(ROWS[row][1](case), int(repeats), ms, sync)})
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
    """Each row's ``vs_copy`` and ``vs_topk``: its time over the baselines' of the same size and density."""
    base = {(r["size"], r["ratio"], r["row"]): r["ms"] for r in rows if r["row"] in BASELINES}
    for r in rows:
        for field, baseline in (("vs_copy", "copy"), ("vs_topk", "torch.topk")):
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
    say(f"  {'size':>7} {'density':>8} {'k':>9} {'row':<12} {'ms':>9} {'/copy':>8} {'/topk':>7}")
    for r in results["rows"]:
        say(
            f"  {format_size(r['size']):>7} {r['ratio']:>8g} {r['k']:>9} {r['row']:<12} {r['ms']:>9.3f} "
            f"{r['vs_copy']:>7.1f}x {r['vs_topk']:>6.2f}x"
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
