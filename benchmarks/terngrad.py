"""TernGrad ablation: ``python -m benchmarks terngrad`` (Wen et al., NeurIPS 2017; docs/references.md).

TernGrad sends ``S * t`` with ``t_j = sign(g_j) Bernoulli(|g_j| / S)`` in {-1, 0, 1}:
unbiased, with per-entry variance ``S |g_j| - g_j^2``, so a smaller scale ``S``
means less noise. Two of the paper's choices act on ``S``:

* **clipping** ``g <- clip(g, -c sigma, c sigma)`` (c = 2.5) before ``S = max|g|``
  lowers ``S`` (and biases the few clipped entries);
* **scalar sharing**: every rank uses ``S = max over ranks of max|g|`` (one
  allreduce-Max), which raises ``S`` on all but one rank, but lets the codes of
  all ranks be summed by an integer allreduce (``floor(32 / ceil(log2(2N+1)))``
  codes per int32 lane) whose traffic does not grow with N. Without it each rank
  allgathers its 2-bit codes and its own scale: ``(N-1) d / 4`` bytes sent.

The study trains the CNN of :mod:`benchmarks.cnn` with the four
combinations (and dense SGD as the reference) and records, besides loss and
accuracy, the relative error of the aggregate ``||avg - mean_r g_r||^2 /
||mean_r g_r||^2`` over the TernGrad-coded tensors every step (quantization
noise plus clipping bias) and ``S / max|g|`` of the largest layer (mean over
ranks). Bytes per rank are measured at the run's N and, on one step of random
gradients of the same shapes, at N = 2, 4, 8, 16.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import cnn
from benchmarks.output import publish
from benchmarks.report import pyplot, require_packages, save_figure
from hvd_compress.algorithms import Compression, Compressor, TernGrad
from hvd_compress.simulator import Simulator

#: World sizes of the bytes table.
WIRE_RANKS = (2, 4, 8, 16)


def variants(clip: float = 2.5) -> List[Tuple[str, Dict[str, Any]]]:
    """``(label, TernGrad options)`` of the four combinations of clipping and scalar sharing."""
    return [
        (f"clip {clip:g}, shared scale", dict(clip=clip, scalar_sharing=True)),
        ("no clip, shared scale", dict(clip=None, scalar_sharing=True)),
        (f"clip {clip:g}, per-rank scale", dict(clip=clip, scalar_sharing=False)),
        ("no clip, per-rank scale", dict(clip=None, scalar_sharing=False)),
    ]


def scale(a: Any, clip: Optional[float]) -> float:
    """One rank's TernGrad scale ``max|clip(a)|`` (float64; :mod:`hvd_compress.algorithms.terngrad`):
    ``clip(a, -c std(a), c std(a))`` with ``c = clip`` (``None``: no clipping; a constant tensor is not
    clipped), so ``min(max|a|, c std(a))``."""
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    top = float(np.max(np.abs(a)))
    if clip is None or a.max() == a.min():
        return top
    return min(top, clip * float(np.std(a)))


class ErrorProbe(cnn.Probe):
    """Per step: relative error of the aggregate over the coded tensors, and ``S / max|g|`` of ``layer``."""

    def __init__(self, layer: str) -> None:
        self.layer = layer
        self.relative_error: List[float] = []
        self.scale_over_max: List[float] = []
        self.coded: List[str] = []
        self.scales: List[float] = []

    def before(self, step: int, grads: Dict[str, List[Any]], sim: Simulator) -> None:
        """Each rank's scale ``S`` of ``layer`` this step: :func:`scale` of what the rank codes (``a = g`` plus
        its residual), the max over ranks with scalar sharing."""
        shapes = {name: tuple(per_rank[0].shape) for name, per_rank in grads.items()}
        self.coded = [row["name"] for row in cnn.layer_table(sim.compressors[0], shapes) if row["sent"] == "ternary"]
        self.scales = []
        if self.layer not in self.coded:
            return
        tern = sim.compressors[0]
        local = []
        for compressor, g in zip(sim.compressors, grads[self.layer]):
            a = np.asarray(g, dtype=np.float64)
            residual = compressor.residual(self.layer)
            local.append(scale(a if residual is None else a + residual, tern.clip))
        self.scales = [max(local)] * len(local) if tern.scalar_sharing else local

    def after(self, step: int, grads: Dict[str, List[Any]], averaged: Dict[str, Any], sim: Simulator) -> None:
        import torch

        error = norm = 0.0
        with torch.no_grad():
            for name in sorted(self.coded):
                mean = torch.stack(grads[name]).mean(0).double()
                error += float((averaged[name].double() - mean).pow(2).sum())
                norm += float(mean.pow(2).sum())
        self.relative_error.append(error / norm if norm > 0 else 0.0)
        if self.scales:
            local = [float(g.abs().max()) for g in grads[self.layer]]
            self.scale_over_max.append(float(np.mean([s / m for s, m in zip(self.scales, local) if m > 0])))


def wire_table(shapes: Dict[str, Tuple[int, ...]], clip: float, world_sizes: Sequence[int], seed: int = 0):
    """Bytes per rank of one step with and without scalar sharing at every N, vs dense fp32."""
    from benchmarks.wire import allreduce_traffic, collective_traffic

    rng = np.random.default_rng(seed)
    dense = 4 * sum(int(np.prod(s)) for s in shapes.values())
    rows = []
    for n in world_sizes:
        grads = {
            name: [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
            for name, shape in shapes.items()
        }
        for sharing in (True, False):
            sim = Simulator(n, TernGrad(clip=clip, scalar_sharing=sharing), seed=seed)
            sim.step(grads)  # the layout's first step: its header check
            sim.step(grads)
            payload = sum(sim.bytes_sent_per_rank) / n
            # with sharing, the scales' allreduce-Max included
            traffic = sum(collective_traffic(posted, n) for posted in sim.collectives_per_rank) / n
            rows.append(
                {
                    "ranks": n,
                    "scalar_sharing": sharing,
                    "bytes": payload,
                    "bytes_vs_dense": payload / dense,
                    "traffic": traffic,
                    "traffic_vs_dense": traffic / allreduce_traffic(dense, n),
                    "collectives": sorted({kind for posted in sim.collectives_per_rank for _, kind, _ in posted}),
                }
            )
    return rows


def study(
    clip: float = 2.5,
    layer: str = "fc1.weight",
    training: cnn.Training = cnn.Training(),
    out: Optional[str] = None,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Dense and TernGrad with/without clipping and scalar sharing; writes ``terngrad.json`` / ``terngrad.png``."""
    require_packages(torch=True, plots=plot and out is not None)
    runs: List[Tuple[str, Compressor]] = [(cnn.label("none"), Compression.none())]
    runs += [(name, TernGrad(**options)) for name, options in variants(clip)]
    shapes = {name: tuple(p.shape) for name, p in cnn.make_net(training.seed).named_parameters()}
    coded = [
        row["name"]
        for row in cnn.layer_table(TernGrad().bind(0, training.ranks), shapes)
        if row["sent"] == "ternary"
    ]
    if layer not in coded:
        raise ValueError(
            f"hvd_compress: layer {layer!r} is not TernGrad-coded; choose one of {', '.join(coded)}"
        )
    probes = {name: ErrorProbe(layer) for name, _ in runs[1:]}
    head, trained = cnn.run_study(
        "terngrad",
        runs,
        training,
        progress,
        probes=probes,
        clip=clip,
        layer=layer,
        relative_error="||avg - mean_r g_r||^2 / ||mean_r g_r||^2 over the TernGrad-coded tensors, per step",
        scale_over_max_abs=f"S / max|g| of {layer}, mean over ranks and steps",
    )
    rows = []
    for name, compressor in runs:
        probe = probes.get(name)
        rows.append(
            {
                "label": name,
                "clip": getattr(compressor, "clip", None),
                "scalar_sharing": getattr(compressor, "scalar_sharing", None),
                "relative_error": probe.relative_error if probe else None,
                "relative_error_mean": float(np.mean(probe.relative_error)) if probe else None,
                "scale_over_max_abs": float(np.mean(probe.scale_over_max)) if probe else None,
                **trained[name],
            }
        )
    wire = wire_table(shapes, clip, sorted(set(WIRE_RANKS) | {training.ranks}), training.seed)
    results = {**head, "runs": rows, "wire": wire}
    return publish(results, out, "terngrad", write_plot if plot else None, print_table, stdout)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(f"TernGrad ablation on the small CNN: {cnn.describe_training(s)}")
    say(
        f"\n  {'run':<24} {'test acc':>8} {'test loss':>9} {'train loss':>10} {'agg. error':>10} "
        f"{'S/max|g|':>8} {'bytes/step':>11} {'traffic':>8}"
    )
    for r in results["runs"]:
        error = "" if r["relative_error_mean"] is None else f"{r['relative_error_mean']:.3f}"
        scale = "" if r["scale_over_max_abs"] is None else f"{r['scale_over_max_abs']:.3f}"
        say(
            f"  {r['label']:<24} {r['final_test_accuracy']:>8.3f} {r['final_test_loss']:>9.4f} "
            f"{r['final_train_loss']:>10.4f} {error:>10} {scale:>8} {r['bytes_per_step']:>11,.0f} "
            f"{r['traffic_vs_dense']:>7.4f}x"
        )
    say(f"\n  agg. error: {s['relative_error']} (mean over steps); S/max|g|: {s['scale_over_max_abs']}")
    say("\n  ring traffic per rank vs dense fp32 allreduce, one step (random gradients):")
    by_key = {(w["ranks"], w["scalar_sharing"]): w for w in results["wire"]}
    world_sizes = sorted({w["ranks"] for w in results["wire"]})
    say(f"  {'':<18}" + "".join(f" {'N=' + str(n):>8}" for n in world_sizes))
    for sharing, name in ((True, "shared scale"), (False, "per-rank scale")):
        cells = "".join(f" {by_key[(n, sharing)]['traffic_vs_dense']:>8.4f}" for n in world_sizes)
        say(f"  {name:<18}{cells}")


