"""Horovod's ``compression=`` wrapper, and a compressor passed to Horovod directly running through it."""

import sys

import pytest

from hvd_compress import FP16, Compression, HorovodCompression, TopK
from hvd_compress.compressors.base import HOROVOD_INTERFACE, horovod_interface


def test_the_wrapper_makes_a_compressor_of_a_factory_and_keeps_an_instance():
    topk = TopK(0.01)
    assert HorovodCompression(topk).compressor is topk
    made = HorovodCompression(Compression.fp16).compressor
    assert type(made) is FP16 and made is not HorovodCompression(Compression.fp16).compressor
    assert repr(HorovodCompression(topk)) == f"HorovodCompression({topk!r})"


def test_a_compressor_passed_directly_runs_the_wrapper():
    fp16 = FP16()
    wrapper = horovod_interface(fp16)
    assert isinstance(wrapper, HorovodCompression) and wrapper.compressor is fp16


def test_wrapper_and_compressor_send_the_same():
    torch = pytest.importorskip("torch")
    grad = torch.tensor([1.0, 2.5, -3.0])
    direct, wrapped = FP16(), HorovodCompression(FP16())
    (sent, ctx), (sent_wrapped, ctx_wrapped) = direct.compress(grad), wrapped.compress(grad)
    assert sent.dtype == sent_wrapped.dtype
    assert torch.equal(direct.decompress(sent, ctx), wrapped.decompress(sent_wrapped, ctx_wrapped))


def test_without_the_package_a_compressor_says_what_to_import(monkeypatch):
    monkeypatch.delitem(sys.modules, HOROVOD_INTERFACE)
    with pytest.raises(RuntimeError, match="import hvd_compress"):
        TopK(0.01).compress(object())
