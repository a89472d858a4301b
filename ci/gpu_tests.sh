#!/usr/bin/env bash
# ci/gpu_tests.sh: the kernel and multi-process tests on CUDA, when this machine has a GPU.
#
#   ci/gpu_tests.sh [PYTEST_ARGS...]
#
# No GPU (nvidia-smi missing or failing): prints "skipped: no GPU" and exits 0.
# GPU present: requires a CUDA build of torch in .venv (make setup installs the CPU build; install
# e.g. `pip install torch==<same version> --index-url https://download.pytorch.org/whl/cu124`), or
# PYTHON=/path/to/python with one (the repo then goes on PYTHONPATH), and Horovod built with NCCL for
# the Horovod tests (HOROVOD_GPU_OPERATIONS=NCCL make setup, see ci/multinode.md); then runs, with
# HVD_COMPRESS_DEVICE=cuda exported:
#   tests/kernels -k "not tf"   every kernel and Simulator comparison on CPU and on CUDA
#                                 (HVD_COMPRESS_DEVICE=cuda makes the CUDA cases fail, not skip,
#                                 without a usable GPU)
#   tests/routes/test_cuda_training.py   the drop-in optimizer on CUDA: 3 thread ranks, NCCL (world size 1),
#                                 and MPI (mpirun -np 2, both ranks on GPU 0) against the Simulator
#   tests/comm/test_thread_ranks.py tests/distributed/test_horovod_torch.py tests/distributed/test_mpi.py tests/distributed/test_ddp_hook.py
#                                 thread-rank and multi-process runs: they ignore HVD_COMPRESS_DEVICE
#                                 and run on CPU
# then measures the fused passes compiled against eager on the GPU (HVD_COMPRESS_COMPILE is off on CUDA
# until this shows them faster): python -m benchmarks select --device cuda, written to
# docs/results/select_cuda_compiled.json and .png (GPU_SELECT=0 skips it)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_tests: skipped: no GPU (nvidia-smi missing or not working)"
  exit 0
fi
nvidia-smi -L
command -v "$PY" >/dev/null || { echo "gpu_tests: $PY missing: run make setup first (or set PYTHON)" >&2; exit 1; }
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_tests: a GPU is present but $PY's torch ($("$PY" -c 'import torch; print(torch.__version__)')) cannot use it:" \
       "install a CUDA build of torch into .venv" >&2
  exit 1
fi
"$PY" -c 'import horovod.torch as h; print("horovod NCCL built:", h.nccl_built())' || true

export HVD_COMPRESS_DEVICE=cuda
if [[ -n "${PYTHON:-}" ]]; then export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"; fi
export PATH="$ROOT/.venv/bin:$PATH" TF_USE_LEGACY_KERAS="${TF_USE_LEGACY_KERAS:-1}"
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
if [[ "$(id -u)" == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
cd "$ROOT"
"$PY" -m pytest -q -ra tests/kernels -k "not tf" "$@"   # -k would also filter the files below
"$PY" -m pytest -q -ra \
  tests/routes/test_cuda_training.py tests/comm/test_thread_ranks.py \
  tests/distributed/test_horovod_torch.py tests/distributed/test_mpi.py tests/distributed/test_ddp_hook.py "$@"
if [[ "${GPU_SELECT:-1}" != 0 ]]; then
  "$PY" -m benchmarks select --device cuda --sizes 11.7M,25.6M --repeats 20 --out docs/results \
    --name select_cuda_compiled
fi
