"""Bad input gets a clear error, naming the tensor where there is one."""

import warnings

import numpy as np
import pytest

from hvd_compress import FP16, Compression, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.wire import DensePayload, TernaryPayload
from hvd_compress.simulator import Simulator

from tests.helpers import ALL_COMPRESSORS, SPARSIFIERS


# --------------------------------------------------------------------------- #
# ratio
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("cls", [TopK, GaussianK, RegTopK])
@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.0000001, 2, float("nan"), float("inf"), -float("inf")])
def test_ratio_out_of_range(cls, ratio):
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        cls(ratio)


@pytest.mark.parametrize("ratio", [True, False, "0.1", None, [0.1], 1j])
def test_ratio_of_wrong_type(ratio):
    with pytest.raises(TypeError, match="ratio must be a number"):
        TopK(ratio)


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
    with pytest.raises(TypeError, match="'layer3.weight'.*floating point"):
        ALL_COMPRESSORS[kind]().encode(tensor, "layer3.weight")


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
def test_empty_gradient(kind):
    with pytest.raises(ValueError, match="'fc.bias'.*empty"):
        ALL_COMPRESSORS[kind]().encode(np.zeros((0, 3), np.float32), "fc.bias")


@pytest.mark.parametrize("kind", sorted(ALL_COMPRESSORS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradient(kind, bad):
    g = np.ones(20, np.float32)
    g[[3, 7]] = bad
    with pytest.raises(ValueError, match=r"'conv1.weight' has 2 NaN/Inf of 20"):
        ALL_COMPRESSORS[kind]().encode(g, "conv1.weight")


def test_non_finite_gradient_leaves_residual_untouched():
    topk = TopK(0.5, dense_below=0)
    topk.encode(np.array([1.0, 2.0, 3.0, 4.0]), "w")
    before = topk.residual("w").copy()
    with pytest.raises(ValueError, match="'w'"):
        topk.encode(np.array([1.0, np.nan, 3.0, 4.0]), "w")
    np.testing.assert_array_equal(topk.residual("w"), before)


def test_terngrad_local_scale_checks_too():
    with pytest.raises(ValueError, match="'w' has 1 NaN/Inf"):
        TernGrad(dense_below=0).local_scale(np.array([1.0, np.inf]), "w")


def test_unsupported_tensor_type():
    with pytest.raises(TypeError, match="'w' of type builtins.set"):
        TopK(0.1).encode({1.0, 2.0}, "w")


def test_fp16_overflow():
    with pytest.raises(ValueError, match="'big' exceeds the float16 range"):
        FP16().encode(np.array([1.0, 7e4], np.float32), "big")
    # the largest half, 65504, is fine
    FP16().encode(np.array([65504.0, -65504.0], np.float32), "edge")


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
# TernGrad scale sharing
# --------------------------------------------------------------------------- #
def test_terngrad_shared_scale_below_local_max():
    g = np.array([0.5, -2.0, 1.0])
    with pytest.raises(ValueError, match="scale 1.5 for 'w' is below this rank's max\\|g\\| = 2.0"):
        TernGrad(clip=None, dense_below=0).encode(g, "w", scale=1.5)


def test_terngrad_payloads_disagree():
    tg = TernGrad(dense_below=0)
    codes = np.zeros(8, np.int8)
    with pytest.raises(ValueError, match="different shared TernGrad scales"):
        tg.decode([TernaryPayload(codes, 1.0, world_size=2), TernaryPayload(codes, 2.0, world_size=2)], (8,))
    with pytest.raises(ValueError, match="packed for \\[4\\] ranks but 2 arrived"):
        tg.decode([TernaryPayload(codes, 1.0, world_size=4)] * 2, (8,))
    with pytest.raises(ValueError, match="tensor of 9 elements"):
        tg.decode([TernaryPayload(codes, 1.0, world_size=1)], (9,))


# --------------------------------------------------------------------------- #
# decode of payloads that do not belong together
# --------------------------------------------------------------------------- #
def test_sparse_decode_of_other_numel():
    topk = TopK(0.5, dense_below=0)
    p10 = topk.encode(np.arange(10.0), "a")
    p12 = topk.encode(np.arange(12.0), "b")
    with pytest.raises(ValueError, match="payloads disagree with a tensor of 10 elements"):
        topk.decode([p10, p12], (10,))
    with pytest.raises(ValueError, match="12 elements"):
        topk.decode([p10], (12,))


def test_sparse_decode_of_mixed_dense_and_sparse():
    # one rank sends this tensor dense (dense_below=1024), the other sparse (dense_below=0)
    g = np.arange(10.0)
    dense = TopK(0.5).encode(g, "w")
    sparse = TopK(0.5, dense_below=0).encode(g, "w")
    with pytest.raises(ValueError, match="mixed dense/sparse"):
        TopK(0.5).decode([dense, sparse], (10,))


def test_dense_decode_of_other_size():
    with pytest.raises(ValueError, match="a rank sent 5 elements, expected 4"):
        NoneCompressor().decode(
            [DensePayload(np.ones(4), np.float64), DensePayload(np.ones(5), np.float64)], (4,)
        )


def test_decode_of_nothing():
    with pytest.raises(ValueError, match="at least one rank"):
        TopK(0.1).decode([], (4,))


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
    saved = SPARSIFIERS[kind](0.5)
    saved.encode(np.arange(1.0, 9.0), "fc.weight")  # shape (8,)
    restored = SPARSIFIERS[kind](0.5)
    restored.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(8,\) but the gradient has shape \(2, 4\)"):
        restored.encode(np.ones((2, 4)), "fc.weight")


@pytest.mark.parametrize("kind", sorted(SPARSIFIERS))
def test_live_shape_change_warns_and_resets(kind):
    compressor = SPARSIFIERS[kind](0.25)
    compressor.encode(np.array([1.0, 2.0, 3.0, 4.0]), "w")  # leaves a residual of shape (4,)
    with pytest.warns(UserWarning, match="'w' changed shape \\(\\(4,\\) -> \\(6,\\)\\)"):
        payload = compressor.encode(np.array([6.0, 0.0, 0.0, 0.0, 0.0, 0.0]), "w")
    # fresh state: nothing of the old residual is added; k = ceil(1.5) = 2 entries sent
    # (index 0, value 6, and by the tie rule index 1, value 0 -- Gaussian-k sends only 6)
    assert 6.0 in payload.values and np.all(payload.values[payload.values != 6.0] == 0)
    assert compressor.residual("w").shape == (6,)
    np.testing.assert_array_equal(compressor.residual("w"), np.zeros(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same shape again: no warning
        compressor.encode(np.zeros(6), "w")


def test_shape_change_after_resuming_from_a_matching_checkpoint_warns():
    """Once a restored state has fit the gradient and training went on, a later change is live."""
    saved = TopK(0.5, dense_below=0)
    saved.encode(np.ones(4), "w")
    resumed = TopK(0.5, dense_below=0)
    resumed.load_state_dict(saved.state_dict())
    resumed.encode(np.ones(4), "w")  # the checkpoint fits this model
    with pytest.warns(UserWarning, match="'w' changed shape"):
        resumed.encode(np.ones(6), "w")
    assert resumed.residual("w").shape == (6,)
