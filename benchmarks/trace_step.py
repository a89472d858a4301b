"""Kernels, bytes and device waits of one steady training step per route: ``python -m benchmarks trace``.

The stand-in for a GPU profile when no GPU is at hand. Each row builds a
route of :mod:`benchmarks.routes` (:func:`~benchmarks.routes.build_route`,
world size 1 in a one-rank gloo group, NCCL on CUDA), runs ``warmup`` steps
(the plan, DDP's bucket rebuild and the header checks happen there), then
traces one more step with :func:`benchmarks.trace.count_ops` (its
docstring has the rules: kernels, bytes, device waits, collectives). The whole
row runs inside :func:`hvd_compress.kernels.torch_ops.accelerator_path`, so on
the CPU our kernels take the branches an accelerator takes (no numpy
selection): the trace counts what a GPU would launch.

Rows: ``local`` (no exchange: what every other row is compared with; ``added``
= the row minus ``local``), ``ddp`` (allreduce), ``ddp+fp16`` (torch's
``fp16_compress_hook``), ``ddp+handwritten-topk``
(:func:`~benchmarks.routes.handwritten_topk_hook`, the peer:
``ops_vs_handwritten`` = added ops / its added ops, same for bytes), then
``ours-ddp-hook``, ``ours-dropin`` and ``ours-stock-horovod`` per compressor.
``local`` and the hand-written hook always run.

With ``ramp`` the traced step is a step of a density warm-up instead: each row's compressor
follows a :class:`~hvd_compress.DensityWarmup` from twice the ratio over :data:`RAMP_STEPS` steps,
stepped before every step, so every step runs at a new density (what the first epochs of a DGC
warm-up cost); rows without a density (None, FP16, TernGrad) trace a steady step.

Models: ``resnet50`` and ``gpt2`` are :mod:`benchmarks.shapes` models
(the real parameter shapes and order, a cheap loss touching every parameter;
no torchvision or transformers), ``mlp`` is
:class:`~benchmarks.routes.MLPWorkload`. The forward and backward of these stand-ins are not the real models', but they are the same in
every row, so the added figures are the exchange's alone.
"""

from __future__ import annotations

import datetime
import functools
import gc
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import report
from benchmarks import routes as step_routes

MODELS = ("resnet50", "gpt2", "mlp")
COMPRESSORS = ("none", "fp16", "topk", "gaussiank", "regtopk", "terngrad")
#: on request: a sparsifier with a shared index set (``<name>-leader``, ``<name>-aggregate``), or Top-k and
#: RegTop-k at a step between exact selections (``<name>-reuse``: ``exact_every`` > 1)
SHARED = tuple(f"{name}-{mode}" for name in ("topk", "gaussiank", "regtopk") for mode in ("leader", "aggregate")) + (
    "topk-reuse", "regtopk-reuse")
LOCAL, PEER = "local", "ddp+handwritten-topk"
TORCH_ROUTES = step_routes.TORCH_ROUTES
OUR_ROUTES = step_routes.OUR_ROUTES
ROUTES = tuple(r for r, _ in TORCH_ROUTES if r != LOCAL) + OUR_ROUTES
ALWAYS = (LOCAL, PEER)
DEFAULT_WARMUP = 3
TOP = 8
#: the warm-up of ``ramp``: this many steps from twice the ratio (far from its end: every step a new density)
RAMP_STEPS = 1000


def plan(routes: Sequence[str], compressors: Sequence[str]) -> List[Tuple[str, str]]:
    """(route, compressor) of every row in table order; ``local`` and the hand-written hook always."""
    rows = [(r, c) for r, c in TORCH_ROUTES if r in routes or r in ALWAYS]
    return rows + [(r, c) for r in OUR_ROUTES if r in routes for c in compressors]


def workload(model: str, device: Any, seed: int) -> Any:
    """The shape model of ``resnet50``/``gpt2``, or the MLP."""
    if model == "mlp":
        return step_routes.MLPWorkload(device, step_routes.MLP_BATCH, seed)
    from benchmarks.shapes import ShapeWorkload

    return ShapeWorkload(model, device, seed)


def density_ramp(compressor: Any) -> Any:
    """A :class:`~hvd_compress.DensityWarmup` of ``compressor`` from twice its ratio over :data:`RAMP_STEPS`
    steps; ``None`` for a compressor without a density (or none: a torch hook's row)."""
    from hvd_compress import DensityWarmup

    ratio = getattr(compressor, "ratio", None)
    return None if ratio is None else DensityWarmup(compressor, RAMP_STEPS, start=min(1.0, 2 * ratio))


