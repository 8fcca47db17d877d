"""Bad input gets a clear error that names the argument; NaN / Inf is never a result."""
from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest

import mgrit
from propagators import Dahlquist

from conftest import uniform_grid

T = uniform_grid(16, 1.0)
U0 = np.array([1.0, 2.0])


def solve(**kw):
    args = dict(propagator=Dahlquist(-1.0), u0=U0, t=T)
    args.update(kw)
    return mgrit.solve(args.pop("propagator"), args.pop("u0"), args.pop("t"), **args)


# --------------------------------------------------------------------------- time grid
@pytest.mark.parametrize("t", [
    T[::-1],
    np.array([0.0, 0.5, 0.5, 1.0]),
    np.array([0.0, 1.0, 0.5, 2.0]),
])
def test_non_increasing_t(t):
    with pytest.raises(ValueError, match="`t`.*increasing"):
        solve(t=t)


@pytest.mark.parametrize("t", [[0.0], [], np.zeros((3, 2))])
def test_too_short_or_not_1d_t(t):
    with pytest.raises(ValueError, match="`t`"):
        solve(t=t)


@pytest.mark.parametrize("t", [[0.0, np.nan, 1.0], [0.0, 1.0, np.inf]])
def test_non_finite_t(t):
    with pytest.raises(ValueError, match="`t`"):
        solve(t=t)


# --------------------------------------------------------------------------- hierarchy options
@pytest.mark.parametrize("cf", [1, 0, -2, 2.5, [2, 1], "2", []])
def test_bad_cf(cf):
    with pytest.raises(ValueError, match="`cf`"):
        solve(cf=cf)


@pytest.mark.parametrize("relax", ["X", "CF", "FC", "FF", "", 3, None, ["F", "FCX"]])
def test_unknown_relaxation(relax):
    with pytest.raises(ValueError, match="`relax`"):
        solve(relax=relax)


@pytest.mark.parametrize("name,value", [
    ("max_levels", 0), ("max_levels", 2.0), ("min_coarse", 0), ("c_weight", 0.0),
    ("c_weight", 2.5), ("c_weight", [1.0, -1.0]),
])
def test_bad_hierarchy_numbers(name, value):
    with pytest.raises(ValueError, match=f"`{name}`"):
        solve(**{name: value})


# --------------------------------------------------------------------------- solver options
@pytest.mark.parametrize("name,value", [
    ("tol_type", "relative"), ("tol_type", None),
    ("norm", 3), ("norm", 0), ("norm", "fro"), ("norm", True),
    ("cycle", "W"), ("cycle", "v2"), ("cycle", None),
    ("max_iter", 0), ("max_iter", -1), ("max_iter", 2.5), ("max_iter", "10"), ("max_iter", True),
    ("tol", -1e-3), ("tol", math.nan), ("tol", "1e-6"),
    pytest.param("tol", 10 ** 400, id="tol-1e400"),  # (float() of it: an OverflowError)
])
def test_bad_solver_option(name, value):
    with pytest.raises(ValueError, match=f"`{name}`"):
        solve(**{name: value})


def test_not_a_propagator():
    class Stepper:  # has the method but is not an mgrit.Propagator
        def step(self, u, t0, t1):
            return u

    for bad in (Stepper(), lambda u, t0, t1: u, [Dahlquist(-1.0), Stepper()]):
        with pytest.raises(TypeError, match="`propagator`"):
            solve(propagator=bad)


def test_bad_callback_and_spatial():
    with pytest.raises(TypeError, match="`callback`"):
        solve(callback=42)
    with pytest.raises(TypeError, match="`spatial`"):
        solve(spatial="coarsen")


# --------------------------------------------------------------------------- states
@pytest.mark.parametrize("u0", [np.array([1.0, np.nan]), np.array(np.inf), np.array([[1.0, -np.inf]])])
def test_non_finite_u0(u0):
    with pytest.raises(ValueError, match="`u0`"):
        solve(u0=u0)


