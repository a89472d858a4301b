"""Gaussian-k during training: ``python -m benchmarks gaussian`` (Shi et al., arXiv:1911.08772, 2019; docs/references.md).

Gaussian-k assumes the error-compensated gradient ``a = g + r`` of a layer is
bell-shaped and takes its threshold from two moments instead of a sort::

    thr = |mean(a)| + std(a) * Phi^-1(1 - ratio / 2),   S = {j : |a_j| > thr}

then corrects ``thr`` at most 3 times (x0.5 below ``2k/3`` selected, x1.5 above
``4k/3``; hclhkbu/GaussianK-SGD), cutting a set to its first ``k`` when it
overshoots (:func:`hvd_compress.kernels.reference.gaussiank_from`). So
``|S| <= 4k/3`` always, and ``|S| >= 2k/3`` unless every threshold tried
selected fewer.

The study trains the CNN of :mod:`benchmarks.cnn` with ``GaussianK(ratio)``
on N simulated ranks and records, from outside the compressor:

* at a few iterations, the histogram of ``a`` of one layer on rank 0 (``g`` this
  step's gradient, ``r`` the residual the previous step left) against the
  Gaussian fitted by its mean and standard deviation, the first threshold, the
  fraction of entries beyond it (the Gaussian predicts ``ratio``) and the excess
  kurtosis (0 for a Gaussian);
* every step and every sparsified layer: ``k``, the count beyond the first
  threshold (the Gaussian estimate alone) and ``|S|`` actually selected after the
  correction, per rank (the selection of the same ``a`` the engine makes; on the wire it
  fills ``|S|`` of the tensor's ``floor(4k/3)`` slots).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from hvd_compress import kernels
from benchmarks import cnn
from benchmarks.output import publish
from benchmarks.report import pyplot, require_packages, save_figure
from hvd_compress.algorithms import GaussianK
from hvd_compress.kernels.reference import GAUSSIANK_HIGH, GAUSSIANK_LOW

#: Histogram bins of ``a``.
BINS = 81


class GaussianProbe(cnn.Probe):
    """Histograms of ``a = g + r`` of ``layer`` at ``snapshot_steps`` and Gaussian-k's counts every step."""

    def __init__(self, ratio: float, layer: str, snapshot_steps: Sequence[int], bins: int = BINS) -> None:
        self.ratio = float(ratio)
        self.layer = layer
        self.snapshot_steps = set(int(s) for s in snapshot_steps)
        self.bins = int(bins)
        self.layers: Optional[List[Dict[str, Any]]] = None
        self.counts: Dict[str, Dict[str, Any]] = {}
        self.snapshots: List[Dict[str, Any]] = []

    def before(self, step: int, grads: Dict[str, List[Any]], sim: Any) -> None:
        rank0 = sim.compressors[0]
        if self.layers is None:
            shapes = {name: tuple(per_rank[0].shape) for name, per_rank in grads.items()}
            self.layers = [row for row in cnn.layer_table(rank0, shapes) if row["sent"] == "sparse"]
            if self.layer not in {row["name"] for row in self.layers}:
                raise ValueError(
                    f"hvd_compress: layer {self.layer!r} is not sparsified; choose one of "
                    f"{', '.join(row['name'] for row in self.layers)}"
                )
            for row in self.layers:
                self.counts[row["name"]] = {
                    "numel": row["numel"],
                    "k": row["k"],
                    "first_guess": [],
                    "selected": [],
                }
        for name, entry in self.counts.items():
            selected = []
            for rank, compressor in enumerate(sim.compressors):
                g = grads[name][rank].reshape(-1)
                residual = compressor.residual(name)
                a = g if residual is None else g + residual.reshape(-1)
                ops = kernels.ops_for(a, name)
                # |S| of this rank's step: the selection the engine makes of the same a (in its slots)
                threshold = ops.gaussiank_threshold(a, self.ratio)
                chosen = ops.gaussiank_from(abs(a), threshold, ops.num_selected(a.shape[0], self.ratio))
                selected.append(int(chosen.shape[0]))
                if rank > 0:
                    continue
                entry["first_guess"].append(int(np.count_nonzero(np.abs(np.asarray(a)) > threshold)))
                if name == self.layer and step in self.snapshot_steps:
                    self.snapshots.append(self._snapshot(step, np.asarray(a, dtype=np.float64), threshold))
            entry["selected"].append(selected)

    def _snapshot(self, step: int, a: np.ndarray, threshold: float) -> Dict[str, Any]:
        mean, std = float(a.mean()), float(a.std())
        edge = float(np.abs(a).max()) or 1.0
        density, edges = np.histogram(a, bins=self.bins, range=(-edge, edge), density=True)
        z = (a - mean) / std if std > 0 else np.zeros_like(a)
        return {
            "step": step + 1,
            "layer": self.layer,
            "numel": int(a.size),
            "mean": mean,
            "std": std,
            "excess_kurtosis": float(np.mean(z**4) - 3.0),
            "threshold": float(threshold),
            "beyond_threshold": float(np.mean(np.abs(a) > threshold)),
            "gaussian_beyond_threshold": self.ratio,
            "max_abs_over_std": edge / std if std > 0 else None,
            "bin_edges": edges.tolist(),
            "density": density.tolist(),
        }


