"""Our compressors in real 2-process Horovod TensorFlow runs: GradientTape and Keras ``fit``.

Stock ``horovod.tensorflow`` / ``horovod.tensorflow.keras`` with
``compression=`` one of ours (with and without Horovod's ``groups=``), and the drop-in
``hvd_compress.tensorflow`` / ``hvd_compress.keras``. The final weights must equal the
in-process Simulator fed the same gradients (1e-6 absolute; FP16 1e-4, since Horovod sums
float16 in float16), the bytes handed to the collectives must be the compressed ones, and
each of Horovod's groups must travel in one exchange.

One ``horovodrun`` job (module fixture) runs the check of the communicator's collectives
(tests/distributed/tf_collectives.py), then every scenario below in turn, the
misconfigured ones included (they must raise on every rank, and the job goes on);
each test checks its part of the job's results.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from tests.distributed import launch

SPARSE = ["topk", "gaussiank", "regtopk"]
ALL = SPARSE + ["terngrad", "fp16", "none"]
KERAS = ["topk", "regtopk", "terngrad"]
STEPS = 4

#: label -> (path, compressors, options): see tests/distributed/tf_horovod.py
SCENARIOS = {
    "tape": ("tape", ALL + ["topk-leader"], []),
    "tape-dropin": ("tape-dropin", ALL + ["regtopk-aggregate", "regtopk-reuse"], []),
    "keras": ("keras", KERAS, []),
    "keras-dropin": ("keras-dropin", KERAS + ["gaussiank-leader"], []),
    "eager": ("tape-dropin", ["gaussiank", "regtopk"], ["eager"]),
    "allreduce": ("tape", ["topk", "regtopk", "terngrad"], ["eager", "allreduce"]),
    "tape-groups1": ("tape", ["topk", "regtopk", "terngrad", "none"], ["groups=1"]),
    "keras-groups2": ("keras", ["topk", "terngrad"], ["groups=2"]),
    "allreduce-grouped": ("tape", ["topk", "terngrad"], ["eager", "allreduce", "groups=1"]),
    "nan": ("tape-dropin", ["regtopk"], ["rank1-nan"]),
    "ratio-tape": ("tape", ["topk"], ["rank1-ratio=0.1"]),
    "ratio-keras-dropin": ("keras-dropin", ["topk"], ["rank1-ratio=0.1"]),
    "ratio-tape-groups1": ("tape", ["topk"], ["rank1-ratio=0.1", "groups=1"]),
    "rank1-none": ("tape", ["topk"], ["rank1-compression=none"]),
    "rank1-fp16": ("tape", ["topk"], ["rank1-compression=fp16"]),
    "switch-tape": ("tape", ["topk"], ["switch"]),
    "switch-tape-dropin": ("tape-dropin", ["topk"], ["switch"]),
}
#: scenarios that train (the others must raise)
TRAINED = ["tape", "tape-dropin", "keras", "keras-dropin", "eager", "allreduce", "tape-groups1", "keras-groups2",
           "allreduce-grouped", "nan", "switch-tape", "switch-tape-dropin"]
#: what the scenarios' results hold per name (``results(..., part=)``)
PER_STEP, HANDED, EXCHANGED = 0, 1, 2

#: Seconds the job may take (a hang, after a NaN gradient or an error on both ranks, fails every test)
LIMIT = 300

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def _horovod():
    launch.require("horovod.tensorflow")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The one job: (finished process, path of its results; error files are ``OUT.LABEL.error.RANK``)."""
    out = tmp_path_factory.mktemp("tf_horovod") / "result.npz"
    scenarios = []
    for label, (path, names, options) in SCENARIOS.items():
        scenarios += ["--scenario", f"{label}={':'.join([path, ','.join(names), *options])}"]
    done, _ = launch.run_to_the_end(
        "horovodrun", 2, "tests.distributed.tf_horovod", *scenarios, "--steps", str(STEPS), "--out", str(out),
        "--collectives", str(out.parent / "collectives"), limit=LIMIT,
    )
    return done, out


