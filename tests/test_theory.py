"""MGRIT convergence theory (mgrit.theory) against docs/theory.md §6 and the solver.

The solver-side iteration matrix is extracted from mgrit.solve itself: with
``skip=False`` every cycle starts with an F-relaxation, so the iterate after
``k`` cycles depends only on the initial C-point values, and (the problem being
linear) affinely so. Starting from a base guess and from the base guess plus a
unit vector at one C-point, the difference of the C-point values after ``k``
cycles is one column of ``E^k``. The returned solution gets a final
F-relaxation, which leaves C-points unchanged.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from mgrit import theory as th
from propagators import Dahlquist, Heat1D

# --------------------------------------------------------------------------------------
# (a) docs/theory.md §6 reference values
# --------------------------------------------------------------------------------------

TABLE = [  # scheme, z, m, N_c, ||E_F||, ||E_FCF||
    ("be", -0.1, 4, 8, "8.000356e-02", "5.158324e-02"),
    ("be", -0.1, 4, 64, "1.083992e-01", "7.401627e-02"),
    ("be", -1.0, 2, 16, "1.233377e-01", "3.078041e-02"),
    ("be", -1.0, 8, 16, "1.202858e-01", "4.696973e-04"),
    ("be", -10.0, 4, 16, "2.491776e-02", "1.701802e-06"),
    ("be", -0.01 + 0.5j, 4, 16, "7.393235e-01", "4.568864e-01"),
    ("fe", -0.1, 4, 8, "1.174265e-01", "7.413368e-02"),
    ("fe", -0.1, 4, 64, "1.396489e-01", "9.161143e-02"),
]

WORST = {2: ("0.125", "0.0527"), 4: ("0.204", "0.0813"), 8: ("0.249", "0.0962"), 16: ("0.273", "0.1038")}


@pytest.mark.parametrize("scheme, z, m, n_c, ref_f, ref_fcf", TABLE)
def test_reference_table(scheme, z, m, n_c, ref_f, ref_fcf):
    lam, mu = th.dahlquist_factors(z, m, scheme)
    for relax, ref in (("F", ref_f), ("FCF", ref_fcf)):
        exact = th.two_level_norm(lam, mu, m, n_c, relax)
        assert f"{exact:.6e}" == ref
        # the same number from the assembled matrix and from the dense multilevel cycle
        E = th.two_level_matrix(lam, mu, m, n_c, relax)
        assert th.matrix_norm(E) == pytest.approx(exact, rel=1e-12, abs=0.0)
        E2 = th.multilevel_matrix([lam, mu], m * n_c, m, relax)
        assert np.allclose(E2, E, rtol=0, atol=1e-14)


def _matches_printed(value: float, printed: str) -> bool:
    decimals = len(printed.split(".")[1])
    return abs(value - float(printed)) <= 0.5 * 10.0**-decimals


@pytest.mark.parametrize("m", sorted(WORST))
def test_worst_case_backward_euler(m):
    for relax, printed in zip(("F", "FCF"), WORST[m]):
        z, factor = th.worst_case(m, relax, "be")
        assert z < 0
        assert _matches_printed(factor, printed), (m, relax, factor, printed)
        # it is a maximum: nearby z give less, and finite N_c stays below the limit
        for zz in (1.1 * z, 0.9 * z):
            lam, mu = th.dahlquist_factors(zz, m)
            assert th.limit_bound(lam, mu, m, relax) <= factor
        lam, mu = th.dahlquist_factors(z, m)
        assert th.two_level_norm(lam, mu, m, 512, relax) <= factor
        assert th.two_level_norm(lam, mu, m, 512, relax) == pytest.approx(factor, rel=1e-3, abs=0.0)


def test_worst_case_forward_euler_is_unbounded_at_the_stability_edge():
    """With forward Euler |mu| -> 1 at z -> -2/m while c_r stays positive: the factor grows without bound (it
    returned 5.3e8, the value at its search's cutoff, where z a little closer to -2/m gives 5.3e11); with m = 2
    and C-relaxation lam -> 0 there and the worst case is finite, inside the stable range."""
    for m, relax in ((4, "F"), (2, "F"), (4, "FCF"), (8, "FCF")):
        z, factor = th.worst_case(m, relax, "fe")
        assert z == -2.0 / m and factor == np.inf
        lam, mu = th.dahlquist_factors(-2.0 / m * (1 - 1e-12), m, "fe")
        assert th.limit_bound(lam, mu, m, relax) > 1e9  # (approaching the edge)
    z, factor = th.worst_case(2, "FCF", "fe")
    assert -1.0 < z < 0 and 0 < factor < 0.1


def test_two_level_formula_structure():
    """E_F is strictly lower triangular Toeplitz with entries (lam^m - mu) mu^(k-1)."""
    lam, mu = th.dahlquist_factors(-0.3 + 0.2j, 4)
    E = th.two_level_matrix(lam, mu, 4, 6, "F")
    c = lam**4 - mu
    for k in range(6):
        for j in range(6):
            want = c * mu ** (k - j - 1) if k > j else 0.0
            assert E[k, j] == pytest.approx(want, abs=1e-15)
    # FCF = F times (lam^m S)
    Efcf = th.two_level_matrix(lam, mu, 4, 6, "FCF")
    assert np.allclose(Efcf, E @ (lam**4 * np.eye(6, k=-1)), atol=1e-15)


def test_exact_after_n_c_iterations_nilpotent():
    """docs/theory.md §5: F is exact after N_c iterations, FCF after ceil(N_c / 2)."""
    for n_c in (6, 7):
        ops = th.level_factors(-0.7, 2, 2)
        for relax, k in (("F", n_c), ("FCF", -(-n_c // 2))):
            E = th.two_level_matrix(ops[0], ops[1], 2, n_c, relax)
            assert np.all(np.linalg.matrix_power(E, k) == 0)
            assert np.any(np.linalg.matrix_power(E, k - 1) != 0)


def test_small_n_c_and_validation():
    lam, mu = th.dahlquist_factors(-1.0, 2)
    assert th.two_level_norm(lam, mu, 2, 1, "F") == 0.0
    assert th.two_level_norm(lam, mu, 2, 2, "FCF") == 0.0
    assert th.sharp_bounds(lam, mu, 2, 2, "FCF") == (0.0, 0.0)
    assert float(th.dobrev_bound(lam, mu, 2, 1, "F")) == 0.0
    with pytest.raises(ValueError, match="`m`"):
        th.two_level_norm(lam, mu, 1, 4)
    with pytest.raises(ValueError, match="`n_c`"):
        th.two_level_norm(lam, mu, 2, 0)
    with pytest.raises(ValueError, match="`relax`"):
        th.two_level_norm(lam, mu, 2, 4, "C")
    with pytest.raises(ValueError, match="`scheme`"):
        th.dahlquist_factors(-1.0, 2, "rk4")
    with pytest.raises(ValueError, match="`cycle`"):
        th.multilevel_matrix([lam, mu], 8, 2, "F", "W")
    with pytest.raises(ValueError, match="need n >="):
        th.multilevel_matrix(th.level_factors(-1.0, 2, 4), 4, 2)


def test_dobrev_bound_at_unit_modulus():
    """|mu| = 1: the geometric sum is n, no division by zero."""
    assert float(th.dobrev_bound(1.0, 1.0j, 2, 5, "F")) == pytest.approx(abs(1.0 - 1.0j) * 4)


def test_bounds_broadcast_over_z():
    z = np.array([-0.1, -1.0, -10.0])
    lam, mu = th.dahlquist_factors(z, 4)
    lo, hi = th.sharp_bounds(lam, mu, 4, 16, "F")
    exact = [th.two_level_norm(a, b, 4, 16, "F") for a, b in zip(lam, mu)]
    assert lo.shape == (3,) and np.all(lo <= exact) and np.all(np.asarray(exact) <= hi)


# --------------------------------------------------------------------------------------
# (b) bounds bracket the exact norm (property-based)
# --------------------------------------------------------------------------------------

RTOL = 1e-10


def _check_bounds(lam, mu, m, n_c, relax):
    exact = th.two_level_norm(lam, mu, m, n_c, relax)
    lo, hi = th.sharp_bounds(lam, mu, m, n_c, relax)
    dob = float(th.dobrev_bound(lam, mu, m, n_c, relax))
    assert float(lo) <= exact * (1 + RTOL) + 1e-300
    assert exact <= float(hi) * (1 + RTOL) + 1e-300
    assert exact <= dob * (1 + RTOL) + 1e-300
    if abs(mu) < 1:
        assert float(hi) <= float(th.limit_bound(lam, mu, m, relax)) * (1 + RTOL) + 1e-300
        assert dob <= float(th.limit_bound(lam, mu, m, relax)) * (1 + RTOL) + 1e-300


@settings(max_examples=150, deadline=None)
@given(
    x=st.floats(-50.0, -1e-3),
    y=st.floats(-20.0, 20.0),
    m=st.integers(2, 16),
    n_c=st.integers(1, 80),
    relax=st.sampled_from(["F", "FCF", "FCFCF"]),
)
def test_bounds_backward_euler(x, y, m, n_c, relax):
    lam, mu = th.dahlquist_factors(complex(x, y), m, "be")
    _check_bounds(lam, mu, m, n_c, relax)
    # the dense matrix agrees with the singular-value formula
    if n_c <= 40:
        E = th.two_level_matrix(lam, mu, m, n_c, relax)
        exact = th.two_level_norm(lam, mu, m, n_c, relax)
        assert th.matrix_norm(E) == pytest.approx(exact, rel=1e-9, abs=1e-300)


@settings(max_examples=100, deadline=None)
@given(
    s=st.floats(0.01, 0.99),
    angle=st.floats(-np.pi, np.pi),
    m=st.integers(2, 16),
    n_c=st.integers(1, 80),
    relax=st.sampled_from(["F", "FCF"]),
)
def test_bounds_forward_euler(s, angle, m, n_c, relax):
    """Forward Euler with a stable coarse step: m z inside the unit disc around -1."""
    z = (-1.0 + s * np.exp(1j * angle)) / m
    lam, mu = th.dahlquist_factors(z, m, "fe")
    assert abs(mu) < 1
    _check_bounds(lam, mu, m, n_c, relax)


def test_matrix_propagators_reduce_to_eigenvalues():
    """Simultaneously (unitarily) diagonalizable Phi, Psi: ||E|| = max over eigenvalue pairs."""
    rng = np.random.default_rng(1)
    Q, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    z = np.array([-0.05, -0.5, -3.0, -20.0])
    lam, mu = th.dahlquist_factors(z, 4)
    Phi, Psi = Q @ np.diag(lam) @ Q.T, Q @ np.diag(mu) @ Q.T
    for relax in ("F", "FCF"):
        want = max(th.two_level_norm(a, b, 4, 10, relax) for a, b in zip(lam, mu))
        assert th.two_level_norm(Phi, Psi, 4, 10, relax) == pytest.approx(want, rel=1e-10, abs=0.0)
        E = th.two_level_matrix(Phi, Psi, 4, 10, relax)
        E2 = th.multilevel_matrix([Phi, Psi], 40, 4, relax)
        assert np.allclose(E, E2, atol=1e-14)


# --------------------------------------------------------------------------------------
# (c) theory against the solver
# --------------------------------------------------------------------------------------


def solver_iteration_matrix(prop, u0, t, m, levels, relax, cycle="V", iters=1, dtype=float):
    """``E^iters`` on fine C-point errors, column by column from mgrit.solve runs."""
    n = len(t) - 1
    n_c = n // m
    shape = np.shape(u0)
    d = int(np.prod(shape, dtype=int))

    def c_values(guess):
        res = mgrit.solve(prop, u0, t, cf=m, max_levels=levels, relax=relax, cycle=cycle,
                          tol=None, max_iter=iters, skip=False, initial_guess=guess)
        assert len(res.hierarchy) == levels and res.iterations == iters
        return np.asarray(res.u)[m::m][:n_c].reshape(-1)

    base = np.zeros((n + 1,) + shape, dtype=dtype)
    ref = c_values(base)
    cols = []
    for j in range(1, n_c + 1):
        for q in range(d):
            g = base.copy()
            g.reshape(n + 1, d)[j * m, q] = 1.0
            cols.append(c_values(g) - ref)
    return np.stack(cols, axis=1)


def dahlquist_setup(z, m, n_c, scheme, levels=2):
    n = m * n_c
    t = np.linspace(0.0, 1.0, n + 1)
    xi = z * n  # h = 1 / n
    dtype = complex if np.iscomplexobj(z) else float
    return Dahlquist(xi, scheme), np.array(1.0, dtype=dtype), t, dtype


CASES_2L = [
    ("be", -0.1, 4, 16),
    ("be", -1.0, 2, 16),
    ("be", -10.0, 4, 8),
    ("be", -0.01 + 0.5j, 4, 16),
    ("be", -2.0 + 3.0j, 8, 6),
    ("fe", -0.1, 4, 16),
]


@pytest.mark.parametrize("scheme, z, m, n_c", CASES_2L)
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_two_level_solver_matches_theory(scheme, z, m, n_c, relax):
    prop, u0, t, dtype = dahlquist_setup(z, m, n_c, scheme)
    lam, mu = th.dahlquist_factors(z, m, scheme)
    E = th.two_level_matrix(lam, mu, m, n_c, relax)
    for k in (1, 2, 3):
        Es = solver_iteration_matrix(prop, u0, t, m, 2, relax, iters=k, dtype=dtype)
        Ek = np.linalg.matrix_power(E, k)
        assert np.allclose(Es, Ek, rtol=0, atol=1e-10 * max(1.0, np.abs(Ek).max()))
        assert th.matrix_norm(Es) == pytest.approx(th.matrix_norm(Ek), rel=1e-9, abs=1e-12)
    assert th.matrix_norm(E) == pytest.approx(th.two_level_norm(lam, mu, m, n_c, relax), rel=1e-12, abs=0.0)


@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_maximizing_error_is_reduced_by_exactly_the_norm(relax):
    """||e_1|| <= ||E|| ||e_0||, with equality for the top right singular vector."""
    z, m, n_c = -0.01 + 0.5j, 4, 16
    prop, u0, t, dtype = dahlquist_setup(z, m, n_c, "be")
    lam, mu = th.dahlquist_factors(z, m)
    norm = th.two_level_norm(lam, mu, m, n_c, relax)
    exact = lam ** np.arange(m * n_c + 1)  # sequential solution u_i = lam^i
    _, _, Vh = np.linalg.svd(th.two_level_matrix(lam, mu, m, n_c, relax))
    rng = np.random.default_rng(3)
    candidates = [Vh[0].conj()] + [rng.standard_normal(n_c) + 1j * rng.standard_normal(n_c) for _ in range(3)]
    for i, v in enumerate(candidates):
        guess = exact.copy()
        guess[m::m] += v
        res = mgrit.solve(prop, u0, t, cf=m, max_levels=2, relax=relax, tol=None, max_iter=1,
                          skip=False, initial_guess=guess)
        e1 = np.linalg.norm(res.u[m::m] - exact[m::m])
        ratio = e1 / np.linalg.norm(v)
        if i == 0:
            assert ratio == pytest.approx(norm, rel=1e-10, abs=0.0)
        else:
            assert ratio <= norm * (1 + 1e-10)


@pytest.mark.parametrize("cycle", ["V", "F"])
@pytest.mark.parametrize("relax", ["F", "FCF"])
@pytest.mark.parametrize("levels, m, n_c, z, scheme", [
    (3, 2, 16, -0.05, "be"),
    (4, 2, 16, -0.05, "be"),
    (3, 4, 8, -0.3 + 0.4j, "be"),
    (4, 2, 16, -0.02, "fe"),
])
def test_multilevel_solver_matches_theory(levels, m, n_c, z, scheme, relax, cycle):
    prop, u0, t, dtype = dahlquist_setup(z, m, n_c, scheme)
    ops = th.level_factors(z, m, levels, scheme)
    E = th.multilevel_matrix(ops, m * n_c, m, relax, cycle)
    for k in (1, 2):
        Es = solver_iteration_matrix(prop, u0, t, m, levels, relax, cycle, iters=k, dtype=dtype)
        Ek = np.linalg.matrix_power(E, k)
        assert np.allclose(Es, Ek, rtol=0, atol=1e-10 * max(1.0, np.abs(Ek).max()))
        assert th.matrix_norm(Es) == pytest.approx(th.matrix_norm(Ek), rel=1e-9, abs=1e-12)


def test_f_cycle_differs_from_v_cycle_on_three_levels():
    ops = th.level_factors(-0.05, 2, 3)
    V = th.multilevel_matrix(ops, 32, 2, "F", "V")
    F = th.multilevel_matrix(ops, 32, 2, "F", "F")
    assert not np.allclose(V, F)
    assert th.matrix_norm(F) < th.matrix_norm(V)


def test_non_multiple_grid_matches_solver():
    """Trailing F-points (N not a multiple of m) on every level."""
    z, m, n, levels = -0.2, 3, 29, 3
    t = np.linspace(0.0, 1.0, n + 1)
    prop = Dahlquist(z * n, "be")
    ops = th.level_factors(z, m, levels)
    for relax in ("F", "FCF"):
        E = th.multilevel_matrix(ops, n, m, relax, "V")
        Es = solver_iteration_matrix(prop, np.array(1.0), t, m, levels, relax)
        assert np.allclose(Es, E, atol=1e-12)


def _heat_step_matrix(nx, dt, a=1.0):
    n = nx - 2
    dx = 1.0 / (nx - 1)
    D2 = (np.eye(n, k=-1) - 2 * np.eye(n) + np.eye(n, k=1)) / dx**2
    return np.linalg.inv(np.eye(n) - dt * a * D2)


@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_heat_equation_block_matrices_match_solver(relax):
    """Matrix propagators: the block iteration matrix against the solver on Heat1D."""
    nx, m, n_c = 9, 4, 6
    n = m * n_c
    t = np.linspace(0.0, 0.5, n + 1)
    h = t[1] - t[0]
    prop = Heat1D(nx, forcing=False)
    Phi, Psi = _heat_step_matrix(nx, h), _heat_step_matrix(nx, m * h)
    E = th.two_level_matrix(Phi, Psi, m, n_c, relax)
    Es = solver_iteration_matrix(prop, prop.initial(), t, m, 2, relax)
    assert np.allclose(Es, E, atol=1e-10)
    assert th.two_level_norm(Phi, Psi, m, n_c, relax) == pytest.approx(th.matrix_norm(Es), rel=1e-9, abs=0.0)
    # symmetric commuting Phi, Psi: the norm is the worst eigenvalue's, below its sharp bound
    lam_d2 = -4.0 / (1.0 / (nx - 1)) ** 2 * np.sin(np.arange(1, nx - 1) * np.pi / (2 * (nx - 1))) ** 2
    lams, mus = th.dahlquist_factors(lam_d2 * h, m)
    worst = max(th.two_level_norm(a, b, m, n_c, relax) for a, b in zip(lams, mus))
    assert th.matrix_norm(E) == pytest.approx(worst, rel=1e-9, abs=0.0)


# --------------------------------------------------------------------------------------
# (d) Hessenthaler et al. (2020): F degrades with levels, FCF stays about flat
# --------------------------------------------------------------------------------------

HESS_LEVELS = (2, 3, 4, 5)


def _hessenthaler_solver_factors(relax, n=128):
    """Average residual reduction per cycle until the residual is below 1e-10."""
    t = np.linspace(0.0, 1.0, n + 1)
    prop = Dahlquist(-0.05 * n, "be")
    out = []
    for levels in HESS_LEVELS:
        res = mgrit.solve(prop, np.array(1.0), t, cf=2, max_levels=levels, relax=relax, tol=1e-10,
                          max_iter=50, skip=False, initial_guess=0.0)
        assert res.converged and len(res.hierarchy) == levels
        r = res.residuals
        out.append((r[-1] / r[0]) ** (1.0 / (len(r) - 1)))
    return np.array(out)


def _hessenthaler_theory(relax, k, n=128):
    """``||E^k||_2^(1/k)`` of the V-cycle (k = 1: the worst single cycle)."""
    out = []
    for levels in HESS_LEVELS:
        E = th.multilevel_matrix(th.level_factors(-0.05, 2, levels), n, 2, relax, "V")
        out.append(th.matrix_norm(np.linalg.matrix_power(E, k)) ** (1.0 / k))
    return np.array(out)


def test_hessenthaler_trend_theory():
    """BE, z = -0.05, m = 2, N_c = 64: two-level values and the growth with levels."""
    f1, fcf1 = _hessenthaler_theory("F", 1), _hessenthaler_theory("FCF", 1)
    # two levels: the two-level theory
    lam, mu = th.dahlquist_factors(-0.05, 2)
    assert f1[0] == pytest.approx(th.two_level_norm(lam, mu, 2, 64, "F"), rel=1e-12, abs=0.0)
    assert fcf1[0] == pytest.approx(th.two_level_norm(lam, mu, 2, 64, "FCF"), rel=1e-12, abs=0.0)
    # F degrades steadily; every level costs more than the one before
    assert np.all(np.diff(f1) > 0) and np.all(np.diff(np.diff(f1)) > 0)
    assert f1[-1] > 10 * f1[0]
    # FCF is better on every level count and its growth slows down
    assert np.all(fcf1 < f1)
    assert fcf1[-1] - fcf1[-2] < 0.5 * (f1[-1] - f1[-2])
    # over several cycles (what a run sees), FCF is flat from 4 to 5 levels, F is not
    f8, fcf8 = _hessenthaler_theory("F", 8), _hessenthaler_theory("FCF", 8)
    assert abs(fcf8[-1] / fcf8[-2] - 1) < 0.05
    assert f8[-1] / f8[-2] > 1.2
    assert fcf8[-1] < 0.5 * f8[-1]


def test_hessenthaler_trend_solver():
    """The same trend in the solver's averaged residual reduction factors."""
    f, fcf = _hessenthaler_solver_factors("F"), _hessenthaler_solver_factors("FCF")
    assert np.all(np.diff(f) > 0)
    assert f[-1] > 4 * f[0]
    assert abs(fcf[-1] / fcf[-2] - 1) < 0.1  # flat from 4 to 5 levels
    assert fcf[-1] < 0.5 * f[-1]
    # measured multi-cycle factors stay below the worst single-cycle norm
    assert np.all(f <= _hessenthaler_theory("F", 1))
    assert np.all(fcf <= _hessenthaler_theory("FCF", 1))


@pytest.mark.parametrize("n_c", [3, 20, 44, 50])
def test_an_unstable_coarse_step_gets_its_exact_norm_and_no_false_bounds(n_c):
    """|mu| > 1 (forward Euler, z = -0.8, m = 4: mu = -2.2): two_level_norm lost its digits from N_c = 44 (the
    smallest singular value underflows) and divided by zero at 50; sharp_bounds' upper value was 16 orders
    below the norm and limit_bound was negative."""
    lam, mu = th.dahlquist_factors(-0.8, 4, "fe")
    assert abs(mu) > 1
    exact = th.matrix_norm(th.two_level_matrix(lam, mu, 4, n_c, "F"))
    assert th.two_level_norm(lam, mu, 4, n_c, "F") == pytest.approx(exact, rel=1e-10, abs=0.0)
    lo, hi = th.sharp_bounds(lam, mu, 4, n_c, "F")
    assert lo <= exact and hi == np.inf
    assert th.limit_bound(lam, mu, 4, "F") == np.inf
    assert th.two_level_norm(lam, mu, 4, 2000, "F") == np.inf  # beyond the largest float, not a ZeroDivisionError


def test_the_norm_and_bounds_are_continuous_through_a_neutral_coarse_step():
    lam = 0.3
    at = th.two_level_norm(lam, 1.0, 4, 30, "F")
    for mu in (1.0 - 1e-9, 1.0 + 1e-9):
        assert th.two_level_norm(lam, mu, 4, 30, "F") == pytest.approx(at, rel=1e-6, abs=0.0)
    assert th.sharp_bounds(lam, 1.0, 4, 30, "F")[1] == pytest.approx(at, rel=1e-12, abs=0.0)  # exact at |mu| = 1
    assert list(th.limit_bound(np.full(3, 0.5), np.array([0.5, 1.0, 0.5**4]), 4, "F")) == [0.875, np.inf, 0.0]


def test_the_bidiagonal_extremes_in_linear_time_equal_the_dense_ones():
    """two_level_norm took O(n^3) time and O(n^2) memory (6.5 s at N_c = 2000, MemoryError at 10^5):
    the smallest singular value of I - |mu| S now comes from its eigenvector equation, the norm of the
    inverse (|mu| > 1) by power iteration beyond 1000 rows; both equal the dense values."""
    for n in (1, 2, 3, 7, 40, 300):
        for a in (0.0, 1e-9, 0.3, 0.9, 0.999, 1.0 - 1e-12, 1.0):
            dense = np.linalg.svd(np.eye(n) - a * np.eye(n, k=-1), compute_uv=False)[-1]
            assert abs(th._bidiagonal_sigma_min(a, n) - dense) <= 1e-12 * dense, (n, a)
        for a in (1.0 + 1e-12, 1.001, 1.3, 4.0):
            if (n - 1) * np.log(a) < 700:
                exact = th._inverse_bidiagonal_norm(a, n, dense=True)
                assert abs(th._inverse_bidiagonal_norm(a, n, dense=False) - exact) <= 1e-12 * exact, (n, a)
    for a, n in ((1e-20, 5), (1e-12, 100_000), (3e-17, 1)):  # (below n eps: the bracket's end is the root)
        assert th._bidiagonal_sigma_min(a, n) == pytest.approx(1.0 - a, rel=1e-15, abs=0.0)
    assert th.two_level_norm(*th.level_factors(-1e14, 4, 2), 4, 1000) > 0  # (a stiff mode: it raised)
    lam, mu = th.dahlquist_factors(-0.1, 4)
    norm = th.two_level_norm(lam, mu, 4, 100_000)  # (a dense SVD would take 80 GB)
    lo, hi = th.sharp_bounds(lam, mu, 4, 100_000)
    assert lo <= norm <= hi and hi - lo < 1e-6 * hi
    grow = th.two_level_norm(1.0, 1.0 + 1e-9, 2, 200_000)  # |mu| > 1: power iteration, finite
    assert math.isfinite(grow) and grow > th.two_level_norm(1.0, 1.0 + 1e-9, 2, 100_000)
    assert th.two_level_norm(1.0, 1.5, 2, 5000) == math.inf  # (|mu|^(n-1) beyond the largest float)


@pytest.mark.parametrize("call, match", [
    (lambda: th.two_level_norm(0.5, np.nan, 2, 8), "contains NaN or Inf"),
    (lambda: th.two_level_norm(np.nan, 0.5, 2, 8), "contains NaN or Inf"),
    (lambda: th.multilevel_matrix([np.nan, 0.3], 8, 2), "contains NaN or Inf"),
    (lambda: th.two_level_norm(0.5, 0.3, 2, True), r"`n_c` must be an integer >= 1.*a bool"),
    (lambda: th.two_level_norm(0.5, 0.3, 2, np.True_), r"`n_c` must be an integer >= 1.*a bool"),
    (lambda: th.multilevel_matrix([0.5, 0.3], 32.7, 2), r"`n` must be an integer >= 1"),
    (lambda: th.level_factors(-1.0, 2, -1), r"`n_levels` must be an integer >= 1"),
])
def test_theory_inputs_are_checked(call, match):
    """A NaN gave the SVD's "did not converge" (or a NaN norm), n_c=True a norm of 0, n=32.7 the
    matrix of n=32, n_levels=-1 an empty list."""
    with pytest.raises(ValueError, match=match):
        call()


def test_nan_factors_are_refused_by_every_bound():
    """two_level_norm refused NaN; sharp_bounds, dobrev_bound, limit_bound and dahlquist_factors returned it."""
    lam, mu = th.dahlquist_factors(-0.1, 4)
    for call in (lambda: th.sharp_bounds(np.nan, mu, 4, 8), lambda: th.dobrev_bound(lam, np.nan, 4, 8),
                 lambda: th.limit_bound(np.array([lam, np.nan]), mu, 4), lambda: th.dahlquist_factors(np.nan, 4),
                 lambda: th.step_factor(np.array([-1.0, np.nan]), "fe")):
        with pytest.raises(ValueError, match="NaN"):
            call()


def test_review_of_the_worst_case_and_nan_checks():
    """c_r at the edge is tiny but positive with many C-relaxations (m = 3, FCF^9: 1.4e-13): the worst case is
    unbounded there too (a 1e-12 cut returned 0.0132, below values inside the range); Fractions and symbols
    have no NaN (the NaN check raised numpy's TypeError on them)."""
    from fractions import Fraction

    assert th.worst_case(3, "F" + "CF" * 9, "fe") == (-2.0 / 3.0, np.inf)
    assert th.step_factor(Fraction(-1, 2), "fe") == Fraction(1, 2)
    assert th.c_factor(Fraction(1, 2), Fraction(0), 2) == Fraction(1, 4)


def test_one_by_one_matrices_take_the_closed_form():
    """A 1 x 1 matrix went through the dense (n_c d)^2 matrix and its SVD (1.7 s at n_c 2000); it is the
    scalar's closed form, which equals that SVD."""
    lam, mu = th.dahlquist_factors(-0.1 + 0.3j, 4)
    for relax in ("F", "FCF"):
        dense = th.matrix_norm(th.two_level_matrix(np.array([[lam]]), np.array([[mu]]), 4, 40, relax))
        one = th.two_level_norm(np.array([[lam]]), np.array([[mu]]), 4, 40, relax)
        assert one == th.two_level_norm(lam, mu, 4, 40, relax) and one == pytest.approx(dense, rel=1e-12)


def test_step_factor_names_what_is_wrong_with_z():
    with pytest.raises(TypeError, match="`z` must be a number"):
        th.step_factor(None)
    with pytest.raises(TypeError, match="`z` must be a number"):
        th.step_factor("abc")
    with pytest.raises(ValueError, match="infinite complex z"):
        th.dahlquist_factors(complex(math.inf, 0.0), 4)
