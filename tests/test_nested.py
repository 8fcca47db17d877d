"""Nested iteration (full multigrid start): exact fixed point, fewer cycles, what it computes."""
import numpy as np
import pytest

import mgrit
from propagators import Dahlquist, Heat1D


def sequential(prop, u0, t):
    u = [np.asarray(u0, dtype=float)]
    for a, b in zip(t[:-1], t[1:]):
        u.append(prop.step(u[-1], a, b))
    return np.array(u)


@pytest.mark.parametrize("kind", ["V", "F"])
@pytest.mark.parametrize("levels", [2, 3, 4])
def test_nested_converges_to_sequential_with_no_more_cycles_than_skip(kind, levels):
    heat = Heat1D(17)
    t = np.linspace(0, 1, 257)
    exact = sequential(heat, heat.initial(), t)
    skip = mgrit.solve(heat, heat.initial(), t, cf=4, max_levels=levels, cycle=kind, tol=1e-10)
    nested = mgrit.solve(heat, heat.initial(), t, cf=4, max_levels=levels, cycle=kind, tol=1e-10, nested=True)
    assert nested.converged and np.abs(nested.u - exact).max() < 1e-8
    assert nested.iterations <= skip.iterations
    assert nested.residuals[0] is not None  # the first cycle relaxes and measures


def test_nested_two_levels_is_skip_plus_one_relaxed_cycle():
    # On two levels the nested start is exactly XBraid's skipped first cycle.
    p, t = Dahlquist(-2.0), np.linspace(0, 2, 33)
    a = mgrit.solve(p, np.ones(1), t, cf=2, max_levels=2, tol=None, max_iter=3, nested=True)
    b = mgrit.solve(p, np.ones(1), t, cf=2, max_levels=2, tol=None, max_iter=4, skip=True)
    np.testing.assert_array_equal(a.u, b.u)
    assert a.residuals == b.residuals[1:]