def results(job, label, part=PER_STEP):
    """Scenario ``label``'s weights (``NAME/wI``) and, per name and rank, ``part`` of what it measured:
    ``PER_STEP``, the bytes per step through our communicator; ``HANDED``, ``[bytes handed to every
    collective, bytes compressor.stats counted]`` over the run; ``EXCHANGED``, the number of tensors
    of each exchange of the stock route over the run."""
    done, out = job
    assert done.returncode == 0, launch.output(done)
    for rank in (0, 1):
        error = out.parent / f"{out.name}.{label}.error.{rank}"
        assert not error.exists(), f"{label}: rank {rank} raised {error.read_text()}"
    loaded = np.load(out)
    prefix = f"{label}/"
    weights = {key[len(prefix):]: loaded[key] for key in loaded.files if key.startswith(prefix)}
    assert weights, f"{label}: no weights in {sorted(loaded.files)}"
    wire = json.loads(str(loaded["wire"]))[label]
    return weights, {name: per_name[part] for name, per_name in wire.items()}


@functools.lru_cache(maxsize=None)
def simulated(name):
    from tests.distributed import tf_horovod as workload

    return workload.simulate(name, 2, STEPS)


def assert_equals_simulator(result, names):
    launch.assert_equals_simulator(result, names, simulated)


def sizes():
    from tests.distributed import tf_horovod as workload

    return [v.shape.num_elements() for v in workload.make_model().trainable_variables]


def topk_bytes(label):
    """Bytes per step through our collectives with Top-k at 5% (eager CPU tensors ride the fused
    numpy bucket): k int32 indices + k float32 values and a flag with its position per weight matrix;
    per exchange, one per matrix (stock, where Horovod allreduces the biases itself), one per Horovod
    group (stock, ``groups=1``) or one for the bucket with the biases (drop-in), the layout check, the
    int64 pair [config, layout], once, spread over the run's steps; stock: once per gradient, the
    int64 pair [config, layout] that checks the ranks agree, spread over the run's steps too."""
    from tests.distributed import tf_horovod as workload

    shapes = sizes()
    matrices = [n for n in shapes if n >= 1024]
    sparse = sum(8 * int(np.ceil(workload.RATIO * n)) for n in matrices) + 8 * len(matrices)
    if label == "tape-dropin":
        return sparse + 16 // STEPS + 4 * sum(n for n in shapes if n < 1024)
    exchanges = 1 if label == "tape-groups1" else len(matrices)
    return sparse + (16 * exchanges + 16 * len(shapes)) // STEPS


@pytest.mark.parametrize("path", ["tape", "tape-dropin", "tape-groups1"])
def test_gradient_tape_equals_simulator_and_sends_compressed_bytes(path, job):
    result, wire = results(job, path)
    assert_equals_simulator(result, SCENARIOS[path][1])
    assert wire["topk"] == [topk_bytes(path)] * 2
    from tests.distributed import tf_horovod as workload

    dense = 4 * sum(v.shape.num_elements() for v in workload.make_model().trainable_variables)
    for name in {"gaussiank", "regtopk", "terngrad"} & set(SCENARIOS[path][1]):
        assert max(wire[name]) < dense / 5, (name, wire[name], dense)


@pytest.mark.parametrize("path", ["keras", "keras-dropin", "keras-groups2"])
def test_keras_fit_equals_simulator(path, job):
    assert_equals_simulator(results(job, path)[0], SCENARIOS[path][1])


def test_dropin_tape_in_eager_mode_equals_simulator(job):
    assert_equals_simulator(results(job, "eager")[0], ["gaussiank", "regtopk"])


@pytest.mark.parametrize("label", ["allreduce", "allreduce-grouped"])
def test_eager_hvd_allreduce_with_names_keeps_each_tensors_state(label, job):
    """``hvd.allreduce(g, name=..., compression=...)`` (or ``hvd.grouped_allreduce`` of all) eagerly:
    each gradient's residual and random stream carry from step to step under its name, as in the Simulator."""
    assert_equals_simulator(results(job, label)[0], SCENARIOS[label][1])


@pytest.mark.parametrize("label", ["tape", "allreduce", "tape-groups1", "keras-groups2", "allreduce-grouped"])
def test_each_horovod_group_is_one_exchange(label, job):
    """The stock route exchanges each of Horovod's groups at once: per step, one exchange per group
    that holds a tensor we compress (not a dense compressor's, not one under ``dense_below``), of all
    of them; without ``groups=`` each gradient is a group of its own. Groups as Horovod splits the
    gradients (``horovod.common.util.split_list``: ``G`` runs of equal length, the first ones a tensor longer)."""
    from tests.distributed import tf_horovod as workload

    _, exchanged = results(job, label, part=EXCHANGED)
    options = SCENARIOS[label][2]
    groups = next((int(o.split("=")[1]) for o in options if o.startswith("groups=")), len(sizes()))
    for name, per_rank in exchanged.items():
        compressor = workload.compressor(name)
        ours = [0 if compressor.dense_only else int(n >= compressor.dense_below) for n in sizes()]
        per_step = [int(group.sum()) for group in np.array_split(np.array(ours), groups) if group.sum()]
        assert per_rank == [per_step * STEPS] * 2, (label, name, per_rank)


