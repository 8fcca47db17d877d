"""Convergence of the solver against two-level theory and multilevel observations.

Two-level theory (docs/theory.md §6, Dobrev et al. 2017, Southworth 2019): on the
Dahlquist problem with lambda = one fine step, mu = one coarse step, the error
at the C-points e_1..e_Nc is multiplied per cycle by

    E_F   = (lambda^m - mu) B^{-1} S,        B = I - mu S,  S = down-shift,
    E_FCF = E_F lambda^m S.

One cycle (skip off) begins with an F-relaxation, which overwrites every
F-point from its C-point, and ends (for the returned solution) with one more
F-relaxation. The map from the C-point errors of the initial guess to the
C-point errors of ``solve(..., max_iter=1)`` is therefore exactly E; the tests
extract it column by column from the solver and compare it with the matrix
built here and with the reference norms.
"""
from __future__ import annotations

import numpy as np
import pytest

import mgrit
from propagators import Dahlquist, Heat1D, Lorenz

from conftest import max_err, scale, sequential, uniform_grid

# scheme, z, m, N_c, ||E_F||_2, ||E_FCF||_2   (docs/theory.md §6)
REFERENCE_NORMS = [
    ("be", -0.1, 4, 8, 8.000356e-02, 5.158324e-02),
    ("be", -0.1, 4, 64, 1.083992e-01, 7.401627e-02),
    ("be", -1.0, 2, 16, 1.233377e-01, 3.078041e-02),
    ("be", -1.0, 8, 16, 1.202858e-01, 4.696973e-04),
    ("be", -10.0, 4, 16, 2.491776e-02, 1.701802e-06),
    ("be", -0.01 + 0.5j, 4, 16, 7.393235e-01, 4.568864e-01),
    ("fe", -0.1, 4, 8, 1.174265e-01, 7.413368e-02),
    ("fe", -0.1, 4, 64, 1.396489e-01, 9.161143e-02),
]


def amplification(scheme, z, m):
    """(lambda, mu): one fine step with z = xi h, one coarse step with m z."""
    if scheme == "be":
        return 1.0 / (1.0 - z), 1.0 / (1.0 - m * z)
    return 1.0 + z, 1.0 + m * z


def iteration_matrix(scheme, z, m, n_coarse, relax, w=1.0):
    """E on the C-point errors e_1..e_Nc, built from the formulas; ``w`` weights C-relaxation:
    one weighted C-sweep maps e to ((1 - w) I + w lambda^m S) e."""
    lam, mu = amplification(scheme, z, m)
    S = np.eye(n_coarse, k=-1)
    B = np.eye(n_coarse) - mu * S
    E = (lam**m - mu) * np.linalg.solve(B, S)
    for _ in range(relax.count("C")):
        E = E @ ((1.0 - w) * np.eye(n_coarse) + w * lam**m * S)
    return E


def dahlquist_setup(scheme, z, m, n_coarse):
    """xi = z and h = 1 so that z = xi h exactly; complex z gets a complex state."""
    prop = Dahlquist(z, scheme)
    t = np.arange(m * n_coarse + 1, dtype=np.float64)
    u0 = np.array(1.0 + 0j) if isinstance(z, complex) else np.array(1.0)
    return prop, t, u0, sequential(prop, u0, t)


def solver_iteration_matrix(prop, t, u0, ref, m, relax, **kw):
    """Column j: C-point errors after one cycle started from the exact solution plus a unit
    error at C-point j + 1 (linear problem: the map is exactly linear)."""
    n_coarse = (len(t) - 1) // m
    E = np.zeros((n_coarse, n_coarse), dtype=complex)
    for j in range(n_coarse):
        guess = ref.copy()
        guess[(j + 1) * m] += 1.0
        res = mgrit.solve(prop, u0, t, cf=m, max_levels=2, relax=relax, skip=False, tol=None,
                          max_iter=1, initial_guess=guess, **kw)
        E[:, j] = (res.u - ref)[m::m]
    return E


