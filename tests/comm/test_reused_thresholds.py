"""Reused thresholds (``exact_every = T > 1``): Top-k's exact selection every T-th step of the run, each
tensor's kept threshold corrected by one count between (hvd_compress.algorithms.sparse_bucket,
``reference.reused_threshold_select``).

The oracle below is written from the rule alone, per tensor and rank, in numpy: the engine (Simulator,
thread ranks; numpy's row selections, torch's the CPU's way and the accelerator's, TensorFlow's) must
equal it bit for bit. Hand-made rows check each branch of the correction and its bounds.
"""

import contextlib

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.kernels import reference
from hvd_compress.simulator import Simulator
from tests import conformance
from tests.helpers import reference_gaussiank, topk_oracle

#: "big": k = 1,920 at 3%, so its counts look at every 30th entry
SHAPES = {"w": (30, 40), "v": (40, 30), "b": (900,), "tiny": (7,), "big": (64, 1000)}
RATIO = 0.03
EVERY = 4


def grads(step, ranks, drift=1.0):
    """Random gradients whose scale drifts from step to step (the kept thresholds must follow)."""
    rng = np.random.default_rng(step)
    scale = drift ** step
    return {name: [(rng.standard_normal(shape) * scale * (1 + 0.3 * rng.random())).astype(np.float32)
                   for _ in range(ranks)] for name, shape in SHAPES.items()}


