"""``regroup_states``: every old rank's checkpoint regrouped for a world of another size.

On the Simulator (4 -> 2, 2 -> 4, 3 -> 2; Top-k, RegTop-k, momentum correction, TernGrad with error
feedback): the sum over the new ranks of the residuals and velocities equals the old ranks' sum, what
cannot be summed starts afresh, and the new world loads the states and trains on. The rule
``i mod N_new`` on hand-made checkpoints; the refusals; the drop-in and MPI optimizers' checkpoints
(thread ranks), which equal the Simulator resumed from the same regrouped states.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from hvd_compress import Auto, RegTopK, TernGrad, TopK, regroup_states
from hvd_compress.algorithms.checkpoint import state_checksum
from hvd_compress.algorithms.state import WORLD_BOUND
from hvd_compress.simulator import Simulator

SHAPES = {"fc.weight": (40, 50), "conv.weight": (3000,), "fc.bias": (7,)}  # the bias travels dense
COMPRESSORS = {
    "topk": lambda: TopK(0.05),
    "regtopk": lambda: RegTopK(0.05),
    "topk-momentum": lambda: TopK(0.05, momentum=0.9),
    "terngrad-feedback": lambda: TernGrad(error_feedback=True),
    "topk-aggregate": lambda: TopK(0.05, indices="aggregate"),
    "regtopk-reuse": lambda: RegTopK(0.05, exact_every=2),
}
#: the arrays each compressor holds after a few steps (some tensor has each)
HOLDS = {"topk": {"residual"}, "regtopk": {"residual", "posterior_indices"},
         "topk-momentum": {"residual", "velocity"}, "terngrad-feedback": {"residual"},
         "topk-aggregate": {"residual", "index_rate"}, "regtopk-reuse": {"residual", "threshold"}}
WORLDS = [(4, 2), (2, 4), (3, 2)]


def gradients(ranks, rng):
    return {name: [rng.standard_normal(shape).astype(np.float32) for _ in range(ranks)]
            for name, shape in SHAPES.items()}


def trained(name, ranks, steps=3, seed=0):
    """A Simulator of ``ranks`` after ``steps`` steps of random gradients."""
    rng = np.random.default_rng(seed)
    sim = Simulator(ranks, COMPRESSORS[name]())
    for _ in range(steps):
        sim.step(gradients(ranks, rng))
    return sim


def total(states, name, key):
    """The sum over ranks of ``key`` of tensor ``name`` (float64; ``None`` where no rank holds one)."""
    arrays = [np.asarray(s["tensors"][name][key], np.float64).reshape(-1) for s in states
              if s["tensors"].get(name, {}).get(key) is not None]
    return sum(arrays) if arrays else None


def present(states):
    return {key for s in states for entry in s["tensors"].values() for key, v in entry.items() if v is not None}


@pytest.mark.parametrize("old, new", WORLDS, ids=[f"{o}to{n}" for o, n in WORLDS])
@pytest.mark.parametrize("name", COMPRESSORS)
def test_the_sum_over_ranks_is_kept_and_the_new_world_trains_on(name, old, new):
    states = trained(name, old).state_dict()["ranks"]
    assert HOLDS[name] <= present(states)
    regrouped = [regroup_states(states, rank, new) for rank in range(new)]
    for key in ("residual", "velocity"):
        for tensor in SHAPES:
            before, after = total(states, tensor, key), total(regrouped, tensor, key)
            assert (before is None) == (after is None), (key, tensor)
            if before is not None:
                assert np.abs(before).max() > 0
                assert np.abs(after - before).max() <= 1e-6 * np.abs(before).max(), (key, tensor)
    dropped = {"posterior_indices", "posterior_values", *WORLD_BOUND}
    assert not dropped & present(regrouped)
    for rank, state in enumerate(regrouped):
        assert (state["rank"], state["world"], state["generators"]) == (rank, new, {})
        assert state.get("exchanges", 0) == 0 and state["checksum"] == state_checksum(state)
        assert state["config"] == states[0]["config"] and state["route"] == "Simulator"
    sim = Simulator(new, COMPRESSORS[name]())
    sim.load_state_dict(regrouped)
    for tensor in SHAPES:
        for rank, residual in enumerate(sim.residuals(tensor)):
            saved = regrouped[rank]["tensors"].get(tensor, {}).get("residual")
            assert (residual is None) == (saved is None)
            if saved is not None:
                np.testing.assert_array_equal(np.asarray(residual).reshape(-1), np.asarray(saved).reshape(-1))
    rng = np.random.default_rng(7)
    for _ in range(2):
        out = sim.step(gradients(new, rng))
        assert all(np.isfinite(out[tensor]).all() and out[tensor].shape == shape for tensor, shape in SHAPES.items())


def hand_made(world, rng, shape=(2, 3)):
    """Every rank's checkpoint of one tensor ``w``: residual, velocity, posterior, a kept threshold."""
    config = TopK(0.5, dense_below=0, momentum=0.9, exact_every=2).config()
    states = []
    for rank in range(world):
        entry = {"shape": shape, "residual": rng.uniform(-1, 1, shape).astype(np.float32),
                 "velocity": rng.uniform(-1, 1, shape).astype(np.float32),
                 "posterior_indices": np.array([1, 4], np.int64), "posterior_values": rng.uniform(-1, 1, 2),
                 "threshold": np.array([0.3], np.float32), "threshold_k": 3}
        states.append({"config": config, "tensors": {"w": entry}, "generators": {}, "rank": rank,
                       "world": world, "route": "Simulator", "exchanges": 5})
    return states


