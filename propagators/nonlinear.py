"""Nonlinear reference systems with an explicit Runge-Kutta step (FAS test cases)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mgrit import Propagator
from mgrit import _backend as B

from ._checks import check_number, check_states


def _rk4(f, U, t0, t1, substeps):
    """Classical RK4 on stacked states ``U`` (n, d) with per-row times; ``substeps`` per interval."""
    dt = (t1 - t0) / substeps
    # (for torch states a tensor of their dtype: a numpy array times a tensor goes through numpy's deprecated
    # __array_wrap__ of the tensor)
    h = torch_like(dt[:, None], U) if B.is_torch(U) else dt[:, None]
    t = t0.astype(np.float64).copy()
    for _ in range(substeps):
        k1 = f(t, U)
        k2 = f(t + dt / 2, U + h / 2 * k1)
        k3 = f(t + dt / 2, U + h / 2 * k2)
        k4 = f(t + dt, U + h * k3)
        U = U + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        t = t + dt
    return U


def _columns(cols: list, like):
    """The columns stacked into states (n, d), in the states' array type (numpy or torch)."""
    if B.is_torch(like):
        import torch

        return torch.stack(cols, dim=1)
    return np.stack(cols, axis=1)


def torch_like(a: np.ndarray, U):
    """``a`` as a tensor of ``U``'s dtype (its real dtype for complex states) and device."""
    import torch

    dtype = U.real.dtype if U.is_complex() else U.dtype
    return torch.as_tensor(a, dtype=dtype, device=U.device)


class _RK4System(Propagator):
    """Shared step logic: one interval = ``substeps`` RK4 steps of ``rhs``."""

    substeps: int = 1
    size = 0  #: the state's length (set by each system; not a dataclass field)
    _coefficients = ()  #: the names of the model's coefficients, checked (set by each system; not a field)

    def __post_init__(self):  # (the dataclasses below call it after their __init__)
        if isinstance(self.substeps, bool) or not isinstance(self.substeps, (int, np.integer)) or self.substeps < 1:
            raise ValueError(f"`substeps` must be an integer >= 1, got {self.substeps!r}")
        for name in self._coefficients:  # finite real numbers (or, for a batch of models, arrays of them)
            value = getattr(self, name)
            if np.ndim(value) == 0:
                object.__setattr__(self, name, check_number(value, name))
            elif not (np.asarray(value).dtype.kind in "iuf" and np.all(np.isfinite(np.asarray(value)))):
                raise ValueError(f"`{name}` must be a finite number (or an array of them), got {value!r}")

    def rhs(self, t, U):  # pragma: no cover - abstract in spirit
        raise NotImplementedError

    def step(self, u, t0, t1):
        check_states(self, u, (self.size,), batched=False)
        u = u if hasattr(u, "shape") else np.asarray(u)  # (a list; numpy and torch states stay as they are)
        return _rk4(self.rhs, u[None, :], np.array([t0]), np.array([t1]), self.substeps)[0]

    def step_batch(self, U, t0, t1):
        check_states(self, U, (self.size,), batched=True)
        return _rk4(self.rhs, U, np.asarray(t0, float), np.asarray(t1, float), self.substeps)


@dataclass(frozen=True)
class Lorenz(_RK4System):
    """The Lorenz-63 system ``x' = s(y-x), y' = x(r-z) - y, z' = xy - bz``.

    A chaotic system: MGRIT converges on short horizons and shows how FAS
    copes with strong nonlinearity. State shape ``(3,)``.

    >>> Lorenz().step(np.array([1.0, 1.0, 1.0]), 0.0, 0.01).round(4)
    array([1.0126, 1.2599, 0.9849])
    """

    sigma: float = 10.0
    rho: float = 28.0
    beta: float = 8.0 / 3.0
    substeps: int = 1
    size = 3
    _coefficients = ("sigma", "rho", "beta")

    def rhs(self, t, U):
        x, y, z = U[:, 0], U[:, 1], U[:, 2]
        return _columns([self.sigma * (y - x), x * (self.rho - z) - y, x * y - self.beta * z], U)


@dataclass(frozen=True)
class Brusselator(_RK4System):
    """The Brusselator ``x' = a + x^2 y - (b+1) x, y' = b x - x^2 y`` (an oscillating reaction).

    With ``b > 1 + a^2`` the solution approaches a limit cycle. State shape ``(2,)``.

    >>> Brusselator().step(np.array([1.0, 1.0]), 0.0, 0.1).round(4)
    array([0.8266, 1.1825])
    """

    a: float = 1.0
    b: float = 3.0
    substeps: int = 1
    size = 2
    _coefficients = ("a", "b")

    def rhs(self, t, U):
        x, y = U[:, 0], U[:, 1]
        return _columns([self.a + x * x * y - (self.b + 1) * x, self.b * x - x * x * y], U)
