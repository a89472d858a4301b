"""``Compression``'s entries are factories: every optimizer gets its own compressor state."""

import numpy as np
import pytest

from hvd_compress import FP16, Compression, NoneCompressor, TopK
from hvd_compress.algorithms import as_compressor
from hvd_compress.simulator import Simulator


@pytest.mark.parametrize("factory, cls", [(Compression.none, NoneCompressor), (Compression.fp16, FP16)])
def test_dense_factories_make_a_new_compressor_each_call(factory, cls):
    first, second = factory(), factory()
    assert type(first) is cls and type(second) is cls
    assert first is not second and first.stats is not second.stats


@pytest.mark.parametrize("value", [Compression.none, Compression.fp16, NoneCompressor, Compression.terngrad])
def test_uncalled_factories_and_classes_become_fresh_compressors(value):
    made = as_compressor(value)
    assert made is not as_compressor(value)
    assert made.stats.bytes_sent == 0


def test_uncalled_fp16_runs_horovods_protocol_without_shared_state():
    torch = pytest.importorskip("torch")
    grad = torch.tensor([1.0, 2.5, -3.0])
    wire, ctx = Compression.fp16.compress(grad)
    assert wire.dtype == torch.float16
    back = Compression.fp16.decompress(wire, ctx)
    assert back.dtype == torch.float32 and torch.equal(back, grad)


def test_uncalled_factory_in_the_simulator_equals_the_instance():
    grads = {"w": [np.arange(6, dtype=np.float32) + r for r in range(2)]}
    uncalled = Simulator(2, Compression.fp16).step(grads)["w"]
    called = Simulator(2, Compression.fp16()).step(grads)["w"]
    np.testing.assert_array_equal(uncalled, called)


def test_a_class_that_needs_arguments_says_so():
    with pytest.raises(TypeError, match=r"TopK\(0.01\)"):
        as_compressor(TopK)
    with pytest.raises(TypeError, match="hvd_compress compressor"):
        as_compressor("topk")


def test_compressor_keyword_is_the_old_name_of_compression():
    from hvd_compress.algorithms import old_keyword

    made = TopK(0.1)
    assert old_keyword(made, None, "f") is made
    with pytest.warns(DeprecationWarning, match=r"f\(compression=...\)"):
        assert old_keyword(None, made, "f") is made
    with pytest.raises(TypeError, match="both compression= and compressor="):
        old_keyword(made, made, "f")
