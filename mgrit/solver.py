"""``mgrit.solve``: set up the hierarchy and iterates, run cycles, report."""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import numpy as np

from . import _backend as B
from ._inputs import array_sums, differing_rank, spread, sums_rtol
from .comm import Call, Communicator, InSession, args_signature, as_communicator, warn_if_alone
from .cycle import DivergenceError, Levels, run
from .hierarchy import is_integer, per_level
from .options import Options
from .partition import level_ranges, neighbours
from .propagator import Propagator
from .relax import LevelState
from .result import IterationInfo, Result, Status
from .spatial import SpatialTransfer

#: A solve that did not converge is reported as diverged when its last residual
#: exceeds this multiple of its first available (nonzero) residual.
DIVERGENCE_GROWTH = 1e3


def _check_propagators(propagator, n_levels: int) -> list:
    props = per_level(propagator, n_levels, "propagator")
    for p in props:
        if not isinstance(p, Propagator):
            raise TypeError(
                "`propagator` must be an mgrit.Propagator (or one per level), "
                f"got {type(p).__name__}; subclass mgrit.Propagator and implement step(u, t0, t1)"
            )
    return props


def _guess_like_u0(g, u0, name: str):
    """A guess (array, tensor or scalar) as an array of ``u0``'s library and device; a complex guess for a
    real ``u0`` and a tracked tensor are refused (numpy would drop the imaginary part with a warning)."""
    _check_no_grad(g, "initial_guess")
    given = g
    try:
        g = g if B.is_torch(g) else np.asarray(g)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise TypeError(f"{name} must be a number, a state or a trajectory of states; numpy cannot read "
                        f"{B.type_name(g)} as an array ({exc})") from None
    if not B.is_torch(g) and (g.dtype.kind not in "biufcO" or g.dtype.kind == "O" and any(
            x is None or isinstance(x, (str, bytes)) for x in g.flat)):
        raise TypeError(f"{name} must hold numbers, got {given!r:.60}")
    if not B.is_torch(g) and g.dtype.kind == "O":  # Python numbers (Fractions, Decimals): as floats
        try:
            try:
                g = g.astype(np.float64)
            except TypeError:
                g = g.astype(np.complex128)
        except OverflowError:  # (an integer beyond float64, such as 10**400)
            raise ValueError(f"{name} holds a number beyond float64's range: {given!r:.60}") from None
    if (B.is_torch(g) or g.dtype.kind in "fc") and not B.all_finite(g):
        raise ValueError(f"{name} contains NaN or Inf")
    if B.is_complex(g) and not B.is_complex(u0):
        raise TypeError(f"{name} {'returned states that are' if name.endswith('(t)`') else 'is'} complex but `u0` is "
                        "real: pass a complex `u0` to solve for complex states, or a real guess")
    if B.is_torch(u0) and not B.is_torch(g):  # through a fresh float64 / complex128 copy: any numpy dtype (longdouble,
        import torch  # objects such as Fractions), negative strides and read-only arrays convert alike

        return torch.from_numpy(np.array(g, dtype=np.complex128 if B.is_complex(g) else np.float64)).to(u0.device)
    if B.is_torch(g) and not B.is_torch(u0):
        return g.cpu().numpy()
    return g


def _initial_states(initial_guess, u0, t_local: np.ndarray, n_total: int, index: range):
    """Stack of initial iterates at the local points (the caller sets u0 at t[0]), stored as ``u0``: same
    library, dtype and device, whatever the guess is given in."""
    n = len(t_local)
    X = B.empty_stack(n, u0)
    ushape = tuple(u0.shape)
    if initial_guess is None:
        X[:] = u0
        return X
    if callable(initial_guess):
        for k, tk in enumerate(t_local):
            g = _guess_like_u0(initial_guess(float(tk)), u0, "`initial_guess(t)`")
            if tuple(g.shape) != ushape:
                raise ValueError(f"`initial_guess(t)` returned shape {tuple(g.shape)} at t = {float(tk)}, "
                                 f"expected {ushape} (the shape of `u0`)")
            with np.errstate(over="ignore"):  # (a value beyond u0's dtype: named by the caller)
                X[k] = g
        return X
    g = _guess_like_u0(initial_guess, u0, "`initial_guess`")
    shape = tuple(g.shape)
    if shape == (n_total,) + ushape:
        with np.errstate(over="ignore"):
            X[:] = g[index.start : index.stop]
        return X
    if shape not in ((), ushape):
        raise ValueError(
            f"`initial_guess` has shape {shape}; give a scalar, a state of shape {ushape}, "
            f"a trajectory of shape {(n_total,) + ushape}, or a callable of t"
        )
    with np.errstate(over="ignore"):
        X[:] = g
    return X


