"""Communication time vs world size N and bandwidth: dense allreduce, sparse allgather, TernGrad.

The model (alpha-beta, per-rank link of ``B`` bytes/s full duplex, ``alpha`` seconds
per sequential message), for a gradient of ``d`` fp32 elements and density
``rho`` (``k = max(1, ceil(rho d))``, ``reference.num_selected``):

* dense fp32, ring allreduce of ``P = 4d``::

      T_dense = 2 (N-1) alpha + 2 (N-1)/N * 4d / B

* sparse (Top-k, RegTop-k; Gaussian-k about the same), as ``BucketExchange``
  sends it: two allgathers (k int32 indices, k fp32 values) started together::

      T_sparse = (N-1) alpha + (N-1) * 8k / B

* shared index set (``indices="leader"``/``"aggregate"``, ``SharedIndexCodec``): the ``k`` values
  at one index set common to every rank, summed by a ring allreduce; the leader's ``k`` int32
  indices first, by an allreduce of their own (the other ranks add zeros)::

      T_leader    = 4 (N-1) alpha + 2 (N-1)/N * 8k / B
      T_aggregate = 2 (N-1) alpha + 2 (N-1)/N * 4k / B

  independent of N in bytes, as the dense allreduce; against an fp16 dense allreduce
  (``2 (N-1)/N 2d``) the bandwidth terms never cross while ``4k < d`` (leader) or ``2k < d``
  (aggregate); only the leader's extra latency term can catch up, at
  ``N - 1 = (2d - 8k) / (alpha B)`` (ring allreduce latency);

* TernGrad with a shared scale: an allreduce-Max of the scale, then the codes
  as an allreduce of ``lanes = ceil(d / floor(32 / ceil(log2(2N+1))))`` int32
  lanes, or, where that moves fewer bytes (``wire.ternary_wire_format``:
  ``N * ceil(d/4) < 2 * 4 lanes``), an allgather of 2-bit codes::

      T_tern = 2 (N-1) alpha + [2 (N-1) alpha + 2 (N-1)/N * 4 lanes / B]  or  [(N-1) alpha + (N-1) ceil(d/4) / B]

Sparse allgather grows linearly with N; dense allreduce tends to ``8d/B``. The
bandwidth terms cross where ``(N-1) 8k = 2 (N-1)/N 4d``, i.e. ``N k = d``:
exactly the library's ``Sparsifier.dense_is_cheaper`` rule (``N k >= numel``:
send dense). With the latency terms, sparse has one ``(N-1) alpha`` less, so
the crossover moves to ``N = 8d / (8k - alpha B)`` (when ``8k > alpha B``).

Measured points: for each N in ``ranks`` (default 2, 4, 8) the real collectives
of the library's communicator (:class:`TorchDistCommunicator`, gloo) run on N
processes over the emulated link (``ci/netns_cluster.sh``; ``--link none``:
localhost): the dense fp32 allreduce of ``d`` elements, the two sparse
allgathers, TernGrad's scale allreduce-Max and its code collective (``d`` codes
packed by the kernels as ``wire.ternary_wire_format`` says: the tensor the bucket
codec sends), and two latency probes
(a one-element allreduce and allgather). Each is timed ``repeats`` times after
a barrier; per repeat the slowest rank counts; the median is reported.

Per link, ``alpha`` and an effective bandwidth ``B_eff`` are fitted to all
points (least squares on relative error); the model with the nominal ``B`` and
its own fitted ``alpha`` is reported too, with both models' relative errors.
Without measurements (``measure="none"``) the model uses ``alpha`` = the link's
one-way delay. Outputs (in ``out``): ``scaling.json``, ``scaling.png`` (model
curves and measured points per link) and tables.
"""

from __future__ import annotations

import functools
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from benchmarks import cluster
from benchmarks.output import describe_machine, publish
from benchmarks import report
from benchmarks.compress import format_size
from benchmarks.wire import numel, resnet18_shapes
from hvd_compress.algorithms import TopK
from hvd_compress.algorithms.base import check_ratio
from hvd_compress.kernels.reference import num_selected
from hvd_compress.wire import ternary_lanes, ternary_wire_format, two_bit_bytes

