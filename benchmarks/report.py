"""What every benchmark and study shares around its measurements: optional packages, progress
bars, the machine's description and the figures' setup."""

from __future__ import annotations

import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hvd_compress import __version__
from hvd_compress.bench import require  # noqa: F401  (the benchmarks' import of it)


# ---------------------------------------------------------------- dependencies
def require_packages(torch: bool, plots: bool) -> None:
    """Fail before any work when torch (if ``torch``) or matplotlib (if a plot is to be written) is missing."""
    if torch:
        require("torch", "torch")
    if plots:
        require("matplotlib", "bench")


# -------------------------------------------------------------------- progress
def progress_bar(total: int, desc: str, unit: str, enabled: bool) -> Any:
    """A tqdm bar named ``desc`` on stderr; without tqdm, one plain line per update."""
    if not enabled:
        return _Lines(total, desc, echo=False)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _Lines(total, desc, echo=True)
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def say(bar: Any, text: str) -> None:
    """Print ``text`` on stderr without breaking the progress ``bar``."""
    write = getattr(bar, "write", None)
    if write is not None:
        write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


class _Lines:
    """The bits of tqdm's interface used here, as one line per update on stderr."""

    def __init__(self, total: int, desc: str, echo: bool) -> None:
        self.total, self.desc, self.n, self.echo, self.text = total, desc, 0, echo, ""

    def set_postfix_str(self, text: str) -> None:
        self.text = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.echo:
            print(f"{self.desc} [{self.n}/{self.total}] {self.text}", file=sys.stderr)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------- machine
def load_average() -> Optional[List[float]]:
    """The 1, 5 and 15 minute load averages (other processes skew timings), or None."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def machine(torch: Any, devices: Sequence[str]) -> Dict[str, Any]:
    """What the numbers were measured on."""
    cpu_name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "cpu_count": os.cpu_count(),
        "cpu": cpu_name,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "hvd_compress_version": __version__,
        "devices": {"cpu": cpu_name},
        # other processes skew timings on small machines; ratios to same-run baselines only partly cancel it
        "load_average_1_5_15min": load_average(),
    }
    if "cuda" in devices:
        info["devices"]["cuda"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
    return info


# --------------------------------------------------------------------- figures
def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write ``path`` (110 dpi) and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def ratio_bars(ax: Any, names: Sequence[str], groups: Sequence[Tuple[str, Sequence[float]]]) -> None:
    """Ratios to a baseline on a log scale: a cluster of bars per name, one ``(label, values)`` bar per group,
    1.0 dashed."""
    width = 0.8 / len(groups)
    for i, (label, values) in enumerate(groups):
        xs = [j + (i - (len(groups) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")


def free_port() -> int:
    """A TCP port free on localhost now (for a one-process rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
