"""``python -m benchmarks time-to-accuracy``: training time to a target test accuracy, dense against
compressed configurations and ``Auto``, N real processes on an emulated link.

N processes (default 4), each in its own network namespace of
``ci/netns_cluster.sh`` (every node a full-duplex link of RATE, :mod:`benchmarks.cluster`;
``--link none``: plain processes on localhost), join a gloo ``torch.distributed``
group and train the convergence study's MLP (:func:`benchmarks.convergence.make_model`)
on Fashion-MNIST (or digits) through the library's drop-in
``hvd_compress.torch.DistributedOptimizer`` over
:class:`~hvd_compress.transport.torch_dist.TorchDistCommunicator`. Every step each
rank takes its own ``batch_per_rank`` rows of the global batch (the same
permutation on every rank, a fresh one per epoch, as the Simulator's study).

Runs (``--runs``, :data:`RUNS`; default ``dense,compressor,auto``), one after another in the
same process group and link, in the order given; each compressor is built by
:class:`benchmarks.convergence.Run` (:meth:`Training.spec`):

- ``dense``: ``NoneCompressor`` (one fp32 allreduce per bucket), SGD with momentum;
- ``fp16``: :class:`~hvd_compress.FP16` (the dense allreduce in float16, half the bytes),
  SGD with momentum as dense;
- ``compressor``: the sparsifier (``--compressor``, ``--ratio``) in the chosen variant of
  :data:`benchmarks.convergence.VARIANTS` (default ``mc+warmup``: momentum
  correction, the optimizer without momentum, and :class:`~hvd_compress.DensityWarmup`
  from ``warmup_start`` stepped every iteration);
- ``aggregate``: the same sparsifier and variant with ``indices="aggregate"`` (one index set
  that every rank derives alike, its values allreduced) at density ``aggregate_ratio``
  (``--aggregate-ratio``, default 0.08);
- ``traffic``: a traffic budget (the README's "A budget in traffic"), ``TopK(traffic=T, momentum=m)`` (``T``:
  ``--traffic``, default 0.04 of a dense fp32 allreduce's bytes per rank; from 2 ranks on the
  ``aggregate`` rule at density ``T``) with ``DensityWarmup(compressor, warm-up steps,
  start=0.1)`` (:data:`TRAFFIC_WARMUP_START`) and SGD without momentum, whatever ``--variant``;
  ``--dense-below`` sets its ``dense_below=`` (the README's recommended setting: ``--traffic 0.03
  --dense-below 2000``);
- ``auto``: ``Auto`` of the ``compressor`` run (:class:`hvd_compress.Auto`: it measures each
  bucket's exchange both ways on this link and sends it the cheaper way), with
  the same variant; with the warm-up, ``DensityWarmup`` has it measure again
  when the ramp reaches the target density, so the choice is made for the
  density that trains on (during the ramp at 25% the "compressed" exchange
  sends every tensor dense).

A row's ``run`` names the configuration in the JSON: ``none`` (dense), ``fp16``, the compressor
(``topk``), ``topk-aggregate``, ``traffic``, ``auto-topk``; ``configuration`` is the ``--runs`` name.

Every run follows the same step-size schedule (``lr_schedule``: by default a cosine decay
from ``lr`` to 0 over the run, stepped every iteration, so that the last evaluations settle
instead of swinging by a point around the target; ``constant`` keeps ``lr``).

Clock: the sum over steps of each step's wall time (zero-grad, forward,
backward, exchange, update, warm-up step), the maximum over ranks; the test
evaluations (``evals_per_epoch`` per epoch, each rank scoring its share of the
test set) are not counted. Time to target: the training seconds at the first
evaluation whose accuracy reaches the target, dense's final accuracy on the
same link minus ``target_gap`` points; ``speedup`` = dense's time to target /
the run's. Bytes per step and rank: handed to the collectives (``payload``;
``warm_payload``: over the steps after the warm-up), their ring traffic, and on
emulated links the bytes the interface sent.

Ranks sharing few cores take turns on the CPU, so compute and compression run
slower than on a machine with a core per rank; the JSON records the machine and
its load. The issue's goals (:data:`GOALS`, over the runs other than dense: the best
at least 2x faster than dense over 1 Gbit/s; one reaching the target no later than
dense over 10 Gbit/s) are printed with the measured values, never asserted.
"""