def trace_row(env: Any, route: str, compressor: str, warmup: int, ramp: bool = False) -> Dict[str, Any]:
    """One row's counts over one steady step (``ramp``: a step of a density warm-up, :func:`density_ramp`);
    a failure is the row's ``error``, never an exception."""
    from benchmarks.trace import count_ops
    from hvd_compress.kernels.torch_ops import accelerator_path

    row: Dict[str, Any] = {
        "route": route,
        "compressor": compressor,
        "ops": None,
        "bytes": None,
        "device_waits": None,
        "error": None,
    }
    step = None
    try:
        with accelerator_path():
            env.last_compressor = None
            step, info = step_routes.build_route(env, route, compressor)
            row["warmup"] = max(warmup, info.pop("min_warmup"), 1)
            row.update(info)
            schedule = density_ramp(env.last_compressor) if ramp else None
            row["ramp"] = schedule is not None
            for _ in range(row["warmup"]):
                if schedule is not None:
                    schedule.step()
                step()
            if schedule is not None:
                schedule.step()
                row["density"] = schedule.density
            with count_ops(host_reads=not env.cuda) as counts:
                step()
        row.update(counts.as_dict())
        row["by_op"] = counts.by_op
    except Exception as error:  # noqa: BLE001  (a failing row must not stop the others)
        row["error"] = f"{type(error).__name__}: {error}"
    finally:
        step = None
        gc.collect()
    return row


def _ratio(value: int, base: Optional[int]) -> Optional[float]:
    return value / base if base else None


def compare(rows: List[Dict[str, Any]], top: int) -> None:
    """Fill each row's added ops/bytes (vs ``local``), ratios to the hand-written hook and top added ops."""
    from benchmarks.trace import difference
    from benchmarks.trace import top as ranked

    by_ops = [row.pop("by_op", None) for row in rows]
    local = next((i for i, r in enumerate(rows) if r["route"] == LOCAL and by_ops[i] is not None), None)
    if local is None:
        return
    for row, by_op in zip(rows, by_ops):
        if by_op is None:
            continue
        added = difference(by_op, by_ops[local])
        row["added_ops"] = row["ops"] - rows[local]["ops"]
        row["added_bytes"] = row["bytes"] - rows[local]["bytes"]
        row["top_ops_by_bytes"] = [dict(op=n, calls=c, bytes=b) for n, c, b in ranked(added, 1, top)]
        row["top_ops_by_count"] = [dict(op=n, calls=c, bytes=b) for n, c, b in ranked(added, 0, top)]
    peer = next((r for r in rows if r["route"] == PEER and "added_ops" in r), {})
    for row in rows:
        if "added_ops" in row:
            row["ops_vs_handwritten"] = _ratio(row["added_ops"], peer.get("added_ops"))
            row["bytes_vs_handwritten"] = _ratio(row["added_bytes"], peer.get("added_bytes"))


