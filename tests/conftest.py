"""Shared pytest configuration: one hypothesis profile for the whole suite, every test leaving the CPU's
way of the torch kernels on (no ``accelerator_path`` block left open), and the CPU's fused passes
run eagerly (``HVD_COMPRESS_COMPILE=0``, inherited by the processes the tests start): compiled and
eager give the same results, and compiling in every rank of every multi-process test would cost
seconds each; tests/kernels/test_compiled.py compiles them.

``derandomize=True`` makes every run draw the same examples, so a failure seen
once is seen again (set HYPOTHESIS_PROFILE=explore for fresh random draws).
"""

import os
import sys

import pytest
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


@pytest.fixture(autouse=True)
def host_shortcuts_restored():
    """A test that leaves an ``accelerator_path`` block open would run every later test of the process on the
    accelerator's way without saying so: fail it."""
    yield
    torch_ops = sys.modules.get("hvd_compress.kernels.torch_ops")
    if torch_ops is not None:
        assert torch_ops._accelerator_blocks == 0, "an accelerator_path() block was left open"
