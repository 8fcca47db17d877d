"""Options of ``mgrit.solve``: relaxation, hierarchy, grids, stopping, norms, callback,
printing, cost counts and the kinds of states the solver carries."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mgrit
from propagators import Brusselator, Dahlquist, Heat1D, Lorenz

from conftest import max_err, random_grid, scale, sequential, uniform_grid


# --------------------------------------------------------------------------- C-relaxation weight
def test_c_weight_one_is_the_default_bit_for_bit():
    prop = Heat1D(17)
    t = uniform_grid(64, 1.0)
    a = mgrit.solve(prop, prop.initial(), t, cf=4, relax="FCF", tol=None, max_iter=3)
    b = mgrit.solve(prop, prop.initial(), t, cf=4, relax="FCF", tol=None, max_iter=3, c_weight=1.0)
    assert np.array_equal(a.u, b.u) and a.residuals == b.residuals


@pytest.mark.parametrize("w", [0.6, 1.4, [1.3, 0.7]])
def test_other_c_weight_changes_the_iteration_and_converges(w):
    prop = Heat1D(17)
    t = uniform_grid(64, 1.0)
    ref = sequential(prop, prop.initial(), t)
    plain = mgrit.solve(prop, prop.initial(), t, cf=2, max_levels=3, relax="FCF", tol=1e-11)
    weighted = mgrit.solve(prop, prop.initial(), t, cf=2, max_levels=3, relax="FCF", tol=1e-11,
                           c_weight=w)
    assert weighted.converged
    assert weighted.residuals[1] != plain.residuals[1]
    assert max_err(weighted.u, ref) <= 1e-8 * scale(ref)
    first = w[0] if isinstance(w, list) else w
    assert f"C weight {first:g}" in str(weighted.hierarchy)


# --------------------------------------------------------------------------- per-level options
def test_per_level_relax_list():
    prop = Dahlquist(-1.0)
    t = uniform_grid(64, 3.2)
    ref = sequential(prop, np.array(1.0), t)
    # with two levels only level 0 relaxes: ["F", "FCF"] is plain F-relaxation
    a = mgrit.solve(prop, np.array(1.0), t, max_levels=2, relax=["F", "FCF"], tol=None, max_iter=3)
    b = mgrit.solve(prop, np.array(1.0), t, max_levels=2, relax="F", tol=None, max_iter=3)
    assert np.array_equal(a.u, b.u) and a.residuals == b.residuals
    # with four levels the list is used level by level, the last entry repeating
    res = mgrit.solve(prop, np.array(1.0), t, max_levels=4, relax=["F", "FCF"], tol=1e-12)
    assert [lv.relax for lv in res.hierarchy] == ["F", "FCF", "FCF", None]
    assert res.converged and max_err(res.u, ref) <= 1e-10
    uniform_f = mgrit.solve(prop, np.array(1.0), t, max_levels=4, relax="F", tol=1e-12)
    assert res.residuals[2] != uniform_f.residuals[2]


def test_per_level_cf_list():
    prop = Brusselator()
    u0 = np.array([1.0, 3.0])
    t = uniform_grid(96, 4.0)
    h = mgrit.build_hierarchy(t, cf=[4, 2, 3], max_levels=4)
    assert [lv.n for lv in h] == [96, 24, 12, 4]
    assert [lv.stride for lv in h] == [1, 4, 8, 24]
    assert [lv.cf for lv in h] == [4, 2, 3, None]
    for lv in h:
        assert np.array_equal(lv.t, t[:: lv.stride])
    ref = sequential(prop, u0, t)
    res = mgrit.solve(prop, u0, t, cf=[4, 2, 3], max_levels=4, tol=1e-10)
    assert res.converged and len(res.hierarchy) == 4
    assert max_err(res.u, ref) <= 1e-8 * scale(ref)


@given(
    N=st.integers(1, 300),
    cf=st.lists(st.integers(2, 5), min_size=1, max_size=4),
    max_levels=st.integers(1, 8),
    min_coarse=st.integers(1, 6),
)
@settings(max_examples=80, deadline=None)
def test_hierarchy_follows_xbraid_rule(N, cf, max_levels, min_coarse):
    """Level l+1 keeps every cf_l-th point of level l; a coarser level exists exactly while
    floor(N_l / cf_l) >= min_coarse and fewer than max_levels levels exist."""
    t = uniform_grid(N, 1.0)
    h = mgrit.build_hierarchy(t, cf=cf, max_levels=max_levels, min_coarse=min_coarse)
    cfs = [cf[min(i, len(cf) - 1)] for i in range(len(h))]
    assert 1 <= len(h) <= max_levels
    assert np.array_equal(h[0].t, t)
    for l, lv in enumerate(h):
        assert lv.index == l
        assert np.array_equal(lv.t, t[:: lv.stride])
        if l < len(h) - 1:
            assert lv.cf == cfs[l] and lv.relax == "FCF"
            assert lv.n // cfs[l] >= min_coarse
            assert h[l + 1].n == lv.n // cfs[l]
            assert h[l + 1].stride == lv.stride * cfs[l]
        else:
            assert lv.cf is None and lv.relax is None
            assert len(h) == max_levels or lv.n // cfs[l] < min_coarse
    table = str(h).splitlines()
    assert len(table) == len(h) + 1


# --------------------------------------------------------------------------- grids
@pytest.mark.parametrize("prop,u0", [(Dahlquist(-2.0), np.array(1.0)),
                                     (Lorenz(), np.array([1.0, 1.0, 1.0])),
                                     (Heat1D(9), Heat1D(9).initial())])
@pytest.mark.parametrize("N", [64, 67])
def test_nonuniform_grid_converges_to_sequential_on_same_grid(prop, u0, N, rng):
    t = random_grid(rng, N, 0.5)
    ref = sequential(prop, u0, t)
    res = mgrit.solve(prop, u0, t, cf=2, max_levels=4, tol=1e-11)
    assert res.converged
    assert np.array_equal(res.t, t)
    assert max_err(res.u, ref) <= 1e-8 * scale(ref)
    # the uniform grid gives a different answer: the grid really is used
    assert max_err(sequential(prop, u0, uniform_grid(N, 0.5)), ref) > 1e-6


# --------------------------------------------------------------------------- stopping rules
def test_tol_abs_and_rel_stop_at_first_crossing():
    prop = Heat1D(17)
    t = uniform_grid(64, 1.0)
    res = mgrit.solve(prop, prop.initial(), t, cf=2, tol=1e-7, tol_type="abs")
    r = res.residuals
    assert res.converged and r[-1] <= 1e-7 and all(x > 1e-7 for x in r[1:-1])
    assert res.iterations == len(r)

    rel = mgrit.solve(prop, prop.initial(), t, cf=2, tol=1e-4, tol_type="rel")
    r = rel.residuals
    first = r[1]  # r[0] is None (skip)
    assert rel.converged and r[-1] <= 1e-4 * first and all(x > 1e-4 * first for x in r[1:-1])
    # a relative tolerance of 1 is met by the first residual itself
    once = mgrit.solve(prop, prop.initial(), t, cf=2, tol=1.0, tol_type="rel", skip=False)
    assert once.iterations == 1 and once.converged


def test_max_iter_without_convergence():
    prop = Dahlquist(-1.0)
    t = uniform_grid(64, 3.2)
    res = mgrit.solve(prop, np.array(1.0), t, relax="F", tol=1e-300, max_iter=3, skip=False)
    assert not res.converged and res.status is mgrit.Status.MAX_ITER
    assert res.iterations == 3 and len(res.residuals) == 3
    none = mgrit.solve(prop, np.array(1.0), t, tol=None, max_iter=5)
    assert none.iterations == 5 and not none.converged and none.residuals[0] is None


# --------------------------------------------------------------------------- norms
def f_relaxed_residuals(prop, u, t, m):
    """C-point residuals r_k = Phi^m(u_{(k-1)m}) - u_{km} after F-relaxing the guess ``u``."""
    out = []
    for k in range(1, (len(t) - 1) // m + 1):
        x = u[(k - 1) * m]
        for i in range((k - 1) * m + 1, k * m + 1):
            x = prop.step(x, float(t[i - 1]), float(t[i]))
        out.append(x - u[k * m])
    return np.stack(out)


@pytest.mark.parametrize("shape", [(), (3,), (2, 3)])
def test_temporal_norms_match_numpy(shape, rng):
    prop = Dahlquist(-0.7)
    m, N = 3, 30
    t = uniform_grid(N, 2.0)
    u0 = rng.standard_normal(shape)
    guess = rng.standard_normal((N + 1,) + shape)
    guess[0] = u0
    r = f_relaxed_residuals(prop, guess, t, m)
    spatial = np.linalg.norm(r.reshape(len(r), -1), axis=1)
    expected = {1: spatial.sum(), 2: np.sqrt((spatial**2).sum()), math.inf: spatial.max()}
    for p, value in expected.items():
        res = mgrit.solve(prop, u0, t, cf=m, max_levels=2, relax="F", skip=False, tol=None,
                          max_iter=1, norm=p, initial_guess=guess)
        assert res.residuals[0] == pytest.approx(value, rel=1e-13, abs=0.0)
    res = mgrit.solve(prop, u0, t, cf=m, max_levels=2, relax="F", skip=False, tol=None,
                      max_iter=1, norm="inf", initial_guess=guess)
    assert res.residuals[0] == pytest.approx(expected[math.inf], rel=1e-13, abs=0.0)


class WeightedNorm(Dahlquist):
    """Dahlquist with a grid-weighted spatial norm (h-weighted l2)."""

    def norms(self, U):
        return np.sqrt(0.25) * np.linalg.norm(U.reshape(U.shape[0], -1), axis=1)


def test_propagator_norms_are_used():
    t = uniform_grid(16, 1.0)
    kw = dict(cf=2, max_levels=2, skip=False, tol=None, max_iter=2, initial_guess=0.3)
    a = mgrit.solve(Dahlquist(-1.0), np.ones(4), t, **kw)
    b = mgrit.solve(WeightedNorm(-1.0), np.ones(4), t, **kw)
    np.testing.assert_allclose(b.residuals, 0.5 * np.array(a.residuals), rtol=1e-14)


# --------------------------------------------------------------------------- callback, printing
def test_callback_once_per_iteration():
    prop = Heat1D(17)
    t = uniform_grid(64, 1.0)
    seen = []
    res = mgrit.solve(prop, prop.initial(), t, cf=2, max_levels=3, tol=1e-9, callback=seen.append)
    assert len(seen) == res.iterations
    assert [info.iteration for info in seen] == list(range(res.iterations))
    assert [info.residual for info in seen] == res.residuals
    assert seen[0].residual is None  # skip
    # propagator counts grow, and the returned counts add the final F-relaxation
    for a, b in zip(seen, seen[1:]):
        assert all(y > x for x, y in zip(a.counts, b.counts))
    n_f_points = 64 - 32
    assert res.counts[0] - seen[-1].counts[0] == n_f_points
    assert list(seen[-1].counts[1:]) == res.counts[1:]


def test_result_and_hierarchy_print_as_tables():
    prop = Dahlquist(-1.0)
    t = uniform_grid(64, 3.2)
    res = mgrit.solve(prop, np.array(1.0), t, cf=4, max_levels=3, relax=["F", "FCF"], tol=1e-10)
    table = str(res.hierarchy).splitlines()
    assert table[0].split() == ["level", "points", "intervals", "cf", "relax"]
    assert table[1].split() == ["0", "65", "64", "4", "F"]
    assert table[2].split() == ["1", "17", "16", "4", "FCF"]
    assert table[3].split() == ["2", "5", "4", "-", "(sequential)"]
    text = str(res)
    for line in table:
        assert line in text
    for k, r in enumerate(res.residuals):
        if r is not None:
            assert f"{r:.6e}" in text
    assert f"{res.iterations} cycles" in text
    assert res.status.value in text
    assert "Result(" in repr(res)


def test_factors_are_residual_ratios():
    prop = Heat1D(17)
    res = mgrit.solve(prop, prop.initial(), uniform_grid(64, 1.0), cf=2, tol=1e-10)
    r, f = res.residuals, res.factors
    assert f[0] is None and f[1] is None
    for k in range(2, len(r)):
        assert f[k] == pytest.approx(r[k] / r[k - 1], rel=1e-15, abs=0.0)


# --------------------------------------------------------------------------- costs
@pytest.mark.parametrize("relax", ["F", "FCF", "FCFCF"])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_two_level_propagator_counts(relax, skip, k):
    """Per cycle: level 0 does (nrelax + 1) F-sweeps, nrelax C-sweeps and one residual sweep,
    level 1 one Psi per coarse point for the FAS right-hand side and one sequential solve;
    the skipped first cycle is only the coarse solve; the result gets one last F-sweep."""
    m, n_coarse = 4, 6
    N = m * n_coarse
    n_f = N - n_coarse
    nrelax = relax.count("C")
    res = mgrit.solve(Dahlquist(-1.0), np.array(1.0), uniform_grid(N, 1.0), cf=m, max_levels=2,
                      relax=relax, skip=skip, tol=None, max_iter=k)
    full = k - (1 if skip else 0)
    assert res.counts[0] == full * (nrelax + 1) * N + n_f
    assert res.counts[1] == full * 2 * n_coarse + (n_coarse if skip else 0)


# --------------------------------------------------------------------------- initial guesses
def test_initial_guess_forms_agree():
    prop = Dahlquist(-1.0)
    t = uniform_grid(32, 2.0)
    u0 = np.array([1.0, -2.0])
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=2)
    scalar = mgrit.solve(prop, u0, t, initial_guess=0.25, **kw)
    state = mgrit.solve(prop, u0, t, initial_guess=np.array([0.25, 0.25]), **kw)
    func = mgrit.solve(prop, u0, t, initial_guess=lambda s: np.full(2, 0.25), **kw)
    traj = np.full((33, 2), 0.25)
    whole = mgrit.solve(prop, u0, t, initial_guess=traj, **kw)
    for other in (state, func, whole):
        assert np.array_equal(scalar.u, other.u)
    default = mgrit.solve(prop, u0, t, **kw)
    copy_u0 = mgrit.solve(prop, u0, t, initial_guess=u0, **kw)
    assert np.array_equal(default.u, copy_u0.u)


def test_inputs_are_not_modified():
    prop = Dahlquist(-1.0)
    t = uniform_grid(32, 2.0)
    u0 = np.array([1.0, -2.0])
    guess = np.full((33, 2), 0.25)
    t_copy, u0_copy, guess_copy = t.copy(), u0.copy(), guess.copy()
    res = mgrit.solve(prop, u0, t, cf=2, tol=1e-10, initial_guess=guess)
    assert np.array_equal(t, t_copy) and np.array_equal(u0, u0_copy)
    assert np.array_equal(guess, guess_copy)
    assert np.array_equal(res.u[0], u0)
    res.u[1] += 1.0  # the result owns its memory
    assert np.array_equal(guess, guess_copy)


# --------------------------------------------------------------------------- kinds of states
@pytest.mark.parametrize("shape", [(), (4,), (2, 3)])
def test_state_shapes_entrywise_independent(shape, rng):
    """Dahlquist acts entry by entry: with a fixed number of cycles an array state gives,
    entry by entry, the numbers of the scalar solves."""
    prop = Dahlquist(-1.5)
    t = uniform_grid(40, 2.0)
    u0 = rng.standard_normal(shape)
    kw = dict(cf=2, max_levels=3, tol=None, max_iter=3, relax="FCF")
    res = mgrit.solve(prop, u0, t, **kw)
    assert res.u.shape == (41,) + shape
    for idx in np.ndindex(*shape):
        one = mgrit.solve(prop, np.array(u0[idx]), t, **kw)
        np.testing.assert_allclose(res.u[(slice(None),) + idx], one.u, rtol=1e-15, atol=1e-300)
    ref = sequential(prop, u0, t)
    conv = mgrit.solve(prop, u0, t, cf=2, max_levels=3, tol=1e-12)
    assert max_err(conv.u, ref) <= 1e-10


class FloatDecay(mgrit.Propagator):
    """A scalar propagator written with Python floats: returns a float, not an array."""

    def step(self, u, t0, t1):
        return float(u) / (1.0 + (t1 - t0))


@pytest.mark.parametrize("levels", [1, 2, 4])
def test_propagator_returning_python_floats(levels):
    """A 0-d state may be returned as a Python float; same numbers as the array version."""
    t = uniform_grid(32, 2.0)
    res = mgrit.solve(FloatDecay(), 1.0, t, max_levels=levels, tol=None, max_iter=3)
    ref = mgrit.solve(Dahlquist(-1.0), np.array(1.0), t, max_levels=levels, tol=None, max_iter=3)
    assert res.u.shape == (33,)
    np.testing.assert_allclose(res.u, ref.u, rtol=1e-13)


class RealRotation(mgrit.Propagator):
    """The real 2x2 form of multiplication by the complex backward-Euler factor."""

    def __init__(self, xi: complex):
        self.xi = xi

    def step(self, u, t0, t1):
        f = 1.0 / (1.0 - self.xi * (t1 - t0))
        return np.array([f.real * u[0] - f.imag * u[1], f.imag * u[0] + f.real * u[1]])


def test_complex_states_match_real_form():
    xi = -0.3 + 2.0j
    t = uniform_grid(48, 3.0)
    prop = Dahlquist(xi, "be")
    u0 = np.array(0.6 - 0.8j)
    ref = sequential(prop, u0, t)
    kw = dict(cf=2, max_levels=3, relax="FCF", tol=None, max_iter=4)
    res = mgrit.solve(prop, u0, t, **kw)
    assert np.iscomplexobj(res.u)
    real = mgrit.solve(RealRotation(xi), np.array([u0.real, u0.imag]), t, **kw)
    np.testing.assert_allclose(res.u.real, real.u[:, 0], rtol=0, atol=1e-14)
    np.testing.assert_allclose(res.u.imag, real.u[:, 1], rtol=0, atol=1e-14)
    np.testing.assert_allclose(res.residuals[1:], real.residuals[1:], rtol=1e-12)
    conv = mgrit.solve(prop, u0, t, cf=2, max_levels=3, tol=1e-12)
    assert conv.converged and max_err(conv.u, ref) <= 1e-10


class NumpyLayer(mgrit.Propagator):
    """Forward-Euler ResNet layer u + h tanh(W u + b), numpy version."""

    def __init__(self, W, b):
        self.W, self.b = W, b

    def step(self, u, t0, t1):
        return u + (t1 - t0) * np.tanh(self.W @ u + self.b)


class TorchLayer(mgrit.Propagator):
    """The same layer on torch tensors, batched over the leading axis."""

    def __init__(self, W, b):
        import torch

        self.W = torch.tensor(W, dtype=torch.float64)
        self.b = torch.tensor(b, dtype=torch.float64)

    def step(self, u, t0, t1):
        import torch

        return u + (t1 - t0) * torch.tanh(self.W @ u + self.b)

    def step_batch(self, U, t0, t1):
        import torch

        h = torch.as_tensor(np.asarray(t1) - np.asarray(t0), dtype=U.dtype)[:, None]
        return U + h * torch.tanh(U @ self.W.T + self.b)


def test_torch_states_give_numpy_numbers(rng):
    import torch

    W = rng.standard_normal((4, 4)) - 2.0 * np.eye(4)
    b = rng.standard_normal(4)
    t = uniform_grid(64, 4.0)
    u0 = rng.standard_normal(4)
    ref = sequential(NumpyLayer(W, b), u0, t)
    kw = dict(cf=4, max_levels=3, relax="FCF", tol=None, max_iter=3)
    a = mgrit.solve(NumpyLayer(W, b), u0, t, **kw)
    b_ = mgrit.solve(TorchLayer(W, b), torch.tensor(u0), t, **kw)
    assert isinstance(b_.u, torch.Tensor) and b_.u.dtype == torch.float64
    np.testing.assert_allclose(b_.u.numpy(), a.u, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(b_.residuals[1:], a.residuals[1:], rtol=1e-11)
    # a torch trajectory as the initial guess, and convergence to sequential stepping
    conv = mgrit.solve(TorchLayer(W, b), torch.tensor(u0), t, cf=4, tol=1e-12,
                       initial_guess=torch.tensor(ref))
    assert max_err(conv.u.numpy(), ref) <= 1e-12 * scale(ref)
    torch_ref = sequential(TorchLayer(W, b), torch.tensor(u0), t)
    one = mgrit.solve(TorchLayer(W, b), torch.tensor(u0), t, max_levels=1)
    assert torch.equal(one.u, torch_ref)


class _StepOnly(mgrit.Propagator):
    """``step`` only: the solver relaxes it interval by interval."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, u, t0, t1):
        return self.inner.step(u, t0, t1)


