"""Ranks as processes on an emulated link or on localhost, for ``bench step`` and ``bench scaling``.

Emulated links come from ``ci/netns_cluster.sh`` (a source checkout's script):
``up N RATE DELAY`` makes N network namespaces on one bridge, each node with a
full-duplex link of RATE (netem ``rate`` and ``delay``; tbf, rate only, where
the kernel has no netem), and rank r runs in namespace r at 10.77.0.(r+1)
through the script's ``run``. Every cluster gets its own namespace prefix and
is removed on exit, on errors and on SIGTERM. Without emulation (``rate=None``)
the ranks are plain processes talking over 127.0.0.1.

Workers are ``python -m MODULE worker CONFIG_JSON``; they join a gloo
``torch.distributed`` group (:func:`init_gloo`), write their result as JSON to
``config["out"]`` (:func:`write_result`) and may print ``@progress TEXT`` lines
(:func:`progress`), which rank 0's driver turns into a progress bar.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

from benchmarks.report import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "ci" / "netns_cluster.sh"
PROGRESS = "@progress "
EMULATED_PORT = 29533
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


class EmulationUnavailable(ValueError):
    """An emulated link was asked for, but this machine cannot make one (with the reason)."""


# ------------------------------------------------------------------- options
def parse_rate(text: str) -> float:
    """tc's rate syntax to bits per second: ``1gbit`` -> 1e9, ``100mbit`` -> 1e8."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)bit\s*", str(text).lower())
    if not match:
        raise ValueError(f"hvd_compress: cannot read rate {text!r}; use e.g. 1gbit, 10gbit or 100mbit")
    bits = float(match.group(1)) * _UNITS[match.group(2)]
    if bits <= 0:
        raise ValueError(f"hvd_compress: rate {text!r} must be positive")
    return bits


def parse_delay(text: str) -> float:
    """tc's time syntax to seconds: ``0.1ms`` -> 1e-4, ``50us`` -> 5e-5, ``0`` -> 0."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us|)\s*", str(text).lower())
    if not match:
        raise ValueError(f"hvd_compress: cannot read delay {text!r}; use e.g. 0.1ms or 50us")
    return float(match.group(1)) * {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6}[match.group(2)]


def format_rate(bits: Optional[float]) -> str:
    if bits is None:
        return "localhost"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


# ---------------------------------------------------------------------- link
@dataclass
class Link:
    """Where the ranks of one job run: ``rate`` None for localhost, else an emulated cluster."""

    nodes: int
    rate: Optional[str] = None
    delay: str = "0"
    prefix: Optional[str] = None
    shaping: str = "none"  # "netem" (rate and delay), "tbf" (rate only) or "none"

    @property
    def emulated(self) -> bool:
        return self.prefix is not None

    @property
    def bits_per_second(self) -> Optional[float]:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def master(self) -> str:
        return "10.77.0.1" if self.emulated else "127.0.0.1"

    @property
    def ifname(self) -> str:
        return "eth0" if self.emulated else "lo"

    def command(self, rank: int, argv: List[str]) -> List[str]:
        return [str(SCRIPT), "run", str(rank), *argv] if self.emulated else argv

    def describe(self) -> Dict[str, Any]:
        return {
            "rate": self.rate,
            "bits_per_second": self.bits_per_second,
            "delay": self.delay if self.shaping == "netem" else None,
            "shaping": self.shaping,
            "nodes": self.nodes,
            "note": {
                "netem": f"netem rate {self.rate} and one-way delay {self.delay} on every node's link",
                "tbf": f"tbf rate {self.rate} on every node's link; this kernel has no netem, so the "
                f"delay {self.delay} is not emulated (latency is the software's own)",
                "none": "no emulation: processes on 127.0.0.1, unshaped loopback",
            }[self.shaping],
        }


def emulation_problem() -> Optional[str]:
    """Why no namespace cluster can be made here, or None."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if not SCRIPT.exists():
        return f"{SCRIPT} is missing (emulation needs a source checkout of hvd_compress)"
    if os.geteuid() != 0:
        return "it needs root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install iproute2)"
    probe = f"hvdp{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"network namespaces cannot be created here: {made.stderr.strip()}"
    return None


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so ``finally`` blocks (cleanup) run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def link(nodes: int, rate: Optional[str] = None, delay: str = "0.1ms") -> Iterator[Link]:
    """A cluster of ``nodes`` namespaces on a ``rate`` link (removed afterwards); ``rate=None``: localhost."""
    if rate is None:
        yield Link(nodes)
        return
    parse_rate(rate)
    parse_delay(delay)
    problem = emulation_problem()
    if problem:
        raise EmulationUnavailable(
            f"hvd_compress: cannot emulate a {rate} link here: {problem}; "
            "use --link none to run on localhost without emulation"
        )
    prefix = f"hvdb{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, HVDC_PREFIX=prefix)
    with _sigterm_as_exit():
        try:
            up = subprocess.run(
                [str(SCRIPT), "up", str(nodes), rate, delay],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            if up.returncode != 0:
                raise EmulationUnavailable(
                    f"hvd_compress: ci/netns_cluster.sh up {nodes} {rate} {delay} failed: "
                    f"{(up.stdout + up.stderr).strip()[-800:]}"
                )
            shaping = "tbf" if "no netem" in up.stdout + up.stderr else "netem"
            yield Link(nodes, rate, delay, prefix, shaping)
        finally:
            subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)


