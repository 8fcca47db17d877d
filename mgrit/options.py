"""The settings of one solve: a frozen value, validated once when it is built.

:func:`mgrit.solve` turns its keyword arguments into an :class:`Options` and
hands that value on (to the hierarchy, the schedule of :mod:`mgrit.cycle`,
the stopping rule and the check that every rank passed the same settings);
:func:`mgrit.model.predict` builds one for the schedule it replays.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .hierarchy import (Hierarchy, check_flag, check_integer, check_levels, check_time_grid, frozen_per_level,
                        levels_of)


def fits_float(value) -> bool:
    """``float(value)`` does not overflow (an integer beyond 1.8e308 does)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


@dataclass(frozen=True)
class Options:
    """Every setting of :func:`mgrit.solve` besides its data (propagators, states, grid, ranks).

    The fields are the keyword arguments of :func:`mgrit.solve`, with the same
    meaning and defaults. Building the value checks them all (ValueError or
    TypeError naming the argument); ``norm="inf"`` is stored as ``math.inf``
    and lists (or 1-D numpy arrays) as tuples.

    >>> Options(cycle="F", norm="inf").norm
    inf
    >>> Options(max_levels=True)
    Traceback (most recent call last):
    ...
    ValueError: `max_levels` must be an integer >= 1, got True (a bool; pass an integer)
    """

    cf: int | Sequence[int] = 2
    max_levels: int = 30
    min_coarse: int = 2
    relax: str | Sequence[str] = "FCF"
    c_weight: float | Sequence[float] = 1.0
    cycle: str = "V"
    tol: float | None = 1e-9
    tol_type: str = "abs"
    norm: float = 2
    max_iter: int = 100
    skip: bool = True
    nested: bool = False
    residual: str = "xbraid"
    final_residual: bool = False
    callback: Callable | None = None
    partition: Sequence[int] | None = None

    def __post_init__(self):
        tol, norm = self.tol, self.norm
        if tol is not None and (isinstance(tol, (bool, np.bool_)) or not isinstance(tol, (int, float, np.integer,
                                                                                          np.floating))
                                or not tol >= 0):
            raise ValueError(f"`tol` must be a number >= 0 or None, got {tol!r}")
        if tol is not None and not fits_float(tol):
            raise ValueError(f"`tol` must fit a float (math.inf is the largest), got {tol!r:.40}")
        if self.tol_type not in ("abs", "rel"):
            raise ValueError(f"`tol_type` must be 'abs' or 'rel', got {self.tol_type!r}")
        if isinstance(norm, (bool, np.bool_)) or not isinstance(norm, (int, float, str, np.integer, np.floating)) \
                or norm not in (1, 2, math.inf, "inf"):
            raise ValueError(f"`norm` (temporal) must be 1, 2 or inf, got {norm!r}")
        check_integer(self.max_iter, "max_iter", 1)
        if self.cycle not in ("V", "F"):
            raise ValueError(f"`cycle` must be 'V' or 'F', got {self.cycle!r}")
        if self.residual not in ("xbraid", "cycle_end"):
            raise ValueError(f"`residual` must be 'xbraid' or 'cycle_end', got {self.residual!r}")
        check_levels(self.cf, self.max_levels, self.min_coarse, self.relax, self.c_weight)
        if self.callback is not None and not callable(self.callback):
            raise TypeError("`callback` must be callable")
        fields = {
            "tol": None if tol is None else float(tol),  # (a numpy scalar, np.float32(1e-3), as a Python float)
            "norm": math.inf if norm == "inf" else norm,
            "skip": check_flag(self.skip, "skip"),
            "nested": check_flag(self.nested, "nested"),
            "final_residual": check_flag(self.final_residual, "final_residual"),
            "max_iter": int(self.max_iter),
            "cf": frozen_per_level(self.cf),
            "relax": frozen_per_level(self.relax),
            "c_weight": frozen_per_level(self.c_weight),
            "partition": frozen_per_level(self.partition),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    @property
    def skip_first(self) -> bool:
        """The first cycle skips its down-sweep (XBraid's skip; never after a nested start)."""
        return self.skip and not self.nested

    @property
    def at_cycle_end(self) -> bool:
        """The residual is measured after each cycle (``residual="cycle_end"``)."""
        return self.residual == "cycle_end"

    def hierarchy(self, t) -> Hierarchy:
        """The time-grid hierarchy of the fine points ``t`` (checked here) with these settings."""
        return levels_of(check_time_grid(t), self.cf, self.max_levels, self.min_coarse, self.relax, self.c_weight)

    def signature(self) -> tuple:
        """What every rank of a distributed solve must agree on (the callback may differ)."""
        return (self.cycle, self.tol, self.tol_type, self.norm, self.max_iter, self.skip, self.nested,
                self.final_residual, self.residual,
                None if self.partition is None else [int(s) for s in self.partition])
