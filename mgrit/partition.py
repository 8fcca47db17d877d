"""How the time axis is split over the ranks of a communicator.

The ownership rule, used by :func:`mgrit.solve`, :mod:`mgrit.model` and the
layer-parallel wrappers alike:

* rank ``p`` owns one contiguous block ``lo..hi`` (inclusive) of fine points;
  the blocks follow the rank order and cover every fine point exactly once.
  By default they are balanced (:func:`block_range`); a ``partition`` lists
  the fine index at which every rank's block starts;
* on a coarser level whose point ``k`` is the fine point ``k * stride``,
  coarse point ``k`` belongs to the owner of fine point ``k * stride``, so a
  rank owns the same time points on every level and injection and correction
  need no messages;
* a rank may own nothing on a level (more ranks than points): its range is
  then empty, with ``hi < lo``.

Every function here is pure and cheap (O(number of ranks) per level).

Examples
--------
Eleven fine points (``N = 10``) on three ranks, coarsened by 2 twice:

>>> import numpy as np, mgrit
>>> h = mgrit.build_hierarchy(np.linspace(0, 1, 11), cf=2, max_levels=3)
>>> for ranges in level_ranges(h, 3):
...     print(ranges)
[(0, 2), (3, 6), (7, 10)]
[(0, 1), (2, 3), (4, 5)]
[(0, 0), (1, 1), (2, 2)]
>>> neighbours(level_ranges(h, 3)[1], 1)
(0, 2)
"""
from __future__ import annotations

import math
import operator
from bisect import bisect_right
from typing import Sequence

import numpy as np

__all__ = ["block_range", "fine_ranges", "level_ranges", "neighbours"]


def block_range(n_points: int, size: int, rank: int) -> tuple[int, int]:
    """Contiguous, balanced block of ``n_points`` indices owned by ``rank`` (hi inclusive).

    Parameters
    ----------
    n_points : int
        Number of indices ``0 .. n_points - 1`` to split.
    size : int
        Number of ranks.
    rank : int
        The rank, ``0 <= rank < size``.

    Returns
    -------
    (lo, hi) : tuple of int
        First and last index of the block; ``hi < lo`` when it is empty.

    Examples
    --------
    >>> [block_range(10, 3, r) for r in range(3)]
    [(0, 2), (3, 5), (6, 9)]
    >>> [block_range(2, 3, r) for r in range(3)]
    [(0, -1), (0, 0), (1, 1)]
    """
    return (rank * n_points) // size, ((rank + 1) * n_points) // size - 1


