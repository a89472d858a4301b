"""The README's table of what each compressor sends per step, formula by formula, against the bytes the
engine hands the collectives (the Simulator counts them as every route does): one tensor of ``d``
float32 elements, after the layout check's first step, at N = 2, 4 and 5 ranks. The formulas are
written here from the README's words, not from ``hvd_compress.wire``."""

import math

import numpy as np
import pytest

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from hvd_compress.simulator import Simulator


def lanes(d: int, n: int) -> int:
    """``P = 4 ceil(d / floor(32 / ceil(log2(2N + 1))))``: the codes summed in packed int32 lanes."""
    return 4 * math.ceil(d / (32 // math.ceil(math.log2(2 * n + 1))))


def terngrad_bytes(d: int, n: int) -> int:
    """``ceil(d/4) + 8`` (2-bit codes, allgathered) where ``N ceil(d/4) < 2P``, else ``P + 8``."""
    two_bit = math.ceil(d / 4)
    return (two_bit if n * two_bit < 2 * lanes(d, n) else lanes(d, n)) + 8


def readme_bytes(kind: str, d: int, n: int) -> int:
    k = math.ceil(0.01 * d)
    return {
        "TopK": 8 * k + 8,
        "RegTopK": 8 * k + 8,
        "GaussianK": 8 * math.floor(4 * k / 3) + 8 + 8,  # the padded slots' spare entry: 8 per bucket
        "TernGrad": terngrad_bytes(d, n),
        "FP16": 2 * d,
        "NoneCompressor": 4 * d,
    }[kind]


MAKE = {"TopK": lambda: TopK(0.01), "RegTopK": lambda: RegTopK(0.01), "GaussianK": lambda: GaussianK(0.01),
        "TernGrad": TernGrad, "FP16": FP16, "NoneCompressor": NoneCompressor}


@pytest.mark.parametrize("d", [5000, 5003])  # d mod 8: 0 and 3
@pytest.mark.parametrize("n", [2, 4, 5])
@pytest.mark.parametrize("kind", sorted(MAKE))
def test_bytes_per_step_are_the_readme_formula(kind, n, d):
    sim = Simulator(n, MAKE[kind]())
    rng = np.random.default_rng(d + n)
    for _ in range(2):  # the first step also sends the layout check's header
        sim.step({"w": [rng.standard_normal(d).astype(np.float32) for _ in range(n)]})
    assert sim.bytes_sent_per_rank == [readme_bytes(kind, d, n)] * n


def test_terngrad_picks_as_the_readme_says():
    """The 2-bit allgather at N <= 3, the lanes from N = 5; at N = 4 the allgather only where d mod 8 is 1 to 4."""
    assert all(terngrad_bytes(d, n) == math.ceil(d / 4) + 8 for n in (2, 3) for d in range(1000, 1016))
    assert all(terngrad_bytes(d, n) == lanes(d, n) + 8 for n in (5, 8, 16) for d in range(1000, 1016))
    for d in range(1000, 1016):
        assert (terngrad_bytes(d, 4) == math.ceil(d / 4) + 8) == (1 <= d % 8 <= 4), d
