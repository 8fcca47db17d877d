"""Checks shared by the reference numpy propagators: fixed parameters and state shapes."""
from __future__ import annotations

import numpy as np

from mgrit.hierarchy import check_real


class FixedParameters:
    """Refuses to change the parameters named in ``_fixed`` once the propagator is built.

    A propagator caches factorizations or stencils built from them; a changed
    parameter would leave those stale (old steps for cached step sizes, new
    ones for the rest: two problems mixed in one solve). Its ``__init__`` calls
    :meth:`_building` first and :meth:`_built` last; until then (a subclass
    setting a parameter before ``super().__init__()``, or ``__init__`` called
    again to rebuild) every attribute may be set.
    """

    _fixed: tuple = ()

    def _building(self) -> None:
        object.__setattr__(self, "_is_built", False)

    def _built(self) -> None:
        object.__setattr__(self, "_is_built", True)

    def __setattr__(self, name, value):
        if name in self._fixed and self.__dict__.get("_is_built", False):
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
    """``value`` as a float; ValueError unless it is a finite real number (at least ``minimum``): a Python or
    numpy number, a 0-d array or tensor, a Fraction; not a bool or a string (:func:`mgrit.hierarchy.check_real`)."""
    return check_real(value, name, minimum)
