"""Top-k of the rows of a flat buffer (the fused path's selection, :class:`torch_rows.Rows`) against the reference.

Both ways run on every device: the host's (each row through ``topk_indices``) and the
accelerator's (``torch.topk`` of the scores' bits, then the lowest-indexed ties found by one
scan), the latter forced with ``host=False`` and under ``accelerator_path()``. Row by row the
selection must be ``reference.topk_indices`` (ties to the lower index), for float16, bfloat16,
float32 and float64 scores, +Inf included; with NaN (which ranks above +Inf) exactly ``k``
distinct in-range indices, NaN entries first.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import strategies as st  # noqa: E402

from hvd_compress.kernels import reference as R  # noqa: E402
from hvd_compress.kernels import torch_ops  # noqa: E402
from hvd_compress.kernels.torch_rows import Rows  # noqa: E402
from tests.kernels.frameworks import given_per_framework as given  # noqa: E402

pytestmark = pytest.mark.parametrize("K", ["torch-cpu", "torch-cuda"], indirect=True)
WAYS = {"host": True, "accelerator": False}
DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}


def topk_rows(scores, k, host=None):
    """:func:`torch_ops.topk_indices` of every row of a 2-D ``scores`` (``k <= columns``): int64
    ``(rows, k)``, ascending, ties to the lower index, NaN above +Inf (see :meth:`Rows.topk`)."""
    rows, n = scores.shape
    plan = Rows([(0, rows, n, k, k)], scores.device)
    positions = plan.topk(scores.reshape(-1), host)[0].view(rows, k)
    return torch.sort(positions - plan.slot_start.view(rows, k), dim=1).values


@st.composite
def score_rows(draw, dtype, specials=()):
    """``(rows, n)`` non-negative scores: |normal|, or small integers (many ties), some ``specials``."""
    rows, n = draw(st.integers(1, 6)), draw(st.integers(1, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        a = rng.integers(0, draw(st.integers(1, 5)), (rows, n)).astype(dtype)
    else:
        a = np.abs(rng.standard_normal((rows, n))).astype(dtype)
    if specials:
        special = rng.random((rows, n)) < draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
        a[special] = rng.choice(specials, special.sum())
    k = draw(st.sampled_from([1, n, draw(st.integers(1, n))]))
    return a, k


def expected(a: np.ndarray, k: int) -> np.ndarray:
    """The reference row by row, NaN ranked above +Inf (the reference itself never sees NaN)."""
    key = np.where(np.isnan(a), 1e301, np.where(np.isinf(a), 1e300, a.astype(np.float64)))
    return np.stack([R.topk_indices(row, k) for row in key])


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype", DTYPES)
@given("some", data=st.data())
def test_topk_rows_equal_reference(K, dtype, way, data):
    a, k = data.draw(score_rows(DTYPES[dtype], specials=(np.inf,)), label="scores, k")
    got = K.numpy(topk_rows(K.tensor(a), k, host=WAYS[way]))
    assert got.dtype == np.int64 and got.shape == (a.shape[0], k)
    for row, chosen in zip(a, got):
        np.testing.assert_array_equal(chosen, R.topk_indices(row, k))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype", DTYPES)
@given("some", data=st.data())
def test_topk_rows_rank_nan_above_inf(K, dtype, way, data):
    a, k = data.draw(score_rows(DTYPES[dtype], specials=(np.nan, np.inf)), label="scores, k")
    got = K.numpy(topk_rows(K.tensor(a), k, host=WAYS[way]))
    np.testing.assert_array_equal(got, expected(a, k))


@given("some", data=st.data())
def test_bfloat16_scores_equal_their_float32_values(K, data):
    """bfloat16 has no numpy dtype: its values are exact in float32, whose selection is the reference's."""
    a, k = data.draw(score_rows(np.float32, specials=(np.inf,)), label="scores, k")
    scores = K.tensor(a).to(torch.bfloat16)
    for host in WAYS.values():
        np.testing.assert_array_equal(
            K.numpy(topk_rows(scores, k, host=host)), K.numpy(topk_rows(scores.float(), k, host=host))
        )


def test_ties_at_the_kth_value_take_the_lowest_indices(K):
    """Every kind of tie the scan resolves: a few ties among the candidates, ties far beyond them
    (all zeros), a tie group spanning rows of two groups, and float64 values float32 would merge."""
    zeros = np.zeros((2, 50))
    zeros[1, [7, 30]] = 1.0
    spread = np.tile(np.repeat([3.0, 2.0, 1.0], [4, 40, 6]), (3, 1))[:, np.random.default_rng(1).permutation(50)]
    close = np.full((1, 50), 3.0)
    close[0, ::3] = 3.0 - 2.0**-40  # below 3: float32 would round it to 3 and tie it
    for a, k in ((zeros, 5), (spread, 10), (close, 20), (zeros, 50)):
        for host in WAYS.values():
            got = K.numpy(topk_rows(K.tensor(a), k, host=host))
            np.testing.assert_array_equal(got, np.stack([R.topk_indices(row, k) for row in a]))


def test_groups_of_a_bucket_select_as_their_rows_alone(K):
    """Several groups in one buffer (rows of different lengths and k), under ``accelerator_path``:
    each row's positions are its own top-k, offset by where it starts."""
    rng = np.random.default_rng(2)
    layout = [(0, 3, 40, 4), (120, 2, 100, 30), (320, 1, 7, 7), (400, 4, 64, 1)]
    flat = np.round(np.abs(rng.standard_normal(656)) * 4) / 4  # ties everywhere
    rows = Rows([(start, count, n, k, k) for start, count, n, k in layout], K.tensor(flat).device)
    with torch_ops.accelerator_path():
        positions, top = rows.topk(K.tensor(flat))
    positions = K.numpy(positions)
    slot = 0
    for start, count, n, k in layout:
        for i in range(count):
            row = flat[start + i * n : start + (i + 1) * n]
            got = np.sort(positions[slot : slot + k]) - (start + i * n)
            np.testing.assert_array_equal(got, R.topk_indices(row, k))
            slot += k
    np.testing.assert_array_equal(
        K.numpy(top), [flat[s + i * n : s + (i + 1) * n].max() for s, c, n, _ in layout for i in range(c)]
    )
