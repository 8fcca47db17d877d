"""Spatial coarsening between time levels (docs/theory.md §3, XBraid's SpatialCoarsen/Refine).

With spatial coarsening the fine problem is unchanged, so the FAS fixed point is
still fine-level sequential stepping; only the speed of convergence depends on
the coarse grids.
"""
from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import mgrit
from propagators import Heat1D, HeatTransfer, heat_hierarchy

from conftest import max_err, scale, sequential, uniform_grid


class Recording(mgrit.Propagator):
    """Wraps a propagator and records the state shapes it is asked to step."""

    def __init__(self, inner):
        self.inner = inner
        self.shapes = set()

    def step(self, u, t0, t1):
        self.shapes.add(tuple(u.shape))
        return self.inner.step(u, t0, t1)

    def step_batch(self, U, t0, t1):
        self.shapes.add(tuple(U.shape[1:]))
        return self.inner.step_batch(U, t0, t1)


class Identity(mgrit.SpatialTransfer):
    """No coarsening, written as a transfer: must change nothing at all."""

    def restrict(self, U):
        return U.copy()

    def interpolate(self, E):
        return E.copy()


def test_heat_hierarchy_shapes():
    props, transfers = heat_hierarchy(33, 4)
    assert [p.nx for p in props] == [33, 17, 9, 5]
    assert all(isinstance(tr, HeatTransfer) for tr in transfers)
    props, transfers = heat_hierarchy(33, 3, coarsen_from=2)
    assert [p.nx for p in props] == [33, 33, 17]
    assert transfers[0] is None and isinstance(transfers[1], HeatTransfer)


def test_heat_transfer_maps():
    """Injection of every other interior point; linear interpolation with zero boundaries,
    so interpolate-then-restrict is the identity and smooth functions are reproduced."""
    tr = HeatTransfer()
    coarse = np.random.default_rng(3).standard_normal((4, 7))
    fine = tr.interpolate(coarse)
    assert fine.shape == (4, 15)
    assert np.array_equal(tr.restrict(fine), coarse)
    x_f = np.linspace(0, 1, 17)[1:-1]
    x_c = np.linspace(0, 1, 9)[1:-1]
    line = lambda x: np.minimum(x, 1 - x)  # piecewise linear, kink on a coarse node
    np.testing.assert_allclose(tr.interpolate(line(x_c)[None])[0], line(x_f), atol=1e-15)


@pytest.mark.parametrize("levels", [2, 3, 4])
@pytest.mark.parametrize("cycle", ["V", "F"])
def test_spatial_coarsening_converges_to_fine_sequential(levels, cycle):
    nx, N = 33, 64
    props, transfers = heat_hierarchy(nx, levels)
    recorders = [Recording(p) for p in props]
    fine = props[0]
    t = uniform_grid(N, 1.0)
    ref = sequential(fine, fine.initial(), t)
    tol = 1e-9
    res = mgrit.solve(recorders, fine.initial(), t, cf=2, max_levels=levels, cycle=cycle,
                      spatial=transfers, tol=tol)
    assert res.converged and len(res.hierarchy) == levels
    assert res.residuals[-1] <= tol
    assert max_err(res.u, ref) <= N * tol * scale(ref)
    # every level really ran on its own spatial grid
    for rec, p in zip(recorders, props):
        assert rec.shapes == {(p.nx - 2,)}
    # and the fixed point is the fine problem, not the coarse ones
    assert max_err(sequential(props[1], props[1].initial(), t[::2]), ref[::2, 1::2]) > 1e-4


def test_identity_transfer_changes_nothing():
    prop = Heat1D(17)
    t = uniform_grid(64, 1.0)
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=3)
    plain = mgrit.solve(prop, prop.initial(), t, **kw)
    ident = mgrit.solve(prop, prop.initial(), t, spatial=Identity(), **kw)
    assert np.array_equal(plain.u, ident.u) and plain.residuals == ident.residuals


def test_spatial_coarsening_from_second_level():
    props, transfers = heat_hierarchy(33, 3, coarsen_from=2)
    t = uniform_grid(64, 1.0)
    ref = sequential(props[0], props[0].initial(), t)
    res = mgrit.solve(props, props[0].initial(), t, cf=4, max_levels=3, spatial=transfers, tol=1e-10)
    assert res.converged
    assert max_err(res.u, ref) <= 1e-7 * scale(ref)


