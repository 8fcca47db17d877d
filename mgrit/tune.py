"""Settings from theory: choose ``cf``, levels, relaxation and C-weight for a propagator.

:func:`choose_settings` linearizes the propagator, estimates the eigenvalues
of the fine step ``Phi`` and of the rediscretized coarse steps ``Psi_l``
(the same propagator over ``stride_l`` fine intervals), pairs them mode by
mode, predicts the residual reduction factor of one V-cycle for every
candidate setting with the linear, time-invariant theory of
docs/theory.md §6 (extended to per-level relaxation and weighted
C-relaxation), rejects settings whose coarse steps are unstable, and picks the
cheapest of the rest under the critical-path cost model
(:func:`mgrit.model.predict`). docs/tuning.md describes the method, its
assumptions, and where the prediction is a bound and where an estimate.
Beside that worst-case factor it predicts the factor a solve measures: the
solve is simulated on an affine model of the problem (the modes of a
time-invariant step, or the linearization along a reference trajectory)
from the solver's own start (docs/tuning.md §7).

Building blocks, usable on their own:

* :func:`jacobian` -- the dense Jacobian of one step (finite differences for
  numpy states, ``torch.func.jvp`` for torch tensors);
* :func:`step_spectrum` -- paired eigenvalues of the fine step, of coarse steps
  and of compositions of steps at one state (dense eigenvalues for small
  states, Arnoldi Ritz values for large ones);
* :func:`cycle_factors` (:func:`residual_matrices`, :func:`error_matrices`) --
  the V-cycle's residual reduction factor per scalar mode, with per-level
  factors, relaxation and C-weight;
* :func:`average_factor` -- the measured factor of a residual history, which
  ``Candidate.expected`` predicts.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import _backend as B
from . import theory
from .comm import _equal
from .hierarchy import build_hierarchy, check_levels, check_time_grid, is_integer, parse_relax, per_level
from .model import StepCost, predict, sequential_time
from .propagator import Propagator
from .relax import check_batch, checked_state, step_keeping_input

__all__ = [
    "choose_settings",
    "Settings",
    "Candidate",
    "Spectrum",
    "jacobian",
    "step_spectrum",
    "cycle_factors",
    "residual_matrices",
    "error_matrices",
    "power_cycles",
    "average_factor",
    "predict_options",
]

#: Most basis columns (modes times fine C-points) of one candidate's scalar-mode evaluation.
MAX_COLUMNS = 2048
#: Default candidate coarsening factors (uniform); see :func:`choose_settings`.
DEFAULT_CF = (2, 4, 8, 16)
#: Default candidate relaxations: F everywhere, FCF everywhere, F on the finest and FCF below.
DEFAULT_RELAX = ("F", "FCF", ("F", "FCF"))
#: Default C-relaxation weights tried on levels that relax with FCF.
DEFAULT_WEIGHTS = (1.0, 1.3)
#: A coarse level is unstable when its step amplifies some mode more than the steps it
#: replaces, by more than this factor over the level's whole horizon (docs/tuning.md §3).
STABILITY_GROWTH = 10.0


# --------------------------------------------------------------------------------------
# Jacobian-vector products
# --------------------------------------------------------------------------------------


class _Linearization:
    """Jacobian-vector products of ``u -> propagator.step(u, t0, t1)`` at one state."""

    def __init__(self, propagator: Propagator, u, jvp: str):
        if jvp not in ("auto", "fd", "torch"):
            raise ValueError(f"`jvp` must be 'auto', 'fd' or 'torch', got {jvp!r}")
        self.prop = propagator
        self.torch = B.is_torch(u)
        if jvp == "torch" and not self.torch:
            raise ValueError("jvp='torch' needs a torch tensor state; pass jvp='fd' (or 'auto') for numpy states")
        self.mode = ("torch" if self.torch else "fd") if jvp == "auto" else jvp
        if self.torch:
            self.u = u.detach()
            import torch

            self.u_np = self.u.reshape(-1).cpu().numpy()
            eps = float(torch.finfo(self.u.dtype).eps)
        else:
            self.u = np.asarray(u)
            self.u_np = self.u.reshape(-1)
            eps = float(np.finfo(self.u.dtype).eps) if self.u.dtype.kind in "fc" else float(np.finfo(float).eps)
        self.shape = tuple(self.u.shape)
        self.d = int(self.u_np.size)
        self.checked = False  # (complex states: the step checked to be complex-differentiable, once)
        # central differences: error O(h^2) + rounding O(eps / h); h ~ eps^(1/3) balances them
        self.fd_step = eps ** (1.0 / 3.0) * max(1.0, _scaled_norm(self.u_np))

    def apply(self, times, V: np.ndarray) -> np.ndarray:
        """``J V`` for real directions ``V`` of shape (d, k); returns (d, k).

        ``J`` is the Jacobian of the composition of the steps ``times[0] -> times[1]
        -> ... -> times[-1]`` (one step for two times).
        """
        V = np.asarray(V)
        if np.iscomplexobj(V):
            return self.apply(times, V.real) + 1j * self.apply(times, V.imag)
        times = [float(x) for x in times]
        if not self.checked and np.iscomplexobj(self.u_np) and len(times) > 1:
            _check_complex_linear(self.prop, self.u, times[0], times[1])
        self.checked = True
        if V.shape[1] == 0:
            return np.zeros((self.d, 0))
        return self._torch_jvp(times, V) if self.mode == "torch" else self._fd(times, V)

    def _fd(self, times, V):
        norms = np.linalg.norm(V, axis=0)
        norms[norms == 0] = 1.0
        h = self.fd_step / norms  # per column: the perturbation has norm fd_step
        k = V.shape[1]
        P = (V * h).T  # (k, d)
        if self.torch:
            import torch

            D = torch.as_tensor(P, dtype=self.u.dtype, device=self.u.device).reshape((k,) + self.shape)
            U = torch.cat([self.u[None] + D, self.u[None] - D])
        else:
            D = P.reshape((k,) + self.shape).astype(np.result_type(self.u, np.float64))
            U = np.concatenate([self.u[None] + D, self.u[None] - D])
        with np.errstate(all="ignore"):  # an unstable step overflows: the caller sees non-finite values
            for t0, t1 in zip(times[:-1], times[1:]):
                U = _step_batch(self.prop, U, np.full(2 * k, t0), np.full(2 * k, t1))
            out = _to_numpy(U).reshape(2 * k, -1)
            return ((out[:k] - out[k:]) / (2.0 * h)[:, None]).T

    def _torch_jvp(self, times, V):
        """Forward mode through ``step_batch`` on ``k`` copies of ``u`` (one tangent each): one call.

        Falls back to one ``torch.func.jvp`` through ``step`` per column when the
        batched call cannot be differentiated.
        """
        import torch

        k = V.shape[1]
        T = torch.as_tensor(V.T.copy(), dtype=self.u.dtype, device=self.u.device).reshape((k,) + self.shape)
        steps = list(zip(times[:-1], times[1:]))

        def batched(X):
            for t0, t1 in steps:
                X = self.prop.step_batch(X, np.full(k, t0), np.full(k, t1))
            return X

        def single(x):
            for t0, t1 in steps:
                x = self.prop.step(x, t0, t1)
            return x

        U = self.u[None].expand((k,) + self.shape).clone()
        try:
            _, tangent = torch.func.jvp(batched, (U,), (T,))
            return _to_numpy(tangent).reshape(k, -1).T
        except Exception:  # noqa: BLE001 - the per-column path below reports a persistent failure
            pass
        cols = []
        for i in range(k):
            try:
                _, tangent = torch.func.jvp(single, (self.u,), (T[i],))
            except Exception as exc:  # noqa: BLE001 - re-raised with what to do
                raise RuntimeError(
                    f"torch.func.jvp through the propagator's step failed ({type(exc).__name__}: {exc}); "
                    "pass jvp='fd' to use finite differences instead") from exc
            cols.append(_to_numpy(tangent).reshape(-1))
        return np.stack(cols, axis=1)


def _check_complex_linear(prop, u, t0: float, t1: float) -> None:
    """Raise unless the step at the complex state ``u`` is complex-differentiable: its derivative along
    ``i v`` must be ``i`` times the one along ``v`` (a random real ``v``, central differences). The theory
    pairs the eigenvalues of a complex-linear Jacobian; a step built with ``conj``, ``.real``, ``.imag`` or
    ``abs`` is only real-linear, and its predictions would be wrong without a sign."""
    x = _to_numpy(u).reshape(-1)
    v = np.random.default_rng(0).standard_normal(x.size)
    v /= np.linalg.norm(v)
    eps = float(np.finfo(x.real.dtype).eps)
    h = eps ** (1.0 / 3.0) * max(1.0, _scaled_norm(x))
    def gap_at(h):
        P = np.stack([x + h * v, x - h * v, x + 1j * h * v, x - 1j * h * v])
        with np.errstate(all="ignore"):
            out = _to_numpy(_step_batch(prop, _as_states(P, u), np.full(4, t0), np.full(4, t1))).reshape(4, -1)
            a, b = (out[0] - out[1]) / (2 * h), (out[2] - out[3]) / (2 * h)
            return _scaled_norm(b - 1j * a), max(_scaled_norm(a), _scaled_norm(b))

    # a real-linear step leaves an O(1) gap at every difference size; the truncation error of a curved
    # holomorphic step (h^2 f''') shrinks fourfold at half the size: both sizes must show the gap
    gap, size = gap_at(h)
    if math.isfinite(gap) and math.isfinite(size) and gap > max(1e-6, 100 * eps ** (2.0 / 3.0)) * size:
        gap2, size2 = gap_at(h / 2)
        if not (math.isfinite(gap2) and gap2 > 0.5 * gap and gap2 > 1e-2 * size2):
            return
        raise ValueError(
            "the step is not complex-differentiable at this complex state (its derivative along i*v is not i "
            f"times the one along v: relative gap {gap / size:.2g}; does it use conj, .real, .imag or abs?). "
            "The tuner's theory needs a complex-linear Jacobian: pass the state as real numbers instead, its "
            "real and imaginary parts side by side (np.concatenate([u.real, u.imag])), with a step written for them")


def _step_batch(prop, U, t0, t1):
    """``prop.step_batch(U, t0, t1)`` checked as the solver checks it (array type, shape, no complex states for
    real ones): a propagator bug is named here, not read as a Jacobian."""
    out = prop.step_batch(U, t0, t1)
    check_batch(out, U, 0, "step" if type(prop).step_batch is Propagator.step_batch else "step_batch")
    return out


def _to_numpy(x) -> np.ndarray:
    if B.is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def jacobian(propagator: Propagator, u, t0: float, t1: float, *, jvp: str = "auto") -> np.ndarray:
    """Dense Jacobian of one step ``u -> propagator.step(u, t0, t1)`` at ``u``.

    Built from Jacobian-vector products, all columns in one batched call:
    central finite differences through ``step_batch`` (perturbations of norm
    ``eps^(1/3) max(1, |u|)``) for numpy states; for torch tensors
    (``jvp="auto"``) forward mode, ``torch.func.jvp`` through ``step_batch`` on
    copies of ``u`` (through ``step`` column by column if that fails).
    ``jvp="fd"`` forces finite differences. A state of any shape is flattened.

    Returns
    -------
    numpy.ndarray, shape (d, d), ``d = u.size``

    Examples
    --------
    >>> import numpy as np, mgrit
    >>> class Decay(mgrit.Propagator):
    ...     def step(self, u, t0, t1):
    ...         return u / (1.0 + (t1 - t0))
    >>> np.round(jacobian(Decay(), np.ones(2), 0.0, 1.0), 10)
    array([[0.5, 0. ],
           [0. , 0.5]])
    """
    _check_propagator(propagator)
    u = _check_state(u)
    _check_keeps_input(propagator, u, np.array([t0, t1], dtype=float))
    lin = _Linearization(propagator, u, jvp)
    return lin.apply((t0, t1), np.eye(lin.d))


# --------------------------------------------------------------------------------------
# Paired spectra of the fine and coarse steps
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Spectrum:
    """Eigenvalues of the fine step and of coarse steps at one state, paired by mode.

    A *step* ``(s, c)`` is ``c`` consecutive steps of the propagator, each over
    ``s`` fine intervals: ``(s, 1)`` is one step of the level with stride ``s``
    (``(1, 1)`` is the fine step ``Phi``), ``(s, m)`` the ``m`` steps of that
    level that one step of the next coarser level replaces.

    Attributes
    ----------
    index : int
        Fine grid index of the state.
    steps : tuple of (int, int)
        The steps, ``steps[0] == (1, 1)``.
    values : numpy.ndarray, shape (n_modes, len(steps)), complex
        Row ``j`` holds mode ``j``'s eigenvalue of every step: column 0 is the
        fine step's eigenvalue ``lam_j``, column ``i`` the paired eigenvalue of
        the Jacobian of ``steps[i]``.
    method : {"dense", "arnoldi"}
        Full eigendecomposition, or Ritz values of an Arnoldi process (large states).
    jvp : {"fd", "torch"}
        How the Jacobian-vector products were computed.
    pairing_defect : float
        How far the other steps' Jacobians are from diagonal in the fine step's
        eigenvectors (0 when they commute: a linear, autonomous problem).
    normal : bool
        The fine step's Jacobian is normal (orthogonal eigenvectors), to
        rounding. Always False for Arnoldi, which does not check it.
    vectors : numpy.ndarray or None, shape (d, n_modes)
        The fine step's eigenvectors (dense; unit columns) or Ritz vectors
        (Arnoldi), column ``j`` for mode ``j``.
    """

    index: int
    steps: tuple
    values: np.ndarray
    method: str
    jvp: str
    pairing_defect: float
    normal: bool
    vectors: np.ndarray | None = None

    @property
    def strides(self) -> tuple:
        """The strides of the single steps ``(s, 1)``."""
        return tuple(s for s, c in self.steps if c == 1)

    def step(self, stride: int, count: int = 1) -> np.ndarray:
        """The eigenvalues of ``count`` steps over ``stride`` fine intervals each, one per mode."""
        key = (int(stride), int(count))
        if key not in self.steps:
            raise KeyError(f"step {key} was not computed; available: {self.steps}")
        return self.values[:, self.steps.index(key)]

    def __getitem__(self, stride: int) -> np.ndarray:
        """The eigenvalues of one step over ``stride`` fine intervals, one per mode."""
        return self.step(stride, 1)


def _window(index: int, span: int, n: int) -> int:
    """Start of the interval of ``span`` fine intervals (aligned to ``span``) that holds fine point ``index``."""
    return min((index // span) * span, n - span)


def _finite_jacobian(J, where: str = ""):
    if not np.all(np.isfinite(J)):
        raise FloatingPointError("the linearized fine step is not finite (NaN or Inf in Jacobian-vector products)"
                                 f"{where}; check that the propagator is finite and stable on the fine grid there")
    return J


def _arnoldi(matvec, d: int, k: int, rng) -> tuple:
    """``k`` steps of Arnoldi with full reorthogonalization: returns ``Q`` (d, j), ``H`` (j, j)."""
    Q = np.zeros((d, k + 1))
    H = np.zeros((k + 1, k))
    q = rng.standard_normal(d)
    Q[:, 0] = q / np.linalg.norm(q)
    j = k
    for i in range(k):
        w = matvec(Q[:, i : i + 1])[:, 0]
        if np.iscomplexobj(w):
            raise ValueError("Arnoldi needs a real Jacobian; complex states need dense_max >= their size")
        for _ in range(2):  # classical Gram-Schmidt, twice
            c = Q[:, : i + 1].T @ w
            w = w - Q[:, : i + 1] @ c
            H[: i + 1, i] += c
        H[i + 1, i] = np.linalg.norm(w)
        if H[i + 1, i] <= 1e-12 * max(1.0, np.abs(H[: i + 1, : i + 1]).max()):
            j = i + 1  # an invariant subspace: the Ritz values are exact eigenvalues
            break
        Q[:, i + 1] = w / H[i + 1, i]
    return Q[:, :j], H[:j, :j]


def step_spectrum(
    propagator: Propagator,
    u,
    t,
    *,
    index: int = 0,
    strides: Sequence[int] = (1,),
    composites: Sequence = (),
    jvp: str = "auto",
    dense_max: int = 100,
    krylov: int = 24,
    seed: int = 0,
) -> Spectrum:
    """Paired eigenvalues of the fine step and of rediscretized coarse steps at state ``u``.

    A step ``(s, c)`` (``c`` steps over ``s`` fine intervals each, see
    :class:`Spectrum`) is linearized at ``u`` over the grid points
    ``t[k], t[k + s], ..., t[k + c s]``, where ``k`` is the start of the
    interval of ``c s`` fine intervals (aligned to ``c s``, clipped to the grid)
    that holds ``i = index``: the interval one step of the level with stride
    ``c s`` covers.

    States with ``d <= dense_max`` values: the dense Jacobians (:func:`jacobian`)
    give the fine eigenpairs ``J_1 V = V Lam``; mode ``j``'s eigenvalue of a
    step with Jacobian ``J`` is ``(V^{-1} J V)_{jj}``, exact when ``J`` commutes
    with ``J_1`` (the same one-step method with a larger step on a linear,
    autonomous problem; ``pairing_defect`` measures the rest). Larger states:
    ``krylov`` Arnoldi steps on ``J_1`` give Ritz pairs ``(theta_j, Q y_j)``,
    and the other steps' eigenvalues are the Rayleigh quotients
    ``y_j^H (Q^T J Q) y_j / |y_j|^2``.

    Parameters
    ----------
    propagator : Propagator
    u : array or tensor
        State at ``t[index]``.
    t : array_like
        The fine time grid.
    index : int
        Fine grid index of ``u``.
    strides : sequence of int
        Single steps over this many fine intervals (1 is always included).
    composites : sequence of (int, int)
        Steps ``(s, c)``: ``c`` steps over ``s`` fine intervals each.
    jvp : {"auto", "fd", "torch"}
        See :func:`jacobian`.
    dense_max : int
        Largest state size that gets dense eigenvalues.
    krylov : int
        Arnoldi steps (Krylov vectors) for larger states.
    seed : int
        Seed of the Arnoldi start vector.

    Returns
    -------
    Spectrum

    Examples
    --------
    Backward Euler on ``u' = -u`` with step ``h = 1/4``: one step ``1 / (1 + h)``,
    one step over two intervals ``1 / (1 + 2 h)``, two fine steps ``1 / (1 + h)^2``:

    >>> import numpy as np, mgrit
    >>> class Decay(mgrit.Propagator):
    ...     def step(self, u, t0, t1):
    ...         return u / (1.0 + (t1 - t0))
    >>> sp = step_spectrum(Decay(), np.ones(1), np.linspace(0, 1, 5), strides=(2,), composites=[(1, 2)])
    >>> sp.steps, np.round(sp.values.real, 8)
    (((1, 1), (2, 1), (1, 2)), array([[0.8       , 0.66666667, 0.64      ]]))
    """
    _check_propagator(propagator)
    u = _check_state(u)
    t = check_time_grid(t)
    n = t.shape[0] - 1
    _check_keeps_input(propagator, u, t)
    if not is_integer(index) or not 0 <= index <= n:
        raise ValueError(f"`index` must be an integer in 0..{n} (a point of `t`), got {index!r}")
    steps = _check_steps(strides, composites, n)
    _check_positive_int(dense_max, "dense_max", 1)
    _check_positive_int(krylov, "krylov", 2)
    lin = _Linearization(propagator, u, jvp)

    def times(step):
        s, c = step
        k = _window(int(index), s * c, n)
        return t[k : k + s * c + 1 : s]

    k1 = _window(int(index), 1, n)
    where = (f" over the fine step from t = {float(t[k1]):g} to {float(t[k1 + 1]):g} (points {k1} and {k1 + 1} of "
             f"`t`){' at a state of a sequential run from u0' if index else ''}")

    if lin.d <= dense_max:
        J1 = _finite_jacobian(lin.apply(times((1, 1)), np.eye(lin.d)), where)
        lam, V = np.linalg.eig(J1)
        scale = max(np.linalg.norm(J1) ** 2, 1e-300)
        normal = bool(np.linalg.norm(J1 @ J1.conj().T - J1.conj().T @ J1) <= 1e-8 * scale)
        well_conditioned = np.linalg.cond(V) < 1e10
        cols, defect = [lam], 0.0
        for step in steps[1:]:
            J = lin.apply(times(step), np.eye(lin.d))
            if not np.all(np.isfinite(J)):  # the step blew up: an unstable step
                cols.append(np.full(lin.d, np.inf, dtype=complex))
                continue
            with np.errstate(all="ignore"):  # a huge (unstable) step may overflow the norms: no defect then
                if well_conditioned:
                    M = np.linalg.solve(V, J @ V)
                else:  # (nearly) defective: Rayleigh quotients with the normalized eigenvectors
                    M = V.conj().T @ J @ V / np.sum(np.abs(V) ** 2, axis=0)[:, None]
                mu = np.diag(M).copy()
                rel = np.linalg.norm(M - np.diag(mu)) / max(np.linalg.norm(M), 1e-300)
            defect = max(defect, float(rel)) if np.isfinite(rel) else defect
            cols.append(mu)
        method = "dense"
    else:
        rng = np.random.default_rng(seed)
        Q, H = _arnoldi(lambda X: _finite_jacobian(lin.apply(times((1, 1)), X), where), lin.d,
                        min(int(krylov), lin.d), rng)
        lam, Y = np.linalg.eig(H)
        Y = Y / np.linalg.norm(Y, axis=0)
        cols, defect, normal = [lam], 0.0, False
        for step in steps[1:]:
            JQ = lin.apply(times(step), Q)
            if not np.all(np.isfinite(JQ)):  # the step blew up: an unstable step
                cols.append(np.full(lam.shape[0], np.inf, dtype=complex))
                continue
            with np.errstate(all="ignore"):
                C = Q.T @ JQ
                CY = C @ Y
                mu = np.einsum("ij,ij->j", Y.conj(), CY)
                rel = np.linalg.norm(CY - Y * mu, axis=0).max() / max(np.linalg.norm(C, 2), 1e-300)
            defect = max(defect, float(rel)) if np.isfinite(rel) else defect
            cols.append(mu)
        method = "arnoldi"
        V = Q @ Y
    values = np.stack([np.asarray(c, dtype=complex) for c in cols], axis=1)
    return Spectrum(int(index), steps, values, method, lin.mode, defect, normal, V)


# --------------------------------------------------------------------------------------
# The V-cycle on scalar modes (vectorized over modes and columns)
# --------------------------------------------------------------------------------------
# Level l has sizes[l] intervals; x has shape (sizes[l] + 1, B): B columns (a basis
# vector per column, for every mode), lam has shape (B,). g is the right-hand side
# (None: zero). The operations are those of mgrit.cycle's schedule on errors, with
# weighted C-relaxation (docs/theory.md §2-§4).


def _f_relax(x, g, lam, m):
    n = x.shape[0] - 1
    for j in range(1, min(m, n + 1)):
        cnt = (n - j) // m + 1
        new = lam * x[j - 1 : j - 1 + m * (cnt - 1) + 1 : m]
        x[j::m] = new if g is None else new + g[j::m]


def _c_relax(x, g, lam, m, w):
    c = (x.shape[0] - 1) // m
    if c == 0:
        return
    new = lam * x[m - 1 : m * c : m]
    if g is not None:
        new = new + g[m::m]
    x[m::m] = new if w == 1.0 else (1.0 - w) * x[m::m] + w * new


def _c_residual(x, g, lam, m):
    c = (x.shape[0] - 1) // m
    r = lam * x[m - 1 : m * c : m] - x[m::m]
    return r if g is None else r + g[m::m]


def _relax(x, g, lam, m, nrelax, w):
    for _ in range(nrelax):
        _f_relax(x, g, lam, m)
        _c_relax(x, g, lam, m, w)
    _f_relax(x, g, lam, m)


def _approximate_solve(l, g, lams, sizes, cfs, nrelax, weights):
    """Level ``l``'s system from a zero guess: one V-cycle ending with F-relaxation, exact on the coarsest."""
    lam = lams[l]
    y = np.zeros_like(g)
    if l == len(sizes) - 1:
        for i in range(1, sizes[l] + 1):
            y[i] = lam * y[i - 1] + g[i]
        return y
    m = cfs[l]
    _relax(y, g, lam, m, nrelax[l], weights[l])
    _correct(y, _c_residual(y, g, lam, m), l, lams, sizes, cfs, nrelax, weights)
    _f_relax(y, g, lam, m)  # the up-sweep's F-relaxation of this level
    return y


