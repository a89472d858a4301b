"""Bad input gets a clear error on every rank, naming the tensor where there is one; NaN/Inf and float16
overflow travel as through the dense allreduce the exchange replaces."""

import warnings

import numpy as np
import pytest

from hvd_compress import FP16, Compression, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.engine.exchange import open_exchange
from hvd_compress.simulator import Simulator
from hvd_compress.transport.threads import run_ranks

from tests.helpers import ALL_COMPRESSORS, SPARSIFIERS


# --------------------------------------------------------------------------- #
# ratio
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cls", [TopK, GaussianK, RegTopK])
@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.0000001, 2, float("nan"), float("inf"), -float("inf")])
def test_ratio_out_of_range(cls, ratio):
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        cls(ratio)


@pytest.mark.parametrize("ratio", [True, False, "0.1", [0.1], 1j])
def test_ratio_of_wrong_type(ratio):
    with pytest.raises(TypeError, match="ratio must be a number"):
        TopK(ratio)


@pytest.mark.parametrize("cls", [TopK, GaussianK, RegTopK])
def test_a_density_or_a_traffic_budget_exactly_one(cls):
    for args, options in (((), {}), ((None,), {}), ((0.01,), {"traffic": 0.1})):
        with pytest.raises(TypeError, match="takes a density ratio or a traffic budget"):
            cls(*args, **options)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        cls(traffic=1.5)


def test_ratio_checked_when_changed_later_and_by_name():
    topk = TopK(0.1)
    with pytest.raises(ValueError, match="ratio"):
        topk.ratio = 1.5
    assert topk.ratio == 0.1  # unchanged
    with pytest.raises(ValueError, match="ratio"):
        Compression.by_name("regtopk", 0)
    with pytest.raises(ValueError, match="unknown compression 'topq'"):
        Compression.by_name("topq", 0.1)


def test_other_bad_parameters():
    with pytest.raises(ValueError, match="mu must be > 0"):
        RegTopK(0.1, mu=0)
    with pytest.raises(ValueError, match="clip must be > 0"):
        TernGrad(clip=-1)
    with pytest.raises(ValueError, match=r"rank 4 is not in \[0, 4\)"):
        TopK(0.1).bind(4, 4)


# --------------------------------------------------------------------------- #
# gradients
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
@pytest.mark.parametrize(
    "tensor",
    [np.arange(10), np.ones(10, dtype=bool), np.ones(10, dtype=np.complex64)],
    ids=["int", "bool", "complex"],
)
def test_non_float_gradient(kind, tensor):
    with pytest.raises(TypeError, match="'layer3.weight'.*cannot be exchanged.*floating point"):
        Simulator(2, ALL_COMPRESSORS[kind]()).step({"layer3.weight": [tensor, tensor]})


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
def test_empty_gradient_is_exchanged_as_empty(kind):
    """An empty gradient (a layer of width 0) comes back empty in its shape, as from a dense allreduce;
    the other gradients of the step are unaffected."""
    g = [np.linspace(-1, 1, 40) * (r + 1) for r in range(2)]
    alone = Simulator(2, ALL_COMPRESSORS[kind]()).step({"w": g})["w"]
    out = Simulator(2, ALL_COMPRESSORS[kind]()).step({"fc.bias": [np.zeros((0, 3))] * 2, "w": g})
    assert out["fc.bias"].shape == (0, 3)
    np.testing.assert_array_equal(out["w"], alone)


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient_propagates_and_leaves_residual_untouched(kind, bad):
    """nonfinite="propagate" (the default): a NaN/Inf on one rank makes that tensor's result non-finite,
    as the dense allreduce it replaces would; the step's other tensors and the residuals are untouched."""
    first = [np.linspace(-1, 1, 20).astype(np.float32) * (r + 1) for r in range(2)]
    other = [np.linspace(2, -3, 30).astype(np.float32) * (r + 2) for r in range(2)]
    sim = Simulator(2, ALL_COMPRESSORS[kind]())
    sim.step({"conv1.weight": first, "fc.weight": other})
    before = [None if r is None else r.copy() for r in sim.residuals("conv1.weight")]
    bad_grad = np.ones(20, np.float32)
    bad_grad[[3, 7]] = bad
    out = sim.step({"conv1.weight": [bad_grad, first[1]], "fc.weight": other})
    assert not np.isfinite(out["conv1.weight"]).all()
    assert np.isfinite(out["fc.weight"]).all()
    for was, now in zip(before, sim.residuals("conv1.weight")):
        if was is None:
            assert now is None
        else:
            np.testing.assert_array_equal(now, was)


def test_fp16_overflow_is_infinite_as_in_a_float16_allreduce():
    # 7e4 is beyond the largest half, 65504: it travels as Inf
    out = Simulator(1, FP16()).step({"big": [np.array([1.0, 7e4], np.float32)]})["big"]
    np.testing.assert_array_equal(out, np.array([1.0, np.inf], np.float32))
    # the largest half, 65504, is exact
    edge = Simulator(1, FP16()).step({"edge": [np.array([65504.0, -65504.0], np.float32)]})["edge"]
    np.testing.assert_array_equal(edge, [65504.0, -65504.0])


