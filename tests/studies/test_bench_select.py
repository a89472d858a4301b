"""``python -m benchmarks select`` on the CPU at a tiny size: every row, its ratios, the files (no timing
assertions)."""

import json

import pytest

torch = pytest.importorskip("torch")

from benchmarks import select  # noqa: E402
from benchmarks.cli import main  # noqa: E402


def test_cli_times_every_row_and_writes_json_and_png(tmp_path, capsys):
    argv = ["select", "--device", "cpu", "--sizes", "20k", "--ratios", "0.01,0.001", "--repeats", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "select.json").read_text())
    assert (tmp_path / "select.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = results["settings"]
    assert (s["device"], s["sizes"], s["ratios"], s["repeats"]) == ("cpu", [20_000], [0.01, 0.001], 2)
    assert list(s["rows"]) == list(select.ROWS)
    rows = {(r["size"], r["ratio"], r["row"]): r for r in results["rows"]}
    assert list(rows) == [(20_000, ratio, name) for ratio in (0.01, 0.001) for name in select.ROWS]
    for (size, ratio, name), row in rows.items():
        assert row["k"] == {0.01: 200, 0.001: 20}[ratio] and row["ms"] > 0, row
        assert row["vs_copy"] == pytest.approx(row["ms"] / rows[size, ratio, "copy"]["ms"])
        assert row["vs_topk"] == pytest.approx(row["ms"] / rows[size, ratio, "torch.topk"]["ms"])
        assert row["vs_clone"] == pytest.approx(row["ms"] / rows[size, ratio, "clone"]["ms"])
        assert (row["first_step_ms"] is None) == (name in select.BASELINES), row
    assert rows[20_000, 0.01, "copy"]["vs_copy"] == 1.0
    table = capsys.readouterr().out
    for name in select.ROWS:
        assert any(line.split()[3:4] == [name] for line in table.splitlines()), table


def test_the_engine_rows_run_what_the_route_runs(monkeypatch):
    """A compressor's row times whole steps of a one-tensor bucket holding a residual (the accelerator's
    code path: the same calls), with the fused passes compiled or not as the row says."""
    from hvd_compress.kernels import torch_compiled
    from hvd_compress.engine import fused

    launched = []
    original = fused.FusedBucket.launch

    def spy(bucket, tensors, comm, run, complete=True):
        launched.append((type(bucket.compressor).__name__, bucket.residual is not None, tensors[0].numel(),
                         torch_compiled.enabled(torch.device("cpu"))))
        return original(bucket, tensors, comm, run, complete)

    monkeypatch.setattr(fused.FusedBucket, "launch", spy)
    results = select.run(device="cpu", sizes=[5000], ratios=[0.01], repeats=1, rows=["gaussiank/eager"],
                         code_path="accelerator", out=None, progress=False)
    assert [r["row"] for r in results["rows"]] == ["copy", "clone", "torch.topk", "gaussiank/eager"]
    assert results["settings"]["code_path"] == "accelerator"
    # the first step, then the warm-up and timed calls, each on the residual the step before left
    assert launched == [("GaussianK", True, 5000, False)] * (1 + select.WARMUP_CALLS + 1)
    launched.clear()
    select.run(device="cpu", sizes=[5000], ratios=[0.01], repeats=1, rows=["topk/compiled"], out=None,
               progress=False)
    assert launched == [("TopK", True, 5000, True)] * (1 + select.WARMUP_CALLS + 1)


def test_a_model_bucket_holds_its_tensors_as_views_of_the_gradient(monkeypatch):
    """``--bucket resnet50``: every step adds ResNet-50's 161 tensors (their shapes, views of the one
    gradient the baselines time), the sizes given left aside."""
    from benchmarks.shapes import PARAMETERS, TENSORS, resnet50_shapes
    from hvd_compress.engine import fused

    launched = []
    original = fused.FusedBucket.launch

    def spy(bucket, tensors, comm, run, complete=True):
        launched.append([tuple(t.shape) for t in tensors])
        return original(bucket, tensors, comm, run, complete)

    monkeypatch.setattr(fused.FusedBucket, "launch", spy)
    results = select.run(device="cpu", sizes=[100], ratios=[0.01], repeats=1, rows=["none/eager"], out=None,
                         progress=False, bucket="resnet50")
    assert results["settings"]["sizes"] == [PARAMETERS["resnet50"]]
    assert results["settings"]["bucket"].startswith("resnet50: its 161 parameter tensors")
    assert {r["size"] for r in results["rows"]} == {PARAMETERS["resnet50"]}
    assert launched == [[shape for _, shape in resnet50_shapes()]] * (1 + select.WARMUP_CALLS + 1)
    assert len(launched[0]) == TENSORS["resnet50"]
    case = select.Case(torch, "cpu", 0, 0.01, 0, "resnet50")
    storage = case.g.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for _, t in case.tensors)
    assert torch.equal(torch.cat([t.reshape(-1) for _, t in case.tensors]), case.g)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown row"):
        select.run(device="cpu", sizes=[100], rows=["nope"], out=None, progress=False)
    with pytest.raises(ValueError, match="sizes"):
        select.run(device="cpu", sizes=[0], out=None, progress=False)
    with pytest.raises(ValueError, match="repeats"):
        select.run(device="cpu", sizes=[100], repeats=0, out=None, progress=False)
    with pytest.raises(ValueError, match="bucket must be one of one, resnet50"):
        select.run(device="cpu", sizes=[100], out=None, progress=False, bucket="vgg")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="is_available"):
            select.run(device="cuda", sizes=[100], out=None, progress=False)