#: (old world, new world) -> the old ranks each new rank sums, written out by hand
GROUPS = {(5, 2): [[0, 2, 4], [1, 3]], (5, 3): [[0, 3], [1, 4], [2]], (2, 3): [[0], [1], []], (3, 3): [[0], [1], [2]]}


@pytest.mark.parametrize("old, new", list(GROUPS), ids=[f"{o}to{n}" for o, n in GROUPS])
def test_new_rank_r_sums_the_old_ranks_i_with_i_mod_n_equal_to_r(old, new):
    states = hand_made(old, np.random.default_rng(old * 10 + new))
    for rank, group in enumerate(GROUPS[(old, new)]):
        state = regroup_states(states, rank, new)
        entry = state["tensors"]["w"]
        assert set(entry) == ({"shape", "residual", "velocity"} if group else {"shape"})
        for key in ("residual", "velocity"):
            if group:
                expected = sum(states[i]["tensors"]["w"][key].astype(np.float64) for i in group).astype(np.float32)
                np.testing.assert_array_equal(entry[key], expected)
                assert entry[key].dtype == np.float32 and entry[key].shape == (2, 3)
        assert state["exchanges"] == 0 and (state["rank"], state["world"]) == (rank, new)


def test_old_ranks_are_found_by_the_rank_they_record_or_by_their_place():
    states = hand_made(5, np.random.default_rng(3))
    shuffled = states[:]
    random.Random(0).shuffle(shuffled)
    anonymous = [{k: v for k, v in s.items() if k not in ("rank", "world")} for s in states]
    for rank in range(2):
        expected = regroup_states(states, rank, 2)
        for other in (shuffled, anonymous):
            got = regroup_states(other, rank, 2)
            for key in ("residual", "velocity"):
                np.testing.assert_array_equal(got["tensors"]["w"][key], expected["tensors"]["w"][key])


def test_the_regrouped_state_loads_on_its_rank_with_no_other_ranks_note():
    states = trained("regtopk", 4).state_dict()["ranks"]
    for rank in range(2):
        compressor = RegTopK(0.05).bind(rank, 2)
        compressor.load_state_dict(regroup_states(states, rank, 2))
        assert compressor.state.origin == (rank, 2) and compressor.state.note(rank) == ""
        assert compressor.state.exchanges == 0 and compressor.state.saved_generators == {}


def test_an_exchange_policys_state_regroups_its_compressors_and_drops_its_decisions():
    states = trained("topk", 4).state_dict()["ranks"]
    config = Auto(TopK(0.05)).config()
    wrapped = [{"config": config, "inner": s, "decisions": {"bucket": {"choice": "dense"}}} for s in states]
    for rank in range(2):
        state = regroup_states(wrapped, rank, 2)
        assert state["config"] == config and state["decisions"] == {}
        bare = regroup_states(states, rank, 2)
        for tensor in SHAPES:
            got = state["inner"]["tensors"].get(tensor, {}).get("residual")
            want = bare["tensors"].get(tensor, {}).get("residual")
            assert (got is None) == (want is None)
            if got is not None:
                np.testing.assert_array_equal(got, want)
        Auto(TopK(0.05)).bind(rank, 2).load_state_dict(state)


def without_checksum(state, **changes):
    return {**{k: v for k, v in state.items() if k != "checksum"}, **changes}


def refusal(states, rank=0, world=2):
    with pytest.raises(ValueError) as error:
        regroup_states(states, rank, world)
    return str(error.value)


