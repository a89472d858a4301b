"""What only the TensorFlow kernels are tested for (the shared tests: ``test_kernels.py``):
random streams created in or used by ``tf.function`` graphs, and ``tf.Variable`` inputs."""

from __future__ import annotations

import numpy as np

from hvd_compress import TopK, kernels
from hvd_compress.kernels import reference as R
from tests.kernels.frameworks import framework

K = framework("tf")  # skips this module without TensorFlow (fails under HVD_COMPRESS_REQUIRE_HOROVOD=1)
tf, F = K.tf, K.ops


def test_tf_random_stream_in_a_graph():
    """A stream created eagerly, or once on a function's first trace (as
    ``Compressor.generator`` caches it), draws inside ``tf.function`` and continues."""
    like = tf.zeros(100)
    eager = F.generator(3, 1, like)
    want = [F.uniform(eager, like) for _ in range(2)]
    cache = {}

    @tf.function(autograph=False)
    def draw(x):
        if "rng" not in cache:
            cache["rng"] = F.generator(3, 1, x)
        rng = cache["rng"]
        state = F.generator_state(rng)
        return F.uniform(rng, x), state

    for step in range(2):
        got, state = draw(like)
        assert np.array_equal(got, want[step]) and tf.is_tensor(state)
    graph_stream = tf.random.Generator.from_seed(0, alg="philox")
    tf.function(lambda: F.set_generator_state(graph_stream, F.generator_state(eager)), autograph=False)()
    assert np.array_equal(F.uniform(graph_stream, like), F.uniform(eager, like))


def test_kernels_take_variables():
    a = np.random.default_rng(1).standard_normal(500).astype(np.float32)
    v = tf.Variable(a)
    assert kernels.ops_for(v) is F
    idx = R.topk_select(a, 20)
    K.assert_same(F.topk_select(v, 20), idx)
    values, residual = F.error_feedback_split(v, K.tensor(idx), in_place=True)
    want_values, want_residual = R.error_feedback_split(a, idx)
    K.assert_same(values, want_values)
    K.assert_same(residual, want_residual)
    assert np.array_equal(v.numpy(), a)  # in_place is ignored: the variable is untouched
    assert F.count_nonfinite(v) == 0 and F.terngrad_scale(v) == R.terngrad_scale(a)
    K.check(lambda x: F.gaussiank_select(x, 0.05), [v], R.gaussiank_select(a, 0.05))
    payload = TopK(0.04, dense_below=0).encode(v, "v")  # an eager CPU variable: compressed as numpy
    assert isinstance(payload.values, np.ndarray)
    np.testing.assert_array_equal(payload.indices, idx)
    np.testing.assert_array_equal(payload.values, want_values)
