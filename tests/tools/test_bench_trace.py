"""``python -m benchmarks trace``: the counting rules on known operator sequences, the hand-written Top-k
hook it compares with, the shape models' sizes, and a tiny run of the command on the MLP (structure only,
no thresholds)."""

import io
import json
import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from benchmarks import routes, shapes, trace_step  # noqa: E402
from benchmarks.trace import count_ops, difference, top  # noqa: E402
from benchmarks.cli import main  # noqa: E402
from hvd_compress import DensityWarmup, TopK  # noqa: E402

F32 = 4


def _count(fn):
    with count_ops() as counts:
        fn()
    return counts


# ------------------------------------------------------------------ counting
def test_one_kernel_counts_its_inputs_and_output():
    a, b = torch.randn(10), torch.randn(10)
    counts = _count(lambda: torch.add(a, b))
    assert (counts.ops, counts.bytes, counts.waits) == (1, 3 * 10 * F32, 0)
    assert counts.by_op == {"add.Tensor": [1, 120]}


def test_in_place_and_out_variants_count_the_written_tensor_as_read_and_written():
    a, b = torch.randn(10), torch.randn(10)
    counts = _count(lambda: a.add_(b))
    assert (counts.ops, counts.bytes) == (1, 3 * 40)
    counts = _count(lambda: a.mul_(2.0))  # a Python scalar is no tensor: 0 bytes
    assert (counts.ops, counts.bytes) == (1, 2 * 40)


def test_views_allocations_and_metadata_are_not_kernels():
    x = torch.randn(4, 6)

    def no_kernels():
        x.view(24), x.reshape(6, 4), x.t(), x[1:], x[0], x.detach(), x.expand(2, 4, 6), x.unsqueeze(0)
        x.split(2), x.flatten(), x.to(torch.float32), torch.empty(5), torch.empty_like(x)
        x.new_empty(3), x.clone().unsqueeze_(0)

    counts = _count(no_kernels)
    assert counts.by_op == {"clone.default": [1, 2 * 24 * F32]}  # the one copy
    assert counts.waits == 0


def test_the_bytes_of_a_view_are_its_own_not_its_storage():
    x = torch.randn(1000)
    counts = _count(lambda: x[:10].neg())
    assert (counts.ops, counts.bytes) == (1, 2 * 10 * F32)


def test_a_sequence_of_kernels():
    x = torch.randn(8, 8)

    def step():
        y = x.abs().sum(dim=1)  # abs: 2 * 256 B, sum: 256 + 32 B
        return torch.topk(y, 3)  # 32 B in, 3 values (12 B) and 3 int64 indices (24 B) out

    counts = _count(step)
    assert counts.by_op == {"abs.default": [1, 512], "sum.dim_IntList": [1, 288], "topk.default": [1, 68]}
    assert (counts.ops, counts.bytes, counts.waits) == (3, 868, 0)


@pytest.mark.parametrize(
    "name, read",
    [
        ("nonzero.default", lambda x, m: x.nonzero()),
        ("_local_scalar_dense.default", lambda x, m: x.sum().item()),
        ("_local_scalar_dense.default", lambda x, m: bool(x[0] > 0)),
        ("masked_select.default", lambda x, m: x.masked_select(m)),
        ("index.Tensor", lambda x, m: x[m]),  # bool-mask indexing
        ("index_put_.default", lambda x, m: x.clone().index_put_((m,), torch.zeros(()))),
        ("_unique2.default", lambda x, m: torch.unique(m)),
        ("repeat_interleave.Tensor", lambda x, m: torch.repeat_interleave(m.long())),
        ("lift_fresh.default", lambda x, m: torch.tensor([1.0, 2.0])),  # host data: an upload on a device
        ("tolist", lambda x, m: x.tolist()),  # dispatches nothing on the CPU; counted as a host read
    ],
)
def test_each_kind_of_device_wait_is_counted_once(name, read):
    x = torch.randn(10)
    mask = torch.arange(10) % 3 == 0
    counts = _count(lambda: read(x, mask))
    assert counts.waits == 1 and dict(counts.waits_by_op) == {name: 1}, counts.as_dict()


def test_a_python_scalar_written_at_indices_is_a_wait():
    """``a[idx] = 0``: ``index_put_`` of a scalar lifted to a 0-dim CPU tensor, which CUDA copies to
    the device with a blocking ``to(device)`` (a host wait per call)."""
    x, idx = torch.randn(10), torch.tensor([1, 4])

    def step():
        y = x.clone()
        y[idx] = 0
        y[idx] = 2.5

    counts = _count(step)
    assert counts.waits == 2 and dict(counts.waits_by_op) == {"index_put_.default": 2}, counts.as_dict()


def test_sizes_known_in_advance_and_scalars_are_no_waits():
    x = torch.randn(10)
    idx = torch.tensor([1, 4])

    def step():
        torch.repeat_interleave(torch.full((3,), 2), output_size=6)
        x.clone().index_fill_(0, idx, 0)  # a Python scalar is a kernel argument, not an upload
        x.clone()[1:3] = 0  # a slice written with a scalar: fill_
        x.clone().index_put_((idx,), x.sum())  # a 0-dim value computed here (on a device: there)
        x[idx]  # integer indexing: no count needed
        x.topk(3)

    counts = _count(step)
    assert counts.waits == 0, counts.as_dict()
    assert counts.ops > 0


def test_callbacks_of_futures_completed_on_another_thread_are_counted():
    x = torch.randn(10)
    future = torch.futures.Future()
    original = torch._C.Future.then
    with count_ops() as counts:
        chained = future.then(lambda f: f.value() * 2)
        worker = threading.Thread(target=future.set_result, args=(x,))
        worker.start()
        worker.join()
        result = chained.wait()
    assert torch.equal(result, x * 2)
    assert counts.by_op == {"mul.Tensor": [1, 80]}
    assert torch._C.Future.then is original


def test_collectives_are_counted_apart():
    with routes.process_group(cuda=False):
        x = torch.ones(10)
        counts = _count(lambda: dist.all_reduce(x))
    assert (counts.collectives, counts.collective_bytes) == (1, 40)
    assert counts.ops == 0


def test_difference_and_top():
    added = difference({"add": [3, 300], "mul": [2, 50]}, {"add": [1, 100], "neg": [1, 8]})
    assert added == {"add": [2, 200], "mul": [2, 50], "neg": [-1, -8]}
    assert top(added, 1, 5) == [("add", 2, 200), ("mul", 2, 50)]
    assert top(added, 0, 1) == [("add", 2, 200)]


# ------------------------------------------------------- the hand-written hook
class _Bucket:
    """What the hook uses of ``dist.GradBucket``."""

    def __init__(self, flat, index=0):
        self.flat, self.i = flat, index

    def buffer(self):
        return self.flat

    def index(self):
        return self.i


def test_handwritten_hook_is_topk_with_error_feedback():
    ratio, numel = 0.05, 300
    k = math.ceil(ratio * numel)
    state = routes.HandwrittenTopKState(ratio)
    rng = np.random.default_rng(0)
    residual = np.zeros(numel, dtype=np.float32)
    with routes.process_group(cuda=False):
        for step in range(4):
            grad = rng.standard_normal(numel).astype(np.float32)
            a = grad + residual
            chosen = np.argsort(-np.abs(a), kind="stable")[:k]
            expected = np.zeros(numel, dtype=np.float32)
            expected[chosen] = a[chosen]  # world size 1: the average is this rank's top-k
            residual = a.copy()
            residual[chosen] = 0

            result = routes.handwritten_topk_hook(state, _Bucket(torch.from_numpy(grad.copy()))).wait()
            assert result.dtype == torch.float32 and result.shape == (numel,)
            np.testing.assert_array_equal(result.numpy(), expected, err_msg=f"step {step}")
            np.testing.assert_array_equal(state.residuals[0].numpy(), residual)
            assert int((result != 0).sum()) == k
    assert not dist.is_initialized()


# ------------------------------------------------------------- shape models
@pytest.mark.parametrize("model", ["resnet50", "gpt2"])
def test_shape_models_have_the_real_parameter_counts(model):
    named = shapes.SHAPES[model]()
    assert len(named) == shapes.TENSORS[model]
    assert sum(math.prod(s) for _, s in named) == shapes.PARAMETERS[model]
    assert len({n for n, _ in named}) == len(named)


def test_resnet50_and_gpt2_shapes_spot_checks():
    r50 = dict(shapes.resnet50_shapes())
    assert r50["conv1.weight"] == (64, 3, 7, 7) and r50["fc.weight"] == (1000, 2048)
    assert r50["layer3.0.downsample.0.weight"] == (1024, 512, 1, 1)
    assert r50["layer4.2.conv2.weight"] == (512, 512, 3, 3)
    gpt2 = shapes.gpt2_shapes()
    assert gpt2[:2] == [("wte.weight", (50257, 768)), ("wpe.weight", (1024, 768))]
    assert dict(gpt2)["h.11.mlp.c_fc.weight"] == (768, 3072)


def test_a_shape_model_gives_every_parameter_its_gradient():
    small = [("a.weight", (3, 4)), ("a.bias", (3,)), ("b.weight", (2, 2, 3, 3))]
    load = shapes.ShapeWorkload("resnet50", torch.device("cpu"), seed=0)
    load.names, load.shapes = [n for n, _ in small], [s for _, s in small]
    model = load.build()
    load.loss(model).backward()
    for p in model.parameters():
        torch.testing.assert_close(p.grad.reshape(-1), load.inputs[: p.numel()])  # d loss / d p = x[:numel]


