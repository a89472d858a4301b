"""Installs per framework: numpy only, torch only, TensorFlow only.

Each case runs in a fresh interpreter where the frameworks the install lacks cannot
be imported (``sys.modules[name] = None`` makes ``import name`` raise
``ModuleNotFoundError``, as on a machine without it), then exchanges gradients of
the framework it has over two thread ranks through the real exchange, and checks
the result against the Simulator fed the same tensors. A library module that imports the
missing framework on the way fails the case.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

EXCHANGE = """
import sys
for missing in {missing!r}:
    sys.modules[missing] = None
import numpy as np
import hvd_compress
from hvd_compress import Compression
from hvd_compress.engine.exchange import BucketExchange
from hvd_compress.transport.threads import run_ranks
from hvd_compress.simulator import Simulator

SHAPES = {{"w": (40, 50), "b": (7,)}}

def grads(rank, step):
    rng = np.random.default_rng(10 * rank + step)
    return {{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}}

def work(comm, name):
    compressor, out = Compression.by_name(name, 0.05), None
    for step in range(2):
        exchange = BucketExchange(compressor, comm, "bucket")
        for n, g in grads(comm.rank, step).items():
            exchange.add(n, to_framework(g))
        exchange.launch()
        out = {{n: np.asarray(t) for n, t in exchange.finish(average=True).items()}}
    return out

for name in ("topk", "regtopk", "terngrad", "fp16"):
    sim = Simulator(2, Compression.by_name(name, 0.05))
    for step in range(2):
        expected = sim.step({{n: [to_framework(grads(r, step)[n]) for r in range(2)] for n in SHAPES}})
    expected = {{n: np.asarray(t) for n, t in expected.items()}}
    for result in run_ranks(2, lambda comm: work(comm, name)):
        for n in SHAPES:
            # FP16: the Simulator sums float16 payloads in float16, the exchange in float32
            atol = 1e-3 if name == "fp16" else 1e-6
            np.testing.assert_allclose(result[n], expected[n], rtol=0, atol=atol, err_msg=name)
for module in {imports!r}:
    __import__(module)
print("ok", sorted(m for m in {missing!r} if sys.modules.get(m) is not None))
"""

CASES = {
    # the hvd-compress command and the trace benchmark's modules (its routes) load without torch
    "numpy": (("torch", "tensorflow"), "to_framework = lambda g: g",
              ["hvd_compress.mpi", "hvd_compress.cli", "benchmarks.trace_step"]),
    "torch": (("tensorflow", "keras", "tf_keras"), "import torch\nto_framework = torch.from_numpy",
              ["hvd_compress.torch"]),
    "tensorflow": (("torch",), "import tensorflow as tf\nto_framework = tf.constant",
                   ["hvd_compress.tensorflow"]),
}


@pytest.mark.parametrize("install", CASES)
def test_exchange_works_without_the_other_frameworks(install):
    missing, setup, imports = CASES[install]
    if install != "numpy":
        pytest.importorskip(install)
    script = EXCHANGE.format(missing=missing, imports=imports)
    head, _, tail = script.partition("from hvd_compress.simulator import Simulator\n")
    script = head + "from hvd_compress.simulator import Simulator\n" + setup + "\n" + tail
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok []"), done.stdout
