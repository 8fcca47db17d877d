"""Validation problems for the settings chooser (docs/tuning.md).

* :class:`AdvectionDiffusion1D` -- ``u_t + c u_x = nu u_xx`` on ``[0, 1]`` with
  backward Euler: complex eigenvalues (periodic, a normal circulant operator)
  or a non-normal operator (Dirichlet), with a batched step.
* :class:`VanDerPol` -- the Van der Pol oscillator with an explicit RK4 step:
  nonlinear (FAS), with a Jacobian that changes along the solution and a
  stiff direction that makes large explicit coarse steps unstable.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from scipy.linalg import lapack

from mgrit import Propagator
from mgrit import _backend as B

from ._checks import FixedParameters, check_number, check_states
from .heat import _evict, _touch
from .nonlinear import _columns, torch_like

__all__ = ["AdvectionDiffusion1D", "VanDerPol"]


class AdvectionDiffusion1D(FixedParameters, Propagator):
    """Backward Euler for ``u_t + c u_x = nu u_xx`` on ``[0, 1]``.

    Parameters
    ----------
    nx : int
        ``boundary="periodic"``: grid points ``x_j = j / nx`` (the state has
        ``nx`` values). ``boundary="dirichlet"``: grid points including the two
        boundary points where ``u = 0`` (the state holds the ``nx - 2`` interior values).
    c : float
        Advection speed.
    nu : float
        Diffusion coefficient (>= 0).
    scheme : {"upwind", "central"}
        First-order upwind or second-order central differences for ``c u_x``;
        diffusion is always central.
    boundary : {"periodic", "dirichlet"}
        Periodic: the operator ``A`` is circulant (normal, complex eigenvalues)
        and a step is solved exactly by FFT. Dirichlet: ``A`` is tridiagonal and
        non-normal; a step solves with a cached LU factorization per step size.
    cache_size : int
        Most step sizes whose factorization is kept (Dirichlet).

    The parameters are fixed when it is built (the stencil and the cached
    factorizations depend on them: setting one is an AttributeError); a state
    of another length is a ValueError. Each step solves ``(I - dt A) u_1 = u_0``; :meth:`generator_eigenvalues`
    gives the eigenvalues of ``A``, so one step has the eigenvalues
    ``1 / (1 - dt a_k)``.

    Examples
    --------
    >>> import numpy as np
    >>> p = AdvectionDiffusion1D(16, c=1.0, nu=0.01)
    >>> u1 = p.step(p.initial(), 0.0, 0.1)
    >>> bool(np.allclose((np.eye(16) - 0.1 * p.matrix()) @ u1, p.initial()))
    True
    """

    def __init__(self, nx: int, c: float = 1.0, nu: float = 0.01, scheme: str = "upwind",
                 boundary: str = "periodic", cache_size: int = 64):
        self._building()
        if boundary not in ("periodic", "dirichlet"):
            raise ValueError(f"`boundary` must be 'periodic' or 'dirichlet', got {boundary!r}")
        if scheme not in ("upwind", "central"):
            raise ValueError(f"`scheme` must be 'upwind' or 'central', got {scheme!r}")
        low = 3 if boundary == "periodic" else 5  # (dirichlet: LAPACK's tridiagonal solver needs 3 interior points)
        if isinstance(nx, bool) or not isinstance(nx, (int, np.integer)) or nx < low:
            raise ValueError(f"`nx` must be an integer >= {low} for boundary={boundary!r}, got {nx!r}")
        c, nu = check_number(c, "c"), check_number(nu, "nu", minimum=0.0)
        if isinstance(cache_size, bool) or not isinstance(cache_size, (int, np.integer)) or cache_size < 1:
            raise ValueError(f"`cache_size` must be an integer >= 1, got {cache_size!r}")
        self.nx, self.c, self.nu = int(nx), float(c), float(nu)
        self.scheme, self.boundary, self.cache_size = scheme, boundary, int(cache_size)
        if boundary == "periodic":
            self.dx = 1.0 / self.nx
            self.x = np.arange(self.nx) * self.dx
        else:
            self.dx = 1.0 / (self.nx - 1)
            self.x = np.linspace(0.0, 1.0, self.nx)[1:-1]
        # stencil of A: coefficients of u_{j-1}, u_j, u_{j+1}
        d, dx = self.nu / self.dx**2, self.dx
        if scheme == "upwind":
            left, mid, right = (self.c / dx, -self.c / dx, 0.0) if self.c >= 0 else (0.0, self.c / dx, -self.c / dx)
        else:
            left, mid, right = self.c / (2 * dx), 0.0, -self.c / (2 * dx)
        self._stencil = (left + d, mid - 2 * d, right + d)
        self._lu: OrderedDict = OrderedDict()
        self._built()

    _fixed = ("nx", "c", "nu", "scheme", "boundary", "dx")

    def __repr__(self) -> str:
        return (f"AdvectionDiffusion1D(nx={self.nx}, c={self.c}, nu={self.nu}, scheme={self.scheme!r}, "
                f"boundary={self.boundary!r})")

    @property
    def size(self) -> int:
        """Number of unknowns (the state's length)."""
        return self.nx if self.boundary == "periodic" else self.nx - 2

    def initial(self) -> np.ndarray:
        """A smooth bump centred at ``x = 0.5`` (zero at the boundary in the Dirichlet case)."""
        u = np.exp(-60.0 * (self.x - 0.5) ** 2)
        return u * np.sin(np.pi * self.x) if self.boundary == "dirichlet" else u

    def matrix(self) -> np.ndarray:
        """The dense operator ``A`` (for checks; the steps never form it)."""
        n = self.size
        left, mid, right = self._stencil
        A = mid * np.eye(n) + left * np.eye(n, k=-1) + right * np.eye(n, k=1)
        if self.boundary == "periodic":
            A[0, -1] += left
            A[-1, 0] += right
        return A

    def _symbol(self, theta):
        left, mid, right = self._stencil
        return left * np.exp(-1j * theta) + mid + right * np.exp(1j * theta)

    def generator_eigenvalues(self) -> np.ndarray:
        """Eigenvalues of ``A``.

        Periodic: ``a_k = left e^{-i theta_k} + mid + right e^{i theta_k}``,
        ``theta_k = 2 pi k / nx`` (the FFT's order). Dirichlet (Toeplitz
        tridiagonal): ``mid + 2 sqrt(left right) cos(k pi / (n + 1))``, ``k = 1..n``.
        """
        if self.boundary == "periodic":
            return self._symbol(2 * np.pi * np.arange(self.nx) / self.nx)
        left, mid, right = self._stencil
        n = self.size
        root = np.sqrt(complex(left * right))
        vals = mid + 2 * root * np.cos(np.arange(1, n + 1) * np.pi / (n + 1))
        return vals.real if root.imag == 0 else vals

    # -- stepping --------------------------------------------------------------------
    def _factor(self, dt: float):
        lu = self._lu.get(dt)
        if lu is not None:
            _touch(self._lu, dt)
            return lu
        left, mid, right = self._stencil
        n = self.size
        dl, d, du, du2, ipiv, info = lapack.dgttrf(np.full(n - 1, -dt * left), np.full(n, 1.0 - dt * mid),
                                                   np.full(n - 1, -dt * right))
        if info != 0:
            raise np.linalg.LinAlgError(f"tridiagonal factorization failed (info={info}); reduce the step size")
        lu = self._lu[dt] = (dl, d, du, du2, ipiv)
        _evict(self._lu, self.cache_size)
        return lu

    def _solve_dirichlet(self, dt: float, rhs_cols: np.ndarray) -> np.ndarray:
        if np.iscomplexobj(rhs_cols):  # A is real: solve the real and imaginary parts
            return self._solve_dirichlet(dt, rhs_cols.real) + 1j * self._solve_dirichlet(dt, rhs_cols.imag)
        x, info = lapack.dgttrs(*self._factor(dt), np.array(rhs_cols, dtype=np.float64, order="F"))
        return x

    def step(self, u, t0, t1):
        check_states(self, u, (self.size,), batched=False)
        return self.step_batch(np.asarray(u)[None], np.array([t0], dtype=np.float64),
                               np.array([t1], dtype=np.float64))[0]

    def step_batch(self, U, t0, t1):
        U = np.asarray(U)
        check_states(self, U, (self.size,), batched=True)
        dt = np.asarray(t1, dtype=np.float64) - np.asarray(t0, dtype=np.float64)
        if U.shape[0] == 0:
            return U.astype(np.result_type(U, np.float64), copy=True)
        if self.boundary == "periodic":
            lam = self.generator_eigenvalues()
            denom = 1.0 - dt[:, None] * lam[None, :]
            # a mode with 1 - dt lambda = 0 up to the rounding of dt lambda (whose eigenvalues carry the rounding
            # of the largest, eps max|lambda|): no solution, and the division returned a finite wrong state
            scale = 1.0 + np.abs(dt[:, None]) * float(np.max(np.abs(lam)))
            if np.any(np.abs(denom) <= 16 * np.finfo(np.float64).eps * scale):
                raise np.linalg.LinAlgError("I - dt A is singular for a step of this size (dt lambda = 1 for a mode "
                                            "of the periodic operator); take another step size")
            out = np.fft.ifft(np.fft.fft(U, axis=1) / denom, axis=1)
            return out if np.iscomplexobj(U) else out.real.copy()
        out = np.empty(U.shape, dtype=np.result_type(U, np.float64))
        order = np.argsort(dt, kind="stable")
        sdt = dt[order]
        cuts = np.flatnonzero(sdt[1:] != sdt[:-1]) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(dt)]):
            idx = order[lo:hi]
            out[idx] = self._solve_dirichlet(float(sdt[lo]), U[idx].T).T
        return out


