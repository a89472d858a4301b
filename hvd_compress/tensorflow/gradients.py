"""Fused, compressed exchange of a whole gradient list for TensorFlow (the drop-in path).

:class:`GradientExchange` replaces the ``_allreduce_grads`` function of
Horovod's ``DistributedGradientTape`` and Keras ``DistributedOptimizer``: the
gradients of one step, keyed by their variables' names, travel in one
:class:`~hvd_compress.engine.exchange.BucketExchange` per dtype (one header, one
allgather of indices, one of values, or TernGrad's scale Max and packed code
sum), run as a single op (:func:`hvd_compress.horovod.tensorflow_hooks.eagerly`).
Horovod's handling of local variables, ``backward_passes_per_step`` and
``tf.IndexedSlices`` stays as it is.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import tensorflow as tf

from hvd_compress.horovod.tensorflow_hooks import HorovodTensorFlowCommunicator, eagerly, exchange


def variable_names(variables: Sequence[Any]) -> List[str]:
    """Unique, rank-independent names: the variables' names, repeats numbered."""
    seen: Dict[str, int] = {}
    names = []
    for variable in variables:
        name = getattr(variable, "path", None) or variable.name
        count = seen.get(name, 0)
        seen[name] = count + 1
        names.append(name if count == 0 else f"{name}#{count}")
    return names


class GradientExchange:
    """``exchange(grads, variables)``: every gradient averaged (or summed) over ranks, compressed."""

    def __init__(self, compression: Any, communicator: Optional[Any] = None, average: bool = True) -> None:
        self.compressor = compression
        compression.state.route = "hvd_compress.tensorflow"
        self.communicator = communicator
        self.average = average

    @property
    def comm(self) -> Any:
        if self.communicator is None:
            self.communicator = HorovodTensorFlowCommunicator()
        return self.communicator

    @tf.autograph.experimental.do_not_convert  # called while a step is traced: see horovod/tensorflow_hooks.py
    def __call__(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any],
        use_generic_names: bool = False,
        names: Optional[Sequence[str]] = None,
    ):
        """``names``: the tensors' names (residuals are kept under them); default the variables'."""
        names = variable_names(variables) if names is None else list(names)
        present = [(name, tf.convert_to_tensor(grad)) for name, grad in zip(names, grads) if grad is not None]
        if not present:
            return list(grads)
        by_dtype: Dict[Any, List[tuple]] = {}
        for name, grad in present:
            by_dtype.setdefault(grad.dtype, []).append((name, grad))
        ordered = [name for bucket in by_dtype.values() for name, _ in bucket]

        def run(*tensors: Any) -> List[Any]:
            received = dict(zip(ordered, tensors))
            results = []
            for dtype, bucket in by_dtype.items():
                named = [(name, received[name]) for name, _ in bucket]
                results += exchange(
                    self.compressor, self.comm, f"hvd_compress.{dtype.name}", named, self.average
                )
            return results

        inputs = [grad for bucket in by_dtype.values() for _, grad in bucket]
        reduced = dict(zip(ordered, eagerly(run, inputs)))
        return [None if grad is None else reduced[name] for name, grad in zip(names, grads)]