MODULE = "benchmarks.scaling"
DEFAULT_RANKS = (2, 4, 8)
DEFAULT_RATES = ("1gbit", "10gbit")
MAX_RANKS = 512
#: Measured collectives, in order; the model's name for each.
COLLECTIVES = ("latency allreduce", "latency allgather", "dense allreduce", "sparse allgather", "shared allreduce",
               "terngrad")
CURVES = ("dense", "dense fp16", "sparse", "shared leader", "shared aggregate", "terngrad")
TABLE_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
#: how far the break-even N against an fp16 dense allreduce is looked for
BREAK_EVEN_MAX_N = 10_000


# ===================================================================== model
def terms(collective: str, n: int, d: int, ratio: float) -> Tuple[float, float]:
    """``(latency count L, bytes W)`` of a collective: its time is ``L alpha + W / B``."""
    if n < 2:
        return 0.0, 0.0
    ring_ar = 2.0 * (n - 1) / n  # bytes sent per byte allreduced
    if collective in ("dense", "dense allreduce"):
        return 2.0 * (n - 1), ring_ar * 4 * d
    if collective == "dense fp16":
        return 2.0 * (n - 1), ring_ar * 2 * d
    if collective in ("sparse", "sparse allgather"):
        return float(n - 1), (n - 1) * 8.0 * num_selected(d, ratio)
    if collective in ("shared leader", "shared allreduce"):
        return 4.0 * (n - 1), ring_ar * 8.0 * num_selected(d, ratio)
    if collective == "shared aggregate":
        return 2.0 * (n - 1), ring_ar * 4.0 * num_selected(d, ratio)
    if collective == "terngrad":
        scale = 2.0 * (n - 1)  # allreduce-Max of the 4-byte scale: latency only
        if ternary_wire_format(d, n) == "allreduce":
            return scale + 2.0 * (n - 1), ring_ar * 4 * ternary_lanes(d, n)
        return scale + (n - 1), (n - 1) * float(two_bit_bytes(d))
    if collective == "latency allreduce":
        return 2.0 * (n - 1), ring_ar * 4
    if collective == "latency allgather":
        return float(n - 1), (n - 1) * 4.0
    raise ValueError(f"hvd_compress: unknown collective {collective!r}")


def seconds(collective: str, n: int, d: int, ratio: float, alpha: float, bytes_per_second: float) -> float:
    """Model time of ``collective`` on ``n`` ranks: ``L alpha + W / B``."""
    latency, nbytes = terms(collective, n, d, ratio)
    return latency * alpha + nbytes / bytes_per_second


def crossover(
    d: int, ratio: float, alpha: float, bytes_per_second: float, against: str = "dense", max_n: int = 100_000,
    sparse_kind: str = "sparse",
) -> Optional[int]:
    """Smallest N >= 2 where ``sparse_kind`` (the allgather, or a shared index set) takes at least as long as
    ``against``; None up to ``max_n``."""
    for n in range(2, max_n + 1):
        sparse = seconds(sparse_kind, n, d, ratio, alpha, bytes_per_second)
        if sparse >= (1 - 1e-12) * seconds(against, n, d, ratio, alpha, bytes_per_second):  # float ties count
            return n
    return None


def crossover_closed_form(d: int, ratio: float, alpha: float, bytes_per_second: float) -> Optional[float]:
    """``N = 8d / (8k - alpha B)``: where the sparse and dense models meet (None if never)."""
    k = num_selected(d, ratio)
    gap = 8.0 * k - alpha * bytes_per_second
    return 8.0 * d / gap if gap > 0 else None


def library_crossover(d: int, ratio: float, max_n: int = 100_000) -> Optional[int]:
    """Smallest N at which ``Sparsifier.dense_is_cheaper(d)`` (``N k >= d``) sends a tensor dense."""
    sparsifier = TopK(ratio)
    for n in range(2, max_n + 1):
        if sparsifier.bind(0, n).dense_is_cheaper(d):
            return n
    return None


