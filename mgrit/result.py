"""What a solve returns: a result dataclass and a status enum."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import numpy as np

from .hierarchy import Hierarchy


class Status(enum.Enum):
    """Why the iteration stopped; the value is the message for users.

    DIVERGED replaces MAX_ITER when the solve did not converge and its last
    residual norm exceeds 1e3 times the first available (nonzero) one
    (``mgrit.solver.DIVERGENCE_GROWTH``); :func:`mgrit.solve` then also warns
    (RuntimeWarning). The residual norms, and so the status, are the same on
    every rank. NaN or Inf raise :class:`mgrit.DivergenceError` instead.
    """

    CONVERGED = "converged: residual norm below tolerance"
    MAX_ITER = "stopped after max_iter cycles without reaching the tolerance"
    DIVERGED = (
        "diverged: the residual norm grew more than 1e3-fold. A coarse step that is unstable "
        "(an explicit scheme over too long a step) is the usual cause: use fewer levels "
        "(`max_levels`, a larger `min_coarse`), then more relaxation (relax='FCF') or a smaller "
        "`cf`; mgrit.choose_settings(propagator, u0, t) checks every level's stability and picks them"
    )
    SEQUENTIAL = "one level: solved by sequential stepping (exact)"


@dataclass(frozen=True)
class IterationInfo:
    """Statistics handed to the ``callback`` after every cycle."""

    iteration: int  #: 0-based index of the cycle that just finished
    residual: float | None  #: level-0 residual norm computed in it (None if skipped)
    counts: tuple  #: propagator calls per level on this rank so far


def convergence_factors(residuals) -> list:
    """Ratios ``r_k / r_{k-1}`` of consecutive available residuals (None otherwise)."""
    out = [None]
    for prev, cur in zip(residuals[:-1], residuals[1:]):
        out.append(cur / prev if (prev not in (None, 0.0) and cur is not None) else None)
    return out[: len(residuals)]


@dataclass
class Result:
    """Outcome of :func:`mgrit.solve`.

    Attributes
    ----------
    u : array, shape (n_local, *state_shape)
        States at the fine time points this rank owns (all of them in a serial
        run), in order. Use :func:`mgrit.gather` for the whole trajectory.
    t : numpy.ndarray, shape (n_local,)
        The times of those points.
    index : range
        Global fine indices of those points.
    residuals : list of float or None
        Level-0 residual norm per cycle; None where none was computed
        (the skipped first cycle).
    iterations : int
        Number of cycles run (XBraid's count).
    converged : bool
    status : Status
    counts : list of int
        Propagator calls (intervals advanced) per level, on this rank.
    hierarchy : Hierarchy
    final_residual : float or None
        Residual norm of the returned solution (only with ``solve(..., final_residual=True)``;
        0 for one level, which is exact).

    On several ranks :meth:`with_ghost` gives this rank's states with the left
    neighbour's last state in front, without a message or a copy.
    """

    u: object
    t: np.ndarray
    index: range
    residuals: list
    iterations: int
    converged: bool
    status: Status
    counts: list
    hierarchy: Hierarchy
    final_residual: float | None = None
    rank: int = 0
    size: int = 1
    comm: object = field(default=None, repr=False)
    #: this rank's level-0 stack with the ghost (the left neighbour's last point) in slot 0, or None
    _local: object = field(default=None, repr=False)

    def with_ghost(self):
        """``(states, first)``: :attr:`u` with the state at global index ``index.start - 1`` (the
        left neighbour's last point) in front, and the global index of the first row.

        The solver's last level-0 operation (the final F-relaxation, or the sequential chain of
        a one-level solve) receives that state from the neighbour after its final update, so
        it is the neighbour's returned value, bit for bit. The rows are a view of the solver's
        storage (no copy). Without a left neighbour (the first rank, one process, or a rank
        that owns no point) this is ``(u, index.start)``.
        """
        if self._local is None:  # (set only on a rank with a left neighbour and points of its own)
            return self.u, self.index.start
        return self._local, self.index.start - 1

    def without_states(self) -> "Result":
        """This result with no states (:attr:`u` has zero rows): its statistics alone.

        For keeping a solve's residuals, counts and hierarchy after its states are no
        longer needed (a training loop's diagnostics) without holding the trajectory.
        """
        u = self.u[:0]
        return replace(self, u=u.clone() if hasattr(u, "clone") else u.copy(), _local=None)

    @property
    def factors(self) -> list:
        """Per-cycle convergence factors ``r_k / r_{k-1}``."""
        return convergence_factors(self.residuals)

    def __str__(self) -> str:
        lines = [str(self.hierarchy), "", "iter  residual      factor"]
        for k, (r, f) in enumerate(zip(self.residuals, self.factors)):
            rs = "-" if r is None else f"{r:.6e}"
            fs = "-" if f is None else f"{f:.4f}"
            lines.append(f"{k:4d}  {rs:<12}  {fs}")
        lines.append("")
        lines.append(f"{self.status.value}; {self.iterations} cycle{'' if self.iterations == 1 else 's'}")
        calls = ", ".join(f"level {i}: {c}" for i, c in enumerate(self.counts))
        lines.append(f"propagator calls ({'rank %d' % self.rank if self.size > 1 else 'all'}): {calls}")
        if self.size > 1:
            held = f"points {self.index.start}..{self.index.stop - 1}" if len(self.index) else "no point"
            lines.append(f"rank {self.rank} of {self.size} holds {held}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        last = next((r for r in reversed(self.residuals) if r is not None), math.nan)
        return (
            f"Result(status={self.status.name}, iterations={self.iterations}, "
            f"residual={last:.3e}, points={len(self.index)}, counts={self.counts})"
        )
