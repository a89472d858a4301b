"""``python -m benchmarks convergence``: dense vs compressors on real data, tiny sizes (a few steps)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import convergence  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from benchmarks.datasets import load  # noqa: E402
from tests.studies.test_datasets import write_fashion  # noqa: E402

#: 128 training images, 4 ranks x 16: 2 steps per epoch, 2 epochs.
TINY = ["--quick", "--train-size", "128", "--test-size", "64", "--no-progress"]


def test_fashion_mnist_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_fashion(tmp_path / "fm", train=200, test=80)
    argv = ["convergence", "--data", "fashion-mnist", "--data-dir", str(tmp_path / "fm"), *TINY, "--models", "mlp",
            "--compressors", "none,topk,terngrad", "--ratios", "0.01", "--variants", "plain,warmup,mc+warmup",
            "--seeds", "0,1", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "convergence_fashion-mnist.png").stat().st_size > 0
    results = json.loads((tmp_path / "convergence_fashion-mnist.json").read_text())
    s = results["settings"]
    assert s["data"]["image_shape"] == [1, 28, 28] and s["data"]["train_images"] == 128
    assert s["steps_per_epoch"] == 2 and s["epochs"] == 2 and s["seeds"] == [0, 1]
    assert s["variants"] == ["plain", "warmup", "mc+warmup"] and s["momentum"] == 0.9
    rows = {(r["model"], r["label"]): r for r in results["rows"]}
    labels = ["dense", "top-k 1%", "top-k 1% +warm-up", "top-k 1% +mc +warm-up", "terngrad"]
    assert list(rows) == [("mlp", label) for label in labels]
    for r in rows.values():
        assert len(r["seeds"]) == 2 and all(len(seed["test_accuracy"]) == 3 for seed in r["seeds"])
        finals = [seed["test_accuracy"][-1] for seed in r["seeds"]]
        assert r["final_accuracy"]["mean"] == pytest.approx(sum(finals) / 2)
        assert r["final_accuracy"]["min"] == min(finals) and r["curve_min"][-1] == min(finals)
    for model in ("mlp",):
        dense, topk, warm = rows[(model, "dense")], rows[(model, "top-k 1%")], rows[(model, "top-k 1% +warm-up")]
        assert "gap_points" not in dense  # dense fp32, and the layout check's header (two int64) at the first of 4 steps
        assert dense["bytes_per_step"] == dense["dense_bytes_per_step"] + 16 / 4
        assert topk["gap_points"] == pytest.approx(
            100 * (topk["final_accuracy"]["mean"] - dense["final_accuracy"]["mean"]))
        assert topk["bytes_vs_dense"] < 0.05 < warm["bytes_vs_dense"]  # the warm-up starts at 25%
        assert [s["warmup_densities"] for s in warm["seeds"]] == [[0.25, 0.01]] * 2  # 2 ramp steps, then 1%
        assert topk["seeds"][0]["warmup_densities"] is None
    out = capsys.readouterr().out
    assert "top-k 1% +mc +warm-up" in out and "convergence_fashion-mnist.png" in out


def fixed_global_batch(tmp_path, ranks):
    """The JSON of a digits run at ``ranks`` with ``--global-batch 16``: 128 images, 8 steps per epoch, 2 epochs."""
    argv = ["convergence", "--data", "digits", "--train-size", "128", "--test-size", "64", "--epochs", "2",
            "--warmup-epochs", "1", "--models", "mlp", "--compressors", "none,topk", "--ratios", "0.01",
            "--variants", "warmup", "--seeds", "0", "--ranks", str(ranks), "--global-batch", "16", "--no-progress",
            "--out", str(tmp_path), "--name", f"ranks{ranks}"]
    assert main(argv) == 0
    return json.loads((tmp_path / f"ranks{ranks}.json").read_text())


def test_fixed_global_batch_is_the_same_run_at_every_n(tmp_path, capsys):
    """``--global-batch 16`` at N = 2 and 4: 8 and 4 images per rank, the same steps and warm-up steps,
    recorded in the JSON; dense is the same run at both N (the same test accuracy, test losses equal to
    float rounding of the average). The per-rank batch instead changes the steps with N, and a global
    batch that N does not divide is an error."""
    pytest.importorskip("sklearn")
    found = {ranks: fixed_global_batch(tmp_path, ranks) for ranks in (2, 4)}
    for ranks, results in found.items():
        s = results["settings"]
        assert (s["protocol"], s["global_batch"], s["images_per_step"]) == ("fixed global batch", 16, 16)
        assert (s["batch_per_rank"], s["steps_per_epoch"], s["steps"], s["warmup_steps"]) == (16 // ranks, 8, 16, 8)
        assert [seed["steps"] for r in results["rows"] for seed in r["seeds"]] == [16, 16]
        assert results["rows"][1]["seeds"][0]["warmup_densities"] == [0.25, 0.01]
    dense = [found[ranks]["rows"][0]["seeds"][0] for ranks in (2, 4)]
    assert dense[0]["test_accuracy"] == dense[1]["test_accuracy"]
    np.testing.assert_allclose(dense[0]["test_loss"], dense[1]["test_loss"], rtol=1e-4)
    assert dense[0]["test_loss"] != found[2]["rows"][1]["seeds"][0]["test_loss"]  # Top-k is another run
    data = load("digits", 128, 64)
    per_rank = [convergence.Setup(ranks=ranks, epochs=2, batch_per_rank=4).described(data) for ranks in (2, 4)]
    assert [(d["protocol"], d["images_per_step"], d["steps"], d["warmup_steps"]) for d in per_rank] == [
        ("fixed per-rank batch", 8, 32, 16), ("fixed per-rank batch", 16, 16, 8)]
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks"):
        convergence.Setup(ranks=3, global_batch=16)
    bad = ["convergence", "--data", "digits", "--quick", "--ranks", "3", "--global-batch", "16", "--out", ""]
    assert main(bad) == 2
    assert "does not split evenly over 3 ranks" in capsys.readouterr().err


def test_momentum_correction_moves_the_momentum_into_the_compressor(tmp_path):
    """With mc the compressor owns the momentum and SGD has none; every other run is SGD with momentum.
    The variants' rows say which they are, and mc+warmup ramps the density like the warm-up alone."""
    pytest.importorskip("sklearn")
    results = convergence.study(
        load("digits", 128, 64), convergence.Setup(epochs=2, batch_per_rank=16, momentum=0.8),
        models=["mlp"], compressors=["none", "regtopk", "terngrad"], ratios=[0.01],
        variants=["plain", "mc", "mc+warmup"], seeds=[0, 1], progress=False, plot=False, out=str(tmp_path),
        name="mc",
    )
    saved = json.loads((tmp_path / "mc.json").read_text())
    assert saved["settings"]["variants"] == ["plain", "mc", "mc+warmup"] == results["settings"]["variants"]
    rows = {r["label"]: r for r in saved["rows"]}
    assert list(rows) == ["dense", "regtop-k 1%", "regtop-k 1% +mc", "regtop-k 1% +mc +warm-up", "terngrad"]
    expected = {  # label: variant, momentum correction, warm-up, the optimizer's and the compressor's momentum
        "dense": (None, False, False, 0.8, 0.0), "regtop-k 1%": ("plain", False, False, 0.8, 0.0),
        "regtop-k 1% +mc": ("mc", True, False, 0.0, 0.8),
        "regtop-k 1% +mc +warm-up": ("mc+warmup", True, True, 0.0, 0.8), "terngrad": (None, False, False, 0.8, 0.0),
    }
    for label, (variant, mc, warmup, optimizer, compressor) in expected.items():
        r = rows[label]
        assert (r["variant"], r["momentum_correction"], r["warmup"]) == (variant, mc, warmup)
        momenta = [(seed["optimizer_momentum"], seed["compressor_momentum"]) for seed in r["seeds"]]
        assert momenta == [(optimizer, compressor)] * 2
        assert (r["optimizer_momentum"], r["compressor_momentum"]) == (optimizer, compressor)
        assert [seed["warmup_densities"] is not None for seed in r["seeds"]] == [warmup] * 2
    plain, mc, mc_warm = rows["regtop-k 1%"], rows["regtop-k 1% +mc"], rows["regtop-k 1% +mc +warm-up"]
    assert plain["bytes_per_step"] == mc["bytes_per_step"] < mc_warm["bytes_per_step"]  # the ramp sends more
    assert plain["seeds"][0]["test_loss"] != mc["seeds"][0]["test_loss"]  # the same selection size, other values