def curves(d: int, ratio: float, alpha: float, bytes_per_second: float, max_n: int) -> Dict[str, List[float]]:
    ns = list(range(2, max_n + 1))
    out: Dict[str, List[float]] = {"n": ns}
    for name in CURVES:
        out[f"{name}_s"] = [seconds(name, n, d, ratio, alpha, bytes_per_second) for n in ns]
    return out


def fit(points: Sequence[Dict[str, Any]]) -> Tuple[float, float]:
    """``(alpha, B_eff)`` minimizing the relative error of ``L alpha + W / B`` (both kept >= 0)."""
    rows = np.array([[p["latency_terms"] / p["seconds"], p["bytes"] / p["seconds"]] for p in points])
    ones = np.ones(len(points))
    alpha, inverse = np.linalg.lstsq(rows, ones, rcond=None)[0]
    if alpha < 0:
        alpha, inverse = 0.0, float(rows[:, 1] @ ones / (rows[:, 1] @ rows[:, 1]))
    elif inverse <= 0:
        inverse, alpha = 0.0, float(rows[:, 0] @ ones / (rows[:, 0] @ rows[:, 0]))
    return float(alpha), (1.0 / inverse if inverse > 0 else math.inf)


def fit_alpha(points: Sequence[Dict[str, Any]], bytes_per_second: float) -> float:
    """``alpha`` minimizing the relative error with the bandwidth fixed at ``bytes_per_second``."""
    a = np.array([p["latency_terms"] / p["seconds"] for p in points])
    rest = np.array([1.0 - p["bytes"] / bytes_per_second / p["seconds"] for p in points])
    return max(0.0, float(a @ rest / (a @ a)))


# ==================================================================== worker
def _collectives(comm: Any, d: int, ratio: float, seed: int) -> Dict[str, Callable[[], None]]:
    """The measured collectives on this rank's buffers, as the library's exchange issues them."""
    import torch

    from hvd_compress.kernels import torch_ops

    n, rank = comm.size, comm.rank
    k = num_selected(d, ratio)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    dense = torch.randn(d, generator=gen)
    indices = torch.randint(0, d, (k,), dtype=torch.int32, generator=gen)
    values = torch.randn(k, generator=gen)
    probe = torch.ones(1)
    # d TernGrad codes in {-1, 0, 1} packed as the bucket codec sends them for N ranks (int32 lanes
    # or 2-bit codes); their scale max|g| travels first, in an allreduce-Max
    codes = torch.randint(-1, 2, (d,), dtype=torch.int8, generator=gen)
    ternary_format = ternary_wire_format(d, n)
    packed = torch_ops.pack_ternary(codes, n) if ternary_format == "allreduce" else torch_ops.pack_two_bit(codes)
    scale = dense.abs().max().reshape(1)

    def wait(handle: Any) -> None:
        comm.wait(handle)

    def sparse() -> None:
        handles = [comm.allgather_async(t, "sparse", [k] * n) for t in (indices, values)]
        for h in handles:
            wait(h)

    def shared() -> None:  # the leader's indices, then the values at them (SharedIndexCodec's two rounds)
        wait(comm.allreduce_async(indices if rank == 0 else torch.zeros_like(indices), comm.SUM, "leader"))
        wait(comm.allreduce_async(values, comm.SUM, "values"))

    def terngrad() -> None:
        wait(comm.allreduce_async(scale, comm.MAX, "scales"))
        if ternary_format == "allreduce":
            wait(comm.allreduce_async(packed, comm.SUM, "lanes"))
        else:
            wait(comm.allgather_async(packed, "codes2bit", [packed.shape[0]] * n))

    return {
        "latency allreduce": lambda: wait(comm.allreduce_async(probe, comm.SUM, "probe")),
        "latency allgather": lambda: wait(comm.allgather_async(probe, "probe", [1] * n)),
        "dense allreduce": lambda: wait(comm.allreduce_async(dense, comm.SUM, "dense")),
        "sparse allgather": sparse,
        "shared allreduce": shared,
        "terngrad": terngrad,
    }


