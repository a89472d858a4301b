"""Checks of a compressor checkpoint (``Compressor.state_dict()``) before it is loaded.

Damaged state must not train silently: a NaN residual makes Top-k send nothing for
ever, an index out of range corrupts RegTop-k's scores, and a residual with a few
flipped bytes is finite garbage that no range check can see. So a checkpoint carries
``checksum``, the SHA-256 of everything it holds (names, shapes, every array's dtype
and bytes, the random streams' states), and :func:`check_state` verifies, before any
of it is used:

- the structure (``config``, ``tensors``) and the algorithm it came from;
- per tensor: the residual's and the momentum-correction velocity's size (any shape
  of the tensor's size: routes keep them flat or in the parameter's shape), a floating
  dtype and finite values (so are a shared index set's ``index_rate`` and ``index_age``; a reused
  ``threshold`` is a float, its ``threshold_k`` a count >= 1, one each); RegTop-k's
  ``posterior_indices``/``sent_indices`` integers in ``[0, size)``, its
  ``posterior_values``/``sent_values`` finite floats of the same length;
- every random stream's state, by setting it on a fresh stream of its framework;
- ``rank`` and ``world``, when present: integers with ``world >= 1`` and
  ``0 <= rank < world`` (:func:`check_origin`; the error names the field);
- last, the checksum, when present (checkpoints written before it existed have none),
  which catches what the checks above cannot see.

A checkpoint records the route that wrote it (``route``: ``hvd_compress.torch.DistributedOptimizer``,
``horovod.torch.DistributedOptimizer``, ``hvd_compress.torch.ddp_hook``, ``Simulator``...).
State moves between routes: each rank's state is the same dict whatever wrote it, residuals of any
shape of the tensor's size, arrays of any framework (moved at the first step). A rank's state belongs to
that rank (``rank``): one holding another rank's is stopped, on every rank, by the exchanges' first
cross-rank check (``CompressorState.note``), the Simulator at its ``load_state_dict``; the number of
ranks may change between save and resume (``world``: ranks no longer present leave their residuals
behind, unless every rank's checkpoint is regrouped for the new world:
:func:`~hvd_compress.algorithms.regroup.regroup_states`). What cannot move is
refused, naming the writer: a whole Simulator or optimizer checkpoint handed to a compressor
(:func:`check_state` says where the compressor state sits in it), and state none of whose tensor
names the reading route uses (:func:`check_names`: routes that are not told parameter names name
tensors by position, each in its own way).

Arrays of any framework (numpy, torch, TensorFlow) are read on the host here, once,
at load or save time: never in a training step.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Dict

import numpy as np

from hvd_compress import kernels

#: Per-tensor arrays and what they must hold: ``(kind, partner)``, the partner an array of
#: the same length (indices and their values).
ARRAYS = {
    "residual": ("float", None),
    "velocity": ("float", None),
    "posterior_indices": ("index", "posterior_values"),
    "posterior_values": ("float", "posterior_indices"),
    "sent_indices": ("index", "sent_values"),
    "sent_values": ("float", "sent_indices"),
    "index_rate": ("float", None),
    "index_age": ("float", None),
    "threshold": ("threshold", "threshold_k"),
    "threshold_k": ("count", "threshold"),
}


def host_array(value: Any) -> np.ndarray:
    """A numpy copy of a numpy array, torch tensor or TensorFlow tensor (bfloat16 as float32, exactly)."""
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.split(".")[0] == "torch":
        value = value.detach().cpu()
        return (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()
    if hasattr(value, "numpy"):
        return np.asarray(value.numpy())
    return np.asarray(value)


def _feed(digest: Any, value: Any) -> None:
    """Hash ``value`` (nested dicts, lists, scalars, arrays) into ``digest``, order-independent for dicts."""
    if isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(json.dumps(str(key)).encode())
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, (bool, int, float, str, np.generic)):
        digest.update(repr(value).encode())
    else:
        array = np.ascontiguousarray(host_array(value))
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())


def state_checksum(state: Dict[str, Any]) -> str:
    """SHA-256 (hex) of a checkpoint's ``config``, ``tensors``, ``generators``, ``rank``, ``world`` and,
    when it records them, ``route`` and ``exchanges`` (a shared index set's steps)."""
    digest = hashlib.sha256()
    keys = ("config", "tensors", "generators", "rank", "world") + tuple(
        key for key in ("route", "exchanges") if key in state)
    _feed(digest, {key: state.get(key) for key in keys})
    return digest.hexdigest()


def writer(state: Dict[str, Any]) -> str:
    """The route that wrote ``state``, for messages (checkpoints may predate the record)."""
    route = state.get("route") if isinstance(state, dict) else None
    return str(route) if route else "a route that did not record itself"


def check_names(names: Any, written_by: str, known: Any, reader: str, advice: str = "") -> None:
    """Refuse checkpoint tensors ``names`` (written by ``written_by``) when ``reader`` will exchange none
    of them (``known(name)`` is false for every name): their residuals would wait for ever under
    names nothing sends, and error feedback would silently start from zero. Routes name tensors by
    parameter name when they are told the names (``named_parameters=``), by position otherwise, each
    in its own way. Checkpoints some of whose tensors the reader knows load (a compressor shared by
    two optimizers holds the tensors of both; the others stay in the state and are saved again)."""
    names = list(names)
    if not names or any(known(name) for name in names):
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise ValueError(
        f"hvd_compress: this compressor state was written by {written_by} and names its tensors {shown}, "
        f"none of which {reader} exchanges{advice}. Routes name tensors alike when each is given the "
        f"model's named_parameters= (hvd_compress.torch, horovod.torch and hvd_compress.mpi "
        f"DistributedOptimizer, the DDP hook's CompressionState); resume on the route that wrote it, or "
        f"without the compressor state"
    )


def plain_counts(tensors: Dict[str, Any]) -> Dict[str, Any]:
    """``tensors`` (a checkpoint's, checked) with every count (``ARRAYS`` of kind ``"count"``: a reused
    threshold's ``threshold_k``) as a plain int, as :meth:`state_dict` writes them: checkpoints written
    with a one-element numpy array there load, and save again in a form ``torch.load(weights_only=True)``
    reads."""
    counts = [key for key, (kind, _) in ARRAYS.items() if kind == "count"]
    return {name: {key: int(host_array(value).reshape(-1)[0]) if key in counts and value is not None else value
                   for key, value in entry.items()} for name, entry in tensors.items()}


def _other_state(state: Dict[str, Any]) -> str:
    """``""``, or what a whole checkpoint that holds compressor state is and where its state sits."""
    if "ranks" in state and "steps" in state:
        return (f"this is a Simulator's state of {len(state['ranks'])} ranks (Simulator.state_dict()): load "
                f"each rank's own, state['ranks'][rank], into that rank's compressor or optimizer")
    if "hvd_compress" in state and "param_groups" in state:
        return (f"this is an optimizer's state_dict() ({writer(state['hvd_compress'])}): load it with that "
                f"optimizer's load_state_dict(), or its compressor state state['hvd_compress'] into the compressor")
    return ""


def _broken(what: str) -> ValueError:
    return ValueError(
        f"hvd_compress: the compressor checkpoint is incomplete or corrupted: {what}; save it again with "
        f"state_dict(), or resume without the compressor state"
    )


def check_state(state: Any, compressor: Any = None) -> None:
    """Raise ``ValueError`` naming what is wrong with checkpoint ``state`` for ``compressor`` (``None``: for
    any compressor, everything but the algorithm checked)."""
    if isinstance(state, dict) and _other_state(state):
        into = "a compressor" if compressor is None else repr(compressor)
        raise ValueError(f"hvd_compress: cannot load this into {into}: {_other_state(state)}")
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict) or "tensors" not in state:
        raise _broken(f"expected a dict with 'config' and 'tensors', got {type(state).__name__} "
                      f"{sorted(state) if isinstance(state, dict) else ''}")
    saved = state["config"].get("type")
    if compressor is not None and saved != type(compressor).__name__:
        raise ValueError(f"hvd_compress: checkpoint holds {saved} state (written by {writer(state)}); cannot "
                         f"load it into {compressor!r}")
    if not isinstance(state["tensors"], dict):
        raise _broken("'tensors' is not a dict")
    for name, entry in state["tensors"].items():
        if not isinstance(entry, dict) or "shape" not in entry:
            raise _broken(f"tensor '{name}' has no shape")
        _check_tensor(name, entry)
    generators = state.get("generators", {})
    if not isinstance(generators, dict):
        raise _broken("'generators' is not a dict")
    for module, generator_state in generators.items():
        _check_generator(module, generator_state)
    check_origin(state)
    if "checksum" in state and state["checksum"] != state_checksum(state):
        raise _broken("its checksum does not match its contents (bytes changed after state_dict() wrote it; "
                      "if you edited it on purpose, delete its 'checksum' entry)")


