"""Real image data for the convergence study: Fashion-MNIST (IDX files) and scikit-learn's 8x8 digits.

- **Fashion-MNIST** (Xiao et al. 2017): 60,000 training and 10,000 test
  grey-scale 28x28 images of ten kinds of clothing, as the four IDX files
  ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (gzipped or not).
  Debian's and Ubuntu's ``dataset-fashion-mnist`` package puts them gzipped in
  ``/usr/share/datasets/fashion-mnist``; ``ci/install_fashion_mnist.sh``
  installs that package (root), or unpacks it into a folder of your choice
  (no root). The folder is, in this order: the ``folder`` argument, the
  environment variable ``HVD_COMPRESS_FASHION_MNIST``, the package's.
- **digits** (``sklearn.datasets.load_digits``): 1,797 8x8 images of
  handwritten digits, 0-16 grey levels, bundled with scikit-learn (no download);
  a fixed split of 1,437 training and 360 test images.

IDX (LeCun's MNIST format): bytes ``0 0 T D``, then ``D`` big-endian uint32
dimensions, then the row-major data, big-endian, of type ``T`` (``0x08``
uint8, ``0x09`` int8, ``0x0B`` int16, ``0x0C`` int32, ``0x0D`` float32,
``0x0E`` float64).

Images come back as float32 ``(n, 1, h, w)``, standardized with the training
set's mean and standard deviation (one number each); labels as int64.
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

#: Where Debian's ``dataset-fashion-mnist`` package puts the IDX files.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
#: Environment variable naming another folder.
FASHION_MNIST_ENV = "HVD_COMPRESS_FASHION_MNIST"
INSTALL_SCRIPT = "ci/install_fashion_mnist.sh"
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
#: IDX type byte -> numpy dtype (big-endian).
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
#: Test images of the fixed digits split (about 20% of 1,797).
DIGITS_TEST = 360
DATASETS = ("digits", "fashion-mnist")


@dataclass
class Images:
    """A training and a test set: numpy images ``(n, 1, h, w)`` float32 and labels int64."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    source: str

    @property
    def shape(self) -> Tuple[int, ...]:
        """The shape of one image, ``(1, h, w)``."""
        return tuple(self.train_x.shape[1:])

    def describe(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "image_shape": list(self.shape),
            "train_images": int(len(self.train_y)),
            "test_images": int(len(self.test_y)),
        }


# ----------------------------------------------------------------------- IDX
def parse_idx(data: bytes, what: str = "IDX data") -> np.ndarray:
    """The array in the IDX bytes ``data`` (native byte order); ``ValueError`` naming ``what`` if malformed."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{what}: not an IDX file (it must start with two zero bytes)")
    kind, ndim = data[2], data[3]
    if kind not in IDX_TYPES:
        raise ValueError(f"{what}: unknown IDX data type 0x{kind:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{what}: IDX header of {ndim} dimensions is cut short")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    dtype = np.dtype(IDX_TYPES[kind])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(f"{what}: {len(data)} bytes, but an IDX array of shape {shape} takes {expected}")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def read_idx(path: Union[str, Path]) -> np.ndarray:
    """The array of the IDX file ``path``, gzipped (recognized by its magic bytes) or not."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return parse_idx(raw, str(path))


# ------------------------------------------------------------- Fashion-MNIST
def fashion_mnist_folder(folder: Optional[Union[str, Path]] = None) -> Path:
    """``folder``, else ``$HVD_COMPRESS_FASHION_MNIST``, else the Debian package's folder."""
    return Path(folder or os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DIR)


def find_idx(folder: Path, stem: str) -> Optional[Path]:
    """``folder/stem.gz`` or ``folder/stem``, whichever exists (the gzipped one first)."""
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def missing_message(folder: Path, missing: Tuple[str, ...]) -> str:
    return (
        f"Fashion-MNIST is not in {folder}: {', '.join(f'{m}[.gz]' for m in missing)} missing. "
        f"Install it with {INSTALL_SCRIPT} (Debian/Ubuntu package dataset-fashion-mnist, into "
        f"{FASHION_MNIST_DIR}; as a user: {INSTALL_SCRIPT} DIR, then export {FASHION_MNIST_ENV}=DIR), "
        f"or point {FASHION_MNIST_ENV} or --data-dir at a folder with the four IDX files"
    )


