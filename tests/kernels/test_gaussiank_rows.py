"""Gaussian-k of the rows of a 2-D torch tensor (the fused path's selection) against the reference.

:func:`~hvd_compress.kernels.torch_ops.gaussiank_rows` runs the threshold correction of
every row at once on the device. Row by row it must select what ``reference.gaussiank_select``
selects from the same first threshold (the moments are reductions, equal within rounding
only: the reference is handed the kernel's threshold), never more than
``reference.gaussiank_slots(k)`` entries, with unused slots holding ``n``. Both ways of
trimming an overshooting row run on every device: read back (CPU) and computed for every
row (accelerators).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import strategies as st

from hvd_compress.kernels import reference as R
from tests.kernels.frameworks import FLOATS
from tests.kernels.frameworks import given_per_framework as given

pytestmark = pytest.mark.parametrize("K", ["torch-cpu", "torch-cuda"], indirect=True)


@st.composite
def gradient_rows(draw, dtype):
    """``(rows, n)`` gradients: normal, heavy-tailed, tie-heavy (small multiples of 0.5) or constant."""
    rows, n = draw(st.integers(1, 5)), draw(st.integers(1, 2000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "cauchy", "ties", "constant"]))
    if kind == "normal":
        a = rng.standard_normal((rows, n)) * draw(st.sampled_from([1e-3, 1.0, 50.0]))
    elif kind == "cauchy":
        a = np.clip(rng.standard_cauchy((rows, n)), -1e3, 1e3)
    elif kind == "ties":
        a = np.round(rng.standard_normal((rows, n)) * 2) / 2
    else:
        a = np.full((rows, n), draw(st.sampled_from([0.0, 1.0, -3.5])))
    return a.astype(dtype)


@pytest.mark.parametrize("read_back", [True, False], ids=["read-back", "every-row"])
@pytest.mark.parametrize("dtype", FLOATS)
@given("some", data=st.data(), ratio=st.sampled_from([0.001, 0.01, 0.05, 0.3, 0.9]))
def test_gaussiank_rows_follow_the_reference_row_by_row(K, dtype, read_back, data, ratio):
    a = data.draw(gradient_rows(dtype), label="a")
    rows, n = a.shape
    k = R.num_selected(n, ratio)
    tensor = K.tensor(a)
    got = K.numpy(K.ops.gaussiank_rows(tensor, tensor.abs(), ratio, k, read_back=read_back))
    slots = R.gaussiank_slots(k)
    assert got.dtype == np.int64 and got.shape == (rows, slots)
    thresholds = K.numpy(K.ops.gaussiank_thresholds(tensor, ratio))
    for row, chosen, threshold in zip(a, got, thresholds):
        used = chosen[chosen < n]
        assert np.all(chosen[used.shape[0]:] == n), "unused slots come last and hold n"
        with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: float(threshold)):
            want = R.gaussiank_select(row, ratio)
        np.testing.assert_array_equal(used, want)


@given("few", k=st.integers(1, 10**6))
def test_gaussiank_never_selects_more_than_its_slots(K, k):
    """The bound the fused path's fixed payload rests on: every way out of the correction loop."""
    assert k <= R.gaussiank_slots(k) <= R.GAUSSIANK_HIGH * k
    assert R.GAUSSIANK_LOW * k < R.gaussiank_slots(k) + 1