def solve(
    propagator: Propagator | Sequence[Propagator],
    u0,
    t,
    *,
    cf: int | Sequence[int] = 2,
    max_levels: int = 30,
    min_coarse: int = 2,
    relax: str | Sequence[str] = "FCF",
    c_weight: float | Sequence[float] = 1.0,
    cycle: str = "V",
    tol: float | None = 1e-9,
    tol_type: str = "abs",
    norm=2,
    max_iter: int = 100,
    skip: bool = True,
    nested: bool = False,
    residual: str = "xbraid",
    initial_guess=None,
    spatial: SpatialTransfer | Sequence[SpatialTransfer | None] | None = None,
    callback: Callable[[IterationInfo], None] | None = None,
    final_residual: bool = False,
    comm=None,
    partition=None,
) -> Result:
    """Solve ``u_i = Phi(u_{i-1})``, ``u_0 = u0`` on the time grid ``t`` with MGRIT / FAS.

    Parameters
    ----------
    propagator : Propagator or sequence of Propagator
        One propagator for all levels (it is called with each level's own
        ``t0, t1``: rediscretization) or one per level (last repeats).
    u0 : array
        Initial state at ``t[0]``; numpy array (any shape) or torch tensor.
        The states are stored in its dtype: integer and boolean states become
        float64 (numpy) or torch's default floating dtype. A real ``u0`` needs a
        propagator that returns real states (pass a complex ``u0`` otherwise).
        A tensor that requires grad is rejected: the solve is not differentiable.
        On several ranks every rank passes the same ``u0`` (up to rounding): the
        ranks compare sums of it in their handshake, and a ValueError on every
        rank names one that differs (sums miss a change far below the largest
        entries; a solve on an ``InSession`` view, inside a session of the
        caller, leaves the comparison to the caller).
    t : array_like, shape (N + 1,)
        Strictly increasing fine time points; non-uniform grids are fine.
    cf, max_levels, min_coarse, relax, c_weight
        Hierarchy and relaxation, see :func:`mgrit.build_hierarchy`.
        ``relax`` is "F", "FCF", "FCFCF", ... (or one per level).
    cycle : {"V", "F"}
        V-cycles, or F-cycles (each level visits its coarse level twice).
    tol : float or None
        Stop after the cycle whose level-0 residual norm is ``<= tol`` (abs) or
        ``<= tol * first residual`` (rel); None runs ``max_iter`` cycles. The
        residual cannot fall below the rounding of the states: about ``1e-7``
        of their size in float32 (``1e-16`` in float64), so the default ``1e-9``
        is out of reach for float32 states of size 0.01 and more (the solve then
        runs all ``max_iter`` cycles and reports ``Status.MAX_ITER``, without a
        warning): give float32 states a tolerance above their rounding.
    tol_type : {"abs", "rel"}
    norm : {2, 1, inf}
        Temporal norm of the C-point residuals (spatial norm: ``propagator.norms``).
    max_iter : int
        Largest number of cycles.
    skip : bool
        XBraid's skip: the first cycle does no relaxation on the way down; the
        fine initial guess is injected to all levels (zero right-hand side) and
        the coarsest level is solved and interpolated up.
    nested : bool
        Nested iteration (full multigrid start, as in PyMGRIT): before the
        first cycle, every coarse level runs one cycle on its own sub-hierarchy,
        from the coarsest up; the first cycle then relaxes and measures a
        residual (``skip`` is ignored).
    initial_guess : None, scalar, state, trajectory or callable
        Iterate at ``t > t[0]``: None copies ``u0``; a scalar or a state is used
        at every point; an array of shape ``(N + 1, *u0.shape)`` is a whole
        trajectory (warm start); a callable is called as ``initial_guess(t_k)``.
        On several ranks a scalar or a state must be the same on every rank (compared
        in the handshake: a ``ValueError`` otherwise); a trajectory or a callable is read
        at each rank's own points.
    spatial : SpatialTransfer or sequence of (SpatialTransfer or None), optional
        Spatial coarsening between level ``l`` and ``l + 1`` (entry ``l``; last
        repeats); None keeps the spatial grid.
    residual : {"xbraid", "cycle_end"}
        Where the level-0 residual that decides convergence is measured.
        "xbraid": in each cycle's down-sweep, before its coarse correction
        (XBraid's convention; the skipped first cycle has none). "cycle_end":
        after each cycle, on the F-relaxed iterate that would be returned (as
        PyMGRIT reports it); this costs one extra C-point sweep per cycle and
        usually saves the last cycle.
    final_residual : bool
        Also measure the residual of the returned solution (one extra batched
        C-point sweep; none with ``residual="cycle_end"``, whose last entry is
        already that residual): ``Result.final_residual``. With
        ``residual="xbraid"`` the history is measured before each cycle's
        coarse correction, so its last entry lags the returned solution by one cycle;
        without a ``callback`` that entry's all-reduce is the final residual's (one
        synchronisation of the ranks less, the same values). With an unstable coarse
        propagator (one that amplifies) that last correction can make the returned
        states arbitrarily wrong under a ``CONVERGED`` status, and with ``tol_type="rel"``
        and ``skip`` the first residual it is relative to can be inflated as much: this
        residual is the one that shows it.
    callback : callable, optional
        Called after every cycle with an :class:`IterationInfo` (once for a
        one-level solve, the sequential stepping, with residual None;
        ``Result.residuals`` stays empty there), on every rank, inside the solve's
        collective call: collective calls made there on some ranks only (a nested
        solve, a gather) wait forever.
    comm : None, mpi4py communicator, torch.distributed group or Communicator
        Split the time axis over the ranks of this communicator; None runs
        serially. The call is collective: every rank passes the same grid,
        hierarchy and stopping rule (checked). Rank ``p`` owns a contiguous
        block of fine points; ranks may outnumber the coarse points or even
        the fine points (they then own nothing). ``Result.u`` holds this
        rank's points (see ``Result.index``); :func:`gather` collects them.
        The results do not depend on the number of ranks, bit for bit, when
        a row of ``step_batch``'s result does not depend on how many rows it
        gets (a ``step`` alone always; numpy's ``U @ A.T`` may round a single
        row differently from a row of many, and the rows per call depend on
        the blocks).
    partition : sequence of int, optional
        Fine index at which the block of each rank starts (default: balanced
        contiguous blocks).

    Returns
    -------
    Result
        ``Result.status`` is CONVERGED, SEQUENTIAL (one level), MAX_ITER, or
        DIVERGED: the solve did not converge and its last residual norm exceeds
        1e3 times its first available (nonzero) one.

    Raises
    ------
    DivergenceError
        NaN or Inf appeared (the message names the level and iteration).
    TypeError
        The propagator returned something other than states of the type of
        ``u0`` (a numpy array or a torch tensor), or complex states for a real ``u0``.
    ValueError
        Bad arguments (the message names the argument and what to pass).
    RemoteRankError
        Another rank of ``comm`` failed (bad input, an exception in its
        propagator, a divergence); the message names the rank and its error.

    Warns
    -----
    RuntimeWarning
        When the status is DIVERGED (on every rank: the residuals are).

    Examples
    --------
    XBraid's ex-01 (``u' = -u``, backward Euler, 10 steps on [0, 5]):

    >>> import numpy as np, mgrit
    >>> class Decay(mgrit.Propagator):
    ...     def step(self, u, t0, t1):
    ...         return u / (1.0 + (t1 - t0))
    >>> res = mgrit.solve(Decay(), np.array(1.0), np.linspace(0, 5, 11), cf=2, max_levels=2,
    ...                   relax="FCF", tol=1e-6, initial_guess=0.456)
    >>> ["%.6e" % r for r in res.residuals[1:]]
    ['2.845538e-02', '8.621939e-04', '0.000000e+00']
    >>> res.iterations, res.converged
    (4, True)
    """
    warn_if_alone(comm, "mgrit.solve")
    comm = as_communicator(comm)
    try:  # every check is local: a rank with bad input tells the others in comm.open
        opts = Options(cf=cf, max_levels=max_levels, min_coarse=min_coarse, relax=relax, c_weight=c_weight,
                       cycle=cycle, tol=tol, tol_type=tol_type, norm=norm, max_iter=max_iter, skip=skip,
                       nested=nested, residual=residual, final_residual=final_residual, callback=callback,
                       partition=partition)
        _check_no_grad(u0, "u0")
        _check_no_grad(initial_guess, "initial_guess")
        for name, x in (("u0", u0), ("initial_guess", initial_guess)):
            if np.ma.is_masked(x):  # (a masked array with nothing masked, as netCDF4 returns, is its values)
                raise TypeError(f"`{name}` is a masked array with masked entries, whose mask the solver would "
                                f"drop: pass the values to use, e.g. {name}.filled(0.0)")
        u0 = B.as_state(u0)
        if not B.is_torch(u0) and u0.dtype.kind not in "fc":
            raise TypeError(f"`u0` must be a numeric array (real or complex), got dtype {u0.dtype}")
        wider = B.arithmetic_dtype(u0)
        if wider is not None:
            raise TypeError(f"`u0` has dtype {u0.dtype}, for which torch has no sums, norms or comparisons (the "
                            f"solver's residuals and checks); convert it, e.g. u0.to(torch.{wider})")
        if (u0.numel() if B.is_torch(u0) else u0.size) == 0:
            raise ValueError(f"`u0` is empty (shape {tuple(u0.shape)}): a state needs at least one value")
        if not B.all_finite(u0):
            raise ValueError("`u0` contains NaN or Inf")
        hierarchy = opts.hierarchy(t)
        L = len(hierarchy)
        props = _check_propagators(propagator, L)
        transfers = per_level(spatial, max(L - 1, 1), "spatial")
        for tr in transfers:
            if tr is not None and not isinstance(tr, SpatialTransfer):
                raise TypeError(f"`spatial` entries must be mgrit.SpatialTransfer or None, got {type(tr).__name__}")
        states = _setup(hierarchy, props, transfers, u0, initial_guess, comm, opts.partition)
        sig = Call("mgrit.solve", args_signature(
            [(lv.n, lv.cf, lv.relax, lv.c_weight) for lv in hierarchy], hierarchy[0].t.tobytes(),
            B.shape_of(u0), str(u0.dtype), [tr is None for tr in transfers], *opts.signature(),
        ), "time grids, hierarchies, state shapes or dtypes, spatial transfers or stopping rules")
        # the ranks compare their u0 in the handshake (no message of its own); inside a caller's session
        # (InSession: no handshake to ride on) the caller has compared its inputs itself
        share = None
        if comm.size > 1 and not isinstance(comm, InSession):
            sums = _u0_sums(u0)
            share = (sums, _guess_summary(initial_guess, u0, sums))
    except BaseException as exc:  # an interrupt too: the other ranks must not wait in open
        comm.open(failure=exc)  # the other ranks raise RemoteRankError
        raise
    shared = comm.open(signature=sig, share=share)
    differ = None if share is None else _differing_u0([u for u, _ in shared]) or _differing_guess(
        [g for _, g in shared])
    if differ is not None:  # every rank found it in the handshake: raised after the session (no one waits)
        comm.close()
        raise differ
    try:
        res = _run(hierarchy, states, u0, comm, opts)
    except BaseException as exc:
        comm.close(exc)  # tells the other ranks (they raise RemoteRankError)
        raise
    comm.close()
    if res.status is Status.DIVERGED:
        first, last = _available(res.residuals)[0], res.residuals[-1]
        warnings.warn(
            f"MGRIT diverged: the residual norm grew from {first:.3e} to {last:.3e} in "
            f"{res.iterations} cycles; {Status.DIVERGED.value}",
            RuntimeWarning,
            stacklevel=2,
        )
    return res


