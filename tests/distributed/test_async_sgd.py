"""Asynchronous SGD with clipping over MPI (docs/references.md): ``examples/parameter_server.py``.

- ``clip_lambda``: norm bound, identity below lambda, the zero vector, ``None``;
- ``mpirun -np 3`` with ``deterministic=True`` and a delay schedule (one slow
  worker) equals a single-process replay of the schedule written here (same
  gradients, same order): ``x`` and losses bit for bit, delays and per-worker
  counts exactly; the same with Top-k 0.1 and with TernGrad compressed gradients (the
  replay compresses with the Simulator on one rank: the engine's sum over that rank is
  what the worker ships, rebuilt by the server);
- what a worker ships, by hand: Top-k's nonzero entries and int32 indices, TernGrad's
  2-bit codes and scale, FP16's float16 values;
- arrival order with well-separated injected delays follows the schedule;
- heavy-tailed (Student-t 1.5) noise and one slow worker (``-np 4``): clipped
  ends at a lower loss than unclipped;
- a worker that exits abruptly, or hangs, ends the job within 60 s with an
  error naming its rank;
- an exception on one rank (in a worker's ``grad_fn``, a NaN gradient the
  server rejects, or in the script after ``async_sgd`` returned while the other
  rank waits in a barrier) aborts the 2-process job within seconds, the cause
  printed by that rank.

Skipped without mpi4py or mpirun, unless HVD_COMPRESS_REQUIRE_HOROVOD=1 (``make test``).
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest

from hvd_compress.simulator import Simulator

from examples.parameter_server import DENSE, SPARSE, TERNARY, clip_lambda, compressed, received, worker_rng
from tests.distributed import async_sgd_work as work
from tests.distributed import launch

MODULE = "tests.distributed.async_sgd_work"
STEPS = 60
LR = 0.1
CLIP = 1.0

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ clip_lambda
def test_clip_bounds_the_norm_and_keeps_the_direction():
    rng = np.random.default_rng(0)
    for dtype in (np.float64, np.float32):
        for lam in (1e-3, 0.5, 3.0):
            v = (rng.standard_normal(50) * 10).astype(dtype)
            c = clip_lambda(v, lam)
            assert c.dtype == dtype
            assert np.linalg.norm(c.astype(np.float64)) <= lam * (1 + 1e-6)
            np.testing.assert_allclose(np.linalg.norm(c.astype(np.float64)), lam, rtol=1e-5)
            np.testing.assert_allclose(c * (np.linalg.norm(v.astype(np.float64)) / lam), v, rtol=1e-5)


def test_clip_is_identity_at_or_below_lambda_and_without_lambda():
    v = np.array([3.0, 4.0])  # norm 5
    assert clip_lambda(v, 5.0) is v
    assert clip_lambda(v, 100.0) is v
    assert clip_lambda(v, None) is v
    np.testing.assert_array_equal(clip_lambda(v, 2.5), [1.5, 2.0])


def test_clip_zero_vector_and_bad_lambda():
    z = np.zeros(7)
    out = clip_lambda(z, 1.0)
    assert np.all(out == 0) and np.all(np.isfinite(out))
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="lambda"):
            clip_lambda(z, bad)


# ------------------------------------------------------------------ the replay
def replay(problem, size, steps, lr, clip, schedule, seed, compressor=None):
    """Single-process async SGD of the virtual clock in the module docstring.

    Worker ``w`` reads ``x`` at update count ``version``; its ``i``-th gradient is
    ready ``schedule(w, i)`` after that read (the read happens when the server
    applies w's previous gradient, at that gradient's ready time); the earliest
    ready is applied next, ties to the worker that read first.
    """
    workers = range(1, size)
    x = problem.x0.copy()
    rngs = {w: worker_rng(seed, w) for w in workers}
    # each worker: the engine on a world of one, its compressor's state kept from step to step
    encoders = {w: Simulator(1, compressor(w)) for w in workers} if compressor else {}
    reads, order = 0, {}
    stale, version, ready, iteration = {}, {}, {}, {}
    for w in workers:
        stale[w], version[w], ready[w], iteration[w] = x.copy(), 0, schedule(w, 0), 0
        order[w], reads = reads, reads + 1
    losses, delays, applied = [problem.loss(x)], [], []
    for t in range(steps):
        w = min(workers, key=lambda v: (ready[v], order[v]))
        g = problem.grad(stale[w], rngs[w])
        if compressor:
            g = encoders[w].step({"x": [g]})["x"]  # the average over one rank: what the worker sends
        delays.append(t - version[w])
        applied.append(w)
        x = x - lr * clip_lambda(g, clip)
        losses.append(problem.loss(x))
        iteration[w] += 1
        now = ready[w]
        stale[w], version[w], ready[w] = x.copy(), t + 1, now + schedule(w, iteration[w])
        order[w], reads = reads, reads + 1
    counts = [applied.count(w) for w in workers]
    return x, np.array(losses), np.array(delays), np.array(applied), np.array(counts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One ``mpirun -np 3`` of every configuration in ``async_sgd_work.RUNS``."""
    launch.require_mpi()
    out = tmp_path_factory.mktemp("async") / "runs.npz"
    done = launch.run(
        "mpirun",
        3,
        MODULE,
        "run",
        "--steps",
        str(STEPS),
        "--lr",
        str(LR),
        "--clip",
        str(CLIP),
        "--out",
        str(out),
        timeout=120,
    )
    assert done.returncode == 0, launch.output(done)
    return dict(np.load(out))