class _LoopedBatch(_StepOnly):
    """The same steps through ``step_batch``, in the order of one sweep per residue class."""

    def step_batch(self, U, t0, t1):
        return np.stack([self.inner.step(U[k], float(t0[k]), float(t1[k])) for k in range(U.shape[0])])


@pytest.mark.parametrize("kw", [dict(cf=2, max_levels=4, relax="FCF"), dict(cf=3, max_levels=3, relax="F", cycle="F"),
                                dict(cf=4, max_levels=3, relax="FCFCF", nested=True),
                                dict(cf=3, max_levels=2, relax="FCF", c_weight=1.2)])
def test_step_only_relaxation_by_interval_equals_the_sweep_order_bit_for_bit(kw):
    """A propagator with only ``step`` is F-relaxed interval by interval (cache-friendly); every
    state, residual and count equals the residue-class sweeps of a ``step_batch``."""

    u0, t = np.array([1.0, 1.0, 1.0]), np.linspace(0.0, 0.38, 39)
    a = mgrit.solve(_StepOnly(Lorenz()), u0, t, tol=1e-10, max_iter=30, **kw)
    b = mgrit.solve(_LoopedBatch(Lorenz()), u0, t, tol=1e-10, max_iter=30, **kw)
    assert np.array_equal(a.u, b.u) and a.residuals == b.residuals and a.counts == b.counts