def _integer(value: Any) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_origin(state: Dict[str, Any]) -> None:
    """The ``rank`` and ``world`` a checkpoint records (when it records them): ``world`` an integer
    ``>= 1``, ``rank`` an integer in ``[0, world)``; ``ValueError`` naming the field otherwise."""
    if "world" not in state and "rank" not in state:
        return
    world, rank = state.get("world"), state.get("rank")
    if not _integer(world) or world < 1:
        raise _broken(f"its 'world' (the number of ranks that saved it) is {world!r}, not an integer >= 1")
    if not _integer(rank) or not 0 <= rank < world:
        raise _broken(f"its 'rank' (the rank that saved it) is {rank!r}, not an integer in [0, {world}) "
                      f"('world' is {world})")


def _check_tensor(name: str, entry: Dict[str, Any]) -> None:
    """One tensor's arrays: sizes, dtypes, index ranges, finite values."""
    numel = math.prod(int(n) for n in entry["shape"])
    arrays = {}
    for key, (kind, partner) in ARRAYS.items():
        if entry.get(key) is None:
            continue
        try:
            array = host_array(entry[key]).reshape(-1)
        except Exception as error:  # noqa: BLE001  (anything that is not an array)
            raise _broken(f"the {key} of '{name}' is not an array ({type(entry[key]).__name__}: {error})")
        arrays[key] = array
        if kind == "threshold" and array.dtype.kind != "f":  # any value: NaN where a tensor was non-finite
            raise _broken(f"the {key} of '{name}' has dtype {array.dtype}, not a floating type")
        if kind == "count" and (array.dtype.kind not in "iu" or (array.size and array.min() < 1)):
            raise _broken(f"the {key} of '{name}' is not a count >= 1 ({array.dtype}: {array.tolist()[:4]})")
        if kind in ("threshold", "count"):
            continue
        if kind == "index":
            if array.dtype.kind not in "iu":
                raise _broken(f"the {key} of '{name}' has dtype {array.dtype}, not an integer type")
            if array.size and (array.min() < 0 or array.max() >= numel):
                raise _broken(f"the {key} of '{name}' hold indices outside [0, {numel}) "
                              f"(from {array.min()} to {array.max()})")
            continue
        if array.dtype.kind != "f":
            raise _broken(f"the {key} of '{name}' has dtype {array.dtype}")
        bad = int(array.size - np.isfinite(array).sum())
        if bad and key in ("residual", "velocity"):
            raise ValueError(f"hvd_compress: the checkpoint's {key} of '{name}' holds {bad} NaN/Inf; "
                             f"resume from an earlier checkpoint, or without the compressor state")
        if bad:
            raise _broken(f"the {key} of '{name}' hold {bad} NaN/Inf")
    for key in ("residual", "velocity"):
        array = arrays.get(key)
        if array is not None and array.size != numel:
            raise _broken(f"the {key} of '{name}' has {array.size} elements, its shape "
                          f"{tuple(entry['shape'])} {numel}")
    for key, (_, partner) in ARRAYS.items():
        if partner and key in arrays and arrays.get(partner) is None:
            raise _broken(f"'{name}' has {key} without {partner}")
        if partner and key in arrays and arrays[key].size != arrays[partner].size:
            raise _broken(f"the {key} ({arrays[key].size}) and {partner} ({arrays[partner].size}) of '{name}' "
                          f"differ in length")


def _check_generator(module: str, generator_state: Any) -> None:
    """Set ``generator_state`` on a fresh stream of ``module``'s framework on the host (``ops.host_empty()``).
    Every stream state fits a host stream: torch's counter stream on the host and a CUDA generator both
    keep 16 bytes (a seed and a position)."""
    try:
        ops = kernels.module(module)
    except ValueError as error:
        raise _broken(str(error))
    try:
        ops.set_generator_state(ops.generator(0, 0, ops.host_empty()), generator_state)
    except Exception as error:  # noqa: BLE001  (each framework raises its own type)
        raise _broken(f"the random stream state for {module.rsplit('.', 1)[-1]} is damaged "
                      f"({type(error).__name__}: {error})")