def oracle_select(scores, threshold, k):
    """Gaussian-k's correction toward [ceil(k/2), k] entries above the threshold (x0.5 below, x1.5 above,
    3 counts, each s times the count in every s-th entry, s = max(1, k // 64); else the smallest
    overshooting set or the last threshold tried); the first k entries above the chosen threshold."""
    low, high, factor, last, superset = (k + 1) // 2, k, 1.0, threshold, None
    stride = max(1, k // 64)
    for _ in range(3):
        current = threshold * factor
        count = stride * np.count_nonzero(scores[::stride] > np.float32(current))
        if low <= count <= high:
            return np.flatnonzero(scores > np.float32(current))[:k], current
        if count > high and (superset is None or count < superset[0]):
            superset = (count, current)
        last, factor = current, factor * (0.5 if count < low else 1.5)
    chosen = last if superset is None else superset[1]
    return np.flatnonzero(scores > np.float32(chosen))[:k], chosen


class Oracle:
    """Top-k with reused thresholds per tensor and rank, float32 sums in rank order."""

    def __init__(self, ranks, every=EVERY, ratio=RATIO, dense_below=100):
        self.ranks, self.every, self.ratio, self.dense_below = ranks, every, ratio, dense_below
        self.residual, self.threshold, self.step, self.exact_steps = {}, {}, 0, 0

    def exchange(self, per_rank):
        out = {}
        exact = self.step % self.every == 0 or not self.threshold
        for name, gs in per_rank.items():
            n = gs[0].size
            if n < self.dense_below:
                total = gs[0].reshape(-1).astype(np.float32)
                for g in gs[1:]:
                    total = total + g.reshape(-1)
                out[name] = (total / np.float32(self.ranks)).reshape(gs[0].shape)
                continue
            k = int(np.ceil(self.ratio * n * (1 - 1e-12)))
            total = np.zeros(n, np.float32)
            for r, g in enumerate(gs):
                a = g.reshape(-1) + self.residual.get((name, r), np.zeros(n, np.float32))
                if exact:
                    chosen = topk_oracle(a, k)
                    self.threshold[(name, r)] = float(np.abs(a[chosen]).min())
                else:
                    chosen, self.threshold[(name, r)] = oracle_select(np.abs(a), self.threshold[(name, r)], k)
                total[chosen] = total[chosen] + a[chosen]
                a[chosen] = 0
                self.residual[(name, r)] = a
            out[name] = (total / np.float32(self.ranks)).reshape(gs[0].shape)
        self.exact_steps += exact
        self.step += 1
        return out


@contextlib.contextmanager
def path_of(path):
    """numpy arrays, torch tensors the CPU's way or the accelerator's, TensorFlow tensors on its kernels."""
    if path == "tensorflow":
        with conformance.tensorflow_kernels():
            yield
    elif path == "accelerator":
        from hvd_compress.kernels import torch_ops

        with torch_ops.accelerator_path():
            yield
    else:
        yield


def in_framework(g, path):
    if path in ("host", "accelerator"):
        torch = pytest.importorskip("torch")
        return {name: [torch.from_numpy(x.copy()) for x in per_rank] for name, per_rank in g.items()}
    if path == "tensorflow":
        tf = pytest.importorskip("tensorflow")
        return {name: [tf.constant(x) for x in per_rank] for name, per_rank in g.items()}
    return g


@pytest.mark.parametrize("path", ["numpy", "host", "accelerator", "tensorflow"])
def test_simulator_equals_the_oracle_bit_for_bit(path):
    """Over 10 steps (three exact, seven by kept thresholds, scales drifting 1.3x a step) every result and
    every residual equals the oracle's."""
    ranks = 3
    sim = Simulator(ranks, TopK(RATIO, exact_every=EVERY, dense_below=100))
    oracle = Oracle(ranks)
    with path_of(path):
        for step in range(10):
            g = grads(step, ranks, drift=1.3)
            got, want = sim.step(in_framework(g, path)), oracle.exchange(g)
            for name in SHAPES:
                np.testing.assert_array_equal(conformance.as_numpy(got[name]), want[name], err_msg=f"{step} {name}")
        for name in ("w", "v", "b", "big"):
            for r, residual in enumerate(sim.residuals(name)):
                np.testing.assert_array_equal(conformance.as_numpy(residual).reshape(-1), oracle.residual[(name, r)])
    assert oracle.exact_steps == 3


def test_kept_thresholds_select_other_sets_than_top_k_and_fit_the_slots():
    """Between exact steps the sets differ from Top-k's (the threshold path really runs) and never exceed k."""
    ranks, differs = 2, 0
    oracle = Oracle(ranks)
    for step in range(8):
        g = grads(step, ranks, drift=1.5)
        before = {key: r.copy() for key, r in oracle.residual.items()}
        oracle.exchange(g)
        for (name, r), residual in oracle.residual.items():
            sent = np.flatnonzero(residual == 0)
            k = int(np.ceil(RATIO * residual.size))
            assert sent.size <= k
            a = g[name][r].reshape(-1) + before.get((name, r), 0)
            differs += step % EVERY != 0 and not np.array_equal(sent, topk_oracle(a, k))
    assert differs > 0


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("make", [TopK, RegTopK])
def test_thread_ranks_equal_the_simulator(framework, make):
    conformance.check_thread_ranks_equal_simulator(
        lambda: make(0.05, exact_every=2, dense_below=0), ranks=3, steps=5, framework=framework, rtol=0)


def test_momentum_correction_on_thread_ranks_equals_the_simulator():
    conformance.check_thread_ranks_equal_simulator(
        lambda: TopK(0.05, exact_every=3, dense_below=0, momentum=0.9), ranks=2, steps=5, rtol=0)


def test_drop_in_optimizer_equals_the_simulator():
    conformance.check_drop_in_optimizer_equals_simulator(lambda: RegTopK(0.1, exact_every=2, dense_below=0), steps=4)


def test_checkpoint_resumes_exactly():
    """A restored Simulator goes on as the one that did not stop: the kept thresholds come back with the
    residuals, and the schedule goes on from the run's step count."""
    conformance.check_state_dict_round_trip(lambda: TopK(0.05, exact_every=3, dense_below=0), ranks=3)


def test_a_density_change_selects_exactly_then_reuses_again():
    """A new ``k`` rebuilds the plan, whose first step selects exactly (the kept thresholds were for the old
    ``k``), whatever the schedule says."""
    sim = Simulator(2, TopK(0.05, exact_every=EVERY, dense_below=100))
    oracle = Oracle(2, ratio=0.05)
    for step in range(7):
        if step == 2:
            for c in sim.compressors:
                c.ratio = 0.08
            oracle.ratio, oracle.threshold = 0.08, {}
        g = grads(step, 2)
        got, want = sim.step(g), oracle.exchange(g)
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step} {name}")
    assert oracle.exact_steps == 3  # steps 0, 2 (the new k) and 4


def test_sent_plus_residual_is_what_was_produced():
    ranks = 3
    sim = Simulator(ranks, RegTopK(0.05, exact_every=2, dense_below=0))
    produced = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    summed = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(5):
        g = {name: [x.astype(np.float64) for x in per_rank] for name, per_rank in grads(step, ranks).items()}
        out = sim.step(g)
        for name in SHAPES:
            produced[name] += np.sum(g[name], axis=0)
            summed[name] += out[name] * ranks
    for name in SHAPES:
        residuals = np.stack(sim.residuals(name))
        np.testing.assert_allclose(summed[name] + residuals.sum(0), produced[name], rtol=0, atol=1e-9)


