"""The mpi4py transport under ``mpirun``: MPICommunicator's collectives, the MPI optimizer, the example.

- collectives (``mpirun -np 2`` and ``-np 4``, each job then trains) against numpy: SUM/MAX allreduce of
  float and int dtypes (int32 sums wrap around), variable-size allgather with
  empty contributions, numpy and torch inputs, broadcast;
- ``hvd_compress.mpi.DistributedOptimizer`` on 4 processes == the in-process
  Simulator (1e-6 absolute, as for Horovod), its statistics == the bytes handed to
  the collectives, and the dense-switch probe loses nothing; numpy buckets through the
  exchange's fused path == the Simulator too;
- a rank configured with another ratio makes every rank fail fast with "ranks disagree";
  left uncaught, every rank prints it (``[rank R]`` lines) and the job aborts;
- an exception on rank 1 alone during training (in the script, or a NaN gradient
  Gaussian-k rejects) ends the 2-process job within seconds, not a hang, with
  rank 1's traceback in the output (the abort hook of ``hvd_compress.transport.mpi``);
  ``HVD_COMPRESS_MPI_ABORT_ON_ERROR=0`` does not install it;
- ``examples/mpi_train.py`` trains (1 epoch, 2 processes): its loss decreases.

Skipped without mpi4py or mpirun, unless HVD_COMPRESS_REQUIRE_HOROVOD=1 (``make test``).
"""

from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
import pytest

from tests.distributed import launch
from tests.distributed import torch_horovod as workload

STEPS = 4
MODULE = "tests.distributed.mpi_torch"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _mpi4py():
    launch.require_mpi()


