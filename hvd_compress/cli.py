"""The ``hvd-compress`` command.

hvd-compress demo [--ranks 4] [--compression topk ...] [--ratio 0.01]
hvd-compress simulate linreg [--steps 2500] [--lr 0.01] [--ratio 0.4] [--mu 4] [--mu-sweep 1,2,4,8] [--instances 1]
                             [--plot DIR]
hvd-compress simulate cnn [--ranks 4] [--epochs 5] [--ratios 0.01,0.001] [--lr 0.05] [--seed 0] [--plot DIR]
hvd-compress simulate gaussian [--ranks 4] [--epochs 5] [--ratio 0.01] [--layer fc1.weight] [--plot DIR]
hvd-compress simulate terngrad [--ranks 4] [--epochs 5] [--clip 2.5] [--plot DIR]
hvd-compress bench compress [--sizes 1M 11.7M 25M] [--ratio 0.01] [--repeats 5] [--device all] [--out results]
hvd-compress bench wire [--ranks 2,4,16] [--ratio 0.01] [--scale 1] [--out results]
hvd-compress bench step [--ranks 4] [--rates 1gbit,10gbit | --link none] [--ratio 0.01] [--steps 10] [--scale 1] [--out results]
hvd-compress bench scaling [--ranks 2,4,8] [--rates 1gbit,10gbit | --link none | --measure none] [--ratio 0.01] [--out results]
hvd-compress bench train-step [--model mlp] [--device cpu] [--steps 25] [--warmup 8] [--batch N]
                              [--compressors none,fp16,...] [--ratio 0.01] [--routes ...] [--json FILE] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, List, Optional, Sequence

from hvd_compress import Compression, __version__


def _demo(args: argparse.Namespace) -> int:
    from hvd_compress.bench import demo, single_threaded_blas

    names = args.compression or list(Compression.names)
    data = demo.Dataset.synthetic(seed=args.seed)
    print(
        f"Training a 64-256-10 perceptron on {args.ranks} simulated ranks, "
        f"{args.epochs} epochs, ratio {args.ratio} for the sparsifiers"
    )
    results = []
    for name in names:
        compressor = Compression.by_name(name, args.ratio)
        label = f"{name} {args.ratio:g}" if hasattr(compressor, "ratio") else name

        def report(epoch: int, loss: float, accuracy: float, label: str = label) -> None:
            print(f"  {label:<15} epoch {epoch + 1}/{args.epochs}  loss {loss:.4f}  test acc {accuracy:.3f}")

        with single_threaded_blas():
            results.append(
                demo.train(
                    label,
                    compressor,
                    data,
                    ranks=args.ranks,
                    epochs=args.epochs,
                    seed=args.seed,
                    on_epoch=report,
                )
            )
    print()
    print(
        f"{'compression':<15} {'loss':>7} {'test acc':>9} {'bytes/step/rank':>16} {'smaller than dense':>19}"
    )
    for r in results:
        print(
            f"{r.compression:<15} {r.losses[-1]:>7.4f} {r.accuracy:>9.3f} "
            f"{r.bytes_per_step:>16,d} {r.savings:>18.1f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=2)
    return 0


def _wrote(folder: Optional[str], stem: str) -> int:
    if folder:
        print(f"Wrote {folder}/{stem}.json and {folder}/{stem}.png")
    return 0


def _simulate_linreg(args: argparse.Namespace) -> int:
    from hvd_compress.bench import linreg

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
    from hvd_compress.bench.cnn import Training

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
    from hvd_compress.bench import cnn

    cnn.study(ratios=args.ratios, training=_training(args), out=args.plot)
    return _wrote(args.plot, "cnn")


def _simulate_gaussian(args: argparse.Namespace) -> int:
    from hvd_compress.bench import gaussian

    gaussian.study(
        ratio=args.ratio, layer=args.layer, snapshots=args.snapshots, training=_training(args), out=args.plot
    )
    return _wrote(args.plot, "gaussian")


def _simulate_terngrad(args: argparse.Namespace) -> int:
    from hvd_compress.bench import terngrad

    terngrad.study(clip=args.clip, layer=args.layer, training=_training(args), out=args.plot)
    return _wrote(args.plot, "terngrad")


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
    from hvd_compress.bench import compress

    args.sizes = [size for group in args.sizes for size in group]  # "--sizes 1M,25M 11.7M"
    print(
        f"Compression cost: one encode vs torch.topk and one memory pass; sizes "
        f"{', '.join(compress.format_size(s) for s in args.sizes)}, ratio {args.ratio}, "
        f"median of {args.repeats}, device {args.device}"
    )
    compress.run(sizes=args.sizes, ratio=args.ratio, repeats=args.repeats, device=args.device, out=args.out)
    return _wrote(args.out, "compress")


def _bench_wire(args: argparse.Namespace) -> int:
    from hvd_compress.bench import wire

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
    from hvd_compress.bench.cluster import parse_rate

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
        print(f"hvd-compress: {error}", file=sys.stderr)
        return 1
    return _wrote(out, stem)


def _bench_step(args: argparse.Namespace) -> int:
    from hvd_compress.bench import step

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


def _bench_scaling(args: argparse.Namespace) -> int:
    from hvd_compress.bench import scaling

    measure = args.measure != "none"
    print(
        f"Communication scaling: dense allreduce vs sparse allgather vs TernGrad, ratio {args.ratio}; "
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


def _bench_train_step(args: argparse.Namespace) -> int:
    from hvd_compress.bench import train_step

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
    )
    for path in (args.json, args.plot):
        if path:
            print(f"Wrote {path}")
    return 0


def _names(choices: Sequence[str]) -> Callable[[str], List[str]]:
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


def _size(text: str) -> List[int]:
    from hvd_compress.bench.compress import parse_size

    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _add_ratio(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")


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


def _add_delay(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--delay", default="0.1ms", help="one-way link delay where netem exists (default 0.1ms)"
    )


def _add_out(parser: argparse.ArgumentParser, stem: str, run: Callable[[argparse.Namespace], int]) -> None:
    """``--out`` for ``<stem>.json`` and ``<stem>.png``, and the handler ``run``."""
    parser.add_argument("--out", default="results", help=f"folder for {stem}.json and {stem}.png")
    parser.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvd-compress", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hvd_compress {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model with every compressor on simulated ranks")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--epochs", type=int, default=5)
    _add_ratio(demo)
    demo.add_argument(
        "--compression", action="append", choices=Compression.names, help="repeatable; default all"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", help="write the results to this file")
    demo.set_defaults(run=_demo)

    simulate = commands.add_parser("simulate", help="convergence studies on the in-process simulator")
    studies = simulate.add_subparsers(dest="study", required=True)
    linreg = studies.add_parser("linreg", help="RegTop-k paper's distributed linear regression")
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
    cnn = studies.add_parser("cnn", help="small CNN: dense, Top-k, Gaussian-k, RegTop-k per ratio, TernGrad")
    _add_cnn_options(cnn, "cnn")
    cnn.add_argument("--ratios", type=_floats, default=[0.01, 0.001], help="densities (0.01,0.001)")
    cnn.set_defaults(run=_simulate_cnn)
    gauss = studies.add_parser("gaussian", help="Gaussian-k: histogram of g + r vs its Gaussian, |S| vs k")
    _add_cnn_options(gauss, "gaussian")
    gauss.add_argument("--ratio", type=float, default=0.01, help="Gaussian-k density (default 0.01)")
    gauss.add_argument("--layer", default="fc1.weight", help="layer of the histograms (default fc1.weight)")
    gauss.add_argument("--snapshots", type=int, default=4, help="iterations with a histogram (default 4)")
    gauss.set_defaults(run=_simulate_gaussian)
    tern = studies.add_parser("terngrad", help="TernGrad with/without clipping and scalar sharing")
    _add_cnn_options(tern, "terngrad")
    tern.add_argument("--clip", type=float, default=2.5, help="clipping factor c of the clipped runs (2.5)")
    tern.add_argument("--layer", default="fc1.weight", help="layer whose scale is reported (fc1.weight)")
    tern.set_defaults(run=_simulate_terngrad)

    bench = commands.add_parser("bench", help="benchmarks; ratios against baselines measured in the same run")
    benchmarks = bench.add_subparsers(dest="study", required=True)
    compress = benchmarks.add_parser("compress", help="encode time vs torch.topk and one memory pass")
    compress.add_argument(
        "--sizes",
        type=_size,
        nargs="+",
        default=[[1_000_000, 11_700_000, 25_000_000]],
        help="gradient sizes in elements: 1M 11.7M 25M, 10000 or 1M,25M (default 1M 11.7M 25M)",
    )
    _add_ratio(compress)
    compress.add_argument("--repeats", type=int, default=5, help="timed encodes per measurement (median)")
    compress.add_argument(
        "--device", choices=("cpu", "cuda", "all"), default="all", help="all: cpu, and cuda when available"
    )
    _add_out(compress, "compress", _bench_compress)

    wire = benchmarks.add_parser("wire", help="bytes per rank per step vs dense fp32, ResNet-18 shapes")
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

    step = benchmarks.add_parser(
        "step", help="training-step time, dense vs compressors, N ranks on emulated links"
    )
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
        choices=Compression.names + tuple(f"auto-{name}" for name in Compression.names),
        help="repeatable; auto-NAME: Auto(NAME), each bucket the cheaper way, measured; default all and "
        "auto-regtopk (dense always)",
    )
    step.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bytes per fused bucket (MB)")
    step.add_argument("--seed", type=int, default=0)
    _add_out(step, "step", _bench_step)

    scaling = benchmarks.add_parser(
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

    from hvd_compress.bench.train_step import COMPRESSORS, DROPIN_COMMS, MODELS, ROUTES

    train = benchmarks.add_parser(
        "train-step", help="full training-step time per route (DDP, hooks, ours) at world size 1, CPU or GPU"
    )
    train.add_argument("--model", choices=MODELS, default="mlp", help="resnet50 and gpt2 need [bench-gpu]")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    train.add_argument("--steps", type=int, default=25, help="timed steps per row (median and min reported)")
    train.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    train.add_argument("--batch", type=int, help="default: resnet50 64, gpt2 8, mlp 32")
    train.add_argument(
        "--compressors",
        type=_names(COMPRESSORS),
        default=list(COMPRESSORS),
        help=f"ours, per route (default {','.join(COMPRESSORS)})",
    )
    _add_ratio(train)
    train.add_argument(
        "--routes",
        type=_names(ROUTES),
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
    train.add_argument("--json", default="results/train_step.json", help="results file (default %(default)s)")
    train.add_argument(
        "--plot", default="results/train_step.png", help="bar chart of the ratios (default %(default)s)"
    )
    train.set_defaults(run=_bench_train_step)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, ImportError) as error:  # bad options, missing optional packages
        print(f"hvd-compress: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
