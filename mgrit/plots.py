"""Plots of what a solve did: residual histories, the hierarchy and its ranks, the cycle, training.

matplotlib is imported only when a function here is called (``import mgrit``
never loads it). Every function draws into ``ax`` (a new figure when None) and
returns the axes, so notebooks can combine and restyle them.

Examples
--------
>>> import numpy as np, mgrit
>>> from mgrit import plots
>>> class Decay(mgrit.Propagator):
...     def step(self, u, t0, t1):
...         return u / (1.0 + (t1 - t0))
>>> res = mgrit.solve(Decay(), np.array(1.0), np.linspace(0, 5, 65), cf=2, tol=1e-10)
>>> ax = plots.residuals(res)                      # doctest: +SKIP
>>> ax = plots.hierarchy(res.hierarchy, size=3)    # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .hierarchy import check_integer
from .partition import level_ranges
from .result import Result, convergence_factors


def _axes(ax):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 3.5))[1]


def _is_number(v) -> bool:
    """A residual norm: a Python or numpy number, or a 0-d array or tensor."""
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) or \
        getattr(v, "ndim", None) == 0 and hasattr(v, "item")


def _is_history(x) -> bool:
    """One residual history (numbers or None), as opposed to a collection of solves."""
    if isinstance(x, np.ndarray) or hasattr(x, "ndim") and hasattr(x, "tolist"):  # (numpy, torch)
        return x.ndim == 1
    return isinstance(x, Sequence) and not isinstance(x, str) and all(v is None or _is_number(v) for v in x)


def _history(res) -> list:
    """The residual norms of a Result or a history, as floats (None where a cycle measured none)."""
    hist = res.residuals if isinstance(res, Result) else res
    if not _is_history(hist) and not isinstance(res, Result):
        raise TypeError(f"expected a mgrit Result or a residual history (numbers or None), got {type(res).__name__}")
    if hasattr(hist, "tolist") and getattr(hist, "ndim", None) == 1:  # (a 1-D array or tensor of norms)
        hist = hist.tolist()
    return [None if v is None else float(v.item() if hasattr(v, "item") else v) for v in hist]


def residuals(results, labels: Sequence[str] | None = None, ax=None, factors: bool = True,
              floor: float = 0.0, **style):
    """Residual norm per cycle (log scale) of one or several solves.

    Parameters
    ----------
    results : Result, residual history, or a list of them
        A history is a list or 1-D array of norms; skipped cycles (``None``
        entries) are left out.
    labels : sequence of str, optional
    factors : bool
        Annotate the mean convergence factor ``(r_last / r_first)^(1/k)`` in the legend.
    floor : float
        Leave out residuals at or below ``floor`` (a round-off plateau would
        dilute the mean factor).
    **style
        Passed to ``ax.semilogy`` for every line (``color``, ``linestyle``, ...).

    Returns
    -------
    matplotlib.axes.Axes
    """
    try:
        floor = float(floor) if not isinstance(floor, (bool, np.bool_, str, bytes)) else math.nan
    except (TypeError, ValueError):
        floor = math.nan
    if math.isnan(floor):
        raise ValueError("`floor` must be a number (0: keep every positive residual)")
    ax = _axes(ax)
    if isinstance(results, Result) or _is_history(results):
        results = [results]
    if results is None or isinstance(results, (str, bytes, dict)) or not hasattr(results, "__iter__"):
        raise TypeError("expected a mgrit Result, a residual history (numbers or None) or a list of them, got "
                        f"{type(results).__name__}")
    results = list(results)
    if labels is not None and (isinstance(labels, str) or len(labels) != len(results)):
        raise ValueError(f"`labels` must be a sequence of one label per solve ({len(results)}), got {labels!r}")
    for k, res in enumerate(results):
        hist = _history(res)
        its = [i for i, r in enumerate(hist) if r is not None and (r > max(floor, 0.0) or not math.isfinite(r))]
        vals = [hist[i] for i in its]
        label = labels[k] if labels is not None else f"solve {k}"
        if not all(math.isfinite(v) for v in vals):  # (NaN or Inf: a diverged cycle, not a gap in the line)
            label += " (diverged: NaN or Inf)"
            its = [i for i, v in zip(its, vals) if math.isfinite(v)]
            vals = [v for v in vals if math.isfinite(v)]
        elif factors and len(vals) > 1:  # (from logs: a ratio of 1e-200 / 1e200 underflows)
            rate = math.exp((math.log(vals[-1]) - math.log(vals[0])) / (its[-1] - its[0]))
            label += f" (factor {rate:.3g})"
        ax.semilogy(its, vals, **{"marker": "o", "label": label, **style})
    ax.set_xlabel("cycle")
    ax.set_ylabel("residual norm")
    ax.legend()
    return ax


def factors(result, ax=None):
    """The convergence factor ``r_k / r_{k-1}`` of every cycle of one solve (a Result or a residual history)."""
    ax = _axes(ax)
    f = convergence_factors(_history(result))
    its = [i for i, v in enumerate(f) if v is not None]
    ax.plot(its, [f[i] for i in its], "s-")
    ax.set_xlabel("cycle")
    ax.set_ylabel("r_k / r_(k-1)")
    return ax


def hierarchy(h, size: int = 1, partition=None, ax=None):
    """The time points of every level (finest at the top), coloured by the rank that owns them.

    Parameters
    ----------
    h : Hierarchy (or a Result: its hierarchy)
    size : int
        Number of ranks the time axis is split over (:mod:`mgrit.partition`).
    partition : sequence of int, optional
        First fine index of every rank's block.
    """
    h = h.hierarchy if isinstance(h, Result) else h
    ax = _axes(ax)
    import matplotlib.pyplot as plt

    colours = plt.get_cmap("tab10")
    ranges = level_ranges(h, size, partition)
    for l, lv in enumerate(h):
        for r, (lo, hi) in enumerate(ranges[l]):
            if hi < lo:
                continue
            t = lv.t[lo: hi + 1]
            ax.plot(t, np.full(t.shape, -l), "|", ms=12, color=colours(r % 10),
                    label=f"rank {r}" if l == 0 and size > 1 else None)
    ax.set_yticks([-l for l in range(len(h))])
    ax.set_yticklabels([f"level {l} ({lv.n} intervals)" for l, lv in enumerate(h)])
    ax.set_xlabel("t")
    if size > 1:
        ax.legend(loc="lower right", fontsize="small")
    return ax


def cycle_path(n_levels: int, kind: str = "V") -> list:
    """The sequence of levels one cycle visits (0 = finest): the V- or F-cycle of :func:`mgrit.solve`.

    With XBraid's ``skip`` (the default) the first cycle is a V-cycle whatever ``kind``: it only injects
    on the way down, and the solver leaves out the F-cycle's extra descents then.

    >>> cycle_path(3, "V")
    [0, 1, 2, 1, 0]
    >>> cycle_path(3, "F")
    [0, 1, 2, 1, 2, 1, 0]
    """
    check_integer(n_levels, "n_levels", 1)
    if kind not in ("V", "F"):
        raise ValueError(f"`kind` must be 'V' or 'F', got {kind!r}")

    def visit(l, k):
        if l == n_levels - 1:
            return [l]
        inner = visit(l + 1, k)
        if k == "F" and l + 1 < n_levels - 1:
            inner = inner + visit(l + 1, "V")[1:]
        return [l] + inner + [l]

    return visit(0, kind)


def cycle(n_levels: int, kind: str = "V", ax=None):
    """The cycle diagram: level against step (down = relax and restrict, up = correct)."""
    ax = _axes(ax)
    path = cycle_path(n_levels, kind)
    ax.plot(range(len(path)), [-l for l in path], "o-")
    ax.set_yticks([-l for l in range(n_levels)])
    ax.set_yticklabels([f"level {l}" for l in range(n_levels)])
    ax.set_xticks([])
    ax.set_title(f"{kind}-cycle, {n_levels} levels")
    return ax


def training(losses: Sequence[float], residuals: Sequence[float] | None = None,
             labels=("loss", "forward residual"), ax=None):
    """A training curve (per step) with the residual of each step's solve on a second axis.
    ``labels``: the loss's and the residuals' (two strings)."""
    if isinstance(labels, str) or len(labels) != 2:
        raise ValueError(f"`labels` must be two strings (the loss's, the residuals'), got {labels!r}")
    if residuals is not None and len(residuals) > len(losses):
        raise ValueError(f"{len(residuals)} residuals for {len(losses)} losses: give at most one residual per "
                         "training step")
    ax = _axes(ax)
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="C0", label=labels[0])
    ax.set_xlabel("step")
    ax.set_ylabel(labels[0])
    if residuals is not None:
        ax2 = ax.twinx()
        r = [math.nan if v is None else v for v in residuals]
        ax2.semilogy(steps[: len(r)], r, color="C1", alpha=0.7, label=labels[1])
        ax2.set_ylabel(labels[1])
    return ax