# ------------------------------------------------------------------ command
def test_cli_traces_the_mlp_and_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "trace.json", tmp_path / "trace.png"
    argv = ["trace", "--model", "mlp", "--warmup", "1", "--compressors", "none,topk"]
    argv += ["--routes", "ours-dropin", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["benchmark"] == "trace" and results["settings"]["model"] == "mlp"
    rows = {(r["route"], r["compressor"]): r for r in results["rows"]}
    assert list(rows) == [
        ("local", "none"),
        ("ddp+handwritten-topk", "topk"),
        ("ours-dropin", "none"),
        ("ours-dropin", "topk"),
    ]
    for row in rows.values():
        assert row["error"] is None, row
        assert row["ops"] > 0 and row["bytes"] > 0 and isinstance(row["device_waits"], int)
        assert row["added_ops"] == row["ops"] - rows["local", "none"]["ops"]
        assert row["added_bytes"] == row["bytes"] - rows["local", "none"]["bytes"]
        for entry in row["top_ops_by_bytes"] + row["top_ops_by_count"]:
            assert set(entry) == {"op", "calls", "bytes"}
    assert rows["local", "none"]["added_ops"] == 0 and rows["local", "none"]["top_ops_by_count"] == []
    peer = rows["ddp+handwritten-topk", "topk"]
    assert peer["ops_vs_handwritten"] == 1.0 and peer["bytes_vs_handwritten"] == 1.0
    assert peer["collectives"] > 0  # its allgathers, through torch.distributed
    assert "scatter_add_.default" in {e["op"] for e in peer["top_ops_by_count"]}  # decoded in a callback
    for compressor in ("none", "topk"):
        dropin = rows["ours-dropin", compressor]
        assert dropin["device_waits"] == 0, dropin  # the accelerator's path reads nothing back
        assert dropin["ops_vs_handwritten"] == dropin["added_ops"] / peer["added_ops"]
    table = capsys.readouterr().out
    for route, compressor in rows:
        assert any(line.split()[:2] == [route, compressor] for line in table.splitlines()), table
    assert not dist.is_initialized()


def test_a_failing_row_is_reported_and_the_others_run(tmp_path, monkeypatch, capsys):
    def broken(state, bucket):
        raise RuntimeError("hook exploded")

    monkeypatch.setattr(routes, "handwritten_topk_hook", broken)
    results = trace_step.run(
        model="mlp", warmup=1, compressors=["none"], routes=["ours-dropin"], progress=False, stdout=None
    )
    peer, dropin = results["rows"][1], results["rows"][2]
    assert "hook exploded" in peer["error"] and peer["ops"] is None
    assert dropin["error"] is None and dropin["added_ops"] >= 0
    assert dropin["ops_vs_handwritten"] is None  # no peer to compare with
    assert "error: RuntimeError: hook exploded" in capsys.readouterr().out


def test_ramp_traces_a_step_of_a_density_warmup():
    """``ramp``: every step a new density, so the traced step builds a plan (its header check reads the
    host); rows without a density trace a steady step."""
    results = trace_step.run(model="mlp", warmup=2, compressors=["none", "topk"], routes=["ours-dropin"],
                             progress=False, stdout=io.StringIO(), ramp=True)
    rows = {(r["route"], r["compressor"]): r for r in results["rows"]}
    topk, none = rows["ours-dropin", "topk"], rows["ours-dropin", "none"]
    assert topk["ramp"] and not none["ramp"] and "DensityWarmup" in results["settings"]["ramp"]
    ratio = results["settings"]["ratio"]
    ramp = DensityWarmup(TopK(ratio), trace_step.RAMP_STEPS, start=2 * ratio)
    assert topk["density"] == ramp.density_at(3) and ratio < topk["density"] < 2 * ratio
    assert topk["host_reads"].get("tolist", 0) >= 1, topk  # the new plan's check across ranks
    assert none["device_waits"] == 0, none


def test_bad_options_are_refused_before_any_work():
    with pytest.raises(ValueError, match="warmup"):
        trace_step.run(model="mlp", warmup=0)
    with pytest.raises(ValueError, match="unknown route"):
        trace_step.run(model="mlp", routes=["ddp+powersgd"])
    with pytest.raises(ValueError, match="model"):
        trace_step.run(model="vgg")
    with pytest.raises(SystemExit):  # argparse: exit status 2
        main(["trace", "--model", "mlp", "--compressors", "auto-regtopk"])