def test_the_ranks_compare_guesses_as_the_states_they_give():
    """What the ranks compare of a scalar or one-state initial_guess (several ranks: tests/mpi_scripts/failures.py):
    the state it gives in u0's shape and dtype. None (u0 itself), a scalar and the state full of it, and a real
    and a complex-typed guess of a complex u0 are equal guesses; another value, or a callable against a state,
    differ, and the message names the rank and how."""
    from mgrit.solver import _differing_guess, _guess_summary

    u = np.array([1.0, -0.5, 0.25])

    def differ(a, b, u0=u):
        return _differing_guess([_guess_summary(a, u0), _guess_summary(b, u0)])

    assert differ(None, u.copy()) is None and differ(0.5, np.full(3, 0.5)) is None and differ(0, np.zeros(3)) is None
    assert differ(np.ones(3, np.float32), 1.0) is None and differ([1, 2, 3], np.array([1.0, 2.0, 3.0])) is None
    st = np.array([0.3, 0.2, -0.1])
    assert differ(st, st.astype(complex), u0=u + 0.5j) is None
    assert "rank 1 gives the state" in str(differ(0.0, 1.0))
    assert "rank 1 gives a callable, rank 0 the state" in str(differ(None, lambda t: u))
    assert differ(np.zeros((5, 3)), np.ones((5, 3))) is None  # trajectories: read at each rank's points, not compared
    with pytest.raises(ValueError, match="beyond float64's range"):
        mgrit.solve(Dahlquist(-1.0), u, np.linspace(0.0, 1.0, 9), initial_guess=10 ** 400)