def _rk4(f, U, h, substeps):
    """``substeps`` classical RK4 steps of the autonomous ``u' = f(u)``; ``h`` per row, shape (n, 1)."""
    for _ in range(substeps):
        k1 = f(U)
        k2 = f(U + 0.5 * h * k1)
        k3 = f(U + 0.5 * h * k2)
        k4 = f(U + h * k3)
        U = U + h / 6.0 * (k1 + 2.0 * k2 + 2.0 * k3 + k4)
    return U


@dataclass(frozen=True)
class VanDerPol(Propagator):
    """The Van der Pol oscillator ``x' = y, y' = mu (1 - x^2) y - x`` with explicit RK4.

    One interval is ``substeps`` RK4 steps. The Jacobian of the right-hand
    side, ``[[0, 1], [-1 - 2 mu x y, mu (1 - x^2)]]``, changes along the limit
    cycle: near ``|x| = 2`` it has a stiff eigenvalue about ``-3 mu``, for which
    RK4 is unstable once ``3 mu dt`` exceeds about 2.8. That bounds how far a
    rediscretized coarse level may coarsen. State shape ``(2,)``.

    >>> VanDerPol(mu=1.0).step(np.array([2.0, 0.0]), 0.0, 0.1).round(4)
    array([ 1.9909, -0.1726])
    """

    mu: float = 3.0
    substeps: int = 1

    def __post_init__(self):
        object.__setattr__(self, "mu", check_number(self.mu, "mu"))
        if isinstance(self.substeps, bool) or not isinstance(self.substeps, (int, np.integer)) or self.substeps < 1:
            raise ValueError(f"`substeps` must be an integer >= 1, got {self.substeps!r}")

    def rhs(self, U):
        """``f(u)`` for stacked states ``U`` of shape (n, 2)."""
        x, y = U[:, 0], U[:, 1]
        return _columns([y, self.mu * (1.0 - x * x) * y - x], U)

    def rhs_jacobian(self, u) -> np.ndarray:
        """``df/du`` at one state ``u`` (2x2)."""
        x, y = float(u[0]), float(u[1])
        return np.array([[0.0, 1.0], [-1.0 - 2.0 * self.mu * x * y, self.mu * (1.0 - x * x)]])

    def step(self, u, t0, t1):
        check_states(self, u, (2,), batched=False)
        u = u if B.is_torch(u) else np.asarray(u)  # (torch states are stepped in torch)
        return self.step_batch(u[None], np.array([t0], dtype=np.float64),
                               np.array([t1], dtype=np.float64))[0]

    def step_batch(self, U, t0, t1):
        check_states(self, U, (2,), batched=True)
        h = ((np.asarray(t1, dtype=np.float64) - np.asarray(t0, dtype=np.float64)) / self.substeps)[:, None]
        if B.is_torch(U):  # (a tensor of the states' dtype: numpy arrays times tensors are deprecated in numpy)
            return _rk4(self.rhs, U, torch_like(h, U), int(self.substeps))
        return _rk4(self.rhs, np.asarray(U), h, int(self.substeps))
