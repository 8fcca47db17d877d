"""Data sets for the layer-parallel demos: bundled digits and an MNIST idx reader.

Nothing is downloaded: :func:`load_digits` uses the 8 x 8 handwritten digits
that scikit-learn ships; :func:`read_idx` / :func:`load_mnist` read MNIST's
idx files when you have them on disk.
"""
from __future__ import annotations

import gzip
import math
import numbers
import struct
import zlib
from pathlib import Path

import numpy as np

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
              0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path) -> np.ndarray:
    """Read an idx file (MNIST's format; ``.gz`` compressed or not) into an array.

    The header is two zero bytes, a type code, the number of dimensions and one
    big-endian 32-bit size per dimension.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        compressed = fh.read(2) == b"\x1f\x8b"  # gzip's signature, whatever the file's name
    try:
        with (gzip.open if compressed else open)(path, "rb") as fh:
            data = fh.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: the gzip stream is cut short or corrupt ({exc}); copy the file again") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_TYPES:
        raise ValueError(f"{path} is not an idx file (bad magic number)")
    ndim = data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path}: the header is cut short ({len(data)} bytes for {ndim} dimensions)")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_TYPES[data[2]])
    nbytes = len(data) - 4 - 4 * ndim
    if nbytes != math.prod(shape) * dtype.itemsize:  # Python integers: no wrap-around for huge sizes
        raise ValueError(f"{path}: header says {shape} values of {dtype.itemsize} byte(s) but the file holds "
                         f"{nbytes} bytes of data (a truncated or corrupt file?)")
    body = np.frombuffer(data, dtype=dtype, offset=4 + 4 * ndim)
    return body.reshape(shape).astype(dtype.newbyteorder("="))


def load_mnist(directory, kind: str = "train"):
    """Images (n, rows * cols) as float32 and labels (n,) as int64 from MNIST idx files in ``directory``.

    Looks for ``{kind}-images-idx3-ubyte[.gz]`` and ``{kind}-labels-idx1-ubyte[.gz]``
    with ``kind`` "train" or "t10k". Integer images (MNIST's own are bytes, type
    code 0x08) are grey levels 0..255 scaled to [0, 1] by 1/255 (other values are a
    ValueError); images stored as floats are returned as they are (already scaled).
    Labels must be whole numbers >= 0 of an integer type.
    """
    if kind not in ("train", "t10k"):
        raise ValueError(f"`kind` must be 'train' or 't10k' (MNIST's file prefixes: t10k-images-idx3-ubyte is the "
                         f"test set), got {kind!r}")
    d = Path(directory)

    def find(stem):
        for name in (stem, stem + ".gz"):
            if (d / name).exists():
                return d / name
        raise FileNotFoundError(f"no {stem}[.gz] in {d}; MNIST cannot be downloaded here, copy the files in")

    images = read_idx(find(f"{kind}-images-idx3-ubyte"))
    labels = read_idx(find(f"{kind}-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(f"MNIST in {d}: images must be 3-dimensional (n, rows, cols) and labels 1-dimensional "
                         f"(n,); got {images.shape} and {labels.shape}")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    if images.dtype.kind not in "uif":
        raise ValueError(f"MNIST images in {d} hold {images.dtype} values; expected bytes (MNIST's own) or floats")
    if labels.dtype.kind not in "ui":
        raise ValueError(f"MNIST labels in {d} hold {labels.dtype} values; class labels must be an integer type "
                         "(MNIST's own are bytes)")
    if images.dtype.kind in "ui" and images.size and (images.min() < 0 or images.max() > 255):
        raise ValueError(f"MNIST images in {d} hold integers from {images.min()} to {images.max()}, outside the grey "
                         "levels 0..255 that integer images are scaled from; store bytes (type 0x08) or floats")
    if labels.size and labels.min() < 0:
        raise ValueError(f"MNIST labels in {d} include {labels.min()}; class labels must be >= 0")
    n, rows, cols = images.shape
    X = images.reshape(n, rows * cols).astype(np.float32)
    if images.dtype.kind in "ui":  # grey levels 0..255 (MNIST's bytes, or any integer type)
        X /= np.float32(255.0)
    return X, labels.astype(np.int64)


def load_digits(test_fraction: float = 0.2, seed: int = 0):
    """scikit-learn's 8 x 8 digits, standardised, split into train and test sets.

    Returns ``(X_train, y_train, X_test, y_test)`` as numpy arrays (float32, int64).
    Each pixel is centred by its mean over the training set and divided by
    its standard deviation there plus 1e-3 (a pixel constant there is only
    centred). The split is
    stratified and fixed by ``seed``; ``test_fraction`` lies in
    [0, 1) (0: every sample in the training set, an empty test set); every
    class keeps at least one training sample.
    """
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real) \
            or not 0.0 <= float(test_fraction) < 1.0:
        raise ValueError(f"`test_fraction` must be a number in [0, 1) (the share of each class held out), "
                         f"got {test_fraction!r}")
    from sklearn.datasets import load_digits as _load

    data = _load()
    X, y = data.data.astype(np.float32) / 16.0, data.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test[idx[: min(int(round(test_fraction * len(idx))), len(idx) - 1)]] = True  # one sample per class trains
    mean, std = X[~test].mean(0), X[~test].std(0)
    scale = np.where(std == 0, np.float32(1.0), std + np.float32(1e-3))  # a pixel constant over the training set
    X = (X - mean) / scale  # is only centred (std + 1e-3 blew a test image's stray value there up 1000-fold)
    return X[~test], y[~test], X[test], y[test]