# --------------------------------------------------------------------------- #
# simulator input
# --------------------------------------------------------------------------- #
def test_simulator_wrong_number_of_rank_gradients():
    sim = Simulator(3, TopK(0.5, dense_below=0))
    with pytest.raises(ValueError, match="'w' has 2 gradients for 3 ranks"):
        sim.step({"w": [np.ones(4), np.ones(4)]})


def test_simulator_mismatched_shapes():
    sim = Simulator(2, NoneCompressor())
    with pytest.raises(ValueError, match="ranks disagree on the shape of 'w'"):
        sim.step({"w": [np.ones(4), np.ones(5)]})


def test_simulator_bad_construction():
    with pytest.raises(ValueError, match="n_ranks must be a positive int"):
        Simulator(0, TopK(0.1))
    with pytest.raises(ValueError, match="n_ranks must be a positive int"):
        Simulator(True, TopK(0.1))
    with pytest.raises(TypeError, match=r"needs arguments; pass an instance such as TopK\(0.01\)"):
        Simulator(2, TopK)
    with pytest.raises(TypeError, match="must be an hvd_compress compressor"):
        Simulator(2, "topk")


def test_simulator_state_of_other_world_size():
    state = Simulator(2, TopK(0.1)).state_dict()
    with pytest.raises(ValueError, match="state of 2 ranks cannot load into a Simulator of 3"):
        Simulator(3, TopK(0.1)).load_state_dict(state)


# --------------------------------------------------------------------------- #
# ranks that do not belong together
# --------------------------------------------------------------------------- #
def failures_on_every_rank(compressors, grads):
    """Each thread rank's error of one exchange of ``w`` (``None`` where it succeeded)."""

    def work(comm):
        try:
            exchange = open_exchange(compressors[comm.rank], comm, "bucket")
            exchange.add("w", grads[comm.rank])
            exchange.launch()
            exchange.finish()
        except ValueError as error:
            return str(error)
        return None

    return run_ranks(len(compressors), work, timeout=30)


def test_ranks_with_other_numel_fail_on_every_rank():
    errors = failures_on_every_rank([TopK(0.1, dense_below=0) for _ in range(2)],
                                    [np.arange(10.0), np.arange(12.0)])
    assert all(e is not None and "ranks disagree on 'bucket'" in e for e in errors), errors
    assert "w[10]" in errors[0] and "w[12]" in errors[1]


def test_ranks_that_disagree_on_dense_or_sparse_fail_on_every_rank():
    # one rank sends this tensor dense (dense_below=1024), the other sparse (dense_below=0)
    errors = failures_on_every_rank([TopK(0.1), TopK(0.1, dense_below=0)], [np.arange(100.0)] * 2)
    assert all(e is not None and "ranks disagree on 'bucket'" in e for e in errors), errors
    assert "dense_below=1024" in errors[0] and "dense_below=0" in errors[1]


# --------------------------------------------------------------------------- #
# state
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("source, target", [("topk", "gaussiank"), ("regtopk", "topk"), ("none", "terngrad")])
def test_load_state_of_another_algorithm(source, target):
    state = ALL_COMPRESSORS[source]().state_dict()
    compressor = ALL_COMPRESSORS[target]()
    with pytest.raises(ValueError, match="checkpoint holds .* state .*; cannot load it into"):
        compressor.load_state_dict(state)


@pytest.mark.parametrize("kind", sorted(SPARSIFIERS))
def test_restored_residual_of_wrong_shape_raises(kind):
    saved = Simulator(1, SPARSIFIERS[kind](0.5))
    saved.step({"fc.weight": [np.arange(1.0, 9.0)]})  # shape (8,)
    restored = Simulator(1, SPARSIFIERS[kind](0.5))
    restored.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(8,\) but the gradient has shape \(2, 4\)"):
        restored.step({"fc.weight": [np.ones((2, 4))]})


@pytest.mark.parametrize("kind", sorted(SPARSIFIERS))
def test_live_shape_change_warns_and_resets(kind):
    sim = Simulator(1, SPARSIFIERS[kind](0.25))
    sim.step({"w": [np.array([1.0, 2.0, 3.0, 4.0])]})  # leaves a residual of shape (4,)
    with pytest.warns(UserWarning, match="'w' changed shape \\(\\(4,\\) -> \\(6,\\)\\)"):
        sent = sim.step({"w": [np.array([6.0, 0.0, 0.0, 0.0, 0.0, 0.0])]})["w"]
    # fresh state: nothing of the old residual is added; of k = ceil(1.5) = 2 entries the 6 is sent
    # (the other, by the tie rule, a 0; Gaussian-k sends only the 6), and nothing stays behind
    np.testing.assert_array_equal(sent, [6, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(sim.residuals("w")[0], np.zeros(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same shape again: no warning
        sim.step({"w": [np.zeros(6)]})


def test_shape_change_after_resuming_from_a_matching_checkpoint_warns():
    """Once a restored state has fit the gradient and training went on, a later change is live."""
    saved = Simulator(1, TopK(0.5, dense_below=0))
    saved.step({"w": [np.ones(4)]})
    resumed = Simulator(1, TopK(0.5, dense_below=0))
    resumed.load_state_dict(saved.state_dict())
    resumed.step({"w": [np.ones(4)]})  # the checkpoint fits this model
    with pytest.warns(UserWarning, match="'w' changed shape"):
        resumed.step({"w": [np.ones(6)]})
    assert resumed.residuals("w")[0].shape == (6,)
