"""``python -m benchmarks linreg --plot/--mu-sweep``: the RegTop-k linear-regression study, tiny sizes."""

import json

import numpy as np
import pytest

from hvd_compress import NoneCompressor, RegTopK, TopK
from benchmarks import linreg
from benchmarks.cli import main

SMALL = dict(n_ranks=4, dim=12, ratio=0.4, mu=4.0, steps=40, lr=0.01)
LABELS = {"dense", "top-k", "regtop-k mu=4", "regtop-k mu=4 + revert", "regtop-k mu=1", "regtop-k mu=2"}


def _check(path):
    results = json.loads((path / "linreg.json").read_text())
    assert set(results["curves"]) == LABELS
    for curve in results["curves"].values():
        assert curve["step"][0] == 1 and curve["step"][-1] == results["settings"]["steps"]
        assert len(curve["step"]) == len(curve["distance"]) <= linreg.CURVE_POINTS
    rows = {r["label"]: r for r in results["final"]}
    assert set(rows) == LABELS
    assert rows["top-k"]["vs_topk"] == 1
    assert rows["regtop-k mu=4 + revert"]["revert"] is True and rows["regtop-k mu=2"]["mu"] == 2
    assert all(r["final_distance"] > 0 for r in rows.values())
    png = path / "linreg.png"
    assert png.exists() and png.stat().st_size > 0
    return results


def test_study_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = linreg.study(**SMALL, mu_sweep=[1, 2, 4], out=str(tmp_path), progress=False)
    _check(tmp_path)
    # the revert curve is linreg.run(..., revert=True) with RegTop-k, outside the compressor
    problem = linreg.LinearRegressionProblem.generate(n_ranks=4, dim=12)
    direct = linreg.run(problem, linreg._sparse(RegTopK, 0.4, mu=4.0), steps=40, lr=0.01, revert=True)
    final = {r["label"]: r["final_distance"] for r in results["final"]}
    assert final["regtop-k mu=4 + revert"] == pytest.approx(np.mean(direct[-4:]))
    assert "regtop-k mu=2" in capsys.readouterr().out


def test_instances_and_reverted_steps(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    small = dict(SMALL, steps=30)
    results = linreg.study(**small, instances=3, out=str(tmp_path), progress=False)
    rows = results["instances"]
    assert [row["seed"] for row in rows] == [0, 1, 2]
    final = {r["label"]: r for r in results["final"]}
    assert rows[0]["top-k"] == final["top-k"]["final_distance"]
    assert rows[0]["vs_topk"] == pytest.approx(final["regtop-k mu=4"]["vs_topk"])
    other = linreg.LinearRegressionProblem.generate(n_ranks=4, dim=12, seed=2)
    topk = linreg.final_distance(linreg.run(other, linreg._sparse(TopK, 0.4), steps=30, lr=0.01))
    assert rows[2]["top-k"] == pytest.approx(topk)
    assert final["regtop-k mu=4 + revert"]["reverted_steps"] >= 0 and final["top-k"]["reverted_steps"] is None
    assert "3 problem instances" in capsys.readouterr().out
    with pytest.raises(ValueError, match="instances"):
        linreg.study(**small, instances=0, progress=False)


def test_revert_undoes_a_jump(monkeypatch):
    """A step 10x longer than the one before (100x squared) is undone and reported."""
    problem = linreg.LinearRegressionProblem.generate(n_ranks=2, dim=4, samples=50)
    reverted = []
    distances = linreg.run(problem, NoneCompressor(), steps=3, lr=0.01, revert=True, reverted=reverted)
    assert reverted == [] and distances[-1] < problem.distance(problem.start)
    reverted, plain, calls = [], problem.gradients, []

    def jumping(x):  # the gradients times 1000 from the third step on
        calls.append(x)
        return [g * (1000.0 if len(calls) >= 3 else 1.0) for g in plain(x)]

    monkeypatch.setattr(problem, "gradients", jumping)
    linreg.run(problem, NoneCompressor(), steps=4, lr=0.01, revert=True, reverted=reverted)
    assert reverted == [2, 3]


def test_final_distance_and_subsample():
    d = list(range(1, 101))
    assert linreg.final_distance(d) == np.mean(range(91, 101))
    assert linreg.final_distance([3.0]) == 3.0
    curve = linreg.subsample(list(range(2500)), points=500)
    assert len(curve["step"]) == 500 and curve["step"][-1] == 2500 and curve["distance"][-1] == 2499


def test_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["linreg", "--ranks", "4", "--dim", "12", "--steps", "40", "--mu-sweep", "1,2"]
    assert main(args + ["--plot", str(tmp_path)]) == 0
    _check(tmp_path)
    out = capsys.readouterr().out
    assert "linreg.png" in out and "regtop-k / top-k" in out


def test_cli_rejects_bad_sweep(capsys):
    with pytest.raises(SystemExit):
        main(["linreg", "--mu-sweep", "a,b"])
