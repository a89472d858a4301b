"""What every study does with its results: save the JSON and the figure, print the table; and the machine
they were measured on."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from benchmarks.report import machine


def describe_machine() -> Dict[str, Any]:
    """:func:`machine` for CPU runs: torch's fields are ``None`` without torch."""
    try:
        import torch
    except ImportError:
        torch = types.SimpleNamespace(get_num_threads=lambda: None, __version__=None)
    return machine(torch, ["cpu"])


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
