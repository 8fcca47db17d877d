"""Inter-level transfer (FAS restriction, ideal interpolation) and the schedule of a solve.

Level ``l`` with factor ``m`` and its coarse level ``l + 1`` share points: the
coarse point ``k`` is the fine C-point ``i = k m``. A rank owns the same
points on both levels, so injection and correction are local; only the coarse
ghost needs a message.

The schedule (:func:`run`: nested start, cycles, residual norms, final
relaxation) is written once, against the small set of level operations of
:class:`LevelOps`. :class:`Levels` executes them on one rank's iterates (the
solver); :mod:`mgrit.model` replays the same calls on the simulated clocks of
all ranks (the critical-path cost model), so the two cannot drift apart.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from . import _backend as B
from .comm import RemoteRankError
from .propagator import Propagator
from .relax import LevelState, advance, c_relax, c_residual, exchange, f_relax, sequential_solve


_NAMED = re.compile(r"(propagator|spatial transfer) of level \d+")  # the solver's own checks name the level


class DivergenceError(FloatingPointError):
    """The iteration produced NaN or Inf; raised instead of returning a result."""


def _transferred(out, U, w: LevelState, method: str, fine_shape=None):
    """``out``, returned by ``w.transfer.<method>(U)``, checked as a stack of ``U``'s rows: an array of
    ``U``'s kind (a list or tuple of numpy states becomes one; tensors for torch states), one row per input
    row, not tracked by autograd, non-empty states, and for ``interpolate`` states with the fine states'
    axes that broadcast to their shape (they are added to them in place). Reads only metadata."""
    where = f"the spatial transfer of level {w.level.index} ({type(w.transfer).__name__}.{method})"
    if isinstance(out, (list, tuple)) and not B.is_torch(U):
        out = np.asarray(out)
    if out is None or not hasattr(out, "shape") or isinstance(out, (list, tuple)) or B.is_torch(out) != B.is_torch(U):
        raise TypeError(f"{where} returned {B.type_name(out)} for a stack of {B.type_name(U)}; it must return "
                        "a stack of states (numpy arrays for numpy states, tensors for torch states)")
    if B.requires_grad(out):
        raise ValueError(f"{where} returned a tensor that requires grad (computed from parameters that require "
                         "grad): the solver does not differentiate through its transfers; compute it under "
                         "torch.no_grad() or from detached tensors")
    shape = tuple(out.shape)
    if not shape or shape[0] != U.shape[0]:
        raise ValueError(f"{where} returned shape {shape} for a stack of shape {tuple(U.shape)}: it maps a stack "
                         f"of n states to n states (n = {U.shape[0]}), one row per state")
    if fine_shape is not None:
        fine_shape = tuple(fine_shape)
        try:  # rows that broadcast onto the fine states (a spatial mean as an (n, 1) stack), with as many axes
            fits = len(shape) == len(fine_shape) + 1 and np.broadcast_shapes(shape[1:], fine_shape) == fine_shape
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(f"{where} returned states of shape {shape[1:]}; the states of level {w.level.index} "
                             f"have shape {fine_shape}: interpolate maps (n, *coarse_shape) to (n, *fine_shape)")
    elif shape[0] and int(np.prod(shape[1:])) == 0:
        raise ValueError(f"{where} restricts states of shape {tuple(U.shape[1:])} to empty states {shape[1:]}: "
                         "the hierarchy has more levels than this spatial coarsening allows; pass fewer "
                         "`max_levels` (the last transfer of a list repeats on every coarser level)")
    return out


def _transfer(w: LevelState, method: str, U):
    """``w.transfer.<method>(U)`` for ``restrict`` and ``restrict_residual``, whose input is the solver's own
    storage (the fine C-points, the C-point residuals that the residual norms are read from): the first call
    of each per solve and level is checked for writing into it (its first and last rows, compared with a copy
    taken before), as :func:`mgrit.relax` checks ``step``."""
    fn = getattr(w.transfer, method)
    if method in w.watched or U.shape[0] == 0:
        return _transferred(fn(U), U, w, method)
    w.watched.add(method)
    ends = [0, U.shape[0] - 1]
    before = U[ends]  # (a copy: fancy indexing, numpy and torch alike)
    out = _transferred(fn(U), U, w, method)
    if not B.same_values(before, U[ends]):
        raise ValueError(
            f"the spatial transfer of level {w.level.index} ({type(w.transfer).__name__}.{method}) changed its "
            "input in place (`U[:, 0] = ...`, `U *= ...`): that input is the solver's own storage (the fine "
            "C-points, or the residuals whose norms it reports); compute into a new array (`U = U.copy()` "
            "first) and return it")
    return out


def _inject(w: LevelState, wc: LevelState):
    """``v_c = R_x(u_i)`` at the fine C-points this rank owns (the initial point included).

    Stores it in ``wc.v``, fills the coarse ghost from the left neighbour and
    starts the coarse iterate at ``u_c = v_c``.
    """
    m = w.level.cf
    own0 = w.lo - w.g0  # local slot of the first owned point
    ac = own0 if (w.g0 + own0) % m == 0 else w.first(0)
    U = w.u[ac::m]
    V = _transfer(w, "restrict", U) if w.transfer is not None else U
    if wc.v is None:
        wc.v = B.empty_stack(wc.nloc, V[0])
        wc.u = B.empty_stack(wc.nloc, V[0])
    wc.v[wc.lo - wc.g0 :] = V  # (a copy: no transfer needs no copy of its own)
    exchange(wc, wc.v)
    wc.u[...] = wc.v


def restrict(w: LevelState, wc: LevelState, r) -> None:
    """FAS restriction from level ``w`` to ``wc`` given the fine C-point residuals ``r``.

    Per coarse point ``k >= 1`` (fine C-point ``i = k m``), docs/theory.md §3:
    ``g_c[k] = R_x(g_i - u_i + Phi(u_{i-1})) + v[k] - Psi(v[k-1])``.
    """
    # 1. inject the fine C-points: v = R_x u (this is also the coarse initial iterate)
    _inject(w, wc)
    if wc.nloc == 1:  # this rank holds only coarse point 0 (the initial condition)
        return
    if wc.g is None:
        wc.g = B.zeros_stack(wc.nloc, wc.v[0])
    G = wc.g[1:]  # g_c[0] stays zero
    # 2. the coarse operator applied to v: Psi(v[k-1]) for every owned k >= 1
    psi = advance(wc, wc.v[:-1], wc.tl[:-1], wc.tl[1:], out=G)
    # 3. restrict the fine residual r_i = g_i + Phi(u_{i-1}) - u_i
    rc = _transfer(w, "restrict_residual", r) if w.transfer is not None else r
    if w.transfer is not None and tuple(rc.shape[1:]) != tuple(wc.v.shape[1:]):
        raise ValueError(f"the spatial transfer of level {w.level.index} ({type(w.transfer).__name__}) restricts "
                         f"residuals to shape {tuple(rc.shape[1:])} but states to {tuple(wc.v.shape[1:])}: "
                         "restrict_residual must map to the coarse states' shape")
    # 4. g_c = r_c + A_c-consistent shift: v[k] - Psi(v[k-1]) (in place when Psi was written to G)
    if psi is G:
        B.subtract_into(wc.v[1:], G, G)
        G += rc
    else:
        G[...] = rc + (wc.v[1:] - psi)


def inject_guess(w: LevelState, wc: LevelState) -> None:
    """XBraid's skip: inject the fine iterate to the coarse level with a zero right-hand side."""
    _inject(w, wc)
    wc.g = None


