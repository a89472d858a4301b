"""Shared index sets (``indices='leader'`` / ``'aggregate'``): one index set per tensor for every rank,
its values summed by an allreduce (hvd_compress.algorithms.shared_bucket).

The oracle below is written from the rule alone, per tensor, in numpy: the engine (Simulator, thread
ranks) must equal it bit for bit; the bytes per rank must not grow with the ranks.
"""

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.simulator import Simulator
from tests import conformance
from tests.helpers import topk_oracle

SHAPES = {"w": (30, 40), "v": (40, 30), "b": (500,), "tiny": (7,)}
RATIO = 0.03


def grads(step, ranks, seed=0):
    rng = np.random.default_rng(1000 * seed + step)
    return {name: [(rng.standard_normal(shape) * (1 + 0.3 * rng.random())).astype(np.float32) for _ in range(ranks)]
            for name, shape in SHAPES.items()}


class Oracle:
    """The shared-index rules per tensor (float32 sums in rank order, as the thread and lockstep ranks add)."""

    def __init__(self, ranks, rule, ratio=RATIO, dense_below=100):
        self.ranks, self.rule, self.ratio, self.dense_below = ranks, rule, ratio, dense_below
        self.residual, self.rate, self.age, self.step = {}, {}, {}, 0

    def k(self, n):
        return max(1, int(np.ceil(self.ratio * n * (1 - 1e-12))))

    def exchange(self, per_rank):
        out = {}
        for name, gs in per_rank.items():
            flat = [g.reshape(-1) for g in gs]
            n = flat[0].size
            if n < self.dense_below:
                total = flat[0].astype(np.float32)
                for g in flat[1:]:
                    total = total + g
                out[name] = (total / np.float32(self.ranks)).reshape(gs[0].shape)
                continue
            a = [g + self.residual.get((name, r), np.zeros(n, np.float32)) for r, g in enumerate(flat)]
            if self.rule == "leader":
                chosen = topk_oracle(a[self.step % self.ranks], self.k(n))
            elif name not in self.rate:
                chosen = np.arange(n)
            else:
                age = self.age[name] + 1
                chosen = topk_oracle(self.rate[name] * age, self.k(n))
            summed = a[0][chosen]
            for r in range(1, self.ranks):
                summed = summed + a[r][chosen]
            total = np.zeros(n, np.float32)
            total[chosen] = summed
            if self.rule == "aggregate":
                if name not in self.rate:
                    self.rate[name], self.age[name] = np.abs(total), np.zeros(n, np.float32)
                else:
                    self.rate[name][chosen] = np.abs(summed) / age[chosen]
                    age[chosen] = 0
                    self.age[name] = age
            for r in range(self.ranks):
                a[r][chosen] = 0
                self.residual[(name, r)] = a[r]
            out[name] = (total / np.float32(self.ranks)).reshape(gs[0].shape)
        self.step += 1
        return out


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
@pytest.mark.parametrize("ranks", [1, 3])
def test_simulator_equals_the_oracle_bit_for_bit(rule, ranks):
    sim = Simulator(ranks, TopK(RATIO, indices=rule, dense_below=100))
    oracle = Oracle(ranks, rule)
    for step in range(5):
        g = grads(step, ranks)
        got, want = sim.step(g), oracle.exchange(g)
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step} {name}")
    for name in ("w", "v", "b"):
        for r, residual in enumerate(sim.residuals(name)):
            np.testing.assert_array_equal(residual.reshape(-1), oracle.residual[(name, r)], err_msg=name)


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
@pytest.mark.parametrize("make", [TopK, GaussianK, RegTopK])
def test_sent_plus_residual_is_what_was_produced(rule, make):
    """Error feedback: per rank, the sum over steps of the gradients = what it sent + its residual (float64)."""
    ranks = 3
    sim = Simulator(ranks, make(0.05, indices=rule, dense_below=0))
    produced = {name: np.zeros((ranks,) + shape) for name, shape in SHAPES.items()}
    summed = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    for step in range(4):
        g = {name: [x.astype(np.float64) for x in per_rank] for name, per_rank in grads(step, ranks).items()}
        out = sim.step(g)
        for name in SHAPES:
            produced[name] += np.stack(g[name])
            summed[name] += out[name] * ranks
    for name in SHAPES:
        residuals = np.stack(sim.residuals(name))
        np.testing.assert_allclose(summed[name] + residuals.sum(0), produced[name].sum(0), rtol=0, atol=1e-9)
        assert np.count_nonzero(residuals), name


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_every_rank_sends_the_same_positions(rule):
    """What the ranks keep differs, but the entries they zeroed (sent) are the same set on every rank."""
    ranks = 4
    sim = Simulator(ranks, TopK(RATIO, indices=rule, dense_below=100))
    for step in range(3):
        g = grads(step, ranks)
        before = {name: [np.zeros(SHAPES[name]) if r is None else r for r in sim.residuals(name)] for name in ("w",)}
        sim.step(g)
        if step == 0 and rule == "aggregate":
            continue  # the first step sends every entry
        for name in before:
            sent = [np.flatnonzero(sim.residuals(name)[r] == 0) for r in range(ranks)]
            for r in range(1, ranks):
                np.testing.assert_array_equal(sent[r], sent[0])
            assert sent[0].size == int(np.ceil(RATIO * 1200)), (step, sent[0].size)


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("make", [TopK, GaussianK, RegTopK])
def test_thread_ranks_equal_the_simulator(rule, framework, make):
    conformance.check_thread_ranks_equal_simulator(
        lambda: make(0.05, indices=rule, dense_below=0), ranks=3, steps=3, framework=framework, rtol=0)


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_momentum_correction_on_thread_ranks_equals_the_simulator(rule):
    conformance.check_thread_ranks_equal_simulator(
        lambda: TopK(0.05, indices=rule, dense_below=0, momentum=0.9), ranks=2, steps=4, rtol=0)


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_drop_in_optimizer_equals_the_simulator(rule):
    conformance.check_drop_in_optimizer_equals_simulator(lambda: RegTopK(0.1, indices=rule, dense_below=0))


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_checkpoint_resumes_exactly(rule):
    """A restored Simulator goes on as the one that did not stop: the leader's turn, the aggregate rule's
    rates and ages, and the residuals come back."""
    conformance.check_state_dict_round_trip(lambda: TopK(0.05, indices=rule, dense_below=0), ranks=3)


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_a_density_change_keeps_the_rule_going(rule):
    """A new density rebuilds the plan; the leader goes on from the step the run stands at, the aggregate
    rule from its rates (no step sends the whole part again)."""
    sim = Simulator(3, TopK(0.05, indices=rule, dense_below=100))
    oracle = Oracle(3, rule, ratio=0.05)
    for step in range(5):
        if step in (2, 4):
            for c in sim.compressors:
                c.ratio = 0.02 * step
            oracle.ratio = 0.02 * step
        g = grads(step, 3)
        got, want = sim.step(g), oracle.exchange(g)
        for name in SHAPES:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {step} {name}")


