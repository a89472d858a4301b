"""The built-in compressors pass the conformance checks a new one must pass (tests/conformance.py).

This keeps the checks honest: what docs/adding_a_compressor.md asks of a new
algorithm, TopK, Gaussian-k, RegTop-k, TernGrad, None and FP16 already do.
"""

import pytest

from hvd_compress import FP16, GaussianK, NoneCompressor, RegTopK, TernGrad, TopK
from tests import conformance

BUILT_IN = {
    "topk": lambda: TopK(0.1, dense_below=0),
    "gaussiank": lambda: GaussianK(0.1, dense_below=0),
    "regtopk": lambda: RegTopK(0.1, dense_below=0),
    "terngrad": lambda: TernGrad(dense_below=0),
    "terngrad_ef_unshared": lambda: TernGrad(dense_below=0, error_feedback=True, scalar_sharing=False),
    "none": NoneCompressor,
    "fp16": FP16,
}
#: Another configuration of the same kind of compressor (the per-tensor header has a
#: column per sparse tensor, so rank 1 differs in configuration, not in kind).
OTHER = {
    "topk": lambda: TopK(0.2, dense_below=0),
    "gaussiank": lambda: GaussianK(0.2, dense_below=0),
    "regtopk": lambda: RegTopK(0.1, mu=2.0, dense_below=0),
    "terngrad": lambda: TernGrad(clip=None, dense_below=0),
    "terngrad_ef_unshared": lambda: TernGrad(dense_below=0, scalar_sharing=False),
    "none": FP16,
    "fp16": NoneCompressor,
}
WITH_ERROR_FEEDBACK = ["topk", "gaussiank", "regtopk", "terngrad_ef_unshared"]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_results_and_checkpoints(kind, framework):
    conformance.check_results_keep_shape_and_dtype(BUILT_IN[kind], framework)
    conformance.check_state_dict_round_trip(BUILT_IN[kind], framework=framework)


@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_rejects_bad_gradients(kind):
    conformance.check_rejects_bad_gradients(BUILT_IN[kind])


@pytest.mark.parametrize("kind", WITH_ERROR_FEEDBACK)
def test_conserves_mass(kind):
    conformance.check_conserves_mass(BUILT_IN[kind])


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_thread_ranks_equal_the_per_tensor_spec(kind, framework):
    rtol = 1e-3 if kind == "fp16" else 1e-6  # the float16 wire rounds the sum, the Simulator sums in float32
    # Each rank's own scale S = c std (clipped): torch's std may round an ulp from the spec's float64 one, and
    # the ranks' S t (|S| near 2) cancel in the sum, so that ulp (1.2e-7 each) stays whole in a small average.
    atol = 1e-6 if kind == "terngrad_ef_unshared" and framework == "torch" else 1e-7
    conformance.check_thread_ranks_equal_per_tensor_spec(BUILT_IN[kind], framework=framework, rtol=rtol, atol=atol)


@pytest.mark.parametrize("kind", sorted(BUILT_IN))
def test_ranks_disagreeing_fail_clearly(kind):
    conformance.check_ranks_disagreeing_fail_clearly(BUILT_IN[kind], OTHER[kind])
