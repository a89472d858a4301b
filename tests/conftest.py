"""Shared pytest configuration: one hypothesis profile for the whole suite, and the CPU's fused passes
run eagerly (``HVD_COMPRESS_COMPILE=0``, inherited by the processes the tests start): compiled and
eager give the same results, and compiling in every rank of every multi-process test would cost
seconds each; tests/kernels/test_compiled.py compiles them.

``derandomize=True`` makes every run draw the same examples, so a failure seen
once is seen again (set HYPOTHESIS_PROFILE=explore for fresh random draws).
"""

import os

from hypothesis import HealthCheck, settings

os.environ.setdefault("HVD_COMPRESS_COMPILE", "0")

settings.register_profile(
    "suite",
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))