def fine_ranges(n_points: int, size: int, partition: Sequence[int] | None = None) -> list:
    """``(lo, hi)`` of every rank on the fine level.

    Parameters
    ----------
    n_points : int
        Number of fine points (``N + 1``).
    size : int
        Number of ranks.
    partition : sequence of int, optional
        Fine index at which the block of every rank starts: one per rank,
        starting at 0, non-decreasing, at most ``n_points``. Default:
        balanced blocks (:func:`block_range`).

    Returns
    -------
    list of (lo, hi)
        One inclusive range per rank, in rank order.

    Raises
    ------
    ValueError
        ``partition`` does not describe ``size`` ordered blocks.

    Examples
    --------
    >>> fine_ranges(10, 3)
    [(0, 2), (3, 5), (6, 9)]
    >>> fine_ranges(10, 3, partition=[0, 0, 4])
    [(0, -1), (0, 3), (4, 9)]
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"`size` (the number of ranks) must be an integer >= 1, got {size!r}")
    if partition is None:
        return [block_range(n_points, size, r) for r in range(size)]
    starts = [_start(s, partition) for s in partition]
    if len(starts) != size or starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) \
            or starts[-1] > n_points:
        raise ValueError(
            f"`partition` must list one start index per rank ({size}), beginning with 0 and "
            f"non-decreasing up to {n_points}, got {partition!r}"
        )
    ends = starts[1:] + [n_points]
    return [(a, b - 1) for a, b in zip(starts, ends)]


def _start(s, partition) -> int:
    """One start index: an integer (Python, numpy or an integer tensor) or an integral float (5.0); a float
    such as 2.7 was truncated to 2 and NaN raised int()'s own error, a bool counted as 0 or 1."""
    if isinstance(s, (bool, np.bool_, str, bytes)) or str(getattr(s, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"`partition` must list integer start indices, got {s!r} in {partition!r}")
    try:
        return operator.index(s)
    except TypeError:
        pass
    try:
        f = float(s)
    except (TypeError, ValueError):
        f = math.nan
    if not f.is_integer():
        raise ValueError(f"`partition` must list integer start indices, got {s!r} in {partition!r}")
    return int(f)


def level_ranges(hierarchy, size: int, partition: Sequence[int] | None = None) -> list:
    """For every level, the ``(lo, hi)`` owned by every rank.

    Coarse point ``k`` of a level with stride ``s`` belongs to the owner of
    fine point ``k * s``: the rank that owns fine points ``lo..hi`` owns the
    coarse points ``ceil(lo / s) .. floor(hi / s)``. Empty ranges have ``hi < lo``.

    Parameters
    ----------
    hierarchy : Hierarchy
        From :func:`mgrit.build_hierarchy` (only ``n`` and ``stride`` are read).
    size : int
        Number of ranks.
    partition : sequence of int, optional
        Start of every rank's fine block, as in :func:`fine_ranges`.

    Returns
    -------
    list of list of (lo, hi)
        ``out[l][p]`` is the range of rank ``p`` on level ``l``, in that level's indices.

    Examples
    --------
    >>> import numpy as np, mgrit
    >>> h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=4, max_levels=2)
    >>> level_ranges(h, 2)
    [[(0, 3), (4, 8)], [(0, 0), (1, 2)]]
    """
    fine = fine_ranges(hierarchy[0].n + 1, size, partition)
    return [[(-(-lo // lv.stride), hi // lv.stride) for lo, hi in fine] for lv in hierarchy]


def neighbours(ranges: Sequence[tuple[int, int]], rank: int) -> tuple:
    """Left and right neighbour ranks of ``rank`` on one level.

    The left neighbour owns point ``lo - 1`` and the right one point
    ``hi + 1`` (ranks with empty ranges are skipped); None at either end of
    the time axis. ``rank`` must own at least one point.

    Parameters
    ----------
    ranges : sequence of (lo, hi)
        The ranges of all ranks on the level (one entry of :func:`level_ranges`).
    rank : int
        The rank whose neighbours are wanted.

    Returns
    -------
    (left, right) : tuple of int or None

    Examples
    --------
    >>> neighbours([(0, 2), (3, 2), (3, 5)], 0)
    (None, 2)
    >>> neighbours([(0, 2), (3, 2), (3, 5)], 2)
    (0, None)
    """
    lo, hi = ranges[rank]
    owners = [(r[0], p) for p, r in enumerate(ranges) if r[0] <= r[1]]
    starts = [first for first, _ in owners]

    def owner(i):
        return owners[bisect_right(starts, i) - 1][1]

    n = max(r[1] for r in ranges)
    left = owner(lo - 1) if lo > 0 else None
    right = owner(hi + 1) if hi < n else None
    return left, right


def all_neighbours(ranges: Sequence[tuple[int, int]]) -> dict:
    """:func:`neighbours` of every rank that owns points on the level, in one pass over the ranks (the
    ranges are contiguous blocks in rank order: an owner's neighbours are the owners before and after it).

    >>> all_neighbours([(0, 2), (3, 2), (3, 5)])
    {0: (None, 2), 2: (0, None)}
    """
    owners = [p for p, (lo, hi) in enumerate(ranges) if lo <= hi]
    n = max(hi for _, hi in ranges)
    return {p: (owners[k - 1] if ranges[p][0] > 0 else None, owners[k + 1] if ranges[p][1] < n else None)
            for k, p in enumerate(owners)}
