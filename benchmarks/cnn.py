"""A small CNN trained on simulated ranks: the model, data and loop of the convergence studies.

``python -m benchmarks cnn`` (this module's :func:`study`), ``gaussian``
(:mod:`benchmarks.gaussian`) and ``terngrad``
(:mod:`benchmarks.terngrad`) all train :func:`make_net` with :func:`train`.

Data: synthetic 1x8x8 "digits" (ten smooth random templates plus Gaussian
noise, :func:`synthetic_digits`),
generated from a seed, no download.
Each step, every one of N simulated ranks computes the gradient of its own
shard of the global batch; the gradients go through
:class:`~hvd_compress.simulator.Simulator` (the routes' bucket engine on every rank, in
lockstep) and SGD with momentum applies the average. The study reports what the ranks
handed to the collectives, as a route would: bytes per rank, their ring traffic
(allreduce ``2 (N-1)/N P``, allgather ``(N-1) Q``, :func:`benchmarks.wire.collective_traffic`
of ``Simulator.collectives_per_rank``) and the density (values sent / entries: a
sparsifier's slots, Gaussian-k's ``floor(4k/3)``), against dense fp32 in the same run.

The sparsifiers send some tensors dense: those under ``dense_below`` elements
(biases, the 144-weight first convolution) and those where ``N k >= numel``
(a dense allreduce is then cheaper), so the achieved density is above the
requested ratio, markedly so at 0.1%.
"""

from __future__ import annotations

import functools
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks.output import describe_machine, publish
from hvd_compress.bench import single_threaded_blas
from benchmarks.report import progress_bar, pyplot, require_packages, save_figure
from hvd_compress.algorithms import Compression, Compressor
from hvd_compress.simulator import Simulator

#: Densities of the sparsifiers in ``simulate cnn``.
DEFAULT_RATIOS = (0.01, 0.001)
SPARSE = ("topk", "gaussiank", "regtopk")
#: Display names of the compressors.
LABELS = {"none": "dense", "topk": "top-k", "gaussiank": "gaussian-k", "regtopk": "regtop-k",
          "terngrad-ef": "terngrad +ef"}
#: Test-set evaluations per run (evenly spaced, the last step included).
EVALS = 12
#: Training epochs of the studies: 64 steps each with the defaults (8192 images, 4 ranks x 32).
EPOCHS = 5


# --------------------------------------------------------------------- data
def synthetic_digits(n: int, seed: int = 0, noise: float = 0.8):
    """``n`` noisy 1x8x8 images of ten smooth class templates, and their labels (torch)."""
    import torch
    import torch.nn.functional as F

    templates = F.avg_pool2d(torch.randn(10, 1, 10, 10, generator=torch.Generator().manual_seed(1234)), 3, 1)
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = templates[labels] + noise * torch.randn(n, 1, 8, 8, generator=generator)
    return images, labels


@dataclass
class ImageData:
    train_x: Any
    train_y: Any
    test_x: Any
    test_y: Any

    @classmethod
    def synthetic(cls, train: int = 8192, test: int = 2048, seed: int = 0) -> "ImageData":
        """Training and test sets drawn independently (seeds ``seed`` and ``seed + 1``)."""
        if train < 1 or test < 1:
            raise ValueError(f"hvd_compress: need at least one training and test image, got {train}, {test}")
        return cls(*synthetic_digits(train, seed), *synthetic_digits(test, seed + 1))