def test_progress_lines_and_a_missing_data_set(tmp_path, capsys):
    write_fashion(tmp_path / "fm", train=80, test=20)
    argv = ["convergence", "--data", "fashion-mnist", "--data-dir", str(tmp_path / "fm"), "--quick",
            "--train-size", "64", "--models", "mlp", "--compressors", "none", "--seeds", "3", "--out", ""]
    assert main(argv) == 0
    assert "convergence [1/1] mlp dense seed 3: test accuracy" in capsys.readouterr().err
    bad_variant = ["convergence", "--data", "fashion-mnist", "--data-dir", str(tmp_path / "fm"), "--quick",
                   "--train-size", "64", "--variants", "plain,dgc", "--out", ""]
    assert main(bad_variant) == 2
    assert "unknown ['dgc']" in capsys.readouterr().err
    missing = ["convergence", "--data", "fashion-mnist", "--data-dir", str(tmp_path / "none"), "--quick"]
    assert main(missing) == 2
    assert "ci/install_fashion_mnist.sh" in capsys.readouterr().err


@pytest.mark.parametrize(
    "shape, size", [((1, 8, 8), 71_754), ((1, 28, 28), 206_922)], ids=["8x8", "28x28"]
)
def test_cnn_shapes(shape, size):
    model = convergence.make_model("cnn", shape, seed=1)
    assert sum(p.numel() for p in model.parameters()) == size
    assert model(torch.zeros(3, *shape)).shape == (3, 10)
    assert "max-pool -> conv 16->32" in convergence.describe_model("cnn", (1, 28, 28))


