"""Asynchronous SGD with and without gradient clipping under heavy-tailed noise.

    mpirun -np 4 python examples/async_sgd.py
    mpirun -np 4 python examples/async_sgd.py --arrival --steps 3000

Rank 0 is the parameter server, ranks 1..N-1 workers; the last worker is slow
(injected delays ``--slow``x longer), so its gradients are many updates stale.
Problem: least squares f(x) = ||Ax - b||^2 / (2n) with Student-t(1.5) noise
(infinite variance) added to every gradient. Both runs use the same seeds,
step size and delay schedule; by default the server applies gradients in the
schedule's virtual-clock order (``deterministic=True``: bit-for-bit
reproducible), ``--arrival`` uses real arrival order instead.

The method and its analysis: Erickson & Johansson, arXiv:2606.13287, 2026
(docs/references.md).
Clipping (x <- x - eta * min(1, lambda/||g||) g) converges; without it the rare
huge noise draws, applied late by stale workers too, throw x far away.
"""

import argparse
import os
import sys

if __package__ in (None, ""):  # run as a script: make `hvd_compress` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from examples.parameter_server import async_sgd  # noqa: E402


class HeavyTailedLeastSquares:
    def __init__(self, d=20, n=200, noise=1.0, df=1.5, seed=0):
        rng = np.random.default_rng(seed)
        self.A = rng.standard_normal((n, d))
        self.b = self.A @ rng.standard_normal(d) + 0.1 * rng.standard_normal(n)
        self.n, self.d, self.noise, self.df = n, d, noise, df
        x_star = np.linalg.lstsq(self.A, self.b, rcond=None)[0]
        self.f_star = self._f(x_star)

    def _f(self, x):
        r = self.A @ x - self.b
        return float(r @ r) / (2 * self.n)

    def loss(self, x):  # excess loss f(x) - f*
        return self._f(x) - self.f_star

    def grad(self, x, rng):
        return self.A.T @ (self.A @ x - self.b) / self.n + self.noise * rng.standard_t(self.df, size=self.d)


def main():
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="server updates per run")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--clip", type=float, default=1.0, help="lambda of the clipped run")
    parser.add_argument("--fast", type=float, default=0.001, help="fast workers' injected delay (s)")
    parser.add_argument("--slow", type=float, default=15.0, help="the last worker is this many times slower")
    parser.add_argument("--arrival", action="store_true", help="arrival order instead of the virtual clock")
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        sys.exit("run under mpirun -np N with N >= 2 (rank 0 is the server)")
    problem = HeavyTailedLeastSquares()
    slowest = size - 1

    def schedule(worker, iteration):
        if worker == slowest and size > 2:
            return args.fast * args.slow
        return args.fast * (1 + (worker * 7 + iteration * 3) % 5 / 4)  # 1x to 2x jitter

    if rank == 0:
        order = "arrival order" if args.arrival else "virtual-clock order (deterministic)"
        print(
            f"async SGD: 1 server + {size - 1} workers (worker {slowest} {args.slow:g}x slower), "
            f"{args.steps} updates, lr {args.lr}, Student-t(1.5) gradient noise, {order}"
        )
        print(f"initial excess loss {problem.loss(np.zeros(problem.d)):.4f}")
    for label, lam in ((f"clipped (lambda={args.clip:g})", args.clip), ("unclipped", None)):
        result = async_sgd(
            problem.grad,
            np.zeros(problem.d),
            args.steps,
            args.lr,
            lam,
            loss_fn=problem.loss,
            loss_every=10,
            delay_schedule=schedule,
            deterministic=not args.arrival,
            seed=args.seed,
        )
        if result is None:
            continue
        losses = np.array(result.losses)
        tail = losses[-max(1, len(losses) // 5) :]
        stats = result.delay_stats()
        delays = np.array(result.delays)
        per_worker = {w: float(delays[np.array(result.workers) == w].mean()) for w in result.counts}
        print(
            f"\n{label}: final excess loss {losses[-1]:.4g}  (median of last 20%: {np.median(tail):.4g}, "
            f"max over run: {losses.max():.4g})  {result.clipped}/{args.steps} updates clipped  "
            f"{result.elapsed:.1f} s"
        )
        print(
            f"  delays tau: mean {stats['mean']:.2f}  p50 {stats['p50']:.0f}  p90 {stats['p90']:.0f}  "
            f"p99 {stats['p99']:.0f}  max {stats['max']:.0f}"
        )
        print(
            "  updates per worker: "
            + ", ".join(f"{w}: {c}" for w, c in result.counts.items())
            + "   mean tau per worker: "
            + ", ".join(f"{w}: {t:.1f}" for w, t in per_worker.items())
        )


if __name__ == "__main__":
    main()
