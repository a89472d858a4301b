"""Workloads of the ``hvd-compress`` command: the demo, and what the repository's benchmarks share
with it (optional packages, BLAS threads).

The training-step timing and trace benchmarks, the paper reproductions and the link studies
live in the repository's ``benchmarks/`` folder (``python -m benchmarks``), which is not installed.
"""

import contextlib
import importlib
from typing import Any


def single_threaded_blas():
    """Limit BLAS to one thread: simulated ranks run many small products, where threads only contend."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def require(module: str, extra: str) -> Any:
    """Import ``module``, or say which extra of ``hvd_compress`` installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"hvd-compress needs {module} for this command ({error}); "
            f"install it with: pip install 'hvd_compress[{extra}]'"
        ) from error