# ==================================================================== run
def _check(model: str, device: str, warmup: int, routes: Sequence[str], compressors: Sequence[str]) -> None:
    if model not in MODELS:
        raise ValueError(f"hvd_compress: model must be one of {', '.join(MODELS)}, got {model!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"hvd_compress: device must be cpu or cuda, got {device!r}")
    if int(warmup) < 1:
        raise ValueError(f"hvd_compress: warmup must be >= 1 (the traced step is a steady one), got {warmup}")
    for name in routes:
        if name not in ROUTES:
            raise ValueError(f"hvd_compress: unknown route {name!r}; choose from {', '.join(ROUTES)}")
    for name in compressors:
        if name not in COMPRESSORS + SHARED:
            raise ValueError(
                f"hvd_compress: unknown compressor {name!r}; choose from {', '.join(COMPRESSORS + SHARED)}"
            )


def _rows(env: Any, todo: List[Tuple[str, str]], warmup: int, progress: bool,
          ramp: bool = False) -> List[Dict[str, Any]]:
    """Trace every row, one progress line each."""
    rows: List[Dict[str, Any]] = []
    bar = report.progress_bar(len(todo), "bench trace", "row", progress)
    try:
        for route, compressor in todo:
            row = trace_row(env, route, compressor, warmup, ramp)
            rows.append(row)
            if row["error"]:
                report.say(bar, f"bench trace: {route} {compressor} failed: {row['error']}")
                bar.set_postfix_str(f"{route} {compressor}: error")
            else:
                bar.set_postfix_str(
                    f"{route} {compressor}: {row['ops']} ops, {row['bytes'] / 1e9:.2f} GB, "
                    f"{row['device_waits']} waits"
                )
            bar.update()
    finally:
        bar.close()
    return rows


def run(
    model: str = "resnet50",
    device: str = "cpu",
    warmup: int = DEFAULT_WARMUP,
    compressors: Sequence[str] = COMPRESSORS,
    ratio: float = 0.01,
    routes: Sequence[str] = ROUTES,
    dropin_comm: str = "auto",
    seed: int = 0,
    top: int = TOP,
    json_path: Optional[str] = None,
    plot_path: Optional[str] = None,
    progress: bool = True,
    stdout: Any = None,
    ramp: bool = False,
) -> Dict[str, Any]:
    """Trace every row (``ramp``: a step of a density warm-up, see the module docstring), write the JSON and
    the PNG (when given), print the table; returns the results."""
    from hvd_compress.algorithms.base import check_ratio

    report.require_packages(torch=True, plots=plot_path is not None)
    import torch

    ratio = check_ratio(ratio)
    _check(model, device, warmup, routes, compressors)
    load = workload(model, step_routes.torch_device(device, dropin_comm), seed)
    hvd, horovod_note, todo, skipped = step_routes.rows_to_run(plan(routes, compressors), routes, dropin_comm)

    started = time.perf_counter()
    with step_routes.process_group(device == "cuda") as backend:
        rows = _rows(step_routes.Environment(load, ratio, hvd, dropin_comm), todo, warmup, progress, ramp)
    compare(rows, top)
    machine = report.machine(torch, [device])
    results = {
        "benchmark": "trace",
        "machine": machine,
        "settings": _settings(
            dict(model=model, load=load, device=device, backend=backend, warmup=warmup, ratio=ratio,
                 compressors=compressors, routes=routes, dropin_comm=dropin_comm, horovod_note=horovod_note,
                 ramp=ramp),
            machine, torch, hvd,
        ),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "skipped": skipped,
    }
    step_routes.save(results, json_path, plot_path, plot=write_plot)
    print_table(results, stdout)
    return results


def _settings(v: Dict[str, Any], machine: Dict[str, Any], torch: Any, hvd: Any) -> Dict[str, Any]:
    """The run's settings and how it counts (``v``: :func:`run`'s arguments and what it set up)."""
    load = v["load"]
    return {
        "model": v["model"],
        "model_description": load.description,
        "parameters": load.parameter_count,
        "device": v["device"],
        "device_name": machine["devices"][v["device"]],
        "torch_version": torch.__version__,
        "world_size": 1,
        "backend": v["backend"],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "warmup": v["warmup"],
        "ratio": v["ratio"],
        "ramp": (f"DensityWarmup from {2 * v['ratio']:g} over {RAMP_STEPS} steps, stepped before every step: "
                 "the traced step runs at a new density" if v["ramp"] else None),
        "compressors": list(v["compressors"]),
        "routes": list(dict.fromkeys(r for r, _ in plan(v["routes"], v["compressors"]))),
        "dropin_comm": v["dropin_comm"],
        "horovod": None if hvd is None else getattr(sys.modules.get("horovod"), "__version__", "?"),
        "horovod_note": v["horovod_note"],
        "optimizer": f"SGD lr {step_routes.LR:g} momentum 0.9",
        "code_path": "hvd_compress.kernels.torch_ops.accelerator_path() (no CPU-only numpy shortcuts)",
        "counting": (
            "one steady step traced with a TorchDispatchMode (benchmarks.trace): ops = aten "
            "operators that launch a kernel (views, allocations and metadata changes excluded); bytes = "
            "numel*itemsize of every tensor argument and result of those; device waits = operators that "
            "synchronise the host on CUDA (_local_scalar_dense, nonzero, masked_select, unique*, equal, "
            "bool-mask indexing, repeat_interleave without output_size, uploads: lift_fresh of host data, "
            "CPU<->device copies, index_put_ of a Python scalar) plus tolist/numpy reads; c10d collectives counted apart; Horovod's "
            "collectives (its C++ thread) not seen"
        ),
        "added": f"row minus the {LOCAL} row (no exchange)",
        "vs_handwritten": f"added ops (bytes) / the {PEER} row's added ops (bytes)",
    }


# ================================================================= output
def _fmt(value: Optional[float], spec: str, width: int) -> str:
    return ("-" if value is None else format(value, spec)).rjust(width)


def print_table(results: Dict[str, Any], stdout: Any = None) -> None:
    say = functools.partial(print, file=stdout)
    s = results["settings"]
    say(
        f"\nOne steady step traced, {s['model_description']}; {s['device_name']} ({s['backend']}, "
        f"world size 1), torch {s['torch_version']}, the accelerator's code path; after {s['warmup']} steps; "
        f"ratio {s['ratio']:g} for the sparsifiers"
    )
    say(
        f"  {'route':<22} {'compressor':<10} {'ops':>7} {'GB':>7} {'waits':>5} {'+ops':>7} {'+GB':>7} "
        f"{'ops/hw':>7} {'GB/hw':>7}"
    )
    for r in results["rows"]:
        if r["error"]:
            say(f"  {r['route']:<22} {r['compressor']:<10} error: {r['error']}")
            continue
        added_gb = None if r.get("added_bytes") is None else r["added_bytes"] / 1e9
        say(
            f"  {r['route']:<22} {r['compressor']:<10} {r['ops']:>7,d} {r['bytes'] / 1e9:>7.3f} "
            f"{r['device_waits']:>5d} {_fmt(r.get('added_ops'), ',d', 7)} {_fmt(added_gb, '.3f', 7)} "
            f"{_fmt(r.get('ops_vs_handwritten'), '.2f', 7)} {_fmt(r.get('bytes_vs_handwritten'), '.2f', 7)}"
        )
    for skipped in results["skipped"]:
        say(f"  {skipped['route']:<22} {skipped['compressor']:<10} {skipped['note']}")
    say(
        f"  ops: kernels launched; GB: their inputs + outputs; waits: host synchronisations; "
        f"+: what the route adds to {LOCAL}; /hw: added / {PEER}'s added"
    )


def write_plot(results: Dict[str, Any], path: Any) -> None:
    """Added ops and bytes / the hand-written hook's (log scale): torch's routes, then ours per compressor."""
    plt = report.pyplot()
    rows = [r for r in results["rows"] if r.get("ops_vs_handwritten") is not None and r["route"] != LOCAL]
    torch_rows = [r for r in rows if r["route"] not in OUR_ROUTES]
    ours = [r for r in rows if r["route"] in OUR_ROUTES]
    names = list(dict.fromkeys(r["compressor"] for r in ours))
    routes = list(dict.fromkeys(r["route"] for r in ours))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), gridspec_kw={"width_ratios": [1, 2]}, sharey="row")
    panels = (("ops_vs_handwritten", "kernels"), ("bytes_vs_handwritten", "bytes"))
    for line, (key, what) in enumerate(panels):
        def value(r: Dict[str, Any]) -> float:
            return r[key] if r.get(key) and r[key] > 0 else float("nan")

        if torch_rows:
            values = [(what, [value(r) for r in torch_rows])]
            report.ratio_bars(axes[line][0], [r["route"] for r in torch_rows], values)
            axes[line][0].tick_params(axis="x", labelrotation=20)
        if ours:
            by_key = {(r["route"], r["compressor"]): value(r) for r in ours}
            groups = [(route, [by_key.get((route, n), float("nan")) for n in names]) for route in routes]
            report.ratio_bars(axes[line][1], names, groups)
            axes[line][1].legend(fontsize="small")
        axes[line][0].set_ylabel(f"added {what} / hand-written hook's")
        for ax in axes[line]:
            ax.grid(axis="y", which="both", alpha=0.3)
    axes[0][0].set_title("torch routes")
    axes[0][1].set_title("ours, per compressor")
    s = results["settings"]
    fig.suptitle(
        f"One steady step, kernels and bytes added to a local step, vs a hand-written Top-k hook: "
        f"{s['model']} shapes, ratio {s['ratio']:g}, on {s['device']} (accelerator code path)"
    )
    report.save_figure(fig, path)


__all__ = ["run", "plan", "trace_row", "compare", "workload", "MODELS", "COMPRESSORS", "ROUTES"]
