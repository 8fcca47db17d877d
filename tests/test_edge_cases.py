"""Core edge cases: odd dtypes, wrong return types, autograd inputs, divergence
without NaN, interrupts during validation and bools passed as integers."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import mgrit
from propagators import Dahlquist

from conftest import max_err, sequential, uniform_grid

torch = pytest.importorskip("torch")

T = uniform_grid(16, 2.0)


class Decay(mgrit.Propagator):
    """Backward Euler for ``u' = -u``; works on numpy arrays and tensors alike."""

    def step(self, u, t0, t1):
        return u / (1.0 + (t1 - t0))


class BadBatch(Decay):
    """A correct ``step`` and a ``step_batch`` that returns ``make(U)``."""

    def __init__(self, make):
        self.make = make

    def step_batch(self, U, t0, t1):
        return self.make(U)


class BadStep(mgrit.Propagator):
    """A ``step`` that returns ``make(u)``."""

    def __init__(self, make):
        self.make = make

    def step(self, u, t0, t1):
        return self.make(u)


class Rotate(mgrit.Propagator):
    """Decay with a rotation: complex states even for a real input."""

    def step(self, u, t0, t1):
        return u * (1.0 + 0.1j) / (1.0 + (t1 - t0))


# --------------------------------------------------------------------------- a. integer torch u0
@pytest.mark.parametrize("u0", [torch.tensor([2, 4]), torch.tensor([True, False])])
def test_integer_torch_u0_is_converted_to_the_default_float_dtype(u0):
    res = mgrit.solve(Decay(), u0, T, cf=2, tol=1e-6)
    as_float = u0.to(torch.get_default_dtype())
    ref = sequential(Decay(), as_float, T)
    assert res.u.dtype == torch.get_default_dtype()
    assert res.converged and max_err(res.u, ref) < 1e-5
    assert float(res.u[-1, 0]) > 0.0  # decayed, not truncated to an integer


# --------------------------------------------------------------------------- b. complex for real
@pytest.mark.parametrize("kw", [dict(max_levels=1), dict(skip=False, relax="F"), dict()])
def test_complex_states_for_a_real_u0_are_rejected(kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ComplexWarning either
        with pytest.raises(TypeError, match=r"level \d.*complex states for a real `u0`.*astype\(complex\)"):
            mgrit.solve(Rotate(), np.array([1.0, 2.0]), T, cf=2, **kw)


def test_complex_states_for_a_real_torch_u0_are_rejected():
    with pytest.raises(TypeError, match=r"level 0.*complex states for a real `u0`"):
        mgrit.solve(Rotate(), torch.tensor([1.0, 2.0]), T, cf=2, skip=False)


def test_complex_u0_with_a_complex_propagator_still_works():
    u0 = np.array([1.0, 2.0]).astype(complex)
    res = mgrit.solve(Rotate(), u0, T, cf=2, tol=1e-12)
    assert res.converged and max_err(res.u, sequential(Rotate(), u0, T)) < 1e-12


# --------------------------------------------------------------------------- c. wrong return types
@pytest.mark.parametrize("make", [
    lambda U: None,
    lambda U: [row for row in U],
    lambda U: U.numpy().copy(),
], ids=["None", "list", "numpy"])
def test_step_batch_returning_no_tensor_for_torch_states(make):
    with pytest.raises(TypeError, match=r"level 0.*step_batch.*torch"):
        mgrit.solve(BadBatch(make), torch.tensor([1.0, 2.0]), T, cf=2, skip=False)


@pytest.mark.parametrize("make", [
    lambda U: None,
    lambda U: [row for row in U],
    lambda U: torch.from_numpy(U.copy()),
], ids=["None", "list", "tensor"])
def test_step_batch_returning_no_numpy_array_for_numpy_states(make):
    with pytest.raises(TypeError, match=r"level 0.*step_batch.*numpy"):
        mgrit.solve(BadBatch(make), np.array([1.0, 2.0]), T, cf=2, skip=False)


@pytest.mark.parametrize("u0,make,kind", [
    (torch.tensor([1.0, 2.0]), lambda u: u.numpy() / 2, "torch"),
    (torch.tensor([1.0, 2.0]), lambda u: None, "torch"),
    (np.array([1.0, 2.0]), lambda u: None, "numpy"),
    (np.array([1.0, 2.0]), lambda u: torch.from_numpy(u / 2), "numpy"),
], ids=["numpy-for-torch", "None-for-torch", "None-for-numpy", "torch-for-numpy"])
def test_step_returning_the_wrong_type_in_sequential_stepping(u0, make, kind):
    with pytest.raises(TypeError, match=rf"level 0.*`step`.*{kind}"):
        mgrit.solve(BadStep(make), u0, T, max_levels=1)


def test_default_step_batch_reports_a_step_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"level 0.*torch"):
        mgrit.solve(BadStep(lambda u: u.numpy() / 2), torch.tensor([1.0, 2.0]), T, cf=2, skip=False)