def test_nonfinite_gradient_on_a_reused_step_reaches_every_rank_and_keeps_the_state():
    """An Inf on one rank at a step between exact ones: that tensor is non-finite on every rank, every
    residual and kept threshold stays as before, and the next steps go on as if the step had not been."""
    ranks = 3
    sim = Simulator(ranks, TopK(RATIO, exact_every=EVERY, dense_below=100))
    oracle = Oracle(ranks)
    for step in range(2):
        oracle.exchange(grads(step, ranks))
        sim.step(grads(step, ranks))
    bad = grads(2, ranks)
    bad["w"][1] = bad["w"][1].copy()
    bad["w"][1][3, 4] = np.inf
    out = sim.step(bad)
    assert not np.all(np.isfinite(out["w"])) and np.all(np.isfinite(out["v"]))
    skipped = Oracle(ranks)
    for step in range(2):
        skipped.exchange(grads(step, ranks))
    partial = {name: per_rank for name, per_rank in bad.items() if name != "w"}
    skipped.exchange(partial)  # step 2: the other tensors exchange as usual, "w" keeps its state
    for step in (3, 4, 5):
        g = grads(step, ranks)
        got, want = sim.step(g), skipped.exchange(g)
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{step} {name}")


def test_steady_step_on_the_accelerator_path_reads_nothing_back():
    torch = pytest.importorskip("torch")
    from benchmarks.host_reads import count_host_reads
    from hvd_compress.transport.communicator import SingleProcessCommunicator
    from hvd_compress.engine.exchange import BucketExchange
    from hvd_compress.kernels import torch_ops

    compressor, comm = TopK(0.05, exact_every=2, dense_below=0), SingleProcessCommunicator()
    generator = torch.Generator().manual_seed(0)
    with torch_ops.accelerator_path():
        for step in range(5):
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, shape in SHAPES.items():
                exchange.add(name, torch.randn(shape, generator=generator))
            with count_host_reads() if step >= 3 else contextlib.nullcontext() as reads:
                exchange.launch()
                exchange.finish(average=True)
    syncing = {kind: n for kind, n in reads.by_kind.items() if kind not in ("numpy", "cpu")}
    assert not syncing, f"host reads in a steady step (one exact, one reused): {syncing} at {reads.sites.most_common(5)}"


@pytest.mark.parametrize("above, between, expected_count", [
    (8, 0, 8),      # in [5, 10]: the kept threshold as it is
    (10, 0, 10),    # the upper bound itself
    (5, 0, 5),      # the lower bound itself
])
def test_a_count_in_range_keeps_the_threshold(above, between, expected_count):
    """k = 10 accepts [ceil(10/2), 10] entries above the kept threshold 10: ``above`` entries of 20 (and
    ones of 1 below)."""
    scores = np.ones(100, dtype=np.float32)
    where = np.random.default_rng(0).permutation(100)[:above]
    scores[where] = 20.0
    chosen, kept = reference.reused_threshold_select(scores, 10.0, 10)
    assert kept == 10.0
    np.testing.assert_array_equal(chosen, np.sort(where))
    assert chosen.size == expected_count


def test_one_over_the_bound_grows_the_threshold():
    """11 entries above 10 (> k = 10): x1.5, and the 8 above 15 are in range."""
    scores = np.ones(60, dtype=np.float32)
    scores[[3, 9, 17, 20, 33, 41, 50, 58]] = 20.0
    scores[[5, 12, 44]] = 12.0
    chosen, kept = reference.reused_threshold_select(scores, 10.0, 10)
    assert kept == 15.0
    np.testing.assert_array_equal(chosen, [3, 9, 17, 20, 33, 41, 50, 58])


def test_one_under_the_bound_shrinks_the_threshold():
    """4 entries above 10 (< ceil(10/2)): x0.5, and the 7 above 5 are in range."""
    scores = np.ones(60, dtype=np.float32)
    scores[[2, 30, 31, 59]] = 20.0
    scores[[0, 7, 40]] = 6.0
    chosen, kept = reference.reused_threshold_select(scores, 10.0, 10)
    assert kept == 5.0
    np.testing.assert_array_equal(chosen, [0, 2, 7, 30, 31, 40, 59])


def test_an_overshoot_beyond_every_correction_keeps_the_first_k():
    """Every threshold tried selects more than k: the smallest such set, cut to its first k indices."""
    scores = np.full(50, 10.0, dtype=np.float32)
    scores[::2] = 100.0
    chosen, kept = reference.reused_threshold_select(scores, 1.0, 4)  # 1, 1.5, 2.25: all 50 above
    np.testing.assert_array_equal(chosen, np.arange(4))
    assert kept == 1.0


