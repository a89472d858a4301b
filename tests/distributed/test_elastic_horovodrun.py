"""Horovod Elastic under ``horovodrun --min-np 1 --max-np 2`` with a discovery script: a worker removed
gracefully (2 -> 1), a worker killed (2 -> 1, the survivor renumbered from rank 1 to rank 0 and rolled
back to its last commit), a worker added (1 -> 2), on the stock ``horovod.torch`` route and the drop-in
(tests/distributed/elastic_torch.py runs the job and logs what each process held); and Keras 2's
``fit`` on ``hvd_compress.keras`` with a worker added (tests/distributed/elastic_keras.py); and
examples/elastic_train.py through a removal and an addition.

Each run checks: the job ends with status 0; the loss falls; every rank ends with the same parameters;
a survivor's residuals are those of its last commit when it re-enters training (continuous across a
graceful reset, rolled back after a failure); a process that joins starts with none (nothing
duplicated); every rank counts the same steps after a reset (the shared index set's leader) and
starts counting afresh; a failure reaches Horovod as ``HorovodInternalError``. With
``register(..., flush=True)`` every commit leaves no residual, so a killed worker takes none with it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from tests.distributed import launch

pytestmark = pytest.mark.timeout(200)

STEPS, CHANGE_AT = 20, 5
#: scenario -> (hosts at the start, processes at the start, processes at the end)
SCENARIOS = {
    "remove": ("localhost:1\n127.0.0.1:1\n", 2, 1),
    "kill": ("localhost:1\n127.0.0.1:1\n", 2, 1),
    "add": ("localhost:1\n", 1, 2),
}


def run_elastic(tmp_path: Path, module: str, scenario: str, *args: str, **env: str) -> Dict[int, List[dict]]:
    """Run the job of ``module`` in ``scenario``; returns each process's events by pid."""
    hosts, start, _ = SCENARIOS[scenario]
    hosts_file, events = tmp_path / "hosts", tmp_path / "events"
    hosts_file.write_text(hosts)
    events.mkdir()
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IEXEC)
    command, environment = launch._command("horovodrun", start, module, [
        *args, "--hosts-file", str(hosts_file), "--events", str(events), "--steps", str(STEPS),
        "--change-at", str(CHANGE_AT)])
    command[command.index("--gloo") + 1:command.index("--gloo") + 1] = [
        "--min-np", "1", "--max-np", "2", "--network-interface", "lo",  # one machine: no interface check
        "--host-discovery-script", str(discovery)]
    environment.update(env)
    done = subprocess.run(command, cwd=launch.ROOT, env=environment, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, launch.output(done)
    logs = {int(path.stem): [dict(json.loads(line), pid=int(path.stem)) for line in path.read_text().splitlines()]
            for path in events.glob("*.jsonl")}
    assert logs, launch.output(done)
    return logs


COMMIT = re.compile(r"epoch (\d+) step (\d+) size (\d+) loss ([\d.]+)")
FINAL = re.compile(r"\[rank (\d)\] test accuracy ([\d.]+)  final parameters sha256 (\w+)")


def test_elastic_example_goes_on_through_a_removal_and_an_addition(tmp_path):
    """examples/elastic_train.py as the README launches it: the test removes ``127.0.0.1`` from the hosts
    file after the first commit, and adds it back after the first commit of the smaller world."""
    launch.require_horovod_torch()
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("localhost:1\n127.0.0.1:1\n")
    discovery = tmp_path / "discover.sh"
    discovery.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IEXEC)
    command, env = launch._command("horovodrun", 2, "examples.elastic_train", ["--epochs", "6"])
    command[command.index("--gloo") + 1:command.index("--gloo") + 1] = [
        "--min-np", "1", "--max-np", "2", "--network-interface", "lo", "--host-discovery-script", str(discovery)]
    process = subprocess.Popen(command, cwd=launch.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    sizes, lines = [], []
    watchdog = threading.Timer(180, lambda: os.killpg(process.pid, 9))
    watchdog.start()
    try:
        for line in process.stdout:
            lines.append(line)
            match = COMMIT.search(line)
            if match:
                sizes.append(int(match.group(3)))
                if sizes == [2]:
                    hosts_file.write_text("localhost:1\n")
                elif sizes[-1] == 1 and sizes.count(1) == 1:
                    hosts_file.write_text("localhost:1\n127.0.0.1:1\n")
        returncode = process.wait()
    finally:
        watchdog.cancel()
    output = "".join(lines)
    assert returncode == 0, output[-4000:]
    changes = [size for at, size in enumerate(sizes) if at == 0 or sizes[at - 1] != size]
    assert changes == [2, 1, 2], (sizes, output[-4000:])
    finals = FINAL.findall(output)
    assert sorted(rank for rank, _, _ in finals) == ["0", "1"], output[-4000:]
    assert len({digest for _, _, digest in finals}) == 1  # every rank ends with the same model
    assert float(finals[0][1]) > 0.8


def _of(log: List[dict], event: str) -> List[dict]:
    return [entry for entry in log if entry["event"] == event]


@pytest.mark.parametrize("route", ["stock", "dropin"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_elastic_job_keeps_compression_state(tmp_path, route, scenario):
    launch.require_horovod_torch()
    logs = run_elastic(tmp_path, "tests.distributed.elastic_torch", scenario, "--route", route, "--scenario", scenario)
    check_job(logs, scenario)


@pytest.mark.parametrize("route", ["stock", "dropin"])
def test_elastic_flush_loses_nothing_with_a_worker_killed(tmp_path, route):
    launch.require_horovod_torch()
    logs = run_elastic(tmp_path, "tests.distributed.elastic_torch", "kill", "--route", route, "--scenario", "kill",
                       "--flush")
    commits = [entry for log in logs.values() for entry in _of(log, "commit")]
    assert commits and all(entry["held"] == 0.0 for entry in commits), commits
    check_job(logs, "kill", flushed=True)


@pytest.mark.parametrize("route, scenario", [("dropin", "remove"), ("stock", "add")])
def test_elastic_auto_decides_again_without_a_false_disagreement(tmp_path, route, scenario):
    launch.require_horovod_torch()
    logs = run_elastic(tmp_path, "tests.distributed.elastic_torch", scenario, "--route", route, "--scenario", scenario,
                       "--measured")
    check_job(logs, scenario)


def test_elastic_keras_fit_with_a_process_added(tmp_path):
    launch.require("horovod.tensorflow.keras")
    logs = run_elastic(tmp_path, "tests.distributed.elastic_keras", "add", TF_USE_LEGACY_KERAS="1")
    check_job(logs, "add")


def check_job(logs: Dict[int, List[dict]], scenario: str, flushed: bool = False) -> None:
    """The checks of the module docstring on the events of every process of one job (``flushed``: every
    commit applied the residuals, so a survivor re-enters holding none)."""
    final = SCENARIOS[scenario][2]

    ends = [entry for log in logs.values() for entry in _of(log, "end")]
    assert len(ends) == final and {entry["size"] for entry in ends} == {final}, ends
    assert sorted(entry["rank"] for entry in ends) == list(range(final))
    for entry in ends[1:]:
        np.testing.assert_array_equal(entry["parameters"], ends[0]["parameters"])

    for pid, log in logs.items():
        enters = [at for at, entry in enumerate(log) if entry["event"] == "enter"]
        if log[enters[0]]["step"] > 0:  # joined a running job: nothing of anyone else's
            assert log[enters[0]]["held"] == 0.0, (pid, log[enters[0]])
        for at in enters[1:]:  # a reset: the residuals of the last commit, continuous or rolled back
            enter = log[at]
            committed = [entry for entry in log[:at] if entry["event"] == "commit"][-1]
            assert committed["step"] == enter["step"]
            assert enter["held"] == pytest.approx(committed["held"], rel=1e-12), (pid, log)
            assert (enter["held"] == 0) == flushed and enter["exchanged"] == 0
        failures = _of(log, "failed")
        assert all(entry["error"] == "horovod.common.exceptions.HorovodInternalError" for entry in failures)
    if scenario == "kill":  # the survivor's step before the failure changed what it held: rolled back
        failed = [entry for log in logs.values() for entry in _of(log, "failed")]
        assert len(failed) == 1 and failed[0]["held"] != pytest.approx(
            [e for e in logs[failed[0]["pid"]] if e["event"] == "commit"][-1]["held"], rel=1e-6), logs
        survivor = next(log for log in logs.values() if _of(log, "end"))
        assert survivor[0]["rank"] == 1 and _of(survivor, "end")[0]["rank"] == 0  # renumbered

    counted = defaultdict(set)  # (world size, step) -> the steps each rank's compressor counted
    for log in logs.values():
        for entry in _of(log, "step"):
            counted[entry["size"], entry["step"]].add(entry["exchanged"])
    assert all(len(values) == 1 for values in counted.values()), dict(counted)
    assert counted[final, min(step for size, step in counted if size == final)] == {1}  # counted afresh

    first = [entry["loss"] for log in logs.values() for entry in _of(log, "step") if entry["step"] == 0]
    assert ends[0]["loss"] < min(first) / 2, (first, ends[0]["loss"])  # the loss on one batch, at the end


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