# --------------------------------------------------------------------------- d. autograd inputs
def test_u0_that_requires_grad_is_rejected():
    u0 = torch.tensor([1.0, 2.0], requires_grad=True)
    with pytest.raises(ValueError, match=r"`u0` requires grad.*u0\.detach\(\).*LayerParallel"):
        mgrit.solve(Decay(), u0, T, cf=2)
    res = mgrit.solve(Decay(), u0.detach(), T, cf=2)  # what the message suggests works
    assert res.converged


@pytest.mark.parametrize("guess", [
    lambda: torch.full((17, 2), 0.5, requires_grad=True),
    lambda: torch.full((2,), 0.5, requires_grad=True),
], ids=["trajectory", "state"])
def test_initial_guess_that_requires_grad_is_rejected(guess):
    with pytest.raises(ValueError, match=r"`initial_guess` requires grad.*detach\(\)"):
        mgrit.solve(Decay(), torch.tensor([1.0, 2.0]), T, cf=2, initial_guess=guess())


def test_callable_initial_guess_returning_grad_tensors_is_rejected():
    w = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(ValueError, match=r"`initial_guess` requires grad"):
        mgrit.solve(Decay(), torch.tensor([1.0, 2.0]), T, cf=2, initial_guess=lambda t: w * torch.ones(2))


# --------------------------------------------------------------------------- e. divergence
def unstable_solve(**kw):
    """Forward Euler ``u' = -u`` with ``h = 0.25`` (stable, lambda = 0.75) and
    ``cf = 16``: the coarse step multiplies by ``mu = 1 - 16 * 0.25 = -3``."""
    t = uniform_grid(512, 128.0)
    args = dict(cf=16, max_levels=2, relax="F", tol=1e-10, max_iter=6)
    args.update(kw)
    return mgrit.solve(Dahlquist(-1.0, "fe"), np.array(1.0), t, **args)


def test_growing_residual_is_reported_as_divergence():
    assert abs(1 + 16 * -0.25) > 1  # the coarse propagator is unstable
    with pytest.warns(RuntimeWarning, match="diverged"):
        res = unstable_solve()
    r = [x for x in res.residuals if x is not None]
    assert all(np.isfinite(r)) and r[-1] > 1e3 * r[0]
    assert res.status is mgrit.Status.DIVERGED and not res.converged
    for hint in ("FCF", "`cf`", "`max_levels`", "`min_coarse`", "unstable", "choose_settings"):
        assert hint in mgrit.Status.DIVERGED.value
    assert "diverged" in str(res)


def test_divergence_is_also_reported_without_a_tolerance():
    with pytest.warns(RuntimeWarning, match="diverged"):
        res = unstable_solve(tol=None)
    assert res.status is mgrit.Status.DIVERGED


def test_slow_convergence_is_not_divergence():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = mgrit.solve(Dahlquist(-1.0), np.array(1.0), uniform_grid(64, 3.2), relax="F",
                          tol=1e-300, max_iter=3, skip=False)
    assert res.status is mgrit.Status.MAX_ITER