def _u0_sums(u0) -> tuple:
    """What the ranks compare of their ``u0``: its sums (:func:`mgrit._inputs.array_sums`) and tolerance."""
    v, eps = B.host_values(u0)
    with np.errstate(all="ignore"):  # (u0 is finite: checked before)
        return (*array_sums(v), sums_rtol(eps, lambda: spread(v)))


def _differing_u0(sums: list) -> ValueError | None:
    """The error when the ranks' ``u0`` differ beyond rounding (``sums``: every rank's :func:`_u0_sums`):
    only rank 0's sets the solution, the others' would enter the first iterate alone."""
    r = differing_rank(sums)
    if r is None:
        return None
    return ValueError(
        f"`u0` differs between ranks: rank {r}'s (sum of squares {sums[r][0]:.6g}, sum weighted by position "
        f"{sums[r][3]:.6g}, sum with pseudo-random weights {sums[r][4]:.6g}) against rank 0's ({sums[0][0]:.6g}, "
        f"{sums[0][3]:.6g}, {sums[0][4]:.6g}); every rank must pass the same "
        "initial state: make it alike on every rank (the same data and seed), or broadcast rank 0's")


def _guess_summary(guess, u0, u0_sums: tuple | None = None) -> tuple:
    """What the ranks compare of their ``initial_guess``: its kind, and for a scalar or a single state the sums
    (:func:`_u0_sums`) of the state it gives, in ``u0``'s shape and dtype (a scalar and the state full of it are
    the same guess, as are a real and a complex-typed guess of a complex ``u0``; None, which copies ``u0``, is
    compared as ``u0``: ``u0_sums``, its :func:`_u0_sums` when already made). A trajectory or a callable is read
    at each rank's own points only and not compared (that would read all of it on every rank)."""
    if guess is None:
        return ("state", _u0_sums(u0) if u0_sums is None else u0_sums)
    if callable(guess):
        return ("callable",)
    shape = getattr(guess, "shape", None)
    if shape is not None and tuple(shape) not in ((), tuple(u0.shape)):
        return ("trajectory",)  # (not converted here: _initial_states reads this rank's part)
    g = _guess_like_u0(guess, u0, "`initial_guess`")  # (finite, and complex only for a complex u0: checked there)
    if tuple(g.shape) not in ((), tuple(u0.shape)):
        return ("trajectory",)
    if B.is_torch(u0):
        g = g.to(u0.dtype).expand(u0.shape)
    else:
        with np.errstate(over="ignore"):  # (beyond u0's dtype: named when the iterates are made)
            g = np.broadcast_to(np.asarray(g).astype(u0.dtype), u0.shape)
    return ("state", _u0_sums(g))


