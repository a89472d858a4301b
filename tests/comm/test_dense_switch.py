"""Sparsifiers send dense when N * k >= numel (a sparse allgather would move more bytes): the
per-tensor spec (tests/oracle.py), the Simulator (the engine in lockstep), and thread ranks on the
fused bucket path (numpy, torch) against the per-tensor spec."""

import contextlib
import warnings

import numpy as np
import pytest

from hvd_compress import GaussianK, RegTopK, TopK
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.simulator import Simulator
from tests.helpers import topk_oracle
from tests.oracle import PerTensorRanks

KINDS = [TopK, GaussianK, RegTopK]


def grads(n_ranks, numel, seed):
    rng = np.random.default_rng(seed)
    return {"w": [rng.standard_normal(numel) for _ in range(n_ranks)]}


@pytest.mark.parametrize("kind", KINDS)
def test_crowded_tensor_is_planned_dense_by_the_engine(kind):
    """The Simulator (the routes' engine) plans the tensor dense from its first step, silently (nothing
    is kept back to flush): one allreduce of its float64 values, and the layout header at the first step."""
    sim = Simulator(16, kind(0.1))
    step = grads(16, 1100, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sim.step(step)["w"]
    np.testing.assert_allclose(out, np.mean(step["w"], axis=0), rtol=1e-12)
    assert sim.bytes_sent_per_rank == [8 * 1100 + 16] * 16
    assert all(r is None or np.all(r == 0) for r in sim.residuals("w"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sim.step(grads(16, 1100, 1))
    assert sim.bytes_sent_per_rank == [8 * 1100] * 16


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ranks_of", [Simulator, PerTensorRanks], ids=["engine", "per-tensor"])
def test_switching_to_dense_flushes_the_residual(kind, ranks_of):
    """Sparse at ratio 0.01 (4 x 20 < 2000), then dense at 0.5: what was kept is sent then."""
    compressor = kind(0.01)
    sim = ranks_of(4, compressor)
    first, second = grads(4, 2000, 0), grads(4, 2000, 1)
    sparse_out = sim.step(first)["w"]
    kept = [r.copy() for r in sim.residuals("w")]
    assert any(np.any(r != 0) for r in kept)
    for c in sim.compressors:
        c.ratio = 0.5
    with pytest.warns(UserWarning, match="dense") if ranks_of is Simulator else contextlib.nullcontext():
        dense_out = sim.step(second)["w"]  # the engine warns that the residual goes with the tensor
    expected = np.mean([g + r for g, r in zip(second["w"], kept)], axis=0)
    np.testing.assert_allclose(dense_out, expected, rtol=1e-12, atol=1e-15)
    total_in = np.sum(first["w"], axis=0) + np.sum(second["w"], axis=0)
    np.testing.assert_allclose(4 * (sparse_out + dense_out), total_in, rtol=1e-10, atol=1e-12)


def test_switch_can_be_turned_off_and_needs_several_ranks():
    one = Simulator(1, TopK(0.9, dense_below=0))  # one rank: k = 9 of 10 stays sparse
    one.step(grads(1, 10, 0))
    assert one.values_sent_per_rank == [9]
    off = Simulator(16, TopK(0.1, dense_when_cheaper=False))  # 16 x 110 >= 1100, sparse all the same
    off.step(grads(16, 1100, 0))
    assert off.values_sent_per_rank == [110] * 16
    on = Simulator(16, TopK(0.1))
    on.step(grads(16, 1100, 0))
    assert on.values_sent_per_rank == [1100] * 16


@pytest.mark.filterwarnings("ignore:.*dense")
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_bucket_switching_to_dense_and_back_equals_the_simulator(kind, framework):
    """The same switch on thread ranks through the fused bucket path (numpy arrays, torch tensors): sparse at 0.01,
    dense at 0.5 (the residual flushed into the dense sum, once), sparse again: every rank's results
    and residuals (none, or zeros, while dense) are the per-tensor spec's bit for bit (RegTop-k's posterior
    survives the dense step on both)."""
    ranks = 4
    ratios = [0.01, 0.5, 0.01]
    steps = [{"w": grads(ranks, 2000, seed)["w"], "v": grads(ranks, 300, 10 + seed)["w"]} for seed in range(3)]
    wrap = pytest.importorskip("torch").from_numpy if framework == "torch" else (lambda a: a)

    def work(comm):
        compressor, out = kind(0.01, dense_below=0), []
        for step, ratio in enumerate(ratios):
            compressor.ratio = ratio
            exchange = BucketExchange(compressor, comm, "bucket")
            for name, per_rank in steps[step].items():
                exchange.add(name, wrap(per_rank[comm.rank]))
            exchange.launch()
            assert len(exchange.launched) == 1
            out.append((exchange.finish(), {name: compressor.residual(name) for name in steps[step]}))
        return out

    results = run_ranks(ranks, work)
    sim = PerTensorRanks(ranks, kind(0.01, dense_below=0))
    for step, ratio in enumerate(ratios):
        for c in sim.compressors:
            c.ratio = ratio
        expected = sim.step(steps[step])
        for rank, result in enumerate(results):
            got, residuals = result[step]
            for name in expected:
                np.testing.assert_array_equal(got[name], expected[name], f"step {step} {name}")
                want, mine = sim.compressors[rank].residual(name), residuals[name]
                zeros = np.zeros(got[name].shape)  # a tensor sent dense keeps none on the fused path: all sent
                np.testing.assert_array_equal(zeros if mine is None else mine, zeros if want is None else want,
                                              f"step {step} {name} rank {rank}")


@pytest.mark.parametrize("kind, entries", [(TopK, 10 + 1), (RegTopK, 10 + 1), (GaussianK, 13 + 1 + 1)],
                         ids=["TopK", "RegTopK", "GaussianK"])
def test_dense_exactly_at_n_k_equal_to_numel(kind, entries):
    """No momentum, 3 ranks at ratio 0.32: 30 elements (k = 10, 3 x 10 = 30 >= 30) go dense, one allreduce of
    4 x 30 bytes whose result is the float32 mean; 31 elements (k = 10, 3 x 10 = 30 < 31) stay sparse, an
    allgather of each rank's (value, index) entries, (4 + 4) bytes each: k slots and a flag (Gaussian-k:
    floor(4k/3) slots, a flag and its spare entry). Each with the layout header (16 bytes) of a first step."""
    for numel, dense in ((30, True), (31, False)):
        compressor = kind(0.32, dense_below=0)
        assert compressor.k(numel) == 10
        sim = Simulator(3, compressor)
        step = [g.astype(np.float32) for g in grads(3, numel, numel)["w"]]
        out = sim.step({"w": step})["w"]
        kinds = {(name, kind_of) for posted in sim.collectives_per_rank for name, kind_of, _ in posted}
        if dense:
            assert kinds == {("simulator.header", "allgather"), ("simulator.dense", "allreduce")}
            assert sim.bytes_sent_per_rank == [4 * 30 + 16] * 3
            np.testing.assert_array_equal(out, (step[0] + step[1] + step[2]) / np.float32(3))
        else:
            assert {kind_of for name, kind_of in kinds} == {"allgather"}
            assert sim.bytes_sent_per_rank == [entries * (4 + 4) + 16] * 3
            if kind is TopK:
                want = np.zeros(numel, np.float32)
                for g in step:
                    chosen = topk_oracle(g, 10)
                    want[chosen] += g[chosen]
                np.testing.assert_array_equal(out, want / np.float32(3))


@pytest.mark.parametrize("indices, ratio, k, dense_numel, sparse_numel, sparse_collectives, sparse_bytes", [
    # 2k >= numel: k = 10 of 20 (ceil(0.47 x 20) = 10) dense, of 21 (ceil(9.87) = 10) sparse: the leader's
    # 10 int32 indices, then 10 values and a flag, allreduced
    ("leader", 0.47, 10, 20, 21, {"leader", "values"}, 4 * 10 + 4 * (10 + 1)),
    # k >= numel: k = 19 of 19 (ceil(18.05) = 19) dense, of 20 (ceil(19) = 19) sparse: 19 values and a flag
    ("aggregate", 0.95, 19, 19, 20, {"values"}, 4 * (19 + 1)),
], ids=["leader", "aggregate"])
def test_shared_index_sets_go_dense_exactly_at_their_bound(indices, ratio, k, dense_numel, sparse_numel,
                                                           sparse_collectives, sparse_bytes):
    """No momentum, 3 ranks, a shared index set's values allreduced: dense exactly where the sparse words
    (2k with the leader's indices, k with ``aggregate``'s) reach the tensor's numel, sparse one element
    above. Bytes and collectives of a second step (no layout header, ``aggregate``'s set known); the dense
    result is the float32 mean."""
    for numel, dense in ((dense_numel, True), (sparse_numel, False)):
        compressor = TopK(ratio, indices=indices, dense_below=0)
        assert compressor.k(numel) == k
        sim = Simulator(3, compressor)
        sim.step({"w": [g.astype(np.float32) for g in grads(3, numel, numel)["w"]]})
        step = [g.astype(np.float32) for g in grads(3, numel, 100 + numel)["w"]]
        out = sim.step({"w": step})["w"]
        names = {name.split(".")[-1] for posted in sim.collectives_per_rank for name, _, _ in posted}
        assert {kind for posted in sim.collectives_per_rank for _, kind, _ in posted} == {"allreduce"}
        if dense:
            assert names == {"dense"}
            assert sim.bytes_sent_per_rank == [4 * numel] * 3
            np.testing.assert_array_equal(out, (step[0] + step[1] + step[2]) / np.float32(3))
        else:
            assert names == sparse_collectives
            assert sim.bytes_sent_per_rank == [sparse_bytes] * 3
