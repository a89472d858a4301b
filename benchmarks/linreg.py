"""Distributed linear regression of the RegTop-k paper (Bereyhi et al., section 2 of the supplement).

Reproduces the setup of AlBerey/RegTopK ``LinearRegression.py``/``SynthDataSet.py``:
``n_ranks`` clients with heterogeneous local models ``x_k = m_k 1 + z``
(``m_k ~ N(0, 5)``, ``z ~ N(0, I)``), data ``y = A_k x_k + e`` (``A_k`` standard
normal, ``e ~ N(0, 0.5)``), full-batch gradients of the mean squared error and
plain gradient descent on the average. The global optimum ``x*`` is the least
squares solution over all clients. Top-k with error feedback stalls at a fixed
distance from ``x*``; RegTop-k keeps approaching it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.output import describe_machine, publish
from hvd_compress.bench import single_threaded_blas
from benchmarks.report import progress_bar, pyplot, require_packages, save_figure
from hvd_compress.algorithms import Compressor
from hvd_compress.simulator import Simulator


@dataclass
class LinearRegressionProblem:
    """Per-rank design matrices and targets, and the global optimum."""

    features: List[np.ndarray]
    targets: List[np.ndarray]
    optimum: np.ndarray
    start: np.ndarray

    @classmethod
    def generate(
        cls, n_ranks: int = 20, dim: int = 100, samples: int = 500, seed: int = 0
    ) -> "LinearRegressionProblem":
        rng = np.random.default_rng(seed)
        means = np.sqrt(5.0) * rng.standard_normal(n_ranks)
        features, targets = [], []
        for mean in means:
            local_model = mean + rng.standard_normal(dim)
            a = rng.standard_normal((samples, dim))
            features.append(a)
            targets.append(a @ local_model + np.sqrt(0.5) * rng.standard_normal(samples))
        gram = sum(a.T @ a for a in features)
        optimum = np.linalg.solve(gram, sum(a.T @ y for a, y in zip(features, targets)))
        bound = 1.0 / np.sqrt(dim)  # torch.nn.Linear's initialisation
        return cls(features, targets, optimum, rng.uniform(-bound, bound, dim))

    def gradients(self, x: np.ndarray) -> List[np.ndarray]:
        """Full-batch gradient of ``mean((A_k x - y_k)^2)`` on every rank."""
        return [2.0 / a.shape[0] * a.T @ (a @ x - y) for a, y in zip(self.features, self.targets)]

    def distance(self, x: np.ndarray) -> float:
        """Squared distance ``||x - x*||^2``."""
        return float(np.sum((x - self.optimum) ** 2))


def run(
    problem: LinearRegressionProblem,
    compression: Compressor,
    steps: int = 2500,
    lr: float = 0.01,
    revert: bool = False,
    callback: Optional[Callable[[int, float], None]] = None,
    reverted: Optional[List[int]] = None,
) -> List[float]:
    """Gradient descent on the simulator; returns ``||x_t - x*||^2`` after every step.

    ``revert`` adds the reference script's heuristic (``termination`` in
    ``DistLearnLinearReg.py``): a step that moves ``x`` by at least the allowed
    squared deviation is undone; after an accepted step the allowance becomes
    100x that step's squared length. It lives here, outside the compressor.
    The undone steps (0-based) are appended to ``reverted`` when given.
    """
    sim = Simulator(len(problem.features), compression)
    x = problem.start.copy()
    allowance = 1e5
    distances = []
    for step in range(steps):
        grads = problem.gradients(x)
        update = lr * sim.step({"x": grads})["x"]
        moved = float(np.sum(update**2))
        if not revert or moved < allowance:
            x = x - update
            allowance = 100.0 * moved if revert else allowance
        elif reverted is not None:
            reverted.append(step)
        distances.append(problem.distance(x))
        if callback is not None:
            callback(step, distances[-1])
    return distances


# ------------------------------------------------------------------- study
#: Fraction of the last steps whose mean distance is the "final" distance.
FINAL_FRACTION = 0.1
#: Points kept per curve in the JSON (evenly spaced steps, the last one included).
CURVE_POINTS = 500


def final_distance(distances: Sequence[float], fraction: float = FINAL_FRACTION) -> float:
    """Mean of ``||x - x*||^2`` over the last ``fraction`` of the steps (at least one)."""
    window = max(1, int(round(fraction * len(distances))))
    return float(np.mean(distances[-window:]))


def subsample(distances: Sequence[float], points: int = CURVE_POINTS) -> Dict[str, List[Any]]:
    """``{"step": [...], "distance": [...]}`` at about ``points`` evenly spaced steps (1-based)."""
    steps = np.unique(np.linspace(0, len(distances) - 1, min(points, len(distances))).round().astype(int))
    return {"step": (steps + 1).tolist(), "distance": [float(distances[i]) for i in steps]}


def _sparse(cls: type, ratio: float, **options: Any) -> Compressor:
    """A sparsifier that sparsifies the whole vector even where ``N k >= d`` (the paper's setting).

    The study compares selection rules, so it turns off the switch to a dense
    allreduce that a sparsifier makes when that moves fewer bytes.
    """
    return cls(ratio, dense_below=0, dense_when_cheaper=False, **options)


def study(
    n_ranks: int = 20,
    dim: int = 100,
    ratio: float = 0.4,
    mu: float = 4.0,
    mu_sweep: Sequence[float] = (),
    steps: int = 2500,
    lr: float = 0.01,
    seed: int = 0,
    instances: int = 1,
    out: Optional[str] = None,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """The RegTop-k paper's linear-regression study on the simulator.

    Curves of ``||x_t - x*||^2``: dense gradient descent, Top-k, RegTop-k (``mu``),
    RegTop-k with the reference script's step revert (``run(..., revert=True)``),
    and RegTop-k at every ``mu`` of ``mu_sweep``. The final distance is the mean
    over the last 10% of the steps, compared with Top-k's. ``instances > 1``
    repeats Top-k and RegTop-k (``mu``) on problems drawn with the seeds
    ``seed + 1, ..., seed + instances - 1``: the ratio depends on the instance.
    Writes ``linreg.json`` (curves subsampled) and ``linreg.png`` (log scale) to
    ``out`` when given and prints the table; returns the results.
    """
    from hvd_compress.algorithms import NoneCompressor, RegTopK, TopK

    require_packages(torch=False, plots=plot and out is not None)
    if int(steps) < 1:
        raise ValueError(f"hvd_compress: steps must be at least 1, got {steps}")
    if int(instances) < 1:
        raise ValueError(f"hvd_compress: instances must be at least 1, got {instances}")
    steps, instances = int(steps), int(instances)
    # (label, compressor, mu, revert); every compressor is built (and checked) before any run
    runs = [
        ("dense", NoneCompressor(), None, False),
        ("top-k", _sparse(TopK, ratio), None, False),
        (f"regtop-k mu={mu:g}", _sparse(RegTopK, ratio, mu=mu), float(mu), False),
        (f"regtop-k mu={mu:g} + revert", _sparse(RegTopK, ratio, mu=mu), float(mu), True),
    ]
    for m in dict.fromkeys(float(m) for m in mu_sweep):
        if m != float(mu):
            runs.append((f"regtop-k mu={m:g}", _sparse(RegTopK, ratio, mu=m), m, False))
    problem = LinearRegressionProblem.generate(n_ranks=n_ranks, dim=dim, seed=seed)
    # (problem seed, label, compressor, revert) of every run: the study's, then the other instances'
    jobs = [(seed, label, compressor, revert) for label, compressor, _, revert in runs]
    for other in range(seed + 1, seed + instances):
        jobs += [(other, label, compressor, False) for label, compressor, _, _ in runs[1:3]]

    bar = progress_bar(len(jobs) * steps, "simulate linreg", "step", progress)
    every = max(1, steps // 100)
    curves: Dict[str, List[float]] = {}
    finals: Dict[tuple, float] = {}
    reverted: Dict[str, List[int]] = {label: [] for label, _, _, revert in runs if revert}
    started = time.perf_counter()
    try:
        for problem_seed, label, compressor, revert in jobs:
            bar.set_postfix_str(label if problem_seed == seed else f"{label}, instance seed {problem_seed}")
            instance = problem
            if problem_seed != seed:
                instance = LinearRegressionProblem.generate(n_ranks=n_ranks, dim=dim, seed=problem_seed)

            done = [0]

            def tick(step: int, distance: float, done: List[int] = done) -> None:
                if (step + 1) % every == 0 or step + 1 == steps:
                    bar.update(step + 1 - done[0])
                    done[0] = step + 1

            with single_threaded_blas():
                distances = run(
                    instance,
                    compressor,
                    steps=steps,
                    lr=lr,
                    revert=revert,
                    callback=tick,
                    reverted=reverted.get(label),
                )
            finals[(problem_seed, label)] = final_distance(distances)
            if problem_seed == seed:
                curves[label] = distances
    finally:
        bar.close()

    top = finals[(seed, "top-k")]
    rows = []
    for label, _, m, revert in runs:
        final = finals[(seed, label)]
        rows.append(
            {
                "label": label,
                "compressor": "none" if label == "dense" else label.split(" ")[0],
                "mu": m,
                "revert": revert,
                "reverted_steps": len(reverted[label]) if revert else None,
                "final_distance": final,
                "last_distance": curves[label][-1],
                "vs_topk": final / top if top > 0 else None,
            }
        )
    regtopk = runs[2][0]
    by_instance = [
        {
            "seed": s,
            "top-k": finals[(s, "top-k")],
            regtopk: finals[(s, regtopk)],
            "vs_topk": finals[(s, regtopk)] / finals[(s, "top-k")] if finals[(s, "top-k")] > 0 else None,
        }
        for s in range(seed, seed + instances)
    ]
    results = {
        "study": "linreg",
        "machine": describe_machine(),
        "settings": {
            "ranks": n_ranks,
            "dim": dim,
            "ratio": ratio,
            "mu": mu,
            "mu_sweep": [float(m) for m in mu_sweep],
            "steps": steps,
            "lr": lr,
            "seed": seed,
            "instances": instances,
            "samples_per_rank": int(problem.features[0].shape[0]),
            "final": f"mean ||x - x*||^2 over the last {FINAL_FRACTION:.0%} of the steps",
            "revert": "reference script's heuristic (DistLearnLinearReg.py), outside the compressor",
            "curve_points": f"about {CURVE_POINTS} evenly spaced steps per curve",
        },
        "wall_seconds": time.perf_counter() - started,
        "final": rows,
        "instances": by_instance,
        "curves": {label: subsample(d) for label, d in curves.items()},
    }
    return publish(results, out, "linreg", write_plot if plot else None, print_table, stdout)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(
        f"Distributed linear regression: {s['ranks']} ranks, d={s['dim']}, density {s['ratio']}, "
        f"lr {s['lr']}, {s['steps']} steps; final = {s['final']}"
    )
    say(f"\n  {'run':<26} {'final':>10} {'last step':>10} {'/ top-k':>8}")
    for r in results["final"]:
        ratio = "" if r["vs_topk"] is None else f"{r['vs_topk']:>7.3f}x"
        reverted = "" if r.get("reverted_steps") is None else f"  ({r['reverted_steps']} steps reverted)"
        say(
            f"  {r['label']:<26} {r['final_distance']:>10.3e} {r['last_distance']:>10.3e} {ratio:>8}{reverted}"
        )
    instances = results.get("instances", [])
    if len(instances) > 1:
        label = next(key for key in instances[0] if key.startswith("regtop-k"))
        say(f"\n  {len(instances)} problem instances: {label} / top-k final distance")
        for row in instances:
            say(
                f"  seed {row['seed']:<4} top-k {row['top-k']:.3e}  {label} {row[label]:.3e}  "
                f"{row['vs_topk']:.3f}x"
            )
        ratios = [row["vs_topk"] for row in instances if row["vs_topk"] is not None]
        say(f"  median {np.median(ratios):.3f}x, min {min(ratios):.3f}x, max {max(ratios):.3f}x")


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """``||x_t - x*||^2`` against the step, log scale: all runs, and the sparsified runs zoomed in.

    With several problem instances, a third panel shows RegTop-k's final distance over Top-k's per instance.
    """
    plt = pyplot()
    instances = results.get("instances", [])
    panels = 3 if len(instances) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    labels = list(results["curves"])
    regtopk = [label for label in labels if label.startswith("regtop-k")]
    colors = {"dense": "black", "top-k": "tab:red"}
    colors.update(
        {label: plt.cm.viridis(i / max(1, len(regtopk) - 1) * 0.85) for i, label in enumerate(regtopk)}
    )
    steps = results["settings"]["steps"]
    reverted = {r["label"]: r.get("reverted_steps") for r in results["final"]}
    for ax, zoom in ((axes[0], False), (axes[1], True)):
        for label in labels:
            if zoom and label == "dense":
                continue
            curve = results["curves"][label]
            step = np.asarray(curve["step"])
            distance = np.maximum(np.asarray(curve["distance"]), np.finfo(float).tiny)
            if zoom:
                keep = step > steps // 10
                step, distance = step[keep], distance[keep]
            line = "--" if "revert" in label else "-"
            text = label if reverted.get(label) is None else f"{label} ({reverted[label]} steps reverted)"
            ax.plot(step, distance, line, color=colors[label], label=text, linewidth=1.1)
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel(r"$\|x_t - x^*\|^2$")
    axes[0].set_title("all runs")
    axes[1].set_title(f"sparsified runs after step {steps // 10}")
    if panels == 3:
        ratios = [row["vs_topk"] or 0.0 for row in instances]
        axes[2].bar([str(row["seed"]) for row in instances], ratios, color="tab:green")
        axes[2].axhline(1.0, color="tab:red", linewidth=1, label="top-k")
        axes[2].axhline(float(np.median(ratios)), color="black", linestyle="--", linewidth=1, label="median")
        axes[2].set_xlabel("problem seed")
        axes[2].set_ylabel("final distance / top-k's")
        label = next(key for key in instances[0] if key.startswith("regtop-k"))
        axes[2].set_title(f"{label} vs top-k per problem instance")
        axes[2].grid(axis="y", alpha=0.3)
        axes[2].legend(fontsize="small")
    s = results["settings"]
    fig.suptitle(f"Linear regression, {s['ranks']} ranks, d={s['dim']}, density {s['ratio']}, lr {s['lr']}")
    save_figure(fig, path)
