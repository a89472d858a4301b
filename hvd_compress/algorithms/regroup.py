"""Compressor checkpoints of one world regrouped for a world of another size.

Residuals are per rank (:mod:`~hvd_compress.algorithms.checkpoint`): resumed at another number of
ranks, each rank loading its own file, the residuals of ranks no longer present would be lost.
:func:`regroup_states` reads every old rank's checkpoint and writes rank ``r``'s of the new world
of ``N_new`` ranks, so that nothing is lost. With ``i`` the old ranks ``0 .. N_old - 1``::

    residual'_r = sum of residual_i over i with i mod N_new == r
    velocity'_r = sum of velocity_i over i with i mod N_new == r

hence ``sum_r residual'_r = sum_i residual_i`` (and the same for the velocities). A new rank that no
old rank maps to (``r >= N_old``) holds none, as a process that joins: its error feedback starts at
zero. The velocities of momentum correction (``u = m u + g; a = r + u``; sent entries of ``u`` set
to 0) are error-feedback mass of the same kind as the residuals, what a rank accumulated and has not
sent, and what they add to later sends is linear in them, so they are summed too. The routes that
average (the default) divide each step's sum over ranks by the world size: regrouped residuals and
velocities weigh ``1 / N_new`` in the averaged gradient where they weighed ``1 / N_old``.

What cannot be summed is left out, or starts afresh on the new rank as it does in a process that
joins a world (:meth:`~hvd_compress.algorithms.state.CompressorState.reset_for_new_world`):

- RegTop-k's posterior (``posterior_indices``/``posterior_values``; ``sent_indices``/``sent_values``
  of older checkpoints): one rank's own sends against the old world's sums; the new rank's first
  selection is plain Top-k, as at step 1;
- what one world measured or agreed on (:data:`~hvd_compress.algorithms.state.WORLD_BOUND`): reused
  thresholds and their counts (``threshold``, ``threshold_k``), the ``aggregate`` rule's
  ``index_rate`` and ``index_age``;
- the step count (``exchanges`` 0: rank 0 leads a shared index set first, reused thresholds start
  with an exact selection);
- the random streams (``generators`` empty: new rank ``r`` draws from the stream of ``(seed, r)``
  from its start);
- an exchange policy's measurements and decisions (``Auto``'s ``decisions``).

Arrays are read on the host (numpy), summed in float64 and written back in the framework, dtype and
shape of the old ranks' (load time only, never in a training step).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from hvd_compress import kernels
from hvd_compress.algorithms.checkpoint import check_state, host_array, state_checksum

#: per-tensor arrays that are error-feedback mass: summed over the old ranks that a new rank takes
SUMMED = ("residual", "velocity")

Put = Callable[[Dict[str, Any]], Dict[str, Any]]


def regroup_states(states: Any, rank: int, world: int) -> Dict[str, Any]:
    """Rank ``rank``'s checkpoint in a world of ``world`` ranks, from every old rank's ``states``: its
    residuals and momentum-correction velocities the sums of those of the old ranks ``i`` with
    ``i mod world == rank`` (none where no old rank maps to it); posteriors, reused thresholds, shared
    index rates and ages, the step count and the random streams start afresh (module docstring). The
    sum over ranks is kept; routes that average weigh it ``1 / world`` where it weighed ``1 / N_old``.

    ``states``: every old rank's checkpoint, in rank order or each identified by the ``rank`` it
    records (then ``world`` of them), as one route wrote them:

    - compressor states: ``compression.state_dict()`` (stock ``horovod.torch``),
      ``CompressionState.state_dict()`` (the DDP hook), ``Simulator.state_dict()["ranks"]`` or the whole
      ``Simulator.state_dict()``, an ``Auto``'s state: the result is one of the same kind;
    - ``optimizer.state_dict()`` of ``hvd_compress.torch`` or ``hvd_compress.mpi``
      ``DistributedOptimizer`` (the compressor state under ``"hvd_compress"``): the result is that
      optimizer's ``state_dict()``, the wrapped optimizer's entries those of old rank
      ``rank mod N_old`` (the same on every rank: it steps on the averaged gradients).

    The result records ``rank`` and ``world`` and a fresh ``checksum``; it loads with the route's own
    ``load_state_dict`` (a Simulator of ``world`` ranks: the list of every new rank's). ``ValueError``
    for a damaged checkpoint, duplicated or missing ranks, ranks of different worlds, of different
    compressors or configurations, or of different tensor names or shapes::

        old = [torch.load(f"ckpt.{i}.pt") for i in range(old_world)]
        optimizer.load_state_dict(hvd_compress.regroup_states(old, hvd.rank(), hvd.size()))
    """
    _check_place(rank, world)
    rank, world = int(rank), int(world)
    if isinstance(states, dict) and "ranks" in states and "steps" in states:  # a Simulator's state_dict()
        states = states["ranks"]
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError(f"hvd_compress: regroup_states takes the list of every old rank's checkpoint, got "
                         f"{type(states).__name__}{' (empty)' if isinstance(states, (list, tuple)) else ''}")
    split = [_split(state, position) for position, state in enumerate(states)]
    parts = [part for part, _, _ in split]
    _check_kinds([kind for _, _, kind in split])
    order = _rank_order(parts)
    parts = [parts[position] for position in order]
    _check_alike(parts)
    return split[order[rank % len(parts)]][1](_merged(parts, rank, world))


def _check_place(rank: Any, world: Any) -> None:
    """The new ``rank`` and ``world``: integers, ``world >= 1``, ``0 <= rank < world``."""
    def integer(value: Any) -> bool:
        return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))

    if not integer(world) or world < 1:
        raise ValueError(f"hvd_compress: the new world size must be an integer >= 1, got {world!r}")
    if not integer(rank) or not 0 <= rank < world:
        raise ValueError(f"hvd_compress: the new rank must be an integer in [0, {world}), got {rank!r}")


def _split(state: Any, position: int) -> Tuple[Dict[str, Any], Put, Tuple[Any, ...]]:
    """The compressor state in one rank's checkpoint ``state``, checked; how to put a regrouped one in its
    place; and what holds it (``("optimizer",)``, ``("Auto", config)``...)."""
    if isinstance(state, dict) and "hvd_compress" in state and "param_groups" in state:
        part, put, kind = _split(state["hvd_compress"], position)
        return part, lambda merged: {**state, "hvd_compress": put(merged)}, ("optimizer",) + kind
    if isinstance(state, dict) and isinstance(state.get("inner"), dict) and "tensors" not in state:
        part, put, kind = _split(state["inner"], position)
        policy = f"{state.get('config', {}).get('type')} {state.get('config')}"
        return part, lambda merged: {**state, "inner": put(merged), "decisions": {}}, (policy,) + kind
    try:
        check_state(state)
    except ValueError as error:
        raise ValueError(f"{error} (the checkpoint at position {position} of the list)") from None
    return state, lambda merged: merged, ()


def _check_kinds(kinds: List[Tuple[Any, ...]]) -> None:
    """Every checkpoint holds its compressor state alike (all optimizers' or all compressors', one policy)."""
    for position, kind in enumerate(kinds):
        if kind != kinds[0]:
            raise ValueError(
                f"hvd_compress: the checkpoints hold their compressor state differently: at position 0 "
                f"{_describe(kinds[0])}, at position {position} {_describe(kind)}; regroup the checkpoints "
                f"of one run, every rank's as the route wrote it")


def _describe(kind: Tuple[Any, ...]) -> str:
    words = ["an optimizer's state_dict()" if layer == "optimizer" else f"the state of {layer}" for layer in kind]
    return " holding ".join(words + ["a compressor's state"])


def _rank_order(parts: List[Dict[str, Any]]) -> List[int]:
    """Positions of ``parts`` in old-rank order: by the ``rank`` each records (each of ``0 .. world - 1``
    once, one ``world``), else the list's order."""
    recorded = ["rank" in part for part in parts]
    if not any(recorded):
        return list(range(len(parts)))
    if not all(recorded):
        raise ValueError(f"hvd_compress: the checkpoints at positions {[i for i, r in enumerate(recorded) if not r]} "
                         f"record no rank and the others do: regroup the checkpoints of one run")
    worlds = sorted({int(part["world"]) for part in parts})
    if len(worlds) > 1:
        by_world = {w: [int(p["rank"]) for p in parts if int(p["world"]) == w] for w in worlds}
        raise ValueError(f"hvd_compress: the checkpoints come from worlds of different sizes (world: ranks "
                         f"{by_world}): regroup the checkpoints every rank of one world saved at one step")
    positions: Dict[int, int] = {}
    for position, part in enumerate(parts):
        old_rank = int(part["rank"])
        if old_rank in positions:
            raise ValueError(f"hvd_compress: rank {old_rank}'s checkpoint is in the list twice (positions "
                             f"{positions[old_rank]} and {position}): pass every rank's once")
        positions[old_rank] = position
    missing = [r for r in range(worlds[0]) if r not in positions]
    if missing:
        raise ValueError(f"hvd_compress: the checkpoints of ranks {missing} of the world of {worlds[0]} ranks "
                         f"that saved them are missing: every rank's is needed, or its residuals are lost")
    return [positions[r] for r in range(worlds[0])]


def _check_alike(parts: List[Dict[str, Any]]) -> None:
    """Every old rank's state (in rank order) of one compressor and configuration, one set of tensors and shapes."""
    first = parts[0]
    names = set(first["tensors"])
    for old_rank, part in enumerate(parts):
        if part["config"] != first["config"]:
            raise ValueError(f"hvd_compress: ranks 0 and {old_rank} hold the state of different compressors or "
                             f"configurations ({first['config']} and {part['config']}): regroup one run's")
        if set(part["tensors"]) != names:
            differ = sorted(names.symmetric_difference(part["tensors"]))
            raise ValueError(f"hvd_compress: ranks 0 and {old_rank} hold the state of different tensors "
                             f"(only one of them has {differ[:3]}): regroup one model's")
        for name in names:
            shapes = [tuple(int(n) for n in p["tensors"][name]["shape"]) for p in (first, part)]
            if shapes[0] != shapes[1]:
                raise ValueError(f"hvd_compress: ranks 0 and {old_rank} hold tensor '{name}' of different "
                                 f"shapes ({shapes[0]} and {shapes[1]}): regroup one model's")


def _merged(parts: List[Dict[str, Any]], rank: int, world: int) -> Dict[str, Any]:
    """New rank ``rank``'s compressor state from every old rank's ``parts`` (in rank order, checked)."""
    group = parts[rank::world]  # the old ranks i with i mod world == rank
    tensors = {name: _merged_tensor([part["tensors"][name] for part in parts],
                                    [part["tensors"][name] for part in group])
               for name in parts[0]["tensors"]}
    routes = list(dict.fromkeys(part.get("route") for part in parts))
    state = {"config": dict(parts[0]["config"]), "tensors": tensors, "generators": {}, "rank": rank,
             "world": world, "route": routes[0] if len(routes) == 1 else " and ".join(map(str, routes))}
    if any("exchanges" in part for part in parts):
        state["exchanges"] = 0
    state["checksum"] = state_checksum(state)
    return state


def _merged_tensor(every: Sequence[Dict[str, Any]], group: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One tensor's entry: its shape, and the sum over ``group`` (some of ``every`` old rank's entries) of
    each :data:`SUMMED` array, where any old rank has one (in that rank's framework, dtype and shape)."""
    entry: Dict[str, Any] = {"shape": tuple(int(n) for n in every[0]["shape"])}
    for key in SUMMED:
        like = next((old[key] for old in every if old.get(key) is not None), None)
        arrays = [host_array(old[key]) for old in group if old.get(key) is not None]
        if like is None or not arrays:
            continue
        template = host_array(like)
        total = np.zeros(template.shape, np.float64)
        for array in arrays:
            total += array.reshape(template.shape)
        entry[key] = _in_framework_of(total.astype(np.result_type(*arrays)), like)
    return entry


def _in_framework_of(array: np.ndarray, like: Any) -> Any:
    """``array`` as ``like``'s framework's tensor (on its device); numpy where ``like`` is of none."""
    try:
        ops = kernels.ops_for(like)
    except TypeError:
        return array
    return ops.from_host(array, like)
