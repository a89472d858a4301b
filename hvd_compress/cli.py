"""The ``hvd-compress`` command: what a user runs on their own machines.

hvd-compress demo [--ranks 4] [--compression topk ...] [--ratio 0.01]

The training-step timing and trace benchmarks, the paper reproductions and the
link studies are in the repository's ``benchmarks/`` folder, run from a source
checkout: ``python -m benchmarks --help`` (``hvd-compress bench <name>`` says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from hvd_compress import Compression, __version__

#: ``hvd-compress bench`` subcommands now in the repository's ``benchmarks/`` (``python -m benchmarks``).
MOVED = ("train-step", "trace")


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
    return parser


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
