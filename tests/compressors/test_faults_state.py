"""Compressor checkpoints that do not fit: each load fails with an error that says what is wrong,
and a rank holding another rank's state is named by the cross-rank check."""

import numpy as np
import pytest

from hvd_compress import TernGrad, TopK
from hvd_compress.simulator import Simulator


def trained_state(ranks: int = 2):
    sim = Simulator(ranks, TopK(0.1, dense_below=0))
    rng = np.random.default_rng(0)
    for _ in range(2):
        sim.step({"w": [rng.standard_normal(50).astype(np.float32) for _ in range(ranks)]})
    return sim.compressors[1].state_dict()


def test_state_records_its_rank_and_round_trips():
    state = trained_state()
    assert (state["rank"], state["world"]) == (1, 2)
    fresh = TopK(0.1, dense_below=0).bind(1, 2)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(fresh.residual("w"), state["tensors"]["w"]["residual"])
    assert fresh.state_note() == ""


def test_state_of_another_rank_changes_the_config_hash_and_says_what_to_do():
    state = trained_state()
    mine = TopK(0.1, dense_below=0).bind(0, 2)
    before = mine.config_hash()
    mine.load_state_dict(state)
    assert mine.config_hash() != before  # every rank's cross-rank check stops
    assert "loaded from rank 1's checkpoint (of 2 ranks)" in mine.state_note()
    assert "load each rank's own" in mine.state_note()
    mine.reset()  # the documented way out: start error feedback afresh
    assert mine.config_hash() == before and mine.state_note() == ""


def test_empty_state_of_another_rank_is_harmless():
    state = TopK(0.1).state_dict()  # saved before any exchange
    mine = TopK(0.1).bind(1, 2)
    mine.load_state_dict(state)
    assert mine.state_note() == ""


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: s.pop("tensors"), "incomplete or corrupted: expected a dict with 'config' and 'tensors'"),
        (lambda s: s["tensors"]["w"].pop("shape"), "tensor 'w' has no shape"),
        (lambda s: s["tensors"]["w"].update(residual=np.zeros(7, np.float32)), "residual of 'w' has 7 elements"),
        (lambda s: s["tensors"]["w"].update(residual=np.zeros(50, np.int32)), "residual of 'w' has dtype int32"),
        (lambda s: s["tensors"]["w"]["residual"].__setitem__(3, np.nan), "residual of 'w' holds 1 NaN/Inf"),
    ],
    ids=["no-tensors", "no-shape", "wrong-size", "wrong-dtype", "nan"],
)
def test_damaged_state_is_refused_with_a_clear_error(damage, message):
    state = trained_state()
    state["tensors"]["w"]["residual"] = np.array(state["tensors"]["w"]["residual"])
    damage(state)
    target = TopK(0.1, dense_below=0)
    with pytest.raises(ValueError, match="hvd_compress: ") as error:
        target.load_state_dict(state)
    assert message in str(error.value)


def test_state_of_another_algorithm_is_refused():
    with pytest.raises(ValueError, match="checkpoint holds TopK state; cannot load it into TernGrad"):
        TernGrad().load_state_dict(trained_state())
