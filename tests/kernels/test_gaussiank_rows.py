"""Gaussian-k of the rows of a flat buffer (the fused path's selection, :class:`torch_rows.Rows`) against the reference.

On an accelerator :meth:`~hvd_compress.kernels.torch_rows.Rows.gaussiank` counts every
threshold the correction can meet in one pass and applies the rule to the counts. Row by
row it must select what ``reference.gaussiank_from`` (from ``reference.gaussiank_threshold``) selects from the same first threshold
(the moments are reductions, equal within rounding only: the reference is handed the
kernel's threshold), never more than ``reference.gaussiank_slots(k)`` entries, with unused
slots holding ``n``. Both ways run on every device: read back (the CPU's, row by row) and
the accelerator's.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import strategies as st  # noqa: E402

from hvd_compress.kernels import reference as R  # noqa: E402
from hvd_compress.kernels import torch_ops  # noqa: E402
from hvd_compress.kernels.torch_rows import Rows, _OUTCOMES  # noqa: E402
from tests.helpers import reference_gaussiank, sampled_in_range_but_over_the_slots  # noqa: E402
from tests.kernels.frameworks import FLOATS  # noqa: E402
from tests.kernels.frameworks import given_per_framework as given  # noqa: E402

pytestmark = pytest.mark.parametrize("K", ["torch-cpu", "torch-cuda"], indirect=True)


def gaussiank_rows(a, ratio, k, read_back=None):
    """:func:`torch_ops.gaussiank_select` of every row of a 2-D ``a``, in
    ``gaussiank_slots(k)`` columns: int64 ``(rows, slots)``, ascending, unused slots holding ``n``."""
    rows, n = a.shape
    slots = R.gaussiank_slots(k)
    plan = Rows([(0, rows, n, k, slots)], a.device, spare=rows * n)
    positions = plan.gaussiank(a.reshape(-1), ratio, read_back)[0].view(rows, slots)
    return torch.where(positions == rows * n, n, positions - plan.slot_start.view(rows, slots))


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
    got = K.numpy(gaussiank_rows(tensor, ratio, k, read_back=read_back))
    slots = R.gaussiank_slots(k)
    assert got.dtype == np.int64 and got.shape == (rows, slots)
    thresholds = K.numpy(K.ops.gaussiank_thresholds(tensor, ratio))
    for row, chosen, threshold in zip(a, got, thresholds):
        used = chosen[chosen < n]
        assert np.all(chosen[used.shape[0]:] == n), "unused slots come last and hold n"
        with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: float(threshold)):
            want = reference_gaussiank(row, ratio)
        np.testing.assert_array_equal(used, want)


@given("few", k=st.integers(1, 10**6))
def test_gaussiank_never_selects_more_than_its_slots(K, k):
    """The bound the fused path's fixed payload rests on: every way out of the correction loop."""
    assert k <= R.gaussiank_slots(k) <= R.GAUSSIANK_HIGH * k
    assert R.GAUSSIANK_LOW * k < R.gaussiank_slots(k) + 1


def test_the_outcome_table_is_the_reference_rule(K):
    """Spot checks of the table the accelerator's way applies to its counts (0 below 2k/3,
    1 in range, 2 above 4k/3, per threshold ``first * GAUSSIANK_FACTORS[i]``)."""
    def code(**levels):  # levels by factor
        return sum(levels.get(f"f{i}", 0) * 3**i for i in range(6))

    settle_first = code(f3=1)
    assert _OUTCOMES[settle_first] == 3  # in range at once
    assert _OUTCOMES[code(f3=0, f1=1)] == 1  # below, halved, in range
    assert _OUTCOMES[code(f3=2, f4=2, f5=1)] == 5  # above twice, then in range at 2.25 first
    assert _OUTCOMES[code(f3=0, f1=2, f2=0)] == 1 + 6  # 12 -> 398 -> 102: the set at 0.5 first, cut
    assert _OUTCOMES[code(f3=2, f4=0, f2=2)] == 3 + 6  # above, below, above: the smaller superset (first), cut
    assert _OUTCOMES[code(f3=0, f1=0, f0=0)] == 0  # below every time: the last threshold


@pytest.mark.parametrize("dtype", FLOATS)
def test_rows_of_several_groups_cut_an_overshooting_superset_to_its_first_k(K, dtype):
    """The reference docstring's 12 -> 398 -> 102 case (first threshold 3.1 on 2000 normal
    entries, k = 20) in a bucket of two groups, on the accelerator's way: the cut rows' slots
    hold the first k of their set at threshold / 2, in index order; every row as the reference."""
    rng = np.random.default_rng(0)
    layout = [(0, 2, 2000, 20), (4000, 3, 300, 3)]
    flat = rng.standard_normal(4900).astype(dtype)
    ratio = 0.01
    tensor = K.tensor(flat)
    rows = Rows([(s, c, n, k, R.gaussiank_slots(k)) for s, c, n, k in layout], tensor.device, spare=4900)
    first = torch.tensor([3.1, 3.1, 2.0, 2.6, 5.0], dtype=torch.float64, device=tensor.device)
    thresholds = rows.thresholds
    rows.thresholds = lambda a, r: (first, thresholds(a, r)[1])
    with torch_ops.accelerator_path():
        positions = K.numpy(rows.gaussiank(tensor, ratio)[0])
    slot = row = 0
    for start, count, n, k in layout:
        for i in range(count):
            a = flat[start + i * n : start + (i + 1) * n]
            with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: float(first[row])):
                want = reference_gaussiank(a, ratio)
            if row < 2:
                counts = [int(np.sum(np.abs(a) > a.dtype.type(3.1 * f))) for f in (1.0, 0.5, 0.75)]
                assert counts[0] < 2 * k / 3 and min(counts[1:]) > 4 * k / 3, counts  # the cut is taken
                assert want.shape[0] == k
            mine = positions[slot : slot + R.gaussiank_slots(k)]
            np.testing.assert_array_equal(mine[mine < 4900] - (start + i * n), want)
            slot, row = slot + R.gaussiank_slots(k), row + 1


@pytest.mark.parametrize("read_back", [True, False], ids=["read-back", "every-row"])
def test_rows_count_every_entry_where_a_sample_would_mislead(K, read_back):
    """200 entries above 1 (100 on every 2nd entry) exceed the 170 slots: both ways grow the threshold to
    1.5 and send that set whole, next to a row of the same data halved (nothing above 1: the threshold
    halves until the count is in range); every slot past a row's set holds the spare position."""
    a = sampled_in_range_but_over_the_slots()
    n, k = a.shape[0], R.num_selected(a.shape[0], 0.01)
    flat = K.tensor(np.concatenate([a, a / 2]))
    rows = Rows([(0, 2, n, k, R.gaussiank_slots(k))], flat.device, spare=2 * n)
    first = torch.tensor([1.0, 1.0], dtype=torch.float64, device=flat.device)
    thresholds = rows.thresholds
    rows.thresholds = lambda x, r: (first, thresholds(x, r)[1])
    positions = K.numpy(rows.gaussiank(flat, 0.01, read_back)[0]).reshape(2, -1)
    for row, (values, offset) in enumerate([(a, 0), (a / 2, n)]):
        want = R.gaussiank_from(np.abs(values), 1.0, k)
        np.testing.assert_array_equal(positions[row][: want.shape[0]] - offset, want)
        assert np.all(positions[row][want.shape[0]:] == 2 * n)
    np.testing.assert_array_equal(positions[0][positions[0] < 2 * n], np.flatnonzero(np.abs(a) > 1.5))
