"""``python -m benchmarks convergence``: test accuracy on real data, dense vs every compressor, with and
without Deep Gradient Compression's momentum correction and density warm-up, over several seeds.

Data (:mod:`benchmarks.datasets`): Fashion-MNIST (28x28, the Debian package
``dataset-fashion-mnist``, ``ci/install_fashion_mnist.sh``) or scikit-learn's
8x8 digits (bundled, the small one CI can afford).

Models (:func:`make_model`), for a ``1 x h x w`` image:

- ``cnn``: conv 1->16 (3x3, ReLU), a 2x2 max-pool when ``h >= 16``, conv
  16->32 (3x3, ReLU), 2x2 max-pool, fc -> 128 (ReLU), fc 128 -> 10
  (8x8: 71,754 parameters, :func:`benchmarks.cnn.make_net`'s net; 28x28: 206,922);
- ``mlp``: fc ``h w`` -> 256 -> 128 -> 10 with ReLU (8x8: 50,826; 28x28: 235,146).

Training (:func:`benchmarks.cnn.train`): N simulated ranks
(:class:`~hvd_compress.simulator.Simulator`: the bucket engine every route
runs, on every rank in lockstep, each rank with its own residuals and random
stream; every rank gets the average of the ranks' compressed gradients), SGD
with step size ``lr``, a fresh permutation of the training set per epoch, the
test set evaluated after every epoch. Runs: dense and TernGrad with SGD
momentum 0.9 on the average; Top-k, Gaussian-k and RegTop-k at every density
in every chosen variant (:data:`VARIANTS`):

- ``plain``: SGD momentum 0.9 on the averaged (sparsified) gradient;
- ``warmup``: the same, with the density warm-up
  (:class:`hvd_compress.DensityWarmup` stepped every iteration, from
  ``start`` to the density over the first ``warmup_epochs`` epochs);
- ``mc``: momentum correction and momentum-factor masking (Lin et al.,
  "Deep Gradient Compression", ICLR 2018, section 3.2): the compressor is
  built with ``momentum=0.9`` and keeps the velocity ``u = m u + g`` that
  error feedback accumulates, the optimizer is SGD without momentum;
- ``mc+warmup``: both, as DGC trains.

Every run is repeated for every seed (the seed sets the initialization, the
batch order and the compressors' random streams; the data and its subset are
fixed).

On request (``--compressors``): ``fp16`` (hvd_compress's ``FP16``: the dense allreduce in float16,
half the bytes) and ``powersgd``, torch's PowerSGD DDP hook reproduced for the simulated ranks
(:mod:`benchmarks.powersgd`) at each matrix approximation rank of ``--powersgd-ranks``, with error
feedback and warm start, dense allreduces for its first ``start_powerSGD_iter`` steps
(``--powersgd-start``; by default the sparse modes' warm-up steps) and SGD momentum on the average,
as dense; its settings go to the JSON's ``settings.powersgd``. ``oktopk``: the sum-selected global top-k
(:mod:`benchmarks.oktopk`, after Ok-Topk) at each traffic budget of ``--traffic``, in every variant
(momentum correction its own, the warm-up ramping the budget from ``--warmup-start``).

``--figure frontier`` (:func:`write_frontier`) draws accuracy for traffic: each row's final accuracy
(seed mean, min-max bars) against its ``traffic_vs_dense`` (log), dense's range a band.
``--merge a.json,b.json`` (:func:`merge`) joins studies of one protocol (say, runs of different
``--indices``) into one JSON and figure without training.

Protocol (:class:`Setup`, recorded in the JSON's settings: ``protocol``,
``images_per_step``, ``steps``, ``warmup_steps``): by default each rank takes
``batch_per_rank`` images per step, so the global batch grows with N and the
run (steps per epoch, warm-up steps) shrinks. With ``global_batch``
(``--global-batch B``) each rank takes ``B / N`` images (N must divide B): the
step's images, the number of steps, the step-size schedule and the warm-up's
steps are the same at every N, dense is the same run at every N, and only the
compression differs. Accuracy comparisons across N use the fixed global batch.

Reported per model and run, over the seeds: final test accuracy (mean, sample
standard deviation, min-max), its gap to dense in points, the epoch at which
the seed-mean curve first reaches the target (dense's final mean minus
``target_gap`` points) and the bytes one rank hands to the collectives per
step, against dense fp32 (payload bytes and ring traffic, as in
:mod:`benchmarks.cnn`), and the momentum the optimizer and the compressor
ran with. The warm-up runs' bytes include the denser warm-up steps. This is
the Simulator: it measures accuracy and bytes, not time.
"""

from __future__ import annotations

import functools
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import cnn
from benchmarks.datasets import Images
from benchmarks.output import describe_machine, publish
from benchmarks.report import pyplot, require_packages, save_figure
from benchmarks.powersgd import DEFAULT_RANKS as DEFAULT_POWERSGD_RANKS
from benchmarks.oktopk import OkTopk, OkTopkSimulator
from benchmarks.powersgd import PowerSGD, PowerSGDSimulator
from hvd_compress.algorithms import Compression, DensityWarmup