def test_a_collapse_keeps_the_last_threshold_tried():
    """Every threshold tried selects fewer than ceil(k/2): the last one (x0.25), and what it selects."""
    scores = np.array([1.0, 2.0, 3.0, 40.0, 50.0], dtype=np.float32)
    chosen, kept = reference.reused_threshold_select(scores, 200.0, 4)  # 200, 100, 50: none above
    assert kept == 50.0
    assert chosen.size == 0


def test_counts_come_from_every_stride_th_entry():
    """k = 640 counts every 10th entry (x10): 500 entries of 20 all off the sample count as none, so the
    threshold 10 (which a full count would keep: 500 in [320, 640]) falls to 2.5, and all 500 go."""
    scores = np.ones(20_000, dtype=np.float32)
    off_sample = np.flatnonzero(np.arange(20_000) % 10 != 0)
    where = np.sort(np.random.default_rng(2).choice(off_sample, 500, replace=False))
    scores[where] = 20.0
    assert reference.sample_stride(640) == 10
    chosen, kept = reference.reused_threshold_select(scores, 10.0, 640)
    assert kept == 2.5
    np.testing.assert_array_equal(chosen, where)


def test_a_score_equal_to_the_threshold_is_not_sent():
    """``score > thr``: an entry exactly at the kept threshold (the k-th largest of an exact step) stays."""
    scores = np.array([3.0, 5.0, 5.0, 1.0, 7.0, 0.5, 9.0], dtype=np.float32)
    chosen, kept = reference.reused_threshold_select(scores, 5.0, 2)  # two above 5: in [1, 2]
    np.testing.assert_array_equal(chosen, [4, 6])
    assert kept == 5.0


