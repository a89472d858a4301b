"""Compressor checkpoints that do not fit: each load fails with an error that says what is wrong,
and a rank holding another rank's state is named by the cross-rank check."""

import numpy as np
import pytest

from hvd_compress import RegTopK, TernGrad, TopK
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
    assert fresh.state.note(fresh.rank) == ""


def test_state_of_another_rank_changes_the_config_hash_and_says_what_to_do():
    state = trained_state()
    mine = TopK(0.1, dense_below=0).bind(0, 2)
    before = mine.config_hash()
    mine.load_state_dict(state)
    assert mine.config_hash() != before  # every rank's cross-rank check stops
    assert "loaded from rank 1's checkpoint (of 2 ranks)" in mine.state.note(mine.rank)
    assert "load each rank's own" in mine.state.note(mine.rank)
    mine.reset()  # the documented way out: start error feedback afresh
    assert mine.config_hash() == before and mine.state.note(mine.rank) == ""


def test_empty_state_of_another_rank_is_harmless():
    state = TopK(0.1).state_dict()  # saved before any exchange
    mine = TopK(0.1).bind(1, 2)
    mine.load_state_dict(state)
    assert mine.state.note(mine.rank) == ""


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
    with pytest.raises(ValueError, match=r"holds TopK state \(written by Simulator\); cannot load it into TernGrad"):
        TernGrad().load_state_dict(trained_state())


# --------------------------------------------------------------------------- #
# loaded state is checked completely at load: checksum, index ranges, finite values,
# random streams; arrays of another framework or shape are taken over, not refused
# --------------------------------------------------------------------------- #
def regtopk_state(ranks: int = 2):
    """Rank 0's state after two steps (its posterior), with the sent values and indices that checkpoints
    of releases with a per-tensor path hold (the posterior's arrays: what was sent where it informs)."""
    sim = Simulator(ranks, RegTopK(0.1, dense_below=0))
    rng = np.random.default_rng(1)
    for _ in range(2):
        sim.step({"w": [rng.standard_normal(50).astype(np.float32) for _ in range(ranks)]})
    state = sim.compressors[0].state_dict()
    tensor = state["tensors"]["w"]
    tensor["sent_indices"] = np.array(tensor["posterior_indices"])
    tensor["sent_values"] = np.ones(tensor["sent_indices"].shape, np.float32)
    del state["checksum"]
    return state


def test_flipped_bytes_of_a_finite_residual_fail_the_checksum():
    state = trained_state()
    residual = np.array(state["tensors"]["w"]["residual"])
    raw = residual.view(np.uint8)
    raw[:16] ^= 0x01  # still finite, the right size and dtype: only the checksum can tell
    assert np.all(np.isfinite(residual))
    state["tensors"]["w"]["residual"] = residual
    with pytest.raises(ValueError, match="checksum does not match its contents"):
        TopK(0.1, dense_below=0).bind(1, 2).load_state_dict(state)
    del state["checksum"]  # an edit on purpose: accepted, as checkpoints written before checksums
    TopK(0.1, dense_below=0).bind(1, 2).load_state_dict(state)


@pytest.mark.parametrize(
    "key, damage, message",
    [
        ("sent_values", lambda a: a.__setitem__(0, np.nan), "sent_values of 'w' hold 1 NaN/Inf"),
        ("sent_indices", lambda a: a.__setitem__(0, 50), "sent_indices of 'w' hold indices outside [0, 50)"),
        ("sent_indices", lambda a: a.__setitem__(0, -1), "indices outside [0, 50)"),
        ("posterior_indices", lambda a: a.__setitem__(0, 10**6), "posterior_indices of 'w' hold indices outside"),
        ("posterior_values", lambda a: a.__setitem__(0, np.inf), "posterior_values of 'w' hold 1 NaN/Inf"),
    ],
)
def test_damaged_regtopk_state_is_refused(key, damage, message):
    state = regtopk_state()
    array = np.array(state["tensors"]["w"][key])
    damage(array)
    state["tensors"]["w"][key] = array
    with pytest.raises(ValueError, match="incomplete or corrupted") as error:
        RegTopK(0.1, dense_below=0).load_state_dict(state)
    assert message in str(error.value)


def test_regtopk_indices_without_their_values_are_refused():
    state = regtopk_state()
    del state["tensors"]["w"]["sent_values"]
    with pytest.raises(ValueError, match="'w' has sent_indices without sent_values"):
        RegTopK(0.1, dense_below=0).load_state_dict(state)


