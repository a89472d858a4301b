"""``python -m benchmarks time-to-accuracy``: 2 processes on localhost, a few steps on a few hundred images."""

import io
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
    assert list(rows) == ["none", "regtopk", "auto-regtopk"]  # the default --runs dense,compressor,auto
    assert [r["configuration"] for r in rows.values()] == ["dense", "compressor", "auto"]
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


def test_fp16_aggregate_and_traffic_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_fashion(tmp_path / "fm", train=160, test=40)
    argv = ["time-to-accuracy", "--link", "none", "--ranks", "2", "--data-dir", str(tmp_path / "fm"),
            "--train-size", "128", "--test-size", "40", "--epochs", "2", "--batch-size", "16", "--warmup-epochs", "1",
            "--evals-per-epoch", "1", "--runs", "dense,fp16,aggregate,traffic", "--no-progress",
            "--out", str(tmp_path), "--name", "tta"]
    assert main(argv) == 0
    assert (tmp_path / "tta.png").stat().st_size > 0
    results = json.loads((tmp_path / "tta.json").read_text())
    rows = {r["configuration"]: r for r in results["rows"]}
    assert [r["run"] for r in rows.values()] == ["none", "fp16", "topk-aggregate", "traffic"]
    labels = ["dense", "fp16", "top-k 8% +mc +warm-up [aggregate]", "traffic 0.04 (aggregate 4% +mc +warm-up from 10%)"]
    assert [r["label"] for r in rows.values()] == labels == results["settings"]["runs"]
    dense, fp16, aggregate, traffic = rows.values()
    assert all(r["parameters_agree"] and r["steps"] == 8 for r in rows.values())  # 4 steps per epoch
    # fp16: SGD's momentum as dense, half of dense's payload
    assert (fp16["optimizer_momentum"], fp16["compressor_momentum"]) == (0.9, 0.0)
    assert fp16["payload_bytes"] == pytest.approx(dense["payload_bytes"] / 2, rel=0.01)
    # the shared index set at 8% and the traffic budget of 4%, both with momentum correction and a 4-step warm-up
    for r, density in ((aggregate, 0.08), (traffic, 0.04)):
        assert (r["optimizer_momentum"], r["compressor_momentum"]) == (0.0, 0.9)
        assert (r["final_density"], r["indices"]) == (density, "aggregate")
        # after the warm-up: the density's share of the values (small tensors go dense), no index sent
        assert density < r["warm_payload_bytes"] / dense["warm_payload_bytes"] < 1.1 * density
        assert r["warm_payload_bytes"] < r["payload_bytes"] < dense["payload_bytes"] / 3
    goals = [(g["rate"], g["met"], g["compared"]) for g in results["goals"]]
    assert goals == [("1gbit", None, []), ("10gbit", None, [])]  # no such link ran
    out = capsys.readouterr().out
    assert all(label in out for label in labels)
    assert "goal at 1gbit: best of the runs other than dense (-) speedup >= 2: not run (open)" in out


def test_first_time_at_skips_the_initial_model():
    curve = {"seconds": [0.0, 1.5, 3.0, 4.5], "test_accuracy": [0.9, 0.7, 0.86, 0.95]}
    assert tta.first_time_at(curve, 0.85) == 3.0
    assert tta.first_time_at(curve, 0.96) is None


def test_goals_read_the_right_rows():
    rows = [{"rate": "1gbit", "run": "topk", "label": "top-k", "speedup": 2.5},
            {"rate": "10gbit", "run": "auto-topk", "label": "auto", "speedup": 0.95}]
    one, ten = tta.goals(rows)
    assert (one["value"], one["met"]) == (2.5, True)
    assert ten["value"] == pytest.approx(1 / 0.95) and ten["met"] is False


def test_goals_take_the_best_run_other_than_dense_and_runs_that_never_reach():
    rows = [{"rate": "1gbit", "run": "none", "label": "dense", "speedup": 1.0},
            {"rate": "1gbit", "run": "fp16", "label": "fp16", "speedup": 1.4},
            {"rate": "1gbit", "run": "topk-aggregate", "label": "aggregate", "speedup": 1.9},
            {"rate": "1gbit", "run": "traffic", "label": "traffic", "speedup": None},
            {"rate": "10gbit", "run": "none", "label": "dense", "speedup": 1.0},
            {"rate": "10gbit", "run": "traffic", "label": "traffic", "speedup": None}]
    one, ten = tta.goals(rows)
    assert (one["run"], one["value"], one["met"]) == ("aggregate", 1.9, False)
    assert one["compared"] == ["fp16", "aggregate", "traffic"]
    assert (ten["run"], ten["value"], ten["met"]) == (None, None, False)  # none reached the target
    assert [g["met"] for g in tta.goals(rows[:1])] == [None, None]  # dense alone: nothing to compare
    results = {"settings": {"model": "mlp", "data": "digits", "ranks": 2, "epochs": 1, "batch_per_rank": 8,
                            "target_gap_points": 0.5}, "rows": [], "goals": [one, ten]}
    printed = io.StringIO()
    tta.print_table(results, printed)
    text = printed.getvalue()
    assert "goal at 1gbit: best of the runs other than dense (aggregate) speedup >= 2: 1.90 (missed)" in text
    assert "goal at 10gbit: best of the runs other than dense (-) time ratio <= 1: never reached (missed)" in text


def test_bad_options_fail_before_any_process_starts(capsys):
    cases = {"terngrad": "must be a sparsifier", "fp8": "unknown ['fp8']"}
    for bad, message in [(["--compressor", name], text) for name, text in cases.items()] + [
            (["--ranks", "1"], "ranks must be at least 2")]:
        assert main(["time-to-accuracy", "--link", "none", *bad, "--out", ""]) == 2
        assert message in capsys.readouterr().err


def test_bad_run_names_are_parser_errors_that_list_the_valid_ones(capsys):
    for runs, message in (("dense,fp8", "unknown run 'fp8'; choose from dense, fp16, compressor, aggregate, "
                                        "traffic, auto"),
                          ("fp16,traffic", "the runs must include dense")):
        with pytest.raises(SystemExit) as raised:
            main(["time-to-accuracy", "--link", "none", "--runs", runs, "--out", ""])
        assert raised.value.code == 2
        assert f"argument --runs: {message}" in capsys.readouterr().err
    assert tta.check_runs(["dense", "auto", "dense"]) == ("dense", "auto")


def test_each_run_builds_its_compressor_through_the_convergence_run():
    from hvd_compress import FP16

    training = tta.Training(configurations=tta.RUNS)
    built = {c: tta.make_compressor(c, training) for c in training.runs()}
    assert isinstance(built["fp16"], FP16)
    assert (built["aggregate"].ratio, built["aggregate"].indices, built["aggregate"].momentum) == (0.08, "aggregate", 0.9)
    assert (built["traffic"].traffic, built["traffic"].momentum) == (0.04, 0.9)  # the README's budget in traffic
    assert training.spec("traffic").label == "top-k traffic 0.04 +mc +warm-up [auto]"
    assert built["auto"].inner.ratio == 0.01
    assert [training.warmup_from(c) for c in ("compressor", "aggregate", "traffic")] == [0.25, 0.25, 0.1]
    recommended = tta.Training(configurations=("dense", "traffic"), traffic=0.03, dense_below=2000)
    built = tta.make_compressor("traffic", recommended)  # the README's recommended setting
    assert (built.traffic, built.dense_below, built.momentum) == (0.03, 2000, 0.9)
    assert recommended.label("traffic") == "traffic 0.03 (aggregate 3% +mc +warm-up from 10%, dense below 2000)"
