"""The ``hvd-compress`` command: what a user runs on their own machines.

hvd-compress demo [--ranks 4] [--compression topk ...] [--ratio 0.01]
hvd-compress bench trace [--model resnet50] [--device cpu] [--warmup 3] [--compressors none,fp16,...]
                         [--ratio 0.01] [--routes ...] [--json FILE] [--plot FILE]

The training-step timing benchmark, the paper reproductions and the link
studies are in the repository's ``benchmarks/`` folder, run from a source
checkout: ``python -m benchmarks --help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, List, Optional, Sequence

from hvd_compress import Compression, __version__

#: ``hvd-compress bench`` subcommands now in the repository's ``benchmarks/`` (``python -m benchmarks``).
MOVED = ("train-step",)


def _demo(args: argparse.Namespace) -> int:
    from hvd_compress.bench import demo, single_threaded_blas

    names = args.compression or list(Compression.names)
    data = demo.Dataset.digits(seed=args.seed)
    print(
        f"Training a 64-256-10 perceptron on 8x8 handwritten digits, {args.ranks} simulated ranks, "
        f"{args.epochs} epochs, ratio {args.ratio} for the sparsifiers"
    )
    results, every = [], max(1, args.epochs // 4)  # about four progress lines per run
    for name in names:
        compressor = Compression.by_name(name, args.ratio)
        label = f"{name} {args.ratio:g}" if hasattr(compressor, "ratio") else name

        def report(epoch: int, loss: float, accuracy: float, label: str = label) -> None:
            if (epoch + 1) % every == 0 or epoch + 1 == args.epochs:
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


def _wrote(args: argparse.Namespace) -> int:
    """Name the files a benchmark wrote (``--json``, ``--plot``); the command's exit status."""
    for path in (args.json, args.plot):
        if path:
            print(f"Wrote {path}")
    return 0


def _moved(args: argparse.Namespace) -> int:
    """A subcommand that left the installed package: say where it went; exit status 2."""
    print(
        f"hvd-compress: 'bench {args.study}' moved to the repository's benchmarks: run "
        f"'python -m benchmarks {args.study} ...' (same options) from a source checkout of hvd_compress",
        file=sys.stderr,
    )
    return 2


def _bench_trace(args: argparse.Namespace) -> int:
    from hvd_compress.bench import trace_step

    print(
        f"One steady training step traced at world size 1: {args.model} on {args.device} (the accelerator's "
        f"code path), after {args.warmup} steps, {', '.join(args.compressors)} at ratio {args.ratio}"
    )
    trace_step.run(
        model=args.model,
        device=args.device,
        warmup=args.warmup,
        compressors=args.compressors,
        ratio=args.ratio,
        routes=args.routes,
        dropin_comm=args.dropin_comm,
        seed=args.seed,
        top=args.top,
        json_path=args.json or None,
        plot_path=args.plot or None,
    )
    return _wrote(args)


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


def _add_ratio(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ratio", type=float, default=0.01, help="density of the sparsifiers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvd-compress", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hvd_compress {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small model with every compressor on simulated ranks")
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--epochs", type=int, default=20)
    _add_ratio(demo)
    demo.add_argument(
        "--compression", action="append", choices=Compression.names, help="repeatable; default all"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", help="write the results to this file")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="what a route adds to a training step, against torch's routes")
    benchmarks = bench.add_subparsers(dest="study", required=True)
    for study in MOVED:  # every option is taken, so that the message says where the command went
        moved = benchmarks.add_parser(study, help=f"moved: python -m benchmarks {study}", prefix_chars="+")
        moved.add_argument("options", nargs="*")
        moved.set_defaults(run=_moved)
    _add_trace(benchmarks)
    return parser


def _add_trace(benchmarks: Any) -> None:
    from hvd_compress.bench import trace_step
    from hvd_compress.bench.routes import DROPIN_COMMS

    trace = benchmarks.add_parser(
        "trace",
        help="kernels, bytes and device waits of one steady step per route, the accelerator's code path "
        "traced on any device (the stand-in when no GPU is at hand)",
    )
    trace.add_argument(
        "--model", choices=trace_step.MODELS, default="resnet50", help="parameter shapes (mlp: train-step's)"
    )
    trace.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    trace.add_argument("--warmup", type=int, default=trace_step.DEFAULT_WARMUP, help="untraced steps first")
    trace.add_argument(
        "--compressors",
        type=_names(trace_step.COMPRESSORS + trace_step.SHARED),
        default=list(trace_step.COMPRESSORS),
        help=f"ours, per route (default {','.join(trace_step.COMPRESSORS)}; also <sparsifier>-leader, "
        "<sparsifier>-aggregate: with that shared index set; topk-reuse, regtopk-reuse: a step between exact "
        "selections, exact_every > 1)",
    )
    _add_ratio(trace)
    trace.add_argument(
        "--routes",
        type=_names(trace_step.ROUTES),
        default=list(trace_step.ROUTES),
        help=f"default all: {','.join(trace_step.ROUTES)} (local and ddp+handwritten-topk always run)",
    )
    trace.add_argument(
        "--dropin-comm",
        choices=DROPIN_COMMS,
        default="auto",
        help="transport of ours-dropin: auto = Horovod when it initialises, else torch.distributed",
    )
    trace.add_argument("--seed", type=int, default=0)
    trace.add_argument("--top", type=int, default=trace_step.TOP, help="operators listed per row in the JSON")
    trace.add_argument("--json", default="results/trace.json", help="results file (default %(default)s)")
    trace.add_argument(
        "--plot", default="results/trace.png", help="ratios to the hand-written hook (default %(default)s)"
    )
    trace.set_defaults(run=_bench_trace)


def run_command(parser: argparse.ArgumentParser, argv: Optional[List[str]]) -> int:
    """Parse ``argv`` and run the chosen command; bad options and missing packages are exit status 2."""
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, ImportError) as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2


def main(argv: Optional[List[str]] = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