# ------------------------------------------------------------------- workers
def _pump(stream: Any, lines: "queue.Queue[str]") -> None:
    for line in stream:
        lines.put(line)
    stream.close()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _kill(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)


def run_workers(
    link: Link,
    world: int,
    module: str,
    config: Dict[str, Any],
    timeout: float,
    on_progress: Optional[Callable[[str], None]] = None,
) -> List[Dict[str, Any]]:
    """Run ``world`` ranks of ``python -m module worker``; their results, rank order.

    A rank that fails or a job past ``timeout`` seconds stops every rank and
    raises RuntimeError with the end of the failing rank's output.
    """
    if world > link.nodes:
        raise ValueError(f"hvd_compress: {world} ranks on a cluster of {link.nodes} nodes")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=link.ifname, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if link.emulated:
        env["HVDC_PREFIX"] = link.prefix
    port = EMULATED_PORT if link.emulated else free_port()
    with tempfile.TemporaryDirectory(prefix="hvd_compress_bench_") as tmp, _sigterm_as_exit():
        tmp_path = Path(tmp)
        procs: List[subprocess.Popen] = []
        lines: "queue.Queue[str]" = queue.Queue()
        try:
            for rank in range(world):
                rank_config = dict(
                    config,
                    rank=rank,
                    world=world,
                    master=link.master,
                    port=port,
                    out=str(tmp_path / f"{rank}.json"),
                )
                argv = link.command(rank, [sys.executable, "-m", module, "worker", json.dumps(rank_config)])
                log = open(tmp_path / f"{rank}.log", "w")
                procs.append(
                    subprocess.Popen(
                        argv,
                        stdout=subprocess.PIPE if rank == 0 else log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        text=True,
                        start_new_session=True,
                    )
                )
                log.close()
            reader = threading.Thread(target=_pump, args=(procs[0].stdout, lines), daemon=True)
            reader.start()
            rank0_output = _wait(procs, lines, reader, time.monotonic() + timeout, on_progress, tmp_path)
        finally:
            _kill(procs)
        results = []
        for rank in range(world):
            path = tmp_path / f"{rank}.json"
            if not path.exists():
                log = rank0_output if rank == 0 else _tail(tmp_path / f"{rank}.log")
                raise RuntimeError(f"hvd_compress: rank {rank} wrote no result:\n{log[-3000:]}")
            results.append(json.loads(path.read_text()))
        return results


