"""The ``hvd-compress`` command line (hvd_compress.cli.main) and ``python -m benchmarks``."""

import json

from benchmarks.cli import main as benchmarks_main
from hvd_compress.cli import main


def test_demo_prints_the_table(capsys):
    assert main(["demo", "--epochs", "1", "--compression", "topk", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "bytes/step/rank" in line)
    rows = out.splitlines()[out.splitlines().index(header) + 1 :]
    assert any(line.startswith("topk") for line in rows), out
    assert "epoch 1/1" in out


def test_demo_writes_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--epochs", "1", "--compression", "fp16", "--ranks", "2", "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())
    assert len(result["losses"]) == 1
    # float16 halves the bytes of float32 gradients
    assert result["dense_bytes_per_step"] == 2 * result["bytes_per_step"]


def test_a_moved_subcommand_says_where_it_went(capsys):
    for study, argv in [("train-step", ["bench", "train-step"]),
                        ("train-step", ["bench", "train-step", "--model", "mlp", "--steps", "2", "--help"]),
                        ("trace", ["bench", "trace", "--model", "resnet50", "--json", "x.json"])]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"'bench {study}' moved" in err and f"'python -m benchmarks {study} ...'" in err, err


def test_simulate_linreg(capsys):
    assert benchmarks_main(["linreg", "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert "top-k" in out and "regtop-k" in out


def test_bad_ratio_returns_2_with_a_message(capsys):
    assert main(["demo", "--epochs", "1", "--compression", "topk", "--ratio", "0"]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err
    assert benchmarks_main(["linreg", "--steps", "5", "--ratio", "1.5"]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err


def test_python_m_benchmarks_lists_the_studies():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    studies = ("linreg", "cnn", "gaussian", "terngrad", "convergence", "compress", "wire", "step", "scaling")
    for study in studies + ("train-step", "trace", "select"):
        assert study in done.stdout


def test_every_subcommand_renders_its_help():
    """``--help`` of every subcommand of both command lines prints and exits 0 (a ``%`` in a help string
    that argparse cannot format fails only here)."""
    import argparse

    from benchmarks.cli import build_parser as benchmarks_parser
    from hvd_compress.cli import build_parser

    for parser in (build_parser(), benchmarks_parser()):
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        names = [(name, sub) for action in subparsers for name, sub in action.choices.items()]
        assert names, parser.prog
        for name, sub in names:
            for nested in [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]:
                names += [(f"{name} {n}", s) for n, s in nested.choices.items()]
            assert sub.format_help(), name