def correct(w: LevelState, wc: LevelState) -> None:
    """Add the coarse correction ``P_x(u_c - v_c)`` to the fine C-points ``i >= 1``."""
    if wc.nloc <= 1:
        return
    a = w.first(0)
    if w.transfer is not None:
        E = wc.u[1:] - wc.v[1:]
        w.u[a :: w.level.cf] += _transferred(w.transfer.interpolate(E), E, w, "interpolate", w.u.shape[1:])
        return
    # v is not read again before the next injection overwrites it: E = u_c - v_c is formed there
    E = B.subtract_into(wc.u[1:], wc.v[1:], wc.v[1:])
    w.u[a :: w.level.cf] += E


def temporal_norm(norms: np.ndarray, p, comm) -> float:
    """Temporal ``p``-norm (2, 1 or inf) of the spatial norms of all ranks' C-point residuals.

    Sums are exact (correctly rounded) so that the value does not depend on
    the number of ranks; a NaN or Inf anywhere gives ``inf`` or NaN. The
    2-norm is ``sqrt`` of the exact sum of the rounded squares, formed without
    overflow or underflow (:meth:`Communicator.norm2_exact`: one reduction):
    states near ``1e200`` give their true residual, not a false divergence.
    """
    return temporal_norms([norms], p, comm)[0]


