"""``python -m benchmarks convergence``: the fp16 and PowerSGD rows, the frontier figure and ``--merge`` (tiny
digits runs, a few steps)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import convergence  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from benchmarks.powersgd import PowerSGD, traffic_vs_dense  # noqa: E402

#: digits, 128 training images, global batch 16 on 4 ranks: 8 steps per epoch, 2 epochs, a warm-up of 4 steps
TINY = ["convergence", "--data", "digits", "--train-size", "128", "--test-size", "64", "--epochs", "2",
        "--warmup-epochs", "0.5", "--models", "mlp", "--ranks", "4", "--global-batch", "16", "--no-progress"]


def run(tmp_path, name, *argv):
    assert main([*TINY, *argv, "--out", str(tmp_path), "--name", name]) == 0
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_fp16_and_powersgd_rows(tmp_path):
    pytest.importorskip("matplotlib")
    results = run(tmp_path, "f", "--compressors", "powersgd,fp16,none", "--powersgd-ranks", "1,4", "--seeds", "0",
                  "--figure", "frontier")
    assert (tmp_path / "f.png").stat().st_size > 0
    rows = {r["label"]: r for r in results["rows"]}
    assert list(rows) == ["dense", "fp16", "powersgd rank 1", "powersgd rank 4"]
    steps, dense = results["settings"]["steps"], rows["dense"]
    assert steps == 16
    # fp16: half the bytes, the same layout header (two int64) at the first step
    assert rows["fp16"]["bytes_per_step"] == pytest.approx(dense["dense_bytes_per_step"] / 2 + 16 / steps)
    protocol = results["settings"]["powersgd"]
    assert protocol["start_powerSGD_iter"] == 4 and protocol["ranks"] == [1, 4]  # the warm-up's 4 steps
    shapes = {name: p.shape for name, p in convergence.make_model("mlp", (1, 8, 8)).named_parameters()}
    for rank in (1, 4):
        row = rows[f"powersgd rank {rank}"]
        assert row["powersgd_rank"] == rank and row["density"] is None and "gap_points" in row
        want = traffic_vs_dense(PowerSGD(rank, start_iter=4), shapes, steps)
        assert row["traffic_vs_dense"] == pytest.approx(want, rel=1e-12)
        assert row["bytes_vs_dense"] == pytest.approx(want)
        assert [layer["sent"] for layer in row["layers"]] == ["low-rank", "dense"] * 3  # biases dense
        assert row["seeds"][0]["compressor_momentum"] == 0.0 and row["seeds"][0]["optimizer_momentum"] == 0.9
    assert rows["powersgd rank 1"]["traffic_vs_dense"] < rows["powersgd rank 4"]["traffic_vs_dense"] < 0.5


def test_powersgd_start_and_plan():
    class Data:
        train_y = np.zeros(1000)

    setup = convergence.Setup(ranks=4, batch_per_rank=25, warmup_epochs=0.5)  # 10 steps per epoch
    assert setup.powersgd_start_iter(Data) == 5
    assert convergence.Setup(powersgd_start=30).powersgd_start_iter(Data) == 30
    assert convergence.Setup(powersgd_start=0).powersgd_start_iter(Data) == 2  # torch's minimum
    runs = convergence.plan(["mlp"], ["terngrad", "powersgd", "topk", "fp16", "none"], [0.01], ["plain"],
                            powersgd_ranks=[2, 1, 2])
    assert [r.label for r in runs] == ["dense", "fp16", "top-k 1%", "powersgd rank 2", "powersgd rank 1", "terngrad"]
    assert "fp16" not in convergence.DEFAULT_COMPRESSORS and "powersgd" not in convergence.DEFAULT_COMPRESSORS
    given = convergence.plan(["mlp"], ["powersgd"], [0.01], powersgd_ranks=[4], powersgd_start=10)
    assert [r.label for r in given] == ["powersgd rank 4 from step 10"] and given[0].start == 10


def test_merge(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    sparse = run(tmp_path, "sparse", "--compressors", "topk", "--ratios", "0.01", "--variants", "plain",
                 "--seeds", "0,1")
    dense = run(tmp_path, "dense", "--compressors", "none,fp16", "--seeds", "0,1")
    assert "gap_points" not in sparse["rows"][0]  # no dense in its study
    argv = ["convergence", "--merge", f"{tmp_path}/sparse.json,{tmp_path}/dense.json", "--figure", "frontier",
            "--out", str(tmp_path), "--name", "merged"]
    assert main(argv) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert (tmp_path / "merged.png").stat().st_size > 0
    assert [r["label"] for r in merged["rows"]] == ["dense", "top-k 1%", "fp16"]  # dense first
    base, topk = merged["rows"][0]["final_accuracy"], merged["rows"][1]
    assert topk["gap_points"] == pytest.approx(100 * (topk["final_accuracy"]["mean"] - base["mean"]))
    assert topk["seeds"] == sparse["rows"][0]["seeds"]
    assert [p["rows"] for p in merged["settings"]["parts"]] == [["top-k 1%"], ["dense", "fp16"]]
    assert merged["wall_seconds"] == pytest.approx(sparse["wall_seconds"] + dense["wall_seconds"])
    assert "top-k 1%" in capsys.readouterr().out
    other = run(tmp_path, "other", "--compressors", "none", "--seeds", "0,1", "--lr", "0.1")
    with pytest.raises(ValueError, match="differ in lr"):
        convergence.merge([dense, other])
    # parts whose PowerSGD runs differ keep each one's protocol
    for part, start in ((sparse, 4), (dense, 10)):
        part["settings"]["powersgd"] = {"start_powerSGD_iter": start}
    both = convergence.merge([sparse, dense])["settings"]
    assert both["powersgd"] == [{"start_powerSGD_iter": 4}, {"start_powerSGD_iter": 10}]
    assert convergence.powersgd_starts(both) == "4 / 10"
    dense["settings"]["powersgd"] = {"start_powerSGD_iter": 4}
    assert convergence.merge([sparse, dense])["settings"]["powersgd"] == {"start_powerSGD_iter": 4}
    # a merged study merged again: its list stays one flat list, and the figure's title reads it
    merged["settings"]["powersgd"] = [{"start_powerSGD_iter": 10, "ranks": [4]}, {"start_powerSGD_iter": 10, "ranks": [2]}]
    other_rank = {**sparse, "settings": {**sparse["settings"], "powersgd": {"start_powerSGD_iter": 10, "ranks": [1]}}}
    again = convergence.merge([merged, other_rank])["settings"]
    assert again["powersgd"] == [{"start_powerSGD_iter": 10, "ranks": [r]} for r in (4, 2, 1)]
    assert convergence.powersgd_starts(again) == "10"
    convergence.write_frontier(convergence.merge([convergence.merge([merged, other_rank]), dense]), tmp_path / "f.png")


def test_merge_asks_for_one_warm_up_only_of_the_parts_that_run_one(tmp_path):
    """A part of dense and fp16 rows merges with one whose sparsifier warms up from elsewhere (its warm-up
    settings are the merge's); two parts whose warm-ups differ, or PowerSGD starting at the warm-up's end
    beside a warm-up of another length, do not."""
    warm = run(tmp_path, "warm", "--compressors", "topk", "--ratios", "0.01", "--variants", "mc+warmup",
               "--warmup-start", "0.1", "--seeds", "0")
    dense = run(tmp_path, "dense", "--compressors", "none,fp16", "--seeds", "0")
    assert dense["settings"]["warmup_start"] == 0.25 and not convergence.uses_warmup(dense)
    merged = convergence.merge([dense, warm])
    assert merged["settings"]["warmup_start"] == 0.1 and [r["label"] for r in merged["rows"]] == [
        "dense", "fp16", "top-k 1% +mc +warm-up"]
    other = json.loads(json.dumps(warm))
    other["settings"]["warmup_start"] = 0.25
    with pytest.raises(ValueError, match="differ in warmup_start"):
        convergence.merge([dense, warm, other])
    psgd = json.loads(json.dumps(dense))
    psgd["rows"][1]["compressor"] = "powersgd"  # PowerSGD from the warm-up's end (no --powersgd-start)
    with pytest.raises(ValueError, match="differ in warmup_start"):
        convergence.merge([warm, psgd])
    psgd["settings"]["powersgd_start"] = 10
    assert convergence.merge([warm, psgd])["settings"]["warmup_start"] == 0.1
