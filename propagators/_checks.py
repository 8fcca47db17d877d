"""Checks shared by the reference numpy propagators: fixed parameters and state shapes."""
from __future__ import annotations

import numpy as np


class FixedParameters:
    """Refuses to change the parameters named in ``_fixed`` once ``__init__`` has set them.

    A propagator caches factorizations or stencils built from them; a changed
    parameter would leave those stale (old steps for cached step sizes, new
    ones for the rest: two problems mixed in one solve).
    """

    _fixed: tuple = ()

    def __setattr__(self, name, value):
        if name in self._fixed and name in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}'s `{name}` is fixed when it is built (the stencil and the factorizations it "
                f"caches depend on it); build a new {type(self).__name__} with the new value instead")
        super().__setattr__(name, value)


def check_states(owner, U, shape: tuple, batched: bool) -> None:
    """ValueError naming ``owner`` unless ``U`` is one state of ``shape`` (``batched``: a stack of them)."""
    got = tuple(np.shape(U))
    if (got[1:] if batched else got) != shape or (batched and len(got) != len(shape) + 1):
        what = "a stack of states of shape (n, " + ", ".join(map(str, shape)) + ")" if batched \
            else f"a state of shape {shape}"
        raise ValueError(f"{owner!r} steps {what}; got shape {got}")


def check_number(value, name: str, minimum: float | None = None) -> float:
    """``value`` as a float; ValueError unless it is a finite real number (at least ``minimum``)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not np.isfinite(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"`{name}` must be a finite number{bound}, got {value!r}")
    return float(value)
