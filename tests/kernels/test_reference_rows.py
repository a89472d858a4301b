"""The fused path's kernels on numpy against the per-tensor reference, row by row.

A fused bucket lays its tensors out as rows of a flat buffer, grouped by size
(:class:`hvd_compress.kernels.groups.Group`). Every row of numpy's
:class:`~hvd_compress.kernels.reference_rows.Rows` must select what
:func:`reference.topk_indices` and :func:`reference.gaussiank_from` select on that row
alone (Top-k: ties to the lower index; Gaussian-k: in index order in its first slots,
the others the spare position), and TernGrad's bucket kernels must give each row the
reference's scale, codes (same uniforms) and residual, bit for bit; a row holding NaN/Inf
gets a probe (Top-k's largest score, Gaussian-k's first threshold) that is not finite.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hvd_compress.kernels.groups import Group
from hvd_compress.kernels import reference as R
from hvd_compress.kernels.reference_rows import Rows
from spec import terngrad as terngrad_spec
from tests.helpers import reference_gaussiank

DTYPES = st.sampled_from([np.float16, np.float32, np.float64])


@st.composite
def buckets(draw, specials=False):
    """``(flat, groups)``: a few groups of equal-length rows, magnitudes with many ties or normal;
    with ``specials``, some rows holding NaN or Inf."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(DTYPES)
    shapes = draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 200)), min_size=1, max_size=3))
    groups, start, first = [], 0, 0
    for rows, n in shapes:
        groups.append(Group(start, first, list(range(first, first + rows)), n))
        start, first = groups[-1].stop, groups[-1].last
    if draw(st.booleans()):
        flat = rng.integers(-3, 4, start).astype(dtype)
    else:
        flat = rng.standard_normal(start).astype(dtype)
    if specials:
        row = draw(st.integers(0, first - 1))
        grp = next(g for g in groups if g.first <= row < g.last)
        grp.view(flat)[row - grp.first, draw(st.integers(0, grp.n - 1))] = draw(st.sampled_from([np.nan, np.inf]))
    return flat, groups


def rows_of(flat, groups):
    """Every row of ``flat``: ``(first position, row)``."""
    return [(g.start + i * g.n, row) for g in groups for i, row in enumerate(g.view(flat))]


@settings(max_examples=60, deadline=None)
@given(bucket=buckets(), ratio=st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_topk_of_every_row_is_the_reference(bucket, ratio):
    flat, groups = bucket
    scores = np.abs(flat)
    layout = [(g.start, g.rows, g.n, R.num_selected(g.n, ratio), R.num_selected(g.n, ratio)) for g in groups]
    positions, top = Rows(layout).topk(scores)
    slot = 0
    for row, (first, entries) in enumerate(rows_of(scores, groups)):
        k = R.num_selected(entries.shape[0], ratio)
        np.testing.assert_array_equal(np.sort(positions[slot : slot + k]) - first, R.topk_indices(entries, k))
        assert top[row] == entries.max() and top.dtype == scores.dtype
        slot += k
    assert slot == positions.shape[0]


@settings(max_examples=60, deadline=None)
@given(bucket=buckets(), ratio=st.sampled_from([0.01, 0.05, 0.3]))
def test_gaussiank_of_every_row_is_the_reference(bucket, ratio):
    flat, groups = bucket
    spare = flat.shape[0]
    layout = [(g.start, g.rows, g.n, R.num_selected(g.n, ratio), R.gaussiank_slots(R.num_selected(g.n, ratio)))
              for g in groups]
    positions, probe = Rows(layout, spare=spare).gaussiank(flat, ratio)
    slot = 0
    for row, (first, entries) in enumerate(rows_of(flat, groups)):
        width = R.gaussiank_slots(R.num_selected(entries.shape[0], ratio))
        want = reference_gaussiank(entries, ratio)
        mine = positions[slot : slot + width]
        np.testing.assert_array_equal(mine[: want.shape[0]] - first, want)
        assert np.all(mine[want.shape[0] :] == spare), "unused slots hold the spare position"
        assert probe[row] == R.gaussiank_threshold(entries, ratio)
        slot += width


@settings(max_examples=30, deadline=None)
@given(bucket=buckets(specials=True), ratio=st.sampled_from([0.05, 0.5]))
def test_a_row_holding_nan_or_inf_has_a_probe_that_is_not_finite(bucket, ratio):
    flat, groups = bucket
    bad = [not np.isfinite(entries).all() for _, entries in rows_of(flat, groups)]
    layout = [(g.start, g.rows, g.n, R.num_selected(g.n, ratio), R.num_selected(g.n, ratio)) for g in groups]
    slots = [(start, rows, n, k, R.gaussiank_slots(k)) for start, rows, n, k, _ in layout]
    with np.errstate(all="ignore"):
        positions, top = Rows(layout).topk(np.abs(flat))
        _, first = Rows(slots, spare=flat.shape[0]).gaussiank(flat, ratio)
    assert list(~np.isfinite(top)) == bad and list(~np.isfinite(first)) == bad
    assert np.all((positions >= 0) & (positions < flat.shape[0]))


@settings(max_examples=60, deadline=None)
@given(bucket=buckets(), clip=st.sampled_from([None, 2.5, 0.5]), seed=st.integers(0, 2**16))
def test_terngrad_bucket_kernels_are_the_reference_row_by_row(bucket, clip, seed):
    flat, groups = bucket
    uniform = np.random.default_rng(seed).random(flat.shape[0], dtype=np.float32).astype(flat.dtype)
    scale, bound = R.terngrad_bucket_scales(flat, groups, clip)
    with np.errstate(all="ignore"):
        codes = R.terngrad_bucket_codes(flat, groups, bound, scale, uniform)
    residual = R.terngrad_bucket_residual(flat.copy(), groups, codes, scale)
    option = terngrad_spec.TernGrad(clip=clip)
    for row, (first, entries) in enumerate(rows_of(flat, groups)):  # the spec, one tensor at a time
        measured = terngrad_spec.measure(option, entries, {})
        assert float(scale[row]) == float(measured["scale"]), row
        want = terngrad_spec.codes(option, measured, scale[row], uniform[first : first + entries.shape[0]], {})
        np.testing.assert_array_equal(codes[first : first + entries.shape[0]], want)
        np.testing.assert_array_equal(residual[first : first + entries.shape[0]],
                                      entries - float(scale[row]) * want.astype(entries.dtype))
