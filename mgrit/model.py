"""A critical-path cost model of a distributed MGRIT solve.

The model replays the solver's schedule (:func:`mgrit.cycle.run`, the one
schedule the solver executes, driving this module's level operations instead
of the numerics) on ``P`` simulated ranks that own the same blocks as in :func:`mgrit.solve`
(:mod:`mgrit.partition`).
Every rank has a clock; propagator work advances it, and a message from a
neighbour arrives ``latency`` seconds after it was sent: a receive sets the
clock to ``max(own clock, send time + latency)``. Along the way the model
tracks which work lies on the critical path (the chain of work and messages
that ends at the latest clock), per level.

What one operation costs on a rank (``n`` = states it advances):

* F-relaxation of a level with factor ``m``: ``m - 1`` batched calls, one per
  residue class of F-points in its block. A rank whose block starts inside an
  interval waits for its left neighbour before the sweep that first needs the
  ghost; the neighbour sends its last point as soon as it is final.
* C-relaxation, C-point residuals and the FAS coarse operator ``Psi(v)``: one
  batched call each (the last one counted on the coarse level).
* The coarsest level: sequential stepping, a chain over the ranks that own
  coarsest points: receive, step through the block, send.
* The residual norm (every cycle but a skipped first one) and the final
  handshake are all-reduces: every clock jumps to the largest plus
  ``reduce_latency`` (default ``latency * ceil(log2 P)``).

A batched call of ``n`` states costs ``per_call + n * per_state`` and a single
step ``single`` (:class:`StepCost`, per level); with the default unit costs
the predicted time counts propagator calls. Sequential stepping, the
baseline of the speedup, costs ``N * single`` of the finest level.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .cycle import LevelOps, run
from .hierarchy import Hierarchy, Level, check_real, per_level
from .options import Options
from .partition import all_neighbours, level_ranges


@dataclass(frozen=True)
class StepCost:
    """Seconds of propagator work on one level.

    Attributes
    ----------
    single : float
        One ``step`` call: sequential stepping and the coarsest-level solve.
    per_state : float
        Each state advanced by a batched ``step_batch`` call.
    per_call : float
        Fixed cost of every batched call (Python and dispatch overhead).

    >>> StepCost(single=3.0, per_state=1.0, per_call=0.5).batch(4)
    4.5
    """

    single: float = 1.0
    per_state: float = 1.0
    per_call: float = 0.0

    def __post_init__(self):
        for name in ("single", "per_state", "per_call"):
            v = getattr(self, name)
            real = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
            if not (real and v >= 0 and math.isfinite(v)):
                raise ValueError(f"`{name}` must be a finite number >= 0, got {v!r}")
            object.__setattr__(self, name, float(v))  # (numpy numbers: plain floats, as the model computes)

    def batch(self, n: int) -> float:
        """Seconds of one batched call advancing ``n`` states (0 when ``n == 0``)."""
        return self.per_call + n * self.per_state if n > 0 else 0.0


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` returns.

    Attributes
    ----------
    time : float
        Predicted duration of the solve (the latest clock).
    sequential_time : float
        ``N`` single steps of the finest level: the baseline.
    path_calls : tuple of int
        Propagator calls (states advanced) per level on the critical path.
    iteration_path_calls : tuple of tuple of int
        The growth of the critical path's calls per level in each cycle (the
        last entry is the final F-relaxation and handshake).
    iteration_times : tuple of float
        The latest clock at the end of each cycle.
    rank_calls : tuple of tuple of int
        Calls per level done by every rank (what ``Result.counts`` reports there).
    path_messages : int
        Point-to-point messages on the critical path.
    """

    time: float
    sequential_time: float
    path_calls: tuple
    iteration_path_calls: tuple
    iteration_times: tuple
    rank_calls: tuple
    path_messages: int

    @property
    def speedup(self) -> float:
        """Sequential stepping time over the predicted time (NaN when both are 0: costs of 0 everywhere)."""
        if self.time > 0:
            return self.sequential_time / self.time
        return math.inf if self.sequential_time > 0 else math.nan


