"""Relaxation kernels on one level: F-relaxation, C-relaxation, C-point residuals.

Notation (docs/theory.md): on a level with coarsening factor ``m``, point ``i``
is a C-point when ``i % m == 0`` and an F-point otherwise; ``Phi`` steps from
``t_{i-1}`` to ``t_i``; ``g`` is the right-hand side (zero on the finest level
except the initial condition, which is never changed).

* F-relaxation: ``u_i <- Phi(u_{i-1}) + g_i`` at every F-point, in order
  within each interval, all intervals at once.
* C-relaxation: ``u_i <- (1 - w) u_i + w (Phi(u_{i-1}) + g_i)`` at C-points.
* Residual at C-points: ``r_i = g_i + Phi(u_{i-1}) - u_i``.

Every kernel works on the points one rank owns. The local array of a level
holds the owned points ``lo..hi`` preceded by one *ghost* slot for point
``lo - 1`` when ``lo > 0``; the ghost is refreshed from the left neighbour by
the F-relaxation (the only kernel that needs a neighbour's newest value), so
the other kernels can read it afterwards. Because all points of a given
residue ``i % m`` are independent, each sweep is ``m - 1`` (F) or one (C)
batched propagator call per level, whatever the number of intervals.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import _backend as B
from .comm import Communicator
from .hierarchy import Level
from .propagator import Propagator
from .spatial import SpatialTransfer


@dataclass(eq=False)
class LevelState:
    """The iterates of one level on one rank (mutable; kept apart from :class:`Level`).

    ``u`` / ``g`` / ``v`` are stacks over local points ``g0 .. hi`` (global
    indices of this level); ``g`` is None where the right-hand side is zero and
    ``v`` holds the values restricted from the finer level (FAS).
    """

    level: Level
    prop: Propagator
    transfer: SpatialTransfer | None
    comm: Communicator
    lo: int
    hi: int
    left: int | None
    right: int | None
    u: object = None
    g: object = None
    v: object = None
    count: int = 0
    watched: set = field(default_factory=set)  # calls checked for writing into their input ("step", "restrict", ...)
    tl: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self.tl = self.level.t[self.g0 : self.hi + 1]

    @property
    def g0(self) -> int:
        """Global index of local slot 0 (the ghost when ``lo > 0``)."""
        return self.lo - 1 if self.lo > 0 else 0

    @property
    def nloc(self) -> int:
        return self.hi + 1 - self.g0

    def first(self, residue: int) -> int:
        """First local slot ``a >= 1`` whose global index is ``residue`` mod ``cf``."""
        m = self.level.cf
        return (residue - self.g0 - 1) % m + 1


def _wrong_type(out, U, level: int, call: str) -> TypeError:
    kind = "torch tensor" if B.is_torch(U) else "numpy array"
    got = "None" if out is None else B.type_name(out)
    if isinstance(out, np.ndarray) and out.dtype.kind not in "biufc":
        got += f" of dtype {out.dtype}"
    return TypeError(
        f"the propagator of level {level} returned {got} from `{call}` for {B.type_name(U)} "
        f"states; `step` must return a state of the input's type (a {kind} shaped like its "
        f"input) and `step_batch` a {kind} of shape (n, *state_shape)"
    )


def _complex_for_real(level: int) -> TypeError:
    return TypeError(
        f"the propagator of level {level} returned complex states for a real `u0`; pass a "
        "complex `u0`, e.g. u0.astype(complex) (numpy) or u0.to(torch.complex128) (torch)"
    )


def _tracked(level: int) -> ValueError:
    return ValueError(
        f"the propagator of level {level} returned a tensor that requires grad (a step computed from "
        "parameters that require grad): mgrit.solve does not differentiate through the solve; compute the "
        "step under torch.no_grad() or from detached parameters, or use propagators.torch.LayerParallel for "
        "gradients"
    )


def _untracked(stack, level: int) -> None:
    """Raise :func:`_tracked` when ``stack``, into which a sweep stored the results of ``step`` (only the first is
    checked call by call), requires grad: a later result did (storing it made the stack require grad)."""
    if B.requires_grad(stack):
        raise _tracked(level)


def check_batch(out, U, level: int, call: str = "step_batch") -> None:
    """Raise unless ``out``, returned by ``step_batch(U, ...)``, is a stack like ``U``.

    Checks the array type (torch tensor for torch states, numpy array for numpy
    states), the shape, that real states do not become complex and that autograd
    does not track the result. Reads only metadata, never the entries. ``call``
    names the method the user wrote.
    """
    torch_states = B.is_torch(U)
    if torch_states != B.is_torch(out) or not (
        torch_states or (isinstance(out, np.ndarray) and out.dtype.kind in "biufc")
    ):
        raise _wrong_type(out, U, level, call)
    if tuple(out.shape) != tuple(U.shape):
        if call != "step" and len(out.shape) and out.shape[0] != U.shape[0]:  # (the default loop stacks)
            raise ValueError(
                f"the propagator of level {level} returned a stack of shape {tuple(out.shape)} from `{call}` "
                f"for {U.shape[0]} states of shape {tuple(U.shape)[1:]} (a stack of shape {tuple(U.shape)}): "
                f"`{call}` must return one state per row of its input, in the same order"
            )
        raise ValueError(
            f"the propagator of level {level} returned states of shape "
            f"{tuple(out.shape)[1:]} for inputs of shape {tuple(U.shape)[1:]} from `{call}`; "
            "it must return states shaped like its input"
        )
    if B.is_complex(out) and not B.is_complex(U):
        raise _complex_for_real(level)
    if torch_states and out.requires_grad:
        raise _tracked(level)


def checked_state(x, U, level: int):
    """``x``, returned by ``step`` for a row of the stack ``U``, as a state.

    Numpy states accept anything numpy turns into a numeric array (a Python
    float is a 0-d state); torch states need a tensor. Raises like
    :func:`check_batch`.
    """
    if x is None or B.is_torch(U) != B.is_torch(x):
        raise _wrong_type(x, U, level, "step")
    x = B.as_state(x)
    if not B.is_torch(x) and x.dtype.kind not in "biufc":
        raise _wrong_type(x, U, level, "step")
    if tuple(x.shape) != tuple(U.shape[1:]):
        raise ValueError(
            f"the propagator of level {level} returned a state of shape "
            f"{tuple(x.shape)} for an input of shape {tuple(U.shape[1:])}; "
            "`step` must return a state shaped like its input"
        )
    if B.is_complex(x) and not B.is_complex(U):
        raise _complex_for_real(level)
    if B.requires_grad(x):
        raise _tracked(level)
    return x


def _watched_step(w: LevelState, u, t0: float, t1: float):
    """``step(u, t0, t1)``, the first time on a level checked for writing into ``u`` (which the solver
    stores: a step that divides its input in place corrupts the iterate without an error)."""
    if "step" in w.watched:
        return w.prop.step(u, t0, t1)
    w.watched.add("step")
    return step_keeping_input(w.prop, u, t0, t1, f"the propagator of level {w.level.index}")


def step_keeping_input(prop, u, t0: float, t1: float, who: str = "the propagator"):
    """``prop.step(u, t0, t1)``; a ``ValueError`` naming ``who`` when the call changed ``u``."""
    before = B.copy(u)
    x = prop.step(u, t0, t1)
    if not B.same_values(before, u):
        raise ValueError(
            f"{who} changed its input state in place in `step` (`u /= ...`, `u += ...`, `u[...] = ...`): the "
            "solver stores that state; compute into a new array (`u = u / ...`) and return it"
        )
    return x


def _loop_into(w: LevelState, U, t0: np.ndarray, t1: np.ndarray, out):
    """The default ``step_batch`` (a loop over ``step``) writing straight into ``out``.

    Checks the first state as :meth:`Propagator.step_batch` and :func:`check_batch`
    do (same errors, naming `step`). Returns ``out``, or, when ``step`` returns
    another dtype than the states', a new stack in that dtype (as the default
    ``step_batch`` would), so that the arithmetic that follows is the same.
    """
    step, a, b, level = w.prop.step, t0.tolist(), t1.tolist(), w.level.index
    raw = _watched_step(w, U[0], a[0], b[0])
    if raw is None or B.is_torch(raw) != B.is_torch(U):
        check_batch(raw, U, level, "step")  # raises
    first = B.as_state(raw)
    check_batch(first[None], U[:1], level, "step")  # type, shape, complex: metadata only
    if first.dtype != out.dtype and (B.is_complex(first) or not B.is_complex(out)):  # (complex states stay complex:
        out = B.empty_stack(U.shape[0], first)                                       # a later result may be)
    out[0] = first
    row, shape, dtype = B.result_key(raw)  # every later result like the first passes three comparisons (about 70 ns);
    for k in range(1, U.shape[0]):  # None, a float, another shape or complex is named, not stored
        x = step(U[k], a[k], b[k])
        out[k] = x if type(x) is row and x.shape == shape and x.dtype is dtype else checked_state(x, U, level)
    _untracked(out, level)
    return out


def advance(w: LevelState, U, t0: np.ndarray, t1: np.ndarray, out=None):
    """Batched propagator call on level ``w`` with type, shape and dtype checks and cost count.

    ``out`` (optional) is a stack of the states' dtype for the result; it is
    returned when the result was written there (then the caller may update it
    in place), otherwise a new array is. A propagator without its own
    ``step_batch`` writes into ``out`` state by state: no stack of results is
    built and copied.
    """
    n = U.shape[0]
    w.count += n
    own_batch = type(w.prop).step_batch is not Propagator.step_batch
    if not own_batch and out is not None and n > 0:
        return _loop_into(w, U, t0, t1, out)
    new = w.prop.step_batch(U, t0, t1)
    # name the method the user wrote: `step` when step_batch is the default loop
    check_batch(new, U, w.level.index, "step_batch" if own_batch else "step")
    if out is not None and new.dtype == out.dtype:
        out[...] = new
        return out
    return new


def _phi_from(w: LevelState, a: int, out=None):
    """``Phi(u_{i-1}) + g_i`` for the local slots ``a, a + m, a + 2m, ...``.

    Written into ``out`` (and ``out`` returned) when :func:`advance` could; the
    sum is the same either way (``out += g`` is ``Phi + g`` in the states' dtype).
    """
    m = w.level.cf
    n = (w.nloc - 1 - a) // m + 1
    U = w.u[a - 1 : a - 1 + (n - 1) * m + 1 : m]
    new = advance(w, U, w.tl[a - 1 :: m][:n], w.tl[a::m], out)
    if w.g is not None:
        if new is out:
            new += w.g[a::m]
        else:
            new = new + w.g[a::m]
    return new


def send_last(w: LevelState, X) -> None:
    if w.right is not None:
        w.comm.send(X[-1], w.right, w.level.index)


def recv_ghost(w: LevelState, X) -> None:
    X[0] = w.comm.recv(X[-1], w.left, w.level.index)


def exchange(w: LevelState, X) -> None:
    """Send the last owned entry of ``X`` right and fill the ghost of ``X`` from the left."""
    send_last(w, X)
    if w.left is not None:
        recv_ghost(w, X)


def _f_relax_by_interval(w: LevelState) -> None:
    """F-relaxation for a propagator that only has ``step``: interval by interval, so that each
    step reads the state the previous one just wrote (in cache), instead of one sweep per residue
    class over the whole level. Each F-point gets exactly the value of the batched order.

    Order: the interval holding the last owned point first (then it is sent right), the complete
    intervals, and last the interval this rank starts inside, after receiving its ghost.
    """
    m, u, g, n = w.level.cf, w.u, w.g, w.nloc
    step, tl, level = w.prop.step, w.tl.tolist(), w.level.index
    a0 = w.first(0)  # the first local C-point slot >= 1 (n when there is none)
    head = range(1, min(a0, n))  # F-points before it: they continue from slot 0 (the ghost, or point 0)
    starts = list(range(a0, n, m))  # every later interval: its C-point slot
    if w.right is not None and w.hi % m != 0 and starts:
        starts = starts[-1:] + starts[:-1]  # the interval holding the last point, first
    row = shape = dtype = None  # of the first result (B.result_key); None before it

    def sweep(slots):
        nonlocal row, shape, dtype
        for i in slots:
            x = step(u[i - 1], tl[i - 1], tl[i]) if row is not None else _watched_step(w, u[i - 1], tl[i - 1], tl[i])
            if type(x) is not row or x.shape != shape or x.dtype is not dtype:  # the first result (type, shape,
                if row is None:  # complex, autograd), and any unlike it (None, a float, another shape): named
                    row, shape, dtype = B.result_key(x)
                x = checked_state(x, u, level)
            if g is None:
                u[i] = x
            elif getattr(x, "dtype", u.dtype) == u.dtype:  # as the batch: stored, then g added in place
                u[i] = x
                u[i] += g[i]
            else:  # a step in another dtype: g added in the step's dtype, as the batch does
                u[i] = x + g[i]
        w.count += len(slots)

    if w.right is not None and w.hi % m == 0:
        send_last(w, u)  # a C-point: final before the sweep
    for k, c in enumerate(starts):
        sweep(range(c + 1, min(c + m, n)))
        if k == 0 and w.right is not None and w.hi % m != 0:
            send_last(w, u)
    if w.left is not None:
        recv_ghost(w, u)  # the head needs it; C-relaxation and residuals read it afterwards
    if head:
        sweep(head)
        if not starts and w.right is not None and w.hi % m != 0:
            send_last(w, u)
    _untracked(u, level)


def f_relax(w: LevelState) -> None:
    """F-relaxation: ``u_i <- Phi(u_{i-1}) + g_i`` at all F-points of the level.

    The F-points with residue ``j = 1 .. m-1`` are updated in order of ``j``;
    each residue class is one batched call. The last owned point is sent to
    the right neighbour as soon as it is final (before the sweeps if it is a
    C-point, after sweep ``hi % m`` otherwise). When this rank starts inside
    an interval, the ghost is received just before sweep ``lo % m``, the
    first that needs it, so the sweeps before it overlap with the neighbour's
    work and the wait along a chain of such ranks is at most ``m - 1`` sweeps;
    otherwise the ghost is refreshed at the end (for the C-relaxation and
    residuals that follow).
    """
    if type(w.prop).step_batch is Propagator.step_batch and w.nloc > 1:
        return _f_relax_by_interval(w)
    m = w.level.cf
    j_lo = w.lo % m if w.left is not None else 0  # sweep that first reads the ghost (0: none)
    j_hi = w.hi % m if w.right is not None else -1  # sweep after which u[hi] is final
    if j_hi == 0:
        send_last(w, w.u)
    for j in range(1, m):
        if j == j_lo:
            recv_ghost(w, w.u)
        a = w.first(j)
        if a < w.nloc:
            dest = w.u[a::m]
            new = _phi_from(w, a, out=dest)
            if new is not dest:
                dest[...] = new
        if j == j_hi:
            send_last(w, w.u)
    if w.left is not None and j_lo == 0:
        recv_ghost(w, w.u)


def c_relax(w: LevelState) -> None:
    """(Weighted) C-relaxation: ``u_i <- (1-w) u_i + w (Phi(u_{i-1}) + g_i)``, i a C-point."""
    m, wt = w.level.cf, w.level.c_weight
    a = w.first(0)
    if a >= w.nloc:
        return
    dest = w.u[a::m]
    if wt != 1.0:
        dest[...] = (1.0 - wt) * dest + wt * _phi_from(w, a)
        return
    new = _phi_from(w, a, out=dest)  # reads the slots before the C-points only
    if new is not dest:
        dest[...] = new


def c_residual(w: LevelState):
    """Residuals ``r_i = g_i + Phi(u_{i-1}) - u_i`` at the owned C-points ``i >= 1``.

    Returns the stack of residuals (possibly with zero rows).
    """
    m = w.level.cf
    a = w.first(0)
    if a >= w.nloc:
        return w.u[0:0]
    r = B.empty_stack((w.nloc - 1 - a) // m + 1, w.u[0])
    new = _phi_from(w, a, out=r)
    if new is not r:
        if new.dtype == r.dtype:
            return new - w.u[a::m]
        r[...] = new  # a step that returns a wider dtype (float64 for float32 states): rounded as C-relaxation
        #               stores it, so the residual of the fixed point is 0, not the rounding between the dtypes
    r -= w.u[a::m]
    return r


def sequential_solve(w: LevelState) -> None:
    """Solve the level exactly by stepping ``u_i = Phi(u_{i-1}) + g_i`` in order.

    Used on the coarsest level (and for one-level runs). Across ranks the
    solve is a chain: receive the last state of the left neighbour, step,
    send the last state on.
    """
    if w.left is not None:
        recv_ghost(w, w.u)
    u, tl, step, g, level = w.u, w.tl.tolist(), w.prop.step, w.g, w.level.index
    row = shape = dtype = None  # of the first result (B.result_key): a result like it passes three comparisons
    for a in range(1, w.nloc):
        x = step(u[a - 1], tl[a - 1], tl[a]) if row is not None else _watched_step(w, u[a - 1], tl[a - 1], tl[a])
        if type(x) is not row or x.shape != shape or x.dtype is not dtype:
            if row is None:
                row, shape, dtype = B.result_key(x)
            x = checked_state(x, u, level)
        u[a] = x if g is None else x + g[a]
    _untracked(u, level)
    w.count += max(w.nloc - 1, 0)
    send_last(w, w.u)


def all_finite(w: LevelState) -> bool:
    return B.all_finite(w.u)
