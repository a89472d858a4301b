"""Workloads of the ``hvd-compress`` command: the demo, and the report helpers (tables, progress
lines, figures) the repository's benchmarks share with it.

The training-step timing and trace benchmarks, the paper reproductions and the link studies
live in the repository's ``benchmarks/`` folder (``python -m benchmarks``), which is not installed.
"""

import contextlib
import socket


def single_threaded_blas():
    """Limit BLAS to one thread: simulated ranks run many small products, where threads only contend."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def free_port() -> int:
    """A TCP port free on localhost now (for a one-process rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