@pytest.mark.parametrize("scheme,z,m,n_coarse,norm_f,norm_fcf", REFERENCE_NORMS)
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_solver_iteration_matrix_matches_theory(scheme, z, m, n_coarse, norm_f, norm_fcf, relax):
    prop, t, u0, ref = dahlquist_setup(scheme, z, m, n_coarse)
    E = solver_iteration_matrix(prop, t, u0, ref, m, relax)
    T = iteration_matrix(scheme, z, m, n_coarse, relax)
    np.testing.assert_allclose(E, T, rtol=0, atol=1e-13)
    expected = norm_f if relax == "F" else norm_fcf
    assert np.linalg.norm(E, 2) == pytest.approx(expected, rel=1e-6, abs=0.0)

    # closed form and Southworth's two-sided bound, n = N_c - 1 - r
    lam, mu = amplification(scheme, z, m)
    r = relax.count("C")
    n = n_coarse - 1 - r
    c_r = abs(lam) ** (r * m) * abs(lam**m - mu)
    B_n = np.eye(n) - mu * np.eye(n, k=-1)
    sigma_min = np.linalg.svd(B_n, compute_uv=False)[-1]
    assert np.linalg.norm(E, 2) == pytest.approx(c_r / sigma_min, rel=1e-10, abs=0.0)
    a = abs(mu)
    lower = c_r / np.sqrt(1 + a * a - 2 * a * np.cos(np.pi / (n + 1)))
    upper = c_r / np.sqrt(1 + a * a - 2 * a * np.cos(np.pi / (2 * n + 1)))
    assert lower * (1 - 1e-12) <= np.linalg.norm(E, 2) <= upper * (1 + 1e-12)
    # Dobrev-type bound
    assert np.linalg.norm(E, 2) <= c_r * (1 - a ** (n_coarse - 1 - r)) / (1 - a) * (1 + 1e-12)


@pytest.mark.parametrize("scheme,z,m,n_coarse", [("be", -0.1, 4, 8), ("be", -1.0, 2, 16),
                                                  ("fe", -0.1, 4, 8), ("be", -0.01 + 0.5j, 4, 16)])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_observed_error_reduction_is_iteration_matrix(scheme, z, m, n_coarse, relax, rng):
    """From a random guess, the C-point error after k cycles is E^k e_0 and shrinks per
    cycle by at most ||E||_2."""
    prop, t, u0, ref = dahlquist_setup(scheme, z, m, n_coarse)
    guess = ref + rng.standard_normal(ref.shape)
    E = iteration_matrix(scheme, z, m, n_coarse, relax)
    e = (guess - ref)[m::m]
    bound = np.linalg.norm(E, 2)
    for k in range(1, 5):
        res = mgrit.solve(prop, u0, t, cf=m, max_levels=2, relax=relax, skip=False, tol=None,
                          max_iter=k, initial_guess=guess)
        e_next = (res.u - ref)[m::m]
        np.testing.assert_allclose(e_next, E @ e, rtol=0, atol=1e-13 * max(1.0, np.abs(e).max()))
        assert np.linalg.norm(e_next) <= bound * np.linalg.norm(e) * (1 + 1e-9) + 1e-15
        e = E @ e


@pytest.mark.parametrize("w", [0.5, 0.8, 1.3])
@pytest.mark.parametrize("relax", ["FCF", "FCFCF"])
def test_weighted_c_relaxation_iteration_matrix(w, relax):
    """Weighted C-relaxation u_c <- (1 - w) u_c + w Phi(u_{c-1}) enters E as the factor
    (1 - w) I + w lambda^m S per C-sweep."""
    scheme, z, m, n_coarse = "be", -0.5, 2, 10
    prop, t, u0, ref = dahlquist_setup(scheme, z, m, n_coarse)
    E = solver_iteration_matrix(prop, t, u0, ref, m, relax, c_weight=w)
    np.testing.assert_allclose(E, iteration_matrix(scheme, z, m, n_coarse, relax, w), rtol=0, atol=1e-13)


# --------------------------------------------------------------------------- multilevel
def average_factor(res) -> float:
    """(r_k / r_1)^(1 / (k - 1)) over the computed residuals."""
    r = [x for x in res.residuals if x is not None]
    return (r[-1] / r[0]) ** (1.0 / (len(r) - 1))


