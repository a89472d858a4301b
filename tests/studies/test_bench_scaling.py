"""``python -m benchmarks scaling``: the model's formulas by hand, model-only and localhost runs."""

import json
import math

import pytest

from benchmarks import scaling
from benchmarks.cli import main

D = 10_000  # elements; k = 100 at ratio 0.01
B = 1e8  # bytes per second


def test_two_ranks_allreduce_is_one_buffer_each_way():
    # N=2: reduce-scatter and allgather each send half the buffer; 2 messages in sequence
    assert scaling.terms("dense", 2, D, 0.01) == (2.0, 4.0 * D)
    assert scaling.seconds("dense", 2, D, 0.01, alpha=0.0, bytes_per_second=B) == pytest.approx(4 * D / B)
    assert scaling.seconds("dense", 2, D, 0.01, alpha=1e-3, bytes_per_second=B) == pytest.approx(
        2e-3 + 4 * D / B
    )


def test_allreduce_tends_to_twice_the_buffer_and_allgather_grows_with_n():
    latency, nbytes = scaling.terms("dense", 1000, D, 0.01)
    assert latency == 2 * 999 and nbytes == pytest.approx(2 * 999 / 1000 * 4 * D)
    for n in (2, 4, 16):  # k = 100 (value + index) pairs from each of the n - 1 others
        assert scaling.terms("sparse", n, D, 0.01) == (n - 1, (n - 1) * 800.0)
    assert scaling.terms("dense", 1, D, 0.01) == (0.0, 0.0)


def test_terngrad_terms_by_hand():
    # N=2: 3-bit fields, 10 per lane: 4000 B packed vs 2500 B of 2-bit codes; 2 * 2500 < 2 * 4000: allgather
    # of 2-bit codes (N-1) * 2500 B; latency 2 (scale Max) + 1
    assert scaling.terms("terngrad", 2, D, 0.01) == (3.0, 2500.0)
    # N=4: 4-bit fields, 8 per lane: 1250 lanes = 5000 B; 4 * 2500 == 2 * 5000: allreduce, 2 * 3/4 * 5000 B
    assert scaling.terms("terngrad", 4, D, 0.01) == (6.0 + 6.0, 7500.0)


def test_latency_probes():
    assert scaling.terms("latency allreduce", 4, D, 0.01) == (6.0, 6.0)
    assert scaling.terms("latency allgather", 4, D, 0.01) == (3.0, 12.0)
    with pytest.raises(ValueError):
        scaling.terms("broadcast", 4, D, 0.01)


@pytest.mark.parametrize("d, ratio", [(10_000, 0.01), (11_689_512, 0.01), (1_000_000, 0.001), (5000, 0.07)])
def test_bandwidth_crossover_is_the_library_rule(d, ratio):
    # without latency, sparse (N-1) 8k >= dense 2 (N-1)/N 4d exactly when N k >= d
    n = scaling.crossover(d, ratio, alpha=0.0, bytes_per_second=B)
    k = math.ceil(ratio * d * (1 - 1e-12))
    assert n == max(2, math.ceil(d / k))
    assert n == scaling.library_crossover(d, ratio)
    assert scaling.crossover_closed_form(d, ratio, 0.0, B) == pytest.approx(d / k)


def test_latency_moves_the_crossover_to_the_closed_form():
    alpha = 2e-5  # alpha B = 2000 B against 8k = 800 000 B
    d, ratio = 11_689_512, 0.01
    k = 116_896
    closed = scaling.crossover_closed_form(d, ratio, alpha, B)
    assert closed == pytest.approx(8 * d / (8 * k - alpha * B))
    assert scaling.crossover(d, ratio, alpha, B) == math.ceil(closed)
    assert scaling.crossover_closed_form(d, ratio, alpha=1.0, bytes_per_second=B) is None  # latency-bound
    assert scaling.crossover(10_000, 0.01, 0.0, B, max_n=50) is None


def _points(alpha, bandwidth, ns=(2, 4, 8)):
    points = []
    for n in ns:
        for name in scaling.COLLECTIVES:
            latency, nbytes = scaling.terms(name, n, 1_000_000, 0.01)
            points.append(
                {"latency_terms": latency, "bytes": nbytes, "seconds": latency * alpha + nbytes / bandwidth}
            )
    return points