def worker(config: Dict[str, Any]) -> None:
    """One rank: every collective, one warm-up and ``repeats`` timed runs each."""
    import torch.distributed as dist

    from hvd_compress.transport.torch_dist import TorchDistCommunicator

    cluster.init_gloo(config)
    comm = TorchDistCommunicator()
    timings: Dict[str, List[float]] = {}
    for name, fn in _collectives(comm, config["numel"], config["ratio"], config["seed"]).items():
        fn()
        times = []
        for _ in range(config["repeats"]):
            dist.barrier()
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        timings[name] = times
        cluster.progress(f"N={comm.size} {name}")
    cluster.finish_worker(config, {"seconds": timings})


# ==================================================================== driver
def _points(n: int, ranks: List[Dict[str, Any]], d: int, ratio: float) -> List[Dict[str, Any]]:
    """Per collective: per repeat the slowest rank, the median over repeats, and the model's terms."""
    points = []
    for name in COLLECTIVES:
        slowest = [max(t) for t in zip(*(r["seconds"][name] for r in ranks))]
        latency, nbytes = terms(name, n, d, ratio)
        points.append(
            {
                "ranks": n,
                "collective": name,
                "seconds": statistics.median(slowest),
                "seconds_min": min(slowest),
                "latency_terms": latency,
                "bytes": nbytes,
                "wire_format": ternary_wire_format(d, n) if name == "terngrad" else None,
            }
        )
    return points


