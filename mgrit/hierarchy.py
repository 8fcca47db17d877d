"""The time-grid hierarchy: a list of small frozen level descriptions.

Level ``l + 1`` keeps every ``cf_l``-th point of level ``l`` (index 0
included). A coarser level is created while ``floor(N_l / cf_l) >= min_coarse``
and fewer than ``max_levels`` levels exist (XBraid's rule). When ``N_l`` is not
a multiple of ``cf_l``, the points after the last C-point are F-points of the
last interval. Building the hierarchy costs O(N) time and memory.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from . import _backend as B

_RELAX_RE = re.compile(r"^F(CF)*$")


def per_level_entries(value):
    """The entries of a per-level value: a list or tuple as it is, a 1-D numpy array as a list of its
    numbers; None for one value (a string, a number, a 0-d array, any other object)."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    return value


def frozen_per_level(value):
    """A per-level value as one comparable value: a list, tuple or 1-D numpy array as a tuple of its entries
    (numpy's as Python numbers), anything else as it is."""
    entries = per_level_entries(value)
    return value if entries is None else tuple(entries)


def per_level(value, n: int, name: str) -> list:
    """Expand a scalar or a sequence (a list, a tuple or a 1-D numpy array; last entry repeats) to ``n``
    per-level values."""
    entries = per_level_entries(value)
    if entries is None:
        return [value] * n
    if len(entries) == 0:
        raise ValueError(f"`{name}` is an empty sequence; give one value or one per level")
    return [entries[min(i, len(entries) - 1)] for i in range(n)]


def _levels_to_check(max_levels: int, *values) -> int:
    """How many per-level entries can matter: a grid of fewer than 2^64 points has at most 64 levels (every
    level at least halves it) and a sequence's last entry repeats, so ``max_levels = 10**9`` costs nothing."""
    longest = max([len(e) for e in map(per_level_entries, values) if e is not None] + [1])
    return min(int(max_levels), 64 + longest)


