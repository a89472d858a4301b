"""``python -m benchmarks traffic``: what one rank sends and receives per step as N grows, per index mode.

For a model's parameter shapes (ResNet-50's by default, ``benchmarks.shapes``) and each world
size N, the bucket engine's own plan (:class:`~hvd_compress.engine.fused.FusedBucket`, the whole model
as one bucket, at world size N) gives what one rank hands the collectives in a steady step, split by
collective: the dense part's allreduce, the compressed part's allgathers (``indices="gather"``) or
allreduces (``"leader"``, ``"aggregate"``). What a rank then receives over a ring:

* allreduce of P bytes: ``2 (N-1)/N P`` (reduce-scatter and allgather halves);
* allgather of Q bytes per rank: ``(N-1) Q``.

Rows: dense fp32 and fp16 allreduces, and each sparsifier (Top-k by default) in each index mode. The
plan's numbers are the ones ``compressor.stats`` counts, which the distributed tests hold equal to the
bytes handed to every route's collectives; ``--counted N,...`` also runs two steps of the Simulator
(the real engine on lockstep ranks) of a small model at those N and checks its counted bytes against
the same plan. The break-even N against an fp16 dense allreduce (received bytes, no latency) is
reported per mode. Outputs: ``traffic.json``, ``traffic.png`` and a table.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.output import describe_machine, publish
from benchmarks import report
from benchmarks.shapes import SHAPES
from hvd_compress.engine.fused import FusedBucket
from hvd_compress.algorithms import Compression
from hvd_compress.simulator import Simulator

DEFAULT_RANKS = (2, 4, 8, 16, 64, 256, 1024)
MODES = ("gather", "leader", "aggregate")
#: the allgather without its dense fallback (``dense_when_cheaper=False``): how it grows with N
ALWAYS_SPARSE = "gather, never dense"
#: the small model of ``--counted`` (elements per tensor): two matrices, a vector, a bias
COUNTED_SHAPES = {"w1": (256, 64), "w2": (64, 128), "v": (3000,), "b": (64,)}


def plan_bytes(compressor: Any, shapes: Sequence[tuple], world: int) -> Dict[str, float]:
    """One rank's steady step under ``compressor`` at ``world`` ranks: bytes handed to the collectives
    (``sent``), of which allgathered (``gathered``), and received over a ring (``received``)."""
    names = [f"t{i}" for i in range(len(shapes))]
    plan = FusedBucket(compressor.bind(0, world), compressor.own_state, "traffic", names, list(shapes),
                       np.zeros(0, np.float32), world)
    sent = plan.step_stats[0]
    gathered = 0
    if plan.codec is not None and not getattr(compressor, "shared", False) and hasattr(compressor, "indices"):
        gathered = plan.codec.wire(plan.layout, 4)[0]
    reduced = sent - gathered
    received = 2 * (world - 1) / world * reduced + (world - 1) * gathered
    return {"sent": sent, "gathered": gathered, "received": received}


def dense_bytes(shapes: Sequence[tuple], world: int, itemsize: int) -> Dict[str, float]:
    sent = itemsize * sum(int(np.prod(s)) for s in shapes)
    return {"sent": sent, "gathered": 0, "received": 2 * (world - 1) / world * sent}


def counted(name: str, ratio: float, mode: str, world: int) -> Dict[str, Any]:
    """Two Simulator steps of :data:`COUNTED_SHAPES` on ``world`` lockstep ranks: the second step's counted
    bytes per rank (every rank's), against the plan's."""
    rng = np.random.default_rng(world)
    warnings.filterwarnings("ignore", message=r"hvd_compress: \w+ sends '.*' dense")
    sim = Simulator(world, Compression.by_name(name, ratio, indices=mode, dense_below=100))
    for _ in range(2):
        sim.step({n: [rng.standard_normal(s).astype(np.float32)] * world for n, s in COUNTED_SHAPES.items()})
    compressor = Compression.by_name(name, ratio, indices=mode, dense_below=100)
    planned = plan_bytes(compressor, list(COUNTED_SHAPES.values()), world)["sent"]
    if mode == "gather":  # the Simulator sends gather's tensors one by one; the plan counts one bucket
        return {"world": world, "mode": mode, "counted": sim.bytes_sent_per_rank, "plan": planned}
    return {"world": world, "mode": mode, "counted": sim.bytes_sent_per_rank, "plan": planned,
            "equal": all(b == planned for b in sim.bytes_sent_per_rank)}


def break_even(rows: List[Dict[str, Any]], mode: str, fp16: Dict[int, float]) -> Optional[int]:
    """Smallest N of the table at which ``mode`` receives at least fp16's bytes (``None``: never)."""
    for row in rows:
        if row["mode"] == mode and row["received"] >= fp16[row["ranks"]]:
            return row["ranks"]
    return None


def run(model: str = "resnet50", compressor: str = "topk", ratio: float = 0.01,
        ranks: Sequence[int] = DEFAULT_RANKS, counted_ranks: Sequence[int] = (), out: Optional[str] = "results",
        plot: bool = True, stdout: Any = None, progress: bool = True) -> Dict[str, Any]:
    report.require_packages(torch=False, plots=plot and out is not None)
    shapes = [shape for _, shape in SHAPES[model]()]
    started = time.perf_counter()
    rows: List[Dict[str, Any]] = []
    bar = report.progress_bar(len(ranks) * (2 + len(MODES)) + len(counted_ranks) * len(MODES), "bench traffic",
                              "row", progress)
    try:
        for world in ranks:
            for label, itemsize in (("dense fp32", 4), ("dense fp16", 2)):
                rows.append({"ranks": world, "mode": label, **dense_bytes(shapes, world, itemsize)})
                bar.update()
            for mode in MODES:
                sparsifier = Compression.by_name(compressor, ratio, indices=mode)
                rows.append({"ranks": world, "mode": mode, **plan_bytes(sparsifier, shapes, world)})
                bar.update()
            always = Compression.by_name(compressor, ratio, dense_when_cheaper=False)
            rows.append({"ranks": world, "mode": ALWAYS_SPARSE, **plan_bytes(always, shapes, world)})
        checks = []
        for world in counted_ranks:
            for mode in MODES:
                checks.append(counted(compressor, ratio, mode, world))
                bar.update()
    finally:
        bar.close()
    fp16 = {r["ranks"]: r["received"] for r in rows if r["mode"] == "dense fp16"}
    results = {
        "benchmark": "traffic",
        "machine": describe_machine(),
        "settings": {"model": model, "parameters": sum(int(np.prod(s)) for s in shapes), "tensors": len(shapes),
                     "compressor": compressor, "ratio": ratio, "ranks": list(ranks),
                     "received": "allreduce 2 (N-1)/N x the bytes handed to it, allgather (N-1) x",
                     "plan": "hvd_compress.engine.fused.FusedBucket of the whole model at world size N"},
        "rows": rows,
        "break_even_vs_fp16": {mode: break_even(rows, mode, fp16) for mode in MODES},
        "counted": checks,
        "wall_seconds": time.perf_counter() - started,
    }
    return publish(results, out, "traffic", write_plot if plot else None, print_table, stdout)


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(f"Bytes per rank per step, {s['model']} ({s['parameters']:,} parameters, {s['tensors']} tensors), "
        f"{s['compressor']} at {s['ratio']:g}: MB sent (handed to the collectives) / MB received (ring)")
    ns = s["ranks"]
    say(f"  {'mode':>20}" + "".join(f"{'N=' + str(n):>17}" for n in ns))
    for mode in ("dense fp32", "dense fp16") + MODES + (ALWAYS_SPARSE,):
        cells = {r["ranks"]: r for r in results["rows"] if r["mode"] == mode}
        say(f"  {mode:>20}" + "".join(f"{_mb(cells[n]['sent']) + ' / ' + _mb(cells[n]['received']):>17}" for n in ns))
    even = results["break_even_vs_fp16"]
    say("  received >= an fp16 dense allreduce's from N = " + ", ".join(
        f"{mode}: {even[mode] if even[mode] else 'never up to ' + str(max(ns))}" for mode in MODES))
    for check in results["counted"]:
        verdict = "" if "equal" not in check else (" = the plan" if check["equal"] else " != the plan")
        say(f"  Simulator N={check['world']} {check['mode']}: counted {check['counted'][0]:,} bytes per rank "
            f"(plan of one bucket {check['plan']:,}){verdict}")


def write_plot(results: Dict[str, Any], path: Any) -> None:
    fig, ax = report.pyplot().subplots(figsize=(6.5, 4.2))
    for mode in ("dense fp32", "dense fp16") + MODES + (ALWAYS_SPARSE,):
        points = [(r["ranks"], r["received"] / 1e6) for r in results["rows"] if r["mode"] == mode]
        ax.plot(*zip(*points), "--" if mode.startswith("dense") else "o-", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks N")
    ax.set_ylabel("MB received per rank per step (ring)")
    s = results["settings"]
    ax.set_title(f"{s['model']}, {s['compressor']} {s['ratio']:g}: traffic by index mode", fontsize="medium")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize="small")
    report.save_figure(fig, path)