def make_net(seed: int = 0):
    """``conv 1->16, conv 16->32 (3x3, ReLU), 2x2 max-pool, fc 512->128, fc 128->10``: 71,754 parameters."""
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
            self.fc1 = torch.nn.Linear(32 * 4 * 4, 128)
            self.fc2 = torch.nn.Linear(128, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            return self.fc2(F.relu(self.fc1(x.flatten(1))))

    with torch.random.fork_rng():  # the initialization is seeded; the global stream is left as it was
        torch.manual_seed(seed)
        return Net()


# ------------------------------------------------------------------ layers
def layer_table(compressor: Compressor, shapes: Dict[str, Tuple[int, ...]]) -> List[Dict[str, Any]]:
    """How ``compressor`` (bound to its rank and world) sends each tensor, and why; ``values``: the
    entries a step sends of it (a sparsifier's slots, ``numel`` for a tensor sent dense or ternary)."""
    rows = []
    for name, shape in shapes.items():
        numel = int(np.prod(shape))
        row: Dict[str, Any] = {"name": name, "numel": numel, "k": None, "sent": "dense", "reason": None,
                               "values": numel}
        if numel < getattr(compressor, "dense_below", 0):
            row["reason"] = f"below dense_below={compressor.dense_below}"
        elif hasattr(compressor, "k"):
            row["k"] = compressor.k(numel)
            if compressor.dense_is_cheaper(numel):
                row["reason"] = f"N k = {compressor.size * row['k']} >= numel"
            else:
                row["sent"] = "sparse"
                row["values"] = compressor.slots(numel) if hasattr(compressor, "slots") else row["k"]
        elif hasattr(compressor, "scalar_sharing"):
            row["sent"] = "ternary"
        rows.append(row)
    return rows


# --------------------------------------------------------------------- train
class Probe:
    """Hooks of :func:`train` around every ``Simulator.step`` (subclass what you need).

    ``before(step, grads, sim)``: ``grads`` is ``{name: [grad of rank 0, ...]}``, the
    simulator still holds the residuals of the previous step. ``after(step, grads,
    averaged, sim)``: ``averaged`` is what the ranks decoded.
    """

    def before(self, step: int, grads: Dict[str, List[Any]], sim: Simulator) -> None:
        pass

    def after(self, step: int, grads: Dict[str, List[Any]], averaged: Dict[str, Any], sim: Simulator) -> None:
        pass


def rank_gradients(model: Any, x: Any, y: Any) -> Tuple[Dict[str, List[Any]], float]:
    """Every rank's gradient of the mean cross-entropy on its shard ``x[r], y[r]``, and the mean loss.

    One vectorized pass (``torch.func.vmap`` over the rank dimension) instead of one
    backward per rank.
    """
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value, vmap

    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: Dict[str, Any], xs: Any, ys: Any) -> Any:
        return F.cross_entropy(functional_call(model, p, (xs,)), ys)

    grads, losses = vmap(grad_and_value(loss), in_dims=(None, 0, 0))(params, x, y)
    with torch.no_grad():
        return {name: list(g.unbind(0)) for name, g in grads.items()}, float(losses.mean())


