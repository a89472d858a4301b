"""Compression cost: the time of one engine step on one rank against baselines measured in the same run.

For each device (torch CPU, CUDA when available) and gradient size, one step
of the bucket engine every route runs is timed for every compressor (median
of ``repeats``): :func:`~hvd_compress.engine.exchange.open_exchange` over a
world of one rank (:class:`~hvd_compress.transport.communicator.SingleProcessCommunicator`:
every collective hands back its input, so nothing is moved or copied), ``add``
the tensor, ``launch``, ``finish``: selection or quantization with error
feedback, the codec's wire tensors and their decode into the dense result.
Next to it two baselines on the same tensor: ``torch.topk(t.abs(), k)`` and one
memory pass ``t.abs().max()``. Results are ratios against those baselines, so
they compare across machines. A last section times the engine on numpy arrays
(the reference kernels, the MPI layer's path) at the smallest size against
numpy's own baselines (``argpartition`` and ``abs().max()``): the reference is
the specification, not the fast path. Density and bytes are what the step
handed to the collectives (``compressor.stats``: values and bytes sent).

Outputs (in ``out``): ``compress.json`` (machine and rows), ``compress.png``
(ratio vs ``torch.topk`` per compressor and size) and a table on stdout.

Speed is only measured here, never asserted: the targets
are printed next to the measured numbers.
"""

from __future__ import annotations

import functools
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.output import publish
from benchmarks.report import machine, progress_bar, pyplot, ratio_bars, require, save_figure
from hvd_compress.algorithms import Compression
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.kernels.reference import num_selected
from hvd_compress.transport.communicator import SingleProcessCommunicator

#: Default gradient sizes (elements): a ResNet-50-scale layer bucket up to a whole model.
DEFAULT_SIZES = (1_000_000, 11_700_000, 25_000_000)
#: Compressors timed, in table order.
COMPRESSORS = ("topk", "gaussiank", "regtopk", "terngrad", "fp16")
SPARSE = ("topk", "gaussiank", "regtopk")
#: Fraction of entries replaced by a heavy tail (10 * Student-t, 2 degrees of freedom).
HEAVY_TAIL_FRACTION = 1e-3
#: Untimed calls before each measurement, per device: on CUDA the first calls also load kernels
#: and grow the caching allocator.
WARMUP_CALLS = {"cpu": 1, "cuda": 3}
#: Seconds of matrix products before the first CUDA measurement: an idle GPU runs slower
#: until its clocks come up, which inflated the first (smallest) size's times.
GPU_WARMUP_SECONDS = 1.0

#: Targets printed next to the measurements (never asserted).
TARGETS = (
    # (compressor, ratio field, reference label, bound)
    ("gaussiank", "vs_topk", "torch.topk", 0.2),
    ("gaussiank", "vs_pass", "one pass", 3.0),
    ("regtopk", "vs_topk_compressor", "Top-k", 1.5),
)

NUMPY = "numpy"


# --------------------------------------------------------------------- options
def parse_size(text: str) -> int:
    """``"1M"``, ``"11.7M"``, ``"25m"``, ``"10k"``, ``"10_000"``, ``"1e6"``, ``"2G"`` to a number of elements."""
    match = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:[eE][0-9]+)?)\s*([kKmMgG]?)\s*", str(text))
    if not match:
        raise ValueError(f"hvd_compress: cannot read size {text!r}; use e.g. 1M, 11.7M, 25M or 10000")
    number = float(match.group(1).replace("_", ""))
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2).lower()]
    size = int(round(number * scale))
    if size < 1:
        raise ValueError(f"hvd_compress: size {text!r} must be at least 1 element")
    return size


def format_size(size: int) -> str:
    """``11_700_000`` -> ``"11.7M"``; small sizes as plain integers."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if size >= scale:
            return f"{size / scale:.4g}{unit}"
    return str(size)


# ------------------------------------------------------------------- workload
def gradient(size: int, seed: int = 0) -> np.ndarray:
    """Float32 standard normal with a small heavy tail (so the top 1% is not a plain Gaussian tail)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(size, dtype=np.float32)
    tail = max(1, int(size * HEAVY_TAIL_FRACTION))
    g[rng.integers(0, size, tail)] = (10.0 * rng.standard_t(2, tail)).astype(np.float32)
    return g