def _differing_guess(summaries: list) -> ValueError | None:
    """The error when the ranks' ``initial_guess`` differ (``summaries``: every rank's :func:`_guess_summary`):
    each rank starts its own points from its own guess, so the iterates of a run of fixed cycles match no
    one-rank run (a converged solve is unaffected)."""
    kinds = [s[0] for s in summaries]
    r = next((r for r, k in enumerate(kinds) if k != kinds[0]), None)
    if r is None and kinds[0] == "state":
        r = differing_rank([s[1] for s in summaries])
    if r is None:
        return None
    return ValueError(
        f"`initial_guess` differs between ranks: rank {r} gives {_guess_words(summaries[r])}, rank 0 "
        f"{_guess_words(summaries[0])}; each rank starts its own points from its own guess, so the result would "
        "match no one-rank solve: pass the same initial_guess on every rank")


def _guess_words(summary: tuple) -> str:
    if summary[0] == "state":
        return (f"the state (sum of squares {summary[1][0]:.17g}, sum weighted by position {summary[1][3]:.17g}, "
                f"sum with pseudo-random weights {summary[1][4]:.17g})")
    return {"callable": "a callable", "trajectory": "a trajectory"}[summary[0]]


def _check_no_grad(x, name: str) -> None:
    """Reject a tensor that autograd tracks: the solve is not differentiable."""
    if B.requires_grad(x):
        hint = ("pass u0.detach(), or use propagators.torch.LayerParallel for gradients"
                if name == "u0" else f"pass {name}.detach() (or detached tensors from a callable)")
        raise ValueError(f"`{name}` requires grad: mgrit.solve does not differentiate through the solve; {hint}")


