"""The reference numpy propagators keep their contract under hostile use: step_batch equals step row by
row, parameters that cached work depends on stay fixed, bad states and parameters are clear errors."""
import numpy as np
import pytest

import mgrit
from propagators import AdvectionDiffusion1D, Brusselator, Dahlquist, Heat1D, Lorenz, VanDerPol


def _sequential(p, u0, t):
    u = u0
    for a, b in zip(t[:-1], t[1:]):
        u = p.step(u, float(a), float(b))
    return u


@pytest.mark.parametrize("xi", [np.array([-1.0, -2.0, -3.0]), np.array([-1.0 + 2j, -0.5, -4.0])])
@pytest.mark.parametrize("scheme", ["be", "fe"])
def test_dahlquist_with_an_array_xi_equals_sequential_stepping_on_many_levels(xi, scheme):
    # step_batch multiplied row k by xi[k]: a 3-entry state with batches of 3 rows converged to a wrong
    # answer (0.19 off) and other batch sizes raised a broadcasting error
    p = Dahlquist(xi, scheme)
    t = np.linspace(0.0, 0.5 if scheme == "fe" else 1.0, 65)
    u0 = np.array([1.0, 0.5, -2.0], dtype=np.result_type(xi, np.float64))
    res = mgrit.solve(p, u0, t, cf=4, tol=1e-13, max_iter=50)
    assert res.status is mgrit.Status.CONVERGED
    np.testing.assert_allclose(res.u[-1], _sequential(p, u0, t), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_dahlquist_step_batch_rows_equal_step_for_an_array_xi(n):
    p = Dahlquist(np.array([[-1.0], [-2.0]]))
    rng = np.random.default_rng(0)
    U, t0 = rng.standard_normal((n, 2, 3)), rng.random(n)
    t1 = t0 + rng.random(n)
    rows = np.stack([p.step(U[k], t0[k], t1[k]) for k in range(n)])
    np.testing.assert_array_equal(p.step_batch(U, t0, t1), rows)
    assert not np.allclose(rows[..., 0, :], rows[..., 1, :])  # the two xi entries really differ


def test_dahlquist_refuses_a_state_that_xi_does_not_broadcast_to():
    p = Dahlquist(np.array([-1.0, -2.0, -3.0]))
    with pytest.raises(ValueError, match=r"`xi` of shape \(3,\).*state's shape \(4,\)"):
        p.step(np.ones(4), 0.0, 1.0)
    with pytest.raises(ValueError, match=r"state's shape \(4,\)"):
        p.step_batch(np.ones((3, 4)), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match=r"state's shape \(\)"):  # xi would make a scalar state an array
        p.step(np.float64(1.0), 0.0, 1.0)


@pytest.mark.parametrize("name, value", [("a", 5.0), ("nx", 9), ("forcing", False), ("dx", 0.1)])
def test_heat_parameters_are_fixed_once_built(name, value):
    # changing `a` left the LU factorizations of step sizes already seen at the old `a`: one solve mixed
    # two problems (the steps 1.98 off a fresh Heat1D(17, a=5))
    h = Heat1D(17)
    h.step(h.initial(), 0.0, 0.1)
    with pytest.raises(AttributeError, match=f"`{name}` is fixed.*build a new Heat1D"):
        setattr(h, name, value)
    np.testing.assert_array_equal(h.step(h.initial(), 0.0, 0.1), Heat1D(17).step(h.initial(), 0.0, 0.1))
    h.cache_size = 3  # the cache's size may change: it holds nothing a step depends on
    assert h.cache_size == 3


@pytest.mark.parametrize("name", ["c", "nu", "nx", "scheme", "boundary"])
def test_advection_diffusion_parameters_are_fixed_once_built(name):
    p = AdvectionDiffusion1D(16, c=1.0, nu=0.01)
    with pytest.raises(AttributeError, match=f"`{name}` is fixed"):
        setattr(p, name, getattr(p, name))


@pytest.mark.parametrize("kwargs, match", [
    (dict(a=float("nan")), "`a` must be a finite number >= 0"),
    (dict(a=-1.0), "`a` must be a finite number >= 0"),
    (dict(a="1"), "`a` must be a finite number"),
    (dict(forcing="False"), "`forcing` must be True or False"),
    (dict(forcing=0), "`forcing` must be True or False"),
])
def test_heat_refuses_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Heat1D(17, **kwargs)


@pytest.mark.parametrize("xi", ["a", None, np.nan, np.inf, True, [1.0, "x"], object(), np.array([1.0, np.nan])])
def test_dahlquist_refuses_bad_xi(xi):
    # it was built, and a solve then raised numpy's ufunc error, or a DivergenceError blaming the levels
    with pytest.raises(ValueError, match="`xi` must be a finite real or complex number"):
        Dahlquist(xi)


@pytest.mark.parametrize("kwargs, match", [(dict(c=None), "`c` must be a finite number"),
                                           (dict(c="x"), "`c` must be a finite number"),
                                           (dict(c=np.nan), "`c` must be a finite number"),
                                           (dict(nu=-0.5), "`nu` must be a finite number >= 0"),
                                           (dict(nu="0.1"), "`nu` must be a finite number")])
def test_advection_diffusion_refuses_bad_coefficients(kwargs, match):
    # None and strings raised numpy's "ufunc 'isfinite' not supported"
    with pytest.raises(ValueError, match=match):
        AdvectionDiffusion1D(8, **kwargs)


@pytest.mark.parametrize("p, size", [
    (AdvectionDiffusion1D(16), 16), (AdvectionDiffusion1D(16, boundary="dirichlet"), 14),
    (Lorenz(), 3), (Brusselator(), 2), (VanDerPol(), 2),
])
def test_a_state_of_another_shape_is_a_clear_error(p, size):
    for bad in (np.ones(size + 2), np.ones(max(size - 2, 1)), np.float64(1.0), np.ones((2, size))):
        with pytest.raises(ValueError, match=rf"steps a state of shape \({size},\); got shape"):
            p.step(bad, 0.0, 0.1)
    with pytest.raises(ValueError, match=rf"steps a stack of states of shape \(n, {size}\); got shape"):
        p.step_batch(np.ones((3, size + 1)), np.zeros(3), np.full(3, 0.1))
    u = np.linspace(0.1, 0.9, size)
    np.testing.assert_array_equal(p.step_batch(u[None], np.zeros(1), np.full(1, 0.1))[0], p.step(u, 0.0, 0.1))


@pytest.mark.parametrize("kwargs", [dict(cf=np.array([2, 4])), dict(c_weight=np.array([1.0, 1.5])),
                                    dict(relax=np.array(["F", "FCF"]))])
def test_per_level_options_may_be_numpy_arrays(kwargs):
    # a 1-D array was "`cf` must be an integer >= 2 (or one per level)" although it gave one per level
    t = np.linspace(0.0, 1.0, 65)
    as_list = {k: v.tolist() for k, v in kwargs.items()}
    a = mgrit.solve(Dahlquist(-1.0), np.ones(1), t, tol=1e-12, **kwargs)
    b = mgrit.solve(Dahlquist(-1.0), np.ones(1), t, tol=1e-12, **as_list)
    assert a.residuals == b.residuals and a.iterations == b.iterations
    assert [lv.cf for lv in a.hierarchy] == [lv.cf for lv in b.hierarchy]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_divergence_advice_names_fewer_levels_first():
    # an explicit coarse step that is unstable is the usual cause; the advice (smaller steps, FCF, smaller cf)
    # did not help Van der Pol with the default levels, fewer levels did
    p, t = VanDerPol(mu=1.0), np.linspace(0.0, 10.0, 4097)
    with pytest.raises(mgrit.DivergenceError, match=r"fewer levels \(`max_levels`.*choose_settings"):
        mgrit.solve(p, np.array([2.0, 0.0]), t, cf=4)
    res = mgrit.solve(p, np.array([2.0, 0.0]), t, cf=4, max_levels=3)
    assert res.status is mgrit.Status.CONVERGED


def test_parameters_may_be_set_until_the_propagator_is_built():
    # the first version refused a subclass that sets a parameter before super().__init__(), an __init__ called
    # again to rebuild, and a subclass adjusting `x` (read only while building)
    class Scaled(Heat1D):
        def __init__(self, nx):
            self.a = 2.0
            super().__init__(nx, a=self.a)
            self.x = self.x * 1.0

    h = Scaled(17)
    assert h.a == 2.0
    h.step(h.initial(), 0.0, 0.1)
    Heat1D.__init__(h, 17)  # rebuilt: a fresh cache, the new value
    assert h.a == 1.0 and len(h._lu) == 0
    np.testing.assert_array_equal(h.step(h.initial(), 0.0, 0.1), Heat1D(17).step(h.initial(), 0.0, 0.1))
    with pytest.raises(AttributeError, match="`a` is fixed"):
        h.a = 3.0


@pytest.mark.parametrize("a", [np.array(2.0), np.float32(2.0), np.int64(2), __import__("fractions").Fraction(1, 2)])
def test_heat_takes_any_real_scalar_for_a(a):
    # a 0-d array or a Fraction was "`a` must be a finite number >= 0" in the first version
    assert Heat1D(17, a=a).a == float(a)


# From a hostile review of the reference propagators and Result
@pytest.mark.parametrize("build", [lambda: Lorenz(sigma=np.nan), lambda: Lorenz(rho=True), lambda: Lorenz(beta="x"),
                                   lambda: Brusselator(a=1j), lambda: Brusselator(b=np.inf),
                                   lambda: VanDerPol(mu=True), lambda: VanDerPol(mu=1j), lambda: VanDerPol(mu="3"),
                                   lambda: VanDerPol(mu=None), lambda: VanDerPol(mu=np.ones(2))])
def test_nonlinear_coefficients_must_be_finite_real_numbers(build):
    """They were taken: NaN stepped to NaN states, a complex coefficient made real states complex, a string or
    an array failed later inside numpy."""
    with pytest.raises(ValueError, match="must be a finite number"):
        build()


def test_lorenz_steps_a_list_and_heat_hierarchy_checks_its_arguments():
    from propagators.heat import heat_hierarchy

    np.testing.assert_array_equal(Lorenz().step([1.0, 1.0, 1.0], 0.0, 0.01),
                                  Lorenz().step(np.ones(3), 0.0, 0.01))
    for kwargs, name in (({"n_levels": 0}, "n_levels"), ({"n_levels": 3, "coarsen_from": -5}, "coarsen_from"),
                         ({"n_levels": 3, "min_nx": -1}, "min_nx")):
        with pytest.raises(ValueError, match=f"`{name}`"):
            heat_hierarchy(9, **kwargs)


def test_heat_interpolation_of_integer_corrections_and_a_lowered_cache():
    from propagators.heat import HeatTransfer

    np.testing.assert_array_equal(HeatTransfer().interpolate(np.array([[1, 3]])), [[0.5, 1, 2, 3, 1.5]])
    heat = Heat1D(9)
    u = np.ones(7)
    for k in range(10):
        heat.step(u, 0.0, 0.01 * (k + 1))
    heat.cache_size = 2
    heat.step(u, 0.0, 0.5)
    assert len(heat._lu) == 2  # (one entry was dropped per miss: 10 stayed)


def test_heat_cache_is_safe_for_threads():
    """Threads stepping one propagator with a small cache raised KeyError: another thread evicted the entry
    between the lookup and marking it used. The race, made certain: the entry is gone when it is marked."""
    from collections import OrderedDict

    class Racing(OrderedDict):
        def move_to_end(self, key, last=True):
            self.pop(key, None)  # (another thread's eviction, just before)
            super().move_to_end(key, last)

    for prop, u in ((Heat1D(9, cache_size=2), np.ones(7)), (AdvectionDiffusion1D(8, boundary="dirichlet",
                                                                                cache_size=2), np.ones(6))):
        prop.step(u, 0.0, 0.01)
        object.__setattr__(prop, "_lu", Racing(prop._lu))
        ref = prop.step(u, 0.0, 0.01)  # (a hit whose entry vanishes: still the same step)
        np.testing.assert_array_equal(ref, prop.step(u, 0.0, 0.01))


def test_a_singular_periodic_advection_step_is_an_error():
    """nu = 0 and a reversed step dt = -1/16 on 8 points make I - dt A singular: a finite wrong state came back
    (its residual 0.5), where the Dirichlet boundary's factorization raises."""
    p = AdvectionDiffusion1D(8, c=1.0, nu=0.0)
    with pytest.raises(np.linalg.LinAlgError, match="singular"):
        p.step(np.linspace(0.0, 1.0, p.size), 0.0, -1.0 / 16)


@pytest.mark.parametrize("root", [-1, 2, True, 1.0, "0"])
def test_gather_checks_its_root(root):
    """root=-1 lost the trajectory on every rank (None everywhere); root=True was rank 1."""
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 1, 9), cf=2, max_levels=2)
    with pytest.raises(ValueError, match="`root` must be a rank"):
        mgrit.gather(res, root=root)


