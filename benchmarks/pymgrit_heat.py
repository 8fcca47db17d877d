"""``mgrit`` side by side with PyMGRIT 1.0.6 on PyMGRIT's 1-D heat problem.

What it measures
----------------
Problem (PyMGRIT's ``examples/example_heat_1d.py``): ``u_t - u_xx = b(x, t)``
on x in [0, 1], t in [0, 2], ``b = -sin(pi x)(sin t - pi^2 cos t)``,
``u(x, 0) = sin(pi x)``, zero boundary values, backward Euler, nx = 65 grid
points (63 unknowns), nt = 4097 time points. Both solvers: cf 4, 4 levels,
FCF relaxation, V-cycles, tolerance 1e-10 on the 2-norm of the C-point
residuals, one process.

* ours V: ``mgrit.solve(propagators.Heat1D(65), ...)`` with the defaults
  (XBraid's ``skip``; initial guess u0 everywhere). For information: ours F
  (F-cycles) and ours V loop (``Heat1D`` without its batched ``step_batch``, so
  the solver calls ``step`` once per interval, like PyMGRIT does).
* PyM V: ``Mgrit(simple_setup_problem(Heat1D(...), 4, 4), cf_iter=1,
  cycle_type="V", tol=1e-10)`` with PyMGRIT's defaults (nested iteration, zero
  initial guess). For information: PyM V no-NI (``nested_iteration=False``) and
  PyM V fast (PyMGRIT's solver with a step that has our numerics: a tridiagonal
  LU cached per step size, instead of building and factoring a sparse matrix in
  every call; this separates PyMGRIT's framework cost from its ``step``).
  PyMGRIT runs in its own virtual environment ``benchmarks/.venv-pymgrit``
  (created on the first run with ``pip install pymgrit==1.0.6 'numpy<2.4'
  mpich``: PyMGRIT 1.0.6 calls ``np.in1d``, which numpy 2.4 removed) through
  the helper ``benchmarks/_pymgrit_heat_run.py``, which prints JSON.

Printed side by side: iterations (cycles run), propagator calls, wall and CPU
time (whole solve, set-up included; medians of interleaved rounds: every
round runs every column once, ours 5 rounds, PyMGRIT in the first 3), the time ratios to ours, MGRIT / sequential stepping (each column
with its own ``step``), and the max error against sequential stepping with our
``Heat1D.step``.

Residual conventions differ, so equal tolerances do not mean equal stopping
points. Both use the 2-norm over C-points of the Euclidean norms of
``Phi(u_{i-1}) - u_i``. PyMGRIT computes it after the cycle (after its final
F-relaxation) and its default nested iteration runs V-cycles on the coarse
levels before the first cycle; ours (XBraid's convention) computes it during
the down-sweep of the next cycle and runs one more cycle after the check,
starting from a plain coarsest solve (``skip``). The residual histories are
printed so that this can be seen.

How to run
----------
    .venv/bin/python benchmarks/pymgrit_heat.py            # ~2 minutes (+ ~1 minute for the venv, once)
    .venv/bin/python benchmarks/pymgrit_heat.py --quick    # nt = 257, one PyMGRIT run
    .venv/bin/python benchmarks/pymgrit_heat.py --no-pymgrit   # our side only, offline
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import mgrit
from propagators import Heat1D
from _cli import positive_int  # noqa: E402

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv-pymgrit"
HELPER = HERE / "_pymgrit_heat_run.py"
REQUIREMENTS = ["pymgrit==1.0.6", "numpy<2.4", "mpich"]

NX, T_STOP, CF, LEVELS, TOL = 65, 2.0, 4, 4, 1e-10


def venv_python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_pymgrit_venv() -> Path:
    """The interpreter of ``benchmarks/.venv-pymgrit``, created and filled if needed."""
    py = venv_python()
    probe = [str(py), "-c", "import pymgrit, mpi4py.MPI"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"setting up {VENV} ({' '.join(REQUIREMENTS)}) ...", flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    subprocess.run(probe, check=True)
    return py


def run_pymgrit(py: Path, nt: int, nested: bool, fast: bool, sequential: bool, out: Path) -> dict:
    cmd = [str(py), str(HELPER), "--nx", str(NX), "--nt", str(nt), "--t-stop", str(T_STOP),
           "--cf", str(CF), "--levels", str(LEVELS), "--tol", str(TOL), "--cycle", "V",
           "--cf-iter", "1", "--out", str(out)]
    cmd += ["--no-nested"] if not nested else []
    cmd += ["--fast-step"] if fast else []
    cmd += ["--sequential"] if sequential else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"PyMGRIT helper failed:\n{proc.stdout}\n{proc.stderr}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    data["u"] = np.load(out)
    return data


def timed(fn, repeats: int):
    """Median wall and CPU seconds of ``repeats`` calls, and the last return value."""
    wall, cpu, value = [], [], None
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        value = fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu), value


def sequential(heat: Heat1D, t: np.ndarray) -> np.ndarray:
    """Plain time stepping with ``Heat1D.step``: the whole trajectory."""
    u = np.empty((len(t), heat.nx - 2))
    u[0] = heat.initial()
    step = heat.step
    for i in range(1, len(t)):
        u[i] = step(u[i - 1], t[i - 1], t[i])
    return u


class LoopHeat1D(Heat1D):
    """``Heat1D`` without its batched step: the solver loops over ``step`` (one LAPACK call each)."""

    step_batch = mgrit.Propagator.step_batch


def ours(t: np.ndarray, cycle: str, cls=Heat1D, nested=False, residual="xbraid"):
    def run():
        heat = cls(NX)  # fresh: its factorization cache is part of the cost
        return mgrit.solve(heat, heat.initial(), t, cf=CF, max_levels=LEVELS, relax="FCF",
                           cycle=cycle, tol=TOL, nested=nested, residual=residual)
    return run


def fmt_res(res: list) -> str:
    vals = [r for r in res if r is not None]
    return " ".join(f"{r:.1e}" for r in vals)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="nt = 257 and a single PyMGRIT run")
    ap.add_argument("--no-pymgrit", action="store_true", help="only our side (no download)")
    ap.add_argument("--repeats", type=positive_int, default=None, help="interleaved rounds (default 5; 3 quick)")
    ap.add_argument("--pymgrit-repeats", type=positive_int, default=3,
                    help="rounds that also run PyMGRIT (default 3: its default case takes seconds)")
    args = ap.parse_args(argv)
    nt = 257 if args.quick else 4097
    repeats = args.repeats or (3 if args.quick else 5)
    pym_repeats = 1 if args.quick else min(repeats, args.pymgrit_repeats)

    load0 = os.getloadavg()[0]
    t = np.linspace(0.0, T_STOP, nt)
    ours_cases = (("ours V", "V", Heat1D, False, "xbraid"), ("ours F", "F", Heat1D, False, "xbraid"),
                  ("ours V loop", "V", LoopHeat1D, False, "xbraid"), ("ours V NI", "V", Heat1D, True, "xbraid"),
                  ("ours F NI", "F", Heat1D, True, "xbraid"), ("ours V NI end", "V", Heat1D, True, "cycle_end"),
                  ("ours NI end loop", "V", LoopHeat1D, True, "cycle_end"))
    # (column, nested iteration, fast step)
    pym_cases = [] if args.no_pymgrit else [("PyM V", True, False)] + (
        [] if args.quick else [("PyM V no-NI", False, False), ("PyM V fast", True, True)])
    py = None if args.no_pymgrit else ensure_pymgrit_venv()
    # interleaved repetitions: every round runs every column once; medians over the rounds
    runs: dict = {}
    seq_runs, seq = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(repeats):
            seq_runs.append(timed(lambda: sequential(Heat1D(NX), t), 1))
            for name, cycle, cls, nested, where in ours_cases:
                runs.setdefault(name, []).append(timed(ours(t, cycle, cls, nested, where), 1))
            for k, (name, nested, fast) in enumerate(pym_cases):
                if rnd >= pym_repeats:
                    continue
                d = run_pymgrit(py, nt, nested, fast, sequential=True, out=Path(tmp) / f"u{k}.npy")
                seq.setdefault(fast, []).append((d["seq_wall"], d["seq_cpu"], d["err_vs_own_sequential"]))
                runs.setdefault(name, []).append((d["wall"], d["cpu"], d))
    seq_wall = statistics.median(r[0] for r in seq_runs)
    seq_cpu = statistics.median(r[1] for r in seq_runs)
    u_seq = seq_runs[-1][2]
    cols = []
    for name, *_ in ours_cases:
        rs = runs[name]
        res = rs[-1][2]
        cols.append({
            "name": name, "iterations": res.iterations, "calls": int(sum(res.counts)),
            "wall": statistics.median(r[0] for r in rs), "cpu": statistics.median(r[1] for r in rs),
            "seq_wall": seq_wall, "seq_cpu": seq_cpu, "err": float(np.abs(res.u - u_seq).max()),
            "residuals": res.residuals, "converged": res.converged,
        })
    versions = "PyMGRIT not run"
    for name, nested, fast in pym_cases:
        rs = runs[name]
        d = rs[-1][2]
        s_wall = statistics.median(x[0] for x in seq[fast])
        s_cpu = statistics.median(x[1] for x in seq[fast])
        cols.append({
            "name": name, "iterations": d["iterations"], "calls": int(sum(d["calls"])),
            "wall": statistics.median(r[0] for r in rs), "cpu": statistics.median(r[1] for r in rs),
            "seq_wall": s_wall, "seq_cpu": s_cpu,
            "err": float(np.abs(d["u"] - u_seq).max()), "residuals": d["residuals"],
            "converged": d["residuals"][-1] < TOL, "seq_err": seq[fast][-1][2],
        })
        versions = f"PyMGRIT {d['pymgrit']} (numpy {d['numpy']}), median of {pym_repeats} runs"
    seq = {fast: (None, None, next(c["seq_err"] for c in cols if c["name"] == name))
           for name, _, fast in pym_cases}

    print(f"1-D heat, nx = {NX}, nt = {nt}, t in [0, {T_STOP:g}], backward Euler; cf {CF}, {LEVELS} levels, "
          f"FCF, V-cycles unless noted, tol {TOL:g}; one process")
    print(f"load average (1 min) before / after: {load0:.2f} / {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"ours: numpy {np.__version__}, median of {repeats} interleaved rounds; {versions}; "
          "every round runs every column once")
    print("columns: ours V = mgrit.solve defaults (skip); ours F = F-cycles; ours V loop = Heat1D without "
          "step_batch (per-call path);")
    print("         ours V NI / ours F NI = nested iteration (solve(..., nested=True)), as PyMGRIT's default;")
    print("         ours V NI end = nested iteration with the residual measured at cycle end "
          "(residual='cycle_end'), as PyMGRIT measures it;")
    print("         ours NI end loop = ours V NI end without step_batch: PyMGRIT's schedule, one step call per "
          "interval (compare with PyM V fast: the framework alone);")
    print("         PyM V = PyMGRIT defaults (nested iteration); PyM V no-NI = nested_iteration=False; "
          "PyM V fast = PyM V with a cached-LU step like ours")
    width = 14
    print(f"{'':<26}" + "".join(f"{c['name']:>{width}}" for c in cols))

    def line(label, values):
        print(f"{label:<26}" + "".join(f"{v:>{width}}" for v in values))

    ref, loop = cols[0], cols[2]
    line("iterations (cycles)", [str(c["iterations"]) for c in cols])
    line("converged", [str(c["converged"]) for c in cols])
    line("propagator calls", [str(c["calls"]) for c in cols])
    line("wall time [s]", [f"{c['wall']:.3f}" for c in cols])
    line("CPU time [s]", [f"{c['cpu']:.3f}" for c in cols])
    line("wall / ours V", [f"{c['wall'] / ref['wall']:.2f}" for c in cols])
    line("CPU / ours V", [f"{c['cpu'] / ref['cpu']:.2f}" for c in cols])
    line("CPU / ours V loop", [f"{c['cpu'] / loop['cpu']:.2f}" for c in cols])
    line("CPU per call [us]", [f"{c['cpu'] / c['calls'] * 1e6:.2f}" for c in cols])
    line("own sequential wall [s]", [f"{c['seq_wall']:.3f}" for c in cols])
    line("own sequential CPU [s]", [f"{c['seq_cpu']:.3f}" for c in cols])
    line("wall / own sequential", [f"{c['wall'] / c['seq_wall']:.2f}" for c in cols])
    line("CPU / own sequential", [f"{c['cpu'] / c['seq_cpu']:.2f}" for c in cols])
    line("wall / our sequential", [f"{c['wall'] / seq_wall:.2f}" for c in cols])
    line("max |u - u_seq|", [f"{c['err']:.2e}" for c in cols])
    print("u_seq: sequential stepping with our Heat1D.step; own sequential: the column's own step "
          "in a plain loop (PyMGRIT's Heat1D.step or the cached-LU step)")
    if not args.no_pymgrit:
        print("PyMGRIT's MGRIT vs its own sequential stepping, max difference: "
              + ", ".join(f"{'fast step' if f else 'its step'} {v[2]:.2e}" for f, v in seq.items()))
    print("residual histories (2-norm over C-points; ours: XBraid convention, PyMGRIT: after each cycle):")
    for c in cols:
        print(f"  {c['name']:<12} {fmt_res(c['residuals'])}")
    if not args.no_pymgrit and not args.quick:
        pm = next(c for c in cols if c["name"] == "PyM V")
        ni = next(c for c in cols if c["name"] == "ours V NI")
        fni = next(c for c in cols if c["name"] == "ours F NI")
        end = next(c for c in cols if c["name"] == "ours V NI end")
        for key in ("wall", "cpu"):
            speedup = pm[key] / ref[key]
            verdict = "met" if speedup >= 5 else "MISSED"
            print(f"target: PyMGRIT V / ours V >= 5x ({key}): {speedup:.1f}x, {verdict}")
        verdict = "met" if ref["iterations"] <= pm["iterations"] else "MISSED"
        print(f"target: iterations ours V <= PyMGRIT V: {ref['iterations']} vs {pm['iterations']}, {verdict} "
              f"(propagator calls {ref['calls']} vs {pm['calls']})")
        for c in (ni, fni, end):
            verdict = "met" if c["iterations"] <= pm["iterations"] else "MISSED"
            print(f"target: iterations {c['name']} <= PyMGRIT V: {c['iterations']} vs {pm['iterations']}, "
                  f"{verdict} (propagator calls {c['calls']} vs {pm['calls']}; wall PyMGRIT / ours "
                  f"{pm['wall'] / c['wall']:.1f}x)")
        print("(our residual k is measured in cycle k before its coarse correction, XBraid's convention;"
              " PyMGRIT measures after the cycle, so the same sequence appears one cycle later here)")


if __name__ == "__main__":
    main()