#: Models of ``--models`` by default; ``wide-mlp`` (hidden layers of 1024) has a gradient of 1.9M
#: parameters, one that takes longer to send over 1 Gbit/s than to compute (time-to-accuracy's model).
DEFAULT_MODELS = ("cnn", "mlp")
MODELS = DEFAULT_MODELS + ("wide-mlp",)
#: Compressor names of ``--compressors``; ``none`` is dense, ``fp16`` hvd_compress's FP16 (half the bytes),
#: ``powersgd`` the baseline of :mod:`benchmarks.powersgd` (torch's DDP hook) at each of ``powersgd_ranks``.
#: ``oktopk`` the sum-selected global top-k of :mod:`benchmarks.oktopk` at each of ``traffic`` (budgets, not densities).
COMPRESSORS = ("none", "fp16", "topk", "gaussiank", "regtopk", "powersgd", "oktopk", "terngrad", "terngrad-ef")
#: ``--compressors`` by default (``terngrad-ef``: TernGrad with error feedback, ``fp16``, ``powersgd``: on request)
DEFAULT_COMPRESSORS = ("none", "topk", "gaussiank", "regtopk", "terngrad")
#: Sparsifier variants: name -> (momentum correction, density warm-up).
VARIANTS = {"plain": (False, False), "warmup": (False, True), "mc": (True, False), "mc+warmup": (True, True)}
DEFAULT_VARIANTS = ("plain", "mc+warmup")
DEFAULT_RATIOS = (0.01, 0.001)
#: Per data set: epochs, batch per rank, warm-up epochs (images: all unless --train-size / --test-size).
DEFAULTS = {
    "digits": {"epochs": 20, "batch_size": 16, "warmup_epochs": 2.0},
    "fashion-mnist": {"epochs": 8, "batch_size": 32, "warmup_epochs": 1.0},
}
#: ``--quick``: a few steps on a few hundred images.
QUICK = {"epochs": 2, "batch_size": 16, "warmup_epochs": 1.0, "train_size": 256, "test_size": 128}


