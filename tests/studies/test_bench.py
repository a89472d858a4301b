"""``python -m benchmarks compress``: smoke runs on tiny sizes (speed is measured by the benchmark, never here),
and what its timed engine step sends and returns, by hand."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

from benchmarks import compress  # noqa: E402
from benchmarks.cli import main  # noqa: E402

ROW_FIELDS = {
    "backend",
    "device",
    "size",
    "compressor",
    "seconds",
    "vs_topk",
    "vs_pass",
    "vs_topk_compressor",
    "density",
    "payload_bytes",
    "dense_bytes",
    "bytes_vs_dense",
}


def _check(path, sizes):
    results = json.loads((path / "compress.json").read_text())
    assert {"cpu_count", "torch_version", "devices"} <= set(results["machine"])
    assert results["machine"]["devices"]["cpu"]
    rows = results["rows"]
    for size in sizes:
        for name in compress.COMPRESSORS:
            (row,) = [
                r
                for r in rows
                if r["backend"] == "torch"
                and r["device"] == "cpu"
                and r["size"] == size
                and r["compressor"] == name
            ]
            assert ROW_FIELDS <= set(row), row
            assert row["seconds"] > 0 and row["vs_topk"] > 0 and row["vs_pass"] > 0
            assert row["dense_bytes"] == 4 * size
            if name in compress.SPARSE:
                assert 0 < row["density"] < 1 and row["payload_bytes"] < row["dense_bytes"]
            else:
                assert row["density"] == 1
    # the numpy reference section, at the smallest size only
    numpy_rows = [r for r in rows if r["backend"] == "numpy"]
    assert {r["compressor"] for r in numpy_rows} == set(compress.COMPRESSORS)
    assert {r["size"] for r in numpy_rows} == {min(sizes)}
    assert {(t["compressor"], t["against"]) for t in results["targets"]} == {
        ("gaussiank", "torch.topk"),
        ("gaussiank", "one pass"),
        ("regtopk", "Top-k"),
    }
    png = path / "compress.png"
    assert png.exists() and png.stat().st_size > 0
    return results


def test_run_writes_json_and_plot(tmp_path, capsys):
    results = compress.run(sizes=[10_000, 20_000], repeats=1, device="cpu", out=str(tmp_path))
    _check(tmp_path, [10_000, 20_000])
    assert results["settings"]["sizes"] == [10_000, 20_000]
    out = capsys.readouterr().out
    assert "gaussiank" in out and "target <= 0.2x" in out and "numpy reference" in out


def test_timed_step_is_the_engine_on_one_rank():
    """The step the benchmark times: Top-k's result is the gradient at its k largest |g| (nothing else,
    no residual yet), a second step sends the top k of g + residual; FP16's is the float16 rounding."""
    from hvd_compress.algorithms import FP16, TopK
    from hvd_compress.kernels.reference import num_selected

    g = compress.gradient(5_000, seed=3)
    k = num_selected(g.size, 0.01)
    topk = TopK(0.01, dense_below=0)
    first = compress.engine_step(topk, g, "w")
    top = np.argsort(-np.abs(g), kind="stable")[:k]
    expected = np.zeros_like(g)
    expected[top] = g[top]
    np.testing.assert_array_equal(first, expected)
    second = compress.engine_step(topk, g, "w")
    a = g + (g - first)  # the residual is what the first step did not send
    top = np.argsort(-np.abs(a), kind="stable")[:k]
    assert set(np.flatnonzero(second)) == set(top)
    np.testing.assert_array_equal(second[top], a[top])
    np.testing.assert_array_equal(compress.engine_step(FP16(), g, "w"), g.astype(np.float16).astype(np.float32))


def test_bytes_are_what_one_rank_sends_by_hand(capsys):
    """Per step on a world of one: Top-k and RegTop-k (k + 1) (int32 index, float32 value) slots (a flag
    rides in the last one), TernGrad ceil(d / 4) bytes of 2-bit codes plus its scale and flag (float32),
    FP16 2 bytes per entry."""
    d, ratio = 10_000, 0.01
    results = compress.run(sizes=[d], ratio=ratio, repeats=1, device="cpu", out=None, plot=False, progress=False)
    k = d // 100
    expected = {"topk": 8 * (k + 1), "regtopk": 8 * (k + 1), "terngrad": d // 4 + 8, "fp16": 2 * d}
    for row in results["rows"]:
        if row["compressor"] in expected:
            assert row["payload_bytes"] == expected[row["compressor"]], row
        if row["compressor"] in ("topk", "regtopk"):
            assert row["density"] == k / d
    capsys.readouterr()


def test_cli(tmp_path, capsys):
    assert (
        main(
            [
                "compress",
                "--sizes",
                "10k,12_000",
                "--repeats",
                "1",
                "--device",
                "cpu",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    _check(tmp_path, [10_000, 12_000])
    assert "compress.json" in capsys.readouterr().out


def test_cli_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["compress", "--sizes", "lots", "--out", str(tmp_path)])
    assert main(["compress", "--sizes", "10k", "--ratio", "0", "--out", str(tmp_path)]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, size",
    [
        ("1M", 1_000_000),
        ("11.7M", 11_700_000),
        ("25m", 25_000_000),
        ("10_000", 10_000),
        ("10k", 10_000),
        ("1e6", 1_000_000),
    ],
)
def test_parse_size(text, size):
    assert compress.parse_size(text) == size
    with pytest.raises(ValueError):
        compress.parse_size("1.5.3M")
