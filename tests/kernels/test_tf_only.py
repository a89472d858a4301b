"""What only the TensorFlow kernels are tested for (the shared tests: ``test_kernels.py``):
random streams created in or used by ``tf.function`` graphs, and ``tf.Variable`` inputs."""

from __future__ import annotations

import numpy as np

from hvd_compress import TopK, kernels
from hvd_compress.kernels import reference as R
from hvd_compress.simulator import Simulator
from tests.kernels.frameworks import framework

K = framework("tf")  # skips this module without TensorFlow (fails under HVD_COMPRESS_REQUIRE_HOROVOD=1)
tf, F = K.tf, K.ops


def test_tf_random_stream_in_a_graph():
    """A stream created eagerly, or once on a function's first trace (as
    the run state caches it), draws inside ``tf.function`` and continues."""
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
    idx = R.topk_indices(np.abs(a), 20)
    K.assert_same(F.topk_indices(abs(v), 20), idx)
    values, residual = F.error_feedback_split(v, K.tensor(idx), in_place=True)
    want_values, want_residual = R.error_feedback_split(a, idx)
    K.assert_same(values, want_values)
    K.assert_same(residual, want_residual)
    assert np.array_equal(v.numpy(), a)  # in_place is ignored: the variable is untouched
    threshold = R.gaussiank_threshold(a, 0.05)
    K.check(lambda x: F.gaussiank_from(abs(x), threshold, 25), [v], R.gaussiank_from(np.abs(a), threshold, 25))
    sent = Simulator(1, TopK(0.04, dense_below=0)).step({"v": [v]})["v"]  # an eager CPU variable: as numpy
    assert tf.is_tensor(sent)
    want = np.zeros_like(a)
    want[idx] = want_values
    np.testing.assert_array_equal(sent.numpy(), want)


def test_a_layout_traced_by_two_graphs():
    """A layout's per-entry row index is kept once made eagerly, but made anew in each graph that traces
    it: a tensor of one graph cannot be used in another (a retrace, a second ``tf.function``)."""
    from hvd_compress.kernels.groups import Group

    groups = [Group(0, 0, [0, 1], 3), Group(6, 2, [2], 2)]
    bad = tf.constant([True, False, True])
    old, new = tf.constant(np.arange(9.0) + 0.25), tf.constant(-np.arange(9.0) - 0.5)
    want = np.concatenate([np.arange(3.0) + 0.25, -np.arange(3.0, 6.0) - 0.5, np.arange(6.0, 8.0) + 0.25, [-8.5]])
    for _ in range(2):
        assert np.array_equal(tf.function(lambda: F.keep_rows(groups, bad, old, new), autograph=False)(), want)
        assert np.array_equal(F.keep_rows(groups, bad, old, new), want)
