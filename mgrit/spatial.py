"""Spatial-coarsening hooks between time levels.

On coarse time levels the state may live on a coarser spatial grid (fewer
grid points, fewer channels). A :class:`SpatialTransfer` between level ``l``
and level ``l + 1`` maps stacks of fine states to coarse ones and back. The
solver applies it

* to the states it injects at C-points (``restrict``),
* to the fine residuals that form the FAS right-hand side (``restrict_residual``,
  by default the same map as ``restrict``),
* to the coarse-grid correction ``u_c - v_c`` before adding it to the fine
  C-points (``interpolate``).

The propagator of level ``l + 1`` must then work on coarse states.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class SpatialTransfer(ABC):
    """Abstract restriction / interpolation pair acting on stacked states.

    All methods take and return stacks: arrays of shape ``(n, *state_shape)``,
    new ones of the input's kind (numpy arrays for numpy states, tensors not
    tracked by autograd for torch states). They must not write into their input:
    ``restrict`` gets a view of the solver's fine C-points and ``restrict_residual``
    the residuals whose norms the solve reports (the first call of each per level
    and solve is checked, and a change is a ``ValueError``).

    Examples
    --------
    Keep every other grid point (injection) and interpolate linearly:

    >>> import numpy as np, mgrit
    >>> class EveryOther(mgrit.SpatialTransfer):
    ...     def restrict(self, U):
    ...         return U[:, ::2].copy()
    ...     def interpolate(self, E):
    ...         out = np.zeros((E.shape[0], 2 * E.shape[1] - 1))
    ...         out[:, ::2] = E
    ...         out[:, 1::2] = 0.5 * (E[:, :-1] + E[:, 1:])
    ...         return out
    >>> EveryOther().interpolate(np.array([[0.0, 2.0, 4.0]]))
    array([[0., 1., 2., 3., 4.]])
    """

    @abstractmethod
    def restrict(self, U):
        """Map fine states ``(n, *fine_shape)`` to coarse states ``(n, *coarse_shape)``."""

    @abstractmethod
    def interpolate(self, E):
        """Map coarse corrections ``(n, *coarse_shape)`` to fine ones ``(n, *fine_shape)``."""

    def restrict_residual(self, R):
        """Map fine residuals to the coarse grid (default: :meth:`restrict`)."""
        return self.restrict(R)
