"""Bytes on the wire: what every compressor sends per rank and step, against dense fp32.

One simulated step (:class:`hvd_compress.simulator.Simulator`, numpy: the routes' bucket
engine on every rank, the step after the layout's first) of every compressor on synthetic
gradients shaped like ResNet-18's parameters (11.7M; ``scale`` shrinks the channel widths
for quick runs), for each world size N. Tensors below ``dense_below`` elements (biases,
batch-norm weights) go dense, as the compressors do. Two numbers per compressor and N,
both per rank:

* ``payload``: the bytes a rank hands to the collectives (``Simulator.bytes_sent``:
  the dense part's allreduce and the codec's rounds, flags included);
* ``traffic``: the bytes a rank sends over a ring, from what it posted to each collective
  (``Simulator.collectives_per_rank``, :func:`collective_traffic`). An allreduce of P bytes sends
  ``2 (N-1)/N * P``; an allgather of Q bytes per rank sends ``(N-1) * Q``. The dense part
  (fallback tensors, None, FP16) is allreduced, sparse values and indices allgathered;
  TernGrad's codes go the way ``wire.ternary_wire_format`` says (packed int32 allreduce or
  2-bit allgather) and, with scalar sharing, the scales go through the allreduce-Max
  (without it, they are allgathered).

The baseline is a dense fp32 allreduce of the whole model measured in the same
run: payload ``4 * numel``, traffic ``2 (N-1)/N * 4 * numel``.

Outputs (in ``out``): ``wire.json``, ``wire.png`` (ratio to dense per compressor,
bars per N) and a table. The target "TernGrad wire <= 1/8 of dense at N=4" is
printed with the measured value, never asserted.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.output import describe_machine, publish
from benchmarks import report
from benchmarks.compress import format_size, gradient
from hvd_compress.algorithms import Compression
from hvd_compress.algorithms.base import check_ratio
from hvd_compress.algorithms.sparse import DENSE_BELOW
from hvd_compress.simulator import Simulator

#: Compressors measured, in table order.
COMPRESSORS = ("none", "fp16", "topk", "gaussiank", "regtopk", "terngrad")
SPARSE = ("topk", "gaussiank", "regtopk")
DEFAULT_RANKS = (2, 4, 16)
#: Synthetic gradients: ``compress.gradient`` times this (keeps FP16's range safe).
GRADIENT_SCALE = 1e-3
#: (compressor, world size, field, bound): printed, never asserted (the issue's target).
TARGETS = (("terngrad", 4, "traffic_vs_dense", 1 / 8),)


# -------------------------------------------------------------------- model
def resnet18_shapes(scale: float = 1.0, num_classes: int = 1000) -> List[Tuple[str, Tuple[int, ...]]]:
    """Trainable parameter shapes of torchvision's ``resnet18`` (11,689,512 at ``scale=1``).

    ``scale`` multiplies every channel width (at least 1 channel); the input's 3
    channels and ``num_classes`` stay. Batch-norm weights and biases are listed
    (their running statistics are buffers, not gradients).
    """
    if not scale > 0:
        raise ValueError(f"hvd_compress: scale must be > 0, got {scale!r}")

    def width(channels: int) -> int:
        return max(1, int(round(channels * scale)))

    shapes: List[Tuple[str, Tuple[int, ...]]] = []

    def conv_bn(name: str, out_c: int, in_c: int, kernel: int, bn: str) -> None:
        shapes.append((f"{name}.weight", (out_c, in_c, kernel, kernel)))
        shapes.append((f"{bn}.weight", (out_c,)))
        shapes.append((f"{bn}.bias", (out_c,)))

    conv_bn("conv1", width(64), 3, 7, "bn1")
    in_c = width(64)
    for stage, channels in enumerate((64, 128, 256, 512), start=1):
        out_c = width(channels)
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            stride_or_widen = block == 0 and stage > 1
            conv_bn(f"{prefix}.conv1", out_c, in_c, 3, f"{prefix}.bn1")
            conv_bn(f"{prefix}.conv2", out_c, out_c, 3, f"{prefix}.bn2")
            if stride_or_widen:
                conv_bn(f"{prefix}.downsample.0", out_c, in_c, 1, f"{prefix}.downsample.1")
            in_c = out_c
    shapes.append(("fc.weight", (num_classes, in_c)))
    shapes.append(("fc.bias", (num_classes,)))
    return shapes


def resnet18_label(scale: float) -> str:
    """The model of :func:`resnet18_shapes` in the JSON settings."""
    return "ResNet-18 (torchvision resnet18, 1000 classes) parameter shapes" + (
        "" if scale == 1 else f", channel widths x {scale:g}"
    )


def numel(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64))


# ------------------------------------------------------------------ traffic
def allreduce_traffic(nbytes: float, n_ranks: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2 (N-1)/N * P``."""
    return 2.0 * (n_ranks - 1) / n_ranks * nbytes