@pytest.mark.parametrize("u0", ["abc", np.array(["a", "b"]), [object()]])
def test_non_numeric_u0(u0):
    with pytest.raises(TypeError, match="`u0`"):
        solve(u0=u0)


@pytest.mark.parametrize("guess", [
    np.nan,
    np.array([1.0, np.inf]),
    np.vstack([np.ones((16, 2)), [[np.nan, 0.0]]]),
    lambda s: np.array([1.0, np.nan if s > 0.5 else 0.0]),
])
def test_non_finite_initial_guess(guess):
    with pytest.raises(ValueError, match=r"`initial_guess(\(t\))?` contains NaN or Inf"):
        solve(initial_guess=guess)


@pytest.mark.parametrize("guess", ["abc", [None], [None, 1.0], b"x", lambda s: "x", lambda s: None])
def test_initial_guess_of_no_numbers_names_the_argument(guess):
    """A string gave numpy's 'could not convert string to float', and None became NaN and was reported
    as "contains NaN or Inf"."""
    with pytest.raises(TypeError, match=r"`initial_guess(\(t\))?` must hold numbers"):
        solve(initial_guess=guess)


def test_a_ragged_initial_guess_names_the_argument():
    with pytest.raises(TypeError, match="`initial_guess` must be a number, a state or a trajectory"):
        solve(initial_guess=[[1.0, 2.0], [1.0]])


@pytest.mark.parametrize("kwargs", [dict(relax=["F", "F", "F", "X"]), dict(cf=[2, 2, 2, 1]),
                                    dict(c_weight=[1.0, 1.0, 1.0, 3.0])])
def test_every_entry_of_a_per_level_list_is_checked(kwargs):
    """An entry beyond the levels a grid makes (here 2) was never looked at: a typo there passed."""
    with pytest.raises(ValueError, match="`" + next(iter(kwargs)) + "`"):
        solve(max_levels=2, **kwargs)


@pytest.mark.parametrize("guess", [np.ones(3), np.ones((17, 3)), np.ones((16, 2)), lambda s: np.ones(3)])
def test_wrongly_shaped_initial_guess(guess):
    with pytest.raises(ValueError, match="`initial_guess"):
        solve(initial_guess=guess)


class WrongShape(mgrit.Propagator):
    def step(self, u, t0, t1):
        return np.concatenate([u, u])


class WrongBatchShape(Dahlquist):
    def step_batch(self, U, t0, t1):
        return super().step_batch(U, t0, t1)[:, :1]


class DropsARow(Dahlquist):
    def step_batch(self, U, t0, t1):
        return super().step_batch(U, t0, t1)[:-1]


def test_step_batch_returning_another_number_of_states_is_named():
    """The message quoted two equal state shapes and blamed `step` for a `step_batch` that dropped a row."""
    with pytest.raises(ValueError, match=r"returned a stack of shape \((\d+), 2\) from `step_batch` for (?!\1)\d+ "
                                         r"states of shape \(2,\).*`step_batch` must return one state per row"):
        solve(propagator=DropsARow(-1.0))


@pytest.mark.parametrize("prop,levels", [(WrongShape(), 1), (WrongShape(), 2), (WrongShape(), 3),
                                         (WrongBatchShape(-1.0), 2), (WrongBatchShape(-1.0), 3)])
@pytest.mark.parametrize("skip", [False, True])
def test_propagator_returning_wrong_shape(prop, levels, skip):
    """Checked on every path: single steps (sequential solves) and batched relaxation
    sweeps (one level never calls ``step_batch``)."""
    with pytest.raises(ValueError, match=r"propagator.*shape.*\(2,\)") as info:
        solve(propagator=prop, max_levels=levels, skip=skip)
    assert ("`step_batch`" if isinstance(prop, WrongBatchShape) else "`step`") in str(info.value)


