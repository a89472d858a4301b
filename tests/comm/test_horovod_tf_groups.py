"""The stock ``horovod.tensorflow`` hooks exchange each Horovod group at once (in one process).

Horovod with ``groups=`` (and ``hvd.grouped_allreduce``) calls ``compress`` for every gradient
of a group, allreduces the placeholders, then calls ``decompress`` for each; without, it runs
compress, allreduce and decompress gradient by gradient. Here the hooks are driven in both
patterns, on a world of one rank, placeholders standing in for Horovod's reduction of them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.distributed.launch import require

require("tensorflow")

import tensorflow as tf  # noqa: E402

from hvd_compress import Compression  # noqa: E402
from hvd_compress.horovod import tensorflow_hooks as horovod_tf  # noqa: E402
from hvd_compress.transport.communicator import SingleProcessCommunicator  # noqa: E402

#: a matrix, a bias (under dense_below: Horovod's own allreduce), a float16 matrix
SHAPES = [((64, 32), np.float32), ((10,), np.float32), ((48, 32), np.float16)]


@pytest.fixture
def exchanges(monkeypatch):
    """The names of every exchange the hooks run, in order (on a one-rank communicator)."""
    comm, runs = SingleProcessCommunicator(), []
    real = horovod_tf.exchange

    def counted(compressor, communicator, key, named, *args, **kwargs):
        runs.append([name for name, _ in named])
        return real(compressor, communicator, key, named, *args, **kwargs)

    monkeypatch.setattr(horovod_tf, "_communicator", lambda: comm)
    monkeypatch.setattr(horovod_tf, "exchange", counted)
    return runs


def gradients(step):
    rng = np.random.default_rng(step)
    return [tf.constant(rng.standard_normal(shape).astype(dtype)) for shape, dtype in SHAPES]


def grouped(compressor, tensors):
    """Horovod's ``groups=`` pattern; the group decompressed last first."""
    sent = [horovod_tf.compress(compressor, t) for t in tensors]
    out = [horovod_tf.decompress(compressor, placeholder, ctx) for placeholder, ctx in reversed(sent)]
    return out[::-1]


def one_by_one(compressor, tensors):
    """Horovod without ``groups=``: each gradient compressed and decompressed in turn."""
    return [horovod_tf.decompress(compressor, *horovod_tf.compress(compressor, t)) for t in tensors]


def test_a_group_is_one_exchange_equal_to_exchanging_each_alone(exchanges):
    """In a ``tf.function``: the group's compressed tensors in one exchange per step, the results
    and the residuals they leave those of one exchange per tensor, bit for bit, step after step."""
    together, alone = Compression.topk(0.05), Compression.topk(0.05)
    steps = [tf.function(lambda *ts, c=c, run=run: run(c, list(ts))) for c, run in
             ((together, grouped), (alone, one_by_one))]
    for step in range(3):
        exchanges.clear()
        first, second = (run(*gradients(step)) for run in steps)
        assert [len(names) for names in exchanges] == [2, 1, 1], exchanges  # the bias: Horovod's own
        for a, b, (shape, dtype) in zip(first, second, SHAPES):
            assert a.shape == shape and a.dtype == dtype
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_failed_exchange_leaves_nothing_pending(exchanges):
    """Eagerly: an integer gradient fails its group's exchange with a clear error; the next group
    exchanges only its own tensors."""
    compressor = Compression.topk(0.05)
    with warnings.catch_warnings():  # called without name=: named by call order, with a warning once
        warnings.simplefilter("ignore")
        sent = [horovod_tf.compress(compressor, t) for t in (gradients(0)[0], tf.range(2048))]
    with pytest.raises(TypeError, match="floating point"):
        horovod_tf.decompress(compressor, *sent[0])
    (result,) = grouped(compressor, gradients(1)[:1])
    assert exchanges == [["call.1", "call.2"], ["call.1"]]
    assert result.shape == SHAPES[0][0]


def test_one_gradient_groups_warn_once_naming_groups_1(exchanges, monkeypatch):
    """Horovod without ``groups=`` makes each compressed gradient an exchange of its own: a traced step
    with two such groups warns, once per process; a step traced with ``groups=`` does not."""
    monkeypatch.setattr(horovod_tf, "_warned_groups", [])
    compressor = Compression.topk(0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tf.function(lambda *ts: grouped(compressor, list(ts)))(*gradients(0))
        assert not [w for w in caught if "groups=1" in str(w.message)]
        for step in range(2):  # a new trace each time: the second one does not warn again
            tf.function(lambda *ts: one_by_one(Compression.topk(0.05), list(ts)))(*gradients(step))
    said = [str(w.message) for w in caught if "groups=1" in str(w.message)]
    assert len(said) == 1, said
    assert "one gradient per group" in said[0] and "DistributedGradientTape" in said[0]
    assert [len(names) for names in exchanges] == [2, 1, 1, 1, 1]
