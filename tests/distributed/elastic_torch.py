"""A Horovod Elastic job with compression state, run under ``horovodrun --min-np/--max-np`` with a
discovery script that prints the hosts file ``--hosts-file`` (tests/distributed/test_elastic_horovodrun.py).

Two hosts of one slot each, ``localhost`` and ``127.0.0.1`` (one machine under two names, so Horovod
can drop or blacklist one of them). Every process trains one linear regression with
``TopK(0.05, indices="leader", dense_below=0)`` on the stock ``horovod.torch`` route or the drop-in
``hvd_compress.torch`` (``--measured``: wrapped in ``Auto``; ``--flush``: each commit applies the residuals
first), commits after every
second step, and at step ``--change-at`` the scenario happens:

- ``remove``: the ``localhost`` process rewrites the hosts file without ``127.0.0.1`` (graceful removal);
- ``add``: it rewrites it with ``127.0.0.1`` added (a process joins);
- ``kill``: rank 0 kills itself (SIGKILL) before its step (a failure: the survivor rolls back to the
  last commit, a step before, and becomes rank 0; Horovod blacklists the host).

Each process appends JSON lines to ``<--events>/<pid>.jsonl``: ``enter`` (each entry of the elastic
function: rank, size, step, the L1 norm of the residuals it holds, the steps its compressor counted),
``commit`` (step, residual norm after the commit), ``step`` (after each step: the leader's turn as the compressor counts
it), ``failed`` (an exception out of a step: its type, the residual norm then) and ``end`` (the final
parameters and loss).
"""

from __future__ import annotations

import argparse
import os
import signal

import numpy as np
import torch

from hvd_compress import Auto, TopK
from hvd_compress.torch.elastic import held_residual, register
from tests.distributed.elastic_events import event_log, log_commits, rewrite_hosts


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--route", choices=("stock", "dropin"), required=True)
    parser.add_argument("--scenario", choices=("remove", "add", "kill"), required=True)
    parser.add_argument("--hosts-file", required=True, help="the hosts file the discovery script prints")
    parser.add_argument("--events", required=True, help="a folder for each process's JSON lines")
    parser.add_argument("--measured", action="store_true", help="the compression wrapped in Auto")
    parser.add_argument("--flush", action="store_true", help="register(..., flush=True): commits apply residuals")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--change-at", type=int, default=5, help="an odd step: the steps before it end with a commit")
    return parser.parse_args()


def main() -> None:
    args = parse()
    if args.route == "stock":
        import horovod.torch as hvd
    else:
        import hvd_compress.torch as hvd
    hvd.init()
    host, first_life = os.environ.get("HOROVOD_HOSTNAME", "?"), [True]
    log = event_log(args.events, hvd)

    generator = np.random.default_rng(7)
    inputs = torch.from_numpy(generator.standard_normal((512, 32)).astype(np.float32))
    targets = inputs @ torch.from_numpy(generator.standard_normal((32, 8)).astype(np.float32) / 4)
    torch.manual_seed(hvd.rank())  # processes start apart; Horovod's sync makes them alike
    model = torch.nn.Linear(32, 8)
    compression = TopK(0.05, indices="leader", dense_below=0)
    if args.measured:  # measures compressed against dense by time on every rank, re-measured after a reset
        compression = Auto(compression, warmup=1, decide_every=3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.2)
    optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, batch=0)
    handler = register(state, optimizer if args.route == "dropin" or args.flush else compression, flush=args.flush)
    run = optimizer.compression_state if args.route == "dropin" else compression.state
    log_commits(handler, run, state, log)

    def loss_at(step: int) -> torch.Tensor:
        rows = torch.arange(16) + 16 * ((step * hvd.size() + hvd.rank()) % 32)
        return torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])

    def change(step: int) -> None:
        if step != args.change_at or not first_life[0]:
            return
        if args.scenario == "kill" and hvd.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.scenario in ("remove", "add") and host == "localhost":
            rewrite_hosts(args.hosts_file, "localhost:1\n" + ("127.0.0.1:1\n" if args.scenario == "add" else ""), state)

    @hvd.elastic.run
    def train(state) -> None:
        log("enter", step=state.batch, held=held_residual(run), exchanged=run.exchanged(), first_life=first_life[0])
        while state.batch < args.steps:
            change(state.batch)
            try:
                optimizer.zero_grad()
                loss = loss_at(state.batch)
                loss.backward()
                optimizer.step()
            except BaseException as error:
                log("failed", step=state.batch, error=f"{type(error).__module__}.{type(error).__name__}",
                    held=held_residual(run))
                first_life[0] = False
                raise
            log("step", step=state.batch, exchanged=run.exchanged(), loss=loss.item())
            state.batch += 1
            if state.batch % 2 == 0:
                try:
                    state.commit()
                except BaseException:
                    first_life[0] = False
                    raise
        parameters = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        log("end", step=state.batch, loss=float(loss_at(0)), parameters=parameters.tolist(), held=held_residual(run))

    train(state)


if __name__ == "__main__":
    main()