def count_residue(lo: int, hi: int, j: int, m: int) -> int:
    """Number of indices ``i`` in ``lo..hi`` with ``i % m == j``.

    >>> count_residue(1, 8, 0, 2), count_residue(1, 8, 1, 2), count_residue(5, 4, 0, 2)
    (4, 4, 0)
    """
    if m < 1 or not 0 <= j < m:
        raise ValueError(f"count_residue needs a modulus m >= 1 and a residue 0 <= j < m, got j={j!r}, m={m!r}")
    if hi < lo:
        return 0
    return (hi - j) // m - (lo - 1 - j) // m


def sequential_time(hierarchy: Hierarchy, cost: StepCost | Sequence[StepCost] = StepCost()) -> float:
    """Time of plain sequential stepping over the fine grid: ``N * single``."""
    _check_hierarchy(hierarchy)
    return hierarchy[0].n * _costs(cost, len(hierarchy))[0].single


def _check_hierarchy(hierarchy) -> None:
    if not isinstance(hierarchy, (list, tuple)) or not hierarchy or not all(isinstance(lv, Level) for lv in hierarchy):
        raise TypeError(f"`hierarchy` must be a list of levels from mgrit.build_hierarchy(t, ...), got "
                        f"{type(hierarchy).__name__}")


def _costs(cost, n_levels: int) -> list:
    """``cost`` per level (a StepCost or a sequence of them, the last repeating)."""
    costs = per_level(cost, n_levels, "cost")
    if not all(isinstance(c, StepCost) for c in costs):
        raise TypeError(f"`cost` must be a mgrit.model.StepCost or a sequence of them (one per level), got {cost!r}; "
                        "StepCost(single=seconds) for a step of that many seconds")
    return costs


