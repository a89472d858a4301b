"""The ``hvd-compress`` command line (hvd_compress.cli.main)."""

import json

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


def test_simulate_linreg(capsys):
    assert main(["simulate", "linreg", "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert "top-k" in out and "regtop-k" in out


def test_bad_ratio_returns_2_with_a_message(capsys):
    assert main(["demo", "--epochs", "1", "--compression", "topk", "--ratio", "0"]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err
    assert main(["simulate", "linreg", "--steps", "5", "--ratio", "1.5"]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err