def test_fit_recovers_the_constants():
    alpha, bandwidth = scaling.fit(_points(1e-4, 1.25e8))
    assert alpha == pytest.approx(1e-4, rel=1e-6) and bandwidth == pytest.approx(1.25e8, rel=1e-6)
    assert scaling.fit_alpha(_points(3e-4, 1.25e8), 1.25e8) == pytest.approx(3e-4, rel=1e-6)
    assert scaling.fit_alpha(_points(0.0, 1.25e8), 1e8) == 0.0  # faster than nominal: clamped at zero


def test_model_only(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["scaling", "--measure", "none", "--rates", "1gbit,10gbit", "--max-ranks", "128"]
    assert main(args + ["--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scaling.json").read_text())
    s = results["settings"]
    assert s["measure"] == "none" and s["numel"] == 11_689_512 and s["k"] == 116_896
    assert results["library_rule"]["crossover_n"] == 100
    assert [lk["rate"] for lk in results["links"]] == ["1gbit", "10gbit"]
    for lk in results["links"]:
        assert lk["points"] == [] and list(lk["models"]) == ["nominal"]
        m = lk["models"]["nominal"]
        assert m["alpha_s"] == pytest.approx(1e-4) and m["bytes_per_second"] == lk["bits_per_second"] / 8
        c = m["curves"]
        assert c["n"][0] == 2 and c["n"][-1] == 128
        assert c["dense_s"][0] == pytest.approx(2e-4 + 4 * s["numel"] / m["bytes_per_second"])
        assert all(b > a for a, b in zip(c["sparse_s"], c["sparse_s"][1:]))  # allgather grows with N
        assert m["crossover_vs_dense"] >= 100  # latency only moves it later
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "stops paying at N >=" in capsys.readouterr().out


def test_localhost_measured_points(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    args = ["scaling", "--link", "none", "--ranks", "2", "--scale", "0.0625", "--repeats", "2"]
    assert main(args + ["--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "scaling.json").read_text())
    (lk,) = results["links"]
    assert lk["shaping"] == "none" and lk["bits_per_second"] is None
    assert [p["collective"] for p in lk["points"]] == list(scaling.COLLECTIVES)
    for p in lk["points"]:
        assert p["ranks"] == 2 and p["seconds"] > 0 and p["model_fit_s"] >= 0
    fit = lk["models"]["fit"]
    assert fit["alpha_s"] >= 0 and fit["bytes_per_second"] > 0 and fit["max_abs_rel_error"] >= 0
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "scaling.json" in capsys.readouterr().out


def test_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["scaling", "--measure", "some", "--out", str(tmp_path)])
    assert main(["scaling", "--link", "none", "--ranks", "1", "--out", str(tmp_path)]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_shared_index_terms_do_not_grow_with_n():
    # k = 100 values (and the leader's 100 int32 indices) through a ring allreduce: 2 (N-1)/N x each
    for n in (2, 16, 1000):
        ring = 2 * (n - 1) / n
        assert scaling.terms("shared leader", n, D, 0.01) == (4.0 * (n - 1), pytest.approx(ring * 800.0))
        assert scaling.terms("shared aggregate", n, D, 0.01) == (2.0 * (n - 1), pytest.approx(ring * 400.0))
        assert scaling.terms("dense fp16", n, D, 0.01) == (2.0 * (n - 1), pytest.approx(ring * 2.0 * D))


def test_break_even_against_fp16_by_hand():
    # bandwidth alone: the allgather's (N-1) 8k reaches 2 (N-1)/N 2d at N k = d / 2: N = 50 at 1%
    assert scaling.crossover(D, 0.01, 0.0, B, "dense fp16", sparse_kind="sparse") == 50
    assert scaling.crossover(D, 0.01, 0.0, B, "dense fp16", max_n=5000, sparse_kind="shared leader") is None
    # the leader's extra 2 (N-1) alpha catches up where 2 (N-1) alpha >= 2 (N-1)/N (2d - 8k) / B,
    # N >= (2d - 8k) / (alpha B) = 19 200 / 100
    alpha = 1e-6
    assert scaling.crossover(D, 0.01, alpha, B, "dense fp16", sparse_kind="shared leader") == 192
    assert scaling.crossover(D, 0.01, alpha, B, "dense fp16", max_n=5000, sparse_kind="shared aggregate") is None
