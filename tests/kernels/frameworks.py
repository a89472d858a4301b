"""The kernel modules under test, each behind one small adapter.

The shared kernel tests (``test_kernels.py``) are written once against a
:class:`Framework`: ``K.ops`` is the kernel module (:mod:`hvd_compress.kernels.torch_ops`
on CPU or CUDA, :mod:`hvd_compress.kernels.tf_ops`), ``K.tensor``/``K.numpy`` convert,
``K.check`` runs a function of tensors in every execution mode of the framework (torch:
eagerly; TensorFlow: eagerly and traced by ``tf.function`` without autograph, so Python
branching on a tensor value fails the trace) and compares every result with the numpy
reference bit for bit. What differs between the frameworks and is part of a test's
statement lives here, named: the tolerance of the reductions, the hypothesis example
budgets (a TensorFlow example traces a graph: tens of milliseconds), how a framework
casts without the kernels, where Gaussian-k's threshold can be fixed.

``framework(name)`` builds the adapter for ``torch-cpu``, ``torch-cuda`` or ``tf``; a
framework that is not installed skips, or fails under ``HVD_COMPRESS_REQUIRE_HOROVOD=1``
(:func:`tests.distributed.launch.require`). ``HVD_COMPRESS_DEVICE`` (``ci/gpu_tests.sh``
exports ``cuda``): ``cuda`` makes the CUDA cases required (they fail, not skip, without a
usable GPU), ``cpu`` leaves them out; unset, they run whenever ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import pytest
from hypothesis import example, given, seed, settings

from tests.distributed.launch import require

FLOATS = [np.float16, np.float32, np.float64]
FLOATS_32_64 = [np.float32, np.float64]

#: The kernel modules the shared tests run on (pytest ids: select one framework with ``-k torch``).
NAMES = ["torch-cpu", "torch-cuda", "tf"]

REQUESTED_DEVICE = os.environ.get("HVD_COMPRESS_DEVICE", "").strip().lower()
if REQUESTED_DEVICE not in ("", "cpu", "cuda"):
    raise ValueError(f"HVD_COMPRESS_DEVICE must be cpu or cuda, got {REQUESTED_DEVICE!r}")


class Framework:
    """A kernel module and what the tests need to know about its framework."""

    name: str
    #: The framework's top-level package, and its kernel module.
    package: str
    ops: ModuleType
    #: Execution modes :meth:`run` covers, in order.
    modes: Sequence[str] = ("eager",)
    #: ``max_examples`` per budget of :func:`given_per_framework`; a budget not listed keeps the
    #: profile's (``tests/conftest.py``).
    budgets: Dict[str, int] = {}
    #: Relative tolerance of the reductions (mean, std) against the float64 reference, per input dtype.
    reduction_rtol: Dict[type, float]
    #: What ``ops.generator_state`` returns (checkpoints hold it).
    generator_state_type: type

    def tensor(self, a: np.ndarray) -> Any:
        """A copy of ``a`` as a tensor of this framework (on its device)."""
        raise NotImplementedError

    def numpy(self, t: Any) -> np.ndarray:
        raise NotImplementedError

    def dtype(self, dtype) -> Any:
        """The framework's dtype for a numpy dtype (a framework dtype stays as it is)."""
        raise NotImplementedError

    def is_tensor(self, x: Any) -> bool:
        raise NotImplementedError

    def device_of(self, x: Any) -> str:
        """Where a tensor (or a random stream) lives."""
        raise NotImplementedError

    def native_cast(self, t: Any, dtype) -> Any:
        """The framework's own cast, without the kernels' single rounding."""
        raise NotImplementedError


    def run(self, fn: Callable, *args) -> Dict[str, Any]:
        """``{mode: fn(*args)}`` for every execution mode."""
        return {"eager": fn(*args)}

    def check(self, fn: Callable, args, want, what: str = "") -> None:
        """Every run of ``fn(*args)`` equals ``want``: an array, or a dict, tuple or list of them
        (one ``fn`` checking many kernels keeps it to one trace per example)."""
        for mode, got in self.run(fn, *args).items():
            self.assert_nest_same(got, want, f"{what} ({mode})")

    def assert_nest_same(self, got, want, what: str) -> None:
        if isinstance(want, dict):
            assert set(got) == set(want), what
            for key in want:
                self.assert_nest_same(got[key], want[key], f"{what} {key}")
        elif isinstance(want, (tuple, list)):
            assert len(got) == len(want), what
            for i, (g, w) in enumerate(zip(got, want)):
                self.assert_nest_same(g, w, f"{what}[{i}]")
        else:
            self.assert_same(got, want, what)

    def assert_same(self, got, want: np.ndarray, what: str = "") -> None:
        """Kernel result == reference result: dtype, every value and sign of zero (NaN == NaN)."""
        assert self.is_tensor(got), (what, type(got))
        assert got.dtype == self.dtype(want.dtype), (what, got.dtype, want.dtype)
        got = self.numpy(got)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        if self.flushes_subnormals and want.dtype.kind == "f":  # a subnormal sum may come back 0 there
            want = np.where((np.abs(want) < np.finfo(want.dtype).tiny) & (got == 0), got, want)
        same = np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
        if want.dtype.kind == "f":  # -0.0 and 0.0 compare equal: their sign bits must too
            same = same and np.array_equal(np.signbit(got), np.signbit(want))
        assert same, (what, np.flatnonzero(got != want)[:10], got[got != want][:10], want[got != want][:10])

    #: whether the kernels' scatter-adds flush subnormal values to zero (CUDA's float atomics do)
    flushes_subnormals = False

    def settings(self, budget: str, **options) -> Optional[settings]:
        """The hypothesis settings of ``budget`` (and ``options``); ``None``: the profile's as they are."""
        if budget in self.budgets:
            options = {"max_examples": self.budgets[budget], **options}
        return settings(**options) if options else None

    def __repr__(self) -> str:
        return self.name


