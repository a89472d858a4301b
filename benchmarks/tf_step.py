"""``python -m benchmarks tf-step``: TensorFlow training-step time, dense vs compressed, 2 processes.

Two processes (``horovodrun -np 2 --gloo``, or ``mpirun``; loopback) train a Keras
model inside ``tf.function`` (a custom loop: forward, ``DistributedGradientTape``,
``apply_gradients`` of plain SGD) on synthetic 28x28 images, one fixed batch per rank:

- ``mlp``: the Fashion-MNIST MLP of :func:`benchmarks.convergence.make_model`
  (784 -> 256 -> 128 -> 10, 235,146 parameters);
- ``cnn``: its small CNN (conv 1->16, max-pool, conv 16->32, max-pool, fc 1568 -> 128 -> 10,
  206,922 parameters).

Rows (:data:`ROWS`), every one on the same model, data and processes:

- ``dense``: stock ``horovod.tensorflow.DistributedGradientTape``, no compression;
- ``horovod-fp16``: stock, ``hvd.Compression.fp16`` (Horovod's own);
- ``stock-<name>``: stock, ``compression=`` our Top-k 1%, RegTop-k 1% or TernGrad;
- ``stock-grouped-<name>``: the same with ``groups=1`` (Horovod's one group: one exchange of every gradient);
- ``dropin-<name>``: ``hvd_compress.tensorflow.DistributedGradientTape`` with the same.

Clock: the wall time of one call of the step function until its loss is on the host.
Each row first runs ``warmup`` untimed steps (the trace), then the rows take turns,
``steps`` timed steps each per round for ``rounds`` rounds, so that load from other
processes on a small machine falls on every row alike. Reported: the median step of
each rank, the slower rank's, and its ratio to ``dense`` of the same run. ``ranks_agree``:
every rank ends with the same weights (each row's exchange gave every rank the same average).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from benchmarks.output import describe_machine, publish
from benchmarks import report

MODULE = "benchmarks.tf_step"
PROGRESS = "@progress "
MODELS = ("mlp", "cnn")
RATIO = 0.01
#: row -> (route: "stock", "stock-grouped" (``groups=1``) or "dropin", compression: None, "fp16" (Horovod's) or
#: one of ours by name)
ROWS = {
    "dense": ("stock", None),
    "horovod-fp16": ("stock", "fp16"),
    "stock-topk": ("stock", "topk"),
    "stock-regtopk": ("stock", "regtopk"),
    "stock-terngrad": ("stock", "terngrad"),
    "stock-grouped-topk": ("stock-grouped", "topk"),
    "stock-grouped-regtopk": ("stock-grouped", "regtopk"),
    "stock-grouped-terngrad": ("stock-grouped", "terngrad"),
    "dropin-topk": ("dropin", "topk"),
    "dropin-regtopk": ("dropin", "regtopk"),
    "dropin-terngrad": ("dropin", "terngrad"),
}
#: suffix of a row run with the communicator's queued collectives issued one at a time (``--one-by-one``)
ONE_BY_ONE = ":one-by-one"
LAUNCHERS = ("horovodrun", "mpirun")
HOROVODRUN = "from horovod.runner.launch import run_commandline; run_commandline()"


# ================================================================== worker side
def make_model(kind: str) -> Any:
    """The Keras ``mlp`` or ``cnn`` (module docstring) for 28x28x1 images, the same weights on every rank."""
    import tensorflow as tf

    init = tf.keras.initializers.GlorotUniform
    layers = tf.keras.layers
    if kind == "mlp":
        stack = [layers.Flatten(), layers.Dense(256, "relu", kernel_initializer=init(1)),
                 layers.Dense(128, "relu", kernel_initializer=init(2)), layers.Dense(10, kernel_initializer=init(3))]
    else:
        stack = [layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init(1)),
                 layers.MaxPool2D(), layers.Conv2D(32, 3, padding="same", activation="relu", kernel_initializer=init(2)),
                 layers.MaxPool2D(), layers.Flatten(), layers.Dense(128, "relu", kernel_initializer=init(3)),
                 layers.Dense(10, kernel_initializer=init(4))]
    model = tf.keras.Sequential(stack)
    model.build((None, 28, 28, 1))
    return model


def make_compression(name: Optional[str]) -> Any:
    """Horovod's ``fp16`` or none (``name`` None), else our compressor ``name`` at :data:`RATIO`."""
    import horovod.tensorflow as hvd

    from hvd_compress import Compression

    if name is None:
        return hvd.Compression.none
    if name == "fp16":
        return hvd.Compression.fp16
    return Compression.by_name(name, RATIO)


