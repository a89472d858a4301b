"""Checkpoints: a simulator restored from state_dict() continues bit-exactly.

Covers residuals, RegTop-k's distortion and TernGrad's random streams.
"""

import copy
import pickle

import numpy as np
import pytest

from hvd_compress import Auto
from hvd_compress.algorithms.state import CompressorState
from hvd_compress.simulator import Simulator

from tests.helpers import ALL_COMPRESSORS

N_RANKS = 3
SHAPES = {"conv.weight": (8, 25), "fc.bias": (7,)}


def gradients(step, framework="numpy"):
    """Deterministic float32 gradients of every rank for ``step`` (their scale drifts with the step),
    as numpy arrays or torch tensors (then the torch kernels and random streams run)."""
    rng = np.random.default_rng(1000 + step)
    grads = {
        name: [(rng.standard_normal(shape) * (1 + 0.1 * step)).astype(np.float32) for _ in range(N_RANKS)]
        for name, shape in SHAPES.items()
    }
    if framework == "torch":
        torch = pytest.importorskip("torch")
        grads = {name: [torch.from_numpy(g) for g in per_rank] for name, per_rank in grads.items()}
    return grads


def run(sim, steps, framework="numpy"):
    return [sim.step(gradients(step, framework)) for step in steps]


def assert_identical(outputs, expected):
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name].dtype == want[name].dtype
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_same_residuals(sim_a, sim_b):
    for name in SHAPES:
        for ra, rb in zip(sim_a.residuals(name), sim_b.residuals(name)):
            if ra is None:
                assert rb is None
            else:
                np.testing.assert_array_equal(ra, rb, err_msg=name)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize(
    "checkpoint", [copy.deepcopy, lambda s: pickle.loads(pickle.dumps(s))], ids=["deepcopy", "pickle"]
)
@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
def test_restored_simulator_continues_bit_exactly(kind, checkpoint, framework):
    original = Simulator(N_RANKS, ALL_COMPRESSORS[kind](), seed=5)
    run(original, range(1, 6), framework)
    state = checkpoint(original.state_dict())
    expected = run(original, range(6, 11), framework)

    restored = Simulator(N_RANKS, ALL_COMPRESSORS[kind](), seed=5)
    restored.load_state_dict(state)
    assert restored.steps == 5
    assert_identical(run(restored, range(6, 11), framework), expected)
    assert_same_residuals(restored, original)


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
def test_rewinding_to_an_earlier_checkpoint_repeats_the_steps(kind):
    sim = Simulator(N_RANKS, ALL_COMPRESSORS[kind](), seed=5)
    start = copy.deepcopy(sim.state_dict())  # before any step: no residual, no random draw
    first = run(sim, range(1, 4))
    middle = copy.deepcopy(sim.state_dict())
    second = run(sim, range(4, 7))

    sim.load_state_dict(start)  # the same, already advanced simulator
    assert_identical(run(sim, range(1, 4)), first)
    sim.load_state_dict(middle)
    assert_identical(run(sim, range(4, 7)), second)


def test_random_compressors_do_differ_without_the_checkpoint():
    """Guards the tests above: TernGrad's outputs depend on the random stream position."""
    sim = Simulator(N_RANKS, ALL_COMPRESSORS["terngrad"](), seed=5)
    fresh = Simulator(N_RANKS, ALL_COMPRESSORS["terngrad"](), seed=5)
    run(sim, range(1, 6))
    later, first = run(sim, [6])[0], run(fresh, [6])[0]
    assert not np.array_equal(later["conv.weight"], first["conv.weight"])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
def test_the_run_state_is_all_in_compressor_state(kind, framework):
    """Configuration apart from state: with a fresh ``CompressorState`` on every rank, a simulator
    that ran five steps continues exactly as a new one starts (residuals, posteriors, streams gone)."""
    used = Simulator(N_RANKS, ALL_COMPRESSORS[kind](), seed=5)
    run(used, range(1, 6), framework)
    configs = [c.config() for c in used.compressors]
    for compressor in used.compressors:
        compressor.state = CompressorState()
    fresh = Simulator(N_RANKS, ALL_COMPRESSORS[kind](), seed=5)
    assert_identical(run(used, [6], framework), run(fresh, [6], framework))
    assert [c.config() for c in used.compressors] == configs
    assert all(c.memory is c.state.memory for c in used.compressors)


def test_auto_and_its_dense_view_share_the_inner_state():
    inner = ALL_COMPRESSORS["regtopk"]()
    auto = Auto(inner, pin="dense", log=False)
    assert auto.state is inner.state and auto.dense.state is inner.state and auto.memory is inner.memory


def test_route_data_is_made_once_per_key():
    state = CompressorState()
    first = state.route_data("a route", list)
    assert state.route_data("a route", dict) is first and state.route_data("another", dict) == {}