def evaluate(model: Any, x: Any, y: Any) -> Tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` on ``x, y``."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(x)
        return float(F.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


#: Step-size schedules of the studies: ``constant``, or ``cosine`` (``lr`` decayed to 0 over the run).
LR_SCHEDULES = ("constant", "cosine")


def step_decay(optimizer: Any, schedule: str, steps: int) -> Any:
    """The scheduler of ``schedule`` (:data:`LR_SCHEDULES`) over ``steps`` steps of ``optimizer``, stepped
    after every optimizer step; ``None`` for ``constant``."""
    import torch

    if schedule not in LR_SCHEDULES:
        raise ValueError(f"hvd_compress: unknown step-size schedule {schedule!r}; choose one of {LR_SCHEDULES}")
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if schedule == "cosine" else None


def train(
    compression: Compressor,
    data: ImageData,
    ranks: int = 4,
    epochs: int = EPOCHS,
    batch_per_rank: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    seed: int = 0,
    evals: int = EVALS,
    probe: Optional[Probe] = None,
    tick: Optional[Callable[[], None]] = None,
    net: Callable[[int], Any] = make_net,
    lr_schedule: str = "constant",
    simulator: Optional[Callable[[int, int], Any]] = None,
) -> Dict[str, Any]:
    """Synchronous data-parallel SGD of ``net(seed)`` (:func:`make_net`) on ``ranks`` simulated ranks.

    Every step the global batch of ``ranks * batch_per_rank`` images (a fresh
    permutation per epoch) is split into one shard per rank. Returns the
    training loss of every step (mean over ranks), ``evals`` test evaluations,
    the wire statistics of every payload, averaged over ranks and steps, and
    the momentum the optimizer and the compressor ran with (a compressor with
    momentum correction, ``momentum=m``, wants ``momentum=0`` here). ``lr_schedule``:
    ``constant``, or ``cosine`` (``lr`` decayed to 0 over the run, every step). ``simulator(ranks, seed)``:
    what averages instead of ``Simulator(ranks, compression, seed=seed)``, with its ``step``,
    ``bytes_sent_per_rank``, ``collectives_per_rank``, ``compressors`` and ``layer_table(shapes)``
    (a baseline outside hvd_compress, e.g. :class:`benchmarks.powersgd.PowerSGDSimulator`).
    """
    import torch

    from benchmarks.wire import allreduce_traffic, collective_traffic

    if int(epochs) < 1:
        raise ValueError(f"hvd_compress: epochs must be at least 1, got {epochs}")
    model = net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    sim = Simulator(ranks, compression, seed=seed) if simulator is None else simulator(ranks, seed)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    plan = getattr(sim, "layer_table", None) or functools.partial(layer_table, sim.compressors[0])
    global_batch = ranks * batch_per_rank
    per_epoch = len(data.train_y) // global_batch
    if per_epoch < 1:
        raise ValueError(
            f"hvd_compress: {len(data.train_y)} training images are fewer than one global batch "
            f"of {ranks} ranks x {batch_per_rank}"
        )
    total = epochs * per_epoch
    decay = step_decay(optimizer, lr_schedule, total)
    eval_at = set(np.linspace(0, total, max(1, evals) + 1).round().astype(int).tolist())
    order = torch.Generator().manual_seed(seed)
    losses: List[float] = []
    evaluations: Dict[str, List[float]] = {"step": [], "test_loss": [], "test_accuracy": []}
    sums = {"bytes": 0.0, "traffic": 0.0, "values": 0.0, "numel": 0.0}
    per_layer: Dict[str, List[float]] = {name: [0.0, 0.0] for name in shapes}  # values, numel
    started = time.perf_counter()

    def record_eval(step: int) -> None:
        loss, accuracy = evaluate(model, data.test_x, data.test_y)
        evaluations["step"].append(step)
        evaluations["test_loss"].append(loss)
        evaluations["test_accuracy"].append(accuracy)

    record_eval(0)
    for step in range(total):
        if step % per_epoch == 0:
            perm = torch.randperm(len(data.train_y), generator=order)
        batch = perm[(step % per_epoch) * global_batch : (step % per_epoch + 1) * global_batch]
        x = data.train_x[batch].reshape(ranks, batch_per_rank, *data.train_x.shape[1:])
        y = data.train_y[batch].reshape(ranks, batch_per_rank)
        grads, loss = rank_gradients(model, x, y)
        if probe is not None:
            probe.before(step, grads, sim)
        averaged = sim.step(grads)
        if probe is not None:
            probe.after(step, grads, averaged, sim)
        sums["bytes"] += float(sum(sim.bytes_sent_per_rank))
        sums["traffic"] += sum(collective_traffic(posted, ranks) for posted in sim.collectives_per_rank)
        for row in plan(shapes):  # the plan of this step (a warm-up changes k)
            for key, count in (("values", row["values"]), ("numel", row["numel"])):
                sums[key] += float(count * ranks)
            per_layer[row["name"]][0] += row["values"] * ranks
            per_layer[row["name"]][1] += row["numel"] * ranks
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.grad = averaged[name].reshape(p.shape)
        optimizer.step()
        if decay is not None:
            decay.step()
        losses.append(loss)
        if step + 1 in eval_at:
            record_eval(step + 1)
        if tick is not None:
            tick()
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # fp32 gradients
    steps_ranks = total * ranks
    layers = plan(shapes)
    for row in layers:
        values, numel = per_layer[row["name"]]
        row["density"] = values / numel if numel else None
    sparse = any(row["sent"] == "sparse" for row in layers)
    return {
        "compressor": repr(compression),
        "steps": total,
        "steps_per_epoch": per_epoch,
        "train_loss": losses,
        "eval": evaluations,
        "final_test_loss": evaluations["test_loss"][-1],
        "final_test_accuracy": evaluations["test_accuracy"][-1],
        "final_train_loss": float(np.mean(losses[-per_epoch:])),
        "bytes_per_step": sums["bytes"] / steps_ranks,
        "dense_bytes_per_step": dense_bytes,
        "bytes_vs_dense": sums["bytes"] / steps_ranks / dense_bytes,
        "traffic_per_step": sums["traffic"] / steps_ranks,
        "dense_traffic_per_step": allreduce_traffic(dense_bytes, ranks),
        "traffic_vs_dense": sums["traffic"] / steps_ranks / allreduce_traffic(dense_bytes, ranks),
        "density": sums["values"] / sums["numel"] if sparse else None,
        "optimizer_momentum": float(optimizer.param_groups[0]["momentum"]),
        "compressor_momentum": float(getattr(sim.compressors[0], "momentum", 0.0)),
        "layers": layers,
        "wall_seconds": time.perf_counter() - started,
    }


@contextlib.contextmanager
def one_thread():
    """Torch and BLAS on one thread: the simulated ranks run many small operations, where threads contend."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with single_threaded_blas():
            yield
    finally:
        torch.set_num_threads(threads)


def run_all(
    runs: Sequence[Tuple[str, Compressor]],
    data: ImageData,
    desc: str,
    ranks: int = 4,
    epochs: int = EPOCHS,
    batch_per_rank: int = 32,
    progress: bool = True,
    probes: Optional[Dict[str, Probe]] = None,
    **options: Any,
) -> Dict[str, Dict[str, Any]]:
    """:func:`train` every ``(label, compressor)`` under one progress bar; ``{label: result}``.

    ``probes`` maps labels to the :class:`Probe` of that run; ``options`` go to :func:`train`.
    """
    per_epoch = len(data.train_y) // (ranks * batch_per_rank)
    bar = progress_bar(len(runs) * epochs * per_epoch, desc, "step", progress)
    shape = dict(ranks=ranks, epochs=epochs, batch_per_rank=batch_per_rank)
    results = {}
    try:
        with one_thread():
            for run_label, compressor in runs:
                bar.set_postfix_str(run_label)
                probe = (probes or {}).get(run_label)
                results[run_label] = train(compressor, data, probe=probe, tick=bar.update, **shape, **options)
    finally:
        bar.close()
    return results


def settings(data: ImageData, **options: Any) -> Dict[str, Any]:
    """The JSON ``settings`` every CNN study writes."""
    return {
        **options,
        "model": "conv 1->16, conv 16->32 (3x3, ReLU), 2x2 max-pool, fc 512->128, fc 128->10 (71,754 parameters)",
        "data": "synthetic 1x8x8 digits: 10 smooth random templates + N(0, 0.8^2) noise (no download)",
        "train_images": int(len(data.train_y)),
        "test_images": int(len(data.test_y)),
        "optimizer": "SGD with momentum 0.9 on the averaged gradient",
        "bytes": "payload bytes one rank hands to the collectives per step, mean over ranks and steps",
        "traffic": "ring bytes one rank sends per step: allreduce 2(N-1)/N P, allgather (N-1) Q",
        "density": "entries sent / entries (dense fallbacks count fully), sparsifiers only",
    }


# --------------------------------------------------------------------- study
@dataclass(frozen=True)
class Training:
    """What the CNN studies share: SGD of :func:`make_net` on ``ranks`` simulated ranks for ``epochs``
    epochs of ``train_size`` synthetic images (``ranks * batch_per_rank`` per step), ``test_size`` test
    images, step size ``lr``, everything seeded by ``seed``."""

    ranks: int = 4
    epochs: int = EPOCHS
    batch_per_rank: int = 32
    lr: float = 0.05
    train_size: int = 8192
    test_size: int = 2048
    seed: int = 0

    def options(self) -> Dict[str, Any]:
        """The keywords of :func:`train`, also written to the JSON settings."""
        return dict(
            ranks=self.ranks,
            epochs=self.epochs,
            batch_per_rank=self.batch_per_rank,
            lr=self.lr,
            seed=self.seed,
        )

    @property
    def steps(self) -> int:
        """Steps of one run: ``epochs * floor(train_size / (ranks * batch_per_rank))``."""
        return self.epochs * (self.train_size // (self.ranks * self.batch_per_rank))


def run_study(
    study: str,
    runs: Sequence[Tuple[str, Compressor]],
    training: Training,
    progress: bool = True,
    probes: Optional[Dict[str, Probe]] = None,
    **settings_: Any,
) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """:func:`run_all` for ``simulate <study>`` on the synthetic data of ``training``.

    Returns the results' head (``study``, ``machine``, ``settings``: :func:`settings` with
    ``settings_`` first, ``wall_seconds``) and ``{label: result}``.
    """
    data = ImageData.synthetic(training.train_size, training.test_size, training.seed)
    options = training.options()
    started = time.perf_counter()
    trained = run_all(runs, data, f"simulate {study}", progress=progress, probes=probes, **options)
    head = {
        "study": study,
        "machine": describe_machine(),
        "settings": settings(data, **settings_, **options),
        "wall_seconds": time.perf_counter() - started,
    }
    return head, trained


def label(name: str, ratio: Optional[float] = None) -> str:
    """``top-k 1%``, ``dense``, ``terngrad``."""
    base = LABELS.get(name, name)
    return base if ratio is None else f"{base} {ratio * 100:g}%"


def study(
    ratios: Sequence[float] = DEFAULT_RATIOS,
    training: Training = Training(),
    out: Optional[str] = None,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Dense, Top-k, Gaussian-k and RegTop-k at every ratio, and TernGrad, on the same CNN and data.

    Writes ``cnn.json`` and ``cnn.png`` (loss and accuracy curves) to ``out``
    when given, prints the table; returns the results.
    """
    require_packages(torch=True, plots=plot and out is not None)
    ratios = [float(r) for r in dict.fromkeys(ratios)]
    runs: List[Tuple[str, Compressor]] = [(label("none"), Compression.none())]
    for ratio in ratios:
        runs += [(label(name, ratio), Compression.by_name(name, ratio)) for name in SPARSE]
    runs.append((label("terngrad"), Compression.terngrad()))
    head, trained = run_study("cnn", runs, training, progress, ratios=ratios)
    rows = [
        {"label": run_label, "ratio": getattr(compressor, "ratio", None), **trained[run_label]}
        for run_label, compressor in runs
    ]
    return publish({**head, "runs": rows}, out, "cnn", write_plot if plot else None, print_table, stdout)


def describe_training(s: Dict[str, Any]) -> str:
    """``4 simulated ranks, 5 epochs, batch 32 per rank, lr 0.05`` from a study's settings."""
    return f"{s['ranks']} simulated ranks, {s['epochs']} epochs, batch {s['batch_per_rank']} per rank, lr {s['lr']}"


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(f"Small CNN on synthetic 8x8 digits: {describe_training(s)}")
    say(
        f"\n  {'run':<16} {'test acc':>8} {'test loss':>9} {'train loss':>10} {'bytes/step':>11} "
        f"{'vs dense':>9} {'traffic':>8} {'density':>8}"
    )
    for r in results["runs"]:
        density = "" if r["density"] is None else f"{r['density']:.4f}"
        say(
            f"  {r['label']:<16} {r['final_test_accuracy']:>8.3f} {r['final_test_loss']:>9.4f} "
            f"{r['final_train_loss']:>10.4f} {r['bytes_per_step']:>11,.0f} {r['bytes_vs_dense']:>8.4f}x "
            f"{r['traffic_vs_dense']:>7.4f}x {density:>8}"
        )
    say(
        "\n  train loss: mean over the last epoch; vs dense / traffic: payload bytes and ring traffic "
        "per rank against dense fp32; density: entries sent / entries"
    )


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average over ``window`` steps (shorter at the start)."""
    values = np.asarray(values, dtype=float)
    csum = np.concatenate([[0.0], np.cumsum(values)])
    idx = np.arange(1, len(values) + 1)
    start = np.maximum(0, idx - window)
    return (csum[idx] - csum[start]) / (idx - start)


def curve_style(run_label: str) -> Dict[str, Any]:
    """Colour by compressor, line style by density (solid 1%, dashed 0.1%); dotted with error feedback."""
    colors = {
        "dense": "black",
        "top-k": "tab:red",
        "gaussian-k": "tab:blue",
        "regtop-k": "tab:green",
        "terngrad": "tab:purple",
    }
    base, _, rest = run_label.partition(" ")
    ratio = rest.split(" ")[0]
    dashed = ratio.endswith("%") and float(ratio.rstrip("%")) < 1
    return {"color": colors.get(base), "linestyle": "--" if dashed else ":" if "+ef" in rest else "-"}


def plot_curves(axes: Sequence[Any], runs: Sequence[Dict[str, Any]], style: Callable = curve_style) -> None:
    """Training loss (smoothed), test loss and test accuracy of every run on three axes."""
    for r in runs:
        kw = dict(style(r["label"]), label=r["label"], linewidth=1.1)
        steps = np.arange(1, len(r["train_loss"]) + 1)
        axes[0].plot(steps, smooth(r["train_loss"], max(1, r["steps_per_epoch"] // 4)), **kw)
        axes[1].plot(r["eval"]["step"], r["eval"]["test_loss"], marker=".", **kw)
        axes[2].plot(r["eval"]["step"], r["eval"]["test_accuracy"], marker=".", **kw)
    for ax, title in zip(axes, ("training loss (moving average)", "test loss", "test accuracy")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize="small", loc="lower right")


def write_plot(results: Dict[str, Any], path: Path) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(15, 4.6))
    plot_curves(axes, results["runs"])
    s = results["settings"]
    fig.suptitle(
        f"Small CNN, synthetic 8x8 digits, {s['ranks']} simulated ranks, {s['epochs']} epochs "
        "(solid: density 1% or dense, dashed: 0.1%)"
    )
    save_figure(fig, path)