from __future__ import annotations

import functools
import gc
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import cluster, convergence
from benchmarks.step import AUTO_PREFIX, AUTO_WARMUP, CountingCommunicator
from benchmarks.output import describe_machine, publish
from benchmarks import report
from hvd_compress.algorithms.traffic import SHARED_FROM
from hvd_compress.algorithms.traffic import resolve as traffic_plan

MODULE = "benchmarks.time_to_accuracy"
#: ``--runs`` names (module docstring)
RUNS = ("dense", "fp16", "compressor", "aggregate", "traffic", "auto")
DEFAULT_RUNS = ("dense", "compressor", "auto")
#: the ``traffic`` run's warm-up start, a fraction of a dense allreduce's bytes (as the README recommends)
TRAFFIC_WARMUP_START = 0.1
#: (rate, bound, "speedup" >= bound or "time ratio" <= bound), read on the best run other than dense:
#: printed, never asserted.
GOALS = (("1gbit", 2.0, "speedup"), ("10gbit", 1.0, "time ratio"))
#: Plot colour and line style per configuration; ``compressor``: its sparsifier's colour
#: (:func:`benchmarks.cnn.curve_style`).
STYLES = {"dense": ("black", "-"), "fp16": ("tab:gray", "-"), "aggregate": ("tab:blue", "-"),
          "traffic": ("tab:purple", "-"), "auto": ("tab:orange", "--")}


def check_runs(names: Sequence[str]) -> Tuple[str, ...]:
    """``names`` once each, in order; ``ValueError`` for a name outside :data:`RUNS` or without ``dense``
    (the target and every speedup are dense's)."""
    unknown = [name for name in names if name not in RUNS]
    if unknown:
        raise ValueError(f"unknown run {', '.join(map(repr, unknown))}; choose from {', '.join(RUNS)}")
    if "dense" not in names:
        raise ValueError("the runs must include dense: the target and every speedup are dense's")
    return tuple(dict.fromkeys(names))


