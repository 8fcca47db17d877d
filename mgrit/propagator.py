"""The propagator interface: the one thing a user of the solver implements.

A propagator advances a state over one time interval. MGRIT calls the same
propagator for every interval of a level, in any order, so ``step`` must be a
pure function of its arguments: it returns a new state and keeps no hidden
state that depends on which interval was stepped last.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from . import _backend as B


class Propagator(ABC):
    """Abstract base class of all propagators.

    Subclasses implement :meth:`step`. They may override :meth:`step_batch`
    to advance many independent intervals in one call (stacked states), which
    is how relaxation gets its speed; the default loops over :meth:`step`.

    Examples
    --------
    Backward Euler for the decay problem ``u' = -u``:

    >>> import numpy as np, mgrit
    >>> class Decay(mgrit.Propagator):
    ...     def step(self, u, t0, t1):
    ...         return u / (1.0 + (t1 - t0))
    >>> Decay().step(np.array([1.0]), 0.0, 1.0)
    array([0.5])
    >>> Decay().step_batch(np.ones((3, 1)), np.zeros(3), np.array([1.0, 3.0, 4.0]))[:, 0]
    array([0.5 , 0.25, 0.2 ])
    """

    @abstractmethod
    def step(self, u, t0: float, t1: float):
        """Advance state ``u`` from time ``t0`` to ``t1`` and return the new state.

        Must not modify ``u``. The returned state has the shape of ``u``.
        """

    def step_batch(self, U, t0: np.ndarray, t1: np.ndarray):
        """Advance ``n`` independent states at once.

        Parameters
        ----------
        U : array, shape (n, *state_shape)
            Stacked states; row ``k`` starts at time ``t0[k]``.
        t0, t1 : numpy.ndarray, shape (n,)
            Start and end time of every interval.

        Returns
        -------
        array, shape (n, *state_shape)
            Row ``k`` is ``step(U[k], t0[k], t1[k])``. Must not modify ``U``.
        """
        n = U.shape[0]
        if n == 0:
            return B.copy(U)
        step, a, b = self.step, t0.tolist(), t1.tolist()
        raw = step(U[0], a[0], b[0])
        if raw is None or B.is_torch(raw) != B.is_torch(U):
            return raw  # wrong type: the solver reports it with the level
        first = B.as_state(raw)
        if tuple(first.shape) != tuple(U.shape[1:]):
            return first[None]  # wrong shape: the solver reports it with the level
        out = B.empty_stack(n, first)
        out[0] = first
        # a later result like the first as `step` returned it (a numpy scalar for 0-d states) is stored as is
        row, shape, dtype = B.result_key(raw)
        for k in range(1, n):
            x = step(U[k], a[k], b[k])
            if type(x) is not row or x.shape != shape or x.dtype is not dtype:
                x = B.as_state(x)  # None, a float, another shape: returned for the solver to name, not broadcast
                if B.is_torch(x) != B.is_torch(U) or tuple(x.shape) != tuple(U.shape[1:]) or (
                        not B.is_torch(x) and x.dtype.kind not in "biufc"):
                    return x[None]
                if B.is_complex(x) and not B.is_complex(out):
                    out = out.to(x.dtype) if B.is_torch(out) else out.astype(x.dtype)
            out[k] = x
        return out

    def norms(self, U) -> np.ndarray:
        """Spatial norm of every state in the stack ``U`` (default: Euclidean).

        Override to measure residuals in another norm (for example a grid-weighted
        L2 norm). Returns a float64 numpy array of shape ``(n,)``.
        """
        return B.row_norms(U)
