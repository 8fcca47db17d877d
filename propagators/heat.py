"""The 1-D heat equation with backward Euler, and spatial coarsening between levels.

Problem (PyMGRIT's heat-1D example): ``u_t - a u_xx = b(x, t)`` on ``[0, 1]``
with ``u = 0`` at both ends, ``u(x, 0) = sin(pi x)`` and
``b(x, t) = -sin(pi x) (sin t - a pi^2 cos t)``, whose exact solution is
``sin(pi x) cos t``. Second-order central differences on ``nx`` grid points
(boundaries included); the state holds the ``nx - 2`` interior values.

One backward-Euler step solves ``(I - dt a D2) u1 = u0 + dt b(x, t1)``. The
tridiagonal LU factorization is computed once per step size and reused; a
batched step solves all right-hand sides of a relaxation sweep that share a
step size in one LAPACK call (``?gttrs``), which is where the speed of
relaxation comes from.

Non-uniform time grids: a batched call groups its rows by step size with one
sort (O(n log n) comparisons, one LAPACK call per distinct step), and the
factorizations are kept in a least-recently-used cache of at most
``Heat1D.cache_size`` step sizes (64 by default; each entry holds five arrays of
about ``nx`` floats), so time is linear in the number of time points and memory
is bounded whatever the grid.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
from scipy.linalg import lapack

from mgrit import Propagator, SpatialTransfer
from mgrit.hierarchy import check_flag, check_integer

from ._checks import FixedParameters, check_number


def _in_precision_of(out: np.ndarray, u) -> np.ndarray:
    """``out`` (float64 or complex128) rounded to the precision of the state ``u`` when that is narrower
    (float32 / complex64 states get float32 / complex64 results, as the solver stores them)."""
    kind = np.asarray(u).dtype
    if kind.kind not in "fc" or kind.itemsize >= (16 if kind.kind == "c" else 8):
        return out
    real = kind if kind.kind == "f" else np.dtype(f"f{kind.itemsize // 2}")
    return out.astype(np.result_type(real, np.complex64) if out.dtype.kind == "c" else real)


class Heat1D(FixedParameters, Propagator):
    """Backward-Euler propagator for the 1-D heat equation.

    Parameters
    ----------
    nx : int
        Grid points including the two boundary points (>= 3).
    a : float
        Diffusion coefficient (finite, >= 0).
    forcing : bool
        Include PyMGRIT's source term ``b(x, t)`` (exact solution ``sin(pi x) cos t``);
        False solves the homogeneous equation.
    cache_size : int
        Most step sizes whose LU factorization is kept (least recently used
        ones are dropped). A grid of exactly equal steps with ``L`` levels
        needs ``L``; ``np.linspace`` rounds its steps, so a level has a few
        distinct ones (98 over the 8 levels of 100,001 points on [0, 1] with
        cf 4, where 4,097 points have one per level): the default 64 then
        recomputes some factorizations (787 instead of 98 in 10 cycles, a few
        percent of the solve's time); a larger cache avoids that.

    Attributes
    ----------
    factorizations : int
        LU factorizations computed so far (a cost counter).

    A state is the ``nx - 2`` interior values (a stack of them for
    ``step_batch``); another length is a ValueError. ``nx``, ``a`` and
    ``forcing`` are fixed when it is built (the cached factorizations depend on
    them: setting one is an AttributeError). The steps are computed in
    float64 (LAPACK) and returned in the state's precision when it is narrower
    (float32 states give float32 results).

    Examples
    --------
    >>> import numpy as np, mgrit
    >>> heat = Heat1D(17)
    >>> u = mgrit.solve(heat, heat.initial(), np.linspace(0, 1, 65), cf=4, tol=1e-10).u
    >>> bool(np.abs(u[-1] - heat.exact(1.0)).max() < 1e-2)
    True
    """

    def __init__(self, nx: int, a: float = 1.0, forcing: bool = True, cache_size: int = 64):
        self._building()
        if not isinstance(nx, (int, np.integer)) or nx < 3:
            raise ValueError(f"`nx` must be an integer >= 3, got {nx!r}")
        if isinstance(cache_size, bool) or not isinstance(cache_size, (int, np.integer)) or cache_size < 1:
            raise ValueError(f"`cache_size` must be an integer >= 1, got {cache_size!r}")
        self.nx, self.a, self.forcing = int(nx), check_number(a, "a", 0.0), check_flag(forcing, "forcing")
        self.cache_size = int(cache_size)
        self.x = np.linspace(0.0, 1.0, self.nx)[1:-1]
        self.dx = 1.0 / (self.nx - 1)
        self._sinpx = np.sin(np.pi * self.x)
        self._lu: OrderedDict = OrderedDict()
        self.factorizations = 0
        self._built()

    _fixed = ("nx", "a", "forcing", "dx")

    def __repr__(self) -> str:
        return f"Heat1D(nx={self.nx}, a={self.a}, forcing={self.forcing})"

    def initial(self) -> np.ndarray:
        """The initial state ``sin(pi x)`` at the interior points."""
        return self._sinpx.copy()

    def exact(self, t: float) -> np.ndarray:
        """Exact solution of the forced problem at time ``t``."""
        return self._sinpx * np.cos(t)

    def source(self, t) -> np.ndarray:
        """``b(x, t)`` for every ``t`` in the array ``t``: shape (len(t), nx - 2)."""
        t = np.atleast_1d(t)
        return -np.outer(np.sin(t) - self.a * np.pi**2 * np.cos(t), self._sinpx)

    def _factor(self, dt: float):
        """LU factorization of ``I - dt a D2`` from the LRU cache (computed on a miss)."""
        cache = self._lu
        lu = cache.get(dt)
        if lu is not None:
            _touch(cache, dt)
            return lu
        n = self.nx - 2
        c = self.a * dt / self.dx**2
        off = np.full(n - 1, -c)
        dl, d, du, du2, ipiv, info = lapack.dgttrf(off, np.full(n, 1.0 + 2.0 * c), off.copy())
        if info != 0:
            raise np.linalg.LinAlgError(f"tridiagonal factorization failed (info={info})")
        self.factorizations += 1
        lu = cache[dt] = (dl, d, du, du2, ipiv)
        _evict(cache, self.cache_size)  # the least recently used step sizes
        return lu

    def _solve(self, dt: float, rhs_cols: np.ndarray, overwrite: bool = False) -> np.ndarray:
        """Solve ``(I - dt a D2) X = rhs_cols``, right-hand sides as columns (shape (nx - 2, k)).

        With ``overwrite`` and a Fortran-ordered float64 ``rhs_cols``, LAPACK solves in place.
        """
        n = self.nx - 2
        if n < 3:  # scipy's ?gttrf wrapper needs n >= 3: solve the tiny system densely
            c = self.a * dt / self.dx**2
            A = (1.0 + 2.0 * c) * np.eye(n) - c * (np.eye(n, k=1) + np.eye(n, k=-1))
            # column by column: a column's solution does not depend on the others in the batch
            # (so the same bits on any number of ranks, and step_batch equal to step)
            out = np.empty(rhs_cols.shape, dtype=np.float64)
            for j in range(rhs_cols.shape[1]):
                out[:, j] = np.linalg.solve(A, rhs_cols[:, j])
            return out
        x, info = lapack.dgttrs(*self._factor(dt), rhs_cols, overwrite_b=overwrite)
        return x

    def step(self, u, t0, t1):
        self._check_length(u, 1)
        return _in_precision_of(self._step(u, t0, t1), u)

    def step_batch(self, U, t0, t1):
        self._check_length(U, 2)
        return _in_precision_of(self._step_batch(U, t0, t1), U)

    def _check_length(self, u, ndim: int) -> None:
        shape = np.shape(u)
        if len(shape) != ndim or shape[-1] != self._sinpx.shape[0]:
            what = "a state" if ndim == 1 else "a stack of states"
            raise ValueError(
                f"{self!r} steps {what} of {self._sinpx.shape[0]} interior values, shape "
                f"{(self._sinpx.shape[0],) if ndim == 1 else ('n', self._sinpx.shape[0])}; got shape {shape}. With "
                "spatial coarsening every level needs a Heat1D of its own size: heat_hierarchy(nx, L) gives L "
                "propagators and L - 1 transfers, for solve(..., max_levels=L)")

    def _step(self, u, t0, t1):  # computed in float64 (complex128), LAPACK's tridiagonal solve
        dt = t1 - t0
        if np.iscomplexobj(u):  # the operator and the forcing are real: real and imaginary parts apart
            u = np.asarray(u)
            out = self._step(np.ascontiguousarray(u.real), t0, t1).astype(np.complex128)
            out.imag = self._solve(dt, np.array(u.imag, dtype=np.float64).reshape(-1, 1))[:, 0]
            return out
        if self.forcing:
            # source(t1)[0] without the outer product: the same operations, so the same bits
            t = np.array([t1], dtype=np.float64)
            rhs = u + dt * -((np.sin(t) - self.a * np.pi**2 * np.cos(t)) * self._sinpx)
            return self._solve(dt, rhs.reshape(-1, 1), overwrite=True)[:, 0]
        return self._solve(dt, np.asarray(u, dtype=np.float64).reshape(-1, 1))[:, 0]

    def _step_batch(self, U, t0, t1):
        dt = np.asarray(t1, dtype=np.float64) - np.asarray(t0, dtype=np.float64)
        if np.iscomplexobj(U):  # the operator and the forcing are real: real and imaginary parts apart
            U = np.asarray(U)
            out = self._step_batch(np.ascontiguousarray(U.real), t0, t1).astype(np.complex128)
            out.imag = self._solve_rows(np.array(U.imag, dtype=np.float64, order="C"), dt)
            return out
        if dt.shape[0] == 0:
            return np.empty(np.shape(U), dtype=np.float64)
        # a fresh C-ordered (n, nx - 2) array: its transpose is the Fortran-ordered
        # block of right-hand sides that LAPACK overwrites with the solution
        if self.forcing:
            rhs = U + dt[:, None] * self.source(t1)
        else:
            rhs = np.array(U, dtype=np.float64, order="C")
        return self._solve_rows(rhs, dt)

    def _solve_rows(self, rhs, dt):
        """The solutions of the rows of the fresh C-ordered ``rhs`` (overwritten), row ``k`` with step ``dt[k]``."""
        if dt.shape[0] == 0:
            return rhs
        if np.all(dt == dt[0]):  # one step size: one LAPACK call, no copies
            return self._solve(float(dt[0]), rhs.T, overwrite=True).T
        # group the rows by step size with one stable sort (rows of a group stay in order)
        order = np.argsort(dt, kind="stable")
        sorted_dt = dt[order]
        cuts = np.flatnonzero(sorted_dt[1:] != sorted_dt[:-1]) + 1
        out = np.empty_like(rhs)
        for lo, hi in zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(dt)])).tolist()):
            idx = order[lo:hi]
            out[idx] = self._solve(float(sorted_dt[lo]), rhs[idx].T, overwrite=True).T
        return out


class HeatTransfer(SpatialTransfer):
    """Vertex-centred coarsening ``nx -> (nx - 1) / 2 + 1`` of the interior values.

    ``restrict`` injects every other grid point; ``interpolate`` is linear
    interpolation with zero boundary values.

    >>> import numpy as np
    >>> HeatTransfer().interpolate(np.array([[2.0]]))
    array([[1., 2., 1.]])
    """

    def restrict(self, U):
        if (U.shape[1] + 1) % 2:
            raise ValueError(f"spatial coarsening needs an odd number of interior points, got {U.shape[1]}")
        return np.ascontiguousarray(U[:, 1::2])

    def interpolate(self, E):
        n, nc = E.shape
        dtype = np.result_type(E.dtype, np.float16)  # (integer corrections: the midpoints are halves)
        out = np.zeros((n, 2 * nc + 1), dtype=dtype)
        out[:, 1::2] = E
        padded = np.zeros((n, nc + 2), dtype=dtype)
        padded[:, 1:-1] = E
        out[:, 0::2] = 0.5 * (padded[:, :-1] + padded[:, 1:])
        return out


def heat_hierarchy(nx: int, n_levels: int, coarsen_from: int = 1, a: float = 1.0, forcing: bool = True, min_nx: int = 5):
    """Per-level heat propagators and transfers with spatial coarsening.

    Levels ``>= coarsen_from`` halve the grid of the level above (down to
    ``min_nx`` points). Returns ``(propagators, transfers)`` for
    ``mgrit.solve(propagators, ..., spatial=transfers)``.

    >>> props, transfers = heat_hierarchy(33, 3)
    >>> [p.nx for p in props], [t is None for t in transfers]
    ([33, 17, 9], [False, False])
    """
    check_integer(n_levels, "n_levels", 1)
    check_integer(coarsen_from, "coarsen_from", 0)
    check_integer(min_nx, "min_nx", 3)
    props, transfers = [Heat1D(nx, a, forcing)], []
    for level in range(1, n_levels):
        prev = props[-1].nx
        if level >= coarsen_from and (prev - 1) % 2 == 0 and (prev - 1) // 2 + 1 >= min_nx:
            props.append(Heat1D((prev - 1) // 2 + 1, a, forcing))
            transfers.append(HeatTransfer())
        else:
            props.append(Heat1D(prev, a, forcing))
            transfers.append(None)
    return props, transfers


def _touch(cache, key) -> None:
    """Mark ``key`` most recently used (another thread may have evicted it meanwhile: then nothing to do)."""
    try:
        cache.move_to_end(key)
    except KeyError:
        pass


def _evict(cache, size: int) -> None:
    """Drop the least recently used entries beyond ``size`` (all of them, also after ``cache_size`` was lowered;
    an entry another thread dropped first is not an error)."""
    while len(cache) > size:
        try:
            cache.popitem(last=False)
        except KeyError:
            break
