"""Shared pytest configuration: one hypothesis profile for the whole suite.

``derandomize=True`` makes every run draw the same examples, so a failure seen
once is seen again (set HYPOTHESIS_PROFILE=explore for fresh random draws).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "suite",
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))