def load_fashion_mnist(
    folder: Optional[Union[str, Path]] = None,
    train: Optional[int] = None,
    test: Optional[int] = None,
    subset_seed: int = 0,
) -> Images:
    """Fashion-MNIST from its IDX files; ``FileNotFoundError`` naming the install script when missing.

    ``train`` / ``test``: take that many images (a class-mixed subset drawn
    with ``subset_seed``, the same for every training seed); ``None``: all.
    """
    where = fashion_mnist_folder(folder)
    paths = {key: find_idx(where, stem) for key, stem in FASHION_MNIST_FILES.items()}
    missing = tuple(FASHION_MNIST_FILES[key] for key, path in paths.items() if path is None)
    if missing:
        raise FileNotFoundError(missing_message(where, missing))
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for part in ("train", "test"):
        x, y = arrays[f"{part}_x"], arrays[f"{part}_y"]
        if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
            raise ValueError(
                f"Fashion-MNIST in {where}: {part} images of shape {x.shape} do not match labels of shape {y.shape}"
            )
    rng = np.random.default_rng(subset_seed)
    train_x, train_y = _subset(arrays["train_x"], arrays["train_y"], train, rng)
    test_x, test_y = _subset(arrays["test_x"], arrays["test_y"], test, rng)
    return _standardized("fashion-mnist", train_x, train_y, test_x, test_y, str(where))


def _subset(x: np.ndarray, y: np.ndarray, n: Optional[int], rng: np.random.Generator):
    if n is None or n >= len(y):
        return x, y
    if n < 1:
        raise ValueError(f"need at least one image, got {n}")
    pick = np.sort(rng.permutation(len(y))[:n])
    return x[pick], y[pick]


def _standardized(name: str, train_x, train_y, test_x, test_y, source: str) -> Images:
    """Images as float32 ``(n, 1, h, w)``, standardized by the training set's mean and standard deviation."""
    train_x = np.asarray(train_x, dtype=np.float32)
    test_x = np.asarray(test_x, dtype=np.float32)
    mean, std = float(train_x.mean()), float(train_x.std()) or 1.0

    def prepare(x: np.ndarray) -> np.ndarray:
        return ((x - mean) / std).astype(np.float32)[:, None, :, :]

    return Images(
        name,
        prepare(train_x),
        np.asarray(train_y, dtype=np.int64),
        prepare(test_x),
        np.asarray(test_y, dtype=np.int64),
        source,
    )


# ------------------------------------------------------------------- digits
def load_digits(train: Optional[int] = None, test: Optional[int] = None) -> Images:
    """scikit-learn's 8x8 digits: a fixed split (seed 0) of 1,437 training and 360 test images.

    ``train`` / ``test`` take the first that many of each part.
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as error:
        raise ImportError(
            f"the digits data set comes with scikit-learn ({error}); install it with "
            "pip install scikit-learn (or pip install 'hvd_compress[bench]')"
        ) from error
    bunch = sklearn_digits()
    order = np.random.default_rng(0).permutation(len(bunch.target))
    images, labels = bunch.images[order], bunch.target[order]
    cut = len(labels) - DIGITS_TEST
    train_x, train_y = images[:cut][:train], labels[:cut][:train]
    test_x, test_y = images[cut:][:test], labels[cut:][:test]
    if len(train_y) < 1 or len(test_y) < 1:
        raise ValueError(f"need at least one training and one test image, got {train} and {test}")
    return _standardized("digits", train_x, train_y, test_x, test_y, "sklearn.datasets.load_digits")


def load(
    name: str, train: Optional[int] = None, test: Optional[int] = None, folder: Optional[str] = None
) -> Images:
    """``digits`` or ``fashion-mnist``, with at most ``train`` / ``test`` images."""
    if name == "digits":
        return load_digits(train, test)
    if name == "fashion-mnist":
        return load_fashion_mnist(folder, train, test)
    raise ValueError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}")
