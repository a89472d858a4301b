"""The worked example of docs/adding_a_compressor.md: a compressor written from that page alone.

Random-k: each rank sends ``k = ceil(ratio d)`` entries of ``a = g + r`` chosen
uniformly at random from its own stream (a different choice per rank and step)
and keeps the rest in its residual (error feedback). It is a ``Sparsifier`` that
implements ``_select`` and nothing else: a fused bucket runs ``_select`` on each of its
tensors alone, in the order they were added (``Sparsifier.bucket_select``). The tests
run it through the conformance checks of ``tests/conformance.py``: Simulator,
thread ranks through the real exchange, the drop-in torch optimizer, mass
conservation, checkpoints, and ranks that disagree.
"""

import numpy as np
import pytest

from hvd_compress import TopK
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.algorithms.sparse import Sparsifier
from hvd_compress.simulator import Simulator
from tests import conformance


class RandomK(Sparsifier):
    """Random-k sparsification with error feedback: ``S`` = ``k`` indices drawn without replacement."""

    def _select(self, a, name, shape, ops):
        # the k largest of d uniform draws of this rank's stream: k distinct indices, uniformly chosen
        scores = ops.uniform(self.generator(ops, a), a)
        return ops.topk_indices(scores, self.k(a.shape[0]))


def make():
    return RandomK(0.1, dense_below=0)


# --------------------------------------------------------------------------- the algorithm itself
def sent_by_one_rank(compressor, grad, steps=1):
    """What ``compressor`` sends of ``grad`` at each of ``steps`` steps: the engine's sum over a world of one."""
    sim = Simulator(1, compressor)
    return [sim.step({"w": [grad]})["w"] for _ in range(steps)], sim


def test_sends_k_distinct_entries_of_g_plus_r_and_keeps_the_rest():
    grad = np.random.default_rng(0).standard_normal(200).astype(np.float32)
    (first, second), sim = sent_by_one_rank(make(), grad, steps=2)
    chosen = np.flatnonzero(first)
    assert chosen.shape == (20,)
    np.testing.assert_array_equal(first[chosen], grad[chosen])
    residual = grad.copy()
    residual[chosen] = 0
    again = np.flatnonzero(second)  # a = g + r; another draw
    assert again.shape == (20,) and not np.array_equal(again, chosen)
    np.testing.assert_array_equal(second[again], (grad + residual)[again])
    residual = grad + residual
    residual[again] = 0
    np.testing.assert_array_equal(sim.residuals("w")[0], residual)


def test_ranks_draw_from_their_own_streams_and_the_seed_sets_them():
    def chosen(compressor):  # each rank's choice: where its residual of a gradient of ones is 0
        sim = Simulator(4, compressor)
        sim.step({"w": [np.ones(100, np.float32)] * 4})
        return [np.flatnonzero(r == 0) for r in sim.residuals("w")]

    first = chosen(make())
    assert all(c.shape == (10,) for c in first) and len({c.tobytes() for c in first}) == 4
    for again, before in zip(chosen(make()), first):
        np.testing.assert_array_equal(again, before)
    assert not np.array_equal(chosen(RandomK(0.1, dense_below=0, seed=7))[2], first[2])


def test_is_unbiased_in_its_choice():
    """Each entry is chosen with probability k / d: over 400 draws every entry of 20 is seen about 40 times."""
    sent, _ = sent_by_one_rank(RandomK(0.1, dense_below=0, error_feedback=False), np.ones(20, np.float32), steps=400)
    counts = np.sum([s != 0 for s in sent], axis=0)
    assert counts.sum() == 800
    assert counts.min() > 20 and counts.max() < 65


def test_arguments_are_checked_and_in_the_configuration():
    with pytest.raises(ValueError, match="hvd_compress: ratio"):
        RandomK(0.0)
    compressor = make()
    with pytest.raises(TypeError, match="hvd_compress: RandomK error_feedback"):
        compressor.error_feedback = "no"
    assert compressor.config() == {
        "type": "RandomK",
        "ratio": 0.1,
        "error_feedback": True,
        "dense_below": 0,
        "dense_when_cheaper": True,
    }
    assert compressor.config_hash() != TopK(0.1, dense_below=0).config_hash()
    assert compressor.fused_kind(1000) == "sparse"  # the stock Horovod route compresses it


def test_small_tensors_go_dense_with_the_default_dense_below():
    assert RandomK(0.1).fused_kind(100) == "dense" and RandomK(0.1).fused_kind(1024) == "sparse"
    sent, sim = sent_by_one_rank(RandomK(0.1), np.arange(1.0, 101.0, dtype=np.float32))
    np.testing.assert_array_equal(sent[0], np.arange(1.0, 101.0))
    assert sim.residuals("w")[0] is None


# --------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
def test_results_keep_shape_and_dtype(framework):
    conformance.check_results_keep_shape_and_dtype(make, framework)


def test_rejects_bad_gradients():
    conformance.check_rejects_bad_gradients(make)


