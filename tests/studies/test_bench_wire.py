"""``python -m benchmarks wire``: bytes per rank per step on tiny ResNet-18-shaped models."""

import json

import numpy as np
import pytest

from benchmarks import wire
from benchmarks.cli import main

ROW_FIELDS = {
    "ranks",
    "compressor",
    "payload_bytes",
    "traffic_bytes",
    "dense_payload_bytes",
    "dense_traffic_bytes",
    "payload_vs_dense",
    "traffic_vs_dense",
    "compressed_traffic_vs_dense",
    "collectives",
}


def test_resnet18_shapes():
    shapes = wire.resnet18_shapes()
    assert len(shapes) == 62
    assert sum(wire.numel(s) for _, s in shapes) == 11_689_512  # torchvision resnet18
    small = wire.resnet18_shapes(scale=1 / 16)
    assert [n for n, _ in small] == [n for n, _ in shapes]
    assert sum(wire.numel(s) for _, s in small) < 100_000
    with pytest.raises(ValueError):
        wire.resnet18_shapes(scale=0)


def _one_tensor(n_ranks, numel=2000):
    rng = np.random.default_rng(0)
    return {"w": [rng.standard_normal(numel).astype(np.float32) for _ in range(n_ranks)]}


@pytest.mark.parametrize(
    "n_ranks, payload, traffic, collectives",
    [
        # 2000 codes, N=2: 3-bit fields, 10 per int32 -> 800 B packed; 2-bit codes 500 B;
        # N * 500 < 2 * 800, so allgather: (N-1) * 500, and the allreduce-Max of the 4-byte scale and
        # the 4-byte non-finite flag 2(N-1)/N * 8
        (2, 500 + 8, 1 * 500 + 2 * 1 / 2 * 8, {"allgather": 1, "allreduce": 1}),
        # N=4: 4-bit fields, 8 per int32 -> 1000 B packed; N * 500 == 2 * 1000, so allreduce:
        # 2(N-1)/N * 1000 + 2(N-1)/N * 8
        (4, 1000 + 8, 2 * 3 / 4 * 1000 + 2 * 3 / 4 * 8, {"allreduce": 2}),
    ],
)
def test_terngrad_traffic_by_hand(n_ranks, payload, traffic, collectives):
    row = wire.measure("terngrad", _one_tensor(n_ranks), n_ranks, ratio=0.01, dense_below=1024)
    assert row["payload_bytes"] == payload
    assert row["traffic_bytes"] == pytest.approx(traffic)
    assert row["collectives"] == collectives
    assert row["dense_payload_bytes"] == 4 * 2000
    assert row["dense_traffic_bytes"] == pytest.approx(2 * (n_ranks - 1) / n_ranks * 8000)


def test_topk_and_fallback_traffic_by_hand():
    grads = _one_tensor(4)
    grads["bias"] = [np.ones(10, dtype=np.float32)] * 4  # below dense_below: dense allreduce
    row = wire.measure("topk", grads, 4, ratio=0.01, dense_below=1024)
    # k = 20 of 2000: 20 fp32 values and the tensor's flag, and their 21 int32 positions, in two
    # allgathers (168 B); the 40 B bias allreduced
    assert row["payload_bytes"] == 168 + 40
    assert row["traffic_bytes"] == pytest.approx(3 * 168 + 1.5 * 40)
    assert row["compressed_traffic_vs_dense"] == pytest.approx(3 * 168 / (1.5 * 8000))
    assert row["collectives"] == {"allgather": 2, "allreduce": 1}


def _check(path, ranks):
    results = json.loads((path / "wire.json").read_text())
    assert results["settings"]["ranks"] == ranks
    assert {"cpu_count", "devices"} <= set(results["machine"])
    rows = {(r["compressor"], r["ranks"]): r for r in results["rows"]}
    assert set(rows) == {(c, n) for c in wire.COMPRESSORS for n in ranks}
    for (name, n), row in rows.items():
        assert ROW_FIELDS <= set(row), row
        assert row["dense_payload_bytes"] == 4 * results["settings"]["numel"]
        assert row["traffic_bytes"] > 0
    for n in ranks:
        assert rows[("none", n)]["payload_vs_dense"] == 1 and rows[("none", n)]["traffic_vs_dense"] == 1
        assert rows[("fp16", n)]["traffic_vs_dense"] == pytest.approx(0.5)
        for name in ("topk", "gaussiank", "regtopk", "terngrad"):
            assert rows[(name, n)]["payload_vs_dense"] < 0.5
    if 4 in ranks:
        (target,) = results["targets"]
        assert target["compressor"] == "terngrad" and target["ranks"] == 4 and target["target"] == 1 / 8
    png = path / "wire.png"
    assert png.exists() and png.stat().st_size > 0
    return results


def test_run_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    wire.run(ranks=[4, 2], scale=1 / 16, out=str(tmp_path), progress=False)
    _check(tmp_path, [2, 4])
    out = capsys.readouterr().out
    assert "terngrad traffic at N=4" in out and "target <= 0.1250" in out


def test_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["wire", "--ranks", "2,4", "--scale", "0.0625", "--out", str(tmp_path)]
    assert main(args) == 0
    _check(tmp_path, [2, 4])
    assert "wire.json" in capsys.readouterr().out


def test_cli_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["wire", "--ranks", "two", "--out", str(tmp_path)])
    assert main(["wire", "--ranks", "1", "--scale", "0.0625", "--out", str(tmp_path)]) == 2
    assert "ranks must be at least 2" in capsys.readouterr().err
    assert main(["wire", "--ratio", "0", "--scale", "0.0625", "--out", str(tmp_path)]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err
