#!/usr/bin/env bash
# ci/install_fashion_mnist.sh: Fashion-MNIST for `python -m benchmarks convergence --data fashion-mnist`,
# from Debian's and Ubuntu's package dataset-fashion-mnist (about 30 MB; the four gzipped IDX files).
#
#   ci/install_fashion_mnist.sh       root (or sudo): apt-get install dataset-fashion-mnist, which puts
#                                     the files in /usr/share/datasets/fashion-mnist (the loader's default)
#   ci/install_fashion_mnist.sh DIR   no root: apt-get download the package and unpack the IDX files
#                                     into DIR; then export HVD_COMPRESS_FASHION_MNIST=DIR (or pass
#                                     --data-dir DIR to the benchmark)
#
# Elsewhere: the same four files come from https://github.com/zalandoresearch/fashion-mnist (data/fashion).
set -euo pipefail

PACKAGE=dataset-fashion-mnist
SHARE=usr/share/datasets/fashion-mnist
FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

check() {  # check DIR: the four files are there and not empty
  local f
  for f in "${FILES[@]}"; do
    [ -s "$1/$f" ] || { echo "install_fashion_mnist.sh: $1/$f is missing after the install" >&2; exit 1; }
  done
  echo "Fashion-MNIST is in $1"
}

command -v apt-get >/dev/null || {
  echo "install_fashion_mnist.sh: needs apt-get (Debian/Ubuntu); elsewhere put the four IDX files of" \
       "https://github.com/zalandoresearch/fashion-mnist in a folder and export HVD_COMPRESS_FASHION_MNIST" >&2
  exit 1
}

if [ $# -eq 0 ]; then
  SUDO=()
  [ "$(id -u)" -eq 0 ] || SUDO=(sudo)
  apt-cache show "$PACKAGE" >/dev/null 2>&1 || "${SUDO[@]}" apt-get update
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$PACKAGE"
  check "/$SHARE"
else
  mkdir -p "$1"
  DEST="$(cd "$1" && pwd)"
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
  (cd "$WORK" && apt-get download "$PACKAGE") || {
    echo "install_fashion_mnist.sh: apt-get download $PACKAGE failed (as root: apt-get update first)" >&2
    exit 1
  }
  dpkg-deb -x "$WORK"/"$PACKAGE"_*.deb "$WORK/root"
  cp "${FILES[@]/#/$WORK/root/$SHARE/}" "$DEST/"
  check "$DEST"
  echo "export HVD_COMPRESS_FASHION_MNIST=$DEST"
fi