@dataclass(frozen=True)
class Training:
    """What every run shares: data, model, steps, optimizer, the runs and their compressors."""

    data: str = "fashion-mnist"
    data_dir: Optional[str] = None
    train_size: Optional[int] = 12800
    test_size: Optional[int] = 2000
    model: str = "mlp"
    epochs: int = 4
    batch_per_rank: int = 32
    lr: float = 0.05
    #: ``cosine``: the step size decays from ``lr`` to 0 over the run (per step); ``constant``
    lr_schedule: str = "cosine"
    momentum: float = 0.9
    compressor: str = "topk"
    ratio: float = 0.01
    variant: str = "mc+warmup"
    warmup_epochs: float = 0.5
    warmup_start: float = 0.25
    evals_per_epoch: int = 4
    seed: int = 0
    #: the runs, names of :data:`RUNS` (``--runs``)
    configurations: Tuple[str, ...] = DEFAULT_RUNS
    #: the ``aggregate`` run's density
    aggregate_ratio: float = 0.08
    #: the ``traffic`` run's budget, a fraction of a dense fp32 allreduce's bytes per rank
    traffic: float = 0.04
    #: the ``traffic`` run's ``dense_below=`` (tensors of fewer entries sent dense; None: the sparsifier's
    #: default); the README's recommended setting is ``traffic=0.03, dense_below=2000``
    dense_below: Optional[int] = None

    def runs(self) -> List[str]:
        """The configurations, once each, in the order given."""
        return list(dict.fromkeys(self.configurations))

    def spec(self, configuration: str) -> convergence.Run:
        """The convergence study's run of ``configuration`` (``auto``: the compressor Auto wraps)."""
        if configuration in ("dense", "fp16"):
            return convergence.Run(self.model, "none" if configuration == "dense" else "fp16")
        if configuration == "aggregate":
            return convergence.Run(self.model, self.compressor, self.aggregate_ratio, self.variant, "aggregate")
        if configuration == "traffic":
            return convergence.Run(self.model, "topk", variant="mc+warmup", indices="auto", traffic=self.traffic,
                                   dense_below=self.dense_below)
        return convergence.Run(self.model, self.compressor, self.ratio, self.variant)

    def name(self, configuration: str) -> str:
        """The row's ``run``: ``none``, ``fp16``, ``topk``, ``topk-aggregate``, ``traffic``, ``auto-topk``."""
        return {"dense": "none", "compressor": self.compressor, "aggregate": f"{self.compressor}-aggregate",
                "auto": AUTO_PREFIX + self.compressor}.get(configuration, configuration)

    def warmup_from(self, configuration: str) -> float:
        """The warm-up's start: :data:`TRAFFIC_WARMUP_START` for ``traffic``, else ``warmup_start``; at
        least the target."""
        spec = self.spec(configuration)
        start = TRAFFIC_WARMUP_START if configuration == "traffic" else self.warmup_start
        return max(start, spec.ratio or spec.traffic)

    def label(self, configuration: str) -> str:
        """``dense``, ``fp16``, ``top-k 1% +mc +warm-up``, ``top-k 8% +mc +warm-up [aggregate]``,
        ``traffic 0.04 (aggregate 4% +mc +warm-up from 10%)``, ``traffic 0.03 (aggregate 3% +mc +warm-up from
        10%, dense below 2000)``, ``auto(top-k 1% +mc +warm-up)``."""
        if configuration == "traffic":
            indices, density = traffic_plan(self.traffic, "auto", SHARED_FROM)  # as on every N >= 2 ranks
            dense = "" if self.dense_below is None else f", dense below {self.dense_below}"
            return (f"traffic {self.traffic:g} ({indices} {density * 100:g}% +mc +warm-up from "
                    f"{self.warmup_from(configuration) * 100:g}%{dense})")
        inner = self.spec(configuration).label
        return f"auto({inner})" if configuration == "auto" else inner


# ================================================================== worker side
def make_compressor(configuration: str, training: Training) -> Any:
    """A new compressor of ``configuration``: its :meth:`Training.spec`'s (with momentum correction owning
    ``momentum``), ``Auto`` of it for ``auto``."""
    from hvd_compress import Auto

    compressor = training.spec(configuration).compressor(training.momentum)
    return Auto(compressor, warmup=AUTO_WARMUP, log=False) if configuration == "auto" else compressor


