"""Horovod's ``compression=`` interface: the public compressors carry it, the algorithms do not, and the
wrapper gives it to any compressor."""

import pytest

import hvd_compress
from hvd_compress import FP16, Auto, Compression, HorovodCompression, HorovodInterface, TopK
from hvd_compress.algorithms import registry
from hvd_compress.algorithms.base import Compressor
from hvd_compress.algorithms.sparse import LargestScores, Sparsifier

PUBLIC = ("NoneCompressor", "FP16", "TopK", "GaussianK", "RegTopK", "TernGrad")


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_compressor_is_its_algorithm_with_horovods_interface(name):
    public, algorithm = getattr(hvd_compress, name), getattr(hvd_compress.algorithms, name)
    assert issubclass(public, HorovodInterface) and issubclass(public, algorithm) and public is not algorithm
    assert not hasattr(algorithm, "compress") and not hasattr(Compressor, "decompress")  # no glue below
    assert public.__name__ == algorithm.__name__ and public.__doc__ == algorithm.__doc__  # config type, header


def test_the_name_table_makes_the_public_classes():
    for name in ("topk", "gaussiank", "regtopk", "terngrad"):
        assert registry.factory(name) is getattr(hvd_compress, registry.factory(name).__name__)
    assert type(Compression.by_name("regtopk", 0.1)) is hvd_compress.RegTopK
    assert type(Compression.topk(0.1)) is TopK and type(Compression.fp16()) is FP16
    assert isinstance(Compression.fp16._for_horovod(), HorovodInterface)
    assert isinstance(Auto(TopK(0.1)), HorovodInterface)


def test_the_wrapper_makes_a_compressor_of_a_factory_and_keeps_an_instance():
    topk = TopK(0.01)
    assert HorovodCompression(topk).compressor is topk
    made = HorovodCompression(Compression.fp16).compressor
    assert type(made) is FP16 and made is not HorovodCompression(Compression.fp16).compressor
    assert repr(HorovodCompression(topk)) == f"HorovodCompression({topk!r})"


def test_wrapper_and_compressor_send_the_same():
    torch = pytest.importorskip("torch")
    grad = torch.tensor([1.0, 2.5, -3.0])
    direct, wrapped = FP16(), HorovodCompression(hvd_compress.algorithms.FP16())
    (sent, ctx), (sent_wrapped, ctx_wrapped) = direct.compress(grad), wrapped.compress(grad)
    assert sent.dtype == sent_wrapped.dtype
    assert torch.equal(direct.decompress(sent, ctx), wrapped.decompress(sent_wrapped, ctx_wrapped))


def test_a_compressor_of_your_own_takes_the_interface_by_deriving_from_it():
    class Mine(HorovodInterface, LargestScores, Sparsifier):
        pass

    mine = Mine(0.1)
    assert mine.compress.__func__ is HorovodInterface.compress and isinstance(mine, Compressor)
