"""The examples run as documented (short runs).

The launchers and trainers of ``examples/README.md`` on 2 CPU processes (gloo): ``torchrun`` with the
drop-in optimizer trains; PyTorch Lightning and Hugging Face Accelerate with the DDP hook train,
checkpoint at the end of the first epoch and resume from it through their own checkpointing: each
rank gets back the compressor state it saved (digests of its residuals equal, and differing between
the ranks), and the resumed run ends with the parameters and compressor state of the uninterrupted one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

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


@pytest.mark.parametrize(
    "script",
    ["pytorch_train.py", "keras_train.py", "async_sgd.py", "torchrun_train.py", "accelerate_train.py", "elastic_train.py"],
)
def test_examples_run_as_scripts_without_the_repository_on_the_path(script, tmp_path):
    """``python examples/X.py`` (as the README launches them) imports only the installed library."""
    if script == "accelerate_train.py":
        launch.require("accelerate")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, str(launch.ROOT / "examples" / script), "--help"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage" in done.stdout


EPOCH = re.compile(r"epoch (\d): loss ([\d.]+)  test accuracy ([\d.-]+)  sent .*\(([\d.]+)x less")
# 12 hex digits each (examples/every_rank_state.py): two ranks' lines can reach the pipe unseparated
STATE = re.compile(r"\[rank (\d)\] compressor state (saved|restored): (\d+) tensors, sha256 ([0-9a-f]{12})")
FINAL = re.compile(r"final parameters sha256 ([0-9a-f]{12})")


def run_example(launcher, script, *args, cwd):
    """``launcher examples/script args`` with the repository on the path and no inherited rendezvous."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(launch.ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = launcher + [str(launch.ROOT / "examples" / script), *args]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=launch.TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_torchrun_example_trains_with_the_dropin_optimizer(tmp_path):
    output = run_example(TORCHRUN, "torchrun_train.py", "--epochs", "2", cwd=tmp_path)
    assert "2 ranks, torch.distributed (gloo)" in output, output[-4000:]
    epochs = EPOCH.findall(output)
    assert [e[0] for e in epochs] == ["1", "2"], output[-4000:]
    (_, loss1, _, _), (_, loss2, accuracy, savings) = epochs
    assert float(loss2) < float(loss1), "loss did not decrease"
    assert float(accuracy) > 0.3, f"accuracy {accuracy} is no better than chance"
    assert float(savings) > 5, f"only {savings}x fewer bytes than dense"


def states(output, what):
    """``{rank: [digest, ...]}`` of the compressor states each rank reported as ``what``, in order."""
    found = {}
    for rank, kind, tensors, digest in STATE.findall(output):
        if kind == what:
            assert int(tensors) > 0, "a compressor state without tensors: the hook did not run"
            found.setdefault(int(rank), []).append(digest)
    return found


def assert_resumes_exactly(straight, resumed):
    """``straight`` trained 2 epochs, saving after each; ``resumed`` loaded the first save and trained
    the second: each rank restored its own state, and both runs end alike."""
    saved = states(straight, "saved")
    assert sorted(saved) == [0, 1] and all(len(d) == 2 for d in saved.values()), straight[-4000:]
    assert saved[0][0] != saved[1][0], "both ranks saved the same compressor state"
    restored = states(resumed, "restored")
    assert restored == {0: [saved[0][0]], 1: [saved[1][0]]}, (
        f"restored {restored}, saved after epoch 1 {saved}:\n{resumed[-4000:]}")
    assert states(resumed, "saved") == {0: [saved[0][1]], 1: [saved[1][1]]}, resumed[-4000:]
    assert FINAL.findall(resumed) == FINAL.findall(straight) != [], (straight[-2000:], resumed[-2000:])
    for output, epochs in ((straight, ["1", "2"]), (resumed, ["2"])):
        assert [e[0] for e in EPOCH.findall(output)] == epochs, output[-4000:]
        for epoch, _, _, savings in EPOCH.findall(output):
            assert float(savings) > 5, f"epoch {epoch}: only {savings}x fewer bytes than dense"


def test_lightning_example_checkpoints_and_resumes_every_ranks_residuals(tmp_path):
    launch.require("lightning")
    common = ["--accelerator", "cpu", "--devices", "2", "--epochs", "2", "--batches-per-epoch", "4"]
    lightning = [sys.executable]
    straight = run_example(lightning, "lightning_train.py", *common, "--checkpoint-dir", "a", cwd=tmp_path)
    assert "Lightning DDPStrategy with ddp_hook" in straight, straight[-4000:]
    resumed = run_example(lightning, "lightning_train.py", *common, "--checkpoint-dir", "b",
                          "--resume", str(tmp_path / "a" / "epoch=0.ckpt"), cwd=tmp_path)
    assert_resumes_exactly(straight, resumed)


def test_accelerate_example_checkpoints_and_resumes_every_ranks_residuals(tmp_path):
    launch.require("accelerate")
    common = ["--cpu", "--epochs", "2", "--batches-per-epoch", "4"]
    straight = run_example(TORCHRUN, "accelerate_train.py", *common, "--checkpoint-dir", "a", cwd=tmp_path)
    assert "Accelerate (DistributedType.MULTI_CPU) with ddp_hook" in straight, straight[-4000:]
    resumed = run_example(TORCHRUN, "accelerate_train.py", *common, "--checkpoint-dir", "b",
                          "--resume", str(tmp_path / "a" / "epoch_1"), cwd=tmp_path)
    assert_resumes_exactly(straight, resumed)