def test_restrict_residual_hook_is_used():
    """A transfer whose residual restriction differs from state injection (full weighting)
    is called for the FAS right-hand side and still converges to the fine solution."""

    class FullWeighting(HeatTransfer):
        calls = 0

        def restrict_residual(self, R):
            FullWeighting.calls += 1
            return 0.25 * R[:, 0:-2:2] + 0.5 * R[:, 1:-1:2] + 0.25 * R[:, 2::2]

    props, _ = heat_hierarchy(33, 2)
    t = uniform_grid(64, 1.0)
    ref = sequential(props[0], props[0].initial(), t)
    res = mgrit.solve(props, props[0].initial(), t, cf=2, max_levels=2, spatial=FullWeighting(),
                      tol=1e-10)
    assert FullWeighting.calls == res.iterations - 1  # no residual in the skipped cycle
    assert res.converged and max_err(res.u, ref) <= 1e-7 * scale(ref)


# --------------------------------------------------------------------------- mismatched levels, from a review
T65 = uniform_grid(64, 1.0)


def test_more_levels_than_the_spatial_coarsening_allows_is_named():
    """heat_hierarchy(33, 3) with solve's default max_levels: the last transfer repeated down to states of 0
    points, and numpy's broadcast error came out of Heat1D."""
    props, transfers = heat_hierarchy(33, 3)
    with pytest.raises(ValueError, match=r"spatial transfer of level \d \(HeatTransfer.restrict\).*empty states.*"
                                         r"max_levels"):
        mgrit.solve(props, props[0].initial(), T65, spatial=transfers)
    ok = mgrit.solve(props, props[0].initial(), T65, cf=2, max_levels=3, spatial=transfers, tol=1e-10)
    assert ok.status.name == "CONVERGED"


@pytest.mark.parametrize("case", ["two propagators for three levels", "no transfers"])
def test_a_propagator_list_that_does_not_match_the_levels_names_the_level(case):
    props, transfers = heat_hierarchy(33, 3)
    args = (props[:2], dict(spatial=transfers)) if case.startswith("two") else (props, {})
    with pytest.raises(ValueError, match=r"Heat1D\(nx=\d+.*steps a state of \d+ interior values.*heat_hierarchy") \
            as info:
        mgrit.solve(args[0], props[0].initial(), T65, cf=4, max_levels=3, **args[1])
    notes = getattr(info.value, "__notes__", None)
    if sys.version_info >= (3, 11):  # (exception notes exist from Python 3.11 on; the solver adds one there)
        assert notes, "no note naming the level"
        assert any(re.search(r"mgrit: raised in the .* level 2 \(level 2: propagator Heat1D, states of shape", n)
                   for n in notes)


class BadTransfer(mgrit.SpatialTransfer):
    def __init__(self, restrict=None, interpolate=None):
        self.r, self.i = restrict, interpolate

    def restrict(self, U):
        return self.r(U) if self.r else np.ascontiguousarray(U[:, 1::2])

    def interpolate(self, E):
        return self.i(E) if self.i else HeatTransfer().interpolate(E)


@pytest.mark.parametrize("transfer, error, match", [
    (BadTransfer(restrict=lambda U: None), TypeError, r"level 0 \(BadTransfer.restrict\) returned NoneType"),
    (BadTransfer(restrict=lambda U: U[1:, 1::2]), ValueError, r"BadTransfer.restrict\) returned shape .* one row"),
    (BadTransfer(interpolate=lambda E: E), ValueError, r"BadTransfer.interpolate\) returned states of shape \(7,\); "
                                                        r"the states of level 0 have shape \(15,\)"),
    (BadTransfer(restrict=lambda U: "coarse"), TypeError, "returned str"),
])
def test_what_a_spatial_transfer_returns_is_checked(transfer, error, match):
    """A restrict returning None, a row short, or an interpolate of the wrong width gave TypeError / broadcast
    errors from inside the cycle that named neither the transfer nor the level."""
    fine, coarse = Heat1D(17), Heat1D(9)
    with pytest.raises(error, match=match):
        mgrit.solve([fine, coarse], fine.initial(), T65, cf=2, max_levels=2, spatial=transfer, skip=False)


def test_heat1d_names_a_state_of_another_size():
    heat = Heat1D(17)
    with pytest.raises(ValueError, match=r"Heat1D\(nx=17.*15 interior values.*got shape \(7,\)"):
        heat.step(np.zeros(7), 0.0, 0.1)
    with pytest.raises(ValueError, match=r"stack of states.*got shape \(15,\)"):
        heat.step_batch(np.zeros(15), np.zeros(1), np.ones(1))