@pytest.mark.parametrize("label, compress", [("det", None), ("det_topk", "topk"), ("det_terngrad", "terngrad")])
def test_deterministic_run_equals_single_process_replay(runs, label, compress):
    problem = work.Problem()
    schedule = work.slow_last(3)
    x, losses, delays, applied, counts = replay(
        problem,
        3,
        STEPS,
        LR,
        CLIP,
        schedule,
        work.SEED,
        compressor=work._compressor(compress) if compress else None,
    )
    np.testing.assert_array_equal(runs[f"{label}/workers"], applied, err_msg="order of applied gradients")
    np.testing.assert_array_equal(runs[f"{label}/delays"], delays, err_msg="recorded delays != schedule's")
    np.testing.assert_array_equal(runs[f"{label}/counts"], counts)
    np.testing.assert_array_equal(runs[f"{label}/x"], x, err_msg="x differs from the replay (bit for bit)")
    np.testing.assert_array_equal(runs[f"{label}/losses"], losses)
    # the schedule really is asynchronous: the slow worker's gradients are stale
    slow = delays[applied == 2]
    assert counts[0] > 3 * counts[1] and slow.min() >= 5, (counts, slow)
    assert runs[f"{label}/clipped"] > 0  # the clip was active at least once
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("label", ["det_topk", "det_terngrad"])
def test_compressed_run_differs_from_dense_and_still_converges(runs, label):
    assert not np.array_equal(runs[f"{label}/x"], runs["det/x"])
    assert runs[f"{label}/losses"][-1] < runs[f"{label}/losses"][0]


def test_what_a_worker_ships_by_hand():
    from hvd_compress.algorithms import FP16, TernGrad, TopK

    rng = np.random.default_rng(5)
    g = rng.standard_normal(10)
    topk = TopK(0.3, dense_below=0)
    fmt, values, indices, _ = compressed(topk, g)  # the 3 largest |g|, no residual yet
    top = np.sort(np.argsort(-np.abs(g))[:3])
    assert fmt == SPARSE and indices.dtype == np.int32
    np.testing.assert_array_equal(indices, top)
    np.testing.assert_array_equal(values, g[top])
    fmt, values, indices, _ = compressed(topk, g)  # now g + residual: the residual is g off the top 3
    a = g.copy()
    a[np.setdiff1d(np.arange(10), top)] *= 2
    top = np.sort(np.argsort(-np.abs(a))[:3])
    np.testing.assert_array_equal(indices, top)
    np.testing.assert_array_equal(values, a[top])
    np.testing.assert_array_equal(received(fmt, values, indices, 0.0, 10, np.float64)[top], a[top])

    fmt, packed, indices, scale = compressed(TernGrad(clip=None, dense_below=0), g)
    codes = received(fmt, packed, None, scale, 10, np.float64) / np.max(np.abs(g))
    assert fmt == TERNARY and indices is None and packed.dtype == np.int8 and packed.size == 3  # 2 bits each
    assert scale == np.max(np.abs(g))  # no clipping: S = max|g|
    assert set(codes) <= {-1.0, 0.0, 1.0} and np.all(codes * g >= 0)  # t = sign(g) or 0
    assert codes[np.argmax(np.abs(g))] == np.sign(g[np.argmax(np.abs(g))])  # |g| = S: kept with probability 1

    fmt, values, indices, _ = compressed(FP16(), g)
    assert fmt == DENSE and values.dtype == np.float16 and indices is None
    np.testing.assert_array_equal(received(fmt, values, None, 0.0, 10, np.float64), g.astype(np.float16))


