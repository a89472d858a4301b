"""The host buffer pool (``torch_ops.HostBuffers``): a buffer is handed out again only once nothing else
holds it (a tensor made from it or a view of it counts), at most ``per_size`` are kept per byte size and
``budget`` bytes in all, small requests are plain arrays."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvd_compress.kernels.torch_ops import HostBuffers  # noqa: E402

MiB = 1 << 20


def test_a_buffer_comes_back_only_once_nothing_holds_it():
    pool = HostBuffers(smallest=MiB, per_size=4, budget=64 * MiB)
    first = pool.take(MiB // 4, np.float32)
    address = first.__array_interface__["data"][0]
    held = torch.from_numpy(first)[10:20]  # a view of a tensor made from it
    del first
    second = pool.take(MiB // 4, np.float32)
    assert second.__array_interface__["data"][0] != address  # still held by the view
    del held
    third = pool.take(MiB // 4, np.float32)
    assert third.__array_interface__["data"][0] == address
    other = second.__array_interface__["data"][0]
    del second
    same_bytes = pool.take(MiB // 8, np.float64)  # another dtype of the same byte size: the free buffer
    assert same_bytes.__array_interface__["data"][0] == other and third.__array_interface__["data"][0] == address
    assert same_bytes.dtype == np.float64 and same_bytes.shape == (MiB // 8,)


def test_the_pool_keeps_at_most_per_size_buffers_of_a_size_and_budget_bytes():
    pool = HostBuffers(smallest=MiB, per_size=3, budget=64 * MiB)
    busy = [pool.take(MiB, np.uint8) for _ in range(5)]  # all held: two beyond the cap are plain arrays
    assert len(pool.kept[MiB]) == 3 and pool.held == 3 * MiB
    kept = {b.__array_interface__["data"][0] for b in pool.kept[MiB]}
    assert {b.__array_interface__["data"][0] for b in busy[:3]} == kept
    del busy
    again = [pool.take(MiB, np.uint8) for _ in range(3)]
    assert {b.__array_interface__["data"][0] for b in again} == kept
    small_budget = HostBuffers(smallest=MiB, per_size=8, budget=2 * MiB)
    held = [small_budget.take(MiB, np.uint8) for _ in range(3)]
    assert small_budget.held == 2 * MiB and len(small_budget.kept[MiB]) == 2 and len(held) == 3


def test_small_requests_are_plain_arrays_never_kept():
    pool = HostBuffers(smallest=MiB, per_size=4, budget=64 * MiB)
    small = pool.take(1000, np.float32)
    assert small.shape == (1000,) and small.dtype == np.float32
    assert pool.kept == {} and pool.held == 0


def test_the_default_keeps_a_bucket_state_and_a_step_of_buffers_of_one_size():
    """A bucket's residual, velocity and an aggregate rule's rates and ages stay held for good; a step's own
    buffers of the same size still come from the pool (16 per size by default)."""
    pool = HostBuffers()
    state = [pool.take(MiB, np.float32) for _ in range(6)]
    addresses = set()
    for _ in range(3):  # three steps of eight temporaries each
        step = [pool.take(MiB, np.float32) for _ in range(8)]
        addresses |= {b.__array_interface__["data"][0] for b in step}
        del step
    assert len(addresses) == 8 and len(state) == 6 and pool.held == 14 * 4 * MiB