def _errors(points: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    """``|model / measured - 1|`` over all points and over the payload collectives (no latency probes)."""
    summary = {}
    payload = [p for p in points if not p["collective"].startswith("latency")]
    for label, group in (("", points), ("payload_", payload)):
        errors = [abs(p[key] / p["seconds"] - 1) for p in group]
        if errors:
            summary[f"{label}median_abs_rel_error"] = statistics.median(errors)
            summary[f"{label}max_abs_rel_error"] = max(errors)
    return summary


def _model_link(
    lk: Dict[str, Any], points: List[Dict[str, Any]], d: int, ratio: float, alpha0: float, max_n: int
) -> Dict[str, Any]:
    """Fits, model values at the measured points, errors, crossovers and curves for one link."""
    nominal = None if lk["bits_per_second"] is None else lk["bits_per_second"] / 8
    models: Dict[str, Any] = {}
    if points:
        alpha, bandwidth = fit(points)
        models["fit"] = {"alpha_s": alpha, "bytes_per_second": bandwidth}
        if nominal:
            models["nominal"] = {"alpha_s": fit_alpha(points, nominal), "bytes_per_second": nominal}
    elif nominal:
        models["nominal"] = {"alpha_s": alpha0, "bytes_per_second": nominal}
    for key, m in models.items():
        m["efficiency"] = m["bytes_per_second"] / nominal if nominal else None
        for p in points:
            p[f"model_{key}_s"] = seconds(
                p["collective"], p["ranks"], d, ratio, m["alpha_s"], m["bytes_per_second"]
            )
        if points:
            m.update(_errors(points, f"model_{key}_s"))
        m["crossover_vs_dense"] = crossover(d, ratio, m["alpha_s"], m["bytes_per_second"])
        m["crossover_closed_form"] = crossover_closed_form(d, ratio, m["alpha_s"], m["bytes_per_second"])
        m["crossover_vs_terngrad"] = crossover(d, ratio, m["alpha_s"], m["bytes_per_second"], "terngrad")
        m["break_even_vs_fp16"] = {
            kind: crossover(d, ratio, m["alpha_s"], m["bytes_per_second"], "dense fp16", max_n=BREAK_EVEN_MAX_N,
                            sparse_kind=kind)
            for kind in ("sparse", "shared leader", "shared aggregate")
        }
        m["curves"] = curves(d, ratio, m["alpha_s"], m["bytes_per_second"], max_n)
    return dict(lk, points=points, models=models, measured_speedups=_speedups(points))


def _speedups(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per measured N: dense allreduce time / sparse allgather time, and / TernGrad's."""
    by = {(p["ranks"], p["collective"]): p["seconds"] for p in points}
    return [
        {
            "ranks": n,
            "dense_over_sparse": by[(n, "dense allreduce")] / by[(n, "sparse allgather")],
            "dense_over_shared": by[(n, "dense allreduce")] / by[(n, "shared allreduce")],
            "dense_over_terngrad": by[(n, "dense allreduce")] / by[(n, "terngrad")],
        }
        for n in sorted({p["ranks"] for p in points})
    ]


def run(
    ranks: Sequence[int] = DEFAULT_RANKS,
    rates: Sequence[str] = DEFAULT_RATES,
    link: str = "emulated",
    measure: bool = True,
    ratio: float = 0.01,
    scale: float = 1.0,
    repeats: int = 5,
    delay: str = "0.1ms",
    max_ranks: int = MAX_RANKS,
    seed: int = 0,
    out: Optional[str] = "results",
    progress: bool = True,
    plot: bool = True,
    stdout: Any = None,
) -> Dict[str, Any]:
    """Measure (unless ``measure`` is False), fit, write ``scaling.json`` / ``scaling.png``, print tables.

    ``link="none"`` measures on localhost (one unshaped link, ``rates`` unused
    except by a model-only run).
    """
    report.require_packages(torch=measure, plots=plot and out is not None)
    ratio = check_ratio(ratio)
    ranks, rates, max_ranks, repeats = _check(ranks, rates, link, measure, repeats, delay, max_ranks)
    d = sum(numel(s) for _, s in resnet18_shapes(scale))
    settings = _settings(ranks, rates, link, measure, ratio, scale, repeats, delay, max_ranks, seed, d)
    plan: List[Optional[str]] = list(rates) if link == "emulated" or not measure else [None]
    bar = report.progress_bar(
        len(plan) * len(ranks) * len(COLLECTIVES) if measure else 1, "bench scaling", "meas", progress
    )
    links: List[Dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for rate in plan:
            if measure:
                lk, points = _measure(rate, ranks, delay, d, ratio, repeats, seed, bar)
            else:
                lk, points = cluster.Link(0, rate, delay).describe(), []
                lk.update(
                    shaping="model only", delay=delay, note="not measured: model with alpha = the delay"
                )
                bar.update()
            links.append(_model_link(lk, points, d, ratio, cluster.parse_delay(delay), max_ranks))
    finally:
        bar.close()
    results = {
        "benchmark": "scaling",
        "machine": describe_machine(),
        "settings": settings,
        "wall_seconds": time.perf_counter() - started,
        "library_rule": {
            "rule": "Sparsifier.dense_is_cheaper: N * k >= numel",
            "crossover_n": library_crossover(d, ratio),
        },
        "links": links,
    }
    return publish(results, out, "scaling", write_plot if plot else None, print_tables, stdout)


def _measure(rate, ranks, delay, d, ratio, repeats, seed, bar) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Every world size in ``ranks`` on one link (one cluster of max(ranks) nodes)."""
    points: List[Dict[str, Any]] = []
    config = {"numel": d, "ratio": ratio, "repeats": repeats, "seed": seed}
    with cluster.link(max(ranks), rate, delay) as lk:
        for n in ranks:
            timeout = 300 + 60 * n * repeats * max(1.0, d / 1e7)
            results = cluster.run_workers_with_bar(lk, n, MODULE, config, timeout, bar)
            points.extend(_points(n, results, d, ratio))
        return lk.describe(), points


def _check(ranks, rates, link, measure, repeats, delay, max_ranks):
    ranks = sorted({int(n) for n in ranks})
    if measure and (not ranks or ranks[0] < 2):
        raise ValueError(f"hvd_compress: measured ranks must be at least 2, got {list(ranks)}")
    if link not in ("emulated", "none"):
        raise ValueError(f"hvd_compress: link must be emulated or none, got {link!r}")
    rates = list(rates)
    if (link == "emulated" or not measure) and not rates:
        raise ValueError("hvd_compress: give at least one rate, e.g. 1gbit")
    for rate in rates:
        cluster.parse_rate(rate)
    cluster.parse_delay(delay)
    if int(repeats) < 1:
        raise ValueError(f"hvd_compress: repeats must be at least 1, got {repeats}")
    max_ranks = max(int(max_ranks), max(ranks, default=2), 2)
    return ranks, rates, max_ranks, int(repeats)


def _settings(
    ranks, rates, link, measure, ratio, scale, repeats, delay, max_ranks, seed, d
) -> Dict[str, Any]:
    return {
        "ranks": ranks if measure else [],
        "rates": rates,
        "link": link,
        "measure": "collectives" if measure else "none",
        "ratio": ratio,
        "scale": scale,
        "numel": d,
        "k": num_selected(d, ratio),
        "repeats": repeats,
        "delay": delay,
        "max_ranks": max_ranks,
        "seed": seed,
        "gradient": "ResNet-18 parameter count"
        + ("" if scale == 1 else f" (channel widths x {scale:g})")
        + ", one fused fp32 buffer",
        "transport": "TorchDistCommunicator over torch.distributed gloo (the library's communicator)",
        "statistic": "per repeat the slowest rank; median over repeats",
        "load_average_at_start": report.load_average(),
        "model": {
            "dense": "2(N-1) alpha + 2(N-1)/N * 4d / B",
            "dense fp16": "2(N-1) alpha + 2(N-1)/N * 2d / B",
            "sparse": "(N-1) alpha + (N-1) * 8k / B   (two concurrent allgathers: k int32 + k fp32)",
            "shared leader": "4(N-1) alpha + 2(N-1)/N * 8k / B   (allreduce of the leader's k int32 indices, then "
                             "of the k fp32 values)",
            "shared aggregate": "2(N-1) alpha + 2(N-1)/N * 4k / B   (allreduce of the k fp32 values)",
            "terngrad": "2(N-1) alpha [scale Max] + 2(N-1) alpha + 2(N-1)/N * 4 lanes / B   (packed allreduce), "
            "or + (N-1) alpha + (N-1) ceil(d/4) / B (2-bit allgather, where N ceil(d/4) < 8 lanes)",
            "lanes": "ceil(d / floor(32 / ceil(log2(2N+1))))",
            "crossover": "bandwidth terms equal at N k = d; with latency at N = 8d / (8k - alpha B)",
            "fit": "alpha and B_eff by least squares on relative error over every measured point of a link",
        },
    }


# -------------------------------------------------------------------- output
def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{1e3 * value:.2f}"


def _describe_model(key: str, m: Dict[str, Any]) -> str:
    eff = f" ({m['efficiency']:.2f} of nominal)" if m.get("efficiency") is not None else ""
    text = f"{key}: alpha {1e6 * m['alpha_s']:.0f} us, B {8 * m['bytes_per_second'] / 1e9:.3g} Gbit/s{eff}"
    if "median_abs_rel_error" in m:
        text += (
            f"; |model/measured - 1| median {m['median_abs_rel_error']:.0%}, max {m['max_abs_rel_error']:.0%}"
            f" (dense, sparse, TernGrad only: median {m['payload_median_abs_rel_error']:.0%}, "
            f"max {m['payload_max_abs_rel_error']:.0%})"
        )
    return text


def print_tables(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(
        f"Communication time vs N: d = {format_size(s['numel'])} fp32, ratio {s['ratio']:g} (k = {s['k']}); "
        f"{s['transport']}"
    )
    for lk in results["links"]:
        say(f"\nLink {cluster.format_rate(lk['bits_per_second'])}: {lk['note']}")
        for key, m in lk["models"].items():
            say(f"  model {_describe_model(key, m)}")
        if lk["points"]:
            keys = list(lk["models"])
            head = "".join(f" {'model ' + k:>14} {'err':>6}" for k in keys)
            say(f"  {'N':>3} {'collective':<18} {'measured ms':>11}{head}")
            for p in lk["points"]:
                cells = "".join(
                    f" {_ms(p[f'model_{k}_s']):>14} {p[f'model_{k}_s'] / p['seconds'] - 1:>+6.0%}"
                    for k in keys
                )
                say(f"  {p['ranks']:>3} {p['collective']:<18} {_ms(p['seconds']):>11}{cells}")
            ratios = ", ".join(
                f"N={r['ranks']}: {r['dense_over_sparse']:.1f}x / {r['dense_over_shared']:.1f}x / "
                f"{r['dense_over_terngrad']:.1f}x"
                for r in lk["measured_speedups"]
            )
            say(f"  measured dense time / sparse allgather, / shared allreduce, / TernGrad: {ratios}")
        _print_model_table(lk, stdout)
    rule = results["library_rule"]
    say(f"\nLibrary rule ({rule['rule']}): dense from N = {rule['crossover_n']}")


def _print_model_table(lk: Dict[str, Any], stdout: Any) -> None:
    say = functools.partial(print, file=stdout)
    key = "fit" if "fit" in lk["models"] else "nominal"
    m = lk["models"][key]
    c = m["curves"]
    say(f"  model ({key}) in ms:")
    ns = [n for n in TABLE_RANKS if n <= c["n"][-1]]
    say(f"  {'N':>16}" + "".join(f"{n:>9}" for n in ns))
    for name in CURVES:
        say(f"  {name:>16}" + "".join(f"{_ms(c[f'{name}_s'][n - 2]):>9}" for n in ns))
    say(
        f"  sparse allgather stops paying at N >= {m['crossover_vs_dense']} vs dense "
        f"(closed form {m['crossover_closed_form'] and round(m['crossover_closed_form'], 1)}), "
        f"N >= {m['crossover_vs_terngrad']} vs TernGrad"
    )
    even = m["break_even_vs_fp16"]
    say("  break-even N against an fp16 dense allreduce: " + ", ".join(
        f"{kind} {even[kind] if even[kind] is not None else f'> {BREAK_EVEN_MAX_N:,}'}" for kind in even))


def write_plot(results: Dict[str, Any], path: Path) -> None:
    """One panel per link: model curves (log-log) and measured points; crossover marked."""
    links = results["links"]
    fig, axes = report.pyplot().subplots(1, len(links), figsize=(6 * len(links), 4.6), squeeze=False)
    colors = dict(zip(CURVES, ("black", "gray", "tab:blue", "tab:green", "tab:olive", "tab:orange")))
    measured = {"dense": "dense allreduce", "sparse": "sparse allgather", "shared leader": "shared allreduce",
                "terngrad": "terngrad"}
    for ax, lk in zip(axes[0], links):
        for key, m in lk["models"].items():
            style = "-" if key == "fit" or len(lk["models"]) == 1 else ":"
            for name in CURVES:
                label = f"{name} model ({key})"
                ax.plot(
                    m["curves"]["n"],
                    [1e3 * v for v in m["curves"][f"{name}_s"]],
                    style,
                    color=colors[name],
                    label=label,
                    linewidth=1.5 if style == "-" else 1,
                )
        for name in CURVES:
            pts = [p for p in lk["points"] if p["collective"] == measured.get(name)]
            if pts:
                ax.plot(
                    [p["ranks"] for p in pts],
                    [1e3 * p["seconds"] for p in pts],
                    "o",
                    color=colors[name],
                    label=f"{name} measured",
                )
        main = lk["models"].get("fit") or lk["models"].get("nominal")
        if main and main["crossover_vs_dense"]:
            ax.axvline(
                main["crossover_vs_dense"],
                color="tab:red",
                linestyle="--",
                linewidth=1,
                label=f"sparse = dense at N={main['crossover_vs_dense']}",
            )
        rule = results["library_rule"]["crossover_n"]
        if rule:
            ax.axvline(
                rule, color="gray", linestyle=":", linewidth=1, label=f"library rule N k >= d: N={rule}"
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks N")
        ax.set_title(f"link {cluster.format_rate(lk['bits_per_second'])} ({lk['shaping']})")
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize="x-small")
    axes[0][0].set_ylabel("communication time per step (ms)")
    s = results["settings"]
    fig.suptitle(
        f"Dense allreduce vs sparse allgather vs shared index set vs TernGrad, d = {format_size(s['numel'])}, "
        f"ratio {s['ratio']:g}",
        fontsize="medium",
    )
    report.save_figure(fig, path)


__all__ = [
    "run",
    "worker",
    "terms",
    "seconds",
    "crossover",
    "crossover_closed_form",
    "library_crossover",
    "fit",
    "fit_alpha",
    "COLLECTIVES",
]


if __name__ == "__main__":
    worker(cluster.worker_config(sys.argv[1:]))
