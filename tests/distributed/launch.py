"""Starting multi-process runs from tests: ``horovodrun --gloo`` or ``mpirun``.

``horovodrun`` is the installed one's entry point run with this interpreter, but its check that
Horovod was built with Gloo looks at ``horovod.torch`` alone: Horovod checks each framework in a
fresh process, TensorFlow first, and importing TensorFlow there cost about 2.5 s per launch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240
HOROVODRUN = (
    "import horovod.common.util as util; util.EXTENSIONS[:] = ['torch']; "
    "from horovod.runner.launch import run_commandline; run_commandline()"
)


def require(module: str) -> None:
    """Skip without ``module``, unless the run promises the full stack (``make test`` sets
    HVD_COMPRESS_REQUIRE_HOROVOD=1): then its absence is a failure."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        if os.environ.get("HVD_COMPRESS_REQUIRE_HOROVOD") == "1":
            raise
        pytest.skip(f"{module} is not installed: {error}", allow_module_level=True)


@contextlib.contextmanager
def gloo_group(rank: int, size: int, port: int, timeout_s: float = 30.0) -> Iterator[None]:
    """``torch.distributed`` over Gloo for one rank started by ``torch.multiprocessing.spawn``.

    When the body succeeds, every rank collects its garbage (DDP's reducer and its hooks'
    futures sit in reference cycles that hold Gloo work objects; freed after the group is
    gone, at exit, they abort the process: "terminate called without an active exception")
    and meets the others at a barrier before the group is destroyed (a rank that closes its
    sockets while a peer's Gloo threads still read them aborts that peer the same way). When
    the body raises, the group is destroyed at once, since the peers may never reach a barrier.
    """
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    try:
        yield
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(entry: Callable[..., None], ranks: int, *args: Any, timeout: float = 180.0) -> None:
    """``entry(rank, port, *args)`` on ``ranks`` spawned processes (``port`` a free one for
    :func:`gloo_group`); a rank that fails fails the test, and ranks still running after ``timeout`` s
    are killed and fail it as a hang."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.start_processes(entry, args=(port, *args), nprocs=ranks, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {timeout} s (hang?)")


def require_horovod_torch() -> None:
    require("horovod.torch")


def require_mpi() -> None:
    """mpi4py (not mpi4py.MPI: importing that would initialize MPI in pytest) and mpirun."""
    require("mpi4py")
    launcher("mpirun", 2)


def output(done: subprocess.CompletedProcess) -> str:
    """The end of a finished run's output, for assertion messages."""
    return (done.stdout + done.stderr)[-4000:]


def launcher(kind: str, ranks: int) -> List[str]:
    if kind == "horovodrun":
        tool = shutil.which("horovodrun")
        command = [sys.executable, "-c", HOROVODRUN, "-np", str(ranks), "--gloo"]
    else:
        tool = shutil.which("mpirun")
        command = [tool, "-np", str(ranks)] + (["--oversubscribe"] if ranks > 2 else [])
    if tool is None:
        if os.environ.get("HVD_COMPRESS_REQUIRE_HOROVOD") == "1":
            raise RuntimeError(f"{kind} is not on PATH")
        pytest.skip(f"{kind} is not on PATH")
    return command


def run(
    kind: str, ranks: int, module: str, *args: str, timeout: int = TIMEOUT
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` on ``ranks`` processes; returns the finished process."""
    command, env = _command(kind, ranks, module, args)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_timing_exit(
    kind: str, ranks: int, module: str, *args: str, after: str, timeout: int = TIMEOUT
) -> Tuple[subprocess.CompletedProcess, float]:
    """:func:`run`, and the seconds from the arrival of the last output line that contains ``after``
    (a line the ranks print after their last step) to the launcher's exit: the time the ranks took to
    end (Horovod's shutdown, the interpreter's exit) and the launcher to see them end. ``inf`` when no
    such line came."""
    command, env = _command(kind, ranks, module, args)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)
    lines: List[str] = []
    seen_at, timed_out = float("-inf"), []

    def kill() -> None:  # the launcher and the ranks (its session), so that the output ends too
        timed_out.append(True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    try:
        for line in process.stdout:  # stderr joins stdout: one stream, read to its end
            lines.append(line)
            if after in line:
                seen_at = time.monotonic()
        returncode = process.wait()
    finally:
        watchdog.cancel()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output="".join(lines))
    ended = time.monotonic() - seen_at
    return subprocess.CompletedProcess(command, returncode, "".join(lines), ""), ended


def _command(kind: str, ranks: int, module: str, args: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """The launch command of ``python -m module args`` on ``ranks`` processes, and its environment."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return launcher(kind, ranks) + [sys.executable, "-m", module, *args], env


def run_to_the_end(
    kind: str, ranks: int, module: str, *args: str, limit: int = 60
) -> Tuple[subprocess.CompletedProcess, float]:
    """:func:`run` of a job that must end by itself within ``limit`` s (one that fails on some rank);
    returns the finished process and its wall seconds. Still running at ``limit``: the test fails."""
    start = time.monotonic()
    try:
        done = run(kind, ranks, module, *args, timeout=limit)
    except subprocess.TimeoutExpired as expired:
        seen = "".join(
            out.decode(errors="replace") if isinstance(out, bytes) else out or ""
            for out in (expired.stdout, expired.stderr)
        )
        pytest.fail(f"{module} {' '.join(args)} was still running after {limit} s (a hang):\n{seen[-4000:]}")
    return done, time.monotonic() - start


def assert_equals_simulator(
    result: Dict[str, np.ndarray], names: Sequence[str], simulate: Callable[[str], Dict[str, np.ndarray]]
) -> None:
    """Every ``result[f"{name}/{param}"]`` of a multi-process run equals ``simulate(name)[param]``:
    1e-6 absolute, FP16 1e-4 (Horovod sums float16 in float16, the Simulator in float32)."""
    for name in names:
        for param, value in simulate(name).items():
            np.testing.assert_allclose(
                result[f"{name}/{param}"],
                value,
                rtol=0,
                atol=1e-4 if name == "fp16" else 1e-6,
                err_msg=f"{name} {param}: the multi-process run differs from the Simulator",
            )
