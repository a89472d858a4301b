"""Workloads of the ``hvd-compress`` command: the demo, the training-step benchmark and its trace.

The paper reproductions and link studies live in the repository's ``benchmarks/``
folder (``python -m benchmarks``), which is not installed.
"""

import contextlib
import json
import socket
from pathlib import Path
from typing import Any, Callable, Dict, Optional


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


def save(results: Dict[str, Any], out: Optional[str], stem: str, plot: Optional[Callable] = None) -> None:
    """Write ``out/<stem>.json`` and, with ``plot(results, path)``, ``out/<stem>.png`` (nothing without
    ``out``: ``None`` or ``""``, as ``--out ''`` gives)."""
    if not out:
        return
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / f"{stem}.json", "w") as f:
        json.dump(results, f, indent=2)
    if plot is not None:
        plot(results, path / f"{stem}.png")


def publish(
    results: Dict[str, Any],
    out: Optional[str],
    stem: str,
    plot: Optional[Callable],
    print_table: Callable,
    stdout: Any = None,
) -> Dict[str, Any]:
    """:func:`save` the results, then ``print_table(results, stdout)``; returns ``results``."""
    save(results, out, stem, plot)
    print_table(results, stdout)
    return results