def test_review_of_the_checks_above():
    """A review of the checks above: Lorenz and Brusselator returned numpy from `step` for torch states (their
    solves failed), every dataclass field was taken for a coefficient (a subclass's callable field, per-row
    array coefficients), the singular-step threshold missed a singular step on 256 points (the eigenvalues carry
    the rounding of the largest) and refused a valid one on 8."""
    import dataclasses
    from typing import Callable

    import torch

    for prop, u in ((Lorenz(), torch.ones(3, dtype=torch.float64)), (Brusselator(), torch.ones(2, dtype=torch.float64))):
        assert isinstance(prop.step(u, 0.0, 0.01), torch.Tensor)
        res = mgrit.solve(prop, u, np.linspace(0, 0.1, 17), cf=2, max_levels=2, tol=1e-10)
        assert isinstance(res.u, torch.Tensor)

    @dataclasses.dataclass(frozen=True)
    class Forced(Lorenz):
        forcing: Callable = print

    Forced()
    rows = Lorenz(rho=np.array([28.0, 20.0])).step_batch(np.ones((2, 3)), np.zeros(2), np.full(2, 0.01))
    np.testing.assert_array_equal(rows[0], Lorenz().step(np.ones(3), 0.0, 0.01))
    p = AdvectionDiffusion1D(256, c=0.0, nu=1.0, scheme="central")
    lam = p.generator_eigenvalues()
    with pytest.raises(np.linalg.LinAlgError, match="singular"):
        p.step(np.random.default_rng(0).standard_normal(p.size), 0.0, float(1.0 / np.sort(lam.real)[-2]))
    q = AdvectionDiffusion1D(8, c=1.0, nu=0.0, scheme="upwind")
    np.testing.assert_allclose(q.step(np.ones(q.size), 0.0, -q.dx / 2 * (1 + 1e-14)), np.ones(q.size))