class LateOdd(mgrit.Propagator):
    """Backward Euler for u' = -u whose `step` returns ``odd(u)`` (a float, None, a state of another shape)
    on the fine steps (of 1/32) that start after t = 0.5 only: the first call of a sweep is fine, later
    ones are not, and the coarse levels' sequential solve never sees it."""

    def __init__(self, odd):
        self.odd = odd

    def step(self, u, t0, t1):
        return self.odd(u) if t0 > 0.5 and t1 - t0 < 0.04 else u / (1.0 + (t1 - t0))


ODD = {"a float": (lambda u: 7.0, ValueError, r"level \d returned a state of shape \(\) for an input of shape \(3,\)"),
       "None": (lambda u: None, TypeError, r"level \d returned None from `step`"),
       "another shape": (lambda u: u[:1], ValueError, r"shape \(1,\) for an input of shape \(3,\)"),
       "complex": (lambda u: u * 1j, TypeError, "complex states for a real `u0`")}


@pytest.mark.parametrize("odd", list(ODD))
@pytest.mark.parametrize("kw", [dict(max_levels=3, relax="F"), dict(max_levels=3, relax="FCF"),
                                dict(max_levels=2, relax="FCF", c_weight=0.5), dict(max_levels=1)],
                         ids=["F", "FCF", "weighted C", "one level"])
def test_an_odd_state_from_a_later_step_is_an_error_not_broadcast(odd, kw):
    """A float broadcast into a state of 3 entries made a CONVERGED solve with u(T) = [829, 829, 829] for about
    0.38 (only the first result of a sweep was checked); None became NaN and a DivergenceError that advised
    fewer levels. Every path of a propagator with only `step`: the sweeps interval by interval, the C-point
    calls written into the stack, the default step_batch (weighted C-relaxation) and the sequential solve."""
    fn, kind, match = ODD[odd]
    with pytest.raises(kind, match=match), np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (numpy's ComplexWarning, were the imaginary part dropped)
        mgrit.solve(LateOdd(fn), np.ones(3), np.linspace(0.0, 1.0, 33), cf=2, tol=1e-12, **kw)


def test_the_default_step_batch_returns_an_odd_state_for_the_solver_to_name():
    prop = LateOdd(lambda u: 7.0)
    U, t0 = np.ones((4, 3)), np.array([0.0, 0.25, 0.5, 0.75])
    out = prop.step_batch(U, t0, t0 + 1 / 32)
    assert out.shape == (1,)  # (a stack of the odd 0-d state: check_batch names its shape)
    assert prop.step_batch(U[:2], t0[:2], t0[:2] + 1 / 32).shape == (2, 3)


class InPlace(mgrit.Propagator):
    """Backward Euler that divides its input in place (a common bug)."""

    def step(self, u, t0, t1):
        u /= 1.0 + (t1 - t0)
        return u


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_a_step_that_changes_its_input_is_an_error(levels):
    """The iterate was corrupted without a word: one level gave an error of 0.059 as SEQUENTIAL, three
    levels 0.97 at max_iter."""
    with pytest.raises(ValueError, match=r"level \d changed its input state in place in `step`"):
        mgrit.solve(InPlace(), np.ones(3), np.linspace(0.0, 1.0, 17), cf=2, max_levels=levels)


@pytest.mark.parametrize("levels", [1, 3])
def test_a_torch_step_that_autograd_tracks_is_a_clear_error(levels):
    """An nn.Linear with parameters that require grad: three levels raised torch's 'functions with out=...
    arguments don't support automatic differentiation' from a subtraction, one level returned states with a
    grad_fn (a graph over every step kept in memory)."""
    torch = pytest.importorskip("torch")

    class Linear(mgrit.Propagator):
        def __init__(self):
            self.f = torch.nn.Linear(3, 3, dtype=torch.float64)

        def step(self, u, t0, t1):
            return u + (t1 - t0) * torch.tanh(self.f(u))

    with pytest.raises(ValueError, match="requires grad.*torch.no_grad"):
        mgrit.solve(Linear(), torch.ones(3, dtype=torch.float64), np.linspace(0.0, 1.0, 17), cf=2, max_levels=levels)


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("batched", [False, True])
def test_a_later_torch_step_that_autograd_tracks_is_a_clear_error(levels, batched):
    """Layers 5 to 15 trainable, the first ones frozen: only the first result of a sweep was checked, so one level
    returned states with a grad_fn and two or three levels raised torch's out= error from a subtraction. With
    a step_batch of the user's that loops over step, every batch is checked (check_batch) alike."""
    torch = pytest.importorskip("torch")
    W = [torch.full((4,), 0.5, dtype=torch.float64, requires_grad=i >= 5) for i in range(16)]

    class Partly(mgrit.Propagator):
        def step(self, u, t0, t1):
            return u + (t1 - t0) * torch.tanh(W[min(int(round(t0 * 16)), 15)] * u)

    class PartlyBatched(Partly):
        def step_batch(self, U, t0, t1):
            return torch.stack([self.step(u, a, b) for u, a, b in zip(U, t0.tolist(), t1.tolist())])

    prop = PartlyBatched() if batched else Partly()
    with pytest.raises(ValueError, match=r"propagator of level \d returned a tensor that requires grad.*no_grad"):
        mgrit.solve(prop, torch.ones(4, dtype=torch.float64), np.linspace(0.0, 1.0, 17), cf=2, max_levels=levels,
                    tol=1e-10)


def test_masked_entries_are_refused_rather_than_unmasked():
    u0 = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    with pytest.raises(TypeError, match=r"`u0` is a masked array with masked entries.*u0\.filled"):
        solve(u0=u0)
    guess = np.ma.masked_array(np.ones((17, 2)), mask=np.eye(17, 2, dtype=bool))
    with pytest.raises(TypeError, match=r"`initial_guess` is a masked array with masked entries"):
        solve(initial_guess=guess, skip=False)
    # nothing masked (as netCDF4 returns its variables): the values, as a plain array
    for plain in (np.ma.array(U0), np.ma.masked_array(U0, mask=[False, False])):
        assert np.array_equal(solve(u0=plain).u, solve().u)


@pytest.mark.parametrize("dtype, wider", [("complex32", "complex64"), ("float8_e5m2", "float16")])
def test_torch_dtypes_without_arithmetic_are_refused_with_the_dtype_to_use(dtype, wider):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=rf"`u0` has dtype torch\.{dtype}.*u0\.to\(torch\.{wider}\)"):
        solve(u0=torch.ones(2).to(getattr(torch, dtype)))


