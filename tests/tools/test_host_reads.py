"""``benchmarks.host_reads.count_host_reads``: every kind of read counted, originals restored."""

import operator
import threading

import pytest

torch = pytest.importorskip("torch")

from benchmarks.host_reads import METHODS, count_host_reads  # noqa: E402

READS = {
    "item": lambda t: t.item(),
    "tolist": lambda t: t.tolist(),
    "__bool__": lambda t: bool(t),
    "__int__": lambda t: int(t),
    "__float__": lambda t: float(t),
    "__index__": lambda t: operator.index(t),
    "numpy": lambda t: t.numpy(),
}


@pytest.mark.parametrize("kind", sorted(READS))
def test_counts_each_kind_of_read(kind):
    t = torch.tensor(3)
    with count_host_reads() as reads:
        READS[kind](t)
        READS[kind](t)
    assert reads.count == 2
    assert reads.by_kind == {kind: 2}
    ((site, n),) = reads.sites.items()
    assert site.startswith(__file__ + ":") and n == 2  # the caller outside torch: this file


def test_index_through_python_indexing_and_format_count_once():
    t = torch.tensor(1)
    with count_host_reads() as reads:
        assert [10, 20, 30][t] == 20  # __index__
        assert f"{t}" == "1"  # Tensor.__format__ calls item(): counted once, as item
    assert reads.by_kind == {"__index__": 1, "item": 1}


def test_cpu_counts_only_device_tensors():
    t = torch.ones(3)
    with count_host_reads() as reads:
        t.cpu()
        t.sum().cpu()
    assert reads.count == 0 and reads.by_kind == {}
    if torch.cuda.is_available():
        with count_host_reads() as reads:
            torch.ones(2, device="cuda").cpu()
        assert reads.by_kind == {"cpu": 1}


def test_originals_restored_and_no_counting_outside():
    before = {name: torch.Tensor.__dict__.get(name) for name in METHODS}
    getters = {name: getattr(torch.Tensor, name) for name in METHODS}
    t = torch.tensor([1.0, 2.0])
    with count_host_reads() as reads:
        t.sum().item()
        assert all(getattr(torch.Tensor, name) is not getters[name] for name in METHODS)
    assert {name: torch.Tensor.__dict__.get(name) for name in METHODS} == before
    assert all(getattr(torch.Tensor, name) is getters[name] for name in METHODS)
    t.sum().item(), t.tolist(), bool(t[0]), t.numpy()  # after the block: not counted
    assert reads.count == 1 and reads.by_kind == {"item": 1}


def test_restored_after_an_exception():
    getters = {name: getattr(torch.Tensor, name) for name in METHODS}
    with pytest.raises(RuntimeError, match="boom"):
        with count_host_reads():
            raise RuntimeError("boom")
    assert all(getattr(torch.Tensor, name) is getters[name] for name in METHODS)


def test_counts_reads_on_other_threads_and_from_autograd():
    t = torch.tensor(2.0)
    with count_host_reads() as reads:
        threads = [threading.Thread(target=lambda: [t.item() for _ in range(100)]) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        w = torch.ones(3, requires_grad=True)
        w.register_hook(lambda g: g * float(g.sum()))  # a read inside backward
        (w * 2).sum().backward()
    assert reads.by_kind == {"item": 400, "__float__": 1}
    assert reads.count == 401


TF_READS = {
    "numpy": lambda t: t.numpy(),
    "__bool__": lambda t: bool(t),
    "__int__": lambda t: int(t),
    "__float__": lambda t: float(t),
    "__index__": lambda t: operator.index(t),
}


@pytest.mark.parametrize("kind", sorted(TF_READS))
def test_tensorflow_reads_are_counted_and_originals_restored(kind):
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.framework.ops import EagerTensor

    from benchmarks.host_reads import TF_METHODS

    getters = {name: getattr(EagerTensor, name) for name in TF_METHODS}
    t = tf.constant(3)
    with count_host_reads("tensorflow") as reads:
        TF_READS[kind](t)
        tf.constant([1.0, 2.0]) * 2  # an op: no read
    assert reads.by_kind == {kind: 1}
    assert all(getattr(EagerTensor, name) is getters[name] for name in TF_METHODS)