def evaluate_shared(model: Any, data: Any, rank: int, world: int) -> float:
    """Test accuracy, each rank scoring every ``world``-th test image from ``rank``; summed over ranks."""
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        x, y = data.test_x[rank::world], data.test_y[rank::world]
        counts = torch.tensor([float((model(x).argmax(1) == y).sum()), float(len(y))], dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def parameters_agree(model: Any, world: int) -> bool:
    """Whether every rank holds the same parameters (the exchange gives all ranks the same average)."""
    import torch
    import torch.distributed as dist

    mine = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def train_run(configuration: str, training: Training, data: Any, base: Any, config: Dict[str, Any]) -> Dict[str, Any]:
    """One run on this rank: the test-accuracy curve against training seconds, bytes per step."""
    import torch
    import torch.nn.functional as F

    from hvd_compress import DensityWarmup
    from hvd_compress.torch.optimizer import DistributedOptimizer

    rank, world = config["rank"], config["world"]
    spec = training.spec(configuration)
    compressor = make_compressor(configuration, training)
    model = convergence.make_model(training.model, tuple(data.train_x.shape[1:]), training.seed)
    comm = CountingCommunicator(base)
    sgd = torch.optim.SGD(model.parameters(), lr=training.lr,
                          momentum=0.0 if spec.momentum_correction else training.momentum)
    opt = DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compressor,
                               communicator=comm)
    global_batch = world * training.batch_per_rank
    per_epoch = len(data.train_y) // global_batch
    total = training.epochs * per_epoch
    eval_every = max(1, per_epoch // max(1, training.evals_per_epoch))
    decay = convergence.cnn.step_decay(sgd, training.lr_schedule, total)
    schedule, ramp = None, 0
    if spec.warmup:
        ramp = max(1, round(training.warmup_epochs * per_epoch))
        schedule = DensityWarmup(compressor, ramp, start=training.warmup_from(configuration))
    order = torch.Generator().manual_seed(training.seed)
    curve = {"seconds": [0.0], "step": [0], "test_accuracy": [evaluate_shared(model, data, rank, world)]}
    tx_start, seconds, payload_at_ramp = cluster.tx_bytes(config["ifname"]), 0.0, None
    for step in range(total):
        if step == ramp:
            payload_at_ramp = comm.payload
        if step % per_epoch == 0:
            perm = torch.randperm(len(data.train_y), generator=order)
        start = (step % per_epoch) * global_batch + rank * training.batch_per_rank
        rows = perm[start : start + training.batch_per_rank]
        started = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(data.train_x[rows]), data.train_y[rows]).backward()
        opt.step()
        if schedule is not None:
            schedule.step()  # reaching the target, it has Auto measure again
        if decay is not None:
            decay.step()
        seconds += time.perf_counter() - started
        if (step + 1) % eval_every == 0 or step + 1 == total:
            curve["seconds"].append(max_over_ranks(seconds))
            curve["step"].append(step + 1)
            curve["test_accuracy"].append(evaluate_shared(model, data, rank, world))
            cluster.progress(f"{training.label(configuration)}: step {step + 1}/{total}, "
                             f"{curve['seconds'][-1]:.1f} s, test accuracy {curve['test_accuracy'][-1]:.4f}")
    tx_end = cluster.tx_bytes(config["ifname"])
    return {
        "curve": curve,
        "steps": total,
        "payload_bytes": comm.payload / total,
        "warm_payload_bytes": None if payload_at_ramp is None else (comm.payload - payload_at_ramp) / (total - ramp),
        "traffic_bytes": comm.traffic / total,
        "tx_bytes": None if tx_start is None or tx_end is None else (tx_end - tx_start) / total,
        "optimizer_momentum": float(sgd.param_groups[0]["momentum"]),
        "compressor_momentum": float(getattr(getattr(compressor, "inner", compressor), "momentum", 0.0)),
        "final_density": getattr(compressor, "ratio", None),
        "indices": getattr(getattr(compressor, "inner", compressor), "indices", None),
        "parameters_agree": parameters_agree(model, world),
        "decisions": getattr(compressor.stats, "decisions", None),
    }


def worker(config: Dict[str, Any]) -> None:
    """One rank: every run in turn, in one gloo process group."""
    from benchmarks.datasets import load
    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    cluster.init_gloo(config)
    training = Training(**config["training"])
    images = load(training.data, training.train_size, training.test_size, training.data_dir)
    data = convergence.as_torch(images)
    base = TorchDistCommunicator()
    runs = {c: train_run(c, training, data, base, config) for c in training.runs()}
    # the optimizers' reference cycles hold the collectives' work objects, which keep Gloo's connections;
    # free them while the group lives, so none outlives it to be torn down at interpreter exit
    gc.collect()
    cluster.finish_worker(config, {"runs": runs})


# ================================================================== driver side
def first_time_at(curve: Dict[str, List[float]], target: float) -> Optional[float]:
    """Training seconds at the first evaluation after the start whose accuracy reaches ``target``."""
    pairs = list(zip(curve["seconds"], curve["test_accuracy"]))[1:]
    return next((seconds for seconds, accuracy in pairs if accuracy >= target), None)


def rank_mean(per_rank: List[Dict[str, Any]], configuration: str, key: str) -> Optional[float]:
    """The ranks' mean of a run's ``key``; None where a rank has none (no emulated link, no step after the warm-up)."""
    values = [r["runs"][configuration][key] for r in per_rank]
    return None if None in values else sum(values) / len(values)


