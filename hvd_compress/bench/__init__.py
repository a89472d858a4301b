"""Workloads of the ``hvd-compress`` command: the demo, simulations and benchmarks."""

import contextlib


def single_threaded_blas():
    """Limit BLAS to one thread: simulated ranks run many small products, where threads only contend."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")
