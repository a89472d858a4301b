"""Our compressors in real multi-process Horovod runs: stock ``horovod.torch`` and ``hvd_compress.torch``.

Each run trains a small model a few steps under ``horovodrun --gloo`` or
``mpirun``; the final parameters must equal the in-process Simulator fed the
same gradients (tolerance 1e-6 absolute; FP16 1e-4, since Horovod sums float16
in float16; bfloat16 bit for bit), and the bytes handed to Horovod collectives must be the
compressed ones.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from tests.distributed import launch
from tests.distributed import torch_horovod as workload

SPARSE = ["topk", "gaussiank", "regtopk"]
ALL = SPARSE + ["terngrad", "fp16", "none"]
#: shared index sets (indices='leader' / 'aggregate'): values allreduced at one index set; reused thresholds
SHARED = ["regtopk-leader", "topk-aggregate", "topk-reuse"]
STEPS = 4

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _horovod():
    launch.require_horovod_torch()


def run_workload(kind, ranks, names, tmp_path, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.npz"
    done = launch.run(
        kind,
        ranks,
        "tests.distributed.torch_horovod",
        "--compression",
        *names,
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        *extra,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return np.load(out)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """:func:`run_workload` for the tests of the module that run the same job (each route's test of a job
    that trains both routes, ``--path stock dropin``): launched once, by the first test that asks."""
    done = {}

    def run(kind, ranks, names, *extra):
        key = (kind, ranks, tuple(names), extra)
        if key not in done:
            done[key] = run_workload(kind, ranks, names, tmp_path_factory.mktemp("job"), *extra)
        return done[key]

    return run


def route(result, path):
    """The results of route ``path`` in a job of both routes (keys ``<path>-<name>/...``), keyed
    ``<name>/...`` as in a job of one route; ``wire`` and ``stats`` keyed by name likewise."""
    prefix = f"{path}-"
    own = {key[len(prefix):]: result[key] for key in result.files if key.startswith(prefix)}
    for part in ("wire", "stats"):
        by_key = json.loads(str(result[part]))
        own[part] = json.dumps({key[len(prefix):]: v for key, v in by_key.items() if key.startswith(prefix)})
    return own


def assert_equals_simulator(result, names, ranks):
    launch.assert_equals_simulator(result, names, lambda name: workload.simulate(name, ranks, STEPS))


def expected_topk_bytes(path):
    """What one rank hands Horovod per step (mean of STEPS) with Top-k: k indices + values and one
    NaN flag with its position per weight, the dense biases (in the fused bucket's dense allreduce), at the first step
    only the int64 header ``[config, layout]`` of the single fused bucket, and (stock) a 4-byte
    placeholder per parameter for Horovod's allreduce."""
    params = [p for _, p in workload.make_model().named_parameters()]
    sparse = [p for p in params if p.numel() >= 1024]
    total = sum(4 * p.numel() for p in params if p.numel() < 1024)
    total += sum(8 * int(np.ceil(workload.RATIO * p.numel())) + 8 for p in sparse)
    placeholders = 4 * len(params) if path == "stock" else 0
    return total + placeholders + HEADER // STEPS


#: the int64 header ``[config, layout]`` of the model's one fused bucket, at the first step
HEADER = 16


def first_step_check_bytes():
    """Stock route, None or FP16, per step (mean of STEPS): at the first step every parameter
    travels through our fused bucket (its header, once: the ranks' check that they run the same
    compressor) and hands Horovod a 4-byte placeholder; then Horovod's allreduce moves the
    gradient."""
    return (HEADER + 4 * len(list(workload.make_model().parameters()))) // STEPS


@pytest.mark.parametrize(
    "kind, path", [("horovodrun", "stock"), ("mpirun", "stock"), ("horovodrun", "dropin")]
)
def test_two_ranks_equal_simulator_and_send_compressed_bytes(kind, path, shared_run):
    """horovodrun: one job trains both routes; mpirun: the stock route."""
    paths = ("stock", "dropin") if kind == "horovodrun" else ("stock",)
    result = shared_run(kind, 2, ALL + SHARED, "--path", *paths)
    result = route(result, path) if len(paths) > 1 else result
    assert_equals_simulator(result, ALL + SHARED, 2)
    wire = json.loads(str(result["wire"]))
    dense = 4 * sum(p.numel() for p in workload.make_model().parameters())
    # the fused bucket's [config, layout] header, once; stock: with a placeholder per parameter
    header = first_step_check_bytes() if path == "stock" else HEADER // STEPS
    assert wire["none"] == [dense + header] * 2
    assert wire["fp16"] == [dense // 2 + header] * 2
    assert wire["topk"] == [expected_topk_bytes(path)] * 2
    for name in ("gaussiank", "regtopk", "terngrad"):
        assert max(wire[name]) < dense / 5, (name, wire[name], dense)
    # compressor.stats counts every byte handed to the collectives (ours and Horovod's allreduce)
    for name, totals in json.loads(str(result["stats"])).items():
        assert [handed - counted for handed, counted in totals] == [0] * 2, (name, totals)


@pytest.mark.parametrize("path", ["stock", "dropin"])
def test_four_ranks_mpirun_equal_simulator(path, shared_run):
    """One job of 4 ranks trains both routes."""
    names = ["regtopk", "terngrad", "gaussiank", "topk-momentum", "topk-leader", "gaussiank-aggregate", "topk-traffic"]
    assert_equals_simulator(route(shared_run("mpirun", 4, names, "--path", "stock", "dropin"), path), names, 4)


def test_dropin_checkpoint_resumes_exactly(tmp_path):
    """Save model + optimizer (with residuals) at step 5, restore into fresh objects, run to 10; the
    same job trains each compressor straight through first (``resume-1-``), then resumed (``resume5-``)."""
    names = ["topk", "regtopk", "terngrad"]
    result = run_workload(
        "horovodrun", 2, names, tmp_path, "--path", "dropin", "--steps", "10", "--resume-at", "-1", "5"
    )
    straight = [key for key in result.files if key.startswith("resume-1-")]
    assert len(straight) == len(names) * len(list(workload.make_model().parameters())), result.files
    for key in straight:
        resumed = key.replace("resume-1-", "resume5-", 1)
        np.testing.assert_array_equal(result[resumed], result[key], err_msg=resumed)


@pytest.mark.parametrize("path", ["stock", "dropin"])
def test_accumulation_and_predivide_equal_simulator(path, shared_run):
    """backward_passes_per_step=2 (gradients of two batches summed) and gradient_predivide_factor=2
    (one job trains both routes)."""
    names = ["regtopk", "terngrad"]
    result = route(
        shared_run("horovodrun", 2, names, "--path", "stock", "dropin", "--passes", "2", "--predivide", "2"), path
    )
    for name in names:
        expected = workload.simulate(name, 2, STEPS, passes=2)
        for param, value in expected.items():
            np.testing.assert_allclose(result[f"{name}/{param}"], value, rtol=0, atol=1e-6, err_msg=param)


@pytest.mark.parametrize("path", ["stock", "dropin"])
def test_float16_gradients_equal_simulator(path, shared_run):
    """A float16 model trains as on the Simulator. Horovod sums the dense float16 biases in
    float16, the Simulator in float32, so an entry can round differently and, later, a
    selection can flip: at most 0.1% of the weights may differ by more than 1e-3, none by 1e-2
    (one job trains both routes)."""
    names = ["topk", "regtopk", "terngrad"]
    result = route(shared_run("horovodrun", 2, names, "--path", "stock", "dropin", "--half"), path)
    for name in names:
        expected = workload.simulate(name, 2, STEPS, dtype=torch.float16)
        for param, value in expected.items():
            difference = np.abs(result[f"{name}/{param}"] - value)
            assert difference.max() < 1e-2, (name, param, difference.max())
            assert np.mean(difference > 1e-3) <= 1e-3, (name, param, np.mean(difference > 1e-3))


def test_bfloat16_gradients_equal_simulator_on_both_routes(tmp_path):
    """A bfloat16 model with every compressor, stock and drop-in, in one launch: Horovod 0.28.1
    carries no bfloat16, so sums travel as float32 (over 2 ranks exactly bfloat16's sum) and gathered
    values as their raw bits. The parameters equal the Simulator's (bfloat16, ``torch.optim.SGD``'s
    update) bit for bit; FP16's within two bfloat16 steps (2^-6 relative), since Horovod sums its
    float16 in float16 and the Simulator in float32."""
    result = run_workload("horovodrun", 2, ALL, tmp_path, "--path", "stock", "dropin", "--dtype", "bfloat16")
    for name in ALL:
        expected = workload.simulate(name, 2, STEPS, dtype=torch.bfloat16)
        for path in ("stock", "dropin"):
            for param, value in expected.items():
                got, where = result[f"{path}-{name}/{param}"], f"{path} {name} {param}"
                if name == "fp16":
                    np.testing.assert_allclose(got, value, rtol=2**-6, atol=1e-5, err_msg=where)
                else:
                    np.testing.assert_array_equal(got, value, err_msg=where)


def test_op_sum_equals_average_of_scaled_loss(tmp_path):
    names = ["topk", "terngrad"]
    assert_equals_simulator(run_workload("horovodrun", 2, names, tmp_path, "--op", "sum"), names, 2)


@pytest.mark.parametrize(
    "compression, extra, message",
    # A NaN gradient on rank 1 with the drop-in's strict mode: every rank raises at that step.
    # Mismatched ratio: rank 1 reaches optimizer.step() 2 s after rank 0 has found the mismatch;
    # rank 0 must not exit (and take Horovod down under rank 1) before rank 1 has raised it too.
    [
        ("topk", ("--rank1-ratio", "0.2", "--rank1-delay", "2"), "ranks disagree"),
        ("gaussiank", ("--rank1-nan", "--path", "dropin", "--nonfinite", "raise"), "nonfinite='raise'"),
    ],
    ids=["mismatched-ratio", "nan-gradient-strict"],
)
def test_bad_configuration_fails_fast_with_a_clear_error(compression, extra, message, tmp_path):
    start = time.monotonic()
    done = launch.run(
        "horovodrun",
        2,
        "tests.distributed.torch_horovod",
        "--compression",
        compression,
        "--steps",
        "2",
        "--out",
        str(tmp_path / "x.npz"),
        *extra,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert message in output, output[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    for rank in (0, 1):  # a collective check: every rank must report it
        assert message in (tmp_path / f"x.npz.error.{rank}").read_text()


def test_bfloat16_model_starts_as_the_readme_says(tmp_path):
    """Horovod 0.28.1's broadcasts refuse bfloat16; the README's lines (``broadcast_parameters`` of int16
    views, ``broadcast_object`` of the optimizer's state) give every rank rank 0's model and momentum, and
    the stock route with None counts a dense exchange's bytes: bfloat16's 2 per entry every step, and at
    the first the layout check's header and one float32 placeholder per tensor."""
    out, steps = tmp_path / "start.json", 5
    done = launch.run("horovodrun", 2, "tests.distributed.bfloat16_start", "--steps", str(steps), "--out", str(out))
    assert done.returncode == 0, launch.output(done)
    ranks = json.loads(out.read_text())
    for found in ranks:
        assert "torch.BFloat16Tensor is not supported" in found["parameters_error"]
        assert "torch.BFloat16Tensor is not supported" in found["optimizer_error"]
        assert found["dtypes"] == ["torch.bfloat16", "torch.int64"]  # BatchNorm's count stays int64
        assert found["dense_bytes"] == steps * 2 * found["numel"]
        assert found["bytes_sent"] == found["dense_bytes"] + 16 + 4 * found["tensors"]
    for key in ("model", "momentum", "trained"):
        assert ranks[0][key] == ranks[1][key], key
