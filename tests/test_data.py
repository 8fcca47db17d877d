"""Data loaders: idx files written by the test, and the bundled digits."""
import gzip
import struct

import numpy as np
import pytest

from propagators.data import load_digits, load_mnist, read_idx


def write_idx(path, array, code):
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.write_bytes(payload)


def test_idx_roundtrip_plain_and_gzip(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, size=5).astype(np.uint8)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images, 0x08)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels, 0x08)
    X, y = load_mnist(tmp_path, "t10k")
    assert X.shape == (5, 784) and X.dtype == np.float32
    np.testing.assert_array_equal(X, images.reshape(5, -1) / np.float32(255))
    np.testing.assert_array_equal(y, labels)
    floats = rng.standard_normal((3, 4))
    write_idx(tmp_path / "f.idx", floats, 0x0E)
    np.testing.assert_array_equal(read_idx(tmp_path / "f.idx"), floats)


def test_idx_errors(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="magic"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((2, 2), np.uint8), 0x08)
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ValueError, match="header"):
        read_idx(tmp_path / "short")
    with pytest.raises(FileNotFoundError, match="cannot be downloaded"):
        load_mnist(tmp_path, "train")


def test_digits_split_is_stratified_and_standardised():
    X_train, y_train, X_test, y_test = load_digits(seed=1)
    assert X_train.shape[1] == 64 and len(X_train) + len(X_test) == 1797
    assert set(np.unique(y_test)) == set(range(10))
    assert abs(float(X_train.mean())) < 1e-5
    counts = np.bincount(y_test, minlength=10) / np.bincount(np.concatenate([y_train, y_test]), minlength=10)
    assert np.all(np.abs(counts - 0.2) < 0.02)


def test_idx_files_cut_short_compressed_without_suffix_or_empty(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "ok", images, 0x08)
    raw = (tmp_path / "ok").read_bytes()
    (tmp_path / "zipped").write_bytes(gzip.compress(raw))  # gzip's signature decides, not the name
    np.testing.assert_array_equal(read_idx(tmp_path / "zipped"), images)
    (tmp_path / "header").write_bytes(raw[:9])
    with pytest.raises(ValueError, match="header is cut short"):
        read_idx(tmp_path / "header")
    write_idx(tmp_path / "f", np.ones(3, np.float32), 0x0D)
    (tmp_path / "f").write_bytes((tmp_path / "f").read_bytes()[:-1])  # not a whole number of floats
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(tmp_path / "f")
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((0, 28, 28), np.uint8), 0x08)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(0, np.uint8), 0x08)
    X, y = load_mnist(tmp_path)
    assert X.shape == (0, 784) and y.shape == (0,)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros((0, 2), np.uint8), 0x08)
    with pytest.raises(ValueError, match="labels 1-dimensional"):
        load_mnist(tmp_path)


def test_digits_test_fraction_is_validated_and_every_class_keeps_a_training_sample():
    for bad in (-0.1, 1.0, 1.5, float("nan"), True, "0.2", None):
        with pytest.raises(ValueError, match="test_fraction"):
            load_digits(bad)
    X_train, y_train, X_test, y_test = load_digits(0.0)
    assert len(X_test) == 0 and len(X_train) == 1797 and np.all(np.isfinite(X_train))
    X_train, y_train, X_test, y_test = load_digits(0.9999)  # rounds to the whole class: one sample kept
    assert np.array_equal(np.bincount(y_train, minlength=10), np.ones(10)) and np.all(np.isfinite(X_test))


