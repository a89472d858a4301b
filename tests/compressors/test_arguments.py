"""Compressor arguments are checked at construction and on assignment (``hvd_compress.algorithms.validation``).

- booleans must be bools (``'no'`` is not False), ``dense_below`` and ``seed``
  ints >= 0, ``mu`` a number in float32's normal range, ``clip`` a number >= 1 or
  ``None``, ``seed`` of every compressor an int >= 0: a bad value
  raises ``TypeError``/``ValueError`` naming the argument, when the compressor
  is made and when the attribute is assigned later (which leaves it unchanged);
- Gaussian-k's ratio must keep its tail quantile finite (``>= 1e-323``);
- good values (numpy scalars included) are stored in their canonical type and
  ``config()`` still round-trips.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvd_compress import FP16, Compression, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.algorithms.validation import GAUSSIANK_MIN_RATIO
from hvd_compress.simulator import Simulator

SPARSE = {"topk": TopK, "gaussiank": GaussianK, "regtopk": RegTopK}


def make(kind: str, **options):
    return TernGrad(**options) if kind == "terngrad" else SPARSE[kind](0.1, **options)


# (compressors, argument, default) of every checked argument
BOOLS = [(kind, "error_feedback") for kind in (*SPARSE, "terngrad")]
BOOLS += [(kind, "dense_when_cheaper") for kind in SPARSE] + [("terngrad", "scalar_sharing")]
COUNTS = [(kind, arg) for kind in (*SPARSE, "terngrad") for arg in ("dense_below", "seed")]


def assert_rejected(kind, arg, value, error, match):
    with pytest.raises(error, match=match):
        make(kind, **{arg: value})
    compressor = make(kind)
    before = getattr(compressor, arg)
    with pytest.raises(error, match=match):
        setattr(compressor, arg, value)
    assert getattr(compressor, arg) == before  # unchanged


# --------------------------------------------------------------------------- #
# booleans
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind, arg", BOOLS)
@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, 1.0, None, [True]])
def test_bool_arguments_reject_non_bools(kind, arg, value):
    assert_rejected(kind, arg, value, TypeError, f"{arg} must be True or False, got")


@pytest.mark.parametrize("kind, arg", BOOLS)
@pytest.mark.parametrize("value", [True, False, np.True_, np.False_])
def test_bool_arguments_accept_bools(kind, arg, value):
    compressor = make(kind, **{arg: value})
    assert getattr(compressor, arg) is bool(value)
    setattr(compressor, arg, not value)
    assert getattr(compressor, arg) is (not bool(value))


def test_error_feedback_no_is_not_true():
    """The reported case: these used to become True."""
    with pytest.raises(TypeError, match="error_feedback"):
        TopK(0.01, error_feedback="no")
    with pytest.raises(TypeError, match="scalar_sharing"):
        TernGrad(scalar_sharing="no")
    with pytest.raises(TypeError, match="scalar_sharing"):
        Compression.by_name("terngrad", scalar_sharing="no")


# --------------------------------------------------------------------------- #
# dense_below and seed: ints >= 0
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind, arg", COUNTS)
@pytest.mark.parametrize("value", [True, False, 1.5, 1024.0, "10", None, np.float64(3.0)])
def test_count_arguments_reject_non_ints(kind, arg, value):
    assert_rejected(kind, arg, value, TypeError, f"{arg} must be an int >= 0, got")


@pytest.mark.parametrize("kind, arg", COUNTS)
@pytest.mark.parametrize("value", [-1, -1024, np.int32(-5)])
def test_count_arguments_reject_negatives(kind, arg, value):
    assert_rejected(kind, arg, value, ValueError, f"{arg} must be an int >= 0, got")


@pytest.mark.parametrize("kind, arg", COUNTS)
@pytest.mark.parametrize("value", [0, 7, 2**40, np.int64(12), np.uint8(3)])
def test_count_arguments_accept_ints(kind, arg, value):
    compressor = make(kind, **{arg: value})
    assert getattr(compressor, arg) == int(value) and type(getattr(compressor, arg)) is int
    setattr(compressor, arg, 5)
    assert getattr(compressor, arg) == 5


def test_dense_below_applies_after_assignment():
    sim = Simulator(1, TopK(0.25, dense_below=0))
    g = np.arange(8.0)
    np.testing.assert_array_equal(sim.step({"w": [g]})["w"], [0, 0, 0, 0, 0, 0, 6, 7])  # sparse: k = 2
    for compressor in sim.compressors:
        compressor.dense_below = 100
    # dense now: all of a = g + [0, 1, 2, 3, 4, 5, 0, 0] is sent, nothing stays behind
    np.testing.assert_array_equal(sim.step({"w": [g]})["w"], [0, 2, 4, 6, 8, 10, 6, 7])
    assert sim.values_sent_per_rank == [8] and sim.residuals("w") == [None]


def test_simulator_still_sets_the_seed():
    sim = Simulator(2, TernGrad(dense_below=0), seed=3)
    assert [c.seed for c in sim.compressors] == [3, 3]


# --------------------------------------------------------------------------- #
# mu: float32's normal range; clip: >= 1 (or None)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_mu_out_of_range(value):
    assert_rejected("regtopk", "mu", value, ValueError, "RegTopK mu must be > 0 and finite")


@pytest.mark.parametrize("value", ["5", None, True, [5.0], 1j])
def test_mu_of_wrong_type(value):
    assert_rejected("regtopk", "mu", value, TypeError, "RegTopK mu must be a finite number > 0")


@pytest.mark.parametrize("value", [0, -1, -2.5, float("nan"), float("inf")])
def test_clip_out_of_range(value):
    assert_rejected("terngrad", "clip", value, ValueError, r"TernGrad clip must be > 0 and finite \(or None\)")


@pytest.mark.parametrize("value", ["2.5", True, [2.5]])
def test_clip_of_wrong_type(value):
    assert_rejected("terngrad", "clip", value, TypeError, "TernGrad clip must be a finite number > 0 or None")


def test_negative_clip_after_construction_no_longer_flattens_the_gradient():
    """The reported case: ``clip = -1`` turned every gradient into a constant."""
    terngrad = TernGrad(dense_below=0)
    with pytest.raises(ValueError, match="clip"):
        terngrad.clip = -1
    assert terngrad.clip == 2.5


@pytest.mark.parametrize("value", [1e-300, 1e-39, 1e39])
def test_mu_outside_float32s_normal_range(value):
    """The reported case ``mu=1e-300``: 0 in float32, the scores 0 / 0."""
    assert_rejected("regtopk", "mu", value, ValueError, r"RegTopK mu must be in \[1.17549e-38, 3.40282e\+38\]")


@pytest.mark.parametrize("value", [1e-30, 0.5, 0.999])
def test_clip_below_one(value):
    """The reported case ``clip=1e-30``: a bound that small sends signs only."""
    assert_rejected("terngrad", "clip", value, ValueError, "TernGrad clip must be >= 1, got .*clips most")


@pytest.mark.parametrize("cls", [NoneCompressor, FP16, TopK, TernGrad])
@pytest.mark.parametrize("seed", ["x", "3", 1.5, -1])
def test_every_compressor_checks_its_seed(cls, seed):
    """The reported case ``NoneCompressor(seed='x')`` said ``invalid literal for int()``."""
    args = (0.1,) if cls is TopK else ()
    with pytest.raises((TypeError, ValueError), match=f"{cls.__name__} seed must be an int >= 0"):
        cls(*args, seed=seed)


@pytest.mark.parametrize("value", [1, 1.5, np.float32(2.0), np.float64(4.0), 1e30])
def test_mu_and_clip_accept_sensible_numbers(value):
    regtopk, terngrad = RegTopK(0.1, mu=value), TernGrad(clip=value)
    assert regtopk.mu == float(value) and type(regtopk.mu) is float
    assert terngrad.clip == float(value) and type(terngrad.clip) is float
    regtopk.mu, terngrad.clip = 3, None
    assert regtopk.mu == 3.0 and terngrad.clip is None
    assert TernGrad(clip=None).clip is None


# --------------------------------------------------------------------------- #
# Gaussian-k's ratio
# --------------------------------------------------------------------------- #
def test_gaussiank_ratio_too_small_for_its_tail_quantile():
    with pytest.raises(ValueError, match="GaussianK ratio 5e-324 is too small.*smallest ratio is 1e-323"):
        GaussianK(5e-324)
    gaussiank = GaussianK(0.01)
    with pytest.raises(ValueError, match="too small"):
        gaussiank.ratio = 5e-324
    assert gaussiank.ratio == 0.01
    with pytest.raises(ValueError, match="too small"):
        Compression.by_name("gaussiank", 5e-324)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):  # the general check comes first
        gaussiank.ratio = 0.0


@pytest.mark.parametrize("ratio", [GAUSSIANK_MIN_RATIO, 1e-300, 1e-9, 0.5, 1.0])
def test_gaussiank_smallest_ratios_still_work(ratio):
    gaussiank = GaussianK(ratio, dense_below=0, dense_when_cheaper=False)
    a = np.random.default_rng(0).standard_normal(4000)
    sim = Simulator(1, gaussiank)
    sent = sim.step({"w": [a]})["w"]
    assert np.all(np.isfinite(sent))
    np.testing.assert_array_equal(sent + sim.residuals("w")[0], a)
    gaussiank.ratio = ratio  # assignable (density schedules)
    assert GAUSSIANK_MIN_RATIO == 1e-323 and GAUSSIANK_MIN_RATIO / 2 > 0 and math.ulp(0.0) / 2 == 0


def test_other_sparsifiers_keep_the_general_ratio_range():
    assert TopK(5e-324).ratio == 5e-324 and RegTopK(5e-324).ratio == 5e-324


# --------------------------------------------------------------------------- #
# config() round-trips
# --------------------------------------------------------------------------- #
CONFIGURED = [
    TopK(0.05, error_feedback=False, dense_below=0, dense_when_cheaper=False),
    GaussianK(0.2, dense_below=16),
    RegTopK(0.01, mu=4, error_feedback=True, dense_below=np.int64(8)),
    TernGrad(clip=None, scalar_sharing=False, error_feedback=True, dense_below=0),
    TernGrad(clip=np.float32(1.5), scalar_sharing=np.True_),
]


@pytest.mark.parametrize("compressor", CONFIGURED, ids=repr)
def test_config_round_trips(compressor):
    config = compressor.config()
    params = {k: v for k, v in config.items() if k != "type"}
    rebuilt = Compression.by_name(config["type"], **params)
    assert rebuilt.config() == config and rebuilt.config_hash() == compressor.config_hash()
    assert {type(v) for v in params.values()} <= {bool, int, float, type(None)}


def test_config_follows_assignments():
    regtopk = RegTopK(0.1)
    regtopk.mu, regtopk.dense_below, regtopk.error_feedback = 2, 0, False
    assert regtopk.config() == {
        "type": "RegTopK",
        "ratio": 0.1,
        "error_feedback": False,
        "dense_below": 0,
        "dense_when_cheaper": True,
        "mu": 2.0,
    }