def allgather_traffic(nbytes: float, n_ranks: int) -> float:
    """Bytes one rank sends in a ring allgather of ``nbytes`` per rank: ``(N-1) * Q``."""
    return float((n_ranks - 1) * nbytes)


def alltoall_traffic(nbytes: float, n_ranks: int) -> float:
    """Bytes one rank sends in an all-to-all of ``nbytes`` split evenly over the ranks: ``(N-1)/N * P``
    (its own share stays)."""
    return (n_ranks - 1) / n_ranks * nbytes


#: the bytes one rank sends in each collective, of the bytes it hands it
TRAFFIC = {"allreduce": allreduce_traffic, "allgather": allgather_traffic, "alltoall": alltoall_traffic}


def collective_traffic(posted: Sequence[Tuple[str, str, int]], n_ranks: int) -> float:
    """Ring bytes one rank sends for the collectives it posted in a step (``Simulator.collectives_per_rank[r]``:
    ``(name, "allreduce", "allgather" or "alltoall", bytes)``)."""
    return sum(TRAFFIC[collective](nbytes, n_ranks) for _, collective, nbytes in posted)


# ---------------------------------------------------------------------- run
def _make(name: str, ratio: float, dense_below: int) -> Any:
    if name in SPARSE or name == "terngrad":
        return Compression.by_name(name, ratio, dense_below=dense_below)
    return Compression.by_name(name, ratio)


def _gradients(shapes, n_ranks: int, seed: int) -> Dict[str, List[np.ndarray]]:
    return {
        name: [
            GRADIENT_SCALE * gradient(numel(shape), seed=[seed, rank, i]).reshape(shape)
            for rank in range(n_ranks)
        ]
        for i, (name, shape) in enumerate(shapes)
    }


def measure(
    name: str,
    grads: Dict[str, List[np.ndarray]],
    n_ranks: int,
    ratio: float,
    dense_below: int,
    seed: int = 0,
) -> Dict[str, Any]:
    """One simulated step of compressor ``name`` on ``n_ranks`` ranks (after the layout's first step, its
    header check); its wire row."""
    from benchmarks.cnn import layer_table

    sim = Simulator(n_ranks, _make(name, ratio, dense_below), seed=seed)
    step = {tensor: per_rank[:n_ranks] for tensor, per_rank in grads.items()}
    sim.step(step)
    started = time.perf_counter()
    sim.step(step)
    seconds = time.perf_counter() - started
    payload = sum(sim.bytes_sent_per_rank) / n_ranks
    dense = sim.dense_bytes
    traffic = sum(collective_traffic(posted, n_ranks) for posted in sim.collectives_per_rank) / n_ranks
    dense_traffic = allreduce_traffic(dense, n_ranks)
    collectives: Dict[str, int] = {}
    for _, collective, _ in sim.collectives_per_rank[0]:
        collectives[collective] = collectives.get(collective, 0) + 1
    # the tensors the compressor does compress (fallbacks excluded: the bucket's dense part), when it has fallbacks
    shapes = {tensor: tuple(per_rank[0].shape) for tensor, per_rank in grads.items()}
    compressed_dense = sum(grads[row["name"]][0].nbytes for row in layer_table(sim.compressors[0], shapes)
                           if row["sent"] != "dense")
    compressed_traffic = sum(collective_traffic([c for c in posted if not c[0].endswith(".dense")], n_ranks)
                             for posted in sim.collectives_per_rank) / n_ranks
    return {
        "ranks": n_ranks,
        "compressor": name,
        "ratio": ratio if name in SPARSE else None,
        "payload_bytes": sim.bytes_sent,
        "traffic_bytes": traffic,
        "dense_payload_bytes": dense,
        "dense_traffic_bytes": dense_traffic,
        "payload_vs_dense": payload / dense,
        "traffic_vs_dense": traffic / dense_traffic,
        "compressed_traffic_vs_dense": (
            compressed_traffic / allreduce_traffic(compressed_dense, n_ranks) if compressed_dense else None
        ),
        "collectives": collectives,
        "step_seconds": seconds,
    }