def is_integer(x) -> bool:
    """True for Python and numpy integers; False for bools (``True`` is no level count).

    >>> is_integer(3), is_integer(np.int64(3)), is_integer(True), is_integer(3.0)
    (True, True, False, False)
    """
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_integer(value, name: str, minimum: int, hint: str = "") -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an integer ``>= minimum``.

    >>> check_integer(True, "max_levels", 1)
    Traceback (most recent call last):
    ...
    ValueError: `max_levels` must be an integer >= 1, got True (a bool; pass an integer)
    """
    if is_integer(value) and value >= minimum:
        return
    note = " (a bool; pass an integer)" if isinstance(value, (bool, np.bool_)) else ""
    raise ValueError(f"`{name}` must be an integer >= {minimum}{hint}, got {value!r}{note}")


def check_real(value, name: str, minimum: float | None = None, what: str = "a finite number") -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is a finite real number (at least ``minimum``):
    a Python or numpy number, a 0-d array or tensor, a Fraction; not a bool or a string.

    >>> check_real(np.array(0.5), "latency", 0.0), check_real(3, "a")
    (0.5, 3.0)
    """
    number = None
    if not isinstance(value, (bool, np.bool_, str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is None or not np.isfinite(number) or (minimum is not None and number < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"`{name}` must be {what}{bound}, got {value!r}")
    return number


def check_flag(value, name: str) -> bool:
    """``value`` as a bool; ValueError naming ``name`` unless it is one (a string such as "no" is not).

    >>> check_flag("no", "skip")
    Traceback (most recent call last):
    ...
    ValueError: `skip` must be True or False, got 'no'
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return bool(value)


def parse_relax(relax: str) -> int:
    """Number of (C, F) sweeps after the first F sweep: "F" -> 0, "FCF" -> 1, ...

    >>> [parse_relax(r) for r in ("F", "FCF", "FCFCF")]
    [0, 1, 2]
    """
    if not isinstance(relax, str) or not _RELAX_RE.match(relax.upper()):
        raise ValueError(
            f"`relax` must be 'F', 'FCF', 'FCFCF', ... (F followed by CF pairs), got {relax!r}"
        )
    return relax.upper().count("C")


@dataclass(frozen=True, eq=False)
class Level:
    """One level of the time hierarchy.

    Attributes
    ----------
    index : int
        0 is the finest level.
    t : numpy.ndarray, shape (n + 1,)
        Time points of this level (read-only).
    stride : int
        Fine-level index of this level's point ``k`` is ``k * stride``.
    cf : int or None
        Coarsening factor to the next coarser level; None on the coarsest.
    relax : str or None
        Relaxation on this level ("F", "FCF", ...); None on the coarsest,
        which is solved by sequential stepping.
    c_weight : float
        Weight of C-relaxation (1.0 is plain C-relaxation).
    """

    index: int
    t: np.ndarray = field(repr=False)
    stride: int
    cf: int | None
    relax: str | None
    c_weight: float = 1.0

    @property
    def n(self) -> int:
        """Number of intervals (points minus one)."""
        return self.t.shape[0] - 1

    @property
    def nrelax(self) -> int:
        return parse_relax(self.relax) if self.relax else 0


class Hierarchy(tuple):
    """Tuple of :class:`Level` objects, finest first, with a readable table.

    >>> import numpy as np
    >>> print(build_hierarchy(np.linspace(0, 1, 17), cf=4, max_levels=3))
    level  points  intervals  cf  relax
        0      17         16   4  FCF
        1       5          4   -  (sequential)
    """

    def __str__(self) -> str:
        rows = ["level  points  intervals  cf  relax"]
        for lv in self:
            cf = "-" if lv.cf is None else str(lv.cf)
            rx = lv.relax if lv.relax else "(sequential)"
            if lv.relax and lv.c_weight != 1.0:
                rx += f" (C weight {lv.c_weight:g})"
            rows.append(f"{lv.index:5d}  {lv.n + 1:6d}  {lv.n:9d}  {cf:>2}  {rx}")
        return "\n".join(rows)


def check_time_grid(t) -> np.ndarray:
    """Validate ``t`` (1-D, at least 2 points, real, finite, strictly increasing); a float64 copy."""
    if B.is_torch(t):
        t = t.detach().cpu()  # (the grid is data, never differentiated)
    elif isinstance(t, (list, tuple)):  # (0-d tensors among the points, tracked or not)
        t = [float(x.detach()) if B.is_torch(x) else x for x in t]
    kind = type(t).__name__
    try:
        raw = np.asarray(t)
        kind = f"{kind} of {raw.dtype}"
        if raw.dtype.kind == "c":  # (numpy would drop the imaginary part with a warning)
            raise TypeError
        t = np.array(raw, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"`t` must hold real numbers (the time points), got a {kind}") from None
    if t.ndim != 1 or t.shape[0] < 2:
        raise ValueError(f"`t` must be a 1-D array of at least 2 time points, got shape {t.shape}")
    if not np.all(np.isfinite(t)):
        raise ValueError("`t` contains NaN or Inf (or None, read as NaN)")
    if not np.all(np.diff(t) > 0):
        raise ValueError("`t` must be strictly increasing")
    return t


def check_levels(cf, max_levels, min_coarse, relax, c_weight) -> None:
    """Raise ValueError (naming the argument) unless the hierarchy settings are valid.

    The rules of :func:`build_hierarchy`; :class:`mgrit.options.Options` applies
    them once when a solve's settings are built.
    """
    check_integer(max_levels, "max_levels", 1)
    check_integer(min_coarse, "min_coarse", 1)
    # every entry of a sequence is checked, also those beyond the levels a grid makes (a typo is one there too)
    max_levels = _levels_to_check(max_levels, cf, relax, c_weight)
    max_levels = max([max_levels] + [len(e) for e in map(per_level_entries, (cf, relax, c_weight)) if e is not None])
    for c in per_level(cf, max_levels, "cf"):
        if not (is_integer(c) and c >= 2):
            note = " (a bool; pass an integer)" if isinstance(c, (bool, np.bool_)) else ""
            raise ValueError(f"`cf` must be an integer >= 2 (or one per level), got {cf!r}{note}")
    for r in per_level(relax, max_levels, "relax"):
        parse_relax(r)
    for w in per_level(c_weight, max_levels, "c_weight"):
        if not (isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, (bool, np.bool_))
                and 0.0 < w <= 2.0):
            raise ValueError(f"`c_weight` must be in (0, 2], got {c_weight!r}")


def build_hierarchy(
    t,
    cf: int | Sequence[int] = 2,
    max_levels: int = 30,
    min_coarse: int = 2,
    relax: str | Sequence[str] = "FCF",
    c_weight: float | Sequence[float] = 1.0,
) -> Hierarchy:
    """Build the time-grid hierarchy for fine time points ``t``.

    Parameters
    ----------
    t : array_like, shape (N + 1,)
        Strictly increasing fine time points.
    cf : int or sequence of int
        Coarsening factor, one for all levels or one per level (last repeats).
    max_levels : int
        Largest number of levels (1 means sequential stepping).
    min_coarse : int
        A coarser level is made only if it has at least this many intervals.
    relax : str or sequence of str
        "F", "FCF", "FCFCF", ... for all levels or per level (last repeats).
    c_weight : float or sequence of float
        Weight of C-relaxation, for all levels or per level.
    """
    t = check_time_grid(t)
    check_levels(cf, max_levels, min_coarse, relax, c_weight)
    return levels_of(t, cf, max_levels, min_coarse, relax, c_weight)


def levels_of(t: np.ndarray, cf, max_levels: int, min_coarse: int, relax, c_weight) -> Hierarchy:
    """The hierarchy of a checked grid ``t`` (:func:`check_time_grid`) and checked
    settings (:func:`check_levels`); :func:`build_hierarchy` with the checks done."""
    max_levels = _levels_to_check(max_levels, cf, relax, c_weight)
    cfs = per_level(cf, max_levels, "cf")
    relaxes = per_level(relax, max_levels, "relax")
    weights = per_level(c_weight, max_levels, "c_weight")
    levels = []
    tl, stride = t, 1
    tl.setflags(write=False)
    while True:
        lid = len(levels)
        n = tl.shape[0] - 1
        m = int(cfs[lid])
        if lid + 1 < max_levels and n // m >= min_coarse:
            levels.append(Level(lid, tl, stride, m, relaxes[lid].upper(), float(weights[lid])))
            tl = np.ascontiguousarray(tl[::m])
            tl.setflags(write=False)
            stride *= m
        else:
            levels.append(Level(lid, tl, stride, None, None, 1.0))
            return Hierarchy(levels)