def _median_seconds(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _warm_up_gpu(torch: Any) -> None:
    x = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + GPU_WARMUP_SECONDS
    while time.perf_counter() < end:
        x @ x
        torch.cuda.synchronize()


def engine_step(compressor: Any, tensor: Any, name: str) -> Any:
    """One step of the bucket engine on a world of one rank: open the exchange, add ``tensor``,
    launch, finish; returns the result (the tensor as sent, decoded)."""
    exchange = open_exchange(compressor, SingleProcessCommunicator(), "bench")
    exchange.add(name, tensor)
    exchange.launch()
    return exchange.finish(average=True)[name]


def _density_and_bytes(compressor: Any, tensor: Any, name: str, numel: int) -> tuple:
    """Density (values sent / numel) and bytes sent of one more step (the statistics of
    ``compressor.stats``: what the step handed to the collectives)."""
    stats = compressor.stats
    values, nbytes = stats.values_sent, stats.bytes_sent
    engine_step(compressor, tensor, name)
    return (stats.values_sent - values) / numel, int(stats.bytes_sent - nbytes)


def _make(name: str, ratio: float) -> Any:
    options = {"dense_below": 0} if name in SPARSE + ("terngrad",) else {}
    return Compression.by_name(name, ratio, **options)


def _measure_section(
    backend: str,
    device: str,
    size: int,
    tensor: Any,
    baselines: Dict[str, Callable[[], Any]],
    sync: Callable[[], None],
    ratio: float,
    repeats: int,
    names: Sequence[str],
    bar: Any,
) -> tuple:
    """Baseline times and one row per compressor for one (device, size)."""
    label = f"{NUMPY if backend == NUMPY else device} {format_size(size)}"
    warmups = WARMUP_CALLS.get(device, 1)
    baseline_s = {}
    for key, fn in baselines.items():
        bar.set_postfix_str(f"{label} baseline {key}")
        for _ in range(warmups):
            fn()
        baseline_s[key] = _median_seconds(fn, repeats, sync)
        bar.update()
    rows = []
    topk_compressor_s = None
    for name in names:
        bar.set_postfix_str(f"{label} {name}")
        compressor = _make(name, ratio)  # fresh per size: no state from another tensor
        tensor_name = f"bench.{size}"
        for _ in range(warmups):  # the first step builds the plan and checks the layout; residuals now exist
            engine_step(compressor, tensor, tensor_name)
        seconds = _median_seconds(lambda: engine_step(compressor, tensor, tensor_name), repeats, sync)
        density, nbytes = _density_and_bytes(compressor, tensor, tensor_name, size)
        dense_bytes = 4 * size
        row = {
            "backend": backend,
            "device": device,
            "size": size,
            "compressor": name,
            "ratio": ratio if name in SPARSE else None,
            "k": num_selected(size, ratio) if name in SPARSE else None,
            "seconds": seconds,
            "vs_topk": seconds / baseline_s["topk"],
            "vs_pass": seconds / baseline_s["pass"],
            "density": density,
            "payload_bytes": nbytes,
            "dense_bytes": dense_bytes,
            "bytes_vs_dense": nbytes / dense_bytes,
        }
        if name == "topk":
            topk_compressor_s = seconds
        rows.append(row)
        compressor = None  # free before the next compressor (its buffers)
        bar.update()
    for row in rows:
        row["vs_topk_compressor"] = row["seconds"] / topk_compressor_s if topk_compressor_s else None
    baseline = {
        "backend": backend,
        "device": device,
        "size": size,
        "k": num_selected(size, ratio),
        "topk_s": baseline_s["topk"],
        "pass_s": baseline_s["pass"],
    }
    return baseline, rows


# ----------------------------------------------------------------------- run
def run(
    sizes: Sequence[int] = DEFAULT_SIZES,
    ratio: float = 0.01,
    repeats: int = 5,
    device: str = "all",
    out: Optional[str] = "results",
    numpy_section: bool = True,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Measure, write ``compress.json`` and ``compress.png`` to ``out``, print the table; returns the results."""
    from hvd_compress.algorithms.base import check_ratio

    torch = require("torch", "torch")
    if plot and out is not None:
        require("matplotlib", "bench")
    ratio = check_ratio(ratio)
    sizes = sorted({int(s) for s in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"hvd_compress: sizes must be positive, got {list(sizes)}")
    if int(repeats) < 1:
        raise ValueError(f"hvd_compress: repeats must be at least 1, got {repeats}")
    repeats = int(repeats)
    if device not in ("cpu", "cuda", "all"):
        raise ValueError(f"hvd_compress: device must be cpu, cuda or all, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("hvd_compress: --device cuda asked for, but torch.cuda.is_available() is False")
    devices = ["cpu"] if device == "cpu" else ["cuda"] if device == "cuda" else ["cpu"]
    if device == "all" and torch.cuda.is_available():
        devices.append("cuda")

    names = list(COMPRESSORS)
    per_section = 2 + len(names)
    total = per_section * (len(devices) * len(sizes) + (1 if numpy_section else 0))
    bar = progress_bar(total, "bench compress", "meas", progress)
    baselines: List[Dict[str, Any]] = []
    rows: List[Dict[str, Any]] = []
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for dev in devices:
                sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
                if dev == "cuda":
                    _warm_up_gpu(torch)
                for size in sizes:
                    t = torch.from_numpy(gradient(size)).to(dev)
                    k = num_selected(size, ratio)
                    fns = {"topk": lambda: torch.topk(t.abs(), k), "pass": lambda: t.abs().max()}
                    baseline, section = _measure_section(
                        "torch", dev, size, t, fns, sync, ratio, repeats, names, bar
                    )
                    baselines.append(baseline)
                    rows.extend(section)
                    t = fns = None  # free before the next size
                    if dev == "cuda":
                        torch.cuda.empty_cache()
        if numpy_section:
            size = sizes[0]
            a = gradient(size)
            k = num_selected(size, ratio)
            fns = {
                "topk": lambda: np.argpartition(np.abs(a), size - k)[size - k :],
                "pass": lambda: np.abs(a).max(),
            }
            baseline, section = _measure_section(
                NUMPY, "cpu", size, a, fns, lambda: None, ratio, repeats, names, bar
            )
            baselines.append(baseline)
            rows.extend(section)
    finally:
        bar.close()

    results = {
        "benchmark": "compress",
        "machine": machine(torch, devices),
        "settings": {
            "sizes": sizes,
            "ratio": ratio,
            "repeats": repeats,
            "devices": devices,
            "statistic": "median seconds of one engine step on one rank: open_exchange, add, launch, finish "
                         "(time.perf_counter; cuda synchronized)",
            "warmup": {
                "calls": {dev: WARMUP_CALLS.get(dev, 1) for dev in devices},
                "gpu_seconds": GPU_WARMUP_SECONDS if "cuda" in devices else 0.0,
            },
            "gradient": f"float32 standard normal, {HEAVY_TAIL_FRACTION:g} of entries 10 * Student-t(2)",
            "baselines": {
                "torch": {"topk": "torch.topk(t.abs(), k)", "pass": "t.abs().max()"},
                NUMPY: {"topk": "np.argpartition(np.abs(a), d - k)", "pass": "np.abs(a).max()"},
            },
            "numpy_note": "numpy rows time the engine on the reference kernels: the specification, not the fast path",
        },
        "wall_seconds": time.perf_counter() - started,
        "baselines": baselines,
        "rows": rows,
        "targets": targets(rows),
    }
    return publish(results, out, "compress", write_plot if plot else None, print_table, stdout)


def targets(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The measured value of every target at every torch (device, size); ``met`` is informative only."""
    checks = []
    for row in rows:
        if row["backend"] != "torch":
            continue
        for name, field, against, bound in TARGETS:
            if row["compressor"] == name and row.get(field) is not None:
                checks.append(
                    {
                        "device": row["device"],
                        "size": row["size"],
                        "compressor": name,
                        "against": against,
                        "measured": row[field],
                        "target": bound,
                        "met": row[field] <= bound,
                    }
                )
    return checks


# -------------------------------------------------------------------- output
def _section_title(backend: str, device: str) -> str:
    if backend == NUMPY:
        return ("numpy reference kernels (the engine on numpy: the spec, not the fast path; baselines: "
                "np.argpartition, np.abs().max())")
    return f"torch {device}"


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    m = results["machine"]
    say(
        f"Compression cost, ratio {results['settings']['ratio']:g}, median of "
        f"{results['settings']['repeats']}; {m['cpu_count']} CPUs ({m['torch_threads']} torch threads), "
        f"torch {m['torch_version']}" + (f", {m['devices']['cuda']}" if "cuda" in m["devices"] else "")
    )
    sections: Dict[tuple, List[Dict[str, Any]]] = {}
    for row in results["rows"]:
        sections.setdefault((row["backend"], row["device"]), []).append(row)
    base = {(b["backend"], b["device"], b["size"]): b for b in results["baselines"]}
    for (backend, device), rows in sections.items():
        say(f"\n{_section_title(backend, device)}")
        say(
            f"  {'size':>6} {'compressor':<10} {'ms':>9} {'/topk':>7} {'/pass':>7} {'/Top-k':>7} "
            f"{'density':>8} {'bytes/dense':>11}"
        )
        for size in sorted({r["size"] for r in rows}):
            b = base[(backend, device, size)]
            say(
                f"  {format_size(size):>6} {'baselines':<10} topk {1e3 * b['topk_s']:.2f} ms, "
                f"one pass {1e3 * b['pass_s']:.2f} ms (k={b['k']})"
            )
            for r in (r for r in rows if r["size"] == size):
                say(
                    f"  {format_size(size):>6} {r['compressor']:<10} {1e3 * r['seconds']:>9.2f} "
                    f"{r['vs_topk']:>6.2f}x {r['vs_pass']:>6.1f}x {r['vs_topk_compressor']:>6.2f}x "
                    f"{r['density']:>8.4f} {r['bytes_vs_dense']:>11.4f}"
                )
    if results["targets"]:
        say("\nTargets (measured, not asserted):")
        for t in results["targets"]:
            say(
                f"  {t['device']:<4} {format_size(t['size']):>6} {t['compressor']:<9} vs {t['against']:<10} "
                f"{t['measured']:>6.2f}x  target <= {t['target']:g}x  {'ok' if t['met'] else 'MISSED'}"
            )


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Bar chart of time / baseline top-k per compressor and size, one panel per device."""
    plt = pyplot()
    sections: Dict[tuple, List[Dict[str, Any]]] = {}
    for row in results["rows"]:
        sections.setdefault((row["backend"], row["device"]), []).append(row)
    fig, axes = plt.subplots(1, len(sections), figsize=(5.5 * len(sections), 4.2), squeeze=False, sharey=True)
    for ax, ((backend, device), rows) in zip(axes[0], sections.items()):
        names = list(dict.fromkeys(r["compressor"] for r in rows))
        by_key = {(r["compressor"], r["size"]): r["vs_topk"] for r in rows}
        sizes = sorted({r["size"] for r in rows})
        ratio_bars(ax, names, [(format_size(size), [by_key[(n, size)] for n in names]) for size in sizes])
        ax.set_title("numpy reference (spec)" if backend == NUMPY else f"torch {device}")
        ax.legend(title="elements", fontsize="small")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_ylabel("engine step time / top-k baseline")
    fig.suptitle(
        f"Compression cost vs top-k baseline (ratio {results['settings']['ratio']:g}; 1.0 = baseline)"
    )
    save_figure(fig, path)


__all__ = ["run", "engine_step", "parse_size", "format_size", "gradient", "DEFAULT_SIZES", "COMPRESSORS", "TARGETS"]
