"""Shared helpers for the solver tests: a reference stepper and small model problems.

Everything here is deliberately independent of the solver internals: the
reference solution is plain sequential stepping with ``Propagator.step`` on
the *same* time array that the solver gets (docs/theory.md §5: bitwise
comparisons need bit-identical time grids).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mgrit
from propagators import Brusselator, Dahlquist, Heat1D, Lorenz


def sequential(prop, u0, t):
    """Reference solution ``u_i = prop.step(u_{i-1}, t[i-1], t[i])``, ``u_0 = u0``.

    Returns the stack of all states, shape ``(len(t), *u0.shape)``; a numpy
    array for numpy states, a tensor for torch states.
    """
    t = np.asarray(t, dtype=np.float64)
    states = [u0]
    for i in range(1, t.shape[0]):
        states.append(prop.step(states[-1], float(t[i - 1]), float(t[i])))
    if type(u0).__module__.startswith("torch"):
        import torch

        return torch.stack(states)
    return np.stack([np.asarray(s) for s in states])


def max_err(u, ref) -> float:
    """Largest absolute entry of ``u - ref`` (numpy or torch)."""
    d = u - ref
    if type(d).__module__.startswith("torch"):
        return float(d.abs().max())
    return float(np.max(np.abs(d))) if np.size(d) else 0.0


def scale(ref) -> float:
    """A size for relative comparisons: ``max(1, max |ref|)``."""
    return max(1.0, float(np.max(np.abs(np.asarray(ref)))))


def uniform_grid(n: int, t_end: float, t0: float = 0.0) -> np.ndarray:
    """``t_i = t0 + i (t_end - t0) / n`` computed point by point (no cumulative sums)."""
    return t0 + np.arange(n + 1) * ((t_end - t0) / n)


def random_grid(rng, n: int, t_end: float) -> np.ndarray:
    """A strictly increasing non-uniform grid on ``[0, t_end]`` (steps vary by ~3x)."""
    h = rng.uniform(0.5, 1.5, size=n)
    return np.concatenate([[0.0], np.cumsum(h) * (t_end / h.sum())])


class Scaled(mgrit.Propagator):
    """A deliberately poor coarse propagator: ``Psi(u) = c * u`` whatever the step.

    The exactness properties of MGRIT hold for *any* coarse propagator, and a
    poor one keeps the errors far above rounding until the exact iteration,
    so that "exact after K iterations and not after K - 1" is observable.
    """

    def __init__(self, c: float = 0.5):
        self.c = c

    def step(self, u, t0, t1):
        return self.c * u


class Problem:
    """A propagator, its initial state and a time horizon for the exactness tests."""

    def __init__(self, name, prop, u0, t_end):
        self.name, self.prop, self.u0, self.t_end = name, prop, u0, t_end

    def __repr__(self):
        return f"Problem({self.name})"


def problems() -> dict:
    """Linear (Dahlquist BE/FE, heat) and nonlinear (Lorenz, Brusselator) test problems."""
    heat = Heat1D(9)
    return {
        "dahlquist_be": Problem("dahlquist_be", Dahlquist(-1.0, "be"), np.array(1.0), 2.0),
        "dahlquist_fe": Problem("dahlquist_fe", Dahlquist(-1.0, "fe"), np.array([1.0, -0.5]), 1.0),
        "heat": Problem("heat", heat, heat.initial(), 0.5),
        "lorenz": Problem("lorenz", Lorenz(), np.array([1.0, 1.0, 1.0]), 0.2),
        "brusselator": Problem("brusselator", Brusselator(), np.array([1.0, 3.0]), 2.0),
    }


def exact_iterations(n_coarse: int, relax: str, skip: bool) -> int:
    """docs/theory.md §5: F moves the exact front one C-point per cycle, F(CF)^k moves it
    k + 1; XBraid's skip spends the first cycle on a coarse solve only."""
    per_cycle = relax.upper().count("C") + 1
    return math.ceil(n_coarse / per_cycle) + (1 if skip else 0)


@pytest.fixture
def float64():
    """torch's default dtype set to float64 for the test (restored afterwards)."""
    torch = pytest.importorskip("torch")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def rng():
    return np.random.default_rng(20240601)


@pytest.fixture(scope="session")
def vs_model_parallel_quick(tmp_path_factory) -> tuple:
    """One quick run of benchmarks/vs_model_parallel.py (2 rounds, its JSON and its stdout saved beside it),
    shared by its smoke test and notebook 07's quick run: (stdout, path of the JSON)."""
    pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.pipelining")
    out = tmp_path_factory.mktemp("vs_model_parallel") / "quick.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_model_parallel.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"vs_model_parallel.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    out.with_suffix(".txt").write_text(proc.stdout)
    return proc.stdout, out