def test_multilevel_factors_f_degrades_fcf_flat():
    """docs/theory.md §6 (Hessenthaler et al. 2020): BE, z = -0.05, m = 2, N_c = 64.
    F: 0.014 / 0.033 / 0.075 / 0.127, FCF: 0.011 / 0.026 / 0.036 / 0.036 for 2..5 levels."""
    prop = Dahlquist(-1.0, "be")
    t = uniform_grid(128, 128 * 0.05)
    ref = {"F": [0.014, 0.033, 0.075, 0.127], "FCF": [0.011, 0.026, 0.036, 0.036]}
    got = {}
    for relax in ("F", "FCF"):
        got[relax] = []
        for levels in (2, 3, 4, 5):
            res = mgrit.solve(prop, np.array(1.0), t, cf=2, max_levels=levels, relax=relax,
                              skip=False, tol=1e-10, initial_guess=0.0)
            assert res.converged and len(res.hierarchy) == levels
            got[relax].append(average_factor(res))
    F, FCF = got["F"], got["FCF"]
    # rough agreement with the published factors
    for name in ("F", "FCF"):
        for mine, theirs in zip(got[name], ref[name]):
            assert theirs / 1.5 <= mine <= theirs * 1.5, (name, got)
    # F-relaxation degrades with every added level ...
    assert all(b > a for a, b in zip(F, F[1:])), F
    assert F[3] > 4 * F[0]
    # ... FCF is never worse than F and levels off
    assert all(c <= f for c, f in zip(FCF, F))
    assert 0.8 <= FCF[3] / FCF[2] <= 1.25
    assert FCF[3] < 0.6 * F[3]


CASES = {
    "dahlquist": (Dahlquist(-1.0), np.array(1.0), uniform_grid(128, 128 * 0.05)),
    "heat": (Heat1D(17), Heat1D(17).initial(), uniform_grid(128, 1.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("levels", [2, 3, 4, 5])
@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_v_and_f_cycles_converge(case, levels, relax):
    prop, u0, t = CASES[case]
    ref = sequential(prop, u0, t)
    tol = 1e-10
    factors = {}
    for kind in ("V", "F"):
        res = mgrit.solve(prop, u0, t, cf=2, max_levels=levels, relax=relax, cycle=kind, tol=tol,
                          skip=False, initial_guess=0.0)
        assert len(res.hierarchy) == levels
        assert res.converged and res.status is mgrit.Status.CONVERGED
        r = res.residuals
        assert r[-1] <= tol < r[-2]
        assert all(b < a for a, b in zip(r, r[1:])), r
        # the error is bounded by the residual through the inverse of the unit-diagonal
        # lower bidiagonal system: at most N times the residual
        assert max_err(res.u, ref) <= (len(t) - 1) * r[-1] * scale(ref)
        factors[kind] = average_factor(res)
    # the F-cycle visits the coarse levels more: never slower per cycle
    assert factors["F"] <= factors["V"] * (1 + 1e-12)


def test_f_cycle_equals_v_cycle_on_two_levels():
    prop, u0, t = CASES["heat"]
    v = mgrit.solve(prop, u0, t, cf=4, max_levels=2, cycle="V", tol=None, max_iter=3)
    f = mgrit.solve(prop, u0, t, cf=4, max_levels=2, cycle="F", tol=None, max_iter=3)
    assert np.array_equal(v.u, f.u) and v.residuals == f.residuals and v.counts == f.counts


@pytest.mark.parametrize("cycle", ["V", "F"])
def test_fas_lorenz_multilevel_converges(cycle):
    """Nonlinear FAS: Lorenz over [0, 1] with 4 levels converges to sequential stepping."""
    prop, u0 = Lorenz(), np.array([1.0, 1.0, 1.0])
    t = uniform_grid(256, 1.0)
    ref = sequential(prop, u0, t)
    res = mgrit.solve(prop, u0, t, cf=2, max_levels=4, relax="FCF", cycle=cycle, tol=1e-9)
    assert res.converged
    assert max_err(res.u, ref) <= 1e-6 * scale(ref)
