"""``python -m benchmarks``: the paper reproductions and link studies (not installed).

Run from a checkout of the repository (the library installed, e.g. ``make setup``):

python -m benchmarks linreg [--steps 2500] [--lr 0.01] [--ratio 0.4] [--mu 4] [--mu-sweep 1,2,4,8] [--instances 1]
                            [--plot DIR]
python -m benchmarks cnn [--ranks 4] [--epochs 5] [--ratios 0.01,0.001] [--lr 0.05] [--seed 0] [--plot DIR]
python -m benchmarks gaussian [--ranks 4] [--epochs 5] [--ratio 0.01] [--layer fc1.weight] [--plot DIR]
python -m benchmarks terngrad [--ranks 4] [--epochs 5] [--clip 2.5] [--plot DIR]
python -m benchmarks convergence [--data digits|fashion-mnist] [--data-dir DIR] [--models cnn,mlp]
                                 [--compressors none,topk,gaussiank,regtopk,terngrad] [--ratios 0.01,0.001]
                                 [--variants plain,mc+warmup] [--indices gather,leader,aggregate]
                                 [--exact-every 1,32] [--dense-below N] [--powersgd-ranks 1,2,4]
                                 [--powersgd-start STEPS]
                                 [--traffic 0.04]
                                 [--warmup-epochs E] [--seeds 0,1,2] [--epochs E]
                                 [--batch-size PER_RANK | --global-batch B]
                                 [--train-size N] [--test-size N] [--quick] [--figure curves|frontier]
                                 [--out results] [--name STEM]
python -m benchmarks convergence --merge A.json,B.json [--figure frontier] [--out results] [--name STEM]
python -m benchmarks time-to-accuracy [--rates 1gbit,10gbit | --link none] [--ranks 4]
                                      [--runs dense,fp16,compressor,aggregate,traffic,auto] [--compressor topk]
                                      [--ratio 0.01] [--variant mc+warmup] [--aggregate-ratio 0.08]
                                      [--traffic 0.04] [--dense-below 2000] [--train-size N] [--epochs E]
                                      [--out results] [--name STEM]
python -m benchmarks select [--device cuda|cpu] [--sizes 11.7M,25.6M] [--ratios 0.01,0.001] [--repeats 20]
                           [--rows topk/eager,topk/compiled,...] [--code-path route|accelerator]
                           [--bucket one|resnet50] [--out results] [--name select]
python -m benchmarks trace [--model resnet50|gpt2|mlp] [--device cpu|cuda] [--warmup 3] [--compressors none,fp16,...]
                          [--ratio 0.01] [--routes ...] [--json FILE] [--plot FILE]
python -m benchmarks compress [--sizes 1M 11.7M 25M] [--ratio 0.01] [--repeats 5] [--device all] [--out results]
python -m benchmarks wire [--ranks 2,4,16] [--ratio 0.01] [--scale 1] [--out results]
python -m benchmarks step [--ranks 4] [--rates 1gbit,10gbit | --link none] [--ratio 0.01] [--steps 10] [--scale 1]
                          [--out results]
python -m benchmarks traffic [--model resnet50|gpt2] [--compressor topk] [--ratio 0.01] [--ranks 2,...,1024]
                             [--counted 16,64,256] [--out results]
python -m benchmarks scaling [--ranks 2,4,8] [--rates 1gbit,10gbit | --link none | --measure none] [--ratio 0.01]
                             [--out results]
python -m benchmarks train-step [--model mlp] [--device cpu] [--steps 25] [--warmup 8] [--batch N]
                                [--compressors none,fp16,...] [--ratio 0.01] [--routes ...] [--profile]
                                [--json FILE] [--plot FILE]
python -m benchmarks tf-step [--models mlp,cnn] [--rows dense,...] [--steps 10] [--rounds 3] [--one-by-one]
                             [--baseline JSON] [--out results]
python -m benchmarks tf-xla [--sizes 11.7M,25.6M] [--repeats 9] [--out results]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, List, Optional, Sequence

from hvd_compress import Compression
from hvd_compress.cli import _add_ratio, run_command
from hvd_compress.cli import _wrote as _wrote_json_and_plot


def _ints(text: str) -> List[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected integers like 2,4,16, got {text!r}") from error


def _floats(text: str) -> List[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4,8, got {text!r}") from error

def _wrote(folder: Optional[str], stem: str) -> int:
    if folder:
        print(f"Wrote {folder}/{stem}.json and {folder}/{stem}.png")
    return 0


def _simulate_linreg(args: argparse.Namespace) -> int:
    from benchmarks import linreg

    results = linreg.study(
        n_ranks=args.ranks,
        dim=args.dim,
        ratio=args.ratio,
        mu=args.mu,
        mu_sweep=args.mu_sweep or (),
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        instances=args.instances,
        out=args.plot,
    )
    final = {r["label"]: r["final_distance"] for r in results["final"]}
    print(f"  regtop-k / top-k = {final[f'regtop-k mu={args.mu:g}'] / final['top-k']:.3f}")
    return _wrote(args.plot, "linreg")


def _training(args: argparse.Namespace) -> Any:
    """The training options every CNN study shares."""
    from benchmarks.cnn import Training

    return Training(
        ranks=args.ranks,
        epochs=args.epochs,
        batch_per_rank=args.batch_size,
        lr=args.lr,
        train_size=args.train_size,
        test_size=args.test_size,
        seed=args.seed,
    )


def _simulate_cnn(args: argparse.Namespace) -> int:
    from benchmarks import cnn

    cnn.study(ratios=args.ratios, training=_training(args), out=args.plot)
    return _wrote(args.plot, "cnn")


def _simulate_gaussian(args: argparse.Namespace) -> int:
    from benchmarks import gaussian

    gaussian.study(
        ratio=args.ratio, layer=args.layer, snapshots=args.snapshots, training=_training(args), out=args.plot
    )
    return _wrote(args.plot, "gaussian")


def _simulate_terngrad(args: argparse.Namespace) -> int:
    from benchmarks import terngrad

    terngrad.study(clip=args.clip, layer=args.layer, training=_training(args), out=args.plot)
    return _wrote(args.plot, "terngrad")


def _convergence(args: argparse.Namespace) -> int:
    from benchmarks import convergence, datasets
    from benchmarks.output import publish

    if args.merge:
        stem = args.name or "convergence_merged"
        results = convergence.merge_files(args.merge)
        publish(results, args.out, stem, convergence.FIGURES[args.figure], convergence.print_table)
        return _wrote(args.out, stem)
    options = convergence.options_for(args.data, args.quick, vars(args))
    try:
        data = datasets.load(args.data, options["train_size"], options["test_size"], args.data_dir)
    except FileNotFoundError as error:
        print(f"python -m benchmarks: {error}", file=sys.stderr)
        return 2
    setup = convergence.Setup(
        ranks=args.ranks,
        epochs=options["epochs"],
        batch_per_rank=options["batch_size"],
        lr=args.lr,
        lr_schedule=args.lr_schedule,
        momentum=args.momentum,
        warmup_epochs=options["warmup_epochs"],
        warmup_start=args.warmup_start,
        global_batch=args.global_batch,
        powersgd_start=args.powersgd_start,
    )
    print(
        f"Convergence on {data.name} ({len(data.train_y)} training, {len(data.test_y)} test images): "
        f"{', '.join(args.models)} on {args.ranks} simulated ranks, {setup.epochs} epochs, {setup.protocol} "
        f"({setup.batch_per_rank} images per rank and step); "
        f"{', '.join(args.compressors)} at {', '.join(f'{r:g}' for r in args.ratios)}, "
        f"variants {','.join(args.variants)}; "
        + (f"traffic budgets {', '.join(f'{t:g}' for t in args.traffic)}; " if args.traffic else "") +
        f"seeds {','.join(map(str, args.seeds))}"
    )
    convergence.study(
        data,
        setup,
        models=args.models,
        compressors=args.compressors,
        ratios=args.ratios,
        variants=args.variants,
        indices=args.indices,
        exact_every=args.exact_every,
        seeds=args.seeds,
        target_gap=args.target_gap,
        out=args.out,
        progress=not args.no_progress,
        name=args.name,
        powersgd_ranks=args.powersgd_ranks,
        figure=args.figure,
        traffic=args.traffic,
        dense_below=args.dense_below,
    )
    return _wrote(args.out, args.name or convergence.file_stem(data.name))


def _time_to_accuracy(args: argparse.Namespace) -> int:
    from benchmarks import time_to_accuracy

    names = ("data", "data_dir", "model", "train_size", "test_size", "epochs", "lr", "lr_schedule", "momentum",
             "compressor", "ratio", "variant", "aggregate_ratio", "traffic", "dense_below", "warmup_epochs",
             "warmup_start", "evals_per_epoch", "seed")
    training = time_to_accuracy.Training(batch_per_rank=args.batch_size, configurations=args.runs,
                                         **{n: getattr(args, n) for n in names})
    print(
        f"Time to accuracy: {args.model} on {args.data}, {args.ranks} processes, {args.epochs} epochs; "
        f"{', '.join(training.label(c) for c in training.runs())}; {_where(args)}"
    )
    return _on_ranks(
        time_to_accuracy.run,
        args.out,
        args.name,
        training=training,
        ranks=args.ranks,
        rates=[None] if args.link == "none" else args.rates,
        delay=args.delay,
        target_gap=args.target_gap,
        name=args.name,
        progress=not args.no_progress,
    )


def _time_to_accuracy_runs(text: str) -> Any:
    from benchmarks.time_to_accuracy import check_runs

    try:
        return check_runs(_names(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _add_time_to_accuracy(commands: Any) -> None:
    from benchmarks.convergence import MODELS, VARIANTS
    from benchmarks.datasets import DATASETS
    from benchmarks.time_to_accuracy import RUNS, TRAFFIC_WARMUP_START, Training

    d = Training()
    p = commands.add_parser(
        "time-to-accuracy",
        help="training time to a target accuracy over emulated links: dense, fp16, sparsifiers, a traffic budget, Auto"
    )
    _add_link(p, rates="emulated link rates",
              none="plain processes on localhost, no root needed (default emulated: ci/netns_cluster.sh, root)")
    _add_delay(p)
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--data", choices=DATASETS, default=d.data, help=f"data set (default {d.data})")
    p.add_argument("--data-dir", help="folder of the Fashion-MNIST IDX files (as for convergence)")
    p.add_argument("--model", choices=MODELS, default=d.model, help=f"({d.model})")
    p.add_argument("--train-size", type=int, default=d.train_size, help=f"training images ({d.train_size})")
    p.add_argument("--test-size", type=int, default=d.test_size, help=f"test images ({d.test_size})")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"({d.epochs})")
    p.add_argument("--batch-size", type=int, default=d.batch_per_rank, help=f"per rank ({d.batch_per_rank})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD step size ({d.lr})")
    _add_lr_schedule(p, d.lr_schedule)
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD's momentum, or the compressor's with mc")
    p.add_argument("--runs", type=_time_to_accuracy_runs, default=d.configurations, metavar="NAME,...",
                   help=f"of {','.join(RUNS)}, in this order, dense among them (default {','.join(d.configurations)}). "
                        "dense: fp32 allreduce, SGD with momentum; fp16: FP16, the allreduce in float16, SGD with "
                        "momentum; compressor: --compressor at --ratio in --variant; aggregate: the same with "
                        "indices='aggregate' at --aggregate-ratio; traffic: TopK(traffic=--traffic, momentum="
                        f"--momentum) with a warm-up from {TRAFFIC_WARMUP_START:.0%}% of dense's traffic, SGD without "
                        "momentum (a budget in traffic, README); auto: Auto of the compressor run")
    p.add_argument("--compressor", default=d.compressor, help=f"topk, gaussiank or regtopk ({d.compressor})")
    _add_ratio(p)
    p.add_argument("--variant", choices=tuple(VARIANTS), default=d.variant,
                   help=f"of the compressor, aggregate and auto runs ({d.variant})")
    p.add_argument("--aggregate-ratio", type=float, default=d.aggregate_ratio,
                   help=f"density of the aggregate run ({d.aggregate_ratio})")
    p.add_argument("--traffic", type=float, default=d.traffic,
                   help=f"the traffic run's budget, a fraction of a dense fp32 allreduce's bytes per rank "
                        f"({d.traffic})")
    p.add_argument("--dense-below", type=int, default=d.dense_below,
                   help="the traffic run's dense_below: tensors of fewer entries sent dense (the sparsifier's "
                        "default; the README's recommended setting: --traffic 0.03 --dense-below 2000)")
    p.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, help=f"({d.warmup_epochs})")
    p.add_argument("--warmup-start", type=float, default=d.warmup_start,
                   help=f"warm-up start density of the compressor, aggregate and auto runs ({d.warmup_start})")
    p.add_argument("--evals-per-epoch", type=int, default=d.evals_per_epoch, help=f"({d.evals_per_epoch})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--target-gap", type=float, default=0.5,
                   help="target accuracy: dense's final accuracy minus this many points (0.5)")
    p.add_argument("--no-progress", action="store_true", help="no progress line per evaluation")
    p.add_argument("--name", default="time_to_accuracy", help="stem of the written files (time_to_accuracy)")
    _add_out(p, "<name>", _time_to_accuracy)


def _names(text: str) -> List[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_convergence(commands: Any) -> None:
    from benchmarks.convergence import (
        COMPRESSORS, DEFAULT_COMPRESSORS, DEFAULT_MODELS, DEFAULT_VARIANTS, DEFAULTS, MODELS, QUICK, VARIANTS,
    )
    from benchmarks.datasets import DATASETS

    p = commands.add_parser(
        "convergence",
        help="test accuracy on Fashion-MNIST or digits: dense vs compressors, with/without momentum correction "
             "and warm-up"
    )
    p.add_argument("--data", choices=DATASETS, default="digits", help="data set (default digits)")
    p.add_argument("--data-dir", help="folder of the Fashion-MNIST IDX files (default: $HVD_COMPRESS_FASHION_MNIST, "
                   "else /usr/share/datasets/fashion-mnist)")
    p.add_argument("--models", type=_names, default=list(DEFAULT_MODELS),
                   help=f"of {','.join(MODELS)} (default {','.join(DEFAULT_MODELS)})")
    p.add_argument("--compressors", type=_names, default=list(DEFAULT_COMPRESSORS),
                   help=f"of {','.join(COMPRESSORS)} (default {','.join(DEFAULT_COMPRESSORS)}; none is dense)")
    p.add_argument("--ratios", type=_floats, default=[0.01, 0.001], help="sparsifier densities (0.01,0.001)")
    p.add_argument("--variants", type=_names, default=list(DEFAULT_VARIANTS),
                   help=f"sparsifier variants, of {','.join(VARIANTS)} (mc: momentum correction, the optimizer "
                        f"without momentum; default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--warmup-start", type=float, default=0.25, help="warm-up start density (0.25)")
    p.add_argument("--indices", type=_names, default=["gather"],
                   help="sparsifier index modes, of gather,leader,aggregate (default gather: each rank its own, "
                        "allgathered; leader, aggregate: one set shared by every rank, allreduced)")
    p.add_argument("--exact-every", type=_ints, default=[1],
                   help="steps between exact selections of Top-k and RegTop-k, e.g. 1,32 (default 1: every step; "
                        "above 1 the steps between reuse each tensor's threshold)")
    p.add_argument("--dense-below", type=int,
                   help="the sparsifiers' dense_below: tensors of fewer entries travel dense (default: theirs, 1024)")
    p.add_argument("--powersgd-ranks", type=_ints, default=[1, 2, 4],
                   help="PowerSGD's matrix approximation ranks, one row each (default 1,2,4)")
    p.add_argument("--powersgd-start", type=int,
                   help="PowerSGD's start_powerSGD_iter: dense steps before it compresses (default: the sparse modes' "
                        "warm-up steps, --warmup-epochs of steps; at least 2)")
    p.add_argument("--traffic", type=_floats, default=[],
                   help="oktopk's traffic budgets, fractions of a dense fp32 ring allreduce's bytes per rank, one "
                        "row each per variant (e.g. 0.04)")
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="seeds, e.g. 0,1,2 (default)")
    p.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD step size (0.05)")
    _add_lr_schedule(p, "constant")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD's momentum, or the compressor's with mc (0.9)")
    defaults = "; ".join(f"{name}: {', '.join(f'{k} {v}' for k, v in d.items())}" for name, d in DEFAULTS.items())
    p.add_argument("--epochs", type=int, help="per-data-set default")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, help="per rank, the same at every N (the global batch grows "
                       "with --ranks); per-data-set default")
    batch.add_argument("--global-batch", type=int, metavar="B",
                       help="images per step over all ranks, B / N per rank (N must divide B): the same steps, "
                            "schedule and warm-up at every N; for accuracy comparisons across N")
    p.add_argument("--warmup-epochs", type=float, help="epochs of the warm-up ramp; per-data-set default")
    p.add_argument("--train-size", type=int, help="training images (a fixed subset); default all")
    p.add_argument("--test-size", type=int, help="test images; default all")
    p.add_argument("--target-gap", type=float, default=0.5,
                   help="target accuracy: dense's final mean minus this many points (0.5)")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny run for tests: {', '.join(f'{k} {v}' for k, v in QUICK.items())}. Defaults: {defaults}")
    p.add_argument("--no-progress", action="store_true", help="no progress line per finished run")
    p.add_argument("--figure", choices=("curves", "frontier"), default="curves",
                   help="curves: test accuracy per epoch (default); frontier: final accuracy against ring traffic "
                        "per rank vs dense (log), one point per row, bars: seeds' min-max, band: dense's")
    p.add_argument("--merge", type=_names, metavar="JSON,...",
                   help="train nothing: merge these convergence JSON files of one protocol (same ranks, batch, steps, "
                        "seeds, data) into <name>.json/.png, e.g. runs of different --indices or --ratios")
    p.add_argument("--name", help="stem of the written files (default convergence_<data>; convergence_merged "
                   "with --merge)")
    _add_out(p, "<name>", _convergence)


def _add_cnn_options(parser: argparse.ArgumentParser, study: str) -> None:
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    parser.add_argument("--epochs", type=int, default=5, help="64 steps each with the defaults (5)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD step size, momentum 0.9 (0.05)")
    parser.add_argument("--train-size", type=int, default=8192, help="synthetic training images (8192)")
    parser.add_argument("--test-size", type=int, default=2048, help="synthetic test images (2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="DIR", help=f"write {study}.json and {study}.png here")


def _widths(scale: float) -> str:
    return "" if scale == 1 else f" (widths x {scale:g})"


def _where(args: argparse.Namespace) -> str:
    return "localhost, no emulation" if args.link == "none" else f"emulated links of {', '.join(args.rates)}"


def _bench_compress(args: argparse.Namespace) -> int:
    from benchmarks import compress

    args.sizes = [size for group in args.sizes for size in group]  # "--sizes 1M,25M 11.7M"
    print(
        f"Compression cost: one engine step on one rank vs torch.topk and one memory pass; sizes "
        f"{', '.join(compress.format_size(s) for s in args.sizes)}, ratio {args.ratio}, "
        f"median of {args.repeats}, device {args.device}"
    )
    compress.run(sizes=args.sizes, ratio=args.ratio, repeats=args.repeats, device=args.device, out=args.out)
    return _wrote(args.out, "compress")


def _bench_select(args: argparse.Namespace) -> int:
    from benchmarks import select
    from benchmarks.compress import format_size

    print(
        f"Selection microbenchmark: {', '.join(args.rows)} at "
        f"{', '.join(map(format_size, args.sizes)) if args.bucket == 'one' else 'a ResNet-50 bucket of'} elements, "
        f"densities {', '.join(f'{r:g}' for r in args.ratios)}, median of {args.repeats}, "
        f"device {args.device or 'cuda when available'}"
    )
    select.run(device=args.device, sizes=args.sizes, ratios=args.ratios, repeats=args.repeats, rows=args.rows,
               code_path=args.code_path, seed=args.seed, out=args.out, name=args.name, bucket=args.bucket)
    return _wrote(args.out, args.name)


def _add_select(commands: Any) -> None:
    from benchmarks import select

    p = commands.add_parser(
        "select", help="exchange microbenchmark: copy floor, torch.topk, each compressor's exchange eager and compiled"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available, else cpu")
    p.add_argument("--sizes", type=_size, default=list(select.DEFAULT_SIZES),
                   help="elements, e.g. 1M,4M (default 11.7M,25.6M)")
    p.add_argument("--ratios", type=_floats, default=list(select.DEFAULT_RATIOS), help="densities (0.01,0.001)")
    p.add_argument("--repeats", type=int, default=select.DEFAULT_REPEATS, help="timed calls per row (median)")
    p.add_argument("--rows", type=_some_of(tuple(select.ROWS)), default=list(select.ROWS),
                   help=f"default all: {','.join(select.ROWS)} (copy, clone and torch.topk always run)")
    p.add_argument("--code-path", choices=select.CODE_PATHS, default="route",
                   help="accelerator: on the CPU, the kernels a GPU runs (default: the routes' own way)")
    p.add_argument("--bucket", choices=tuple(select.BUCKETS), default="one",
                   help="what each exchange's bucket holds: the one gradient (default), or resnet50: ResNet-50's "
                   "161 parameter tensors (25.6M elements; --sizes left aside)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="select", help="stem of the written files (select)")
    _add_out(p, "<name>", _bench_select)


def _bench_wire(args: argparse.Namespace) -> int:
    from benchmarks import wire

    print(
        f"Wire bytes: one simulated step of every compressor on ResNet-18-shaped gradients{_widths(args.scale)}, "
        f"N = {', '.join(map(str, args.ranks))}, ratio {args.ratio}"
    )
    wire.run(
        ranks=args.ranks,
        ratio=args.ratio,
        scale=args.scale,
        dense_below=args.dense_below,
        seed=args.seed,
        out=args.out,
    )
    return _wrote(args.out, "wire")


def _rates(text: str) -> List[str]:
    from benchmarks.cluster import parse_rate

    rates = [part.strip() for part in text.split(",") if part.strip()]
    try:
        for rate in rates:
            parse_rate(rate)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return rates


def _on_ranks(run: Callable[..., Any], out: str, stem: str, **options: Any) -> int:
    """Run a benchmark whose ranks are processes: one that failed or timed out is exit status 1."""
    try:
        run(out=out, **options)
    except RuntimeError as error:
        print(f"python -m benchmarks: {error}", file=sys.stderr)
        return 1
    return _wrote(out, stem)


def _bench_step(args: argparse.Namespace) -> int:
    from benchmarks import step

    names = args.compression or list(step.ROWS)
    print(
        f"Step time: {args.ranks} ranks, ResNet-18-shaped gradients{_widths(args.scale)}, "
        f"{', '.join(names)} at ratio {args.ratio}, {args.steps} steps, "
        f"compute stand-in {args.compute_ms:g} ms; {_where(args)}"
    )
    return _on_ranks(
        step.run,
        args.out,
        "step",
        ranks=args.ranks,
        rates=[None] if args.link == "none" else args.rates,
        ratio=args.ratio,
        steps=args.steps,
        warmup=args.warmup,
        scale=args.scale,
        compute_ms=args.compute_ms,
        compressors=names,
        delay=args.delay,
        bucket_mb=args.bucket_mb,
        seed=args.seed,
    )


def _bench_traffic(args: argparse.Namespace) -> int:
    from benchmarks import traffic

    traffic.run(model=args.model, compressor=args.compressor, ratio=args.ratio, ranks=args.ranks,
                counted_ranks=args.counted, out=args.out, progress=not args.no_progress)
    return _wrote(args.out, "traffic")


def _bench_scaling(args: argparse.Namespace) -> int:
    from benchmarks import scaling

    measure = args.measure != "none"
    print(
        f"Communication scaling: dense allreduce vs sparse allgather vs shared index set vs TernGrad, "
        f"ratio {args.ratio}; "
        + (f"{_where(args)}, measured at N = {', '.join(map(str, args.ranks))}" if measure else "model only")
    )
    return _on_ranks(
        scaling.run,
        args.out,
        "scaling",
        ranks=args.ranks,
        rates=args.rates,
        link=args.link,
        measure=measure,
        ratio=args.ratio,
        scale=args.scale,
        repeats=args.repeats,
        delay=args.delay,
        max_ranks=args.max_ranks,
        seed=args.seed,
    )


def _size(text: str) -> List[int]:
    from benchmarks.compress import parse_size

    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _add_width_scale(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="channel-width multiplier of ResNet-18 (1 = 11.7M parameters)",
    )


def _add_link(parser: argparse.ArgumentParser, rates: str, none: str) -> None:
    """``--rates`` (described as ``rates``) and ``--link`` (``none``: what ``--link none`` does)."""
    parser.add_argument(
        "--rates",
        type=_rates,
        default=["1gbit", "10gbit"],
        help=f"{rates}, tc syntax (default 1gbit,10gbit)",
    )
    parser.add_argument(
        "--link",
        choices=("emulated", "none"),
        default="emulated",
        help=f"none: {none}",
    )


def _train_step(args: argparse.Namespace) -> int:
    from benchmarks import train_step

    print(
        f"Training step at world size 1: {args.model} on {args.device}, batch "
        f"{args.batch or train_step.DEFAULT_BATCH[args.model]}, {args.steps} steps after {args.warmup}, "
        f"{', '.join(args.compressors)} at ratio {args.ratio}"
    )
    train_step.run(
        model=args.model,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        batch=args.batch,
        compressors=args.compressors,
        ratio=args.ratio,
        routes=args.routes,
        dropin_comm=args.dropin_comm,
        seed=args.seed,
        json_path=args.json or None,
        plot_path=args.plot or None,
        profile=args.profile,
    )
    return _wrote_json_and_plot(args)


def _add_train_step(commands: Any) -> None:
    from benchmarks.train_step import COMPRESSORS, DROPIN_COMMS, MODELS, ROUTES

    train = commands.add_parser(
        "train-step", help="full training-step time per route (DDP, hooks, ours) at world size 1, CPU or GPU"
    )
    train.add_argument("--model", choices=MODELS, default="mlp", help="resnet50 and gpt2 need [bench-gpu]")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    train.add_argument("--steps", type=int, default=25, help="timed steps per row (median and min reported)")
    train.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    train.add_argument("--batch", type=int, help="default: resnet50 64, gpt2 8, mlp 32")
    train.add_argument(
        "--compressors",
        type=_some_of(COMPRESSORS),
        default=list(COMPRESSORS),
        help=f"ours, per route (default {','.join(COMPRESSORS)})",
    )
    _add_ratio(train)
    train.add_argument(
        "--routes",
        type=_some_of(ROUTES),
        default=list(ROUTES),
        help=f"default all: {','.join(ROUTES)} (ddp, the baseline, always runs)",
    )
    train.add_argument(
        "--dropin-comm",
        choices=DROPIN_COMMS,
        default="auto",
        help="transport of ours-dropin: auto = Horovod when it initialises, else torch.distributed",
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--profile",
        action="store_true",
        help="also profile one steady step per row (torch.profiler): kernels and GPU ms (CPU: operator ms)",
    )
    train.add_argument("--json", default="results/train_step.json", help="results file (default %(default)s)")
    train.add_argument(
        "--plot", default="results/train_step.png", help="bar chart of the ratios (default %(default)s)"
    )
    train.set_defaults(run=_train_step)


def _add_lr_schedule(parser: argparse.ArgumentParser, default: str) -> None:
    from benchmarks.cnn import LR_SCHEDULES

    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=default,
                        help=f"cosine: the step size decays from --lr to 0 over the run (default {default})")


def _some_of(choices: Sequence[str]) -> Callable[[str], List[str]]:
    """A comma-separated list of some of ``choices``."""

    def parse(text: str) -> List[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown)) or 'empty list'}; choose from {','.join(choices)}"
            )
        return names

    return parse


def _trace(args: argparse.Namespace) -> int:
    from benchmarks import trace_step

    which = "A step of a density warm-up" if args.ramp else "One steady training step"
    print(
        f"{which} traced at world size 1: {args.model} on {args.device} (the accelerator's "
        f"code path), after {args.warmup} steps, {', '.join(args.compressors)} at ratio {args.ratio}"
    )
    trace_step.run(model=args.model, device=args.device, warmup=args.warmup, compressors=args.compressors,
                   ratio=args.ratio, routes=args.routes, dropin_comm=args.dropin_comm, seed=args.seed,
                   top=args.top, json_path=args.json or None, plot_path=args.plot or None, ramp=args.ramp)
    for path in (args.json, args.plot):
        if path:
            print(f"Wrote {path}")
    return 0


def _add_trace(commands: Any) -> None:
    from benchmarks import trace_step
    from benchmarks.routes import DROPIN_COMMS

    p = commands.add_parser(
        "trace",
        help="kernels, bytes and device waits of one steady step per route, the accelerator's code path "
             "traced on any device (the stand-in when no GPU is at hand)",
    )
    p.add_argument("--model", choices=trace_step.MODELS, default="resnet50", help="parameter shapes (mlp: train-step's)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--warmup", type=int, default=trace_step.DEFAULT_WARMUP, help="untraced steps first")
    p.add_argument("--compressors", type=_some_of(trace_step.COMPRESSORS + trace_step.SHARED),
                   default=list(trace_step.COMPRESSORS),
                   help=f"ours, per route (default {','.join(trace_step.COMPRESSORS)}; also <sparsifier>-leader, "
                        "<sparsifier>-aggregate: with that shared index set; topk-reuse, regtopk-reuse: a step "
                        "between exact selections, exact_every > 1)")
    p.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")
    p.add_argument("--routes", type=_some_of(trace_step.ROUTES), default=list(trace_step.ROUTES),
                   help=f"default all: {','.join(trace_step.ROUTES)} (local and ddp+handwritten-topk always run)")
    p.add_argument("--dropin-comm", choices=DROPIN_COMMS, default="auto",
                   help="transport of ours-dropin: auto = Horovod when it initialises, else torch.distributed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=trace_step.TOP, help="operators listed per row in the JSON")
    p.add_argument("--ramp", action="store_true",
                   help="trace a step of a density warm-up (every step a new density) instead of a steady one")
    p.add_argument("--json", default="results/trace.json", help="results file (default %(default)s)")
    p.add_argument("--plot", default="results/trace.png", help="ratios to the hand-written hook (default %(default)s)")
    p.set_defaults(run=_trace)


def _add_delay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--delay", default="0.1ms", help="one-way link delay where netem exists (default 0.1ms)"
    )


def _add_out(parser: argparse.ArgumentParser, stem: str, run: Callable[[argparse.Namespace], int]) -> None:
    """``--out`` for ``<stem>.json`` and ``<stem>.png``, and the handler ``run``."""
    parser.add_argument("--out", default="results", help=f"folder for {stem}.json and {stem}.png")
    parser.set_defaults(run=run)



def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    linreg = commands.add_parser("linreg", help="RegTop-k paper's distributed linear regression")
    linreg.add_argument("--ranks", type=int, default=20)
    linreg.add_argument("--dim", type=int, default=100)
    linreg.add_argument("--ratio", type=float, default=0.4)
    linreg.add_argument("--mu", type=float, default=4.0)
    linreg.add_argument("--lr", type=float, default=0.01)
    linreg.add_argument("--steps", type=int, default=2500)
    linreg.add_argument("--seed", type=int, default=0)
    linreg.add_argument(
        "--instances", type=int, default=1, help="problems (seeds seed, seed+1, ...) for Top-k vs RegTop-k"
    )
    linreg.add_argument("--mu-sweep", type=_floats, help="add a RegTop-k run per temperature, e.g. 1,2,4,8")
    linreg.add_argument("--plot", metavar="DIR", help="write linreg.json and linreg.png (log scale) here")
    linreg.set_defaults(run=_simulate_linreg)
    cnn = commands.add_parser("cnn", help="small CNN: dense, Top-k, Gaussian-k, RegTop-k per ratio, TernGrad")
    _add_cnn_options(cnn, "cnn")
    cnn.add_argument("--ratios", type=_floats, default=[0.01, 0.001], help="densities (0.01,0.001)")
    cnn.set_defaults(run=_simulate_cnn)
    gauss = commands.add_parser("gaussian", help="Gaussian-k: histogram of g + r vs its Gaussian, |S| vs k")
    _add_cnn_options(gauss, "gaussian")
    gauss.add_argument("--ratio", type=float, default=0.01, help="Gaussian-k density (default 0.01)")
    gauss.add_argument("--layer", default="fc1.weight", help="layer of the histograms (default fc1.weight)")
    gauss.add_argument("--snapshots", type=int, default=4, help="iterations with a histogram (default 4)")
    gauss.set_defaults(run=_simulate_gaussian)
    tern = commands.add_parser("terngrad", help="TernGrad with/without clipping and scalar sharing")
    _add_cnn_options(tern, "terngrad")
    tern.add_argument("--clip", type=float, default=2.5, help="clipping factor c of the clipped runs (2.5)")
    tern.add_argument("--layer", default="fc1.weight", help="layer whose scale is reported (fc1.weight)")
    tern.set_defaults(run=_simulate_terngrad)

    _add_convergence(commands)
    _add_time_to_accuracy(commands)

    compress = commands.add_parser(
        "compress", help="time of one engine step on one rank vs torch.topk and one memory pass"
    )
    compress.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=[[1_000_000, 11_700_000, 25_000_000]],
        help="gradient sizes in elements: 1M 11.7M 25M, 10000 or 1M,25M (default 1M 11.7M 25M)",
    )
    _add_ratio(compress)
    compress.add_argument("--repeats", type=int, default=5, help="timed engine steps per measurement (median)")
    compress.add_argument(
        "--device", choices=("cpu", "cuda", "all"), default="all", help="all: cpu, and cuda when available"
    )
    _add_out(compress, "compress", _bench_compress)

    _add_select(commands)
    _add_trace(commands)

    wire = commands.add_parser("wire", help="bytes per rank per step vs dense fp32, ResNet-18 shapes")
    wire.add_argument("--ranks", type=_ints, default=[2, 4, 16], help="world sizes, e.g. 2,4,16 (default)")
    _add_ratio(wire)
    _add_width_scale(wire)
    wire.add_argument(
        "--dense-below",
        type=int,
        default=1024,
        help="tensors below this many elements go dense (default 1024)",
    )
    wire.add_argument("--seed", type=int, default=0)
    _add_out(wire, "wire", _bench_wire)

    step = commands.add_parser(
        "step", help="training-step time, dense vs compressors, N ranks on emulated links"
    )
    shared = tuple(f"{name}-{mode}" for name in ("topk", "gaussiank", "regtopk") for mode in ("leader", "aggregate"))
    step.add_argument("--ranks", type=int, default=4, help="processes, one per network namespace (default 4)")
    _add_link(
        step,
        rates="emulated link rates",
        none="plain processes on localhost, no root needed (default emulated: ci/netns_cluster.sh, root)",
    )
    _add_delay(step)
    _add_ratio(step)
    step.add_argument("--steps", type=int, default=10, help="timed steps per compressor (median reported)")
    step.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    _add_width_scale(step)
    step.add_argument(
        "--compute-ms",
        type=float,
        default=50.0,
        help="fixed-duration forward+backward stand-in per step (ms)",
    )
    step.add_argument(
        "--compression",
        action="append",
        choices=Compression.names + shared + tuple(f"auto-{name}" for name in Compression.names + shared),
        help="repeatable; NAME-leader, NAME-aggregate: a sparsifier with that shared index set; auto-NAME: "
        "Auto(NAME), each bucket the fastest way, measured; default all and "
        "auto-regtopk (dense always)",
    )
    step.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bytes per fused bucket (MB)")
    step.add_argument("--seed", type=int, default=0)
    _add_out(step, "step", _bench_step)

    traffic = commands.add_parser(
        "traffic", help="bytes per rank sent and received as N grows: dense, allgather and shared index sets"
    )
    traffic.add_argument("--model", choices=("resnet50", "gpt2"), default="resnet50", help="parameter shapes")
    traffic.add_argument("--compressor", choices=("topk", "gaussiank", "regtopk"), default="topk")
    _add_ratio(traffic)
    traffic.add_argument("--ranks", type=_ints, default=[2, 4, 8, 16, 64, 256, 1024], help="world sizes")
    traffic.add_argument("--counted", type=_ints, default=[],
                         help="also count a Simulator's bytes at these N (a small model), e.g. 16,64,256")
    traffic.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_out(traffic, "traffic", _bench_traffic)

    scaling = commands.add_parser(
        "scaling", help="communication time vs N and bandwidth: model and measured points"
    )
    scaling.add_argument(
        "--ranks", type=_ints, default=[2, 4, 8], help="measured world sizes (default 2,4,8)"
    )
    _add_link(scaling, rates="link rates", none="measure on localhost, no root needed")
    scaling.add_argument(
        "--measure",
        choices=("collectives", "none"),
        default="collectives",
        help="none: the model alone, alpha = --delay (default: run the collectives)",
    )
    _add_ratio(scaling)
    scaling.add_argument(
        "--scale", type=float, default=1.0, help="gradient size as ResNet-18 with widths x SCALE (1 = 11.7M)"
    )
    scaling.add_argument("--repeats", type=int, default=5, help="timed runs per collective (median reported)")
    _add_delay(scaling)
    scaling.add_argument("--max-ranks", type=int, default=512, help="model curves up to this N (default 512)")
    scaling.add_argument("--seed", type=int, default=0)
    _add_out(scaling, "scaling", _bench_scaling)
    _add_train_step(commands)

    from benchmarks import tf_step, tf_xla  # import neither TensorFlow nor Horovod until they run

    tf_step.add_command(commands, _add_out, _wrote)
    tf_xla.add_command(commands, _add_out, _wrote)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    return run_command(build_parser(), argv)
