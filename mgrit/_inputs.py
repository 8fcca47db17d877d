"""Whether the ranks of a solve hold the same array, up to rounding.

Each rank reduces its array to five sums (:func:`array_sums`); the ranks
exchange them in a handshake and compare them with a tolerance
(:func:`sums_gap`). Sums cannot see every difference: a change far below the
largest entries (``[3, 1e20]`` against ``[4, 1e20]``) is within the rounding
of the sums and passes. Used for the initial state of :func:`mgrit.solve` and for
the inputs and output gradients of the torch blocks: data that every rank must
pass alike, but that may come out of computations on other hardware (so the
last bits may differ).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _backend as B

__all__ = ["array_sums", "differing_rank", "flat_weights", "spread", "sums_gap", "sums_rtol", "weights"]

WIDTH = 61  #: the width of the view that large arrays are summed in (a prime: rows and columns mix)
WEIGHT_WIDTHS = (61, 64)  #: the widths of the two views whose row and column weights the random sum uses
_CACHED = 1 << 16  # weight vectors up to this length are kept (longer ones, the rows of a large array, are drawn)


def weights(n: int, key: tuple) -> np.ndarray:
    """``n`` pseudo-random weights (float64), the same on every rank and in every run with one numpy (its
    ``default_rng`` streams). ``key`` ``(width, part)`` names the rows (part 1) or columns (2) of an array's
    view of that width or its last ``size % width`` entries (3). Row weights are +-1 or +-1/2, which scale
    an entry exactly in its own dtype; the others, applied in float64, are drawn from +-[1/2, 3/2], so that
    no two are equal (neighbouring entries whose weights tie would swap unseen). Read only.

    >>> r, c = weights(1000, (61, 1)), weights(1000, (64, 2))
    >>> sorted(set(np.abs(r).tolist())), bool(np.all((np.abs(c) >= 0.5) & (np.abs(c) <= 1.5))), len(set(c))
    ([0.5, 1.0], True, 1000)
    """
    return _cached_weights(n, key) if n <= _CACHED else _draw_weights(n, key)


def _draw_weights(n: int, key: tuple) -> np.ndarray:
    rng = np.random.default_rng((0x5EED, *key))
    sign = rng.integers(0, 2, n).astype(np.float64) * 2.0 - 1.0
    size = np.where(rng.integers(0, 2, n) == 1, 1.0, 0.5) if key[1] == 1 else 0.5 + rng.random(n)
    out = sign * size
    out.flags.writeable = False
    return out


_cached_weights = functools.lru_cache(maxsize=64)(_draw_weights)


@functools.lru_cache(maxsize=64)
def flat_weights(n: int) -> np.ndarray:
    """The weights of the random sum of an array of ``n`` entries in flat order (``n`` up to 4,096): for its
    view of each width in :data:`WEIGHT_WIDTHS`, ``r_i c_j`` for the entry in row ``i`` and column ``j`` and
    their own for the last ``n % width`` entries, added. Two widths, so that samples of a multiple of one
    width, which fill whole rows of its view, still move the sum when two swap."""
    out = np.zeros(n)
    for width in WEIGHT_WIDTHS:
        rows = n // width
        out += np.concatenate([np.outer(weights(rows, (width, 1)), weights(width, (width, 2))).reshape(-1),
                               weights(n - rows * width, (width, 3))])
    out.flags.writeable = False
    return out


def _random_sum(v: np.ndarray) -> float:
    """The random sum (:func:`flat_weights`) of a flat array, from its views: the row weights applied exactly
    in its dtype, the rest in float64."""
    n, total = v.size, 0.0
    for width in WEIGHT_WIDTHS:
        body, tail = v[: n - n % width].reshape(-1, width), v[n - n % width:]
        rows = weights(body.shape[0], (width, 1))
        # (float64: a matrix-vector product; narrower types: exact scalings by +-1 or +-1/2, summed in float64)
        cols = rows @ body if v.dtype == np.float64 else (body * rows.astype(v.dtype)[:, None]).sum(0, dtype=np.float64)
        total += float(cols @ weights(width, (width, 2)) + tail.astype(np.float64) @ weights(len(tail), (width, 3)))
    return total


def array_sums(v: np.ndarray) -> tuple:
    """(sum of squares, sum of magnitudes, sum of magnitudes weighted by flat position, sum of values
    weighted by flat position, sum of values with pseudo-random weights) of a flat real array, summed in
    float64. The weighted sums tell a shuffled array, the fourth a sign (every entry's: the weights
    ``k + 1`` of entry ``k`` start at 1); the random sum, about ``sqrt(n)`` times an entry, moves by about
    ``sqrt(m)`` times one when ``m`` entries change (another sample, two neighbouring samples swapped), which
    the others, about ``n`` times an entry, do not see in a large array. Above 4,096 entries the weights
    ``61 i + j + 1`` come from the column and row sums of a 61-wide view, the random ones from the rows and
    columns of two views (:func:`flat_weights`), and the last entries are summed on their own (with the same
    weights as the entries of a small array in flat order).

    >>> array_sums(np.array([1.0, -2.0, 3.0]))[:4]
    (14.0, 6.0, 14.0, 6.0)
    >>> array_sums(np.array([-1.0]))[3] != array_sums(np.array([1.0]))[3]
    True
    """
    n = v.size
    if v.dtype.kind not in "f":  # (integers: no wrap-around in abs)
        v = v.astype(np.float64)
    if n <= 4096:
        w = v.astype(np.float64)
        k, a = np.arange(1, n + 1, dtype=np.float64), np.abs(w)
        return float(w @ w), float(a.sum()), float(a @ k), float(w @ k), float(w @ flat_weights(n))
    body, tail = v[: n - n % WIDTH].reshape(-1, WIDTH), v[n - n % WIDTH:]
    cols, rows = np.arange(1.0, WIDTH + 1.0), np.arange(body.shape[0]) * float(WIDTH)
    last = np.arange(n - n % WIDTH + 1, n + 1, dtype=np.float64)

    def weighted(b, t):
        return float(b.sum(0, dtype=np.float64) @ cols + b.sum(1, dtype=np.float64) @ rows
                     + t.astype(np.float64) @ last)

    mags, tmags = np.abs(body), np.abs(tail)
    squares = float(np.dot(v, v) if v.dtype == np.float64 else np.square(v, dtype=np.float64).sum())
    total = float(mags.sum(dtype=np.float64) + tmags.sum(dtype=np.float64))
    return squares, total, weighted(mags, tmags), weighted(body, tail), _random_sum(v)


def sums_rtol(eps: float, spread: float = 1.0) -> float:
    """How far two ranks' sums of an array may differ for a dtype of machine epsilon ``eps``: rounding
    in what computed the array (on other hardware), not other data.

    100 units in the last place where that is at most 1e-4 (float32, float64). For float16 and
    bfloat16 that would pass other data. A unit in every entry, in random directions, moves the sum of
    squares by about ``2 eps spread`` (:func:`spread`: ``1 / sqrt(n)`` for ``n`` entries of one size,
    1 for one entry that dominates), other data by about ``2 / sqrt(n)``; they get ``16 eps spread``
    (eight times the first), at least 1e-4 and at most 8 units.

    ``spread`` may be a function that returns it: it is called only for float16 / bfloat16, which need it.

    >>> sums_rtol(np.finfo(np.float64).eps) < 1e-13, sums_rtol(2.0 ** -7, 1 / 64), sums_rtol(2.0 ** -7, 1.0)
    (True, 0.001953125, 0.0625)
    """
    eps = float(eps)
    if 100 * eps <= 1e-4:
        return 100 * eps
    return min(8 * eps, max(1e-4, 16 * eps * float(spread() if callable(spread) else spread)))


def spread(v) -> float:
    """``sqrt(sum x^4) / sum x^2`` of a flat real array or tensor (in float64, a tensor on its device):
    ``1 / sqrt(n)`` for ``n`` entries of one magnitude, 1 for one entry that dominates (or none: zeros).
    What rounding moves the sums by.

    >>> spread(np.ones(4)), spread(np.array([100.0, 0.0, 0.0])), spread(np.zeros(3))
    (0.5, 1.0, 1.0)
    """
    if B.is_torch(v):
        import torch

        w = v.double().square()
        s, fourth = float(w.sum()), float(torch.linalg.vector_norm(w))
    else:
        w = np.square(v, dtype=np.float64)
        s, fourth = float(w.sum()), float(np.sqrt(w @ w))
    return fourth / s if s > 0 and math.isfinite(s) else 1.0


def differing_rank(sums: list) -> int | None:
    """The first rank whose sums (``sums``: every rank's :func:`array_sums` followed by its tolerance, in
    rank order) differ from rank 0's by more than the largest tolerance; None when none does.

    >>> same = (1.0, 1.0, 1.0, 1.0, 1.0, 1e-6)
    >>> differing_rank([same, same, (2.0, 1.0, 1.0, 1.0, 1.0, 1e-6)])
    2
    """
    rtol = max(s[5] for s in sums)
    return next((r for r, s in enumerate(sums) if sums_gap(s, sums[0]) > rtol), None)


def sums_gap(s, s0) -> float:
    """Largest relative difference between one rank's sums ``s`` and rank 0's ``s0`` (the first five
    entries, as :func:`array_sums` makes them; NaN and Inf left out, but NaN or Inf on one side only
    is an infinite gap). The sums with signs and random weights are relative to the matching sums of
    magnitudes (rounding moves them by a few units of those at most).

    >>> sums_gap((14.0, 6.0, 8.0, 4.0, 2.0), (14.0, 6.0, 8.0, 4.0, 2.0))
    0.0
    >>> sums_gap((1.0, 1.0, 1.0, 1.0, 0.0), (1.0, 1.0, 1.0, 1.0, 1.0))
    1.0
    """
    scales = (max(abs(s[0]), abs(s0[0])), max(abs(s[1]), abs(s0[1])), max(abs(s[2]), abs(s0[2])),
              max(abs(s[2]), abs(s0[2])), max(abs(s[1]), abs(s0[1])))
    if any(math.isfinite(a) != math.isfinite(b) for a, b in zip(s[:5], s0[:5])):
        return math.inf  # NaN or Inf on some ranks only: different arrays
    return max((abs(a - b) / max(m, 1e-300) for a, b, m in zip(s[:5], s0[:5], scales)
                if math.isfinite(a) and math.isfinite(b)), default=0.0)