def temporal_norms(parts: list, p, comm) -> list:
    """:func:`temporal_norm` of every entry of ``parts`` (arrays of spatial norms), in one reduction."""
    kind = {2: "norm2", 1: "sum"}.get(p, "max")
    values = comm.exact_many(parts, kind)
    return [max(v, 0.0) for v in values] if kind == "max" else values


def _spatial_norms(prop, R) -> np.ndarray:
    """``prop.norms(R)``; a user's override is checked: one real value per row, none negative (NaN and Inf
    pass: they are reported as a divergence)."""
    out = prop.norms(R)
    if type(prop).norms is Propagator.norms:
        return out
    name = f"{type(prop).__name__}.norms"
    try:
        if out.is_complex() if B.is_torch(out) else np.iscomplexobj(out):
            raise TypeError
        arr = np.asarray(out.detach().cpu() if B.is_torch(out) else out, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} returned {B.type_name(out)}; it must return one real norm per state of the "
                        f"stack (a float64 array of shape ({R.shape[0]},))") from None
    if arr.shape != (R.shape[0],):
        raise ValueError(f"{name} returned shape {arr.shape} for a stack of {R.shape[0]} states; it must return "
                         f"one norm per state, shape ({R.shape[0]},)")
    if bool(np.any(arr < 0)):
        raise ValueError(f"{name} returned a negative norm ({float(arr[arr < 0][0])!r}); norms are >= 0")
    return arr


# --------------------------------------------------------------------------- level operations
class LevelOps(ABC):
    """The operations the schedule is written against, on one rank or on all of them.

    :class:`Levels` does the numerics of one rank (what :func:`mgrit.solve`
    runs); :mod:`mgrit.model` replays the same calls on simulated clocks of
    every rank. ``l`` is a level index; ``R`` is what :meth:`c_residual`
    returned (opaque to the schedule).
    """

    @abstractmethod
    def owns(self, l: int) -> bool:
        """This rank (the model: some rank) holds points of level ``l``."""

    @abstractmethod
    def f_relax(self, l: int) -> None:
        """F-relaxation of level ``l`` (ghost exchanges included)."""

    @abstractmethod
    def c_relax(self, l: int) -> None:
        """C-relaxation of level ``l``."""

    @abstractmethod
    def c_residual(self, l: int):
        """The residuals at the C-points of level ``l``."""

    @abstractmethod
    def check(self, l: int, R=None, iteration: int = 0) -> None:
        """Raise :class:`DivergenceError` on NaN or Inf in ``R`` (default: level ``l``'s iterate)."""

    @abstractmethod
    def restrict(self, l: int, R) -> None:
        """FAS restriction to level ``l + 1`` from the C-point residuals ``R`` of level ``l``."""

    @abstractmethod
    def inject(self, l: int) -> None:
        """Skip: inject level ``l`` to level ``l + 1`` with a zero right-hand side."""

    @abstractmethod
    def correct(self, l: int) -> None:
        """Coarse-grid correction of level ``l`` from level ``l + 1``."""

    @abstractmethod
    def sequential_solve(self, l: int) -> None:
        """Exact solve of level ``l`` by stepping (a chain over the ranks)."""

    @abstractmethod
    def residual_norm(self, R):
        """Temporal norm of the level-0 residuals ``R`` of all ranks (an all-reduce)."""

    def residual_norms(self, Rs: list) -> list:
        """:meth:`residual_norm` of every entry of ``Rs``, in one all-reduce."""
        return [self.residual_norm(R) for R in Rs]

    @abstractmethod
    def finish(self) -> None:
        """The closing handshake of the ranks."""