def test_arrival_order_follows_injected_delays(runs):
    # worker 1 sends at ~0.1, 0.2, 0.3, ...; worker 2 at ~0.15, 0.35, 0.55 (50 ms margins)
    x, losses, delays, applied, counts = replay(
        work.Problem(), 3, work.ARRIVAL_STEPS, LR, CLIP, work.arrival_schedule(3), work.SEED
    )
    np.testing.assert_array_equal(applied, [1, 2, 1, 1, 2, 1, 1, 2, 1])
    np.testing.assert_array_equal(runs["arrival/workers"], applied)
    np.testing.assert_array_equal(runs["arrival/delays"], delays)
    np.testing.assert_array_equal(runs["arrival/x"], x)


# ------------------------------------------------------------------ clipping helps
def test_clipping_beats_unclipped_under_heavy_tails_and_delays(tmp_path):
    launch.require_mpi()
    out = tmp_path / "contrast.npz"
    done = launch.run(
        "mpirun", 4, MODULE, "contrast", "--steps", str(work.CONTRAST_STEPS), "--out", str(out), timeout=120
    )
    assert done.returncode == 0, launch.output(done)
    result = np.load(out)
    clipped, unclipped = result["clipped"], result["unclipped"]  # [final, median of last 20%, max delay]
    message = (
        f"clipped: final {clipped[0]:.4g}, tail median {clipped[1]:.4g}; unclipped: final "
        f"{unclipped[0]:.4g}, tail median {unclipped[1]:.4g}; max delay {clipped[2]:.0f}"
    )
    assert clipped[0] < unclipped[0], message
    assert clipped[1] < unclipped[1], message
    assert clipped[2] >= 10, message


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("how", ["exit", "hang"])
def test_dead_worker_ends_the_job_with_a_clear_error(how):
    launch.require_mpi()
    start = time.monotonic()
    done = launch.run("mpirun", 3, MODULE, "die", "--how", how, "--timeout", "3", timeout=90)
    elapsed = time.monotonic() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0, launch.output(done)
    assert "finished without noticing" not in output
    assert elapsed < 60, f"took {elapsed:.0f} s to end"
    ours = "worker rank 1 sent no gradient within 3 s" in output
    if how == "hang":
        assert ours, launch.output(done)
    else:  # Open MPI's launcher may notice the exit before the server's timeout does
        assert ours or re.search(r"process rank 1 .*exiting\s+improperly|@1,1\]", output), launch.output(done)


@pytest.mark.parametrize(
    "how, cause",
    [
        ("raise", "[rank 1] RuntimeError: injected failure in grad_fn on rank 1"),
        ("nan", "[rank 0] FloatingPointError: hvd_compress: the gradient of worker 1"),
        ("after", "[rank 1] RuntimeError: injected failure after async_sgd on rank 1"),
    ],
    ids=["raise", "nan", "after"],
)
def test_exception_on_one_rank_aborts_the_job(how, cause):
    launch.require_mpi()
    done, elapsed = launch.run_to_the_end("mpirun", 2, MODULE, "fail", "--how", how)
    output = done.stdout + done.stderr
    assert done.returncode != 0, launch.output(done)
    assert "finished without noticing" not in output
    assert elapsed < 45, f"took {elapsed:.0f} s to end"
    assert cause in output, launch.output(done)
    rank = cause[6]
    assert f"[rank {rank}] Traceback (most recent call last):" in output
    assert f"MPI_ABORT was invoked on rank {rank}" in output