def run(
    ranks: Sequence[int] = DEFAULT_RANKS,
    ratio: float = 0.01,
    scale: float = 1.0,
    dense_below: int = DENSE_BELOW,
    seed: int = 0,
    out: Optional[str] = "results",
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Measure, write ``wire.json`` and ``wire.png`` to ``out``, print the table; returns the results."""
    report.require_packages(torch=False, plots=plot and out is not None)
    ratio = check_ratio(ratio)
    ranks = sorted({int(n) for n in ranks})
    if not ranks or ranks[0] < 2:
        raise ValueError(f"hvd_compress: ranks must be at least 2, got {list(ranks)}")
    shapes = resnet18_shapes(scale)
    total_numel = sum(numel(s) for _, s in shapes)
    bar = report.progress_bar(len(ranks) * len(COMPRESSORS) + 1, "bench wire", "meas", progress)
    rows: List[Dict[str, Any]] = []
    started = time.perf_counter()
    try:
        bar.set_postfix_str(f"{max(ranks)} ranks x {format_size(total_numel)} gradients")
        grads = _gradients(shapes, max(ranks), seed)
        bar.update()
        for n in ranks:
            for name in COMPRESSORS:
                bar.set_postfix_str(f"N={n} {name}")
                rows.append(measure(name, grads, n, ratio, dense_below, seed))
                bar.update()
        del grads
    finally:
        bar.close()

    results = {
        "benchmark": "wire",
        "machine": describe_machine(),
        "settings": {
            "ranks": ranks,
            "ratio": ratio,
            "scale": scale,
            "dense_below": dense_below,
            "seed": seed,
            "model": resnet18_label(scale),
            "numel": total_numel,
            "tensors": len(shapes),
            "tensors_below_dense_below": sum(1 for _, s in shapes if numel(s) < dense_below),
            "gradient": f"{GRADIENT_SCALE:g} x (float32 standard normal with a 1e-3 heavy tail), per rank",
            "payload": "bytes a rank hands to the collectives in one step (Simulator.bytes_sent)",
            "traffic": "bytes a rank sends over a ring: allreduce 2(N-1)/N * P, allgather (N-1) * Q; "
            "TernGrad per wire_format, its scale by allreduce-Max",
            "baseline": "dense fp32 allreduce of every tensor",
        },
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "targets": targets(rows),
    }
    return publish(results, out, "wire", write_plot if plot else None, print_table, stdout)


def targets(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Measured value of every target whose world size was run; ``met`` is informative only."""
    checks = []
    for name, n, field, bound in TARGETS:
        for row in rows:
            if row["compressor"] == name and row["ranks"] == n:
                checks.append(
                    {
                        "compressor": name,
                        "ranks": n,
                        "field": field,
                        "measured": row[field],
                        "compressed_tensors_only": row["compressed_traffic_vs_dense"],
                        "target": bound,
                        "met": row[field] <= bound,
                    }
                )
    return checks


# -------------------------------------------------------------------- output
def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    ranks = s["ranks"]
    say(
        f"Bytes per rank per step vs dense fp32 allreduce: {s['model']}, {format_size(s['numel'])} "
        f"parameters in {s['tensors']} tensors ({s['tensors_below_dense_below']} below "
        f"{s['dense_below']} elements go dense), ratio {s['ratio']:g}"
    )
    by_key = {(r["compressor"], r["ranks"]): r for r in results["rows"]}
    head = "".join(f" {'N=' + str(n) + ' payload':>14} {'traffic':>9}" for n in ranks)
    say(f"\n  {'compressor':<10}{head}")
    dense = "".join(
        f" {format_size(by_key[(COMPRESSORS[0], n)]['dense_payload_bytes']) + 'B':>14} "
        f"{format_size(int(by_key[(COMPRESSORS[0], n)]['dense_traffic_bytes'])) + 'B':>9}"
        for n in ranks
    )
    say(f"  {'dense fp32':<10}{dense}")
    for name in COMPRESSORS:
        cells = "".join(
            f" {by_key[(name, n)]['payload_vs_dense']:>13.4f}x {by_key[(name, n)]['traffic_vs_dense']:>8.4f}x"
            for n in ranks
        )
        say(f"  {name:<10}{cells}")
    if results["targets"]:
        say("\nTargets (the issue's; measured, not asserted):")
        for t in results["targets"]:
            say(
                f"  {t['compressor']} traffic at N={t['ranks']}: {t['measured']:.4f} of dense "
                f"(compressed tensors only: {t['compressed_tensors_only']:.4f})  target <= "
                f"{t['target']:.4f}  {'ok' if t['met'] else 'MISSED'}"
            )


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Two panels (payload, ring traffic) of bytes / dense per compressor, one bar per N."""
    ranks = results["settings"]["ranks"]
    by_key = {(r["compressor"], r["ranks"]): r for r in results["rows"]}
    fig, axes = report.pyplot().subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, field, title in (
        (axes[0], "payload_vs_dense", "payload (bytes handed to collectives)"),
        (axes[1], "traffic_vs_dense", "ring traffic (bytes sent per rank)"),
    ):
        report.ratio_bars(
            ax, COMPRESSORS, [(f"N={n}", [by_key[(c, n)][field] for c in COMPRESSORS]) for n in ranks]
        )
        ax.set_title(title)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for name, n, field, bound in TARGETS:
        if n in ranks:
            axes[1].axhline(bound, color="tab:red", linewidth=1, linestyle=":", label=f"{name} target N={n}")
    axes[1].legend(fontsize="small")
    axes[0].set_ylabel("bytes / dense fp32 allreduce")
    s = results["settings"]
    fig.suptitle(
        f"Wire bytes per rank per step vs dense, {format_size(s['numel'])} params, ratio {s['ratio']:g}"
    )
    report.save_figure(fig, path)


__all__ = [
    "run",
    "measure",
    "resnet18_shapes",
    "allreduce_traffic",
    "allgather_traffic",
    "collective_traffic",
    "COMPRESSORS",
    "TARGETS",
]