def _correct(x, res, l, lams, sizes, cfs, nrelax, weights):
    """Coarse-grid correction of level ``l`` from its C-point residuals ``res``."""
    g = np.zeros((sizes[l + 1] + 1, x.shape[1]), dtype=x.dtype)
    g[1:] = res
    x[cfs[l] :: cfs[l]] += _approximate_solve(l + 1, g, lams, sizes, cfs, nrelax, weights)[1:]


def _level_setup(lams, n, cf, relax, c_weight):
    lams = [np.atleast_1d(np.asarray(v)) for v in lams]
    real = all(v.dtype.kind in "biuf" or np.all(v.imag == 0) for v in lams)
    lams = [(v.real if np.iscomplexobj(v) else v).astype(float) if real else v.astype(complex) for v in lams]
    L = len(lams)
    if L < 2:
        raise ValueError("`lams` needs at least two levels (one level is sequential stepping)")
    K = lams[0].shape[0]
    if any(v.shape != (K,) for v in lams):
        raise ValueError("every level of `lams` needs one value per mode (equal 1-D shapes)")
    if not is_integer(n) or n < 1:
        raise ValueError(f"`n` must be an integer >= 1 (fine intervals), got {n!r}")
    # the rules of mgrit.solve (a cf of 2.7 used to be read as 2, a negative C-weight taken)
    check_levels(cf, L, 1, relax, c_weight)
    cfs = [int(c) for c in per_level(cf, L - 1, "cf")]
    nrelax = [parse_relax(r) for r in per_level(relax, L - 1, "relax")]
    weights = [float(w) for w in per_level(c_weight, L - 1, "c_weight")]
    sizes = [int(n)]
    for c in cfs:
        sizes.append(sizes[-1] // c)
    if sizes[-1] < 1:
        raise ValueError(f"{L} levels with cf {cfs} need more than n = {n} fine intervals")
    return lams, K, cfs, nrelax, weights, sizes


def _columns(lams, K, c):
    """Every mode's factor repeated for its ``c`` basis columns, and the identity blocks."""
    return [np.repeat(v, c) for v in lams], np.tile(np.eye(c, dtype=lams[0].dtype), (1, K))


def residual_matrices(lams, n: int, cf, relax="FCF", c_weight=1.0) -> np.ndarray:
    """Per scalar mode: the matrix mapping one cycle's fine C-point residuals to the next cycle's.

    Between two residual measurements the solver does the coarse-grid correction
    of a V-cycle and the next cycle's relaxation (docs/theory.md §4); on a
    linear problem the residuals ``r`` at the fine C-points then change by
    ``r <- P r``. Mode ``k`` steps with ``lams[l][k]`` on level ``l``.

    Parameters
    ----------
    lams : sequence of array_like, one per level (>= 2), each of shape (K,)
        One-step factors per level and mode, finest first.
    n : int
        Fine intervals.
    cf, relax, c_weight
        Per level (last repeats), as in :func:`mgrit.solve`.

    Returns
    -------
    numpy.ndarray, shape (K, N_c, N_c), ``N_c = n // cf[0]``
    """
    lams, K, cfs, nrelax, weights, sizes = _level_setup(lams, n, cf, relax, c_weight)
    m, c = cfs[0], sizes[1]
    cols, R = _columns(lams, K, c)
    x = np.zeros((sizes[0] + 1, K * c), dtype=lams[0].dtype)
    # the F-relaxed iterate whose C-point residuals are the unit vectors R
    lm, prev = cols[0] ** m, np.zeros(K * c, dtype=lams[0].dtype)
    for i in range(c):
        prev = lm * prev - R[i]
        x[(i + 1) * m] = prev
    _f_relax(x, None, cols[0], m)
    _correct(x, _c_residual(x, None, cols[0], m), 0, cols, sizes, cfs, nrelax, weights)
    _relax(x, None, cols[0], m, nrelax[0], weights[0])
    out = _c_residual(x, None, cols[0], m)
    return out.reshape(c, K, c).transpose(1, 0, 2)


def error_matrices(lams, n: int, cf, relax="FCF", c_weight=1.0) -> np.ndarray:
    """Per scalar mode: the C-point error propagation of one V-cycle (relax, coarse correction).

    The quantity of :func:`mgrit.theory.multilevel_matrix`, which it equals for
    one ``cf``, one relaxation and weight 1; here ``cf``, ``relax`` and
    ``c_weight`` may differ per level. Shapes as in :func:`residual_matrices`.
    """
    lams, K, cfs, nrelax, weights, sizes = _level_setup(lams, n, cf, relax, c_weight)
    m, c = cfs[0], sizes[1]
    cols, R = _columns(lams, K, c)
    x = np.zeros((sizes[0] + 1, K * c), dtype=lams[0].dtype)
    x[m::m] = R
    _relax(x, None, cols[0], m, nrelax[0], weights[0])
    _correct(x, _c_residual(x, None, cols[0], m), 0, cols, sizes, cfs, nrelax, weights)
    return x[m::m].reshape(c, K, c).transpose(1, 0, 2)


def cycle_factors(lams, n: int, cf, relax="FCF", c_weight=1.0) -> np.ndarray:
    """Residual reduction factor of one V-cycle per scalar mode: ``||P_k||_2``.

    ``P_k`` from :func:`residual_matrices`. For a propagator that is diagonal
    in an orthonormal basis shared by all levels (a normal fine step and
    commuting coarse steps), the solver's level-0 residual norm shrinks by at
    most ``max_k ||P_k||_2`` in every cycle after the first measured one.

    Examples
    --------
    Two levels: the residual and the error propagate alike, with the norm of
    docs/theory.md §6 (backward Euler, ``z = -0.1``, ``m = 4``, ``N_c = 8``, F):

    >>> from mgrit import theory
    >>> lam, mu = theory.dahlquist_factors(-0.1, 4)
    >>> round(float(cycle_factors([[lam], [mu]], 32, 4, "F")[0]), 10)
    0.0800035592
    """
    P = residual_matrices(lams, n, cf, relax, c_weight)
    if P.shape[1] == 0:
        return np.zeros(P.shape[0])
    return np.linalg.svd(P, compute_uv=False)[:, 0]  # theory.matrix_norm of every mode's matrix


def _scaled_norm(X) -> float:
    """2-norm of all entries of ``X``, computed as the solver's norms (:func:`mgrit._backend.row_norms`): no
    under- or overflow of the squares in the dtype of ``X`` (float32 states near 1e-20 or float64 ones near
    1e-170 or 1e200 give their true size, not 0, Inf or a norm off by the subnormal squares' lost digits)."""
    X = np.asarray(X)
    return float(B.row_norms(X.reshape(1, -1))[0])


def _cheap_norms(M):
    """Upper bounds of the 2-norms of a stack of matrices: ``min(||M||_F, sqrt(||M||_1 ||M||_inf))``."""
    A = np.abs(M)
    # scaled by each matrix's largest entry: squares and products of entries near 1e-170 underflowed to 0, a
    # "bound" of 0 that passed powers whose norm was 1e19 (and those near 1e170 overflowed)
    scale = A.max(axis=(1, 2), initial=0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        A = np.where(scale[:, None, None] > 0, A / scale[:, None, None], 0.0)
    fro = np.sqrt(np.sum(A * A, axis=(1, 2)))
    return scale * np.minimum(fro, np.sqrt(A.sum(axis=1).max(axis=1) * A.sum(axis=2).max(axis=1)))


def _exact_norm(M) -> float:
    """The largest 2-norm in a stack of matrices: SVDs in the order of the cheap bounds, while they can matter."""
    if M.shape[0] == 0 or M.shape[1] == 0:
        return 0.0
    if not np.all(np.isfinite(M)):  # (an SVD of Inf or NaN gives NaN, which max() would drop)
        return math.inf
    cheap = _cheap_norms(M)
    best = 0.0
    for k in np.argsort(-cheap, kind="stable"):
        if cheap[k] <= best:
            break
        best = max(best, float(np.linalg.svd(M[k], compute_uv=False)[0]))
    return best


def _below(M, bound: float) -> bool:
    """Every matrix of the stack has 2-norm ``<= bound`` (cheap bounds first, SVDs only where they fail)."""
    if not np.all(np.isfinite(M)):
        return False
    cheap = _cheap_norms(M)
    for k in np.argsort(-cheap, kind="stable"):
        if cheap[k] <= bound:
            return True
        if float(np.linalg.svd(M[k], compute_uv=False)[0]) > bound:
            return False
    return True


def power_cycles(P, reduction: float, qmax: int = 1000, growth: float = 1.0):
    """A ``q`` with ``max_k ||P_k^q||_2 growth^q <= reduction`` (and not at ``q - 1``), and the rate
    ``(that bound)^(1/q)``: the smallest such ``q`` when the norms decrease with ``q``; they need not (a
    non-normal ``P``), and then the doubling and bisection may return a later crossing (100 where 97 already
    met it, on a 5 x 5 example): a safe count of cycles, not always the least.

    ``P`` is a stack of residual matrices (:func:`residual_matrices`): after
    ``q`` cycles the residual has shrunk by at most ``max_k ||P_k^q||_2``, which
    can be far below ``||P||^q`` (one cycle may even amplify the residual of a
    convergent iteration). ``growth >= 1`` scales every cycle (an
    extrapolation factor). Powers by repeated squaring, a doubling and a
    binary search; the norms are checked mode by mode with cheap upper bounds
    and exact 2-norms where those do not suffice.

    Returns ``(q, rate)``, or ``(None, rate over qmax cycles)`` when ``qmax``
    cycles do not suffice (``inf`` when the powers overflow). A mode whose
    one-cycle bound ``f_k`` already gives ``f_k^q <= reduction`` is dropped
    from the powers; it enters the rate with ``f_k``.

    >>> P = np.array([[[0.0, 0.0], [2.0, 0.0]]])  # norm 2, but P^2 = 0
    >>> power_cycles(P, 1e-8)
    (2, 0.0)
    """
    P = np.asarray(P)
    if P.ndim != 3 or P.shape[1] != P.shape[2]:
        raise ValueError(f"`P` must be a stack of square matrices, shape (modes, n, n), got {P.shape}")
    if isinstance(reduction, bool) or not isinstance(reduction, (int, float, np.integer, np.floating)) \
            or not 0.0 < reduction < 1.0:
        raise ValueError(f"`reduction` must be a number in (0, 1), got {reduction!r}")
    if isinstance(qmax, bool) or not isinstance(qmax, (int, np.integer)) or qmax < 1:
        raise ValueError(f"`qmax` must be an integer >= 1, got {qmax!r}")
    if P.shape[1] == 0:
        return 1, 0.0
    f1 = _exact_norm(P) * growth
    if not math.isfinite(f1):  # Inf or NaN in the matrices (an overflowing step): no number of cycles
        return None, math.inf
    if f1 == 0.0:
        return 1, 0.0
    qcap = None  # ||P^q|| growth^q <= f1^q: q = qcap cycles certainly suffice
    if f1 < 1.0:
        qcap = max(1, math.ceil(math.log(reduction) / math.log(f1) - 1e-12))
        if qcap == 1:
            return 1, f1
    powers = [(1, P)]  # P^(2^i)

    def power(q):
        while 2 * powers[-1][0] <= q:  # every P^(2^i) with 2^i <= q
            with np.errstate(over="ignore", invalid="ignore"):
                powers.append((2 * powers[-1][0], powers[-1][1] @ powers[-1][1]))
        M, rest = None, q
        for e, Pe in reversed(powers):
            if e <= rest:
                M = Pe if M is None else M @ Pe
                rest -= e
        return M

    def bound(q):
        return reduction * growth ** -q  # (growth**q overflowed: OverflowError at growth 2.1, q 1000)

    def rate_of(M, q):
        nrm = _exact_norm(M) if np.all(np.isfinite(M)) else math.inf
        return 0.0 if nrm == 0.0 else nrm ** (1.0 / q) * growth

    fk = np.minimum(_cheap_norms(P), f1 / growth) * growth  # per-mode bounds of one cycle

    pruned = [0.0]  # the largest per-cycle bound of a dropped mode: its rate is at most that

    def prune(q):
        """Drop the modes with fk^q <= bound(q): they meet the bound for every q' >= q."""
        nonlocal fk, powers
        with np.errstate(divide="ignore"):
            alive = q * np.log(np.maximum(fk, 1e-300)) > math.log(reduction)
        if not np.all(alive):
            pruned[0] = max(pruned[0], float(fk[~alive].max()))
            fk = fk[alive]
            powers = [(e, Pe[alive]) for e, Pe in powers]

    lo = 1  # P^lo does not meet the bound (f1 > reduction)
    while True:
        if lo + 1 <= qmax:
            prune(lo + 1)  # (every q still considered is > lo)
            if powers[0][1].shape[0] == 0:  # every mode meets the bound from lo + 1 on
                hi, Mhi = lo + 1, powers[0][1]
                break
        if qcap is not None and qcap <= min(2 * lo, qmax):
            hi, Mhi = qcap, power(qcap)
            break
        if 2 * lo > qmax:
            Mq = power(qmax)
            if qmax > lo and _below(Mq, bound(qmax)):
                hi, Mhi = qmax, Mq
                break
            return None, max(rate_of(Mq, qmax) if Mq.shape[0] else 0.0, pruned[0])
        M = power(2 * lo)
        if not np.all(np.isfinite(M)):
            return None, math.inf
        if _below(M, bound(2 * lo)):
            hi, Mhi = 2 * lo, M
            break
        lo *= 2
    while hi - lo > 1:
        prune(lo + 1)
        mid = (lo + hi) // 2
        Mm = power(mid)
        if Mm.shape[0] == 0 or _below(Mm, bound(mid)):
            hi, Mhi = mid, Mm
        else:
            lo = mid
    return hi, max(rate_of(Mhi, hi) if Mhi.shape[0] else 0.0, pruned[0])


# --------------------------------------------------------------------------------------
# The expected factor: the solve itself, on an affine model of the problem
# --------------------------------------------------------------------------------------
# Level l of the simulated hierarchy holds an iterate of shape (sizes[l] + 1, K): K model
# coordinates (modes, or the flattened state) per time point. Its step over interval k (from
# point k - 1 to k) is x -> A[k] x + c[k] (A: one diagonal for all intervals, shape (K,), or one
# matrix per interval); the schedule is mgrit.cycle's (docs/theory.md §3-§4), on states.

#: Most entries (intervals times the squared state size) of a trajectory model's Jacobians;
#: larger problems are modelled on a shorter leading part of the grid (docs/tuning.md §7).
MAX_MODEL_ENTRIES = 2**23
#: Modes whose coefficients in ``u0`` and in every step's forcing stay below this fraction
#: of the largest are left out of a modal model (docs/tuning.md §7).
MODE_CONTENT_FLOOR = 1e-12
#: A simulated solve ends at the rounding level when its last residual is at most this multiple
#: of ``eps`` times the norm of the states at the fine C-points (docs/tuning.md §7).
FLOOR_MARGIN = 10.0
#: A linearized model holds while its iterate stays within this multiple of the largest
#: reference state from the reference trajectory (docs/tuning.md §7).
LINEARIZATION_RANGE = 4.0
#: A reference run at one stride is kept when it agrees with the run at half that stride to this fraction
#: of the largest state (max-norm), far inside LINEARIZATION_RANGE; else the stride is halved (docs/tuning.md §7).
REFERENCE_AGREEMENT = 1e-2


@dataclass(frozen=True, eq=False)
class _AffineModel:
    """The propagator as affine maps ``x -> A x + c`` per stride, in model coordinates (internal).

    ``steps[s] = (A, c)`` for one step over ``s`` fine intervals: ``A`` of
    shape (K,) (diagonal, every interval) or (n // s + 1, K, K) (one matrix per
    interval, row 0 unused), ``c`` of shape (n // s + 1, K) (row ``k`` belongs to
    the interval from fine point ``(k - 1) s`` to ``k s``). ``x0`` is ``u0``;
    ``basis`` (d, K) maps model coordinates to the state for the residual norm
    (None: they are the flattened state). ``n`` fine intervals are covered.
    The arrays have the precision of the solver's states, whose machine
    epsilon is ``eps``: the simulated solve rounds like the solver.
    ``reference`` (n + 1, K) holds the states a linearized model is valid
    near (None: an affine model, valid everywhere).
    """

    kind: str
    n: int
    x0: np.ndarray
    steps: dict
    basis: np.ndarray | None
    description: str
    eps: float = float(np.finfo(np.float64).eps)
    reference: np.ndarray | None = None

    def norm(self, R) -> float:
        """Temporal 2-norm of the spatial 2-norms of the residuals ``R`` (n_c, K)."""
        X = R if self.basis is None else R @ self.basis.T
        return _scaled_norm(X)


class _SimulatedSolve:
    """:func:`mgrit.solve`'s V-cycle schedule (``skip``, the default initial guess: ``u0`` everywhere,
    residuals in the down-sweep) on an :class:`_AffineModel` (internal)."""

    def __init__(self, model, sizes, cfs, nrelax, weights):
        self.sizes, self.cfs, self.nrelax, self.weights = list(sizes), list(cfs), list(nrelax), list(weights)
        L = len(sizes)
        stride, self.A, self.c = 1, [], []
        for l in range(L):
            A, c = model.steps[stride]
            self.A.append(A if A.ndim == 1 else A[: sizes[l] + 1])
            self.c.append(c[: sizes[l] + 1])
            if l < L - 1:
                stride *= cfs[l]
        dtype = np.result_type(model.x0, *self.A, *self.c)
        self.u, self.v, self.g = [None] * L, [None] * L, [None] * L
        self.u[0] = np.empty((sizes[0] + 1, model.x0.shape[0]), dtype=dtype)
        self.u[0][:] = model.x0

    def _phi(self, l, j, m, cnt, X, g=True):
        """The steps of level ``l`` into points ``j, j + m, ..., j + (cnt - 1) m`` from ``X`` (+ ``g``)."""
        sl = slice(j, j + m * (cnt - 1) + 1, m)
        A = self.A[l]
        out = A * X if A.ndim == 1 else np.matmul(A[sl], X[:, :, None])[:, :, 0]
        out += self.c[l][sl]
        if g and self.g[l] is not None:
            out += self.g[l][sl]
        return out

    def f_relax(self, l):
        u, m, n = self.u[l], self.cfs[l], self.sizes[l]
        for j in range(1, min(m, n + 1)):
            cnt = (n - j) // m + 1
            u[j::m] = self._phi(l, j, m, cnt, u[j - 1 : j - 1 + m * (cnt - 1) + 1 : m])

    def c_relax(self, l):
        u, m, w = self.u[l], self.cfs[l], self.weights[l]
        cnt = self.sizes[l] // m
        if cnt:
            new = self._phi(l, m, m, cnt, u[m - 1 : m * cnt : m])
            u[m::m] = new if w == 1.0 else (1.0 - w) * u[m::m] + w * new

    def c_residual(self, l):
        u, m = self.u[l], self.cfs[l]
        cnt = self.sizes[l] // m
        return self._phi(l, m, m, cnt, u[m - 1 : m * cnt : m]) - u[m::m]

    def inject(self, l, r=None):
        """Injection to level ``l + 1``; with residuals ``r`` the FAS right-hand side, else a zero one."""
        v = self.u[l][:: self.cfs[l]].copy()
        self.v[l + 1], self.u[l + 1] = v, v.copy()
        if r is None:
            self.g[l + 1] = None
            return
        g = np.zeros_like(v)
        if v.shape[0] > 1:
            g[1:] = r + v[1:] - self._phi(l + 1, 1, 1, v.shape[0] - 1, v[:-1], g=False)
        self.g[l + 1] = g

    def correct(self, l):
        self.u[l][self.cfs[l] :: self.cfs[l]] += self.u[l + 1][1:] - self.v[l + 1][1:]

    def sequential(self, l):
        u, A, n = self.u[l], self.A[l], self.sizes[l]
        h = self.c[l][1 : n + 1] if self.g[l] is None else self.c[l][1 : n + 1] + self.g[l][1 : n + 1]
        if A.ndim == 1:  # every mode is a first-order recursion u[k] = a u[k - 1] + h[k]
            from scipy.signal import lfilter

            for j in range(u.shape[1]):
                u[1:, j] = lfilter([1.0], [1.0, -A[j]], h[:, j], zi=np.atleast_1d(A[j] * u[0, j]))[0]
            return
        u[1 : n + 1] = _affine_recursion(A[1 : n + 1], h, u[0])

    def cycle(self, l, skip):
        """One V-cycle from level ``l`` (mgrit.cycle.cycle); the level-0 C-point residuals, or None."""
        if l == len(self.sizes) - 1:
            self.sequential(l)
            return None
        r = None
        if skip:
            self.inject(l)
        else:
            for _ in range(self.nrelax[l]):
                self.f_relax(l)
                self.c_relax(l)
            self.f_relax(l)
            r = self.c_residual(l)
            self.inject(l, r)
        self.cycle(l + 1, skip)
        if l + 1 < len(self.sizes) - 1:
            self.f_relax(l + 1)
        self.correct(l)
        return r


def _affine_recursion(A, h, x0):
    """``x_k = A_k x_{k-1} + h_k`` for ``k = 1..n`` from ``x_0`` (``A``: (n, d, d), ``h``: (n, d)): ``x_1..x_n``.

    Small states go in chunks of about ``sqrt(n)`` steps: every chunk from a
    zero start together with the product of its maps (one batched product per
    step of a chunk), then the chunks' starts in sequence; ``2 sqrt(n)`` batched
    operations instead of ``n`` small ones.
    """
    n, d = h.shape
    dtype = np.result_type(A, h, x0)
    if n <= 64 or d > 32:
        out, x = np.empty((n, d), dtype=dtype), x0
        for k in range(n):
            x = A[k] @ x + h[k]
            out[k] = x
        return out
    b = math.isqrt(n)
    nc = -(-n // b)
    Ac = np.broadcast_to(np.eye(d, dtype=dtype), (nc * b, d, d)).copy()
    hc = np.zeros((nc * b, d), dtype=dtype)
    Ac[:n], hc[:n] = A, h
    Ac, hc = Ac.reshape(nc, b, d, d), hc.reshape(nc, b, d)
    y, prod = np.empty((nc, b, d), dtype=dtype), np.empty((nc, b, d, d), dtype=dtype)
    y[:, 0], prod[:, 0] = hc[:, 0], Ac[:, 0]
    for j in range(1, b):
        y[:, j] = np.matmul(Ac[:, j], y[:, j - 1, :, None])[:, :, 0] + hc[:, j]
        prod[:, j] = np.matmul(Ac[:, j], prod[:, j - 1])
    starts, x = np.empty((nc, d), dtype=dtype), x0
    for c in range(nc):
        starts[c] = x
        x = prod[c, -1] @ x + y[c, -1]
    out = y + np.matmul(prod, starts[:, None, :, None])[:, :, :, 0]
    return out.reshape(nc * b, d)[:n]


def _simulate(model, sizes, cfs, nrelax, weights, *, reduction, max_iter, skip=True):
    """``mgrit.solve(..., tol=reduction, tol_type="rel", max_iter=max_iter, skip=skip)`` on the model.

    Returns the residual norms (None for the skipped cycle), whether it
    converged, the rounding level of the last one (``eps`` times the
    temporal norm of the states at the fine C-points), and whether the
    iterate left the range of a linearized model: some fine C-point farther
    from the reference state than :data:`LINEARIZATION_RANGE` times the
    largest reference state (in the max-norm). It stops like the solver (the
    first residual ``<= reduction`` times the first measured one, or after
    ``max_iter`` cycles), and also, not converged, when a residual is not
    finite or the iterate leaves that range. A residual that grows for a while
    does not end it: the solver converges through such transients (a growing
    problem's residual peaked 1e7 times its first and then reached the
    tolerance in the cycles the theory predicts), unless it exceeds
    ``reduction / eps`` times the first: the rounding of states that large
    exceeds the tolerance. Also returns the largest value the iterate held on
    any level (``peak``: where an affine step's model was used).
    """
    sim = _SimulatedSolve(model, sizes, cfs, nrelax, weights)
    res, first, converged, left, peak = [], None, False, False, 0.0
    m = cfs[0]
    ref = None if model.reference is None else model.reference[m : sizes[0] + 1 : m]
    reach = None if ref is None else LINEARIZATION_RANGE * max(float(np.max(np.abs(model.reference))), 1e-300)
    with np.errstate(all="ignore"):  # a diverging model overflows: its residual is then not finite
        for k in range(max_iter):
            r = sim.cycle(0, skip and k == 0)
            peak = max([peak] + [float(np.max(np.abs(u), initial=0.0)) for u in sim.u if u is not None])
            if ref is not None and not float(np.max(np.abs(sim.u[0][m::m] - ref), initial=0.0)) <= reach:
                res.append(None if r is None else model.norm(r))
                left = True
                break
            if r is None:
                res.append(None)
                continue
            nr = model.norm(r)
            res.append(nr)
            if not math.isfinite(nr):
                break
            first = nr if first is None else first
            if nr <= reduction * first:
                converged = True
                break
            if nr > reduction / model.eps * first:
                break
        floor = model.eps * model.norm(sim.u[0][m::m])
    return res, converged, floor, left, peak


def average_factor(residuals) -> float:
    """The average residual reduction per cycle of a residual history: ``(r_last / r_first)^(1 / (k - 1))``.

    Over the ``k`` residuals that were measured (the skipped first cycle has
    none, ``None``): the measured factor of docs/tuning.md §7, which
    ``Candidate.expected`` predicts. ``inf`` when a residual is not finite, 0
    when the first one is 0, NaN with fewer than two.

    >>> round(average_factor([None, 1.0, 0.1, 0.001]), 10)
    0.0316227766
    """
    r = [float(x) for x in residuals if x is not None]
    if not all(math.isfinite(x) for x in r):
        return math.inf
    if r and r[0] == 0.0:
        return 0.0
    if len(r) < 2:
        return math.nan
    return (r[-1] / r[0]) ** (1.0 / (len(r) - 1))


def _precision(u0):
    """``(real dtype, complex dtype)`` of the model for the states of a solve from ``u0``."""
    single = _to_numpy(u0).dtype in (np.float32, np.complex64)
    return (np.float32, np.complex64) if single else (np.float64, np.complex128)


def _cast_model(model, real: bool, u0):
    """``model`` with its arrays in the precision of the states of ``u0`` (``real``: real arrays)."""
    rdt, cdt = _precision(u0)
    dt = rdt if real else cdt
    steps = {s: (A.astype(dt), c.astype(dt)) for s, (A, c) in model.steps.items()}
    basis = None if model.basis is None else model.basis.astype(dt)
    ref = None if model.reference is None else model.reference.astype(dt)
    return _AffineModel(model.kind, model.n, model.x0.astype(dt), steps, basis, model.description,
                        float(np.finfo(rdt).eps), ref)


def _as_states(X: np.ndarray, like):
    """Rows of ``X`` (k, d) as a stack of states shaped and typed like ``like``."""
    shape = (X.shape[0],) + tuple(like.shape)
    if B.is_torch(like):
        import torch

        return torch.as_tensor(X.reshape(shape), dtype=like.dtype, device=like.device)
    return np.ascontiguousarray(X.reshape(shape)).astype(like.dtype, copy=False)


def _steps(propagator, X: np.ndarray, t0, t1, like) -> np.ndarray:
    """``step_batch`` on the rows of ``X`` (flattened states), flattened."""
    if X.shape[0] == 0:
        return np.zeros_like(X)
    with np.errstate(all="ignore"):  # an unstable step overflows: the model then diverges
        out = _step_batch(propagator, _as_states(X, like), np.asarray(t0, dtype=float), np.asarray(t1, dtype=float))
    return _to_numpy(out).reshape(X.shape[0], -1)


def _batch_jacobians(propagator, X, t0, t1, like, mode):
    """The Jacobians (k, d, d) of the steps ``t0[i] -> t1[i]`` at the states ``X[i]``, and their values (k, d).

    Central differences through ``step_batch`` (perturbation of norm
    ``eps^(1/3) max(1, |x_i|)`` per row, as :func:`jacobian`) or, for torch
    states with ``mode="torch"``, one ``torch.func.jvp`` through ``step_batch``
    per direction (finite differences if that fails).
    """
    k, d = X.shape
    if mode == "torch":
        import torch

        U = _as_states(X, like)
        tt0, tt1 = np.asarray(t0, dtype=float), np.asarray(t1, dtype=float)
        try:
            J = np.empty((k, d, d))
            F = None
            for j in range(d):
                T = torch.zeros_like(U).reshape(k, d)
                T[:, j] = 1.0
                out, tangent = torch.func.jvp(lambda V: propagator.step_batch(V, tt0, tt1), (U,),
                                              (T.reshape(U.shape),))
                J[:, :, j] = _to_numpy(tangent).reshape(k, d)
                F = _to_numpy(out).reshape(k, d) if F is None else F
            return J, F
        except Exception:  # noqa: BLE001 - finite differences below
            pass
    if B.is_torch(like):
        import torch

        eps = float(torch.finfo(like.dtype).eps)
    else:
        eps = float(np.finfo(like.dtype).eps) if like.dtype.kind == "f" else float(np.finfo(float).eps)
    h = eps ** (1.0 / 3.0) * np.maximum(1.0, [_scaled_norm(x) for x in X])
    F = _steps(propagator, X, t0, t1, like)
    J = np.empty((k, d, d))
    chunk = max(1, min(d, (1 << 18) // max(2 * k, 1)))
    t0, t1 = np.asarray(t0, dtype=float), np.asarray(t1, dtype=float)
    for j0 in range(0, d, chunk):
        js = range(j0, min(d, j0 + chunk))
        P = []
        for sign in (1.0, -1.0):
            for j in js:
                Y = X.copy()
                Y[:, j] += sign * h
                P.append(Y)
        out = _steps(propagator, np.concatenate(P), np.tile(t0, 2 * len(js)), np.tile(t1, 2 * len(js)), like)
        half = len(js) * k
        for i, j in enumerate(js):
            J[:, :, j] = (out[i * k : (i + 1) * k] - out[half + i * k : half + (i + 1) * k]) / (2.0 * h[:, None])
    return J, F


def _reference_trajectory(propagator, u0, t, spectrum0):
    """Approximate solution at every point of ``t`` (rows, flattened), or None when the run blows up.

    A coarse sequential run (the largest stable single-step stride of
    ``spectrum0`` that is at most ``N^(1/3)``, halved if the run blows up or
    disagrees with the run at half its stride by more than
    :data:`REFERENCE_AGREEMENT`), then the fine steps from every point of the
    run to the next, batched: ``N / s`` sequential steps (``2 N / s`` more for
    the check) and ``s - 1`` batched calls for stride ``s`` (docs/tuning.md §7).
    """
    n = t.shape[0] - 1
    max_stride = max(1, int(round(n ** (1.0 / 3.0))))
    idx, states = _coarse_run(propagator, u0, t, _run_stride(spectrum0, n, 1, max_stride=max_stride))
    # checked against the run at half the stride, halved until the two agree: a chaotic problem's coarse run
    # drifts from the fine trajectory (Lorenz over 20 time units: 26 off at stride 2, where the states reach
    # 48), and the simulated solve then "left the linearization" for settings that converge
    while len(states) == len(idx) and len(idx) > 1 and idx[1] - idx[0] > 1:
        idx2, states2 = _coarse_run(propagator, u0, t, (idx[1] - idx[0]) // 2)
        if len(states2) < len(idx2):
            return None
        at = dict(zip(idx2, states2))
        common = [(_to_numpy(a).reshape(-1), _to_numpy(at[i]).reshape(-1)) for i, a in zip(idx, states) if i in at]
        scale = max(float(np.max(np.abs(b))) for _, b in common)
        gap = max(float(np.max(np.abs(a - b))) for a, b in common)
        idx, states = idx2, states2
        if gap <= REFERENCE_AGREEMENT * max(scale, 1e-300):
            break
    if len(states) < len(idx):
        return None
    out = np.empty((n + 1, int(np.prod(tuple(u0.shape), dtype=int))),
                   dtype=np.result_type(_to_numpy(u0).dtype, np.float64))
    out[idx] = np.stack([_to_numpy(s).reshape(-1) for s in states])
    stride = idx[1] - idx[0] if len(idx) > 1 else 1
    base = np.asarray(idx)
    for j in range(1, stride):
        pts = base[base + j <= n] + j
        if pts.size:
            out[pts] = _steps(propagator, out[pts - 1], t[pts - 1], t[pts], u0)
    return out if np.all(np.isfinite(out)) else None


#: Relative size of the perturbations that re-linearize a time-invariant step for the modal model
#: (exact differences for an affine step, whatever their size; docs/tuning.md §7).
MODAL_PERTURBATION = 1e-2


def _difference_columns(propagator, x, t0, t1, D, like):
    """``J D`` for the step ``t0 -> t1`` at ``x`` by central differences of size ``1e-2 max(1, |x|)``
    along the (unit) columns of ``D`` (real and imaginary parts apart): exact up to rounding when the step is affine."""
    if np.iscomplexobj(D):
        return (_difference_columns(propagator, x, t0, t1, D.real, like)
                + 1j * _difference_columns(propagator, x, t0, t1, D.imag, like))
    k = D.shape[1]
    norms = np.linalg.norm(D, axis=0)
    norms[norms == 0] = 1.0
    h = MODAL_PERTURBATION * max(1.0, _scaled_norm(x)) / norms
    P = (D * h).T
    out = _steps(propagator, np.concatenate([x[None] + P, x[None] - P]), np.full(2 * k, t0), np.full(2 * k, t1), like)
    return ((out[:k] - out[k:]) / (2.0 * h)[:, None]).T


def _modal_model(propagator, u0, t, spectrum0, strides, n):
    """The time-invariant model in the fine step's eigenbasis (docs/tuning.md §7).

    Dense states are linearized again with larger differences (exact for an
    affine step, so that modes absent from the problem stay absent): the
    eigenpairs ``J_1 V = V Lam`` and mode ``j``'s factor ``(V^{-1} J_s V)_{jj}``
    of every stride ``s``. Arnoldi states keep the Ritz pairs of
    ``spectrum0``. ``c = V^+ Psi_s(u0) - mu_s (V^+ u0)`` per interval is the
    affine part (time-dependent forcing), ``V^+`` the inverse (least squares
    for Ritz vectors). Modes whose coefficients in ``u0`` and in every forcing
    stay below :data:`MODE_CONTENT_FLOOR` of the largest are left out.
    """
    x = _to_numpy(u0).reshape(-1)
    if spectrum0.method == "dense":
        d = x.shape[0]
        with np.errstate(all="ignore"):
            J1 = _difference_columns(propagator, x, t[0], t[1], np.eye(d), u0)
        if not np.all(np.isfinite(J1)):
            return None
        lam, V = np.linalg.eig(J1)
        if np.linalg.cond(V) >= 1e8:  # (nearly) defective: no modal model
            return None
        lams = {1: lam}
        for s in strides:
            if s != 1 and s <= t.shape[0] - 1:
                with np.errstate(all="ignore"):
                    W = _difference_columns(propagator, x, t[0], t[s], V, u0)
                    lams[s] = np.diag(np.linalg.solve(V, W)) if np.all(np.isfinite(W)) else np.full(d, np.inf)
            elif s != 1:
                lams[s] = spectrum0[s]
    else:
        V = np.asarray(spectrum0.vectors)
        lams = {s: spectrum0[s] for s in strides}
    real = (not np.iscomplexobj(V) and not np.iscomplexobj(x)
            and all(np.all(np.imag(v) == 0) for v in lams.values()))
    dtype = np.float64 if real else np.complex128
    V = V.astype(dtype)
    lams = {s: (np.real(v) if real else v).astype(dtype) for s, v in lams.items()}
    square = V.shape[0] == V.shape[1]

    def coords(Y):  # (d, k) states -> (K, k) coordinates
        Y = Y.astype(dtype)
        return np.linalg.solve(V, Y) if square else np.linalg.lstsq(V, Y, rcond=None)[0]

    x0 = coords(x[:, None])[:, 0]
    forcing, content = {}, np.abs(x0)
    for s in strides:
        ns = n // s
        ts = t[: ns * s + 1 : s]
        P = _steps(propagator, np.repeat(x[None], ns, axis=0), ts[:-1], ts[1:], u0)
        c = np.zeros((ns + 1, V.shape[1]), dtype=dtype)
        with np.errstate(all="ignore"):
            c[1:] = coords(P.T).T - lams[s][None, :] * x0[None, :]
        forcing[s] = c
        content = np.maximum(content, np.nan_to_num(np.abs(c).max(axis=0), nan=np.inf))
    keep = content > MODE_CONTENT_FLOOR * content.max() if content.max() > 0 else np.arange(V.shape[1]) == 0
    steps = {s: (lams[s][keep], forcing[s][:, keep]) for s in strides}
    what = "eigenvectors" if square else "Ritz vectors"
    model = _AffineModel("modal", int(n), x0[keep], steps, V[:, keep],
                         f"modal: {int(keep.sum())} of {V.shape[1]} modes ({what}) carry u0 or forcing")
    return _cast_model(model, real, u0)


def _trajectory_model(propagator, u0, t, spectrum0, strides, n, jvp):
    """The linearization along a reference trajectory: one affine map per interval and stride
    (docs/tuning.md §7), or None when the reference run blows up."""
    traj = _reference_trajectory(propagator, u0, t[: n + 1], spectrum0)
    if traj is None:
        return None
    mode = ("torch" if B.is_torch(u0) else "fd") if jvp == "auto" else jvp
    steps = {}
    d = traj.shape[1]
    for s in strides:
        ns = n // s
        if ns < 1:
            continue
        X = traj[0 : (ns - 1) * s + 1 : s]
        J, F = _batch_jacobians(propagator, X, t[0 : (ns - 1) * s + 1 : s], t[s : ns * s + 1 : s], u0, mode)
        A = np.zeros((ns + 1, d, d))
        c = np.zeros((ns + 1, d))
        A[1:] = J
        with np.errstate(all="ignore"):
            c[1:] = F - np.matmul(J, X[:, :, None])[:, :, 0]
        steps[s] = (A, c)
    model = _AffineModel("trajectory", int(n), traj[0].copy(), steps, None,
                         "linearized along a reference trajectory", reference=traj)
    return _cast_model(model, True, u0)


# --------------------------------------------------------------------------------------
# Candidates and the chosen settings
# --------------------------------------------------------------------------------------


def _short(values) -> str:
    """Per-level values joined by "/", a repeated last value shown once: (16, 2, 2) -> "16/2"."""
    v = [str(x) for x in values]
    while len(v) > 1 and v[-1] == v[-2]:
        v.pop()
    return "/".join(v)


@dataclass(frozen=True, eq=False)
class Candidate:
    """One setting the chooser evaluated.

    Attributes
    ----------
    cf : tuple of int
        Coarsening factor of every level but the coarsest.
    levels : int
        Number of levels.
    relax : tuple of str
        Relaxation of every level but the coarsest.
    c_weight : float
        C-relaxation weight (1.0 when no level relaxes with C-points).
    min_coarse : int
    factor : float
        Predicted bound of one cycle's residual reduction, ``max ||P||_2``
        (``inf`` when unstable; it may exceed 1 for a convergent setting).
    rate : float
        Predicted average reduction per cycle over the cycles needed:
        ``max ||P^q||_2^(1/q)`` (``inf`` when it does not converge).
    cycles : int or None
        Predicted cycles to reduce the residual by the chooser's ``reduction``,
        ``2 + q`` (XBraid's skipped first cycle and the cycle that measures the
        first residual included; ``1 + q`` with ``skip=False``, whose first cycle
        measures it); None when it does not converge.
    time : float
        Predicted time to that tolerance on the chooser's ``ranks``
        (:func:`mgrit.model.predict`) for ``cycles`` cycles, or for
        ``expected_cycles`` where the simulated solve needs more (``max_iter``
        where it does not reach the tolerance); ``inf`` when it is predicted
        not to converge.
    stable : bool
        Every coarse level's step is stable (docs/tuning.md §3).
    meets_target : bool
        Stable, ``rate <= target``, and the predicted cycles after the first
        measured residual at most the ``ceil(log(reduction) / log(target))``
        that a factor ``target`` per cycle needs (a setting exact only after
        many cycles has a rate near 0, yet is slower), also in its simulated
        solve (``expected_cycles``), which does not diverge.
    note : str
        Why it was rejected, if it was.
    exact : bool
        The factor comes from every mode on the full grid (no screening, no
        reduced grid).
    expected : float or None
        Expected measured factor: :func:`average_factor` of the residual
        history of ``mgrit.solve(..., tol=reduction, tol_type="rel")`` with
        these options, simulated on an affine model of the problem from the
        solver's start (docs/tuning.md §7); ``inf`` when the simulated solve
        overflows or its iterate leaves the range where the linearization
        holds (the solve is then expected to diverge). None when not modelled
        (``Settings.expected_model`` says why).
    expected_cycles : int or None
        Cycles of that simulated solve (as ``Result.iterations``, the skipped
        first cycle included); None when it did not reach the tolerance
        within ``max_iter`` cycles or was not modelled.
    expected_floor : bool
        The simulated solve's last residual is at the rounding level (within
        10x of ``eps`` times the norm of the states at the fine C-points):
        the measured factor then depends on rounding and the prediction is
        rough (docs/tuning.md §7).
    """

    cf: tuple
    levels: int
    relax: tuple
    c_weight: float
    min_coarse: int
    factor: float
    rate: float
    cycles: int | None
    time: float
    stable: bool
    meets_target: bool
    note: str = ""
    exact: bool = True
    expected: float | None = None
    expected_cycles: int | None = None
    expected_floor: bool = False

    @property
    def simulated_divergence(self) -> bool:
        """The simulated solve (``expected``) diverged: it did not reach the tolerance, and its average
        factor is not below 1 (its residual grew over the ``max_iter`` cycles, overflowed, or the iterate left
        the range of the linearization). Such a setting is never chosen."""
        return self.expected is not None and self.expected_cycles is None and not self.expected < 1.0

    @property
    def options(self) -> dict:
        """Keyword arguments for :func:`mgrit.solve` that build exactly this hierarchy."""
        cf = self.cf[0] if len(set(self.cf)) == 1 else tuple(self.cf)
        relax = self.relax[0] if len(set(self.relax)) == 1 else tuple(self.relax)
        return {"cf": cf, "max_levels": self.levels, "min_coarse": self.min_coarse, "relax": relax,
                "c_weight": self.c_weight, "cycle": "V"}

    def describe(self) -> str:
        """One line: factors, levels, relaxation and weight (a repeated last entry is shown once).

        >>> Candidate((16, 2, 2), 4, ("F", "FCF", "FCF"), 1.3, 2, 0.1, 0.05, 9, 1.0, True, True).describe()
        'cf 16/2, 4 levels, F/FCF w=1.3'
        """
        w = f" w={self.c_weight:g}" if self.c_weight != 1.0 else ""
        return f"cf {_short(self.cf)}, {self.levels} levels, {_short(self.relax)}{w}"


@dataclass(frozen=True, eq=False)
class Settings:
    """What :func:`choose_settings` returns.

    Attributes
    ----------
    choice : Candidate
        The chosen setting.
    candidates : tuple of Candidate
        Every setting evaluated: those that meet the target first, then the others, each group by
        predicted time (cheapest first), ties by factor.
    target : float
    ranks : int
    reduction : float
    cost : StepCost
        Step cost used by the model (measured or unit).
    sequential_time : float
        Model time of sequential stepping (``N`` single steps).
    spectra : tuple of Spectrum
        The linearizations (one per sampled state).
    bound : bool
        The chosen factor is a rigorous bound on the residual reduction per
        cycle: one linearization for the whole run (a linear, time-invariant
        step), dense spectra with a normal fine step and commuting coarse steps,
        no growing modes, every mode and the full grid evaluated. Otherwise it
        is an estimate (docs/tuning.md §4).
    meets_target : bool
        The choice reaches the target; when no stable setting did, the choice
        is the fastest stable one that converges.
    expected_model : str
        The model of the simulated solves behind ``Candidate.expected``
        (docs/tuning.md §7), or why there is none.
    """

    choice: Candidate
    candidates: tuple
    target: float
    ranks: int
    reduction: float
    cost: StepCost
    sequential_time: float
    spectra: tuple
    bound: bool
    meets_target: bool
    expected_model: str = ""

    @property
    def options(self) -> dict:
        """Keyword arguments for ``mgrit.solve(propagator, u0, t, **settings.options)`` (a fresh dict)."""
        return self.choice.options

    @property
    def predicted_factor(self) -> float:
        """Predicted bound of one cycle's residual reduction (``Candidate.factor``) of the chosen setting."""
        return self.choice.factor

    @property
    def predicted_rate(self) -> float:
        """Predicted average reduction per cycle over the predicted cycles (``Candidate.rate``)."""
        return self.choice.rate

    @property
    def predicted_cycles(self) -> int:
        """Predicted cycles to ``tol=reduction, tol_type="rel"`` (the skipped first cycle included)."""
        return self.choice.cycles

    @property
    def predicted_time(self) -> float:
        """Model time to that tolerance on ``ranks`` ranks (``Candidate.time``)."""
        return self.choice.time

    @property
    def expected_factor(self) -> float | None:
        """Expected measured factor of the chosen setting (``Candidate.expected``, docs/tuning.md §7).

        What :func:`average_factor` gives for the residual history of
        ``mgrit.solve(propagator, u0, t, tol=reduction, tol_type="rel", **options)``;
        ``predicted_factor`` bounds every cycle, this predicts their average in that solve. ``inf`` when
        the chosen setting is unstable, as for a simulated solve that diverges (a coarse step at a pole of
        the scheme left its mode out of the simulated solve, which said 0).
        """
        return self.choice.expected if self.choice.stable else math.inf

    @property
    def expected_cycles(self) -> int | None:
        """Cycles of the simulated solve of the chosen setting (``Candidate.expected_cycles``; None when it is
        unstable)."""
        return self.choice.expected_cycles if self.choice.stable else None

    def table(self, limit: int | None = None) -> str:
        """The candidates as a text table in the order of :attr:`candidates` (``limit`` rows, all by default)."""
        rows = [f"{'cf':>9} {'levels':>6} {'relax':>9} {'w':>4} {'factor':>10} {'rate':>10} {'cycles':>6} "
                f"{'expected':>10} {'e.cyc':>5} {'time':>11} {'speedup':>8}  note"]
        for c in self.candidates[: limit if limit is not None else len(self.candidates)]:
            cf, rx = _short(c.cf), _short(c.relax)
            fac = "unstable" if not c.stable else f"{c.factor:10.3e}"
            rate = "-" if not math.isfinite(c.rate) else f"{c.rate:10.3e}"
            cyc = "-" if c.cycles is None else str(c.cycles)
            exp = "-" if c.expected is None else f"{c.expected:9.3e}" + ("*" if c.expected_floor else " ")
            ecyc = "-" if c.expected_cycles is None else str(c.expected_cycles)
            tm = "-" if not math.isfinite(c.time) else f"{c.time:11.4g}"
            sp = "-" if not math.isfinite(c.time) or c.time <= 0 else f"{self.sequential_time / c.time:8.3f}"
            mark = "  <- chosen" if c is self.choice else ""
            rows.append(f"{cf:>9} {c.levels:>6} {rx:>9} {c.c_weight:>4g} {fac:>10} {rate:>10} {cyc:>6} {exp:>10} "
                        f"{ecyc:>5} {tm:>11} {sp:>8}  {c.note}{mark}")
        return "\n".join(rows)

    def __str__(self) -> str:
        c = self.choice
        kind = "bound" if self.bound else "estimate"
        head = (f"chosen: {c.describe()}; predicted factor {c.factor:.3e}, rate {c.rate:.3e} ({kind}), "
                f"{c.cycles} cycles to {self.reduction:g} relative, model time {c.time:.4g} on {self.ranks} "
                f"rank(s) (sequential {self.sequential_time:.4g})")
        if not self.meets_target:
            head += f"; no stable setting reaches the target {self.target:g}"
        if c.expected is None and _UNMODELLED in c.note:
            head += ("\nexpected measured factor: not modelled (the simulated solve leaves the linearization); the "
                     "target is met by the linear theory alone, which can be far off for such a problem "
                     "(docs/tuning.md, section 6): check the choice with a solve")
        elif c.expected is None:
            head += f"\nexpected measured factor: not modelled ({self.expected_model})"
        else:
            cyc = (f"{c.expected_cycles} cycles" if c.expected_cycles is not None
                   else "does not reach the tolerance")
            head += (f"\nexpected measured factor {c.expected:.3e} ({cyc}; simulated solve, "
                     f"{self.expected_model})")
            if c.expected_floor:
                head += "; its last residual is at the rounding level (rough)"
        table = self.table(limit=10)
        if any(x.expected_floor for x in self.candidates[:10]):
            table += "\n(* the simulated solve ends at the rounding level: the expected factor is rough)"
        return head + "\n" + table


# --------------------------------------------------------------------------------------
# choose_settings
# --------------------------------------------------------------------------------------


def _check_propagator(p) -> None:
    if not isinstance(p, Propagator):
        raise TypeError(f"`propagator` must be an mgrit.Propagator, got {type(p).__name__}; "
                        "subclass mgrit.Propagator and implement step(u, t0, t1)")


def _check_state(u):
    """``u`` as the tuner's own state (a copy: the caller's array is never written)."""
    if B.requires_grad(u):
        raise ValueError("`u0` requires grad; pass u0.detach()")
    u = B.copy(B.as_state(u))
    if not B.is_torch(u) and u.dtype.kind not in "fc":
        raise TypeError(f"`u0` must be a numeric array, got dtype {u.dtype}")
    half = (str(u.dtype) in ("torch.float16", "torch.bfloat16", "torch.complex32") if B.is_torch(u)
            else u.dtype.kind in "fc" and u.dtype.itemsize < (8 if u.dtype.kind == "c" else 4))
    if half:
        raise TypeError(f"`u0` is {str(u.dtype).replace('torch.', '')}: half precision resolves a residual only to "
                        "about 1e-3 of its start and the spectra need float32 or float64 (numpy.linalg): tune with "
                        "float32 or float64 states (u0.float(), u0.astype(np.float32)); the settings carry over to "
                        "a solve in half precision, given a tolerance above its rounding (about 1e-3 relative)")
    if not B.is_torch(u) and u.dtype.itemsize > (16 if u.dtype.kind == "c" else 8):
        raise TypeError(f"`u0` is {u.dtype}, which numpy.linalg (the spectra) does not support: tune with "
                        "u0.astype(np.float64) (or complex128); the solve itself takes it")
    if (u.numel() if B.is_torch(u) else u.size) == 0:
        raise ValueError(f"`u0` is empty (shape {tuple(u.shape)}): a state needs at least one value")
    if not B.all_finite(u):
        raise ValueError("`u0` contains NaN or Inf")
    return u


def _check_keeps_input(propagator, u, t) -> None:
    """One step from ``u`` (the tuner's copy); a ``ValueError`` as :func:`mgrit.solve` gives when the step
    changes its input in place (every later analysis would start from the changed state)."""
    step_keeping_input(propagator, B.copy(u), float(t[0]), float(t[1]))


def _check_positive_int(v, name, low):
    if not is_integer(v) or v < low:
        raise ValueError(f"`{name}` must be an integer >= {low}, got {v!r}")


def _check_steps(strides, composites, n):
    """``(1, 1)``, then the single steps ``(s, 1)``, then the composites ``(s, c)``; all within the grid."""
    def bad():
        return ValueError(f"`strides` must be integers >= 1 and `composites` pairs (stride, count) of them, "
                          f"each spanning at most the grid's {n} intervals; got strides={strides!r}, "
                          f"composites={composites!r}")

    try:
        singles = [(s, 1) for s in strides]
        pairs = [tuple(p) for p in composites]
    except TypeError:
        raise bad() from None
    out = [(1, 1)]
    for p in singles + pairs:
        if len(p) != 2 or not all(is_integer(x) and x >= 1 for x in p) or p[0] * p[1] > n:
            raise bad()
        p = (int(p[0]), int(p[1]))
        if p not in out:
            out.append(p)
    return tuple(out)


def _check_fraction(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not 0.0 < v < 1.0:
        raise ValueError(f"`{name}` must be a number in (0, 1), got {v!r}")
    return float(v)


#: The default relative residual reduction of choose_settings and predict_options, by the states' precision:
#: float64 / complex128, and float32 / complex64 (whose rounding stalls a solve near 1e-7 of its start).
DEFAULT_REDUCTION = {8: 1e-8, 4: 1e-4}


def _reduction(reduction, u0) -> float:
    """``reduction`` checked against the precision of ``u0``'s states (None: :data:`DEFAULT_REDUCTION`)."""
    real = _precision(u0)[0]
    eps = float(np.finfo(real).eps)
    if reduction is None:
        return DEFAULT_REDUCTION[np.dtype(real).itemsize]
    reduction = _check_fraction(reduction, "reduction")
    if reduction < eps:
        raise ValueError(f"`reduction`={reduction:g} is below the rounding of {np.dtype(real).name} states "
                         f"(eps {eps:.2g}): their solves stall at the rounding level before it, and the predicted "
                         f"cycles would not be met; pass reduction >= {eps:.0e} (None: "
                         f"{DEFAULT_REDUCTION[np.dtype(real).itemsize]:g}) or float64 states")
    return reduction


def _cf_schedules(cf):
    if cf is None:
        cf = DEFAULT_CF
    if is_integer(cf):
        cf = (cf,)
    if isinstance(cf, np.ndarray):
        cf = cf.tolist()
    if not isinstance(cf, (tuple, list, range)) or not cf:
        raise ValueError(f"`cf` must be a non-empty sequence of candidate factors: integers >= 2 or per-level "
                         f"tuples of them, e.g. (2, 4, 8) or (4, (8, 2)); got {cf!r}")
    out = []
    for c in cf:
        sched = (int(c),) if is_integer(c) else tuple(c) if isinstance(c, (tuple, list)) else None
        if not sched or not all(is_integer(x) and x >= 2 for x in sched):
            raise ValueError(f"`cf` must be a sequence of candidate factors: integers >= 2 or per-level tuples "
                             f"of them, e.g. (2, 4, 8) or (4, (8, 2)); got {cf!r}")
        out.append(tuple(int(x) for x in sched))
    return out


def _relax_candidates(relax):
    if relax is None:
        relax = DEFAULT_RELAX
    if isinstance(relax, str):
        relax = (relax,)
    if isinstance(relax, np.ndarray):
        relax = relax.tolist()
    if not isinstance(relax, (tuple, list)) or not relax:
        raise ValueError(f"`relax` must be a non-empty sequence of candidates: 'F', 'FCF', ... or per-level "
                         f"tuples such as ('F', 'FCF'); got {relax!r}")
    out = []
    for r in relax:
        sched = (r,) if isinstance(r, str) else tuple(r) if isinstance(r, (tuple, list)) else None
        if not sched:
            raise ValueError(f"`relax` must be a sequence of candidates: 'F', 'FCF', ... or per-level tuples "
                             f"such as ('F', 'FCF'); got {relax!r}")
        for s in sched:
            parse_relax(s)
        out.append(tuple(s.upper() for s in sched))
    return out


def _weights(c_weights):
    if c_weights is None:
        c_weights = DEFAULT_WEIGHTS
    if isinstance(c_weights, (int, float, np.integer, np.floating)):
        c_weights = (c_weights,)
    if not isinstance(c_weights, (tuple, list, np.ndarray)) or len(c_weights) == 0:
        raise ValueError(f"`c_weights` must be a number in (0, 2] or a non-empty sequence of them, got {c_weights!r}")
    out = []
    for w in c_weights:
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, float, np.integer, np.floating)) \
                or not 0.0 < w <= 2.0:
            raise ValueError(f"`c_weights` must be numbers in (0, 2], got {c_weights!r}")
        out.append(float(w))
    return sorted(set(out))


def _measure_cost(propagator, u0, t, repeats: int = 5, batch: int = 32) -> StepCost:
    """StepCost from timing ``step`` and ``step_batch`` on the first fine intervals (medians)."""
    n = t.shape[0] - 1
    nb = max(2, min(batch, n))
    t0, t1 = t[:nb].copy(), t[1 : nb + 1].copy()
    if nb > n:  # fewer intervals than 2: repeat the first one
        t0, t1 = np.full(nb, t[0]), np.full(nb, t[1])
    U = B.empty_stack(nb, u0)
    U[:] = u0

    def timed(f):
        ts = []
        for _ in range(repeats):
            a = time.perf_counter()
            f()
            ts.append(time.perf_counter() - a)
        return float(np.median(ts))

    propagator.step(u0, float(t[0]), float(t[1]))  # warm up (caches, lazy setup)
    propagator.step_batch(U, t0, t1)
    single = timed(lambda: propagator.step(u0, float(t[0]), float(t[1])))
    one = timed(lambda: propagator.step_batch(U[:1], t0[:1], t1[:1]))
    many = timed(lambda: propagator.step_batch(U, t0, t1))
    per_state = max((many - one) / (nb - 1), 0.0)
    return StepCost(single=single, per_state=per_state, per_call=max(one - per_state, 0.0))


#: A fine-step eigenvalue counts as growing when its modulus exceeds 1 by more than this
#: (a neutral mode, ``|lam| = 1``, is measured with finite-difference noise).
GROWTH_TOL = 1e-7


def _run_stride(spectrum0, n, min_steps, max_stride=None) -> int:
    """The largest of ``spectrum0``'s single-step strides that leaves at least ``min_steps`` steps, is
    at most ``max_stride`` and amplifies no mode that the fine step does not amplify at its state."""
    decaying = np.abs(spectrum0[1]) <= 1.0 + GROWTH_TOL
    stride = 1
    for s in spectrum0.strides:
        if (n // s >= min_steps and (max_stride is None or s <= max_stride)
                and np.all(np.abs(spectrum0[s][decaying]) <= 1.0 + 1e-6)):
            stride = max(stride, s)
    return stride


def _run_once(propagator, u0, t, stride):
    """A sequential run over every ``stride``-th point of ``t``: ``(indices, states)``, the states cut where
    the run blows up (not finite, or beyond 1e6 times the initial state's size: fewer states than indices)."""
    idx = list(range(0, t.shape[0], stride))
    scale = float(np.max(np.abs(_to_numpy(u0)))) + 1.0
    states, u = [u0], u0
    with np.errstate(all="ignore"):  # a run that blows up is detected below
        for a, b in zip(idx[:-1], idx[1:]):
            u = checked_state(propagator.step(u, float(t[a]), float(t[b])), u0[None], 0)
            if not B.all_finite(u) or float(np.max(np.abs(_to_numpy(u)))) > 1e6 * scale:
                break
            states.append(u)
    return idx, states


def _coarse_run(propagator, u0, t, stride):
    """A sequential run over every ``stride``-th point of ``t``: ``(indices, states)``.

    A run that blows up is repeated with half the stride; at stride 1 it is
    cut where it blew up (fewer states than indices).
    """
    while True:
        idx, states = _run_once(propagator, u0, t, stride)
        if len(states) == len(idx) or stride == 1:
            return idx, states
        stride //= 2


def _sample_states(propagator, u0, t, spectrum0, samples):
    """``samples`` states along a cheap coarse sequential run (``u0`` first).

    The run uses the largest stride (of ``spectrum0``'s single steps) that
    leaves at least ``4 samples`` steps and amplifies no mode that the fine
    step does not amplify at ``u0``; a run that blows up is repeated with half
    the stride.
    """
    n = t.shape[0] - 1
    if samples <= 1:
        return [(0, u0)]
    idx, states = _coarse_run(propagator, u0, t, _run_stride(spectrum0, n, 4 * samples))
    picks = np.unique(np.linspace(0, len(states) - 1, samples).round().astype(int))
    return [(idx[k], states[k]) for k in picks]


def _unique_modes(spectra, rtol: float = 1e-7):
    """All modes of all samples as rows (one column per step), conjugate pairs and repeats merged.

    Two modes are repeats when all their values agree to ``rtol`` (relative to
    the larger modulus): the same linearization sampled twice differs only by
    the finite-difference noise.
    """
    rows = []
    for sp in spectra:
        cols = sp.values.copy()
        flip = cols[:, 0].imag < 0
        cols[flip] = cols[flip].conj()  # a conjugate mode has conjugate cycle matrices: equal norms
        rows.append(cols)
    allrows = np.concatenate(rows)
    keep = []
    with np.errstate(invalid="ignore", over="ignore"):  # unstable steps hold inf: such rows never match
        for i, row in enumerate(allrows):
            if keep:
                kept = allrows[keep]
                scale = np.maximum(np.abs(kept), np.abs(row)[None, :])
                close = np.all(np.abs(kept - row[None, :]) <= rtol * np.maximum(scale, 1e-300), axis=1)
                if np.any(close):
                    continue
            keep.append(i)
    return allrows[keep]


def _root(x, m, near):
    """The ``m``-th root of ``x`` (per mode) nearest to ``near``."""
    k = np.arange(m)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.abs(x)[:, None] ** (1.0 / m) * np.exp(1j * (np.angle(x)[:, None] + 2 * np.pi * k[None, :]) / m)
    best = np.argmin(np.abs(r - near[:, None]), axis=1)
    return r[np.arange(x.shape[0]), best]


#: Composite eigenvalues below this modulus are at the level of finite-difference noise:
#: the levels below them use their single-step eigenvalues (docs/tuning.md §2).
COMPOSITE_FLOOR = 1e-6


def _level_factors(modes, col, cfs):
    """Per-level one-step factors of every mode: the frozen chain of docs/tuning.md §2.

    With ``Y_l`` the eigenvalue of one step of level ``l`` and ``X_l`` that of
    the ``m_l`` steps of level ``l`` that one step of level ``l + 1`` replaces:
    ``lam_0 = X_0^(1/m_0)`` (the root nearest ``Y_0``) and
    ``lam_{l+1} = lam_l^{m_l} Y_{l+1} / X_l``. Every pair of levels keeps its
    own mismatch ``Y_{l+1} / X_l``; for a linear, autonomous problem
    ``X_l = Y_l^{m_l}`` and ``lam_l = Y_l``. Where ``|X_l|`` is below
    :data:`COMPOSITE_FLOOR`, ``Y`` is used instead.

    Returns ``(strides, singles, composites, lams)``.
    """
    strides = [1]
    for c in cfs:
        strides.append(strides[-1] * c)
    singles = [modes[:, col[(s, 1)]] for s in strides]
    comps = [modes[:, col[(s, m)]] for s, m in zip(strides[:-1], cfs)]
    with np.errstate(all="ignore"):
        ok = np.abs(comps[0]) > COMPOSITE_FLOOR
        lams = [np.where(ok, _root(comps[0], cfs[0], singles[0]), singles[0])]
        for l, m in enumerate(cfs):
            ok = np.isfinite(comps[l]) & (np.abs(comps[l]) > COMPOSITE_FLOOR)
            safe = np.where(ok, comps[l], 1.0)
            lams.append(np.where(ok, lams[l] ** m * singles[l + 1] / safe, singles[l + 1]))
    return strides, singles, comps, lams


def _discount_growth(lams, strides, fine):
    """``lam_l / rho^{s_l}``, ``rho = max(|lam_0|, |Y_0|)``, for modes growing under the fine step (docs/tuning.md §3).

    The factors in the time-weighted norm that discounts the growth ``rho``
    per fine step (``Y_0`` is the single fine step's eigenvalue, ``lam_0`` the
    root of the fine composite); decaying modes are unchanged.
    """
    a0 = np.maximum(np.abs(lams[0]), np.abs(fine))
    logrho = np.where(a0 > 1.0 + GROWTH_TOL, np.log(np.maximum(a0, 1.0)), 0.0)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return [v * np.exp(-logrho * s) for v, s in zip(lams, strides)]


#: the note of a candidate whose simulated solve leaves its linearization without blowing up (docs/tuning.md §6)
_UNMODELLED = "leaves the linearization, its coarse runs do not blow up: not modelled"


def _evaluate(modes, col, h_sizes, cfs, relaxes, weight, n_modes, max_points, min_coarse, reduction):
    """Stability, predicted factor and cycles of one candidate (docs/tuning.md §2-§3).

    Returns ``(stable, note, factor, q, rate, exact)``: ``factor`` bounds one
    cycle's residual reduction, ``q`` cycles reduce it by ``reduction`` at an
    average ``rate`` (None and inf when they do not); ``exact`` is False when
    the numbers came from a subset of modes or from a reduced grid.
    """
    L = len(h_sizes)
    strides, singles, comps, lams = _level_factors(modes, col, cfs)
    # stability: one step of level l + 1 may not amplify a mode more than the m_l steps of level l
    # it replaces (their composite, or level l's single step to the m_l-th power), by more than
    # STABILITY_GROWTH over level l + 1's whole horizon
    for l in range(L - 1):
        if not (np.all(np.isfinite(singles[l + 1])) and np.all(np.isfinite(comps[l]))):
            return False, f"unstable on level {max(l, 1)} (its steps blow up)", math.inf, None, math.inf, True
        with np.errstate(divide="ignore"):
            log_x = np.log(np.abs(comps[l]) + 1e-300)
            log_y = cfs[l] * np.log(np.abs(singles[l]) + 1e-300)
            ref = np.maximum(np.maximum(log_x, log_y), 0.0)
            excess = np.log(np.abs(singles[l + 1]) + 1e-300) - ref
        worst = float(np.max(h_sizes[l + 1] * excess))
        if worst > math.log(STABILITY_GROWTH):
            amp = math.exp(min(worst, 700.0))
            return (False, f"unstable on level {l + 1} (error x{amp:.2g} over its {h_sizes[l + 1]} intervals)",
                    math.inf, None, math.inf, True)
    lams = _discount_growth(lams, strides, singles[0])
    # screening: Southworth's upper two-level bound for every pair of levels (docs/theory.md §6)
    uppers = []
    for l in range(L - 1):
        _, up = theory.sharp_bounds(lams[l], lams[l + 1], cfs[l], h_sizes[l + 1], relaxes[l])
        uppers.append(np.nan_to_num(np.asarray(up, dtype=float), nan=np.inf))
    K = modes.shape[0]
    exact = True
    if n_modes is not None and K > n_modes:
        order = np.argsort(-np.max(uppers, axis=0), kind="stable")
        pick = [int(i) for i in order[: max(n_modes - L + 1, 1)]]
        pick += [int(np.argmax(up)) for up in uppers]  # the worst mode of every pair of levels
        sel = np.array(sorted(set(pick)))
        exact = False
    else:
        sel = np.arange(K)
    # deep hierarchies: the levels below the first L levels whose grid fits 4 max_points fine intervals
    # are left out (the last kept level is solved exactly)
    note = ""
    L_all = L
    while L > 2 and int(np.prod(cfs[: L - 1])) * min_coarse > 4 * max_points:
        L -= 1
    if L < L_all:
        cfs, relaxes, h_sizes, lams = cfs[: L - 1], relaxes[: L - 1], h_sizes[:L], lams[:L]
        which = f"level {L}" if L == L_all - 1 else f"levels {L}..{L_all - 1}"
        note, exact = f"{which} not modelled (estimate)", False
    # the reduced grid: same levels and factors, at most max_points fine intervals (or min_coarse coarsest ones)
    P = int(np.prod(cfs))
    n_full = h_sizes[0]
    if n_full <= max_points:
        n_red = n_full
    else:
        n_red = P * min(h_sizes[-1], max(min_coarse, max_points // P))
        exact = False
    if len(sel) * (n_red // cfs[0]) > MAX_COLUMNS:  # keep the worst modes within the column budget
        keep = max(2, MAX_COLUMNS // (n_red // cfs[0]))
        worst = np.argsort(-np.max(uppers, axis=0)[sel], kind="stable")[:keep]
        sel, exact = np.sort(sel[worst]), False
    sub = [v[sel] for v in lams]
    P = residual_matrices(sub, n_red, cfs, relaxes, weight)
    ratio = 1.0
    if n_red < n_full:  # extrapolate with the two-level bounds' growth from the reduced to the full grid
        red_sizes = [n_red]
        for c in cfs:
            red_sizes.append(red_sizes[-1] // c)
        for l in range(L - 1):
            # an unstable coarse step (|mu| > 1) has no finite upper two-sided bound: its growth is taken from
            # the column-sum bound, c_r (|mu|^n - 1) / (|mu| - 1) (|mu|^dn for large |mu|, n_full / n_red near 1)
            unstable = np.abs(np.asarray(sub[l + 1])) > 1.0
            pair = []
            for n in (h_sizes[l + 1], red_sizes[l + 1]):
                up = theory.sharp_bounds(sub[l], sub[l + 1], cfs[l], n, relaxes[l])[1]
                col = theory.dobrev_bound(sub[l], sub[l + 1], cfs[l], n, relaxes[l])
                pair.append(np.where(unstable, col, up))
            hi, lo = pair
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                r = np.where(np.asarray(lo) > 0, np.asarray(hi) / np.asarray(lo), 1.0)
            ratio = max(ratio, float(np.nanmax(r)))
    fac = _exact_norm(P) * ratio
    if L == 2 and n_red < n_full and weight == 1.0:
        # two levels: the scaled reduced-grid norm fell 2-15% below the exact full-grid norm (the upper bounds'
        # growth is slower than the norm's at small sizes); per mode the exact norm is a closed form
        full = max(theory.two_level_norm(complex(a), complex(b), cfs[0], h_sizes[1], relaxes[0])
                   for a, b in zip(sub[0], sub[1]))
        fac = max(fac, full)
    if n_red == n_full:  # the whole grid: the powers are the iteration's (exactness included)
        q, rate = power_cycles(P, reduction)
    else:  # a reduced grid: powers only as far as its exactness front stays far away, then extrapolated
        qs = max(1, (n_red // cfs[0]) // (4 * (parse_relax(relaxes[0]) + 1)))
        q, rate = power_cycles(P, reduction, qmax=qs, growth=ratio)
        if q is None and rate < 1.0:
            q = 1 if rate == 0.0 else max(1, math.ceil(math.log(reduction) / math.log(rate) - 1e-12))
        elif q is None:
            rate = math.inf
    return True, note, fac, q, rate, exact


def _time_to_tolerance(h, ranks, cycles, cost, latency, schedule=None, converged=True):
    """Model time of ``cycles`` cycles: two replays (the schedule repeats after the second cycle).
    ``schedule``: the solve's options that shape it (skip, nested, residual, final_residual, partition)."""
    kw = dict(schedule or {}, cost=cost, latency=latency, converged=converged)
    if cycles <= 3:
        return predict(h, ranks, cycles, **kw).time
    t2 = predict(h, ranks, 2, **kw).time
    t3 = predict(h, ranks, 3, **kw).time
    return t2 + (cycles - 2) * (t3 - t2)


def choose_settings(
    propagator: Propagator,
    u0,
    t,
    *,
    target: float = 0.1,
    ranks: int = 1,
    cf=None,
    max_levels: int = 30,
    min_coarse: int = 2,
    relax=None,
    c_weights=None,
    reduction: float | None = None,
    measure: bool = True,
    cost: StepCost | Sequence[StepCost] | None = None,
    latency: float = 0.0,
    samples: int = 5,
    jvp: str = "auto",
    dense_max: int = 100,
    krylov: int = 24,
    modes: int | None = 16,
    max_points: int = 128,
    seed: int = 0,
    expected: bool = True,
    max_iter: int = 100,
    expected_points: int = 16384,
) -> Settings:
    """Choose MGRIT settings for ``mgrit.solve(propagator, u0, t)`` from convergence theory.

    1. **Spectrum.** The fine step, one step of every candidate level
       (rediscretization: the propagator over ``stride_l`` fine intervals) and
       the ``cf_l`` steps of level ``l`` that one step of level ``l + 1``
       replaces are linearized at ``u0`` and at ``samples - 1`` more states
       along a cheap coarse sequential run, and their eigenvalues paired mode
       by mode (:func:`step_spectrum`; docs/tuning.md §1-§2).
    2. **Prediction.** For every candidate -- a coarsening schedule from ``cf``,
       2 to ``max_levels`` levels, a relaxation from ``relax`` and a C-weight
       from ``c_weights`` -- no coarse step may amplify a mode much more than
       the steps it replaces (docs/tuning.md §3). The two-level bounds of
       :mod:`mgrit.theory` pick the worst ``modes`` modes; their V-cycle
       residual matrices ``P`` (:func:`residual_matrices`, on a grid of at most
       ``max_points`` fine intervals) give the one-cycle factor ``max ||P||``,
       the cycles ``2 + q`` with ``max ||P^q|| <= reduction``
       (:func:`power_cycles`) and the rate ``max ||P^q||^(1/q)``, worst case
       over all samples (docs/tuning.md §2).
    3. **Expected factor.** Every candidate's solve (``tol=reduction,
       tol_type="rel"``, at most ``max_iter`` cycles, the solver's default
       start) is simulated on an affine model of the problem: the modes of a
       time-invariant step, or the linearization along a reference trajectory.
       Its average residual reduction per cycle (:func:`average_factor`) is
       ``Candidate.expected``, the prediction of the factor a solve measures
       (docs/tuning.md §7). A setting whose simulated solve diverges is not
       chosen; one that needs more cycles than predicted is timed for those.
    4. **Cost.** The stable candidates with rate ``<= target`` (and no more
       cycles than a factor ``target`` needs) are ranked by
       the critical-path model (:func:`mgrit.model.predict` on ``ranks`` ranks)
       for those cycles (docs/tuning.md §6).

    Parameters
    ----------
    propagator : Propagator
        One propagator for all levels (rediscretization).
    u0 : array or tensor
        Initial state.
    t : array_like
        Fine time grid.
    target : float
        Largest acceptable predicted rate (average residual reduction per
        cycle over the predicted cycles), in (0, 1).
    ranks : int
        Ranks of the solve, for the cost model.
    cf : sequence, optional
        Candidate coarsening factors: integers (one for all levels) or per-level
        tuples (last repeats). Default ``(2, 4, 8, 16)``.
    max_levels : int
        Most levels tried (>= 2).
    min_coarse : int
        As in :func:`mgrit.solve`: a level is only made with at least this
        many intervals; the returned options keep it.
    relax : sequence, optional
        Candidate relaxations: strings or per-level tuples. Default
        ``("F", "FCF", ("F", "FCF"))``.
    c_weights : sequence of float, optional
        C-weights tried when some level relaxes with C-points. Default ``(1.0, 1.3)``.
    reduction : float, optional
        Relative residual reduction the time is predicted for (``tol=reduction,
        tol_type="rel"`` in :func:`mgrit.solve`). Default 1e-8 for float64 (and
        complex128) states, 1e-4 for float32 (complex64) ones, whose rounding
        stalls a solve near 1e-7 of its start; a value below the states'
        machine epsilon is a ``ValueError``.
    measure : bool
        Time ``step`` and ``step_batch`` for the cost model; False uses unit
        costs (the model time then counts propagator calls).
    cost : StepCost or sequence of StepCost, optional
        Use these costs instead (``measure`` is then ignored).
    latency : float
        Message latency of the cost model (seconds).
    samples : int
        States linearized (``u0`` included); 1 for a linear, time-invariant step.
    jvp : {"auto", "fd", "torch"}
        Jacobian-vector products, see :func:`jacobian`.
    dense_max, krylov, seed
        See :func:`step_spectrum`.
    modes : int or None
        Modes evaluated exactly per candidate (None: all).
    max_points : int
        Largest fine grid of the exact evaluation; larger grids are reduced
        (fewer coarsest intervals) and the factor extrapolated.
    expected : bool
        Simulate every candidate's solve for ``Candidate.expected``.
    max_iter : int
        Most cycles of a simulated solve (as in :func:`mgrit.solve`).
    expected_points : int
        Longer grids are simulated on their first ``expected_points`` fine
        intervals or so (a multiple of the coarsest stride).

    Returns
    -------
    Settings
        ``settings.options`` goes to ``mgrit.solve(propagator, u0, t, **settings.options)``.

    Raises
    ------
    ValueError
        Invalid arguments, or no candidate is stable and convergent (the message
        says what to try).

    Examples
    --------
    >>> import numpy as np, mgrit
    >>> from propagators import Heat1D
    >>> heat = Heat1D(17, forcing=False)
    >>> t = np.linspace(0.0, 1.0, 129)
    >>> s = mgrit.choose_settings(heat, heat.initial(), t, target=0.1, measure=False, samples=2)
    >>> s.bound, s.predicted_rate <= 0.1
    (True, True)
    >>> res = mgrit.solve(heat, heat.initial(), t, tol=1e-8, tol_type="rel", **s.options)
    >>> res.converged and res.iterations <= s.predicted_cycles
    True
    >>> bool(np.isclose(average_factor(res.residuals), s.expected_factor, rtol=1e-3, atol=1e-12))
    True
    >>> s.expected_cycles == res.iterations
    True
    """
    _check_propagator(propagator)
    u0 = _check_state(u0)
    t = check_time_grid(t)
    n = t.shape[0] - 1
    target = _check_fraction(target, "target")
    _check_keeps_input(propagator, u0, t)
    _check_positive_int(max_levels, "max_levels", 2)
    _check_positive_int(min_coarse, "min_coarse", 1)
    _check_positive_int(ranks, "ranks", 1)
    schedules = _cf_schedules(cf)
    relaxes = _relax_candidates(relax)
    weights = _weights(c_weights)
    if n < 2 * min_coarse:
        raise ValueError(f"the grid has {n} intervals: too few for two levels with min_coarse={min_coarse}; "
                         "pass more time points or a smaller `min_coarse`")
    # the hierarchies to evaluate (distinct realized factor schedules)
    hierarchies = {}
    for sched in schedules:
        for L in range(2, max_levels + 1):
            h = build_hierarchy(t, cf=list(sched), max_levels=L, min_coarse=min_coarse)
            if len(h) < L:
                break
            hierarchies.setdefault(tuple(lv.cf for lv in h[:-1]), h)
    if not hierarchies:
        raise ValueError(f"no candidate factor {schedules} gives two levels on {n} intervals with "
                         f"min_coarse={min_coarse}; pass smaller `cf` values or more time points")
    an = _Analysis(propagator, u0, t, list(hierarchies), reduction=reduction, measure=measure, cost=cost,
                   latency=latency, samples=samples, jvp=jvp, dense_max=dense_max, krylov=krylov, modes=modes,
                   max_points=max_points, seed=seed, ranks=ranks, min_coarse=min_coarse, expected=expected,
                   max_iter=max_iter, expected_points=expected_points)
    cands, seen = [], set()
    for key, h in hierarchies.items():
        L = len(h)
        for rx in relaxes:
            level_relax = tuple(per_level(list(rx), L - 1, "relax"))
            has_c = any(parse_relax(r) > 0 for r in level_relax)
            for w in weights if has_c else [1.0]:
                if (key, level_relax, w) in seen:
                    continue
                seen.add((key, level_relax, w))
                cands.append(an.candidate(key, level_relax, w, target))
    cands.sort(key=lambda c: (not c.meets_target, c.time, c.rate))
    meeting = [c for c in cands if c.meets_target]
    if meeting:
        choice, meets = meeting[0], True
    else:
        convergent = sorted([c for c in cands if c.cycles is not None and not c.simulated_divergence],
                            key=lambda c: (c.time, c.rate))
        if not convergent:
            raise ValueError(
                "no candidate setting is stable and predicted to converge "
                f"({sum(not c.stable for c in cands)} of {len(cands)} have unstable coarse steps, "
                f"{sum(c.stable and c.simulated_divergence for c in cands)} stable ones diverge "
                "in the simulated solve); "
                "try smaller `cf` values, fewer levels (`max_levels`), a larger `min_coarse`, "
                "or a finer time grid")
        choice, meets = convergent[0], False
    return an.settings(choice, cands, target, meets)


def predict_options(
    propagator: Propagator,
    u0,
    t,
    *,
    cf=2,
    max_levels: int = 30,
    min_coarse: int = 2,
    relax="FCF",
    c_weight: float = 1.0,
    cycle: str = "V",
    target: float = 0.1,
    ranks: int = 1,
    reduction: float | None = None,
    measure: bool = True,
    cost: StepCost | Sequence[StepCost] | None = None,
    latency: float = 0.0,
    samples: int = 5,
    jvp: str = "auto",
    dense_max: int = 100,
    krylov: int = 24,
    modes: int | None = 16,
    max_points: int = 128,
    seed: int = 0,
    skip: bool = True,
    max_iter: int = 100,
    expected: bool = True,
    expected_points: int = 16384,
    **ignored,
) -> Settings:
    """Predict the factor, stability, cycles and model time of given :func:`mgrit.solve` options.

    The same analysis as :func:`choose_settings` for one setting: pass the
    options you would pass to :func:`mgrit.solve` (the defaults are its
    defaults; options that do not shape the hierarchy, such as ``tol``, are
    ignored). Returns a :class:`Settings` whose ``choice`` is that setting;
    ``meets_target`` says whether it is stable with a factor ``<= target``.
    Only V-cycles are modelled. The simulated solve behind ``expected_factor``
    follows ``skip`` and ``max_iter`` (tolerance ``reduction``, relative); with
    ``nested``, an ``initial_guess``, ``residual="cycle_end"``, another
    ``norm`` or ``spatial`` coarsening it is not modelled (None).

    >>> import numpy as np
    >>> from propagators import Heat1D
    >>> heat = Heat1D(17, forcing=False)
    >>> p = predict_options(heat, heat.initial(), np.linspace(0, 1, 65), cf=4, max_levels=2, relax="F",
    ...                     measure=False, samples=2)
    >>> p.choice.describe(), p.bound, round(p.predicted_factor, 4)
    ('cf 4, 2 levels, F', True, 0.198)
    """
    import inspect

    from .solver import solve

    unknown = sorted(set(ignored) - set(inspect.signature(solve).parameters))
    if unknown:  # (a misspelt option would otherwise be left out silently: max_level for max_levels)
        raise TypeError(f"predict_options() got unexpected keyword arguments {unknown}: it takes mgrit.solve's "
                        "options and its own (see its docstring)")
    if cycle != "V":
        raise ValueError(f"only V-cycles are modelled, got cycle={cycle!r}; pass cycle='V'")
    _check_propagator(propagator)
    u0 = _check_state(u0)
    t = check_time_grid(t)
    target = _check_fraction(target, "target")
    _check_keeps_input(propagator, u0, t)
    _check_positive_int(ranks, "ranks", 1)
    h = build_hierarchy(t, cf=cf, max_levels=max_levels, min_coarse=min_coarse, relax=relax, c_weight=c_weight)
    if len(h) < 2:
        raise ValueError("these options give one level (sequential stepping): nothing to predict; "
                         "pass more time points, a smaller `cf` or `min_coarse`, or `max_levels` >= 2")
    key = tuple(lv.cf for lv in h[:-1])
    level_relax = tuple(lv.relax for lv in h[:-1])
    weight = float(h[0].c_weight)
    if any(lv.c_weight != weight for lv in h[:-1]):
        raise ValueError("per-level `c_weight` values are not modelled; pass one weight for all levels")
    unsupported = [name for name, default in (("nested", False), ("initial_guess", None), ("residual", "xbraid"),
                                              ("norm", 2), ("spatial", None))
                   if name in ignored and not _same(ignored[name], default)]
    if not isinstance(skip, (bool, np.bool_)):
        raise ValueError(f"`skip` must be True or False, got {skip!r}")
    if ignored.get("partition") is not None and len(ignored["partition"]) != ranks:
        raise ValueError(f"`partition` lists {len(ignored['partition'])} blocks but `ranks` is {ranks}: the model "
                         f"replays the solve on `ranks` ranks, one block each; pass ranks={len(ignored['partition'])}")
    an = _Analysis(propagator, u0, t, [key], reduction=reduction, measure=measure, cost=cost, latency=latency,
                   samples=samples, jvp=jvp, dense_max=dense_max, krylov=krylov, modes=modes,
                   max_points=max_points, seed=seed, ranks=ranks, min_coarse=min_coarse,
                   expected=expected, max_iter=max_iter, expected_points=expected_points,
                   skip=bool(skip), why_not=f"{', '.join(unsupported)} not modelled" if unsupported else None,
                   schedule={k: ignored[k] for k in ("nested", "residual", "final_residual", "partition")
                             if k in ignored})
    c = an.candidate(key, level_relax, weight, target)
    return an.settings(c, [c], target, c.meets_target)


def _same(a, b) -> bool:
    """``a`` is the default ``b`` (None, a bool, a number or a string; an array or a tensor is not a default)."""
    return a is None if b is None else _equal(a, b)


class _Analysis:
    """Spectra, costs, the affine model and the evaluation of candidates for one problem (internal)."""

    def __init__(self, propagator, u0, t, keys, *, reduction, measure, cost, latency, samples, jvp, dense_max,
                 krylov, modes, max_points, seed, ranks, min_coarse, expected=True, max_iter=100,
                 expected_points=16384, skip=True, why_not=None, schedule=None):
        self.reduction = _reduction(reduction, u0)
        _check_positive_int(samples, "samples", 1)
        _check_positive_int(max_points, "max_points", 8)
        _check_positive_int(max_iter, "max_iter", 1)
        _check_positive_int(expected_points, "expected_points", 8)
        if modes is not None:
            _check_positive_int(modes, "modes", 1)
        if not isinstance(measure, (bool, np.bool_)):
            raise ValueError(f"`measure` must be True or False, got {measure!r}")
        if not isinstance(expected, (bool, np.bool_)):
            raise ValueError(f"`expected` must be True or False, got {expected!r}")
        if isinstance(latency, bool) or not (isinstance(latency, (int, float, np.integer, np.floating))
                                             and 0 <= latency < math.inf):
            raise ValueError(f"`latency` must be a finite number >= 0, got {latency!r}")
        if cost is not None:
            costs = list(cost) if isinstance(cost, (list, tuple)) else [cost]
            if not costs or not all(isinstance(c, StepCost) for c in costs):
                raise TypeError(f"`cost` must be a mgrit.model.StepCost or a non-empty sequence of them (one per "
                                f"level), got {cost!r}")
        self.t, self.ranks, self.min_coarse, self.latency = t, int(ranks), int(min_coarse), float(latency)
        self.modes, self.max_points = modes, int(max_points)
        self.max_iter, self.expected_points, self.skip = int(max_iter), int(expected_points), bool(skip)
        #: the solve's options besides skip that shape the model's schedule (predict_options passes them on)
        self.schedule = dict(schedule or {})
        singles, composites = set(), set()
        for key in keys:
            st = 1
            for c in key:
                composites.add((st, c))
                st *= c
                singles.add(st)
        spec_args = dict(strides=sorted(singles), composites=sorted(composites), jvp=jvp, dense_max=dense_max,
                         krylov=krylov, seed=seed)
        # spectra at u0 and along a coarse run
        sp0 = step_spectrum(propagator, u0, t, index=0, **spec_args)
        spectra = [sp0]
        if samples > 1:
            for k, u in _sample_states(propagator, u0, t, sp0, samples)[1:]:
                spectra.append(step_spectrum(propagator, u, t, index=k, **spec_args))
        self.spectra = tuple(spectra)
        # (one sample cannot show that the step does not change along the run: then estimates only; the
        # linearizations of an affine step differ by their rounding, about 1e-10 for the heat equation)
        one_linearization = len(spectra) > 1 and all(np.allclose(sp.values, sp0.values, rtol=1e-7, atol=1e-9)
                                                     for sp in spectra)
        # samples that agree add no modes (their rounding would double the modes and push the evaluation
        # onto a subset of them)
        self.all_modes = _unique_modes([sp0] if one_linearization else spectra)
        self.col = {step: i for i, step in enumerate(sp0.steps)}
        growing = bool(np.any(np.abs(self.all_modes[:, 0]) > 1.0 + GROWTH_TOL))
        self.bound_possible = (one_linearization and not growing and all(
            sp.method == "dense" and sp.normal and sp.pairing_defect <= 1e-8 for sp in spectra))
        # the affine model of the simulated solves
        self.model, self.model_note = None, why_not or "not requested (expected=False)"
        self._stepping, self._bounded = (propagator, u0), {}  # (coarse runs of _blows_up, by stride)
        self._affine_ok, self._affine_bad = 0.0, math.inf  # (_affine: sizes checked, passed and failed)
        if expected and why_not is None:
            n = t.shape[0] - 1
            need = max(int(np.prod(key)) * self.min_coarse for key in keys)
            n_model = min(n, max(self.expected_points, need))
            # time-invariant up to the finite-difference noise (which exceeds one_linearization's atol
            # on strongly damped modes)
            lti = all(np.allclose(sp.values, sp0.values, rtol=1e-6, atol=1e-9) for sp in spectra)
            self.model, self.model_note = self._model(propagator, u0, sp0, sorted(singles | {1}), n_model, lti, jvp)
        # costs
        if cost is None:
            cost = _measure_cost(propagator, u0, t) if measure else StepCost()
        self.cost = tuple(cost) if isinstance(cost, (list, tuple)) else cost
        h = build_hierarchy(t, cf=list(keys[0]), max_levels=len(keys[0]) + 1, min_coarse=min_coarse)
        self.seq_time = sequential_time(h, list(self.cost) if isinstance(self.cost, tuple) else self.cost)

    def _model(self, propagator, u0, sp0, strides, n_model, lti, jvp):
        """The affine model (docs/tuning.md §7) and its description, or (None, why there is none).

        Modal for a time-invariant step on a uniform grid whose fine step is
        diagonalizable with coarse steps diagonal in its eigenvectors; else
        linearized along a reference trajectory (dense real states).
        """
        N = self.t.shape[0] - 1
        V = sp0.vectors
        dt = np.diff(self.t)
        uniform = bool(np.all(np.abs(dt - dt[0]) <= 1e-10 * dt[0]))
        commuting = sp0.pairing_defect <= 1e-6 or sp0.method != "dense"
        conditioned = V is not None and np.all(np.isfinite(V)) and np.linalg.cond(V) < 1e8
        model = None
        if lti and uniform and commuting and conditioned:
            model = _modal_model(propagator, u0, self.t, sp0, strides, n_model)
        if model is None:
            if B.is_complex(u0):
                return None, "complex states are modelled only by modes (a time-invariant, diagonalizable step)"
            if sp0.method != "dense":
                return None, (f"a state of {V.shape[0]} values (Arnoldi) whose step is not time-invariant "
                              "is not modelled; raise `dense_max` to linearize along a trajectory")
            d = int(V.shape[0])
            n_model = min(n_model, int(MAX_MODEL_ENTRIES / (d * d * sum(1.0 / s for s in strides))))
            if n_model < 2:
                return None, f"a state of {d} values is too large for the trajectory model"
            model = _trajectory_model(propagator, u0, self.t, sp0, [s for s in strides if n_model // s >= 1],
                                      n_model, jvp)
            if model is None:
                return None, "the reference run of the trajectory model blows up"
        note = model.description
        if model.n < N:
            note += f"; about the first {model.n} of {N} intervals"
        return model, note

    def _affine(self, size: float) -> bool:
        """Whether the fine step agrees with the trajectory model's affine maps ``A x + c`` on states of values
        up to ``size`` (the largest value a simulated iterate held), so that a simulated solve whose iterate
        strayed from the reference states may be trusted: at 32 random states with entries in
        ``[-1.5 size, 1.5 size]``, 4 at each of 8 intervals spread over the model, to ``1000 eps^(2/3)`` of the
        values' size (central differences' rounding; ``eps`` the states' precision). A heuristic: a step that
        is nonlinear only in directions or intervals it does not sample passes."""
        if self._affine_ok >= size:
            return True
        if self._affine_bad <= size:
            return False
        propagator, u0 = self._stepping
        A, c = self.model.steps[1]
        n, d = self.model.n, self.model.reference.shape[1]
        ks = np.repeat(np.unique(np.linspace(1, n, min(n, 8)).round().astype(int)), 4)
        X = 1.5 * size * np.random.default_rng(0).uniform(-1.0, 1.0, (ks.size, d))
        with np.errstate(all="ignore"):
            F = _steps(propagator, X, self.t[ks - 1], self.t[ks], u0)
            P = np.einsum("kij,kj->ki", A[ks].astype(np.float64), X) + c[ks]
            scale = max(float(np.max(np.abs(F))), float(np.max(np.abs(P))), 1.5 * size)
            gap = float(np.max(np.abs(F - P)))
        if math.isfinite(gap) and gap <= 1e3 * self.model.eps ** (2.0 / 3.0) * scale:
            self._affine_ok = size
            return True
        self._affine_bad = size
        return False

    def _blows_up(self, stride: int) -> bool:
        """Whether the sequential run over every ``stride``-th point (the steps of a coarse level) blows up
        (one run per stride, stopped where it blows up; not repeated at smaller strides)."""
        if stride not in self._bounded:
            idx, states = _run_once(*self._stepping, self.t, stride)
            self._bounded[stride] = len(states) == len(idx)
        return not self._bounded[stride]

    def _expected(self, key, level_relax, w, stable=True):
        """``(expected factor, cycles, at the rounding level, why not modelled)`` of the simulated solve of
        one candidate, or ``(None, None, False, why)``."""
        if self.model is None:
            return None, None, False, ""
        N, P = self.t.shape[0] - 1, int(np.prod(key))
        n = N if N <= self.expected_points else P * max(self.min_coarse, self.expected_points // P)
        if n > self.model.n:
            return None, None, False, ""
        sizes = [n]
        for c in key:
            sizes.append(sizes[-1] // c)
        if sizes[-1] < 1 or any(st not in self.model.steps for st in np.cumprod((1,) + tuple(key))):
            return None, None, False, ""
        args = (sizes, list(key), [parse_relax(r) for r in level_relax], [w] * len(key))
        kw = dict(reduction=self.reduction, max_iter=self.max_iter, skip=self.skip)
        res, converged, floor, left, _ = _simulate(self.model, *args, **kw)
        if left and stable:  # an affine step's model holds at any distance (a stretch of large steps whose
            # coarse step amplifies: the iterate leaves the reference far behind, yet converges): simulated on
            # without the reference, kept where the step agrees with the model as far as the iterate went
            again = _simulate(dataclasses.replace(self.model, reference=None), *args, **kw)
            if self._affine(again[4]):
                res, converged, floor, left = again[:4]
        if left:  # the prediction of the nonlinear solve is void: it is expected to diverge when one of its
            # levels' nonlinear coarse runs blows up (Van der Pol's large RK4 steps); when they all stay bounded
            # the linearization failed, not the solve (Lorenz over 20 time units: its errors grow like
            # e^(0.9 t) along the linearization, but saturate on the attractor), and it is not modelled
            if any(self._blows_up(int(st)) for st in np.cumprod(key)[::-1]):  # (the coarsest first)
                return math.inf, None, False, ""
            return None, None, False, _UNMODELLED
        last = [x for x in res if x is not None][-1:]
        # (an exact 0 too: the solver's own residual is then at the rounding level, not 0)
        at_floor = bool(last and math.isfinite(last[0]) and 0.0 <= last[0] <= FLOOR_MARGIN * floor)
        return average_factor(res), (len(res) if converged else None), at_floor, ""

    def candidate(self, key, level_relax, w, target) -> Candidate:
        t, L = self.t, len(key) + 1
        h = build_hierarchy(t, cf=list(key), max_levels=L, min_coarse=self.min_coarse, relax=list(level_relax),
                            c_weight=w)
        sizes = [lv.n for lv in h]
        stable, note, fac, q, rate, exact = _evaluate(self.all_modes, self.col, sizes, list(key),
                                                      list(level_relax), w, self.modes, self.max_points,
                                                      self.min_coarse, self.reduction)
        exp, exp_cycles, at_floor, unmodelled = self._expected(key, level_relax, w, stable)
        cycles = None if q is None else (2 if self.skip else 1) + q  # (without skip the first cycle measures)
        # a factor `target` every cycle reduces by `reduction` in q_target cycles; a setting exact only after
        # more (its P^q is 0 while the cycles before it reduce slowly) has a rate near 0 but is not faster
        q_target = max(1, math.ceil(math.log(self.reduction) / math.log(target) - 1e-12))
        first = 2 if self.skip else 1  # the cycle that measures the first residual
        slow = q is not None and q > q_target
        sim_slow = exp_cycles is not None and exp_cycles - first > q_target  # (the simulated solve sees more)
        if stable and cycles is None:
            note = "; ".join(x for x in ("does not converge (predicted)", note) if x)
        elif stable and exp is not None and exp_cycles is None:
            why = ("leaves the linearization" if exp == math.inf else "diverges" if not exp < 1.0
                   else "stalls at the rounding level" if at_floor else f"needs over {self.max_iter} cycles")
            note = "; ".join(x for x in (f"{why} (simulated solve)", note) if x)
        elif stable and rate > target:
            note = "; ".join(x for x in (f"rate above target {target:g}", note) if x)
        elif stable and (slow or sim_slow):
            need, how = (q, "") if slow else (exp_cycles - first, " (simulated solve)")
            note = "; ".join(x for x in (f"needs {need} cycles to reduce the residual by {self.reduction:g}{how}, "
                                         f"a factor {target:g} needs {q_target}", note) if x)
        if unmodelled:
            note = "; ".join(x for x in (note, f"{unmodelled} (simulated solve)") if x)
        tm = math.inf
        if cycles is not None:  # the simulated solve's cycles where it needs more (docs/tuning.md §6)
            cost = list(self.cost) if isinstance(self.cost, tuple) else self.cost
            simulated = 0 if exp is None else exp_cycles if exp_cycles is not None else self.max_iter
            n = max(cycles, simulated)
            tm = _time_to_tolerance(h, self.ranks, n, cost, self.latency, dict(self.schedule, skip=self.skip),
                                    converged=n < self.max_iter)
        c = Candidate(tuple(key), L, tuple(level_relax), float(w), self.min_coarse, fac, rate, cycles, tm,
                      stable, False, note, exact, exp, exp_cycles, at_floor)
        meets = stable and rate <= target and not slow and not sim_slow and not c.simulated_divergence
        return dataclasses.replace(c, meets_target=meets)

    def settings(self, choice, cands, target, meets) -> Settings:
        return Settings(choice, tuple(cands), float(target), self.ranks, self.reduction, self.cost,
                        self.seq_time, self.spectra, bool(self.bound_possible and choice.exact), bool(meets),
                        self.model_note)
