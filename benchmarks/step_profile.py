"""What the device spends on one training step: kernels and milliseconds from ``torch.profiler``.

``python -m benchmarks train-step --profile`` runs :func:`profile_step` on one more steady step of
every row, after its timed steps:

* **CUDA**: every device event the profiler records (CUPTI: kernels, memcpy and memset, on any
  stream, NCCL's included) counts as a launch; ``device_ms`` is the sum of their durations (the
  GPU's busy time, streams added up where they overlap).
* **CPU**: the device is the host. ``kernels`` counts the innermost aten operator calls that
  launch a kernel by :func:`benchmarks.trace.is_kernel`'s rule (views, allocations and
  metadata changes left out; :func:`innermost_kernel`: one per chain of calls), on every thread (``profile_all_threads`` where torch has it: the gloo threads that
  run DDP hooks' callbacks); ``device_ms`` is the self CPU time of every aten operator call:
  the time spent inside operators, not Python's or the framework's own.

Horovod's collectives run in its C++ background thread and are not aten operators: on the CPU
they are not counted; on CUDA their copies and reductions are device events like any other.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict

#: What the two fields measure, per device, for the results' settings.
METHOD = {
    "cuda": "torch.profiler over one steady step: kernels = device events (kernels, memcpy, memset; "
    "every stream), device_ms = sum of their durations",
    "cpu": "torch.profiler over one steady step, all threads: kernels = innermost aten operator calls "
    "that launch a kernel (views, allocations, metadata excluded), device_ms = self CPU time of all "
    "aten operator calls",
}


def _config() -> Dict[str, Any]:
    """``experimental_config`` recording every thread, where this torch offers it (else nothing)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


@functools.lru_cache(maxsize=None)
def launches(name: str) -> bool:
    """Whether the aten operator ``name`` (``aten::add_``) launches a kernel (the trace's rule); an
    unknown name counts."""
    import torch

    from benchmarks.trace import is_kernel

    packet = getattr(torch.ops.aten, name.split("::", 1)[-1], None)
    overloads = packet.overloads() if packet is not None else []
    if not overloads:
        return True
    return is_kernel(getattr(packet, "default" if "default" in overloads else overloads[0]))


def _is_device(event: Any) -> bool:
    return str(event.device_type).rsplit(".", 1)[-1] != "CPU"


def summarize(events: Any, cuda: bool) -> Dict[str, Any]:
    """``{"kernels", "device_ms"}`` of a profiler's ``events()`` (module docstring)."""
    if cuda:
        device = [e for e in events if _is_device(e)]
        return {
            "kernels": len(device),
            "device_ms": sum(e.time_range.elapsed_us() for e in device) / 1e3,
        }
    aten = [e for e in events if e.name.startswith("aten::") and not _is_device(e)]
    return {
        "kernels": sum(innermost_kernel(e) for e in aten),
        "device_ms": sum(e.self_cpu_time_total for e in aten) / 1e3,
    }


def _launches_below(event: Any) -> bool:
    """Whether ``event`` or an aten operator it calls (at any depth) launches a kernel."""
    return (event.name.startswith("aten::") and launches(event.name)) or any(
        _launches_below(child) for child in event.cpu_children
    )


def innermost_kernel(event: Any) -> bool:
    """An aten operator call that launches a kernel and calls none that does (``sum`` calling ``fill_``
    counts once, as ``fill_``; ``mul`` of a Python scalar counts once, as the scalar's copy)."""
    return launches(event.name) and not any(_launches_below(child) for child in event.cpu_children)


def profile_step(step: Callable[[], None], cuda: bool) -> Dict[str, Any]:
    """Profile one call of ``step`` (synchronised before and after on CUDA): :func:`summarize`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities, **_config()) as prof:
        step()
        sync()
    return summarize(prof.events(), cuda)


__all__ = ["profile_step", "summarize", "launches", "innermost_kernel", "METHOD"]
