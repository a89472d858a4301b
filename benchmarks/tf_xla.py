"""``python -m benchmarks tf-xla``: the CPU's Top-k marking pass on TensorFlow's route, numpy vs a TensorFlow
graph vs XLA.

The work of one Top-k selection pass over a float32 gradient ``g`` with residual ``r`` (the sampled
limit ``t`` given): ``a = g + r``, the marks ``|a| > t``, the largest ``|a|`` (the non-finite flag) and
the marked positions. Rows, timed in the same run (median of ``repeats`` calls, each after ``warmup``):

- ``clone``: ``g.copy()`` in numpy (a read and a write of the gradient: the yardstick);
- ``numpy``: the pass as TensorFlow's eager CPU tensors run it (:func:`hvd_compress.kernels.computed_form`
  hands them to numpy's kernels): ``np.add`` into a kept buffer, the comparison, ``np.max`` and
  ``np.flatnonzero``;
- ``tf-graph``: the same ops in one ``tf.function`` (TensorFlow's own kernels, ``tf.where`` for the
  positions): what a TensorFlow graph runs;
- ``tf-xla``: ``a``, the marks and the largest in one ``tf.function(jit_compile=True)`` (XLA fuses them;
  the positions, a shape known only from the data, by ``np.flatnonzero`` of the marks on the host).

Each row's result is checked against numpy's (the same positions and largest). The JSON records the
machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from benchmarks.output import describe_machine, publish

ROWS = ("clone", "numpy", "tf-graph", "tf-xla")
#: the share of entries above the limit (Top-k's marked few k at 1%)
MARKED = 0.012


def _inputs(n: int, seed: int):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n, dtype=np.float32)
    r = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.3))
    limit = np.float32(np.quantile(np.abs(g[:: max(1, n // 65536)] + r[:: max(1, n // 65536)]), 1 - MARKED))
    return g, r, limit


def _passes(g: np.ndarray, r: np.ndarray, limit: np.float32) -> Dict[str, Callable[[], Any]]:
    """Each row's call, returning ``(positions, largest)`` (``clone``: the copy)."""
    import tensorflow as tf

    kept = np.empty_like(g)

    def numpy_pass():
        a = np.add(g, r, out=kept)
        magnitude = np.abs(a)
        return np.flatnonzero(magnitude > limit), magnitude.max()

    def body(g, r, limit):
        magnitude = tf.abs(g + r)
        return magnitude > limit, tf.reduce_max(magnitude)

    @tf.function
    def graph_body(g, r, limit):
        marks, largest = body(g, r, limit)
        return tf.where(marks)[:, 0], largest

    xla_body = tf.function(body, jit_compile=True)
    tg, tr, tl = tf.constant(g), tf.constant(r), tf.constant(limit)

    def graph_pass():
        positions, largest = graph_body(tg, tr, tl)
        return positions.numpy(), largest.numpy()

    def xla_pass():
        marks, largest = xla_body(tg, tr, tl)
        return np.flatnonzero(marks.numpy()), largest.numpy()

    return {"clone": g.copy, "numpy": numpy_pass, "tf-graph": graph_pass, "tf-xla": xla_pass}


def _median_ms(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - started))
    return statistics.median(times)


def run(sizes: Sequence[int] = (11_700_000, 25_600_000), repeats: int = 9, warmup: int = 3, seed: int = 0,
        out: Optional[str] = "results", stdout: Any = None) -> Dict[str, Any]:
    """Every row at every size (module docstring); writes ``tf_xla.json`` and ``tf_xla.png`` to ``out``."""
    rows: List[Dict[str, Any]] = []
    for n in sizes:
        g, r, limit = _inputs(n, seed)
        passes = _passes(g, r, limit)
        want = passes["numpy"]()
        for name in ROWS:
            if name != "clone":
                positions, largest = passes[name]()
                if not (np.array_equal(positions, want[0]) and float(largest) == float(want[1])):
                    raise RuntimeError(f"tf-xla: {name} selects otherwise than numpy at {n} elements")
            rows.append({"size": n, "row": name, "ms": _median_ms(passes[name], repeats, warmup)})
        clone = rows[-len(ROWS)]["ms"]
        for row in rows[-len(ROWS):]:
            row["vs_clone"] = row["ms"] / clone
    results = {"benchmark": "tf-xla", "machine": describe_machine(),
               "settings": {"sizes": list(sizes), "repeats": repeats, "warmup_calls": warmup, "seed": seed,
                            "marked_share": MARKED, "statistic": "median ms of one call"},
               "rows": rows}
    return publish(results, out, "tf_xla", write_plot, print_table, stdout)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    stdout = stdout or sys.stdout
    print("Top-k's marking pass on TensorFlow's route (a = g + r, |a| > t, max |a|, the positions), "
          f"median of {results['settings']['repeats']}", file=stdout)
    print(f"{'size':>8} {'row':<10} {'ms':>9} {'/clone':>7}", file=stdout)
    for row in results["rows"]:
        print(f"{row['size'] / 1e6:>7.1f}M {row['row']:<10} {row['ms']:>9.2f} {row['vs_clone']:>6.2f}x", file=stdout)


def write_plot(results: Dict[str, Any], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["settings"]["sizes"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(ROWS)
    for i, name in enumerate(ROWS):
        ms = [next(r["ms"] for r in results["rows"] if r["size"] == n and r["row"] == name) for n in sizes]
        ax.bar(np.arange(len(sizes)) + i * width, ms, width, label=name)
    ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, [f"{n / 1e6:.1f}M float32" for n in sizes])
    ax.set_ylabel("ms per call (median)")
    ax.set_title("Top-k's marking pass on TensorFlow's route: numpy, a graph, XLA")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_command(commands: Any, add_out: Callable, wrote: Callable) -> None:
    """``python -m benchmarks tf-xla`` on the CLI's subcommands."""
    p = commands.add_parser("tf-xla", help="Top-k's marking pass on TensorFlow's CPU route: numpy, a graph, XLA")
    from benchmarks.compress import parse_size

    p.add_argument("--sizes", type=lambda text: [parse_size(part) for part in text.split(",") if part.strip()],
                   default=[11_700_000, 25_600_000], help="elements, e.g. 11.7M,25.6M (default)")
    p.add_argument("--repeats", type=int, default=9, help="timed calls per row (median)")
    p.add_argument("--seed", type=int, default=0)

    def handle(args: argparse.Namespace) -> int:
        run(sizes=args.sizes, repeats=args.repeats, seed=args.seed, out=args.out)
        return wrote(args.out, "tf_xla")

    add_out(p, "tf_xla", handle)