class _Schedule(LevelOps):
    """Clocks, critical paths and the blocks of the simulated ranks (internal).

    The level operations of :class:`mgrit.cycle.LevelOps`, executed on all
    simulated ranks at once: :func:`mgrit.cycle.run` drives them exactly as it
    drives the solver's numerics.
    """

    def __init__(self, hierarchy, size, costs, latency, reduce_latency, partition):
        self.h, self.size, self.costs, self.lat = hierarchy, size, costs, latency
        self.red = latency * math.ceil(math.log2(size)) if reduce_latency is None else reduce_latency
        L = len(hierarchy)
        self.clock = np.zeros(size)
        self.path = np.zeros((size, L), dtype=np.int64)  # calls on the path that ends at each clock
        self.msgs = np.zeros(size, dtype=np.int64)
        self.work = np.zeros((size, L), dtype=np.int64)  # everything each rank did
        self.blocks = []  # per level: {rank: (lo, hi, left, right)}
        for ranges in level_ranges(hierarchy, size, partition):
            nb = all_neighbours(ranges)  # (one pass: neighbours() per rank made choose_settings quadratic in ranks)
            self.blocks.append({r: (lo, hi) + nb[r] for r, (lo, hi) in enumerate(ranges) if hi >= lo})

    # -- primitives -------------------------------------------------------
    def snap(self, r):
        return self.clock[r], self.path[r].copy(), self.msgs[r]

    def arrive(self, r, sent) -> None:
        """A message sent at ``sent`` reaches rank ``r``."""
        t, path, msgs = sent
        if t + self.lat > self.clock[r]:
            self.clock[r], self.path[r], self.msgs[r] = t + self.lat, path, msgs + 1

    def compute(self, r, l, n, batched=True) -> None:
        if n <= 0:
            return
        c = self.costs[l]
        self.clock[r] += c.batch(n) if batched else n * c.single
        self.path[r, l] += n
        self.work[r, l] += n

    def sync(self) -> None:
        """An all-reduce over every rank."""
        r = int(np.argmax(self.clock))
        self.clock[:] = self.clock[r] + self.red
        self.path[:] = self.path[r]
        self.msgs[:] = self.msgs[r]

    # -- the level operations of mgrit.cycle.LevelOps, on every rank at once ----------
    def owns(self, l) -> bool:
        return bool(self.blocks[l])

    def f_relax(self, l) -> None:
        m, sent = self.h[l].cf, {}
        for r, (lo, hi, left, right) in self.blocks[l].items():  # left neighbours come first
            j_lo = lo % m if left is not None else 0
            j_hi = hi % m if right is not None else -1
            if j_hi == 0:
                sent[r] = self.snap(r)
            for j in range(1, m):
                if j == j_lo:
                    self.arrive(r, sent[left])
                self.compute(r, l, count_residue(max(lo, 1), hi, j, m))
                if j == j_hi:
                    sent[r] = self.snap(r)
            if left is not None and j_lo == 0:
                self.arrive(r, sent[left])

    def c_sweep(self, l) -> None:
        """C-relaxation or C-point residuals: one batched call over the owned C-points."""
        m = self.h[l].cf
        for r, (lo, hi, _, _) in self.blocks[l].items():
            self.compute(r, l, count_residue(max(lo, 1), hi, 0, m))

    c_relax = c_sweep

    def c_residual(self, l) -> None:
        self.c_sweep(l)

    def check(self, l, R=None, iteration=0) -> None:
        """Checks for NaN and Inf cost nothing here."""

    def exchange(self, l) -> None:
        """Every rank sends its last point right, then receives its ghost."""
        sent = {r: self.snap(r) for r in self.blocks[l]}
        for r, (_, _, left, _) in self.blocks[l].items():
            if left is not None:
                self.arrive(r, sent[left])

    def inject(self, l) -> None:
        """Injection: the coarse ghosts come from the left neighbours."""
        self.exchange(l + 1)

    def restrict(self, l, R) -> None:
        """Injection, then ``Psi(v[k-1])`` at the owned coarse points ``k >= 1``."""
        self.exchange(l + 1)
        for r, (lo, hi, _, _) in self.blocks[l + 1].items():
            self.compute(r, l + 1, hi - max(lo, 1) + 1)

    def correct(self, l) -> None:
        """Local: no propagator call, no message."""

    def sequential_solve(self, l) -> None:
        sent = {}
        for r, (lo, hi, left, _) in self.blocks[l].items():
            if left is not None:
                self.arrive(r, sent[left])
            self.compute(r, l, hi - max(lo, 1) + 1, batched=False)
            sent[r] = self.snap(r)

    def residual_norm(self, R) -> None:
        self.sync()

    def residual_norms(self, Rs) -> list:
        self.sync()  # one all-reduce for all of them
        return [None] * len(Rs)

    def finish(self) -> None:
        self.sync()

    def latest(self) -> tuple:
        r = int(np.argmax(self.clock))
        return float(self.clock[r]), self.path[r].copy()


