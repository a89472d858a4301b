"""``DensityWarmup``: DGC's density warm-up as a framework-free schedule of ``compressor.ratio``."""

import json
import math

import numpy as np
import pytest

from hvd_compress import FP16, Auto, DensityWarmup, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.algorithms.schedule import warmup_density
from hvd_compress.kernels.reference import num_selected
from hvd_compress.simulator import Simulator


def test_formula_is_dgc_geometric_decay():
    """Lin et al. 2018: 25%, 6.25%, 1.5625%, 0.39% over four epochs, then the target (0.25 ** 5)."""
    target = 0.25**5
    assert [warmup_density(n, 4, 0.25, target) for n in range(7)] == pytest.approx(
        [0.25, 0.0625, 0.015625, 0.00390625, target, target, target]
    )
    # DGC's released code multiplies by target ** (1 / (W + 1)) every epoch
    code = [warmup_density(n, 4, 0.001 ** 0.2, 0.001) for n in range(5)]
    assert code == pytest.approx([0.001 ** ((n + 1) / 5) for n in range(5)])
    assert warmup_density(0, 0, 0.25, 0.01) == 0.01  # no warm-up
    assert warmup_density(-3, 4, 0.5, 0.01) == 0.5  # before the start: the start
    assert warmup_density(1, 2, 1.0, 0.01) == pytest.approx(0.1)  # dense start, geometric mean


@pytest.mark.parametrize("cls", [TopK, GaussianK, RegTopK])
def test_step_sets_the_ratio_and_stops_at_the_target(cls):
    compressor = cls(0.001)
    warmup = DensityWarmup(compressor, warmup_steps=4, start=0.25)
    seen = [compressor.ratio]
    for _ in range(6):
        assert warmup.step() == compressor.ratio
        seen.append(compressor.ratio)
    assert seen == pytest.approx([0.25 * (0.004 ** (n / 4)) for n in range(4)] + [0.001] * 3)
    assert warmup.done and warmup.target == 0.001 and warmup.last_step == 6


def test_zero_warmup_steps_leaves_the_target():
    topk = TopK(0.01)
    warmup = DensityWarmup(topk, warmup_steps=0)
    assert topk.ratio == 0.01 and warmup.done


def test_state_dict_round_trip_continues_the_ramp():
    reference = TopK(0.001)
    straight = DensityWarmup(reference, warmup_steps=5, start=0.5)
    expected = [straight.step() for _ in range(6)]

    first = TopK(0.001)
    warmup = DensityWarmup(first, warmup_steps=5, start=0.5)
    warmup.step(), warmup.step()
    state = json.loads(json.dumps(warmup.state_dict()))  # plain numbers
    assert state == {"last_step": 2, "warmup_steps": 5, "start": 0.5, "target": 0.001}

    resumed = TopK(0.001)
    restored = DensityWarmup(resumed, warmup_steps=5, start=0.5)  # at step 0
    assert resumed.ratio == 0.5
    restored.load_state_dict(state)
    assert resumed.ratio == first.ratio == expected[1]  # set on load, not at the next step()
    assert [restored.step() for _ in range(4)] == pytest.approx(expected[2:])


def test_load_state_dict_restores_the_target_and_rejects_a_bad_state():
    warmup = DensityWarmup(TopK(0.01), warmup_steps=3, start=0.5)
    warmup.load_state_dict({"last_step": 9, "warmup_steps": 3, "start": 0.5, "target": 0.02})
    assert warmup.compressors[0].ratio == 0.02 and warmup.done
    with pytest.raises(KeyError, match="last_step"):
        warmup.load_state_dict({"warmup_steps": 3, "start": 0.5, "target": 0.02})
    with pytest.raises(ValueError, match="start"):
        warmup.load_state_dict({"last_step": 0, "warmup_steps": 3, "start": 0.01, "target": 0.02})


@pytest.mark.parametrize("compressor", [TernGrad(), FP16(), NoneCompressor(), object()], ids=repr)
def test_refuses_compressors_without_a_ratio(compressor):
    with pytest.raises(TypeError, match=rf"density \(ratio\).*{type(compressor).__name__}"):
        DensityWarmup(compressor, warmup_steps=2)


@pytest.mark.parametrize(
    "options",
    [
        {"warmup_steps": -1},
        {"warmup_steps": 2.5},
        {"start": 0.0},
        {"start": 1.5},
        {"start": float("nan")},
        {"start": 0.001},  # below the target 0.01
    ],
    ids=str,
)
def test_rejects_bad_numbers(options):
    with pytest.raises(ValueError, match="hvd_compress"):
        DensityWarmup(TopK(0.01), **{"warmup_steps": 2, **options})


def test_rejects_compressors_that_disagree():
    with pytest.raises(ValueError, match="disagree"):
        DensityWarmup([TopK(0.01), TopK(0.02)], warmup_steps=2)


def test_auto_and_holders_of_a_compressor():
    auto = Auto(RegTopK(0.01))
    DensityWarmup(auto, warmup_steps=2, start=1.0)
    assert auto.inner.ratio == auto.ratio == 1.0

    class Holder:  # Keras's DistributedOptimizer (.compression), the DDP hook's state (.compressor)
        def __init__(self, **kw):
            self.__dict__.update(kw)

    for holder in (Holder(compression=TopK(0.01)), Holder(compressor=TopK(0.01))):
        warmup = DensityWarmup(holder, warmup_steps=2, start=0.25)
        assert warmup.compressors[0].ratio == 0.25


def test_every_simulated_rank_sends_the_scheduled_k():
    """On the Simulator's per-rank copies: each step every rank sends k = ceil(density * numel) values."""
    sim = Simulator(3, TopK(0.01, dense_below=0), seed=0)
    warmup = DensityWarmup(sim, warmup_steps=3, start=0.3)
    rng = np.random.default_rng(0)
    numel = 400
    for step in range(5):
        density = warmup.density
        sim.step({"w": [rng.standard_normal(numel).astype(np.float32) for _ in range(3)]})
        assert sim.values_sent_per_rank == [num_selected(numel, density)] * 3, (step, density)
        warmup.step()
    assert all(c.ratio == 0.01 for c in sim.compressors)
    assert math.isclose(warmup.density_at(1), 0.3 * (0.01 / 0.3) ** (1 / 3))
