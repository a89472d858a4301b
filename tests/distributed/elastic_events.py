"""What the elastic jobs of tests/distributed/test_elastic_horovodrun.py share: each process's events
as JSON lines in ``<folder>/<pid>.jsonl``, every commit logged with the residuals held after it, and a
rewrite of the hosts file that waits for Horovod's driver to notice it."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

from hvd_compress.horovod.elastic import held_residual


def event_log(folder: str, hvd: Any) -> Callable[..., None]:
    """``log(event, **fields)``: one JSON line in this process's file, with its host, rank and world size."""
    path, host = os.path.join(folder, f"{os.getpid()}.jsonl"), os.environ.get("HOROVOD_HOSTNAME", "?")

    def log(event: str, **fields: Any) -> None:
        with open(path, "a") as out:
            out.write(json.dumps(dict(event=event, host=host, rank=hvd.rank(), size=hvd.size(), **fields)) + "\n")

    return log


def log_commits(handler: Any, run: Any, state: Any, log: Callable[..., None]) -> None:
    """After each save of the compression state's ``handler`` (a commit), a ``commit`` event: the step
    (``state.batch``) and the L1 norm of the residuals ``run`` holds then."""
    save = handler.save

    def save_and_log() -> None:
        save()
        log("commit", step=state.batch, held=held_residual(run))

    handler.save = save_and_log


def rewrite_hosts(path: str, hosts: str, state: Any, wait_s: float = 30.0) -> None:
    """Replace the hosts file at once (the discovery script never reads half of it), then wait until
    Horovod's driver has told ``state`` (so that the next commit raises the reset)."""
    with open(path + ".new", "w") as out:
        out.write(hosts)
    os.replace(path + ".new", path)
    deadline = time.monotonic() + wait_s
    while state._host_messages.empty() and time.monotonic() < deadline:
        time.sleep(0.05)
