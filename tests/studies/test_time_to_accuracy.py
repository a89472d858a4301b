"""``python -m benchmarks time-to-accuracy``: 2 processes on localhost, a few steps on a few hundred images."""

import json

import pytest

pytest.importorskip("torch")

from benchmarks import time_to_accuracy as tta  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from tests.studies.test_datasets import write_fashion  # noqa: E402


def test_localhost_run_writes_curves_and_times(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_fashion(tmp_path / "fm", train=160, test=40)
    argv = ["time-to-accuracy", "--link", "none", "--ranks", "2", "--data-dir", str(tmp_path / "fm"),
            "--train-size", "128", "--test-size", "40", "--epochs", "3", "--batch-size", "16", "--warmup-epochs", "1",
            "--evals-per-epoch", "2", "--compressor", "regtopk", "--out", str(tmp_path), "--name", "tta"]
    assert main(argv) == 0
    assert (tmp_path / "tta.png").stat().st_size > 0
    results = json.loads((tmp_path / "tta.json").read_text())
    rows = {r["run"]: r for r in results["rows"]}
    assert list(rows) == ["none", "regtopk", "auto-regtopk"]
    assert [r["label"] for r in rows.values()] == ["dense", "regtop-k 1% +mc +warm-up", "auto(regtop-k 1% +mc +warm-up)"]
    dense = rows["none"]
    # momentum correction: the compressor owns the momentum, the optimizer has none; dense keeps SGD's
    assert (dense["optimizer_momentum"], dense["compressor_momentum"]) == (0.9, 0.0)
    for name in ("regtopk", "auto-regtopk"):
        assert (rows[name]["optimizer_momentum"], rows[name]["compressor_momentum"]) == (0.0, 0.9)
        assert rows[name]["final_density"] == 0.01  # the warm-up ended at the target
    for r in rows.values():
        curve = r["curve"]
        assert r["steps"] == 12 and curve["step"] == [0, 2, 4, 6, 8, 10, 12]  # 4 steps per epoch, 2 evaluations each
        assert curve["seconds"][0] == 0 and all(a < b for a, b in zip(curve["seconds"], curve["seconds"][1:]))
        assert r["train_seconds"] == curve["seconds"][-1] and r["final_accuracy"] == curve["test_accuracy"][-1]
        assert r["parameters_agree"]  # every rank decoded the same average
        assert r["target_accuracy"] == pytest.approx(dense["final_accuracy"] - 0.005)
        assert r["time_to_target"] == tta.first_time_at(curve, r["target_accuracy"])
        if r["time_to_target"] is not None:
            assert r["speedup"] == pytest.approx(dense["time_to_target"] / r["time_to_target"])
    assert dense["time_to_target"] is not None and dense["speedup"] == 1.0
    assert rows["regtopk"]["payload_bytes"] < dense["payload_bytes"]
    # Auto measured again once the 4-step ramp reached 1% (1 untimed + 3 timed exchanges): without it, 4
    assert [d["decided_at"] for d in rows["auto-regtopk"]["decisions"].values()] == [8]
    assert [g["rate"] for g in results["goals"]] == ["1gbit", "10gbit"]
    assert all(g["value"] is None and g["met"] is None for g in results["goals"])  # no such link ran
    captured = capsys.readouterr()
    assert "time-to-accuracy [localhost] dense: step 12/12" in captured.err
    assert "regtop-k 1% +mc +warm-up" in captured.out


def test_first_time_at_skips_the_initial_model():
    curve = {"seconds": [0.0, 1.5, 3.0, 4.5], "test_accuracy": [0.9, 0.7, 0.86, 0.95]}
    assert tta.first_time_at(curve, 0.85) == 3.0
    assert tta.first_time_at(curve, 0.96) is None


def test_goals_read_the_right_rows():
    training = tta.Training(compressor="topk")
    rows = [{"rate": "1gbit", "run": "topk", "label": "top-k", "speedup": 2.5},
            {"rate": "10gbit", "run": "auto-topk", "label": "auto", "speedup": 0.95}]
    one, ten = tta.goals(rows, training)
    assert (one["value"], one["met"]) == (2.5, True)
    assert ten["value"] == pytest.approx(1 / 0.95) and ten["met"] is False


def test_bad_options_fail_before_any_process_starts(capsys):
    cases = {"terngrad": "must be a sparsifier", "fp8": "unknown ['fp8']"}
    for bad, message in [(["--compressor", name], text) for name, text in cases.items()] + [
            (["--ranks", "1"], "ranks must be at least 2")]:
        assert main(["time-to-accuracy", "--link", "none", *bad, "--out", ""]) == 2
        assert message in capsys.readouterr().err