def rows_of(link: cluster.Link, training: Training, per_rank: List[Dict[str, Any]], gap: float) -> List[Dict]:
    """One row per run on ``link``: rank 0's curve (every rank has the same accuracies), the time to target."""
    first = per_rank[0]["runs"]
    target = first["dense"]["curve"]["test_accuracy"][-1] - gap / 100
    dense_time = first_time_at(first["dense"]["curve"], target)
    rows = []
    for configuration in training.runs():
        run = first[configuration]
        reached = first_time_at(run["curve"], target)
        rows.append({
            "rate": link.rate, "bits_per_second": link.bits_per_second, "run": training.name(configuration),
            "configuration": configuration, "label": training.label(configuration),
            **{key: run[key] for key in ("curve", "steps", "optimizer_momentum", "compressor_momentum",
                                         "final_density", "indices", "decisions")},
            "final_accuracy": run["curve"]["test_accuracy"][-1],
            "train_seconds": run["curve"]["seconds"][-1],
            "seconds_per_step": run["curve"]["seconds"][-1] / run["steps"],
            **{key: rank_mean(per_rank, configuration, key)
               for key in ("payload_bytes", "warm_payload_bytes", "traffic_bytes", "tx_bytes")},
            "parameters_agree": all(r["runs"][configuration]["parameters_agree"] for r in per_rank),
            "target_accuracy": target,
            "time_to_target": reached,
            "speedup": None if reached is None or dense_time is None else dense_time / reached,
        })
    return rows