@pytest.mark.parametrize("rule", ["leader", "aggregate"])
def test_bytes_per_rank_do_not_grow_with_the_ranks(rule):
    """Counted at the collectives (the lockstep ranks' statistics): a steady step sends the same bytes per
    rank at 2 and at 64 ranks; the allgather's grow... only in what each rank receives, (N-1) times its own."""
    per_rank = {}
    for ranks in (2, 16, 64):
        sim = Simulator(ranks, TopK(RATIO, indices=rule, dense_below=100))
        rng = np.random.default_rng(ranks)
        for _ in range(3):
            sim.step({name: [rng.standard_normal(shape).astype(np.float32)] * ranks for name, shape in SHAPES.items()})
        per_rank[ranks] = sim.bytes_sent_per_rank
    k = sum(int(np.ceil(RATIO * np.prod(s))) for s in SHAPES.values() if np.prod(s) >= 100)
    values = 4 * (k + 3)  # K values and a flag per compressed tensor
    expected = values + (4 * k if rule == "leader" else 0) + 4 * 7  # and the 7-element tensor dense
    for ranks, sent in per_rank.items():
        assert sent == [expected] * ranks, (ranks, sent, expected)


def test_nonfinite_gradient_on_one_rank_reaches_every_rank_and_state_is_kept():
    ranks = 3
    sim = Simulator(ranks, TopK(RATIO, indices="leader", dense_below=100))
    sim.step(grads(0, ranks))
    kept = [r.copy() for r in sim.residuals("w")]
    g = grads(1, ranks)
    g["w"][2] = g["w"][2].copy()
    g["w"][2][3, 4] = np.inf  # not at the leader (rank 1 leads step 1)
    out = sim.step(g)
    assert not np.all(np.isfinite(out["w"]))
    assert np.all(np.isfinite(out["b"]))
    for before, after in zip(kept, sim.residuals("w")):
        np.testing.assert_array_equal(after, before)


def test_ranks_that_disagree_on_the_rule_fail_on_every_rank():
    conformance.check_ranks_disagreeing_fail_clearly(lambda: TopK(0.05, indices="leader", dense_below=0),
                                                     lambda: TopK(0.05, indices="aggregate", dense_below=0))
    conformance.check_ranks_disagreeing_fail_clearly(lambda: TopK(0.05, indices="leader", dense_below=0),
                                                     lambda: TopK(0.05, dense_below=0))


def test_bad_modes_are_clear_errors():
    with pytest.raises(ValueError, match="indices must be one of 'gather', 'leader', 'aggregate'"):
        TopK(0.01, indices="broadcast")
    with pytest.raises(TypeError, match="indices must be one of"):
        GaussianK(0.01, indices=3)
    with pytest.raises(ValueError, match="indices must be one of"):  # 'auto' picks by a traffic budget
        TopK(0.01, indices="auto")


def test_dense_only_where_the_shared_payload_is_no_smaller():
    """A shared set's payload does not grow with N: at 64 ranks a tensor goes dense only when ``2k``
    (leader: values and indices) or ``k`` (aggregate) reach its size, unlike the allgather's ``N k``."""
    gather, leader, aggregate = (TopK(0.1, indices=m).bind(0, 64) for m in ("gather", "leader", "aggregate"))
    assert gather.fused_kind(5000) == "dense"
    assert leader.fused_kind(5000) == aggregate.fused_kind(5000) == "sparse"
    assert TopK(0.5, indices="leader").bind(0, 64).fused_kind(5000) == "dense"
    assert TopK(0.5, indices="aggregate").bind(0, 64).fused_kind(5000) == "sparse"


def test_aggregate_rule_recovers_from_a_nonfinite_first_step():
    """A NaN in the step that teaches every rate (the first) makes that tensor non-finite everywhere, as
    dense would; its rates start at 0 instead of NaN, so the next steps choose and train again."""
    ranks = 3
    sim = Simulator(ranks, TopK(RATIO, indices="aggregate", dense_below=100))
    g = grads(0, ranks)
    g["w"][1] = g["w"][1].copy()
    g["w"][1][0, 0] = np.nan
    assert np.isnan(sim.step(g)["w"]).any()
    for step in (1, 2):
        out = sim.step(grads(step, ranks))
        assert all(np.all(np.isfinite(v)) for v in out.values()), step
        assert np.count_nonzero(out["w"]) == int(np.ceil(RATIO * 1200))
