"""``python -m benchmarks cnn / gaussian / terngrad``: the CNN convergence studies, tiny sizes."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

from hvd_compress import Compression, TopK  # noqa: E402
from benchmarks import cnn, gaussian  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from hvd_compress.kernels.reference import GAUSSIANK_HIGH  # noqa: E402
from hvd_compress.simulator import Simulator  # noqa: E402

#: 2 ranks x 16 images, 256 training images: 8 steps.
TINY = ["--ranks", "2", "--epochs", "1", "--batch-size", "16", "--train-size", "256", "--test-size", "64"]
SHAPES = {name: tuple(p.shape) for name, p in cnn.make_net().named_parameters()}


def _load(path, stem):
    png = path / f"{stem}.png"
    assert png.exists() and png.stat().st_size > 0
    return json.loads((path / f"{stem}.json").read_text())


def test_cnn_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["cnn", *TINY, "--ratios", "0.01,0.001", "--plot", str(tmp_path)]) == 0
    results = _load(tmp_path, "cnn")
    runs = {r["label"]: r for r in results["runs"]}
    assert list(runs) == [
        "dense",
        *(f"{name} {pct}" for pct in ("1%", "0.1%") for name in ("top-k", "gaussian-k", "regtop-k")),
        "terngrad",
    ]
    for r in runs.values():
        assert len(r["train_loss"]) == r["steps"] == 8
        assert r["eval"]["step"][0] == 0 and r["eval"]["step"][-1] == 8
        assert 0 <= r["final_test_accuracy"] <= 1 and r["final_test_loss"] > 0
    dense = runs["dense"]
    assert dense["dense_bytes_per_step"] == 4 * sum(map(math.prod, SHAPES.values()))
    # dense fp32, and the layout check's header (two int64) at the first of 8 steps
    assert dense["bytes_per_step"] == dense["dense_bytes_per_step"] + 16 / 8
    for pct, ratio in (("1%", 0.01), ("0.1%", 0.001)):
        for name in ("top-k", "regtop-k"):  # fixed k: 8 bytes per value sent, the rest dense fp32
            r = runs[f"{name} {pct}"]
            assert r["density"] > ratio  # small tensors go dense
            assert r["bytes_vs_dense"] < 3 * r["density"]
            sent = {row["name"]: row for row in r["layers"]}
            assert sent["conv1.weight"]["sent"] == "dense" and "dense_below" in sent["conv1.weight"]["reason"]
            assert sent["fc1.weight"]["sent"] == "sparse" and sent["fc1.weight"]["k"] == math.ceil(
                65536 * ratio
            )
    assert runs["top-k 0.1%"]["density"] < runs["top-k 1%"]["density"]
    assert runs["terngrad"]["density"] is None and runs["terngrad"]["bytes_vs_dense"] < 0.2
    out = capsys.readouterr().out
    assert "cnn.png" in out and "regtop-k 0.1%" in out


def test_dense_training_lowers_the_loss():
    data = cnn.ImageData.synthetic(train=2048, test=512, seed=3)
    result = cnn.run_all(
        [("dense", Compression.none())], data, "test", ranks=2, epochs=2, progress=False, evals=2
    )["dense"]
    losses, accuracy = result["eval"]["test_loss"], result["eval"]["test_accuracy"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert accuracy[-1] > 0.5, accuracy  # ten classes: chance is 0.1


def test_layer_table_reasons():
    rows = {row["name"]: row for row in cnn.layer_table(Simulator(4, TopK(0.3)).compressors[0], SHAPES)}
    assert rows["conv1.weight"]["reason"] == "below dense_below=1024" and rows["conv1.weight"]["k"] is None
    assert rows["fc2.weight"]["k"] == 384 and rows["fc2.weight"]["reason"] == "N k = 1536 >= numel"
    rows = {row["name"]: row for row in cnn.layer_table(Simulator(4, TopK(0.2)).compressors[0], SHAPES)}
    assert rows["fc2.weight"]["sent"] == "sparse" and rows["fc2.weight"]["reason"] is None
    rows = {row["name"]: row for row in cnn.layer_table(Compression.terngrad().bind(0, 4), SHAPES)}
    assert rows["fc1.weight"]["sent"] == "ternary" and rows["fc1.bias"]["sent"] == "dense"


def test_gaussian_cli(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["gaussian", *TINY, "--snapshots", "3", "--plot", str(tmp_path)]) == 0
    results = _load(tmp_path, "gaussian")
    assert [s["step"] for s in results["snapshots"]] == [1, 5, 8]
    for snap in results["snapshots"]:
        width = snap["bin_edges"][1] - snap["bin_edges"][0]
        assert sum(snap["density"]) * width == pytest.approx(1.0)
        assert snap["std"] > 0 and snap["threshold"] > abs(snap["mean"])
    assert {row["name"] for row in results["layers"]} == {"conv2.weight", "fc1.weight", "fc2.weight"}
    for name, counts in results["counts"].items():
        k = counts["k"]
        assert len(counts["selected"]) == len(counts["first_guess"]) == 8
        for per_rank in counts["selected"]:
            assert len(per_rank) == 2
            # the correction accepts at most 4k/3 entries or cuts a larger set to its first k
            assert all(1 <= n <= GAUSSIANK_HIGH * k for n in per_rank), (name, k, per_rank)
    fc1 = next(row for row in results["layers"] if row["name"] == "fc1.weight")
    assert fc1["selected_within_2k3_4k3"] >= 0.9


@pytest.mark.parametrize(
    "study, message", [("gaussian", "not sparsified"), ("terngrad", "not TernGrad-coded")]
)
def test_rejects_a_dense_layer(study, message, capsys):
    assert main([study, *TINY, "--layer", "conv1.weight"]) == 2
    assert message in capsys.readouterr().err


def test_gaussian_probe_matches_the_compressor_on_step_one():
    """At step 1 the residual is zero: the first-guess count is that of the reference threshold on g."""
    from hvd_compress.kernels import reference

    data = cnn.ImageData.synthetic(train=64, test=16)
    probe = gaussian.GaussianProbe(0.01, "fc1.weight", [0])
    x = data.train_x[:64].reshape(2, 32, 1, 8, 8)
    y = data.train_y[:64].reshape(2, 32)
    grads, _ = cnn.rank_gradients(cnn.make_net(), x, y)
    sim = Simulator(2, Compression.gaussiank(0.01))
    probe.before(0, grads, sim)
    g = grads["fc1.weight"][0].reshape(-1).numpy()
    threshold = reference.gaussiank_threshold(g, 0.01)
    assert probe.counts["fc1.weight"]["first_guess"] == [int((abs(g) > threshold).sum())]
    assert probe.snapshots[0]["threshold"] == pytest.approx(threshold, rel=1e-5)


def test_terngrad_cli(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["terngrad", *TINY, "--plot", str(tmp_path)]) == 0
    results = _load(tmp_path, "terngrad")
    runs = {r["label"]: r for r in results["runs"]}
    assert list(runs) == [
        "dense",
        "clip 2.5, shared scale",
        "no clip, shared scale",
        "clip 2.5, per-rank scale",
        "no clip, per-rank scale",
    ]
    assert runs["dense"]["relative_error"] is None
    for r in list(runs.values())[1:]:
        assert len(r["relative_error"]) == 8 and r["bytes_vs_dense"] < 0.2
    # S = max|g| exactly with per-rank scales; sharing takes the max over ranks; clipping lowers it
    assert runs["no clip, per-rank scale"]["scale_over_max_abs"] == pytest.approx(1.0)
    assert runs["no clip, shared scale"]["scale_over_max_abs"] >= 1.0
    assert runs["clip 2.5, shared scale"]["scale_over_max_abs"] < 1.0
    # variance grows with S: the unclipped aggregate is the noisier one
    assert (
        runs["no clip, shared scale"]["relative_error_mean"]
        > runs["clip 2.5, shared scale"]["relative_error_mean"]
    )
    wire = {(w["ranks"], w["scalar_sharing"]): w for w in results["wire"]}
    assert sorted({n for n, _ in wire}) == [2, 4, 8, 16]
    for n in (2, 4, 8, 16):  # the shared scale allows the packed allreduce, never more traffic
        assert wire[(n, False)]["traffic"] >= wire[(n, True)]["traffic"]
    for n in (8, 16):  # allgathering per-rank 2-bit codes grows with N
        assert wire[(n, False)]["traffic"] > 1.4 * wire[(n, True)]["traffic"]


def test_cli_rejects_bad_ratios():
    with pytest.raises(SystemExit):
        main(["cnn", "--ratios", "a,b"])