def test_a_cut_short_gzip_stream_names_the_file(tmp_path):
    write_idx(tmp_path / "ok.gz", np.arange(600, dtype=np.uint8).reshape(6, 10, 10) % 7, 0x08)
    raw = (tmp_path / "ok.gz").read_bytes()
    (tmp_path / "cut.gz").write_bytes(raw[: len(raw) // 2])  # was a bare EOFError from gzip
    with pytest.raises(ValueError, match=r"cut\.gz.*cut short or corrupt"):
        read_idx(tmp_path / "cut.gz")
    (tmp_path / "bad.gz").write_bytes(raw[:10] + bytes(b ^ 0xFF for b in raw[10:]))
    with pytest.raises(ValueError, match=r"bad\.gz"):
        read_idx(tmp_path / "bad.gz")


def test_a_header_whose_sizes_overflow_int64_is_not_read_as_matching(tmp_path):
    """Three sizes of 2^21 and 2^22 multiply to 2^64: np.prod wrapped to 0, which 'matched' an empty body."""
    header = struct.pack(">BBBB", 0, 0, 0x08, 3) + struct.pack(">3I", 2**21, 2**21, 2**22)
    (tmp_path / "huge").write_bytes(header)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_idx(tmp_path / "huge")


def test_mnist_float_images_are_not_divided_by_255_and_labels_must_be_integers(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.random((4, 5, 6)).astype(np.float32)  # already in [0, 1]
    write_idx(tmp_path / "train-images-idx3-ubyte", images, 0x0D)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(4, dtype=np.uint8), 0x08)
    X, y = load_mnist(tmp_path)
    np.testing.assert_array_equal(X, images.reshape(4, 30))
    assert y.dtype == np.int64 and list(y) == [0, 1, 2, 3]
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([0.5, 1, 2, 3]), 0x0E)
    with pytest.raises(ValueError, match="integer type"):
        load_mnist(tmp_path)


@pytest.mark.parametrize("code, dtype", [(0x09, np.int8), (0x0B, np.int16), (0x0C, np.int32)])
def test_mnist_integer_images_of_any_width_are_grey_levels(tmp_path, code, dtype):
    images = (np.arange(2 * 3 * 4) * 3).astype(dtype).reshape(2, 3, 4)
    write_idx(tmp_path / "train-images-idx3-ubyte", images, code)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(2, dtype=np.uint8), 0x08)
    X, _ = load_mnist(tmp_path)
    np.testing.assert_array_equal(X, images.reshape(2, 12).astype(np.float32) / np.float32(255))


@pytest.mark.parametrize("images, code, match", [
    (np.array([[[-1, 127]]], np.int8), 0x09, "integers from -1 to 127, outside the grey levels 0..255"),
    (np.array([[[1000, 65793]]], ">i4"), 0x0C, "integers from 1000 to 65793"),
])
def test_integer_images_outside_the_grey_levels_are_refused(tmp_path, images, code, match):
    # they were scaled by 1/255 all the same: -0.0039 and 258 for "grey levels scaled to [0, 1]"
    write_idx(tmp_path / "train-images-idx3-ubyte", images, code)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([3], np.uint8), 0x08)
    with pytest.raises(ValueError, match=match):
        load_mnist(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte", np.array([[[0, 255]]], ">i2"), 0x0B)  # in range: any type
    np.testing.assert_array_equal(load_mnist(tmp_path)[0], [[0.0, 1.0]])


def test_negative_labels_are_refused(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 1, 1), np.uint8), 0x08)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([1, -1], np.int8), 0x09)
    with pytest.raises(ValueError, match="include -1; class labels must be >= 0"):
        load_mnist(tmp_path)


def test_digits_pixels_constant_in_training_are_only_centred():
    """With seed 3 pixel 56 is 0 in every training image: a test image's 1/16 there became 62.5 (std + 1e-3)."""
    X_train, _, X_test, _ = load_digits(seed=3)
    const = np.flatnonzero(X_train.std(0) == 0)
    assert 56 in const
    assert np.all(X_train[:, const] == 0)  # centred
    # a test value of a constant pixel is its raw value minus the training mean: never scaled up
    assert np.abs(X_test[:, const]).max() <= 1.0


def test_mnist_kind_is_checked(tmp_path):
    with pytest.raises(ValueError, match="`kind` must be 'train' or 't10k'"):
        load_mnist(tmp_path, "test")