def _style(run_label: str) -> Dict[str, Any]:
    """Colour by clipping, solid with a shared scale, dashed with per-rank scales; dense in black."""
    if run_label == "dense":
        return {"color": "black", "linestyle": "-"}
    return {
        "color": "tab:orange" if run_label.startswith("no clip") else "tab:purple",
        "linestyle": "-" if "shared" in run_label else "--",
    }


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Loss and accuracy curves, the aggregate's relative error, and traffic vs N."""
    fig, axes = pyplot().subplots(2, 3, figsize=(15, 8.5))
    cnn.plot_curves(axes[0], results["runs"], style=_style)
    ax = axes[1, 0]
    for r in results["runs"]:
        if r["relative_error"] is not None:
            steps = np.arange(1, len(r["relative_error"]) + 1)
            window = max(1, r["steps_per_epoch"] // 4)
            ax.plot(steps, cnn.smooth(r["relative_error"], window), label=r["label"], **_style(r["label"]))
    ax.set_yscale("log")
    ax.set_title("relative error of the aggregate (moving average)")
    ax.set_xlabel("step")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small")
    ax = axes[1, 1]
    coded = [r for r in results["runs"] if r["scale_over_max_abs"] is not None]
    ax.bar(
        range(len(coded)),
        [r["scale_over_max_abs"] for r in coded],
        color=[_style(r["label"])["color"] for r in coded],
    )
    ax.set_xticks(range(len(coded)), [r["label"].replace(", ", "\n") for r in coded], fontsize="x-small")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_title(f"scale S / local max|g|, {results['settings']['layer']}")
    ax.grid(axis="y", alpha=0.3)
    ax = axes[1, 2]
    for sharing, name in (
        (True, "shared scale (packed int32 allreduce)"),
        (False, "per-rank scale (2-bit allgather)"),
    ):
        rows = sorted(
            (w for w in results["wire"] if w["scalar_sharing"] == sharing), key=lambda w: w["ranks"]
        )
        style = {"color": "black", "linestyle": "-"} if sharing else {"color": "grey", "linestyle": "--"}
        ax.plot(
            [w["ranks"] for w in rows], [w["traffic_vs_dense"] for w in rows], marker="o", label=name, **style
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(
        sorted({w["ranks"] for w in results["wire"]}),
        [str(n) for n in sorted({w["ranks"] for w in results["wire"]})],
    )
    ax.set_xlabel("ranks N")
    ax.set_title("ring traffic per rank / dense fp32")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small")
    s = results["settings"]
    fig.suptitle(f"TernGrad: clipping and scalar sharing, small CNN, {s['ranks']} simulated ranks")
    save_figure(fig, path)
