"""Workloads for ``examples/parameter_server.py`` (asynchronous SGD), run under ``mpirun``.

``run --clip L|none --steps N --out FILE``: the async SGD runs of :data:`RUNS`
on :class:`Problem` (deterministic order, without and with Top-k 0.1 and TernGrad, and
arrival order); rank 0 writes each run's ``x``, losses, delays, workers and
counts to ``FILE`` (npz, keys ``label/field``).

``contrast --steps N --out FILE``: the same problem with clipped and unclipped
updates (same seeds, step size and schedule, deterministic order); rank 0 writes
both final excess losses.

``die --how exit|hang --timeout T``: worker rank 1 exits abruptly
(``os._exit``) or stops answering after 3 gradients; the job must end with
``WorkerTimeoutError`` naming rank 1.

``fail --how raise|nan|after``: worker rank 1's ``grad_fn`` raises after 3
gradients, or returns NaN (the server rejects it), or the run completes and
rank 1 raises in the script while rank 0 waits in a barrier; the job must end
(aborted) with the cause printed by the rank that had it.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from examples.parameter_server import async_sgd


class Problem:
    """Least squares ``f(x) = ||Ax - b||^2 / (2n)`` with Student-t(df) noise added to the exact gradient."""

    def __init__(self, d: int = 20, n: int = 200, noise: float = 1.0, df: float = 1.5, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.A = rng.standard_normal((n, d))
        self.b = self.A @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n)
        self.n, self.d, self.noise, self.df = n, d, noise, df
        self.x_star = np.linalg.lstsq(self.A, self.b, rcond=None)[0]
        self.f_star = self._f(self.x_star)
        self.x0 = np.zeros(d)

    def _f(self, x: np.ndarray) -> float:
        r = self.A @ x - self.b
        return float(r @ r) / (2 * self.n)

    def loss(self, x: np.ndarray) -> float:
        """Excess loss ``f(x) - f*``."""
        return self._f(x) - self.f_star

    def grad(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        exact = self.A.T @ (self.A @ x - self.b) / self.n
        return exact + self.noise * rng.standard_t(self.df, size=self.d)


def slow_last(size: int, fast: float = 0.001, slow_factor: float = 10.0):
    """Delay schedule: the last worker is ``slow_factor`` times slower; the others jitter 1x-2x."""

    def schedule(worker: int, iteration: int) -> float:
        if worker == size - 1:
            return fast * slow_factor
        return fast * (1 + (worker * 7 + iteration * 3) % 5 / 4)

    return schedule


def arrival_schedule(size: int):
    """Well separated send times: worker 1 every 0.1 s, worker 2 at 0.15 s then every 0.2 s."""

    def schedule(worker: int, iteration: int) -> float:
        if worker == 1:
            return 0.1
        return 0.15 if iteration == 0 else 0.2

    return schedule


SEED = 1
ARRIVAL_STEPS = 9
CONTRAST_STEPS = 600
CONTRAST_LR = 0.05
#: (label, order, compression) of the configurations ``run`` executes
RUNS = [("det", "det", "none"), ("det_topk", "det", "topk"), ("det_terngrad", "det", "terngrad"),
        ("arrival", "arrival", "none")]


def _compressor(name: str):
    if name == "none":
        return None
    from hvd_compress.algorithms import TernGrad, TopK

    if name == "terngrad":
        return lambda worker: TernGrad(dense_below=0)
    return lambda worker: TopK(0.1, dense_below=0)


def main() -> None:
    from mpi4py import MPI

    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["run", "contrast", "die", "fail"])
    parser.add_argument("--clip", default="none")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--how", choices=["exit", "hang", "raise", "nan", "after"], default="exit")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    clip = None if args.clip == "none" else float(args.clip)

    if args.command == "run":  # several configurations, one launch (each mpirun start costs seconds)
        problem = Problem()
        saved = {}
        for label, order, compress in RUNS:
            schedule = slow_last(size) if order == "det" else arrival_schedule(size)
            steps = args.steps if order == "det" else ARRIVAL_STEPS
            result = async_sgd(
                problem.grad,
                problem.x0,
                steps,
                args.lr,
                clip,
                loss_fn=problem.loss,
                compression=_compressor(compress),
                delay_schedule=schedule,
                deterministic=order == "det",
                timeout=30.0,
                seed=SEED,
            )
            if result is not None:
                saved.update(
                    {
                        f"{label}/x": result.x,
                        f"{label}/losses": np.array(result.losses),
                        f"{label}/delays": np.array(result.delays),
                        f"{label}/workers": np.array(result.workers),
                        f"{label}/counts": np.array([result.counts[w] for w in range(1, size)]),
                        f"{label}/clipped": np.array(result.clipped),
                    }
                )
        if saved:
            np.savez(args.out, **saved)
    elif args.command == "contrast":
        problem = Problem()
        finals = {}
        for name, lam in (("clipped", 1.0), ("unclipped", None)):
            result = async_sgd(
                problem.grad,
                problem.x0,
                args.steps,
                CONTRAST_LR,
                lam,
                loss_fn=problem.loss,
                loss_every=10,
                delay_schedule=slow_last(size, slow_factor=15),
                deterministic=True,
                timeout=30.0,
                seed=3,
            )
            if result is not None:
                tail = np.array(result.losses[-len(result.losses) // 5 :])
                finals[name] = (result.losses[-1], float(np.median(tail)), max(result.delays))
        if comm.Get_rank() == 0:
            np.savez(args.out, **{k: np.array(v) for k, v in finals.items()})
    elif args.command == "fail":
        problem = Problem()
        rank = comm.Get_rank()
        calls = [0]

        def grad(x, rng):
            calls[0] += 1
            g = problem.grad(x, rng)
            if rank == 1 and calls[0] > 3 and args.how == "raise":
                raise RuntimeError("injected failure in grad_fn on rank 1")
            if rank == 1 and calls[0] > 3 and args.how == "nan":
                g[2] = np.nan
            return g

        steps = 20 if args.how == "after" else 10_000
        async_sgd(grad, problem.x0, steps, 0.01, 1.0, delay_schedule=lambda w, i: 0.001, timeout=30.0)
        if args.how == "after":
            if rank == 1:
                raise RuntimeError("injected failure after async_sgd on rank 1")
            comm.Barrier()  # rank 0 waits for a rank that will never come
        print(f"rank {rank}: finished without noticing the failure", flush=True)
    else:  # die
        problem = Problem()
        rank = comm.Get_rank()
        calls = [0]

        def grad(x, rng):
            calls[0] += 1
            if rank == 1 and calls[0] > 3:
                if args.how == "exit":
                    os._exit(0)
                time.sleep(3600)
            return problem.grad(x, rng)

        async_sgd(
            grad, problem.x0, 10_000, 0.01, 1.0, delay_schedule=lambda w, i: 0.001, timeout=args.timeout
        )
        print(f"rank {rank}: finished without noticing the dead worker", flush=True)


if __name__ == "__main__":
    main()