def test_an_error_of_the_coarse_propagator_during_restriction_names_the_coarse_level():
    """The FAS restriction steps level l + 1's propagator; the note named only level l and its propagator."""
    class Coarse(mgrit.Propagator):
        def step(self, u, t0, t1):
            raise ArithmeticError("coarse step failed")

    fine = Heat1D(17)
    with pytest.raises(ArithmeticError, match="coarse step failed") as info:
        mgrit.solve([fine, Coarse()], fine.initial(), T65, cf=2, max_levels=2, spatial=HeatTransfer(), skip=False)
    notes = getattr(info.value, "__notes__", None)
    if sys.version_info >= (3, 11):  # (exception notes exist from Python 3.11 on; the solver adds one there)
        assert notes, "no note naming the level"
        assert any("from level 0 to 1" in n and "level 1: propagator Coarse, states of shape (7,)" in n
                   and "spatial transfer HeatTransfer to level 1" in n for n in notes), notes


class Broadcasting(mgrit.SpatialTransfer):
    """Averages to one value and prolongs it as an (n, 1) stack that broadcasts onto the fine states."""

    def restrict(self, U):
        return U.mean(1, keepdims=True)

    def interpolate(self, E):
        return E


def test_an_interpolation_that_broadcasts_onto_the_fine_states_is_accepted():
    class Decay(mgrit.Propagator):
        def step(self, u, t0, t1):
            return u / (1.0 + (t1 - t0))

    u0 = np.array([1.0, 2.0, 3.0, 4.0])
    res = mgrit.solve(Decay(), u0, uniform_grid(16, 1.0), cf=2, max_levels=2, spatial=Broadcasting(), tol=1e-12)
    assert res.status.name == "CONVERGED"
    assert max_err(res.u, sequential(Decay(), u0, uniform_grid(16, 1.0))) < 1e-12


class _Writes(HeatTransfer):
    """A heat transfer that writes into its input first (an "apply the boundary condition" step, a scaling)."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def restrict(self, U):
        if self.method == "restrict":
            U[:, 0] = 0.0
        return super().restrict(U)

    def restrict_residual(self, R):
        if self.method == "restrict_residual":
            R *= 0.5  # (the solver reads the residual norms from R afterwards: they would be halved)
        return super().restrict(R)


@pytest.mark.parametrize("method", ["restrict", "restrict_residual"])
def test_a_spatial_transfer_that_writes_into_its_input_is_named(method):
    """restrict gets a view of the fine C-points and restrict_residual the residuals whose norms the solve
    reports: a write into either stalled the solve at a residual of 6e-2 (restrict) or halved the reported
    residuals (restrict_residual), without a word."""
    props, _ = heat_hierarchy(33, 3)
    with pytest.raises(ValueError, match=rf"spatial transfer of level 0 \(_Writes.{method}\) changed its input "
                                         "in place"):
        mgrit.solve(props, props[0].initial(), T65, cf=2, max_levels=3, relax="FCF", spatial=_Writes(method),
                    tol=1e-12, max_iter=30, skip=False)


def _torch_cases():
    torch = pytest.importorskip("torch")
    from propagators.torch import FeatureMapTransfer

    class Numpy(FeatureMapTransfer):
        def restrict(self, U):
            return super().restrict(U).numpy()

    class Tracked(FeatureMapTransfer):
        scale = torch.ones(1, dtype=torch.float64, requires_grad=True)

        def interpolate(self, E):
            return super().interpolate(E) * self.scale

    class LosesAxis(FeatureMapTransfer):
        def interpolate(self, E):
            return super().interpolate(E)[:, 0]

    return torch, [(Numpy(), TypeError, r"level 0 \(Numpy.restrict\) returned numpy.ndarray for a stack of "
                                        "torch.Tensor"),
                   (Tracked(), ValueError, r"\(Tracked.interpolate\) returned a tensor that requires grad"),
                   (LosesAxis(), ValueError, r"\(LosesAxis.interpolate\) returned states of shape \(3, 4, 4\); the "
                                             r"states of level 1 have shape \(2, 3, 4, 4\)")]


@pytest.mark.parametrize("case", range(3))
def test_what_a_spatial_transfer_of_torch_states_returns_is_checked(case):
    """A numpy stack for torch states ran the coarse level in numpy until a torch error two levels down; a tracked
    interpolation was blamed on the propagator one step later; an interpolation that lost the batch axis passed
    the check (its rows broadcast) and failed in torch's in-place add."""
    torch, cases = _torch_cases()
    transfer, error, match = cases[case]

    class Decay(mgrit.Propagator):
        def step(self, u, t0, t1):
            return u / (1.0 + (t1 - t0))

    u0 = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(error, match=match):
        mgrit.solve(Decay(), u0, T65, cf=2, max_levels=3, relax="FCF", spatial=transfer, tol=1e-12, max_iter=25)
