"""Two "nodes" on an emulated link: ``ci/netns_cluster.sh up 2 1gbit 0.1ms``.

A 2-process gloo ``torch.distributed`` job, one process per network namespace
(10.77.0.1 and 10.77.0.2, started with ``ip netns exec``), checks an allreduce
result and that sending 10 MiB takes at least the time 1 Gbit/s implies (with
slack): the traffic really crosses the shaped veth link. Skipped when not root,
without ``ip``/``tc``, or when namespaces cannot be created (CI containers often
forbid it).

The same file is the worker (``python tests/studies/test_netns.py worker RANK WORLD MODE``);
mode ``bench`` times a dense allreduce of ResNet-18's 11.7M fp32 against the
allgather of its 1% sparse payload (fp32 values + int32 indices)::

    ci/netns_cluster.sh up 2 1gbit 0.1ms
    for r in 0 1; do ci/netns_cluster.sh run $r .venv/bin/python tests/studies/test_netns.py worker $r 2 bench & done; wait
    ci/netns_cluster.sh down
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ci" / "netns_cluster.sh"
RATE_BITS = 1e9  # the "1gbit" below
BYTES = 10 * 2**20  # the timed transfer
SLACK = 0.8  # the transfer may beat RATE by 20% (tbf burst, timer granularity), not more
PORT = 29577


# --------------------------------------------------------------------------- #
# Worker: runs inside a namespace
# --------------------------------------------------------------------------- #
def worker(rank: int, world: int, mode: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://10.77.0.1:{PORT}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    result = {"rank": rank}
    if mode == "check":
        x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(x)
        expected = torch.arange(1000, dtype=torch.float32) * (world * (world + 1) / 2)
        result["allreduce_ok"] = bool(torch.equal(x, expected))
        buf = torch.ones(BYTES // 4) * (rank + 1)
        times = []
        for _ in range(2):
            dist.barrier()
            t = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf[:1], 1)  # ack: the time covers delivery, not just the local send
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf[:1], 0)
            times.append(time.perf_counter() - t)
        result["transfer_s"] = min(times)
        result["received_ok"] = bool(rank != 1 or torch.all(buf == 1).item())
    elif mode == "bench":
        d = 11_689_512  # ResNet-18's parameters
        k = -(-d // 100)  # density 1%
        grad = torch.randn(d, generator=torch.Generator().manual_seed(rank))
        payload = torch.empty(2 * k, dtype=torch.int32)  # k fp32 values then k int32 indices, one buffer
        payload[:k] = grad[:k].view(torch.int32)
        payload[k:] = torch.randperm(d, dtype=torch.int32)[:k]
        gathered = [torch.empty_like(payload) for _ in range(world)]

        def timed(fn, repeats):
            best = float("inf")
            for _ in range(repeats):
                dist.barrier()
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            return best

        result["d"], result["k"] = d, k
        result["dense_allreduce_s"] = timed(lambda: dist.all_reduce(grad.clone()), 3)
        result["sparse_allgather_s"] = timed(lambda: dist.all_gather(gathered, payload), 5)
        result["dense_bytes"], result["sparse_bytes"] = 4 * d, 8 * k
        t = time.perf_counter()
        torch.topk(grad.abs(), k, sorted=False)
        result["torch_topk_s"] = time.perf_counter() - t
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- #
# Driver (used by the test and by hand)
# --------------------------------------------------------------------------- #
def run_job(mode: str, prefix: str, timeout: float = 120.0):
    """Start one worker per namespace, wait, return their RESULT dicts (rank order)."""
    env = dict(os.environ, HVDC_PREFIX=prefix, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [str(SCRIPT), "run", str(r), sys.executable, __file__, "worker", str(r), "2", mode],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    results = []
    for out in outputs:
        line = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert line, out[-3000:]
        results.append(json.loads(line[-1][len("RESULT ") :]))
    return results


def test_two_namespaces_allreduce_and_rate():
    import pytest

    prefix = "hvdt" + uuid.uuid4().hex[:4]  # never touches a user's hvdc* cluster
    from benchmarks.cluster import emulation_problem

    reason = emulation_problem()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, HVDC_PREFIX=prefix)
    up = subprocess.run([str(SCRIPT), "up", "2", "1gbit", "0.1ms"], env=env, capture_output=True, text=True)
    try:
        if up.returncode != 0 and (
            "Operation not permitted" in up.stderr or "qdisc kind is unknown" in up.stderr
        ):
            pytest.skip(f"namespace cluster not possible here: {up.stderr.strip()[-500:]}")
        assert up.returncode == 0, up.stdout + up.stderr
        results = run_job("check", prefix, timeout=60)
    finally:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in listed, f"down left namespaces behind: {listed}"

    assert all(r["allreduce_ok"] for r in results), results
    assert all(r["received_ok"] for r in results), results
    floor = BYTES * 8 / RATE_BITS
    seconds = results[0]["transfer_s"]
    print(
        f"10 MiB over the emulated 1 Gbit/s link: {seconds * 1e3:.1f} ms (rate implies {floor * 1e3:.1f} ms)"
    )
    assert (
        seconds >= SLACK * floor
    ), f"10 MiB took {seconds:.4f} s < {SLACK} x {floor:.4f} s: link not shaped?"
    assert seconds < 20 * floor, f"10 MiB took {seconds:.3f} s: link far slower than 1 Gbit/s"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(__doc__)
