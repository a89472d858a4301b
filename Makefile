# Makefile: entry points for hvd_compress development and CI.
#   make setup   create/refresh .venv with the full stack (ci/setup.sh; idempotent)
#   make test    setup, then pytest inside .venv    (extra args: make test PYTEST_ARGS='-k topk');
#                it lists the 25 slowest tests at the end (CI's time budget); then the installs per
#                framework (ci/test_installs.sh: numpy only, torch only, TensorFlow only)
#   make demo    setup, then `hvd-compress demo` and a 2-process horovodrun of examples/pytorch_train.py
#   make clean   remove .venv and .venv-installs (the Horovod wheel cache in ~/.cache/hvd_compress is kept)
# Test and demo runs (only those; nothing is exported to the calling shell) get:
#  - .venv/bin first on PATH, so spawned horovodrun/mpirun/mpicc are the venv's;
#  - as root, the variables Open MPI needs to run as root;
#  - Open MPI 5 allowed to oversubscribe (more ranks than the 2 cores of CI);
#  - TF_USE_LEGACY_KERAS=1 unless set: stock horovod.tensorflow.keras only averages gradients
#    with tf_keras (Keras 2); the hvd_compress.keras tests start their Keras 3 ranks with 0.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PYTEST_ARGS ?=
ROOT_ENV := $(if $(filter 0,$(shell id -u)),OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
RUN := env PATH="$(VENV)/bin:$$PATH" $(ROOT_ENV) \
	PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe \
	TF_USE_LEGACY_KERAS=$${TF_USE_LEGACY_KERAS:-1}

.PHONY: setup test demo clean

setup:
	@bash ci/setup.sh

# HVD_COMPRESS_REQUIRE_HOROVOD=1: setup installed Horovod, so its tests fail instead of skipping.
test: setup
	$(RUN) HVD_COMPRESS_REQUIRE_HOROVOD=1 $(VENV)/bin/python -m pytest -q --durations=25 $(PYTEST_ARGS)
	@bash ci/test_installs.sh

# The demo: every compressor on 4 simulated ranks (a comparison table), then a real
# 2-process Horovod run of examples/pytorch_train.py with RegTop-k.
demo: setup
	@test -x $(VENV)/bin/hvd-compress || { echo "error: $(VENV)/bin/hvd-compress is missing: the hvd_compress CLI (entry point hvd_compress.cli:main) is not installed" >&2; exit 1; }
	$(RUN) $(VENV)/bin/hvd-compress demo
	@echo
	@echo "== 2 processes under horovodrun --gloo: examples/pytorch_train.py, RegTop-k at 1% =="
	@set -o pipefail; $(RUN) TF_CPP_MIN_LOG_LEVEL=3 $(VENV)/bin/horovodrun -np 2 --gloo \
	  $(VENV)/bin/python examples/pytorch_train.py --compression regtopk --ratio 0.01 --epochs 5 2>&1 \
	  | sed -n 's/^\[0\]<stdout>://p'

clean:
	rm -rf $(VENV) .venv-installs
