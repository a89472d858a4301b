"""``benchmarks.datasets``: the IDX parser, the Fashion-MNIST loader on tiny files, scikit-learn's digits."""

import gzip
import struct

import numpy as np
import pytest

from benchmarks import datasets


def idx_bytes(array: np.ndarray) -> bytes:
    """``array`` as an IDX file: ``0 0 T D``, D big-endian uint32 dimensions, big-endian data."""
    code = {np.dtype(v).str[1:]: k for k, v in datasets.IDX_TYPES.items()}[array.dtype.str[1:]]
    head = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return head + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_fashion(folder, train=300, test=100, gz=True, seed=0):
    """Four tiny Fashion-MNIST files: image pixels are ``20 * label`` plus the image number mod 7.

    Returns the raw uint8 training images and labels.
    """
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for part, n in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = (20 * labels[:, None, None] + (np.arange(n) % 7)[:, None, None]).astype(np.uint8)
        images = np.broadcast_to(images, (n, 28, 28)).copy()
        arrays[part] = (images, labels)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            data = idx_bytes(array)
            name = f"{part}-{kind}-ubyte"
            if gz:
                (folder / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
    return arrays["train"]


@pytest.mark.parametrize("dtype", ["u1", "i1", ">i2", ">i4", ">f4", ">f8"])
def test_parse_idx_every_type(dtype):
    array = (np.arange(24).reshape(2, 3, 4) - (0 if dtype == "u1" else 5)).astype(dtype)
    parsed = datasets.parse_idx(idx_bytes(array))
    assert parsed.shape == (2, 3, 4) and parsed.dtype.isnative
    np.testing.assert_array_equal(parsed, array)


def test_read_idx_gzipped_or_not(tmp_path):
    labels = np.array([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.uint8)
    (tmp_path / "plain").write_bytes(idx_bytes(labels))
    (tmp_path / "packed.gz").write_bytes(gzip.compress(idx_bytes(labels)))
    (tmp_path / "packed_without_suffix").write_bytes(gzip.compress(idx_bytes(labels)))  # magic bytes decide
    for name in ("plain", "packed.gz", "packed_without_suffix"):
        np.testing.assert_array_equal(datasets.read_idx(tmp_path / name), labels)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x01\x00\x08\x01", "two zero bytes"),
        (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", "unknown IDX data type 0x07"),
        (b"\x00\x00\x08\x02\x00\x00\x00\x02", "cut short"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02", "takes 11"),
    ],
    ids=["magic", "type", "header", "size"],
)
def test_parse_idx_rejects_malformed_files(data, message):
    with pytest.raises(ValueError, match=message):
        datasets.parse_idx(data, "probe")


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "raw"])
def test_fashion_mnist_loader_on_tiny_files(tmp_path, gz):
    images, labels = write_fashion(tmp_path, gz=gz)
    data = datasets.load_fashion_mnist(tmp_path)
    assert data.train_x.shape == (300, 1, 28, 28) and data.test_x.shape == (100, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    assert abs(float(data.train_x.mean())) < 1e-4 and float(data.train_x.std()) == pytest.approx(1, abs=1e-4)
    np.testing.assert_array_equal(data.train_y, labels)
    raw = images.astype(np.float64)
    restored = data.train_x[:, 0] * raw.std() + raw.mean()
    np.testing.assert_allclose(restored, raw, atol=1e-3)  # images stay with their labels


def test_fashion_mnist_subset_keeps_pairs_and_the_environment_variable(tmp_path, monkeypatch):
    images, labels = write_fashion(tmp_path / "fm")
    monkeypatch.setenv(datasets.FASHION_MNIST_ENV, str(tmp_path / "fm"))
    data = datasets.load_fashion_mnist(train=64, test=10)
    assert len(data.train_y) == 64 and len(data.test_y) == 10 and data.source == str(tmp_path / "fm")
    pixel = data.train_x[:, 0, 0, 0]
    # pixel = 20 * label + small offset, standardized: sorted by pixel, labels never decrease
    assert np.all(np.diff(data.train_y[np.argsort(pixel, kind="stable")]) >= 0)
    again = datasets.load_fashion_mnist(train=64, test=10)
    np.testing.assert_array_equal(again.train_y, data.train_y)  # the subset is fixed


def test_missing_fashion_mnist_names_the_install_script(tmp_path, monkeypatch):
    monkeypatch.delenv(datasets.FASHION_MNIST_ENV, raising=False)
    write_fashion(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError) as caught:
        datasets.load_fashion_mnist(tmp_path)
    message = str(caught.value)
    assert "ci/install_fashion_mnist.sh" in message and "t10k-labels-idx1-ubyte[.gz]" in message
    assert "train-images" not in message and str(tmp_path) in message
    with pytest.raises(FileNotFoundError, match="install_fashion_mnist.sh"):
        datasets.load("fashion-mnist", folder=str(tmp_path / "nothing"))


def test_mismatched_fashion_mnist_files_are_refused(tmp_path):
    write_fashion(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(idx_bytes(np.zeros(5, np.uint8))))
    with pytest.raises(ValueError, match="do not match labels"):
        datasets.load_fashion_mnist(tmp_path)


def test_digits_split():
    pytest.importorskip("sklearn")
    data = datasets.load("digits")
    assert data.train_x.shape == (1437, 1, 8, 8) and data.test_x.shape == (360, 1, 8, 8)
    assert set(np.unique(data.test_y)) == set(range(10))
    assert abs(float(data.train_x.mean())) < 1e-4
    small = datasets.load_digits(train=100, test=50)
    np.testing.assert_array_equal(small.train_y, data.train_y[:100])  # the same fixed split
    np.testing.assert_array_equal(small.test_y, data.test_y[:50])