def test_what_cannot_be_regrouped_is_refused_naming_the_problem():
    states = trained("topk", 4).state_dict()["ranks"]
    assert "rank 1's checkpoint is in the list twice" in refusal([states[0], states[1], states[1], states[3]])
    assert "ranks [2] of the world of 4 ranks" in refusal([states[0], states[1], states[3]])
    two = trained("topk", 2).state_dict()["ranks"]
    assert "worlds of different sizes" in refusal(states[:2] + two)
    other = trained("regtopk", 4).state_dict()["ranks"]
    assert "different compressors or configurations" in refusal(states[:3] + other[3:])
    denser = trained("topk", 4, seed=1).state_dict()["ranks"]
    denser[2] = without_checksum(denser[2], config={**denser[2]["config"], "ratio": 0.1})
    assert "ranks 0 and 2 hold the state of different compressors" in refusal(states[:2] + denser[2:3] + states[3:])
    fewer = without_checksum(states[1], tensors={k: v for k, v in states[1]["tensors"].items() if k != "fc.weight"})
    assert "different tensors" in refusal([states[0], fewer] + states[2:])
    reshaped = dict(states[3]["tensors"])
    reshaped["fc.weight"] = {**reshaped["fc.weight"], "shape": (50, 40)}
    reshaped = without_checksum(states[3], tensors=reshaped)
    assert "tensor 'fc.weight' of different shapes" in refusal(states[:3] + [reshaped])
    damaged = {**states[2], "tensors": dict(states[2]["tensors"])}
    damaged["tensors"]["fc.weight"] = {**damaged["tensors"]["fc.weight"],
                                       "residual": damaged["tensors"]["fc.weight"]["residual"] * 1.5}
    message = refusal(states[:2] + [damaged] + states[3:])
    assert "checksum does not match" in message and "position 2" in message
    anonymous = {k: v for k, v in states[1].items() if k not in ("rank", "world", "checksum")}
    assert "record no rank" in refusal([states[0], anonymous] + states[2:])
    optimizer = {"state": {}, "param_groups": [], "hvd_compress": states[0]}
    assert "hold their compressor state differently" in refusal([optimizer] + states[1:])
    with pytest.raises(ValueError, match=r"regroup_states\(state, r, 2\)"):
        Simulator(2, TopK(0.05)).load_state_dict(states)
    assert "list of every old rank's checkpoint" in refusal([])
    assert "list of every old rank's checkpoint" in refusal(states[0])
    for rank, world in ((2, 2), (-1, 2), (0, 0), (True, 2), (0, 2.0)):
        assert "the new" in refusal(states, rank, world)


def test_optimizer_checkpoints_regroup_on_the_drop_in_and_mpi_routes():
    """4 -> 2 on the drop-in optimizer, 2 -> 3 on the MPI optimizer (thread ranks): each old rank's
    ``optimizer.state_dict()`` regrouped, loaded by ``load_state_dict``, trains as the Simulator does
    from the same regrouped compressor states."""
    torch = pytest.importorskip("torch")
    from hvd_compress.transport.threads import run_ranks
    from tests.distributed import route_checkpoints as moves

    for route, old, new in (("dropin", 4, 2), ("mpi", 2, 3)):
        for name in moves.NAMES:
            initial = moves.initial()
            saved = run_ranks(old, lambda comm: optimizer_run(torch, route, name, comm, initial, 0, moves.HALF))
            params = saved[0][0]
            regrouped = [regroup_states([state for _, state in saved], rank, new) for rank in range(new)]
            for state in regrouped:
                assert state["param_groups"] == saved[0][1]["param_groups"]
            expected, _ = moves.simulate(name, new, moves.HALF, moves.STEPS, params,
                                         [state["hvd_compress"] for state in regrouped])
            finals = run_ranks(new, lambda comm: optimizer_run(torch, route, name, comm, params, moves.HALF,
                                                               moves.STEPS, regrouped[comm.rank]))
            for final, _ in finals:
                assert moves.difference(final, expected) < 1e-6, (route, name)


def optimizer_run(torch, route, name, comm, params, start, stop, state=None):
    """Steps ``start``..``stop`` of rank ``comm.rank`` on the drop-in or MPI optimizer from ``params``
    (and ``state``, a whole ``optimizer.state_dict()``): (final parameters, ``optimizer.state_dict()``)."""
    import hvd_compress.mpi
    import hvd_compress.torch
    from tests.distributed import torch_horovod as workload

    model = workload.make_model()
    model.load_state_dict(params)
    sgd = torch.optim.SGD(model.parameters(), lr=workload.LR)
    named, compression = model.named_parameters(), workload.compressor(name)
    if route == "dropin":
        opt = hvd_compress.torch.DistributedOptimizer(sgd, named_parameters=named, compression=compression,
                                                      communicator=comm)
    else:
        opt = hvd_compress.mpi.DistributedOptimizer(sgd, named_parameters=named, compression=compression, comm=comm)
    if state is not None:
        opt.load_state_dict(state)
    data = workload.batches(comm.rank, stop)
    for step in range(start, stop):
        opt.zero_grad()
        workload.loss_fn(model, *data[step]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, opt.state_dict()