# --------------------------------------------------------------------------- divergence
class Rotation(mgrit.Propagator):
    """``u -> 0.99^k R(0.75 pi k) u`` over ``k`` steps of ``h``, exact on every level, in the state's dtype."""

    h = 1.0 / 16

    def step(self, u, t0, t1):
        k = (t1 - t0) / self.h
        a, d = 0.75 * np.pi * k, 0.99 ** k
        R = d * np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])
        return (R @ u.astype(np.float64)).astype(u.dtype)


def test_float16_residuals_that_overflow_are_named_as_such():
    """A float16 trajectory within range (|u| <= 45000 < 65504) whose residuals, differences of two states, are
    not: the DivergenceError names float16's range instead of only the propagator and the coarse steps."""
    u0, t = np.array([45000.0, 0.0], dtype=np.float16), uniform_grid(16, 1.0)
    seq = [u0]
    for k in range(16):
        seq.append(Rotation().step(seq[-1], t[k], t[k + 1]))
    assert np.isfinite(np.stack(seq)).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (numpy's overflow warning)
        with pytest.raises(mgrit.DivergenceError, match=r"float16 \(largest value 65504\)"):
            mgrit.solve(Rotation(), u0, t, cf=2, max_levels=3, tol=1.0)
        small = np.array([10000.0, 0.0], dtype=np.float16)  # differences in range: solved
        r = mgrit.solve(Rotation(), small, t, cf=2, max_levels=3, tol=1.0)
    seq = [small]
    for k in range(16):
        seq.append(Rotation().step(seq[-1], t[k], t[k + 1]))
    assert r.u.dtype == np.float16 and np.array_equal(r.u, np.stack(seq))


class NaNAfter(mgrit.Propagator):
    """Backward Euler for u' = -u that returns NaN on steps ending after ``t_bad``."""

    def __init__(self, t_bad):
        self.t_bad = t_bad

    def step(self, u, t0, t1):
        return u * np.nan if t1 > self.t_bad else u / (1.0 + (t1 - t0))


class NaNForLongSteps(mgrit.Propagator):
    """Fine only for steps up to ``h``: every coarse-level step returns NaN."""

    def __init__(self, h):
        self.h = h

    def step(self, u, t0, t1):
        return u / (1.0 + (t1 - t0)) if t1 - t0 <= self.h * (1 + 1e-9) else u * np.inf


class Switchable(Dahlquist):
    """Backward Euler for u' = -u that returns NaN once ``broken[0]`` is set."""

    def __init__(self):
        super().__init__(-1.0)
        object.__setattr__(self, "broken", [False])

    def step_batch(self, U, t0, t1):
        out = super().step_batch(U, t0, t1)
        return out * np.nan if self.broken[0] else out


def divergence_message(**kw):
    seen = []
    with pytest.raises(mgrit.DivergenceError) as info, np.errstate(invalid="ignore", over="ignore"):
        solve(callback=seen.append, **kw)
    msg = str(info.value)
    return msg, seen


def test_nan_on_fine_level_first_iteration():
    msg, _ = divergence_message(propagator=NaNAfter(0.5), skip=False, max_levels=2)
    assert re.search(r"level 0 in iteration 0", msg), msg


def test_nan_on_coarse_level_is_named():
    h = T[1] - T[0]
    msg, _ = divergence_message(propagator=NaNForLongSteps(h), skip=False, max_levels=2)
    assert re.search(r"level 1 in iteration 0", msg), msg


def test_nan_in_a_later_iteration():
    """The fine propagator breaks after the callback of iteration 1: the NaN appears in the
    relaxation of iteration 2 on level 0, and no result comes back."""
    prop = Switchable()
    seen = []

    def callback(info):
        seen.append(info)
        if info.iteration == 1:
            prop.broken[0] = True

    with pytest.raises(mgrit.DivergenceError) as info, np.errstate(invalid="ignore"):
        solve(propagator=[prop, Dahlquist(-1.0)], skip=False, max_levels=2, tol=None,
              max_iter=10, callback=callback)
    assert re.search(r"level 0 in iteration 2", str(info.value)), str(info.value)
    assert [i.iteration for i in seen] == [0, 1]
    assert all(math.isfinite(i.residual) for i in seen)


def test_nan_with_one_level():
    msg, _ = divergence_message(propagator=NaNAfter(0.5), max_levels=1)
    assert re.search(r"level 0 in iteration 0", msg), msg


def test_overflow_to_inf_is_divergence():
    class Explode(mgrit.Propagator):
        def step(self, u, t0, t1):
            return u * 1e300

    with np.errstate(over="ignore"):
        with pytest.raises(mgrit.DivergenceError, match=r"level \d+ in iteration \d+"):
            solve(propagator=Explode(), t=uniform_grid(64, 1.0), max_levels=2)


# --------------------------------------------------------------------------- from the review of the solver API
def test_complex_or_non_numeric_t_is_refused_and_a_tracked_torch_t_is_a_grid():
    """A complex grid lost its imaginary part with a ComplexWarning; a torch grid that requires grad raised
    torch's "Can't call numpy() on Tensor that requires grad"."""
    torch = pytest.importorskip("torch")
    for t in (T + 0j, ["a", "b"], [object(), object()]):
        with pytest.raises(ValueError, match="`t` must hold real numbers"):
            solve(t=t)
    want = solve().u
    for t in (torch.tensor(T, requires_grad=True), [torch.tensor(x, requires_grad=True) for x in T],
              [str(x) for x in T]):
        assert np.array_equal(solve(t=t).u, want)
    seconds = solve(t=(16 * T).astype("m8[s]"), propagator=Dahlquist(-0.1)).u  # a timedelta grid: its units
    assert np.array_equal(seconds, solve(t=16 * T, propagator=Dahlquist(-0.1)).u)


@pytest.mark.parametrize("norm", [np.True_, np.False_, [2], np.array([1, 2])])
def test_norm_must_be_one_of_the_temporal_norms(norm):
    with pytest.raises(ValueError, match="`norm`"):
        solve(norm=norm)


class _Norms(Dahlquist):
    def __init__(self, f):
        super().__init__(-1.0)
        object.__setattr__(self, "f", f)

    def norms(self, U):
        return self.f(U)


@pytest.mark.parametrize("f, match", [
    (lambda U: -np.linalg.norm(U, axis=1), "negative norm"),  # was CONVERGED with residuals [None, -0.101]
    (lambda U: float(np.linalg.norm(U)), r"shape \(\) for a stack of"),  # was accepted as one norm for all
    (lambda U: np.linalg.norm(U, axis=1)[:-1], "one norm per state"),
    (lambda U: np.linalg.norm(U, axis=1) + 0j, "one real norm per state"),
])
def test_a_users_norms_are_checked(f, match):
    with pytest.raises((ValueError, TypeError), match=match):
        solve(propagator=_Norms(f), norm=1)


def test_a_users_norms_in_another_form_are_read():
    torch = pytest.importorskip("torch")
    want = solve(norm=1).residuals
    for f in (lambda U: list(np.linalg.norm(U, axis=1)), lambda U: torch.as_tensor(np.linalg.norm(U, axis=1))):
        assert solve(propagator=_Norms(f), norm=1).residuals == want


def test_a_one_level_solve_calls_the_callback_once():
    seen = []
    res = solve(max_levels=1, callback=seen.append)
    assert res.status is mgrit.Status.SEQUENTIAL and res.residuals == []
    assert len(seen) == 1 and seen[0].iteration == 0 and seen[0].residual is None
    assert seen[0].counts == tuple(res.counts) == (len(T) - 1,)


@pytest.mark.parametrize("guess", [1e5, lambda t: np.full(2, 1e5)])
def test_a_finite_guess_beyond_u0s_dtype_is_named_as_such(guess):
    """A guess of 1e5 for float16 states was reported as containing NaN or Inf."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no overflow warning from the cast either)
        with pytest.raises(ValueError, match=r"beyond the range of u0's dtype \(float16\)"):
            solve(u0=U0.astype(np.float16), initial_guess=guess)


def test_complex_states_whose_first_step_is_real_keep_the_imaginary_parts_of_later_steps():
    """`np.real_if_close` in a step: the first result real, later ones complex; the stack of results was
    built real from the first and dropped the later imaginary parts (a ComplexWarning)."""

    class RealIfClose(mgrit.Propagator):
        def step(self, u, t0, t1):
            return np.real_if_close(u * np.exp(1j * (t1 - t0) * t0))

    prop, t = RealIfClose(), np.linspace(0.0, 2.0, 17)
    u0 = np.array([1.0 + 0.0j])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a ComplexWarning fails)
        res = mgrit.solve(prop, u0, t, cf=2, max_levels=3, tol=1e-13, max_iter=30)
    serial = [u0]
    for a, b in zip(t[:-1], t[1:]):
        serial.append(np.asarray(prop.step(serial[-1], a, b), dtype=complex))
    assert np.max(np.abs(res.u - np.array(serial))) < 1e-12
