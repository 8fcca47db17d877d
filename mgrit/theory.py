"""Convergence theory of MGRIT for linear, time-invariant propagators.

Two kinds of input:

* eigenvalues: ``lam`` is the fine step (one step of ``Phi``), ``mu`` the coarse
  step (one step of ``Psi`` over ``m`` fine intervals); complex values are
  allowed. For the Dahlquist problem ``u' = xi u`` with ``z = xi h``,
  :func:`dahlquist_factors` gives them for backward and forward Euler.
* small matrices: ``Phi`` and ``Psi`` as ``(d, d)`` arrays; the iteration
  matrices are then block matrices with ``d x d`` blocks.

Notation (docs/theory.md §6): ``N_c`` coarse intervals, C-point errors
``e_1 .. e_{N_c}`` (``e_0 = 0``: the initial condition is exact), ``r = 0`` for
F-relaxation and ``r = 1`` for FCF (``r`` = number of CF pairs after the first
F sweep), ``n = N_c - 1 - r`` and

    c_r = |lam|^(r m) |lam^m - mu|.

Two-level iteration matrix on C-point errors, ``S`` the down-shift and
``B = I - mu S``:

    E_F = (lam^m - mu) B^{-1} S,        E_{F(CF)^r} = E_F (lam^m S)^r.

Its 2-norm is ``c_r / sigma_min(B_n)`` with ``B_n`` the ``n x n`` bidiagonal
``I - mu S`` (:func:`two_level_norm`), bracketed by the sharp bounds of
Southworth (2019) (:func:`sharp_bounds`) and below the Dobrev et al. (2017)
bound (:func:`dobrev_bound`), whose ``N_c -> inf`` limit is
:func:`limit_bound`.

:func:`multilevel_matrix` assembles the exact C-point iteration matrix of a
V- or F-cycle with any number of levels by dense linear algebra on the whole
space-time error vector (the linear form of the cycle that :func:`mgrit.solve`
runs as FAS). It is independent of the solver and meant for small problems
(a few hundred time points).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .hierarchy import check_integer, parse_relax

__all__ = [
    "step_factor",
    "dahlquist_factors",
    "level_factors",
    "c_factor",
    "two_level_matrix",
    "two_level_norm",
    "dobrev_bound",
    "sharp_bounds",
    "limit_bound",
    "worst_case",
    "multilevel_matrix",
    "matrix_norm",
]

# --------------------------------------------------------------------------------------
# Dahlquist helpers
# --------------------------------------------------------------------------------------


def step_factor(z, scheme: str = "be"):
    """Amplification factor of one Euler step for ``u' = xi u``, ``z = xi h``.

    Backward Euler: ``1 / (1 - z)``; forward Euler: ``1 + z``.

    Parameters
    ----------
    z : complex or array_like
        ``xi`` times the step size.
    scheme : {"be", "fe"}

    Examples
    --------
    >>> step_factor(-1.0, "be"), step_factor(-0.5, "fe")
    (0.5, 0.5)
    """
    if z is None or isinstance(z, (str, bytes)):
        raise TypeError(f"`z` must be a number or an array of numbers (xi times the step), got {z!r:.40}")
    if _has_nan(z):
        raise ValueError("`z` contains NaN (a coarse step's m z of an infinite complex z is one: inf * (1 + 0j) "
                         "has a NaN imaginary part); pass finite values")
    if scheme == "be":
        if np.any(np.asarray(z) == 1.0):
            raise ValueError("z = xi h = 1 is the pole of backward Euler: the step solves (1 - z) u_new = u, "
                             "which has no solution there; take another step size")
        return 1.0 / (1.0 - np.asarray(z)) if np.ndim(z) else 1.0 / (1.0 - z)
    if scheme == "fe":
        return 1.0 + np.asarray(z) if np.ndim(z) else 1.0 + z
    raise ValueError(f"`scheme` must be 'be' (backward Euler) or 'fe' (forward Euler), got {scheme!r}")


def _has_nan(x) -> bool:
    """NaN in ``x`` (numbers, arrays; exact or symbolic values such as Fractions or sympy symbols have none)."""
    try:
        return bool(np.any(np.isnan(np.asarray(x, dtype=complex))))
    except (TypeError, ValueError):
        return False


def dahlquist_factors(z, m: int, scheme: str = "be"):
    """Fine and coarse step factors ``(lam, mu)`` of a rediscretized Euler scheme.

    The coarse step is the same scheme with step ``m h``: ``mu = R(m z)``.

    Parameters
    ----------
    z : complex or array_like
        ``xi h`` on the fine grid.
    m : int
        Coarsening factor.
    scheme : {"be", "fe"}

    Returns
    -------
    lam, mu : complex or ndarray

    Examples
    --------
    >>> dahlquist_factors(-1.0, 2, "be")
    (0.5, 0.3333333333333333)
    >>> dahlquist_factors(-0.1, 4, "fe")
    (0.9, 0.6)
    """
    _check_cf(m)
    return step_factor(z, scheme), step_factor(m * np.asarray(z) if np.ndim(z) else m * z, scheme)


def level_factors(z, cf: int, n_levels: int, scheme: str = "be") -> list:
    """One-step factors of every level of a rediscretized hierarchy.

    Level ``l`` steps over ``cf**l`` fine intervals: its factor is ``R(cf**l z)``.
    The list is the ``ops`` argument of :func:`multilevel_matrix`.

    Examples
    --------
    >>> level_factors(-1.0, 2, 3)
    [0.5, 0.3333333333333333, 0.2]
    """
    _check_cf(cf)
    check_integer(n_levels, "n_levels", 1)
    return [step_factor(cf**l * z, scheme) for l in range(n_levels)]


# --------------------------------------------------------------------------------------
# Two-level theory
# --------------------------------------------------------------------------------------


def _check_cf(m) -> None:
    check_integer(m, "m", 2, " (coarsening factor)")


def _check_nc(n_c) -> None:
    check_integer(n_c, "n_c", 1, " (number of coarse intervals)")


def c_factor(lam, mu, m: int, relax: str = "F"):
    """``c_r = |lam|^(r m) |lam^m - mu|``, the scale of all two-level bounds.

    Broadcasts over arrays of ``lam`` and ``mu``.

    Examples
    --------
    >>> lam, mu = dahlquist_factors(-1.0, 2)
    >>> round(float(c_factor(lam, mu, 2, "F")), 6), round(float(c_factor(lam, mu, 2, "FCF")), 6)
    (0.083333, 0.020833)
    """
    _check_cf(m)
    r = parse_relax(relax)
    lam = np.asarray(lam)
    if _has_nan(lam) or _has_nan(mu):  # (every bound is built on this one)
        raise ValueError("`lam` or `mu` contains NaN")
    return np.abs(lam) ** (r * m) * np.abs(lam**m - np.asarray(mu))


def _operator(x) -> np.ndarray:
    """A scalar or a square matrix as a 2-D complex-or-real array."""
    a = np.asarray(x)
    if a.ndim != 2 and a.ndim != 0 or a.ndim == 2 and a.shape[0] != a.shape[1]:
        raise ValueError(f"a propagator must be a scalar or a square matrix, got shape {a.shape}")
    if not np.all(np.isfinite(a)):  # (the SVD's "did not converge" otherwise)
        raise ValueError("a propagator (lam, mu, Phi, Psi or ops) contains NaN or Inf")
    return a.reshape(1, 1) if a.ndim == 0 else a


def two_level_matrix(Phi, Psi, m: int, n_c: int, relax: str = "F") -> np.ndarray:
    """Two-level MGRIT iteration matrix on the C-point errors ``e_1 .. e_{N_c}``.

    ``E_F = B^{-1} (S kron (Phi^m - Psi))`` with ``B = I - S kron Psi``
    (for scalars ``(lam^m - mu) B^{-1} S``), and
    ``E_{F(CF)^r} = E_F (S kron Phi^m)^r``.

    Parameters
    ----------
    Phi, Psi : scalar or array_like, shape (d, d)
        Fine one-step operator and coarse one-step operator (over ``m`` fine steps).
    m : int
        Coarsening factor.
    n_c : int
        Number of coarse intervals (= unknown C-points).
    relax : {"F", "FCF", "FCFCF", ...}

    Returns
    -------
    numpy.ndarray, shape (n_c * d, n_c * d)
        Block ``(k, j)`` maps the error at C-point ``j + 1`` to C-point ``k + 1``.

    Examples
    --------
    >>> E = two_level_matrix(0.5, 0.25, 2, 3)  # lam^m = mu: the coarse step is exact
    >>> bool(np.all(E == 0))
    True
    >>> E = two_level_matrix(0.5, 0.5, 2, 3)
    >>> E / (0.25 - 0.5) + 0.0  # (+ 0.0 turns -0.0 into 0.0)
    array([[0. , 0. , 0. ],
           [1. , 0. , 0. ],
           [0.5, 1. , 0. ]])
    """
    _check_cf(m)
    _check_nc(n_c)
    r = parse_relax(relax)
    P, Q = _operator(Phi), _operator(Psi)
    if P.shape != Q.shape:
        raise ValueError(f"`Phi` and `Psi` must have the same shape, got {P.shape} and {Q.shape}")
    Pm = np.linalg.matrix_power(P, m)
    S = np.eye(n_c, k=-1)
    B = np.eye(n_c * P.shape[0]) - np.kron(S, Q)
    E = np.linalg.solve(B, np.kron(S, Pm - Q))
    C = np.kron(S, Pm)
    for _ in range(r):
        E = E @ C
    return E


def matrix_norm(E) -> float:
    """Spectral norm (largest singular value) of a dense matrix.

    >>> matrix_norm(np.array([[0.0, 2.0], [0.0, 0.0]]))
    2.0
    """
    E = np.asarray(E)
    if E.size == 0:
        return 0.0
    return float(np.linalg.norm(E, 2))


def _bidiagonal_sigma_min(abs_mu: float, n: int) -> float:
    """Smallest singular value of the ``n x n`` matrix ``B = I - a S``, ``0 <= a = |mu| <= 1``, in O(1).

    ``B^T B`` is tridiagonal (``1 + a^2`` on the diagonal but a last 1, ``-a`` beside it); its eigenvectors
    are ``v_k = sin(k theta)`` with ``sin((n+1) theta) = a sin(n theta)``, eigenvalue
    ``(1 - a)^2 + 4 a sin^2(theta / 2)``. The smallest root lies in ``[pi/(2n+1), pi/(n+1)]`` (the two
    sharp bounds: the ends are the roots for ``a = 1`` and ``a = 0``), found to rounding by brentq; the
    dense SVD took O(n^3) time and O(n^2) memory (74 GiB at ``n = 10^5``) for the same digits."""
    from scipy.optimize import brentq

    a = float(abs_mu)
    if a == 0.0:
        return 1.0
    lo, hi = math.pi / (2 * n + 1), math.pi / (n + 1)

    def f(theta):
        return math.sin((n + 1) * theta) - a * math.sin(n * theta)

    if f(lo) <= 0.0:  # (a = 1, to rounding)
        theta = lo
    elif f(hi) >= 0.0:  # (a below n eps: sin((n+1) hi) rounds to about 1e-16, above a sin(n hi))
        theta = hi
    else:
        theta = brentq(f, lo, hi, xtol=1e-300, rtol=4 * np.finfo(float).eps, maxiter=500)
    return math.sqrt((1.0 - a) ** 2 + 4.0 * a * math.sin(theta / 2) ** 2)


#: up to this size the inverse's norm is taken from the dense matrix; beyond, by power iteration
_DENSE_INVERSE = 1000


def _inverse_bidiagonal_norm(a: float, n: int, dense: bool | None = None) -> float:
    """``||(I - a S)^-1||_2`` for ``a > 1``, ``n x n``: the inverse is lower-triangular Toeplitz with entries
    ``a^(i-j)``; it is scaled by ``a^(n-1)`` first (entries <= 1), so that the norm neither loses its digits
    (``sigma_min`` of ``I - a S`` underflows like ``a^-n``) nor overflows before the last product (inf when the
    norm exceeds the largest float: at once when its corner entry ``a^(n-1)`` does). Beyond
    ``_DENSE_INVERSE`` rows (or with ``dense=False``) by power iteration on ``M^T M``, each product two
    first-order recurrences (O(n)): the entries are positive, so the all-ones start has the Perron vector
    in it, and the singular values of the inverse are well separated (a ratio of about 3 near ``a = 1``)."""
    if (n - 1.0) * math.log(a) > math.log(np.finfo(np.float64).max):
        return math.inf
    if dense if dense is not None else n <= _DENSE_INVERSE:
        k = np.subtract.outer(np.arange(n), np.arange(n))
        M = np.where(k >= 0, a ** np.minimum(k - (n - 1.0), 0.0), 0.0)
        with np.errstate(over="ignore"):
            return float(np.float64(a) ** (n - 1.0) * np.linalg.norm(M, 2))
    from scipy.signal import lfilter

    c = a ** -(n - 1.0)
    v, sigma = np.full(n, n ** -0.5), 0.0
    for _ in range(2000):
        w = lfilter([c], [1.0, -a], v)  # M v: w_i = a w_(i-1) + c v_i
        new = float(np.linalg.norm(w))
        v = lfilter([c], [1.0, -a], w[::-1])[::-1]  # M^T w
        v /= np.linalg.norm(v)
        if abs(new - sigma) <= 1e-15 * new:
            break
        sigma = new
    with np.errstate(over="ignore"):
        return float(np.float64(a) ** (n - 1.0) * new)


def two_level_norm(lam, mu, m: int, n_c: int, relax: str = "F") -> float:
    """Exact ``||E||_2`` of the two-level iteration matrix.

    For scalars this is ``c_r / sigma_min(B_n)``, ``n = N_c - 1 - r`` (0 when
    ``n <= 0``: then MGRIT is exact after one iteration); for an unstable
    coarse step (``|mu| > 1``) ``c_r ||B_n^-1||_2``, which grows like
    ``|mu|^n`` (inf beyond the largest float). For matrices ``lam`` and ``mu``
    (``Phi``, ``Psi``), the norm of :func:`two_level_matrix`.

    Examples
    --------
    >>> lam, mu = dahlquist_factors(-0.1, 4)
    >>> round(two_level_norm(lam, mu, 4, 8, "F"), 10)
    0.0800035592
    """
    _check_cf(m)
    _check_nc(n_c)
    if np.size(lam) == 1 and np.size(mu) == 1 and np.ndim(lam) == np.ndim(mu) == 2:
        lam, mu = np.asarray(lam).item(), np.asarray(mu).item()  # 1 x 1 matrices: the closed form (not an SVD)
    if np.ndim(lam) or np.ndim(mu):
        return matrix_norm(two_level_matrix(lam, mu, m, n_c, relax))
    _operator(lam), _operator(mu)  # (finite: a NaN gave NaN or the SVD's error)
    n = n_c - 1 - parse_relax(relax)
    if n <= 0:
        return 0.0
    c = float(c_factor(lam, mu, m, relax))
    if abs(mu) > 1.0:
        return 0.0 if c == 0.0 else c * _inverse_bidiagonal_norm(abs(mu), n)
    return c / _bidiagonal_sigma_min(abs(mu), n)


def _geometric_sum(q, n: int):
    """``1 + q + ... + q^(n-1)`` for ``q >= 0`` (array-safe, exact at ``q = 1``)."""
    q = np.asarray(q, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (1.0 - q**n) / (1.0 - q)
    return np.where(q == 1.0, float(n), s)


def dobrev_bound(lam, mu, m: int, n_c: int, relax: str = "F"):
    """Dobrev-type upper bound ``c_r (1 - |mu|^n) / (1 - |mu|)``, ``n = N_c - 1 - r``.

    The bound sums the moduli of the entries of a column of ``E`` (a 1-norm
    bound that is also a 2-norm bound for this Toeplitz matrix). Broadcasts
    over arrays.

    Examples
    --------
    >>> lam, mu = dahlquist_factors(-0.1, 4)
    >>> round(float(dobrev_bound(lam, mu, 4, 8, "F")), 6)
    0.09907
    """
    _check_nc(n_c)
    n = max(n_c - 1 - parse_relax(relax), 0)
    return c_factor(lam, mu, m, relax) * _geometric_sum(np.abs(mu), n)


def sharp_bounds(lam, mu, m: int, n_c: int, relax: str = "F"):
    """Southworth's two-sided bound on ``||E||_2``, ``n = N_c - 1 - r``.

    ``c_r / sqrt(1 + |mu|^2 - 2|mu| cos(pi/(n+1)))`` from below and the same
    with ``cos(pi/(2n+1))`` from above; both are 0 when ``n <= 0``. The upper
    bound holds for ``|mu| <= 1`` (a stable coarse step; it is the exact norm at
    ``|mu| = 1``); for ``|mu| > 1`` the norm grows like ``|mu|^n`` and the upper
    value is inf (:func:`two_level_norm` gives it exactly). Broadcasts over arrays.

    Returns
    -------
    lower, upper : float or ndarray

    Examples
    --------
    >>> lam, mu = dahlquist_factors(-0.1, 4)
    >>> lo, hi = sharp_bounds(lam, mu, 4, 8, "F")
    >>> bool(lo <= two_level_norm(lam, mu, 4, 8, "F") <= hi)
    True
    """
    _check_nc(n_c)
    n = n_c - 1 - parse_relax(relax)
    c = c_factor(lam, mu, m, relax)
    if n <= 0:
        zero = np.zeros_like(np.asarray(c, dtype=np.float64))
        return zero, zero
    a = np.abs(mu)

    def bound(angle):
        return c / np.sqrt(1.0 + a * a - 2.0 * a * np.cos(angle))

    upper = bound(np.pi / (2 * n + 1))
    return bound(np.pi / (n + 1)), np.where(a > 1.0, np.where(c == 0, 0.0, np.inf), upper)[()]


def limit_bound(lam, mu, m: int, relax: str = "F"):
    """``N_c -> inf`` limit of the two-level bounds: ``c_r / (1 - |mu|)`` for ``|mu| < 1``; inf for ``|mu| >= 1``
    (an unstable or undamped coarse step: the norm grows without bound with ``N_c``), 0 where ``c_r = 0``.

    Examples
    --------
    >>> lam, mu = dahlquist_factors(-0.1, 4)
    >>> round(float(limit_bound(lam, mu, 4, "F")), 6)
    0.109453
    """
    c, a = c_factor(lam, mu, m, relax), np.abs(mu)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(a >= 1.0, np.inf, c / (1.0 - a))
    return np.where(c == 0, 0.0, out)[()]


def worst_case(m: int, relax: str = "F", scheme: str = "be"):
    """Worst ``N_c -> inf`` two-level factor over real ``z < 0``.

    Maximizes :func:`limit_bound` over ``z < 0`` (backward Euler) or
    ``-2/m < z < 0`` (forward Euler, where the coarse step is stable):
    a log-spaced scan followed by a bounded refinement. With forward Euler
    ``|mu| -> 1`` at ``z -> -2/m`` while ``c_r`` stays positive (except for
    ``m = 2`` with C-relaxation, where ``lam -> 0``): the factor grows without
    bound there, and ``(-2/m, inf)`` is returned.

    Returns
    -------
    z, factor : float
        The maximizing ``z`` and the factor there.

    Examples
    --------
    >>> z, f = worst_case(2, "F")
    >>> round(f, 4)
    0.125
    """
    from scipy.optimize import minimize_scalar

    _check_cf(m)
    parse_relax(relax)
    if scheme == "be":
        lo, hi = -12.0, 12.0  # z = -exp(s)

        def to_z(s):
            return -np.exp(s)

    elif scheme == "fe":
        lo, hi = 1e-9, 1.0 - 1e-9  # z = -(2/m) s

        def to_z(s):
            return -(2.0 / m) * s

    else:
        raise ValueError(f"`scheme` must be 'be' or 'fe', got {scheme!r}")

    def factor(s):
        lam, mu = dahlquist_factors(to_z(s), m, scheme)
        return limit_bound(lam, mu, m, relax)

    if scheme == "fe":  # at the edge of the coarse step's stability |mu| = 1: unbounded unless c_r vanishes there
        lam, mu = dahlquist_factors(-2.0 / m, m, "fe")
        if float(c_factor(lam, mu, m, relax)) > 0.0:  # (0 only for lam = 0: m = 2 with C-relaxation)
            return -2.0 / m, math.inf

    grid = np.linspace(lo, hi, 4001)
    k = int(np.argmax(factor(grid)))
    a, b = grid[max(k - 1, 0)], grid[min(k + 1, grid.size - 1)]
    best = minimize_scalar(lambda s: -float(factor(s)), bounds=(a, b), method="bounded",
                           options={"xatol": 1e-12})
    s = best.x if -best.fun >= factor(grid[k]) else grid[k]
    return float(to_z(s)), float(factor(s))


# --------------------------------------------------------------------------------------
# Multilevel cycles by dense linear algebra
# --------------------------------------------------------------------------------------
# Unknowns of a level with N intervals: the errors e_1 .. e_N (e_0 = 0), each of size d,
# stacked into one vector of length N d. Point i is a C-point when i % m == 0.


def _shift(n: int) -> np.ndarray:
    return np.eye(n, k=-1)


def _system(P: np.ndarray, n: int) -> np.ndarray:
    """``A = I - S kron Phi``: rows ``e_i - Phi e_{i-1}`` of the time-stepping system."""
    return np.eye(n * P.shape[0]) - np.kron(_shift(n), P)


def _f_relax(P: np.ndarray, n: int, m: int) -> np.ndarray:
    """F-relaxation on errors: C-points kept, F-point ``k m + j`` becomes ``Phi^j e_{k m}``."""
    d = P.shape[0]
    F = np.zeros((n * d, n * d), dtype=np.result_type(P, float))
    powers = [np.linalg.matrix_power(P, j) for j in range(m)]
    for i in range(1, n + 1):
        k, j = divmod(i, m)
        row = slice((i - 1) * d, i * d)
        if j == 0:
            F[row, row] = np.eye(d)
        elif k >= 1:
            col = slice((k * m - 1) * d, k * m * d)
            F[row, col] = powers[j]
    return F


def _c_relax(P: np.ndarray, n: int, m: int) -> np.ndarray:
    """C-relaxation on errors: C-point ``i`` becomes ``Phi e_{i-1}``, the rest is kept."""
    d = P.shape[0]
    C = np.eye(n * d, dtype=np.result_type(P, float))
    for i in range(m, n + 1, m):
        row = slice((i - 1) * d, i * d)
        C[row, row] = 0.0
        C[row, (i - 2) * d : (i - 1) * d] = P
    return C


def _restriction(n: int, m: int, d: int) -> np.ndarray:
    """Injection at C-points: coarse point ``k`` is fine point ``k m``."""
    nc = n // m
    R = np.zeros((nc, n))
    R[np.arange(nc), m * np.arange(1, nc + 1) - 1] = 1.0
    return np.kron(R, np.eye(d))


def _cycle_error(ops: list, sizes: list, m: int, nrelax: int, kind: str, l: int) -> np.ndarray:
    """Error propagation of one cycle on level ``l``, ending with an F-relaxation.

    ``M_l = F_l (I - Q_l (I - M_c) A_{l+1}^{-1} R_l A_l) F_l (C_l F_l)^r`` where
    ``M_c`` is the error propagation of the approximate coarse solve: 0 on the
    coarsest level, ``M_{l+1}^V`` for a V-cycle, ``M_{l+1}^V M_{l+1}^F`` for an
    F-cycle. The final F-relaxation is the ideal interpolation.
    """
    P, n = ops[l], sizes[l]
    d = P.shape[0]
    F, C = _f_relax(P, n, m), _c_relax(P, n, m)
    relax = F
    for _ in range(nrelax):
        relax = F @ C @ relax
    A, Ac = _system(P, n), _system(ops[l + 1], sizes[l + 1])
    R = _restriction(n, m, d)
    last = len(ops) - 1
    if l + 1 == last:
        Mc = np.zeros_like(Ac)
    elif kind == "V":
        Mc = _cycle_error(ops, sizes, m, nrelax, "V", l + 1)
    else:
        Mc = _cycle_error(ops, sizes, m, nrelax, "V", l + 1) @ _cycle_error(
            ops, sizes, m, nrelax, "F", l + 1)
    coarse = (np.eye(Ac.shape[0]) - Mc) @ np.linalg.solve(Ac, R @ A)
    return F @ (np.eye(n * d) - R.T @ coarse) @ relax


def multilevel_matrix(ops: Sequence, n: int, m: int, relax: str = "F", cycle: str = "V") -> np.ndarray:
    """Exact iteration matrix of one MGRIT V- or F-cycle on the fine C-point errors.

    Dense linear algebra on the whole space-time error vector; independent
    of :func:`mgrit.solve`, which runs the same cycle as FAS. Level ``l``
    has ``n // m**l`` intervals (trailing points are F-points of the last
    interval), its one-step operator is ``ops[l]``, and the coarsest level is
    solved exactly. Relaxation ``relax`` is used on every level but the
    coarsest. With two levels and ``n = m N_c`` this equals
    :func:`two_level_matrix`.

    Parameters
    ----------
    ops : sequence of scalars or (d, d) arrays
        One-step operator of every level, finest first (e.g. :func:`level_factors`);
        ``len(ops)`` is the number of levels (>= 2).
    n : int
        Number of fine intervals.
    m : int
        Coarsening factor.
    relax : {"F", "FCF", ...}
    cycle : {"V", "F"}

    Returns
    -------
    numpy.ndarray, shape (N_c d, N_c d), ``N_c = n // m``

    Examples
    --------
    >>> ops = level_factors(-0.1, 4, 2)
    >>> E = multilevel_matrix(ops, 32, 4, "F")
    >>> bool(np.allclose(E, two_level_matrix(ops[0], ops[1], 4, 8, "F")))
    True
    >>> E3 = multilevel_matrix(level_factors(-0.05, 2, 3), 32, 2, "FCF", "V")
    >>> E3.shape
    (16, 16)
    """
    _check_cf(m)
    nrelax = parse_relax(relax)
    if cycle not in ("V", "F"):
        raise ValueError(f"`cycle` must be 'V' or 'F', got {cycle!r}")
    mats = [_operator(P) for P in ops]
    if len(mats) < 2:
        raise ValueError("`ops` needs at least two levels (one level is sequential stepping)")
    if any(P.shape != mats[0].shape for P in mats):
        raise ValueError("all `ops` must have the same shape")
    check_integer(n, "n", 1, " (number of fine intervals)")
    sizes = [int(n)]
    for _ in range(len(mats) - 1):
        sizes.append(sizes[-1] // m)
    if sizes[-1] < 1:
        raise ValueError(f"{len(mats)} levels with m = {m} need n >= {m ** (len(mats) - 1)}, got n = {n}")
    M = _cycle_error(mats, sizes, m, nrelax, cycle, 0)
    R = _restriction(sizes[0], m, mats[0].shape[0])
    return R @ M @ R.T