def test_gaussian_k_still_selects_as_before():
    """Gaussian-k runs the same correction with its own bounds [ceil(2k/3), floor(4k/3)]."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(5000).astype(np.float32)
    chosen = reference_gaussiank(a, 0.01)
    k = reference.num_selected(5000, 0.01)
    assert reference.gaussiank_bounds(k) == (34, 66)
    assert chosen.size <= reference.gaussiank_slots(k)
    np.testing.assert_array_equal(chosen, np.sort(chosen))


def test_bad_values_and_combinations_are_clear_errors():
    with pytest.raises(ValueError, match="exact_every must be an int >= 1"):
        TopK(0.01, exact_every=0)
    with pytest.raises(TypeError, match="exact_every must be an int >= 1"):
        TopK(0.01, exact_every=2.5)
    with pytest.raises(TypeError, match="exact_every must be an int >= 1"):
        RegTopK(0.01, exact_every=True)
    with pytest.raises(ValueError, match="applies to TopK and RegTopK"):
        GaussianK(0.01, exact_every=8)
    with pytest.raises(ValueError, match="choose one of them"):
        TopK(0.01, indices="leader", exact_every=8)
    compressor = TopK(0.01, exact_every=8)
    with pytest.raises(ValueError, match="choose one of them"):
        compressor.indices = "aggregate"
    assert compressor.config()["exact_every"] == 8 and "exact_every" not in TopK(0.01).config()


def test_ranks_that_disagree_on_the_schedule_fail_on_every_rank():
    conformance.check_ranks_disagreeing_fail_clearly(lambda: TopK(0.05, exact_every=4, dense_below=0),
                                                     lambda: TopK(0.05, exact_every=8, dense_below=0))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_kernel_twins_select_as_the_reference(framework):
    """Each kernel module's per-tensor ``reused_threshold_select`` equals numpy's, in and out of range."""
    module = pytest.importorskip(framework)
    from hvd_compress.kernels import ops_for

    rng = np.random.default_rng(5)
    for threshold in (0.5, 2.0, 2.6, 9.0):
        scores = np.abs(rng.standard_normal(3000)).astype(np.float32)
        want, kept = reference.reused_threshold_select(scores, threshold, 40)
        tensor = module.constant(scores) if framework == "tensorflow" else module.from_numpy(scores)
        got, got_kept = ops_for(tensor).reused_threshold_select(tensor, threshold, 40)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert float(got_kept) == kept


def odd_k_row(rng, threshold, numel=90):
    """A row for k = 9 (bounds [ceil(9/2), 9] = [5, 9]) and a kept ``threshold``: 4 random scores above it,
    3 in (threshold/2, threshold), the rest random below threshold/2; returns ``(scores, the 7 indices above
    threshold/2)``."""
    scores = (rng.random(numel) * 0.45 * threshold).astype(np.float32)
    where = rng.choice(numel, 7, replace=False)
    scores[where[:4]] = rng.uniform(1.05, 2.9, 4) * threshold
    scores[where[4:]] = rng.uniform(0.55, 0.95, 3) * threshold
    return scores, np.sort(where)


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
def test_an_odd_k_rounds_its_lower_bound_up(framework):
    """k = 9 accepts [ceil(9/2), 9] = [5, 9] entries: 4 above the kept threshold are too few, so it halves,
    and the 7 above half of it are in range (every kernel module's per-tensor selection)."""
    assert reference.reuse_bounds(9) == (5, 9)
    rng = np.random.default_rng(11)
    threshold = float(np.float32(rng.uniform(1.3, 2.7)))
    scores, above_half = odd_k_row(rng, threshold)
    if framework == "numpy":
        select = reference.reused_threshold_select
        tensor = scores
    else:
        module = pytest.importorskip(framework)
        from hvd_compress.kernels import ops_for

        tensor = module.constant(scores) if framework == "tensorflow" else module.from_numpy(scores)
        select = ops_for(tensor).reused_threshold_select
    chosen, kept = select(tensor, threshold, 9)
    assert float(kept) == threshold / 2
    np.testing.assert_array_equal(np.asarray(chosen), above_half)


@pytest.mark.parametrize("path", ["numpy", "host", "accelerator", "tensorflow"])
def test_an_odd_k_rounds_its_lower_bound_up_in_the_engine(path):
    """The same rule in the engine (Simulator, k = 9 of 90 on each of 2 ranks): an exact step keeps each rank's
    9th largest |g| (its only 9 nonzero entries, so nothing is left over), then a step with 4 entries above it
    halves it and sends the 7 above the half; the kept threshold and the residual show it."""
    ranks, numel = 2, 90
    rng = np.random.default_rng(12)
    first, second, thresholds, sent = [], [], [], []
    for _ in range(ranks):
        g = np.zeros(numel, np.float32)
        g[rng.choice(numel, 9, replace=False)] = rng.uniform(1.3, 2.7, 9) * rng.choice([-1, 1], 9)
        thresholds.append(float(np.abs(g[g != 0]).min()))
        scores, above_half = odd_k_row(rng, thresholds[-1])
        first.append(g)
        second.append(scores * rng.choice([-1, 1], numel).astype(np.float32))
        sent.append(above_half)
    sim = Simulator(ranks, TopK(0.1, exact_every=EVERY, dense_below=0))
    with path_of(path):
        sim.step(in_framework({"w": first}, path))
        out = sim.step(in_framework({"w": second}, path))
        residuals = [conformance.as_numpy(r).reshape(-1) for r in sim.residuals("w")]
        saved = [float(np.asarray(rank["tensors"]["w"]["threshold"]).reshape(-1)[0])
                 for rank in sim.state_dict()["ranks"]]
    want = np.zeros(numel, np.float32)
    for r in range(ranks):
        assert saved[r] == thresholds[r] / 2
        kept = second[r].copy()
        kept[sent[r]] = 0
        np.testing.assert_array_equal(residuals[r], kept)
        want[sent[r]] += second[r][sent[r]]
    np.testing.assert_array_equal(conformance.as_numpy(out["w"]), want / np.float32(ranks))


@pytest.mark.parametrize("path", ["numpy", "host", "accelerator", "tensorflow"])
def test_a_nonfinite_tensor_keeps_its_threshold_while_the_others_move(path):
    """An Inf on one rank at a step between exact ones, where every gradient grew 8x (each kept threshold
    would move up): that tensor's kept threshold stays as it was on every rank; another tensor's moves."""
    ranks = 3
    sim = Simulator(ranks, TopK(RATIO, exact_every=EVERY, dense_below=100))

    def saved(name):
        return [float(np.asarray(rank["tensors"][name]["threshold"]).reshape(-1)[0])
                for rank in sim.state_dict()["ranks"]]

    bad = {name: [g * np.float32(8.0) for g in per_rank] for name, per_rank in grads(2, ranks).items()}
    bad["w"][1][3, 4] = np.inf
    with path_of(path):
        for step in range(2):
            sim.step(in_framework(grads(step, ranks), path))
        before = {name: saved(name) for name in ("w", "v")}
        out = sim.step(in_framework(bad, path))
        after = {name: saved(name) for name in ("w", "v")}
    assert not np.all(np.isfinite(conformance.as_numpy(out["w"])))
    assert np.all(np.isfinite(conformance.as_numpy(out["v"])))
    assert after["w"] == before["w"]
    assert all(moved > old for moved, old in zip(after["v"], before["v"]))
