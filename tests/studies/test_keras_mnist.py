"""benchmarks/keras_mnist.py (Horovod's Keras MNIST example with hvd_compress.keras, docs/keras.md's
Adam recipe) in one process on tiny Fashion-MNIST files: the recipe's settings reach the optimizer and
the density warm-up, and the run reports what docs/keras.md quotes."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.distributed.launch import require
from tests.studies.test_datasets import write_fashion

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
require("horovod.tensorflow.keras")

from benchmarks import keras_mnist  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_recipe_arguments():
    recipe = keras_mnist.arguments(["--compression", "regtopk", "--recipe"])
    assert (recipe.dense_below, recipe.density_warmup_epochs, recipe.start) == (100_000, 2, 1.0)
    plain = keras_mnist.arguments(["--compression", "regtopk"])
    assert (plain.dense_below, plain.density_warmup_epochs) == (None, 0)
    assert keras_mnist.arguments(["--recipe", "--dense-below", "5"]).dense_below == 5


def test_recipe_trains_with_adam_a_dense_start_and_the_big_kernel_sparse(tmp_path, capsys, monkeypatch):
    import hvd_compress.keras as hvd

    write_fashion(tmp_path, train=256, test=64)
    made = []
    real = hvd.DistributedOptimizer
    monkeypatch.setattr(hvd, "DistributedOptimizer", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    keras_mnist.main(["--compression", "regtopk", "--recipe", "--epochs", "3", "--steps-per-epoch", "1",
                      "--data-dir", str(tmp_path)])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["density"] == pytest.approx([1.0, 0.1, 0.01])
    assert np.all(np.isfinite(result["loss"])) and len(result["accuracy"]) == 3
    (opt,) = made
    assert type(opt.compression).__name__ == "RegTopK" and opt.compression.ratio == 0.01  # reset at train end
    assert opt.compression.dense_below == keras_mnist.RECIPE_DENSE_BELOW and opt.compression.momentum == 0
    assert opt.get_config()["beta_1"] == 0.9  # Adam keeps its momentum; the compressor has none
