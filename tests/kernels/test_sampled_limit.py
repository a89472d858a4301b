"""Top-k by marking (the CPU's way on numpy and torch): the entries above a limit drawn from a strided
sample of the row, then the ``k`` largest among them, must be :func:`reference.topk_indices` exactly,
whether the limit leaves ``k`` or more entries above it or (many ties at the k-th value, k near n, a
sample that misjudges) fewer, where the row is selected whole. Rows long enough to be sampled."""

import numpy as np
import pytest

from hvd_compress.kernels import reference as R
from hvd_compress.kernels.reference_rows import Rows, sampled_limit, topk_by_marking

CASES = [(200_003, 2000, "normal"), (200_003, 150, "ties"), (65_537, 6000, "ties"), (40_000, 39_000, "normal"),
         (90_001, 900, "zeros"), (50_000, 500, "periodic")]


def row_of(n, k, kind, seed):
    """``|normal|``; with a third tied at the k-th value; mostly zeros; or a period the stride could meet."""
    rng = np.random.default_rng(seed)
    a = np.abs(rng.standard_normal(n)).astype(np.float32)
    if kind == "ties":
        a[rng.integers(0, n, n // 3)] = np.sort(a)[-k]
    elif kind == "zeros":
        a[rng.random(n) < 0.995] = 0
    elif kind == "periodic":
        a[::7] *= 50  # every 7th entry large: a sample at a multiple of 7 would see only those
    return a


@pytest.mark.parametrize("n, k, kind", CASES)
def test_topk_by_marking_equals_the_reference(n, k, kind):
    a = row_of(n, k, kind, n + k)
    np.testing.assert_array_equal(topk_by_marking(a, k), R.topk_indices(a, k))
    positions, top = Rows([(0, 1, n, k, k)]).topk(a)
    np.testing.assert_array_equal(np.sort(positions), R.topk_indices(a, k))
    assert top[0] == a.max()


def test_the_limit_leaves_a_few_k_above_it():
    """The expected count above the limit is about ``k (1 + 3 / sqrt(e))``, e the sampled entries above the
    k-th largest: at least ``k``, at most a few ``k`` (normal data, 1% and 0.1%)."""
    a = np.abs(np.random.default_rng(0).standard_normal((3, 1_000_000))).astype(np.float32)
    for k in (10_000, 1_000):
        above = np.count_nonzero(a > sampled_limit(a, k), axis=1)
        assert np.all(above >= k) and np.all(above <= 3 * k), (k, above)


def test_a_sample_larger_than_the_row_marks_every_entry():
    a = np.arange(10, dtype=np.float64)[None]
    assert sampled_limit(a, 9)[0, 0] == -np.inf
    np.testing.assert_array_equal(topk_by_marking(a[0], 9), np.arange(1, 10))


@pytest.mark.parametrize("n, k, kind", CASES)
def test_torch_cpu_rows_equal_the_reference(n, k, kind):
    torch = pytest.importorskip("torch")
    from hvd_compress.kernels.torch_rows import Rows as TorchRows

    a = np.stack([row_of(n, k, kind, n + k), row_of(n, k, kind, n + k + 1)])
    positions = TorchRows([(0, 2, n, k, k)], "cpu").topk(torch.from_numpy(a.reshape(-1)), host=True)[0].numpy()
    for i in range(2):
        np.testing.assert_array_equal(np.sort(positions[i * k : (i + 1) * k] - i * n), R.topk_indices(a[i], k))
