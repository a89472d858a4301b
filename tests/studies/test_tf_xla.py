"""``python -m benchmarks tf-xla`` at a tiny size: every row selects what numpy does (the benchmark checks it
and raises otherwise), the ratios to the clone, the files (no timing assertions)."""

import json

import pytest

pytest.importorskip("tensorflow")

from benchmarks import tf_xla  # noqa: E402
from benchmarks.cli import main  # noqa: E402


def test_cli_times_every_row_and_writes_json_and_png(tmp_path):
    assert main(["tf-xla", "--sizes", "20k", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "tf_xla.json").read_text())
    assert (tmp_path / "tf_xla.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {r["row"]: r for r in results["rows"]}
    assert list(rows) == list(tf_xla.ROWS) and results["settings"]["sizes"] == [20_000]
    for row in rows.values():
        assert row["ms"] > 0 and row["vs_clone"] == pytest.approx(row["ms"] / rows["clone"]["ms"])


def test_a_row_that_selects_otherwise_is_an_error(monkeypatch, tmp_path):
    passes = tf_xla._passes

    def wrong(g, r, limit):
        rows = passes(g, r, limit)
        rows["tf-xla"] = lambda: (rows["numpy"]()[0][1:], rows["numpy"]()[1])
        return rows

    monkeypatch.setattr(tf_xla, "_passes", wrong)
    with pytest.raises(RuntimeError, match="tf-xla selects otherwise than numpy"):
        tf_xla.run(sizes=[20_000], repeats=1, warmup=0, out=str(tmp_path))