def test_van_der_pol_steps_torch_states_in_torch_and_an_array_xi_dahlquist_is_hashable():
    """VanDerPol returned numpy arrays for torch states (its solves failed at the first sequential solve, as
    Lorenz's did before the test above); a Dahlquist with an array xi could not be hashed, and == raised
    numpy's 'truth value of an array is ambiguous'."""
    import torch

    p = VanDerPol(mu=2.0)
    for dtype in (torch.float64, torch.float32):
        u = torch.tensor([2.0, 0.5], dtype=dtype)
        out = p.step(u, 0.0, 0.1)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        np.testing.assert_allclose(out.numpy(), p.step(u.numpy(), 0.0, 0.1), rtol=1e-6 if dtype == torch.float32 else 1e-15)
    u0 = torch.tensor([2.0, 0.5], dtype=torch.float64)
    res = mgrit.solve(p, u0, np.linspace(0, 1, 33), cf=4, tol=1e-12)
    assert isinstance(res.u, torch.Tensor)
    np.testing.assert_allclose(res.u.numpy(), mgrit.solve(p, u0.numpy(), np.linspace(0, 1, 33), cf=4, tol=1e-12).u,
                               rtol=0, atol=1e-13)

    d = Dahlquist(np.array([-1.0, -2.0]))
    assert d == Dahlquist(np.array([-1.0, -2.0])) and hash(d) == hash(Dahlquist(np.array([-1.0, -2.0])))
    assert d != Dahlquist(np.array([-1.0, -3.0])) and d != Dahlquist(np.array([[-1.0, -2.0]]))
    assert d != Dahlquist(np.array([-1.0, -2.0]), "fe")
    assert Dahlquist(-1) == Dahlquist(-1.0) and len({Dahlquist(-1.0), Dahlquist(-1), d}) == 2