def test_zero_first_residual_is_not_divergence():
    """Started from the exact solution the residuals are rounding noise around 0."""
    prop, t = Dahlquist(-1.0), uniform_grid(64, 3.2)
    exact = sequential(prop, np.array(1.0), t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = mgrit.solve(prop, np.array(1.0), t, tol=None, max_iter=3, initial_guess=exact)
    assert res.status is mgrit.Status.MAX_ITER


# --------------------------------------------------------------------------- f. interrupts
class Recording(mgrit.SerialComm):
    """A one-rank communicator that records what ``open`` was told."""

    def __init__(self):
        self.opened = []

    def open(self, failure=None, signature=None):
        self.opened.append(failure)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_during_validation_still_reaches_the_handshake(exc):
    def guess(t):
        raise exc()

    comm = Recording()
    with pytest.raises(exc):
        mgrit.solve(Decay(), np.array([1.0]), T, initial_guess=guess, comm=comm)
    assert len(comm.opened) == 1 and isinstance(comm.opened[0], exc)


def test_a_communicator_written_before_share_still_opens_sessions():
    """``open(failure, signature)`` without ``share``: sessions without a share still work
    (``shared`` is what that ``open`` returned); one with a share needs the keyword."""
    comm = Recording()
    s = comm.session(signature=7)
    with s as c:
        assert c is comm and s.shared is None
    assert comm.opened == [None]
    with pytest.raises(TypeError, match="share"):
        with comm.session(share=1):
            pass
    s = mgrit.SerialComm().session(share={"a": 1})
    with s:
        assert s.shared == [{"a": 1}]


# --------------------------------------------------------------------------- g. bools as integers
@pytest.mark.parametrize("name,value", [
    ("max_levels", True), ("min_coarse", True), ("cf", True), ("cf", [2, True]),
    ("max_iter", True), ("max_levels", np.True_),
])
def test_bool_is_not_an_integer_option(name, value):
    with pytest.raises(ValueError, match=rf"`{name}`.*bool"):
        mgrit.solve(Decay(), np.array([1.0]), T, **{name: value})


@pytest.mark.parametrize("name", ["max_levels", "min_coarse", "cf"])
def test_build_hierarchy_rejects_bools(name):
    with pytest.raises(ValueError, match=rf"`{name}`"):
        mgrit.build_hierarchy(T, **{name: True})


@pytest.mark.parametrize("scale", [2.0**664, 2.0**-664])
def test_huge_and_tiny_states_with_default_norms(scale):
    """The default spatial norm does not over- or underflow: a solve at states ~1e200
    (or ~1e-200) reports the residuals of the unit-scale solve times the scale (a power
    of two, so that every operation scales exactly)."""
    import warnings

    from propagators import Dahlquist

    t = np.linspace(0.0, 1.0, 65)
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=4, skip=False)
    unit = mgrit.solve(Dahlquist(-1.0), np.array([1.0, 2.0]), t, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big = mgrit.solve(Dahlquist(-1.0), np.array([1.0, 2.0]) * scale, t, **kw)
    assert big.status is mgrit.Status.MAX_ITER
    for r_big, r_unit in zip(big.residuals, unit.residuals):
        assert r_big == pytest.approx(r_unit * scale, rel=1e-14, abs=0.0)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "2"])
def test_the_rk4_systems_reject_a_substep_count_below_one_or_not_an_integer(bad):
    """Lorenz and Brusselator with ``substeps <= 0`` used to step as the identity (a loop that never
    runs); they reject it as VanDerPol does."""
    from propagators import Brusselator, Lorenz

    for cls in (Lorenz, Brusselator):
        with pytest.raises(ValueError, match="`substeps` must be an integer >= 1"):
            cls(substeps=bad)
    assert np.allclose(Lorenz(substeps=np.int64(2)).step(np.ones(3), 0.0, 0.01),
                       Lorenz(substeps=2).step(np.ones(3), 0.0, 0.01), rtol=0, atol=0)


@pytest.mark.parametrize("u0", [np.ones(0), np.ones((3, 0))])
def test_an_empty_state_is_named(u0):
    from mgrit import tune

    t = uniform_grid(8, 1.0)
    with pytest.raises(ValueError, match="`u0` is empty"):
        mgrit.solve(Dahlquist(-1.0), u0, t)
    with pytest.raises(ValueError, match="`u0` is empty"):
        tune.choose_settings(Dahlquist(-1.0), u0, t, measure=False)