def _available(residuals) -> list:
    """The residuals that were computed (the skipped first cycle has none)."""
    return [r for r in residuals if r is not None]


def _diverged(residuals, growth: float = DIVERGENCE_GROWTH) -> bool:
    """True when the last residual exceeds ``growth`` times the first available one.

    Used for solves that did not converge (:attr:`Status.DIVERGED`). A zero
    first residual (started from the exact solution) never counts as divergence.

    >>> _diverged([None, 1.0, 10.0, 2e3]), _diverged([None, 1.0, 999.0]), _diverged([0.0, 1e-16])
    (True, False, False)
    """
    r = _available(residuals)
    return len(r) > 1 and r[0] > 0 and r[-1] > growth * r[0]


def _setup(hierarchy, props, transfers, u0, initial_guess, comm: Communicator, partition=None):
    ranges = level_ranges(hierarchy, comm.size, partition)
    states = []
    for l, lv in enumerate(hierarchy):
        lo, hi = ranges[l][comm.rank]
        if hi < lo:
            states.append(None)
            continue
        left, right = neighbours(ranges[l], comm.rank)
        tr = transfers[l] if l < len(hierarchy) - 1 else None
        states.append(LevelState(lv, props[l], tr, comm, lo, hi, left, right))
    w = states[0]
    if w is not None:
        n_total = hierarchy[0].n + 1
        X = _initial_states(initial_guess, u0, w.tl, n_total, range(w.g0, w.hi + 1))
        if not B.all_finite(X):
            raise ValueError(f"`initial_guess` has values beyond the range of u0's dtype ({u0.dtype}): stored as "
                             "u0's states they overflow to Inf; scale the problem or use a wider dtype")
        if w.lo == 0:
            X[0] = u0
        w.u = X
    return states


