"""``python -m benchmarks tf-step``: 2 processes, two timed steps per row on the MLP.

The run takes one row of each kind (dense, Horovod's FP16, stock, stock with ``groups=1``, drop-in; each of
our compressors once) and each compressed one again ``:one-by-one``: every row costs a trace of its own, and
tests/distributed/test_horovod_tf.py trains every compressor on every route.
"""

import json

import pytest

from benchmarks import tf_step
from benchmarks.cli import main
from tests.distributed import launch

#: one row of each kind of tf_step.ROWS, each of our compressors once
ROWS = ["dense", "horovod-fp16", "stock-topk", "stock-grouped-regtopk", "dropin-terngrad"]
ROW_FIELDS = {"model", "row", "route", "compression", "steps", "median_step_s_per_rank", "step_s", "ranks_agree",
              "ratio_to_dense"}


def test_every_kind_of_row_runs_and_the_output_has_its_structure(tmp_path, capsys):
    launch.require("horovod.tensorflow")
    pytest.importorskip("matplotlib")
    routes = {route for route, _ in tf_step.ROWS.values()}
    names = {name for _, name in tf_step.ROWS.values()}
    assert {tf_step.ROWS[row][0] for row in ROWS} == routes and {tf_step.ROWS[row][1] for row in ROWS} == names
    argv = ["tf-step", "--models", "mlp", "--rows", ",".join(ROWS), "--steps", "2", "--rounds", "1", "--warmup", "1",
            "--batch-size", "8", "--one-by-one", "--out", str(tmp_path), "--label", "tiny"]
    assert main(argv) == 0
    assert (tmp_path / "tf_step.png").stat().st_size > 0
    results = json.loads((tmp_path / "tf_step.json").read_text())
    assert results["benchmark"] == "tf_step" and results["label"] == "tiny" and results["baseline"] is None
    assert results["settings"]["ranks"] == 2 and results["settings"]["models"] == ["mlp"]
    rows = results["rows"]
    ours = [row for row in ROWS if tf_step.ROWS[row][1] not in (None, "fp16")]
    assert [r["row"] for r in rows] == ROWS + [f"{row}:one-by-one" for row in ours]
    for r in rows:
        assert set(r) == ROW_FIELDS
        assert r["model"] == "mlp" and r["steps"] == 2 and len(r["median_step_s_per_rank"]) == 2
        assert r["step_s"] == max(r["median_step_s_per_rank"]) > 0
        assert r["ratio_to_dense"] == pytest.approx(r["step_s"] / rows[0]["step_s"])
        assert r["ranks_agree"], r  # every rank applied the same average
        route_and_name = tf_step.ROWS[r["row"].removesuffix(tf_step.ONE_BY_ONE)]
        assert (r["route"], None if r["compression"] == "none" else r["compression"]) == route_and_name
    captured = capsys.readouterr()
    assert "tf-step mlp round 1/1: median ms dense" in captured.err
    assert "dropin-terngrad" in captured.out and "Wrote" in captured.out


def test_a_baseline_is_shown_next_to_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    row = {"model": "mlp", "route": "stock", "compression": "none", "steps": 1, "median_step_s_per_rank": [0.01],
           "step_s": 0.01, "ranks_agree": True}
    earlier = {"label": "before", "rows": [dict(row, row="dense", ratio_to_dense=1.0),
                                           dict(row, row="stock-topk", step_s=0.05, ratio_to_dense=5.0)]}
    (tmp_path / "before.json").write_text(json.dumps(earlier))
    results = {"label": "after", "machine": {"cpu_count": 2}, "baseline": tf_step.baseline_of(tmp_path / "before.json"),
               "settings": {"ranks": 2, "launcher": "horovodrun", "batch": 8, "ratio": 0.01, "rounds": 1, "steps": 1},
               "rows": [dict(row, row="dense", ratio_to_dense=1.0), dict(row, row="stock-topk", step_s=0.02,
                                                                         ratio_to_dense=2.0),
                        dict(row, row="dropin-topk", step_s=0.02, ratio_to_dense=2.0)]}
    lines = []
    tf_step.print_table(results, stdout=type("Out", (), {"write": lambda self, s: lines.append(s)})())
    table = "".join(lines)
    assert "stock-topk           20.0    2.00x      50.0    5.00x" in table
    assert "dropin-topk          20.0    2.00x         -        -" in table
    tf_step.write_plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("bad, message", [
    (["--models", "resnet"], "unknown ['resnet']"),
    (["--rows", "stock-topk"], "must include dense"),
    (["--ranks", "1"], "ranks must be at least 2"),
    (["--baseline", "/nonexistent/tf_step.json"], "cannot read the baseline"),
])
def test_bad_options_fail_before_any_process_starts(bad, message, capsys):
    assert main(["tf-step", *bad, "--out", ""]) == 2
    assert message in capsys.readouterr().err