def test_conserves_mass_sent_plus_residual_equals_produced():
    conformance.check_conserves_mass(make)


def test_bytes_are_k_values_and_indices():
    """Per tensor k float32 values and k int32 indices; the engine (the Simulator, every route) also sends
    each tensor's flag with its position, and the layout check's header (two int64) at its first step."""
    sim = Simulator(3, make())
    payloads = sum(8 * make().k(int(np.prod(shape))) for shape in conformance.SHAPES.values())
    flags, header = 8 * len(conformance.SHAPES), 16
    for step in range(2):
        sim.step(conformance.gradients(step, 3))
        assert sim.bytes_sent_per_rank == [payloads + flags + (header if step == 0 else 0)] * 3


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow", "tensorflow-kernels"])
def test_thread_ranks_through_the_real_exchange_equal_the_per_tensor_spec(framework):
    conformance.check_thread_ranks_equal_per_tensor_spec(make, framework=framework)


def test_drop_in_torch_optimizer_on_thread_ranks_equals_the_simulator():
    conformance.check_drop_in_optimizer_equals_simulator(make)


@pytest.mark.parametrize("framework", ["numpy", "torch", "tensorflow"])
def test_state_dict_round_trip_continues_exactly(framework):
    conformance.check_state_dict_round_trip(make, framework=framework)


def test_ranks_running_another_compressor_fail_clearly():
    conformance.check_ranks_disagreeing_fail_clearly(make, lambda: TopK(0.1, dense_below=0))
    conformance.check_ranks_disagreeing_fail_clearly(make, lambda: RandomK(0.2, dense_below=0))


# --------------------------------------------------------------------------- the fused bucket
#: sizes interleaved: the bucket lays out "a", "c" (40 each), then "b"; the draws still come in the order a, b, c
INTERLEAVED = {"a": (40,), "b": (8, 40), "c": (40,)}


def interleaved(step, ranks, framework="numpy"):
    rng = np.random.default_rng(700 + step)
    grads = {name: [rng.standard_normal(shape).astype(np.float32) for _ in range(ranks)]
             for name, shape in INTERLEAVED.items()}
    if framework == "torch":
        torch = pytest.importorskip("torch")
        grads = {name: [torch.from_numpy(g) for g in per_rank] for name, per_rank in grads.items()}
    return grads


def fused_steps(comm, compressor, grads_of, steps):
    """This rank's averages of ``steps`` steps through one bucket."""
    out = []
    for step in range(steps):
        exchange = BucketExchange(compressor, comm, "bucket0")
        for name, per_rank in grads_of(step, comm.size).items():
            exchange.add(name, per_rank[comm.rank])
        exchange.launch()
        out.append({name: conformance.as_numpy(v) for name, v in exchange.finish(average=True).items()})
    return out


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_a_fused_bucket_selects_each_tensor_alone_in_the_order_they_were_added(framework):
    ranks, steps = 3, 3
    compressors = [make() for _ in range(ranks)]
    grads_of = lambda step, size: interleaved(step, size, framework)  # noqa: E731
    results = run_ranks(ranks, lambda comm: fused_steps(comm, compressors[comm.rank], grads_of, steps), timeout=30)
    sim = Simulator(ranks, make())
    expected = [sim.step(interleaved(step, ranks, framework)) for step in range(steps)]
    for rank, (rank_result, compressor) in enumerate(zip(results, compressors)):
        for got, want in zip(rank_result, expected):
            for name in INTERLEAVED:
                np.testing.assert_array_equal(got[name], conformance.as_numpy(want[name]), err_msg=name)
        for name in INTERLEAVED:
            np.testing.assert_array_equal(conformance.as_numpy(compressor.residual(name)),
                                          conformance.as_numpy(sim.compressors[rank].residual(name)), err_msg=name)


def test_a_nan_on_one_rank_is_nan_on_every_rank_and_no_state_moves():
    compressors = [make() for _ in range(3)]

    def poisoned(step, size):
        grads = interleaved(step, size)
        if step == 1:
            grads["b"][1][3, 5] = np.inf
        return grads

    before = {}

    def run(comm):
        first = fused_steps(comm, compressors[comm.rank], poisoned, 1)
        before[comm.rank] = compressors[comm.rank].residual("b").copy()
        return first + fused_steps(comm, compressors[comm.rank], lambda step, size: poisoned(step + 1, size), 1)

    results = run_ranks(3, run, timeout=30)
    sim = Simulator(3, make())
    sim.step(interleaved(0, 3))
    want = sim.step({name: interleaved(1, 3)[name] for name in ("a", "c")})  # "b" draws after "a", before "c"
    for rank, result in enumerate(results):
        assert np.isnan(result[1]["b"]).any()  # non-finite, as a dense allreduce would give
        np.testing.assert_array_equal(compressors[rank].residual("b"), before[rank])
        np.testing.assert_array_equal(result[1]["a"], want["a"])
        assert not np.array_equal(result[1]["c"], want["c"])  # "b"'s draws came before "c"'s