def run_workers_with_bar(
    link: Link, world: int, module: str, config: Dict[str, Any], timeout: float, bar: Any
) -> List[Dict[str, Any]]:
    """:func:`run_workers` with rank 0's progress lines on ``bar`` (a tqdm-like bar), after the link's rate."""
    label = format_rate(link.bits_per_second)
    bar.set_postfix_str(f"{label}: starting {world} ranks")

    def advance(text: str) -> None:
        bar.set_postfix_str(f"{label} {text}")
        bar.update()

    return run_workers(link, world, module, config, timeout, on_progress=advance)


def _wait(
    procs: List[subprocess.Popen],
    lines: "queue.Queue[str]",
    reader: threading.Thread,
    deadline: float,
    on_progress: Optional[Callable[[str], None]],
    tmp_path: Path,
) -> str:
    """Wait for every rank; rank 0's output. Raises on the first failing rank or at the deadline."""
    output: List[str] = []

    def drain() -> None:
        while True:
            try:
                line = lines.get_nowait()
            except queue.Empty:
                return
            if line.startswith(PROGRESS):
                if on_progress:
                    on_progress(line[len(PROGRESS) :].strip())
            else:
                output.append(line)

    def done(rank: int, code: Optional[int]) -> bool:  # exited after writing its result (see finish_worker)
        return code == 0 or (code is not None and (tmp_path / f"{rank}.json").exists())

    while True:
        drain()
        codes = [p.poll() for p in procs]
        failed = [r for r, code in enumerate(codes) if code is not None and not done(r, code)]
        if failed:
            time.sleep(0.5)
            drain()
            rank = failed[0]
            log = "".join(output) if rank == 0 else _tail(tmp_path / f"{rank}.log")
            raise RuntimeError(f"hvd_compress: rank {rank} exited with {codes[rank]}:\n{log[-3000:]}")
        if all(done(r, code) for r, code in enumerate(codes)):
            reader.join(timeout=10)
            drain()
            return "".join(output)
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"hvd_compress: ranks still running after the time limit; rank 0's output:\n"
                f"{''.join(output)[-3000:]}"
            )
        time.sleep(0.1)


# -------------------------------------------------------------- worker side
def worker_config(argv: List[str]) -> Dict[str, Any]:
    """The configuration passed as ``worker CONFIG_JSON``."""
    if len(argv) != 2 or argv[0] != "worker":
        raise SystemExit("usage: python -m MODULE worker CONFIG_JSON (started by python -m benchmarks)")
    return json.loads(argv[1])


def init_gloo(config: Dict[str, Any], timeout_s: float = 600.0) -> None:
    """Join the job's gloo process group; one torch thread per rank (ranks share the cores)."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config['master']}:{config['port']}",
        rank=config["rank"],
        world_size=config["world"],
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def progress(text: str) -> None:
    print(PROGRESS + text, flush=True)


def write_result(config: Dict[str, Any], result: Dict[str, Any]) -> None:
    """Write ``result`` whole or not at all (the driver takes a rank with a result as done)."""
    partial = config["out"] + ".partial"
    with open(partial, "w") as f:
        json.dump(result, f)
    os.replace(partial, config["out"])


def finish_worker(config: Dict[str, Any], result: Dict[str, Any]) -> None:
    """Once every rank is done, write ``result`` with this rank's number, then leave the process group
    (gloo may abort a process while its peers close their connections: the result is in by then)."""
    import torch.distributed as dist

    dist.barrier()
    write_result(config, {"rank": config["rank"], **result})
    dist.destroy_process_group()


def tx_bytes(ifname: str) -> Optional[int]:
    """Bytes ``ifname`` has sent, from this process's network namespace (/proc/net/dev)."""
    try:
        with open("/proc/net/dev") as f:
            for line in f:
                name, _, fields = line.partition(":")
                if name.strip() == ifname:
                    return int(fields.split()[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


__all__ = [
    "EmulationUnavailable",
    "Link",
    "link",
    "run_workers",
    "run_workers_with_bar",
    "emulation_problem",
    "parse_rate",
    "parse_delay",
    "format_rate",
    "worker_config",
    "init_gloo",
    "progress",
    "write_result",
    "finish_worker",
    "tx_bytes",
]