def goals(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's goals (:data:`GOALS`) on the fastest run other than dense to reach the target: its speedup
    or its time ratio (1 / speedup). ``met`` is None where the link or no such run was run, False where none
    reached the target."""
    out = []
    for rate, bound, kind in GOALS:
        runs = [r for r in rows if r["rate"] == rate and r["run"] != "none"]
        best = max((r for r in runs if r["speedup"] is not None), key=lambda r: r["speedup"], default=None)
        if best is None:
            value, met = None, (False if runs else None)
        else:
            value = best["speedup"] if kind == "speedup" else 1.0 / best["speedup"]
            met = value >= bound if kind == "speedup" else value <= bound
        out.append({"rate": rate, "run": None if best is None else best["label"], "measure": kind,
                    "bound": bound, "value": value, "met": met, "compared": [r["label"] for r in runs]})
    return out


def run(
    training: Training = Training(),
    ranks: int = 4,
    rates: Sequence[Optional[str]] = ("1gbit", "10gbit"),
    delay: str = "0.1ms",
    target_gap: float = 0.5,
    out: Optional[str] = "results",
    name: str = "time_to_accuracy",
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Every run on every link; writes ``<name>.json`` and ``<name>.png`` to ``out``, prints the table.

    ``rates``: tc rates such as ``"1gbit"``; ``[None]`` runs once on localhost without emulation.
    """
    report.require_packages(torch=True, plots=plot and out is not None)
    if int(ranks) < 2:
        raise ValueError(f"hvd_compress: ranks must be at least 2, got {ranks}")
    convergence.plan([training.model], [training.compressor], [training.ratio], [training.variant])  # checks names
    check_runs(training.configurations)
    if training.lr_schedule not in convergence.cnn.LR_SCHEDULES:
        raise ValueError(f"hvd_compress: lr_schedule must be one of {convergence.cnn.LR_SCHEDULES}, "
                         f"got {training.lr_schedule!r}")
    if training.compressor not in convergence.cnn.SPARSE:
        raise ValueError(f"hvd_compress: --compressor must be a sparsifier ({', '.join(convergence.cnn.SPARSE)})")
    for configuration in training.runs():
        make_compressor(configuration, training)  # checks the densities and budgets
    rows: List[Dict[str, Any]] = []
    links: List[Dict[str, Any]] = []
    started = time.perf_counter()
    for rate in rates:
        with cluster.link(ranks, rate, delay) as lk:
            where = cluster.format_rate(lk.bits_per_second)

            def say(text: str, where: str = where) -> None:
                if progress:
                    print(f"time-to-accuracy [{where}] {text} ({time.perf_counter() - started:.0f} s in all)",
                          file=sys.stderr, flush=True)

            per_rank = cluster.run_workers(lk, ranks, MODULE, {"training": asdict(training), "ifname": lk.ifname},
                                           timeout=3600, on_progress=say)
            links.append(lk.describe())
            rows.extend(rows_of(lk, training, per_rank, target_gap))
    results = {
        "benchmark": "time_to_accuracy",
        "machine": describe_machine(),
        "settings": {**asdict(training), "ranks": ranks, "rates": list(rates), "delay": delay,
                     "target_gap_points": target_gap, "runs": [training.label(n) for n in training.runs()],
                     "clock": "sum of the step times (evaluations excluded), maximum over ranks"},
        "links": links,
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "goals": goals(rows),
    }
    return publish(results, out, name, write_plot if plot else None, print_table, stdout)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(f"Time to accuracy: {s['model']} on {s['data']}, {s['ranks']} processes, {s['epochs']} epochs, batch "
        f"{s['batch_per_rank']} per rank; target: dense's final accuracy - {s['target_gap_points']:g} points")
    width = max([34] + [len(r["label"]) for r in results["rows"]])
    say(f"\n  {'link':<10} {'run':<{width}} {'final acc':>9} {'target':>7} {'s to target':>11} {'speedup':>8} "
        f"{'s/step':>7} {'bytes/step':>11} {'ranks agree':>11}")
    for r in results["rows"]:
        reach = "never" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        say(f"  {cluster.format_rate(r['bits_per_second']):<10} {r['label']:<{width}} {r['final_accuracy']:>9.4f} "
            f"{r['target_accuracy']:>7.4f} {reach:>11} {speedup:>8} {r['seconds_per_step']:>7.4f} "
            f"{r['payload_bytes']:>11,.0f} {str(r['parameters_agree']):>11}")
    for g in results["goals"]:
        value = f"{g['value']:.2f}" if g["value"] is not None else "never reached" if g["met"] is False else "not run"
        verdict = {True: "met", False: "missed", None: "open"}[g["met"]]
        bound = f">= {g['bound']:g}" if g["measure"] == "speedup" else f"<= {g['bound']:g}"
        say(f"  goal at {g['rate']}: best of the runs other than dense ({g['run'] or '-'}) {g['measure']} {bound}: "
            f"{value} ({verdict})")


def write_plot(results: Dict[str, Any], path: Any) -> None:
    """Test accuracy against training seconds, a panel per link, the target dotted."""
    rows, s = results["rows"], results["settings"]
    styles = {**STYLES, "compressor": (convergence.cnn.curve_style(convergence.cnn.label(s["compressor"]))["color"],
                                       "-")}
    rates = list(dict.fromkeys(r["bits_per_second"] for r in rows))
    fig, axes = report.pyplot().subplots(1, len(rates), figsize=(6.5 * len(rates), 4.4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        shown = [r for r in rows if r["bits_per_second"] == rate]
        for r in shown:
            color, linestyle = styles[r["configuration"]]
            ax.plot(r["curve"]["seconds"], r["curve"]["test_accuracy"], linestyle, marker=".", label=r["label"],
                    color=color)
        ax.axhline(shown[0]["target_accuracy"], color="grey", linestyle=":", label="target")
        low = min(min(r["curve"]["test_accuracy"][1:] or [0.0]) for r in shown)
        ax.set_ylim(max(0.0, low - 0.02), min(1.0, max(max(r["curve"]["test_accuracy"]) for r in shown) + 0.01))
        ax.set_title(f"link {cluster.format_rate(rate)}")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    fig.suptitle(f"Time to accuracy: {s['model']} on {s['data']} ({s['train_size'] or 'all'} training images), "
                 f"{s['ranks']} processes, seed {s['seed']}; target: dense's final accuracy - "
                 f"{s['target_gap_points']:g} points")
    report.save_figure(fig, path)


if __name__ == "__main__":
    worker(cluster.worker_config(sys.argv[1:]))