def test_digits_dense_cnn_learns():
    """On 512 real digits, a dense CNN learns in a few steps."""
    pytest.importorskip("sklearn")
    results = convergence.study(
        load("digits", 512, 200), convergence.Setup(epochs=3, batch_per_rank=16),
        models=["cnn"], compressors=["none"], seeds=[0], progress=False, plot=False,
    )
    curve = results["rows"][0]["curve_mean"]
    assert curve[-1] > 0.5 > curve[0]  # ten classes: chance is 0.1


def test_plan_orders_runs_and_rejects_unknown_names():
    runs = convergence.plan(["mlp"], ["terngrad", "regtopk", "none"], [0.01, 0.001], ["warmup"])
    assert [r.label for r in runs] == ["dense", "regtop-k 1% +warm-up", "regtop-k 0.1% +warm-up", "terngrad"]
    runs = convergence.plan(["cnn"], ["topk"], [0.01], ["mc+warmup", "plain", "mc+warmup"])
    assert [r.label for r in runs] == ["top-k 1% +mc +warm-up", "top-k 1%"]
    assert [(r.momentum_correction, r.warmup) for r in runs] == [(True, True), (False, False)]
    assert runs[0].compressor(0.9).momentum == 0.9 and runs[1].compressor(0.9).momentum == 0.0
    assert [r.label for r in convergence.plan(["cnn"], ["topk"], [0.01])] == ["top-k 1%", "top-k 1% +mc +warm-up"]
    ternary = convergence.plan(["mlp"], ["terngrad-ef", "terngrad"], [0.01])
    assert [r.label for r in ternary] == ["terngrad", "terngrad +ef"]
    assert [r.compressor(0.9).error_feedback for r in ternary] == [False, True]
    for bad in ({"compressors": ["topk", "fp8"]}, {"models": ["resnet"]}, {"variants": ["sometimes"]},
                {"variants": []}):
        options = {"models": ["cnn"], "compressors": ["topk"], "ratios": [0.01], "variants": ["plain"], **bad}
        with pytest.raises(ValueError, match="unknown"):
            convergence.plan(**options)


def test_dense_below_reaches_the_sparsifiers_and_their_labels():
    runs = convergence.plan(["cnn"], ["none", "topk", "terngrad"], [0.04], ["mc+warmup"], ["aggregate"],
                            dense_below=5000)
    assert [r.label for r in runs] == ["dense", "top-k 4% +mc +warm-up [aggregate] [dense below 5000]", "terngrad"]
    assert runs[1].compressor(0.9).dense_below == 5000
    assert convergence.plan(["cnn"], ["topk"], [0.04], ["plain"])[0].compressor(0.9).dense_below == 1024


def test_options_precedence():
    given = {"epochs": 7, "batch_size": None, "warmup_epochs": None, "train_size": None, "test_size": 50}
    options = convergence.options_for("fashion-mnist", True, given)
    assert options == {**convergence.QUICK, "epochs": 7, "test_size": 50}
    assert convergence.options_for("digits", False, {})["epochs"] == convergence.DEFAULTS["digits"]["epochs"]


def test_summary_of_seeds():
    seeds = [{"test_accuracy": [0.1, 0.80, 0.90], "density": 0.02}, {"test_accuracy": [0.1, 0.70, 0.94],
                                                                      "density": 0.04}]
    for s in seeds:
        s.update(bytes_per_step=10.0, dense_bytes_per_step=100.0, bytes_vs_dense=0.1, traffic_vs_dense=0.2,
                 optimizer_momentum=0.9, compressor_momentum=0.0)
    dense = {"final_accuracy": {"mean": 0.93, "min": 0.925}}
    row = convergence.summarize(convergence.Run("cnn", "topk", 0.01), seeds, dense, gap=0.5)
    assert row["final_accuracy"]["mean"] == pytest.approx(0.92) and row["final_accuracy"]["min"] == 0.90
    assert row["final_accuracy"]["std"] == pytest.approx(0.0282843, rel=1e-5)
    assert row["gap_points"] == pytest.approx(-1.0) and not row["within_dense_spread"]
    assert row["target_accuracy"] == pytest.approx(0.925) and row["epochs_to_target"] is None
    assert row["density"] == pytest.approx(0.03)
    assert convergence.first_epoch_at([0.95, 0.5, 0.93], 0.925) == 2  # the initial model does not count
    table = convergence.markdown_table({"rows": [row]}).splitlines()
    assert table[2] == "| cnn | top-k 1% | 0.9200 +- 0.0283 (0.9000-0.9400) | -1.00 pt | never | 0.1000 |"


def test_step_decay_reaches_zero_and_refuses_unknown_schedules():
    from benchmarks import cnn

    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    assert cnn.step_decay(sgd, "constant", 10) is None
    decay = cnn.step_decay(sgd, "cosine", 10)
    for _ in range(10):
        sgd.step()
        decay.step()
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="unknown step-size schedule"):
        cnn.step_decay(sgd, "Cosine", 10)