def summarize(counts: Dict[str, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per layer: ``|S| / k`` and the Gaussian estimate's ``count / k`` over all steps and ranks."""
    rows = []
    for name, c in counts.items():
        k = c["k"]
        counts = np.asarray([n for step in c["selected"] for n in step], dtype=float)
        selected = counts / k
        first = np.asarray(c["first_guess"], dtype=float) / k

        def within(ratios: np.ndarray) -> float:
            return float(np.mean((ratios >= GAUSSIANK_LOW - 1e-12) & (ratios <= GAUSSIANK_HIGH + 1e-12)))

        rows.append(
            {
                "name": name,
                "numel": c["numel"],
                "k": k,
                "selected_over_k_median": float(np.median(selected)),
                "selected_over_k_min": float(selected.min()),
                "selected_over_k_max": float(selected.max()),
                "selected_within_2k3_4k3": within(selected),
                "selected_exactly_k": float(np.mean(counts == k)),
                "first_guess_over_k_median": float(np.median(first)),
                "first_guess_over_k_min": float(first.min()),
                "first_guess_over_k_max": float(first.max()),
                "first_guess_within_2k3_4k3": within(first),
            }
        )
    return rows


def study(
    ratio: float = 0.01,
    layer: str = "fc1.weight",
    snapshots: int = 4,
    training: cnn.Training = cnn.Training(),
    out: Optional[str] = None,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Train with Gaussian-k, record histograms and counts; writes ``gaussian.json`` / ``gaussian.png``."""
    require_packages(torch=True, plots=plot and out is not None)
    compressor = GaussianK(ratio)
    steps = np.linspace(0, max(0, training.steps - 1), max(1, snapshots)).round().astype(int).tolist()
    steps = sorted(set(steps))
    probe = GaussianProbe(compressor.ratio, layer, steps)
    run_label = cnn.label("gaussiank", compressor.ratio)
    head, trained = cnn.run_study(
        "gaussian",
        [(run_label, compressor)],
        training,
        progress,
        probes={run_label: probe},
        ratio=compressor.ratio,
        layer=layer,
        snapshot_steps=[s + 1 for s in steps],
        correction=f"|S| in [{GAUSSIANK_LOW:.3g} k, {GAUSSIANK_HIGH:.3g} k] accepted, at most 3 thresholds",
        a="error-compensated gradient g + r of rank 0, before this step's selection",
    )
    kept = ("final_test_accuracy", "final_test_loss", "final_train_loss", "density", "bytes_vs_dense")
    results = {
        **head,
        "training": {key: trained[run_label][key] for key in kept},
        "snapshots": probe.snapshots,
        "layers": summarize(probe.counts),
        "counts": probe.counts,
    }
    return publish(results, out, "gaussian", write_plot if plot else None, print_table, stdout)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    t = results["training"]
    say(
        f"Gaussian-k {s['ratio'] * 100:g}% on the small CNN, {s['ranks']} simulated ranks, {s['epochs']} "
        f"epochs: test accuracy {t['final_test_accuracy']:.3f}, achieved density {t['density']:.4f}"
    )
    say(f"\n  a = g + r of {s['layer']} (rank 0) against its fitted Gaussian:")
    say(
        f"  {'step':>5} {'mean':>10} {'std':>10} {'kurtosis':>9} {'max|a|/std':>10} "
        f"{'beyond thr':>10} {'Gaussian':>9}"
    )
    for snap in results["snapshots"]:
        say(
            f"  {snap['step']:>5} {snap['mean']:>10.2e} {snap['std']:>10.2e} {snap['excess_kurtosis']:>9.2f} "
            f"{snap['max_abs_over_std']:>10.1f} {snap['beyond_threshold']:>10.4f} "
            f"{snap['gaussian_beyond_threshold']:>9.4f}"
        )
    say("\n  selected count |S| / k over all steps and ranks (first guess: the Gaussian threshold alone):")
    say(
        f"  {'layer':<12} {'numel':>6} {'k':>4} {'|S|/k median':>12} {'min':>5} {'max':>5} "
        f"{'in [2k/3,4k/3]':>14} {'= k':>6} {'first guess':>11} {'min':>5} {'max':>5} {'in range':>8}"
    )
    for r in results["layers"]:
        say(
            f"  {r['name']:<12} {r['numel']:>6} {r['k']:>4} {r['selected_over_k_median']:>12.3f} "
            f"{r['selected_over_k_min']:>5.2f} {r['selected_over_k_max']:>5.2f} "
            f"{r['selected_within_2k3_4k3']:>14.1%} {r['selected_exactly_k']:>6.1%} "
            f"{r['first_guess_over_k_median']:>11.3f} {r['first_guess_over_k_min']:>5.2f} "
            f"{r['first_guess_over_k_max']:>5.2f} {r['first_guess_within_2k3_4k3']:>8.1%}"
        )


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """Top: histograms of ``a`` with the fitted Gaussian (log scale); bottom: ``|S| / k`` per layer."""
    plt = pyplot()
    snaps = results["snapshots"]
    columns = max(1, len(snaps))
    fig = plt.figure(figsize=(3.6 * max(columns, 3), 8))
    grid = fig.add_gridspec(2, columns)
    for i, snap in enumerate(snaps):
        ax = fig.add_subplot(grid[0, i])
        edges = np.asarray(snap["bin_edges"])
        centres = (edges[:-1] + edges[1:]) / 2
        ax.bar(centres, snap["density"], width=np.diff(edges), color="tab:blue", alpha=0.6, label="a = g + r")
        x = np.linspace(edges[0], edges[-1], 400)
        pdf = np.exp(-0.5 * ((x - snap["mean"]) / snap["std"]) ** 2) / (snap["std"] * np.sqrt(2 * np.pi))
        ax.plot(x, pdf, color="tab:red", linewidth=1.2, label="fitted Gaussian")
        for sign in (-1, 1):
            ax.axvline(sign * snap["threshold"], color="black", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylim(bottom=max(min(d for d in snap["density"] if d > 0) / 2, pdf.max() * 1e-6))
        ax.set_title(
            f"step {snap['step']}: kurtosis {snap['excess_kurtosis']:+.1f}\n"
            f"beyond thr {snap['beyond_threshold']:.2%} (Gaussian {snap['gaussian_beyond_threshold']:.2%})",
            fontsize="small",
        )
        ax.set_xlabel("a")
        if i == 0:
            ax.set_ylabel(f"density, {results['settings']['layer']}")
            ax.legend(fontsize="x-small")
    ax = fig.add_subplot(grid[1, :])
    colors = plt.cm.tab10.colors
    for i, (name, c) in enumerate(results["counts"].items()):
        steps = np.arange(1, len(c["selected"]) + 1)
        selected = np.asarray(c["selected"], dtype=float) / c["k"]
        ax.plot(
            steps, selected.mean(axis=1), color=colors[i], linewidth=1.1, label=f"{name} |S|/k (k={c['k']})"
        )
        ax.fill_between(steps, selected.min(axis=1), selected.max(axis=1), color=colors[i], alpha=0.15)
        ax.plot(
            steps,
            np.asarray(c["first_guess"]) / c["k"],
            color=colors[i],
            linestyle=":",
            linewidth=0.9,
            label=f"{name} first threshold alone",
        )
    ax.axhspan(GAUSSIANK_LOW, GAUSSIANK_HIGH, color="grey", alpha=0.15, label="accepted [2k/3, 4k/3]")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("selected / k (rank mean, band: min-max)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="x-small", ncol=2)
    s = results["settings"]
    fig.suptitle(f"Gaussian-k {s['ratio'] * 100:g}%, small CNN, {s['ranks']} simulated ranks")
    save_figure(fig, path)
