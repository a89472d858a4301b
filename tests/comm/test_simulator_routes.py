"""The Simulator runs the routes' engine: its bytes per rank and step are a real route's.

Thread ranks (:mod:`hvd_compress.transport.threads`: one thread per rank, the real
:class:`~hvd_compress.engine.exchange.BucketExchange`) and the Simulator step the same random
gradients (not multiples of 0.5) for every built-in compressor at N = 2 and 4: every rank hands
the collectives the bytes the Simulator counts for it (the layout check's header at the first
step included; Gaussian-k's ``floor(4k/3)`` slots per tensor), and the averages are equal bit for
bit, FP16's included (the Simulator sums the float16 wire in rank order, as thread ranks do).
"""

import numpy as np
import pytest

from hvd_compress import FP16, Auto, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.simulator import Simulator

#: a layer the sparsifiers compress at N = 4 (k = 41, N k < d), a matrix, and a bias sent dense
SHAPES = {"w": (64, 64), "v": (40, 30), "b": (64,)}
STEPS = 3
BUILT_IN = {
    "none": NoneCompressor,
    "fp16": FP16,
    "topk": lambda: TopK(0.01),
    "gaussiank": lambda: GaussianK(0.01),
    "regtopk": lambda: RegTopK(0.01, seed=2),
    "terngrad": lambda: TernGrad(seed=3),
    "terngrad-unshared": lambda: TernGrad(scalar_sharing=False, seed=3),
    "auto-topk-pinned": lambda: Auto(TopK(0.01), pin="compressed", log=False),  # timing-free
}


def gradients(step: int, ranks: int, dtype=np.float32):
    rng = np.random.default_rng(1000 + 10 * step + ranks)
    return {name: [rng.standard_normal(shape).astype(dtype) for _ in range(ranks)] for name, shape in SHAPES.items()}


def thread_ranks(make, ranks: int, dtype=np.float32):
    """Every rank's ``(bytes sent, averages)`` per step over thread ranks."""
    def work(comm):
        compressor, out = make(), []
        for step in range(STEPS):
            before = compressor.stats.bytes_sent
            exchange = open_exchange(compressor, comm, "bucket")
            for name, per_rank in gradients(step, ranks, dtype).items():
                exchange.add(name, per_rank[comm.rank])
            exchange.launch()
            result = exchange.finish(average=True)
            out.append((compressor.stats.bytes_sent - before, {n: np.asarray(t).copy() for n, t in result.items()}))
        return out

    return run_ranks(ranks, work, timeout=60)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("kind", BUILT_IN)
def test_simulator_bytes_and_averages_equal_thread_ranks(kind, ranks):
    routes = thread_ranks(BUILT_IN[kind], ranks)
    sim = Simulator(ranks, BUILT_IN[kind]())
    for step in range(STEPS):
        averaged = sim.step(gradients(step, ranks))
        assert sim.bytes_sent_per_rank == [routes[r][step][0] for r in range(ranks)], (kind, step)
        for r in range(ranks):
            for name in SHAPES:
                np.testing.assert_array_equal(routes[r][step][1][name], averaged[name], err_msg=f"{step} {name}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("ranks", [2, 4])
def test_fp16_over_thread_ranks_equals_the_simulator_bit_for_bit(ranks, dtype):
    """Random data: every rank's float16 wire summed in rank order, then divided, on both sides."""
    routes = thread_ranks(FP16, ranks, dtype)
    sim = Simulator(ranks, FP16())
    for step in range(STEPS):
        averaged = sim.step(gradients(step, ranks, dtype))
        for name in SHAPES:
            assert averaged[name].dtype == dtype
            for r in range(ranks):
                np.testing.assert_array_equal(routes[r][step][1][name], averaged[name], err_msg=f"{step} {name}")


def test_gaussiank_sends_its_slots_and_topk_its_k():
    """Hand-computed bytes of a steady step at N = 4: ``w`` (4,096 entries, k = 41) and ``v`` (1,200,
    k = 12) compressed, ``b`` dense (256 bytes). Top-k: per tensor k (float32 value, int32 index) slots
    and a flag with its position (8 bytes); Gaussian-k: floor(4k/3) slots (54 and 16) instead of k,
    and one more flag slot for the spare entry its unused slots point at."""
    def steady(make):
        sim = Simulator(4, make())
        sim.step(gradients(0, 4))
        sim.step(gradients(1, 4))
        return sim.bytes_sent_per_rank

    dense = 64 * 4
    assert steady(lambda: TopK(0.01)) == [dense + 8 * (41 + 12) + 8 * 2] * 4
    assert steady(lambda: GaussianK(0.01)) == [dense + 8 * (54 + 16) + 8 * 3] * 4