@pytest.mark.parametrize("guess", [1j, np.full(9, 1j), lambda t: np.array([1j])])
def test_a_complex_initial_guess_for_a_real_u0_is_refused_not_truncated(guess):
    """numpy dropped the imaginary part with a ComplexWarning (an error under -W error)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="complex"):
            mgrit.solve(Dahlquist(-1.0), np.ones(1), uniform_grid(8, 1.0), initial_guess=guess)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("form", ["scalar", "state", "trajectory"])
def test_a_numpy_initial_guess_for_torch_states_equals_the_same_guess_as_tensors(dtype, form):
    """A numpy (or Python complex) guess for a torch ``u0`` raised TypeError ("only length-1 arrays",
    "float() argument ... not 'complex'", "can't assign a numpy.ndarray"); it is the same iterate as the
    tensor guess."""
    rng = np.random.default_rng(3)
    complex_ = dtype == torch.complex128
    shape = {"scalar": (), "state": (3,), "trajectory": (len(T), 3)}[form]
    g = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if complex_ else 0.0)
    g_np = complex(g) if form == "scalar" and complex_ else g
    u0 = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=1)
    got = mgrit.solve(Decay(), u0, T, initial_guess=g_np, **kw)
    want = mgrit.solve(Decay(), u0, T, initial_guess=torch.as_tensor(g, dtype=dtype), **kw)
    assert got.u.dtype == dtype and torch.equal(got.u, want.u)
    assert not torch.equal(got.u[1:], mgrit.solve(Decay(), u0, T, **kw).u[1:])  # the guess mattered


@pytest.mark.parametrize("u0, guess", [
    (np.array([1.0 + 1.0j, -0.5j]), lambda t: np.zeros(2)),  # the imaginary part of u0 was dropped: error 1.0
    (np.array([0.1, 0.2]), lambda t: np.full(2, 0.3, np.float32)),  # the solve ran in float32: stalled
    (np.array([0.1, 0.2]), lambda t: torch.full((2,), 0.3, dtype=torch.float64)),  # TypeError
    (torch.tensor([0.1, 0.2], dtype=torch.float64), lambda t: np.full(2, 0.3)),  # numpy result
    (torch.tensor([0.1j, 0.2], dtype=torch.complex128), lambda t: torch.full((2,), 0.3, dtype=torch.float64)),
])
def test_a_callable_initial_guess_is_stored_as_u0(u0, guess):
    """A callable's states took their own array type and dtype: the whole solve ran in them. Now they are
    stored as u0 (library, dtype), and the solve converges to sequential stepping as with an array guess."""
    got = mgrit.solve(Decay(), u0, T, cf=2, tol=1e-12, initial_guess=guess)
    assert type(got.u) is type(u0) and got.u.dtype == u0.dtype and got.status.name == "CONVERGED"
    ref = sequential(Decay(), u0, T)
    assert max_err(got.u, ref) < 1e-12


@pytest.mark.parametrize("tol", [np.float32(1e-3), np.float64(1e-9), np.int64(0)])
def test_a_numpy_scalar_tolerance_is_a_tolerance(tol):
    t = uniform_grid(64, 1.0)
    a = mgrit.solve(Dahlquist(-1.0), np.ones(1), t, tol=tol)
    b = mgrit.solve(Dahlquist(-1.0), np.ones(1), t, tol=float(tol))
    assert a.iterations == b.iterations and np.array_equal(a.u, b.u)
    for bad in (np.bool_(True), np.float64(-1.0), np.float64("nan")):
        with pytest.raises(ValueError, match="`tol` must be a number"):
            mgrit.solve(Dahlquist(-1.0), np.ones(1), t, tol=bad)


def test_tuning_a_long_double_state_is_a_clear_error_and_tiny_dirichlet_grids_are_refused():
    from mgrit import tune
    from propagators import AdvectionDiffusion1D

    with pytest.raises(TypeError, match="numpy.linalg"):
        tune.choose_settings(Dahlquist(-1.0), np.ones(1, np.longdouble), uniform_grid(64, 1.0), measure=False)
    with pytest.raises(ValueError, match="`nx` must be an integer >= 5"):
        AdvectionDiffusion1D(4, boundary="dirichlet")
    p = AdvectionDiffusion1D(5, boundary="dirichlet")
    A = np.eye(3) - 0.1 * p.matrix()
    assert np.allclose(A @ p.step(np.ones(3), 0.0, 0.1), np.ones(3), rtol=0, atol=1e-14)


class Wider(mgrit.Propagator):
    """A step computed and returned in float64 whatever the state's dtype (as a float64 library call)."""

    def step(self, u, t0, t1):
        return np.asarray(u, dtype=np.float64) / (1.0 + (t1 - t0))


