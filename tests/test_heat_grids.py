"""Heat1D on non-uniform time grids: the same numbers as stepping one interval at a time,
work linear in the number of intervals (one factorization per distinct step size) and a
bounded factorization cache. Costs are counted, not timed."""
from __future__ import annotations

import numpy as np
import pytest

import mgrit
from propagators import Heat1D


def random_grid(n, seed=0):
    rng = np.random.default_rng(seed)
    t = np.concatenate(([0.0], np.cumsum(rng.uniform(0.5, 1.5, n))))
    return t / t[-1]


@pytest.mark.parametrize("n", [5, 64, 300])
def test_batched_step_on_a_non_uniform_grid_equals_single_steps_bitwise(n):
    heat = Heat1D(17)
    t = random_grid(n)
    t[1::3] = t[0:-1:3] + (t[1] - t[0])  # some repeated step sizes among distinct ones
    t = np.sort(t)
    U = np.random.default_rng(1).standard_normal((n, 15))
    out = heat.step_batch(U, t[:-1], t[1:])
    ref = np.array([Heat1D(17).step(U[k], float(t[k]), float(t[k + 1])) for k in range(n)])
    np.testing.assert_array_equal(out, ref)


def test_one_factorization_per_distinct_step_and_none_when_cached():
    heat = Heat1D(17)
    dts = np.array([0.1, 0.2, 0.1, 0.3, 0.2, 0.1] * 50)
    t0 = np.zeros(dts.size)
    heat.step_batch(np.ones((dts.size, 15)), t0, t0 + dts)
    assert heat.factorizations == 3
    heat.step_batch(np.ones((dts.size, 15)), t0, t0 + dts)
    assert heat.factorizations == 3


@pytest.mark.parametrize("n", [1000, 2000, 4000])
def test_work_is_linear_and_the_cache_bounded_on_a_grid_of_distinct_steps(n):
    """Every step distinct: n factorizations (not n per distinct step), at most cache_size kept."""
    heat = Heat1D(9, cache_size=16)
    t = random_grid(n)
    heat.step_batch(np.ones((n, 7)), t[:-1], t[1:])
    assert heat.factorizations == n
    assert len(heat._lu) == 16


def test_lru_keeps_the_recently_used_step_sizes():
    heat = Heat1D(9, cache_size=2)
    u = np.ones(7)
    for dt in (0.1, 0.2, 0.1, 0.3):  # 0.2 is the least recently used when 0.3 arrives
        heat.step(u, 0.0, dt)
    assert heat.factorizations == 3
    heat.step(u, 0.0, 0.1)
    assert heat.factorizations == 3
    heat.step(u, 0.0, 0.2)
    assert heat.factorizations == 4


def test_a_solve_on_a_non_uniform_grid_is_exact_and_factors_each_step_size_once():
    heat = Heat1D(17, cache_size=10_000)
    t = random_grid(256)
    res = mgrit.solve(heat, heat.initial(), t, cf=4, max_levels=3, tol=1e-11, max_iter=40)
    seq = Heat1D(17).initial()
    for k in range(256):
        seq = Heat1D.step(heat, seq, float(t[k]), float(t[k + 1]))
    assert np.abs(res.u[-1] - seq).max() < 1e-9
    distinct = {float(d) for lv in res.hierarchy for d in np.diff(lv.t)}
    assert heat.factorizations == len(distinct)  # once per step size, whatever the number of calls


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_cache_size_is_validated(bad):
    with pytest.raises(ValueError, match="cache_size"):
        Heat1D(9, cache_size=bad)


@pytest.mark.parametrize("forcing", [False, True])
def test_a_complex_state_is_the_real_problem_plus_i_times_the_unforced_one(forcing):
    """The operator and the forcing are real: a complex state ``x + i y`` steps to ``S(x) + i S0(y)``
    (``S0`` without the forcing), in ``step``, ``step_batch`` and a solve; the imaginary part is kept."""
    heat, free = Heat1D(9, forcing=forcing), Heat1D(9, forcing=False)
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((6, 7)), rng.standard_normal((6, 7))
    t = np.array([0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.9])  # non-uniform: rows grouped by step size
    Z = heat.step_batch(X + 1j * Y, t[:-1], t[1:])
    assert Z.dtype == np.complex128
    assert np.array_equal(Z.real, heat.step_batch(X, t[:-1], t[1:]))
    assert np.array_equal(Z.imag, free.step_batch(Y, t[:-1], t[1:]))
    for k in range(6):
        assert np.array_equal(heat.step(X[k] + 1j * Y[k], t[k], t[k + 1]), Z[k])
    grid = np.linspace(0.0, 1.0, 65)
    u0 = heat.initial()
    r = mgrit.solve(heat, (1 + 2j) * u0, grid, cf=4, tol=1e-12)
    re = mgrit.solve(heat, u0, grid, cf=4, tol=1e-12)
    im = mgrit.solve(free, 2 * u0, grid, cf=4, tol=1e-12)
    assert np.abs(r.u[-1].imag).max() > 1e-6
    assert np.allclose(r.u[-1].real, re.u[-1], rtol=0, atol=1e-12)
    assert np.allclose(r.u[-1].imag, im.u[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("nx", [3, 4])
def test_the_dense_step_of_tiny_grids_does_not_depend_on_the_batch(nx):
    """nx 3 and 4 solve densely: each right-hand side alone, so a row's result is the same bits in any
    batch (the same on any number of ranks) and equals ``step``."""
    heat = Heat1D(nx)
    U = np.random.default_rng(1).standard_normal((9, nx - 2))
    t0, t1 = np.linspace(0.0, 0.8, 9), np.linspace(0.1, 0.9, 9)
    whole = heat.step_batch(U, t0, t1)
    assert np.array_equal(heat.step_batch(U[5:9], t0[5:9], t1[5:9]), whole[5:9])
    for k in range(9):
        assert np.array_equal(heat.step(U[k], t0[k], t1[k]), whole[k])
