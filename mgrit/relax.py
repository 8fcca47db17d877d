"""Relaxation kernels on one level: F-relaxation, C-relaxation, C-point residuals.

Notation (REFERENCE.md): on a level with coarsening factor ``m``, point ``i``
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


def check_batch(out, U, level: int, call: str = "step_batch") -> None:
    """Raise unless ``out``, returned by ``step_batch(U, ...)``, is a stack like ``U``.

    Checks the array type (torch tensor for torch states, numpy array for numpy
    states), the shape, and that real states do not become complex. Reads only
    metadata, never the entries. ``call`` names the method the user wrote.
    """
    torch_states = B.is_torch(U)
    if torch_states != B.is_torch(out) or not (
        torch_states or (isinstance(out, np.ndarray) and out.dtype.kind in "biufc")
    ):
        raise _wrong_type(out, U, level, call)
    if tuple(out.shape) != tuple(U.shape):
        raise ValueError(
            f"the propagator of level {level} returned states of shape "
            f"{tuple(out.shape)[1:]} for inputs of shape {tuple(U.shape)[1:]}; "
            "`step` must return a state shaped like its input"
        )
    if B.is_complex(out) and not B.is_complex(U):
        raise _complex_for_real(level)


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
    return x


def advance(w: LevelState, U, t0: np.ndarray, t1: np.ndarray):
    """Batched propagator call on level ``w`` with type, shape and dtype checks and cost count."""
    out = w.prop.step_batch(U, t0, t1)
    # name the method the user wrote: `step` when step_batch is the default loop
    own_batch = type(w.prop).step_batch is not Propagator.step_batch
    check_batch(out, U, w.level.index, "step_batch" if own_batch else "step")
    w.count += U.shape[0]
    return out


def _phi_from(w: LevelState, a: int):
    """``Phi(u_{i-1}) + g_i`` for the local slots ``a, a + m, a + 2m, ...``."""
    m = w.level.cf
    n = (w.nloc - 1 - a) // m + 1
    new = advance(w, w.u[a - 1 : a - 1 + (n - 1) * m + 1 : m], w.tl[a - 1 :: m][:n], w.tl[a::m])
    if w.g is not None:
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
            w.u[a::m] = _phi_from(w, a)
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
    new = _phi_from(w, a)
    if wt != 1.0:
        new = (1.0 - wt) * w.u[a::m] + wt * new
    w.u[a::m] = new


def c_residual(w: LevelState):
    """Residuals ``r_i = g_i + Phi(u_{i-1}) - u_i`` at the owned C-points ``i >= 1``.

    Returns the stack of residuals (possibly with zero rows).
    """
    m = w.level.cf
    a = w.first(0)
    if a >= w.nloc:
        return w.u[0:0]
    return _phi_from(w, a) - w.u[a::m]


def sequential_solve(w: LevelState) -> None:
    """Solve the level exactly by stepping ``u_i = Phi(u_{i-1}) + g_i`` in order.

    Used on the coarsest level (and for one-level runs). Across ranks the
    solve is a chain: receive the last state of the left neighbour, step,
    send the last state on.
    """
    if w.left is not None:
        recv_ghost(w, w.u)
    u, tl, step, g, level = w.u, w.tl, w.prop.step, w.g, w.level.index
    for a in range(1, w.nloc):
        x = checked_state(step(u[a - 1], float(tl[a - 1]), float(tl[a])), u, level)
        u[a] = x if g is None else x + g[a]
    w.count += max(w.nloc - 1, 0)
    send_last(w, w.u)


def all_finite(w: LevelState) -> bool:
    return B.all_finite(w.u)