NAMES = ["topk", "regtopk", "terngrad", "gaussiank", "topk-leader", "regtopk-traffic"]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """One ``mpirun -np 4`` job: the collectives, numpy buckets, the dense-switch probe, then the optimizer
    with every name of NAMES."""
    launch.require_mpi()
    out = tmp_path_factory.mktemp("mpi4") / "result.npz"
    done = launch.run(
        "mpirun", 4, MODULE, "collectives", "buckets", "probe", "train", "--compression", *NAMES,
        "--steps", str(STEPS), "--out", str(out), timeout=180,
    )
    return done, out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One ``mpirun -np 2`` job: the collectives, then Top-k with another ratio on rank 1, which
    every rank must report ("ranks disagree") before the job exits with an error."""
    launch.require_mpi()
    out = tmp_path_factory.mktemp("mpi2") / "x.npz"
    start = time.monotonic()
    done = launch.run(
        "mpirun", 2, MODULE, "collectives", "train", "--compression", "topk", "--steps", "2",
        "--rank1-ratio", "0.2", "--out", str(out), timeout=120,
    )
    return done, out, time.monotonic() - start


@pytest.mark.parametrize("ranks", [2, 4])
def test_collectives_match_numpy(ranks, request):
    done, out, *_ = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[ranks])
    files = [out.parent / f"{out.name}.{r}" for r in range(ranks)]
    assert all(f.exists() for f in files), launch.output(done)
    counts = [int(f.read_text()) for f in files]
    assert counts == [counts[0]] * ranks and counts[0] > 100, counts


def test_mpi_optimizer_equals_simulator(four_ranks):
    done, out = four_ranks
    assert done.returncode == 0, launch.output(done)
    result = np.load(out)
    assert int(result["size"]) == 4
    for name in NAMES:
        for param, value in workload.simulate(name, 4, STEPS).items():
            np.testing.assert_allclose(
                result[f"{name}/{param}"],
                value,
                rtol=0,
                atol=1e-6,
                err_msg=f"{name} {param}: 4-process MPI run differs from the Simulator",
            )


def test_numpy_buckets_take_the_fused_path_and_equal_the_simulator(four_ranks):
    """numpy arrays through ``BucketExchange`` over the MPICommunicator (the fused path, which the job
    asserts): every rank's averages are the Simulator's; the compressed tensors' bit for bit, the dense
    ones' within 1e-6 (MPI's allreduce adds the ranks in its own order)."""
    from hvd_compress.simulator import Simulator
    from tests.distributed.mpi_torch import BUCKET_SHAPES, bucket_gradients

    done, out = four_ranks
    assert done.returncode == 0, launch.output(done)
    results = [np.load(out.parent / f"{out.name}.buckets.{rank}.npz") for rank in range(4)]
    for name in NAMES:
        sim = Simulator(4, workload.compressor(name))
        for step in range(STEPS):
            expected = sim.step({t: [bucket_gradients(r, step)[t] for r in range(4)] for t in BUCKET_SHAPES})
            for rank, result in enumerate(results):
                for tensor, want in expected.items():
                    dense = sim.compressors[0].fused_kind(want.size) == "dense"
                    np.testing.assert_allclose(result[f"{name}/{step}/{tensor}"], want, rtol=0,
                                               atol=1e-6 if dense else 0, err_msg=f"{name} {step} {tensor} {rank}")


def test_statistics_count_every_byte_handed_to_the_collectives(four_ranks):
    """compressor.stats.bytes_sent == the bytes each rank handed to MPICommunicator over the run."""
    done, out = four_ranks
    assert done.returncode == 0, launch.output(done)
    for rank in range(4):
        counted = json.loads((out.parent / f"{out.name}.stats.{rank}").read_text())
        assert sorted(counted) == sorted(NAMES), counted
        for name, (handed, stats) in counted.items():
            assert stats == handed > 0, (rank, name, handed, stats)


def test_a_tensor_that_turns_dense_sends_its_residual(four_ranks):
    """The dense-switch probe (``tests/distributed/switch_probe.py``) on 4 ranks: the weights moved by
    exactly lr x the sum of the mean gradients (float32 rounding), nothing read a residual before
    the check; the statistics equal the bytes handed over."""
    done, out = four_ranks
    for rank in range(4):
        path = out.parent / f"{out.name}.switch.{rank}"
        assert path.exists(), launch.output(done)
        case = json.loads(path.read_text())
        assert case["error"] < 1e-5 and case["counted"] == case["handed"], (rank, case)


def test_mismatched_ratio_fails_every_rank_fast(two_ranks):
    done, out, elapsed = two_ranks
    assert done.returncode != 0
    assert "ranks disagree" in done.stdout + done.stderr, launch.output(done)
    assert elapsed < 60, f"took {elapsed:.0f} s to fail"
    for rank in (0, 1):
        assert "ranks disagree" in (out.parent / f"{out.name}.error.{rank}").read_text()
    assert not out.exists()


#: Seconds a failing job may take: a hang runs into ``launch.run_to_the_end``'s limit (60 s) instead.
ENDS_WITHIN = 45


@pytest.mark.parametrize(
    "compression, fails, cause",
    [
        ("topk", "error", "RuntimeError: injected failure on rank 1 at step 2"),
        # (a NaN gradient raises on no rank alone: it reaches every rank's result, as in a dense
        # allreduce, or with nonfinite="raise" every rank raises: tests/routes/test_strict_nonfinite.py)
    ],
    ids=["error"],
)
def test_exception_on_one_rank_aborts_the_job(tmp_path, compression, fails, cause):
    done, elapsed = launch.run_to_the_end(
        "mpirun",
        2,
        MODULE,
        "train",
        "--compression",
        compression,
        "--steps",
        "4",
        "--rank1-fails",
        fails,
        "--fail-step",
        "2",
        "--out",
        str(tmp_path / "x.npz"),
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, launch.output(done)
    assert elapsed < ENDS_WITHIN, f"took {elapsed:.0f} s to end"
    assert f"[rank 1] hvd_compress: uncaught {cause.split(':')[0]} on rank 1 of 2: aborting" in output, output
    assert f"[rank 1] {cause}" in output, launch.output(done)
    assert "[rank 1] Traceback (most recent call last):" in output
    assert "[rank 0]" not in output  # rank 0 was waiting in the exchange, and was ended
    assert "MPI_ABORT was invoked on rank 1" in output
    assert not (tmp_path / "x.npz").exists()


def test_uncaught_mismatch_is_reported_by_every_rank(tmp_path):
    done, elapsed = launch.run_to_the_end(
        "mpirun",
        2,
        MODULE,
        "train",
        "--compression",
        "topk",
        "--steps",
        "2",
        "--rank1-ratio",
        "0.2",
        "--uncaught",
        "--out",
        str(tmp_path / "x.npz"),
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, launch.output(done)
    assert elapsed < ENDS_WITHIN, f"took {elapsed:.0f} s to end"
    for rank, ratio in ((0, 0.05), (1, 0.2)):
        assert f"[rank {rank}] ValueError: hvd_compress: ranks disagree" in output, output
        assert re.search(rf"\[rank {rank}\] ValueError: .*this rank runs TopK\(ratio={ratio},", output), output
    assert "MPI_ABORT was invoked" in output


def test_abort_hook_opt_out(monkeypatch):
    from hvd_compress.transport import mpi

    monkeypatch.setenv("HVD_COMPRESS_MPI_ABORT_ON_ERROR", "0")
    monkeypatch.setattr(mpi, "_ABORT_HOOK_INSTALLED", False)
    hook = sys.excepthook
    assert mpi.install_abort_on_error() is False
    assert sys.excepthook is hook
    assert "mpi4py.MPI" not in sys.modules  # decided before initializing MPI in this process


def test_mpi_example_trains():
    done = launch.run(  # one epoch: 44 steps of 16 images per rank
        "mpirun", 2, "examples.mpi_train", "--epochs", "1", "--compression", "regtopk", timeout=180,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    epoch = re.search(r"epoch 1: loss ([\d.]+)  test accuracy ([\d.]+)  sent .*\(([\d.]+)x less", output)
    progress = re.search(r"first \d+ batches ([\d.]+) -> last \d+ batches ([\d.]+)", output)
    assert epoch and progress, output[-3000:]
    first, last = map(float, progress.groups())
    assert last < first, f"loss did not decrease within the epoch: {first} -> {last}"
    assert float(epoch.group(2)) > 0.3, f"accuracy {epoch.group(2)} is no better than chance"
    assert float(epoch.group(3)) > 5, f"only {epoch.group(3)}x fewer bytes than dense"
