"""The fused path's row selections on TensorFlow against the per-tensor kernels and numpy's rows.

Every row of :class:`~hvd_compress.kernels.tf_rows.Rows` must select what
:func:`tf_ops.topk_indices` and :func:`tf_ops.gaussiank_from` select on that row alone, in its
slots (Gaussian-k: in index order in the first, the others the spare position), eagerly and
traced by ``tf.function``; and what numpy's :class:`~hvd_compress.kernels.reference_rows.Rows`
selects: Top-k bit for bit (each row's largest score too), Gaussian-k from the same first
thresholds (the moments are reductions, equal to the reference's within rounding only: numpy's
rows are handed TensorFlow's thresholds). A row holding NaN/Inf gets the reference's probe:
the same largest score, a first threshold that is not finite. bfloat16 (no numpy dtype) is
checked against the per-tensor kernels, and Top-k against its values in float32.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_compress import kernels
from hvd_compress.kernels import reference as R
from hvd_compress.kernels import reference_rows
from tests.kernels.frameworks import framework
from tests.kernels.test_reference_rows import buckets, rows_of

K = framework("tf")  # skips this module without TensorFlow (fails under HVD_COMPRESS_REQUIRE_HOROVOD=1)
tf, F = K.tf, K.ops
from hvd_compress.kernels import tf_rows  # noqa: E402  (imports TensorFlow)

TOPK_RATIOS = st.sampled_from([0.01, 0.1, 0.5, 1.0])
GAUSSIANK_RATIOS = st.sampled_from([0.01, 0.05, 0.3])


def layout(groups, ratio, slots=lambda k: k):
    """``(start, rows, n, k, width)`` of every group: ``k = num_selected(n, ratio)``, ``slots(k)`` slots."""
    return [(g.start, g.rows, g.n, R.num_selected(g.n, ratio), slots(R.num_selected(g.n, ratio))) for g in groups]


def per_row(flat, groups, ratio, select, slots=lambda k: k):
    """``select(row)`` of every row of the TF tensor ``flat`` as work positions in ``slots(k)`` slots,
    unused slots ``len(flat)``: what the rows must select."""
    out = []
    for first, row in rows_of(np.arange(flat.shape[0]), groups):
        chosen = select(flat[first : first + row.shape[0]]).numpy().astype(np.int64) + first
        width = slots(R.num_selected(row.shape[0], ratio))
        out.append(np.concatenate([chosen, np.full(width - chosen.shape[0], flat.shape[0])]))
    return np.concatenate(out)


def topk_of(ratio):
    """The per-tensor Top-k of a row, NaN ranked as +Inf."""
    def select(row):
        key = tf.where(tf.math.is_nan(row), tf.constant(np.inf, row.dtype), row)
        return F.topk_indices(key, R.num_selected(row.shape[0], ratio))
    return select


def rows_run(method, groups, *args):
    """``Rows(groups).method(*args)`` eagerly and traced, as numpy arrays (spare: past the buffer)."""
    def run(*tensors):
        return getattr(tf_rows.Rows(groups, tensors[0].device, spare=tensors[0].shape[0]), method)(*tensors)
    return {mode: tuple(x.numpy() for x in got) for mode, got in K.run(run, *args).items()}


BUCKETS = st.one_of(buckets(), buckets(specials=True))


@settings(max_examples=15, deadline=None)
@given(bucket=BUCKETS, ratio=TOPK_RATIOS)
def test_topk_rows_are_the_kernels_and_numpys(bucket, ratio):
    flat, groups = bucket
    scores = np.abs(flat)
    want_positions, want_top = reference_rows.Rows(layout(groups, ratio)).topk(scores)
    kernel = per_row(tf.constant(scores), groups, ratio, topk_of(ratio))
    for mode, (positions, top) in rows_run("topk", layout(groups, ratio), tf.constant(scores)).items():
        assert positions.dtype == np.int64 and top.dtype == scores.dtype, mode
        np.testing.assert_array_equal(positions, kernel, mode)
        np.testing.assert_array_equal(positions, want_positions, mode)
        np.testing.assert_array_equal(top, want_top, mode)  # NaN where numpy's is NaN


@settings(max_examples=15, deadline=None)
@given(bucket=BUCKETS, ratio=GAUSSIANK_RATIOS)
def test_gaussiank_rows_are_the_kernels_and_numpys(bucket, ratio):
    flat, groups = bucket
    slots = layout(groups, ratio, R.gaussiank_slots)
    a = tf.constant(flat)
    kernel = per_row(a, groups, ratio, lambda row: F.gaussiank_from(abs(row), F.gaussiank_first_threshold(row, ratio), R.num_selected(row.shape[0], ratio)), R.gaussiank_slots)
    thresholds = np.array([F.gaussiank_threshold(a[first : first + row.shape[0]], ratio)
                           for first, row in rows_of(flat, groups)])
    handed = iter(thresholds)
    with mock.patch.object(R, "gaussiank_threshold", lambda _a, _r: next(handed)), np.errstate(all="ignore"):
        want_positions, _ = reference_rows.Rows(slots, spare=flat.shape[0]).gaussiank(flat, ratio)
    with np.errstate(all="ignore"):
        _, reference_first = reference_rows.Rows(slots, spare=flat.shape[0]).gaussiank(flat, ratio)
    for mode, (positions, first) in rows_run("gaussiank", slots, a, ratio).items():
        assert positions.dtype == np.int64 and first.dtype == np.float64, mode
        np.testing.assert_array_equal(positions, kernel, mode)
        np.testing.assert_array_equal(positions, want_positions, mode)
        np.testing.assert_array_equal(first, thresholds, mode)
        assert np.array_equal(np.isfinite(first), np.isfinite(reference_first)), mode
        finite = np.isfinite(first)
        scale = np.array([np.max(np.abs(row.astype(np.float64))) for _, row in rows_of(flat, groups)])
        tol = K.reduction_rtol[flat.dtype.type] * scale[finite] * (1 + R.normal_tail_quantile(ratio))
        assert np.all(np.abs(first[finite] - reference_first[finite]) <= tol), mode


@settings(max_examples=10, deadline=None)
@given(bucket=buckets(), ratio=GAUSSIANK_RATIOS)
def test_bfloat16_rows_are_the_kernels(bucket, ratio):
    """bfloat16 has no numpy dtype: each row selects the per-tensor kernels' selection, and Top-k
    that of its values in float32 (exact there)."""
    flat, groups = bucket
    a = tf.cast(tf.constant(flat.astype(np.float32)), tf.bfloat16)
    rows = tf_rows.Rows(layout(groups, ratio), a.device)
    positions, top = rows.topk(tf.abs(a))
    np.testing.assert_array_equal(positions, per_row(tf.abs(a), groups, ratio, topk_of(ratio)))
    single_positions, single_top = rows.topk(tf.abs(tf.cast(a, tf.float32)))
    np.testing.assert_array_equal(positions, single_positions)
    assert top.dtype == tf.bfloat16 and np.array_equal(tf.cast(top, tf.float32), single_top)
    slots = layout(groups, ratio, R.gaussiank_slots)
    positions, _ = tf_rows.Rows(slots, a.device, spare=flat.shape[0]).gaussiank(a, ratio)
    want = per_row(a, groups, ratio, lambda row: F.gaussiank_from(abs(row), F.gaussiank_first_threshold(row, ratio), R.num_selected(row.shape[0], ratio)), R.gaussiank_slots)
    np.testing.assert_array_equal(positions, want)


def test_rows_of_tf_tensors_live_on_their_device():
    """The kernel module names these rows, and their tensors are made on the work buffer's device."""
    a = tf.constant(np.linspace(-1.0, 1.0, 30, dtype=np.float32))
    rows = kernels.bucket_rows(F, [(0, 2, 10, 3, 4), (20, 1, 10, 3, 4)], a, spare=30)
    assert isinstance(rows, tf_rows.Rows) and rows.slot_row.device == a.device
    np.testing.assert_array_equal(rows.slot_row, np.repeat([0, 1, 2], 4))
    for got in rows.topk(tf.abs(a)) + rows.gaussiank(a, 0.3):
        assert got.device == a.device
