"""Top-k of the rows of a 2-D torch tensor (the fused path's selection) against the reference.

:func:`~hvd_compress.kernels.torch_ops.topk_rows_exact` serves float64 off the CPU, where
the float32 keys of ``topk_rows_keyed`` cannot hold the scores; it runs on every device and
is checked on CPU too: row by row equal to ``reference.topk_indices`` (ties to the lower
index, +Inf included), and exactly ``k`` distinct in-range indices per row when there is NaN.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from hvd_compress.kernels import reference as R
from hvd_compress.kernels import torch_ops
from tests.kernels.frameworks import FLOATS_32_64
from tests.kernels.frameworks import given_per_framework as given

pytestmark = pytest.mark.parametrize("K", ["torch-cpu", "torch-cuda"], indirect=True)


@st.composite
def score_rows(draw, dtype, specials=()):
    """``(rows, n)`` scores, signed: normal, or small integers (many ties), some entries ``specials``."""
    rows, n = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        a = rng.integers(-2, draw(st.integers(-1, 4)), (rows, n)).astype(dtype)
    else:
        a = rng.standard_normal((rows, n)).astype(dtype)
    if specials:
        special = rng.random((rows, n)) < draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
        a[special] = rng.choice(specials, special.sum())
    k = draw(st.sampled_from([1, n, draw(st.integers(1, n))]))
    return a, k


def check_in_range(got: np.ndarray, rows: int, n: int, k: int) -> None:
    assert got.dtype == np.int64 and got.shape == (rows, k)
    assert ((got >= 0) & (got < n)).all()
    assert all(np.unique(row).shape[0] == k for row in got)


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@given("some", data=st.data())
def test_exact_topk_rows_equal_reference(K, dtype, data):
    a, k = data.draw(score_rows(dtype, specials=(np.inf, -np.inf)), label="scores, k")
    got = K.numpy(K.ops.topk_rows_exact(K.tensor(a), k))
    check_in_range(got, *a.shape, k)
    for row, chosen in zip(a, got):
        np.testing.assert_array_equal(chosen, R.topk_indices(row, k))


@pytest.mark.parametrize("dtype", FLOATS_32_64)
@given("some", data=st.data())
def test_exact_topk_rows_with_nan_take_k_distinct_indices(K, dtype, data):
    a, k = data.draw(score_rows(dtype, specials=(np.nan, np.inf)), label="scores, k")
    check_in_range(K.numpy(K.ops.topk_rows_exact(K.tensor(a), k)), *a.shape, k)


@given("some", data=st.data())
def test_exact_topk_rows_equal_keyed_rows_with_nan_and_inf(K, data):
    """On non-negative float32 scores both rank NaN above +Inf, ties to the lower index."""
    a, k = data.draw(score_rows(np.float32, specials=(np.nan, np.inf)), label="scores, k")
    scores = K.tensor(np.abs(a))
    np.testing.assert_array_equal(
        K.numpy(K.ops.topk_rows_exact(scores, k)), K.numpy(K.ops.topk_rows_keyed(scores, k))
    )


def test_topk_rows_of_float64_on_cuda_is_exact(K, monkeypatch):
    """Off the CPU float64 goes to ``topk_rows_exact``, the float32 and narrower dtypes to the keys;
    on CUDA for real, here also through a stand-in for a CUDA tensor (``topk_rows`` reads its
    device and dtype only)."""
    a = np.random.default_rng(0).integers(0, 4, (3, 50)).astype(np.float64)
    a[:, 7] = 3 - 2.0**-40  # below the 3s; float32 rounds it to 3, a tie taken first
    scores = K.tensor(a)
    expected = np.stack([R.topk_indices(row, 9) for row in a])
    np.testing.assert_array_equal(K.numpy(K.ops.topk_rows(scores, 9)), expected)

    calls = []
    monkeypatch.setattr(torch_ops, "topk_rows_exact", lambda s, k: calls.append(("exact", s.dtype)))
    monkeypatch.setattr(torch_ops, "topk_rows_keyed", lambda s, k: calls.append(("keyed", s.dtype)))
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        torch_ops.topk_rows(SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype), 9)
    assert calls == [("exact", torch.float64)] + [("keyed", d) for d in (torch.float32, torch.float16, torch.bfloat16)]