def predict(
    hierarchy: Hierarchy,
    size: int,
    iterations: int,
    *,
    cycle: str = "V",
    skip: bool = True,
    nested: bool = False,
    residual: str = "xbraid",
    final_residual: bool = False,
    cost: StepCost | Sequence[StepCost] = StepCost(),
    latency: float = 0.0,
    reduce_latency: float | None = None,
    partition=None,
    converged: bool = False,
    callback: bool = False,
) -> Prediction:
    """Predict the critical path and time of ``mgrit.solve`` on ``size`` ranks.

    Parameters
    ----------
    hierarchy : Hierarchy
        From :func:`mgrit.build_hierarchy` (time grid, factors, relaxation).
    size : int
        Number of ranks ``P``.
    iterations : int
        Number of cycles (``Result.iterations``).
    cycle : {"V", "F"}
    skip : bool
        XBraid's skip, as in :func:`mgrit.solve`.
    nested : bool
        Nested-iteration start, as in :func:`mgrit.solve` (``skip`` is then ignored).
    residual : {"xbraid", "cycle_end"}
        Where the residual is measured, as in :func:`mgrit.solve`.
    final_residual : bool
        The residual of the returned solution is measured, as in :func:`mgrit.solve`.
    cost : StepCost or sequence of StepCost
        Propagator cost per level (last repeats); default: unit costs, so
        that times count propagator calls.
    latency : float
        Seconds from sending a message to its arrival.
    reduce_latency : float, optional
        Seconds of an all-reduce; default ``latency * ceil(log2 P)``.
    partition : sequence of int, optional
        Start index of every rank's block, as in :func:`mgrit.solve`.
    converged : bool
        The solve stops on its tolerance after ``iterations`` cycles (default: it runs them as its
        ``max_iter``). With ``final_residual`` this costs one all-reduce more: the solver merges the
        last cycle's norm with the final residual's only at ``max_iter``.
    callback : bool
        The solve has a ``callback`` (with ``final_residual`` and XBraid's residual this costs one
        all-reduce more: the last cycle's norm is reduced before the callback, not with the final
        residual's).

    Returns
    -------
    Prediction

    Examples
    --------
    Eight intervals on two ranks (points 0..3 and 4..8), two levels,
    F-relaxation, one cycle without skip. The critical path holds 7 fine and
    6 coarse calls (rank 1's work) and four latencies: two ghost messages and
    two all-reduces (the residual norm, the final handshake):

    >>> import numpy as np, mgrit
    >>> h = mgrit.build_hierarchy(np.linspace(0, 1, 9), cf=2, max_levels=2, relax="F")
    >>> p = predict(h, 2, iterations=1, skip=False, latency=0.5)
    >>> p.path_calls, p.path_messages, p.time, p.sequential_time, p.rank_calls
    ((7, 6), 2, 15.0, 8.0, ((5, 2), (7, 6)))
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"`size` must be an integer >= 1, got {size!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
        raise ValueError(f"`iterations` must be an integer >= 1, got {iterations!r}")
    _check_hierarchy(hierarchy)
    latency = check_real(latency, "latency", 0.0, "a finite number of seconds")
    reduce_latency = None if reduce_latency is None else \
        check_real(reduce_latency, "reduce_latency", 0.0, "a finite number of seconds")
    for name, v in (("converged", converged), ("callback", callback)):
        if not isinstance(v, (bool, np.bool_)):
            raise ValueError(f"`{name}` must be True or False, got {v!r}")
    # (stopping on the tolerance: max_iter lies beyond the last cycle, which after_cycle ends)
    opts = Options(cycle=cycle, skip=skip, nested=nested, residual=residual, final_residual=final_residual,
                   max_iter=int(iterations) + bool(converged), tol=None,
                   callback=(lambda info: None) if callback else None)
    L = len(hierarchy)
    costs = _costs(cost, L)
    s = _Schedule(hierarchy, int(size), costs, float(latency), reduce_latency, partition)
    marks, times = [np.zeros(L, dtype=np.int64)], []

    def after_cycle(k, _norm) -> bool:
        t, path = s.latest()
        times.append(t)
        marks.append(path)
        return k == iterations - 1  # the schedule stops after `iterations` cycles

    run(s, hierarchy, opts, after_cycle)
    t, path = s.latest()
    marks.append(path)
    per_iter = tuple(tuple(int(x) for x in b - a) for a, b in zip(marks[:-1], marks[1:]))
    return Prediction(
        time=t,
        sequential_time=sequential_time(hierarchy, costs),
        path_calls=tuple(int(x) for x in path),
        iteration_path_calls=per_iter,
        iteration_times=tuple(times),
        rank_calls=tuple(tuple(int(x) for x in row) for row in s.work),
        path_messages=int(s.msgs[int(np.argmax(s.clock))]),
    )