# -------------------------------------------------------------------- models
def make_model(kind: str, shape: Sequence[int], seed: int = 0) -> Any:
    """The ``cnn`` or ``mlp`` (module docstring) for images of ``shape = (1, h, w)``, seeded by ``seed``."""
    import torch

    _, h, w = shape
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind in ("mlp", "wide-mlp"):
            first, second = (256, 128) if kind == "mlp" else (1024, 1024)
            return torch.nn.Sequential(
                torch.nn.Flatten(), torch.nn.Linear(h * w, first), torch.nn.ReLU(),
                torch.nn.Linear(first, second), torch.nn.ReLU(), torch.nn.Linear(second, 10),
            )
        if kind != "cnn":
            raise ValueError(f"unknown model {kind!r}; choose one of {', '.join(MODELS)}")
        pool = h >= 16
        side_h, side_w = (h // 2, w // 2) if pool else (h, w)
        return torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
            *([torch.nn.MaxPool2d(2)] if pool else []),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(32 * (side_h // 2) * (side_w // 2), 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )


def describe_model(kind: str, shape: Sequence[int]) -> str:
    """``cnn: conv 1->16, ... (206,922 parameters)`` for images of ``shape``."""
    model = make_model(kind, shape)
    size = sum(p.numel() for p in model.parameters())
    layers = " -> ".join(
        f"conv {m.in_channels}->{m.out_channels}" if hasattr(m, "in_channels")
        else f"fc {m.in_features}->{m.out_features}" if hasattr(m, "in_features")
        else "max-pool" if "Pool" in type(m).__name__ else ""
        for m in model
    )
    return f"{kind}: {' -> '.join(p for p in layers.split(' -> ') if p)} ({size:,} parameters)"


def options_for(data: str, quick: bool, given: Dict[str, Any]) -> Dict[str, Any]:
    """``epochs``, ``batch_size``, ``warmup_epochs``, ``train_size``, ``test_size``: those ``given`` (not
    None), else :data:`QUICK`'s with ``quick``, else the data set's :data:`DEFAULTS`."""
    base = {"train_size": None, "test_size": None, **DEFAULTS[data], **(QUICK if quick else {})}
    return {key: base[key] if given.get(key) is None else given[key] for key in base}


# ---------------------------------------------------------------------- runs
@dataclass(frozen=True)
class Run:
    """One configuration: ``model``, compressor ``name`` at density ``ratio``, in sparsifier ``variant``."""

    model: str
    name: str
    ratio: Optional[float] = None
    variant: str = "plain"
    #: a sparsifier's index mode (``indices=``): ``gather``, ``leader``, ``aggregate``
    indices: str = "gather"
    #: steps between exact selections (``exact_every=``; 1: every step exact)
    exact_every: int = 1
    #: a sparsifier's ``dense_below=`` when given (tensors of fewer entries sent dense; None: its default)
    dense_below: Optional[int] = None
    #: PowerSGD's matrix approximation rank (``powersgd`` only)
    rank: Optional[int] = None
    #: PowerSGD's start_powerSGD_iter when given (``--powersgd-start``; None: the warm-up's steps)
    start: Optional[int] = None
    #: a sparsifier's traffic budget (``traffic=``, a fraction of a dense fp32 allreduce's bytes per rank) in place
    #: of ``ratio``; ``indices`` is then its rule (``auto``: picked from the number of ranks)
    traffic: Optional[float] = None

    @property
    def momentum_correction(self) -> bool:
        return VARIANTS[self.variant][0]

    @property
    def warmup(self) -> bool:
        return VARIANTS[self.variant][1]

    @property
    def label(self) -> str:
        """``dense``, ``fp16``, ``top-k 1%``, ``top-k 1% +warm-up``, ``top-k 1% +mc +warm-up``,
        ``top-k traffic 0.04 +mc +warm-up [auto]``, ``powersgd rank 2``, ``terngrad``."""
        if self.name == "powersgd":
            return f"powersgd rank {self.rank}" + ("" if self.start is None else f" from step {self.start}")
        if self.name == "oktopk":
            return f"ok-topk traffic {self.traffic:g}" + " +mc" * self.momentum_correction + " +warm-up" * self.warmup
        label = cnn.label(self.name, self.ratio) + (f" traffic {self.traffic:g}" if self.traffic is not None else "")
        label += " +mc" * self.momentum_correction + " +warm-up" * self.warmup
        label += f" [{self.indices}]" if self.indices != "gather" else ""
        label += f" [exact every {self.exact_every}]" if self.exact_every > 1 else ""
        return label + (f" [dense below {self.dense_below}]" if self.dense_below is not None else "")

    def compressor(self, momentum: float) -> Any:
        """A new compressor; with momentum correction it owns ``momentum`` (the optimizer then has none)."""
        if self.name == "terngrad-ef":
            return Compression.terngrad(error_feedback=True)
        if not (self.ratio or self.traffic):
            return Compression.by_name(self.name)
        return Compression.by_name(self.name, self.ratio, momentum=momentum if self.momentum_correction else 0.0,
                                   indices=self.indices,
                                   **({"exact_every": self.exact_every} if self.exact_every > 1 else {}),
                                   **({"dense_below": self.dense_below} if self.dense_below is not None else {}),
                                   **({"traffic": self.traffic} if self.traffic is not None else {}))


def plan(
    models: Sequence[str], compressors: Sequence[str], ratios: Sequence[float],
    variants: Sequence[str] = DEFAULT_VARIANTS, indices: Sequence[str] = ("gather",),
    exact_every: Sequence[int] = (1,), powersgd_ranks: Sequence[int] = DEFAULT_POWERSGD_RANKS,
    powersgd_start: Optional[int] = None, traffic: Sequence[float] = (), dense_below: Optional[int] = None,
) -> List[Run]:
    """Every run, model by model: dense, fp16, the sparsifiers per density (each variant, then each index mode,
    then each spacing of exact selections, in the order given; a spacing applies to Top-k and RegTop-k
    with indices 'gather'), PowerSGD at each rank (labelled with ``powersgd_start`` when given), Ok-Topk at
    each budget of ``traffic`` in each variant, TernGrad."""
    unknown = [c for c in compressors if c not in COMPRESSORS] + [m for m in models if m not in MODELS]
    unknown += [v for v in variants if v not in VARIANTS]
    if "oktopk" in compressors and not traffic:
        raise ValueError("oktopk needs at least one traffic budget (--traffic 0.04)")
    if unknown or not variants:
        raise ValueError(
            f"unknown {unknown or 'empty variants'}: compressors {COMPRESSORS}, models {MODELS}, "
            f"variants {tuple(VARIANTS)}"
        )
    runs: List[Run] = []
    for model in dict.fromkeys(models):
        runs += [Run(model, name) for name in ("none", "fp16") if name in compressors]
        for ratio in dict.fromkeys(float(r) for r in ratios):
            runs += [Run(model, n, ratio, v, mode, every, dense_below=dense_below)
                     for n in cnn.SPARSE if n in compressors
                     for v in dict.fromkeys(variants) for mode in dict.fromkeys(indices)
                     for every in dict.fromkeys(exact_every)
                     if every == 1 or (n != "gaussiank" and mode == "gather")]
        if "powersgd" in compressors:
            runs += [Run(model, "powersgd", rank=int(rank), start=powersgd_start)
                     for rank in dict.fromkeys(powersgd_ranks)]
        if "oktopk" in compressors:
            runs += [Run(model, "oktopk", variant=v, traffic=float(budget))
                     for budget in dict.fromkeys(traffic) for v in dict.fromkeys(variants)]
        runs += [Run(model, name) for name in ("terngrad", "terngrad-ef") if name in compressors]
    return runs


class WarmupProbe(cnn.Probe):
    """Steps a :class:`~hvd_compress.DensityWarmup` of every simulated rank before each step after the first."""

    def __init__(self, warmup_steps: int, start: float) -> None:
        self.warmup_steps, self.start = warmup_steps, start
        self.schedule: Optional[DensityWarmup] = None
        self.densities: List[float] = []

    def before(self, step: int, grads: Any, sim: Any) -> None:
        if self.schedule is None:
            self.schedule = DensityWarmup(sim, self.warmup_steps, start=max(self.start, sim.compressors[0].ratio))
        else:
            self.schedule.step()
        self.densities.append(self.schedule.density)


@dataclass(frozen=True)
class Setup:
    """The training shared by every run: ``ranks``, ``epochs``, batch, step size, momentum, warm-up.

    Two protocols (:attr:`protocol`): by default ``batch_per_rank`` is fixed, so the global batch,
    the steps per epoch and the warm-up's steps change with ``ranks``; with ``global_batch`` the
    global batch is fixed and ``batch_per_rank`` is ``global_batch / ranks`` (a ``ValueError`` where
    ``ranks`` does not divide it), so the steps, the step-size schedule and the warm-up's steps are
    the same at every N and dense is the same run at every N (up to float rounding of the average).
    """

    ranks: int = 4
    epochs: int = 5
    batch_per_rank: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    warmup_epochs: float = 1.0
    warmup_start: float = 0.25
    #: ``constant`` step size, or ``cosine``: decayed from ``lr`` to 0 over the run
    lr_schedule: str = "constant"
    #: images per step over all ranks, the same at every N (``--global-batch``); None: ``batch_per_rank`` fixed
    global_batch: Optional[int] = None
    #: PowerSGD's dense steps, ``start_powerSGD_iter`` (``--powersgd-start``); None: the warm-up's steps
    powersgd_start: Optional[int] = None

    def __post_init__(self) -> None:
        if self.global_batch is None:
            return
        if self.global_batch < 1 or self.global_batch % self.ranks:
            raise ValueError(
                f"a global batch of {self.global_batch} images does not split evenly over {self.ranks} ranks: "
                "give a positive multiple of the number of ranks"
            )
        object.__setattr__(self, "batch_per_rank", self.global_batch // self.ranks)

    @property
    def protocol(self) -> str:
        """``fixed global batch`` (``global_batch`` given) or ``fixed per-rank batch``."""
        return "fixed per-rank batch" if self.global_batch is None else "fixed global batch"

    def steps_per_epoch(self, data: Images) -> int:
        return len(data.train_y) // (self.ranks * self.batch_per_rank)

    def warmup_steps(self, data: Images) -> int:
        """Steps of the density warm-up's ramp: ``warmup_epochs`` epochs, at least one step."""
        return max(1, round(self.warmup_epochs * self.steps_per_epoch(data)))

    def powersgd_start_iter(self, data: Images) -> int:
        """PowerSGD's ``start_powerSGD_iter``: ``powersgd_start``, else the sparse modes' warm-up steps
        (:meth:`warmup_steps`), at least 2 (torch's minimum with error feedback and warm start)."""
        return max(2, self.warmup_steps(data) if self.powersgd_start is None else self.powersgd_start)

    def described(self, data: Images) -> Dict[str, Any]:
        """The settings' record of the protocol: every field, the images and steps per step and run."""
        return {
            **self.__dict__, "protocol": self.protocol, "images_per_step": self.ranks * self.batch_per_rank,
            "steps_per_epoch": self.steps_per_epoch(data), "steps": self.epochs * self.steps_per_epoch(data),
            "warmup_steps": self.warmup_steps(data),
        }


def train_run(run: Run, data: Any, setup: Setup, seed: int, warmup_steps: int,
              powersgd_start: int = 2) -> Dict[str, Any]:
    """One seed of ``run``: the per-epoch test curve, final accuracy, bytes per step, densities. PowerSGD
    starts compressing at step ``powersgd_start``, its Q drawn from ``seed``."""
    probe = WarmupProbe(warmup_steps, setup.warmup_start) if run.warmup and run.name != "oktopk" else None
    simulator, compressor = None, None
    if run.name == "oktopk":  # its warm-up ramps the budget inside the baseline
        compressor = OkTopk(run.traffic, momentum=setup.momentum if run.momentum_correction else 0.0,
                            warmup_steps=warmup_steps if run.warmup else 0, warmup_start=setup.warmup_start)
        simulator = lambda ranks, _seed: OkTopkSimulator(ranks, compressor)  # noqa: E731
    elif run.name == "powersgd":
        compressor = PowerSGD(run.rank, start_iter=powersgd_start, random_seed=seed)
        simulator = lambda ranks, _seed: PowerSGDSimulator(ranks, compressor)  # noqa: E731
    result = cnn.train(
        compressor or run.compressor(setup.momentum), data, simulator=simulator, ranks=setup.ranks, epochs=setup.epochs,
        batch_per_rank=setup.batch_per_rank, lr=setup.lr, momentum=0.0 if run.momentum_correction else setup.momentum,
        seed=seed, evals=setup.epochs, probe=probe, lr_schedule=setup.lr_schedule,
        net=functools.partial(make_model, run.model, tuple(data.train_x.shape[1:])),
    )
    keep = ("final_test_accuracy", "final_test_loss", "final_train_loss", "bytes_per_step", "dense_bytes_per_step",
            "bytes_vs_dense", "traffic_per_step", "traffic_vs_dense", "density", "steps", "wall_seconds",
            "optimizer_momentum", "compressor_momentum")
    return {
        "seed": seed,
        "test_accuracy": result["eval"]["test_accuracy"],  # after epochs 0 (initial), 1, ..., E
        "test_loss": result["eval"]["test_loss"],
        **{key: result[key] for key in keep},
        "warmup_densities": None if probe is None else [probe.densities[0], probe.densities[-1]],
        "layers": result["layers"],
    }


def as_torch(data: Images) -> cnn.ImageData:
    import torch

    return cnn.ImageData(*(torch.from_numpy(a) for a in (data.train_x, data.train_y, data.test_x, data.test_y)))


def run_all(runs: Sequence[Run], data: Images, setup: Setup, seeds: Sequence[int], progress: bool = True):
    """Train every run for every seed on one thread; a progress line on stderr after each."""
    tensors, per_epoch = as_torch(data), setup.steps_per_epoch(data)
    warmup_steps, powersgd_start = setup.warmup_steps(data), setup.powersgd_start_iter(data)
    if per_epoch < 1:
        raise ValueError(
            f"{len(data.train_y)} training images are fewer than one global batch of "
            f"{setup.ranks} ranks x {setup.batch_per_rank}"
        )
    total, done, started = len(runs) * len(seeds), 0, time.perf_counter()
    trained: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    with cnn.one_thread(), warnings.catch_warnings():
        # while the warm-up's density is high, tensors go dense; each run's layer table says so already
        warnings.filterwarnings("ignore", message=r"hvd_compress: \w+ sends '.*' dense")
        for run in runs:
            for seed in seeds:
                result = train_run(run, tensors, setup, seed, warmup_steps, powersgd_start)
                trained.setdefault((run.model, run.label), []).append(result)
                done += 1
                if progress:
                    print(
                        f"convergence [{done}/{total}] {run.model} {run.label} seed {seed}: test accuracy "
                        f"{result['final_test_accuracy']:.4f}, {result['wall_seconds']:.1f} s "
                        f"({time.perf_counter() - started:.0f} s in all)",
                        file=sys.stderr, flush=True,
                    )
    return trained


# ------------------------------------------------------------------- summary
def spread(values: Sequence[float]) -> Dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max."""
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max())}


def first_epoch_at(curve: Sequence[float], target: float) -> Optional[int]:
    """The first epoch (1-based; index 0 is the initial model) whose accuracy reaches ``target``."""
    return next((epoch for epoch, acc in enumerate(curve) if epoch and acc >= target), None)


def summarize(run: Run, seeds: List[Dict[str, Any]], dense: Optional[Dict[str, Any]], gap: float) -> Dict[str, Any]:
    """The row of ``run``: spreads over seeds, the gap to dense, the epoch reaching the target."""
    layers = [s.pop("layers", None) for s in seeds][0]
    curves = np.array([s["test_accuracy"] for s in seeds])
    final = spread(curves[:, -1])
    row: Dict[str, Any] = {
        "model": run.model, "label": run.label, "compressor": run.name, "ratio": run.ratio,
        "variant": run.variant if run.ratio or run.traffic else None, "traffic_budget": run.traffic,
        "momentum_correction": run.momentum_correction,
        "powersgd_rank": run.rank,
        "warmup": run.warmup,
        **{key: seeds[0][key] for key in ("optimizer_momentum", "compressor_momentum")},
        "final_accuracy": final,
        "curve_mean": curves.mean(0).tolist(), "curve_min": curves.min(0).tolist(),
        "curve_max": curves.max(0).tolist(),
        **{key: float(np.mean([s[key] for s in seeds])) for key in
           ("bytes_per_step", "dense_bytes_per_step", "bytes_vs_dense", "traffic_vs_dense")},
        "density": None if seeds[0]["density"] is None else float(np.mean([s["density"] for s in seeds])),
        "layers": layers,  # how each tensor is sent at the target density (the first seed's run)
        "seeds": seeds,
    }
    if dense is not None:
        against_dense(row, dense, gap)
    return row


def against_dense(row: Dict[str, Any], dense: Dict[str, Any], gap: float) -> None:
    """Set ``row``'s ``gap_points`` (100 (mean - dense mean)), ``within_dense_spread`` (mean >= dense's min),
    ``target_accuracy`` (dense mean - ``gap`` points) and ``epochs_to_target``."""
    final, target = row["final_accuracy"], dense["final_accuracy"]["mean"] - gap / 100
    row["gap_points"] = 100 * (final["mean"] - dense["final_accuracy"]["mean"])
    row["within_dense_spread"] = final["mean"] >= dense["final_accuracy"]["min"]
    row["target_accuracy"] = target
    row["epochs_to_target"] = first_epoch_at(row["curve_mean"], target)


def rows_of(runs: Sequence[Run], trained, gap: float) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    dense: Dict[str, Dict[str, Any]] = {}
    for run in runs:  # dense comes first for every model
        row = summarize(run, trained[(run.model, run.label)], dense.get(run.model), gap)
        if run.name == "none":
            dense[run.model] = row
        rows.append(row)
    return rows


# --------------------------------------------------------------------- study
def study(
    data: Images,
    setup: Setup = Setup(),
    models: Sequence[str] = DEFAULT_MODELS,
    compressors: Sequence[str] = DEFAULT_COMPRESSORS,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    indices: Sequence[str] = ("gather",),
    exact_every: Sequence[int] = (1,),
    seeds: Sequence[int] = (0, 1, 2),
    target_gap: float = 0.5,
    out: Optional[str] = None,
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
    name: Optional[str] = None,
    powersgd_ranks: Sequence[int] = DEFAULT_POWERSGD_RANKS,
    figure: str = "curves",
    traffic: Sequence[float] = (),
    dense_below: Optional[int] = None,
) -> Dict[str, Any]:
    """Train every run of :func:`plan` for every seed on ``data``; write ``<name>.json/.png``
    (default :func:`file_stem`; ``figure``: a key of :data:`FIGURES`) to ``out`` when given, print the
    table; returns the results."""
    require_packages(torch=True, plots=plot and out is not None)
    runs = plan(models, compressors, ratios, variants, indices, exact_every, powersgd_ranks, setup.powersgd_start,
                traffic, dense_below)
    seeds = list(dict.fromkeys(int(s) for s in seeds))
    if not runs or not seeds:
        raise ValueError("nothing to run: give at least one model, compressor and seed")
    started = time.perf_counter()
    trained = run_all(runs, data, setup, seeds, progress)
    results = {
        "study": "convergence",
        "machine": describe_machine(),
        "settings": {
            **setup.described(data), "seeds": seeds,
            "ratios": list(ratios), "variants": list(dict.fromkeys(variants)), "target_gap_points": target_gap,
            "indices": list(dict.fromkeys(indices)),
            "exact_every": list(dict.fromkeys(exact_every)),
            "dense_below": dense_below,
            "data": data.describe(), "models": {m: describe_model(m, data.shape) for m in dict.fromkeys(models)},
            "optimizer": f"SGD, lr {setup.lr} ({setup.lr_schedule}), with momentum {setup.momentum} on the averaged gradient; "
                         f"with momentum correction (mc) the compressor owns momentum {setup.momentum} "
                         "and SGD runs without",
            "warmup": "DensityWarmup stepped every iteration from warmup_start to the density over "
                      "warmup_steps steps, warmup_epochs epochs (DGC's exponential ramp)",
            "bytes": "payload bytes one rank hands to the collectives per step, mean over ranks, steps, seeds",
            **({"powersgd": powersgd_protocol(setup, data, powersgd_ranks)} if "powersgd" in compressors else {}),
            **({"oktopk": {"traffic": list(dict.fromkeys(traffic)), "baseline": "benchmarks.oktopk.OkTopkSimulator: "
                           "a sum-selected global top-k after Ok-Topk (PPoPP 2022), interleaved fixed regions, s "
                           "pairs per region sent and kept, s = round(traffic d / 2N); the warm-up ramps the "
                           "budget"}} if "oktopk" in compressors else {}),
        },
        "rows": rows_of(runs, trained, target_gap),
        "wall_seconds": time.perf_counter() - started,
    }
    return publish(results, out, name or file_stem(data.name), FIGURES[figure] if plot else None, print_table,
                   stdout)


def powersgd_protocol(setup: Setup, data: Images, ranks: Sequence[int]) -> Dict[str, Any]:
    """The settings' record of the PowerSGD runs (:mod:`benchmarks.powersgd`)."""
    start = setup.powersgd_start_iter(data)
    return {
        "ranks": [int(r) for r in dict.fromkeys(ranks)],
        "hook": "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook, reproduced for the "
                "simulated ranks by benchmarks.powersgd.PowerSGDSimulator (checked against the hook on 2 and 4 "
                "gloo processes: tests/studies/test_powersgd.py)",
        "state": {**PowerSGD(1, start_iter=start).describe(), "matrix_approximation_rank": "the row's rank",
                  "random_seed": "the run's seed"},
        "start_powerSGD_iter": start,
        "start_rule": "--powersgd-start" if setup.powersgd_start is not None else
                      "the sparse modes' warm-up steps (warmup_steps), dense allreduces before it",
        "buckets": "one, the model's tensors in reverse order (DDP's rebuilt bucket under its 1 MiB first-bucket cap)",
        "optimizer": f"SGD with momentum {setup.momentum} on the averaged gradient, as dense",
        "traffic": "ring allreduces of fp32: the whole gradient before start_powerSGD_iter, then P (n k), Q (m k) "
                   "per compressed matrix and the dense part (1-D tensors and those with (n + m) k "
                   "min_compression_rate >= n m), 2 (N-1)/N of each",
    }


def file_stem(data: str) -> str:
    """``convergence_<data>``: the default name of the JSON and PNG files."""
    return f"convergence_{data}"


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(
        f"Convergence on {s['data']['name']} ({s['data']['train_images']} training, {s['data']['test_images']} test "
        f"images): {s['ranks']} simulated ranks, {s['epochs']} epochs of {s['steps_per_epoch']} steps, batch "
        f"{s['batch_per_rank']} per rank, lr {s['lr']} ({s.get('lr_schedule', 'constant')}), momentum {s['momentum']}, seeds {','.join(map(str, s['seeds']))}"
    )
    if "protocol" in s:
        say(f"  {s['protocol']}: {s['images_per_step']} images per step, {s['steps']} steps, "
            f"a warm-up of {s['warmup_steps']} steps")
    say(f"\n  {'model':<5} {'run':<36} {'test acc (mean +- sd)':>22} {'min-max':>13} {'vs dense':>9} "
        f"{'epoch>=target':>13} {'bytes/step':>11} {'vs dense':>9} {'traffic':>8}")
    for r in results["rows"]:
        acc = r["final_accuracy"]
        gap = "" if "gap_points" not in r else f"{r['gap_points']:+.2f}pt"
        reach = "" if "epochs_to_target" not in r else (str(r["epochs_to_target"] or "never"))
        say(
            f"  {r['model']:<5} {r['label']:<36} {acc['mean']:>13.4f} +- {acc['std']:.4f} "
            f"{acc['min']:.3f}-{acc['max']:.3f} {gap:>9} {reach:>13} {r['bytes_per_step']:>11,.0f} "
            f"{r['bytes_vs_dense']:>8.4f}x {r['traffic_vs_dense']:>7.4f}x"
        )
    say(
        f"\n  vs dense: points of final test accuracy against dense's mean; epoch>=target: first epoch whose "
        f"seed-mean accuracy reaches dense's final mean - {s['target_gap_points']:g} points; bytes/step: "
        "payload bytes per rank and step (warm-up runs include the warm-up); traffic: ring traffic per rank "
        "against a dense fp32 allreduce's; mc: momentum correction"
    )


def markdown_table(results: Dict[str, Any]) -> str:
    """The final-accuracy table as Markdown (docs/results.md), one row per model and run."""
    lines = [
        "| model | run | test accuracy, mean +- sd (min-max) | vs dense | first epoch >= target | bytes/step vs dense |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        acc = r["final_accuracy"]
        gap = "" if "gap_points" not in r else f"{r['gap_points']:+.2f} pt"
        reach = "" if "epochs_to_target" not in r else str(r["epochs_to_target"] or "never")
        lines.append(
            f"| {r['model']} | {r['label']} | {acc['mean']:.4f} +- {acc['std']:.4f} ({acc['min']:.4f}-{acc['max']:.4f}) "
            f"| {gap} | {reach} | {r['bytes_vs_dense']:.4f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot
def write_plot(results: Dict[str, Any], path: Any) -> None:
    """Test accuracy per epoch, seed mean and min-max band: a row per model, a column per density."""
    rows = results["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    ratios = list(dict.fromkeys(r["ratio"] for r in rows if r["ratio"])) or [None]
    fig, axes = pyplot().subplots(len(models), len(ratios), figsize=(max(9.5, 6.5 * len(ratios)), 4.4 * len(models)),
                                  squeeze=False)
    for i, model in enumerate(models):
        for j, ratio in enumerate(ratios):
            shown = [r for r in rows if r["model"] == model and r["ratio"] in (None, ratio)]
            plot_panel(axes[i][j], shown)
            axes[i][j].set_title(f"{model}, " + ("dense and TernGrad" if ratio is None else f"density {ratio:.2%}"))
    s = results["settings"]
    title = (
        f"{s['data']['name']} ({s['data']['train_images']:,} training images, {s['epochs']} epochs): test accuracy, "
        f"{s['ranks']} simulated ranks ({s.get('protocol', 'fixed per-rank batch')}: "
        f"{s['ranks'] * s['batch_per_rank']} images per step), mean of seeds {','.join(map(str, s['seeds']))} "
        "(band: min-max). Line style: "
        + ", ".join(f"{VARIANT_STYLES[v]} {v}" for v in s["variants"])
        + " (mc: momentum correction; dense and TernGrad: solid, TernGrad +ef: dotted)"
    )
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(11 * fig.get_figwidth()))))
    save_figure(fig, path)


#: Line style of each sparsifier variant in the plot (dense and TernGrad: solid).
VARIANT_STYLES = {"plain": "solid", "warmup": "dotted", "mc": "dashdot", "mc+warmup": "dashed"}


def plot_panel(ax: Any, rows: Sequence[Dict[str, Any]]) -> None:
    lows = []
    for r in rows:
        style = cnn.curve_style(cnn.label(r["compressor"]))
        if r["variant"]:  # sparsifiers; dense and TernGrad keep curve_style's (TernGrad +ef: dotted)
            style["linestyle"] = VARIANT_STYLES[r["variant"]]
        epochs = np.arange(len(r["curve_mean"]))
        ax.plot(epochs, r["curve_mean"], marker=".", label=r["label"], linewidth=1.2, **style)
        ax.fill_between(epochs, r["curve_min"], r["curve_max"], color=style["color"], alpha=0.15, linewidth=0)
        lows.append(min(r["curve_mean"][1:] or r["curve_mean"]))
    top = max(max(r["curve_max"]) for r in rows)
    ax.set_ylim(max(0.0, min(lows) - 0.02), min(1.0, top + 0.01) if top < 0.99 else 1.0)
    ax.xaxis.set_major_locator(pyplot().MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")


# --------------------------------------------------------------------- merge
#: Settings the studies of a merge must share: the same protocol, data and seeds.
SHARED_SETTINGS = ("ranks", "epochs", "batch_per_rank", "lr", "momentum", "lr_schedule", "global_batch", "steps",
                   "seeds", "data", "target_gap_points")
#: Settings of the warm-up, shared by the parts whose rows run one (a density warm-up, or PowerSGD's dense
#: steps when they default to the warm-up's): dense, fp16 or PowerSGD from a given step do not depend on them.
WARMUP_SETTINGS = ("warmup_epochs", "warmup_start")


def uses_warmup(part: Dict[str, Any]) -> bool:
    """Whether a study's rows depend on its :data:`WARMUP_SETTINGS`."""
    default_start = part["settings"].get("powersgd_start") is None
    return any(row.get("warmup") or (row["compressor"] == "powersgd" and default_start) for row in part["rows"])


def merge(parts: Sequence[Dict[str, Any]], sources: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """One study of the rows of ``parts`` (studies of the same :data:`SHARED_SETTINGS`, and of the same
    :data:`WARMUP_SETTINGS` among those whose rows use them: a ``ValueError`` otherwise): per model dense
    first, then the rows in the parts' order, a (model, label) once (the first); the gaps to dense recomputed against the merged dense row; ratios, variants, index modes,
    spacings and models the union; ``parts`` records each source's labels and wall time."""
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]["settings"]
    warm = next((part["settings"] for part in parts if uses_warmup(part)), first)
    for part in parts[1:]:
        want = {key: (warm if key in WARMUP_SETTINGS else first).get(key)
                for key in SHARED_SETTINGS + (WARMUP_SETTINGS if uses_warmup(part) else ())}
        differ = [key for key, value in want.items() if part["settings"].get(key) != value]
        if differ:
            raise ValueError(f"the studies differ in {', '.join(differ)}: merge runs of one protocol only")
    settings = {**first, **{key: warm.get(key) for key in WARMUP_SETTINGS}}
    for key in ("ratios", "variants", "indices", "exact_every"):
        settings[key] = list(dict.fromkeys(v for part in parts for v in part["settings"].get(key, [])))
    settings["models"] = {m: d for part in parts for m, d in part["settings"]["models"].items()}
    blocks = [block for part in parts for block in powersgd_blocks(part["settings"])]
    blocks = [block for i, block in enumerate(blocks) if block not in blocks[:i]]
    settings.pop("powersgd", None)
    if blocks:  # one, or a list where the parts' PowerSGD runs differ (their start)
        settings["powersgd"] = blocks[0] if len(blocks) == 1 else blocks
    settings["parts"] = [{"source": None if sources is None else str(sources[i]),
                          "rows": [r["label"] for r in part["rows"]], "wall_seconds": part["wall_seconds"]}
                         for i, part in enumerate(parts)]
    seen: Dict[Tuple[str, str], Dict[str, Any]] = {}
    for part in parts:
        for row in part["rows"]:
            seen.setdefault((row["model"], row["label"]), dict(row))
    rows = sorted(seen.values(), key=lambda r: (list(settings["models"]).index(r["model"]), r["compressor"] != "none"))
    dense = {r["model"]: r for r in rows if r["compressor"] == "none"}
    for row in rows:
        for key in ("gap_points", "within_dense_spread", "target_accuracy", "epochs_to_target"):
            row.pop(key, None)
        if row["compressor"] != "none" and row["model"] in dense:
            against_dense(row, dense[row["model"]], first["target_gap_points"])
    return {"study": "convergence", "machine": parts[0]["machine"], "settings": settings, "rows": rows,
            "wall_seconds": sum(part["wall_seconds"] for part in parts)}


def merge_files(paths: Sequence[str]) -> Dict[str, Any]:
    """:func:`merge` of the convergence JSON files ``paths``."""
    import json

    parts = []
    for path in paths:
        with open(path) as f:
            parts.append(json.load(f))
    return merge(parts, paths)


# ------------------------------------------------------------------ frontier
#: Colour per family of row in the frontier plot: compressor, and a sparsifier's index mode.
FAMILY_COLORS = {"none": "black", "fp16": "tab:gray", "powersgd": "tab:orange", "powersgd [from step]": "gold",
                 "topk": "tab:red",
                 "topk [leader]": "tab:brown", "topk [aggregate]": "tab:blue", "gaussiank": "tab:cyan",
                 "regtopk": "tab:green", "terngrad": "tab:purple", "terngrad-ef": "tab:pink"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def family(row: Dict[str, Any]) -> str:
    """``topk``, ``topk [leader]``, ``powersgd``, ...: the compressor and a shared index mode (``[from step]``:
    PowerSGD with a given start)."""
    mode = next((m for m in ("leader", "aggregate") if f"[{m}]" in row["label"]), None)
    mode = "from step" if " from step " in row["label"] else mode
    return row["compressor"] + (f" [{mode}]" if mode else "")


def write_frontier(results: Dict[str, Any], path: Any) -> None:
    """Final test accuracy against ``traffic_vs_dense`` (log x), a panel per model: one point per row,
    the seed mean with the seeds' min-max as error bars; dense's min-max as a grey band."""
    rows = results["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = pyplot().subplots(1, len(models), figsize=(14 * len(models), 7), squeeze=False)
    for ax, model in zip(axes[0], models):
        shown = [r for r in rows if r["model"] == model]
        dense = next((r for r in shown if r["compressor"] == "none"), None)
        if dense is not None:
            acc = dense["final_accuracy"]
            ax.axhspan(acc["min"], acc["max"], color="0.85", zorder=0, label="dense, min-max of seeds")
            ax.axhline(acc["mean"], color="black", linewidth=0.8, linestyle=":", zorder=0)
        counts: Dict[str, int] = {}
        for r in shown:
            kind, acc = family(r), r["final_accuracy"]
            marker = MARKERS[counts.get(kind, 0) % len(MARKERS)]
            counts[kind] = counts.get(kind, 0) + 1
            bars = [[acc["mean"] - acc["min"]], [acc["max"] - acc["mean"]]]
            ax.errorbar([r["traffic_vs_dense"]], [acc["mean"]], yerr=bars, fmt=marker, color=FAMILY_COLORS.get(kind),
                        capsize=3, markersize=6, label=r["label"])
        ax.set_xscale("log")
        ax.set_xlabel("ring traffic per rank / a dense fp32 allreduce's (log)")
        ax.set_ylabel("final test accuracy (mean of seeds; bars: min-max)")
        ax.set_title(model)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    s = results["settings"]
    title = (
        f"{s['data']['name']} ({s['data']['train_images']:,} training images), {s['epochs']} epochs, "
        f"{s['ranks']} simulated ranks ({s.get('protocol', 'fixed per-rank batch')}: "
        f"{s['ranks'] * s['batch_per_rank']} images per step, "
        f"{s['steps']} steps), seeds {','.join(map(str, s['seeds']))}: accuracy for traffic"
        + (f"; PowerSGD dense for its first {powersgd_starts(s)} steps" if "powersgd" in s else "")
    )
    fig.suptitle("\n".join(textwrap.wrap(title, width=int(11 * fig.get_figwidth()))))
    save_figure(fig, path)


def powersgd_blocks(settings: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The PowerSGD protocols of a study's ``settings``: none, its one, or each of a merged study's list (flat:
    lists nested by merging merged studies are read through)."""
    def flat(value: Any) -> List[Dict[str, Any]]:
        return [block for item in value for block in flat(item)] if isinstance(value, list) else [value]

    return flat(settings["powersgd"]) if settings.get("powersgd") else []


def powersgd_starts(settings: Dict[str, Any]) -> str:
    """``117``, or ``117 / 10``: the start_powerSGD_iter of each PowerSGD block of ``settings``."""
    blocks = powersgd_blocks(settings)
    starts = [str(block["start_powerSGD_iter"]) for block in blocks]
    return " / ".join(dict.fromkeys(starts))


#: ``--figure``: the per-epoch curves (:func:`write_plot`) or accuracy for traffic (:func:`write_frontier`).
FIGURES = {"curves": write_plot, "frontier": write_frontier}
