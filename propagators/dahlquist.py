"""The Dahlquist test equation, the model problem of MGRIT convergence theory."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgrit import Propagator


@dataclass(frozen=True)
class Dahlquist(Propagator):
    """``u' = xi u`` with one Euler step per interval; ``xi`` may be complex.

    With ``z = xi (t1 - t0)`` the step multiplies ``u`` by
    ``1 / (1 - z)`` (``scheme="be"``, backward Euler) or ``1 + z``
    (``scheme="fe"``, forward Euler: a linear ResNet layer). The state may be
    any numpy array or torch tensor; every entry evolves independently, and
    the result keeps the state's precision (float32 stays float32; a complex
    ``xi`` makes real states complex of the same precision).

    Examples
    --------
    >>> import numpy as np
    >>> Dahlquist(-1.0, "be").step(np.array([1.0]), 0.0, 0.5)
    array([0.66666667])
    >>> Dahlquist(-1.0, "fe").step(np.array([1.0]), 0.0, 0.5)
    array([0.5])
    """

    xi: complex = -1.0
    scheme: str = "be"

    def __post_init__(self):
        if self.scheme not in ("be", "fe"):
            raise ValueError(f"`scheme` must be 'be' (backward Euler) or 'fe' (forward Euler), got {self.scheme!r}")
        try:
            xi = None if isinstance(self.xi, (str, bytes)) else np.asarray(self.xi)
        except (TypeError, ValueError, RuntimeError):
            xi = None
        if xi is None or xi.dtype.kind not in "iufc" or not np.all(np.isfinite(xi)):
            raise ValueError(f"`xi` must be a finite real or complex number (or an array of them, one per entry of "
                             f"the state), got {self.xi!r}")

    def _key(self) -> tuple:
        xi = np.asarray(self.xi)
        return self.scheme, xi.shape, tuple(xi.ravel().tolist())

    def __eq__(self, other):  # (an array xi compares entry by entry: the dataclass's == raised on it)
        return self._key() == other._key() if type(other) is type(self) else NotImplemented

    def __hash__(self):  # (an array xi is unhashable; its entries are not)
        return hash(self._key())

    def factor(self, dt):
        """Amplification factor of one step of size ``dt`` (scalar or array)."""
        z = self.xi * np.asarray(dt)
        return 1.0 / (1.0 - z) if self.scheme == "be" else 1.0 + z

    def step(self, u, t0, t1):
        self._check_shape(tuple(np.shape(u)))
        return _scale(self.factor(t1 - t0), u)  # (an array xi: one factor per entry)

    def step_batch(self, U, t0, t1):
        shape = tuple(np.shape(U))
        self._check_shape(shape[1:])
        dt = np.asarray(t1) - np.asarray(t0)
        # row k's steps dt[k] times every entry's xi (an array xi broadcasts against each state)
        return _scale(self.factor(dt.reshape((-1,) + (1,) * (len(shape) - 1))), U)

    def _check_shape(self, state_shape: tuple) -> None:
        """An array ``xi`` must broadcast to the state's shape without changing it."""
        xi_shape = np.shape(self.xi)
        if xi_shape and _broadcast(xi_shape, state_shape) != state_shape:
            raise ValueError(f"Dahlquist's `xi` of shape {xi_shape} gives one factor per entry of a state; it "
                             f"must broadcast to the state's shape {state_shape} (pass a state of that shape, or a "
                             "scalar xi)")


def _broadcast(a: tuple, b: tuple):
    try:
        return np.broadcast_shapes(a, b)
    except ValueError:
        return None


def _scale(f: np.ndarray, u):
    """``f * u`` in the precision of ``u`` (float32 states stay float32; a complex ``f`` makes real states
    complex of that precision), for numpy arrays and torch tensors."""
    if type(u).__module__.startswith("torch"):
        import torch

        real = u.real.dtype if u.is_complex() else u.dtype if u.is_floating_point() else torch.float64
        dtype = real.to_complex() if np.iscomplexobj(f) or u.is_complex() else real
        return torch.as_tensor(f, device=u.device).to(dtype) * u
    u = np.asarray(u)
    real = u.real.dtype if u.dtype.kind in "fc" else np.dtype(np.float64)
    return np.asarray(f).astype(np.result_type(real, np.complex64) if np.iscomplexobj(f) else real) * u