class TorchFramework(Framework):
    """:mod:`hvd_compress.kernels.torch_ops` on ``device``; every budget keeps the profile's count."""

    #: torch reduces in the input dtype (accumulating in double, rounding the result to the
    #: dtype), the reference in float64.
    package = "torch"
    reduction_rtol = {np.float16: 4 * 2.0**-10, np.float32: 8 * 2.0**-23, np.float64: 1e-12}

    def __init__(self, device: str) -> None:
        import torch

        from hvd_compress.kernels import torch_ops

        self.torch, self.ops, self.device = torch, torch_ops, device
        self.name = f"torch-{device}"
        self.flushes_subnormals = device == "cuda"
        self.generator_state_type = torch.Tensor

    def tensor(self, a):
        return self.torch.from_numpy(np.array(a, copy=True)).to(self.device)

    def numpy(self, t):
        return t.detach().cpu().numpy()

    def dtype(self, dtype):
        if isinstance(dtype, self.torch.dtype):
            return dtype
        return self.torch.from_numpy(np.empty(0, dtype=dtype)).dtype

    def is_tensor(self, x):
        return isinstance(x, self.torch.Tensor)

    def device_of(self, x):
        from hvd_compress.kernels.counter_stream import CounterStream

        return "cpu" if isinstance(x, CounterStream) else x.device.type  # a counter stream: the host's

    def native_cast(self, t, dtype):
        return t.to(self.dtype(dtype))


class TFFramework(Framework):
    """:mod:`hvd_compress.kernels.tf_ops`, eagerly and in a graph; fewer examples (each traces)."""

    name, package = "tf", "tensorflow"
    modes = ("eager", "graph")
    budgets = {"few": 6, "some": 15}
    #: TF reduces in float32 (float16 inputs too) or float64, the reference in float64.
    reduction_rtol = {np.float16: 8 * 2.0**-23, np.float32: 8 * 2.0**-23, np.float64: 1e-12}
    generator_state_type = np.ndarray

    def __init__(self) -> None:
        import tensorflow as tf

        from hvd_compress.kernels import tf_ops

        self.tf, self.ops = tf, tf_ops

    def tensor(self, a):
        return self.tf.constant(np.array(a, copy=True))

    def numpy(self, t):
        return t.numpy()

    def dtype(self, dtype):
        return self.tf.as_dtype(dtype)

    def is_tensor(self, x):
        return self.tf.is_tensor(x)

    def device_of(self, x):
        return getattr(x, "state", x).device  # a tf.random.Generator: where its state variable is

    def native_cast(self, t, dtype):
        return self.tf.cast(t, self.dtype(dtype))


    def run(self, fn, *args):
        """Eagerly, and traced by ``tf.function`` for the args' static shapes."""
        return {"eager": fn(*args), "graph": self.tf.function(fn, autograph=False)(*args)}


def _cuda_usable() -> None:
    """Skip the CUDA case unless it is asked for (then it must run) or a GPU is there."""
    import torch

    if REQUESTED_DEVICE == "cpu":
        pytest.skip("HVD_COMPRESS_DEVICE=cpu")
    if REQUESTED_DEVICE != "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")


@functools.lru_cache(maxsize=None)
def _build(name: str) -> Framework:
    if name == "tf":
        return TFFramework()
    return TorchFramework(name.split("-")[1])


def framework(name: str) -> Framework:
    """The adapter for ``name`` (one of :data:`NAMES`), or a skip when it cannot run here."""
    require("tensorflow" if name == "tf" else "torch")
    if name == "torch-cuda":
        _cuda_usable()
    return _build(name)


def given_per_framework(
    budget: str = "all", options: Optional[dict] = None, examples: Sequence[dict] = (), **strategies
):
    """``@given(**strategies)`` with the example budget of the test's framework ``K``.

    A hypothesis test has one example count, set when it is decorated; here every call
    (one pytest case: a framework and the other parameters) decorates the test afresh with
    ``K.settings(budget, **options)``, and ``@example(**e)`` for each of ``examples``.
    Under a derandomized profile each case is seeded from its pytest node id, as hypothesis'
    pytest plugin does for parametrized tests, so each case draws its own examples.
    """

    def decorate(test: Callable) -> Callable:
        signature = inspect.signature(test)
        outer = [p for name, p in signature.parameters.items() if name not in strategies]
        takes_request = "request" in signature.parameters
        if not takes_request:
            outer.append(inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(test)
        def run_case(**arguments):
            request = arguments["request"] if takes_request else arguments.pop("request")
            case = given(**strategies)(test)
            for explicit in examples:
                case = example(**explicit)(case)
            chosen = arguments["K"].settings(budget, **(options or {}))
            if chosen is not None:
                case = chosen(case)
            if (settings.default if chosen is None else chosen).derandomize:
                digest = hashlib.sha256(request.node.nodeid.encode()).digest()
                case = seed(int.from_bytes(digest[:16], "big"))(case)
            case(**arguments)

        run_case.__signature__ = signature.replace(parameters=outer)
        return run_case

    return decorate

