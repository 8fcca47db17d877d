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


@pytest.mark.parametrize("relax,kind,nested,levels", [("FCF", "V", False, 3), ("F", "V", True, 4),
                                                      ("FCF", "F", True, 4), ("F", "F", False, 2)])
def test_cycle_end_residual_is_the_residual_of_the_returned_solution(relax, kind, nested, levels):
    heat = Heat1D(17)
    t = np.linspace(0, 1, 129)
    full = mgrit.solve(heat, heat.initial(), t, cf=2, max_levels=levels, relax=relax, cycle=kind, nested=nested,
                       residual="cycle_end", tol=None, max_iter=4)
    assert None not in full.residuals
    for k in range(1, 5):
        part = mgrit.solve(heat, heat.initial(), t, cf=2, max_levels=levels, relax=relax, cycle=kind,
                           nested=nested, residual="cycle_end", tol=None, max_iter=k, final_residual=True)
        assert part.residuals == full.residuals[:k]
        assert part.final_residual == pytest.approx(full.residuals[k - 1], rel=1e-12, abs=0.0)


@pytest.mark.parametrize("relax", ["F", "FCF", "FCFCF"])
def test_cycle_end_measurement_does_not_change_the_iterates(relax):
    # Only where the residual is measured changes: the iterates are the same bits.
    p, t = Dahlquist(-3.0), np.linspace(0, 2, 65)
    for k in (1, 2, 3):
        a = mgrit.solve(p, np.ones(2), t, cf=4, max_levels=3, relax=relax, tol=None, max_iter=k, skip=False)
        b = mgrit.solve(p, np.ones(2), t, cf=4, max_levels=3, relax=relax, tol=None, max_iter=k, skip=False,
                        residual="cycle_end")
        np.testing.assert_array_equal(a.u, b.u)
        # with F-relaxation, XBraid's residual of cycle k + 1 is measured on the same
        # iterate as the cycle-end residual of cycle k
        if relax == "F":
            c = mgrit.solve(p, np.ones(2), t, cf=4, max_levels=3, relax=relax, tol=None, max_iter=k + 1,
                            skip=False)
            assert c.residuals[k] == pytest.approx(b.residuals[k - 1], rel=1e-13, abs=0.0)


def test_cycle_end_needs_no_more_cycles_than_xbraid_and_rejects_unknown():
    heat = Heat1D(33)
    t = np.linspace(0, 2, 513)
    a = mgrit.solve(heat, heat.initial(), t, cf=4, max_levels=4, tol=1e-10, nested=True)
    b = mgrit.solve(heat, heat.initial(), t, cf=4, max_levels=4, tol=1e-10, nested=True, residual="cycle_end")
    assert b.converged and b.iterations <= a.iterations
    with pytest.raises(ValueError, match="`residual`"):
        mgrit.solve(heat, heat.initial(), t, residual="after")


def test_an_unstable_coarse_step_is_shown_by_the_residual_of_the_returned_states():
    """MGRIT needs a stable coarse step. Forward Euler on u' = -10u, dt 0.05, cf 8 has the coarse factor
    1 + 8(-0.5) = -3: started from the exact trajectory, the residual measured before the last coarse
    correction (XBraid's) is 0 and the solve reports CONVERGED, while that correction amplifies the rounding
    of the coarse right-hand side about 3^64 times. The residual of the returned states (final_residual,
    or residual="cycle_end", which then never converges) is the one that shows it, as README's Options say."""
    prop, t, u0 = Dahlquist(-10.0, "fe"), np.linspace(0.0, 25.6, 513), np.array([1.0])
    exact = sequential(prop, u0, t)
    res = mgrit.solve(prop, u0, t, cf=8, max_levels=2, initial_guess=exact, skip=False, tol=1e-9,
                      final_residual=True)
    assert res.status is mgrit.Status.CONVERGED and res.residuals == [0.0]
    err = np.abs(res.u - exact).max()
    assert err > 1e6 and res.final_residual > 1e6
    end = mgrit.solve(prop, u0, t, cf=8, max_levels=2, initial_guess=exact, skip=False, tol=1e-9,
                      residual="cycle_end", max_iter=3)
    assert end.status is not mgrit.Status.CONVERGED
    # from the default start, a relative tolerance is relative to a first residual the unstable coarse
    # solve has inflated: CONVERGED far off, and the returned states' residual shows it
    rel = mgrit.solve(prop, u0, t, cf=8, max_levels=2, tol=1e-6, tol_type="rel", final_residual=True)
    assert rel.status is mgrit.Status.CONVERGED and rel.residuals[1] > 1e20
    assert np.abs(rel.u - exact).max() > 1e6 and rel.final_residual > 1e6