def torch_terngrad_state(torch):
    """The state of a TernGrad rank after one step on torch gradients (its torch random stream drawn)."""
    sim = Simulator(1, TernGrad(dense_below=0))
    sim.step({"w": [torch.randn(64)]})
    return sim.compressors[0].state_dict()


def test_truncated_generator_state_is_refused_at_load():
    torch = pytest.importorskip("torch")
    state = torch_terngrad_state(torch)
    module = "hvd_compress.kernels.torch_ops"
    state["generators"][module] = state["generators"][module][:10]
    with pytest.raises(ValueError, match="random stream state for torch_ops is damaged"):
        TernGrad(dense_below=0).load_state_dict(state)


def test_a_cuda_or_mersenne_twister_stream_state_resumes_on_the_host_stream():
    """A CUDA generator's state (seed and offset, 16 bytes) and torch's CPU generator's (a Mersenne Twister's)
    load into the host's counter stream: the first continues from its seed and position, the second on a
    stream seeded from its digest; a 16-byte state is damaged for numpy's stream."""
    torch = pytest.importorskip("torch")
    from hvd_compress.kernels import torch_ops

    module = "hvd_compress.kernels.torch_ops"
    cuda_state = torch.tensor([2**62 + 12345, 4096], dtype=torch.int64).view(torch.uint8)
    twister_state = torch.Generator().manual_seed(3).get_state()
    drawn = {}
    for name, saved in (("cuda", cuda_state), ("twister", twister_state)):
        state = torch_terngrad_state(torch)
        state["generators"][module] = saved
        state.pop("checksum")
        compressor = TernGrad(dense_below=0)
        compressor.load_state_dict(state)
        stream = compressor.generator(torch_ops, torch.empty(0))
        drawn[name] = (stream.seed, stream.position)
    assert drawn["cuda"] == (2**62 + 12345, 4096)
    assert drawn["twister"][1] == 0 and drawn["twister"][0] != drawn["cuda"][0]
    state["generators"] = {"hvd_compress.kernels.reference": np.zeros(16, dtype=np.uint8)}
    with pytest.raises(ValueError, match="random stream state for reference is damaged"):
        TernGrad(dense_below=0).load_state_dict(state)


def trained_states(ranks: int = 2):
    """Every rank's state, in rank order, after two steps (as :func:`trained_state`)."""
    sim = Simulator(ranks, TopK(0.1, dense_below=0))
    rng = np.random.default_rng(0)
    for _ in range(2):
        sim.step({"w": [rng.standard_normal(50).astype(np.float32) for _ in range(ranks)]})
    return [c.state_dict() for c in sim.compressors]


def resumed_step(states, grads):
    """The average and residuals of one Simulator step resumed from every rank's ``states``."""
    sim = Simulator(len(states), TopK(0.1, dense_below=0))
    sim.load_state_dict(states)
    out = sim.step({"w": grads})["w"]
    return np.asarray(out), [np.asarray(r) for r in sim.residuals("w")]


def test_numpy_state_trains_on_torch_gradients_as_it_would_on_numpy():
    """A checkpoint of the numpy route (the Simulator, MPI) resumes on a torch route."""
    torch = pytest.importorskip("torch")
    states = trained_states()
    grads = [np.random.default_rng(5 + r).standard_normal(50).astype(np.float32) for r in range(2)]
    on_numpy = resumed_step(states, grads)
    on_torch = resumed_step(states, [torch.from_numpy(g) for g in grads])
    np.testing.assert_array_equal(on_numpy[0], on_torch[0])
    for a, b in zip(on_numpy[1], on_torch[1]):
        np.testing.assert_array_equal(a, b)
    # the residuals were used: a fresh run sends something else
    fresh = Simulator(2, TopK(0.1, dense_below=0)).step({"w": grads})["w"]
    assert not np.array_equal(fresh, on_numpy[0])


def test_residual_in_the_parameters_shape_loads_into_a_flat_route():
    """The drop-in optimizer and the DDP hook save residuals in the parameter's shape; the stock
    route and the Simulator compress flat tensors: the checkpoint moves between them."""
    states = trained_states()
    shaped, plain = [], []
    for state in states:
        flat = np.array(state["tensors"]["w"]["residual"])
        rest = {k: v for k, v in state.items() if k != "checksum"}
        shaped.append({**rest, "tensors": {"w": {"shape": (5, 10), "residual": flat.reshape(5, 10)}}})
        plain.append({**rest, "tensors": {"w": {"shape": (5, 10), "residual": flat}}})
    grads = [np.random.default_rng(6 + r).standard_normal((5, 10)).astype(np.float32) for r in range(2)]
    a, b = resumed_step(shaped, grads), resumed_step(plain, grads)
    np.testing.assert_array_equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------- #
