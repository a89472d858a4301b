"""Oracles, factories and hypothesis strategies shared by the test modules.

Everything here is written independently of the library's selection code so that
tests compare the library against a second, simpler implementation.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.kernels import reference
from hvd_compress.kernels.reference import NO_DISTORTION

# --------------------------------------------------------------------------- #
# Compressor factories (small tests send everything sparsely: dense_below=0, and no switch to
# dense when N * k >= numel)
# --------------------------------------------------------------------------- #
SPARSIFIERS = {
    "topk": lambda ratio: TopK(ratio, dense_below=0, dense_when_cheaper=False),
    "gaussiank": lambda ratio: GaussianK(ratio, dense_below=0, dense_when_cheaper=False),
    "regtopk": lambda ratio: RegTopK(ratio, mu=4.0, dense_below=0, dense_when_cheaper=False),
}

ALL_COMPRESSORS = {
    "topk": lambda: TopK(0.1, dense_below=0, dense_when_cheaper=False),
    "gaussiank": lambda: GaussianK(0.1, dense_below=0, dense_when_cheaper=False),
    "regtopk": lambda: RegTopK(0.1, dense_below=0, dense_when_cheaper=False),
    "terngrad": lambda: TernGrad(dense_below=0),
    "terngrad_ef_noshare": lambda: TernGrad(dense_below=0, error_feedback=True, scalar_sharing=False),
    "none": lambda: NoneCompressor(),
    "fp16": lambda: FP16(),
}


# --------------------------------------------------------------------------- #
# Oracles
# --------------------------------------------------------------------------- #
def exact_k(permille: int, numel: int) -> int:
    """``k = max(1, ceil(permille / 1000 * numel))`` in exact integer arithmetic."""
    return max(1, -(-permille * numel // 1000))


def topk_oracle(a: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the k largest |a|, ties to the lower index, by a full sort.

    ``lexsort`` sorts by the last key first: descending magnitude, then ascending index.
    """
    order = np.lexsort((np.arange(a.shape[0]), -np.abs(a)))
    return np.sort(order[:k])



def reference_gaussiank(a: np.ndarray, ratio: float) -> np.ndarray:
    """Gaussian-k of one tensor on the numpy kernels: the count rule (``gaussiank_from``) on ``|a|`` from the
    reference's first threshold (what numpy's rows run on each row)."""
    return reference.gaussiank_from(np.abs(a), reference.gaussiank_threshold(a, ratio),
                                    reference.num_selected(a.shape[0], ratio))


def rank_uniforms(seed: int, rank: int, numel: int) -> np.ndarray:
    """The uniforms TernGrad draws on ``rank``: stream ``default_rng([seed, rank])``, float32."""
    return np.random.default_rng([seed, rank]).random(numel, dtype=np.float32)


# --------------------------------------------------------------------------- #
# Strategies
# --------------------------------------------------------------------------- #
finite64 = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def training_runs(draw, max_ranks: int = 4, max_steps: int = 5, max_numel: int = 40):
    """``grads[step][rank]``: float64 vectors with repeated values (ties) and zeros likely."""
    n_ranks = draw(st.integers(1, max_ranks))
    steps = draw(st.integers(1, max_steps))
    numel = draw(st.integers(1, max_numel))
    grads = draw(hnp.arrays(np.float64, (steps, n_ranks, numel), elements=finite64))
    return grads


def vectors(min_size: int = 1, max_size: int = 200, elements=finite64, dtype=np.float64):
    return hnp.arrays(dtype, st.integers(min_size, max_size), elements=elements)


permille = st.integers(1, 1000)  # ratio = permille / 1000


# --------------------------------------------------------------------------- #
# Kernel inputs (arrays drawn from a seed: fast); the framework kernel tests compare on them
# --------------------------------------------------------------------------- #
#: Values that tie often, signed zeros included.
TIE_POOL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, 1e-3, -1e-3])


@st.composite
def float_arrays(draw, dtype, min_size: int = 1, max_size: int = 3000) -> np.ndarray:
    """Normal, heavy-tailed, tie-heavy or constant vectors of ``dtype``."""
    size = draw(st.integers(min_size, max_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "cauchy", "ties", "mixed", "constant"]))
    if kind == "normal":
        a = rng.standard_normal(size) * draw(st.sampled_from([1e-3, 1.0, 50.0])) + draw(
            st.sampled_from([0.0, 0.0, 0.3, -2.0])
        )
    elif kind == "cauchy":
        a = np.clip(rng.standard_cauchy(size), -1e3, 1e3)
    elif kind == "ties":
        a = rng.choice(TIE_POOL, size)
    elif kind == "mixed":
        a = np.where(rng.random(size) < 0.5, rng.choice(TIE_POOL, size), rng.standard_normal(size))
    else:
        a = np.full(size, draw(st.sampled_from([0.0, 0.1, -3.0, 7.0])))
    return a.astype(dtype)


@st.composite
def index_sets(draw, numel: int, min_count: int = 0) -> np.ndarray:
    """Ascending distinct int32 indices into ``numel`` entries."""
    count = draw(st.integers(min(min_count, numel), numel))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return np.sort(rng.choice(numel, count, replace=False)).astype(np.int32)


@st.composite
def ternary_codes(draw, numel: int) -> np.ndarray:
    """int8 codes in {-1, 0, 1}; constant codes (all -1, all +1: the extreme fields) are likely."""
    fill = draw(st.sampled_from([None, None, -1, 0, 1]))
    if fill is not None:
        return np.full(numel, fill, dtype=np.int8)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(-1, 2, numel).astype(np.int8)


@st.composite
def distortions(draw, numel: int, dtype) -> np.ndarray:
    """What RegTop-k's D looks like: 1e8 (no information) where nothing was sent,
    ``(T - s) / s`` elsewhere: -1 (cancelled), 0, reinforced, random."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    d = rng.choice(np.array([NO_DISTORTION, -1.0, 0.0, 1.0, -2.0, 3.0]), numel)
    informative = rng.random(numel) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    d = np.where(informative, rng.standard_normal(numel) * 3, d)
    with np.errstate(over="ignore"):
        return d.astype(dtype)


def sampled_in_range_but_over_the_slots():
    """12,800 entries, ``k = 128`` at 1%: 50 even-indexed and 150 odd-indexed entries lie above 1 (uniform
    in [1.1, 3.0], either sign), the rest below 0.9. Counted on every 2nd entry
    (:func:`reference.sample_stride`) the set above 1 holds ``2 x 50 = 100``, in Gaussian-k's ``[86, 170]``
    and a reused threshold's ``[64, 128]``; counted exactly it holds 200, more than either's slots."""
    rng = np.random.default_rng(3)
    a = rng.uniform(-0.9, 0.9, 12800)
    above = np.concatenate([rng.choice(np.arange(0, 12800, 2), 50, replace=False),
                            rng.choice(np.arange(1, 12800, 2), 150, replace=False)])
    a[above] = rng.uniform(1.1, 3.0, 200) * rng.choice([-1.0, 1.0], 200)
    return a
