"""Inter-level transfer (FAS restriction, ideal interpolation) and the cycle.

Level ``l`` with factor ``m`` and its coarse level ``l + 1`` share points: the
coarse point ``k`` is the fine C-point ``i = k m``. A rank owns the same
points on both levels, so injection and correction are local; only the coarse
ghost needs a message.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import _backend as B
from .relax import LevelState, advance, c_relax, c_residual, exchange, f_relax, sequential_solve


class DivergenceError(FloatingPointError):
    """The iteration produced NaN or Inf; raised instead of returning a result."""


def _inject(w: LevelState, wc: LevelState):
    """``v_c = R_x(u_i)`` at the fine C-points this rank owns (the initial point included).

    Stores it in ``wc.v``, fills the coarse ghost from the left neighbour and
    starts the coarse iterate at ``u_c = v_c``.
    """
    m = w.level.cf
    own0 = w.lo - w.g0  # local slot of the first owned point
    ac = own0 if (w.g0 + own0) % m == 0 else w.first(0)
    U = w.u[ac::m]
    V = w.transfer.restrict(U) if w.transfer is not None else B.copy(U)
    if wc.v is None:
        wc.v = B.empty_stack(wc.nloc, V[0])
        wc.u = B.empty_stack(wc.nloc, V[0])
    wc.v[wc.lo - wc.g0 :] = V
    exchange(wc, wc.v)
    wc.u[:] = wc.v


def restrict(w: LevelState, wc: LevelState, r) -> None:
    """FAS restriction from level ``w`` to ``wc`` given the fine C-point residuals ``r``.

    Per coarse point ``k >= 1`` (fine C-point ``i = k m``), REFERENCE.md 1:
    ``g_c[k] = R_x(g_i - u_i + Phi(u_{i-1})) + v[k] - Psi(v[k-1])``.
    """
    # 1. inject the fine C-points: v = R_x u (this is also the coarse initial iterate)
    _inject(w, wc)
    if wc.nloc == 1:  # this rank holds only coarse point 0 (the initial condition)
        return
    # 2. the coarse operator applied to v: Psi(v[k-1]) for every owned k >= 1
    psi = advance(wc, wc.v[:-1], wc.tl[:-1], wc.tl[1:])
    # 3. restrict the fine residual r_i = g_i + Phi(u_{i-1}) - u_i
    rc = w.transfer.restrict_residual(r) if w.transfer is not None else r
    # 4. g_c = r_c + A_c-consistent shift: v[k] - Psi(v[k-1])
    if wc.g is None:
        wc.g = B.zeros_stack(wc.nloc, wc.v[0])
    wc.g[1:] = rc + (wc.v[1:] - psi)


def inject_guess(w: LevelState, wc: LevelState) -> None:
    """XBraid's skip: inject the fine iterate to the coarse level with a zero right-hand side."""
    _inject(w, wc)
    wc.g = None


def correct(w: LevelState, wc: LevelState) -> None:
    """Add the coarse correction ``P_x(u_c - v_c)`` to the fine C-points ``i >= 1``."""
    if wc.nloc <= 1:
        return
    E = wc.u[1:] - wc.v[1:]
    if w.transfer is not None:
        E = w.transfer.interpolate(E)
    a = w.first(0)
    w.u[a :: w.level.cf] += E


@dataclass
class CycleContext:
    """What one cycle needs besides the level states."""

    states: list  # LevelState or None (rank owns no point there), finest first
    iteration: int = 0
    relaxed0: bool = False  # level-0 F-points are consistent with its C-points

    def check(self, l: int, X=None) -> None:
        """Raise DivergenceError if ``X`` (default: all states of level ``l``) has NaN or Inf."""
        if not B.all_finite(self.states[l].u if X is None else X):
            raise DivergenceError(
                f"MGRIT diverged: NaN or Inf on level {l} in iteration {self.iteration}; "
                "reduce the time step, use more levels of relaxation ('FCF') or a smaller `cf`"
            )


def down(ctx: CycleContext, l: int, skip: bool):
    """Relax level ``l`` and set up the problem of level ``l + 1``.

    Returns the C-point residuals of level ``l`` (None when skipping).
    """
    w, wc = ctx.states[l], ctx.states[l + 1]
    if skip:
        if wc is not None:
            inject_guess(w, wc)
        return None
    # After a cycle-end residual the fine F-points are already relaxed: the
    # first F-relaxation would recompute the same values, so it is left out.
    relaxed = l == 0 and ctx.relaxed0
    if l == 0:
        ctx.relaxed0 = False
    for _ in range(w.level.nrelax):
        if not relaxed:
            f_relax(w)
        relaxed = False
        c_relax(w)
    if not relaxed:
        f_relax(w)
    r = c_residual(w)
    # A NaN or Inf in an interval reaches the residual at its closing C-point, so
    # checking r (1/m of the states) suffices; trailing F-points are checked at the end.
    ctx.check(l, r)
    if wc is not None:
        restrict(w, wc, r)
    return r


def cycle(ctx: CycleContext, l: int, kind: str, skip: bool = False):
    """One V- or F-cycle starting on level ``l``.

    ``V(l)``: down(l); V(l+1); F-relax(l+1); correct(l).
    ``F(l)``: down(l); F(l+1); V(l+1); F-relax(l+1); correct(l).
    Returns the C-point residuals computed on level ``l`` (None when skipped).
    """
    w = ctx.states[l]
    if w is None:
        return None
    last = len(ctx.states) - 1
    if l == last:
        sequential_solve(w)
        ctx.check(l)
        return None
    r = down(ctx, l, skip)
    if ctx.states[l + 1] is not None:
        cycle(ctx, l + 1, kind, skip)
        if kind == "F" and not skip and l + 1 < last:
            cycle(ctx, l + 1, "V")
        if l + 1 < last:
            f_relax(ctx.states[l + 1])
        correct(w, ctx.states[l + 1])
    return r


def temporal_norm(norms: np.ndarray, p, comm) -> float:
    """Temporal ``p``-norm (2, 1 or inf) of the spatial norms of all ranks' C-point residuals.

    Sums are exact (correctly rounded) so that the value does not depend on
    the number of ranks; a NaN or Inf anywhere gives ``inf`` or NaN. The
    2-norm is ``sqrt`` of the exact sum of the rounded squares, formed without
    overflow or underflow (:meth:`Communicator.norm2_exact`: one reduction):
    states near ``1e200`` give their true residual, not a false divergence.
    """
    if p == 2:
        return comm.norm2_exact(norms)
    if p == 1:
        return comm.sum_exact(norms)
    return max(comm.max(norms), 0.0)


def nested_start(ctx: CycleContext, kind: str) -> None:
    """Nested iteration (full multigrid start) before the first cycle.

    The fine initial guess is injected to every level with a zero right-hand
    side, so each level holds the rediscretized problem; the coarsest level is
    solved, and then, from coarse to fine, every intermediate level receives the
    solution of the level below it and runs one cycle on its own sub-hierarchy.
    The finest level finally receives the corrected C-points from level 1.
    """
    S, last = ctx.states, len(ctx.states) - 1
    for l in range(last):
        if S[l] is not None and S[l + 1] is not None:
            inject_guess(S[l], S[l + 1])
    if S[last] is not None:
        sequential_solve(S[last])
    for l in range(last - 1, -1, -1):
        if S[l] is None:
            continue
        if S[l + 1] is not None:
            if l + 1 < last:
                f_relax(S[l + 1])
            correct(S[l], S[l + 1])
        if l > 0:  # every owner of level-l points takes part, coarse points or not
            cycle(ctx, l, kind)