def _run(hierarchy, states, u0, comm, opts: Options) -> Result:
    """Run the schedule (:func:`mgrit.cycle.run`) on this rank's iterates and report."""
    residuals: list = []
    first, converged = None, False  # first available residual norm; tolerance reached

    def after_cycle(k: int, res_k) -> bool:
        nonlocal first, converged
        if res_k is not None:
            if not math.isfinite(res_k):
                raise DivergenceError(f"MGRIT diverged: residual norm {res_k} in iteration {k}")
            first = res_k if first is None else first
        residuals.append(res_k)
        if opts.callback is not None:
            opts.callback(IterationInfo(k, res_k, tuple(w.count if w else 0 for w in states)))
        if res_k is not None and opts.tol is not None:
            converged = res_k <= (opts.tol if opts.tol_type == "abs" else opts.tol * first)
        return converged

    final = run(Levels(states, comm, opts.norm), hierarchy, opts, after_cycle)
    if len(hierarchy) == 1:
        iterations, converged, status = 1, True, Status.SEQUENTIAL
        if opts.callback is not None:  # the one "cycle": sequential stepping, which measures no residual
            opts.callback(IterationInfo(0, None, tuple(w.count if w else 0 for w in states)))
    else:
        iterations = len(residuals)
        status = Status.CONVERGED if converged else (Status.DIVERGED if _diverged(residuals) else Status.MAX_ITER)
    w0 = states[0]
    local = None
    if w0 is None:
        u_local, t_local, index = B.empty_stack(0, u0), np.zeros(0), range(0, 0)
    else:
        own0 = w0.lo - w0.g0
        u_local, t_local, index = w0.u[own0:], np.array(w0.tl[own0:]), range(w0.lo, w0.hi + 1)
        local = w0.u if own0 and w0.left is not None else None
    return Result(
        u=u_local,
        t=t_local,
        index=index,
        residuals=residuals,
        iterations=iterations,
        converged=converged,
        status=status,
        counts=[w.count if w is not None else 0 for w in states],
        hierarchy=hierarchy,
        final_residual=final,
        rank=comm.rank,
        size=comm.size,
        comm=comm,
        _local=local,
    )


def gather(result: Result, root: int | None = 0):
    """Whole trajectory ``(N + 1, *state_shape)`` from a distributed result.

    Returns the stacked states on ``root`` (on every rank when ``root`` is
    None) and None on the other ranks. For a serial result it returns ``u``.
    """
    if root is not None and (not is_integer(root) or not 0 <= root < result.size):
        raise ValueError(f"`root` must be a rank, an integer from 0 to {result.size - 1} (or None: every rank), got "
                         f"{root!r}; pass the same on every rank")
    if result.size == 1:
        return result.u
    parts = result.comm.gather((result.index.start, result.u), root=root)
    if parts is None:
        return None
    parts = [u for _, u in sorted(parts, key=lambda x: x[0]) if len(u)]
    if B.is_torch(parts[0]):
        import torch

        return torch.cat(parts)
    return np.concatenate(parts)