class Levels(LevelOps):
    """The numerics: the level operations on this rank's :class:`LevelState` objects.

    ``states[l]`` is None where the rank owns no point of level ``l``; ``p``
    is the temporal norm (1, 2 or inf) and ``comm`` the communicator.
    """

    def __init__(self, states: list, comm, p):
        self.states, self.comm, self.p = states, comm, p

    def owns(self, l):
        return self.states[l] is not None

    def _on(self, levels: tuple, what: str, fn, *args):
        """``fn(*args)``; an error of the user's code (a propagator, a spatial transfer) gets a note naming
        the operation and the levels it works on (their propagators, state shapes and transfers), unless it
        is one of the solver's own checks, whose message names the level already."""
        try:
            return fn(*args)
        except (DivergenceError, RemoteRankError):
            raise
        except Exception as exc:
            if hasattr(exc, "add_note") and not _NAMED.search(str(exc)):  # (Python >= 3.11)
                parts = []
                for l in levels:
                    w = self.states[l] if l < len(self.states) else None
                    if w is None or w.u is None:
                        continue
                    transfer = "" if w.transfer is None or l == levels[-1] and len(levels) > 1 else \
                        f", spatial transfer {type(w.transfer).__name__} to level {l + 1}"
                    parts.append(f"level {l}: propagator {type(w.prop).__name__}, states of shape "
                                 f"{tuple(w.u.shape[1:])}{transfer}")
                exc.add_note(f"mgrit: raised in {what} ({'; '.join(parts)}); with a list of propagators or "
                             "spatial transfers, check these levels' entries (the last entry repeats on coarser "
                             "levels)")
            raise

    def f_relax(self, l):
        self._on((l,), f"the F-relaxation of level {l}", f_relax, self.states[l])

    def c_relax(self, l):
        self._on((l,), f"the C-relaxation of level {l}", c_relax, self.states[l])

    def c_residual(self, l):
        return self._on((l,), f"the C-point residual of level {l}", c_residual, self.states[l])

    def check(self, l, R=None, iteration=0):
        x = self.states[l].u if R is None else R
        if not B.all_finite(x):
            half = ("" if str(x.dtype) not in ("float16", "torch.float16") else
                    ". In float16 (largest value 65504) a residual or a correction, the difference of two states, "
                    "overflows where the states themselves may not: compute in float32, or scale the problem")
            raise DivergenceError(
                f"MGRIT diverged: NaN or Inf on level {l} in iteration {iteration}. Either the propagator "
                "returned NaN or Inf for some state (a layer's log or sqrt of a negative value, an overflow: "
                "check it on the serial trajectory) or the iteration diverged. A coarse step that is unstable "
                "(an explicit scheme over too long a step) is the usual cause: use fewer levels (`max_levels`, "
                "a larger `min_coarse`), then more relaxation (relax='FCF') or a smaller `cf`; "
                "mgrit.choose_settings(propagator, u0, t) checks every level's stability and picks them" + half
            )

    def restrict(self, l, R):
        self._on((l, l + 1), f"the FAS restriction from level {l} to {l + 1}", restrict, self.states[l],
                 self.states[l + 1], R)

    def inject(self, l):
        self._on((l, l + 1), f"the injection from level {l} to {l + 1}", inject_guess, self.states[l],
                 self.states[l + 1])

    def correct(self, l):
        self._on((l, l + 1), f"the correction of level {l} from {l + 1}", correct, self.states[l],
                 self.states[l + 1])

    def sequential_solve(self, l):
        self._on((l,), f"the sequential solve of level {l}", sequential_solve, self.states[l])

    def residual_norm(self, R):
        return self.residual_norms([R])[0]

    def residual_norms(self, Rs):
        w0 = self.states[0]
        parts = [_spatial_norms(w0.prop, R) if w0 is not None and R is not None else np.zeros(0) for R in Rs]
        return temporal_norms(parts, self.p, self.comm)

    def finish(self):
        self.comm.finish()


# --------------------------------------------------------------------------- the schedule
@dataclass
class Sweep:
    """Where the schedule stands: its operations, the relaxations per level and two flags."""

    ops: LevelOps
    nrelax: list  # (C, F) sweeps after the first F sweep, per level (Level.nrelax)
    iteration: int = 0
    relaxed0: bool = False  # level-0 F-points are consistent with its C-points

    @property
    def n_levels(self) -> int:
        return len(self.nrelax)


def down(s: Sweep, l: int, skip: bool):
    """Relax level ``l`` and set up the problem of level ``l + 1`` (docs/theory.md §4).

    Returns the C-point residuals of level ``l`` (None when skipping).
    """
    ops = s.ops
    if skip:
        if ops.owns(l + 1):
            ops.inject(l)
        return None
    # After a cycle-end residual the fine F-points are already relaxed: the
    # first F-relaxation would recompute the same values, so it is left out.
    relaxed = l == 0 and s.relaxed0
    if l == 0:
        s.relaxed0 = False
    for _ in range(s.nrelax[l]):
        if not relaxed:
            ops.f_relax(l)
        relaxed = False
        ops.c_relax(l)
    if not relaxed:
        ops.f_relax(l)
    r = ops.c_residual(l)
    # A NaN or Inf in an interval reaches the residual at its closing C-point, so
    # checking r (1/m of the states) suffices; trailing F-points are checked at the end.
    ops.check(l, r, s.iteration)
    if ops.owns(l + 1):
        ops.restrict(l, r)
    return r


