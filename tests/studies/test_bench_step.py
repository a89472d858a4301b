"""``python -m benchmarks step``: tiny runs on localhost, and on an emulated link where root allows."""

import json
import os
import subprocess

import pytest

pytest.importorskip("torch")

from benchmarks import cluster, step, wire  # noqa: E402
from benchmarks.cli import main  # noqa: E402

ROW_FIELDS = {
    "rate",
    "compressor",
    "step_s",
    "compute_s",
    "exchange_s",
    "compress_s",
    "communicate_s",
    "update_s",
    "speedup",
    "speedup_without_compress",
    "payload_bytes",
    "traffic_bytes",
    "tx_bytes",
    "link_time_s",
    "payload_vs_dense",
}
TINY = ["--ranks", "2", "--scale", "0.0625", "--compute-ms", "1"]


def test_layer_macs_add_up_to_resnet18():
    assert step.layer_macs("conv1.weight", (64, 3, 7, 7)) == 64 * 3 * 49 * 112 * 112
    assert step.layer_macs("layer4.1.conv2.weight", (512, 512, 3, 3)) == 512 * 512 * 9 * 7 * 7
    assert step.layer_macs("fc.weight", (1000, 512)) == 512_000
    assert step.layer_macs("bn1.weight", (64,)) == 0 and step.layer_macs("fc.bias", (1000,)) == 0
    total = sum(step.layer_macs(n, s) for n, s in wire.resnet18_shapes())
    assert total == pytest.approx(1.814e9, rel=0.01)  # ResNet-18: 1.8 G multiply-adds at 224x224


class _FourRanks:
    """A world of four that returns its inputs: enough to count bytes."""

    matches_by_order, SUM, MAX, rank, size = True, "sum", "max", 0, 4

    def allreduce_async(self, tensor, op, name):
        return tensor

    def allreduce_donated_async(self, tensor, op, name):
        return tensor

    def allgather_async(self, tensor, name, rows=None):
        return tensor

    def wait(self, handle):
        return handle


def test_counting_communicator_bytes_by_hand():
    import torch

    comm = step.CountingCommunicator(_FourRanks())
    comm.wait(comm.allreduce_async(torch.zeros(100), comm.SUM, "a"))  # 400 B: ring sends 2 * 3/4 * 400
    comm.wait(comm.allgather_async(torch.zeros(10, dtype=torch.int32), "g"))  # 40 B: ring sends 3 * 40
    comm.wait(comm.allreduce_donated_async(torch.zeros(50), comm.SUM, "d"))  # 200 B: 2 * 3/4 * 200
    assert comm.payload == 640
    assert comm.traffic == pytest.approx(600 + 120 + 300)
    assert comm.calls == {"allreduce": 2, "allgather": 1}


def _check(path, rates, names):
    results = json.loads((path / "step.json").read_text())
    s = results["settings"]
    assert s["ranks"] == 2 and s["rates"] == rates and s["compressors"] == names
    assert {"cpu_count", "devices"} <= set(results["machine"])
    assert "note" in s and "oversubscribed" in s
    rows = {(r["rate"], r["compressor"]): r for r in results["rows"]}
    assert set(rows) == {(rate, name) for rate in rates for name in names}
    for (rate, name), row in rows.items():
        assert ROW_FIELDS <= set(row), row
        assert row["step_s"] > 0 and row["compute_s"] >= 0 and row["compress_s"] >= 0
        parts = row["compute_s"] + row["exchange_s"] + row["update_s"]
        assert parts == pytest.approx(row["step_s"])
        assert row["exchange_s"] == pytest.approx(row["compress_s"] + row["communicate_s"])
        dense = rows[(rate, "none")]
        assert row["speedup"] == pytest.approx(dense["step_s"] / row["step_s"])
        if name.startswith(step.AUTO_PREFIX):  # Auto: sent each bucket one way or the other
            assert row["auto_dense_buckets"] + row["auto_compressed_buckets"] == len(row["auto_decisions"]) >= 1
        elif name != "none":
            assert row["payload_bytes"] < dense["payload_bytes"]
            assert row["traffic_bytes"] < dense["traffic_bytes"]
    for rate in rates:
        dense = rows[(rate, "none")]
        assert dense["payload_bytes"] >= 4 * s["numel"]  # every gradient in fp32, plus headers
        assert dense["dense_check"] < 1e-5  # the averaged gradients add up
    assert (path / "step.png").stat().st_size > 0
    return results, rows


def test_localhost_every_compressor(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    args = ["step", "--link", "none", *TINY, "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    results, rows = _check(tmp_path, ["none"], list(step.ROWS))
    assert {g["compressor"] for g in results["auto_goals"]} <= {"auto-regtopk"}
    assert results["links"][0]["shaping"] == "none"
    assert all(r["tx_bytes"] is None and r["link_time_s"] is None for r in rows.values())
    assert rows[("none", "fp16")]["payload_vs_dense"] < 0.6
    for name in ("topk", "gaussiank", "regtopk", "terngrad"):
        assert rows[("none", name)]["payload_vs_dense"] < 0.5
    out = capsys.readouterr().out
    assert "step.json" in out and "speedup" in out


def _namespaces():
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def test_emulated_link(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    problem = cluster.emulation_problem()
    if problem:
        pytest.skip(f"no emulated link here: {problem}")
    before = _namespaces()
    args = ["step", "--rates", "1gbit", *TINY, "--steps", "1", "--warmup", "0"]
    assert main(args + ["--compression", "topk", "--out", str(tmp_path)]) == 0
    assert _namespaces() <= before, "bench step left network namespaces behind"
    results, rows = _check(tmp_path, ["1gbit"], ["none", "topk"])
    (lk,) = results["links"]
    assert lk["bits_per_second"] == 1e9 and lk["shaping"] in ("netem", "tbf")
    for row in rows.values():
        assert row["tx_bytes"] >= 0.9 * row["traffic_bytes"]  # the bytes did cross the namespaces' links
        assert row["link_time_s"] == pytest.approx(8 * row["traffic_bytes"] / 1e9)
    (target,) = results["targets"]  # printed and recorded, never asserted
    assert target["compressor"] == "topk" and target["target"] == 5.0
    assert "MISSED" in capsys.readouterr().out or target["met"]


def test_emulation_without_root_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["step", "--rates", "1gbit", *TINY, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "needs" in err and "--link none" in err
    assert not (tmp_path / "step.json").exists()


def test_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["step", "--rates", "1gb", "--out", str(tmp_path)])
    assert main(["step", "--link", "none", "--ranks", "1", "--out", str(tmp_path)]) == 2
    assert "ranks must be at least 2" in capsys.readouterr().err
    assert main(["step", "--link", "none", "--ratio", "0", "--out", str(tmp_path)]) == 2
    assert "ratio must be in (0, 1]" in capsys.readouterr().err


def test_a_rank_that_crashes_after_writing_its_result_is_done_one_before_fails():
    """Gloo may abort a process while its peers leave the process group: a rank whose result is
    written is done; a rank that dies without one stops the job with its exit code."""
    link = cluster.Link(nodes=2)
    results = cluster.run_workers(link, 2, "tests.studies.abort_worker", {"mode": "after"}, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    with pytest.raises(RuntimeError, match="exited with -6"):
        cluster.run_workers(link, 2, "tests.studies.abort_worker", {"mode": "before"}, timeout=60)
