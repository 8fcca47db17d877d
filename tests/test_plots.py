"""mgrit.plots: draws what the solver did; matplotlib is loaded only when used."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import mgrit
from mgrit import plots
from propagators import Dahlquist

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


def test_importing_mgrit_does_not_load_matplotlib():
    code = "import sys, mgrit, mgrit.plots; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_residual_plot_draws_the_available_residuals():
    t = np.linspace(0, 4, 65)
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), t, cf=2, max_levels=4, tol=1e-10)  # skip: r_0 is None
    ax = plots.residuals([res, res.residuals], labels=["a", "b"])
    lines = ax.get_lines()
    assert len(lines) == 2
    avail = [r for r in res.residuals if r is not None and r > 0]
    assert np.allclose(lines[0].get_ydata(), avail)
    assert "factor" in ax.get_legend().get_texts()[0].get_text()
    ax = plots.factors(res)
    assert len(ax.get_lines()[0].get_ydata()) == len(avail) - 1


def test_hierarchy_plot_colours_every_point_once_by_its_owner():
    h = mgrit.build_hierarchy(np.linspace(0, 1, 17), cf=2, max_levels=3)
    ax = plots.hierarchy(h, size=3)
    n_points = sum(len(line.get_xdata()) for line in ax.get_lines())
    assert n_points == sum(lv.n + 1 for lv in h)


@pytest.mark.parametrize("levels, kind, visits", [(2, "V", 3), (4, "V", 7), (3, "F", 7), (4, "F", 13)])
def test_cycle_paths_match_the_solver_recursion(levels, kind, visits):
    path = plots.cycle_path(levels, kind)
    assert len(path) == visits and path[0] == path[-1] == 0 and max(path) == levels - 1
    assert all(abs(a - b) == 1 for a, b in zip(path, path[1:]))
    assert len(plots.cycle(levels, kind).get_lines()[0].get_xdata()) == visits


def test_training_curve_with_residuals():
    ax = plots.training([1.0, 0.5, 0.25], [1e-1, None, 1e-3])
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 0.5, 0.25]


def test_residual_plot_takes_arrays_a_floor_and_styles():
    hist = np.array([1.0, 1e-2, 1e-4, 1e-16, 1e-16])
    ax = plots.residuals(hist, labels=["a"], floor=1e-14, color="k", linestyle="--")
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 1, 2] and line.get_linestyle() == "--"
    assert "factor 0.01)" in ax.get_legend().get_texts()[0].get_text()  # plateau left out
    ax = plots.residuals([hist, [None, 1.0, 0.5]])
    assert len(ax.get_lines()) == 2


@pytest.mark.parametrize("call, match", [
    (lambda: plots.cycle_path(0), "`n_levels` must be an integer >= 1"),  # recursed until RecursionError
    (lambda: plots.cycle(0), "`n_levels` must be an integer >= 1"),
    (lambda: plots.cycle_path(2.5), "`n_levels`"),
    (lambda: plots.residuals([[1.0, 0.1], [1.0, 0.2]], labels=["a"]), "one label per solve"),  # IndexError
    (lambda: plots.residuals([[1.0, 0.1]], labels="ab"), "one label per solve"),
    (lambda: plots.training([1.0, 0.5], [1e-3, 1e-4, 1e-5]), "3 residuals for 2 losses"),  # inside matplotlib
])
def test_bad_plot_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    assert plots.cycle_path(1) == [0]


def test_odd_histories_and_inputs(tmp_path):
    """From a review of the plots: a NaN residual was dropped and the legend showed a clean factor across the
    gap; 1e200 -> 1e-200 over 40 cycles showed 'factor 0' (the ratio underflowed); 0-d arrays as norms,
    hierarchy(result), factors(history), wrong training labels and floor=None raised raw Python errors."""
    import matplotlib.pyplot as plt
    import torch

    ax = plots.residuals([[1.0, 0.1, float("nan"), 0.001]], labels=["nan"])
    assert "diverged" in ax.get_legend().get_texts()[0].get_text()
    ax = plots.residuals([[10.0 ** (200 - 10 * k) for k in range(41)]], labels=["long"])
    assert "factor 1e-10" in ax.get_legend().get_texts()[0].get_text()
    ax = plots.residuals([np.array(1.0), np.array(0.1)], labels=["0-d"])
    assert "factor 0.1" in ax.get_legend().get_texts()[0].get_text()
    plots.residuals([torch.tensor(1.0), torch.tensor(0.5)])
    with pytest.raises(ValueError, match="`floor` must be a number"):
        plots.residuals([1.0, 0.1], floor=None)
    res = mgrit.solve(Dahlquist(-1.0), np.array([1.0]), np.linspace(0, 4, 33), cf=2, max_levels=3, tol=1e-10)
    plots.hierarchy(res, size=2)
    ax = plots.factors([1.0, 0.1, 0.01])
    assert np.allclose(ax.get_lines()[0].get_ydata(), [0.1, 0.1])
    with pytest.raises(ValueError, match="`labels` must be two strings"):
        plots.training([1.0, 0.5], labels=("loss",))
    plt.close("all")


def test_review_of_the_plot_checks():
    """Lists of 1-D tensors as histories and 0-d arrays as floor were refused by the first checks; latencies as
    0-d arrays, tensors or Fractions by predict's."""
    import matplotlib.pyplot as plt
    import torch
    from fractions import Fraction

    from mgrit.model import predict

    ax = plots.residuals([torch.tensor([1.0, 0.1]), torch.tensor([1.0, 0.5])], floor=np.array(1e-12))
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["solve 0 (factor 0.1)", "solve 1 (factor 0.5)"]
    h = mgrit.build_hierarchy(np.linspace(0, 1, 17), cf=2, max_levels=3)
    times = {predict(h, 2, 2, latency=v).time
             for v in (1e-3, np.array(1e-3), torch.tensor(1e-3, dtype=torch.float64), Fraction(1, 1000))}
    assert len(times) == 1
    plt.close("all")


@pytest.mark.parametrize("bad", [None, {"a": 1}, 3.5])
def test_residual_plot_names_what_it_expects(bad):
    """None said "'NoneType' object is not iterable", a dict "got str" (its keys)."""
    with pytest.raises(TypeError, match=rf"expected a mgrit Result, a residual history .* got {type(bad).__name__}"):
        plots.residuals(bad)