def make_step(row: str, model: Any, lr: float) -> Callable[[Any, Any], Any]:
    """The row's training step, a ``tf.function`` returning the loss."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvd_compress.tensorflow as dropin

    route, name = ROWS[row.removesuffix(ONE_BY_ONE)]
    wrap = dropin.DistributedGradientTape if route == "dropin" else hvd.DistributedGradientTape
    grouping = {"groups": 1} if route == "stock-grouped" else {}
    compression = make_compression(name)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = tf.keras.optimizers.SGD(lr)

    @tf.function
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = wrap(tape, compression=compression, **grouping).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def use_collectives(row: str) -> None:
    """Before running ``row``: the TF communicator runs its queue grouped, or one by one for ``:one-by-one`` rows."""
    from hvd_compress.horovod.tensorflow_hooks import HorovodTensorFlowCommunicator

    HorovodTensorFlowCommunicator.grouped = not row.endswith(ONE_BY_ONE)


def ranks_agree(model: Any) -> bool:
    """Whether every rank holds the same weights."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    mine = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
    gathered = hvd.allgather(mine[None], name=f"tf_step.agree.{id(model)}").numpy()
    return bool((gathered == gathered[0]).all())


def time_model(kind: str, config: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """Every row on model ``kind``: warm-up, then ``rounds`` rounds of ``steps`` timed steps per row."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(config["seed"] + rank)
    x = tf.constant(rng.standard_normal((config["batch"], 28, 28, 1)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, config["batch"]).astype(np.int64))
    rows = config["rows"]
    models = {row: make_model(kind) for row in rows}
    steps = {row: make_step(row, models[row], config["lr"]) for row in rows}
    times: Dict[str, List[float]] = {row: [] for row in rows}
    for row in rows:
        use_collectives(row)
        started = time.perf_counter()
        for _ in range(config["warmup"]):
            steps[row](x, y).numpy()
        if rank == 0:
            print(f"{PROGRESS}{kind} {row}: traced and warmed up in {time.perf_counter() - started:.1f} s", flush=True)
    for round_ in range(config["rounds"]):
        for row in rows:
            use_collectives(row)
            for _ in range(config["steps"]):
                started = time.perf_counter()
                steps[row](x, y).numpy()
                times[row].append(time.perf_counter() - started)
        if rank == 0:
            medians = ", ".join(f"{row} {1e3 * float(np.median(times[row])):.1f}" for row in rows)
            print(f"{PROGRESS}{kind} round {round_ + 1}/{config['rounds']}: median ms {medians}", flush=True)
    return {row: {"step_s": times[row], "ranks_agree": ranks_agree(models[row])} for row in rows}


def worker(config: Dict[str, Any]) -> None:
    """One rank: every model, every row; writes ``config["out"].<rank>``."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    tf.config.threading.set_inter_op_parallelism_threads(config["threads"])
    tf.config.threading.set_intra_op_parallelism_threads(config["threads"])
    result = {model: time_model(model, config, hvd.rank()) for model in config["models"]}
    with open(f"{config['out']}.{hvd.rank()}", "w") as f:
        json.dump({"rank": hvd.rank(), "size": hvd.size(), "models": result}, f)


# ================================================================== driver side
def launch_command(launcher: str, ranks: int, config: Dict[str, Any]) -> List[str]:
    if launcher == "horovodrun":
        head = [sys.executable, "-c", HOROVODRUN, "-np", str(ranks), "--gloo"]
    else:
        head = ["mpirun", "-np", str(ranks), "--oversubscribe"]
    return head + [sys.executable, "-m", MODULE, "worker", json.dumps(config)]


def run_ranks(launcher: str, ranks: int, config: Dict[str, Any], timeout: float, say: Callable) -> List[Dict]:
    """Run the workers; rank 0's progress lines go to ``say``; every rank's result, rank order."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_USE_LEGACY_KERAS="1", OMP_NUM_THREADS=str(config["threads"]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.TemporaryDirectory(prefix="hvd_compress_tf_step_") as tmp:
        config = dict(config, out=str(Path(tmp) / "result.json"))
        proc = subprocess.Popen(launch_command(launcher, ranks, config), cwd=root, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        output: List[str] = []
        stop = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a hang ends here
        stop.start()
        try:
            for line in proc.stdout:
                if PROGRESS in line:
                    say(line.split(PROGRESS, 1)[1].strip())
                else:
                    output.append(line)
            code = proc.wait()
        finally:
            stop.cancel()
        missing = [r for r in range(ranks) if not Path(f"{config['out']}.{r}").exists()]
        if code != 0 or missing:
            raise RuntimeError(f"hvd_compress: {launcher} exited with {code}, no result from ranks {missing}:\n"
                               f"{''.join(output)[-3000:]}")
        return [json.loads(Path(f"{config['out']}.{r}").read_text()) for r in range(ranks)]


def rows_of(per_rank: List[Dict[str, Any]], model: str) -> List[Dict[str, Any]]:
    """One row per run on ``model``: each rank's median step, the slower rank's, its ratio to dense."""
    import numpy as np

    rows = []
    for row in per_rank[0]["models"][model]:
        medians = [float(np.median(r["models"][model][row]["step_s"])) for r in per_rank]
        route, name = ROWS[row.removesuffix(ONE_BY_ONE)]
        rows.append({"model": model, "row": row, "route": route, "compression": name or "none",
                     "steps": len(per_rank[0]["models"][model][row]["step_s"]), "median_step_s_per_rank": medians,
                     "step_s": max(medians), "ranks_agree": all(r["models"][model][row]["ranks_agree"]
                                                               for r in per_rank)})
    dense = next((r["step_s"] for r in rows if r["row"] == "dense"), None)
    for r in rows:
        r["ratio_to_dense"] = None if dense is None else r["step_s"] / dense
    return rows


def baseline_of(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """An earlier run's rows (``--baseline``: its JSON), shown next to this run's."""
    if not path:
        return None
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"hvd_compress: cannot read the baseline {path}: {error}") from error
    return {"file": Path(path).name, "label": earlier.get("label"), "rows": earlier["rows"]}


def run(models: Sequence[str] = MODELS, rows: Sequence[str] = tuple(ROWS), ranks: int = 2, steps: int = 10,
        rounds: int = 3, warmup: int = 3, batch: int = 64, lr: float = 0.05, threads: int = 1,
        launcher: str = "horovodrun", baseline: Optional[str] = None, label: Optional[str] = None,
        seed: int = 0, out: Optional[str] = "results", progress: bool = True, plot: bool = True,
        stdout: Any = None, timeout: float = 3600) -> Dict[str, Any]:
    """Every row on every model; writes ``tf_step.json`` and ``tf_step.png`` to ``out``, prints the table."""
    report.require_packages(torch=False, plots=plot and out is not None)
    check(models, rows, ranks, launcher)
    earlier = baseline_of(baseline)
    config = {"models": list(models), "rows": list(rows), "steps": steps, "rounds": rounds, "warmup": warmup,
              "batch": batch, "lr": lr, "threads": threads, "seed": seed}
    started = time.perf_counter()

    def say(text: str) -> None:
        if progress:
            print(f"tf-step {text} ({time.perf_counter() - started:.0f} s in all)", file=sys.stderr, flush=True)

    per_rank = run_ranks(launcher, ranks, config, timeout, say)
    results = {
        "benchmark": "tf_step",
        "label": label,
        "machine": describe_machine(),
        "settings": {**config, "ranks": ranks, "launcher": launcher, "ratio": RATIO, "link": "loopback",
                     "clock": "one step-function call until the loss is on the host; median per rank, slower rank"},
        "wall_seconds": time.perf_counter() - started,
        "rows": [r for model in models for r in rows_of(per_rank, model)],
        "baseline": earlier,
    }
    return publish(results, out, "tf_step", write_plot if plot else None, print_table, stdout)


def check(models: Sequence[str], rows: Sequence[str], ranks: int, launcher: str) -> None:
    """Bad options fail before any process starts."""
    unknown = [m for m in models if m not in MODELS] + [r for r in rows if r.removesuffix(ONE_BY_ONE) not in ROWS]
    if unknown:
        raise ValueError(f"hvd_compress: unknown {unknown}; models: {', '.join(MODELS)}; rows: {', '.join(ROWS)}")
    if "dense" not in rows:
        raise ValueError("hvd_compress: the rows must include dense (the ratios' baseline)")
    if int(ranks) < 2:
        raise ValueError(f"hvd_compress: ranks must be at least 2, got {ranks}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"hvd_compress: launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")


# ---------------------------------------------------------------------- output
def _earlier(results: Dict[str, Any], model: str, row: str) -> Optional[Dict[str, Any]]:
    base = results.get("baseline")
    return None if base is None else next(
        (r for r in base["rows"] if r["model"] == model and r["row"] == row), None)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    base = results.get("baseline")
    say(f"TensorFlow step time: {s['ranks']} processes ({s['launcher']}, loopback), batch {s['batch']} per rank, "
        f"ratio {s['ratio']:g}; median of {s['rounds']} x {s['steps']} steps, slower rank; "
        f"{results['machine']['cpu_count']} CPU cores")
    extra = f" {'before ms':>9} {'before x':>8}" if base else ""
    width = max([16] + [len(r["row"]) for r in results["rows"]])
    say(f"\n  {'model':<5} {'row':<{width}} {'step ms':>8} {'x dense':>8}{extra} {'ranks agree':>11}")
    for r in results["rows"]:
        earlier = _earlier(results, r["model"], r["row"])
        before = "" if not base else (f" {'-':>9} {'-':>8}" if earlier is None else
                                      f" {1e3 * earlier['step_s']:>9.1f} {earlier['ratio_to_dense']:>7.2f}x")
        say(f"  {r['model']:<5} {r['row']:<{width}} {1e3 * r['step_s']:>8.1f} {r['ratio_to_dense']:>7.2f}x{before} "
            f"{str(r['ranks_agree']):>11}")


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """A panel per model: each row's step time as a ratio to dense (this run; the baseline's next to it)."""
    models = list(dict.fromkeys(r["model"] for r in results["rows"]))
    fig, axes = report.pyplot().subplots(1, len(models), figsize=(6.5 * len(models), 4.4), squeeze=False)
    base = results.get("baseline")
    for ax, model in zip(axes[0], models):
        shown = [r for r in results["rows"] if r["model"] == model]
        groups = [(results.get("label") or "this run", [r["ratio_to_dense"] for r in shown])]
        if base:
            earlier = [_earlier(results, model, r["row"]) for r in shown]
            groups.insert(0, (base.get("label") or base["file"],
                              [float("nan") if e is None else e["ratio_to_dense"] for e in earlier]))
        report.ratio_bars(ax, [r["row"] for r in shown], groups)
        ax.set_title(f"{model}: median step / dense step")
        for label in ax.get_xticklabels():
            label.set(rotation=30, horizontalalignment="right")
        ax.legend(fontsize="small")
    s = results["settings"]
    fig.suptitle(f"TensorFlow step time vs dense, {s['ranks']} processes on {results['machine']['cpu_count']} "
                 f"CPU cores (loopback), batch {s['batch']} per rank, ratio {s['ratio']:g}", fontsize="medium")
    report.save_figure(fig, path)


# ------------------------------------------------------------------------- CLI
def add_command(commands: Any, add_out: Callable, wrote: Callable) -> None:
    """``python -m benchmarks tf-step`` on the CLI's subcommands."""
    p = commands.add_parser("tf-step", help="TensorFlow step time on 2 processes: dense, Horovod fp16, our "
                                            "compressors through stock horovod.tensorflow and the drop-in tape")
    split = lambda text: [part.strip() for part in text.split(",") if part.strip()]  # noqa: E731
    p.add_argument("--models", type=split, default=list(MODELS), help=f"{','.join(MODELS)} (default both)")
    p.add_argument("--rows", type=split, default=list(ROWS), help=f"of {','.join(ROWS)} (default all)")
    p.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row and round (10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the rows (3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first, the trace included (3)")
    p.add_argument("--batch-size", type=int, default=64, help="per rank (64)")
    p.add_argument("--threads", type=int, default=1, help="TensorFlow threads per process (1)")
    p.add_argument("--launcher", choices=LAUNCHERS, default="horovodrun", help="horovodrun --gloo or mpirun")
    p.add_argument("--one-by-one", action="store_true",
                   help=f"add each compressed row again as ROW{ONE_BY_ONE}: the TF communicator's collectives "
                        "issued one Horovod call at a time, as before they were grouped (the rows take turns)")
    p.add_argument("--baseline", help="an earlier tf_step.json, shown next to this run")
    p.add_argument("--label", help="this run's name in the table and figure")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")

    def handle(args: argparse.Namespace) -> int:
        print(f"TensorFlow step time: {', '.join(args.models)}; rows {', '.join(args.rows)}; {args.ranks} "
              f"processes, {args.rounds} rounds of {args.steps} steps")
        if args.one_by_one:
            args.rows += [row + ONE_BY_ONE for row in args.rows if ROWS.get(row, (None, None))[1] not in (None, "fp16")]
        try:
            run(models=args.models, rows=args.rows, ranks=args.ranks, steps=args.steps, rounds=args.rounds,
                warmup=args.warmup, batch=args.batch_size, threads=args.threads, launcher=args.launcher,
                baseline=args.baseline, label=args.label, out=args.out, progress=not args.no_progress)
        except RuntimeError as error:
            print(f"python -m benchmarks: {error}", file=sys.stderr)
            return 1
        return wrote(args.out, "tf_step")

    add_out(p, "tf_step", handle)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "worker":
        raise SystemExit("usage: python -m benchmarks.tf_step worker CONFIG_JSON (started by python -m benchmarks)")
    worker(json.loads(sys.argv[2]))