def cycle(s: Sweep, l: int, kind: str, skip: bool = False):
    """One V- or F-cycle starting on level ``l``.

    ``V(l)``: down(l); V(l+1); F-relax(l+1); correct(l).
    ``F(l)``: down(l); F(l+1); V(l+1); F-relax(l+1); correct(l).
    Returns the C-point residuals computed on level ``l`` (None when skipped).
    """
    ops = s.ops
    if not ops.owns(l):
        return None
    last = s.n_levels - 1
    if l == last:
        ops.sequential_solve(l)
        ops.check(l, None, s.iteration)
        return None
    r = down(s, l, skip)
    if ops.owns(l + 1):
        cycle(s, l + 1, kind, skip)
        if kind == "F" and not skip and l + 1 < last:
            cycle(s, l + 1, "V")
        if l + 1 < last:
            ops.f_relax(l + 1)
        ops.correct(l)
    return r


def nested_start(s: Sweep, kind: str) -> None:
    """Nested iteration (full multigrid start) before the first cycle.

    The fine initial guess is injected to every level with a zero right-hand
    side, so each level holds the rediscretized problem; the coarsest level is
    solved, and then, from coarse to fine, every intermediate level receives the
    solution of the level below it and runs one cycle on its own sub-hierarchy.
    The finest level finally receives the corrected C-points from level 1.
    """
    ops, last = s.ops, s.n_levels - 1
    for l in range(last):
        if ops.owns(l) and ops.owns(l + 1):
            ops.inject(l)
    if ops.owns(last):
        ops.sequential_solve(last)
    for l in range(last - 1, -1, -1):
        if not ops.owns(l):
            continue
        if ops.owns(l + 1):
            if l + 1 < last:
                ops.f_relax(l + 1)
            ops.correct(l)
        if l > 0:  # every owner of level-l points takes part, coarse points or not
            cycle(s, l, kind)


def run(ops: LevelOps, hierarchy, opts, after_cycle: Callable[[int, object], bool]):
    """The whole schedule of a solve: the start, the cycles, the final relaxation and handshake.

    ``after_cycle(k, norm)`` is called after cycle ``k`` with the residual norm
    that :meth:`LevelOps.residual_norm` returned (None when the cycle measured
    none) and returns True to stop. ``opts`` is an :class:`mgrit.options.Options`.
    Returns the residual norm of the returned solution when
    ``opts.final_residual`` (else None).
    """
    L = len(hierarchy)
    s = Sweep(ops, [lv.nrelax for lv in hierarchy])
    final = None
    if L == 1:
        cycle(s, 0, opts.cycle)  # sequential stepping
        if opts.final_residual:
            final = ops.residual_norm(None)  # exact: 0
        ops.finish()
        return final
    if opts.nested:
        nested_start(s, opts.cycle)
    norm = pending = None
    deferred = False
    for k in range(opts.max_iter):
        s.iteration = k
        skipped = opts.skip_first and k == 0
        r = cycle(s, 0, opts.cycle, skip=skipped)
        if opts.at_cycle_end:  # measure on the iterate as it would be returned
            skipped = False
            if ops.owns(0):
                ops.f_relax(0)
                r = ops.c_residual(0)
                ops.check(0, r, k)
            s.relaxed0 = True
        if k == opts.max_iter - 1 and not skipped and _one_reduction_at_end(opts):
            pending, deferred = r, True  # its norm is reduced with the final residual's (below): one all-reduce
            break
        norm = None if skipped else ops.residual_norm(r)
        if after_cycle(k, norm):
            break
    if ops.owns(0):
        if not s.relaxed0:  # (a cycle-end residual has relaxed it already)
            ops.f_relax(0)  # ideal interpolation of the last correction
        ops.check(0, None, s.iteration)  # every state, the trailing F-points included
    if deferred:
        norm, final = ops.residual_norms([pending, ops.c_residual(0) if ops.owns(0) else None])
        after_cycle(s.iteration, norm)
    elif opts.final_residual and opts.at_cycle_end:
        final = norm  # measured on exactly the returned iterate
    elif opts.final_residual:
        final = ops.residual_norm(ops.c_residual(0) if ops.owns(0) else None)
    ops.finish()
    return final


def _one_reduction_at_end(opts) -> bool:
    """The last cycle's residual norm may wait for the final residual's, to share its all-reduce:
    nothing reads it before (no callback, and the loop ends after the last cycle anyway)."""
    return opts.final_residual and not opts.at_cycle_end and opts.callback is None