@pytest.mark.parametrize("path", ["tape", "keras-dropin", "tape-groups1"])
def test_mismatched_ratio_fails_on_every_rank(path, job):
    assert_every_rank_says(job, f"ratio-{path}", "ranks disagree")


@pytest.mark.parametrize("rank1", ["none", "fp16"])
def test_different_compressors_fail_on_every_rank_on_the_stock_route(rank1, job):
    """Top-k on rank 0, a dense compressor on rank 1: our error naming both, not Horovod's."""
    expected = {"none": "NoneCompressor", "fp16": "FP16"}[rank1]
    message = f"ranks run different compressors: rank 0 TopK, rank 1 {expected}"
    assert_every_rank_says(job, f"rank1-{rank1}", message)


def assert_every_rank_says(job, label, message):
    """Scenario ``label`` raised ``message`` on both ranks (and trained nothing)."""
    done, out = job
    assert done.returncode == 0, launch.output(done)
    for rank in (0, 1):
        error = out.parent / f"{out.name}.{label}.error.{rank}"
        assert error.exists(), f"{label}: rank {rank} reported no error:\n{launch.output(done)}"
        assert message in error.read_text(), (label, rank, error.read_text())
    assert not [key for key in np.load(out).files if key.startswith(f"{label}/")], label


def test_nan_gradient_on_one_rank_reaches_every_rank_as_in_a_dense_allreduce(job):
    """Rank 1's NaN data: no rank raises or hangs (the job ends within the fixture's limit), and
    the NaN reaches the weights of every rank (rank 0 writes its own, which only a NaN gradient
    from rank 1 can have made non-finite)."""
    result, _ = results(job, "nan")
    weights = [result[key] for key in result if key.startswith("regtopk/")]
    assert weights and any(not np.isfinite(w).all() for w in weights), sorted(result)


@pytest.mark.parametrize("label", ["switch-tape", "switch-tape-dropin"])
def test_a_tensor_that_turns_dense_sends_its_residual(label, job):
    """The dense-switch probe (``tf_horovod.train_switch``): Top-k at 1% for 4 steps, then the ratio
    raised so that N k >= d (sent dense): the weights moved by exactly lr x the sum of the mean
    gradients (float32 rounding), stock and drop-in; nothing read a residual before the check."""
    result, _ = results(job, label)
    assert float(result["topk/switch_error"]) < 1e-5, float(result["topk/switch_error"])


@pytest.mark.parametrize("label", TRAINED)
def test_statistics_count_every_byte_handed_to_the_collectives(label, job):
    """compressor.stats.bytes_sent == the bytes each rank handed to the collectives over the run:
    ours (payloads, headers, the check of agreement) and, on the stock route, Horovod's own
    allreduce of what we hand it (None's gradients, FP16's, small tensors, placeholders)."""
    _, handed = results(job, label, part=HANDED)
    for name, per_rank in handed.items():
        for rank, (total, counted) in enumerate(per_rank):
            assert counted == total, (label, name, rank, total, counted)


def test_collectives_started_together_equal_horovods_own_one_by_one(job):
    """The communicator's queued collectives (one grouped allgather; with two ranks the allreduces
    in it, but a float16 sum) make two Horovod calls and give the bytes Horovod's eager allgather and
    allreduce give, every dtype, sizes that differ by rank, wrapping integer sums, an infinite maximum;
    the same for numpy arrays, whose results come back as numpy (tf_collectives.check, first in the job)."""
    from tests.distributed import tf_collectives

    done, out = job
    assert done.returncode == 0, launch.output(done)
    for rank in (0, 1):
        calls, *lines = (out.parent / f"collectives.{rank}").read_text().splitlines()
        assert calls == "calls grouped_allgather allreduce grouped_allgather allreduce", calls  # float16 sums: Horovod's
        assert len(lines) == len(tf_collectives.collectives(rank))
        assert all(line.endswith(" same") for line in lines), lines