# the rank and world a state records: checked at load, and against the run that loads it
# --------------------------------------------------------------------------- #
def edited(state, **fields):
    """``state`` with ``fields`` changed and its checksum recomputed (an edit the checksum cannot see)."""
    from hvd_compress.algorithms.checkpoint import state_checksum

    state = {**state, **fields}
    state["checksum"] = state_checksum(state)
    return state


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"world": -3, "rank": 5}, "its 'world' (the number of ranks that saved it) is -3, not an integer >= 1"),
        ({"world": "two"}, "its 'world' (the number of ranks that saved it) is 'two', not an integer >= 1"),
        ({"world": 0, "rank": 0}, "its 'world' (the number of ranks that saved it) is 0"),
        ({"world": 2.0}, "its 'world' (the number of ranks that saved it) is 2.0"),
        ({"rank": 5}, "its 'rank' (the rank that saved it) is 5, not an integer in [0, 2) ('world' is 2)"),
        ({"rank": -1}, "its 'rank' (the rank that saved it) is -1"),
        ({"rank": True}, "its 'rank' (the rank that saved it) is True"),
        ({"rank": None}, "its 'rank' (the rank that saved it) is None"),
    ],
    ids=["negative-world", "world-text", "world-0", "world-float", "rank-past-world", "rank-negative",
         "rank-bool", "rank-missing"],
)
def test_edited_rank_or_world_is_refused_naming_the_field(fields, message):
    state = edited(trained_state(), **fields)
    with pytest.raises(ValueError, match="incomplete or corrupted") as error:
        TopK(0.1, dense_below=0).bind(1, 2).load_state_dict(state)
    assert message in str(error.value)


def test_numpy_integers_are_a_rank_and_world():
    state = edited(trained_state(), rank=np.int64(1), world=np.int32(2))
    TopK(0.1, dense_below=0).bind(1, 2).load_state_dict(state)


def test_every_rank_holding_the_same_other_ranks_state_differs_in_the_cross_rank_check():
    """Rank 3's state (of 4) loaded on both ranks of a 2-rank run: each rank's note names its own
    number, so the ranks' config hashes differ and the first exchange stops every rank."""
    state = edited(trained_state(), rank=3, world=4)
    ranks = [TopK(0.1, dense_below=0).bind(r, 2) for r in range(2)]
    for compressor in ranks:
        compressor.load_state_dict(state)
    assert ranks[0].config_hash() != ranks[1].config_hash()
    assert "rank 0's state was loaded from rank 3's checkpoint (of 4 ranks)" in ranks[0].state.note(ranks[0].rank)


def test_a_resized_run_keeps_each_ranks_own_state():
    """Saved by rank 1 of 4, resumed by rank 1 of 2: its own, nothing to say."""
    state = edited(trained_state(), world=4)
    mine = TopK(0.1, dense_below=0).bind(1, 2)
    mine.load_state_dict(state)
    assert mine.state.note(mine.rank) == ""


def test_a_single_rank_holding_another_ranks_state_stops_at_its_first_exchange():
    """A world of one rank has nobody to differ from: its header check refuses the state itself."""
    torch = pytest.importorskip("torch")
    from hvd_compress.transport.communicator import SingleProcessCommunicator
    from hvd_compress.engine.exchange import open_exchange

    compressor = TopK(0.1, dense_below=0)
    compressor.load_state_dict(trained_state())  # rank 1's
    exchange = open_exchange(compressor, SingleProcessCommunicator(), "b")
    exchange.add("w", torch.randn(50))
    with pytest.raises(ValueError, match="rank 0's state was loaded from rank 1's checkpoint"):
        exchange.launch()
        exchange.finish()


def test_simulator_refuses_states_out_of_rank_order():
    sim = Simulator(2, TopK(0.1, dense_below=0))
    rng = np.random.default_rng(0)
    sim.step({"w": [rng.standard_normal(50).astype(np.float32) for _ in range(2)]})
    states = [c.state_dict() for c in sim.compressors]
    Simulator(2, TopK(0.1, dense_below=0)).load_state_dict(states)
    with pytest.raises(ValueError, match="not in rank order; rank 0's state was loaded from rank 1's"):
        Simulator(2, TopK(0.1, dense_below=0)).load_state_dict(states[::-1])
