"""``python -m benchmarks compress``: smoke runs on tiny sizes (speed is measured by the benchmark, never here)."""

import json

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