@pytest.mark.parametrize("make", [lambda: Dahlquist(-1.0), lambda: __import__("propagators").Heat1D(17), Wider])
def test_float32_states_converge_with_steps_computed_in_float64(make):
    """The C-point residual was the float64 step minus the float32 stored state: it floored at float32's
    rounding (about 1e-7) and the solve ran 100 cycles to MAX_ITER. Now the step is rounded as C-relaxation
    stores it, and the bundled propagators return the state's precision."""
    prop = make()
    u0 = prop.initial() if hasattr(prop, "initial") else np.ones(3)
    t = uniform_grid(64, 1.0)
    res = mgrit.solve(prop, u0.astype(np.float32), t, cf=2, tol=1e-9)
    assert res.status.name == "CONVERGED" and res.u.dtype == np.float32 and res.iterations < 15
    ref = sequential(prop, u0.astype(np.float64), t)
    assert max_err(res.u.astype(np.float64), ref) < 1e-5 * max(1.0, float(np.abs(ref).max()))


def test_dahlquist_steps_torch_states_and_keeps_their_precision():
    t = uniform_grid(16, 1.0)
    for xi, dtype in [(-1.0, torch.float32), (-1.0, torch.float64), (-1.0 + 2.0j, torch.float64),
                      (-1.0 + 2.0j, torch.complex64)]:
        prop = Dahlquist(xi)
        u0 = torch.tensor([1.0, -0.5]).to(dtype)
        if prop.step(u0, 0.0, 0.1).is_complex() and not u0.is_complex():
            u0 = u0.to(torch.complex128)
        res = mgrit.solve(prop, u0, t, cf=2, tol=1e-12 if u0.dtype in (torch.float64, torch.complex128) else 1e-6)
        assert res.status.name == "CONVERGED" and res.u.dtype == u0.dtype
        want = mgrit.solve(prop, u0.numpy(), t, cf=2, tol=1e-12).u
        assert np.abs(res.u.numpy() - want).max() < (1e-12 if u0.dtype in (torch.float64, torch.complex128)
                                                     else 1e-5)
        U = torch.stack([u0, 2 * u0])
        assert torch.equal(prop.step_batch(U, np.zeros(2), np.full(2, 0.1))[0], prop.step(u0, 0.0, 0.1))


@pytest.mark.parametrize("guess", [np.longdouble(0.5), __import__("fractions").Fraction(1, 2), np.full(3, 0.5)[::-1],
                                   np.broadcast_to(0.5, (3,))])
def test_any_numpy_guess_converts_to_torch_states(guess):
    """Through torch.as_tensor a longdouble or object guess raised torch's TypeError, a reversed view its
    negative-stride ValueError, and a read-only array warned on every solve."""
    u0 = torch.tensor([1.0, -2.0, 0.5])
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = mgrit.solve(Decay(), u0, T, initial_guess=guess, **kw)
    assert torch.equal(got.u, mgrit.solve(Decay(), u0, T, initial_guess=0.5, **kw).u)


def test_dahlquist_with_one_xi_per_entry_steps_each_entry_with_its_own():
    """An array xi raised TypeError in step (float() of an array) after the precision change; one-level
    solves (which call step) failed with it."""
    xi = np.array([-1.0, -2.0])
    prop = Dahlquist(xi)
    np.testing.assert_array_equal(prop.step(np.ones(2), 0.0, 0.5), 1.0 / (1.0 + 0.5 * np.array([1.0, 2.0])))
    t = uniform_grid(8, 1.0)
    res = mgrit.solve(prop, np.ones(2), t, max_levels=1)
    np.testing.assert_allclose(res.u[-1], (1.0 / (1.0 - xi / 8)) ** 8, rtol=1e-14, atol=0.0)
