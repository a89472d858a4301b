"""Which Keras ``tf.keras`` is (Keras 3 or Keras 2), and Keras-3-aware variable helpers.

Shared by :mod:`hvd_compress.keras` and its callbacks.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf


def uses_keras3() -> bool:
    """Whether TensorFlow's ``tf.keras`` is Keras 3 (else Keras 2, ``tf_keras``)."""
    if tf.keras.__name__.startswith("tf_keras"):
        return False
    return not str(getattr(tf.keras, "__version__", "3")).startswith("2.")


KERAS3 = uses_keras3()
KERAS = "Keras 3" if KERAS3 else "Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1)"


def broadcast_variables(variables: Sequence[Any], root_rank: int) -> None:
    """``horovod.tensorflow.broadcast_variables`` that also takes Keras 3 variables."""
    import horovod.tensorflow as hvd

    hvd.broadcast_variables([_tf_variable(v) for v in variables], root_rank)


def _tf_variable(variable: Any) -> Any:
    """The ``tf.Variable`` of a Keras 3 variable (its ``.value``); others as they are."""
    value = getattr(variable, "value", None)
    return value if isinstance(value, tf.Variable) else variable
