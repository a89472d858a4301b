"""The examples run as documented (short runs)."""

from __future__ import annotations

import re

import pytest

from tests.distributed import launch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("path, compression", [("stock", "regtopk"), ("dropin", "terngrad")])
def test_pytorch_example_trains_and_reports_savings(path, compression):
    launch.require_horovod_torch()
    done = launch.run(
        "horovodrun",
        2,
        "examples.pytorch_train",
        "--epochs",
        "2",
        "--path",
        path,
        "--compression",
        compression,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    epochs = re.findall(r"epoch (\d): loss ([\d.]+)  test accuracy ([\d.]+)  sent .*\(([\d.]+)x less", output)
    assert [e[0] for e in epochs] == ["1", "2"], output[-3000:]
    (_, loss1, _, _), (_, loss2, accuracy, savings) = epochs
    assert float(loss2) < float(loss1), "loss did not decrease"
    assert float(accuracy) > 0.3, f"accuracy {accuracy} is no better than chance"
    assert float(savings) > 5, f"only {savings}x fewer bytes than dense"


@pytest.mark.parametrize("script", ["pytorch_train.py", "keras_train.py", "async_sgd.py"])
def test_examples_run_as_scripts_without_the_repository_on_the_path(script, tmp_path):
    """``python examples/X.py`` (as the README launches them) imports only the installed library."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(launch.ROOT / "examples" / script), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout
