"""``python -m benchmarks train-step`` on the CPU: the tiny MLP, a few steps (no timing assertions)."""

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from benchmarks import train_step  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from benchmarks import routes  # noqa: E402

COLUMNS = {
    "route",
    "compressor",
    "median_ms",
    "min_ms",
    "ratio",
    "overhead_ms",
    "host_syncs_per_step",
    "peak_mem_mib",
    "error",
}
TINY = ["--model", "mlp", "--device", "cpu", "--steps", "2", "--warmup", "1", "--batch", "4"]


def _horovod_imports() -> bool:
    try:
        import horovod.torch  # noqa: F401
    except Exception:  # noqa: BLE001
        if os.environ.get("HVD_COMPRESS_REQUIRE_HOROVOD") == "1":
            raise
        return False
    return True


def test_cli_writes_json_and_png_with_every_row(tmp_path, capsys):
    out, png = tmp_path / "ts.json", tmp_path / "sub" / "ts.png"
    assert main(["train-step", *TINY, "--json", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    s = results["settings"]
    assert (s["model"], s["batch"], s["world_size"]) == ("mlp", 4, 1)
    assert (s["device"], s["backend"]) == ("cpu", "gloo")
    assert s["torch_version"] == torch.__version__ and s["device_name"] and s["date"]

    expected = train_step.plan(train_step.ROUTES, train_step.COMPRESSORS)
    stock = [(r, c) for r, c in expected if r == "ours-stock-horovod"]
    assert len(expected) == 5 + 3 * len(train_step.COMPRESSORS)
    if not _horovod_imports():
        expected = [rc for rc in expected if rc not in stock]
        assert [(r["route"], r["compressor"]) for r in results["skipped"]] == stock
    assert [(r["route"], r["compressor"]) for r in results["rows"]] == expected

    for row in results["rows"]:
        assert COLUMNS <= set(row), row
        assert row["error"] is None, row
        assert row["median_ms"] > 0 and 0 < row["min_ms"] <= row["median_ms"]
        assert row["ratio"] > 0 and isinstance(row["host_syncs_per_step"], int)
        assert row["overhead_ms"] == pytest.approx(row["median_ms"] - results["rows"][1]["median_ms"])
        assert row["peak_mem_mib"] is None or row["peak_mem_mib"] >= 0
    (ddp,) = [r for r in results["rows"] if r["route"] == "ddp"]
    assert ddp["ratio"] == 1.0 and ddp["overhead_ms"] == 0.0
    powersgd = next(r for r in results["rows"] if r["route"] == "ddp+powersgd")
    assert powersgd["warmup"] == train_step.POWERSGD_START + 1  # timed past PowerSGD's warm-up

    table = capsys.readouterr().out
    for route, compressor in expected:
        assert any(line.split()[:2] == [route, compressor] for line in table.splitlines()), table
    assert not dist.is_initialized()  # the benchmark's one-rank group is gone


def test_a_failing_row_is_reported_and_the_others_run(tmp_path, capsys, monkeypatch):
    def broken(state, bucket):  # fails inside backward, in the middle of a step
        raise RuntimeError("hook exploded")

    monkeypatch.setattr(routes, "handwritten_topk_hook", broken)
    out = tmp_path / "ts.json"
    argv = ["--routes", "ddp+handwritten-topk,ours-ddp-hook", "--compressors", "topk,terngrad"]
    assert main(["train-step", *TINY, *argv, "--json", str(out), "--plot", ""]) == 0
    rows = {(r["route"], r["compressor"]): r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == [
        ("ddp", "none"),
        ("ddp+handwritten-topk", "topk"),
        ("ours-ddp-hook", "topk"),
        ("ours-ddp-hook", "terngrad"),
    ]
    failed = rows.pop(("ddp+handwritten-topk", "topk"))
    assert "hook exploded" in failed["error"] and failed["median_ms"] is None and failed["ratio"] is None
    assert all(r["error"] is None and r["ratio"] > 0 for r in rows.values())
    captured = capsys.readouterr()
    assert "hook exploded" in captured.err
    assert "error: RuntimeError" in captured.out  # in the table too


def test_clear_errors(capsys):
    if not torch.cuda.is_available():
        assert main(["train-step", "--device", "cuda", "--json", "", "--plot", ""]) == 2
        assert "torch.cuda.is_available() is False" in capsys.readouterr().err
    try:
        import torchvision  # noqa: F401
    except ImportError:
        assert main(["train-step", "--model", "resnet50", "--json", "", "--plot", ""]) == 2
        assert "hvd_compress[bench-gpu]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-step", "--routes", "ddp,nope"])
    assert "unknown 'nope'" in capsys.readouterr().err


def test_resnet50_and_gpt2_inputs_with_stand_in_packages(monkeypatch):
    """The optional models' plumbing (inputs, labels, loss), tiny stand-ins for torchvision/transformers."""
    import types

    class _LM(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.embed = torch.nn.Embedding(config.vocab_size, 8)
            self.head = torch.nn.Linear(8, config.vocab_size)

        def forward(self, input_ids, labels, use_cache):
            assert input_ids.shape == (1, train_step.GPT2_SEQUENCE) and labels is input_ids and not use_cache
            logits = self.head(self.embed(input_ids))
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return types.SimpleNamespace(loss=loss)

    def resnet50():
        conv = torch.nn.Conv2d(3, 4, 7, stride=8)
        pool = torch.nn.AdaptiveAvgPool2d(1)
        return torch.nn.Sequential(conv, pool, torch.nn.Flatten(), torch.nn.Linear(4, 1000))

    models = types.ModuleType("torchvision.models")
    models.resnet50 = resnet50
    vision = types.ModuleType("torchvision")
    vision.models = models
    transformers = types.ModuleType("transformers")
    transformers.GPT2Config = lambda: types.SimpleNamespace(vocab_size=50)
    transformers.GPT2LMHeadModel = _LM
    monkeypatch.setitem(sys.modules, "torchvision", vision)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    for model in ("resnet50", "gpt2"):
        results = train_step.run(
            model=model, steps=1, warmup=0, batch=1, routes=["ddp"], compressors=["topk"], progress=False
        )
        (row,) = results["rows"]
        assert row["error"] is None and row["ratio"] == 1.0, row


def test_profile_records_kernels_and_milliseconds_of_a_steady_step(tmp_path, capsys):
    """``--profile`` on the CPU: operator calls and their time per row, and what each adds to ``local``."""
    out = tmp_path / "ts.json"
    argv = ["--routes", "local,ddp+handwritten-topk,ours-dropin", "--compressors", "topk", "--dropin-comm", "torch"]
    assert main(["train-step", *TINY, *argv, "--profile", "--json", str(out), "--plot", ""]) == 0
    results = json.loads(out.read_text())
    assert "innermost aten operator calls" in results["settings"]["profile"]
    rows = {(r["route"], r["compressor"]): r for r in results["rows"]}
    for row in rows.values():
        assert row["error"] is None, row
        assert row["profile"]["kernels"] > 0 and row["profile"]["device_ms"] > 0, row
    assert rows["local", "none"]["profile_added"] == {"kernels": 0, "device_ms": 0}
    for route in ("ddp+handwritten-topk", "ours-dropin"):  # the exchange's selection and decode on top
        assert rows[route, "topk"]["profile_added"]["kernels"] > 0, rows[route, "topk"]
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[-3:] == ["kernels", "op", "ms"] for line in lines), lines
    dropin = next(line.split() for line in lines if line.split()[:2] == ["ours-dropin", "topk"])
    assert int(dropin[-2]) == rows["ours-dropin", "topk"]["profile"]["kernels"]


def test_profile_counts_innermost_kernels_on_the_cpu():
    """The CPU's count: one per chain of operator calls that launches a kernel; views and allocations none."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.step_profile import summarize

    a, b = torch.randn(1000), torch.randn(1000)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.add(a, b)  # 1
        a.view(10, 100), a.unsqueeze(0), torch.empty(5)  # 0: views, an allocation
        a.abs().sum()  # abs (through its out variant) 1, sum 1
        a.clone()  # the copy 1
    summary = summarize(prof.events(), cuda=False)
    assert summary["kernels"] == 4 and summary["device_ms"] > 0, summary
