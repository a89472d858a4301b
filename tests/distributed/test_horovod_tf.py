"""Our compressors in real 2-process Horovod TensorFlow runs: GradientTape and Keras ``fit``.

Stock ``horovod.tensorflow`` / ``horovod.tensorflow.keras`` with
``compression=`` one of ours, and the drop-in ``hvd_compress.tensorflow`` /
``hvd_compress.keras``. The final weights must equal the in-process Simulator
fed the same gradients (1e-6 absolute; FP16 1e-4, since Horovod sums float16 in
float16), and the bytes handed to the collectives must be the compressed ones.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.distributed import launch

SPARSE = ["topk", "gaussiank", "regtopk"]
ALL = SPARSE + ["terngrad", "fp16", "none"]
STEPS = 4

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _horovod():
    launch.require("horovod.tensorflow")


def run_workload(path, names, tmp_path, *extra, expect_success=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.npz"
    done = launch.run(
        "horovodrun",
        2,
        "tests.distributed.tf_horovod",
        "--compression",
        *names,
        "--steps",
        str(STEPS),
        "--path",
        path,
        "--out",
        str(out),
        *extra,
    )
    if not expect_success:
        return done, out
    assert done.returncode == 0, launch.output(done)
    return np.load(out)


def assert_equals_simulator(result, names):
    from tests.distributed import tf_horovod as workload

    launch.assert_equals_simulator(result, names, lambda name: workload.simulate(name, 2, STEPS))


def topk_bytes(dropin):
    """Bytes per step through our collectives with Top-k at 5%: k int32 indices + k float32 values
    per weight matrix; an int64 header [config, layout, counts] per exchange: one per matrix (stock,
    where Horovod allreduces the biases itself) or one for the fused bucket with the biases (drop-in);
    stock: once per gradient, the int64 pair [config, layout] that checks the ranks agree, spread
    over the run's steps."""
    from tests.distributed import tf_horovod as workload

    shapes = [v.shape.num_elements() for v in workload.make_model().trainable_variables]
    matrices = [n for n in shapes if n >= 1024]
    sparse = sum(8 * int(np.ceil(workload.RATIO * n)) for n in matrices)
    if not dropin:
        return sparse + 8 * 3 * len(matrices) + 16 * len(shapes) // STEPS
    return sparse + 8 * (2 + len(matrices)) + 4 * sum(n for n in shapes if n < 1024)


@pytest.mark.parametrize("path", ["tape", "tape-dropin"])
def test_gradient_tape_equals_simulator_and_sends_compressed_bytes(path, tmp_path):
    result = run_workload(path, ALL, tmp_path)
    assert_equals_simulator(result, ALL)
    wire = json.loads(str(result["wire"]))
    assert wire["topk"] == [topk_bytes(path == "tape-dropin")] * 2
    from tests.distributed import tf_horovod as workload

    dense = 4 * sum(v.shape.num_elements() for v in workload.make_model().trainable_variables)
    for name in ("gaussiank", "regtopk", "terngrad"):
        assert max(wire[name]) < dense / 5, (name, wire[name], dense)


@pytest.mark.parametrize("path", ["keras", "keras-dropin"])
def test_keras_fit_equals_simulator(path, tmp_path):
    names = ["topk", "regtopk", "terngrad"]
    assert_equals_simulator(run_workload(path, names, tmp_path), names)


def test_dropin_tape_in_eager_mode_equals_simulator(tmp_path):
    names = ["gaussiank", "regtopk"]
    assert_equals_simulator(run_workload("tape-dropin", names, tmp_path, "--eager"), names)


@pytest.mark.parametrize("path", ["tape", "keras-dropin"])
def test_mismatched_ratio_fails_on_every_rank(path, tmp_path):
    done, out = run_workload(path, ["topk"], tmp_path, "--rank1-ratio", "0.1", expect_success=False)
    assert_every_rank_says(done, out, "ranks disagree")


@pytest.mark.parametrize("rank1", ["none", "fp16"])
def test_different_compressors_fail_on_every_rank_on_the_stock_route(rank1, tmp_path):
    """Top-k on rank 0, a dense compressor on rank 1: our error naming both, not Horovod's."""
    done, out = run_workload("tape", ["topk"], tmp_path, "--rank1-compression", rank1, expect_success=False)
    expected = {"none": "NoneCompressor", "fp16": "FP16"}[rank1]
    assert_every_rank_says(done, out, f"ranks run different compressors: rank 0 TopK, rank 1 {expected}")


def assert_every_rank_says(done, out, message):
    assert done.returncode != 0
    for rank in (0, 1):
        error = out.parent / f"{out.name}.error.{rank}"
        assert error.exists(), f"rank {rank} reported no error:\n{launch.output(done)}"
        assert message in error.read_text(), (rank, error.read_text())


def test_nan_gradient_on_one_rank_reaches_every_rank_as_in_a_dense_allreduce(tmp_path):
    """Rank 1's NaN data: no rank raises or hangs, and the NaN reaches the weights of every rank
    (rank 0 writes its own, which only a NaN gradient from rank 1 can have made non-finite)."""
    started = time.monotonic()
    result = run_workload("tape-dropin", ["regtopk"], tmp_path, "--rank1-nan")
    assert time.monotonic() - started < 120, "the job hung after a NaN gradient"
    weights = [result[key] for key in result.files if key.startswith("regtopk/")]
    assert weights and any(not np.isfinite(w).all() for w in weights), sorted(result.files)