"""``traffic=``: a budget in bytes per rank relative to a dense float32 ring allreduce, resolved per world
size into an index mode and a density (hvd_compress/algorithms/traffic.py).

Per rank, a ring allreduce of ``b`` bytes moves ``2 (N-1)/N b`` and an allgather receives ``(N-1) b``;
the Simulator records what each rank hands to which collective, so the traffic of a step is counted
here from the collectives, independently of the resolution's formulas.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress import Auto, DensityWarmup, GaussianK, RegTopK, TopK
from hvd_compress.simulator import Simulator
from hvd_compress.algorithms import traffic
from hvd_compress.transport.threads import run_ranks
from tests import conformance

D = 200_000


@pytest.mark.parametrize("size", [1, 2, 4, 7, 8, 16, 64, 256])
def test_resolution_by_hand(size):
    indices, ratio = traffic.resolve(0.05, "auto", size)
    assert indices == ("aggregate" if size >= traffic.SHARED_FROM else "gather")
    assert ratio == pytest.approx(0.05 if indices == "aggregate" else 0.05 / size, rel=1e-12)
    assert traffic.resolve(0.05, "leader", size) == ("leader", pytest.approx(0.025))
    assert traffic.resolve(0.05, "gather", size) == ("gather", pytest.approx(0.05 / size))
    assert traffic.resolve(1.0, "leader", size)[1] == 0.5 and traffic.resolve(1.0, "aggregate", size)[1] == 1.0


def ring_traffic(sim: Simulator, numel: int = D) -> float:
    """The last step's bytes per rank on the wire (mean over ranks) over a dense float32 ring allreduce's of
    ``numel`` entries."""
    n = sim.n_ranks
    factor = {"allreduce": 2 * (n - 1) / n, "allgather": n - 1}
    moved = np.mean([sum(factor[kind] * size for _, kind, size in rank) for rank in sim.collectives_per_rank])
    return moved / (2 * (n - 1) / n * 4 * numel)


@pytest.mark.parametrize("make", [lambda: TopK(traffic=0.05), lambda: RegTopK(traffic=0.05),
                                  lambda: TopK(traffic=0.05, indices="leader")])
@pytest.mark.parametrize("size", [2, 4, 16, 64])
def test_the_simulator_moves_the_budget_at_every_size(make, size):
    sim = Simulator(size, make())
    rng = np.random.default_rng(size)
    for _ in range(3):
        sim.step({"w": [rng.standard_normal(D).astype(np.float32) for _ in range(size)]})
    assert ring_traffic(sim) == pytest.approx(0.05, rel=0.02)
    assert len({repr(c.config()) for c in sim.compressors}) == 1  # every rank resolved alike


@pytest.mark.parametrize("size", [4, 16, 64])
def test_tensors_under_dense_below_travel_dense_beside_the_budget(size):
    """The recommended setting, ``TopK(traffic=0.03, dense_below=2000)``, on a model with a classifier head
    (1,280 entries) and a bias: those go dense, the rest at the budget, so a step moves ``(1,280 + 128 + 0.03
    D) / (D + 1,408)`` of a dense allreduce's ring traffic, the same at every N."""
    shapes = {"w": D, "head": 1280, "b": 128}
    sim = Simulator(size, TopK(traffic=0.03, dense_below=2000))
    rng = np.random.default_rng(size)
    for _ in range(3):
        sim.step({name: [rng.standard_normal(n).astype(np.float32) for _ in range(size)]
                  for name, n in shapes.items()})
    numel = sum(shapes.values())
    assert ring_traffic(sim, numel) == pytest.approx((1280 + 128 + 0.03 * D) / numel, rel=0.02)


def test_a_budget_is_flat_in_n_where_a_density_is_not():
    """TopK(0.01) (gather) costs N x its density, dense from N k >= d on; TopK(traffic=0.04) costs 0.04
    at every N."""
    for size in (4, 16, 64, 128):
        rng = np.random.default_rng(0)
        grads = {"w": [rng.standard_normal(D).astype(np.float32) for _ in range(size)]}
        dense_ratio, budget = Simulator(size, TopK(0.01)), Simulator(size, TopK(traffic=0.04))
        for _ in range(2):  # the aggregate rule's first step sends every entry once (every rank learns the rates)
            dense_ratio.step(grads)
            budget.step(grads)
        assert ring_traffic(dense_ratio) == pytest.approx(min(1.0, 0.01 * size), rel=0.02)
        assert ring_traffic(budget) == pytest.approx(0.04, rel=0.02)


def test_thread_ranks_resolve_alike_and_equal_the_simulator():
    for ranks in (2, 4):
        conformance.check_thread_ranks_equal_simulator(lambda: TopK(traffic=0.2, dense_below=0), ranks=ranks)
    configs = run_ranks(4, lambda comm: TopK(traffic=0.05).bind(comm.rank, comm.size).config(), timeout=10)
    assert all(config == configs[0] for config in configs)


def test_warmup_ramps_the_traffic_and_rebinding_resolves_again():
    compressor = TopK(traffic=0.05, indices="gather")
    warmup = DensityWarmup(compressor, 4, start=0.25)
    compressor.bind(0, 4)
    assert compressor.traffic == 0.25 and compressor.ratio == pytest.approx(0.25 / 4)
    for _ in range(4):
        warmup.step()
    assert compressor.traffic == 0.05 and compressor.ratio == pytest.approx(0.05 / 4)
    compressor.bind(0, 16)  # an elastic reset, a resume at another N
    assert (compressor.indices, compressor.ratio) == ("gather", pytest.approx(0.05 / 16))
    auto = Auto(TopK(traffic=0.05, indices="leader")).bind(0, 2)
    assert auto.traffic == 0.05 and auto.inner.ratio == pytest.approx(0.025)
    default = TopK(traffic=0.05)
    assert (default.indices, default.ratio) == ("gather", 0.05)  # one rank: nothing to share
    assert (default.bind(0, 2).indices, default.ratio) == ("aggregate", 0.05)


def test_gaussiank_and_exact_every_with_a_budget():
    assert GaussianK(traffic=0.04, indices="gather").bind(0, 4).ratio == pytest.approx(0.01)
    assert TopK(traffic=0.04, exact_every=8, indices="gather").bind(0, 4).exact_every == 8
    with pytest.raises(ValueError, match="pass indices='gather'"):
        TopK(traffic=0.04, exact_every=8)


def test_a_checkpoint_resumes_at_another_size_with_the_budget_resolved_again():
    rng = np.random.default_rng(3)
    four = Simulator(4, TopK(traffic=0.05))
    four.step({"w": [rng.standard_normal(D).astype(np.float32) for _ in range(4)]})
    state = four.compressors[0].state_dict()
    resumed = TopK(traffic=0.05).bind(0, 16)
    resumed.load_state_dict(state)
    assert (resumed.indices, resumed.ratio) == ("aggregate", pytest.approx(0.05))
    np.testing.assert_array_equal(resumed.residual("w"), four.compressors[0].residual("w"))
